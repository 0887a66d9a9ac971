"""What a first ROCm host meets before any kernel runs, checked without an AMD GPU: which launcher
target a ROCm lowering uses (HIP graphs opt-in), a jax that refuses the command-buffer trait, a
launcher registration that fails, an unsupported FlyDSL release, and the code-object version
facts the launcher's load errors name.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import child_env
import jax_rope_cache as jrc
from jax_rope_cache.backends import launcher, native, rocm
from jax_rope_cache.compilers import amdgpu_elf, flydsl


class _FakeLauncherModule:
    """Stands in for jax_rope_cache._native's launcher: the capsules are only handed to the
    (mocked) registration, never called."""

    def gpu_handler(self, platform, command_buffers):
        return {"execute": (platform, command_buffers)}


@pytest.fixture
def registrations(monkeypatch):
    """A fresh registration state and a mocked jax.ffi.register_ffi_target that records each call
    and refuses the command-buffer trait for the platforms in `refuse` (as jaxlib's GPU plugin
    extension does when the PJRT plugin lacks custom-call traits), or everything in `fail_all`."""
    state = dict(calls=[], refuse=set(), fail_all=set())

    def register(name, capsules, platform, api_version=0, traits=None, **kw):
        state["calls"].append((name, platform, traits is not None))
        if platform in state["fail_all"]:
            raise RuntimeError(f"registration of {name} failed on {platform} (mocked)")
        if traits is not None and platform in state["refuse"]:
            raise RuntimeError("The plugin does not support custom call traits")

    monkeypatch.setattr(native, "_registered", set())
    monkeypatch.setattr(native, "_rejected", {})
    monkeypatch.setattr(launcher, "_warned", set())
    monkeypatch.setattr(jax.ffi, "register_ffi_target", register)
    monkeypatch.delenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", raising=False)
    return state


@pytest.mark.parametrize("env,cuda,rocm_target", [
    (None, launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH),  # HIP graphs are opt-in
    ("1", launcher.GPU_TARGET, launcher.GPU_TARGET),
    ("0", launcher.GPU_TARGET_NO_GRAPH, launcher.GPU_TARGET_NO_GRAPH),
    ("off", launcher.GPU_TARGET_NO_GRAPH, launcher.GPU_TARGET_NO_GRAPH),
])
def test_rocm_uses_the_no_graph_target_unless_asked(registrations, monkeypatch, env, cuda, rocm_target):
    if env is not None:
        monkeypatch.setenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", env)
    module = _FakeLauncherModule()
    assert launcher.register_gpu_targets(module, "CUDA") == cuda
    assert launcher.register_gpu_targets(module, "ROCM") == rocm_target
    # both targets are registered for both platforms (an executable lowered elsewhere finds either)
    assert {(n, p) for n, p, _ in registrations["calls"]} == {
        (t, p) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH) for p in ("CUDA", "ROCM")}
    assert all(traits == (n == launcher.GPU_TARGET) for n, _, traits in registrations["calls"])


def test_a_bad_command_buffers_value_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", "sometimes")
    with pytest.raises(ValueError, match=r"JAX_ROPE_CACHE_COMMAND_BUFFERS: expected 1 .* or 0 .*got 'sometimes'"):
        launcher.command_buffers_enabled("ROCM")


def test_a_refused_trait_falls_back_to_the_no_graph_target_with_one_warning(registrations, monkeypatch):
    """jax 0.11.0's ROCm plugin refuses any custom-call trait: the graph target cannot be
    registered there; the lowering must use the other target and say so once."""
    registrations["refuse"].add("ROCM")
    monkeypatch.setenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", "1")
    module = _FakeLauncherModule()
    with pytest.warns(RuntimeWarning, match=r"refused the command-buffer trait .* for ROCM .*"
                                            r"The plugin does not support custom call traits"):
        assert launcher.register_gpu_targets(module, "ROCM") == launcher.GPU_TARGET_NO_GRAPH
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second lowering is silent
        assert launcher.register_gpu_targets(module, "ROCM") == launcher.GPU_TARGET_NO_GRAPH
        assert launcher.register_gpu_targets(module, "CUDA") == launcher.GPU_TARGET  # CUDA unaffected
    # the refused registration is not retried on every lowering
    assert sum(1 for n, p, _ in registrations["calls"] if (n, p) == (launcher.GPU_TARGET, "ROCM")) == 1
    assert (launcher.GPU_TARGET_NO_GRAPH, "ROCM") in native._registered
    assert (launcher.GPU_TARGET, "ROCM") not in native._registered
    # without the opt-in the no-graph target was ROCm's anyway: no warning
    monkeypatch.delenv("JAX_ROPE_CACHE_COMMAND_BUFFERS")
    launcher._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launcher.register_gpu_targets(module, "ROCM") == launcher.GPU_TARGET_NO_GRAPH


def _rocm_problem():
    rng = np.random.default_rng(3)
    s = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    cos, sin = jrc.rope_tables(32, 64, base=10000.0)
    return (s(4, 4, 64), s(4, 2, 64), s(4, 2, 64), s(2, 8, 2, 64), s(2, 8, 2, 64),
            rng.permutation(16)[:4].astype(np.int32), rng.integers(0, 32, 4).astype(np.int32), cos, sin)


def _export_for_rocm(impl):
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _rocm_problem()]
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl=impl))
    return jax.export.export(step, platforms=["rocm"], disabled_checks=checks)(*args).mlir_module()


@pytest.fixture
def stand_in_code_objects(monkeypatch):
    """A ROCm lowering without FlyDSL: kernel_config is the real one (the builder module imports
    without FlyDSL), the code-object table a stand-in (the launcher call around it is real)."""
    table = launcher.pack_code_table([(launcher.KIND_AMDGPU, a, b"\x7fELF stand-in " + a.encode())
                                      for a in rocm.DEFAULT_ARCHS])
    monkeypatch.setattr(rocm, "missing", lambda: None)
    monkeypatch.setattr(rocm, "build_code_table", lambda cfg, archs=None: (table, "jrc_rope_cache_0", [
        flydsl.CodeObject(arch=a, code=b"", symbol="jrc_rope_cache_0", info={}, key="") for a in archs]))


@pytest.mark.parametrize("env,target", [(None, launcher.GPU_TARGET_NO_GRAPH), ("1", launcher.GPU_TARGET)])
def test_a_rocm_lowering_calls_the_no_graph_target_by_default(stand_in_code_objects, monkeypatch, env, target):
    if env is None:
        monkeypatch.delenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", raising=False)
    else:
        monkeypatch.setenv("JAX_ROPE_CACHE_COMMAND_BUFFERS", env)
    text = _export_for_rocm("kernel")
    assert f"@{target}(" in text or f'call_target_name = "{target}"' in text, text[-2000:]
    other = ({launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH} - {target}).pop()
    assert f"@{other}(" not in text and f'call_target_name = "{other}"' not in text


def test_a_failing_launcher_registration_falls_back_under_impl_none(registrations, stand_in_code_objects):
    """A jax that refuses the launcher's registration outright: impl=None lowers the XLA path with
    a warning naming the failure; impl='kernel' raises it."""
    registrations["fail_all"].add("ROCM")
    with pytest.warns(RuntimeWarning, match=r"falling back to the XLA implementation on ROCm: it needs its launcher "
                                            r"target registered with jax, which failed .*mocked"):
        text = _export_for_rocm(None)
    assert "jax_rope_cache_gpu" not in text and "scatter" in text
    with pytest.raises(RuntimeError, match="mocked"):
        _export_for_rocm("kernel")


# ---- FlyDSL: one release ------------------------------------------------------------------------
@pytest.mark.parametrize("installed", ["0.4.2", "0.5.1", "0.6.0"])
def test_another_flydsl_release_is_reported_with_the_supported_one(monkeypatch, installed):
    real_find_spec = flydsl.importlib.util.find_spec
    monkeypatch.setattr(flydsl.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flydsl" else real_find_spec(name, *a))
    monkeypatch.setattr(flydsl, "_find_lld", lambda: ("path", "/usr/bin/ld.lld"))
    monkeypatch.setattr(flydsl, "flydsl_version", lambda: installed)
    flydsl._probe.cache_clear()
    try:
        assert not flydsl.available()
        reason = flydsl.unavailable_reason()
        assert f"FlyDSL {installed} is installed" in reason and "FlyDSL 0.5.0 exactly" in reason, reason
        assert "pip install 'flydsl==0.5.0'" in reason and "--bundle" in reason and "JAX_ROPE_CACHE_ROCM_BUNDLE" in reason
        with pytest.raises(flydsl.FlyDSLUnavailable, match=f"FlyDSL {installed} is installed"):
            flydsl.require()
        monkeypatch.setattr(flydsl, "flydsl_version", lambda: flydsl.FLYDSL_VERSION)
        flydsl._probe.cache_clear()
        assert flydsl.available(), flydsl.unavailable_reason()
    finally:
        flydsl._probe.cache_clear()


def test_the_flydsl_pin_is_the_supported_release():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pins = set()
    for rel in ("pyproject.toml", "scripts/test-requirements.txt"):
        with open(os.path.join(root, rel)) as f:
            pins |= set(re.findall(r"flydsl==([0-9][0-9.]*)", f.read()))
    assert pins == {flydsl.FLYDSL_VERSION}, pins


# ---- code-object versions --------------------------------------------------------------------------
@pytest.mark.parametrize("abi,version", [(2, 4), (3, 5), (4, 6)])
def test_code_object_version_is_read_from_the_elf_abi_version(abi, version):
    header = bytearray(64)
    header[:9] = b"\x7fELF\x02\x01\x01" + bytes([amdgpu_elf.ELFOSABI_AMDGPU_HSA, abi])
    assert amdgpu_elf.code_object_version(bytes(header)) == version
    assert amdgpu_elf.code_object_version(b"\x7fELF\x02\x01\x01\x00\x00" + bytes(55)) is None  # not HSA


def test_flydsl_code_objects_are_version_6_needing_rocm_6_3():
    """FlyDSL 0.5.0 emits code-object v6: what the launcher's load error and docs/rocm.md state."""
    if not flydsl.available():
        pytest.skip(f"needs FlyDSL for a real code object: {flydsl.unavailable_reason()}")
    from conftest import make_spec

    cfg = rocm.kernel_config(make_spec(T=4, QH=4, KH=1, D=64))
    _, _, objs = rocm.build_code_table(cfg, ("gfx942",))
    assert amdgpu_elf.code_object_version(objs[0].code) == 6
    assert amdgpu_elf.MIN_ROCM[6] == (6, 3)


