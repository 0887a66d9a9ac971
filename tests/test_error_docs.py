"""docs/errors.md documents every error family the library raises, and quotes its lists as they are.

A family is an argument (the message's prefix before ": ") and the kind of expectation (the first
words after it, placeholders as wildcards): `key_cache: expected dtype ...` and
`key_cache: expected rank ...` are two families, `k: expected dtype ...` a third. The families are
read with `ast` from every `raise ValueError / TypeError / ArgumentTypeError / <subclass>(...)` and
every `parser.error(...)` under jax_rope_cache/, so a new check fails here until its message is in
docs/errors.md. A prefix that is a loop variable over literal names (`for name in ("k", "v")`)
stands for each name; a helper's parameter (`_check_shape(arg, ...)`) for each name its callers
pass, and a documented `<arg>: ...` covers those. Removing a message from docs/errors.md fails
test_every_error_family_is_in_docs_errors_md, naming the raise.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_rope_cache"
ERRORS_MD = ROOT / "docs" / "errors.md"
STEM_WORDS = 3  # words after the prefix that name the kind of expectation
_RAISED = {"ValueError", "TypeError", "ArgumentTypeError"}
_WILD = "<>"
# ValueErrors that their callers in the library catch and turn into something else; none reaches
# a caller of the library. (file, function): why.
CAUGHT = {
    ("compilers/cache.py", "decode"): "a corrupt cache entry (cache.read, flydsl's bundle reader): a CacheWarning",
    ("compilers/cache.py", "read_regular"): "a corrupt cache entry (cache.read): a CacheWarning naming the reason",
}
# (argument, first words) that a helper's message could form but no call reaches: why.
UNREACHABLE = {
    ("q_scale", ("scales", "apply", "to")): "check_scale sees q_scale only with a float8 q_out (q_scale's own "
                                           "error covers the rest)",
}
# Messages that are not literal text at the raise (what they re-raise is documented at its source).
DYNAMIC = {
    ("primitive.py", "_refuse_jvp"): "the op's not-differentiable message, passed in (NOT_DIFFERENTIABLE)",
    ("cli/aot.py", "main"): "re-raises a configs_for / mla_configs_for ValueError as argparse's error line",
}


@dataclasses.dataclass(frozen=True)
class Family:
    prefix: str | None   # the argument; _WILD: not resolvable (matches any); None: no "name: " prefix
    stem: tuple          # the first STEM_WORDS words after the prefix
    where: str           # file:line of one raise
    helper: bool = False  # the prefix is a helper's parameter: a documented `<arg>: ...` covers it

    def __str__(self):
        return f"{self.prefix or ''}: {' '.join(self.stem)} ...  ({self.where})"


# ---- the library's raise sites ---------------------------------------------------------------------------

_HOLE = "\x00"  # a placeholder in a message template: \x00<expression source>\x00


def _module_strings(trees) -> dict:
    """Module-level `NAME = "literal"` of every module (names defined twice with different values dropped)."""
    out, clash = {}, set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, str):
                    name = node.targets[0].id
                    clash |= {name} if out.get(name, value) != value else set()
                    out[name] = value
    return {k: v for k, v in out.items() if k not in clash}


def _template(node, strings) -> str | None:
    """A message expression as text with placeholders, or None when it is not literal text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            elif isinstance(v.value, ast.Name) and v.value.id in strings and v.conversion == -1:
                parts.append(strings[v.value.id])
            else:
                parts.append(f"{_HOLE}{ast.unparse(v.value)}{'!r' if v.conversion == ord('r') else ''}{_HOLE}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, strings), _template(node.right, strings)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name) and node.id in strings:
        return strings[node.id]
    return None


def _loop_values(name: str, stack) -> list[str] | None:
    """The literal strings a loop variable takes: `for name in ("a", "b")` or
    `for name, x in (("a", a), ("b", b))` around a node; None if it is not such a loop."""
    for node in reversed(stack):
        if not isinstance(node, (ast.For, ast.comprehension)):
            continue
        target, items = node.target, node.iter
        if not isinstance(items, (ast.Tuple, ast.List)):
            continue
        if isinstance(target, ast.Name) and target.id == name:
            index = None
        elif isinstance(target, ast.Tuple) and name in [getattr(e, "id", None) for e in target.elts]:
            index = [getattr(e, "id", None) for e in target.elts].index(name)
        else:
            continue
        values = []
        for item in items.elts:
            e = item if index is None else (item.elts[index] if isinstance(item, ast.Tuple) else None)
            if not (isinstance(e, ast.Constant) and isinstance(e.value, str)):
                return None
            values.append(e.value)
        return values
    return None


def _split(message: str):
    """(prefix, rest) of `<argument>: <expectation>`; prefix None when the message has no such head."""
    head, sep, rest = message.partition(": ")
    if not sep or len(head) > 100 or len(head.split()) > 4:
        return None, message
    return head, rest


def _words(text: str) -> tuple:
    return tuple(w.rstrip(",;:.") for w in text.split()[:STEM_WORDS])


def _catches(handler, raised) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
    return handler.type is None or any(getattr(n, "id", None) in raised | {"Exception"} for n in names)


def _inside(node, body) -> bool:
    return any(node is n for stmt in body for n in ast.walk(stmt))


@dataclasses.dataclass
class _Scan:
    messages: list    # (file, function, line, template or None, ancestors)
    calls: dict       # function name -> [(ast.Call, ancestors)] of every call in the package


def _scan() -> _Scan:
    trees = {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}
    strings = _module_strings(trees)
    subclasses = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)
                  and any(getattr(b, "id", getattr(b, "attr", None)) in ("ValueError", "TypeError") for b in n.bases)}
    raised = _RAISED | subclasses
    aliases = {}  # `_rank, _shape = contract._check_rank, contract._check_shape`
    for tree in trees.values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                    and isinstance(node.value, ast.Tuple)):
                for a, b in zip(node.targets[0].elts, node.value.elts):
                    if isinstance(a, ast.Name) and isinstance(b, (ast.Name, ast.Attribute)):
                        aliases[a.id] = getattr(b, "id", getattr(b, "attr", None))
    scan = _Scan([], {})

    def visit(node, stack, path, func):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            scan.calls.setdefault(aliases.get(name, name), []).append((node, stack))
        call = None
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            f = node.exc.func
            if getattr(f, "id", None) in raised or getattr(f, "attr", None) in raised:
                call = node.exc
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "error"
              and getattr(node.func.value, "id", "") in ("p", "parser")):
            call = node
        if call is not None:
            caught = any(isinstance(s, ast.Try) and any(
                _catches(h, raised) for h in s.handlers) and _inside(node, s.body) for s in stack)
            if not caught:
                text = _template(call.args[0], strings) if call.args else None
                scan.messages.append((path.relative_to(PACKAGE).as_posix(), func, node.lineno, text, stack))
        for child in ast.iter_child_nodes(node):
            visit(child, stack + [node], path,
                  node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else func)

    for path, tree in trees.items():
        visit(tree, [], path, "<module>")
    return scan


