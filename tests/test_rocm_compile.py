"""The ROCm (FlyDSL) kernel without an AMD GPU (runs in CPU-only CI).

1. Every variant of a config matrix (all layouts, NeoX/GPT-J, half/full tables, partial rotary,
   bf16/f16/f32 inputs, f32/bf16/f16 tables, fp8 e4m3fn and e4m3fnuz caches, both precisions,
   int32/int64 indices, D in {64, 128, 256}) compiles for gfx942 AND gfx950, in both regimes of
   make_config (T = 64: latency, T = 8192: bandwidth).
2. Each code object's AMDGPU metadata (parsed in pure Python) matches what the launcher does:
   the kernarg segment is exactly the launcher's parameter block (18 pointers then 14 int64
   dim0, 8 bytes each at offsets 0..248, 256 bytes, no hidden arguments), no scratch, no spills,
   at most 64 VGPRs (8 waves per SIMD), required workgroup size == the launch block of the
   lowering, wave64.
3. The ISA of representative variants has no fused multiply-add (the arithmetic must round each
   product and sum separately) and uses 16-byte global memory instructions; "fused" native
   arithmetic (f32 tables) has its FMAs; every kernel keeps f32/f16 denormals (its descriptor's
   FLOAT_DENORM_MODE is "flush none", as the reference and the lane emulator assume).
4. `jax.export` of a jitted decode step for platform "rocm" works on this CPU machine; the
   deserialized program's custom call carries a code-object table with valid gfx942 and gfx950
   code objects whose kernel symbol is the one the call names.
5. Without FlyDSL, impl="kernel" raises an error naming what to install and impl=None falls back
   to XLA with a warning (this part runs even where flydsl is not installed).
6. The `compile` CLI fills the disk cache that lowering then reads.
On a ROCm host the kernel's numerics are checked by the rest of the suite (tests/test_op.py etc.
parametrise over the "rocm" platform with impl="kernel").
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import make_spec, flydsl_kernel_module
from jax_rope_cache import backends, contract
from jax_rope_cache.backends import launcher, rocm
from jax_rope_cache.cli import aot
from jax_rope_cache.compilers import amdgpu_elf, flydsl

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
E5 = np.dtype(ml_dtypes.float8_e5m2)
ARCHS = ("gfx942", "gfx950")
NUM_OPERANDS, NUM_RESULTS = 14, 4  # the custom call: 14 operands (layer, then the two norm weights), 4 results
MAX_VGPRS = 64

needs_flydsl = pytest.mark.skipif(not flydsl.available(),
                                  reason=f"the ROCm kernel cannot be compiled here: {flydsl.unavailable_reason()}; "
                                         f"install with: {flydsl.INSTALL_HINT}")




# (q/k/v dtype, cache dtype, table dtype, precision)
COMBOS = [(BF16, BF16, F32, "fp32"), (F16, FN, F16, "native"), (F32, F32, BF16, "fp32"),
          (BF16, FNUZ, BF16, "native"), (BF16, FN, F32, "fp32"), (F16, F16, F32, "native")]


def matrix():
    out = []
    i = 0
    for layout in contract.LAYOUTS:
        for neox in (True, False):
            for dt, cdt, tdt, prec in COMBOS:
                # hnd, head_major, kv_merged: flash's code with other strides
                for D in ((64, 128, 256) if layout in ("flash", "xpacked", "xpacked_shuffled") else (128,)):
                    i += 1
                    # rotate the rarer options through the matrix so each appears with every layout
                    R = D // 2 if i % 3 == 0 else None
                    full = i % 2 == 0
                    QH, KH = ((8, 1), (4, 2), (16, 4))[i % 3]
                    out.append(dict(layout=layout, neox=neox, dt=dt, cdt=cdt, tdt=tdt, prec=prec, D=D, R=R,
                                    full=full, QH=QH, KH=KH, slot64=i % 4 == 1, pos64=i % 4 != 2,
                                    layers=4 if i % 5 == 0 else None))  # stacked caches: layer operand
    # odd shapes: D=80 (chunks of 8 / 4 elements), tiny rotary dim, a partial GPT-J with f32 input
    out.append(dict(layout="flash", neox=True, dt=BF16, cdt=BF16, tdt=F32, prec="fp32", D=80, R=None, full=False,
                    QH=8, KH=8, slot64=False, pos64=False))
    out.append(dict(layout="flash", neox=True, dt=BF16, cdt=FN, tdt=F32, prec="native", D=64, R=2, full=True,
                    QH=2, KH=1, slot64=True, pos64=True))
    out.append(dict(layout="xpacked", neox=False, dt=F32, cdt=FNUZ, tdt=F32, prec="fp32", D=128, R=32,
                    full=False, QH=64, KH=8, slot64=False, pos64=False))
    # X taken from the key cache: narrower than a chunk (split key stores), 1, wider than 16 bytes
    for i, (layout, x, neox, dt, cdt, tdt, prec) in enumerate([
            ("xpacked", 4, True, BF16, BF16, F32, "fp32"), ("xpacked_shuffled", 1, False, F16, F16, F32, "native"),
            ("xpacked", 2, True, F16, FN, F16, "native"), ("xpacked_shuffled", 16, False, BF16, FNUZ, BF16, "native"),
            ("xpacked", 32, True, BF16, BF16, F32, "fp32"), ("xpacked_shuffled", 8, True, F32, F32, F32, "fp32")]):
        out.append(dict(layout=layout, X=x, neox=neox, dt=dt, cdt=cdt, tdt=tdt, prec=prec, D=(128, 64)[i % 2],
                        R=None if i % 3 else 64, full=bool(i % 2), QH=8, KH=(1, 2)[i % 2], slot64=i % 2 == 1,
                        pos64=True, layers=4 if i == 2 else None))
    return out


MATRIX = matrix()


def _id(p):
    return (f"{p['layout']}-{'neox' if p['neox'] else 'gptj'}-{p['dt'].name}-{p['cdt'].name}-{p['tdt'].name}-"
            f"{p['prec']}-D{p['D']}-R{p['R'] or p['D']}-{'full' if p['full'] else 'half'}-h{p['QH']}x{p['KH']}"
            f"{'-L' + str(p['layers']) if p.get('layers') else ''}{'-X' + str(p['X']) if p.get('X') else ''}")


def expected_kernargs():
    """The parameter block the launcher packs: pointers of operands and results, then dim0 of operands."""
    n = NUM_OPERANDS + NUM_RESULTS + NUM_OPERANDS
    return [dict(offset=8 * i, size=8, kind="by_value") for i in range(n)], 8 * n


def check_code_object(code: bytes, arch: str, cfg, symbol: str | None = None, max_vgprs: int = MAX_VGPRS):
    info = amdgpu_elf.kernel_info(code)
    args, size = expected_kernargs()
    assert info["target"].endswith(arch), info["target"]
    assert info["args"] == args, info["args"]
    assert info["kernarg_size"] == size
    assert info["private_segment_size"] == 0, "scratch memory used"
    assert info["vgpr_spill_count"] == 0 and info["sgpr_spill_count"] == 0
    # <= 64 VGPRs: 8 waves per SIMD on CDNA3/CDNA4 (512 VGPRs per lane / 64), the occupancy cap
    assert info["vgpr_count"] <= max_vgprs, f"{info['vgpr_count']} VGPRs (> {max_vgprs}: fewer than 8 waves per SIMD)"
    assert info["group_segment_size"] == 0  # the launcher passes smem=0
    assert list(info["reqd_workgroup_size"]) == [cfg.nt, 1, 1]
    assert info["max_flat_workgroup_size"] >= cfg.nt
    assert info["wavefront_size"] == 64
    assert info["agpr_count"] == 0
    if symbol is not None:
        assert info["name"] == symbol
    return info


@needs_flydsl
@pytest.mark.parametrize("T", [64, 8192], ids=["latency", "bandwidth"])  # both regimes of make_config
@pytest.mark.parametrize("p", MATRIX, ids=[_id(p) for p in MATRIX])
def test_variant_compiles_for_both_archs(p, T):
    check_variant_compiles(p, T)


# float8_e5m2 caches: every layout, both precisions, fused and rounded, stacked, X from the key cache
E5M2_MATRIX = [
    dict(layout="flash", neox=True, dt=BF16, cdt=E5, tdt=F32, prec="native", D=128, R=None, full=False, QH=8, KH=1,
         slot64=False, pos64=True),
    dict(layout="xpacked_shuffled", neox=False, dt=F16, cdt=E5, tdt=F16, prec="native", D=128, R=64, full=True,
         QH=16, KH=4, slot64=True, pos64=True),
    dict(layout="xpacked", neox=True, dt=F32, cdt=E5, tdt=BF16, prec="fp32", D=64, R=None, full=False, QH=4, KH=2,
         slot64=False, pos64=False, layers=4),
    dict(layout="hnd", neox=False, dt=BF16, cdt=E5, tdt=BF16, prec="fp32", D=128, R=None, full=True, QH=8, KH=8,
         slot64=False, pos64=True),
    dict(layout="xpacked", X=4, neox=True, dt=BF16, cdt=E5, tdt=F32, prec="native", D=128, R=None, full=False,
         QH=8, KH=2, slot64=False, pos64=True),
]


@needs_flydsl
@pytest.mark.parametrize("T", [64, 8192], ids=["latency", "bandwidth"])
@pytest.mark.parametrize("p", E5M2_MATRIX, ids=[_id(p) for p in E5M2_MATRIX])
def test_e5m2_variant_compiles_for_both_archs(p, T):
    check_variant_compiles(p, T)


def check_variant_compiles(p, T):
    spec = make_spec(T=T, layout=p["layout"], neox=p["neox"], dt=p["dt"], cdt=p["cdt"], tdt=p["tdt"],
                     prec=p["prec"], D=p["D"], R=p["R"], full=p["full"], QH=p["QH"], KH=p["KH"], slot64=p["slot64"],
                     pos64=p["pos64"], layers=p.get("layers"), X=p.get("X"))
    cfg = rocm.kernel_config(spec)
    assert cfg.latency == (T <= 256) and cfg.layer_blocks == (spec.num_blocks if p.get("layers") else 0)
    assert cfg.x == spec.x
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS)
    for o in objs:
        check_code_object(o.code, o.arch, o.config, symbol)  # the occupancy candidate that was built
    assert len({o.config for o in objs}) == 1  # one configuration (one launch geometry) for both archs
    assert launcher.unpack_code_table(table) == [(3, a, o.code) for a, o in zip(ARCHS, objs)]


ISA_CASES = [
    dict(layout="flash", neox=True, dt=BF16, cdt=BF16, tdt=F32, prec="fp32", D=128),
    dict(layout="xpacked_shuffled", neox=False, dt=F16, cdt=FN, tdt=F16, prec="native", D=64),
    dict(layout="xpacked", neox=True, dt=F32, cdt=FNUZ, tdt=BF16, prec="fp32", D=256),
]

FMA = re.compile(r"^\s*(v_(?:pk_)?(?:fma|fmac|mad|mac)\w*|v_fma_mix\w*|v_dot\w*)\s", re.M)
GMEM = re.compile(r"^\s*((?:buffer|global|flat)_(?:load|store)_\w+)", re.M)


def fma_outside_division(isa: str) -> list[str]:
    """FMA-like instructions, except those of the correctly rounded f32 division sequence
    (v_div_scale ... v_div_fixup), which the fp8 variants use once for 1/scale and the norm for
    1/sqrt, and of the correctly rounded sqrt expansion (v_sqrt_f32 ... v_cmp_class_f32: residual
    FMAs picking the root or a neighbour)."""
    out, inside = [], None
    for line in isa.splitlines():
        op = line.strip().split(" ")[0]
        if op.startswith("v_div_scale_f32"):
            inside = "v_div_fixup_f32"
        elif op.startswith("v_sqrt_f32"):
            inside = "v_cmp_class_f32"
        elif inside and op.startswith(inside):
            inside = None
        elif FMA.match(line) and not inside:
            out.append(line.strip())
    return out


@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", ISA_CASES, ids=lambda p: f"{p['layout']}-{p['dt'].name}-{p['cdt'].name}-{p['prec']}")
def test_isa_no_fma_and_wide_memory(p, arch):
    spec = make_spec(**p)
    cfg = rocm.kernel_config(spec)
    isa = flydsl.isa(cfg, arch)
    assert "s_endpgm" in isa
    fused = fma_outside_division(isa)
    assert not fused, f"fused multiply-add in the ISA outside the IEEE division of 1/scale: {fused[:8]}"
    ops = set(GMEM.findall(isa))
    assert any(o.endswith("dwordx4") for o in ops if o.startswith("buffer_load")), ops
    assert "scratch_" not in isa
    assert_keeps_denormals(isa)


def assert_keeps_denormals(isa: str):
    modes = dict(re.findall(r"^\s*\.amdhsa_(float_denorm_mode_32|float_denorm_mode_16_64)\s+(\d+)", isa, re.M))
    assert modes == {"float_denorm_mode_32": "3", "float_denorm_mode_16_64": "3"}, modes  # 3: flush none


@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
def test_isa_e5m2_converts_in_integer_arithmetic(arch):
    """An e5m2 cache uses no fp8 conversion instruction on either arch (gfx942's bf8 instructions
    write e5m2fnuz, bias 16; the kernel's integer conversion is what the emulator checks), no
    contraction, keeps denormals."""
    cfg = rocm.kernel_config(make_spec(layout="xpacked", neox=True, dt=BF16, cdt=E5, tdt=BF16, prec="fp32", D=128))
    isa = flydsl.isa(cfg, arch)
    assert "s_endpgm" in isa
    assert not re.findall(r"^\s*v_cvt\w*_(?:bf8|fp8)\w*", isa, re.M)
    assert not fma_outside_division(isa)
    assert_keeps_denormals(isa)


@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
def test_isa_fused_arithmetic_has_its_fma(arch):
    """Native arithmetic with f32 tables is "fused" (reference.arithmetic): its first product is
    an llvm.intr.fma, which must reach the ISA as an FMA instruction (one rounding)."""
    spec = make_spec(layout="flash", neox=True, dt=BF16, cdt=FN, tdt=F32, prec="native", D=128)
    isa = flydsl.isa(rocm.kernel_config(spec), arch)
    assert fma_outside_division(isa), "no FMA instruction in a fused-arithmetic kernel"
    assert_keeps_denormals(isa)


# ---- export ------------------------------------------------------------------------------------
def decode_args(layout="flash", T=8, QH=8, KH=1, D=64, NB=64, BS=16, cdt=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, NB, BS, KH, D, np.dtype(cdt))
    return (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s(kc, cdt), s(vc, cdt), s((T,), jnp.int32), s((T,), jnp.int32),
            s((4096, D // 2), jnp.float32), s((4096, D // 2), jnp.float32))


def export_rocm(impl="kernel", layout="flash", cdt=jnp.bfloat16):
    import jax_rope_cache as jrc

    fp8 = np.dtype(cdt) in contract.FP8_DTYPES

    def step(q, k, v, kc, vc, slots, pos, cos, sin):
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layout=layout, impl=impl,
                                  k_scale=0.5 if fp8 else None, v_scale=0.25 if fp8 else None)

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph")]
    return jax.export.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["rocm"],
                             disabled_checks=checks)(*decode_args(layout=layout, cdt=cdt))


def custom_calls(exported):
    """[(target, {attr: python value})] of the stablehlo.custom_call ops of an Exported."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir

    out = []
    with jmlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "stablehlo.custom_call":
                            attrs = {}
                            cfg = inner.attributes["mhlo.backend_config"]
                            d = ir.DictAttr(cfg)
                            for i in range(len(d)):
                                na = d[i]
                                a = na.attr
                                if isinstance(a, ir.StringAttr):
                                    attrs[na.name] = a.value_bytes
                                elif isinstance(a, ir.IntegerAttr):
                                    attrs[na.name] = a.value
                            out.append((ir.StringAttr(inner.attributes["call_target_name"]).value, attrs))
                        walk(inner.operation)

        walk(module.operation)
    return out


@needs_flydsl
@pytest.mark.parametrize("layout,cdt", [("flash", jnp.bfloat16), ("xpacked_shuffled", jnp.float8_e4m3fnuz)])
def test_export_rocm_on_cpu_carries_both_archs(layout, cdt):
    exp = export_rocm(layout=layout, cdt=cdt)
    assert exp.platforms == ("rocm",)
    restored = jax.export.deserialize(exp.serialize())
    calls = [c for c in custom_calls(restored) if c[0].startswith("jax_rope_cache_gpu")]
    assert len(calls) == 1, calls
    _, attrs = calls[0]
    entries = launcher.unpack_code_table(attrs["code"])
    assert [(k, a) for k, a, _ in entries] == [(3, "gfx942"), (3, "gfx950")]
    symbol = attrs["kernel"].decode()
    spec_cfg = rocm.build_code_table(rocm.kernel_config(make_spec_from_decode(layout, cdt)), ARCHS)[2][0].config
    assert attrs["block"] == spec_cfg.nt and attrs["grid_div"] == spec_cfg.tpb and attrs["smem"] == 0
    for _, arch, code in entries:
        check_code_object(code, arch, spec_cfg, symbol)
    assert attrs["code_hash"] == launcher.code_hash(attrs["code"])


def make_spec_from_decode(layout, cdt):
    a = decode_args(layout=layout, cdt=cdt)
    fp8 = np.dtype(cdt) in contract.FP8_DTYPES
    return contract.check_op(*a, layout=layout, k_scale=0.5 if fp8 else None, v_scale=0.25 if fp8 else None)


def test_without_flydsl_kernel_raises_and_default_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path))  # nothing precompiled either
    monkeypatch.delenv("JAX_ROPE_CACHE_ROCM_BUNDLE", raising=False)
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setattr(flydsl, "available", lambda: False)
    monkeypatch.setattr(flydsl, "unavailable_reason", lambda: "the Python package 'flydsl' is not installed")
    with pytest.raises(RuntimeError, match=r"pip install .flydsl.*precompile"):
        export_rocm(impl="kernel")
    with pytest.warns(RuntimeWarning, match="falling back to the XLA implementation on ROCm"):
        exp = export_rocm(impl=None)
    assert not [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache")]
    assert "rocm" not in backends.kernel_platforms()


def test_compile_failure_falls_back_for_default_impl(monkeypatch):
    monkeypatch.setattr(flydsl, "available", lambda: True)

    def broken(cfg, arch, hints=None):
        raise RuntimeError("DSLCompileError: lld invocation failed")

    monkeypatch.setattr(flydsl, "compile_config", broken)
    monkeypatch.setattr(flydsl, "kernel_module", lambda path=None: _REPO_KERNEL)
    with pytest.raises(RuntimeError, match="lld invocation failed"):
        export_rocm(impl="kernel")
    with pytest.warns(RuntimeWarning, match="compiling the kernel failed"):
        exp = export_rocm(impl=None)
    assert not [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache")]


_REPO_KERNEL = flydsl_kernel_module()


@needs_flydsl
def test_compile_cli_fills_the_disk_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flydsl, "_mem", {})
    cli = ["--arch", "gfx942,gfx950", "--preset", "gpt-oss-120b", "--tp", "8", "--layout", "flash,xpacked_shuffled",
           "--dtype", "bfloat16"]
    aot.main(cli + ["--regimes", "bandwidth"])
    err = capsys.readouterr().err
    assert "4 code objects (2 configurations x 2 archs)" in err, err
    assert len(list((tmp_path / "rocm").glob("*.hsaco.jrc"))) == 4
    # a lowering of the same shape now reads the disk cache (nothing compiled): large calls get the
    # bandwidth configurations ...
    monkeypatch.setattr(flydsl, "_mem", {})
    real_compile = flydsl._compile_now
    monkeypatch.setattr(flydsl, "_compile_now", lambda *a, **k: pytest.fail("compiled instead of using the cache"))
    spec = make_spec(T=8192, QH=8, KH=1, D=64, layout="xpacked_shuffled", tdt=F32, pos64=False)
    _, _, objs = rocm.build_code_table(rocm.kernel_config(spec), ARCHS)
    assert all(o.from_disk for o in objs)
    # ... and a decode call on a host without FlyDSL falls back to them (its latency candidates come first)
    monkeypatch.setattr(flydsl, "available", lambda: False)
    small = rocm.kernel_config(make_spec(T=3, QH=8, KH=1, D=64, layout="xpacked_shuffled", tdt=F32, pos64=False))
    _, _, objs2 = rocm.build_code_table(small, ARCHS)
    assert small.latency and [o.code for o in objs2] == [o.code for o in objs] and not objs2[0].config.latency
    # `compile` with both regimes (the default) adds the latency configurations: the decode call reads its own
    monkeypatch.setattr(flydsl, "available", lambda: True)
    monkeypatch.setattr(flydsl, "_compile_now", real_compile)
    aot.main(cli)
    err = capsys.readouterr().err
    assert "8 code objects (4 configurations x 2 archs)" in err, err
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setattr(flydsl, "available", lambda: False)
    _, _, objs3 = rocm.build_code_table(small, ARCHS)
    assert all(o.from_disk and o.config.latency for o in objs3)
    assert {o.code for o in objs3}.isdisjoint(o.code for o in objs)


LAUNCHER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "ffi", "gpu_launcher.cc")


