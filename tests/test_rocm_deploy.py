"""Deploying the ROCm kernel without a compiler, and compiling it without touching the user's process.

A "host without FlyDSL" is a fresh Python process in which `flydsl`, `torch` and `ziglang` are
marked absent in sys.modules (None entries: `import flydsl` raises ModuleNotFoundError and
importlib.util.find_spec returns None, exactly as when the packages are not installed), with the
same jax and jax_rope_cache. In such a process:
  * a bundle written by `compile --bundle` (JAX_ROPE_CACHE_ROCM_BUNDLE), or a copied disk cache,
    serves the lowering: the custom call carries the precompiled code objects byte for byte;
  * a configuration that was not precompiled raises (impl="kernel") an error that says how to
    precompile, or falls back to XLA with a warning (impl=None);
  * nothing imports flydsl or torch.
Where FlyDSL is installed, compiling happens in a child process: after a lowering that compiled,
the user's process has imported neither flydsl nor torch; the child's stand-in torch gives the
same bytes as a real torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import child_env
from jax_rope_cache.cli import aot
from jax_rope_cache.compilers import cache, flydsl

needs_flydsl = pytest.mark.skipif(not flydsl.available(),
                                  reason=f"the ROCm kernel cannot be compiled here: {flydsl.unavailable_reason()}; "
                                         f"install with: {flydsl.INSTALL_HINT}")

# A fresh process: optionally without flydsl/torch, lowers (exports) a decode step for "rocm" and
# prints what the launcher call embeds. argv: JSON {"block": bool, "heads": [QH, KH, D], "impl": ...}.
_CHILD = textwrap.dedent("""
    import json, sys, time, warnings
    opts = json.loads(sys.argv[1])
    if opts["block"]:
        for name in ("flydsl", "torch", "ziglang"):
            sys.modules[name] = None   # what Python records for a package that is not installed
    import importlib.util
    assert opts["block"] is False or importlib.util.find_spec("flydsl") is None
    import jax, jax.numpy as jnp
    import jax_rope_cache as jrc
    from jax_rope_cache.backends import launcher
    from jax_rope_cache.compilers import flydsl
    QH, KH, D = opts["heads"]
    s = jax.ShapeDtypeStruct
    args = (s((4, QH, D), jnp.bfloat16), s((4, KH, D), jnp.bfloat16), s((4, KH, D), jnp.bfloat16),
            s((8, 16, KH, D), jnp.bfloat16), s((8, 16, KH, D), jnp.bfloat16), s((4,), jnp.int32),
            s((4,), jnp.int32), s((64, D // 2), jnp.float32), s((64, D // 2), jnp.float32))
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl=opts["impl"]), donate_argnums=(3, 4))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    out = {}
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            exp = jax.export.export(step, platforms=["rocm"], disabled_checks=checks)(*args)
            text = exp.mlir_module()
            out["custom_call"] = "jax_rope_cache_gpu" in text
            out["codes"] = [o.code.hex() for o in flydsl._mem.values()]
            out["origins"] = sorted({o.origin.split(":")[0] for o in flydsl._mem.values()})
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["lower_s"] = time.perf_counter() - t
    out["warnings"] = [str(x.message) for x in w]
    out["imported"] = sorted(m for m in ("flydsl", "torch") if sys.modules.get(m) is not None)
    out["worker_pid"] = flydsl.worker_pid()
    out["pid"] = __import__("os").getpid()
    print("RESULT " + json.dumps(out))
""")


def _run(env_extra: dict, **opts) -> dict:
    o = dict(block=True, heads=[8, 1, 64], impl="kernel") | opts
    env = child_env(**env_extra)
    r = subprocess.run([sys.executable, "-P", "-c", _CHILD, json.dumps(o)], env=env, capture_output=True, text=True,
                       timeout=600, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A build machine's output: `compile --bundle` for one shape (8x1x64, flash, bf16; both regimes) and
    its disk cache."""
    if not flydsl.available():
        pytest.skip(f"building the bundle needs FlyDSL: {flydsl.unavailable_reason()}")
    root = tmp_path_factory.mktemp("build")
    bundle = root / "rope.jrcbundle"
    env_before = os.environ.get("JAX_ROPE_CACHE_DIR")
    os.environ["JAX_ROPE_CACHE_DIR"] = str(root / "cache")
    try:  # even with these code objects already in this process's memory, the cache gets them
        out = aot.precompile(("gfx942", "gfx950"), aot.configs_for(q_heads=8, kv_heads=1, head_dim=64,
                                                                   layouts=("flash",)), bundle=str(bundle))
    finally:
        if env_before is None:
            os.environ.pop("JAX_ROPE_CACHE_DIR")
        else:
            os.environ["JAX_ROPE_CACHE_DIR"] = env_before
    # both regimes (the default): the bandwidth and the latency configuration, 2 archs each
    assert len(list((root / "cache" / "rocm").glob("*.hsaco.jrc"))) == 4
    # what the helper's call (T = 4, a decode-sized call) lowers to: the latency configuration's
    return dict(root=root, bundle=bundle, cache=root / "cache",
                codes=sorted(co.code.hex() for cfg, co in out if cfg.latency))


def test_bundle_serves_a_host_without_flydsl_or_torch(built, tmp_path):
    r = _run({"JAX_ROPE_CACHE_DIR": str(tmp_path / "empty"), "JAX_ROPE_CACHE_ROCM_BUNDLE": str(built["bundle"])})
    assert "error" not in r, r["error"]
    assert r["custom_call"] and sorted(r["codes"]) == built["codes"] and r["origins"] == ["bundle"]
    assert r["imported"] == [] and r["worker_pid"] is None
    assert not [w for w in r["warnings"] if "falling back" in w], r["warnings"]


def test_bundle_in_the_cache_folder_is_found_too(built, tmp_path):
    (tmp_path / "rocm").mkdir()
    (tmp_path / "rocm" / "deploy.jrcbundle").write_bytes(built["bundle"].read_bytes())
    r = _run({"JAX_ROPE_CACHE_DIR": str(tmp_path), "JAX_ROPE_CACHE_ROCM_BUNDLE": ""})
    assert "error" not in r, r["error"]
    assert sorted(r["codes"]) == built["codes"] and r["imported"] == []


def test_copied_disk_cache_serves_a_host_without_flydsl(built):
    r = _run({"JAX_ROPE_CACHE_DIR": str(built["cache"]), "JAX_ROPE_CACHE_ROCM_BUNDLE": ""})
    assert "error" not in r, r["error"]
    assert sorted(r["codes"]) == built["codes"] and r["origins"] == ["disk"] and r["imported"] == []


def test_a_miss_without_flydsl_says_how_to_precompile_or_falls_back(built, tmp_path):
    env = {"JAX_ROPE_CACHE_DIR": str(tmp_path), "JAX_ROPE_CACHE_ROCM_BUNDLE": str(built["bundle"])}
    r = _run(env, heads=[4, 2, 64])  # not in the bundle
    assert "FlyDSLUnavailable" in r["error"] and "no precompiled code object" in r["error"], r["error"]
    assert "--bundle" in r["error"] and "JAX_ROPE_CACHE_ROCM_BUNDLE" in r["error"] and "pip install" in r["error"]
    r = _run(env, heads=[4, 2, 64], impl=None)
    assert "error" not in r and not r["custom_call"]
    assert any("falling back to the XLA implementation on ROCm" in w for w in r["warnings"]), r["warnings"]
    assert r["imported"] == []


def test_a_damaged_bundle_is_ignored_with_a_warning(built, tmp_path):
    bad = tmp_path / "bad.jrcbundle"
    blob = bytearray(built["bundle"].read_bytes())
    blob[-10] ^= 0xFF
    bad.write_bytes(bytes(blob))
    r = _run({"JAX_ROPE_CACHE_DIR": str(tmp_path / "c"), "JAX_ROPE_CACHE_ROCM_BUNDLE": str(bad)}, impl=None)
    assert any("ignoring the ROCm code-object bundle" in w and "checksum" in w for w in r["warnings"]), r["warnings"]
    assert not r["custom_call"]


def test_bundle_format_roundtrip(tmp_path, monkeypatch):
    """write_bundle / lookup without FlyDSL, on synthetic entries: keys, arch, bytes, atomic file."""
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setattr(flydsl.amdgpu_elf, "kernel_info", lambda code: {"name": "jrc_rope_cache_0"})

    class Cfg:
        def key(self):
            return "synthetic"

    objs = [flydsl.CodeObject(arch=a, code=b"\x7fELF-" + a.encode(), symbol="jrc_rope_cache_0", info={},
                              key=flydsl.key_for(Cfg(), a)) for a in ("gfx942", "gfx950")]
    path = flydsl.write_bundle(str(tmp_path / "b.jrcbundle"), objs + objs[:1])
    header, _ = cache.decode(open(path, "rb").read())
    assert header["kind"] == flydsl.BUNDLE_MAGIC_KIND and len(header["entries"]) == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    monkeypatch.setenv("JAX_ROPE_CACHE_ROCM_BUNDLE", path)
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path / "none"))
    for o in objs:
        got = flydsl.lookup(Cfg(), o.arch)
        assert got.code == o.code and got.arch == o.arch and got.origin == f"bundle:{path}"
    monkeypatch.setenv("JAX_ROPE_CACHE_ROCM_BUNDLE", str(tmp_path / "missing.jrcbundle"))
    monkeypatch.setattr(flydsl, "_mem", {})
    with pytest.warns(cache.CacheWarning, match="does not exist"):
        assert flydsl.lookup(Cfg(), "gfx942") is None


