"""The CUDA kernel without a GPU (runs in CPU-only CI).

1. NVRTC compiles every kernel variant of a config matrix (layouts, rotation styles, dtypes incl.
   fp8, precisions, D in {64, 80, 128, 256}, partial rotary, half/full tables, int32/int64
   indices) for sm_80 and sm_90; the kernel symbol is in each cubin and ptxas reports no spills
   and no stack frame. Compiles go through the package's disk cache, so reruns are fast.
2. The same source, built for the host with a C++ compiler (kernels/cuda/host_emulation.h, one
   thread per block), is compared bit for bit with the numpy reference on hostile inputs
   (invalid/duplicate-free slots, out-of-range positions, random caches): this checks the
   kernel's index math and arithmetic; thread-level parallelism is left to the GPU tests.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import itertools
import os
import re
import shutil
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

from conftest import make_spec, special_problem
from jax_rope_cache import contract, reference

nvrtc = pytest.importorskip("jax_rope_cache.compilers.nvrtc")
if not nvrtc.available():
    pytest.skip(f"NVRTC is not available: {nvrtc.unavailable_reason()} (pip install nvidia-cuda-nvrtc)",
                allow_module_level=True)

import jax  # noqa: E402

from jax_rope_cache.backends import cuda, launcher  # noqa: E402

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)




# dtype combos: (q/k/v, cache, table, precision)
COMBOS = [(BF16, BF16, F32, "fp32"), (F16, FN, F16, "native"), (F32, F32, BF16, "fp32"), (BF16, FNUZ, BF16, "native")]


def compile_matrix():
    out = []
    for i, (d, layout, neox, combo) in enumerate(itertools.product((64, 80, 128, 256), contract.LAYOUTS, (True, False),
                                                                   COMBOS)):
        dt, cdt, tdt, prec = combo
        x = contract.pack_width(cdt)
        if layout != "flash" and d % x:
            continue
        r = d if i % 3 else d // 2  # partial rotary on every third variant
        if neox and (r // 2) % 2 and i % 2:
            r = d
        heads = [(8, 1), (32, 8), (4, 4)][i % 3]
        t = (1, 8192, 128)[i % 3]
        out.append(dict(T=t, QH=heads[0], KH=heads[1], D=d, R=r, layout=layout, neox=neox, dt=dt, cdt=cdt, tdt=tdt,
                        prec=prec, full=bool(i % 2), slot64=bool(i % 4 == 1), pos64=bool(i % 4 == 2)))
    # "fused" native arithmetic (rc_fma; an fp8 key cache quantizes the f32 values)
    for i, (layout, neox, dt, cdt, tdt) in enumerate([("flash", True, BF16, FN, F32), ("xpacked", False, F16, FNUZ, F32),
                                                       ("xpacked_shuffled", True, F32, F32, F32),
                                                       ("flash", False, BF16, BF16, F16)]):
        out.append(dict(T=(1, 8192, 128, 7)[i], QH=32, KH=8, D=128, R=128 if i % 2 else 64, layout=layout, neox=neox,
                        dt=dt, cdt=cdt, tdt=tdt, prec="native", full=bool(i % 2), slot64=False, pos64=True))
    return out


MATRIX = compile_matrix()


def _id(kw):
    return "-".join(f"{k}{v.name if isinstance(v, np.dtype) else v}" for k, v in kw.items())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_every_variant_without_spills(arch):
    failures = []
    cfgs = [cuda.kernel_config(make_spec(**kw)) for kw in MATRIX]
    # separate NVRTC programs compile concurrently (ctypes drops the GIL); the disk cache makes reruns fast
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        compiled = list(pool.map(lambda cfg: cuda.compile_variant(cfg, arch), cfgs))
    for kw, c in zip(MATRIX, compiled):
        assert c.code[:4] == b"\x7fELF", f"{_id(kw)}: not a cubin"
        assert cuda.KERNEL_NAME.encode() in c.code, f"{_id(kw)}: kernel symbol missing"
        stores, loads, stack = nvrtc.spill_bytes(c.log)
        if "spill" not in c.log:
            failures.append(f"{_id(kw)}: no ptxas -v report in the log")
        elif stores or loads or stack:
            failures.append(f"{_id(kw)}: {stores} B spill stores, {loads} B spill loads, {stack} B stack\n{c.log}")
    assert not failures, "\n".join(failures[:5])
    assert len(MATRIX) >= 80


def test_ptx_fallback_and_code_table():
    cfg = cuda.kernel_config(make_spec())
    table = cuda.build_code_table(cfg, None)
    assert table[:8] == b"JRCCODE1"
    count = int.from_bytes(table[8:12], "little")
    archs = [table[16 + 40 * i + 8:16 + 40 * i + 24].rstrip(b"\0").decode() for i in range(count)]
    assert archs == ["sm_90", "compute_90"]
    # a newer arch than this NVRTC knows: PTX only
    t2 = cuda.build_code_table(cfg, 999)
    assert int.from_bytes(t2[8:12], "little") == 1


def test_code_table_unpacks_to_what_was_packed():
    entries = [(launcher.KIND_CUBIN, "sm_90", b"\x7fELF" + bytes(range(37))), (launcher.KIND_PTX, "compute_90", b".version 8.0\0")]
    table = launcher.pack_code_table(entries)
    assert launcher.unpack_code_table(table) == entries
    # the byte layout gpu_launcher.cc parses: magic, count, 40-byte rows, 16-byte aligned blobs
    assert table[:8] == b"JRCCODE1" and struct.unpack_from("<I", table, 8)[0] == 2
    for i, (kind, arch, data) in enumerate(entries):
        k, _, a, off, size = struct.unpack_from("<II16sQQ", table, 16 + 40 * i)
        assert (k, a.rstrip(b"\0").decode(), table[off:off + size]) == (kind, arch, data) and off % 16 == 0
    with pytest.raises(ValueError, match="bad magic"):
        launcher.unpack_code_table(b"NOTATABLE" + table[9:])


def test_disk_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_mem_cache", {})
    cfg = cuda.kernel_config(make_spec(D=64, QH=2, KH=1))
    a = cuda.compile_variant(cfg, "sm_90")
    assert not a.from_disk and list(tmp_path.glob("*.cubin.jrc"))
    monkeypatch.setattr(nvrtc, "_mem_cache", {})
    b = cuda.compile_variant(cfg, "sm_90")
    assert b.from_disk and b.code == a.code
    assert not list(tmp_path.glob(".tmp-*"))


# ---- host emulation of the kernel ------------------------------------------------------------------
_KDIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def _kernel_dir():
    return _KDIR if os.path.isdir(os.path.join(_KDIR, "cuda")) else os.path.join(os.path.dirname(cuda.__file__),
                                                                                 "kernels")


class _Params(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p * 18), ("dim0", ctypes.c_int64 * 14)]


def _build_emulation(cfg, tmp_dir):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host emulation")
    kd = _kernel_dir()
    defs = [f"-D{k}={1 if k == 'RC_NT' else v}" for k, v in cfg.defines]
    tag = hashlib.sha256(" ".join(defs).encode()).hexdigest()[:16]
    so = os.path.join(tmp_dir, f"emu_{tag}.so")
    if not os.path.exists(so):
        cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-DRC_EMULATE",
               *defs, "-I", os.path.join(kd, "cuda"), "-I", os.path.join(kd, "common"), "-x", "c++",
               os.path.join(kd, "cuda", "rope_cache.cu"), "-o", so]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(so)
    lib.rc_emulate.argtypes = [ctypes.POINTER(_Params), ctypes.c_longlong]
    return lib


def _random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def make_inputs(spec, rng):
    t, qh, kh, d = spec.num_tokens, spec.q_heads, spec.kv_heads, spec.head_dim
    q = _random(rng, (t, qh, d), spec.dtype, 2.0)
    k = _random(rng, (t, kh, d), spec.dtype, 2.0)
    v = _random(rng, (t, kh, d), spec.dtype, 300.0 if spec.fp8 else 2.0)  # fp8: some saturate
    kshape, vshape = contract.cache_shapes(spec.layout, spec.num_blocks, spec.block_size, kh, d, spec.cache_dtype)
    kc = _random(rng, kshape, spec.cache_dtype)
    vc = _random(rng, vshape, spec.cache_dtype)
    n = spec.num_slots
    slots = rng.permutation(n)[:t].astype(np.int64)
    bad = rng.random(t) < 0.25
    slots[bad] = rng.choice([-1, -7, n, n + 3, 2**40 if spec.slot_dtype == np.int64 else 2**30], bad.sum())
    pos = rng.integers(-5, spec.max_pos + 5, t)
    w = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    ang = rng.random((spec.max_pos, w)) * 6.3
    cos, sin = np.cos(ang).astype(spec.table_dtype), np.sin(ang).astype(spec.table_dtype)
    return (q, k, v, kc, vc, slots.astype(spec.slot_dtype), pos.astype(spec.pos_dtype), cos, sin)


def run_emulation(spec, args, k_scale, v_scale, tmp_dir, layer=0, num_sms=cuda.DEFAULT_SMS, defines=None):
    cfg = cuda.kernel_config(spec, num_sms)
    if defines:  # another variant of the same kernel (tokens per block, unroll, ...)
        d = dict(cfg.defines, **defines)
        cfg = cuda.KernelConfig(defines=tuple(d.items()), tokens_per_block=d["RC_TPB"], threads=d["RC_NT"])
    lib = _build_emulation(cfg, tmp_dir)
    q, k, v, kc, vc, slots, pos, cos, sin = (np.ascontiguousarray(a) for a in args)
    ks = np.array(k_scale if k_scale is not None else 1.0, np.float32)
    vs = np.array(v_scale if v_scale is not None else 1.0, np.float32)
    q_out, k_out = np.full_like(q, 7), np.full_like(k, 7)
    kc_out, vc_out = kc.copy(), vc.copy()
    no_norm = np.zeros(1, np.float32)  # q_norm_weight / k_norm_weight placeholders
    ops = [q, k, v, kc_out, vc_out, slots, pos, cos, sin, ks, vs, np.array(layer, np.int32), no_norm, no_norm]
    p = _Params()
    for i, a in enumerate(ops + [q_out, k_out, kc_out, vc_out]):
        p.ptr[i] = a.ctypes.data
    for i, a in enumerate(ops):
        p.dim0[i] = a.shape[0] if a.ndim else 1
    grid = -(-spec.num_tokens // cfg.tokens_per_block)
    lib.rc_emulate(ctypes.byref(p), grid)
    return q_out, k_out, kc_out, vc_out


def emulation_matrix():
    cases = []
    for i, (layout, neox, combo) in enumerate(itertools.product(contract.LAYOUTS, (True, False), COMBOS)):
        dt, cdt, tdt, prec = combo
        d = (128, 64, 80, 256)[i % 4]
        if layout != "flash" and d % contract.pack_width(cdt):
            d = 128
        r = (d, d // 2, d)[i % 3]
        cases.append(dict(T=(37, 5, 130)[i % 3], QH=(4, 8, 2)[i % 3], KH=(2, 1, 2)[i % 3], D=d, R=r, layout=layout,
                          neox=neox, dt=dt, cdt=cdt, tdt=tdt, prec=prec, full=bool(i % 2), slot64=bool(i % 2),
                          pos64=bool(i % 3 == 0), max_pos=50))
    cases.append(dict(T=9, QH=2, KH=1, D=64, R=6, neox=True, dt=F16))  # odd R/2: scalar chunks
    cases.append(dict(T=9, QH=2, KH=1, D=80, R=20, neox=False, dt=F32, full=True, prec="native"))
    # "fused" native arithmetic (f32 tables, f32 inputs, mixed 16-bit), fp8 caches quantizing f32 values
    for i, (layout, neox, dt, cdt, tdt) in enumerate([("flash", True, BF16, FN, F32), ("xpacked", False, BF16, FNUZ, F32),
                                                       ("xpacked_shuffled", True, F16, FN, F32),
                                                       ("flash", False, F16, F16, F32), ("xpacked", True, F32, F32, F32),
                                                       ("flash", True, BF16, BF16, F16), ("flash", False, F32, FN, BF16)]):
        cases.append(dict(T=(37, 5, 130)[i % 3], QH=4, KH=2, D=128, R=(128, 64)[i % 2], layout=layout, neox=neox, dt=dt,
                          cdt=cdt, tdt=tdt, prec="native", full=bool(i % 2), slot64=False, pos64=True, max_pos=50))
    return cases


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu"))


@pytest.mark.parametrize("kw", emulation_matrix(), ids=_id)
def test_host_emulation_matches_reference_bitwise(kw, emu_dir):
    spec = make_spec(**kw)
    rng = np.random.default_rng(abs(hash(_id(kw))) % 2**32)
    args = make_inputs(spec, rng)
    ks = vs = None
    if spec.fp8:
        ks, vs = np.float32(0.37), np.float32(1.9)
    want = reference.rope_and_cache(*args, layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim,
                                    k_scale=ks, v_scale=vs, precision=spec.precision)
    got = run_emulation(spec, args, ks, vs, emu_dir)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        gb, wb = g.view(np.uint8), np.asarray(w).view(np.uint8)
        assert g.shape == w.shape
        if not np.array_equal(gb, wb):
            bad = np.argwhere(g.view(f"u{g.dtype.itemsize}") != np.asarray(w).view(f"u{g.dtype.itemsize}"))
            pytest.fail(f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}")


def _run_slots(rng, t, spec):
    """Prefill-like slots: sequences filling random blocks in order; in the first half of the tokens
    whole blocks from offset 0 (aligned runs), then sequences of any length starting at any offset
    (misaligned runs); a few invalid slots break runs."""
    bs, nb = spec.block_size, spec.num_blocks
    blocks = rng.permutation(nb)
    slots, bi = [], 0
    while len(slots) < t:
        aligned = len(slots) < t // 2
        off = 0 if aligned else int(rng.integers(0, bs))
        for _ in range(bs * int(rng.integers(1, 3)) if aligned else int(rng.integers(1, 3 * bs))):
            if off == bs:
                bi, off = bi + 1, 0
            slots.append(int(blocks[bi]) * bs + off)
            off += 1
        bi += 1
    slots = np.array(slots[:t], np.int64)
    bad = rng.random(t) < 0.03
    slots[bad] = rng.choice([-1, spec.num_slots, spec.num_slots + 5], bad.sum())
    return slots.astype(spec.slot_dtype)


@pytest.mark.parametrize("variant", [{}, {"RC_TPB": 8}, {"RC_TPB": 64, "RC_VPAIRS": 0}],
                         ids=["default", "tpb8", "tpb64-nopairs"])
@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("combo", [(BF16, BF16), (F16, FN), (F32, F32)], ids=lambda c: f"{c[0].name}-{c[1].name}")
def test_host_emulation_slot_runs(layout, combo, variant, emu_dir):
    """Slot runs (prefill): the x-packed V writer stores an aligned run of X slots as one piece and
    every other group element by element; both bit-exact, nothing else written. A small SM count
    keeps the tokens per block >= X (the configuration of a large call); the variants run several
    units per thread, with and without paired V lanes (tokens per block >= 2X)."""
    dt, cdt = combo
    spec = make_spec(T=203, QH=4, KH=2, D=64, layout=layout, dt=dt, cdt=cdt, NB=64, max_pos=50)
    cfg = cuda.kernel_config(spec, num_sms=1)
    assert layout == "flash" or cfg.tokens_per_block % spec.x == 0, cfg
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, _, pos, cos, sin = make_inputs(spec, rng)
    slots = _run_slots(rng, spec.num_tokens, spec)
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    ks = vs = None
    if spec.fp8:
        ks, vs = np.float32(0.37), np.float32(1.9)
    want = reference.rope_and_cache(*args, layout=layout, k_scale=ks, v_scale=vs)
    got = run_emulation(spec, args, ks, vs, emu_dir, num_sms=1, defines=variant)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), name


SPECIAL_COMBOS = [(BF16, BF16, None, "native"), (F16, F16, FNUZ, "native"), (BF16, F32, FN, "native"),
                  (F16, F32, None, "native"), (F32, F32, None, "native"), (F32, BF16, FN, "native"),
                  (BF16, F16, None, "native"), (BF16, F32, None, "fp32"), (F16, F16, FN, "fp32"),
                  (F32, F32, FNUZ, "fp32")]


@pytest.mark.parametrize("dt,tdt,cdt,prec", SPECIAL_COMBOS, ids=lambda v: getattr(v, "name", str(v)))
def test_host_emulation_special_values_bitwise(dt, tdt, cdt, prec, emu_dir):
    """NaN (payloads, signs, signalling), +-inf, +-0, subnormals and +-max as x, partner, cos and
    sin in every combination (conftest.special_problem), every precision and arithmetic: the
    kernel's source built for the host equals the reference bit for bit, NaN bits included."""
    args, opts = special_problem(dt, tdt, cdt, prec)
    spec = contract.check_op(*args, **opts)
    ks, vs = opts.get("k_scale"), opts.get("v_scale")
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    got = run_emulation(spec, args, ks, vs, emu_dir)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        gb, wb = g.view(np.uint8), np.asarray(w).view(np.uint8)
        assert np.array_equal(gb, wb), f"{name}: {int((gb != wb).sum())} bytes differ"


