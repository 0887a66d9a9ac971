"""The CUDA kernel's model-family options without a GPU (and on one, where there is).

Options (OpSpec fields; rope_cache.cu's "model families"): rotary_dim=0 (NoPE), the traced use_rope
switch (an int32 [] operand after contract.OPERANDS), rotary_position="tail", the Gemma (1 + w) and
weightless QK-norms, the norm after the rotation, the attention temperature (the temperature_factors
operand after use_rope) and gated q rows in the fused QKV input.

1. NVRTC compiles each option and combinations for sm_90 and sm_80 (the launcher's entry and the
   kernel-node entry); the variants without the options keep their defines (so their code: see
   tools/kernel_digest.py for the compiled bytes).
2. The same source built for the host (kernels/cuda/host_emulation.h) with the extra operands in the
   launcher's ABI (pointers of the operands, the extra operands, the results; then dim0 of every
   operand) equals the numpy reference bit for bit: q_out, k_out, the caches (and the per-token scale
   caches), with fp8 static and per-token scales, every layout, GPT-J and NeoX, partial rotary,
   stacked layers, both precisions; every byte outside the outputs untouched (guard bytes).
   The default tier runs a sample of the matrix, the full tier all of it.
3. On a CUDA device: rope_and_cache(impl="kernel") against the reference for each option.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import TIER, Case, make_problem, num_blocks, tier_sample
from jax_rope_cache import contract, reference

tcc = pytest.importorskip("test_cuda_compile")  # skips this module where NVRTC is missing, as that one
from test_fp8_per_token import per_token_problem  # noqa: E402

from jax_rope_cache.backends import cuda  # noqa: E402

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
E4, FNUZ, E5 = "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"


@dataclasses.dataclass(frozen=True)
class FCase:
    case: Case
    nope: bool = False               # rotary_dim=0
    tail: bool = False               # rotary_position="tail"
    use_rope: bool | None = None     # the switch operand's value (None: no switch)
    norm: str | None = None          # None, "rms", "gemma" or "weightless"
    after: bool = False              # norm_position="after"
    temp: tuple | None = None        # attn_temperature (floor_scale, attn_scale)
    q_gate: bool = False             # gated rows of the fused QKV input
    token: bool = False              # per-token fp8 scales (scale caches)
    layers: int | None = None        # stacked caches
    layer: int | None = None         # the layer written (None: the last)
    f32_weight: bool = False         # norm weights in float32 (else q's dtype)
    int8: bool = False               # an int8 cache (per-token scales; case.cache_dtype an fp8 stand-in)
    int4: bool = False               # an int4 cache (uint8 bytes of two values), the same way
    mrope: tuple | None = None       # M-RoPE sections (positions [3, T])

    @property
    def id(self) -> str:
        c = self.case
        parts = [f"T{c.T}-h{c.QH}x{c.KH}-D{c.D}-R{c.R or c.D}-{c.layout}-{'neox' if c.is_neox else 'gptj'}-{c.table}",
                 f"{c.dtype}-{c.table_dtype}-{c.cache_dtype or 'same'}-{c.precision}"]
        for on, name in ((self.nope, "nope"), (self.tail, "tail"), (self.after, "after"), (self.q_gate, "qgate"),
                         (self.token, "token"), (self.f32_weight, "wf32"), (self.int8, "int8"),
                         (self.int4, "int4")):
            if on:
                parts.append(name)
        if self.use_rope is not None:
            parts.append(f"rope{int(self.use_rope)}")
        if self.norm:
            parts.append(self.norm)
        if self.temp:
            parts.append(f"temp{self.temp[0]}")
        if self.mrope:
            parts.append("mrope" + ".".join(map(str, self.mrope)))
        if self.layers:
            parts.append(f"L{self.layers}.{self.layer}")
        if c.index_dtype == "int64":
            parts.append("int64")
        return "-".join(parts)


def problem(fc: FCase, seed: int = 5):
    """(spec, kernel operands: the 14 and the extra operands, the reference's (args, opts), extra results
    count). Random inputs (conftest.make_problem: invalid slots, out-of-range positions, random caches)."""
    c = fc.case
    if fc.token:
        args, opts = per_token_problem(c, seed, layers=fc.layers)
    else:
        args, opts = make_problem(c, seed)
        if fc.layers is not None:
            rng = np.random.default_rng(seed + 7)
            stack = lambda a: None if a is None else np.stack(  # noqa: E731
                [a] + [rng.standard_normal(a.shape).astype(F32).astype(a.dtype) for _ in range(fc.layers - 1)])
            args = args[:3] + (stack(args[3]), stack(args[4])) + args[5:]
            opts["layer"] = fc.layers - 1
    if fc.layers is not None and fc.layer is not None:
        opts["layer"] = np.array(fc.layer, np.int32)
    rng = np.random.default_rng(seed + 3)
    if fc.int8:  # random int8 caches of the same shapes (untouched entries show)
        assert fc.token
        args = args[:3] + tuple(None if a is None else rng.integers(-128, 128, a.shape).astype(np.int8)
                                for a in args[3:5]) + args[5:]
    if fc.int4:  # random bytes in the int4 storage shapes (rows of D / 2 bytes)
        assert fc.token
        lead = () if fc.layers is None else (fc.layers,)
        shapes = contract.cache_shapes(c.layout, num_blocks(c), c.BS, c.KH, c.D, contract.INT4)
        args = args[:3] + tuple(None if sh is None else rng.integers(0, 256, lead + tuple(sh)).astype(np.uint8)
                                for sh in shapes) + args[5:]
    q, k, v = args[:3]
    if fc.nope:
        opts["rotary_dim"] = 0
    if fc.tail:
        opts["rotary_position"] = "tail"
    if fc.use_rope is not None:
        opts["use_rope"] = np.array(fc.use_rope, np.int32)
    if fc.norm in ("rms", "gemma"):
        wdt = F32 if fc.f32_weight else q.dtype
        lo, hi = (-0.5, 0.5) if fc.norm == "gemma" else (0.5, 1.5)  # gemma scales by 1 + w
        opts["q_norm_weight"] = rng.uniform(lo, hi, c.D).astype(wdt)
        opts["k_norm_weight"] = rng.uniform(lo, hi, c.D).astype(wdt)
    if fc.norm:
        opts["norm_type"] = fc.norm
        opts["norm_eps"] = 1e-5
    if fc.after:
        opts["norm_position"] = "after"
    if fc.temp:
        opts["attn_temperature"] = fc.temp
    if fc.mrope:  # three position streams near each other (text tokens: equal)
        p = args[6]
        pos = np.stack([p, p + rng.integers(0, 3, len(p)), p + rng.integers(-2, 5, len(p))]).astype(p.dtype)
        args = args[:6] + (pos,) + args[7:]
        opts["mrope_section"] = fc.mrope
    spec = contract.check_op(*args, **{n: o for n, o in opts.items()})
    kargs = list(args)
    ref = dict(args=args, opts=opts)
    if fc.q_gate:  # the fused rows [T, 2 QH + 2 KH, D]: q head h at 2h, its gate (random, never read) at 2h + 1
        t, qh, kh, d = c.T, c.QH, c.KH, c.D
        gates = rng.standard_normal((t, qh, d)).astype(F32).astype(q.dtype)
        qg = np.stack([q, gates], axis=2).reshape(t, 2 * qh, d)
        fused = np.ascontiguousarray(np.concatenate([qg, k, v], axis=1))
        spec = dataclasses.replace(spec, qkv=True, q_gate=True)
        kargs[:3] = [fused, fused, fused]
        ref = dict(args=args, opts=opts, qkv=fused)
    return spec, kargs, ref


def reference_results(spec, ref):
    """The reference's results (q_gate: through rope_and_cache_qkv on the fused rows)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if "qkv" in ref:
            a = ref["args"]
            got = reference.rope_and_cache_qkv(ref["qkv"], *a[3:], num_q_heads=spec.q_heads,
                                               num_kv_heads=spec.kv_heads, q_gate=True, **ref["opts"])
            direct = reference.rope_and_cache(*a, **ref["opts"])  # the same as the split inputs
            for g, w in zip(got, direct):
                assert (g is None and w is None) or np.array_equal(np.asarray(g).view(np.uint8),
                                                                   np.asarray(w).view(np.uint8))
            return got
        return reference.rope_and_cache(*ref["args"], **ref["opts"])


