#!/usr/bin/env python3
"""Kernel-level speed harness for the CUDA kernel: device time per call of
kernels/cuda/rope_cache.cu launched directly through the driver API (torch allocates, ctypes
launches, CUDA graphs of N calls time it, like ../shared/peers/bench_peers.py times AITER), next to
AITER's Triton kernel on the same inputs (when its source is on sys.path), an older kernel source
for A/B (--old), and floor kernels (benchmarks/diagnostics/floor_kernels.cu) that move the op's bytes with no
arithmetic. Checks: every new-kernel result is bit-identical to the old kernel's (which the test
suite proved bit-exact to jax_rope_cache.reference), whole caches included; the conversion
instructions are checked against the integer code over all 2^32 inputs.

    python3 benchmarks/diagnostics/kernel_speed.py OUTDIR [--old path/to/old.cu] [--peers .peers] [--budget-s 300]
        [--norm] [--precs fp32,native] [--profile]

--norm: every large case also runs the fused QK-RMSNorm kernel (bf16 q/k weights, eps
1e-6; the configs q32-8 / q235-4 are Qwen3-32B TP8 / Qwen3-235B TP4), its --variants and --alt
sources, next to the same call without the norm (column nrm/plain). --profile: each variant runs
once, untimed, for `ncu -k rope_cache_kernel`.

Inputs follow bench_peers.py (imported from --peers): bf16 q/k/v, bf16 half tables [32768, D/2],
2 GiB caches, random unique slots or prefill runs (sequences of 1024 tokens in random blocks).
Prints a table last; writes OUTDIR/kernel_speed.jsonl.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from cuda_graph_timing import graph_us  # noqa: E402  (benchmarks/)


def log(*a):
    print(*a, flush=True)


# ---- driver API ---------------------------------------------------------------------------------
_cu = None


def cu():
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
    return _cu


def check(rc, what):
    if rc != 0:
        s = ctypes.c_char_p()
        cu().cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError(f"{what}: CUDA error {rc} {s.value}")


class Fn:
    def __init__(self, image: bytes, name: str):
        self.mod = ctypes.c_void_p()
        check(cu().cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(image)), "cuModuleLoadData")
        self.fn = ctypes.c_void_p()
        check(cu().cuModuleGetFunction(ctypes.byref(self.fn), self.mod, name.encode()), f"cuModuleGetFunction {name}")

    def launch(self, grid, block, args, stream):
        """grid: blocks, or (x, y) blocks; args: list of ctypes values (kept alive by the caller)."""
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        check(cu().cuLaunchKernel(self.fn, int(gx), int(gy), 1, int(block), 1, 1, 0, ctypes.c_void_p(stream), ptrs,
                                  None), "cuLaunchKernel")


def params_type(n_ops: int):
    """The kernel's one parameter: pointers of the n_ops operands and 4 results, dim0 of each operand
    (14 operands with the QK-norm weights; kernels of --old without them take 12)."""
    class Params(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_void_p * (n_ops + 4)), ("dim0", ctypes.c_int64 * n_ops)]
    return Params


# ---- configurations -----------------------------------------------------------------------------
def make_spec(T, QH, KH, D, layout, prec, NB, max_pos, BS=16, norm=False):
    import jax
    import ml_dtypes

    from jax_rope_cache import contract

    bf = np.dtype(ml_dtypes.bfloat16)
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, NB, BS, KH, D, bf)
    w = s((D,), bf) if norm else None
    return contract.check_op(s((T, QH, D), bf), s((T, KH, D), bf), s((T, KH, D), bf), s(kc, bf), s(vc, bf),
                          s((T,), np.int32), s((T,), np.int32), s((max_pos, D // 2), bf), s((max_pos, D // 2), bf),
                          layout=layout, is_neox=True, rotary_dim=D, precision=prec, q_norm_weight=w,
                          k_norm_weight=w, norm_eps=NORM_EPS)


def old_kernel_config(spec, num_sms=132):
    """kernel_config of jax_rope_cache/cuda.py at d0e2734 (the kernel before the one-unit-per-thread design)."""
    from jax_rope_cache import contract
    from jax_rope_cache.backends import cuda

    w = cuda.chunk_width(spec)
    d, r, qh, kh = spec.head_dim, spec.rotary_dim, spec.q_heads, spec.kv_heads
    rh = qh + kh
    units_rot = rh * ((r // 2) // w if spec.is_neox else r // w)
    units = units_rot + rh * ((d - r) // w) + kh * (d // w)
    table_w = r if spec.table_full else r // 2
    pw = lambda n: 1 << (max(1, n).bit_length() - 1)  # noqa: E731
    nt = 256
    tpb = max(1, min(64, pw(2048 // max(1, units))))
    if spec.layout != "flash":
        tpb = max(tpb, 16)
    while tpb > 1 and (tpb * 2 * table_w * 4 > 32768 or tpb * 2 * table_w > 16 * nt):
        tpb //= 2
    t = spec.num_tokens
    while tpb > 1 and -(-t // tpb) < 2 * num_sms:
        tpb //= 2
    work = units * tpb
    nt = min(512, max(64, -(-work // 32) * 32)) if -(-t // tpb) < num_sms else min(256, max(64, -(-work // 32) * 32))
    while tpb * 2 * table_w > 16 * nt and tpb > 1:
        tpb //= 2
    defines = (
        ("RC_QH", qh), ("RC_KH", kh), ("RC_D", d), ("RC_R", r), ("RC_BS", spec.block_size),
        ("RC_LAYOUT", contract.LAYOUT_TABLE[spec.layout].code), ("RC_NEOX", 1), ("RC_FULL_TABLE", 0),
        ("RC_NATIVE", int(spec.precision == "native")), ("RC_DT", 1), ("RC_TAB_DT", 1), ("RC_CACHE_DT", 1),
        ("RC_SLOT64", 0), ("RC_POS64", 0), ("RC_LAYER_BLOCKS", 0),
        ("RC_WCH", w), ("RC_TPB", tpb), ("RC_NT", nt), ("RC_UNROLL", 4),
    )
    return dict(defines), tpb, nt


def new_kernel_config(spec, override=None):
    """The lowering's configuration with `override`'s defines changed (KEY=V, KEY*V, KEY+V); a KEY
    without the RC_ prefix is a constant of backends/cuda.py set while kernel_config chooses (e.g.
    V_CHANNELS=4: the thread count follows the variant's unit count)."""
    from jax_rope_cache.backends import cuda

    consts = {k: v for k, op, v in override or () if not k.startswith("RC_")}
    saved = {k: getattr(cuda, k) for k in consts}
    try:
        for k, v in consts.items():
            setattr(cuda, k, v)
        cfg, _ = cuda.fit_registers(cuda.kernel_config(spec, 132), "sm_90")  # the lowering's build
    finally:
        for k, v in saved.items():
            setattr(cuda, k, v)
    d = dict(cfg.defines)
    for key, op, val in override or ():
        if key.startswith("RC_"):
            d[key] = val if op == "=" else (d[key] * val if op == "*" else d[key] + val)
    return d, d["RC_TPB"], d["RC_NT"]


def compile_defs(src, defs, headers):
    from jax_rope_cache.backends import cuda
    from jax_rope_cache.compilers import nvrtc

    opts = list(cuda.BASE_OPTIONS) + [f"-D{k}={v}" for k, v in defs.items()]
    c = nvrtc.compile_cuda(src, arch="sm_90", options=opts, headers=headers, name="rope_cache.cu")
    regs = [ln for ln in c.log.splitlines() if "registers" in ln]
    return c.code, (regs[-1].strip() if regs else "")


# ---- timing -------------------------------------------------------------------------------------
def stream():
    import torch

    return torch.cuda.current_stream().cuda_stream


# ---- the cases ----------------------------------------------------------------------------------
CONFIGS = {"oss-8": ("oss120b_tp8", 8, 1, 64, 150000.0), "l70b8": ("llama70b_tp8", 8, 1, 128, 500000.0),
           "l8b-1": ("llama8b_tp1", 32, 8, 128, 500000.0), "oss-1": ("oss120b_tp1", 64, 8, 64, 150000.0),
           "q32-8": ("qwen3_32b_tp8", 8, 1, 128, 1000000.0), "q235-4": ("qwen3_235b_tp4", 16, 1, 128, 1000000.0)}
NORM_EPS = 1e-6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--old", default=None)
    ap.add_argument("--old-operands", type=int, default=14, help="operands of the --old kernel's ABI (12 without the QK-norm weights)")
    ap.add_argument("--peers", default=None)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--configs", default="oss-8,l70b8,l8b-1,oss-1")
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--decode-tokens", default="1,16,64,128")
    ap.add_argument("--decode-layouts", default="flash", help="layouts of the decode cases (flash,xpacked)")
    ap.add_argument("--alt", default="", help="other kernel sources run with the new configuration: name=path,...")
    ap.add_argument("--variants", default="", help="extra new-kernel variants: name:KEY=V/KEY*V/KEY+V;... (KEY: "
                    "an RC_ define, or a backends/cuda.py constant such as V_CHANNELS)")
    ap.add_argument("--norm", action="store_true", help="also the fused QK-RMSNorm kernel")
    ap.add_argument("--norm-configs", default="q32-8,q235-4", help="the configs --norm applies to")
    ap.add_argument("--precs", default="fp32,native")
    ap.add_argument("--profile", action="store_true", help="one untimed launch per variant (for ncu)")
    args = ap.parse_args()
    if args.profile:
        global graph_us
        graph_us = lambda call: float("nan")  # noqa: E731
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    res_path = os.path.join(args.out, "kernel_speed.jsonl")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax only builds specs here
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    from jax_rope_cache.backends import cuda as jcuda

    src_new, headers = jcuda.kernel_sources()
    src_old = open(args.old).read() if args.old else None
    alts = [(a.split("=", 1)[0], open(a.split("=", 1)[1]).read()) for a in args.alt.split(",") if a]
    bp = None
    if args.peers:
        sys.path.insert(0, args.peers)
        sys.path.insert(0, os.path.join(args.peers, "aiter_src"))
        import bench_peers as bp  # noqa: F811
    W = None
    if bp is not None:
        try:
            W = bp.load_aiter()
            log("AITER loaded:", W.__file__)
        except Exception as e:  # noqa: BLE001
            log("AITER not loaded:", type(e).__name__, e)
    rows = []

    def emit(rec):
        rows.append(rec)
        with open(res_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(json.dumps(rec))

    # 1. conversions, exhaustively
    fsrc = open(os.path.join(HERE, "floor_kernels.cu")).read()
    from jax_rope_cache.compilers import nvrtc

    def floor_fn(name, defs):
        opts = list(jcuda.BASE_OPTIONS) + [f"-D{k}={v}" for k, v in defs.items()]
        c = nvrtc.compile_cuda(fsrc, arch="sm_90", options=opts, headers=headers, name="floor_kernels.cu")
        return Fn(c.code, name)

    out = torch.zeros(16, dtype=torch.int64, device="cuda")
    chk = floor_fn("check_cvt", {})
    t0 = time.time()
    chk.launch(132 * 16, 256, [ctypes.c_void_p(out.data_ptr())], stream())
    torch.cuda.synchronize()
    o = out.cpu().numpy()
    emit(dict(kind="cvt_check", bf16_mismatch=int(o[0]), bf16_nan_not_canonical=int(o[1]), f16_mismatch=int(o[2]),
              f16_nan_not_canonical=int(o[3]), packed_bf16_mismatch=int(o[4]), packed_f16_mismatch=int(o[5]),
              first=[hex(int(x) & 0xffffffff) for x in o[6:12]], s=round(time.time() - t0, 2)))

    out.zero_()
    chk = floor_fn("check_mul", {})
    t0 = time.time()
    chk.launch(132 * 16, 256, [ctypes.c_void_p(out.data_ptr())], stream())
    torch.cuda.synchronize()
    o = out.cpu().numpy()
    emit(dict(kind="mul_check", bf16_mismatch=int(o[0]), f16_mismatch=int(o[1]), bf16_nan_not_canonical=int(o[2]),
              f16_nan_not_canonical=int(o[3]), first=[hex(int(x)) for x in o[4:6]], s=round(time.time() - t0, 2)))

    # 2. copy ceiling
    n = 4 << 30
    xbuf = torch.empty(n, dtype=torch.uint8, device="cuda")
    xbuf.fill_(1)
    ybuf = torch.empty_like(xbuf)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(6):
        e0.record()
        ybuf.copy_(xbuf)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ceil_gbs = 2 * n / (float(np.median(ts[1:])) * 1e-3) / 1e9
    del xbuf, ybuf
    torch.cuda.empty_cache()
    emit(dict(kind="ceiling", GBps=ceil_gbs))

    variants = []
    for spec_s in [v for v in args.variants.split(";") if v]:
        name, kv = spec_s.split(":", 1)
        ov = []
        for part in kv.split("/"):
            op = next(o for o in "=*+" if o in part)
            key, val = part.split(op)
            ov.append((key, op, int(val)))
        variants.append((name, ov))

    MAX_POS = 32768
    cfg_names = [c for c in args.configs.split(",") if c]
    big_tokens = [int(t) for t in args.tokens.split(",") if t]
    dec_tokens = [int(t) for t in args.decode_tokens.split(",") if t]
    for cname in cfg_names:
        cfg = CONFIGS[cname]
        name, QH, KH, D, theta = cfg
        NB = (2 << 30) // (16 * KH * D * 2)
        cos_np, sin_np = bp.rope_tables(D, theta) if bp else (None, None)
        bf = torch.bfloat16
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).cuda().view(bf)  # noqa: E731
        cos_t, sin_t = to_t(cos_np), to_t(sin_np)
        cases = [(T, lay, pat) for T in big_tokens for lay in ("flash", "xpacked") for pat in ("random", "prefill")]
        if cname in ("oss-8", "l8b-1", "q32-8", "q235-4", "oss-1", "l70b8"):
            cases = [(T, lay, "random") for T in dec_tokens for lay in args.decode_layouts.split(",")] + cases
        caches = {}
        for T, lay, pat in cases:
            if time.time() - t_start > args.budget_s:
                emit(dict(kind="skipped", config=cname, T=T, layout=lay, slots=pat))
                continue
            bp.SLOT_PATTERN = pat
            inp = bp.make_inputs(cfg, T, NB, 16)
            q, k, v = to_t(inp["q"]), to_t(inp["k"]), to_t(inp["v"])
            pos = torch.from_numpy(inp["pos"]).cuda()
            slots = torch.from_numpy(inp["slots"]).cuda()
            if lay not in caches:
                caches.clear()
                torch.cuda.empty_cache()
                ks, vs = bp.cache_shapes(lay, NB, KH, D)
                g = torch.Generator(device="cuda").manual_seed(1)
                base_k = torch.randint(-2**15, 2**15, ks, dtype=torch.int16, device="cuda", generator=g).view(bf)
                base_v = torch.randint(-2**15, 2**15, vs, dtype=torch.int16, device="cuda", generator=g).view(bf)
                caches[lay] = (base_k, base_v, torch.empty_like(base_k), torch.empty_like(base_v))
            base_k, base_v, kc, vc = caches[lay]
            nbytes = bp.min_bytes(T, T, QH, KH, D)
            rec = dict(kind="case", config=cname, T=T, layout=lay, slots=pat, bytes=nbytes)
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            results = {}

            g = torch.Generator(device="cuda").manual_seed(T)  # norm weights near 1 (Qwen3's are ~0.5-2)
            w_q = (1 + 0.25 * torch.randn(D, generator=g, device="cuda")).to(bf)
            w_k = (1 + 0.25 * torch.randn(D, generator=g, device="cuda")).to(bf)

            def run_ours(tag, src, defs, tpb, nt, prec, n_ops=14, norm=False):
                image, regs = compile_defs(src, defs, headers)
                fn = Fn(image, "rope_cache_kernel")
                kc.copy_(base_k)
                vc.copy_(base_v)
                q_out.fill_(0)
                k_out.fill_(0)
                one = torch.ones((), dtype=torch.float32, device="cuda")
                lay_i = torch.zeros((), dtype=torch.int32, device="cuda")
                ops = [q, k, v, kc, vc, slots, pos, cos_t, sin_t, one, one, lay_i] + ([w_q, w_k] if norm else [one, one])
                ops = ops[:n_ops]  # without the norm: placeholders, never read
                p = params_type(n_ops)()
                for i, a in enumerate(ops + [q_out, k_out, kc, vc]):
                    p.ptr[i] = a.data_ptr()
                for i, a in enumerate(ops):
                    p.dim0[i] = a.shape[0] if a.dim() else 1
                parts = int(defs.get("RC_SPLIT", 1))  # RC_SPLIT: grid.y
                grid = (-(-T // tpb), parts)
                call = lambda: fn.launch(grid, nt, [p], stream())  # noqa: E731
                call()
                torch.cuda.synchronize()
                snap = (q_out.clone(), k_out.clone(), kc.clone(), vc.clone())
                us = graph_us(call)
                rec[f"{tag}_us"] = round(us, 2) if us == us else None
                rec[f"{tag}_frac"] = round(nbytes / (us * 1e-6) / 1e9 / ceil_gbs, 3) if us == us else None
                split = f" x{parts}" if parts > 1 else ""
                rec[f"{tag}_cfg"] = f"tpb{tpb} nt{nt}{split} {regs.split('Used')[-1].strip() if regs else ''}"
                results[tag] = snap
                return snap

            for prec in [p for p in args.precs.split(",") if p]:
                spec = make_spec(T, QH, KH, D, lay, prec, NB, MAX_POS)
                if src_old:
                    d, tpb, nt = old_kernel_config(spec)
                    run_ours(f"old_{prec}", src_old, d, tpb, nt, prec, n_ops=args.old_operands)
                d, tpb, nt = new_kernel_config(spec)
                run_ours(f"new_{prec}", src_new, d, tpb, nt, prec)
                for vname, ov in variants:  # every T (decode: latency variants, e.g. RC_WCH=4/RC_NT*2)
                    d2, tpb2, nt2 = new_kernel_config(spec, ov)
                    run_ours(f"{vname}_{prec}", src_new, d2, tpb2, nt2, prec)
                if T >= 8192:
                    for aname, asrc in (alts if prec == "fp32" else []):
                        for suffix, ov in (("", []), ("t2", [("RC_TPB", "*", 2)])):
                            d2, tpb2, nt2 = new_kernel_config(spec, ov)
                            run_ours(f"{aname}{suffix}_{prec}", asrc, d2, tpb2, nt2, prec)
                if args.norm and cname in args.norm_configs.split(","):  # the fused norm: source, variants, alts
                    nspec = make_spec(T, QH, KH, D, lay, prec, NB, MAX_POS, norm=True)
                    d, tpb, nt = new_kernel_config(nspec)
                    run_ours(f"nrm_{prec}", src_new, d, tpb, nt, prec, norm=True)
                    for vname, ov in variants:
                        d2, tpb2, nt2 = new_kernel_config(nspec, ov)
                        run_ours(f"nrm{vname}_{prec}", src_new, d2, tpb2, nt2, prec, norm=True)
                    for aname, asrc in alts:
                        run_ours(f"nrm{aname}_{prec}", asrc, d, tpb, nt, prec, norm=True)
                if src_old:  # bit-identical to the old kernel (outputs and whole caches)
                    a, b = results[f"old_{prec}"], results[f"new_{prec}"]
                    rec[f"same_{prec}"] = all(bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
                                              for x, y in zip(a, b))
                for kk in [kk for kk in results if kk not in (f"new_{prec}", f"nrm_{prec}") and kk.endswith(prec)]:
                    if kk.startswith("old"):
                        continue
                    a, b = results[kk], results[f"nrm_{prec}" if kk.startswith("nrm") else f"new_{prec}"]
                    rec[f"same_{kk}"] = all(bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
                                            for x, y in zip(a, b))
                results.clear()
            # AITER on the same inputs
            if W is not None:
                kc.copy_(base_k)
                vc.copy_(base_v)
                flash = lay == "flash"

                def acall():
                    return W.fused_qk_rope_reshape_and_cache(q, k, v, kc, vc, slots, pos, cos_t, sin_t, None, None,
                                                             True, flash, apply_scale=False, q_out=q_out,
                                                             k_out=k_out, output_zeros=False)
                try:
                    acall()
                    torch.cuda.synchronize()
                    us = graph_us(acall)
                    rec["aiter_us"] = round(us, 2)
                    rec["aiter_frac"] = round(nbytes / (us * 1e-6) / 1e9 / ceil_gbs, 3)
                except Exception as e:  # noqa: BLE001
                    rec["aiter_error"] = f"{type(e).__name__}: {e}"[:200]
            if T <= 128:  # decode floors: empty kernel and the dependent chain, same grid and block
                nt_new = new_kernel_config(make_spec(T, QH, KH, D, lay, "fp32", NB, MAX_POS))[2]
                fnull = floor_fn("null_kernel", {})
                iT = ctypes.c_int64(T)
                rec["null_us"] = round(graph_us(lambda: fnull.launch(T, nt_new, [iT], stream())), 2)
                fch = floor_fn("chain2", {})
                ca = [ctypes.c_void_p(a.data_ptr()) for a in (pos, cos_t, q, q_out)] + [iT]
                rec["chain2_us"] = round(graph_us(lambda: fch.launch(T, min(nt_new, QH * D // 8), ca, stream())), 2)
            # floors (same slots): the op's traffic without arithmetic (decode too, from T = 64);
            # x-packed at T >= 8192 also write-only V / K
            if T >= 64:
                nslots = NB * 16
                fd = {"FL_KH": KH, "FL_D": D, "FL_BS": 16, "FL_QH": QH, "FL_XP": int(lay != "flash")}
                fop = floor_fn("floor_op", fd)
                ptrs = [ctypes.c_void_p(a.data_ptr()) for a in (q, k, v, slots, q_out, k_out, kc, vc)]
                iT, ins = ctypes.c_int64(T), ctypes.c_int64(nslots)
                per_tok = QH * D // 8 + KH * D // 8 + (KH * D if lay != "flash" else KH * D // 8)
                g_op = -(-T * per_tok // 256)
                us = graph_us(lambda: fop.launch(g_op, 256, ptrs + [iT, ins], stream()))
                rec["floor_op_us"] = round(us, 2)
                if T <= 128:  # plus the position -> table dependency and bytes (one chunk a thread, like decode;
                    ftab = floor_fn("floor_op_tab", fd)  # at large T its extra table loads make it no floor)
                    tabs = [ctypes.c_void_p(a.data_ptr()) for a in (pos, cos_t, sin_t)]
                    rec["floor_tab_us"] = round(graph_us(lambda: ftab.launch(g_op, 256, ptrs + [iT, ins] + tabs,
                                                                              stream())), 2)
                if lay != "flash" and T >= 8192:
                    for fname, cnt in (("floor_v_xp_d", T * KH * D), ("floor_v_xp_t", T * KH * D),
                                       ("floor_k_xp", T * KH * D // 8)):
                        f = floor_fn(fname, fd)
                        buf = vc if "_v_" in fname else kc
                        fa = [ctypes.c_void_p(slots.data_ptr()), ctypes.c_void_p(buf.data_ptr()), iT, ins]
                        us = graph_us(lambda: f.launch(-(-cnt // 256), 256, fa, stream()))
                        rec[fname + "_us"] = round(us, 2)
            emit(rec)
            del q, k, v, pos, slots, q_out, k_out
        caches.clear()
        torch.cuda.empty_cache()

    # table
    log("\n==== H200 kernel device time per call (CUDA graph of 20 calls / 20), us; frac = bytes/time/ceiling ====")
    log(f"copy ceiling {ceil_gbs:.0f} GB/s")
    hdr = ("config", "T", "layout", "slots", "AITER", "old F", "new F", "new N", "A/newF", "N/F", "frac newF",
           "floor op/tab/null/chain2", "same")
    log(" | ".join(hdr))
    for r in rows:
        if r.get("kind") != "case":
            continue
        a, nf, nn = r.get("aiter_us"), r.get("new_fp32_us"), r.get("new_native_us")
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        log(" | ".join(str(x) for x in (
            r["config"], r["T"], r["layout"], r["slots"], fmt(a), fmt(r.get("old_fp32_us")), fmt(nf), fmt(nn),
            fmt(a / nf if a and nf else None), fmt(nn / nf if nn and nf else None), r.get("new_fp32_frac"),
            "/".join(fmt(r.get(k)) for k in ("floor_op_us", "floor_tab_us", "null_us", "chain2_us") if k in r),
            f"{r.get('same_fp32')}/{r.get('same_native')}")))
    for r in rows:
        if r.get("kind") == "case" and r["layout"] == "xpacked" and r["T"] >= 8192:
            log(f"xp floors {r['config']} T={r['T']} {r['slots']}: V write-only d-fastest {r.get('floor_v_xp_d_us')} "
                f"t-fastest {r.get('floor_v_xp_t_us')} K write-only {r.get('floor_k_xp_us')} op {r.get('floor_op_us')}")
        for prec in ("fp32", "native"):
            sfx = f"_{prec}_us"
            extra = {k[:-len(sfx)]: v for k, v in r.items() if k.endswith(sfx) and v and k.split("_")[0] not in
                     ("aiter", "old", "new", "floor") and not k.startswith("nrm")}
            nrm = {k[:-len(sfx)]: v for k, v in r.items() if k.endswith(sfx) and v and k.startswith("nrm")}
            plain = r.get("new" + sfx)
            if nrm and plain:
                best = min(nrm, key=nrm.get)
                log(f"norm {prec} {r['config']} T={r['T']} {r['layout']} {r['slots']}: plain {plain} | " +
                    " ".join(f"{k}={v} ({v / plain:.3f}x, {r.get(k + '_' + prec + '_cfg')})" for k, v in nrm.items()) +
                    f" | best {best} {nrm[best] / plain:.3f}x plain")
            if extra:
                best = min(extra, key=extra.get)
                log(f"variants {prec} {r['config']} T={r['T']} {r['layout']} {r['slots']}: new {r.get('new' + sfx)} "
                    f"aiter {r.get('aiter_us')} | " + " ".join(f"{k}={v}" for k, v in extra.items()) +
                    f" | best {best} x/A {r.get('aiter_us', 0) / extra[best]:.2f}")
    log(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