def test_keys_do_not_depend_on_flydsl_being_installed(monkeypatch):
    cfg = aot.configs_for(q_heads=8, kv_heads=1, head_dim=64, layouts=("flash",))[0]
    k = flydsl.key_for(cfg, "gfx942")
    monkeypatch.setattr(flydsl, "flydsl_version", lambda: "9.9-other")
    monkeypatch.setattr(flydsl, "available", lambda: False)
    assert flydsl.key_for(cfg, "gfx942") == k != flydsl.key_for(cfg, "gfx950")


@needs_flydsl
def test_compiling_never_loads_flydsl_or_torch_into_the_jax_process(tmp_path):
    """Empty caches, FlyDSL installed: the lowering compiles (in a child process); this process
    has imported neither flydsl nor torch; a second shape reuses the same child."""
    r = _run({"JAX_ROPE_CACHE_DIR": str(tmp_path), "JAX_ROPE_CACHE_ROCM_BUNDLE": ""}, block=False)
    assert "error" not in r, r["error"]
    assert r["origins"] == ["compiled"] and len(r["codes"]) == 2
    assert r["imported"] == [], r["imported"]
    assert r["worker_pid"] not in (None, r["pid"])
    # warm cache, fresh process: no child process at all
    r2 = _run({"JAX_ROPE_CACHE_DIR": str(tmp_path), "JAX_ROPE_CACHE_ROCM_BUNDLE": ""}, block=False)
    assert r2["origins"] == ["disk"] and r2["worker_pid"] is None and r2["imported"] == []
    assert sorted(r2["codes"]) == sorted(r["codes"])