def kernel_operands(spec, kargs, opts):
    """The 14 operands and the extra operands (contract.extra_operands) as the lowering passes them."""
    q, k, v, kc, vc, slots, pos, cos, sin = kargs
    if cos is None:
        cos = sin = np.zeros((1, 0), np.float32)
    if spec.token_scales:
        ks, vs = opts["k_scale_cache"], opts["v_scale_cache"]
    else:
        ks = np.asarray(opts.get("k_scale", 1.0), np.float32).reshape(-1 if spec.k_scale_heads else ())
        vs = np.asarray(opts.get("v_scale", 1.0), np.float32).reshape(-1 if spec.v_scale_heads else ())
    absent = np.full(1, np.nan, np.float32)  # an absent weight's placeholder (never read)
    wq, wk = (absent if opts.get(n) is None else np.ascontiguousarray(opts[n]) for n in ("q_norm_weight",
                                                                                        "k_norm_weight"))
    layer = np.array(opts.get("layer", 0), np.int32)
    ops = [q, k, v, kc, vc, slots, pos, cos, sin, ks, vs, layer, wq, wk]
    extra = []
    if spec.rope_switch:
        extra.append(np.array(opts["use_rope"], np.int32).reshape(()))
    if spec.temperature is not None:
        extra.append(reference.temperature_factors(spec.max_pos, *spec.temperature))
    return [None if a is None else np.ascontiguousarray(a) for a in ops], extra