# ---- a run asked for a GPU that jax did not load ---------------------------------------------------
def _collect_with_a_failing_rocm_plugin(tmp_path, extra, rocm_root=None):
    """`pytest --collect-only` of one test file in a fresh process whose jax finds a ROCm plugin that
    fails to load the way a TheRock install's does (its initialize() cannot open a librocm_sysdeps_*
    library): jax logs the error and runs on the CPU."""
    import os
    import subprocess
    import sys

    plugin = tmp_path / "plugins" / "jax_plugins" / "xla_rocm7"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "def initialize():\n"
        "    raise OSError('librocm_sysdeps_drm.so.2: cannot open shared object file: No such file or directory')\n")
    env = child_env(path=[tmp_path / "plugins"], drop=("JAX_PLATFORMS",), JRC_JAX_EXTRA=extra,
                    ROCM_PATH=str(rocm_root or tmp_path / "no-rocm"), LD_LIBRARY_PATH="")
    tests = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           os.path.join(tests, "test_cli_info.py")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tests)


def test_a_rocm_run_without_a_rocm_backend_fails_naming_the_plugin_error_and_the_fix(tmp_path):
    root = tmp_path / "rocm"
    (root / "lib" / "rocm_sysdeps" / "lib").mkdir(parents=True)
    (root / "lib" / "rocm_sysdeps" / "lib" / "librocm_sysdeps_drm.so.2").write_bytes(b"")
    r = _collect_with_a_failing_rocm_plugin(tmp_path, "rocm7-local", root)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "JRC_JAX_EXTRA=rocm7-local asks for a rocm run, but jax has no rocm backend here" in out, out[-3000:]
    assert "librocm_sysdeps_drm.so.2: cannot open shared object file" in out  # the plugin's own load error
    assert f"export LD_LIBRARY_PATH={root}/lib/rocm_sysdeps/lib:$LD_LIBRARY_PATH" in out  # the fix
    assert "ROCm 7.x" in out


def test_a_cpu_run_is_not_affected_by_a_failing_gpu_plugin(tmp_path):
    r = _collect_with_a_failing_rocm_plugin(tmp_path, "")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "test_info_help" in r.stdout
