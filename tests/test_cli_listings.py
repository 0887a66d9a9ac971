"""What the command line and the README list comes from the library's own tables: the presets
(models/presets.PRESET_GROUPS), generate's models (cli/generate.MODELS); and `generate --model X`
checks and times X only."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from jax_rope_cache.cli import generate
from jax_rope_cache.models import presets

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALL_PRESETS = {*presets.PRESETS, *presets.MROPE_PRESETS, *presets.MLA_PRESETS, *presets.FAMILY_PRESETS}


def _cli(*args) -> str:
    return subprocess.run([sys.executable, "-P", "-m", "jax_rope_cache", *args], capture_output=True, text=True,
                          check=True, timeout=180).stdout


def test_the_preset_groups_are_every_preset_table():
    listed = [n for names in presets.PRESET_GROUPS.values() for n in names]
    assert sorted(listed) == sorted(ALL_PRESETS) and len(listed) == len(set(listed))
    assert set(presets.MODELS) == {*presets.PRESETS, *presets.MROPE_PRESETS, "tiny"}


def test_info_lists_every_preset():
    data = json.loads(_cli("info", "--json"))
    assert data["presets"] == {op: list(names) for op, names in presets.PRESET_GROUPS.items()}


def test_compile_help_lists_every_preset():
    text = " ".join(_cli("compile", "--help").split())  # argparse wraps the help text
    for name in ALL_PRESETS - set(presets.FAMILY_PRESETS):  # the kernels refuse the family options yet
        assert re.search(rf"[\s:,]{re.escape(name)}[,;\s]", text), name


def test_readme_lists_every_preset():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [n for n in sorted(ALL_PRESETS) if f"`{n}`" not in readme]
    assert not missing, f"README.md does not list the presets {missing}"


def test_usage_names_every_model_generate_runs(capsys):
    from jax_rope_cache import cli

    cli.main(["--help"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("generate"))
    for name in generate.MODELS:
        assert name.removeprefix("tiny-") in line, (name, line)


class _Calls:
    def __init__(self):
        self.checks, self.timed = [], []


@pytest.fixture
def calls(monkeypatch):
    """generate.main with check and timing recorded instead of run (the fixtures are found as usual)."""
    c = _Calls()
    monkeypatch.setattr(generate, "check", lambda ref, impls, layouts, **kw: c.checks.append(
        (pathlib.Path(ref).name, kw.get("models"))) or True)
    monkeypatch.setattr(generate, "timing", lambda model, *a, **kw: c.timed.append(model))
    return c


def _main(*args):
    with pytest.raises(SystemExit) as e:
        generate.main(["--reference", str(ROOT / "tests" / "data" / "hf_greedy.npz"), *args])
    assert e.value.code == 0


def test_generate_without_model_checks_every_fixture_and_times_the_default(calls):
    _main()
    assert calls.checks == [("hf_greedy.npz", None), ("hf_greedy_mla.npz", None), ("hf_greedy_families.npz", None)]
    assert calls.timed == [generate.DEFAULT_MODEL]


@pytest.mark.parametrize("model,fixture", [("tiny-qwen3", "hf_greedy.npz"), ("tiny-deepseek-v3", "hf_greedy_mla.npz"),
                                           ("tiny-gemma-3", "hf_greedy_families.npz"),
                                           ("tiny-llama-4", "hf_greedy_families.npz"),
                                           ("tiny-llama-4-maverick", "hf_greedy_families.npz")])
def test_generate_model_checks_and_times_that_model_only(calls, model, fixture):
    _main("--model", model)
    assert calls.checks == [(fixture, {model})]
    assert calls.timed == [model]


def test_generate_model_without_a_recording_is_timed_only(calls, capsys):
    _main("--model", "llama-3.1-8b")
    assert calls.checks == [] and calls.timed == ["llama-3.1-8b"]
    assert "llama-3.1-8b has no recorded transformers output" in capsys.readouterr().out


def test_check_runs_only_the_models_asked_for(monkeypatch, capsys):
    """check(models=...) generates those fixture entries only (the generation stubbed: the recording)."""
    ran = []

    def recorded(entry, impl, layout="flash", **kw):
        ran.append(next(n for n, e in ref.items() if e is entry))
        return entry["tokens"], entry["logits"]

    path = ROOT / "tests" / "data" / "hf_greedy.npz"
    from jax_rope_cache import decoder

    ref = decoder.load_hf_reference(str(path))
    monkeypatch.setattr(decoder, "load_hf_reference", lambda p: dict(ref))
    monkeypatch.setattr(generate, "reference_generation", recorded)
    assert generate.check(str(path), ["xla"], ["flash"], models={"tiny-qwen3"})
    assert set(ran) == {"tiny-qwen3"}
    assert "tiny-llama-3.1" not in capsys.readouterr().out
