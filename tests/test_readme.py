"""Every ```python block of README.md and docs/*.md runs as written (on CPU here), each in a fresh
namespace.

The blocks carry their own asserts (most compare with jax_rope_cache.reference), so a block that
runs without an exception shows what the README says. Non-Python snippets use ```bash / ```text.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[str, str]]:
    """("file:first line", source) of every ```python block of the documents."""
    out = []
    for doc in DOCUMENTS:
        text = doc.read_text(encoding="utf-8")
        name = doc.relative_to(ROOT).as_posix()
        out += [(f"{name}:{text.count(chr(10), 0, m.start()) + 2}", m.group(1)) for m in _BLOCK.finditer(text)]
    return out


def test_readme_has_python_blocks():
    assert sum(w.startswith("README.md:") for w, _ in python_blocks()) >= 5, "README.md lost its runnable examples"


@pytest.mark.parametrize("where,source", python_blocks(), ids=lambda x: x if ".md:" in str(x) else "")
def test_readme_block_runs(where, source):
    code = compile(source, where, "exec")
    exec(code, {"__name__": "doc_block"})  # noqa: S102: the documents' own examples
