"""The FlyDSL (AMD) kernel's model-family options without an AMD GPU.

NoPE calls (rotary_dim=0), the traced use_rope switch, rotary channels at the tail, the Gemma and
weightless QK-norms, the norm after the rotation, the attention temperature and the gated fused QKV
rows:
1. The lane emulator (tests/rocm_emulator.py) runs the kernel's program against the numpy
   reference, every result bit for bit, alone and combined with fp8 caches (static, per-head and
   per-token scales), the layouts, NeoX and GPT-J, partial rotary, stacked layers, both regimes;
   the emulator asserts every access is in range.
2. Routing: the options are in backends/rocm.SUPPORTS, configurations without them keep the fields'
   off values (their code is unchanged), shapes the kernel cannot take are refused.
3. With FlyDSL: a compile for gfx942 and gfx950 of each option.
The default tier runs a sample of the matrices; JRC_TEST_TIER=full all of them.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, flydsl_kernel_module, make_problem, num_blocks, tier_sample
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import native, rocm
from jax_rope_cache.compilers import flydsl

K = flydsl_kernel_module()
BIG_T = 100_000  # a token count of the bandwidth regime (the configuration only; the calls stay small)


@dataclasses.dataclass(frozen=True)
class Fam:
    case: Case
    nope: bool = False
    tail: bool = False
    switch: int | None = None   # use_rope's value (None: no switch)
    norm: str | None = None     # "rms", "gemma", "weightless" (None: no norm)
    qn: bool = True             # a q weight (rms / gemma)
    kn: bool = True
    after: bool = False         # norm_position="after"
    temp: tuple | None = None   # attn_temperature
    gate: bool = False          # fused QKV rows with the q gate
    qkv: bool = False           # fused QKV rows
    layers: int | None = None   # stacked caches
    token: bool = False         # per-token fp8 scales
    wdtype: str = "same"        # norm weight dtype: as q, or "float32"
    no_pos: bool = False        # NoPE without positions and tables
    int8: bool = False          # an int8 cache (per-token scales always)
    int4: bool = False          # an int4 (uint8) cache (per-token scales always)
    mrope: tuple | None = None  # mrope_section (positions [3, T])

    @property
    def id(self) -> str:
        c = self.case
        parts = [f"T{c.T}-h{c.QH}x{c.KH}-D{c.D}-R{c.R or c.D}-{c.layout}-{'neox' if c.is_neox else 'gptj'}-{c.table}-"
                 f"{c.dtype}-{c.table_dtype}-{c.cache_dtype or 'same'}-{c.precision}"]
        parts += [n for n, on in (("nope", self.nope), ("tail", self.tail), ("gate", self.gate), ("qkv", self.qkv),
                                  ("after", self.after), ("token", self.token), ("nopos", self.no_pos),
                                  ("int8", self.int8), ("int4", self.int4)) if on]
        if self.switch is not None:
            parts.append(f"use_rope{self.switch}")
        if self.norm:
            parts.append(f"{self.norm}{'q' if self.qn else ''}{'k' if self.kn else ''}-{self.wdtype}")
        if self.temp:
            parts.append(f"temp{self.temp[0]}")
        if self.layers:
            parts.append(f"L{self.layers}")
        if self.mrope:
            parts.append("mrope" + "-".join(map(str, self.mrope)))
        return "-".join(parts)


def family_call(fc: Fam, seed: int):
    """(reference args, options, the kernel's q / k / v operands) of a fresh random call."""
    c = fc.case
    args, opts = make_problem(c, seed)
    rng = np.random.default_rng(seed + 77)
    args = list(args)
    dt = np.dtype(args[0].dtype)
    if fc.nope:
        opts["rotary_dim"] = 0
        if fc.no_pos:
            args[6] = args[7] = args[8] = None
    if fc.tail:
        opts["rotary_position"] = "tail"
    if fc.mrope:  # three position streams, partly out of range, text tokens (equal streams) mixed in
        pos = np.stack([args[6], rng.integers(-3, c.max_pos + 5, c.T), rng.integers(0, c.max_pos, c.T)])
        pos[:, ::3] = pos[0, ::3]
        args[6] = pos.astype(args[6].dtype)
        opts["mrope_section"] = fc.mrope
    if fc.switch is not None:
        opts["use_rope"] = np.int32(fc.switch)
    if fc.norm:
        opts["norm_type"] = fc.norm
        opts["norm_eps"] = 1e-6
        if fc.norm != "weightless":
            wd = dt if fc.wdtype == "same" else np.dtype(np.float32)
            lo = -0.9 if fc.norm == "gemma" else 0.25  # Gemma's weights sit around 0
            for name, on in (("q_norm_weight", fc.qn), ("k_norm_weight", fc.kn)):
                if on:
                    opts[name] = rng.uniform(lo, 2.0, c.D).astype(np.float32).astype(wd)
        if fc.after:
            opts["norm_position"] = "after"
    if fc.temp:
        opts["attn_temperature"] = fc.temp
    if fc.int8:  # fresh int8 caches (every value in [-128, 127], -128 never written by the op)
        shapes = contract.cache_shapes(c.layout, num_blocks(c), c.BS, c.KH, c.D, np.dtype(np.int8), c.X)
        args[3:5] = [None if sh is None else rng.integers(-128, 128, sh).astype(np.int8) for sh in shapes]
    if fc.int4:  # fresh bytes (two nibbles each)
        shapes = contract.cache_shapes(c.layout, num_blocks(c), c.BS, c.KH, c.D, contract.INT4, c.X)
        args[3:5] = [None if sh is None else rng.integers(0, 256, sh).astype(np.uint8) for sh in shapes]
    if fc.layers:
        stacks = []
        for cache in args[3:5]:
            if cache is None:
                stacks.append(None)
                continue
            if cache.dtype in (np.int8, np.uint8):
                stacks.append(rng.integers(0, 256, (fc.layers,) + cache.shape).astype(np.uint8).view(cache.dtype))
                continue
            bits = rng.standard_normal((fc.layers,) + cache.shape).astype(np.float32)
            stacks.append(bits.astype(cache.dtype))
        args[3:5] = stacks
        opts["layer"] = np.int32(fc.layers - 1)
    if fc.token or fc.int8 or fc.int4:
        nb = num_blocks(c)
        shape = ((fc.layers,) if fc.layers else ()) + tuple(contract.scale_shape(c.layout, nb, c.BS, c.KH))
        for k in ("k_scale", "v_scale"):
            opts.pop(k, None)
        for k in ("k_scale_cache", "v_scale_cache"):
            opts[k] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    inputs = args[:3]
    if fc.qkv or fc.gate:
        q, k, v = args[:3]
        if fc.gate:  # q head h at row 2h, its gate (fresh values, never read) at 2h + 1
            gates = rng.standard_normal(q.shape).astype(np.float32).astype(dt)
            q = np.stack([q, gates], axis=2).reshape(c.T, 2 * c.QH, c.D)
        inputs = (np.concatenate([q, k, v], axis=1),) * 3
    return args, opts, inputs


def spec_of(fc: Fam, args, opts):
    spec = contract.check_op(*args, **opts)
    if fc.qkv or fc.gate:
        spec = dataclasses.replace(spec, qkv=True, q_gate=fc.gate)
    return spec


def emulate(fc: Fam, regime: str = "latency", seed: int = 7, cfg=None, layer=None):
    """(config, the kernel's results under the lane emulator, the reference's)."""
    args, opts, inputs = family_call(fc, seed)
    spec = spec_of(fc, args, opts)
    if cfg is None:
        cfg = rocm.kernel_config(spec, K, num_tokens=None if regime == "latency" else BIG_T)
    assert cfg.latency == (regime == "latency"), cfg
    assert K.family_problem(cfg) is None and K.token_scales_problem(cfg) is None
    layer = opts.get("layer", 0) if layer is None else layer
    operands = rocm_emulator.custom_call_operands(list(inputs) + args[3:], opts, layer=layer)
    operands += rocm_emulator.extra_operands(spec, opts)
    if layer is not None and fc.layers:
        opts = dict(opts, layer=np.int32(layer))
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
        want = reference.rope_and_cache(*args, **opts)
    return cfg, got, want


def assert_all_equal(got, want, what=""):
    names = contract.RESULTS + contract.TOKEN_SCALE_RESULTS
    assert len(got) == len(want)
    for name, g, w in zip(names, got, want):
        assert_bits_equal(g, w, f"{what}{name}")


C = Case  # shorthand
BF, F16, F32 = "bfloat16", "float16", "float32"

# Each option alone, then combined with the kernel's other axes.
CASES = [
    # NoPE: caches written, no rotation; with a norm, without positions / tables
    Fam(C(T=5, QH=4, KH=2, D=64), nope=True),
    Fam(C(T=6, QH=8, KH=1, D=128, layout="xpacked", cache_dtype="float8_e4m3fn"), nope=True, norm="rms"),
    Fam(C(T=4, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), nope=True, no_pos=True, norm="weightless"),
    Fam(C(T=5, QH=4, KH=4, D=64, layout="hnd", dtype=F16, table_dtype=F16), nope=True, norm="gemma", kn=False),
    Fam(C(T=5, QH=4, KH=2, D=80, dtype=F32, table_dtype=F32), nope=True, norm="rms"),  # 20 lanes: the row reloaded
    Fam(C(T=3, QH=2, KH=2, D=256, dtype=F32, table_dtype=F32), nope=True, norm="rms", kn=False),  # 64-lane butterfly
    # the temperature on NoPE calls (Llama 4), floor_scale 1 and 8
    Fam(C(T=7, QH=4, KH=1, D=128, max_pos=64), nope=True, temp=(8, 0.1)),
    Fam(C(T=6, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32, cache_dtype="float8_e4m3fnuz"), nope=True,
        temp=(1, 0.37), norm="weightless"),
    # the use_rope switch: on, off, off with the temperature (Llama 4's stacked layers)
    Fam(C(T=5, QH=4, KH=2, D=64), switch=1),
    Fam(C(T=5, QH=4, KH=2, D=64, is_neox=False), switch=0),
    Fam(C(T=6, QH=8, KH=2, D=128, R=64, cache_dtype="float8_e4m3fn", precision="native"), switch=0, temp=(4, 0.1)),
    Fam(C(T=6, QH=8, KH=2, D=128, R=64, cache_dtype="float8_e4m3fn", precision="native"), switch=5, temp=(4, 0.1)),
    # rotary channels at the tail (nope-first heads): NeoX / GPT-J, half / full tables, layouts
    Fam(C(T=5, QH=4, KH=2, D=128, R=64), tail=True),
    Fam(C(T=6, QH=4, KH=2, D=96, R=32, is_neox=False, table="full", layout="xpacked", dtype=F16,
          table_dtype=F16, precision="native"), tail=True),
    Fam(C(T=5, QH=8, KH=1, D=192, R=64, layout="xpacked_shuffled", cache_dtype="float8_e4m3fnuz"), tail=True),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64, dtype=F32, table_dtype=F32), tail=True, norm="rms"),
    Fam(C(T=4, QH=4, KH=2, D=64, R=16, is_neox=False, dtype=F32, table_dtype=F32, layout="hnd"), tail=True,
        norm="rms", kn=False),
    # QK-norm variants: Gemma (1 + w), weightless; q only / k only / both; float32 weights
    Fam(C(T=5, QH=8, KH=2, D=128, dtype=F32, table_dtype=F32), norm="gemma"),
    Fam(C(T=6, QH=8, KH=1, D=128), norm="gemma", wdtype="float32", kn=False),
    Fam(C(T=5, QH=4, KH=2, D=256, dtype=F32, table_dtype=F32, layout="xpacked_shuffled"), norm="weightless"),
    Fam(C(T=5, QH=4, KH=2, D=80, dtype=F32, table_dtype=F32, cache_dtype="float8_e4m3fn"), norm="gemma"),
    # the norm after the rotation (Llama 4's RoPE layers): rms / weightless, switch on and off
    Fam(C(T=5, QH=4, KH=2, D=128, dtype=F32, table_dtype=F32, is_neox=False), norm="weightless", after=True),
    Fam(C(T=6, QH=8, KH=1, D=128, is_neox=False, precision="native", cache_dtype="float8_e4m3fn"), norm="rms",
        after=True, qn=False),
    Fam(C(T=5, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), norm="weightless", after=True, switch=1, temp=(4, 0.1)),
    Fam(C(T=5, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), norm="weightless", after=True, switch=0, temp=(4, 0.1)),
    Fam(C(T=5, QH=4, KH=2, D=64, R=32, dtype=F32, table_dtype=F32), norm="gemma", after=True, kn=False),
    # gated fused QKV rows (Qwen3-Next): with the norm, partial rotary, fp8
    Fam(C(T=5, QH=4, KH=2, D=64), gate=True),
    Fam(C(T=6, QH=8, KH=2, D=128, R=64, cache_dtype="float8_e4m3fn"), gate=True, norm="gemma"),
    Fam(C(T=5, QH=4, KH=1, D=64, is_neox=False, layout="xpacked"), gate=True, nope=True),
    # per-token fp8 scales, stacked layers, layouts with the options
    Fam(C(T=5, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn"), token=True, norm="gemma"),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64, cache_dtype="float8_e4m3fn"), token=True, tail=True),
    Fam(C(T=5, QH=4, KH=2, D=64, cache_dtype="float8_e5m2"), token=True, switch=0, temp=(2, 0.2)),
    Fam(C(T=5, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn"), token=True, nope=True, temp=(4, 0.3)),
    Fam(C(T=6, QH=4, KH=2, D=64), layers=3, nope=True, norm="rms"),
    Fam(C(T=6, QH=4, KH=2, D=64, layout="xpacked"), layers=2, switch=0),
    Fam(C(T=5, QH=4, KH=2, D=64, R=32, layout="head_major"), tail=True, layers=2),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="kv_merged", cache_dtype="float8_e4m3fn"), nope=True, temp=(1, 0.1)),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="kv_merged"), qkv=True, norm="weightless"),
    # M-RoPE with the switch, the tail and the norm after
    Fam(C(T=6, QH=4, KH=2, D=128), mrope=(16, 24, 24), switch=0),
    Fam(C(T=6, QH=4, KH=2, D=128, dtype=F32, table_dtype=F32), mrope=(16, 24, 24), switch=1, norm="weightless",
        after=True),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64), mrope=(8, 12, 12), tail=True, norm="gemma"),
]