@pytest.mark.parametrize("dt,tdt,cdt,prec", [(BF16, F32, FN, "native"), (BF16, BF16, None, "native"),
                                             (F32, F32, FNUZ, "native"), (BF16, F32, None, "fp32")],
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("scale", [1e-38, 1e-40, 0.0])
def test_host_emulation_subnormals_and_tiny_scales(dt, tdt, cdt, prec, scale, emu_dir):
    """Inputs, table values, products and results spread over the subnormal range, and fp8 scales
    whose reciprocal is huge or overflows (clamped to FLT_MAX): bit-exact to the reference."""
    rng = np.random.default_rng(17)
    spec = make_spec(T=24, QH=4, KH=2, D=64, dt=dt, cdt=cdt, tdt=tdt, prec=prec, max_pos=24, pos64=False)
    q, k, v, kc, vc, slots, pos, cos, sin = make_inputs(spec, rng)
    mag = lambda a: (a.astype(np.float32) * np.exp2(rng.integers(-140, 2, a.shape))).astype(a.dtype)  # noqa: E731
    q, k, v, cos, sin = (mag(a) for a in (q, k, v, cos, sin))
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    ks = vs = np.float32(scale) if spec.fp8 else None
    want = reference.rope_and_cache(*args, rotary_dim=spec.rotary_dim, k_scale=ks, v_scale=vs, precision=prec)
    assert (np.abs(want[0].astype(np.float32)) < 2.0**-126).sum() > 20
    got = run_emulation(spec, args, ks, vs, emu_dir)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), name


