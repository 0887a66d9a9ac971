"""Occupancy candidates of the ROCm kernel (backends/rocm.occupancy_candidates, flydsl.choose).

A lowering builds the first candidate whose code objects fit in 64 VGPRs with no spills and no
scratch on every arch: the configuration as made, with a waves_per_eu=8 hint, with rotation chunks
of half the width (with and without the hint), with every chunk kind at half width. The
candidates differ in chunk widths (values in flight per lane, access widths) and compiler hints
only, never in the arithmetic:
  * the lane emulator runs every candidate of a covering set of cases bit-exact to the reference
    (no FlyDSL needed);
  * `choose` takes candidates in order, compiling where FlyDSL is here, and on a host without it
    picks among precompiled ones the same way a build machine did (fake code objects);
  * where FlyDSL is installed, the chosen code objects of a few wide variants fit (the whole CI
    matrix is checked by tests/test_rocm_compile.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, make_problem, reference_op, flydsl_kernel_module
from jax_rope_cache import contract
from jax_rope_cache.backends import rocm
from jax_rope_cache.compilers import flydsl

K = flydsl_kernel_module()  # the installed source, else the repository's (the emulator needs no build)

CASES = [
    Case(T=5, QH=4, KH=2, D=64, layout="flash", dtype="bfloat16", cache_dtype="float8_e4m3fnuz",
         table_dtype="bfloat16", precision="native", table="full"),
    Case(T=6, QH=8, KH=1, D=128, layout="xpacked_shuffled", dtype="bfloat16", table_dtype="bfloat16",
         precision="native"),
    Case(T=4, QH=2, KH=2, D=64, R=32, layout="xpacked", dtype="float16", cache_dtype="float8_e4m3fn",
         table_dtype="float16", table="full"),
    Case(T=7, QH=4, KH=1, D=64, layout="flash", is_neox=False, dtype="float32", cache_dtype="float8_e4m3fn",
         table_dtype="bfloat16"),
    Case(T=3, QH=2, KH=1, D=80, layout="flash", dtype="bfloat16", table="full", table_dtype="float32",
         precision="native", index_dtype="int64"),
    Case(T=9, QH=6, KH=3, D=128, R=64, layout="xpacked_shuffled", is_neox=False, dtype="bfloat16",
         cache_dtype="float8_e4m3fnuz", table_dtype="float16", precision="native"),
]


_operands = rocm_emulator.custom_call_operands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_occupancy_candidate_is_bit_exact(case):
    args, opts = make_problem(case, seed=11)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    cands = rocm.occupancy_candidates(cfg, K)
    assert cands[0] == (cfg, None) and cands[1] == (cfg, rocm.WAVES_PER_EU)
    configs = list(dict.fromkeys(c for c, _ in cands))
    assert len(configs) >= 2, "no narrower candidate"
    wide = rocm.kernel_config(contract.kernel_codes(contract.check_op(*args, **opts)), K)  # bandwidth
    assert cfg.latency and configs[-1] != cfg and any(c == wide for c in configs)  # latency, then bandwidth
    for c in configs[1:]:
        ref = cfg if c.latency else wide
        assert c.w_rot <= ref.w_rot and c.w_pass <= ref.w_pass and c.w_v <= ref.w_v
        assert (c.qh, c.kh, c.d, c.r, c.layout, c.dt, c.cache_dt, c.native) == (
            cfg.qh, cfg.kh, cfg.d, cfg.r, cfg.layout, cfg.dt, cfg.cache_dt, cfg.native)
    want = reference_op(*args, **opts)
    for c in configs:
        got = rocm_emulator.run(K, c, _operands(args, opts))
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert_bits_equal(g, w, f"{name} (w_rot {c.w_rot}, w_pass {c.w_pass}, w_v {c.w_v}, tpb {c.tpb})")


def _fake(cfg, arch, hints, vgprs):
    code = b"\x7fELF-" + arch.encode() + cfg.key().encode() + str(hints).encode()
    return flydsl.CodeObject(arch=arch, code=code, symbol="jrc_rope_cache_0", info=dict(vgpr_count=vgprs),
                             key=flydsl.key_for(cfg, arch, hints), config=cfg, hints=hints)


def test_choose_takes_the_first_fitting_candidate_compiling_or_not(monkeypatch):
    cfg = rocm.kernel_config(contract.check_op(*make_problem(CASES[0], 1)[0], **make_problem(CASES[0], 1)[1]), K)
    cands = rocm.occupancy_candidates(cfg, K)
    # VGPRs per candidate index and arch: the base fits on gfx942 only, the hint spills, the narrow one fits
    vgprs = {0: {"gfx942": 60, "gfx950": 70}, 1: {"gfx942": 64, "gfx950": 64}, 2: {"gfx942": 50, "gfx950": 52}}
    spills = {1}
    compiled = []

    def compile_config(c, arch, hints=None):
        i = cands.index((c, hints))
        compiled.append((i, arch))
        co = _fake(c, arch, hints, vgprs.get(i, {}).get(arch, 40))
        if i in spills:
            co = dataclasses.replace(co, info=dict(co.info, vgpr_spill_count=3, private_segment_size=16))
        return co

    monkeypatch.setattr(flydsl, "compile_config", compile_config)
    monkeypatch.setattr(flydsl, "available", lambda: True)
    objs = flydsl.choose(cands, ("gfx942", "gfx950"), rocm.fits)
    assert [o.config for o in objs] == [cands[2][0]] * 2 and compiled == [(i, a) for i in range(3)
                                                                         for a in ("gfx942", "gfx950")]
    compiled.clear()
    assert flydsl.choose(cands, ("gfx942",), rocm.fits)[0].config == cfg and compiled == [(0, "gfx942")]

    # a host without FlyDSL that holds only what the build machine bundled (the chosen candidate)
    store = {flydsl.key_for(o.config, o.arch, o.hints): o for o in objs}
    monkeypatch.setattr(flydsl, "available", lambda: False)
    monkeypatch.setattr(flydsl, "lookup", lambda c, a, h=None: store.get(flydsl.key_for(c, a, h)))
    assert [o.code for o in flydsl.choose(cands, ("gfx942", "gfx950"), rocm.fits)] == [o.code for o in objs]
    assert flydsl.choose(cands, ("gfx950",), rocm.fits)[0].config == cands[2][0]
    # ... or the build machine's whole disk cache (rejected candidates too): still the same choice
    for i in (0, 1):
        for a in ("gfx942", "gfx950"):
            co = compile_config(cands[i][0], a, cands[i][1])
            store[co.key] = co
    assert [o.code for o in flydsl.choose(cands, ("gfx942", "gfx950"), rocm.fits)] == [o.code for o in objs]
    # nothing precompiled: the clear error of the base configuration
    store.clear()
    monkeypatch.setattr(flydsl, "compile_config", lambda c, a, h=None: (_ for _ in ()).throw(
        flydsl.FlyDSLUnavailable("compiling the ROCm kernel needs FlyDSL")))
    with pytest.raises(flydsl.FlyDSLUnavailable):
        flydsl.choose(cands, ("gfx942",), rocm.fits)


def test_fits():
    assert rocm.fits(dict(vgpr_count=64, vgpr_spill_count=0, sgpr_spill_count=0, private_segment_size=0))
    assert not rocm.fits(dict(vgpr_count=65))
    assert not rocm.fits(dict(vgpr_count=60, private_segment_size=16))
    assert not rocm.fits(dict(vgpr_count=60, vgpr_spill_count=1))
    assert rocm.fits({})  # a stand-in code object without metadata


@pytest.mark.skipif(not flydsl.available(), reason=f"needs FlyDSL: {flydsl.unavailable_reason()}")
@pytest.mark.parametrize("case", CASES[:3], ids=[c.id for c in CASES[:3]])
def test_the_built_candidate_fits_on_both_archs(case):
    args, opts = make_problem(case, seed=1)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts))
    _, _, objs = rocm.build_code_table(cfg, ("gfx942", "gfx950"))
    assert len({o.config for o in objs}) == 1
    for o in objs:
        assert rocm.fits(o.info), (o.arch, o.info["vgpr_count"], o.info["private_segment_size"])


NORM_CASES = [  # (case, q norm, k norm): float32 data, whose outputs carry the sum's last bits
    (Case(T=5, QH=8, KH=1, D=128, dtype="float32", table_dtype="float32"), True, True),
    (Case(T=4, QH=4, KH=2, D=256, R=64, layout="xpacked", dtype="float32", table_dtype="float32",
          cache_dtype="float8_e4m3fn"), True, False),
    (Case(T=5, QH=4, KH=4, D=80, dtype="float32", table_dtype="float32"), False, True),
]


@pytest.mark.parametrize("p", NORM_CASES, ids=[f"{c.id}-{int(q)}{int(k)}" for c, q, k in NORM_CASES])
def test_every_norm_candidate_is_bit_exact(p):
    """Narrower candidates change the lanes per head, hence the butterfly's steps and how the
    channels >= R spread: each is bit-exact."""
    from test_rocm_emulated import norm_problem, run_and_compare

    case, qn, kn = p
    args, opts = norm_problem(case, 13, qn, kn, heads=(True, True))
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    configs = list(dict.fromkeys(c for c, _ in rocm.occupancy_candidates(cfg, K)))
    assert len(configs) >= 2 and all(c.norm for c in configs)
    for c in configs:
        run_and_compare(c, args, opts, f" (w_rot {c.w_rot}, {K.norm_layout(c).lanes} lanes per head)")
