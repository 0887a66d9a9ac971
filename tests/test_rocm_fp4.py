"""NVFP4 and MXFP4 caches in the FlyDSL (AMD) kernel without an AMD GPU.

1. The lane emulator (tests/rocm_emulator.py) runs the kernel's program against the numpy reference,
   every result bit for bit (q_out, k_out, the uint8 caches, the E4M3 / E8M0 block-scale caches), on
   fresh random data with NaN / inf / zero rows, blocks whose scale rounds to 0, huge blocks, slots -1
   and out of range: flash, hnd, head_major, stacked layers, QK-norm, partial rotary (merged
   pass-through channels), R = 0, f32 / bf16 inputs (a block spread over 2 to 16 lanes: every
   occupancy candidate), both regimes; the NVFP4 global scales are run-time operands.
2. Routing: the formats are in backends/rocm.SUPPORTS; shapes whose lane chunks split a block unevenly
   and NVFP4 with use_rope / the temperature are refused with an error naming the shape.
3. With FlyDSL: a compile for gfx942 and gfx950 of each format.
The default tier runs a sample; JRC_TEST_TIER=full all of it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, flydsl_kernel_module, num_blocks, tier_sample
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import native, rocm
from test_rocm_families import BIG_T, Fam, family_call, spec_of

K = flydsl_kernel_module()
C = Case
F32 = "float32"


@dataclasses.dataclass(frozen=True)
class Fp4:
    fam: Fam
    fmt: str = "nvfp4"
    gk: float = 0.01   # NVFP4 global decode scales
    gv: float = 0.003

    @property
    def id(self) -> str:
        return f"{self.fmt}-{self.fam.id}" + (f"-g{self.gk}-{self.gv}" if self.fmt == "nvfp4" else "")


def fp4_call(fc: Fp4, seed: int):
    """family_call's call with uint8 caches of random bytes, random block-scale caches, special rows."""
    f = fc.fam
    c = f.case
    args, opts, inputs = family_call(f, seed)
    rng = np.random.default_rng(seed + 991)
    nb = num_blocks(c)
    lead = (f.layers,) if f.layers else ()
    shapes = contract.cache_shapes(c.layout, nb, c.BS, c.KH, c.D, contract.INT4, c.X)
    args[3:5] = [rng.integers(0, 256, lead + tuple(sh)).astype(np.uint8) for sh in shapes]
    sshape = lead + tuple(contract.block_scale_shape(c.layout, nb, c.BS, c.KH, c.D, fc.fmt))
    sdt = contract.BLOCK_SCALE_DTYPE[fc.fmt]
    for k in ("k_scale", "v_scale"):
        opts.pop(k, None)
    for k in ("k_scale_cache", "v_scale_cache"):
        opts[k] = rng.integers(0, 256, sshape).astype(np.uint8).view(sdt)
    if fc.fmt == "nvfp4":
        opts["k_scale"], opts["v_scale"] = np.float32(fc.gk), np.float32(fc.gv)
    # special values: NaN / inf in a k and a v row, an all-zero v row, a tiny block (its NVFP4 scale rounds
    # to 0, MXFP4's exponent clamps), a huge block (NVFP4's scale saturates at 448)
    q, k, v = (np.array(a) for a in args[:3])
    g = contract.BLOCK_GROUP[fc.fmt]
    T = c.T
    k[0, 0, 1], k[min(1, T - 1), -1, 3] = np.nan, np.inf
    v[0, 0, 2], v[min(2, T - 1), 0, :] = -np.inf, 0
    v[min(1, T - 1), -1, g:2 * g] = 1e-30
    v[min(3, T - 1), 0, :g] = 3e4
    v[min(4, T - 1), 0, g:2 * g] = -1e-41  # float32 subnormals
    # E2M1's ties (round half to even) and its saturation, exact after MXFP4's 2^-3 (amax 32)
    ties = np.array([4, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 7], np.float32) * 8
    v[min(5, T - 1), -1, :16] = ties
    k[min(5, T - 1), 0, :16] = ties  # (R = 0 calls store k as given)
    args[:3] = [q, k, v]
    if f.qkv or f.gate:
        raise AssertionError("fused rows are not sampled here")
    inputs = args[:3]
    return args, opts, inputs