@pytest.mark.skipif(not os.path.exists(LAUNCHER_SRC), reason="kernels/ffi/gpu_launcher.cc is not in this checkout")
def test_launcher_passes_the_parameter_block_as_the_hip_kernarg_buffer():
    with open(LAUNCHER_SRC) as f:
        src = f.read()
    execute = src[src.index("ffi::Error Execute("):]
    hip = execute[execute.index("if (d.hip)"):execute.index("} else {", execute.index("if (d.hip)"))]
    assert "hipModuleLaunchKernel" in hip
    assert "HIP_LAUNCH_PARAM_BUFFER_POINTER" in hip or "(void*)0x01" in hip or "(0x01)" in hip, hip


# ---- QK-RMSNorm and per-head fp8 scales -------------------------------------------------------
def norm_spec(q_norm=BF16, k_norm=BF16, eps=1e-6, heads=(False, False), **p) -> contract.OpSpec:
    """make_spec(**p) with norm weights of these dtypes (None: that norm off) and per-head scales."""
    spec = make_spec(**p)
    fp8 = spec.cache_dtype in contract.FP8_DTYPES
    return dataclasses.replace(spec, q_norm_dtype=None if q_norm is None else np.dtype(q_norm),
                               k_norm_dtype=None if k_norm is None else np.dtype(k_norm),
                               norm_eps=float(np.float32(eps)) if (q_norm or k_norm) else 0.0,
                               k_scale_heads=fp8 and heads[0], v_scale_heads=fp8 and heads[1])


