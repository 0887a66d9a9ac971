"""mla_rope_and_cache as ONE FlyDSL kernel for AMD GPUs (gfx942 / gfx950), compiled without a GPU.

What it computes (jax_rope_cache/mla/reference.py is the definition):
  q_out[t, h]  = cat(q_nope[t, h], rope(q_pe[t, h]))   [Dn + Dr], q_out's dtype (input or fp8 with q_scale)
  k_pe_out[t]  = rope(k_pe[t])                         [Dr]
  latent row of slot s = cat(kv_c[t], rope(k_pe[t]))   one combined cache [.., Dc + Dr], or split:
                                                       ckv [.., Dc] and kpe [.., Dr]; fp8 with kv_scale

Static configuration: an `MlaRocmConfig` (jax_rope_cache/mla/rocm_kernel.py builds it from an
MlaSpec with make_config). The scalar arithmetic (bf16 / f16 / fp8 conversions, roundings,
1/scale, buffer and global accesses) is the main kernel's (`_Emitter` of rope_cache_flydsl.py,
loaded from beside this file), so both kernels round, quantize and write NaNs the same way.

Kernel ABI (kernels/ffi/gpu_launcher.cc, generic): 8-byte kernel arguments, the device addresses
of the NA operands, then of the NR results, then int64 dim0 of every operand:
  combined: NA = 12 (q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos, sin,
            kv_scale, q_scale, layer), NR = 3 (q_out, k_pe_out, kv_cache): 27 arguments, 216 bytes
  split:    NA = 13 (kv_cache -> ckv_cache, kpe_cache), NR = 4: 30 arguments, 240 bytes
T = dim0[0]; NB (stacked: L) = dim0[4]; max_pos = dim0[cos]. Grid: (ceil(T / TPB), PARTS, 1)
workgroups of NT lanes (NT is the required workgroup size); no LDS, no barrier.
The launch function the compile driver traces takes NUM_ARGS (30) values and hands the kernel the
first kernel_args(cfg) of them: one driver (compilers/flydsl_worker.py) serves both kernels.

Work decomposition. A workgroup owns TPB consecutive tokens and a flat list of independent units:
first the copy units (token, then the q_nope chunks of every head, then the kv_c chunks: W elements
each), then the rotation units (token, row h <= QH, chunk j: h < QH is q_pe's head h, h == QH is
k_pe; RW pairs (NeoX) or RW channels (GPT-J) each). Part y (grid.y) lane l takes units
y*NT + l, + NT*PARTS, ... A unit loads its data (and a rotation unit its position) first, then its
table values (the one dependent load), then stores. Whole iterations of one kind are issued in
groups: every load of the group before its first store. The iteration where the copy units end
(and a partial last one) runs each unit in a branch on its range.
  * latency (T <= 256): one token per workgroup, PARTS = ceil(units / NT): one unit per lane;
  * bandwidth: NT = 256 lanes, as many tokens per workgroup as ~2048 units allow.

Bounds: every q/kv/q_out/k_pe_out/slot/position access is a buffer access through a descriptor
based at the workgroup's first token row and covering only its valid rows (the hardware returns 0
and drops stores past it); tables through a descriptor of max_pos rows. Positions are clamped to
[0, max_pos - 1] (64-bit); a latent row is written only when the token exists and
0 <= slot < NB*BS (64-bit compare; stacked: 0 <= layer < L and the row lands in layer `layer`),
with 64-bit global stores. q_out and k_pe_out are written for every token.
32-bit limits (as the main kernel's, rope_cache_flydsl.py): each table < 4 GiB (TABLE_BYTES_LIMIT)
and each per-workgroup descriptor <= OOB_OFFSET bytes (span_problem); both refused at lowering
(jax_rope_cache/mla/rocm_kernel.py through backends/rocm.refuse_buffer_limits).
Arithmetic: "fp32", native "rounded" or native "fused" exactly as the main kernel (arith_mode);
fp8 outputs quantize the value rounded to the input dtype, or in "fused" arithmetic the f32 value
before that rounding (q_out's rope part and the cached rope key alike). Copies into an output of
the input dtype keep their bits.
"""