def run_family_emulation(spec, kargs, opts, tmp_dir, *, defines=None, source=None):
    """The kernel on the host with the extra operands: (q_out, k_out, key_cache, value_cache[, k_scale_cache,
    v_scale_cache]); checks the emulation's own checks, the unit count and the guard bytes."""
    cfg = cuda.kernel_config(spec)
    if defines:
        d = dict(cfg.defines, **defines)
        cfg = dataclasses.replace(cfg, defines=tuple(d.items()), tokens_per_block=d["RC_TPB"])
    lib = tcc._build_emulation(cfg, tmp_dir, source)
    assert lib.rc_units() == tcc._units(cfg, spec), (lib.rc_units(), tcc._units(cfg, spec), cfg)
    ops, extra = kernel_operands(spec, kargs, opts)
    merged = ops[4] is None
    if merged:
        shape = contract.value_operand_shape(spec)
        ops[4] = np.full(shape + (spec.cache_dtype.itemsize,), 0x5A, np.uint8).view(spec.cache_dtype).reshape(shape)
    t, d = spec.num_tokens, spec.head_dim
    outs = [np.full((t, spec.q_heads, d), 7, spec.dtype), np.full((t, spec.kv_heads, d), 7, spec.dtype), ops[3], ops[4]]
    if spec.token_scales:
        outs += [ops[9], ops[10]]
    results, guards = zip(*(tcc._guarded(a) for a in outs))
    ops[3], ops[4] = results[2], results[3]
    if spec.token_scales:
        ops[9], ops[10] = results[4], results[5]
    args = ops + extra
    n_ptr = len(args) + len(results)

    class P(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_void_p * n_ptr), ("dim0", ctypes.c_int64 * len(args))]

    p = P()
    for i, a in enumerate(args + list(results)):
        p.ptr[i] = a.ctypes.data
    for i, a in enumerate(args):
        p.dim0[i] = a.shape[0] if a.ndim else 1
    lib.rc_emulate.argtypes = [ctypes.POINTER(P), ctypes.c_longlong]
    grid = -(-t // cfg.tokens_per_block)
    assert lib.rc_emulate(ctypes.byref(p), grid) == 0, "emulated shuffles (wrong lanes or sums) or misaligned stores"
    assert all((g[:tcc._GUARD] == 0xA5).all() and (g[-tcc._GUARD:] == 0xA5).all() for g in guards), \
        "a write outside the outputs"
    layer = int(np.asarray(opts.get("layer", 0)))
    if not spec.token_scales:
        assert lib.rc_pieces() == tcc._run_pieces(cfg, spec, kargs[5], layer), "x-packed V runs"
    results = list(results)
    if merged:
        assert (results[3].view(np.uint8) == 0x5A).all(), "kv_merged: the value_cache placeholder was written"
        results[3] = None
    return results


def assert_bitwise(got, want):
    names = contract.RESULTS + contract.TOKEN_SCALE_RESULTS
    assert len(got) == len(want), (len(got), len(want))
    for name, g, w in zip(names, got, want):
        if g is None or w is None:
            assert g is None and w is None, name
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        gb, wb = g.view(f"u{g.dtype.itemsize}"), w.view(f"u{g.dtype.itemsize}")
        if not np.array_equal(gb, wb):
            bad = np.argwhere(gb != wb)
            raise AssertionError(f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}")


def check(fc: FCase, emu_dir, seed=5, **kw):
    spec, kargs, ref = problem(fc, seed)
    want = reference_results(spec, ref)
    got = run_family_emulation(spec, kargs, ref["opts"], emu_dir, **kw)
    assert_bitwise(got, want)
    return spec, want


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu_families"))


# ---- the matrix ---------------------------------------------------------------------------------
def family_matrix() -> list[FCase]:
    out = []
    # each option alone, on both rotation styles and a few layouts / dtypes
    for i, (lay, neox, dt, cdt, tdt, prec, table) in enumerate([
            ("flash", True, "bfloat16", None, "float32", "fp32", "half"),
            ("xpacked", False, "float16", E4, "float16", "native", "full"),
            ("hnd", True, "float32", None, "bfloat16", "fp32", "full"),
            ("xpacked_shuffled", True, "bfloat16", FNUZ, "bfloat16", "native", "half"),
            ("head_major", False, "bfloat16", E5, "float32", "native", "half"),
            ("kv_merged", True, "float16", None, "float32", "fp32", "half")]):
        base = dict(T=(37, 9, 21)[i % 3], QH=4, KH=2, D=(128, 64)[i % 2], layout=lay, is_neox=neox, dtype=dt,
                    cache_dtype=cdt, table_dtype=tdt, precision=prec, table=table,
                    index_dtype=("int32", "int64")[i % 2])
        c = Case(**base)
        cp = Case(**dict(base, R=base["D"] // 2))
        out += [FCase(c, nope=True), FCase(c, nope=True, norm="rms"), FCase(c, nope=True, norm="weightless"),
                FCase(c, nope=True, temp=(4, 0.1)), FCase(cp, tail=True), FCase(cp, tail=True, norm="gemma"),
                FCase(c, use_rope=True), FCase(c, use_rope=False), FCase(c, norm="gemma"),
                FCase(c, norm="gemma", f32_weight=True), FCase(c, norm="weightless"),
                FCase(c, norm="rms", after=True), FCase(c, norm="weightless", after=True),
                FCase(cp, norm="rms", after=True), FCase(c, use_rope=False, temp=(8, 0.25), norm="weightless"),
                FCase(c, use_rope=True, temp=(8, 0.25), norm="weightless", after=True),
                FCase(c, use_rope=False, norm="gemma", after=False),
                FCase(c, use_rope=False, norm="rms", after=True)]
    # Llama 4 (NoPE every fourth layer: weightless norm after RoPE, temperature on NoPE calls) and
    # Qwen3-Next (gemma norm, partial rotary, gated q) shapes, stacked layers, per-token fp8 scales
    l4 = Case(T=21, QH=8, KH=2, D=128, layout="flash", dtype="bfloat16", table_dtype="float32")
    for rope in (True, False):
        out.append(FCase(l4, use_rope=rope, norm="weightless", after=True, temp=(8192 // 64, 0.1), layers=3, layer=1))
    q3n = Case(T=21, QH=4, KH=2, D=256, R=64, layout="flash", dtype="bfloat16", table_dtype="float32")
    out += [FCase(q3n, norm="gemma", q_gate=True), FCase(q3n, norm="gemma", q_gate=True, f32_weight=True),
            FCase(dataclasses.replace(q3n, layout="xpacked", cache_dtype=E4), norm="gemma", q_gate=True, tail=True)]
    # per-token fp8 scales with each option (the k row's amax over the final values)
    tk = dict(T=21, QH=4, KH=2, cache_dtype=E4)
    out += [FCase(Case(**tk, D=64), nope=True, token=True), FCase(Case(**tk, D=64), nope=True, norm="rms", token=True),
            FCase(Case(**tk, D=64, R=32), tail=True, norm="gemma", token=True),
            FCase(Case(**tk, D=128), norm="weightless", after=True, token=True),
            FCase(Case(**tk, D=128, precision="native"), norm="rms", after=True, token=True),  # "fused" arithmetic
            FCase(Case(**tk, D=64, R=32, layout="xpacked"), norm="rms", after=True, token=True),
            FCase(Case(**tk, D=128, layout="hnd"), use_rope=False, temp=(4, 0.2), token=True, norm="rms"),
            FCase(Case(**tk, D=128, layout="head_major"), use_rope=True, norm="weightless", after=True, token=True,
                  layers=2, layer=0),
            FCase(Case(**dict(tk, cache_dtype=E5), D=128, is_neox=False), norm="gemma", q_gate=True, token=True)]
    # the norm after the rotation on rows of D / W not a power of two (the unrolled tree), GPT-J and NeoX
    out += [FCase(Case(T=13, QH=4, KH=2, D=80, R=40, dtype="bfloat16"), norm="rms", after=True),
            FCase(Case(T=13, QH=4, KH=2, D=80, R=40, is_neox=False, dtype="float16", cache_dtype=E4, table="full",
                       precision="native"), norm="gemma", after=True, tail=True, token=True),
            FCase(Case(T=13, QH=2, KH=1, D=96, R=32, dtype="float32", layout="hnd"), norm="weightless", after=True,
                  use_rope=True)]
    # M-RoPE with the switch (blocks of several tokens: the merged rows and their barrier, RC_MROW) and the
    # norm after the rotation
    mr = Case(T=300, QH=4, KH=2, D=64, dtype="bfloat16", layout="xpacked", NB=40)
    out += [FCase(mr, mrope=(8, 12, 12), use_rope=rope, norm="rms", after=after)
            for rope, after in ((False, False), (True, True), (False, True))]
    # stacked layers: a valid layer and one outside [0, L) (nothing written)
    out += [FCase(Case(T=21, QH=4, KH=2, D=64, layout="xpacked", cache_dtype=E4), nope=True, layers=2, layer=5),
            FCase(Case(T=21, QH=4, KH=2, D=64, R=32, layout="hnd"), tail=True, norm="rms", after=True, layers=3,
                  layer=0)]
    return out


MATRIX = family_matrix()


def test_matrix_covers_every_option():
    on = set()
    for fc in MATRIX:
        spec = problem(fc)[0]
        on |= contract.features(spec)
    assert {"nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after", "temperature",
            "q_gate", "token_scales"} <= on
    assert {"nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after", "temperature",
            "q_gate", "int8_cache"} <= cuda.SUPPORTS
    assert "int4_cache" in cuda.SUPPORTS
    assert any(problem(fc)[0].int8 for fc in INT8_MATRIX)


@pytest.mark.parametrize("fc", tier_sample(MATRIX, 5), ids=lambda fc: fc.id)
def test_host_emulation_family_options_bitwise(fc, emu_dir):
    check(fc, emu_dir)


# the lane paths of the norm after the rotation (R == D, D a power of two) with several units per thread
# and paired k units (x-packed, even tokens per block)
@pytest.mark.parametrize("variant", [{"RC_TPB": 8}, {"RC_TPB": 8, "RC_KPAIRS": 1}],
                         ids=["tpb8", "tpb8-kpairs"])
@pytest.mark.parametrize("norm", ["weightless", "rms"])
def test_host_emulation_norm_after_lanes_with_blocks_of_tokens(variant, norm, emu_dir):
    fc = FCase(Case(T=37, QH=4, KH=2, D=64, layout="xpacked", dtype="bfloat16"), norm=norm, after=True,
               use_rope=True)
    spec = problem(fc)[0]
    cfg = cuda.kernel_config(spec)
    d = dict(cfg.defines, **variant)
    d["RC_NT"] = max(32, -(-tcc._units(dataclasses.replace(cfg, defines=tuple(d.items())), spec) // 32) * 32)
    check(fc, emu_dir, defines=d)


def test_host_emulation_families_would_catch_wrong_arithmetic(emu_dir):
    """Kernels with a family option done wrong differ from the reference."""
    src, _ = cuda.kernel_sources()
    mutants = [
        ("rc_norm_gemma(x, inv, w)", "rc_mul(w, rc_round_to(rc_mul(x, inv), DT))", FCase(Case(T=9, D=64), norm="gemma")),
        ("return p.temp[(prow + 1) / RC_TEMP_FS];", "return p.temp[prow / RC_TEMP_FS];",
         FCase(Case(T=37, D=64, max_pos=64), nope=True, temp=(1, 0.5))),
        ("if (rotate) norm_after_unit(", "if (!rotate) norm_after_unit(",
         FCase(Case(T=9, D=64), norm="rms", after=True)),
        ("return h < QH ? t * IN_QROW + (i64)(QGATE ? 2 * h : h) * D", "return h < QH ? t * IN_QROW + (i64)h * D",
         FCase(Case(T=9, D=64), q_gate=True)),
    ]
    for old, new, fc in mutants:
        assert src.count(old) == 1, old
        spec, kargs, ref = problem(fc)
        want = reference_results(spec, ref)
        got = run_family_emulation(spec, kargs, ref["opts"], emu_dir, source=src.replace(old, new))
        with pytest.raises(AssertionError):
            assert_bitwise(got, want)


# ---- int8 caches (per-token scales) ---------------------------------------------------------------------
def int8_matrix() -> list[FCase]:
    out = []
    for i, lay in enumerate(contract.LAYOUTS):
        base = dict(T=(37, 9, 21)[i % 3], QH=4, KH=2, D=(64, 128)[i % 2], layout=lay, cache_dtype=E4,
                    is_neox=bool(i % 2), dtype=("bfloat16", "float16", "float32")[i % 3],
                    precision=("fp32", "native")[i % 2], index_dtype=("int32", "int64")[i % 2])
        out.append(FCase(Case(**base), token=True, int8=True))
        out.append(FCase(Case(**dict(base, R=base["D"] // 2)), token=True, int8=True, norm="rms"))
    out += [
        FCase(Case(T=21, QH=4, KH=2, D=128, cache_dtype=E4, precision="native"), token=True, int8=True),  # "fused"
        FCase(Case(T=13, QH=4, KH=2, D=80, cache_dtype=E4), token=True, int8=True),  # rows read by every unit
        FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4, layout="xpacked"), token=True, int8=True, layers=3,
              layer=1),
        FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4, layout="hnd"), token=True, int8=True, layers=2, layer=7),
        FCase(Case(T=21, QH=8, KH=2, D=128, cache_dtype=E4), token=True, int8=True, use_rope=False,
              norm="weightless", temp=(8, 0.1)),
        FCase(Case(T=21, QH=8, KH=2, D=128, cache_dtype=E4, precision="native"), token=True, int8=True,
              use_rope=True, norm="weightless", after=True),
        FCase(Case(T=21, QH=4, KH=2, D=256, R=64, cache_dtype=E4), token=True, int8=True, norm="gemma", q_gate=True,
              tail=True),
        FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4), token=True, int8=True, nope=True, norm="rms"),
    ]
    return out


INT8_MATRIX = int8_matrix()


@pytest.mark.parametrize("fc", tier_sample(INT8_MATRIX, 3), ids=lambda fc: fc.id)
def test_host_emulation_int8_caches_bitwise(fc, emu_dir):
    spec, want = check(fc, emu_dir)
    assert spec.int8 and spec.token_scales


def test_host_emulation_int8_would_catch_a_wrong_rounding(emu_dir):
    src, _ = cuda.kernel_sources()
    fc = FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4), token=True, int8=True)
    spec, kargs, ref = problem(fc)
    want = reference_results(spec, ref)
    for old, new in [("if constexpr (LOWB) return rc_low_bit_scale(amax, INT4C != 0);",
                      "if constexpr (LOWB) return rc_low_bit_scale(amax, true);"),
                     ("if constexpr (INT8C) return (raw_cache)(rc_u8)rc_quantize_int(to_f32<DT>(x), inv_scale, 127.0f);",
                      "if constexpr (INT8C) return (raw_cache)(rc_u8)rc_quantize_int(to_f32<DT>(x), inv_scale, 128.0f);")]:
        assert src.count(old) == 1, old
        got = run_family_emulation(spec, kargs, ref["opts"], emu_dir, source=src.replace(old, new))
        with pytest.raises(AssertionError):
            assert_bitwise(got, want)


# ---- int4 caches (per-token scales, two values a byte) --------------------------------------------------
def int4_matrix() -> list[FCase]:
    out = [dataclasses.replace(fc, int8=False, int4=True) for fc in INT8_MATRIX
           if fc.case.D % 32 == 0 or not contract.LAYOUT_TABLE[fc.case.layout].packed]
    out.append(FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4, is_neox=False, table="full", dtype="float32"),
                     token=True, int4=True, norm="gemma"))
    return out


INT4_MATRIX = int4_matrix()


@pytest.mark.parametrize("fc", tier_sample(INT4_MATRIX, 3), ids=lambda fc: fc.id)
def test_host_emulation_int4_caches_bitwise(fc, emu_dir):
    spec, want = check(fc, emu_dir)
    assert spec.int4 and spec.token_scales


def test_host_emulation_int4_would_catch_a_wrong_nibble_order(emu_dir):
    src, _ = cuda.kernel_sources()
    fc = FCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4), token=True, int4=True)
    spec, kargs, ref = problem(fc)
    want = reference_results(spec, ref)
    for old, new in [("o.e[e] = (raw_cache)rc_pack_int4(rc_quantize_int(y[2 * e], inv_scale, 7.0f),\n"
                      "                                     rc_quantize_int(y[2 * e + 1], inv_scale, 7.0f));",
                      "o.e[e] = (raw_cache)rc_pack_int4(rc_quantize_int(y[2 * e + 1], inv_scale, 7.0f),\n"
                      "                                     rc_quantize_int(y[2 * e], inv_scale, 7.0f));"),
                     ("if constexpr (LOWB) return rc_low_bit_scale(amax, INT4C != 0);",
                      "if constexpr (LOWB) return rc_low_bit_scale(amax, false);")]:
        assert src.count(old) == 1, old
        got = run_family_emulation(spec, kargs, ref["opts"], emu_dir, source=src.replace(old, new))
        with pytest.raises(AssertionError):
            assert_bitwise(got, want)