def emulate(fc: Fp4, regime: str = "latency", seed: int = 11, cfg=None):
    args, opts, inputs = fp4_call(fc, seed)
    spec = spec_of(fc.fam, args, opts)
    assert spec.cache_format == fc.fmt
    if cfg is None:
        cfg = rocm.kernel_config(spec, K, num_tokens=None if regime == "latency" else BIG_T)
    assert cfg.block_fmt == (K.NVFP4 if fc.fmt == "nvfp4" else K.MXFP4) and cfg.cache_dt == K.INT4
    assert K.block_problem(cfg) is None, K.block_problem(cfg)
    operands = rocm_emulator.custom_call_operands(list(inputs) + args[3:], opts, layer=opts.get("layer", 0))
    operands += rocm_emulator.extra_operands(spec, opts)
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
        want = reference.rope_and_cache(*args, **opts)
    return cfg, got, want


def assert_all_equal(got, want):
    names = contract.RESULTS + contract.TOKEN_SCALE_RESULTS
    assert len(got) == len(want) == 6
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if g.dtype.itemsize == 1:  # bytes: the uint8 caches, E4M3 / E8M0 scales
            bad = np.flatnonzero(g.view(np.uint8) != w.view(np.uint8))
            assert bad.size == 0, (name, bad[:8], g.view(np.uint8).ravel()[bad[:8]], w.view(np.uint8).ravel()[bad[:8]])
        else:
            assert_bits_equal(g, w, name)


CASES = [
    # bf16: 8-channel chunks, a block over 2 (NVFP4) or 4 (MXFP4) lanes
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64))),
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64)), fmt="mxfp4"),
    Fp4(Fam(C(T=6, QH=4, KH=2, D=128, R=64, layout="hnd")), gk=0.5, gv=2.0),
    Fp4(Fam(C(T=6, QH=4, KH=2, D=128, R=64, layout="hnd")), fmt="mxfp4"),
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64, layout="head_major"), layers=2)),
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64, layout="head_major"), layers=2), fmt="mxfp4"),
    Fp4(Fam(C(T=5, QH=8, KH=2, D=128, precision="native"), norm="rms")),
    Fp4(Fam(C(T=5, QH=8, KH=2, D=128, is_neox=False), norm="gemma"), fmt="mxfp4"),
    # f32 inputs, R = 0, the tail, a stacked flash cache
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), nope=True, norm="weightless"), gk=1e-3, gv=7.0),
    Fp4(Fam(C(T=5, QH=4, KH=2, D=128, R=64, dtype=F32, table_dtype=F32), tail=True, layers=2), fmt="mxfp4"),
    Fp4(Fam(C(T=7, QH=4, KH=1, D=256, dtype=F32, table_dtype=F32, index_dtype="int64")), gk=3e-5, gv=40.0),
    Fp4(Fam(C(T=5, QH=4, KH=2, D=64), nope=True, switch=None), fmt="mxfp4"),
    # Llama-3.1-8B heads: the latency configuration splits the phases over grid.y
    Fp4(Fam(C(T=3, QH=32, KH=8, D=128))),
    Fp4(Fam(C(T=3, QH=32, KH=8, D=128, layout="hnd")), fmt="mxfp4"),
]


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", tier_sample(CASES, 3), ids=lambda fc: fc.id)
def test_emulated_fp4_cache_matches_reference(fc, regime):
    cfg, got, want = emulate(fc, regime)
    assert_all_equal(got, want)


def test_split_configuration_matches_reference():
    cfg, got, want = emulate(CASES[-1], "latency")
    assert cfg.split > 1
    assert_all_equal(got, want)


@pytest.mark.full
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", CASES, ids=lambda fc: fc.id)
def test_emulated_fp4_cache_matches_reference_full(fc, regime):
    test_emulated_fp4_cache_matches_reference(fc, regime)


@pytest.mark.parametrize("fc", [CASES[8], CASES[9], CASES[7]], ids=lambda fc: fc.id)
def test_every_occupancy_candidate_runs_bit_exact(fc):
    """The narrower configurations the lowering may build instead (f32 chunks of 2 channels: an MXFP4
    block over 16 lanes) keep the format and run bit-exact."""
    args, opts, _ = fp4_call(fc, 7)
    spec = spec_of(fc.fam, args, opts)
    widths = set()
    for regime in ("latency", "bandwidth"):
        cfg = rocm.kernel_config(spec, K, num_tokens=None if regime == "latency" else BIG_T)
        for cand, _ in rocm.occupancy_candidates(cfg, K):
            assert cand.block_fmt == cfg.block_fmt and K.block_problem(cand) is None
            widths.add((cand.w_rot, cand.w_pass, cand.w_v))
            _, got, want = emulate(fc, cfg=cand)
            assert_all_equal(got, want)
    assert len(widths) > 1