# Qwen3-32B TP8 (8/1/128) and Qwen3-235B-A22B TP4 (16/1/128) in every layout, then the other options
NORM_MATRIX = [dict(layout=lay, QH=qh, KH=1, D=128, dt=BF16, tdt=tdt, prec=prec, cdt=cdt)
               for lay in contract.LAYOUTS for qh, tdt, prec, cdt in ((8, F32, "fp32", None), (16, BF16, "native", FN))]
NORM_MATRIX += [
    dict(q_norm=F32, k_norm=F32, layout="flash", QH=8, KH=1, D=128, dt=BF16),
    dict(k_norm=None, layout="xpacked", QH=8, KH=2, D=128, dt=BF16, cdt=FNUZ, heads=(True, True)),
    dict(q_norm=None, layout="xpacked_shuffled", QH=16, KH=2, D=128, dt=BF16, tdt=BF16, prec="native"),
    dict(q_norm=F16, k_norm=F32, layout="flash", QH=4, KH=2, D=64, dt=F16, tdt=F16, prec="native", cdt=FN,
         heads=(True, False)),
    dict(q_norm=F32, k_norm=F32, layout="flash", QH=4, KH=2, D=256, dt=F32, tdt=F32),
    dict(layout="xpacked", QH=8, KH=2, D=128, R=64, neox=False, dt=BF16, full=True),
    dict(layout="flash", QH=8, KH=1, D=256, dt=BF16, cdt=FN, heads=(True, True), prec="native"),
    dict(layout="flash", QH=8, KH=8, D=80, dt=BF16),                  # the row reloaded (5 lanes per head)
    dict(layout="flash", QH=8, KH=2, D=128, R=96, dt=BF16),           # reload + separate pass-through phase
    dict(layout="xpacked", QH=16, KH=2, D=256, R=64, dt=BF16),        # Qwen3-Next: partial rotary, 256
    dict(q_norm=None, k_norm=None, layout="xpacked", QH=8, KH=4, D=128, dt=BF16, cdt=FN, heads=(True, True)),
    dict(layout="flash", QH=8, KH=1, D=128, dt=BF16, layers=4, slot64=True),
]


