"""The package is a one-way stack: imports point down, never in a circle.

    cli -> decoder_mla -> decoder -> attention -> mla -> api -> primitive -> backends -> compilers
    models, reference -> contract
An AST walk over jax_rope_cache/ (module-level and function-level imports alike) builds the import
graph; the test fails on any circle and on any import that points up a layer.
"""

from __future__ import annotations

import ast
import os

import pytest

_PKG = "jax_rope_cache"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", _PKG)

# Layer of each module or subpackage; a module imports only lower layers and its own subpackage.
LAYERS = {
    "contract": 0, "versions": 0,
    "reference": 1, "compilers": 1, "models": 1, "gpu_env": 1,
    "backends": 2,
    "primitive": 3,
    "api": 4,
    "mla": 4.5,  # the MLA op's own stack (contract .. api), above the main op's api whose helpers it reuses
    "attention": 4.8,  # the model client's decode attention over the paged cache (jax and Pallas only)
    "decoder": 5,
    "decoder_mla": 5.5,  # the MLA model client: decoder.Decoder with MLA attention
    "decoder_families": 5.5,  # Gemma 3 / Llama 4 clients: decoder.Decoder with the family options
    "cli": 6,
    "__main__": 7,
}


def _modules(root: str) -> dict[str, str]:
    """{dotted module name: path} of every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(root))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


def import_graph(root: str = _SOURCE) -> dict[str, set[str]]:
    mods = _modules(root)
    graph = {m: set() for m in mods}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg
                full = [f"{node.module}.{a.name}" for a in node.names]
                targets = [f if f in mods else node.module for f in full if f != f"{_PKG}._native"]
            for t in targets:
                if t.split(".")[0] == _PKG and (dep := resolve(t)) and dep != mod:
                    graph[mod].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def _layer(mod: str) -> tuple[int, str]:
    part = mod.split(".")[1]
    return LAYERS[part], part


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        if mod == _PKG:
            bad += [f"{mod} -> {d} (the package __init__ loads its public names lazily)" for d in deps]
            continue
        layer, group = _layer(mod)
        for dep in deps:
            if dep == _PKG:
                if group not in ("decoder", "decoder_mla", "decoder_families", "cli", "__main__"):
                    bad.append(f"{mod} -> {dep} (only the model client and the command line use the public names)")
                continue
            dlayer, dgroup = _layer(dep)
            if not (dlayer < layer or dgroup == group):
                bad.append(f"{mod} (layer {layer}) -> {dep} (layer {dlayer})")
    return bad


def test_imports_point_down():
    bad = upward_imports(import_graph())
    assert not bad, "imports pointing up:\n" + "\n".join(bad)


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    pkg = tmp_path / _PKG
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "contract.py").write_text("from jax_rope_cache import primitive\n")
    (pkg / "primitive.py").write_text("def f():\n    from jax_rope_cache.backends import cpu\n"
                                      "from jax_rope_cache import _native\n")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "backends" / "cpu.py").write_text("import jax_rope_cache.contract\n")
    graph = import_graph(str(pkg))
    assert graph["jax_rope_cache.primitive"] == {"jax_rope_cache.backends.cpu"}
    assert upward_imports(graph) == ["jax_rope_cache.contract (layer 0) -> jax_rope_cache.primitive (layer 3)"]
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"jax_rope_cache.contract", "jax_rope_cache.primitive",
                                                "jax_rope_cache.backends.cpu"}


@pytest.mark.parametrize("module", ["jax_rope_cache.reference", "jax_rope_cache.models.presets",
                                    "jax_rope_cache.contract"])
def test_numpy_layers_import_nothing_of_jax(module):
    graph = import_graph()

    def closure(m, seen):
        for d in graph.get(m, ()):
            if d not in seen:
                seen.add(d)
                closure(d, seen)
        return seen

    for m in closure(module, {module}):
        with open(_modules(_SOURCE)[m]) as f:
            tree = ast.parse(f.read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "jax" not in names and "jaxlib" not in names, f"{m} (reached from {module}) imports jax"
