"""rope_and_cache as ONE FlyDSL kernel for AMD GPUs (gfx942 / gfx950), compiled without a GPU.

Static configuration: a `RocmKernelConfig` (jax_rope_cache/rocm.py builds it from an OpSpec).
Every option of the op contract is a compile-time parameter: NeoX / GPT-J pairing, partial
rotary (R < D), "half" / "full" cos/sin tables, the three cache layouts, bf16/f16/f32 inputs,
bf16/f16/f32 tables, caches of the input dtype or float8 e4m3fn / e4m3fnuz (both formats on both
archs: the conversion is integer arithmetic, not the hardware's fp8 instructions), per-tensor
k/v scales, "fp32" and "native" precision, int32/int64 slot_mapping and positions, one cache or
stacked per-layer caches [L, NB, ...] (`layer_blocks` = NB) with the layer read on the device.

Kernel ABI (what kernels/ffi/gpu_launcher.cc packs): 32 kernel arguments of 8 bytes each, at
byte offsets 0, 8, ..., 248 (kernarg segment 256 bytes, no hidden arguments):
  0..13   device addresses of the operands  q, k, v, key_cache, value_cache, slot_mapping,
          positions, cos, sin, k_scale, v_scale (f32 [] or [KH]), layer (int32 scalar),
          q_norm_weight, k_norm_weight ([D], or an f32[1] placeholder when absent)
  14..17  device addresses of the results   q_out, k_out, key_cache_out, value_cache_out
  18..31  int64 dim0 of each operand (T = dim0[0], NB = dim0[3] (stacked: L), max_pos = dim0[7])
Grid: (ceil(T / TPB), 1, 1) workgroups of NT threads (NT is the required workgroup size).

Work decomposition. A workgroup owns TPB consecutive tokens. Three phases run one after the other
(no shared memory, no barriers); each maps its lanes as (token sub-slot, head slot, chunk):
  * rot  : the rotary channels of the QH + KH heads. A lane owns one chunk of W rotary pairs
           (NeoX: channels [cW, cW+W) and [R/2+cW, R/2+cW+W): two 16-byte loads; GPT-J: one
           chunk of W channels holding W/2 pairs). It loads its cos/sin chunk ONCE per token and
           reuses it for every Q and K head it visits. K heads also write the key cache.
  * pass : channels >= R of every Q and K head (copied; K also to the key cache). Only if R < D.
  * v    : V heads copied into the value cache.
All loads of a (token, phase) iteration are issued before the first store; a lane makes one access
per chunk (Q and K heads branch on the head kind, which is uniform per wave whenever QH is a
multiple of the heads one wave covers). q/k/v/q_out/k_out and
the tables are accessed with 32-bit-offset buffer instructions through descriptors based at the
workgroup's first token row, whose size covers only the valid rows (the hardware drops accesses
past T). The caches (any size) are written with 64-bit global stores.

Bounds: positions clamped to [0, max_pos - 1] (in 64-bit); a cache row is written only when the
token exists (t < T) and 0 <= slot < NB*BS (64-bit compare; stacked: and 0 <= layer < L, the row
then lands in layer `layer`). Offsets into the caches are 64-bit.
Arithmetic (bit-exact with jax_rope_cache.reference and kernels/common/rope_cache_math.h):
`arith_mode` picks "fp32", native "rounded" (tables in the input dtype) or native "fused" (any
other table dtype, or f32 inputs). fp32 and "rounded" use separate f32 multiply / add / subtract
(no contraction: no fast-math flags are set, and the compile-only test checks their ISA has no
FMA/MAD); "fused" makes its first product an llvm.intr.fma (v_fma_f32, one rounding) and an fp8
key cache then quantizes the f32 values before the final rounding. bf16 and fp8 rounding in
integer arithmetic (round to nearest even, fp8 saturates), f16 by the hardware conversion (RNE);
every NaN written is the canonical one of rope_cache_math.h (bf16/f16 0x7FFF, f32 0x7FFFFFFF,
e4m3fn 0x7F, e4m3fnuz 0x80). 1/scale by a correctly rounded f32 division, an overflow to +-inf
replaced by +-FLT_MAX (rc_inv_scale). Tables are never rounded.
"""

import dataclasses

KERNEL_BASENAME = "jrc_rope_cache"
NUM_ARGS = 32
NUM_OPERANDS = 14
ARG_BYTES = 8

# dtype codes: jax_rope_cache/_spec.py DTYPE_CODES
F32, BF16, F16, FP8_FN, FP8_FNUZ = 0, 1, 2, 3, 4
ITEMSIZE = {F32: 4, BF16: 2, F16: 2, FP8_FN: 1, FP8_FNUZ: 1}
FLASH, XPACKED, XPACKED_SHUFFLED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class RocmKernelConfig:
    qh: int
    kh: int
    d: int
    r: int
    bs: int
    layout: int        # 0 flash, 1 xpacked, 2 xpacked_shuffled
    neox: bool
    full_table: bool
    native: bool       # "native" precision (arith_mode: "rounded" or "fused")
    dt: int            # q/k/v dtype code
    tab_dt: int        # cos/sin dtype code
    cache_dt: int      # cache dtype code
    slot64: bool
    pos64: bool
    w_rot: int         # elements per rotation chunk (pairs per lane for NeoX, channels for GPT-J)
    w_pass: int        # elements per pass-through chunk
    w_v: int           # elements per V chunk
    tpb: int           # tokens per workgroup
    nt: int            # threads per workgroup
    layer_blocks: int = 0  # 0: one cache [NB, ...]; NB: stacked caches [L, NB, ...]

    @property
    def x(self) -> int:
        return 16 // ITEMSIZE[self.cache_dt]

    def key(self) -> str:
        f = dataclasses.astuple(self)
        return "_".join(str(int(v)) for v in f)


