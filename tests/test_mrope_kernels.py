"""Multimodal RoPE in the GPU kernels without a GPU (CPU-only CI).

CUDA: the kernel built for the host (kernels/cuda/host_emulation.h, tests/test_cuda_compile.py's
run_emulation: guard bytes around every output, checked untouched) bit for bit against the numpy
reference on positions [3, T] with out-of-range streams, both assignment rules, the QK-norm, both
styles, every layout, fp8 caches; NVRTC compiles Qwen3-VL variants for sm_90 without spills.
FlyDSL (AMD): the lane emulator (tests/rocm_emulator.py) runs the kernel's M-RoPE variants bit for
bit against the reference in both regimes (a kernel with the height and width streams swapped must
fail); FlyDSL compiles them for gfx942 / gfx950 within the register budget, and lowering for "rocm"
emits the launcher's custom call, where FlyDSL is installed.

The default tier runs a handful of cases; the rest carry the `full` marker (JRC_TEST_TIER=full).
"""

from __future__ import annotations

import dataclasses
import os
import re

import ml_dtypes
import numpy as np
import pytest

from jax_rope_cache import contract, reference
from conftest import Case
from test_mrope import FULL, QWEN25_VL, QWEN3_VL, make_mrope_problem

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


def _cuda():
    """test_cuda_compile's emulation helpers (skips, as that module does, without NVRTC)."""
    import test_cuda_compile

    return test_cuda_compile


# (case, section, interleaved, norm); the first CUDA_DEFAULT run in the default tier
KERNEL_CASES = [
    (Case(T=37, QH=8, KH=2, D=128, table_dtype="float32"), QWEN3_VL, True, "qk"),
    (Case(T=5, QH=4, KH=2, D=128, layout="xpacked", precision="native", dtype="bfloat16", table_dtype="bfloat16",
          table="full"), QWEN25_VL, False, "qk"),
    (Case(T=130, QH=4, KH=1, D=64, R=48, layout="xpacked_shuffled", is_neox=False, dtype="float16",
          cache_dtype="float8_e4m3fn", precision="native", index_dtype="int64"), (8, 8, 8), False, ""),
    (Case(T=9, QH=2, KH=2, D=80, R=64, is_neox=False, table="full", dtype="float32", table_dtype="bfloat16"),
     (12, 10, 10), True, "k"),
    (Case(T=21, QH=4, KH=2, D=128, layout="xpacked", dtype="bfloat16", cache_dtype="float8_e4m3fnuz",
          precision="native"), QWEN3_VL, True, "q"),
    (Case(T=1, QH=16, KH=1, D=128, precision="native", dtype="bfloat16", table_dtype="bfloat16"), QWEN3_VL, True,
     "qk"),
    (Case(T=64, QH=8, KH=1, D=256, R=128, layout="xpacked", is_neox=True, table="full"), (16, 24, 24), False, "qk"),
    (Case(T=37, QH=8, KH=2, D=128, layout="head_major", cache_dtype="float8_e4m3fn"), QWEN3_VL, True, "qk"),
    (Case(T=130, QH=4, KH=2, D=64, layout="kv_merged", dtype="float16", table_dtype="float16", precision="native"),
     (8, 12, 12), False, "k"),
]
CUDA_DEFAULT = 3
IDS = [f"{c.id}-{'il' if il else 'sec'}-norm{n or 'none'}" for c, _, il, n in KERNEL_CASES]


def _cases(default: int):
    return [pytest.param(*c, id=i, marks=() if n < default else FULL) for n, (c, i) in
            enumerate(zip(KERNEL_CASES, IDS))]


def _problem(case, section, interleaved, norm, seed=0):
    args, opts = make_mrope_problem(case, section, interleaved, seed=seed, norm=norm)
    return args, opts, reference.rope_and_cache(*args, **opts)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu_mrope"))


