"""The FlyDSL (AMD) kernel's per-token fp8 scales (k_scale_cache / v_scale_cache) without an AMD GPU.

1. The lane emulator (tests/rocm_emulator.py) runs the kernel's program against the numpy
   reference, every result bit for bit (q_out, k_out, both caches, both scale caches): rows of very
   different magnitudes, an all-zero row, rows with inf and NaN, slot -1 and other invalid slots,
   stacked layers (in and out of range), the QK-norm on and off, every layout and fp8 format, NeoX
   and GPT-J, partial rotary, the fused QKV input, M-RoPE, both regimes and the decode split.
2. Mutations of the kernel (a wrong FP8_MAX, a butterfly missing its last step, no floor) fail.
3. Routing: which shapes the kernel takes and which it refuses (a row that is no power-of-two lane
   group), the launcher's aliases for the two extra results.
4. With FlyDSL: the compile matrix for gfx942 and gfx950 (34 kernel arguments, 272-byte kernarg
   segment, no scratch, no spills, <= 64 VGPRs), the ISA's arithmetic, and `jax.export` for rocm.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, flydsl_kernel_module, make_spec
from test_fp8_per_token import MATRIX, SPECIAL_TOKENS, TokenCase, _token_call
from test_rocm_compile import ARCHS, assert_keeps_denormals, custom_calls, fma_outside_division, needs_flydsl
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import launcher, native, rocm
from jax_rope_cache.compilers import amdgpu_elf, flydsl

K = flydsl_kernel_module()
F32 = np.float32
RESULTS = contract.RESULTS + contract.TOKEN_SCALE_RESULTS

# The other implementations' matrix (tests/test_fp8_per_token.py), then shapes that reach the rest of
# the kernel's paths: the butterfly at 32 and 64 lanes (ds_swizzle, ds_bpermute), GPT-J with partial
# rotary and the norm (pass-through channels merged into the rotation lanes), f32 inputs, a narrow X,
# int64 indices, many heads (the decode split), tokens per workgroup with a tail.
CASES = MATRIX + [
    TokenCase(Case(T=5, QH=4, KH=2, D=128, R=64, layout="xpacked", is_neox=False, table="full",
                   cache_dtype="float8_e4m3fnuz", index_dtype="int64"), norm=True),
    TokenCase(Case(T=6, QH=2, KH=1, D=256, dtype="float32", table_dtype="float32", cache_dtype="float8_e4m3fn")),
    TokenCase(Case(T=5, QH=4, KH=2, D=64, R=16, layout="flash", dtype="float32", table_dtype="bfloat16",
                   cache_dtype="float8_e5m2"), layers=2),
    TokenCase(Case(T=5, QH=4, KH=2, D=64, layout="xpacked", X=4, cache_dtype="float8_e4m3fn", precision="native",
                   table_dtype="bfloat16")),
    TokenCase(Case(T=5, QH=32, KH=8, D=128, layout="xpacked_shuffled", cache_dtype="float8_e4m3fnuz"), norm=True),
    TokenCase(Case(T=6, QH=8, KH=4, D=128, R=32, layout="hnd", dtype="float16", table_dtype="float16",
                   cache_dtype="float8_e5m2", precision="native")),
    # head_major's scale caches [L, KH, NB, BS]; kv_merged's V rows in the one array
    TokenCase(Case(T=6, QH=4, KH=2, D=64, layout="head_major", cache_dtype="float8_e4m3fnuz"), layers=3, norm=True),
    TokenCase(Case(T=5, QH=8, KH=2, D=128, layout="kv_merged", cache_dtype="float8_e4m3fn", precision="native"),
              layers=2),
]


def emulate(tc: TokenCase, regime: str, seed: int = 17, layer=None, cfg=None):
    """(config, the kernel's 6 results under the lane emulator, the reference's). `layer`: the value
    of the layer operand the kernel reads (default: the call's); `cfg`: a configuration to run
    instead of the lowering's."""
    args, opts = _token_call(tc, seed)
    spec = contract.check_op(*args, **opts)
    inputs = args[:3]
    if tc.qkv:  # q, k and v each the fused [T, QH + 2 KH, D] tensor
        spec = dataclasses.replace(spec, qkv=True)
        inputs = (np.concatenate(args[:3], axis=1),) * 3
    cfg = cfg or rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.token_scales and cfg.latency == (regime == "latency"), cfg
    layer = opts.get("layer", 0) if layer is None else layer
    operands = rocm_emulator.custom_call_operands(inputs + args[3:], opts, layer=layer)
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
        want = reference.rope_and_cache(*args, **opts)
    assert len(got) == len(want) == 6
    return cfg, got, want


def assert_all_bits_equal(got, want, what=""):
    for name, g, w in zip(RESULTS, got, want):
        assert_bits_equal(g, w, f"{what}{name}")


# ---- 1. the lane emulator against the reference ----------------------------------------------------
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("tc", CASES, ids=lambda tc: tc.id + f"-T{tc.case.T}-h{tc.case.QH}x{tc.case.KH}")
def test_emulated_kernel_matches_reference(tc, regime):
    cfg, got, want = emulate(tc, regime)
    assert "pass" not in K.phases(cfg)  # the rotation lanes hold whole K rows
    assert_all_bits_equal(got, want)


def test_cases_reach_every_butterfly_step_and_the_split():
    """The matrix is not vacuous: K and V rows over 1..64 lanes, the decode split, tokens per workgroup."""
    k_lanes, v_lanes, split, tpb = set(), set(), False, False
    for tc in CASES:
        for regime in ("latency", "bandwidth"):
            args, opts = _token_call(tc, 17)
            spec = contract.check_op(*args, **opts)
            cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
            k_lanes.add(K.norm_layout(cfg).lanes)
            v_lanes.add(cfg.d // cfg.w_v)
            split |= cfg.split > 1
            tpb |= cfg.tpb > 1 and tc.case.T % cfg.tpb != 0
    assert {4, 8, 16, 32} <= k_lanes and 64 in v_lanes, (k_lanes, v_lanes)
    assert split and tpb


def test_special_rows_get_finite_scales():
    """Straight from the kernel's results: the all-zero row stores the floor's scale and zeros, rows
    with inf or NaN still get a finite positive scale, invalid slots write no scale."""
    tc = TokenCase(Case(T=9, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn"))
    args, opts = _token_call(tc, 17)
    _, got, _ = emulate(tc, "latency")
    slots, bs = np.asarray(args[5]).astype(np.int64), tc.case.BS
    nslots = args[3].shape[0] * bs
    floor = F32(F32(contract.TOKEN_AMAX_FLOOR) / F32(448.0))
    z = SPECIAL_TOKENS[0]
    assert 0 <= slots[z] < nslots
    vs = got[5][slots[z] // bs, 0, slots[z] % bs]
    assert vs == floor and vs > 0
    for t in SPECIAL_TOKENS:
        s = got[4][slots[t] // bs, :, slots[t] % bs], got[5][slots[t] // bs, :, slots[t] % bs]
        assert all(np.isfinite(x).all() and (x > 0).all() for x in s)
    valid = (slots >= 0) & (slots < nslots)
    assert (~valid).any()
    touched = np.zeros(got[4].shape, bool)
    touched[slots[valid] // bs, :, slots[valid] % bs] = True
    for res, before in ((got[4], opts["k_scale_cache"]), (got[5], opts["v_scale_cache"])):
        assert_bits_equal(res[~touched], before[~touched], "untouched scales")
        assert (res[touched] != before[touched]).mean() > 0.9  # fresh scales, not the prefilled values


@pytest.mark.parametrize("layer", [-1, 3, 2 ** 31 - 1])
def test_stacked_layer_out_of_range_writes_nothing(layer):
    tc = TokenCase(Case(T=7, QH=4, KH=2, D=64, layout="xpacked", cache_dtype="float8_e4m3fnuz"), layers=3)
    args, opts = _token_call(tc, 5)
    _, got, want = emulate(tc, "latency", seed=5, layer=layer)
    assert_all_bits_equal(got[:2], want[:2])
    for g, before in zip(got[2:], (args[3], args[4], opts["k_scale_cache"], opts["v_scale_cache"])):
        assert_bits_equal(g, before, "an out-of-range layer writes nothing")


# ---- 2. mutations ------------------------------------------------------------------------------
def _mutant_fails(tc, regime="latency"):
    _, got, want = emulate(tc, regime)
    with pytest.raises(AssertionError):
        assert_all_bits_equal(got, want)


MUTANT_CASE = TokenCase(Case(T=9, QH=4, KH=2, D=128, R=64, layout="xpacked", cache_dtype="float8_e4m3fnuz"), norm=True)


def test_mutation_wrong_fp8_max_fails(monkeypatch):
    monkeypatch.setattr(K, "FP8_MAX", {**K.FP8_MAX, K.FP8_FNUZ: 448.0})  # e4m3fn's max for an e4m3fnuz cache
    _mutant_fails(MUTANT_CASE)


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
def test_mutation_butterfly_missing_a_lane_fails(monkeypatch, regime):
    original = K._Emitter.token_scale_row
    monkeypatch.setattr(K._Emitter, "token_scale_row",
                        lambda self, vals, lanes, tid: original(self, vals, lanes // 2, tid))
    _mutant_fails(MUTANT_CASE, regime)


def test_mutation_no_floor_fails(monkeypatch):
    monkeypatch.setattr(K, "TOKEN_AMAX_FLOOR_BITS", 0)  # the all-zero row's scale becomes 0
    _mutant_fails(MUTANT_CASE)


def test_kernel_constants_are_the_contract():
    for dt, m in contract.FP8_MAX.items():
        assert K.FP8_MAX[contract.DTYPE_CODES[np.dtype(dt)]] == m
    assert np.array(K.TOKEN_AMAX_FLOOR_BITS, np.uint32).view(F32) == F32(contract.TOKEN_AMAX_FLOOR)


# ---- 3. routing ------------------------------------------------------------------------------------
def token_spec(T=64, **kw):
    """make_spec's call with per-token scales (static scales dropped): for configs and compiles."""
    return dataclasses.replace(make_spec(T=T, **kw), token_scales=True, k_scale_heads=False, v_scale_heads=False)


FN, FNUZ, E5 = (np.dtype(d) for d in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2))


def test_rocm_supports_token_scales_and_routes_them():
    assert "token_scales" in rocm.SUPPORTS
    spec = token_spec(QH=8, KH=2, D=128, R=64, cdt=FN)
    cfg = rocm.kernel_config(spec, K)
    assert cfg.token_scales and K.kernel_args(cfg) == 34 and K.num_results(cfg) == 6
    assert K.phases(cfg) == ["rot", "v"]
    rocm.refuse_token_scales(cfg, K)  # fits: no error
    buf = rocm.launch_buffers(spec)
    assert buf["aliases"] == contract.cache_aliases(spec) == {3: 2, 4: 3, 9: 4, 10: 5}
    fenced = {contract.OPERANDS[i] for i in buf["fenced"]}
    assert fenced == set(contract.FENCED_OPERANDS) - {"k_scale", "v_scale"}  # donated caches, not fenced
    assert buf["buffer_names"].split(",")[-2:] == ["k_scale_cache result", "v_scale_cache result"]
    assert buf["buffer_names"].split(",")[9:11] == ["k_scale_cache", "v_scale_cache"]  # the operand slots
    assert rocm.launch_buffers(make_spec(cdt=FN)) == {}  # static scales: the launcher's defaults
    # a key of its own; without the option the key is that of a configuration without it
    plain = rocm.kernel_config(make_spec(QH=8, KH=2, D=128, R=64, cdt=FN), K)
    assert "token_scales" not in plain.key() and plain.key() != dataclasses.replace(plain, token_scales=True).key()


@pytest.mark.parametrize("D,R", [(80, None), (96, None), (128, 96)], ids=["D80", "D96-phi3", "D128-R96"])
def test_shapes_whose_rows_are_no_lane_group_are_refused(D, R):
    cfg = rocm.kernel_config(token_spec(QH=4, KH=2, D=D, R=R, cdt=FN), K)
    problem = K.token_scales_problem(cfg)
    assert problem and "lanes" in problem
    with pytest.raises(native.KernelUnavailable, match="per-token fp8 scales") as e:
        rocm.refuse_token_scales(cfg, K)
    assert isinstance(e.value.__cause__, NotImplementedError) and "impl=None" in str(e.value.__cause__)


def test_occupancy_candidates_keep_rows_within_a_wave():
    """f32 D = 256: half-width rotation chunks would spread a K row over 128 lanes; that candidate
    is dropped, the others kept."""
    spec = token_spec(T=8192, QH=2, KH=1, D=256, dt=np.dtype(np.float32), tdt=np.dtype(np.float32), cdt=FN)
    cfg = rocm.kernel_config(spec, K)
    cands = rocm.occupancy_candidates(cfg, K)
    assert cands[0] == (cfg, None)
    assert all(K.token_scales_problem(c) is None for c, _ in cands)
    assert K.token_scales_problem(K.make_config(**rocm.config_codes(cfg, K), rot_cap=1))  # 128 lanes


def test_k_row_of_64_lanes_matches_reference():
    """The occupancy candidate with half-width rotation chunks of f32 D = 256: a K row over a whole
    wave (the butterfly's ds_bpermute step)."""
    tc = TokenCase(Case(T=6, QH=2, KH=1, D=256, dtype="float32", table_dtype="float32", cache_dtype="float8_e4m3fn"))
    args, opts = _token_call(tc, 17)
    codes = rocm.config_codes(contract.kernel_codes(contract.check_op(*args, **opts)), K)
    cfg = K.make_config(**codes, rot_cap=2)
    assert K.norm_layout(cfg).lanes == 64 and K.token_scales_problem(cfg) is None
    _, got, want = emulate(tc, "bandwidth", cfg=cfg)
    assert_all_bits_equal(got, want)


def test_make_config_refuses_token_scales_without_fp8():
    codes = rocm.config_codes(contract.kernel_codes(make_spec()), K)
    with pytest.raises(ValueError, match="token_scales: expected an fp8 cache"):
        K.make_config(**{**codes, "token_scales": True})


def _export(impl, D=64, cdt=jnp.float8_e4m3fn, layout="flash"):
    import jax_rope_cache as jrc

    T, QH, KH, NB, BS = 8, 8, 2, 32, 16
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, NB, BS, KH, D, np.dtype(cdt))
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s(kc, cdt),
            s(vc, cdt), s((T,), jnp.int32), s((T,), jnp.int32), s((4096, D // 2), jnp.float32),
            s((4096, D // 2), jnp.float32), s((NB, KH, BS), jnp.float32), s((NB, KH, BS), jnp.float32))

    def step(q, k, v, kc, vc, slots, pos, cos, sin, ksc, vsc):
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layout=layout, impl=impl,
                                  k_scale_cache=ksc, v_scale_cache=vsc)

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph")]
    return jax.export.export(jax.jit(step, donate_argnums=(3, 4, 9, 10)), platforms=["rocm"],
                             disabled_checks=checks)(*args)


def _no_kernel_call(exp) -> bool:
    return not [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]


def test_refused_shape_raises_with_kernel_and_falls_back_by_default(monkeypatch):
    """D=80 has no per-token-scale kernel. The refusal comes before any compile, so it needs no
    FlyDSL; but a process that can build no ROCm kernel at all (no FlyDSL, no precompiled code
    objects) says that first, for every shape."""
    problem = rocm.missing()
    if problem is not None:
        with pytest.raises(RuntimeError, match=re.escape(f"impl='kernel' on ROCm needs {problem}")):
            _export("kernel", D=80)
        with pytest.warns(RuntimeWarning, match=re.escape(f"falling back to the XLA implementation on ROCm: it "
                                                          f"needs {problem}")):
            assert _no_kernel_call(_export(None, D=80))
        # the shape's refusal as a process with precompiled code objects meets it (a refusal that let
        # the shape through would reach the compiler and fail with FlyDSL's absence instead)
        monkeypatch.setattr(rocm, "missing", lambda: None)
    with pytest.raises(NotImplementedError, match="per-token fp8 scales.*D=80"):
        _export("kernel", D=80)
    with pytest.warns(RuntimeWarning, match="falling back to the XLA implementation.*per-token fp8 scales"):
        assert _no_kernel_call(_export(None, D=80))


# ---- 4. with FlyDSL: compile matrix, ISA, export -------------------------------------------------
# (layout, dtype, table dtype, cache dtype, precision, D, R, neox, QH, KH, norm, layers, X)
BF16, F16, F32D = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
COMPILE = [
    ("flash", BF16, F32D, FN, "fp32", 128, None, True, 8, 1, False, None, None),
    ("xpacked", BF16, BF16, FNUZ, "native", 128, None, True, 32, 8, False, None, None),
    ("xpacked_shuffled", F16, F16, E5, "native", 64, None, False, 16, 4, False, 4, None),
    ("hnd", BF16, F32D, FN, "native", 128, 64, True, 8, 2, False, None, None),
    ("flash", BF16, F32D, FNUZ, "fp32", 128, None, True, 16, 2, True, 4, None),  # Qwen3-32B TP4, stacked
    ("xpacked", BF16, F32D, FN, "fp32", 128, 64, False, 16, 4, True, None, 4),
    ("flash", F32D, F32D, E5, "fp32", 256, None, True, 4, 2, False, None, None),
    ("xpacked_shuffled", BF16, F32D, FN, "fp32", 64, None, True, 64, 8, False, None, None),
]


def compile_spec(p, T):
    layout, dt, tdt, cdt, prec, D, R, neox, QH, KH, norm, layers, X = p
    spec = token_spec(T=T, layout=layout, dt=dt, tdt=tdt, cdt=cdt, prec=prec, D=D, R=R, neox=neox, QH=QH, KH=KH,
                      layers=layers, X=X)
    if norm:
        spec = dataclasses.replace(spec, q_norm_dtype=dt, k_norm_dtype=dt, norm_eps=1e-6)
    return spec


def check_token_code_object(code, arch, cfg, symbol):
    info = amdgpu_elf.kernel_info(code)
    n = K.kernel_args(cfg)
    assert n == 34
    assert info["target"].endswith(arch)
    # the launcher's block: 14 operand addresses, 6 result addresses (the scale caches last), 14 dim0
    assert info["args"] == [dict(offset=8 * i, size=8, kind="by_value") for i in range(n)]
    assert info["kernarg_size"] == 8 * n == 272
    assert info["private_segment_size"] == 0 and info["group_segment_size"] == 0
    assert info["vgpr_spill_count"] == 0 and info["sgpr_spill_count"] == 0
    assert info["vgpr_count"] <= rocm.MAX_VGPRS, info["vgpr_count"]
    assert list(info["reqd_workgroup_size"]) == [cfg.nt, 1, 1] and info["wavefront_size"] == 64
    assert info["name"] == symbol


@needs_flydsl
@pytest.mark.parametrize("T", [64, 8192], ids=["latency", "bandwidth"])
@pytest.mark.parametrize("p", COMPILE, ids=lambda p: f"{p[0]}-{p[1].name}-{p[3].name}-{p[4]}-D{p[5]}-R{p[6] or p[5]}"
                         f"-{'neox' if p[7] else 'gptj'}-h{p[8]}x{p[9]}{'-norm' if p[10] else ''}"
                         f"{'-L' if p[11] else ''}{'-X' + str(p[12]) if p[12] else ''}")
def test_token_scale_variant_compiles_for_both_archs(p, T):
    cfg = rocm.kernel_config(compile_spec(p, T))
    assert cfg.token_scales and cfg.latency == (T <= K.LATENCY_TOKENS)
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS) and len({o.config for o in objs}) == 1
    for o in objs:
        assert o.config.token_scales and K.token_scales_problem(o.config) is None
        check_token_code_object(o.code, o.arch, o.config, symbol)
    assert launcher.unpack_code_table(table) == [(3, a, o.code) for a, o in zip(ARCHS, objs)]


@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
def test_isa_rounds_every_operation_and_converts_in_integers(arch):
    """fp32 precision with per-token scales: no FMA outside the correctly rounded divisions (the
    scale and 1/scale), no fp8 conversion instruction, denormals kept, the butterfly's DPP moves."""
    cfg = rocm.kernel_config(compile_spec(COMPILE[0], 64))
    isa = flydsl.isa(cfg, arch)
    assert "s_endpgm" in isa
    assert not fma_outside_division(isa)
    assert not re.findall(r"^\s*v_cvt\w*_(?:bf8|fp8)\w*", isa, re.M)
    assert re.search(r"\b(?:row_half_mirror|row_mirror|quad_perm)", isa)
    assert isa.count("v_div_fixup_f32") >= 2  # scale = amax / FP8_MAX and 1 / scale, each correctly rounded
    assert_keeps_denormals(isa)


@needs_flydsl
def test_export_rocm_carries_the_scale_caches():
    exp = jax.export.deserialize(_export("kernel", layout="xpacked").serialize())
    calls = [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]
    assert len(calls) == 1, calls
    _, attrs = calls[0]
    assert attrs["buffer_names"].decode().split(",")[-2:] == ["k_scale_cache result", "v_scale_cache result"]
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", exp.mlir_module())
    assert sorted((int(operand), int(result)) for result, operand in aliases) == [(3, 2), (4, 3), (9, 4), (10, 5)]
    entries = launcher.unpack_code_table(attrs["code"])
    assert [(k, a) for k, a, _ in entries] == [(3, "gfx942"), (3, "gfx950")]
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
    cfg = rocm.kernel_config(contract.check_op(*avals[:9], layout="xpacked", k_scale_cache=avals[9],
                                               v_scale_cache=avals[10]))
    built = rocm.build_code_table(cfg, ARCHS)[2][0].config
    assert attrs["block"] == built.nt and attrs["grid_div"] == built.tpb
    for _, arch, code in entries:
        check_token_code_object(code, arch, built, attrs["kernel"].decode())