def _nid(p):
    q = p.get("q_norm", BF16)
    k = p.get("k_norm", BF16)
    heads = p.get("heads", (False, False))
    rest = {k2: v for k2, v in p.items() if k2 not in ("q_norm", "k_norm", "heads")}
    return (f"q{q.name if q is not None else '-'}-k{k.name if k is not None else '-'}"
            f"{'-ks' if heads[0] else ''}{'-vs' if heads[1] else ''}-" +
            "-".join(f"{k2}{getattr(v, 'name', v)}" for k2, v in rest.items()))


@needs_flydsl
@pytest.mark.parametrize("p", NORM_MATRIX, ids=[_nid(p) for p in NORM_MATRIX])
def test_norm_variant_compiles_for_both_archs(p):
    """The norm and per-head scale variants: both archs, the 256-byte kernarg segment, no scratch,
    <= 64 VGPRs (the chosen occupancy candidate)."""
    spec = norm_spec(**p)
    cfg = rocm.kernel_config(spec)
    assert (cfg.q_norm >= 0, cfg.k_norm >= 0) == (spec.q_norm_dtype is not None, spec.k_norm_dtype is not None)
    assert (cfg.k_scale_heads, cfg.v_scale_heads) == (spec.k_scale_heads, spec.v_scale_heads)
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    for o in objs:
        # a row the butterfly does not fit (every lane reloads it) may need more registers: correct,
        # at lower occupancy (docs/rocm.md, "Occupancy")
        reload = K_NORM.norm_layout(o.config).plan is None if o.config.norm else False
        info = check_code_object(o.code, o.arch, o.config, symbol, max_vgprs=128 if reload else MAX_VGPRS)
        assert info["kernarg_size"] == 256
    assert len({o.config for o in objs}) == 1