# int8 caches (per-token scales): every layout, NeoX / GPT-J, partial rotary, the norm, fused and rounded
# native arithmetic, f32 inputs, a narrow X, stacked layers, with the family options
INT8_CASES = [
    Fam(C(T=5, QH=4, KH=2, D=64), int8=True),
    Fam(C(T=6, QH=8, KH=1, D=128, layout="xpacked", precision="native"), int8=True, norm="rms"),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64, layout="xpacked_shuffled", is_neox=False, table="full", dtype=F16,
          table_dtype=F16, precision="native"), int8=True),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="hnd", dtype=F32, table_dtype=F32, index_dtype="int64"), int8=True),
    Fam(C(T=6, QH=4, KH=2, D=64, layout="head_major"), int8=True, layers=2),
    Fam(C(T=5, QH=8, KH=2, D=128, layout="kv_merged", precision="native"), int8=True, norm="gemma"),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="xpacked", X=4, is_neox=False), int8=True, layers=3),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64), int8=True, tail=True, norm="weightless", after=True),
    Fam(C(T=5, QH=4, KH=2, D=64), int8=True, switch=0, temp=(2, 0.2), gate=True),
    Fam(C(T=6, QH=4, KH=2, D=128, layout="xpacked"), int8=True, nope=True, norm="rms", layers=2),
    Fam(C(T=7, QH=4, KH=2, D=256, dtype=F32, table_dtype=F32), int8=True),
]