@pytest.mark.parametrize("case,section,interleaved,norm", _cases(CUDA_DEFAULT))
def test_cuda_host_emulation_bitwise(case, section, interleaved, norm, emu_dir):
    tcc = _cuda()
    args, opts, want = _problem(case, section, interleaved, norm, seed=case.T)
    got = tcc._emulate(args, opts, emu_dir)
    tcc._assert_bitwise(got, want)


def test_cuda_host_emulation_would_catch_a_wrong_assignment(emu_dir):
    """The kernel with the interleaved rule's height and width slots swapped fails the comparison."""
    tcc = _cuda()
    args, opts, want = _problem(*KERNEL_CASES[0], seed=1)
    hdr = open(os.path.join(tcc._kernel_dir(), "common", "rope_cache_math.h")).read()
    old = "((i % 3 == 1 && i < 3 * h) ? 1 : ((i % 3 == 2 && i < 3 * w) ? 2 : 0))"
    assert old in hdr
    src = open(os.path.join(tcc._kernel_dir(), "cuda", "rope_cache.cu")).read()
    mutant = src.replace('#include "rope_cache_math.h"', hdr.replace(old, "((i % 3 == 2 && i < 3 * w) ? 1 : "
                                                                     "((i % 3 == 1 && i < 3 * h) ? 2 : 0))"))
    assert mutant != src
    got = tcc._emulate(args, opts, emu_dir, source=mutant)
    assert not np.array_equal(got[0].view(np.uint8), np.asarray(want[0]).view(np.uint8))


