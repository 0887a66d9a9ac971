"""The ROCm kernel's two regimes (make_config(latency=...), chosen by backends/rocm.kernel_config
from the call's static T): which configuration small and large calls get, and that both are
bit-exact to the reference in the lane emulator, with and without the fused QK-RMSNorm.

  * latency (T <= LATENCY_TOKENS): one token per workgroup, one unit per lane, rotation chunks of
    half the width where one token's units fit a workgroup and the norm's butterfly stays within
    32 lanes; the norm weights load with the q/k chunks;
  * bandwidth (larger T, or no T: the `compile` CLI's KernelCodes): as before (256 threads, as many
    tokens per workgroup as its lanes hold, full-width chunks, weights after the sum).
No flydsl needed (the compile matrix, tests/test_rocm_compile.py, compiles both regimes).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import rocm_emulator
from conftest import Case, make_problem, make_spec, flydsl_kernel_module
from jax_rope_cache import contract
from jax_rope_cache.backends import rocm

K = flydsl_kernel_module()
BF16 = np.dtype(ml_dtypes.bfloat16)

# (QH, KH, D, norm): the shapes of the build notes' table (per shard)
SHAPES = [(32, 8, 128, False), (8, 1, 128, False), (8, 1, 64, False), (64, 8, 64, False),
          (8, 1, 128, True), (16, 1, 128, True)]


def spec_of(T, QH, KH, D, norm=False, **kw):
    spec = make_spec(T=T, QH=QH, KH=KH, D=D, **kw)
    if norm:
        spec = dataclasses.replace(spec, q_norm_dtype=BF16, k_norm_dtype=BF16, norm_eps=1e-6)
    return spec


@pytest.mark.parametrize("layout", ["flash", "xpacked"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + ("-norm" if s[3] else ""))
def test_small_calls_get_the_latency_config_large_ones_the_bandwidth_config(shape, layout):
    QH, KH, D, norm = shape
    big = rocm.kernel_config(spec_of(8192, QH, KH, D, norm, layout=layout), K)
    assert not big.latency and big.nt == 256 and big.w_rot == 8  # bf16: 16-byte chunks
    assert big == rocm.kernel_config(contract.kernel_codes(spec_of(1, QH, KH, D, norm, layout=layout)), K)
    for T in (1, 64, K.LATENCY_TOKENS):
        small = rocm.kernel_config(spec_of(T, QH, KH, D, norm, layout=layout), K)
        assert small.latency and small.tpb == 1
        assert small.w_rot == big.w_rot // 2  # 8-byte q/k accesses
        units = (D // 2) // small.w_rot * (QH + KH)  # rotation units of one token: one per lane
        assert small.nt == -(-units // 64) * 64 and small.nt <= K.MAX_NT
        assert dataclasses.replace(small, w_rot=big.w_rot, tpb=big.tpb, nt=big.nt, latency=False, split=1) == big
    assert not rocm.kernel_config(spec_of(K.LATENCY_TOKENS + 1, QH, KH, D, norm, layout=layout), K).latency


def test_latency_keeps_full_width_where_halving_does_not_apply():
    # one token's half-width units would exceed a workgroup (64 + 8 heads x 16 chunks = 1152 lanes)
    c = rocm.kernel_config(spec_of(1, 64, 8, 128), K)
    assert c.latency and c.tpb == 1 and c.w_rot == 8 and c.nt == 576
    # the norm's butterfly would cross 32 lanes (f32, D = 256: 32 lanes per head at full width)
    c = rocm.kernel_config(spec_of(1, 4, 2, 256, dt=np.dtype(np.float32), tdt=np.dtype(np.float32)), K)
    assert c.w_rot == 2  # no norm: halved
    s = dataclasses.replace(spec_of(1, 4, 2, 256, dt=np.dtype(np.float32), tdt=np.dtype(np.float32)),
                            q_norm_dtype=np.dtype(np.float32), norm_eps=1e-6)
    c = rocm.kernel_config(s, K)
    assert c.latency and c.w_rot == 4 and K.norm_layout(c).lanes == 32
    # the norm's row reload (D = 80: chunks not on the tree): not halved
    s = dataclasses.replace(spec_of(1, 4, 2, 80), q_norm_dtype=BF16, k_norm_dtype=BF16, norm_eps=1e-6)
    c = rocm.kernel_config(s, K)
    assert K.norm_layout(c).plan is None and c.w_rot == rocm.kernel_config(contract.kernel_codes(s), K).w_rot


def test_latency_candidates_end_with_the_bandwidth_ones():
    """A host without FlyDSL holding what `compile` precompiles (bandwidth configs: it knows no T)
    still finds a code object for a decode call."""
    small = rocm.kernel_config(spec_of(1, 8, 1, 128, True), K)
    big = rocm.kernel_config(contract.kernel_codes(spec_of(1, 8, 1, 128, True)), K)
    cands = rocm.occupancy_candidates(small, K)
    assert cands[:2] == [(small, None), (small, rocm.WAVES_PER_EU)]
    n_lat = sum(c.latency for c, _ in cands)
    assert all(c.latency for c, _ in cands[:n_lat]) and n_lat >= 3
    assert cands[n_lat:] == rocm.occupancy_candidates(big, K)


def _norm_problem(case, seed, weights=True):
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed)
    if weights:
        dt = np.dtype(args[0].dtype)
        opts.update(q_norm_weight=rng.uniform(0.25, 2.0, case.D).astype(np.float32).astype(dt),
                    k_norm_weight=rng.uniform(0.25, 2.0, case.D).astype(np.float32).astype(dt), norm_eps=1e-6)
    return args, opts


EXACT_CASES = [  # the table's shapes, a few layouts / dtypes; float32 data carry the sum's order
    (Case(T=1, QH=8, KH=1, D=128), True),  # Qwen3-32B TP8, decode
    (Case(T=5, QH=16, KH=1, D=128, layout="xpacked"), True),  # Qwen3-235B TP4
    (Case(T=3, QH=8, KH=1, D=128, dtype="float32", table_dtype="float32"), True),
    (Case(T=4, QH=8, KH=2, D=128, layout="xpacked_shuffled", cache_dtype="float8_e4m3fnuz",
          table_dtype="bfloat16", precision="native"), True),
    (Case(T=2, QH=32, KH=8, D=128), False),  # Llama-8B
    (Case(T=7, QH=8, KH=1, D=64, layout="xpacked", cache_dtype="float8_e4m3fn", precision="native"), False),
]


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("p", EXACT_CASES, ids=lambda p: p[0].id + ("-norm" if p[1] else ""))
def test_both_regimes_are_bit_exact(p, regime):
    from test_rocm_emulated import run_and_compare

    case, norm = p
    args, opts = _norm_problem(case, 3, norm)
    spec = contract.check_op(*args, **opts)
    cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.latency == (regime == "latency") and cfg.norm == norm
    configs = list(dict.fromkeys(c for c, _ in rocm.occupancy_candidates(cfg, K)))
    for c in configs:  # the candidates too (narrower chunks; latency: then the bandwidth ones)
        run_and_compare(c, args, opts, f" ({regime}: w_rot {c.w_rot}, nt {c.nt}, tpb {c.tpb})")


def test_latency_loads_the_norm_weights_before_the_sum(monkeypatch):
    """Early weights (latency): the weight loads are emitted before the butterfly, not after it."""
    case = Case(T=1, QH=8, KH=1, D=128)
    args, opts = _norm_problem(case, 1)
    ops = rocm_emulator.custom_call_operands(args, opts)
    spec = contract.check_op(*args, **opts)
    weights = {np.asarray(opts[n]).tobytes() for n in ("q_norm_weight", "k_norm_weight")}
    order = []
    real_load, real_xor = rocm_emulator.rocdl.raw_ptr_buffer_load, K._Emitter.lane_xor

    def load(ty, rsrc, off, soff):
        b0, buf = rocm_emulator.M.buffer(rsrc.a[0])
        if bytes(buf) in weights:
            order.append("w")
        return real_load(ty, rsrc, off, soff)

    def xor(self, v, m, tid):
        order.append("x")
        return real_xor(self, v, m, tid)

    monkeypatch.setattr(rocm_emulator.rocdl, "raw_ptr_buffer_load", staticmethod(load))
    monkeypatch.setattr(K._Emitter, "lane_xor", xor)
    for regime, want_early in (("latency", True), ("bandwidth", False)):
        order.clear()
        cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
        rocm_emulator.run(K, cfg, ops)
        assert "w" in order and "x" in order
        assert (order.index("w") < order.index("x")) == want_early, (regime, "".join(order))


# ---- the latency regime's phase split (grid.y: each phase in its own workgroup of the token) ------------
def test_latency_splits_tokens_of_many_lanes_by_phase():
    """A latency configuration whose phases hold more than SPLIT_MIN_LANES lanes in all runs each
    phase in its own workgroup (split = the number of phases, grid.y); others, and every bandwidth
    configuration, are one workgroup per token block."""
    l8b = rocm.kernel_config(spec_of(1, 32, 8, 128), K)
    assert l8b.latency and l8b.split == 2 and K.phases(l8b) == ["rot", "v"]
    assert sum(K.phase_lanes(l8b).values()) > K.SPLIT_MIN_LANES
    partial = rocm.kernel_config(spec_of(64, 32, 8, 128, R=64), K)
    assert partial.split == 3 and K.phases(partial) == ["rot", "pass", "v"]
    merged = rocm.kernel_config(spec_of(1, 32, 8, 128, True, R=64), K)  # the norm's lanes hold the pass channels
    assert K.norm_layout(merged).merged and K.phases(merged) == ["rot", "v"] and merged.split == 2
    for shape in ((8, 1, 128), (8, 1, 64), (16, 1, 128)):  # one KV head: 88-288 lanes
        c = rocm.kernel_config(spec_of(1, *shape), K)
        assert c.split == 1 and sum(K.phase_lanes(c).values()) <= K.SPLIT_MIN_LANES
    assert rocm.kernel_config(spec_of(8192, 32, 8, 128), K).split == 1
    assert all(c.split == l8b.split for c, _ in rocm.occupancy_candidates(l8b, K) if c.latency)
    assert all(c.split == 1 for c, _ in rocm.occupancy_candidates(l8b, K) if not c.latency)


SPLIT_CASES = [
    Case(T=3, QH=32, KH=8, D=128, layout="xpacked"),  # Llama-8B decode: rot | v
    Case(T=2, QH=32, KH=8, D=128, R=64, layout="flash", cache_dtype="float8_e4m3fn", precision="native"),
    Case(T=4, QH=64, KH=8, D=64, layout="xpacked_shuffled", dtype="float16", table_dtype="float16"),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_split_latency_config_is_bit_exact_and_each_output_has_one_part(case):
    """Split configurations in the lane emulator: bit-exact to the reference (their candidates
    too), and every output is stored by exactly the part of its phase (q_out / k_out / key cache:
    rotation and pass-through; value cache: V), so no phase runs twice or not at all."""
    from test_rocm_emulated import run_and_compare

    args, opts = make_problem(case, 7)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert cfg.split == len(K.phases(cfg)) > 1, cfg
    for c in dict.fromkeys(c for c, _ in rocm.occupancy_candidates(cfg, K) if c.latency):
        run_and_compare(c, args, opts, f" (split {c.split}: w_rot {c.w_rot}, nt {c.nt})")
        ph = K.phases(c)
        want = {"q_out": {0} | ({ph.index("pass")} if "pass" in ph else set()), "value_cache": {ph.index("v")}}
        want["k_out"] = want["key_cache"] = want["q_out"]
        assert rocm_emulator.LAST_WRITERS == want, rocm_emulator.LAST_WRITERS


def test_split_would_catch_a_wrong_part_index(monkeypatch):
    """A kernel whose workgroups all read part 0 (grid.y ignored) runs the rotation twice, with the
    same bits, and V never: the store record and the comparison both see it."""
    from test_rocm_emulated import run_and_compare

    args, opts = make_problem(SPLIT_CASES[0], 7)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    monkeypatch.setattr(K._Emitter, "bid_y", lambda self: self.i32c(0))
    with pytest.raises(AssertionError, match="value_cache"):
        run_and_compare(cfg, args, opts)
    assert rocm_emulator.LAST_WRITERS["q_out"] == {0, 1} and "value_cache" not in rocm_emulator.LAST_WRITERS