# int4 (uint8) caches: the int8 matrix's axes, x-packed with D/2 a multiple of 16 bytes
INT4_CASES = [
    Fam(C(T=5, QH=4, KH=2, D=64), int4=True),
    Fam(C(T=6, QH=8, KH=1, D=128, layout="xpacked", precision="native"), int4=True, norm="rms"),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64, layout="xpacked_shuffled", is_neox=False, table="full", dtype=F16,
          table_dtype=F16, precision="native"), int4=True),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="hnd", dtype=F32, table_dtype=F32, index_dtype="int64"), int4=True),
    Fam(C(T=6, QH=4, KH=2, D=64, layout="head_major"), int4=True, layers=2),
    Fam(C(T=5, QH=8, KH=2, D=128, layout="kv_merged", precision="native"), int4=True, norm="gemma"),
    Fam(C(T=5, QH=4, KH=2, D=64, layout="xpacked", X=4, is_neox=False), int4=True, layers=3),
    Fam(C(T=5, QH=4, KH=2, D=128, R=64), int4=True, tail=True, norm="weightless", after=True),
    Fam(C(T=5, QH=4, KH=2, D=64), int4=True, switch=0, temp=(2, 0.2), gate=True),
    Fam(C(T=6, QH=4, KH=2, D=128, layout="xpacked"), int4=True, nope=True, norm="rms", layers=2),
    Fam(C(T=7, QH=4, KH=2, D=256, dtype=F32, table_dtype=F32), int4=True),
    Fam(C(T=5, QH=4, KH=2, D=64, R=16, is_neox=False, dtype=F32, table_dtype=F32), int4=True, norm="rms"),
]


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", tier_sample(INT4_CASES, 3), ids=lambda fc: fc.id)
def test_emulated_int4_cache_matches_reference(fc, regime):
    cfg, got, want = emulate(fc, regime)
    assert cfg.cache_dt == K.INT4 and cfg.token_scales
    assert_all_equal(got, want)