# ---- 2. routing ----------------------------------------------------------------------------------------
def test_supports_lists_the_block_formats():
    assert {"nvfp4_cache", "mxfp4_cache"} <= rocm.SUPPORTS


def test_block_format_off_keeps_the_configuration():
    """Without a block format the field is off: the key (and the code) of a configuration made before it."""
    args, opts, _ = family_call(Fam(C(T=5, QH=4, KH=2, D=64), int4=True), 3)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert cfg.block_fmt == 0 and K.block_problem(cfg) is None and K.num_operands(cfg) == 14
    assert cfg.key() == K.RocmKernelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}).key()


def test_nvfp4_global_scales_are_the_last_operands():
    fc = Fp4(Fam(C(T=5, QH=4, KH=2, D=64)))
    args, opts, _ = fp4_call(fc, 3)
    spec = spec_of(fc.fam, args, opts)
    cfg = rocm.kernel_config(spec, K)
    assert K.num_operands(cfg) == 16 and K.kernel_args(cfg) == 16 + 6 + 16
    names = rocm.launch_buffers(spec)["buffer_names"].split(",")
    assert names[14:16] == ["k_global_scale", "v_global_scale"] and len(names) == 16 + 6
    mx = Fp4(Fam(C(T=5, QH=4, KH=2, D=64)), fmt="mxfp4")
    args, opts, _ = fp4_call(mx, 3)
    assert K.num_operands(rocm.kernel_config(spec_of(mx.fam, args, opts), K)) == 14


@pytest.mark.parametrize("fc, text", [
    # NeoX with R = 16: the second rotation half starts at channel 8, inside a block of 16
    (Fp4(Fam(C(T=3, QH=2, KH=1, D=64, R=16))), "NVFP4 blocks of 16 channels"),
    # MXFP4 with R = 32: the halves start at 0 and 16, inside a block of 32
    (Fp4(Fam(C(T=3, QH=2, KH=1, D=64, R=32)), fmt="mxfp4"), "MXFP4 blocks of 32 channels"),
    # NVFP4's global scales with use_rope: more kernel arguments than the launcher takes
    (Fp4(Fam(C(T=3, QH=2, KH=1, D=64), switch=1)), "use_rope switch"),
], ids=lambda x: x if isinstance(x, str) else x.id)
def test_shapes_the_lanes_cannot_take_are_refused(fc, text):
    args, opts, _ = fp4_call(fc, 1)
    cfg = rocm.kernel_config(spec_of(fc.fam, args, opts), K)
    assert text in K.block_problem(cfg)
    with pytest.raises(native.KernelUnavailable, match="NVFP4|MXFP4") as e:
        rocm.refuse_token_scales(cfg, K)
    assert isinstance(e.value.__cause__, NotImplementedError) and text in str(e.value.__cause__)


def test_mxfp4_with_the_switch_runs():
    """MXFP4 has no global scales: use_rope and the temperature fit the launcher."""
    fc = Fp4(Fam(C(T=5, QH=4, KH=2, D=64), switch=0, temp=(2, 0.2)), fmt="mxfp4")
    cfg, got, want = emulate(fc)
    assert K.kernel_args(cfg) == 38
    assert_all_equal(got, want)


def test_nvfp4_traced_global_scales_change_the_results():
    """The global scales are read at run time: other values give other block scales (same program)."""
    base = Fp4(Fam(C(T=5, QH=4, KH=2, D=64)))
    other = dataclasses.replace(base, gk=0.25, gv=0.0625)
    cfg1, got1, want1 = emulate(base)
    cfg2, got2, want2 = emulate(other)
    assert cfg1 == cfg2
    assert_all_equal(got1, want1)
    assert_all_equal(got2, want2)
    assert not np.array_equal(got1[4].view(np.uint8), got2[4].view(np.uint8))


# ---- 3. FlyDSL: each format compiles for gfx942 and gfx950 ---------------------------------------------
from test_rocm_families import ARCHS, needs_flydsl  # noqa: E402

