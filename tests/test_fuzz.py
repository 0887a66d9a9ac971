"""Fuzzing: random problems on every (platform, impl) present, each compared with the reference.

Each case draws, from a generator seeded by its index: layout, rotation style, table kind, rotary
dim, head counts, head dim, block size (1 to 64), number of blocks (1 = a one-block cache), T (0
included), dtypes of inputs, tables and caches (fp8 included), index dtypes (int32, and int64 under
`jax.enable_x64`), precision, and optionally stacked layers. Slots mix unique valid ones with
invalid ones over the whole index range (int min/max, -1, NB*BS, NB*BS +- small); positions are
drawn over the whole index range too (clamped by the op). Some cases inject NaN and +-Inf into
q/k/v and the tables. About one case in eight breaks one argument instead and must raise the same
documented error type (ValueError/TypeError) from the op and from the reference. The QK-norm's
options come from a stream of their own (so the other draws of a case stay as they were): the
QK-RMSNorm on q, k or both (weights in q's dtype or float32, several eps) and per-head fp8 scales.
A kernel whose backend does not implement a drawn option (its SUPPORTS) must refuse it.

Checks: the native kernels are bit-exact to the reference, NaN bits included; the XLA path within the tolerance of
tests/test_op.py (1 ulp, or 2 f32 ulps of the row's largest finite input: FMA). With NaN/Inf: the
same NaN positions, the same infinities, the finite values by the rules above. Cache entries the
reference leaves alone keep their bits.

Case count: JRC_FUZZ_CASES (default 150 in the full tier, 50 in the default tier) per (platform, impl); JRC_FUZZ_SEED shifts the seeds.
"""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from conftest import TIER, impl_params, reference_op, to_host, ulp_diff

N_CASES = int(os.environ.get("JRC_FUZZ_CASES", "150" if TIER == "full" else "50"))
SEED0 = int(os.environ.get("JRC_FUZZ_SEED", "0"))

DTYPES = [np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)]
FP8 = list(contract.FP8_DTYPES)
LAYOUTS = list(contract.LAYOUTS)