# ---- NVRTC --------------------------------------------------------------------------------------------
def compile_cases() -> list[FCase]:
    llama4 = Case(T=8192, QH=40, KH=8, D=128, dtype="bfloat16")
    out = [FCase(llama4, use_rope=True, norm="weightless", after=True, temp=(8192, 0.1)),
           FCase(llama4, nope=True, norm="weightless", temp=(8192, 0.1)),
           FCase(dataclasses.replace(llama4, T=1), use_rope=False, norm="weightless", after=True, temp=(8192, 0.1)),
           FCase(Case(T=8192, QH=8, KH=4, D=256, dtype="bfloat16"), norm="gemma"),  # Gemma 3 27B TP4
           FCase(Case(T=1, QH=16, KH=2, D=256, R=64, dtype="bfloat16"), norm="gemma", q_gate=True),  # Qwen3-Next
           FCase(Case(T=8192, QH=16, KH=2, D=256, R=64, dtype="bfloat16", layout="xpacked", cache_dtype=E4),
                 norm="gemma", q_gate=True, tail=True),
           FCase(Case(T=64, QH=16, KH=4, D=128, dtype="bfloat16"), nope=True, norm="rms"),  # SmolLM3 NoPE
           FCase(Case(T=64, QH=16, KH=4, D=128, R=64, dtype="float16", cache_dtype=E4, precision="native"),
                 norm="rms", after=True, token=True),
           FCase(Case(T=64, QH=8, KH=8, D=128, dtype="bfloat16", layout="hnd", cache_dtype=E5), nope=True,
                 token=True, temp=(4, 0.1)),
           FCase(Case(T=8192, QH=32, KH=8, D=128, dtype="bfloat16", layout="xpacked", cache_dtype=E4), token=True,
                 int8=True),
           FCase(Case(T=8, QH=32, KH=8, D=128, dtype="bfloat16", cache_dtype=E4), token=True, int8=True, norm="rms"),
           FCase(Case(T=8192, QH=32, KH=8, D=128, dtype="bfloat16", layout="xpacked", cache_dtype=E4), token=True,
                 int4=True),
           FCase(Case(T=8, QH=32, KH=8, D=128, dtype="bfloat16", cache_dtype=E4), token=True, int4=True, norm="rms"),
           FCase(Case(T=64, QH=8, KH=1, D=64, dtype="float32", layout="hnd", cache_dtype=E4, is_neox=False),
                 token=True, int4=True, use_rope=True, norm="weightless", after=True)]
    return out


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("fc", compile_cases() if TIER == "full" else compile_cases()[::3], ids=lambda fc: fc.id)
def test_nvrtc_compiles_family_variants(fc, arch):
    spec = problem(fc)[0]
    cfg = cuda.kernel_config(spec)
    c = cuda.compile_variant(cfg, arch)
    assert c.code[:4] == b"\x7fELF"
    st, ld, _ = tcc.nvrtc.spills(c)
    assert st == ld == 0, f"spills: {st} bytes stored, {ld} loaded"
    node = cuda.compile_variant(cuda.node_config(cfg, (spec.num_tokens, spec.num_blocks, spec.max_pos)), arch)
    assert node.code[:4] == b"\x7fELF"