@pytest.mark.full
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", INT4_CASES, ids=lambda fc: fc.id)
def test_emulated_int4_cache_matches_reference_full(fc, regime):
    test_emulated_int4_cache_matches_reference(fc, regime)


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", tier_sample(INT8_CASES, 3), ids=lambda fc: fc.id)
def test_emulated_int8_cache_matches_reference(fc, regime):
    cfg, got, want = emulate(fc, regime)
    assert cfg.cache_dt == K.INT8 and cfg.token_scales
    assert_all_equal(got, want)


@pytest.mark.full
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", INT8_CASES, ids=lambda fc: fc.id)
def test_emulated_int8_cache_matches_reference_full(fc, regime):
    test_emulated_int8_cache_matches_reference(fc, regime)


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", tier_sample(CASES, 3), ids=lambda fc: fc.id)
def test_emulated_kernel_matches_reference(fc, regime):
    cfg, got, want = emulate(fc, regime)
    assert_all_equal(got, want)


@pytest.mark.full
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", CASES, ids=lambda fc: fc.id)
def test_emulated_kernel_matches_reference_full(fc, regime):
    cfg, got, want = emulate(fc, regime)
    assert_all_equal(got, want)


# ---- 2. routing ----------------------------------------------------------------------------------------
FAMILY_FEATURES = ("nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after",
                   "temperature", "q_gate")