NORM_ISA_CASES = [
    dict(layout="flash", QH=8, KH=1, D=128, dt=BF16),                                   # DPP 1, 2, 4
    dict(q_norm=F32, k_norm=F32, layout="xpacked", QH=4, KH=2, D=256, dt=F32, tdt=F32),  # + DPP 8, ds_swizzle
    dict(k_norm=None, layout="flash", QH=8, KH=2, D=128, R=64, neox=False, dt=BF16, cdt=FN, heads=(True, True)),
]


@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", NORM_ISA_CASES, ids=[_nid(p) for p in NORM_ISA_CASES])
def test_isa_norm_is_correctly_rounded_and_uses_cross_lane_ops(p, arch):
    """The norm's sqrt is the IEEE expansion (v_sqrt_f32 then the residual check and the zero/inf
    fix-up v_cmp_class_f32), never v_rsq_f32; 1/sqrt is the IEEE division (v_div_fixup_f32); the
    butterfly uses the DPP / ds_swizzle patterns of lane_xor; fp32 rotation keeps its separate
    roundings; no scratch; denormals kept."""
    spec = norm_spec(**p)
    cfg = rocm.kernel_config(spec)
    isa = flydsl.isa(cfg, arch)
    lines = [ln.strip() for ln in isa.splitlines()]
    ops = [ln.split(" ")[0] for ln in lines]
    assert not [o for o in ops if o.startswith(("v_rsq", "v_sqrt_f16", "v_log", "v_exp"))]
    sq = [i for i, o in enumerate(ops) if o.startswith("v_sqrt_f32")]
    assert sq, "no sqrt"
    for i in sq:
        window = ops[i:i + 40]
        assert any(o.startswith("v_cmp_class_f32") for o in window), "sqrt without the IEEE fix-up"
        assert sum(o.startswith("v_fma_f32") for o in window) >= 2, "sqrt without its residual check"
    assert sum(o.startswith("v_div_fixup_f32") for o in ops) >= len(sq)
    lanes = K_NORM.norm_layout(cfg).lanes
    pats = {1: "quad_perm:[1,0,3,2]", 2: "quad_perm:[2,3,0,1]", 4: " row_half_mirror ", 8: " row_mirror ",
            16: "swizzle(SWAP,16)"}
    for m, pat in pats.items():
        assert (m < lanes) == any(pat in ln for ln in lines), (m, pat, lanes)
    if spec.precision != "native":
        assert not fma_outside_division(isa), fma_outside_division(isa)[:8]
    assert "scratch_" not in isa
    assert_keeps_denormals(isa)


