"""A numpy interpreter for the ROCm kernel's emitter (kernels/rocm/rope_cache_flydsl.py).

The kernel body is written against a small set of MLIR builder calls (arith, rocdl buffer ops,
llvm store, scf.if, vector extract/from_elements, gpu ids). This module implements the same
calls on numpy arrays holding one value per lane of a workgroup, so the *same emitter code*
that FlyDSL compiles runs on the CPU: every workgroup of a launch is executed lane-parallel
against byte arrays standing in for device memory, and the results are compared with the
numpy reference. Semantics follow the AMDGPU/MLIR ops used: wrapping integer arithmetic,
IEEE f32 operations with one rounding each (llvm.intr.fma: one rounding of a*b + c; subnormals
kept, as the kernel's f32 denormal mode does; NaN results are some NaN, the kernel's conversions
write the canonical patterns), scf.if as an execution mask. Buffer accesses: wholly past the
descriptor's num_records a load returns 0 and a store is dropped (the documented buffer-descriptor
range check the kernels rely on); an active lane's access that is partly in range raises, because
what the hardware does with its bytes (per dword, or all of the access) is not what the kernels may
rely on. A masked-in global store outside every buffer raises (an out-of-bounds write on the GPU).
Huge read-only operands (a cos/sin table of GiBs) can be RowTable stand-ins that make each row on
demand. Needs no flydsl.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from jax_rope_cache.reference import fma32


@dataclasses.dataclass(frozen=True)
class Ty:
    kind: str          # "i", "f", "ptr", "v", "index"
    width: int = 0
    n: int = 0
    elem: "Ty | None" = None


I1, I8, I16, I32, I64 = (Ty("i", w) for w in (1, 8, 16, 32, 64))
F32, F16, PTR, INDEX = Ty("f", 32), Ty("f", 16), Ty("ptr"), Ty("index")
_UDT = {1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_SDT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}


class Val:
    def __init__(self, ty: Ty, a):
        self.ty, self.a = ty, a

    @property
    def result(self):
        return self


def _np(ty):
    if ty.kind == "i":
        return _UDT[ty.width]
    if ty.kind == "f":
        return np.float32 if ty.width == 32 else np.float16
    raise TypeError(ty)


class Machine:
    """Lane state of one workgroup plus device memory."""

    def __init__(self, nt: int):
        self.nt = nt
        self.mask = [np.ones(nt, bool)]
        self.blocks = []
        self.bufs: list[tuple[int, bytearray]] = []
        self.tid = np.arange(nt, dtype=np.uint64)
        self.bid = self.bid_y = 0
        self.writers: dict[int, set] = {}  # buffer base -> the grid.y parts that stored into it

    def alloc(self, arr) -> int:
        base = (len(self.bufs) + 1) << 40  # 1 TiB apart: room for any stand-in
        self.bufs.append((base, arr if isinstance(arr, RowTable) else bytearray(np.ascontiguousarray(arr).tobytes())))
        return base

    def buffer(self, addr: int) -> tuple[int, bytearray]:
        for base, b in self.bufs:
            if base <= addr < base + max(1, len(b)):
                return base, b
        raise IndexError(f"address 0x{addr:x} is in no buffer")

    def read(self, base: int, like: np.ndarray) -> np.ndarray:
        for b0, b in self.bufs:
            if b0 == base:
                return np.frombuffer(bytes(b), dtype=like.dtype).reshape(like.shape)
        raise KeyError(base)


M: Machine | None = None


class RowTable:
    """A read-only 2-D operand too large to hold (a cos/sin table of 4 GiB): `row(i)` makes row i
    (shape[1] values) when a load reaches it. Has the shape / ndim / dtype that run() and launch()
    read of an operand; alloc() maps it as a buffer of shape[0] * row bytes."""

    def __init__(self, shape, dtype, row):
        self.shape, self.ndim, self.dtype, self.row = tuple(shape), 2, np.dtype(dtype), row
        self.row_bytes = self.shape[1] * self.dtype.itemsize
        self.rows_read: set[int] = set()

    def __len__(self):
        return self.shape[0] * self.row_bytes

    def __getitem__(self, sl: slice) -> bytes:
        start, stop, out = sl.start, sl.stop, bytearray()
        assert 0 <= start <= stop <= len(self), (start, stop)
        while start < stop:
            r, o = divmod(start, self.row_bytes)
            self.rows_read.add(r)
            data = np.ascontiguousarray(self.row(r), self.dtype).tobytes()
            assert len(data) == self.row_bytes
            take = min(stop - start, self.row_bytes - o)
            out += data[o:o + take]
            start += take
        return bytes(out)

    def __setitem__(self, sl, value):
        raise AssertionError("a store into a read-only RowTable operand")



# ---------------------------------------------------------------- ir
class _IntegerType:
    def __new__(cls, ty):
        return ty

    @staticmethod
    def get_signless(w):
        return Ty("i", w)


class _Attr:
    def __init__(self, ty, v):
        self.ty, self.v = ty, v


class ir:  # noqa: N801 - mirrors the module name
    IntegerType = _IntegerType

    class F32Type:
        @staticmethod
        def get():
            return F32

    class F16Type:
        @staticmethod
        def get():
            return F16

    class Type:
        @staticmethod
        def parse(s):
            return PTR

    class VectorType:
        @staticmethod
        def get(shape, elem):
            return Ty("v", 0, shape[0], elem)

    class IntegerAttr:
        @staticmethod
        def get(ty, v):
            return _Attr(ty, v)

    class FloatAttr:
        @staticmethod
        def get(ty, v):
            return _Attr(ty, v)

    @staticmethod
    @contextlib.contextmanager
    def InsertionPoint(block):  # noqa: N802
        M.mask.append(M.mask[-1] & block.cond)
        M.blocks.append(block)
        try:
            yield
        finally:
            M.mask.pop()
            M.blocks.pop()


# ---------------------------------------------------------------- arith
def _u(v):
    return v.a


def _s(v):
    return v.a.view(_SDT[v.ty.width]) if v.ty.width > 1 else v.a


class arith:  # noqa: N801
    class CmpIPredicate:
        eq, ne, slt, sle, sgt, sge, ult, ule, ugt, uge = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule",
                                                          "ugt", "uge")

    @staticmethod
    def ConstantOp(ty, attr):  # noqa: N802
        if ty.kind == "f":
            return Val(ty, np.full(M.nt, attr.v, _np(ty)))
        return Val(ty, np.full(M.nt, attr.v & ((1 << ty.width) - 1), _np(ty)))

    @staticmethod
    def addi(a, b):
        return Val(a.ty, _u(a) + _u(b))

    @staticmethod
    def subi(a, b):
        return Val(a.ty, _u(a) - _u(b))

    @staticmethod
    def muli(a, b):
        return Val(a.ty, _u(a) * _u(b))

    @staticmethod
    def andi(a, b):
        return Val(a.ty, _u(a) & _u(b))

    @staticmethod
    def ori(a, b):
        return Val(a.ty, _u(a) | _u(b))

    @staticmethod
    def xori(a, b):
        return Val(a.ty, _u(a) ^ _u(b))

    @staticmethod
    def shli(a, b):
        assert (_u(b) < a.ty.width).all()
        return Val(a.ty, _u(a) << _u(b).astype(_u(a).dtype))

    @staticmethod
    def shrui(a, b):
        assert (_u(b) < a.ty.width).all()
        return Val(a.ty, _u(a) >> _u(b).astype(_u(a).dtype))

    @staticmethod
    def divui(a, b):
        return Val(a.ty, _u(a) // np.maximum(_u(b), 1))

    @staticmethod
    def remui(a, b):
        return Val(a.ty, _u(a) % np.maximum(_u(b), 1))

    @staticmethod
    def minui(a, b):
        return Val(a.ty, np.minimum(_u(a), _u(b)))

    @staticmethod
    def maxui(a, b):
        return Val(a.ty, np.maximum(_u(a), _u(b)))

    @staticmethod
    def minsi(a, b):
        return Val(a.ty, np.minimum(_s(a), _s(b)).view(_u(a).dtype))

    @staticmethod
    def maxsi(a, b):
        return Val(a.ty, np.maximum(_s(a), _s(b)).view(_u(a).dtype))

    @staticmethod
    def cmpi(pred, a, b):
        sig = pred[0] == "s"
        x, y = (_s(a), _s(b)) if sig else (_u(a), _u(b))
        op = pred[1:] if pred[0] in "su" else pred
        r = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}[op]
        return Val(I1, r)

    @staticmethod
    def select(c, a, b):
        cond = c.a.reshape(c.a.shape + (1,) * (a.a.ndim - c.a.ndim))  # an i1 picking whole vectors
        return Val(a.ty, np.where(cond, a.a, b.a))

    @staticmethod
    def extui(ty, v):
        return Val(ty, v.a.astype(_np(ty)))

    @staticmethod
    def extsi(ty, v):
        return Val(ty, _s(v).astype(_SDT[ty.width]).view(_np(ty)))

    @staticmethod
    def trunci(ty, v):
        return Val(ty, v.a.astype(_np(ty)))

    @staticmethod
    def index_cast(ty, v):
        return Val(ty, v.a.astype(_np(ty)))

    @staticmethod
    def bitcast(ty, v):
        return Val(ty, v.a.view(_np(ty)))

    @staticmethod
    def mulf(a, b):
        return Val(F32, (a.a * b.a).astype(np.float32))

    @staticmethod
    def addf(a, b):
        return Val(F32, (a.a + b.a).astype(np.float32))

    @staticmethod
    def subf(a, b):
        return Val(F32, (a.a - b.a).astype(np.float32))

    @staticmethod
    def negf(a):  # flips the sign bit (NaN included), as v_xor of the sign does
        return Val(F32, (a.a.view(np.uint32) ^ np.uint32(0x80000000)).view(np.float32))

    @staticmethod
    def divf(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            return Val(F32, (a.a / b.a).astype(np.float32))

    @staticmethod
    def extf(ty, v):
        return Val(ty, v.a.astype(np.float32))

    @staticmethod
    def truncf(ty, v):
        with np.errstate(over="ignore"):
            return Val(ty, v.a.astype(np.float16))


# ---------------------------------------------------------------- gpu / llvm / rocdl / scf / vector
class gpu:  # noqa: N801
    class Dimension:
        x = "x"
        y = "y"

    @staticmethod
    def thread_id(d):
        assert d == "x"
        return Val(INDEX, M.tid.copy())

    @staticmethod
    def block_id(d):
        return Val(INDEX, np.full(M.nt, M.bid if d == "x" else M.bid_y, np.uint64))


class llvm:  # noqa: N801
    @staticmethod
    def intr_fma(a, b, c):
        return Val(F32, fma32(a.a, b.a, c.a))

    @staticmethod
    def intr_sqrt(a):  # IEEE: correctly rounded (what the backend's expansion of llvm.sqrt.f32 computes)
        with np.errstate(invalid="ignore"):
            return Val(F32, np.sqrt(a.a).astype(np.float32))

    @staticmethod
    def inttoptr(ty, v):
        return Val(PTR, v.a.astype(np.uint64))

    @staticmethod
    def StoreOp(val, ptr, alignment=None):  # noqa: N802
        nb = _nbytes(val.ty)
        data = _lane_bytes(val)
        for lane in np.nonzero(M.mask[-1])[0]:
            addr = int(ptr.a[lane])
            assert alignment is None or addr % alignment == 0, "misaligned store"
            base, buf = M.buffer(addr)
            off = addr - base
            if off + nb > len(buf):
                raise IndexError(f"store of {nb} bytes at +{off} past a buffer of {len(buf)} bytes")
            buf[off:off + nb] = data[lane]
            M.writers.setdefault(base, set()).add(M.bid_y)


def _nbytes(ty):
    if ty.kind == "v":
        return ty.n * ty.elem.width // 8
    return ty.width // 8


def _lane_bytes(v):
    a = np.ascontiguousarray(v.a)
    if a.ndim == 1:
        a = a[:, None]
    return [bytes(a[i].tobytes()) for i in range(M.nt)]


def _from_bytes(ty, raw: list[bytes]):
    if ty.kind == "v":
        arr = np.frombuffer(b"".join(raw), dtype=_np(ty.elem)).reshape(M.nt, ty.n)
    else:
        arr = np.frombuffer(b"".join(raw), dtype=_np(ty)).copy()
    return Val(ty, arr.copy())


def _cross_lane(src, from_lane, what):
    """src's value of lane from_lane[i] for each lane i (within its wave of 64). A lane that is on
    may only read a lane that is on: what an off lane holds is not the program's value."""
    from_lane = np.asarray(from_lane, np.int64)
    on = M.mask[-1]
    assert (from_lane // 64 == np.arange(M.nt) // 64).all(), f"{what}: a lane read across waves"
    bad = on & ~on[from_lane]
    assert not bad.any(), f"{what}: lanes {np.nonzero(bad)[0][:8]} read lanes that are off"
    return Val(src.ty, src.a[from_lane].copy())


def _dpp_source(ctrl: int, lane: np.ndarray) -> np.ndarray:
    """Source lane of each lane for a GFX9 DPP control (quad_perm, row_mirror, row_half_mirror)."""
    if ctrl <= 0xFF:  # quad_perm: lane 4q + i reads 4q + sel[i]
        sel = (ctrl >> (2 * (lane & 3))) & 3
        return (lane & ~3) | sel
    if ctrl == 0x140:  # row_mirror: reversed within each row of 16
        return (lane & ~15) | (15 - (lane & 15))
    if ctrl == 0x141:  # row_half_mirror: reversed within each half row of 8
        return (lane & ~7) | (7 - (lane & 7))
    raise NotImplementedError(f"DPP control 0x{ctrl:x}")


class rocdl:  # noqa: N801
    @staticmethod
    def update_dpp(ty, old, src, dpp_ctrl, row_mask, bank_mask, bound_ctrl):
        assert (row_mask, bank_mask) == (0xF, 0xF), "partial DPP masks are not modelled"
        lane = np.arange(M.nt, dtype=np.int64)
        return _cross_lane(src, _dpp_source(int(dpp_ctrl), lane), f"DPP 0x{int(dpp_ctrl):x}")

    @staticmethod
    def ds_swizzle(ty, src, offset):
        off = np.unique(offset.a)
        assert len(off) == 1, "ds_swizzle offset is an immediate"
        off = int(off[0])
        assert off < 0x8000, "only the bitmask mode is modelled"
        and_m, or_m, xor_m = off & 0x1F, (off >> 5) & 0x1F, (off >> 10) & 0x1F
        lane = np.arange(M.nt, dtype=np.int64)
        j = lane & 31  # within each group of 32 lanes
        return _cross_lane(src, (lane & ~31) | (((j & and_m) | or_m) ^ xor_m), f"ds_swizzle 0x{off:x}")

    @staticmethod
    def ds_bpermute(ty, index, src):
        lane = np.arange(M.nt, dtype=np.int64)
        return _cross_lane(src, (lane & ~63) | ((index.a.astype(np.int64) >> 2) & 63), "ds_bpermute")

    @staticmethod
    def make_buffer_rsrc(ty, base, stride, nrec, flags):
        b, n = np.unique(base.a), np.unique(nrec.a)
        assert len(b) == 1 and len(n) == 1, "buffer descriptor is not uniform across the workgroup"
        return Val(Ty("rsrc"), (int(b[0]), int(n[0])))

    @staticmethod
    def raw_ptr_buffer_load(ty, rsrc, off, soff):
        base, nrec = rsrc.a
        nb = _nbytes(ty)
        raw = []
        on = M.mask[-1]
        for lane in range(M.nt):
            o = int(off.a[lane]) + int(soff.a[lane])
            _check_range(o, nb, nrec, on[lane], "load")
            if o + nb <= nrec:
                b0, buf = M.buffer(base)
                s = base - b0 + o
                assert s + nb <= len(buf), "descriptor larger than its buffer"
                raw.append(bytes(buf[s:s + nb]))
            else:
                raw.append(b"\0" * nb)
        return _from_bytes(ty, raw)

    @staticmethod
    def raw_ptr_buffer_store(val, rsrc, off, soff):
        base, nrec = rsrc.a
        nb = _nbytes(val.ty)
        data = _lane_bytes(val)
        for lane in np.nonzero(M.mask[-1])[0]:
            o = int(off.a[lane]) + int(soff.a[lane])
            _check_range(o, nb, nrec, True, "store")
            if o + nb <= nrec:
                b0, buf = M.buffer(base)
                s = base - b0 + o
                assert s + nb <= len(buf), "descriptor larger than its buffer"
                buf[s:s + nb] = data[lane]
                M.writers.setdefault(b0, set()).add(M.bid_y)


def _check_range(off: int, nbytes: int, nrec: int, active: bool, what: str) -> None:
    """An active lane's buffer access must be wholly inside [0, num_records) or wholly past it."""
    assert not (active and off < nrec < off + nbytes), (
        f"buffer {what} of {nbytes} bytes at offset {off} is partly in range (num_records {nrec}): the hardware's "
        "handling of such an access is not verified")


class _Block:
    def __init__(self, cond):
        self.cond = cond
        self.yielded = None


class scf:  # noqa: N801
    class IfOp:
        def __init__(self, cond, results_=None, *, has_else=False):
            c = cond.a.astype(bool)
            self.types = list(results_ or [])
            self.then_block = _Block(c)
            self.else_block = _Block(~c) if has_else else None

        @property
        def results(self):
            t, e = self.then_block.yielded, self.else_block.yielded
            assert len(t) == len(e) == len(self.types)
            out = []
            for ty, a, b in zip(self.types, t, e):
                c = self.then_block.cond.reshape((-1,) + (1,) * (a.a.ndim - 1))
                out.append(Val(ty, np.where(c, a.a, b.a)))
            return out

    @staticmethod
    def YieldOp(vals):  # noqa: N802
        M.blocks[-1].yielded = list(vals)


class vector:  # noqa: N801
    @staticmethod
    def extract(v, dyn, pos):
        return Val(v.ty.elem, v.a[:, pos[0]].copy())

    @staticmethod
    def from_elements(ty, elems):
        return Val(ty, np.stack([e.a for e in elems], axis=1))


DIALECTS = (ir, arith, gpu, llvm, rocdl, scf, vector)


def custom_call_operands(args, opts, layer=0) -> list[np.ndarray]:
    """The custom call's 14 operands of a call (args, opts as for the reference): scales as f32 []
    or [KH] (1 without an fp8 cache), or the scale caches (k_scale_cache / v_scale_cache) in their
    slots, layer, absent norm weights as an f32[1] placeholder."""
    fp8 = np.dtype(args[3].dtype).itemsize == 1
    scales = []
    for name in ("k_scale", "v_scale"):
        if opts.get(name + "_cache") is not None:  # float32, or NVFP4 / MXFP4 block scales (1-byte floats)
            sc = np.asarray(opts[name + "_cache"])
            scales.append(sc if sc.dtype.itemsize == 1 else sc.astype(np.float32))
            continue
        s = np.asarray(opts.get(name, 1.0) if fp8 else 1.0, np.float32)
        scales.append(s.reshape(()) if s.size == 1 else s.reshape(-1))
    none = np.zeros(1, np.float32)
    weights = [none if opts.get(n) is None else np.asarray(opts[n]) for n in ("q_norm_weight", "k_norm_weight")]
    args = list(args)
    if args[6] is None:  # rotary_dim=0 without positions / tables: the op's placeholders (never read)
        args[6] = np.zeros(np.asarray(args[0]).shape[:1], np.int32)
    if args[7] is None:
        args[7] = args[8] = np.zeros((1, 0), np.float32)
    if args[4] is None:  # kv_merged (no value cache): the op's one-element placeholder per layer
        kc = np.asarray(args[3])
        args[4] = np.zeros(kc.shape[:kc.ndim - 4] + (1,), kc.dtype)
    return [np.asarray(a) for a in args] + scales + [np.asarray(layer, np.int32).reshape(())] + weights


def extra_operands(spec, opts) -> list[np.ndarray]:
    """The operands after the 14 (contract.extra_operands) of a call: use_rope as int32 [], the
    temperature factors [max_pos // floor_scale + 1] (reference.temperature_factors), NVFP4's global
    scales (k_scale / v_scale) as float32 []."""
    from jax_rope_cache import contract, reference

    out = []
    for name in contract.extra_operands(spec):
        if name == "use_rope":
            out.append(np.asarray(opts["use_rope"]).astype(np.int32).reshape(()))
        elif name in ("k_global_scale", "v_global_scale"):
            out.append(np.asarray(opts[name[0] + "_scale"], np.float32).reshape(()))
        else:
            out.append(reference.temperature_factors(spec.max_pos, *spec.temperature))
    return out


def run(kernel_module, cfg, operands: list[np.ndarray]) -> list[np.ndarray]:
    """Launches the kernel on numpy operands (the custom call's 14, in order); returns the 4
    results (q_out, k_out, key_cache, value_cache), caches updated in place semantics; with
    per-token scales (cfg.token_scales) also the scale caches (aliased to operands 9 and 10)."""
    global M
    q, k, v, kc, vc = operands[:5]
    T = q.shape[0]
    grid = -(-T // cfg.tpb)
    M = Machine(cfg.nt)
    addrs = [M.alloc(a) for a in operands]
    # q_out [T, QH, D], k_out [T, KH, D] (q, k and v may each be the fused [T, QH + 2 KH, D] tensor)
    q_out, k_out = np.zeros((T, cfg.qh, cfg.d), q.dtype), np.zeros((T, cfg.kh, cfg.d), k.dtype)
    a_qo, a_ko = M.alloc(q_out), M.alloc(k_out)
    # the caches are aliased: results = operands 3 and 4
    scale_caches = [addrs[9], addrs[10]] if getattr(cfg, "token_scales", False) else []
    args_py = (addrs + [a_qo, a_ko, addrs[3], addrs[4]] + scale_caches
               + [a.shape[0] if a.ndim else 1 for a in operands])
    for b in range(grid):
        for y in range(getattr(cfg, "split", 1)):  # grid.y: a split configuration's parts
            M.bid, M.bid_y = b, y
            M.mask = [np.ones(cfg.nt, bool)]
            args = [Val(I64, np.full(cfg.nt, x, np.uint64)) for x in args_py]
            kernel_module.emit_kernel_body(cfg, args, dialects=DIALECTS)
    global LAST_WRITERS
    names = {a_qo: "q_out", a_ko: "k_out", addrs[3]: "key_cache", addrs[4]: "value_cache"}
    names.update(zip(scale_caches, ("k_scale_cache", "v_scale_cache")))
    LAST_WRITERS = {names.get(base, hex(base)): parts for base, parts in M.writers.items()}
    out = [M.read(a_qo, q_out), M.read(a_ko, k_out), M.read(addrs[3], kc), M.read(addrs[4], vc)]
    if cfg.layout == getattr(kernel_module, "KV_MERGED", None):  # the placeholder: untouched, no value cache
        assert out[3].tobytes() == vc.tobytes(), "kv_merged: the value_cache placeholder was written"
        out[3] = None
    return out + [M.read(a, operands[i]) for a, i in zip(scale_caches, (9, 10))]


LAST_WRITERS: dict[str, set] = {}  # run(): each written output -> the grid.y parts that stored into it


def launch(kernel_module, cfg, operands: list[np.ndarray], results: list[np.ndarray], aliases: dict[int, int],
           grid: int, grid_y: int = 1) -> list[np.ndarray]:
    """Launches any kernel of the launcher's ABI (operand addresses, result addresses, operand dim0)
    on numpy arrays: `results` are the result buffers' initial contents, result i aliased to operand
    aliases[i] (a cache updated in place); a (grid, grid_y) grid. Returns the results."""
    global M, LAST_WRITERS
    M = Machine(cfg.nt)
    addrs = [M.alloc(a) for a in operands]
    raddrs = [addrs[aliases[i]] if i in aliases else M.alloc(r) for i, r in enumerate(results)]
    args_py = addrs + raddrs + [a.shape[0] if a.ndim else 1 for a in operands]
    for b in range(grid):
        for y in range(grid_y):
            M.bid, M.bid_y = b, y
            M.mask = [np.ones(cfg.nt, bool)]
            args = [Val(I64, np.full(cfg.nt, x, np.uint64)) for x in args_py]
            kernel_module.emit_kernel_body(cfg, args, dialects=DIALECTS)
    LAST_WRITERS = {i: M.writers.get(M.buffer(a)[0], set()) for i, a in enumerate(raddrs)}
    return [M.read(a, r) for a, r in zip(raddrs, results)]


def launch_raw(emit, nt: int, buffers: list[np.ndarray], scalars: list[int], grid: int) -> list[np.ndarray]:
    """Runs `emit(args, dialects)` as a kernel of `grid` workgroups of `nt` lanes whose 8-byte
    arguments are the addresses of `buffers`, then `scalars`; returns the buffers' contents after."""
    global M
    M = Machine(nt)
    addrs = [M.alloc(b) for b in buffers]
    for b in range(grid):
        M.bid, M.bid_y = b, 0
        M.mask = [np.ones(nt, bool)]
        emit([Val(I64, np.full(nt, x & (2**64 - 1), np.uint64)) for x in addrs + list(scalars)], DIALECTS)
    return [M.read(a, b) for a, b in zip(addrs, buffers)]