def test_supports_lists_the_family_options_and_the_low_bit_caches():
    assert set(FAMILY_FEATURES) <= rocm.SUPPORTS
    assert {"int8_cache", "int4_cache"} <= rocm.SUPPORTS


def test_int4_chunks_that_split_a_pair_are_refused():
    """An int4 lane stores whole bytes: a NeoX rotation of R = 2 (one pair per half, at channels 0 and 1)
    has chunks of one channel; refused (impl=None: the XLA path), never a half-written byte."""
    fc = Fam(C(T=3, QH=2, KH=1, D=64, R=2), int4=True)
    args, opts, _ = family_call(fc, 1)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert "int4" in K.token_scales_problem(cfg)
    with pytest.raises(native.KernelUnavailable, match="int4"):
        rocm.refuse_token_scales(cfg, K)


@pytest.mark.parametrize("fc", CASES[:: 5], ids=lambda fc: fc.id)
def test_options_off_keep_the_configuration_of_a_call_without_them(fc):
    """A call without the options gets the fields' off values: the key and the code of a configuration
    made before the options existed (tools/kernel_digest.py checks the bytes)."""
    args, opts, _ = family_call(dataclasses.replace(fc, nope=False, tail=False, switch=None, norm=None, after=False,
                                                    temp=None, gate=False), 7)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert all(getattr(cfg, f) == v for f, v in rocm.FAMILY_DEFAULTS.items())
    assert K.num_operands(cfg) == 14 and K.kernel_args(cfg) in (32, 34) and K.launch_args(cfg) == K.NUM_ARGS
    assert not any(f in cfg.key() for f in ("tail", "rope_switch", "q_gate"))


