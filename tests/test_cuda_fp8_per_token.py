"""The CUDA kernel's per-token fp8 scales (RC_TOKEN_SCALES) without a GPU.

1. NVRTC compiles the per-token variants (every layout, the three fp8 formats, QK-norm, partial
   rotary, GPT-J / NeoX, M-RoPE, fused QKV, stacked layers, decode splits, the kernel-node entry)
   for sm_90 and sm_80 with no spills; the variants without per-token scales keep their code.
2. The kernel built for the host (kernels/cuda/host_emulation.h) with the 20-pointer ABI (14 operands,
   the 6 results: the scale caches last) equals the numpy reference bit for bit: caches, scale
   caches, q_out and k_out, on rows of very different magnitudes, all-zero rows, inf / NaN rows and
   invalid slots; every byte outside the outputs untouched. The emulated k-row butterfly checks its
   lanes; kernels with a wrong reduction fail.
3. Lowering for "cuda" on this machine: one custom call (launcher or kernel node) with the scale
   caches as results 4 and 5, aliased to the k_scale / v_scale operands and outside the barrier.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import Case, make_spec
from jax_rope_cache import contract, reference

tcc = pytest.importorskip("test_cuda_compile")  # skips this module where NVRTC is missing, as that one
from test_fp8_per_token import TokenCase, per_token_problem  # noqa: E402

from jax_rope_cache.backends import cuda, kernel_node  # noqa: E402

FP8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


class _TokenParams(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p * 20), ("dim0", ctypes.c_int64 * 14)]


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu_token"))


def _config(spec, num_sms, defines):
    """kernel_config's variant, or another of the same kernel (`defines`) with threads for its units."""
    cfg = cuda.kernel_config(spec, num_sms)
    if not defines:
        return cfg
    d = dict(cfg.defines, **defines)
    cfg = cuda.KernelConfig(defines=tuple(d.items()), tokens_per_block=d["RC_TPB"], threads=0)
    d["RC_NT"] = min(cuda.MAX_THREADS, max(32, -(-tcc._units(cfg, spec) // 32) * 32))
    return dataclasses.replace(cfg, defines=tuple(d.items()), threads=d["RC_NT"])


def _paths(spec, cfg) -> int:
    """Which amax reductions cfg's kernel takes: 1 k rows over their rotation lanes (R == D, D a power
    of two, <= 32 lanes a head), 2 v rows over their CH lanes (CH = D / W a power of two <= 32);
    rope_cache.cu's TOKEN_LANES | V_LANES << 1."""
    w, dd = dict(cfg.defines)["RC_WCH"], spec.head_dim
    p, ch = cuda._rot_lanes(spec, w), dd // w
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return int(spec.rotary_dim == dd and pow2(dd) and p <= 32) | int(pow2(ch) and ch <= 32) << 1


def run_token_emulation(spec, args, opts, tmp_dir, *, num_sms=cuda.DEFAULT_SMS, defines=None, source=None,
                        math_header=None):
    """The kernel on the host: (q_out, k_out, key_cache, value_cache, k_scale_cache, v_scale_cache).
    The caches and scale caches are passed as operand and result at one address (XLA's aliasing);
    `source` / `math_header`: other texts of rope_cache.cu / rope_cache_math.h."""
    assert spec.token_scales
    cfg = _config(spec, num_sms, defines)
    assert dict(cfg.defines).get("RC_TOKEN_SCALES") == 1
    lib = tcc._build_emulation(cfg, tmp_dir, source, math_header)
    lib.rc_emulate.argtypes = [ctypes.POINTER(_TokenParams), ctypes.c_longlong]
    assert lib.rc_units() == tcc._units(cfg, spec), (lib.rc_units(), tcc._units(cfg, spec), cfg)
    d = dict(cfg.defines)
    assert lib.rc_token_lanes() == _paths(spec, cfg), "the amax reductions"
    assert lib.rc_kpairs() == (d.get("RC_KPAIRS", 0) and d["RC_TPB"] % 2 == 0), "paired k units as configured"
    merged = args[4] is None  # kv_merged: the value_cache operand is the op's placeholder, never touched
    q, k, v, kc, vc, slots, pos, cos, sin = (None if a is None else np.ascontiguousarray(a) for a in args)
    if merged:
        shape = contract.value_operand_shape(spec)
        vc = np.full(shape + (spec.cache_dtype.itemsize,), 0x5A, np.uint8).view(spec.cache_dtype).reshape(shape)
    absent = np.full(1, np.nan, np.float32)
    wq, wk = (absent if opts.get(n) is None else np.ascontiguousarray(opts[n]) for n in ("q_norm_weight",
                                                                                        "k_norm_weight"))
    t, d = spec.num_tokens, spec.head_dim
    outs = (np.full((t, spec.q_heads, d), 7, q.dtype), np.full((t, spec.kv_heads, d), 7, k.dtype), kc, vc,
            opts["k_scale_cache"], opts["v_scale_cache"])
    (q_out, k_out, kc_out, vc_out, ks_out, vs_out), guards = zip(*(tcc._guarded(a) for a in outs))
    layer = np.array(opts.get("layer", 0), np.int32)
    ops = [q, k, v, kc_out, vc_out, slots, pos, cos, sin, ks_out, vs_out, layer, wq, wk]
    p = _TokenParams()
    for i, a in enumerate(ops + [q_out, k_out, kc_out, vc_out, ks_out, vs_out]):
        p.ptr[i] = a.ctypes.data
    for i, a in enumerate(ops):
        p.dim0[i] = a.shape[0] if a.ndim else 1
    grid = -(-t // cfg.tokens_per_block)
    assert lib.rc_emulate(ctypes.byref(p), grid) == 0, "emulated shuffles (wrong lanes or amax) or misaligned stores"
    assert all((g[:tcc._GUARD] == 0xA5).all() and (g[-tcc._GUARD:] == 0xA5).all() for g in guards), \
        "a write outside the outputs"
    assert lib.rc_pieces() == 0 and lib.rc_run_units() == 0, "per-token V: row units only"
    if merged:
        assert (vc_out.view(np.uint8) == 0x5A).all(), "kv_merged: the value_cache placeholder was written"
        vc_out = None
    return q_out, k_out, kc_out, vc_out, ks_out, vs_out


def _assert_bitwise(got, want):
    names = contract.RESULTS + contract.TOKEN_SCALE_RESULTS
    assert len(got) == len(want) == 6
    for name, g, w in zip(names, got, want):
        if g is None or w is None:  # kv_merged's absent value cache: None on both sides
            assert g is None and w is None, name
            continue
        w = np.asarray(w)
        assert g.shape == w.shape, name
        gb, wb = g.view(f"u{g.dtype.itemsize}"), w.view(f"u{g.dtype.itemsize}")
        if not np.array_equal(gb, wb):
            bad = np.argwhere(gb != wb)
            raise AssertionError(f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}")


@dataclasses.dataclass(frozen=True)
class TCase(TokenCase):
    layer: int | None = None  # stacked: the layer written (None: the last)

    @property
    def id(self):
        c = self.case
        return (f"T{c.T}-QH{c.QH}-KH{c.KH}-{c.table_dtype}-{super().id}" + ("-full" if c.table == "full" else "")
                + (f"-L{self.layers}.{self.layer}" if self.layers and self.layer is not None else "")
                + (f"-X{c.X}" if c.X else "") + ("-int64" if c.index_dtype == "int64" else ""))


def problem(tc: TCase, seed: int):
    """(spec, kernel operands q, k, v (fused with qkv), args for the reference, opts)."""
    args, opts = per_token_problem(tc.case, seed, layers=tc.layers, norm=tc.norm)
    if tc.layers is not None and tc.layer is not None:
        opts["layer"] = np.array(tc.layer, np.int32)  # an array: a layer outside [0, L) is valid (writes nothing)
    if tc.mrope:
        rng = np.random.default_rng(seed)
        p = args[6]
        pos = np.stack([p, p + rng.integers(0, 3, len(p)), p + rng.integers(-2, 5, len(p))]).astype(p.dtype)
        args = args[:6] + (pos,) + args[7:]
        opts["mrope_section"] = tc.mrope
    spec = contract.check_op(*args, **opts)
    kargs = args
    if tc.qkv:
        fused = np.ascontiguousarray(np.concatenate(args[:3], axis=1))
        spec = dataclasses.replace(spec, qkv=True)
        kargs = (fused, fused, fused) + args[3:]
    return spec, kargs, args, opts


def _check(tc: TCase, emu_dir, seed=11, **kw):
    """The emulated kernel against the reference; returns (spec, the reference's results, opts)."""
    spec, kargs, args, opts = problem(tc, seed)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    _assert_bitwise(run_token_emulation(spec, kargs, opts, emu_dir, **kw), want)
    return spec, want, opts


E4, FNUZ, E5 = FP8
MATRIX = [TCase(Case(T=37, QH=4, KH=2, D=64, layout=lay, cache_dtype=cdt)) for lay in contract.LAYOUTS for cdt in FP8]
MATRIX += [
    # k rows reduced by the lanes' butterfly (R == D): GPT-J, full tables, both precisions, QK-norm
    TCase(Case(T=37, QH=4, KH=2, D=128, cache_dtype=E4, is_neox=False, table="full", layout="xpacked")),
    TCase(Case(T=37, QH=4, KH=2, D=128, cache_dtype=E4, precision="native"), norm=True),  # "fused": f32 k rows
    TCase(Case(T=21, QH=4, KH=2, D=128, cache_dtype=E5, dtype="float16", table_dtype="float16", precision="native",
               layout="xpacked_shuffled"), norm=True),  # "rounded" native arithmetic
    TCase(Case(T=9, QH=2, KH=2, D=256, cache_dtype=FNUZ, dtype="float32", layout="hnd"), norm=True),  # 32 lanes
    TCase(Case(T=11, QH=2, KH=1, D=8, cache_dtype=E4)),  # one lane per head: no shuffle
    # every unit reads its row: partial rotary, D not a power of two, more than 32 lanes per head
    PARTIAL := TCase(Case(T=37, QH=4, KH=2, D=64, R=32, cache_dtype=FNUZ, is_neox=False, layout="hnd"), layers=3),
    TCase(Case(T=37, QH=4, KH=2, D=128, R=64, cache_dtype=E4, layout="xpacked"), norm=True),
    ROW_V := TCase(Case(T=13, QH=4, KH=2, D=80, cache_dtype=E5, layout="flash"), norm=True),  # CH = 10: v rows read
    TCase(Case(T=9, QH=2, KH=2, D=256, cache_dtype=E4, dtype="float32", is_neox=False)),  # 64 lanes
    TCase(Case(T=9, QH=2, KH=1, D=64, R=6, cache_dtype=E4, dtype="float16")),  # odd R/2: one-element chunks
    # stacked layers (a valid layer, one outside [0, L): nothing written), M-RoPE, fused QKV, X, int64
    TCase(Case(T=37, QH=4, KH=2, D=64, cache_dtype=E5, layout="xpacked_shuffled"), layers=2, layer=0),
    TCase(Case(T=37, QH=4, KH=2, D=64, cache_dtype=E4, layout="xpacked"), layers=2, layer=5),
    TCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4, layout="xpacked"), mrope=(8, 12, 12)),
    TCase(Case(T=21, QH=4, KH=2, D=64, cache_dtype=E4, dtype="float32", precision="native"), qkv=True, norm=True),
    TCase(Case(T=37, QH=4, KH=2, D=64, cache_dtype=FNUZ, layout="xpacked", X=4, index_dtype="int64")),
    TCase(Case(T=70, QH=8, KH=4, D=128, BS=32, cache_dtype=E4, layout="xpacked", index_dtype="int64")),
    # head_major's scale caches [L, KH, NB, BS] (a layer's heads apart), kv_merged's V rows in the one array
    TCase(Case(T=37, QH=4, KH=2, D=64, cache_dtype=E4, layout="head_major"), layers=3, layer=1),
    TCase(Case(T=21, QH=4, KH=2, D=128, cache_dtype=E5, layout="kv_merged", precision="native"), layers=2,
          layer=1, norm=True),
]


def test_matrix_takes_every_reduction_path():
    """The matrix runs k rows by lanes and by recomputed rows, v rows by lanes and by reads."""
    paths = {_paths(s, cuda.kernel_config(s)) for s in (problem(tc, 11)[0] for tc in MATRIX)}
    assert paths == {0, 1, 2, 3}, paths


@pytest.mark.parametrize("tc", MATRIX, ids=lambda tc: tc.id)
def test_host_emulation_per_token_matches_reference_bitwise(tc, emu_dir):
    spec, want, opts = _check(tc, emu_dir)
    written = spec.num_layers is None or 0 <= opts["layer"] < spec.num_layers
    for i, name in ((4, "k_scale_cache"), (5, "v_scale_cache")):  # the comparison saw new scales (or none)
        assert (want[i] != opts[name]).any() == written, name


BLOCK_VARIANTS = [(lay, v) for lay in ("flash", "xpacked")
                  for v in ({"RC_TPB": 8}, {"RC_TPB": 32}, {"RC_TPB": 1, "RC_WCH": 4})]
BLOCK_VARIANTS += [("xpacked", {"RC_TPB": 4, "RC_KPAIRS": 1}), ("xpacked_shuffled", {"RC_TPB": 16, "RC_KPAIRS": 1})]


@pytest.mark.parametrize("layout,variant", BLOCK_VARIANTS, ids=[f"{lay}-{v}" for lay, v in BLOCK_VARIANTS])
def test_host_emulation_per_token_blocks_and_lanes(layout, variant, emu_dir):
    """Blocks of several tokens (several units per thread), paired k units (every other lane of 2P),
    half-width chunks (twice the lanes per head): the same bits."""
    tc = TCase(Case(T=45, QH=8, KH=2, D=128, cache_dtype=E4, layout=layout), norm=True)
    _check(tc, emu_dir, num_sms=1, defines=variant)


@pytest.mark.parametrize("mrope,norm", [((8, 12, 12), True), ((16, 8, 8), False)])
def test_host_emulation_per_token_with_merged_mrope_rows(mrope, norm, emu_dir):
    """Per-token scales with M-RoPE's merged rows in shared memory (RC_MROW, blocks of several
    tokens): the rotation units read the merged rows, the k row recompute the three streams' global
    rows; the same bits either way."""
    tc = TCase(Case(T=45, QH=4, KH=2, D=64, cache_dtype=E4, layout="flash"), norm=norm, mrope=mrope)
    _check(tc, emu_dir, num_sms=1, defines={"RC_TPB": 8, "RC_MROW": 1})
    tc = TCase(Case(T=45, QH=4, KH=2, D=64, R=32, cache_dtype=E5, layout="xpacked"), mrope=(4, 6, 6))
    _check(tc, emu_dir, num_sms=1, defines={"RC_TPB": 8, "RC_MROW": 1})


def test_host_emulation_per_token_split_decode(emu_dir, monkeypatch):
    """A decode token split over several blocks (RC_SPLIT): the k row's lanes stay in one warp of one
    part, V row units read their row themselves, so no regime is restricted."""
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", 64)
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_MIN", 0)
    for tc in (TCase(Case(T=5, QH=32, KH=8, D=128, NB=8, cache_dtype=E4, layout="xpacked"), norm=True),
               TCase(Case(T=6, QH=16, KH=4, D=128, R=64, NB=8, cache_dtype=E5))):
        spec = problem(tc, 11)[0]
        assert cuda.kernel_config(spec).parts > 1
        _check(tc, emu_dir)


@pytest.mark.parametrize("tc", MATRIX[::4], ids=lambda tc: tc.id)
def test_host_emulation_of_the_node_entry_per_token(tc, emu_dir):
    """The kernel-node entry (20 pointer parameters, dims compiled in): the same bits."""
    spec = problem(tc, 11)[0]
    lead = spec.num_layers if spec.num_layers is not None else spec.num_blocks
    node = {"RC_NODE": 1, "RC_NODE_T": spec.num_tokens, "RC_NODE_LEAD": lead, "RC_NODE_MAX_POS": spec.max_pos}
    _check(tc, emu_dir, defines=node)


def test_per_token_rows_of_every_kind_are_present():
    """The data the bitwise tests use: zero rows, inf and NaN rows, invalid slots, magnitudes 1e-3..1e3."""
    spec, kargs, args, opts = problem(MATRIX[0], 11)
    k, v, slots = args[1].astype(np.float32), args[2].astype(np.float32), args[5]
    assert (np.abs(v).max(axis=-1) == 0).any() and np.isinf(v).any() and np.isnan(v).any() and np.isnan(k).any()
    assert ((slots < 0) | (slots >= spec.num_slots)).any()
    amax = np.where(np.isfinite(v), np.abs(v), 0).max(axis=-1)
    assert amax.max() / amax[amax > 0].min() > 1e4


_SRC = os.path.join(tcc._kernel_dir(), "cuda", "rope_cache.cu")
MUTATIONS = [
    ("amax over one lane only (k and v)", "for (int off = 1; off < N; off <<= 1) level(off);",
     "for (int off = 1; off < 1; off <<= 1) level(off);", MATRIX[0]),
    ("k lane amax of the first half only", "own = chunk_amax(va, vb);", "own = chunk_amax(va, va);", MATRIX[0]),
    ("v row amax over the unit's own chunk",
     "for (int i = 0; i < CH; ++i) {\n      const Chunk y = load_chunk(row, i * W);",
     "for (int i = c; i < c + 1; ++i) {\n      const Chunk y = load_chunk(row, i * W);", ROW_V),
    ("v amax over one lane only", "m = v_amax_lanes(row, c, m);", "(void)row;", MATRIX[0]),
    ("k row amax without the pass-through channels", "for (int c = PASS0; c < PASS0 + CPASS; ++c) {",
     "for (int c = CH; c < PASS0 + CPASS; ++c) {", PARTIAL),
    ("k scales of every head at head 0", "p.k_sc[scale_index(s_any, h - QH)]", "p.k_sc[scale_index(s_any, 0)]",
     MATRIX[0]),
    ("amax with inf (math header)", "return (a <= 3.40282347e38f && a > m) ? a : m;", "return (a > m) ? a : m;",
     MATRIX[0]),
]
_HDR = os.path.join(tcc._kernel_dir(), "common", "rope_cache_math.h")


@pytest.mark.parametrize("what,old,new,tc", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_host_emulation_per_token_would_catch_a_wrong_reduction(what, old, new, tc, emu_dir):
    """Kernels with a wrong amax (one lane, half a lane's values, one chunk of v, no pass-through
    channels, inf counted) or a scale not written fail the emulation on the data of the tests above."""
    in_header = "math header" in what
    text = open(_HDR if in_header else _SRC).read()
    assert text.count(old) == 1, what
    spec, kargs, args, opts = problem(tc, 11)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    bad = {"math_header" if in_header else "source": text.replace(old, new)}
    with pytest.raises(AssertionError, match="elements differ|emulated shuffles"):
        _assert_bitwise(run_token_emulation(spec, kargs, opts, emu_dir, **bad), want)


# ---- NVRTC: the per-token variants compile without spills; the others keep their code -------------
def _token_spec(**kw):
    norm = kw.pop("norm", None)
    spec = make_spec(**kw)
    eps = 1e-6 if norm is not None else 0.0
    return dataclasses.replace(spec, token_scales=True, q_norm_dtype=norm, k_norm_dtype=norm, norm_eps=eps)


FN, FNUZ_DT, E5_DT = (np.dtype(getattr(ml_dtypes, n)) for n in FP8)
COMPILE = [dict(T=t, QH=32, KH=8, D=128, layout=lay, cdt=cdt, neox=neox, prec=prec)
           for (t, lay, cdt, neox, prec) in [
               (1, "flash", FN, True, "fp32"), (8192, "flash", FNUZ_DT, False, "native"),
               (128, "xpacked", E5_DT, True, "native"), (8192, "xpacked_shuffled", FN, False, "fp32"),
               (64, "hnd", E5_DT, True, "fp32"), (1, "xpacked", FNUZ_DT, True, "native")]]
COMPILE += [
    dict(T=8192, QH=8, KH=1, D=128, cdt=FN, norm=BF16),  # Qwen3 shapes: norm lanes
    dict(T=1, QH=16, KH=1, D=128, cdt=FN, norm=BF16, layout="xpacked", prec="native"),
    dict(T=8192, QH=32, KH=8, D=128, R=64, cdt=FN, norm=F32, layout="xpacked"),  # the row path
    dict(T=128, QH=8, KH=2, D=80, cdt=E5_DT, neox=False),
    dict(T=4096, QH=16, KH=4, D=256, dt=F32, cdt=FNUZ_DT, layers=4),
    dict(T=1, QH=32, KH=8, D=128, cdt=FN, layers=32, layout="xpacked"),
    dict(T=128, QH=8, KH=2, D=64, cdt=FN, X=4, layout="xpacked", neox=False, full=True),
]


@pytest.mark.parametrize("arch", ["sm_90", pytest.param("sm_80", marks=pytest.mark.full)])
def test_nvrtc_compiles_per_token_variants_without_spills(arch):
    specs = [_token_spec(**kw) for kw in COMPILE]
    cfgs = [cuda.kernel_config(s) for s in specs]
    assert all(dict(c.defines).get("RC_TOKEN_SCALES") == 1 for c in cfgs)
    failures = tcc.spill_failures(specs, [tcc._id(kw) for kw in COMPILE], arch, cfgs=cfgs)
    assert not failures, "\n".join(failures[:5])


def test_per_token_instructions_in_the_ptx():
    """Lane paths: butterfly shuffles and the correctly rounded division (div.rn, never an approximate
    reciprocal); the row paths: the division without shuffles; without per-token scales neither."""
    ptx = lambda spec: cuda.compile_variant(cuda.kernel_config(spec), "compute_90").code.decode()  # noqa: E731
    lanes = ptx(_token_spec(T=128, QH=8, KH=2, D=128, cdt=FN))
    rows = ptx(_token_spec(T=128, QH=8, KH=2, D=80, cdt=FN))  # D / W = 10 chunks: no lanes for k or v
    plain = ptx(make_spec(T=128, QH=8, KH=2, D=128, cdt=FN))
    for text in (lanes, rows):
        assert "div.rn.f32" in text and "div.approx" not in text and "div.full" not in text
    assert "shfl.sync.bfly" in lanes and "shfl.sync" not in rows
    assert "shfl.sync" not in plain and "div.rn.f32" not in plain


def test_per_token_configuration():
    """V row units in every layout (no x-packed V groups, runs or vector units), the units the kernel
    counts; the token's define only where per-token scales are used."""
    for layout in contract.LAYOUTS:
        spec = _token_spec(T=8192, QH=32, KH=8, D=128, layout=layout, cdt=FN)
        d = dict(cuda.kernel_config(spec).defines)
        assert d["RC_TOKEN_SCALES"] == 1 and d["RC_VCH"] == 1 and d["RC_VSEL"] == 0
        units, _ = cuda._block_units(spec, d["RC_WCH"])
        assert units(d["RC_TPB"]) == d["RC_TPB"] * (40 * 8 + 8 * 16)  # NeoX rotation lanes + V row units (W = 8)
        plain = dataclasses.replace(spec, token_scales=False)
        assert "RC_TOKEN_SCALES" not in dict(cuda.kernel_config(plain).defines)
    assert "token_scales" in cuda.SUPPORTS


# ---- lowering for "cuda" on this machine ------------------------------------------------------------
def _export_token(monkeypatch, setting, layers=None, t=4):
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    monkeypatch.setenv(kernel_node.ENV, setting)
    T, QH, KH, D, NB, BS = t, 8, 2, 64, 8, 16
    lead = () if layers is None else (layers,)
    s = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s(lead + (NB, BS, KH, D), f8), s(lead + (NB, BS, KH, D), f8), s((T,), jnp.int32), s((T,), jnp.int32),
            s((40, D // 2), jnp.float32), s((40, D // 2), jnp.float32), s(lead + (NB, KH, BS), jnp.float32),
            s(lead + (NB, KH, BS), jnp.float32))

    def step(*a):
        return jrc.rope_and_cache(*a[:9], k_scale_cache=a[9], v_scale_cache=a[10], impl="kernel",
                                  layer=None if layers is None else 1)

    return jrc.export(jax.jit(step, donate_argnums=(3, 4, 9, 10)), platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("setting", ["0", "1"])
def test_cuda_lowering_per_token_is_one_call_with_the_scale_caches_aliased(setting, layers, monkeypatch):
    text = _export_token(monkeypatch, setting, layers)
    target = "@__gpu$xla.gpu.ptx" if setting == "1" else "@jax_rope_cache_gpu"
    calls = [ln for ln in text.splitlines() if f"stablehlo.custom_call {target}" in ln]
    assert len(calls) == 1, text[:2000]
    line = calls[0]
    assert line.split("(", 1)[1].split(")", 1)[0].count("%") == 14
    aliases = sorted(re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", line))
    assert aliases == [("2", "3"), ("3", "4"), ("4", "9"), ("5", "10")], aliases
    assert line.count("tensor<" + ("3x" if layers else "") + "8x2x16xf32>") >= 4  # 2 operands, 2 results
    barrier = [ln for ln in text.splitlines() if "stablehlo.optimization_barrier" in ln]
    assert len(barrier) == 1 and "8x2x16xf32" not in barrier[0]  # the scale caches are not fenced
    if setting == "1":
        ptx = re.search(r'kernel_data = "((?:[^"\\]|\\.)*)"', line).group(1).encode().decode("unicode_escape")
        entry = ptx[ptx.index(f".entry {cuda.NODE_KERNEL_NAME}("):]
        assert entry[:entry.index(")")].count(".param .u64") == 20
    else:
        assert "k_scale_cache result" in line and "v_scale_cache result" in line  # buffer_names


# ---- on a CUDA GPU: the regimes the small calls of tests/test_fp8_per_token.py do not reach ---------
GPU_CASES = [  # (case, slot runs): prefill runs (paired k units, several units a thread), packed flash
    (TCase(Case(T=4096, QH=32, KH=8, D=128, cache_dtype=E4, layout="xpacked")), True),  # blocks, decode split
    (TCase(Case(T=2048, QH=8, KH=1, D=128, cache_dtype=E5), norm=True), False),
    (TCase(Case(T=1024, QH=16, KH=4, D=128, R=64, cache_dtype=E4, layout="hnd", index_dtype="int64"), layers=2), True),
    (TCase(Case(T=5, QH=32, KH=8, D=128, cache_dtype=FNUZ, layout="xpacked_shuffled")), False),
    (TCase(Case(T=64, QH=16, KH=1, D=128, cache_dtype=E4, layout="xpacked", precision="native"), norm=True), True),
]
_CUDA = "cuda" in __import__("conftest").platforms()


@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("route", ["auto", "0"], ids=["node-auto", "launcher"])
@pytest.mark.parametrize("tc,runs", GPU_CASES, ids=[tc.id + ("-runs" if r else "") for tc, r in GPU_CASES])
def test_gpu_per_token_large_calls_bitwise(tc, runs, route, monkeypatch):
    """impl="kernel" on the GPU (kernel node where the plugin compiles it, and the launcher): the same
    bits as the reference."""
    monkeypatch.setenv(kernel_node.ENV, route)
    run_large_call(tc, runs, "cuda")


@pytest.mark.parametrize("tc,runs", GPU_CASES, ids=[tc.id + ("-runs" if r else "") for tc, r in GPU_CASES])
def test_host_emulation_of_the_gpu_cases(tc, runs, emu_dir):
    """The variants the GPU test runs (kernel_config's choice for 132 SMs), emulated: the same bits."""
    spec, args, opts, want = large_call(tc, runs)
    _assert_bitwise(run_token_emulation(spec, args, opts, emu_dir), want)


def large_call(tc: TCase, runs: bool):
    """(spec, args, opts, the reference's results) of a GPU case."""
    spec, _, args, opts = problem(tc, 13)
    args = list(args)
    if runs:  # aligned slot runs with a few invalid tokens (prefill)
        s = np.arange(spec.num_tokens, dtype=np.int64) + 16
        s[5::97] = -1
        args[5] = s.astype(args[5].dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    return spec, args, opts, want


def run_large_call(tc: TCase, runs: bool, platform: str):
    import jax_rope_cache as jrc

    _, args, opts, want = large_call(tc, runs)
    opts = dict(opts)
    arrays = {n: opts.pop(n) for n in ("k_scale_cache", "v_scale_cache", "q_norm_weight", "k_norm_weight") if n in opts}
    if "layer" in opts:
        arrays["layer"] = np.asarray(opts.pop("layer"), np.int32)
    f = jax.jit(lambda a, kw: jrc.rope_and_cache(*a, **kw, impl="kernel", **opts))
    with jax.default_device(jax.devices(platform)[0]):
        got = f(args, arrays)
    _assert_bitwise([np.asarray(g) for g in got], want)


# ---- the launcher's buffer check (its initialize stage, CPU-runnable) with the 20 buffers -----------
def _check_buffers(ops, results, signature, names):
    from jax_rope_cache.backends import launcher, native

    target = "jax_rope_cache_gpu_check_buffers_token_test"
    native.register_target(target, native.native_module().gpu_check_buffers_handler, "cpu")
    shapes = [jax.ShapeDtypeStruct(np.shape(r), np.asarray(r).dtype) for r in results]
    fn = jax.ffi.ffi_call(target, shapes, input_output_aliases={3: 2, 4: 3, 9: 4, 10: 5})
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return jax.block_until_ready(fn(*[jax.device_put(o, cpu) for o in ops], signature=signature,
                                        buffer_names=names))


def test_launcher_buffer_check_names_the_scale_caches():
    """The signature a per-token lowering declares (14 operands, 6 results) is accepted for its own
    buffers; a scale cache of other dims is refused naming it, before any launch."""
    from jax_rope_cache.backends import launcher

    spec, kargs, args, opts = problem(TCase(Case(T=9, QH=4, KH=2, D=64, cache_dtype=E4, layout="xpacked")), 3)
    ph = np.ones(1, np.float32)
    q, k, v, kc, vc, slots, pos, cos, sin = args

    def buffers(ksc):
        ops = [q, k, v, kc, vc, slots, pos, cos, sin, ksc, opts["v_scale_cache"], np.int32(0), ph, ph]
        return ops, [q, k, kc, vc, ksc, opts["v_scale_cache"]]

    ops, rets = buffers(opts["k_scale_cache"])
    aval = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)  # noqa: E731
    sig = launcher.buffer_signature([aval(a) for a in ops], [aval(a) for a in rets])
    assert sig[:2].tolist() == [14, 6]
    names = launcher.buffer_names(spec)
    assert names.split(",")[9:11] == ["k_scale_cache", "v_scale_cache"] and len(names.split(",")) == 20
    _check_buffers(ops, rets, sig, names)
    bad = np.ascontiguousarray(np.swapaxes(opts["k_scale_cache"], 1, 2))  # [NB, BS, KH]
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"INVALID_ARGUMENT.*gpu launcher: k_scale_cache: expected"):
        _check_buffers(*buffers(bad), sig, names)