K_NORM = flydsl_kernel_module()


# ---- per-arch census ----------------------------------------------------------------------------
# Instructions in one arch's code of a configuration that the other arch's code of the same
# configuration lacks (mnemonics; the encoding suffixes _e32 / _e64 / _sdwa / _dpp dropped, as the
# register allocation picks them). The lane emulator runs the emitter, not the ISA, so what only
# one arch executes is checked here by review: a new one fails the test until it is added, with
# what it computes and what checks it.
ARCH_ONLY = {
    "gfx942": {
        "v_cvt_f16_f32": "f32 -> f16 (RNE, denormals kept) one value at a time; gfx950 packs two",
        "v_pack_b32_f16": "two f16 results into one word (gfx950: v_cvt_pk_f16_f32 does both)",
        "v_xor_b32": "tid ^ 32 of the ds_bpermute address (gfx950: folded into v_bitop3_b32)",
    },
    "gfx950": {
        "v_cvt_pk_f16_f32": "two f32 -> f16 (RNE) in one instruction: every f16 store and the per-token scale "
                            "path; checked on all 2**32 inputs on a ROCm host by tests/test_rocm_f16_conversion.py",
        "v_bitop3_b32": "((tid ^ 32) & 63) of the ds_bpermute address as one three-input bitwise op",
    },
}
_ENCODING = re.compile(r"_(?:e32|e64|sdwa|dpp)$")