def test_extra_operands_widen_the_argument_list():
    fc = Fam(C(T=5, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn"), token=True, switch=0, temp=(2, 0.2))
    args, opts, _ = family_call(fc, 3)
    spec = spec_of(fc, args, opts)
    cfg = rocm.kernel_config(spec, K)
    assert K.num_operands(cfg) == 16 and K.kernel_args(cfg) == 16 + 6 + 16
    buffers = rocm.launch_buffers(spec)
    names = buffers["buffer_names"].split(",")
    assert names[14:16] == ["use_rope", "temperature_factors"] and len(names) == 16 + 6
    assert 14 in buffers["fenced"] and 15 not in buffers["fenced"]


def test_norm_after_on_a_row_the_butterfly_does_not_fit_is_refused():
    """D = 80 (5 lanes per row): the norm after the rotation has no rotated row sum; refused (impl=None
    then runs the XLA path), not computed from the unrotated row."""
    fc = Fam(C(T=5, QH=4, KH=2, D=80, dtype=F32, table_dtype=F32), norm="weightless", after=True)
    args, opts, _ = family_call(fc, 3)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert "norm_position='after'" in K.family_problem(cfg)
    with pytest.raises(native.KernelUnavailable, match="model-family"):
        rocm.refuse_families(cfg, K)
    ok = rocm.kernel_config(contract.check_op(*family_call(CASES[19], 3)[:2][0], **family_call(CASES[19], 3)[1]), K)
    rocm.refuse_families(ok, K)  # D = 128: taken


def test_nope_temperature_reads_only_inside_the_factor_table():
    """Positions far outside the tables (and negative): the factor index is clamped like the rows; the
    emulator asserts every access is in range and the result matches."""
    fc = Fam(C(T=9, QH=4, KH=2, D=64, max_pos=40), nope=True, temp=(3, 0.5))
    args, opts, inputs = family_call(fc, 11)
    args[6] = np.array([0, 39, 40, -5, 2**31 - 1, -(2**31), 7, 38, 1], np.int32)
    spec = spec_of(fc, args, opts)
    cfg = rocm.kernel_config(spec, K)
    operands = (rocm_emulator.custom_call_operands(list(inputs) + args[3:], opts)
                + rocm_emulator.extra_operands(spec, opts))
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
        want = reference.rope_and_cache(*args, **opts)
    assert_all_equal(got, want)
    factors = reference.temperature_rows(args[6], spec)
    assert len(np.unique(factors)) >= 3  # the positions pick different factors


def _plant(x, rng):
    """NaN with payloads, +-inf, subnormals and +-0 at random places of x."""
    x = x.copy()
    u = x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
    bits = x.dtype.itemsize * 8
    specials = ([0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x8000] if bits == 16 and x.dtype == ml_dtypes.bfloat16
                else [0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x0001, 0x8000] if bits == 16
                else [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0x00000001, 0x80000000])
    flat = u.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 6 * 8), replace=False)
    for i, j in enumerate(idx):
        flat[j] = specials[i % len(specials)]
    return x


@pytest.mark.parametrize("fc", [
    Fam(C(T=6, QH=4, KH=2, D=64), nope=True, temp=(2, 0.3)),
    Fam(C(T=6, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32, cache_dtype="float8_e4m3fn"), switch=0, temp=(2, 0.3)),
    Fam(C(T=6, QH=4, KH=2, D=64, R=32, dtype=F16, table_dtype=F16), tail=True, switch=0),
    Fam(C(T=6, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), norm="gemma"),
    Fam(C(T=6, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32), int8=True),  # NaN stores 0, inf saturates
    Fam(C(T=6, QH=4, KH=2, D=64), int8=True, nope=True, temp=(2, 0.3)),
    Fam(C(T=6, QH=4, KH=2, D=64, dtype=F32, table_dtype=F32, layout="xpacked"), int4=True),
], ids=lambda fc: fc.id)
def test_special_values_bit_for_bit(fc):
    """NaN payloads are copied where the op copies (NoPE k, a call that does not rotate) and canonical
    where it computes (the temperature product, the norm); inf saturates fp8."""
    args, opts, inputs = family_call(fc, 5)
    rng = np.random.default_rng(5)
    args[0], args[1], args[2] = (_plant(a, rng) for a in args[:3])
    spec = spec_of(fc, args, opts)
    cfg = rocm.kernel_config(spec, K)
    operands = (rocm_emulator.custom_call_operands(list(args[:3]) + args[3:], opts)
                + rocm_emulator.extra_operands(spec, opts))
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
        want = reference.rope_and_cache(*args, **opts)
    assert_all_equal(got, want)
    assert any(np.isnan(np.asarray(w, np.float32)).any() for w in want[:2])


# ---- 3. FlyDSL: each option compiles for gfx942 and gfx950 ---------------------------------------------
needs_flydsl = pytest.mark.skipif(not flydsl.available(),
                                  reason=f"FlyDSL cannot compile here ({flydsl.unavailable_reason()})")