@needs_flydsl
def test_the_stand_in_torch_compiles_the_same_bytes_as_a_real_torch(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("no real torch installed to compare with")
    cfgs = aot.configs_for(q_heads=8, kv_heads=1, head_dim=64, layouts=("flash", "xpacked_shuffled"),
                           cache_dtypes=("bfloat16", "float8_e4m3fnuz"), precisions=("native",),
                           table_dtypes=("bfloat16",))
    out = {}
    for mode in ("stub", "real"):
        monkeypatch.setenv("JAX_ROPE_CACHE_FLYDSL_TORCH", mode)
        w = flydsl._Worker()
        try:
            assert (w.torch == "stub") == (mode == "stub"), w.torch
            out[mode] = []
            for cfg in cfgs:
                for arch in ("gfx942", "gfx950"):
                    r = w.request(dict(op="compile", kernel=flydsl.kernel_source_path(),
                                       config=__import__("dataclasses").asdict(cfg), arch=arch,
                                       rocm_path=flydsl.toolkit_root(), isa=False))
                    assert r["ok"], r.get("error")
                    out[mode].append(r["code"])
        finally:
            w.close()
    assert out["stub"] == out["real"] and len(out["stub"]) == 2 * len(cfgs)


@needs_flydsl
def test_a_compile_error_in_the_child_is_reported(monkeypatch):
    cfg = aot.configs_for(q_heads=8, kv_heads=1, head_dim=64, layouts=("flash",))[0]
    bad = __import__("dataclasses").replace(cfg, nt=0)  # an impossible workgroup
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", "")
    with pytest.raises(flydsl.FlyDSLError, match=r"FlyDSL failed to compile"):
        flydsl.compile_config(bad, "gfx942")
    # the child survives a failed request
    assert flydsl.compile_config(cfg, "gfx942").code[:4] == b"\x7fELF"


# ---- QK-norm options: what `compile` builds is what a call with them lowers to --------------------
def _lowered_config(case, **opts):
    """The FlyDSL configuration a call of `case` with `opts` (norm weights, scales) lowers to."""
    import numpy as np
    from conftest import make_problem
    from jax_rope_cache import contract
    from jax_rope_cache.backends import rocm

    args, base = make_problem(case, seed=5)
    base = {k: v for k, v in base.items() if k not in ("k_scale", "v_scale")}
    for w in ("q_norm_weight", "k_norm_weight"):
        if opts.get(w) == "q":
            opts[w] = np.random.default_rng(1).standard_normal(case.D).astype(args[0].dtype)
    return rocm.kernel_config(contract.check_op(*args, **base, **opts))  # the call's T picks the regime


def test_compile_builds_the_qwen3_norm_variant_a_call_lowers_to():
    """`compile --preset qwen3-32b --tp 8` (qk_norm "auto"): the fused norm with the config's eps and
    weights in q's dtype, exactly the configuration a Qwen3 call with q/k_norm_weight lowers to."""
    from conftest import Case
    from jax_rope_cache.models import presets

    eps = presets.preset_qk_norm_eps("qwen3-32b")
    assert eps is not None and presets.preset_qk_norm_eps("llama-3.1-8b") is None
    m = presets.model_shape("qwen3-32b", 8)
    case = Case(T=3, QH=m.q_heads, KH=m.kv_heads, D=m.head_dim)
    want = _lowered_config(case, q_norm_weight="q", k_norm_weight="q", norm_eps=eps)
    plain = _lowered_config(case)
    built = lambda **kw: aot.configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim,  # noqa: E731
                                         layouts=("flash",), **kw)
    assert want.latency  # T = 3: a decode-sized call; `compile` builds both regimes by default
    assert want in built(norm_eps=eps) and plain not in built(norm_eps=eps)
    assert plain in built() and want not in built()
    assert want not in built(norm_eps=eps, regimes=("bandwidth",))
    big = _lowered_config(dataclasses.replace(case, T=8192), q_norm_weight="q", k_norm_weight="q", norm_eps=eps)
    assert not big.latency and big in built(norm_eps=eps) and big in built(norm_eps=eps, regimes=("bandwidth",))
    with pytest.raises(ValueError, match="regimes: expected a subset"):
        built(regimes=("fast",))
    assert aot.preset_norms("qwen3-32b") == (eps,) and aot.preset_norms("qwen3-32b", "off") == (None,)
    assert aot.preset_norms("qwen3-32b", "both") == (None, eps)
    assert aot.preset_norms("llama-3.1-8b") == (None,) == aot.preset_norms("llama-3.1-8b", "both")
    with pytest.raises(ValueError, match="qk_norm: expected one of"):
        aot.preset_norms("qwen3-32b", "yes")


