"""Every ```python block of README.md and docs/*.md runs as written (on CPU here), each in a fresh
namespace.

The blocks carry their own asserts (most compare with jax_rope_cache.reference), so a block that
runs without an exception shows what the README says. Non-Python snippets use ```bash / ```text.
"""

from __future__ import annotations

import inspect
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


def _readme_text() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_public_name_is_in_the_readme():
    import jax_rope_cache

    readme = _readme_text()
    missing = [n for n in jax_rope_cache.__all__ if not re.search(rf"`(jrc\.)?{n}[`(]", readme)]
    assert not missing, f"README.md does not mention the public names {missing}"


def _readme_signature(name: str) -> inspect.Signature:
    """The signature the README writes for `name(...)`, read as Python."""
    text = " ".join(_readme_text().split())
    m = re.search(rf"`{name}\((.*?)\)(?: ->|`)", text)
    assert m, f"README.md has no `{name}(...)` signature"
    ns = {}
    exec(f"def {name}({m.group(1)}): pass", ns)  # noqa: S102: the README's own parameter list
    return inspect.signature(ns[name])


@pytest.mark.parametrize("name", ["rope_and_cache", "mla_rope_and_cache"])
def test_readme_signature_is_the_functions(name):
    """Every parameter, in order, of the same kind and default as the function's."""
    import jax_rope_cache

    want = inspect.signature(getattr(jax_rope_cache, name))
    got = _readme_signature(name)
    assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == [
        (p.name, p.kind, p.default) for p in want.parameters.values()]


def test_readme_says_what_per_token_scales_return():
    import numpy as np

    import jax_rope_cache as jrc
    from jax_rope_cache import reference

    kc, vc = (np.zeros((2, 4, 1, 8), np.dtype("float8_e4m3fn")) for _ in "kv")
    ks, vs = (np.ones((2, 1, 4), np.float32) for _ in "kv")
    x = np.ones((1, 1, 8), np.float32)
    out = reference.rope_and_cache(x, x, x, kc, vc, np.zeros(1, np.int32), np.zeros(1, np.int32),
                                   *jrc.rope_tables(4, 8, base=1e4), k_scale_cache=ks, v_scale_cache=vs)
    assert len(out) == 6
    assert "`(q_out, k_out, key_cache, value_cache, k_scale_cache, v_scale_cache)`" in _readme_text()