ARCHS = ("gfx942", "gfx950")
COMPILE_CASES = [
    Fam(C(T=1, QH=32, KH=8, D=128), nope=True, temp=(8192, 0.1), norm="weightless"),       # Llama 4 NoPE layer
    Fam(C(T=1, QH=32, KH=8, D=128, is_neox=False), switch=1, temp=(8192, 0.1), norm="weightless", after=True),
    Fam(C(T=1, QH=16, KH=2, D=256, R=64, table_dtype=BF), norm="gemma", gate=True),         # Qwen3-Next
    Fam(C(T=1, QH=16, KH=8, D=256, cache_dtype="float8_e4m3fn"), norm="gemma"),             # Gemma 3
    Fam(C(T=1, QH=8, KH=1, D=192, R=64, layout="xpacked", cache_dtype="float8_e4m3fnuz"), tail=True),
    Fam(C(T=1, QH=8, KH=2, D=128, layout="hnd", cache_dtype="float8_e4m3fn"), token=True, switch=0, temp=(4, 0.1)),
    Fam(C(T=1, QH=32, KH=8, D=128), int8=True),                                              # Llama-3.1-8B int8
    Fam(C(T=1, QH=32, KH=8, D=128, layout="xpacked"), int4=True, norm="rms"),
]


@needs_flydsl
@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("fc", tier_sample(COMPILE_CASES, 2), ids=lambda fc: fc.id)
def test_family_variant_compiles_for_both_archs(fc, regime):
    from jax_rope_cache.backends import launcher
    from jax_rope_cache.compilers import amdgpu_elf

    args, opts, _ = family_call(fc, 1)
    spec = spec_of(fc, args, opts)
    cfg = rocm.kernel_config(spec, num_tokens=None if regime == "latency" else BIG_T)
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS) and len({o.config for o in objs}) == 1
    for o in objs:
        info = amdgpu_elf.kernel_info(o.code)
        n = K.kernel_args(o.config)
        assert n == 2 * (14 + len(contract.extra_operands(spec))) + len(contract.results(spec))
        assert info["target"].endswith(o.arch) and info["name"] == symbol
        assert info["args"] == [dict(offset=8 * i, size=8, kind="by_value") for i in range(n)]
        assert info["kernarg_size"] == 8 * n
        assert info["private_segment_size"] == 0 and info["vgpr_spill_count"] == 0 and info["sgpr_spill_count"] == 0
        assert list(info["reqd_workgroup_size"]) == [o.config.nt, 1, 1]
    assert launcher.unpack_code_table(table) == [(3, a, o.code) for a, o in zip(ARCHS, objs)]


@needs_flydsl
@pytest.mark.full
@pytest.mark.parametrize("fc", COMPILE_CASES, ids=lambda fc: fc.id)
def test_family_variant_compiles_full(fc):
    test_family_variant_compiles_for_both_archs(fc, "latency")
    test_family_variant_compiles_for_both_archs(fc, "bandwidth")