COMPILE_CASES = [
    Fp4(Fam(C(T=1, QH=32, KH=8, D=128))),                                        # Llama-3.1-8B NVFP4
    Fp4(Fam(C(T=1, QH=16, KH=8, D=128, layout="hnd"), norm="rms"), fmt="mxfp4"),  # Qwen3 MXFP4
]


@needs_flydsl
@pytest.mark.parametrize("fc", COMPILE_CASES, ids=lambda fc: fc.id)
def test_fp4_variant_compiles_for_both_archs(fc):
    from jax_rope_cache.compilers import amdgpu_elf

    args, opts, _ = fp4_call(fc, 1)
    spec = spec_of(fc.fam, args, opts)
    cfg = rocm.kernel_config(spec, K)
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS)
    for o in objs:
        info = amdgpu_elf.kernel_info(o.code)
        n = K.kernel_args(o.config)
        assert n == 2 * (14 + len(contract.extra_operands(spec))) + 6
        assert info["target"].endswith(o.arch) and info["name"] == symbol and info["kernarg_size"] == 8 * n
        assert info["private_segment_size"] == 0 and info["vgpr_spill_count"] == 0


@needs_flydsl
def test_export_rocm_nvfp4_with_traced_global_scales():
    """jax.export for rocm on this CPU: an NVFP4 call with traced global scales lowers to ONE launcher
    call with 16 operands (the global scales last), the kernel's 38-word argument block."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.backends import launcher
    from jax_rope_cache.compilers import amdgpu_elf
    from test_rocm_compile import custom_calls

    T, QH, KH, D, NB, BS = 4, 8, 2, 128, 16, 16
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes("flash", NB, BS, KH, D, contract.INT4)
    sc = contract.block_scale_shape("flash", NB, BS, KH, D, "nvfp4")
    e4 = contract.BLOCK_SCALE_DTYPE["nvfp4"]

    def step(q, k, v, kc, vc, slots, pos, cos, sin, ksc, vsc, gk, gv):
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, impl="kernel", k_scale_cache=ksc,
                                  v_scale_cache=vsc, k_scale=gk, v_scale=gv)

    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph")]
    exp = jax.export.export(jax.jit(step, donate_argnums=(3, 4, 9, 10)), platforms=["rocm"], disabled_checks=checks)(
        s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s(kc, jnp.uint8),
        s(vc, jnp.uint8), s((T,), jnp.int32), s((T,), jnp.int32), s((4096, D // 2), jnp.float32),
        s((4096, D // 2), jnp.float32), s(sc, e4), s(sc, e4), s((), jnp.float32), s((), jnp.float32))
    calls = [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]
    assert len(calls) == 1, calls
    names = calls[0][1]["buffer_names"].decode().split(",")
    assert names[14:16] == ["k_global_scale", "v_global_scale"] and len(names) == 22
    entries = launcher.unpack_code_table(calls[0][1]["code"])
    assert [(k, a) for k, a, _ in entries] == [(3, "gfx942"), (3, "gfx950")]
    for _, arch, code in entries:
        assert amdgpu_elf.kernel_info(code)["kernarg_size"] == 8 * 38


@pytest.mark.parametrize("mutation", ["nan_in_amax", "group", "no_butterfly"])
def test_mutated_block_rules_fail(monkeypatch, mutation):
    """The emulator comparison catches a wrong rule: NaN / inf counted in the amax, the wrong block
    size, a block's amax from one lane only."""
    if mutation == "nan_in_amax":
        def amax_bits(self, vals):
            amax = None
            for v in vals:
                a = self.band(self.bitcast(self.i32, v), self.i32c(0x7FFFFFFF))
                amax = a if amax is None else self.arith.maxui(amax, a)
            return amax
        monkeypatch.setattr(K._Emitter, "amax_bits", amax_bits)
    elif mutation == "group":
        monkeypatch.setattr(K, "BLOCK_GROUP", {K.NVFP4: 32, K.MXFP4: 16})
    else:
        monkeypatch.setattr(K, "block_plan", lambda off, w, lanes, group: 1)
    failed = 0
    for fc in (CASES[0], CASES[1]):
        _, got, want = emulate(fc)
        try:
            assert_all_equal(got, want)
        except AssertionError:
            failed += 1
    assert failed == 2