import dataclasses
import importlib.util
import os
import sys
import typing


def _base():
    """The main FlyDSL kernel module (rope_cache_flydsl.py beside this file): its emitter and helpers."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope_cache_flydsl.py")
    name = "_jrc_rocm_base_" + str(abs(hash(path)))
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


_B = _base()
F32, BF16, F16, FP8_FN, FP8_FNUZ, FP8_E5M2 = _B.F32, _B.BF16, _B.F16, _B.FP8_FN, _B.FP8_FNUZ, _B.FP8_E5M2
ITEMSIZE = _B.ITEMSIZE
FP8 = _B.FP8_CODES
TABLE_BYTES_LIMIT, OOB_OFFSET = _B.TABLE_BYTES_LIMIT, _B.OOB_OFFSET

KERNEL_BASENAME = "jrc_mla_cache"
NUM_ARGS = 30  # what the launch function takes (the split layout's count; combined uses the first 27)
LATENCY_TOKENS = _B.LATENCY_TOKENS  # calls of at most this many tokens: one token per workgroup
BANDWIDTH_NT = 256
UNITS_PER_WORKGROUP = 2048  # bandwidth regime: tokens per workgroup ~ this many units (8 per lane)
MAX_NT = 256
MAX_PARTS = 64
GROUP = 4  # whole iterations whose loads are all issued before their stores


def num_operands(split: bool) -> int:
    return 11 + (2 if split else 1)


def num_results(split: bool) -> int:
    return 2 + (2 if split else 1)


def kernel_args(cfg) -> int:
    """The kernel's 8-byte arguments: operand addresses, result addresses, operand dim0."""
    return 2 * num_operands(cfg.split) + num_results(cfg.split)


@dataclasses.dataclass(frozen=True)
class MlaRocmConfig:
    KERNEL: typing.ClassVar[str] = "mla_cache"  # compilers/flydsl.KERNEL_SOURCES: this file and its base

    qh: int
    dn: int
    dc: int
    dr: int
    bs: int
    split: bool        # "split" layout (ckv + kpe caches), else one combined cache
    neox: bool
    full_table: bool
    native: bool       # "native" precision (arith_mode: "rounded" or "fused")
    dt: int            # q_nope / q_pe / kv_c / k_pe / k_pe_out dtype code
    tab_dt: int
    cache_dt: int
    q_dt: int          # q_out dtype code
    slot64: bool
    pos64: bool
    w: int             # elements per copy chunk (divides Dn, Dc and Dr)
    rw: int            # NeoX: pairs per rotation unit (divides Dr/2); GPT-J: channels (even, divides Dr)
    tpb: int           # tokens per workgroup
    nt: int            # lanes per workgroup
    parts: int = 1     # workgroups per token block (grid.y)
    layer_blocks: int = 0  # 0: caches [NB, BS, row]; NB: stacked [L, NB, BS, row], layer read on the device
    latency: bool = False

    def key(self) -> str:
        return "mla_" + "_".join(str(int(v)) for v in dataclasses.astuple(self))


RocmKernelConfig = MlaRocmConfig  # the name the compile driver (flydsl_worker.py) constructs


def arith_mode(cfg) -> str:
    return _B.arith_mode(cfg)


def latency_regime(num_tokens) -> bool:
    return num_tokens is not None and 0 < num_tokens <= LATENCY_TOKENS