@needs_flydsl
def test_export_rocm_with_a_traced_switch_and_the_temperature():
    """jax.export for rocm on this CPU: a Llama 4 layer step with a traced use_rope, the temperature and
    the weightless norm after the rotation lowers to ONE launcher call with 16 operands (use_rope,
    then the factor table), the kernel's 38-word argument block and named buffers."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.backends import launcher
    from test_rocm_compile import custom_calls

    T, QH, KH, D, NB, BS = 4, 8, 2, 128, 16, 16
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes("flash", NB, BS, KH, D, np.dtype(jnp.bfloat16))

    def step(q, k, v, kc, vc, slots, pos, cos, sin, use_rope):
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, impl="kernel", is_neox=False,
                                  use_rope=use_rope, norm_type="weightless", norm_position="after",
                                  attn_temperature=(8192, 0.1))

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph")]
    exp = jax.export.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["rocm"], disabled_checks=checks)(
        s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s(kc, jnp.bfloat16),
        s(vc, jnp.bfloat16), s((T,), jnp.int32), s((T,), jnp.int32), s((4096, D // 2), jnp.float32),
        s((4096, D // 2), jnp.float32), s((), jnp.int32))
    calls = [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]
    assert len(calls) == 1, calls
    attrs = calls[0][1]
    names = attrs["buffer_names"].decode().split(",")
    assert names[14:16] == ["use_rope", "temperature_factors"] and len(names) == 20
    entries = launcher.unpack_code_table(attrs["code"])
    assert [(k, a) for k, a, _ in entries] == [(3, "gfx942"), (3, "gfx950")]
    from jax_rope_cache.compilers import amdgpu_elf

    for _, arch, code in entries:
        assert amdgpu_elf.kernel_info(code)["kernarg_size"] == 8 * (16 + 4 + 16)


@pytest.mark.parametrize("fc", [CASES[1], CASES[13], CASES[21], CASES[25], INT8_CASES[1]], ids=lambda fc: fc.id)
def test_every_occupancy_candidate_keeps_the_options(fc):
    """The narrower configurations the lowering may build instead (backends/rocm.occupancy_candidates)
    keep every option and run bit-exact."""
    args, opts, _ = family_call(fc, 7)
    spec = spec_of(fc, args, opts)
    for regime in ("latency", "bandwidth"):
        cfg = rocm.kernel_config(spec, K, num_tokens=None if regime == "latency" else BIG_T)
        cands = rocm.occupancy_candidates(cfg, K)
        for cand, _ in cands:
            assert all(getattr(cand, f) == getattr(cfg, f) for f in rocm.FAMILY_DEFAULTS)
            _, got, want = emulate(fc, "latency" if cand.latency else "bandwidth", cfg=cand)
            assert_all_equal(got, want, f"{cand.key()}: ")


@needs_flydsl
def test_isa_arch_specific_instructions_are_the_reviewed_ones():
    """The emulator runs the emitter, not the ISA: the family options, int8 and int4 (f16 inputs too)
    must use no instruction on one arch that the other lacks beyond the reviewed list
    (test_rocm_compile.ARCH_ONLY)."""
    from test_rocm_compile import ARCH_ONLY, isa_mnemonics

    cases = COMPILE_CASES + [Fam(C(T=1, QH=8, KH=2, D=128, dtype=F16, table_dtype=F16, precision="native"),
                                 int4=True, switch=0, temp=(4, 0.1), norm="gemma")]
    for fc in cases:
        args, opts, _ = family_call(fc, 1)
        cfg = rocm.kernel_config(spec_of(fc, args, opts))
        ops = {a: isa_mnemonics(flydsl.isa(cfg, a)) for a in ARCHS}
        for a, b in (ARCHS, ARCHS[::-1]):
            assert ops[a] - ops[b] <= set(ARCH_ONLY[a]), (fc.id, a, sorted(ops[a] - ops[b]))


# ---- mutations: a kernel computing another rule must fail the comparison -------------------------------
def _mismatch(fc, cfg=None, regime="latency"):
    """True when the kernel's results (with `cfg`, a mutated configuration) differ from the reference."""
    try:
        _, got, want = emulate(fc, regime, cfg=cfg)
        assert_all_equal(got, want)
    except AssertionError:
        return True
    return False


def _first(**want):
    return next(fc for fc in CASES if all(getattr(fc, k) == v for k, v in want.items()))


MUTATIONS = [  # (case, field of the lowering's configuration set to another value)
    (_first(nope=True, temp=(8, 0.1)), "temp_floor", 4),        # floor_scale 8 read as 4
    (_first(norm="gemma", after=False, gate=False), "norm_type", 0),  # Gemma's (1 + w) as the RMS weight
    (_first(norm="weightless", after=True), "norm_after", False),  # the norm before the rotation
    (_first(tail=True), "tail", False),                           # tail rotary at the head
    (_first(gate=True), "q_gate", False),                         # gated rows read as plain fused rows
]


@pytest.mark.parametrize("fc,field,value", MUTATIONS, ids=lambda v: getattr(v, "id", str(v)))
def test_mutated_option_fails(fc, field, value):
    args, opts, _ = family_call(fc, 7)
    cfg = rocm.kernel_config(spec_of(fc, args, opts), K)
    assert not _mismatch(fc, cfg)
    bad = dataclasses.replace(cfg, **{field: value})
    assert _mismatch(fc, bad), (field, value)


def test_mutated_low_bit_rules_fail(monkeypatch):
    """Nibbles swapped, 127 / 7 replaced by 126 / 8 in the rounding's saturation: the int8 / int4 cases fail."""
    int8, int4 = INT8_CASES[0], dataclasses.replace(INT4_CASES[0], case=dataclasses.replace(INT4_CASES[0].case))
    assert not _mismatch(int8) and not _mismatch(int4)
    with monkeypatch.context() as m:
        m.setattr(K._Emitter, "int4_bytes", lambda self, n: [self.bor(n[j + 1], self.shl(n[j], self.i32c(4)))
                                                             for j in range(0, len(n), 2)])
        assert _mismatch(int4)
    with monkeypatch.context() as m:
        m.setattr(K, "QUANT_MAX", {**K.QUANT_MAX, K.INT8: 126.0, K.INT4: 8.0})
        assert _mismatch(int8) and _mismatch(int4)
