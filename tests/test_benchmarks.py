"""The GPU benchmark harness (benchmarks/bench_gpu.py) reaches every suite: each suite's module
imports on any machine and answers --help; an unknown suite is refused by name. The suites the
H200 runs (mla, mrope, qkv) go through their whole code path in a --dry-run on the CPU backend:
the reference checks, the timing, the files and the table they print last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import child_env

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
HARNESS = os.path.join(BENCH, "bench_gpu.py")
SUITES = ["op", "qk_norm", "mrope", "mla", "qkv", "tp", "fp8", "families", "low_bit"]


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-P", HARNESS, *args], env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_answers_help(suite):
    r = _run(suite, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:300]


def test_the_harness_lists_its_suites_and_refuses_an_unknown_one():
    r = _run("--help")
    assert r.returncode == 0 and all(f"bench_gpu.py {s}" in r.stdout for s in SUITES)
    r = _run("bogus")
    assert r.returncode == 2 and "suite: expected one of op, qk_norm, mrope, mla, qkv, tp, fp8, families, low_bit, got 'bogus'" in r.stderr


def _dry(suite, tmp_path, *extra):
    r = _run(suite, str(tmp_path), "--dry-run", "--aiter-src", "off", *extra) if suite == "mla" else \
        _run(suite, str(tmp_path), "--dry-run", *extra)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout, json.load(open(tmp_path / f"bench_{suite}.json"))


def test_mla_dry_run_checks_ours_exactly_and_prints_the_ratios_last(tmp_path):
    out, res = _dry("mla", tmp_path, "--tokens", "1,8")
    rows = res["rows"]
    assert [(r["cache"], r["T"]) for r in rows] == [("bf16", 1), ("bf16", 8), ("fp8", 1), ("fp8", 8)]
    for r in rows:
        assert r["check"]["kernel"] == "exact" and r["check"]["xla"] in ("exact", "<=1 step"), r["check"]
        assert all(r[k]["time_us"] > 0 for k in ("kernel", "xla", "copy")), r
    # bytes: every input read once, every output written once (2 q heads in the dry run)
    assert rows[0]["bytes"] == (2 * 576 + 576) * 2 + 2 * 32 * 4 + 2 * 4 + 2 * 576 * 2 + 64 * 2 + 576 * 2
    table = out[out.index("targets: x/A"):].splitlines()
    assert table[1].split()[:6] == ["cache", "T", "ours", "of", "copy", "of"]
    assert len(table) == 2 + len(rows) and all("kernel exact" in ln for ln in table[2:])
    assert (tmp_path / "bench_mla.log").read_text().rstrip().endswith(table[-1])


def test_mla_check_tells_a_wrong_result(tmp_path):
    """The comparison the suite's checks use fails on a one-step change (exact) and on a two-step one."""
    sys.path.insert(0, os.path.join(BENCH, "gpu"))
    import mla

    rng = np.random.default_rng(3)
    want = rng.standard_normal(200).astype(mla.BF16)
    assert mla.compare([want.copy()], [want], exact=True) == "exact"
    up = (want.view(np.uint16) + 1).view(mla.BF16)  # one ulp
    assert mla.compare([up], [want], exact=True) == "NOT exact" and mla.compare([up], [want], exact=False) == "<=1 step"
    two = (want.view(np.uint16) + 2).view(mla.BF16)
    worst = mla.compare([two], [want], exact=False)  # 2 ulps, 3 of want's where it crosses a binade
    assert worst in ("2.0 steps", "3.0 steps"), worst
    f8 = rng.standard_normal(200).astype(mla.FN)
    assert mla.compare([(f8.view(np.uint8) ^ 2).view(mla.FN)], [f8], exact=False).endswith("steps")


class _FakeTensor:
    """Enough of a torch tensor for aiter_mla.timed / _bind: remembers which random draw it came from."""

    def __init__(self, shape, dtype, origin):
        self.shape, self.dtype, self.origin, self.device = tuple(shape), dtype, origin, "cuda"

    def to(self, dtype):
        return _FakeTensor(self.shape, dtype, self.origin)

    def __getitem__(self, index):
        return self

    def view(self, *shape):
        return self

    def cuda(self):
        return self