@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_host_emulation_writes_one_layer_of_stacked_caches(layout, emu_dir):
    """Stacked caches [L, NB, ...]: the layer comes from the device operand; every layer in range
    writes exactly that layer (bit-exact to the reference), one outside [0, L) writes nothing."""
    layers = 3
    spec = make_spec(T=21, QH=4, KH=2, D=64, layout=layout, max_pos=50, layers=layers)
    rng = np.random.default_rng(11)
    q, k, v, kc, vc, slots, pos, cos, sin = make_inputs(dataclasses.replace(spec, num_layers=None), rng)
    kc = np.stack([_random(rng, kc.shape, kc.dtype) for _ in range(layers)])
    vc = np.stack([_random(rng, vc.shape, vc.dtype) for _ in range(layers)])
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    for layer in (0, 2, 1, -1, 3, 2**31 - 1, -2**31):
        want = reference.rope_and_cache(*args, layout=layout, layer=np.array(layer, np.int32))  # as if traced
        got = run_emulation(spec, args, None, None, emu_dir, layer=layer)
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), (layer, name)
        if not 0 <= layer < layers:
            assert np.array_equal(got[2].view(np.uint8), kc.view(np.uint8)), layer


# ---- lowering for "cuda" on this CPU machine (jax.export): fallback and stacked layers ----------
def _export_cuda(impl, layers=None):
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    T, QH, KH, D, NB, BS = 4, 8, 2, 64, 8, 16
    kshape = (NB, BS, KH, D) if layers is None else (layers, NB, BS, KH, D)
    s = jax.ShapeDtypeStruct
    args = (s((T, QH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16), s((T, KH, D), jnp.bfloat16),
            s(kshape, jnp.bfloat16), s(kshape, jnp.bfloat16), s((T,), jnp.int32), s((T,), jnp.int32),
            s((32, D // 2), jnp.float32), s((32, D // 2), jnp.float32))
    step = lambda *a: jrc.rope_and_cache(*a, impl=impl, layer=None if layers is None else 1)  # noqa: E731
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    return jax.export.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["cuda"], disabled_checks=checks)(*args)


def test_cuda_lowering_without_nvrtc_falls_back_or_raises(monkeypatch):
    monkeypatch.setattr(nvrtc, "available", lambda: False)
    with pytest.raises(Exception, match="pip install nvidia-cuda-nvrtc"):
        _export_cuda("kernel")
    with pytest.warns(RuntimeWarning, match="falling back to the XLA implementation on CUDA"):
        exp = _export_cuda(None)
    assert "custom_call @jax_rope_cache" not in exp.mlir_module()
    assert "scatter" in exp.mlir_module()


@pytest.mark.parametrize("layers", [None, 3])
def test_cuda_lowering_is_one_custom_call_with_every_operand(layers):
    """The CUDA kernel takes all 14 operands, the layer and the norm weights' placeholders included:
    stacked caches [L, NB, ...] go to
    the one custom call as they are (no folding, no op on the slots before it)."""
    text = _export_cuda("kernel", layers).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_rope_cache_gpu" in ln]
    assert len(calls) == 1, calls
    operands = calls[0].split("(", 1)[1].split(")", 1)[0]
    assert operands.count("%") == len(contract.OPERANDS) == 14, calls[0]
    assert "tensor<24x16x2x64xbf16>" not in text  # never folded to L*NB blocks
    main = text[text.index("func.func public @main"):]
    ops = set(re.findall(r"^\s*%[\w#:]+ = \"?([\w.]+)", main[:main.index("return")], re.M))
    # reshapes are layout-free bitcasts here (the layer scalar); no arithmetic on slots or layer
    assert ops <= {"stablehlo.custom_call", "stablehlo.constant", "stablehlo.reshape"}, ops