def _spec(T, QH, KH, D, layout, section, interleaved, norm=True, dt=BF16, tdt=F32, prec="fp32"):
    import jax

    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, 64, 16, KH, D, dt)
    w = None if not norm else s((D,), dt)
    return contract.check_op(s((T, QH, D), dt), s((T, KH, D), dt), s((T, KH, D), dt), s(kc, dt), s(vc, dt),
                             s((T,), np.int32), s((3, T) if section else (T,), np.int32), s((4096, D // 2), tdt),
                             s((4096, D // 2), tdt),
                             layout=layout, precision=prec, q_norm_weight=w, k_norm_weight=w,
                             mrope_section=section, mrope_interleaved=interleaved)


# Qwen3-VL-8B TP1 (32/8/128) and Qwen3-VL-235B-A22B TP8 (8/1/128) at T = 1 and 8192
COMPILE_CASES = [dict(T=1, QH=32, KH=8, D=128, layout="flash"), dict(T=8192, QH=8, KH=1, D=128, layout="flash"),
                 dict(T=8192, QH=32, KH=8, D=128, layout="xpacked"), dict(T=1, QH=8, KH=1, D=128, layout="xpacked_shuffled",
                                                                           dt=BF16, tdt=BF16, prec="native"),
                 dict(T=128, QH=28, KH=4, D=128, layout="flash", norm=False, section=QWEN25_VL, interleaved=False)]


@pytest.mark.parametrize("kw", [pytest.param(kw, id=f"{kw['T']}-{kw['QH']}x{kw['KH']}-{kw['layout']}",
                                             marks=() if i < 2 else FULL) for i, kw in enumerate(COMPILE_CASES)])
def test_nvrtc_compiles_qwen3_vl_without_spills(kw):
    tcc = _cuda()
    kw = dict(kw)
    spec = _spec(section=kw.pop("section", QWEN3_VL), interleaved=kw.pop("interleaved", True), **kw)
    failures = tcc.spill_failures([spec], ["mrope"], "sm_90")
    assert not failures, failures[0]
    from jax_rope_cache.backends import cuda

    defines = dict(cuda.kernel_config(spec).defines)
    assert defines["RC_MROPE"] == (1 if spec.mrope_section == QWEN25_VL else 2)
    assert (defines["RC_MROPE_T"], defines["RC_MROPE_H"], defines["RC_MROPE_W"]) == spec.mrope_section
    from conftest import make_spec

    # without M-RoPE the variant (and its cache key) has no M-RoPE define: the kernel's defaults
    assert not any(k.startswith("RC_MROPE") for k, _ in cuda.kernel_config(make_spec(T=kw["T"])).defines)


    assert "RC_MROW" not in dict(cuda.kernel_config(make_spec(T=kw["T"])).defines)


# ---- CUDA merged rows (RC_MROW): a block of several tokens builds each token's cos/sin row once ---
def _mrow(cfg) -> int:
    return dict(cfg.defines).get("RC_MROW", 0)


def _without_mrow(cfg):
    return dataclasses.replace(cfg, defines=tuple(d for d in cfg.defines if d[0] != "RC_MROW"))


@pytest.mark.parametrize("case,section,interleaved,norm", _cases(CUDA_DEFAULT))
def test_cuda_host_emulation_merged_rows_bitwise(case, section, interleaved, norm, emu_dir):
    """On one SM the blocks hold several tokens (the last one often partly past T), so the kernel merges
    the rows in shared memory (RC_MROW; forced where the rows exceed the configuration's cap): the
    same bits as the reference. Also RC_MROW at one token per block (and RC_SPLIT parts, where the
    configuration splits)."""
    from jax_rope_cache.backends import cuda

    tcc = _cuda()
    args, opts, want = _problem(case, section, interleaved, norm, seed=case.T + 1)
    spec = contract.check_op(*args, **opts)
    cfg = cuda.kernel_config(spec, num_sms=1)
    tpb = cfg.tokens_per_block
    assert tpb >= 2 and _mrow(cfg) == (cuda.mrow_bytes(spec, tpb) <= cuda.MROW_MAX_BYTES), cfg
    tcc._assert_bitwise(tcc._emulate(args, opts, emu_dir, num_sms=1, defines={"RC_MROW": 1}), want)
    tcc._assert_bitwise(tcc._emulate(args, opts, emu_dir, defines={"RC_MROW": 1}), want)


def test_cuda_host_emulation_merged_rows_would_catch_a_wrong_stream(emu_dir):
    """A kernel whose merged rows take the temporal and width streams the wrong way round fails with
    RC_MROW and passes without it (the one-token blocks' load_tab3 never reads the merged rows)."""
    tcc = _cuda()
    args, opts, want = _problem(*KERNEL_CASES[0], seed=2)
    src = open(os.path.join(tcc._kernel_dir(), "cuda", "rope_cache.cu")).read()
    old = "load_index(p.pos, col_stream(c) * T + t,"
    assert src.count(old) == 1
    mutant = src.replace(old, "load_index(p.pos, (2 - col_stream(c)) * T + t,")
    got = tcc._emulate(args, opts, emu_dir, num_sms=1, source=mutant)
    assert not np.array_equal(got[0].view(np.uint8), np.asarray(want[0]).view(np.uint8))
    tcc._assert_bitwise(tcc._emulate(args, opts, emu_dir, source=mutant), want)


@pytest.mark.parametrize("layout", ["flash", "xpacked"])
@pytest.mark.parametrize("QH,KH", [(32, 8), (16, 1)])
def test_kernel_config_merges_rows_in_multi_token_blocks(QH, KH, layout):
    """Qwen3-VL-8B TP1 and 235B TP4 at T = 8192 (the benchmark's shapes): merged rows, within the
    shared-memory cap; decode (one token per block) and the 1-D op: no RC_MROW define."""
    from conftest import make_spec
    from jax_rope_cache.backends import cuda

    spec = _spec(8192, QH, KH, 128, layout, QWEN3_VL, True)
    cfg = cuda.kernel_config(spec)
    assert _mrow(cfg) == 1 and cfg.tokens_per_block >= cuda.MROW_MIN_TPB, cfg
    assert cuda.mrow_bytes(spec, cfg.tokens_per_block) == 2 * cfg.tokens_per_block * 64 * 4 <= cuda.MROW_MAX_BYTES
    if layout == "xpacked":  # one kv head: blocks of 256 threads (MROW_XP_BLOCK), else 512
        assert cfg.threads == (cuda.MROW_XP_BLOCK[0] if KH == 1 else cuda.MAX_THREADS), cfg
    one = cuda.kernel_config(_spec(1, QH, KH, 128, layout, QWEN3_VL, True))
    assert one.tokens_per_block == 1 and "RC_MROW" not in dict(one.defines)
    assert "RC_MROW" not in dict(cuda.kernel_config(make_spec(T=8192, QH=QH, KH=KH, layout=layout)).defines)


def _ptx_count(cfg, what: str) -> int:
    from jax_rope_cache.backends import cuda

    ptx = cuda.compile_variant(cfg, "compute_90").code.decode(errors="replace")
    return len(re.findall(r"^\s*(@%p\d+\s+)?" + re.escape(what), ptx, re.M))


def test_nvrtc_merged_rows_read_the_table_from_shared_memory():
    """PTX of Qwen3-VL-8B TP1 at T = 8192 (flash, f32 tables, fp32): the merged-row kernel reads
    the table values from shared memory after one barrier, and has as many global loads as the 1-D
    kernel plus one (the rows' build loads a position and a cos and a sin value; a rotation unit loads
    no position and no table value); the kernel without merged rows has ten more (load_tab3)."""
    from jax_rope_cache.backends import cuda

    cfg = cuda.kernel_config(_spec(8192, 32, 8, 128, "flash", QWEN3_VL, True))
    plain = cuda.kernel_config(_spec(8192, 32, 8, 128, "flash", None, False))  # the same op, positions [T]
    assert _mrow(cfg) == 1
    assert _ptx_count(cfg, "barrier.sync 0") >= 1 and _ptx_count(cfg, "ld.shared.v4.f32") == 4
    assert _ptx_count(cfg, "ld.global") == _ptx_count(plain, "ld.global") + 1
    assert _ptx_count(_without_mrow(cfg), "ld.global") == _ptx_count(cfg, "ld.global") + 9
    assert _ptx_count(_without_mrow(cfg), "ld.shared") == 0


@pytest.mark.parametrize("layout", ["flash", "xpacked"])
def test_nvrtc_merged_rows_take_the_packed_native_path(layout):
    """"native" precision with bf16 tables (Qwen2.5-VL sections, no norm): with merged rows the
    rotation multiplies in packed bf16 (mul.rn.bf16x2, the 1-D op's sm_90 path; the merged row holds
    the table's bytes, so the exhaustive check of that path covers it), reading shared memory; without
    them, the scalar path. Both build for sm_90 without spills."""
    from jax_rope_cache.backends import cuda

    spec = _spec(8192, 28, 4, 128, layout, QWEN25_VL, False, norm=False, tdt=BF16, prec="native")
    cfg = cuda.kernel_config(spec)
    assert _mrow(cfg) == 1
    assert _ptx_count(cfg, "mul.rn.bf16x2") > 0 and _ptx_count(cfg, "ld.shared") > 0
    assert _ptx_count(_without_mrow(cfg), "mul.rn.bf16x2") == 0
    tcc = _cuda()
    for name, c in (("mrow", cfg), ("no-mrow", _without_mrow(cfg))):
        assert not tcc.spill_failures([spec], [name], "sm_90", cfgs=[c])


# ---- FlyDSL (AMD): the lane emulator, the compile matrix, the lowering --------------------------
def _rocm():
    """(the lane emulator, the FlyDSL kernel module: installed, else the repository's)."""
    import rocm_emulator
    from conftest import flydsl_kernel_module

    return rocm_emulator, flydsl_kernel_module()


def _rocm_config(spec, regime, K):
    """The kernel configuration of an M-RoPE `spec` in the "latency" regime (these small calls) or the
    "bandwidth" one (what the same shapes get at a large T)."""
    from jax_rope_cache.backends import rocm

    cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.latency == (regime == "latency"), cfg
    assert (cfg.mrope, cfg.mrope_t, cfg.mrope_h, cfg.mrope_w) == (
        2 if spec.mrope_interleaved else 1,) + spec.mrope_section, cfg
    return cfg


def _emulate_rocm(cfg, args, opts, K, emu, layer=0):
    """The kernel's outputs under the lane emulator and the reference's (stacked caches: `layer`)."""
    ref_opts = dict(opts, layer=np.array(layer, np.int32)) if cfg.layer_blocks else opts
    with np.errstate(all="ignore"):
        got = emu.run(K, cfg, emu.custom_call_operands(args, opts, layer))
        want = reference.rope_and_cache(*args, **ref_opts)
    return got, want


def _assert_same_bits(got, want, what=""):
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if g is None or w is None:  # kv_merged: no value cache
            assert g is None and w is None, name
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (
            f"{name}{what}: {int((g.view(np.uint8) != w.view(np.uint8)).sum())} bytes differ")


# ROCm-only cases besides KERNEL_CASES: (case, section, interleaved, norm, per-head scales, layers)
ROCM_CASES = [
    # Qwen3-VL-8B TP1 decode: the latency configuration splits the token over 2 workgroups (phases)
    (Case(T=2, QH=32, KH=8, D=128, dtype="bfloat16", table_dtype="float32"), QWEN3_VL, True, "qk", False, 0),
    # fp8 cache with per-head k/v scales, the norm, x-packed
    (Case(T=6, QH=8, KH=2, D=128, layout="xpacked", dtype="bfloat16", cache_dtype="float8_e4m3fn",
          precision="native"), QWEN3_VL, True, "qk", True, 0),
    # partial rotary, "full" NeoX table, the norm's pass-through channels merged into the rotation lanes
    (Case(T=7, QH=4, KH=2, D=128, R=64, table="full", dtype="float32", table_dtype="float32"), (8, 12, 12), False,
     "qk", False, 0),
    # sections without temporal frequencies; interleaved without width ones (a stream never loaded)
    (Case(T=9, QH=4, KH=2, D=64, is_neox=False, dtype="float16", table_dtype="float16", precision="native"),
     (0, 24, 8), False, "", False, 0),
    (Case(T=5, QH=2, KH=1, D=64, layout="xpacked_shuffled", table="full", dtype="bfloat16", index_dtype="int64"),
     (22, 10, 0), True, "k", False, 0),
    # stacked per-layer caches (the layer read on the device), fp8 e4m3fnuz with scalar scales
    (Case(T=9, QH=4, KH=2, D=64, layout="xpacked", dtype="bfloat16", cache_dtype="float8_e4m3fnuz"), (12, 10, 10),
     True, "q", False, 3),
    # several tokens per workgroup (bandwidth) with a partial last one: tiny heads
    (Case(T=10, QH=1, KH=1, D=16, dtype="bfloat16"), (4, 2, 2), True, "", False, 0),
    (Case(T=10, QH=1, KH=1, D=16, is_neox=False, table="full", dtype="float32"), (2, 3, 3), False, "", False, 0),
]
ROCM_DEFAULT = 3  # KERNEL_CASES[:ROCM_DEFAULT] and ROCM_CASES[:ROCM_DEFAULT] run in the default tier


def _rocm_problem(case, section, interleaved, norm, heads, layers, seed):
    args, opts = make_mrope_problem(case, section, interleaved, seed=seed, norm=norm)
    rng = np.random.default_rng(seed + 7)
    if heads and "k_scale" in opts:
        opts.update(k_scale=rng.uniform(0.05, 0.5, case.KH).astype(np.float32),
                    v_scale=rng.uniform(0.05, 0.5, case.KH).astype(np.float32))
    if layers:
        args = list(args)
        for i in (3, 4):
            c = np.asarray(args[i])
            bits = rng.integers(0, 256 if c.itemsize == 1 else 2**16, (layers,) + c.shape)
            bits = bits.astype(np.uint8 if c.itemsize == 1 else np.uint16) & (0x77 if c.itemsize == 1 else 0x3FFF)
            args[i] = bits.view(c.dtype)  # finite values of the cache dtype
        args = tuple(args)
    return args, opts


def _rocm_params():
    out = []
    for n, (c, sec, il, norm) in enumerate(KERNEL_CASES):
        out.append(pytest.param((c, sec, il, norm, False, 0), id=IDS[n], marks=() if n < ROCM_DEFAULT else FULL))
    for n, p in enumerate(ROCM_CASES):
        c, sec, il, norm, heads, layers = p
        pid = (f"{c.id}-{'il' if il else 'sec'}{sec[0]}.{sec[1]}.{sec[2]}-norm{norm or 'none'}"
               f"{'-heads' if heads else ''}{f'-L{layers}' if layers else ''}")
        out.append(pytest.param(p, id=pid, marks=() if n < ROCM_DEFAULT else FULL))
    return out


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("p", _rocm_params())
def test_rocm_emulated_kernel_bitwise(p, regime):
    """The FlyDSL kernel's M-RoPE variant, run lane by lane (tests/rocm_emulator.py: buffer bounds,
    masks, whole workgroups), bit for bit against the reference: both assignment rules, NeoX and
    GPT-J, half and full tables, partial rotary, the QK-norm, fp8 caches with (per-head) scales,
    stacked caches, int64 positions, out-of-range positions per stream, both regimes, the decode
    token split over workgroups, several tokens per workgroup with a partial last one."""
    emu, K = _rocm()
    case, section, interleaved, norm, heads, layers = p
    args, opts = _rocm_problem(case, section, interleaved, norm, heads, layers, seed=case.T + 3)
    pos = np.asarray(args[6])
    assert case.T < 2 or ((pos < 0) | (pos >= case.max_pos)).any()  # positions the kernel clamps, per stream
    spec = contract.check_op(*args, **opts, **({"layer": np.zeros((), np.int32)} if layers else {}))
    cfg = _rocm_config(spec, regime, K)
    if case.QH == 32 and regime == "latency":
        assert cfg.split > 1, cfg  # the decode split: the rotation phase in its own workgroup
    if case.D == 16 and regime == "bandwidth":
        assert cfg.tpb > 1 and case.T % cfg.tpb, cfg
    for layer in ((2, -1) if layers else (0,)):
        got, want = _emulate_rocm(cfg, args, opts, K, emu, layer)
        _assert_same_bits(got, want, f" (layer {layer})" if layers else "")


@pytest.mark.parametrize("which", [0, 1])
def test_rocm_emulator_would_catch_swapped_streams(monkeypatch, which):
    """The kernel with its height and width streams swapped (the rows taken where the other stream's
    condition holds) fails the comparison: interleaved (Qwen3-VL) and sections (Qwen2.5-VL)."""
    emu, K = _rocm()
    case, section, interleaved, norm = KERNEL_CASES[which]
    args, opts, _ = _problem(case, section, interleaved, norm, seed=5)
    cfg = _rocm_config(contract.check_op(*args, **opts), "latency", K)
    _assert_same_bits(*_emulate_rocm(cfg, args, opts, K, emu))
    real = K.mrope_selector

    swap = {1: 2, 2: 1}

    def swapped(E, cfg, i0):  # height's values where width's condition holds, and the reverse
        order, take = real(E, cfg, i0)
        return [swap.get(st, st) for st in order], lambda k, st: take(k, swap.get(st, st))

    monkeypatch.setattr(K, "mrope_selector", swapped)
    with pytest.raises(AssertionError, match="differ"):
        _assert_same_bits(*_emulate_rocm(cfg, args, opts, K, emu))


def test_rocm_config_without_mrope_is_the_one_stream_configuration():
    """M-RoPE off: the configuration (and its cache key) is the one without the option, and
    make_config refuses sections that do not describe R/2 frequencies."""
    from conftest import make_spec
    from jax_rope_cache.backends import rocm

    _, K = _rocm()
    cfg = rocm.kernel_config(make_spec(T=8))
    off = ("pack_x", "qkv", "token_scales", "nb") + tuple(K._FAMILY_DEFAULTS)  # options that leave the key when off
    assert cfg.mrope == 0 and "mrope" not in cfg.key() and len(cfg.key().split("_")) == len(
        [f for f in K.dataclasses.fields(cfg) if not f.name.startswith("mrope") and f.name not in off])
    codes = rocm.config_codes(cfg, K)
    on = K.make_config(**dict(codes, mrope=2, mrope_t=24, mrope_h=20, mrope_w=20), latency=cfg.latency)
    assert K.dataclasses.replace(on, mrope=0, mrope_t=0, mrope_h=0, mrope_w=0) == cfg  # same geometry
    assert on.key() != cfg.key()
    with pytest.raises(ValueError, match="summing to R/2"):
        K.make_config(**dict(codes, mrope=1, mrope_t=24, mrope_h=20, mrope_w=21))
    with pytest.raises(ValueError, match="interleaved"):
        K.make_config(**dict(codes, mrope=2, mrope_t=4, mrope_h=30, mrope_w=30))


def _flydsl_available():
    from jax_rope_cache.compilers import flydsl

    return flydsl.available()


needs_flydsl = pytest.mark.skipif(not _flydsl_available(),
                                  reason="FlyDSL is not installed (scripts/test-requirements.txt)")

# Qwen3-VL-8B TP1 (32/8/128), Qwen3-VL-235B-A22B TP8 (8/1/128), Qwen2.5-VL-7B (28/4/128, sections)
ROCM_COMPILE_CASES = [dict(T=1, QH=32, KH=8, D=128, layout="flash"),
                      dict(T=8192, QH=8, KH=1, D=128, layout="flash"),
                      dict(T=8192, QH=32, KH=8, D=128, layout="xpacked", dt=BF16, tdt=BF16, prec="native"),
                      dict(T=1, QH=8, KH=1, D=128, layout="xpacked_shuffled", dt=BF16, tdt=BF16, prec="native"),
                      dict(T=4096, QH=28, KH=4, D=128, layout="flash", norm=False, section=QWEN25_VL,
                           interleaved=False),
                      dict(T=16, QH=28, KH=4, D=128, layout="xpacked", norm=False, section=QWEN25_VL,
                           interleaved=False)]


@needs_flydsl
@pytest.mark.parametrize("kw", [pytest.param(kw, id=f"{kw['T']}-{kw['QH']}x{kw['KH']}-{kw['layout']}",
                                             marks=() if i < 1 else FULL) for i, kw in enumerate(ROCM_COMPILE_CASES)])
def test_flydsl_compiles_mrope_for_both_archs(kw):
    """FlyDSL builds the M-RoPE variants for gfx942 and gfx950: the launcher's kernarg block, no
    scratch, no spills, <= 64 VGPRs (the occupancy candidate chosen); fp32 arithmetic without FMA."""
    from test_rocm_compile import ARCHS, check_code_object, fma_outside_division
    from jax_rope_cache.backends import launcher, rocm
    from jax_rope_cache.compilers import flydsl

    kw = dict(kw)
    spec = _spec(section=kw.pop("section", QWEN3_VL), interleaved=kw.pop("interleaved", True), **kw)
    cfg = rocm.kernel_config(spec)
    assert cfg.mrope == (2 if spec.mrope_interleaved else 1) and cfg.latency == (spec.num_tokens <= 256)
    table, symbol, objs = rocm.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS) and len({o.config for o in objs}) == 1
    for o in objs:
        assert o.config.mrope == cfg.mrope
        check_code_object(o.code, o.arch, o.config, symbol)
    assert launcher.unpack_code_table(table) == [(3, a, o.code) for a, o in zip(ARCHS, objs)]
    if spec.precision == "fp32":
        isa = flydsl.isa(objs[0].config, ARCHS[0])
        assert not fma_outside_division(isa), fma_outside_division(isa)[:8]


@needs_flydsl
def test_rocm_lowering_emits_the_kernel_for_mrope():
    """M-RoPE is in the FlyDSL kernel: rocm.SUPPORTS has it, and lowering a Qwen3-VL decode step for
    "rocm" (jax.export on this CPU machine) emits the launcher's custom call, its code-object table
    holding the M-RoPE variant for gfx942 and gfx950 (no XLA fallback, no warning)."""
    import warnings

    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from test_rocm_compile import ARCHS, check_code_object, custom_calls
    from jax_rope_cache.backends import launcher, native, rocm

    spec = _spec(T=8, QH=8, KH=1, D=128, layout="flash", section=QWEN3_VL, interleaved=True)
    assert "mrope" in rocm.SUPPORTS
    native.refuse_unsupported(spec, rocm.SUPPORTS, rocm.NAME)
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes("flash", 64, 16, 1, 128, BF16)
    shapes = (s((8, 8, 128), jnp.bfloat16), s((8, 1, 128), jnp.bfloat16), s((8, 1, 128), jnp.bfloat16),
              s(kc, jnp.bfloat16), s(vc, jnp.bfloat16), s((8,), jnp.int32), s((3, 8), jnp.int32),
              s((4096, 64), jnp.float32), s((4096, 64), jnp.float32), s((128,), jnp.bfloat16), s((128,), jnp.bfloat16))

    def step(q, k, v, kc, vc, slots, pos, cos, sin, wq, wk):
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, impl="kernel", q_norm_weight=wq,
                                  k_norm_weight=wk, mrope_section=QWEN3_VL, mrope_interleaved=True)

    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        exp = jax.export.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["rocm"],
                                disabled_checks=checks)(*shapes)
    calls = [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]
    assert len(calls) == 1, calls
    attrs = calls[0][1]
    entries = launcher.unpack_code_table(attrs["code"])
    assert [(k, a) for k, a, _ in entries] == [(3, a) for a in ARCHS]
    objs = rocm.build_code_table(rocm.kernel_config(spec), ARCHS)[2]
    cfg = objs[0].config
    assert cfg.mrope == 2 and (cfg.mrope_t, cfg.mrope_h, cfg.mrope_w) == QWEN3_VL
    assert attrs["block"] == cfg.nt and attrs["grid_div"] == cfg.tpb
    for (_, arch, code), o in zip(entries, objs):
        assert code == o.code
        check_code_object(code, arch, cfg, attrs["kernel"].decode())


@pytest.mark.parametrize("n", [0, 2])
def test_cuda_node_entry_host_emulation_bitwise(n, emu_dir):
    """The kernel-node entry (pointers in custom-call order, T / leading dim / table rows compiled in)
    with positions [3, T]: the same bits as the reference."""
    tcc = _cuda()
    case, section, interleaved, norm = KERNEL_CASES[n]
    args, opts, want = _problem(case, section, interleaved, norm, seed=7 + n)
    spec = contract.check_op(*args, **opts)
    lead = spec.num_layers if spec.num_layers is not None else spec.num_blocks
    node = {"RC_NODE": 1, "RC_NODE_T": spec.num_tokens, "RC_NODE_LEAD": lead, "RC_NODE_MAX_POS": spec.max_pos}
    tcc._assert_bitwise(tcc._emulate(args, opts, emu_dir, defines=node), want)


def test_cuda_kernel_node_lowering_takes_positions_of_three_streams(monkeypatch):
    """With the kernel-node route on, an M-RoPE call lowers to one `__gpu$xla.gpu.ptx` call whose
    PTX is the node entry built with the M-RoPE defines (the [3, T] positions pass the shape check)."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.backends import kernel_node

    _cuda()  # skips without NVRTC
    monkeypatch.setenv(kernel_node.ENV, "1")
    T, QH, KH, D = 3, 8, 2, 128
    s = jax.ShapeDtypeStruct
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s((4, 16, KH, D), jnp.bfloat16), s((4, 16, KH, D), jnp.bfloat16), s((T,), jnp.int32),
            s((3, T), jnp.int32), s((64, D // 2), jnp.float32), s((64, D // 2), jnp.float32))
    step = lambda *a: jrc.rope_and_cache(*a, impl="kernel", mrope_section=QWEN3_VL,  # noqa: E731
                                         mrope_interleaved=True)
    text = jrc.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["cuda"])(*args).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.ptx" in ln]
    assert len(calls) == 1 and "jax_rope_cache_gpu" not in text
    assert "tensor<3x3xi32>" in calls[0]