def _fake_torch():
    import types

    torch = types.ModuleType("torch")
    torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz = "bf16", "f32", "e4m3fn", "e4m3fnuz"
    draws = iter(range(1 << 30))
    torch.Generator = lambda device: types.SimpleNamespace(manual_seed=lambda seed: None)
    torch.randn = lambda *shape, generator, device: _FakeTensor(shape, "f32", next(draws))
    torch.randperm = lambda n, generator, device: _FakeTensor((n,), "i64", next(draws))
    torch.randint = lambda lo, hi, shape, generator, device: _FakeTensor(shape, "i64", next(draws))
    torch.from_numpy = lambda a: _FakeTensor(a.shape, "f32", next(draws))
    torch.tensor = lambda values, dtype, device: _FakeTensor((len(values),), dtype, next(draws))
    torch.cuda = types.SimpleNamespace(empty_cache=lambda: None)
    return torch


def test_mla_aiter_column_rotates_through_input_sets_as_ours_do(monkeypatch):
    """aiter_mla.timed: the N calls that torch's profiler times and the N a CUDA graph captures read N
    different input sets (q_nope, q_pe, kv_c, k_pe, slots, positions) and one cache, as our chain does
    (call j on set j % N); one set reused would stay in L2 at small T. torch and AITER stood in for."""
    import types

    sys.path.insert(0, os.path.join(BENCH, "gpu"))
    import aiter_mla

    from jax_rope_cache.models import presets

    seen = {"kernel": [], "graph": []}
    phase = []

    def fused_qk_rope_cat_and_cache_mla(q_nope, q_pe, k_nope, k_rope, rows, slots, pos, cos, sin, scale, **kw):
        if phase:
            seen[phase[-1]].append((q_nope.origin, q_pe.origin, k_nope.origin, k_rope.origin, slots.origin,
                                    pos.origin, rows.origin))

    def kernel_us(call, n_calls):  # as cuda_graph_timing: one warm-up call, then n_calls profiled
        call()
        phase.append("kernel")
        for _ in range(n_calls):
            call()
        phase.pop()
        return 1.0, 1

    def graph_us(call, n_calls):  # three warm-up calls, then n_calls captured in the graph
        for _ in range(3):
            call()
        phase.append("graph")
        for _ in range(n_calls):
            call()
        phase.pop()
        return 1.0

    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    monkeypatch.setitem(sys.modules, "cuda_graph_timing", types.SimpleNamespace(kernel_us=kernel_us, graph_us=graph_us))
    W = types.SimpleNamespace(fused_qk_rope_cat_and_cache_mla=fused_qk_rope_cat_and_cache_mla)
    n = 16
    cos = np.ones((64, 32), np.float32)
    aiter_mla.timed(W, presets.mla_shape("deepseek-v3", 8), 1, 4096, 64, "bf16", cos, cos, 0.25, n, n_sets=n)
    for which, calls in seen.items():
        assert len(calls) == n, which
        for i in range(6):  # each input: n different draws, never two calls on the same one
            assert len({c[i] for c in calls}) == n, (which, i)
        assert len({c[6] for c in calls}) == 1, which  # the one cache, carried through the calls
    assert {c[0] for c in seen["kernel"]} == {c[0] for c in seen["graph"]}


def test_mrope_dry_run_checks_the_kernels_exactly(tmp_path):
    out, res = _dry("mrope", tmp_path, "--models", "qwen3-vl-8b:1", "--layouts", "flash", "--tokens", "1,8")
    assert [c["fused"] for c in res["checks"].values()] == ["exact", "exact"]
    assert [c["front"] for c in res["checks"].values()] == ["exact", "exact"]
    assert {r["variant"] for r in res["rows"]} == {"fused", "jnp", "front", "plain"}
    assert all(r["time_us"] > 0 for r in res["rows"])
    last = out.rstrip().splitlines()[-2:]
    assert all(ln.startswith("qwen3-vl-8b TP1") and "exact, " in ln for ln in last), last


