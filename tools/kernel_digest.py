"""Digests of the GPU code the kernels compile to, for a matrix of configurations: which code a
change leaves byte-identical. Run it in two checkouts and compare:

    PYTHONPATH=<checkout A> python tools/kernel_digest.py a.json
    PYTHONPATH=<checkout B> python tools/kernel_digest.py b.json
    python tools/kernel_digest.py --compare a.json b.json

Per configuration: the CUDA kernel's sm_90 cubin, compute_90 PTX and kernel-node PTX (NVRTC), and,
where FlyDSL is installed, the ROCm code objects for gfx942 and gfx950. The matrix covers the four
original cache layouts at T = 1, 64, 8192 with bf16 / f16 / f32 inputs, fp8 caches with static,
per-head and per-token scales, the QK-norm, partial rotary, GPT-J, full tables, stacked layers and
M-RoPE. Identical bytes need the same compiler versions in both runs (one machine, one venv).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json

import jax
import ml_dtypes
import numpy as np

BF16, F16, F32 = (np.dtype(d) for d in (ml_dtypes.bfloat16, np.float16, np.float32))
FN = np.dtype(ml_dtypes.float8_e4m3fn)
S = jax.ShapeDtypeStruct
LAYOUTS = ("flash", "xpacked", "xpacked_shuffled", "hnd")


def cases() -> list[dict]:
    out = []
    for i, (layout, t) in enumerate(itertools.product(LAYOUTS, (1, 64, 8192))):
        base = dict(T=t, layout=layout, layers=None, norm=False, token=False, heads=False, R=None, mrope=None)
        out += [
            dict(base, QH=32, KH=8, D=128, dt=BF16, cdt=BF16, full=False, neox=True),
            dict(base, QH=8, KH=1, D=64, dt=(F16, F32, BF16)[i % 3], cdt=FN, full=bool(i % 2), neox=bool(i % 2),
                 layers=4 if i % 3 == 0 else None, norm=bool(i % 2), token=i % 3 == 1),
            dict(base, QH=16, KH=4, D=128, dt=BF16, cdt=FN, full=False, neox=False, norm=True, heads=True, R=64),
            dict(base, QH=28, KH=4, D=128, dt=BF16, cdt=BF16, full=bool(i % 2), neox=True, mrope=(16, 24, 24)),
        ]
    return out


def spec_of(c: dict):
    """The OpSpec of case c (abstract shapes; a checkout without `table_form` is given none)."""
    from jax_rope_cache import contract

    nb, bs, r, d = 24, 16, c["R"] or c["D"], c["D"]
    kc, vc = contract.cache_shapes(c["layout"], nb, bs, c["KH"], d, c["cdt"])
    lead = (c["layers"],) if c["layers"] else ()
    w = r if c["full"] else r // 2
    kw = dict(layout=c["layout"], is_neox=c["neox"], rotary_dim=r,
              layer=np.zeros((), np.int32) if c["layers"] else None)
    if c["full"] and "table_form" in inspect.signature(contract.check_op).parameters:
        kw["table_form"] = "full"
    if c["cdt"] == FN and c["token"]:
        kw.update(k_scale_cache=S(lead + (nb, c["KH"], bs), F32), v_scale_cache=S(lead + (nb, c["KH"], bs), F32))
    elif c["cdt"] == FN:
        scale = S((c["KH"],), F32) if c["heads"] else 1.0
        kw.update(k_scale=scale, v_scale=scale)
    if c["norm"]:
        kw.update(q_norm_weight=S((d,), c["dt"]), k_norm_weight=S((d,), F32))
    if c["mrope"]:
        kw.update(mrope_section=c["mrope"])
    t, dt = c["T"], c["dt"]
    pos = S((3, t), np.int32) if c["mrope"] else S((t,), np.int32)
    return contract.check_op(S((t, c["QH"], d), dt), S((t, c["KH"], d), dt), S((t, c["KH"], d), dt),
                             S(lead + kc, c["cdt"]), S(lead + vc, c["cdt"]), S((t,), np.int32), pos,
                             S((64, w), F32), S((64, w), F32), **kw)


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def record(path: str) -> None:
    from jax_rope_cache.backends import cuda, rocm
    from jax_rope_cache.compilers import flydsl

    out = {}
    for c in cases():
        s = spec_of(c)
        cfg = cuda.kernel_config(s, num_sms=132)
        cfg, cubin = cuda.fit_registers(cfg, "sm_90")
        ptx = cuda.compile_variant(cfg, "compute_90")
        _, node = cuda.build_node_ptx(cuda.node_config(cfg, (s.num_tokens, s.num_blocks, s.max_pos)), 90)
        row = dict(cubin=digest(cubin.code), ptx=digest(ptx.code), node=digest(node.code))
        if flydsl.available():
            rcfg = rocm.kernel_config(s)
            row.update({a: digest(flydsl._compile_now(rcfg, a)) for a in ("gfx942", "gfx950")})
        key = "-".join(f"{k}={getattr(v, 'name', v)}" for k, v in c.items())
        out[key] = row
        print(key, row, flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    differ = [(k, f) for k in a for f in a[k] if b.get(k, {}).get(f) != a[k][f]]
    for k, f in differ:
        print(f"differs: {k}: {f}")
    print(f"{len(a)} configurations, {sum(len(v) for v in a.values())} code objects: {len(differ)} differ")
    return 1 if differ or set(a) != set(b) else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="JSON file to write")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    if not args.out:
        p.error("give OUT.json or --compare A B")
    record(args.out)