def units(cfg) -> tuple[int, int]:
    """(copy units, rotation units) of one token."""
    p = (cfg.dr // 2) // cfg.rw if cfg.neox else cfg.dr // cfg.rw
    return cfg.qh * (cfg.dn // cfg.w) + cfg.dc // cfg.w, (cfg.qh + 1) * p


def span_problem(cfg) -> str | None:
    """Why one workgroup's per-token descriptors would span more than OOB_OFFSET bytes (None: they
    do not): the main kernel's rule (rope_cache_flydsl.span_problem)."""
    s, sq = ITEMSIZE[cfg.dt], ITEMSIZE[cfg.q_dt]
    rows = {"q_nope": cfg.qh * cfg.dn * s, "q_pe": cfg.qh * cfg.dr * s, "kv_c": cfg.dc * s, "k_pe": cfg.dr * s,
            "q_out": cfg.qh * (cfg.dn + cfg.dr) * sq, "slot_mapping / positions": 8 if cfg.slot64 or cfg.pos64 else 4}
    name, row = max(rows.items(), key=lambda kv: kv[1])
    if cfg.tpb * row <= OOB_OFFSET:
        return None
    return (f"{name}: {cfg.tpb} token row(s) of {row} bytes per workgroup ({cfg.tpb * row} bytes), more than the "
            f"{OOB_OFFSET} bytes one 32-bit buffer descriptor addresses")


def rot_store_elems(cfg) -> int:
    """Elements per rotated store piece: the chunk, unless q_out's rows (Dn + Dr) or the combined
    cache's (Dc + Dr) would leave it misaligned."""
    return _B._pow2_width(cfg.rw, cfg.rw, cfg.dn, *(() if cfg.split else (cfg.dc,)))


def make_config(*, qh, dn, dc, dr, bs, split, neox, full_table, native, dt, tab_dt, cache_dt, q_dt, slot64, pos64,
                layer_blocks: int = 0, latency: bool = False, w_cap: int | None = None,
                rot_cap: int | None = None) -> MlaRocmConfig:
    """The configuration of a call; `w_cap` / `rot_cap`: at most that many elements per copy /
    rotation chunk (the occupancy candidates of mla/rocm_kernel.py; None: 16 bytes of input)."""
    vmax = 16 // ITEMSIZE[dt]
    w = _B._pow2_width(min(vmax, w_cap or vmax), dn, dc, dr)
    rcap = min(vmax, rot_cap or vmax)
    rw = _B._pow2_width(rcap, dr // 2) if neox else max(2, _B._pow2_width(rcap, dr))
    base = dict(qh=qh, dn=dn, dc=dc, dr=dr, bs=bs, split=bool(split), neox=bool(neox), full_table=bool(full_table),
                native=bool(native), dt=dt, tab_dt=tab_dt, cache_dt=cache_dt, q_dt=q_dt, slot64=bool(slot64),
                pos64=bool(pos64), w=w, rw=rw, layer_blocks=int(layer_blocks), latency=bool(latency))
    probe = MlaRocmConfig(**base, tpb=1, nt=64)
    per_token = sum(units(probe))
    if latency:
        nt = min(MAX_NT, -(-per_token // 64) * 64)
        return MlaRocmConfig(**base, tpb=1, nt=nt, parts=min(MAX_PARTS, -(-per_token // nt)))
    tpb = 1
    while tpb < 64 and 2 * tpb * per_token <= UNITS_PER_WORKGROUP:
        tpb *= 2
    return MlaRocmConfig(**base, tpb=tpb, nt=BANDWIDTH_NT, parts=1)


def emit_kernel_body(cfg: MlaRocmConfig, args: list, dialects=None) -> None:
    """Emits the kernel body. `args`: the kernel_args(cfg) i64 kernel arguments as MLIR values.
    `dialects`: (ir, arith, gpu, llvm, rocdl, scf, vector) modules to emit with (default FlyDSL's)."""
    E = _B._Emitter(cfg, dialects)
    ir = E.ir
    c32, c64 = E.i32c, E.i64c
    NC = 2 if cfg.split else 1
    NA, NR = num_operands(cfg.split), num_results(cfg.split)
    ptrs, dims = args[:NA + NR], args[NA + NR:NA + NR + NA]
    p_qn, p_qp, p_kvc, p_kpe = ptrs[:4]
    p_slot, p_pos, p_cos, p_sin, p_kvs, p_qs, p_layer = ptrs[4 + NC:11 + NC]
    p_qo, p_ko, p_c0 = ptrs[NA], ptrs[NA + 1], ptrs[NA + 2]
    p_c1 = ptrs[NA + 3] if cfg.split else None
    T, MAXPOS = dims[0], dims[6 + NC]

    s_in, s_tab, s_c, s_q = (ITEMSIZE[c] for c in (cfg.dt, cfg.tab_dt, cfg.cache_dt, cfg.q_dt))
    c_fp8, q_fp8 = cfg.cache_dt in FP8, cfg.q_dt in FP8
    mode = arith_mode(cfg)
    native_dt = cfg.dt if mode == "rounded" else None
    QH, DN, DC, DR, BS = cfg.qh, cfg.dn, cfg.dc, cfg.dr, cfg.bs
    HALF, DQ = DR // 2, DN + DR
    TW = DR if cfg.full_table else HALF
    ROW0 = DC if cfg.split else DC + DR
    W, RW, TPB, NT, PARTS = cfg.w, cfg.rw, cfg.tpb, cfg.nt, cfg.parts
    CN = DN // W
    CU, RU = units(cfg)
    P = RU // (QH + 1)
    NPAIR = RW if cfg.neox else RW // 2
    N_COPY, N_ROT = TPB * CU, TPB * RU
    N_ALL = N_COPY + N_ROT
    STRIDE = NT * PARTS
    RSE = rot_store_elems(cfg)
    BIG = c32(OOB_OFFSET)  # past every descriptor (span_problem): loads return 0, stores are dropped

    tid = E.tid()
    t0 = E.mul(E.ext64(E.bid()), c64(TPB))
    rows = E.arith.minsi(E.sub(T, t0), c64(TPB))  # valid tokens of this workgroup (>= 1)

    def row_rsrc(ptr, row_bytes):
        return E.rsrc(E.add(ptr, E.mul(t0, c64(row_bytes))), E.mul(rows, c64(row_bytes)))

    rs_qn, rs_qp = row_rsrc(p_qn, QH * DN * s_in), row_rsrc(p_qp, QH * DR * s_in)
    rs_kvc, rs_kpe = row_rsrc(p_kvc, DC * s_in), row_rsrc(p_kpe, DR * s_in)
    rs_qo, rs_ko = row_rsrc(p_qo, QH * DQ * s_q), row_rsrc(p_ko, DR * s_in)
    rs_slot = row_rsrc(p_slot, 8 if cfg.slot64 else 4)
    rs_pos = row_rsrc(p_pos, 8 if cfg.pos64 else 4)
    tab_bytes = E.mul(MAXPOS, c64(TW * s_tab))
    rs_cos, rs_sin = E.rsrc(p_cos, tab_bytes), E.rsrc(p_sin, tab_bytes)

    num_slots, slot_base = E.mul(dims[4], c64(BS)), c64(0)
    if cfg.layer_blocks:  # stacked [L, NB, ...]: NB static, L = dims[4]; a layer outside [0, L) writes nothing
        layer = E.sext64(E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_layer, c64(4)), c32(0), c32(0)))
        layer_ok = E.and1(E.cmp("sge", layer, c64(0)), E.cmp("slt", layer, dims[4]))
        per_layer = c64(cfg.layer_blocks * BS)
        num_slots = E.sel(layer_ok, per_layer, c64(0))
        slot_base = E.sel(layer_ok, E.mul(layer, per_layer), c64(0))

    def scale_inv(p):
        return E.inv_scale(E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p, c64(4)), c32(0), c32(0))))

    inv_kv = scale_inv(p_kvs) if c_fp8 else None
    inv_q = scale_inv(p_qs) if q_fp8 else None

    def load_index(rs, tl, is64):
        """int64 value of an index array at local token tl (i32)."""
        if is64:
            (_, w0), (_, w1) = E.piece_words(E.buf_load_words(rs, E.mul(tl, c32(8)), 8))
            return E.bor(E.ext64(w0), E.shl(E.ext64(w1), c64(32)))
        (_, w), = E.buf_load_words(rs, E.mul(tl, c32(4)), 4)
        return E.sext64(w)

    def slot_of(tl, ok):
        """(write?, the cache slot (i64, 0 when not written)) of local token tl; `ok`: the unit is real."""
        s = load_index(rs_slot, tl, cfg.slot64)
        w = E.and1(E.and1(E.cmp("sge", s, c64(0)), E.cmp("slt", s, num_slots)), E.cmp("slt", E.ext64(tl), rows))
        if ok is not None:
            w = E.and1(w, ok)
        return w, E.sel(w, E.add(s, slot_base), c64(0))

    def guarded(cond, fn):
        op = E.scf.IfOp(cond)
        with ir.InsertionPoint(op.then_block):
            fn()
            E.scf.YieldOp([])

    def branch(cond, then_fn, else_fn, types):
        """scf.if yielding `types` from then_fn() / else_fn() (lists of values)."""
        op = E.scf.IfOp(cond, types, has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.scf.YieldOp(then_fn())
        with ir.InsertionPoint(op.else_block):
            E.scf.YieldOp(else_fn())
        return list(op.results)

    def split_pieces(pieces, sizes):
        out, res = [], list(pieces)
        for n in sizes:
            out.append(list(zip(E._pieces(n), res[:len(E._pieces(n))])))
            res = res[len(E._pieces(n)):]
        return out

    def elem_pieces(vals, code, inv, max_elems):
        """f32 values as stored pieces of dtype `code` (quantized with inv for fp8), no piece wider
        than max_elems elements (its alignment)."""
        bits = [E.to_bits(v, code, inv) for v in vals]
        sc = ITEMSIZE[code]
        out = []
        for g in range(0, len(bits), max_elems):
            grp = bits[g:g + max_elems]
            words = E.pack_bits(grp, sc)
            out += E.words_to_pieces(words) if sc * len(grp) >= 4 else words
        return out

    def out_vals(ys, code):
        """What an output of dtype `code` stores of the rotation's f32 results: fp8 quantizes the
        value rounded to the input dtype, or in "fused" arithmetic (or f32 inputs) the f32 value."""
        if code in FP8 and not (cfg.dt == F32 or mode == "fused"):
            return [E.round_to(v, cfg.dt) for v in ys]
        return ys

    def ok_off(ok, off):
        return off if ok is None else E.sel(ok, off, BIG)

    # ------------------------------ copy units ------------------------------
    def copy_load(u, ok):
        """Loads of copy unit u (i32; ok: i1 'u is a unit', or None): q_nope chunk or kv_c chunk + its slot."""
        tl = E.arith.divui(u, c32(CU))
        r = E.arith.remui(u, c32(CU))
        is_q = E.cmp("ult", r, c32(QH * CN))
        nb = W * s_in
        off_q = ok_off(ok, E.add(E.mul(tl, c32(QH * DN * s_in)), E.mul(r, c32(nb))))
        jl = E.sub(r, c32(QH * CN))
        off_l = ok_off(ok, E.add(E.mul(tl, c32(DC * s_in)), E.mul(jl, c32(nb))))
        sizes = E._pieces(nb)
        types = [E._raw_type(p) for p in sizes] + [E.i1, E.i64]

        def q():
            return [v for _, v in E.buf_load_words(rs_qn, off_q, nb)] + [E.c(0, E.i1), c64(0)]

        def lat():
            w, s = slot_of(tl, ok)
            return [v for _, v in E.buf_load_words(rs_kvc, off_l, nb)] + [w, s]

        res = branch(is_q, q, lat, types)
        return dict(tl=tl, r=r, is_q=is_q, jl=jl, ok=ok, data=list(zip(sizes, res[:len(sizes)])),
                    w=res[len(sizes)], s=res[len(sizes) + 1])

    def copy_store(st):
        tl, r, data, ok = st["tl"], st["r"], st["data"], st["ok"]

        def q():
            h, j = E.arith.divui(r, c32(CN)), E.arith.remui(r, c32(CN))
            off = E.add(E.mul(E.add(E.mul(tl, c32(QH)), h), c32(DQ * s_q)), E.mul(j, c32(W * s_q)))
            if cfg.q_dt == cfg.dt:
                pieces = data
            else:
                pieces = elem_pieces(E.elems_from_pieces(data, cfg.dt, W), cfg.q_dt, inv_q, W)
            E.buf_store_pieces(pieces, rs_qo, ok_off(ok, off))
            return []

        def lat():
            def body():
                el = E.add(E.mul(st["s"], c64(ROW0)), E.ext64(E.mul(st["jl"], c32(W))))
                if cfg.cache_dt == cfg.dt:
                    pieces = data
                else:
                    pieces = elem_pieces(E.elems_from_pieces(data, cfg.dt, W), cfg.cache_dt, inv_kv, W)
                E.global_store_pieces(pieces, E.add(p_c0, E.mul(el, c64(s_c))))
            guarded(st["w"], body)
            return []

        branch(st["is_q"], q, lat, [])

    # ------------------------------ rotation units ------------------------------
    def rot_load(v, ok):
        """Loads of rotation unit v (i32): its chunk(s) of q_pe (h < QH) or k_pe (h == QH), and its position."""
        tl = E.arith.divui(v, c32(RU))
        r = E.arith.remui(v, c32(RU))
        h, j = E.arith.divui(r, c32(P)), E.arith.remui(r, c32(P))
        is_k = E.cmp("eq", h, c32(QH))
        nb = RW * s_in
        col = E.mul(j, c32(RW * s_in))
        off_q = ok_off(ok, E.add(E.mul(E.add(E.mul(tl, c32(QH)), h), c32(DR * s_in)), col))
        off_k = ok_off(ok, E.add(E.mul(tl, c32(DR * s_in)), col))
        n_ch = 2 if cfg.neox else 1
        sizes = [nb] * n_ch

        def ld(rs, off):
            out = []
            for c in range(n_ch):
                o = off if c == 0 else E.add(off, c32(HALF * s_in))
                out += [x for _, x in E.buf_load_words(rs, o, nb)]
            return out

        res = branch(is_k, lambda: ld(rs_kpe, off_k), lambda: ld(rs_qp, off_q),
                     [E._raw_type(p) for n in sizes for p in E._pieces(n)])
        pos = load_index(rs_pos, tl, cfg.pos64)
        return dict(tl=tl, h=h, j=j, is_k=is_k, ok=ok, data=split_pieces(res, sizes), pos=pos)

    def rot_finish(st):
        tl, h, j, is_k, ok = st["tl"], st["h"], st["j"], st["is_k"], st["ok"]
        pos = E.arith.maxsi(E.arith.minsi(st["pos"], E.sub(MAXPOS, c64(1))), c64(0))
        row = E.mul(E.trunc32(pos), c32(TW * s_tab))  # 32-bit: tables < TABLE_BYTES_LIMIT (refused at lowering)

        def tab(rs, first, n):
            off = E.add(row, E.add(E.mul(j, c32(n * s_tab)), c32(first * s_tab)))
            return E.elems_from_pieces(E.buf_load_words(rs, off, n * s_tab), cfg.tab_dt, n)

        if cfg.neox:
            ca, sa = tab(rs_cos, 0, NPAIR), tab(rs_sin, 0, NPAIR)
            cb, sb = (tab(rs_cos, HALF, NPAIR), tab(rs_sin, HALF, NPAIR)) if cfg.full_table else (ca, sa)
            xa = E.elems_from_pieces(st["data"][0], cfg.dt, RW)
            xb = E.elems_from_pieces(st["data"][1], cfg.dt, RW)
        else:
            if cfg.full_table:
                cf, sf = tab(rs_cos, 0, RW), tab(rs_sin, 0, RW)
                ca, cb, sa, sb = cf[0::2], cf[1::2], sf[0::2], sf[1::2]
            else:
                ca, sa = tab(rs_cos, 0, NPAIR), tab(rs_sin, 0, NPAIR)
                cb, sb = ca, sa
            x = E.elems_from_pieces(st["data"][0], cfg.dt, RW)
            xa, xb = x[0::2], x[1::2]
        ya, yb = _base().rotate_pairs(E, mode, native_dt, xa, xb, ca, sa, cb, sb)
        if cfg.neox:
            chunks = [(0, ya), (HALF, yb)]  # (first channel, values)
        else:
            inter = []
            for a, b in zip(ya, yb):
                inter += [a, b]
            chunks = [(0, inter)]

        def store_buf(rs, base_off, s_out, code, inv, max_elems):
            for first, ys in chunks:
                off = E.add(base_off, E.add(E.mul(j, c32(RW * s_out)), c32(first * s_out)))
                E.buf_store_pieces(elem_pieces(out_vals(ys, code), code, inv, max_elems), rs, ok_off(ok, off))

        def k():
            store_buf(rs_ko, E.mul(tl, c32(DR * s_in)), s_in, cfg.dt, None, RW)
            w, s = slot_of(tl, ok)

            def body():
                base, p = (E.mul(s, c64(DR)), p_c1) if cfg.split else (E.add(E.mul(s, c64(ROW0)), c64(DC)), p_c0)
                for first, ys in chunks:
                    el = E.add(base, E.ext64(E.add(E.mul(j, c32(RW)), c32(first))))
                    pieces = elem_pieces(out_vals(ys, cfg.cache_dt), cfg.cache_dt, inv_kv, RW if cfg.split else RSE)
                    E.global_store_pieces(pieces, E.add(p, E.mul(el, c64(s_c))))
            guarded(w, body)
            return []

        def q():
            base = E.add(E.mul(E.add(E.mul(tl, c32(QH)), h), c32(DQ * s_q)), c32(DN * s_q))
            store_buf(rs_qo, base, s_q, cfg.q_dt, inv_q, RSE)
            return []

        branch(is_k, k, q, [])

    # ------------------------------ the lane's units ------------------------------
    u0 = E.add(E.mul(E.bid_y(), c32(NT)), tid) if PARTS > 1 else tid
    n_iter = -(-N_ALL // STRIDE)
    full = []  # (kind, k) of whole iterations of one kind, in order

    def flush():
        """Every load of the queued iterations, then (per unit) their tables and stores."""
        states = []
        for kind, k in full:
            u = E.add(u0, c32(k * STRIDE)) if k else u0
            states.append((kind, copy_load(u, None) if kind == "copy" else rot_load(E.sub(u, c32(N_COPY)), None)))
        for kind, st in states:
            copy_store(st) if kind == "copy" else rot_finish(st)
        full.clear()

    for k in range(n_iter):
        lo, hi = k * STRIDE, (k + 1) * STRIDE
        if hi <= N_COPY or (lo >= N_COPY and hi <= N_ALL):
            if full and (full[-1][0] != ("copy" if hi <= N_COPY else "rot") or len(full) == GROUP):
                flush()
            full.append(("copy" if hi <= N_COPY else "rot", k))
            continue
        flush()
        u = E.add(u0, c32(k * STRIDE)) if k else u0
        if lo < N_COPY:  # the copy units end in this iteration
            ok = E.cmp("ult", u, c32(N_COPY))
            guarded(ok, lambda u=u: copy_store(copy_load(u, None)))
        if hi > N_COPY:
            ok = E.and1(E.cmp("uge", u, c32(N_COPY)), E.cmp("ult", u, c32(N_ALL)))
            guarded(ok, lambda u=u: rot_finish(rot_load(E.sub(u, c32(N_COPY)), None)))
    flush()


def build_launcher(cfg: MlaRocmConfig):
    """A @flyc.jit function of NUM_ARGS Int64 arguments launching the kernel for `cfg`, which takes
    the first kernel_args(cfg) of them (27 combined, 30 split)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    def _raw(v):
        return v.ir_value() if hasattr(v, "ir_value") else v

    if cfg.split:
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_mla_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                          a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                          a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                          a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                          a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13,
                                                     a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25,
                                                     a26, a27, a28, a29)])
    else:
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_mla_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                          a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                          a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                          a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                          a24: fx.Int64, a25: fx.Int64, a26: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13,
                                                     a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25,
                                                     a26)])

    n = kernel_args(cfg)

    @flyc.jit
    def jrc_mla_launch(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                       a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                       a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                       a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                       a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64):
        every = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
                 a22, a23, a24, a25, a26, a27, a28, a29)
        jrc_mla_cache(*every[:n]).launch(grid=(1, 1, 1), block=(cfg.nt, 1, 1))

    return jrc_mla_launch