def test_qkv_dry_run_counts_the_slices_the_fused_input_removes(tmp_path):
    out, res = _dry("qkv", tmp_path, "--models", "llama-3.1-8b:1", "--tokens", "4")
    (row,) = res["rows"]
    fu, sl = row["fused"], row["sliced"]
    assert fu["qkv_producers"] == ["projection"] * 3, fu
    assert sl["qkv_producers"] == ["slice"] * 3, sl
    assert sl["hlo_kernels"] - fu["hlo_kernels"] == 3, (fu["hlo_opcodes"], sl["hlo_opcodes"])
    assert fu["check"] == sl["check"] == "exact" and row["same_bits"] is True and row["same_projection"] is True
    assert out.rstrip().splitlines()[-1].startswith("llama-3.1-8b TP1")


def test_qkv_check_uses_each_forms_own_projection_and_tells_a_wrong_output():
    """The reference is fed the projection output given, so another projection (as XLA may compile
    for the sliced form) is checked against its own reference; a one-bit change is a mismatch."""
    sys.path.insert(0, os.path.join(BENCH, "gpu"))
    import ml_dtypes
    import qkv

    from jax_rope_cache import reference

    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(5)
    qh, kh, d, t, layers, nb, bs = 2, 1, 16, 3, 2, 2, 16

    class Case:
        slots = rng.permutation(nb * bs)[:t].astype(np.int32)
        pos = rng.integers(0, 64, t).astype(np.int32)
        cos, sin = (rng.standard_normal((64, d // 2)).astype(np.float32) for _ in range(2))

    init = [rng.standard_normal((layers, nb, bs, kh, d)).astype(bf) for _ in range(2)]
    proj = rng.standard_normal((layers, t, (qh + 2 * kh) * d)).astype(bf)

    def run(p):  # the op on projection outputs p, layer after layer
        kc, vc, qs, ks = init[0], init[1], [], []
        for i in range(layers):
            q, k, kc, vc = reference.rope_and_cache_qkv(p[i], kc, vc, Case.slots, Case.pos, Case.cos, Case.sin,
                                                        num_q_heads=qh, num_kv_heads=kh, layer=i)
            qs.append(q), ks.append(k)
        return np.stack(qs), np.stack(ks), kc, vc

    other = (proj.view(np.uint16) ^ 1).view(bf)  # another projection's last bits
    assert qkv.compare_layers(run(proj), proj, init, Case, qh, kh, reference) == "exact"
    assert qkv.compare_layers(run(other), other, init, Case, qh, kh, reference) == "exact"
    assert qkv.compare_layers(run(other), proj, init, Case, qh, kh, reference).startswith("NOT exact (q, layer 0)")
    q, k, kc, vc = run(proj)
    kc = kc.copy()
    kc.view(np.uint16)[1, Case.slots[0] // bs, Case.slots[0] % bs, 0, 0] ^= 1
    assert qkv.compare_layers((q, k, kc, vc), proj, init, Case, qh, kh, reference) == "NOT exact (key cache)"


def test_a_row_without_device_time_says_wall_time():
    sys.path.insert(0, os.path.join(BENCH, "gpu"))
    import timing

    lost = dict(wall_us=50.0, time_us=50.0, timing="wall", trace_error="the profile has no GPU events")
    assert timing.wall_note(lost, expect_device=True) == "WALL time (the profile has no GPU events)"
    assert timing.wall_note(dict(device_us=1.5, time_us=1.5, timing="device"), expect_device=True) == ""
    assert timing.wall_note(lost, expect_device=False) == ""  # a dry run has wall time only


def test_budget_skips_cases_and_says_so(tmp_path):
    out, res = _dry("qkv", tmp_path, "--models", "llama-3.1-8b:1", "--tokens", "1,4", "--budget-s", "0")
    assert res["rows"] == [] and "budget (0 s): skipped llama-3.1-8b TP1 T=1" in out


MODEL_STEP = os.path.join(BENCH, "diagnostics", "model_step.py")


def test_model_step_context_routes_run_on_the_cpu(tmp_path):
    """benchmarks/diagnostics/model_step.py --contexts (the H200's attention benchmark) on a tiny
    model: every route of every context measured from one shared cache pool (the GPU kernel
    interpreted), the attention bytes per step as counted, and the JSON of the rows."""
    r = subprocess.run([sys.executable, "-P", MODEL_STEP, "--model", "tiny-llama-3.1", "--contexts", "16,40",
                        "--batch", "3", "--steps", "2", "--repeats", "2", "--dtype", "float32", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=os.path.dirname(BENCH))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    routes = ["kernel:pallas_gpu", "kernel:gather", "xla:pallas_gpu", "baseline:pallas_gpu"]
    res = json.load(open(tmp_path / "model_step_tiny-llama-3.1.json"))
    assert list(res) == ["16", "40"] and all(list(rows) == routes for rows in res.values())
    # 3 sequences x (context + 1.5 keys on average over 2 steps) x KH 2 x D 32 x K and V x 4 bytes x 2 layers
    for ctx, rows in res.items():
        assert all(row["wall_us"] > 0 and len(row["wall_runs"]) == 2 for row in rows.values())
        assert rows["kernel:gather"]["attention_bytes"] == 3 * (int(ctx) + 1.5) * 2 * 32 * 2 * 4 * 2
    for ctx in ("16", "40"):
        table = r.stdout[r.stdout.index(f"context {ctx}:"):].splitlines()
        assert [ln.split()[0] for ln in table[2:6]] == routes, table[:6]
        assert table[2].split()[-3].endswith("%")  # the op's share, against the baseline with the same attention


def test_families_dry_run_times_each_switch_next_to_its_plain_call(tmp_path):
    out, res = _dry("families", tmp_path, "--tokens", "1", "--cases", "nope,gemma_norm,rotary_tail")
    rows = res["rows"]
    assert [(r["case"], r["variant"]) for r in rows] == [
        (c, v) for c in ("nope", "gemma_norm", "rotary_tail") for v in ("switch", "plain", "xla")]
    assert all(r["time_us"] > 0 for r in rows), rows
    table = out[out.index("sw/plain = switch / plain"):].splitlines()
    assert len(table) == 2 + 3 and table[1].split()[:3] == ["case", "model", "T"]


def test_low_bit_dry_run_counts_each_formats_bytes(tmp_path):
    out, res = _dry("low_bit", tmp_path, "--tokens", "8", "--models", "llama-3.1-8b:1",
                    "--variants", "bf16,fp8_token,int8_xla,int4_xla,nvfp4_xla,mxfp4_xla")
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"bf16", "fp8_token", "int8_xla", "int4_xla", "nvfp4_xla", "mxfp4_xla"}
    assert all(r["time_us"] > 0 for r in rows.values()), rows
    # the dry run's 32 q heads, 8 KV heads, D = 32: the K and V rows at 2, 1 and 1/2 bytes a value, f32 scales
    kv_values, scales = 2 * 8 * 32, 2 * 8 * 4
    assert rows["bf16"]["bytes"] - rows["fp8_token"]["bytes"] == 8 * (kv_values - scales)
    assert rows["int8_xla"]["bytes"] - rows["int4_xla"]["bytes"] == 8 * kv_values / 2
    # the block scales: one byte per 16 (NVFP4) or 32 (MXFP4) values instead of 4 bytes per row
    assert rows["int4_xla"]["bytes"] - rows["nvfp4_xla"]["bytes"] == 8 * 2 * 8 * (4 - 32 // 16)
    assert rows["int4_xla"]["bytes"] - rows["mxfp4_xla"]["bytes"] == 8 * 2 * 8 * (4 - 32 // 32)
    assert "/fp8 = time / fp8_token time" in out