def isa_mnemonics(isa: str) -> set[str]:
    """The instructions of an ISA listing (tab-indented lines that are not directives)."""
    out = set()
    for line in isa.splitlines():
        m = re.match(r"^\t([a-z][a-z0-9_]*)", line)
        if m and not line.startswith("\t."):
            out.add(_ENCODING.sub("", m.group(1)))
    return out


def census_configs() -> dict:
    """Configurations reaching every conversion and cross-lane path of both kernels, in both regimes."""
    from test_rocm_mla import DEEPSEEK_TP8, spec_of
    from mla_cases import MlaCase
    from jax_rope_cache.mla import rocm_kernel

    KM = rocm_kernel.kernel_module()
    bpermute = norm_spec(q_norm=None, k_norm=F32, QH=2, KH=2, D=256, dt=F32, tdt=F32, prec="native", T=8192)
    out = {
        "bf16 flash": rocm.kernel_config(make_spec(T=8192)),
        "f16 latency": rocm.kernel_config(make_spec(T=1, dt=F16)),
        "f16 native gptj fp8": rocm.kernel_config(make_spec(T=1, dt=F16, tdt=F16, cdt=FN, prec="native", neox=False,
                                                            layout="xpacked_shuffled", D=64)),
        "f32 fnuz": rocm.kernel_config(make_spec(T=8192, dt=F32, tdt=BF16, cdt=FNUZ, layout="xpacked", D=256)),
        "e5m2": rocm.kernel_config(make_spec(T=1, tdt=BF16, cdt=E5, prec="native", layout="hnd")),
        "fused fp8": rocm.kernel_config(make_spec(T=8192, cdt=FN, prec="native")),
        "norm ds_bpermute": K_NORM.make_config(**rocm.config_codes(contract.kernel_codes(bpermute), K_NORM), rot_cap=2),
        "per-token f16": rocm.kernel_config(dataclasses.replace(make_spec(T=1, dt=F16, cdt=FN, QH=8, KH=2),
                                                                token_scales=True)),
        "mla f16 fp8": rocm_kernel.kernel_config(spec_of(MlaCase(**DEEPSEEK_TP8, dtype=F16, cache_dtype=FNUZ,
                                                                 q_out_dtype=FN), 1), KM),
        "mla bf16 split": rocm_kernel.kernel_config(spec_of(MlaCase(**DEEPSEEK_TP8, layout="split", cache_dtype=FN),
                                                            8192), KM),
    }
    assert K_NORM.norm_layout(out["norm ds_bpermute"]).lanes == 64
    return out