def _choice(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _draw_spec(rng) -> dict:
    """The static shape of one random case (always valid)."""
    dt = _choice(rng, DTYPES)
    cdt = dt if rng.random() < 0.6 else _choice(rng, FP8)
    x = contract.pack_width(cdt)
    layout = _choice(rng, LAYOUTS)
    d = int(_choice(rng, [2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 256]))
    if layout != "flash" and d % x:
        d = x * int(rng.integers(1, 5))
    r = d if rng.random() < 0.6 else 2 * int(rng.integers(1, d // 2 + 1))
    kh = int(_choice(rng, [1, 1, 2, 3, 4]))
    qh = kh * int(_choice(rng, [1, 2, 4, 8]))
    if layout == "xpacked_shuffled":
        bs = x * int(_choice(rng, [1, 1, 2, 4]))
    else:
        bs = int(_choice(rng, [1, 2, 3, 5, 8, 16, 32, 64]))
    nb = 1 if rng.random() < 0.25 else int(rng.integers(1, 9))
    t = int(_choice(rng, [0, 1, 1, 2, 3, 7, 16, 33, 64]))
    return dict(dt=dt, cdt=cdt, tdt=_choice(rng, DTYPES), layout=layout, D=d, R=r, QH=qh, KH=kh, BS=bs, NB=nb,
                T=t, neox=bool(rng.random() < 0.5), table="full" if rng.random() < 0.4 else "half",
                idt=np.dtype(np.int64) if rng.random() < 0.4 else np.dtype(np.int32),
                precision="native" if rng.random() < 0.4 else "fp32", max_pos=int(_choice(rng, [1, 2, 17, 512])),
                layers=None if rng.random() < 0.8 else int(rng.integers(1, 4)),
                nonfinite=bool(rng.random() < 0.3))


def _indices(rng, n, t, idt, nslots):
    """t slots: unique valid ones mixed with invalid values over the whole index range."""
    info = np.iinfo(idt)
    invalid = [-1, nslots, nslots + 1, info.min, info.max, info.min + 1, info.max - 1, -nslots]
    valid = rng.permutation(nslots)
    slots = np.empty(t, np.int64)
    nv = 0
    for i in range(t):
        u = rng.random()
        if u < 0.5 and nv < nslots:
            slots[i] = valid[nv]
            nv += 1
        elif u < 0.8:
            slots[i] = _choice(rng, invalid)
        else:  # anywhere in the range, almost always invalid
            slots[i] = rng.integers(info.min, info.max, dtype=np.int64, endpoint=True)
            if 0 <= slots[i] < nslots:
                slots[i] = -1
    pos = np.where(rng.random(t) < 0.5, rng.integers(0, n, t),
                   rng.integers(info.min, info.max, t, dtype=np.int64, endpoint=True))
    pos[rng.random(t) < 0.1] = info.max
    pos[rng.random(t) < 0.1] = info.min
    return slots.astype(idt), pos.astype(idt)


def _sprinkle(rng, a, frac=0.03):
    """A copy of float array `a` with NaN, +Inf and -Inf at random places."""
    a = a.copy()
    flat = a.reshape(-1)
    if flat.size == 0:
        return a
    hit = rng.random(flat.size) < frac
    vals = np.array([np.nan, np.inf, -np.inf], np.float32)[rng.integers(0, 3, flat.size)]
    flat[hit] = vals[hit].astype(a.dtype)
    return a


def make_case(i: int):
    """(args, opts, layer, description) of case i; `opts` may hold one broken argument (see `expect_error`)."""
    rng = np.random.default_rng([SEED0, i])
    s = _draw_spec(rng)
    t, d, r = s["T"], s["D"], s["R"]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32) * np.float32(rng.uniform(0.1, 8))  # noqa: E731
    q, k, v = (normal(t, h, d) for h in (s["QH"], s["KH"], s["KH"]))
    width = r if s["table"] == "full" else r // 2
    ang = rng.uniform(-np.pi, np.pi, (s["max_pos"], width)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    if s["nonfinite"]:
        q, k, v = (_sprinkle(rng, a) for a in (q, k, v))
        if rng.random() < 0.5:
            cos, sin = _sprinkle(rng, cos, 0.02), _sprinkle(rng, sin, 0.02)
    q, k, v = (a.astype(s["dt"]) for a in (q, k, v))
    cos, sin = cos.astype(s["tdt"]), sin.astype(s["tdt"])
    kshape, vshape = contract.cache_shapes(s["layout"], s["NB"], s["BS"], s["KH"], d, s["cdt"])
    if s["layers"]:
        kshape, vshape = (s["layers"],) + kshape, None if vshape is None else (s["layers"],) + vshape
    kc = rng.standard_normal(kshape).astype(np.float32).astype(s["cdt"])
    vc = None if vshape is None else rng.standard_normal(vshape).astype(np.float32).astype(s["cdt"])  # kv_merged: None
    slots, pos = _indices(rng, s["max_pos"], t, s["idt"], s["NB"] * s["BS"])
    opts = dict(layout=s["layout"], is_neox=s["neox"], rotary_dim=None if r == d else r, precision=s["precision"],
                table_form=s["table"])
    if s["cdt"] in contract.FP8_DTYPES:
        opts.update(k_scale=np.float32(rng.uniform(0.01, 2)), v_scale=np.float32(rng.uniform(0.01, 2)))
    layer = int(rng.integers(0, s["layers"])) if s["layers"] else None
    args = [q, k, v, kc, vc, slots, pos, cos, sin]
    broken = None
    if rng.random() < 0.125:
        broken = _break(rng, args, opts, s)
    norm = _draw_issue18(np.random.default_rng([SEED0, i, 18]), opts, s) if broken is None else ""
    desc = (f"case {i}: T={t} QH={s['QH']} KH={s['KH']} D={d} R={r} NB={s['NB']} BS={s['BS']} {s['layout']} "
            f"{'neox' if s['neox'] else 'gptj'} {s['table']} {s['dt'].name}/{s['tdt'].name}/{s['cdt'].name} "
            f"{s['idt'].name} {s['precision']} layers={s['layers']} nonfinite={s['nonfinite']} broken={broken}{norm}")
    return tuple(args), opts, layer, desc, broken


def _draw_issue18(rng, opts, s) -> str:
    """Adds the norm weights / eps and per-head scales to opts (in place); returns a description."""
    out = ""
    if rng.random() < 0.4:
        which = _choice(rng, ["q", "k", "qk"])
        wdt = _choice(rng, [s["dt"], np.dtype(np.float32)])
        for w in which:
            opts[f"{w}_norm_weight"] = (rng.standard_normal(s["D"]) * 1.5).astype(wdt)
        opts["norm_eps"] = float(_choice(rng, [1e-6, 1e-5, 0.25]))
        out += f" norm={which}/{np.dtype(wdt).name}/eps={opts['norm_eps']:g}"
    for name in ("k_scale", "v_scale"):
        if name in opts and s["KH"] > 1 and rng.random() < 0.5:
            opts[name] = rng.uniform(0.01, 2, s["KH"]).astype(np.float32)
            out += f" {name}=[KH]"
    return out


def _break(rng, args, opts, s) -> str:
    """Makes one argument invalid in place; returns what was broken."""
    t, d = s["T"], s["D"]
    what = _choice(rng, ["q-dtype", "k-shape", "slots-dtype", "slots-len", "cos-width", "cache-rank",
                         "rotary-odd", "scale", "layout", "v-dtype", "value-cache"])
    if what == "q-dtype":
        args[0] = np.zeros((t, s["QH"], d), np.int32)
    elif what == "k-shape":
        args[1] = np.zeros((t, s["KH"] + 1, d), s["dt"])
    elif what == "slots-dtype":
        args[5] = args[5].astype(np.float32)
    elif what == "slots-len":
        args[5] = np.zeros(t + 1, s["idt"])
    elif what == "cos-width":
        args[7] = np.zeros((s["max_pos"], s["R"] + 2), s["tdt"])
        args[8] = args[7]
    elif what == "cache-rank":
        args[3] = args[3].reshape(args[3].shape[:-2] + (-1,))
    elif what == "rotary-odd":
        opts["rotary_dim"] = s["R"] - 1 if s["R"] > 2 else d + 2
    elif what == "scale":
        if "k_scale" in opts:
            opts.pop("k_scale")
        else:
            opts["k_scale"] = np.float32(0.5)
    elif what == "layout":
        opts["layout"] = "paged"
    elif what == "value-cache":  # given to kv_merged (K and V in key_cache), missing elsewhere
        args[4] = args[3].copy() if args[4] is None else None
    elif what == "v-dtype":
        other = DTYPES[(DTYPES.index(s["dt"]) + 1) % 3]
        args[2] = args[2].astype(np.float32).astype(other)
    return what


def _run(platform, impl, args, opts, layer):
    use64 = any(np.asarray(a).dtype == np.int64 for a in args[5:7])
    with jax.enable_x64(use64):
        dev = jax.devices(platform)[0]
        dargs = jax.device_put(args, dev)
        scales = {n: jax.device_put(opts[n], dev) for n in ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight")
                  if n in opts}
        static = {n: v for n, v in opts.items() if n not in scales}
        fn = jax.jit(lambda *a, **sc: jrc.rope_and_cache(*a, **sc, **static, impl=impl, layer=layer))
        return to_host(fn(*dargs, **scales))


def _isnan(a):
    return np.isnan(np.asarray(a).astype(np.float32))


def _finite_max(a, axis=None, keepdims=False):
    f = np.abs(np.asarray(a).astype(np.float32))
    f = np.where(np.isfinite(f), f, 0)
    return f.max(axis=axis, keepdims=keepdims, initial=0)


def _rotation_inputs(args, opts):
    """q and k as the rotation sees them: normalised where a norm weight is given."""
    q, k = args[0], args[1]
    eps = np.float32(opts.get("norm_eps", 1e-6))
    with np.errstate(invalid="ignore", over="ignore"):
        if "q_norm_weight" in opts:
            q = reference.rms_norm(q, opts["q_norm_weight"], eps)
        if "k_norm_weight" in opts:
            k = reference.rms_norm(k, opts["k_norm_weight"], eps)
    return q, k


def _bound(name, args, opts, platform="cpu"):
    """The FMA bound over the rotation's inputs; on a GPU, where XLA's division and square root in
    the QK-norm are not correctly rounded, plus test_qk_norm's GPU_NORM_ULPS of the normalised row."""
    from test_qk_norm import GPU_NORM_ULPS

    eps = 2.0**-22
    q, k = _rotation_inputs(args, opts)
    normed = "q_norm_weight" in opts if name == "q_out" else "k_norm_weight" in opts
    if platform != "cpu" and normed:
        eps += 2 * GPU_NORM_ULPS[np.dtype(args[0].dtype)]
    if name in ("q_out", "k_out"):
        return eps * _finite_max(q if name == "q_out" else k, axis=-1, keepdims=True)
    inv = 1.0 / float(np.min(opts.get("k_scale", 1.0)))
    return eps * inv * float(_finite_max(k))


def compare(got, want, name, exact, bound, desc):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (desc, name, got.dtype, want.dtype, got.shape)
    gn, wn = _isnan(got), _isnan(want)
    assert (gn == wn).all(), f"{name}: NaN positions differ ({int((gn != wn).sum())} elements) [{desc}]"
    keep = ~wn
    ulps = ulp_diff(got, want)
    if exact:  # every bit, NaN payloads included (computed NaNs are canonical, copies keep theirs)
        bad = ulps != 0
    else:
        with np.errstate(invalid="ignore"):
            err = np.abs(got.astype(np.float64) - want.astype(np.float64))
            close = (ulps <= 1) | (err <= bound)
        # infinities must match exactly (inf - inf is NaN above, so `close` is False for them)
        close |= ulps == 0
        bad = keep & ~close
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} elements differ, first at "
                           f"{tuple(np.argwhere(bad)[0])}, {got[bad][:4]} vs {want[bad][:4]} [{desc}]")


def check_case(platform, impl, i):
    args, opts, layer, desc, broken = make_case(i)
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference_op(*args, **opts, layer=layer)
        ref_exc = None
    except (ValueError, TypeError) as e:
        ref_exc = e
    if broken is not None or ref_exc is not None:
        assert ref_exc is not None, f"the reference accepted a broken call [{desc}]"
        with pytest.raises(type(ref_exc)) as err:
            _run(platform, impl, args, opts, layer)
        # the message names the argument first, as the reference's does
        assert str(err.value).split(":")[0] == str(ref_exc).split(":")[0], (str(err.value), str(ref_exc), desc)
        return "error"
    used = contract.features(contract.check_op(*args, **opts, layer=layer))
    if impl == "kernel" and not used <= backends.KERNEL_BACKENDS[platform].SUPPORTS:
        with pytest.raises(NotImplementedError, match="does not implement"):
            _run(platform, impl, args, opts, layer)
        return "refused"
    got = _run(platform, impl, args, opts, layer)
    names = ("q_out", "k_out", "key_cache", "value_cache")
    for name, g, w in zip(names, got, want):
        if w is None:  # kv_merged's absent value cache
            assert g is None, f"{name}: expected None [{desc}]"
            continue
        compare(g, w, name, impl == "kernel", _bound(name, args, opts, platform), desc)
    for name, g, before, w in zip(names[2:], got[2:], args[3:5], want[2:]):
        untouched = ulp_diff(w, before) == 0
        assert (ulp_diff(g, before)[untouched] == 0).all(), f"{name}: an unwritten entry changed [{desc}]"
    return "match"


def test_case_mix():
    """The generator covers what the brief asks for (counted over the CI case set)."""
    seen = dict(t0=0, one_block=0, fp8=0, int64=0, nonfinite=0, broken=0, layers=0, norm=0, per_head_scale=0)
    for i in range(N_CASES):
        args, opts, layer, desc, broken = make_case(i)
        seen["t0"] += args[0].shape[0] == 0
        seen["one_block"] += "NB=1 " in desc
        seen["fp8"] += "k_scale" in opts or "float8" in desc
        seen["int64"] += "int64" in desc
        seen["nonfinite"] += "nonfinite=True" in desc
        seen["broken"] += broken is not None
        seen["layers"] += layer is not None
        seen["norm"] += "norm=" in desc
        seen["per_head_scale"] += "_scale=[KH]" in desc
    print(f"fuzz case mix over {N_CASES} cases: {seen}")
    if N_CASES >= 100:
        assert all(v > 0 for v in seen.values()), seen


def run_cases(platform, impl, n, on_case=None) -> str:
    """Checks cases 0..n-1; returns the summary line. on_case(i, outcome) follows progress."""
    outcomes = {"match": 0, "error": 0, "refused": 0}
    for i in range(n):
        outcome = check_case(platform, impl, i)
        outcomes[outcome] += 1
        if on_case is not None:
            on_case(i, outcome)
    return (f"fuzz {platform}-{impl}: {n} cases, {outcomes['match']} matched the reference, "
            f"{outcomes['error']} raised the documented error"
            + (f", {outcomes['refused']} refused an option the kernel lacks" if outcomes["refused"] else ""))


@pytest.mark.parametrize("platform,impl", impl_params())
def test_fuzz(platform, impl, capsys):
    summary = run_cases(platform, impl, N_CASES)
    jax.clear_caches()
    with capsys.disabled():
        print("\n" + summary)


def main(argv=None) -> int:
    """Standalone run with a line per case, for runs that may be cut short (compute-sanitizer):
    python tests/test_fuzz.py --platform cuda --impl kernel --cases 150   (no -P: conftest is beside it)"""
    import argparse
    import time

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--platform", required=True)
    p.add_argument("--impl", default="kernel", choices=["kernel", "xla"])
    p.add_argument("--cases", type=int, default=N_CASES)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    progress = lambda i, outcome: print(f"case {i}: {outcome} ({time.perf_counter() - t0:.0f} s)", flush=True)  # noqa: E731
    print(run_cases(a.platform, a.impl, a.cases, progress), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