def test_family_defines_only_where_used():
    """A call without the options compiles with exactly the defines of before (no RC_ROT_OFF ... RC_QGATE)."""
    fam = ("RC_ROT_OFF", "RC_USE_ROPE", "RC_TEMP_FS", "RC_NORM_TYPE", "RC_NORM_AFTER", "RC_QGATE")
    plain = problem(FCase(Case(T=9, D=64), norm="rms"))[0]
    assert not {k for k, _ in cuda.kernel_config(plain).defines} & set(fam)
    for fc, want in [(FCase(Case(T=9, D=64, R=32), tail=True), {"RC_ROT_OFF": 32}),
                     (FCase(Case(T=9, D=64), use_rope=True), {"RC_USE_ROPE": 1}),
                     (FCase(Case(T=9, D=64), nope=True, temp=(4, 0.1)), {"RC_TEMP_FS": 4}),
                     (FCase(Case(T=9, D=64), norm="gemma"), {"RC_NORM_TYPE": 1}),
                     (FCase(Case(T=9, D=64), norm="weightless", after=True), {"RC_NORM_TYPE": 2, "RC_NORM_AFTER": 1}),
                     (FCase(Case(T=9, D=64), q_gate=True), {"RC_QGATE": 1})]:
        d = dict(cuda.kernel_config(problem(fc)[0]).defines)
        assert {k: d[k] for k in fam if k in d} == want, fc.id