@needs_flydsl
def test_isa_census_of_arch_specific_instructions():
    per_case, found = {}, {a: set() for a in ARCHS}
    for name, cfg in census_configs().items():
        ops = {a: isa_mnemonics(flydsl.isa(cfg, a)) for a in ARCHS}
        assert all("s_endpgm" in o for o in ops.values()), name
        for a, b in (ARCHS, ARCHS[::-1]):
            only = ops[a] - ops[b]
            found[a] |= only
            per_case[(name, a)] = sorted(only)
    detail = "; ".join(f"{n} {a}: {o}" for (n, a), o in per_case.items() if o)
    for a in ARCHS:
        assert found[a] == set(ARCH_ONLY[a]), (
            f"{a}-only instructions changed: new {sorted(found[a] - set(ARCH_ONLY[a]))}, gone "
            f"{sorted(set(ARCH_ONLY[a]) - found[a])} (per configuration: {detail}); review what a new one computes "
            "on that arch and record it in ARCH_ONLY")
    assert per_case[("f16 latency", "gfx950")] == ["v_cvt_pk_f16_f32"]
    assert per_case[("norm ds_bpermute", "gfx950")] == ["v_bitop3_b32"]


def test_isa_mnemonics_reads_instructions_not_directives():
    isa = "\t.amdgcn_target \"x\"\nk_0:\n\tv_xor_b32_e32 v1, 32, v0\n\tv_cvt_pk_f16_f32 v5, v2, v3\n\ts_endpgm\n"
    assert isa_mnemonics(isa) == {"v_xor_b32", "v_cvt_pk_f16_f32", "s_endpgm"}