def arith_mode(cfg: RocmKernelConfig) -> str:
    """"fp32", or native "rounded" (tables in the 16-bit input dtype) / "fused" (anything else):
    rc_arith of rope_cache_math.h, reference.arithmetic."""
    if not cfg.native:
        return "fp32"
    return "rounded" if cfg.dt == cfg.tab_dt and cfg.dt in (BF16, F16) else "fused"


def _pow2_width(max_elems: int, *divides: int) -> int:
    w = max_elems
    while w > 1 and any(n % w for n in divides):
        w //= 2
    return max(1, w)


def phase_geometry(cpx: int, nh: int, nt: int) -> tuple[int, int]:
    """(heads in parallel, tokens in parallel) for a phase of `cpx` chunks per head."""
    hp = max(1, min(nh, nt // cpx))
    ts = max(1, nt // (cpx * hp))
    return hp, ts


def make_config(*, qh, kh, d, r, bs, layout, neox, full_table, native, dt, tab_dt, cache_dt, slot64,
                pos64, layer_blocks: int = 0, nt: int = 256, rot_cap: int | None = None,
                width_cap: int | None = None) -> RocmKernelConfig:
    """`rot_cap` / `width_cap`: at most that many elements per rotation chunk / per pass-through and
    V chunk (narrower accesses, fewer values in flight per lane: the occupancy candidates of
    jax_rope_cache/backends/rocm.py; None = as wide as 16 bytes and the shape allow)."""
    s = ITEMSIZE[dt]
    vmax = 16 // s
    w_rot = _pow2_width(min(vmax, rot_cap or vmax), r // 2) if neox else _pow2_width(min(vmax, rot_cap or vmax), r)
    if not neox and w_rot < 2:
        w_rot = 2
    wmax = min(vmax, width_cap or vmax)
    w_pass = _pow2_width(wmax, r, d) if r < d else 1
    w_v = _pow2_width(wmax, d)
    cpx_rot = (r // 2) // w_rot if neox else r // w_rot
    nt = max(64, min(nt, 1024))
    while nt > 64 and cpx_rot * (qh + kh) <= nt // 2 and cpx_rot * (qh + kh) * 4 < 64:
        nt //= 2  # tiny heads: keep the workgroup small rather than idle
    _, ts = phase_geometry(cpx_rot, qh + kh, nt)
    tpb = ts
    return RocmKernelConfig(qh=qh, kh=kh, d=d, r=r, bs=bs, layout=layout, neox=bool(neox),
                            full_table=bool(full_table), native=bool(native), dt=dt, tab_dt=tab_dt,
                            cache_dt=cache_dt, slot64=bool(slot64), pos64=bool(pos64), w_rot=w_rot,
                            w_pass=w_pass, w_v=w_v, tpb=tpb, nt=nt, layer_blocks=int(layer_blocks))


# ------------------------------------------------------------------------------------------------
# IR emission (runs inside a FlyDSL trace; imports flydsl lazily so this module imports anywhere)
# ------------------------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, cfg: RocmKernelConfig, dialects=None):
        if dialects is None:  # FlyDSL's MLIR bindings; tests pass a numpy interpreter with the same API
            from flydsl._mlir import ir
            from flydsl._mlir.dialects import arith, gpu, llvm, rocdl, scf, vector
        else:
            ir, arith, gpu, llvm, rocdl, scf, vector = dialects

        self.cfg = cfg
        self.ir, self.arith, self.gpu, self.llvm, self.rocdl, self.scf, self.vector = (
            ir, arith, gpu, llvm, rocdl, scf, vector)
        self.i1 = ir.IntegerType.get_signless(1)
        self.i8 = ir.IntegerType.get_signless(8)
        self.i16 = ir.IntegerType.get_signless(16)
        self.i32 = ir.IntegerType.get_signless(32)
        self.i64 = ir.IntegerType.get_signless(64)
        self.f32 = ir.F32Type.get()
        self.f16 = ir.F16Type.get()
        self.ptr0 = ir.Type.parse("!llvm.ptr")
        self.ptr1 = ir.Type.parse("!llvm.ptr<1>")
        self.ptr8 = ir.Type.parse("!llvm.ptr<8>")

    # ---- scalars ----
    def c(self, v: int, ty=None):
        ty = ty or self.i32
        if ty == self.f32:
            return self.arith.ConstantOp(ty, self.ir.FloatAttr.get(ty, float(v))).result
        width = self.ir.IntegerType(ty).width
        v = int(v) & ((1 << width) - 1)
        if v >= 1 << (width - 1):
            v -= 1 << width
        return self.arith.ConstantOp(ty, self.ir.IntegerAttr.get(ty, v)).result

    def add(self, a, b):
        return self.arith.addi(a, b)

    def sub(self, a, b):
        return self.arith.subi(a, b)

    def mul(self, a, b):
        return self.arith.muli(a, b)

    def band(self, a, b):
        return self.arith.andi(a, b)

    def bor(self, a, b):
        return self.arith.ori(a, b)

    def shl(self, a, b):
        return self.arith.shli(a, b)

    def lshr(self, a, b):
        return self.arith.shrui(a, b)

    def cmp(self, pred: str, a, b):
        P = self.arith.CmpIPredicate
        return self.arith.cmpi(getattr(P, pred), a, b)

    def sel(self, c, a, b):
        return self.arith.select(c, a, b)

    def and1(self, a, b):
        return self.arith.andi(a, b)

    def i32c(self, v):
        return self.c(v, self.i32)

    def i64c(self, v):
        return self.c(v, self.i64)

    def ext64(self, v):
        return self.arith.extui(self.i64, v)

    def sext64(self, v):
        return self.arith.extsi(self.i64, v)

    def trunc32(self, v):
        return self.arith.trunci(self.i32, v)

    def bitcast(self, ty, v):
        return self.arith.bitcast(ty, v)

    # ---- memory ----
    def rsrc(self, addr_i64, nbytes_i64):
        """Buffer descriptor over [addr, addr + nbytes) (nbytes clamped to 32 bits)."""
        base = self.llvm.inttoptr(self.ptr0, addr_i64)
        n = self.arith.minui(nbytes_i64, self.i64c(0xFFFFFFFF))
        flags = self.i32c((7 << 12) | (4 << 15))  # CDNA: DATA_FORMAT 32, NUM_FORMAT float; raw
        return self.rocdl.make_buffer_rsrc(self.ptr8, base, self.c(0, self.i16), n, flags)

    def _raw_type(self, nbytes: int):
        if nbytes == 1:
            return self.i8
        if nbytes == 2:
            return self.i16
        if nbytes == 4:
            return self.i32
        assert nbytes % 4 == 0 and nbytes <= 16, nbytes
        return self.ir.VectorType.get([nbytes // 4], self.i32)

    @staticmethod
    def _pieces(nbytes: int) -> list[int]:
        out = []
        while nbytes > 0:
            p = min(16, nbytes)
            if p not in (1, 2, 4, 8, 12, 16):
                p = 8 if p > 8 else (4 if p > 4 else p)
            out.append(p)
            nbytes -= p
        return out

    def buf_load_words(self, rsrc, off_i32, nbytes: int) -> list:
        """Loads nbytes at byte offset off; returns raw pieces (i8/i16/i32/vector<Nxi32>)."""
        res, pos = [], 0
        for p in self._pieces(nbytes):
            o = off_i32 if pos == 0 else self.add(off_i32, self.i32c(pos))
            res.append((p, self.rocdl.raw_ptr_buffer_load(self._raw_type(p), rsrc, o, self.i32c(0))))
            pos += p
        return res

    def buf_store_pieces(self, pieces, rsrc, off_i32):
        pos = 0
        for p, val in pieces:
            o = off_i32 if pos == 0 else self.add(off_i32, self.i32c(pos))
            self.rocdl.raw_ptr_buffer_store(val, rsrc, o, self.i32c(0))
            pos += p

    def global_store_pieces(self, pieces, addr_i64):
        pos = 0
        for p, val in pieces:
            a = addr_i64 if pos == 0 else self.add(addr_i64, self.i64c(pos))
            ptr = self.llvm.inttoptr(self.ptr1, a)
            self.llvm.StoreOp(val, ptr, alignment=min(p, 16))
            pos += p

    def piece_words(self, pieces) -> list:
        """Raw pieces -> list of (bytes, i32/i16/i8 scalar) in memory order."""
        out = []
        for p, val in pieces:
            if p <= 4:
                out.append((p, val))
            else:
                for j in range(p // 4):
                    out.append((4, self.vector.extract(val, [], [j])))
        return out

    def words_to_pieces(self, words: list) -> list:
        """list of (bytes, scalar) in memory order, total a multiple of the piece sizes -> pieces."""
        nbytes = sum(b for b, _ in words)
        if nbytes < 4:
            assert len(words) == 1
            return words
        pieces, i = [], 0
        for p in self._pieces(nbytes):
            group = []
            got = 0
            while got < p:
                group.append(words[i][1])
                got += words[i][0]
                i += 1
            if p == 4:
                pieces.append((4, group[0]))
            else:
                vt = self.ir.VectorType.get([p // 4], self.i32)
                pieces.append((p, self.vector.from_elements(vt, group)))
        return pieces

    # ---- element conversions ----
    def elems_from_pieces(self, pieces, code: int, n: int) -> list:
        """Raw loaded pieces holding n elements of dtype `code` -> n f32 values."""
        words = self.piece_words(pieces)
        vals = []
        for b, w in words:
            if code == F32:
                vals.append(self.bitcast(self.f32, w))
                continue
            w32 = w if b == 4 else self.arith.extui(self.i32, w)
            for k in range(b // 2):
                h = self.lshr(w32, self.i32c(16 * k)) if k else w32
                if code == BF16:
                    bits = self.shl(h, self.i32c(16)) if k == 0 else self.band(w32, self.i32c(0xFFFF0000))
                    vals.append(self.bitcast(self.f32, bits))
                else:
                    h16 = self.arith.trunci(self.i16, h)
                    vals.append(self.arith.extf(self.f32, self.bitcast(self.f16, h16)))
        assert len(vals) == n, (len(vals), n)
        return vals

    def is_nan_bits(self, u):
        return self.cmp("ugt", self.band(u, self.i32c(0x7FFFFFFF)), self.i32c(0x7F800000))

    def f32_to_bf16_bits(self, f):
        u = self.bitcast(self.i32, f)
        r = self.lshr(self.add(self.add(u, self.i32c(0x7FFF)), self.band(self.lshr(u, self.i32c(16)), self.i32c(1))),
                      self.i32c(16))
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFF), r)  # canonical NaN

    def f32_to_f16_bits(self, f):
        u = self.bitcast(self.i32, f)
        h = self.arith.extui(self.i32, self.bitcast(self.i16, self.arith.truncf(self.f16, f)))
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFF), h)  # canonical NaN

    def canonical_f32_bits(self, f):
        u = self.bitcast(self.i32, f)
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFFFFFF), u)

    def inv_scale(self, scale):
        """rc_inv_scale: r32(1 / scale), +-inf replaced by +-FLT_MAX."""
        u = self.bitcast(self.i32, self.arith.divf(self.c(1, self.f32), scale))
        sign = self.band(u, self.i32c(0x80000000))
        is_inf = self.cmp("eq", self.band(u, self.i32c(0x7FFFFFFF)), self.i32c(0x7F800000))
        return self.bitcast(self.f32, self.sel(is_inf, self.bor(sign, self.i32c(0x7F7FFFFF)), u))

    def round_to(self, f, code: int):
        """f32 value rounded to dtype `code` and back (native precision)."""
        if code == BF16:
            return self.bitcast(self.f32, self.shl(self.f32_to_bf16_bits(f), self.i32c(16)))
        if code == F16:
            return self.arith.extf(self.f32, self.arith.truncf(self.f16, f))
        return f

    def _rne_shift(self, m, s):
        """m >> s rounded to nearest even; s an i32 value in [1, 31]."""
        kept = self.lshr(m, s)
        one = self.i32c(1)
        rem = self.band(m, self.sub(self.shl(one, s), one))
        half = self.shl(one, self.sub(s, one))
        up = self.arith.ori(self.cmp("ugt", rem, half),
                            self.and1(self.cmp("eq", rem, half), self.cmp("ne", self.band(kept, one), self.i32c(0))))
        return self.add(kept, self.arith.extui(self.i32, up))

    def f32_to_fp8_bits(self, f, fnuz: bool):
        """rc_f32_to_fp8 of rope_cache_math.h (saturating e4m3fn / e4m3fnuz, RNE)."""
        c = self.i32c
        x0 = self.bitcast(self.i32, f)
        sign = self.band(self.lshr(x0, c(24)), c(0x80))
        x = self.band(x0, c(0x7FFFFFFF))
        bias = 8 if fnuz else 7
        max_code = 0x7F if fnuz else 0x7E
        e = self.lshr(x, c(23))
        # normal e4m3 range
        rebased = self.sub(x, c((127 - bias) << 23))
        code_n = self._rne_shift(rebased, c(20))
        code_n = self.sel(self.cmp("ugt", e, c(127 + 9)), c(max_code + 1), code_n)
        code_n = self.arith.minui(code_n, c(max_code))
        # subnormal e4m3 range: shift = 148 - bias - e, clamped to [1, 31] for the shift itself
        shift = self.sub(c(148 - bias), e)
        sh = self.arith.minui(self.arith.maxsi(shift, c(1)), c(31))
        mant = self.bor(self.band(x, c(0x7FFFFF)), c(0x800000))
        code_s = self._rne_shift(mant, sh)
        zero_s = self.arith.ori(self.cmp("sgt", shift, c(25)), self.cmp("eq", e, c(0)))
        code_s = self.sel(zero_s, c(0), code_s)
        code = self.sel(self.cmp("uge", e, c(128 - bias)), code_n, code_s)
        out = self.bor(sign, code)
        if fnuz:
            out = self.sel(self.cmp("eq", code, c(0)), c(0), out)
        nan = c(0x80 if fnuz else 0x7F)  # canonical NaN
        return self.sel(self.cmp("ugt", x, c(0x7F800000)), nan, out)

    def pack_bits(self, bits: list, elem_bytes: int) -> list:
        """Element bit patterns (i32 each, low bits used) -> list of (bytes, word) for storing."""
        per = 4 // elem_bytes if elem_bytes < 4 else 1
        n = len(bits)
        if elem_bytes * n < 4:  # 1 or 2 bytes in total
            tot = elem_bytes * n
            w = bits[0]
            for k in range(1, n):
                w = self.bor(w, self.shl(bits[k], self.i32c(8 * elem_bytes * k)))
            return [(tot, self.arith.trunci(self.i8 if tot == 1 else self.i16, w))]
        words = []
        for j in range(0, n, per):
            w = bits[j]
            for k in range(1, per):
                w = self.bor(w, self.shl(bits[j + k], self.i32c(8 * elem_bytes * k)))
            words.append((4, w))
        return words

    def to_bits(self, f, code: int, inv_scale=None):
        if code == F32:
            return self.canonical_f32_bits(f)
        if code == BF16:
            return self.f32_to_bf16_bits(f)
        if code == F16:
            return self.f32_to_f16_bits(f)
        return self.f32_to_fp8_bits(self.arith.mulf(f, inv_scale), code == FP8_FNUZ)

    def store_elems_pieces(self, vals: list, code: int, inv_scale=None) -> list:
        bits = [self.to_bits(v, code, inv_scale) for v in vals]
        return self.words_to_pieces(self.pack_bits(bits, ITEMSIZE[code]))

    # ---- thread / block ----
    def tid(self):
        return self.arith.index_cast(self.i32, self.gpu.thread_id(self.gpu.Dimension.x))

    def bid(self):
        return self.arith.index_cast(self.i32, self.gpu.block_id(self.gpu.Dimension.x))


def emit_kernel_body(cfg: RocmKernelConfig, args: list, dialects=None) -> None:
    """Emits the kernel body. `args`: the NUM_ARGS i64 kernel arguments as MLIR values.
    `dialects`: (ir, arith, gpu, llvm, rocdl, scf, vector) modules to emit with (default FlyDSL's)."""
    E = _Emitter(cfg, dialects)
    ir = E.ir
    c32, c64 = E.i32c, E.i64c
    (p_q, p_k, p_v, _p_kc, _p_vc, p_slot, p_pos, p_cos, p_sin, p_ks, p_vs, p_layer, _p_qw, _p_kw,
     p_qo, p_ko, p_kco, p_vco) = args[:NUM_OPERANDS + 4]
    dims = args[NUM_OPERANDS + 4:NUM_ARGS]
    T, NB, MAXPOS = dims[0], dims[3], dims[7]

    s_in = ITEMSIZE[cfg.dt]
    s_tab = ITEMSIZE[cfg.tab_dt]
    s_c = ITEMSIZE[cfg.cache_dt]
    fp8 = cfg.cache_dt in (FP8_FN, FP8_FNUZ)
    D, R, QH, KH, BS, X = cfg.d, cfg.r, cfg.qh, cfg.kh, cfg.bs, cfg.x
    RH = QH + KH
    TPB = cfg.tpb
    tw = R if cfg.full_table else R // 2
    mode = arith_mode(cfg)
    native_dt = cfg.dt if mode == "rounded" else None

    tid = E.tid()
    bid = E.bid()
    t0 = E.mul(E.ext64(bid), c64(TPB))                       # first token of this workgroup
    rows = E.arith.minsi(E.sub(T, t0), c64(TPB))              # valid tokens here (>= 1)

    def row_rsrc(ptr, row_bytes):
        base = E.add(ptr, E.mul(t0, c64(row_bytes)))
        return E.rsrc(base, E.mul(rows, c64(row_bytes)))

    rs_q = row_rsrc(p_q, QH * D * s_in)
    rs_k = row_rsrc(p_k, KH * D * s_in)
    rs_v = row_rsrc(p_v, KH * D * s_in)
    rs_qo = row_rsrc(p_qo, QH * D * s_in)
    rs_ko = row_rsrc(p_ko, KH * D * s_in)
    rs_slot = row_rsrc(p_slot, 8 if cfg.slot64 else 4)
    rs_pos = row_rsrc(p_pos, 8 if cfg.pos64 else 4)
    tab_bytes = E.mul(MAXPOS, c64(tw * s_tab))
    rs_cos = E.rsrc(p_cos, tab_bytes)
    rs_sin = E.rsrc(p_sin, tab_bytes)
    num_slots, slot_base = E.mul(NB, c64(BS)), c64(0)
    if cfg.layer_blocks:  # stacked [L, NB, ...]: NB is static, L = dims[3]; a layer outside [0, L) writes nothing
        layer = E.sext64(E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_layer, c64(4)), c32(0), c32(0)))
        layer_ok = E.and1(E.cmp("sge", layer, c64(0)), E.cmp("slt", layer, dims[3]))
        per_layer = c64(cfg.layer_blocks * BS)
        num_slots = E.sel(layer_ok, per_layer, c64(0))
        slot_base = E.sel(layer_ok, E.mul(layer, per_layer), c64(0))

    inv_k = inv_v = None
    if fp8:
        one = E.c(1, E.f32)
        ks = E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_ks, c64(4)), c32(0), c32(0)))
        vs = E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_vs, c64(4)), c32(0), c32(0)))
        inv_k = E.inv_scale(ks)
        inv_v = E.inv_scale(vs)

    def load_index(rs, tl, is64):
        """int64 value of an index array at local token tl (i32)."""
        if is64:
            pieces = E.buf_load_words(rs, E.mul(tl, c32(8)), 8)
            (_, w0), (_, w1) = E.piece_words(pieces)
            return E.bor(E.ext64(w0), E.shl(E.ext64(w1), c64(32)))
        (_, w), = E.buf_load_words(rs, E.mul(tl, c32(4)), 4)
        return E.sext64(w)

    def token_slot(tl, tvalid):
        """(write?, cache slot as i64 made safe (0 when not written)); stacked: the layer's slot."""
        s = load_index(rs_slot, tl, cfg.slot64)
        ok = E.and1(E.and1(E.cmp("sge", s, c64(0)), E.cmp("slt", s, num_slots)), tvalid)
        return ok, E.sel(ok, E.add(s, slot_base), c64(0))

    def k_cache_addr(s, h, d0: int | None, dvar=None):
        """Byte address in the key cache of element d of head h for slot s (i64)."""
        hh = c64(h) if isinstance(h, int) else E.ext64(h)
        if cfg.layout == FLASH:
            el = E.mul(E.add(E.mul(s, c64(KH)), hh), c64(D))
            el = E.add(el, c64(d0)) if dvar is None else E.add(el, dvar)
        else:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            d = c64(d0) if dvar is None else dvar
            grp = E.arith.divui(d, c64(X))
            el = E.mul(E.add(E.mul(blk, c64(KH)), hh), c64(D // X))
            el = E.add(el, grp)
            el = E.add(E.mul(el, c64(BS)), off)
            el = E.add(E.mul(el, c64(X)), E.arith.remui(d, c64(X)))
        return E.add(p_kco, E.mul(el, c64(s_c)))

    def v_cache_addr(s, hh64, d64):
        if cfg.layout == FLASH:
            el = E.add(E.mul(E.add(E.mul(s, c64(KH)), hh64), c64(D)), d64)
        else:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            bh = E.add(E.mul(blk, c64(KH)), hh64)
            if cfg.layout == XPACKED:
                el = E.add(E.mul(E.add(E.mul(bh, c64(D)), d64), c64(BS)), off)
            else:
                el = E.add(E.mul(bh, c64(BS // X)), E.arith.divui(off, c64(X)))
                el = E.add(E.mul(E.add(E.mul(el, c64(D)), d64), c64(X)), E.arith.remui(off, c64(X)))
        return E.add(p_vco, E.mul(el, c64(s_c)))

    def guarded(cond, fn):
        op = E.scf.IfOp(cond)
        with ir.InsertionPoint(op.then_block):
            fn()
            E.scf.YieldOp([])

    def store_k_cache(s_ok, s, h_k, d0, vals):
        """vals: f32 values of channels [d0, d0+len) of K head h_k (static d0 offset, var head)."""
        def body():
            pieces = E.store_elems_pieces(vals, cfg.cache_dt, inv_k)
            E.global_store_pieces(pieces, k_cache_addr(s, h_k, None, dvar=d0))
        guarded(s_ok, body)

    def lanes(cpx, nh):
        hp, ts = phase_geometry(cpx, nh, cfg.nt)
        c = E.arith.remui(tid, c32(cpx))
        hs = E.arith.remui(E.arith.divui(tid, c32(cpx)), c32(hp))
        tsl = E.arith.divui(tid, c32(cpx * hp))
        active_all = cpx * hp * ts >= cfg.nt
        return hp, ts, c, hs, tsl, active_all

    def run_phase(cpx, nh, per_token):
        """Calls per_token(tl, tvalid, c, head_list) for each token iteration."""
        hp, ts, c, hs, tsl, active_all = lanes(cpx, nh)
        for it in range(-(-TPB // ts)):
            tl = E.add(tsl, c32(it * ts)) if it else tsl
            tvalid = E.cmp("slt", E.ext64(tl), rows)
            heads = []
            for j in range(-(-nh // hp)):
                h = E.add(hs, c32(j * hp)) if j else hs
                hvalid = None if (j + 1) * hp <= nh else E.cmp("slt", h, c32(nh))
                heads.append((h, hvalid))
            lane_ok = None if active_all and (it + 1) * ts <= TPB else E.cmp("slt", tsl, c32(min(ts, TPB - it * ts)))
            if lane_ok is None:
                per_token(tl, tvalid, c, heads)
            else:
                guarded(lane_ok, lambda: per_token(tl, tvalid, c, heads))

    def load_qk(is_q, oq, ok, nbytes):
        """nbytes of q (Q heads) or k (K heads): one load per lane, branch on the head kind (uniform
        per wave whenever QH is a multiple of the heads a wave covers)."""
        sizes = E._pieces(nbytes)
        op = E.scf.IfOp(is_q, [E._raw_type(p) for p in sizes], has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.scf.YieldOp([v for _, v in E.buf_load_words(rs_q, oq, nbytes)])
        with ir.InsertionPoint(op.else_block):
            E.scf.YieldOp([v for _, v in E.buf_load_words(rs_k, ok, nbytes)])
        return list(zip(sizes, op.results))

    def store_qk(is_q, pieces, oq, ok):
        op = E.scf.IfOp(is_q, [], has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.buf_store_pieces(pieces, rs_qo, oq)
            E.scf.YieldOp([])
        with ir.InsertionPoint(op.else_block):
            E.buf_store_pieces(pieces, rs_ko, ok)
            E.scf.YieldOp([])

    def head_offset(tl, h, nheads, ch0_bytes_i32):
        return E.add(E.mul(E.add(E.mul(tl, c32(nheads)), h), c32(D * s_in)), ch0_bytes_i32)

    # ------------------------------ rotation phase ------------------------------
    W = cfg.w_rot
    cpx_rot = (R // 2) // W if cfg.neox else R // W

    def rot_token(tl, tvalid, c, heads):
        pos = load_index(rs_pos, tl, cfg.pos64)
        pos = E.arith.maxsi(E.arith.minsi(pos, E.sub(MAXPOS, c64(1))), c64(0))
        row = E.mul(E.trunc32(pos), c32(tw * s_tab))
        # table values for this lane's chunk: lists ca, sa, cb, sb (f32, per pair in the chunk)
        npairs = W if cfg.neox else W // 2

        def tab(rs, first_elem, n):
            off = E.add(row, E.add(E.mul(c, c32(n * s_tab)), c32(first_elem * s_tab)))
            return E.elems_from_pieces(E.buf_load_words(rs, off, n * s_tab), cfg.tab_dt, n)  # exact

        if cfg.neox:
            ca = tab(rs_cos, 0, npairs)
            sa = tab(rs_sin, 0, npairs)
            if cfg.full_table:
                cb = tab(rs_cos, R // 2, npairs)
                sb = tab(rs_sin, R // 2, npairs)
            else:
                cb, sb = ca, sa
        else:
            if cfg.full_table:
                cf = tab(rs_cos, 0, W)
                sf = tab(rs_sin, 0, W)
                ca, cb = cf[0::2], cf[1::2]
                sa, sb = sf[0::2], sf[1::2]
            else:
                ca = tab(rs_cos, 0, npairs)
                sa = tab(rs_sin, 0, npairs)
                cb, sb = ca, sa

        kslot = None
        if KH > 0:
            kslot = token_slot(tl, tvalid)

        # loads first
        loaded = []
        for h, hvalid in heads:
            is_q = E.cmp("slt", h, c32(QH))
            hk = E.sub(h, c32(QH))
            # offsets for q and k rows; select by head kind (both descriptors are uniform)
            cw = E.mul(c, c32(W * s_in))
            off_q = head_offset(tl, h, QH, cw)
            off_k = head_offset(tl, hk, KH, cw)
            loaded.append((h, hvalid, is_q, hk, off_q, off_k))

        results = []
        for h, hvalid, is_q, hk, off_q, off_k in loaded:
            def ld(extra_bytes):
                oq = E.add(off_q, c32(extra_bytes)) if extra_bytes else off_q
                ok = E.add(off_k, c32(extra_bytes)) if extra_bytes else off_k
                if hvalid is not None:
                    big = c32(0x7FFFFFF0)  # past the descriptor: the hardware returns 0, drops stores
                    oq = E.sel(hvalid, oq, big)
                    ok = E.sel(hvalid, ok, big)
                return load_qk(is_q, oq, ok, W * s_in), oq, ok
            if cfg.neox:
                a = ld(0)
                b = ld((R // 2) * s_in)
                results.append((h, hvalid, is_q, hk, a, b))
            else:
                a = ld(0)
                results.append((h, hvalid, is_q, hk, a, None))

        for h, hvalid, is_q, hk, a, b in results:
            if cfg.neox:
                xa = E.elems_from_pieces(a[0], cfg.dt, W)
                xb = E.elems_from_pieces(b[0], cfg.dt, W)
            else:
                xx = E.elems_from_pieces(a[0], cfg.dt, W)
                xa, xb = xx[0::2], xx[1::2]
            ya, yb = [], []
            for i in range(npairs):
                if mode == "fused":  # fma(a, cos_a, -(b*sin_a)), fma(b, cos_b, a*sin_b)
                    neg = E.arith.negf(E.arith.mulf(xb[i], sa[i]))
                    ya.append(E.llvm.intr_fma(xa[i], ca[i], neg))
                    yb.append(E.llvm.intr_fma(xb[i], cb[i], E.arith.mulf(xa[i], sb[i])))
                elif native_dt is None:
                    ya.append(E.arith.subf(E.arith.mulf(xa[i], ca[i]), E.arith.mulf(xb[i], sa[i])))
                    yb.append(E.arith.addf(E.arith.mulf(xb[i], cb[i]), E.arith.mulf(xa[i], sb[i])))
                else:
                    r = lambda v: E.round_to(v, native_dt)  # noqa: E731
                    ya.append(r(E.arith.subf(r(E.arith.mulf(xa[i], ca[i])), r(E.arith.mulf(xb[i], sa[i])))))
                    yb.append(r(E.arith.addf(r(E.arith.mulf(xb[i], cb[i])), r(E.arith.mulf(xa[i], sb[i])))))
            # output values (rounded to the input dtype once)
            if cfg.neox:
                outs = [(0, ya), ((R // 2) * s_in, yb)]
            else:
                inter = []
                for i in range(npairs):
                    inter += [ya[i], yb[i]]
                outs = [(0, inter)]
            out_pieces = []
            for (extra, vals), src in zip(outs, [a, b] if cfg.neox else [a]):
                pieces = E.store_elems_pieces(vals, cfg.dt)
                out_pieces.append(pieces)
                # q_out / k_out: the same offsets as the loads (out-of-range ones are dropped)
                store_qk(is_q, pieces, src[1], src[2])
            # key cache: K heads only
            if KH > 0:
                s_ok, s = kslot
                wr = E.and1(s_ok, E.arith.xori(is_q, E.c(1, E.i1)))
                if hvalid is not None:
                    wr = E.and1(wr, hvalid)
                # the cache stores k_out (rounded to the input dtype), converted to the cache dtype;
                # an fp8 cache in "fused" arithmetic quantizes the f32 values before that rounding
                for (d_extra, vals), pieces in zip(outs, out_pieces):
                    d0 = E.add(E.ext64(E.mul(c, c32(W))), c64(d_extra // s_in))
                    if cfg.cache_dt == cfg.dt:
                        guarded(wr, lambda pieces=pieces, d0=d0: E.global_store_pieces(
                            pieces, k_cache_addr(s, hk, None, dvar=d0)))
                    else:
                        keep_f32 = cfg.dt == F32 or mode == "fused"
                        kvals = vals if keep_f32 else [E.round_to(v, cfg.dt) for v in vals]
                        store_k_cache(wr, s, hk, d0, kvals)

    run_phase(cpx_rot, RH, rot_token)

    # ------------------------------ pass-through phase ------------------------------
    if R < D:
        WP = cfg.w_pass
        cpx_p = (D - R) // WP

        def pass_token(tl, tvalid, c, heads):
            kslot = token_slot(tl, tvalid)
            for h, hvalid in heads:
                is_q = E.cmp("slt", h, c32(QH))
                hk = E.sub(h, c32(QH))
                cw = E.add(E.mul(c, c32(WP * s_in)), c32(R * s_in))
                big = c32(0x7FFFFFF0)
                oq = head_offset(tl, h, QH, cw)
                ok = head_offset(tl, hk, KH, cw)
                if hvalid is not None:
                    oq = E.sel(hvalid, oq, big)
                    ok = E.sel(hvalid, ok, big)
                pieces = load_qk(is_q, oq, ok, WP * s_in)
                words = E.piece_words(pieces)
                store_qk(is_q, pieces, oq, ok)
                s_ok, s = kslot
                wr = E.and1(s_ok, E.arith.xori(is_q, E.c(1, E.i1)))
                if hvalid is not None:
                    wr = E.and1(wr, hvalid)
                d0 = E.add(E.ext64(E.mul(c, c32(WP))), c64(R))
                if cfg.cache_dt == cfg.dt:
                    guarded(wr, lambda: E.global_store_pieces(pieces, k_cache_addr(s, hk, None, dvar=d0)))
                else:
                    vals = E.elems_from_pieces(words, cfg.dt, WP)
                    store_k_cache(wr, s, hk, d0, vals)

        run_phase(cpx_p, RH, pass_token)

    # ------------------------------ V phase ------------------------------
    WV = cfg.w_v
    cpx_v = D // WV

    def v_token(tl, tvalid, c, heads):
        s_ok, s = token_slot(tl, tvalid)
        for h, hvalid in heads:
            cw = E.mul(c, c32(WV * s_in))
            off = head_offset(tl, h, KH, cw)
            if hvalid is not None:
                off = E.sel(hvalid, off, c32(0x7FFFFFF0))
            pv = E.buf_load_words(rs_v, off, WV * s_in)
            wr = s_ok if hvalid is None else E.and1(s_ok, hvalid)
            d0 = E.ext64(E.mul(c, c32(WV)))
            hh = E.ext64(h)

            def body(pv=pv, d0=d0, hh=hh):
                if cfg.layout == FLASH:
                    if cfg.cache_dt == cfg.dt:
                        pieces = pv
                    else:
                        vals = E.elems_from_pieces(pv, cfg.dt, WV)
                        pieces = E.store_elems_pieces(vals, cfg.cache_dt, inv_v)
                    E.global_store_pieces(pieces, v_cache_addr(s, hh, d0))
                else:  # one element per row of the value cache
                    vals = E.elems_from_pieces(pv, cfg.dt, WV)
                    for i, v in enumerate(vals):
                        bits = E.to_bits(v, cfg.cache_dt, inv_v)
                        words = E.pack_bits([bits], s_c)
                        E.global_store_pieces(E.words_to_pieces(words), v_cache_addr(s, hh, E.add(d0, c64(i))))
            guarded(wr, body)

    run_phase(cpx_v, KH, v_token)


def build_launcher(cfg: RocmKernelConfig):
    """A @flyc.jit function (NUM_ARGS Int64 arguments) that launches the kernel for `cfg`."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    def _raw(v):
        return v.ir_value() if hasattr(v, "ir_value") else v

    @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
    def jrc_rope_cache(
            a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64, a6: fx.Int64,
            a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64, a12: fx.Int64, a13: fx.Int64,
            a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64, a18: fx.Int64, a19: fx.Int64,
            a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64, a24: fx.Int64, a25: fx.Int64,
            a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64, a30: fx.Int64, a31: fx.Int64):
        emit_kernel_body(cfg, [_raw(a) for a in (
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
            a22, a23, a24, a25, a26, a27, a28, a29, a30, a31)])

    @flyc.jit
    def jrc_launch(
            a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64, a6: fx.Int64,
            a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64, a12: fx.Int64, a13: fx.Int64,
            a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64, a18: fx.Int64, a19: fx.Int64,
            a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64, a24: fx.Int64, a25: fx.Int64,
            a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64, a30: fx.Int64, a31: fx.Int64):
        jrc_rope_cache(
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
            a22, a23, a24, a25, a26, a27, a28, a29, a30, a31).launch(grid=(1, 1, 1), block=(cfg.nt, 1, 1))

    return jrc_launch