# ---- on a CUDA device ------------------------------------------------------------------------------------
def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.skipif(not _cuda_devices(), reason="needs a CUDA device")
@pytest.mark.parametrize("fc", MATRIX + INT8_MATRIX + INT4_MATRIX, ids=lambda fc: fc.id)
def test_gpu_kernel_family_options_bitwise(fc):
    import jax_rope_cache as jrc

    spec, kargs, ref = problem(fc)
    want = reference_results(spec, ref)
    dev = _cuda_devices()[0]
    put = lambda a: None if a is None else jax.device_put(a, dev)  # noqa: E731
    opts = {n: (put(o) if isinstance(o, np.ndarray) else o) for n, o in ref["opts"].items()}
    a = [put(x) for x in ref["args"]]
    if fc.q_gate:
        got = jrc.rope_and_cache_qkv(put(ref["qkv"]), *a[3:], num_q_heads=spec.q_heads, num_kv_heads=spec.kv_heads,
                                     q_gate=True, impl="kernel", **opts)
    else:
        got = jrc.rope_and_cache(*a, impl="kernel", **opts)
    assert_bitwise([None if g is None else np.asarray(g) for g in got], want)


# ---- lowering for "cuda" on this machine ------------------------------------------------------------
def _export_family(monkeypatch, node: bool):
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.backends import kernel_node, launcher

    monkeypatch.setenv(kernel_node.ENV, "1" if node else "0")
    T, QH, KH, D, NB, BS, L = 4, 8, 2, 64, 8, 16, 3
    s = jax.ShapeDtypeStruct
    kshape = (L, NB, BS, KH, D)
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s(kshape, jnp.bfloat16), s(kshape, jnp.bfloat16), s((T,), jnp.int32), s((T,), jnp.int32),
            s((32, D // 2), jnp.float32), s((32, D // 2), jnp.float32), s((L,), jnp.int32))

    def step(q, k, v, kc, vc, slots, pos, cos, sin, rope_flags):  # a layer's switch read from a traced table
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layer=1, use_rope=rope_flags[1],
                                  norm_type="weightless", norm_position="after", attn_temperature=(8, 0.1),
                                  impl="kernel")

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH,
                                                                      kernel_node.TARGET)]
    return jax.export.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["cuda"],
                             disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("node", [False, True], ids=["launcher", "kernel-node"])