def _argument_values(name: str, stack, scan: _Scan, depth: int = 0) -> list[str] | None:
    """The literal names a variable holds at a raise: a loop over literal names around it, or, for
    a helper's parameter, what every call of the helper passes (resolved the same way, two levels)."""
    values = _loop_values(name, stack)
    if values is not None:
        return values
    func = next((n for n in reversed(stack) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    params = [] if func is None else func.args.posonlyargs + func.args.args
    kwonly = [] if func is None else func.args.kwonlyargs
    if depth > 2 or name not in [a.arg for a in params + kwonly]:
        return None
    index = [a.arg for a in params].index(name) if name in [a.arg for a in params] else None
    out = []
    for call, call_stack in scan.calls.get(func.name, []):
        given = call.args[index] if index is not None and index < len(call.args) else next(
            (k.value for k in call.keywords if k.arg == name), None)
        if isinstance(given, ast.Constant) and isinstance(given.value, str):
            out.append(given.value)
        elif isinstance(given, ast.Name):
            out += _argument_values(given.id, call_stack, scan, depth + 1) or [_WILD]
        else:
            out.append(_WILD)
    return sorted(set(out)) or None


def _is_parameter(name: str, stack) -> bool:
    func = next((n for n in reversed(stack) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return func is not None and name in [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]


def _resolve(prefix: str, stack, scan: _Scan) -> list[str]:
    """The argument names a raise's prefix stands for: each placeholder that is a loop variable over
    literal names, or a helper's parameter, takes each name (its repr for `!r`); any other is _WILD."""
    m = re.search(f"{_HOLE}([^{_HOLE}]*){_HOLE}", prefix)
    if m is None:
        return [prefix]
    expr, _, conv = m.group(1).partition("!")
    values = _argument_values(expr, stack, scan) if expr.isidentifier() else None
    values = [_WILD] if values is None else [repr(v) if conv == "r" and v != _WILD else v for v in values]
    return [prefix[:m.start()] + v + rest for v in values for rest in _resolve(prefix[m.end():], stack, scan)]


def source_families() -> list[Family]:
    scan = _scan()
    families = []
    for file, func, line, text, stack in scan.messages:
        if (file, func) in CAUGHT:
            continue
        if text is None:
            assert (file, func) in DYNAMIC, (
                f"{file}:{line} ({func}) raises a message that is not literal text: write it as a string or "
                "f-string (so docs/errors.md can be checked against it), or list it in DYNAMIC with why")
            continue
        prefix, rest = _split(text)
        names = [prefix] if prefix is None else _resolve(prefix, stack, scan)
        hole = re.search(f"{_HOLE}(\\w+)[!{_HOLE}]", prefix or "")
        helper = bool(hole) and _loop_values(hole.group(1), stack) is None and _is_parameter(hole.group(1), stack)
        stem = _words(re.sub(f"{_HOLE}[^{_HOLE}]*{_HOLE}", _WILD, rest))
        families += [Family(n, stem, f"jax_rope_cache/{file}:{line}", helper) for n in names]
    return families


# ---- docs/errors.md --------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"<([^<>\s][^<>]*)>")


def _expand(prefix: str) -> list[str]:
    """The argument names a documented prefix stands for: `<k|v>` -> k, v; `x[<a|b>]` -> x[a], x[b];
    `<arg>` alone -> _WILD; other placeholders -> _WILD in place."""
    m = _PLACEHOLDER.search(prefix)
    if m is None:
        return [prefix]
    if "|" not in m.group(1):
        if m.group(0) == prefix:
            return [_WILD]
        return [prefix[:m.start()] + _WILD + e for e in _expand(prefix[m.end():])]
    return [prefix[:m.start()] + alt + e for alt in m.group(1).split("|") for e in _expand(prefix[m.end():])]


def documented() -> list[tuple[set, tuple]]:
    """(argument names, stem) of every message quoted in docs/errors.md (each `...` code span). A span
    starting `...:` continues the argument of the span before it on the same line."""
    out = []
    for line in ERRORS_MD.read_text(encoding="utf-8").splitlines():
        last = None
        for span in re.findall(r"`([^`]+)`", line.replace("\\|", "|")):
            prefix, rest = _split(span)
            if prefix in ("...", "…") and last is not None:
                names = last
            else:
                names = None if prefix is None else set(_expand(prefix))
            if prefix is None:  # a sentence-like message: its words count wherever they start
                out.append((None, _words(_PLACEHOLDER.sub(_WILD, span))))
            else:
                out.append((names, _words(_PLACEHOLDER.sub(_WILD, rest))))
                last = names
    return out


def _stem_matches(want: tuple, got: tuple) -> bool:
    if len(got) < len(want):
        return False
    return all(a == b or _WILD in (a, b) or a.replace(_WILD, "") == b.replace(_WILD, "") and _WILD in a + b
               or b == "..." for a, b in zip(want, got))


def _same_argument(name: str, documented: str) -> bool:
    """`name` (from the code) is `documented`, a placeholder inside either matching any text
    (`config[<>]` and `config['rope_theta']`). A documented prefix that is only a placeholder
    (`<arg>`) matches only a helper's messages (is_documented), never a named argument."""
    if name == documented:
        return True
    if _WILD not in name + documented or documented == _WILD:
        return False
    pattern = lambda a: re.escape(a).replace(re.escape(_WILD), ".+")  # noqa: E731
    return bool(re.fullmatch(pattern(name), documented) or re.fullmatch(pattern(documented), name))


def is_documented(family: Family, docs) -> bool:
    for names, stem in docs:
        if not _stem_matches(family.stem, stem):
            continue
        if family.prefix in (None, _WILD) or (names is not None and (
                any(_same_argument(family.prefix, n) for n in names) or family.helper and _WILD in names)):
            return True
    return False


def test_the_scan_finds_the_checks():
    """The scanner sees the op's checks (a broken scan would make the next test pass vacuously)."""
    fams = source_families()
    keys = {(f.prefix, f.stem) for f in fams}
    assert len(fams) > 200, len(fams)
    for want in [("key_cache", ("expected", "dtype", _WILD)), ("mrope_section", ("expected", "3", "counts")),
                 ("k_scale", ("expected", "None", "with")), ("v_scale", ("expected", "None", "with")),
                 ("kv_cache", ("expected", "two", "different")), ("--batch", ("expected", ">=", "1")),
                 ("layout", ("expected", "one", "of"))]:
        assert want in keys, want


def test_every_error_family_is_in_docs_errors_md():
    docs = documented()
    missing = [f for f in source_families() if not is_documented(f, docs) and (f.prefix, f.stem) not in UNREACHABLE]
    assert not missing, ("docs/errors.md lacks these errors (argument: expectation ...), add each message's "
                         "shape to its table:\n  " + "\n  ".join(map(str, missing)))


def test_a_family_missing_from_the_docs_is_found():
    """The matching is not vacuous: drop one documented message and its family is reported."""
    fam = next(f for f in source_families() if f.prefix == "mrope_interleaved" and f.stem[0] == "True")
    docs = documented()
    assert is_documented(fam, docs)
    assert not is_documented(fam, [d for d in docs if not (d[0] and "mrope_interleaved" in d[0]
                                                             and d[1][:1] == ("True",))])
    other = dataclasses.replace(fam, prefix="mrope_section")  # another argument with the same words
    assert not is_documented(other, docs)


# ---- the lists the docs quote ----------------------------------------------------------------------------

def _message(fn, *args, **kwargs) -> str:
    with pytest.raises((ValueError, TypeError)) as e:
        fn(*args, **kwargs)
    return str(e.value)


def _unknown_command() -> str:
    import contextlib
    import io

    from jax_rope_cache import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    return err.getvalue().strip().splitlines()[-1]


def _quoted_list(what: str) -> str:
    """The library's message for `what`, whose list docs/errors.md quotes verbatim."""
    import numpy as np

    import jax_rope_cache as jrc
    from jax_rope_cache import reference
    from jax_rope_cache.mla import contract as mla_contract

    good = dict(q=np.ones((2, 2, 8), np.float32), k=np.ones((2, 1, 8), np.float32), v=np.ones((2, 1, 8), np.float32),
                key_cache=np.ones((1, 4, 1, 8), np.float32), value_cache=np.ones((1, 4, 1, 8), np.float32),
                slot_mapping=np.zeros(2, np.int32), positions=np.zeros(2, np.int32),
                cos=np.ones((4, 4), np.float32), sin=np.ones((4, 4), np.float32))
    call = lambda **kw: reference.rope_and_cache(**(good | kw))  # noqa: E731
    fp16 = lambda: np.ones((1, 4, 1, 8), np.float16)  # noqa: E731
    messages = {
        "layout": lambda: _message(call, layout="paged"),
        "precision": lambda: _message(call, precision="bf16"),
        "impl": lambda: _message(jrc.rope_and_cache, *good.values(), impl="gpu"),
        "cache dtype": lambda: _message(call, key_cache=fp16(), value_cache=fp16()),
        "q dtype": lambda: _message(call, q=np.ones((2, 2, 8), np.int32)),
        "make_kv_cache dtype": lambda: _message(jrc.make_kv_cache, 1, 4, 1, 8, np.int16),
        "MLA layout": lambda: _message(mla_contract.check_layout, "paged"),
        "commands": _unknown_command,
    }
    return messages[what]()


# what -> the words the docs put right before the list (so each list is checked where it is quoted)
QUOTED = {"layout": "`layout: expected one of ", "precision": "`precision: expected one of ",
          "impl": "`impl: expected one of ", "cache dtype": "(same as q) or one of ",
          "q dtype": "`q: expected dtype one of ", "make_kv_cache dtype": "`dtype: expected one of ",
          "MLA layout": "`layout: expected one of ", "commands": "unknown command <c>; expected one of "}


@pytest.mark.parametrize("what", sorted(QUOTED))
def test_the_quoted_lists_are_the_librarys(what):
    """Where docs/errors.md spells out a list (layouts, dtypes, commands), it is the list the library
    has now: a new layout or dtype fails here until the docs say it."""
    message = _quoted_list(what)
    listed = re.search(r"one of (\(.*?\)|[\w, -]+$)", message)
    assert listed, message
    text = ERRORS_MD.read_text(encoding="utf-8")
    quoted = QUOTED[what] + listed.group(1)
    assert quoted in text, f"docs/errors.md does not quote the {what} list as {quoted!r}; the library says:\n{message}"
