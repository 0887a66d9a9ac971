"""Every ```python block of README.md runs as written (on CPU here), each in a fresh namespace.

The blocks carry their own asserts (most compare with jax_rope_cache.reference), so a block that
runs without an exception shows what the README says. Non-Python snippets use ```bash / ```text.
"""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 5, "README.md lost its runnable examples"


@pytest.mark.parametrize("line,source", python_blocks(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_readme_block_runs(line, source):
    code = compile(source, f"README.md:{line}", "exec")
    exec(code, {"__name__": f"readme_block_{line}"})  # noqa: S102: the README's own examples