def test_cuda_lowering_passes_the_extra_operands(node, monkeypatch):
    """One custom call with the 14 operands, then use_rope and temperature_factors; the launcher's
    buffer names count them; the switch goes through the small operands' barrier."""
    text = _export_family(monkeypatch, node)
    target = "__gpu$xla.gpu.ptx" if node else "@jax_rope_cache_gpu"
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln and target in ln]
    assert len(calls) == 1, calls
    operands = calls[0].split("(", 1)[1].split(")", 1)[0]
    assert operands.count("%") == len(contract.OPERANDS) + 2, calls[0]
    if not node:
        names = re.search(r'buffer_names = "([^"]*)"', calls[0]).group(1).split(",")
        assert names[14:16] == ["use_rope", "temperature_factors"] and len(names) == 16 + 4, names
    if node:
        assert "rope_cache_node" in calls[0]


def test_cuda_lowering_of_an_int8_cache(monkeypatch):
    """An int8 cache lowers to the one custom call; the launcher's signature names int8 (XLA S8) caches."""
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.backends import kernel_node, launcher

    monkeypatch.setenv(kernel_node.ENV, "0")
    T, QH, KH, D, NB, BS = 4, 8, 2, 64, 8, 16
    s = jax.ShapeDtypeStruct
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s((NB, BS, KH, D), jnp.int8), s((NB, BS, KH, D), jnp.int8), s((T,), jnp.int32), s((T,), jnp.int32),
            s((32, D // 2), jnp.float32), s((32, D // 2), jnp.float32), s((NB, KH, BS), jnp.float32),
            s((NB, KH, BS), jnp.float32))
    step = lambda q, k, v, kc, vc, sl, p, c, sn, ks, vs: jrc.rope_and_cache(  # noqa: E731
        q, k, v, kc, vc, sl, p, c, sn, k_scale_cache=ks, v_scale_cache=vs, impl="kernel")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    text = jax.export.export(jax.jit(step, donate_argnums=(3, 4, 9, 10)), platforms=["cuda"],
                             disabled_checks=checks)(*args).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_rope_cache_gpu" in ln]
    assert len(calls) == 1 and "tensor<8x16x2x64xi8>" in calls[0], calls


def test_int4_shapes_the_kernel_cannot_take_are_refused():
    """An int4 cache with one-channel chunks (NeoX, odd R / 2): KernelUnavailable from NotImplementedError."""
    from jax_rope_cache.backends import native

    ok = problem(FCase(Case(T=9, QH=2, KH=1, D=64, cache_dtype=E4), token=True, int4=True))[0]
    cuda.refuse_int4_shape(ok)
    odd = problem(FCase(Case(T=9, QH=2, KH=1, D=64, R=6, cache_dtype=E4), token=True, int4=True))[0]
    assert cuda.chunk_width(odd) == 1
    with pytest.raises(native.KernelUnavailable) as e:
        cuda.refuse_int4_shape(odd)
    assert isinstance(e.value.__cause__, NotImplementedError) and "odd R / 2" in str(e.value.__cause__)