def test_compile_scale_heads_builds_the_per_head_fp8_variant():
    from conftest import Case
    import numpy as np

    case = Case(T=3, QH=8, KH=2, D=64, cache_dtype="float8_e4m3fn")
    want = _lowered_config(case, k_scale=np.array([0.5, 2.0], np.float32), v_scale=np.array([1.5, 0.25], np.float32))
    scalar = _lowered_config(case, k_scale=0.5, v_scale=1.5)
    built = aot.configs_for(q_heads=8, kv_heads=2, head_dim=64, layouts=("flash",), cache_dtypes=("float8_e4m3fn",),
                            scale_heads=True)
    assert want in built and scalar not in built
    assert scalar in aot.configs_for(q_heads=8, kv_heads=2, head_dim=64, layouts=("flash",),
                                     cache_dtypes=("float8_e4m3fn",))


def test_compile_builds_the_mrope_kernels_a_qwen_vl_call_lowers_to():
    """`compile --preset qwen3-vl-8b --tp 4`: the M-RoPE configuration (its interleaved sections, its
    QK-norm) that a Qwen3-VL call with positions [3, T] lowers to, not the 1-D one."""
    import numpy as np
    from conftest import Case, make_problem
    from jax_rope_cache import contract
    from jax_rope_cache.backends import rocm
    from jax_rope_cache.models import presets

    section, interleaved = presets.preset_mrope("qwen3-vl-8b")
    assert (section, interleaved) == ((24, 20, 20), True) and presets.preset_mrope("llama-3.1-8b") is None
    m = presets.model_shape("qwen3-vl-8b", 4)
    case = Case(T=3, QH=m.q_heads, KH=m.kv_heads, D=m.head_dim)
    args, base = make_problem(case, seed=5)
    base = {k: v for k, v in base.items() if k not in ("k_scale", "v_scale")}
    weight = np.ones(case.D, args[0].dtype)
    norm = dict(q_norm_weight=weight, k_norm_weight=weight, norm_eps=presets.preset_qk_norm_eps("qwen3-vl-8b"))
    text = rocm.kernel_config(contract.check_op(*args, **base, **norm))
    args = list(args)
    args[6] = np.stack([args[6]] * 3)  # positions [3, T]
    want = rocm.kernel_config(contract.check_op(*args, **base, **norm, mrope_section=section,
                                                mrope_interleaved=interleaved))
    built = aot.preset_configs("qwen3-vl-8b", 4, layouts=("flash",))
    assert want in built and text not in built
