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
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest

import cuda_emulation_exec
from conftest import TIER, child_env, make_spec, special_problem, tier_sample
from cuda_emulation_exec import GUARD as _GUARD, Params as _Params, guarded as _guarded  # noqa: F401 (other tests)
from e5m2_values import ROUNDING_EXPONENTS, boundary_f32, oracle_e5m2
from jax_rope_cache import contract, reference

nvrtc = pytest.importorskip("jax_rope_cache.compilers.nvrtc")
if not nvrtc.available():
    pytest.skip(f"NVRTC is not available: {nvrtc.unavailable_reason()} (pip install nvidia-cuda-nvrtc)",
                allow_module_level=True)

import jax  # noqa: E402

from jax_rope_cache.backends import cuda, kernel_node, launcher  # noqa: E402

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
E5 = np.dtype(ml_dtypes.float8_e5m2)




# dtype combos: (q/k/v, cache, table, precision)
COMBOS = [(BF16, BF16, F32, "fp32"), (F16, FN, F16, "native"), (F32, F32, BF16, "fp32"), (BF16, FNUZ, BF16, "native")]


def compile_matrix():
    out = []
    for i, (d, layout, neox, combo) in enumerate(itertools.product((64, 80, 128, 256), contract.LAYOUTS, (True, False),
                                                                   COMBOS)):
        dt, cdt, tdt, prec = combo
        x = contract.pack_width(cdt)
        if contract.LAYOUT_TABLE[layout].packed and d % x:
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
    out += X_COMPILE_CASES
    return out


# X taken from the key cache (RC_X): narrower than a chunk (one store per group), wider than 16 bytes
# (no whole-run V pieces), and 1; both x-packed layouts, the three cache widths.
X_CASES = [
    dict(layout="xpacked", X=4, neox=True, dt=BF16, cdt=BF16, tdt=F32, prec="fp32"),
    dict(layout="xpacked_shuffled", X=16, neox=False, dt=BF16, cdt=BF16, tdt=BF16, prec="native"),
    dict(layout="xpacked", X=1, neox=False, dt=F16, cdt=F16, tdt=F32, prec="fp32"),
    dict(layout="xpacked_shuffled", X=2, neox=True, dt=F16, cdt=FN, tdt=F16, prec="native"),
    dict(layout="xpacked", X=32, neox=True, dt=BF16, cdt=FNUZ, tdt=F32, prec="native"),
    dict(layout="xpacked_shuffled", X=8, neox=False, dt=F32, cdt=FN, tdt=F32, prec="fp32"),
    dict(layout="xpacked", X=2, neox=True, dt=F32, cdt=F32, tdt=BF16, prec="native"),
]
X_COMPILE_CASES = [dict(T=(1, 8192, 128)[i % 3], QH=8, KH=(1, 2, 8)[i % 3], D=(128, 64, 256)[i % 3],
                        R=None if i % 2 else 64, full=bool(i % 2), slot64=False, pos64=True, **kw)
                   for i, kw in enumerate(X_CASES)]


MATRIX = compile_matrix()


def _id(kw):
    return "-".join(f"{k}{v.name if isinstance(v, np.dtype) else v}" for k, v in kw.items())


def spill_failures(specs, ids, arch, cfgs=None):
    """Every spec compiled by NVRTC for arch (its kernel_config, or cfgs): a cubin with the kernel,
    and ptxas' report of no spill stores, spill loads or stack frame. Returns the failures."""
    failures = []
    cfgs = cfgs or [cuda.kernel_config(spec) for spec in specs]
    ids, cfgs = tier_sample(ids), tier_sample(cfgs)
    # separate NVRTC programs compile concurrently (ctypes drops the GIL); the disk cache makes reruns fast;
    # the build the lowering makes: a tight register budget that spills is rebuilt with its fallback
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        compiled = [c for _, c in pool.map(lambda cfg: cuda.fit_registers(cfg, arch), cfgs)]
    for name, c in zip(ids, compiled):
        assert c.code[:4] == b"\x7fELF", f"{name}: not a cubin"
        assert cuda.KERNEL_NAME.encode() in c.code, f"{name}: kernel symbol missing"
        stores, loads, stack = nvrtc.spills(c)  # ptxas' report, else the cubin's stack frame
        if stores or loads or stack:
            failures.append(f"{name}: {stores} B spill stores, {loads} B spill loads, {stack} B stack\n{c.log}")
    return failures


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_nvrtc_compiles_every_variant_without_spills(arch):
    failures = spill_failures([make_spec(**kw) for kw in MATRIX], [_id(kw) for kw in MATRIX], arch)
    assert not failures, "\n".join(failures[:5])
    assert len(MATRIX) >= 80


# float8_e5m2 caches: every layout, both precisions, fused and not, per-head scales, stacked, X from the cache
E5M2_COMPILE = [
    dict(T=1, QH=8, KH=1, D=128, layout="flash", neox=True, dt=BF16, cdt=E5, tdt=F32, prec="native"),
    dict(T=8192, QH=32, KH=8, D=128, layout="xpacked_shuffled", neox=False, dt=F16, cdt=E5, tdt=F16, prec="native"),
    dict(T=128, QH=4, KH=4, D=64, layout="xpacked", neox=True, dt=F32, cdt=E5, tdt=BF16, prec="fp32", full=True),
    dict(T=8192, QH=8, KH=1, D=256, layout="hnd", neox=False, dt=BF16, cdt=E5, tdt=BF16, prec="fp32", R=128),
    dict(T=7, QH=64, KH=8, D=128, layout="xpacked", neox=True, dt=BF16, cdt=E5, tdt=F32, prec="native", X=8),
    dict(T=8192, QH=32, KH=8, D=128, layout="flash", neox=True, dt=BF16, cdt=E5, tdt=F32, prec="native", layers=4),
]
E5M2_COMPILE_IDS = [_id(kw) for kw in E5M2_COMPILE]


@pytest.mark.parametrize("arch", ["sm_90", pytest.param("sm_80", marks=pytest.mark.full)])
def test_nvrtc_compiles_e5m2_variants_without_spills(arch):
    """The float8_e5m2 variants compile (the default tier: every fourth; the full tier: all, and
    with per-head scales) to a cubin with no spills."""
    specs = [make_spec(**kw) for kw in E5M2_COMPILE]
    ids = list(E5M2_COMPILE_IDS)
    if TIER == "full":
        specs += [dataclasses.replace(s, k_scale_heads=s.kv_heads > 1, v_scale_heads=s.kv_heads > 1) for s in specs]
        ids += [i + "-heads" for i in ids]
    failures = spill_failures(specs, ids, arch)
    assert not failures, "\n".join(failures[:5])


def test_register_budget_falls_back_where_it_spills():
    """A large flash call asks for 4 blocks of 256 threads per SM (<= 64 registers); where ptxas
    would spill under a budget, fit_registers rebuilds with the fallback budget (same geometry)."""
    cfg = cuda.kernel_config(make_spec(T=8192, QH=32, KH=8))
    d = dict(cfg.defines)
    assert (cfg.threads, d["RC_MINB"], cfg.fallback_minb) == (cuda.PACKED_NT, cuda.PACKED_MINB, 3)
    fitted, c = cuda.fit_registers(cfg, "sm_90")
    assert fitted == cfg and not any(nvrtc.spills(c))  # fits: kept
    tight = dataclasses.replace(cfg, defines=tuple((k, 8 if k == "RC_MINB" else v) for k, v in cfg.defines))
    assert any(nvrtc.spills(cuda.compile_variant(tight, "sm_90")))  # 32 registers: spills
    fitted, c = cuda.fit_registers(tight, "sm_90")
    assert dict(fitted.defines)["RC_MINB"] == 3 and fitted.fallback_minb == 0 and not any(nvrtc.spills(c))
    assert (fitted.threads, fitted.tokens_per_block) == (tight.threads, tight.tokens_per_block)
    assert cuda.kernel_config(make_spec(T=1)).fallback_minb == 0  # decode: one unit per thread, as before


def test_the_cubin_stack_frame_is_what_ptxas_reports():
    """Where NVRTC prints no ptxas report (13.0 rebuilding a program it built before in the process),
    spills() reads the cubin's stack-frame record: the frame ptxas reports, 0 without spills and
    non-zero with them (spilled registers live in the frame)."""
    cfg = cuda.kernel_config(make_spec(T=8192, QH=32, KH=8))
    tight = dataclasses.replace(cfg, defines=tuple((k, 8 if k == "RC_MINB" else v) for k, v in cfg.defines))
    for variant, spilling in ((cfg, False), (tight, True)):
        c = cuda.compile_variant(variant, "sm_90")
        frame = nvrtc.stack_frame_bytes(c.code)
        assert (frame > 0) == spilling
        if "ptxas" in c.log:  # a first build in this process (always with NVRTC 13.5): the report agrees
            stores, _, stack = nvrtc.spill_bytes(c.log)
            assert stack == frame and (stores > 0) == spilling, c.log
        silent = dataclasses.replace(c, log="")  # the log of a rebuild: no report
        assert nvrtc.spills(silent) == (0, 0, frame)
    ptx = cuda.compile_variant(cfg, "compute_90")
    assert nvrtc.stack_frame_bytes(ptx.code) is None
    with pytest.raises(nvrtc.NvrtcError, match="no ptxas report"):
        nvrtc.spills(ptx)


def test_regimes_latency_width_and_packed_blocks():
    """Static regime choice from the shapes: a one-token-per-block call (decode) with few heads gets
    half-width chunks (8-byte accesses, twice the threads), unless the block would pass MAX_THREADS or
    a QK-norm would leave its lane butterfly; a large flash call gets 256-thread blocks."""
    def cfg(**kw):
        c = cuda.kernel_config(make_spec(**kw))
        return dict(c.defines)["RC_WCH"], c.tokens_per_block, c.threads

    assert cfg(T=1, QH=8, KH=1) == (4, 1, 192)  # Qwen3-32B TP8: 96 -> 192 threads
    assert cfg(T=128, QH=16, KH=1, layout="xpacked") == (4, 1, 416)  # half width: not split (measured)
    assert cfg(T=1, QH=32, KH=8) == (8, 1, 128)  # Llama-8B: 896 threads would be slower (H200); 4 blocks
    assert cfg(T=8192, QH=8, KH=1) == (8, 16, cuda.PACKED_NT)
    assert cfg(T=8192, QH=8, KH=1, layout="xpacked")[0] == 8
    bf = np.dtype(ml_dtypes.bfloat16)
    norm = lambda spec: dataclasses.replace(spec, q_norm_dtype=bf, k_norm_dtype=bf, norm_eps=1e-6)  # noqa: E731
    assert dict(cuda.kernel_config(norm(make_spec(T=1, QH=8, KH=1))).defines)["RC_WCH"] == 4  # 16 lanes per head
    assert dict(cuda.kernel_config(norm(make_spec(T=1, QH=8, KH=1, R=64))).defines)["RC_WCH"] == 8  # generic path
    f32 = np.dtype(np.float32)
    spec = dataclasses.replace(make_spec(T=1, QH=2, KH=1, D=256, dt=f32), q_norm_dtype=f32, norm_eps=1e-6)
    assert dict(cuda.kernel_config(spec).defines)["RC_WCH"] == 4  # 2-element chunks: 64 lanes per head


def test_host_emulation_latency_width_with_norm_bitwise(emu_dir):
    """The half-width decode configuration (16 lanes per head for Qwen3 bf16) equals the reference."""
    kw = dict(T=5, QH=8, KH=1, D=128, dt=BF16, tdt=F32, qn=BF16, kn=BF16, max_pos=50)
    args, opts = _norm_problem(kw, np.random.default_rng(11))
    assert dict(cuda.kernel_config(contract.check_op(*args, **opts)).defines)["RC_WCH"] == 4
    _assert_bitwise(_emulate(args, opts, emu_dir), reference.rope_and_cache(*args, **opts))


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


def _build_emulation(cfg, tmp_dir, source=None, math_header=None):
    """The kernel built for the host with cfg's defines; `source`: another text of rope_cache.cu,
    `math_header`: another text of kernels/common/rope_cache_math.h (the tests that check a wrong
    kernel would be caught)."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host emulation")
    kd = _kernel_dir()
    defs = cuda.define_flags((k, 1 if k == "RC_NT" else v) for k, v in cfg.defines)
    src = os.path.join(kd, "cuda", "rope_cache.cu")
    tag = hashlib.sha256((" ".join(defs) + (source or "") + (math_header or "")).encode()).hexdigest()[:16]
    if source is not None:
        src = os.path.join(tmp_dir, f"rope_cache_{tag}.cu")
        with open(src, "w") as f:
            f.write(source)
    common = os.path.join(kd, "common")
    if math_header is not None:  # a folder of its own, searched before kernels/common
        common = os.path.join(tmp_dir, f"common_{tag}")
        os.makedirs(common, exist_ok=True)
        with open(os.path.join(common, "rope_cache_math.h"), "w") as f:
            f.write(math_header)
    so = os.path.join(tmp_dir, f"emu_{tag}.so")
    if not os.path.exists(so):
        cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-DRC_EMULATE",
               *defs, "-I", os.path.join(kd, "cuda"), "-I", common, "-x", "c++", src, "-o", so]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(so)
    lib.rc_emulate.argtypes = [ctypes.POINTER(_Params), ctypes.c_longlong]
    lib.rc_emulate.restype = ctypes.c_int  # failed checks: emulated shuffles, misaligned 16-byte V stores
    lib.rc_units.restype = ctypes.c_int
    lib.rc_pieces.restype = ctypes.c_longlong  # x-packed V: 16-byte pieces of slot runs stored
    lib.rc_run_units.restype = ctypes.c_longlong  # RC_VSEL: V units of all-run blocks done
    lib.rc_rot_unit.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.rc_kpairs.restype = ctypes.c_int
    return lib


def _run_pieces(cfg, spec, slots, layer):
    """The 16-byte run pieces the x-packed V writer stores: every whole group of X tokens (tokens per
    block a multiple of X, BS too) whose slots are s0, s0 + 1, ... with s0 % X == 0, all in the
    layer's range, gives one piece per (kv head, channel)."""
    x, tpb = spec.x, dict(cfg.defines)["RC_TPB"]
    if not contract.LAYOUT_TABLE[spec.layout].packed or tpb % x or spec.block_size % x:
        return 0
    if x * spec.cache_dtype.itemsize > 16:  # X elements wider than one access: stored element by element
        return 0
    n = 0 if spec.num_layers is not None and not 0 <= layer < spec.num_layers else spec.num_slots
    s = np.asarray(slots[:len(slots) // x * x], np.int64).reshape(-1, x)
    run = (s[:, 0] >= 0) & (s[:, -1] < n) & (s[:, 0] % x == 0) & (np.diff(s, axis=1) == 1).all(axis=1)
    return int(run.sum()) * spec.kv_heads * spec.head_dim


def _run_blocks(cfg, spec, slots, layer):
    """RC_VSEL: the blocks whose every group of X tokens is an aligned run (the block whole inside T;
    each group's slots s0 .. s0 + X - 1 with s0 % X == 0, inside the layer's range), as a boolean per
    block; empty with RC_VSEL 0."""
    d = dict(cfg.defines)
    if not d.get("RC_VSEL", 0):
        return np.zeros(0, bool)
    x, tpb = spec.x, d["RC_TPB"]
    n = 0 if spec.num_layers is not None and not 0 <= layer < spec.num_layers else spec.num_slots
    t = spec.num_tokens // tpb * tpb
    s = np.asarray(slots[:t], np.int64).reshape(-1, tpb // x, x)
    run = (s[..., 0] >= 0) & (s[..., -1] < n) & (s[..., 0] % x == 0) & (np.diff(s, axis=-1) == 1).all(axis=-1)
    return run.all(axis=1)


def _run_units(cfg, spec, slots, layer):
    """RC_VSEL = C: the V units of C channels the all-run blocks have ((TPB / X) * KH * D / C each)."""
    d = dict(cfg.defines)
    if not d.get("RC_VSEL", 0):
        return 0
    per = d["RC_TPB"] // spec.x * spec.kv_heads * spec.head_dim // d["RC_VSEL"]
    return int(_run_blocks(cfg, spec, slots, layer).sum()) * per


def _units(cfg, spec):
    """The units of one block of cfg as backends/cuda counts them (its thread count's basis)."""
    d = dict(cfg.defines)
    return cuda._block_units(spec, d["RC_WCH"], d.get("RC_VCH", 1))[0](d["RC_TPB"])


def _random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def _both_none(got, want) -> bool:
    """kv_merged's absent value cache: None on both sides (one None only is a failure)."""
    assert (got is None) == (want is None), (type(got), type(want))
    return got is None


def make_inputs(spec, rng):
    t, qh, kh, d = spec.num_tokens, spec.q_heads, spec.kv_heads, spec.head_dim
    q = _random(rng, (t, qh, d), spec.dtype, 2.0)
    k = _random(rng, (t, kh, d), spec.dtype, 2.0)
    v = _random(rng, (t, kh, d), spec.dtype, 300.0 if spec.fp8 else 2.0)  # fp8: some saturate
    kshape, vshape = contract.cache_shapes(spec.layout, spec.num_blocks, spec.block_size, kh, d, spec.cache_dtype,
                                           spec.x)
    kc = _random(rng, kshape, spec.cache_dtype)
    vc = None if vshape is None else _random(rng, vshape, spec.cache_dtype)  # kv_merged: K and V in kc
    n = spec.num_slots
    slots = rng.permutation(n)[:t].astype(np.int64)
    bad = rng.random(t) < 0.25
    slots[bad] = rng.choice([-1, -7, n, n + 3, 2**40 if spec.slot_dtype == np.int64 else 2**30], bad.sum())
    pos = rng.integers(-5, spec.max_pos + 5, t)
    w = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    ang = rng.random((spec.max_pos, w)) * 6.3
    cos, sin = np.cos(ang).astype(spec.table_dtype), np.sin(ang).astype(spec.table_dtype)
    return (q, k, v, kc, vc, slots.astype(spec.slot_dtype), pos.astype(spec.pos_dtype), cos, sin)


def _execute_in_child(so_path, ops, outs, grid) -> dict:
    """cuda_emulation_exec.execute in a fresh process (a kernel that writes far outside its buffers
    kills that one, not the tests); a crash fails as an AssertionError naming the signal."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.npz"), os.path.join(d, "out.npz")
        packed = {f"{name}_{k}": v for name, a in [*((f"op{i}", a) for i, a in enumerate(ops)),
                                                   *((f"out{i}", a) for i, a in enumerate(outs))]
                  for k, v in cuda_emulation_exec.pack(a).items()}
        np.savez(src, so=so_path, grid=grid, **packed)
        r = subprocess.run([sys.executable, "-P", cuda_emulation_exec.__file__, src, dst], env=child_env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"the emulation died (exit status {r.returncode}): {r.stderr[-2000:]}"
        with np.load(dst) as f:
            return dict(results=[np.array(f[f"out{i}"]) for i in range(4)], failed=int(f["failed"]),
                        guards_ok=bool(f["guards_ok"]), pieces=int(f["pieces"]), run_units=int(f["run_units"]))


def run_emulation(spec, args, k_scale, v_scale, tmp_dir, layer=0, num_sms=cuda.DEFAULT_SMS, defines=None,
                  q_norm_weight=None, k_norm_weight=None, source=None, math_header=None, isolated=False):
    """The kernel of `spec` (cfg's variant with `defines`) run on the host over args, checked for
    failed emulation checks, writes outside the outputs and its run counters; -> the 4 results.
    isolated: in a child process (a deliberately wrong kernel may crash)."""
    cfg = cuda.kernel_config(spec, num_sms)
    if defines:  # another variant of the same kernel (tokens per block, V channels, ...): threads for its units
        d = dict(cfg.defines, **defines)
        if "RC_VSEL" not in defines:  # the per-block choice as kernel_config makes it for the variant's blocks
            d["RC_VSEL"] = cuda.v_select(spec, d["RC_TPB"], d.get("RC_VCH", 1), dict(cfg.defines).get("RC_VSEL", 0))
        cfg = cuda.KernelConfig(defines=tuple(d.items()), tokens_per_block=d["RC_TPB"], threads=0)
        nt = min(cuda.MAX_THREADS, max(32, -(-_units(cfg, spec) // 32) * 32))
        d["RC_NT"] = nt
        cfg = dataclasses.replace(cfg, defines=tuple(d.items()), threads=nt)
    lib = _build_emulation(cfg, tmp_dir, source, math_header)
    # The kernel's unit count is the one its threads are sized by (here one host thread runs them all).
    assert lib.rc_units() == _units(cfg, spec), (lib.rc_units(), _units(cfg, spec), cfg)
    merged = args[4] is None
    q, k, v, kc, vc, slots, pos, cos, sin = (None if a is None else np.ascontiguousarray(a) for a in args)
    ks = np.ascontiguousarray(k_scale if k_scale is not None else 1.0, np.float32)
    vs = np.ascontiguousarray(v_scale if v_scale is not None else 1.0, np.float32)
    absent = np.full(1, np.nan, np.float32)  # an absent weight's placeholder (never read)
    wq, wk = (absent if w is None else np.ascontiguousarray(w) for w in (q_norm_weight, k_norm_weight))
    t, d = spec.num_tokens, spec.head_dim  # q, k, v may each be the fused [T, QH + 2 KH, D] (spec.qkv)
    if merged:  # kv_merged: the value_cache operand is the op's placeholder, which the kernel never touches
        shape = contract.value_operand_shape(spec)
        vc = np.full(shape + (spec.cache_dtype.itemsize,), 0x5A, np.uint8).view(spec.cache_dtype).reshape(shape)
    outs = [np.full((t, spec.q_heads, d), 7, q.dtype), np.full((t, spec.kv_heads, d), 7, k.dtype), kc, vc]
    ops = [q, k, v, kc, vc, slots, pos, cos, sin, ks, vs, np.array(layer, np.int32), wq, wk]
    grid = -(-spec.num_tokens // cfg.tokens_per_block)
    r = (_execute_in_child if isolated else cuda_emulation_exec.execute)(lib._name, ops, outs, grid)
    assert r["failed"] == 0, "emulated shuffles (wrong lanes, sums) or misaligned V stores"
    assert r["guards_ok"], "a write outside the outputs"
    assert r["pieces"] == _run_pieces(cfg, spec, slots, layer), "x-packed V: runs stored whole, or not, wrongly"
    assert r["run_units"] == _run_units(cfg, spec, slots, layer), "RC_VSEL: the blocks' V decomposition"
    q_out, k_out, kc_out, vc_out = r["results"]
    if merged:
        assert (np.asarray(vc_out).view(np.uint8) == 0x5A).all(), "kv_merged: the value_cache placeholder was written"
        vc_out = None
    return q_out, k_out, kc_out, vc_out


def emulation_matrix():
    cases = []
    for i, (layout, neox, combo) in enumerate(itertools.product(contract.LAYOUTS, (True, False), COMBOS)):
        dt, cdt, tdt, prec = combo
        d = (128, 64, 80, 256)[i % 4]
        if contract.LAYOUT_TABLE[layout].packed and d % contract.pack_width(cdt):
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
    # float8_e5m2 caches: every layout, both precisions, "fused" (wide fp8) and not, X narrower than 16
    for i, (layout, neox, dt, tdt, prec) in enumerate([("flash", True, BF16, F32, "native"),
                                                        ("xpacked", False, F16, F16, "native"),
                                                        ("xpacked_shuffled", True, F32, BF16, "fp32"),
                                                        ("hnd", False, BF16, BF16, "fp32")]):
        cases.append(dict(T=(37, 5, 130, 9)[i], QH=4, KH=2, D=(128, 64)[i % 2], R=(None, 32)[i % 2], layout=layout,
                          neox=neox, dt=dt, cdt=E5, tdt=tdt, prec=prec, full=bool(i % 2), slot64=bool(i % 2),
                          pos64=True, max_pos=50))
    cases.append(dict(T=37, QH=4, KH=2, D=64, layout="xpacked", X=4, neox=True, dt=BF16, cdt=E5, tdt=F32,
                      prec="native", max_pos=50))
    # X taken from the key cache (RC_X), prefill-sized calls with slot runs among random slots
    for i, kw in enumerate(X_CASES):
        cases.append(dict(T=(37, 130, 5)[i % 3], QH=4, KH=2, D=(128, 64)[i % 2], R=(None, 32)[i % 2], full=bool(i % 2),
                          slot64=bool(i % 2), pos64=True, max_pos=50, **kw))
    return cases


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu"))


def _matrix_problem(kw):
    """(spec, inputs, k_scale, v_scale) of one case of the random matrix (fresh data per case)."""
    spec = make_spec(**kw)
    args = make_inputs(spec, np.random.default_rng(abs(hash(_id(kw))) % 2**32))
    ks = vs = None
    if spec.fp8:
        ks, vs = np.float32(0.37), np.float32(1.9)
    return spec, args, ks, vs


@pytest.mark.parametrize("kw", emulation_matrix(), ids=_id)
def test_host_emulation_matches_reference_bitwise(kw, emu_dir):
    spec, args, ks, vs = _matrix_problem(kw)
    want = reference.rope_and_cache(*args, layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim,
                                    k_scale=ks, v_scale=vs, precision=spec.precision, table_form=spec.table_form)
    got = run_emulation(spec, args, ks, vs, emu_dir)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if _both_none(g, w):
            continue
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


def _skip_unless_vch(variant, spec):
    """RC_VCH > 1 exists for x-packed layouts with C * element size <= 16 bytes only."""
    c = variant.get("RC_VCH", 1)
    if c > 1 and cuda.v_channels(spec, c) != c:
        pytest.skip(f"RC_VCH={c}: not a configuration of {spec.layout} {spec.dtype.name}")


VCH_VARIANTS = [{"RC_VCH": 2}, {"RC_VCH": 4}, {"RC_VCH": 8}, {"RC_VCH": 4, "RC_TPB": 8},
                {"RC_VCH": 8, "RC_TPB": 64, "RC_VPAIRS": 0}]
VCH_IDS = ["vch2", "vch4", "vch8", "vch4-tpb8", "vch8-tpb64-nopairs"]


KP = {"RC_KPAIRS": 1}  # k-head rotation units paired by token (x-packed, even RC_TPB; flash: ignored)
KP_VARIANTS = [KP, dict(KP, RC_TPB=8), dict(KP, RC_TPB=2), dict(KP, RC_VCH=4)]
KP_IDS = ["kpairs", "kpairs-tpb8", "kpairs-tpb2", "kpairs-vch4"]


@pytest.mark.parametrize("variant", [{}, {"RC_TPB": 8}, {"RC_TPB": 64, "RC_VPAIRS": 0}] + VCH_VARIANTS + KP_VARIANTS,
                         ids=["default", "tpb8", "tpb64-nopairs"] + VCH_IDS + KP_IDS)
@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("combo", [(BF16, BF16), (F16, FN), (F32, F32)], ids=lambda c: f"{c[0].name}-{c[1].name}")
def test_host_emulation_slot_runs(layout, combo, variant, emu_dir):
    """Slot runs (prefill): the x-packed V writer stores an aligned run of X slots as one piece and
    every other group element by element; both bit-exact, nothing else written. A small SM count
    keeps the tokens per block >= X (the configuration of a large call); the variants run several
    units per thread, with and without paired V lanes (tokens per block >= 2X), and V units of
    RC_VCH channels (one run: RC_VCH pieces transposed in registers)."""
    dt, cdt = combo
    spec = make_spec(T=203, QH=4, KH=2, D=64, layout=layout, dt=dt, cdt=cdt, NB=64, max_pos=50)
    _skip_unless_vch(variant, spec)
    cfg = cuda.kernel_config(spec, num_sms=1)
    assert not contract.LAYOUT_TABLE[layout].packed or cfg.tokens_per_block % spec.x == 0, cfg
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, _, pos, cos, sin = make_inputs(spec, rng)
    slots = _run_slots(rng, spec.num_tokens, spec)
    runs = _run_pieces(dataclasses.replace(cfg, defines=tuple(dict(cfg.defines, **variant).items())), spec, slots, 0)
    assert runs > 0 or not contract.LAYOUT_TABLE[layout].packed or variant.get("RC_TPB", spec.x) % spec.x, \
        "no run in the data"
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    ks = vs = None
    if spec.fp8:
        ks, vs = np.float32(0.37), np.float32(1.9)
    want = reference.rope_and_cache(*args, layout=layout, k_scale=ks, v_scale=vs)
    got = run_emulation(spec, args, ks, vs, emu_dir, num_sms=1, defines=variant)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert _both_none(g, w) or np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), name


SPECIAL_COMBOS = [(BF16, BF16, None, "native"), (F16, F16, FNUZ, "native"), (BF16, F32, FN, "native"),
                  (F16, F32, None, "native"), (F32, F32, None, "native"), (F32, BF16, FN, "native"),
                  (BF16, F16, None, "native"), (BF16, F32, None, "fp32"), (F16, F16, FN, "fp32"),
                  (F32, F32, FNUZ, "fp32"), (BF16, F32, E5, "native"), (F32, F32, E5, "fp32")]


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
                                             (F32, F32, FNUZ, "native"), (BF16, F32, None, "fp32"),
                                             (F16, F32, E5, "native")],
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
        assert _both_none(g, w) or np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), name


@pytest.mark.parametrize("variant", [None, dict(KP, RC_TPB=8)], ids=["default", "kpairs-tpb8"])
@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_host_emulation_writes_one_layer_of_stacked_caches(layout, variant, emu_dir):
    """Stacked caches [L, NB, ...]: the layer comes from the device operand; every layer in range
    writes exactly that layer (bit-exact to the reference), one outside [0, L) writes nothing."""
    layers = 3
    spec = make_spec(T=21, QH=4, KH=2, D=64, layout=layout, max_pos=50, layers=layers)
    rng = np.random.default_rng(11)
    q, k, v, kc, vc, slots, pos, cos, sin = make_inputs(dataclasses.replace(spec, num_layers=None), rng)
    kc = np.stack([_random(rng, kc.shape, kc.dtype) for _ in range(layers)])
    vc = None if vc is None else np.stack([_random(rng, vc.shape, vc.dtype) for _ in range(layers)])
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    for layer in (0, 2, 1, -1, 3, 2**31 - 1, -2**31):
        want = reference.rope_and_cache(*args, layout=layout, layer=np.array(layer, np.int32))  # as if traced
        got = run_emulation(spec, args, None, None, emu_dir, layer=layer, defines=variant)
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert _both_none(g, w) or np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), (layer, name)
        if not 0 <= layer < layers:
            assert np.array_equal(got[2].view(np.uint8), kc.view(np.uint8)), layer


EDGE_VARIANTS = [None, {"RC_TPB": 8}, dict(KP, RC_TPB=8), {"RC_VCH": 4, "RC_TPB": 8}, {"RC_TPB": 16, "RC_VSEL": 4}]


def _variant_exists(spec, variant) -> bool:
    """V channels and the per-block choice exist for some layouts and shapes only."""
    v = variant or {}
    c = v.get("RC_VCH", 1)
    if c > 1 and cuda.v_channels(spec, c) != c:
        return False
    return "RC_VSEL" not in v or cuda.v_select(spec, v["RC_TPB"], 1, v["RC_VSEL"]) == v["RC_VSEL"]


def _edge_problem(layout, index_dtype):
    from test_hardening import _slot_edge_problem

    args, opts = _slot_edge_problem(layout, index_dtype, None, seed=31)
    return args, opts, contract.check_op(*args, **opts, layer=np.zeros((), np.int32))


def test_host_emulation_slots_at_the_edges_write_their_layer_only(emu_dir):
    """tests/test_hardening.py's slot-edge problem (slots n, n+1, -1, the int32/int64 extremes, runs
    crossing 0 and n on stacked caches) bit-exact at every layer, in every layout and with the
    vector run paths (x-packed runs of X slots, V channels, the per-block choice): a group past
    slot n - 1 or before 0 is not a run. (One test, not a matrix: the default tier samples this
    file's matrices.)"""
    for layout, index_dtype in [(lay, idt) for lay in contract.LAYOUTS for idt in ("int32", "int64")]:
        args, opts, spec = _edge_problem(layout, index_dtype)
        for variant in [v for v in EDGE_VARIANTS if _variant_exists(spec, v)]:
            for layer in range(args[3].shape[0]):
                want = reference.rope_and_cache(*args, **opts, layer=np.array(layer, np.int32))
                got = run_emulation(spec, args, None, None, emu_dir, layer=layer, defines=variant)
                for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
                    if w is None:  # kv_merged: no value cache (run_emulation checked its placeholder)
                        assert g is None, (layout, name)
                        continue
                    assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), \
                        (layout, index_dtype, variant, layer, name)


# (what, text in rope_cache.cu, its replacement, layout, variant): each place the kernel bounds a slot
_EDGE_MUTANTS = [
    ("x-packed V: slot n let through", "return (s >= 0 && s < r.n) ? r.base + s : -1;",
     "return (s >= 0 && s <= r.n) ? r.base + s : -1;", "xpacked", None),
    ("x-packed V: slot -1 let through", "return (s >= 0 && s < r.n) ? r.base + s : -1;",
     "return (s >= -1 && s < r.n) ? r.base + s : -1;", "xpacked", None),
    ("x-packed V: a run may start below slot 0", "return seq && s0 >= 0 && s0 < sr.n", "return seq && s0 < sr.n",
     "xpacked", {"RC_VCH": 4, "RC_TPB": 8}),
    ("rotated K: slot n let through", "const i64 s_any = (s_raw >= 0 && s_raw < sr.n)",
     "const i64 s_any = (s_raw >= 0 && s_raw <= sr.n)", "hnd", None),
    ("V chunks: slot n let through", "const bool ok = s_raw >= 0 && s_raw < sr.n;\n  if constexpr (VS_HEADS)",
     "const bool ok = s_raw >= 0 && s_raw <= sr.n;\n  if constexpr (VS_HEADS)", "flash", None),
]


def test_host_emulation_slot_edges_would_catch_an_off_by_one_bound(emu_dir):
    """Each off-by-one in the slot checks, built into the emulation, changes a neighbouring layer
    of the slot-edge problem at the middle layer (so the test above would fail)."""
    with open(os.path.join(_kernel_dir(), "cuda", "rope_cache.cu")) as f:
        text = f.read()
    for what, old, new, layout, variant in _EDGE_MUTANTS:
        assert text.count(old) == 1, f"{what}: the kernel no longer has {old!r}; update the mutant"
        args, opts, spec = _edge_problem(layout, "int32")
        want = reference.rope_and_cache(*args, **opts, layer=np.array(1, np.int32))
        try:
            got = run_emulation(spec, args, None, None, emu_dir, layer=1, defines=variant,
                                source=text.replace(old, new), isolated=True)
        except AssertionError:  # a write outside the caches, or a wrong run count: caught too
            continue
        assert any(not np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8))
                   for g, w in zip(got[2:], want[2:])), f"{what}: not caught"


def test_host_emulation_e5m2_stacked_layers_per_head_scales(emu_dir):
    """A float8_e5m2 cache stacked [L, ...] with one scale per kv head: each layer in range is
    written exactly (bit-exact to the reference), one outside [0, L) writes nothing."""
    layers = 3
    spec = make_spec(T=21, QH=4, KH=2, D=64, layout="xpacked", dt=BF16, cdt=E5, tdt=F32, prec="native", max_pos=50,
                     layers=layers)
    spec = dataclasses.replace(spec, k_scale_heads=True, v_scale_heads=True)
    rng = np.random.default_rng(12)
    q, k, v, kc, vc, slots, pos, cos, sin = make_inputs(dataclasses.replace(spec, num_layers=None), rng)
    kc = np.stack([_random(rng, kc.shape, kc.dtype) for _ in range(layers)])
    vc = None if vc is None else np.stack([_random(rng, vc.shape, vc.dtype) for _ in range(layers)])
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    ks, vs = np.asarray([0.3, 0.02], np.float32), np.asarray([2.5, 0.007], np.float32)
    for layer in (0, 2, -1):
        want = reference.rope_and_cache(*args, layout="xpacked", layer=np.array(layer, np.int32), k_scale=ks,
                                        v_scale=vs, precision="native")
        got = run_emulation(spec, args, ks, vs, emu_dir, layer=layer)
        _assert_bitwise(got, want)


def _e5m2_boundary_problem():
    """v (float32) holds every e5m2 boundary value (e5m2_values.boundary_f32); scale 1, so the value
    cache holds the conversion of each."""
    f = boundary_f32(exponents=ROUNDING_EXPONENTS)
    kh, d = 4, 64
    f = np.concatenate([f, np.full((-f.size) % (kh * d), 1.5, np.float32)])
    t = f.size // (kh * d)
    rng = np.random.default_rng(13)
    q = rng.standard_normal((t, kh, d)).astype(np.float32)
    kshape, vshape = contract.cache_shapes("flash", -(-t // 16), 16, kh, d, E5)
    kc, vc = (_random(rng, s, E5) for s in (kshape, vshape))
    slots = rng.permutation(kshape[0] * 16)[:t].astype(np.int32)
    args = (q, q.copy(), f.reshape(t, kh, d), kc, vc, slots, np.zeros(t, np.int32), np.ones((1, d // 2), np.float32),
            np.zeros((1, d // 2), np.float32))
    return args, dict(k_scale=np.float32(1.0), v_scale=np.float32(1.0)), f


def test_host_emulation_e5m2_conversion_every_boundary(emu_dir):
    """The CUDA kernel's e5m2 stores (rc_f32_to_e5m2 as NVRTC compiles it, built for the host) on
    every boundary value: the value cache equals the independent oracle, every output the reference."""
    args, opts, f = _e5m2_boundary_problem()
    got = _emulate(args, opts, emu_dir)
    _, v_read = reference.read_kv(got[2], got[3], args[5])
    assert np.array_equal(v_read.view(np.uint8).ravel(), oracle_e5m2(f))
    _assert_bitwise(got, reference.rope_and_cache(*args, **opts))


_E5M2_MUTANTS = [
    ("saturates to inf", "rc_f32_to_f8(f, 2u, 15u, 0x7bu, 0x7fu, false)", "rc_f32_to_f8(f, 2u, 15u, 0x7cu, 0x7fu, false)"),
    ("truncates", "(rebased + ((1u << (shift - 1u)) - 1u) + ((rebased >> shift) & 1u)) >> shift",
     "rebased >> shift"),
    ("subnormal step", "const rc_u32 magic = (127u + 23u + 1u - B - M) << 23;",
     "const rc_u32 magic = (127u + 23u - B - M) << 23;"),
    ("NaN keeps the sign", "a > 0x7f800000u ? nan_code : out", "a > 0x7f800000u ? (sign | 0x7eu) : out"),
]


@pytest.mark.parametrize("what,old,new", [pytest.param(*m, marks=[pytest.mark.full] if i else [])
                                          for i, m in enumerate(_E5M2_MUTANTS)], ids=[m[0] for m in _E5M2_MUTANTS])
def test_host_emulation_e5m2_conversion_would_catch_a_wrong_rule(what, old, new, emu_dir):
    """Each plausible mistake in rc_f32_to_e5m2, built into the host emulation of the CUDA kernel,
    changes the value cache of the boundary problem above (so that test would fail)."""
    with open(os.path.join(_kernel_dir(), "common", "rope_cache_math.h")) as fh:
        text = fh.read()
    assert text.count(old) == 1, f"{what}: the header no longer has {old!r}; update the mutant"
    args, opts, f = _e5m2_boundary_problem()
    got = _emulate(args, opts, emu_dir, math_header=text.replace(old, new))
    _, v_read = reference.read_kv(got[2], got[3], args[5])
    assert not np.array_equal(v_read.view(np.uint8).ravel(), oracle_e5m2(f)), f"{what}: not caught"


# ---- x-packed V units of RC_VCH channels ---------------------------------------------------------
def _raw_bits(rng, shape, dtype):
    """Values with uniformly random bit patterns: NaNs with payloads and signs, infs, subnormals, -0."""
    u = np.dtype(f"u{dtype.itemsize}")
    return rng.integers(0, np.iinfo(u).max, shape, dtype=u, endpoint=True).view(dtype)


def _vch_problem(kw, rng, slots="runs", raw=True):
    """(args, opts) of an x-packed call: fp8 scales (per head with vsh), prefill runs or random slots,
    v of random bits (raw) or normal values."""
    kw = dict(kw)
    vsh = kw.pop("vsh", False)
    spec = make_spec(**kw)
    q, k, v, kc, vc, s, pos, cos, sin = make_inputs(spec, rng)
    if raw:
        v = _raw_bits(rng, v.shape, v.dtype)
    if slots == "runs":
        s = _run_slots(rng, spec.num_tokens, spec)
    opts = dict(layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim, precision=spec.precision,
                table_form=spec.table_form)
    if spec.fp8:
        opts["k_scale"] = np.float32(0.37)
        opts["v_scale"] = _scales(rng, spec.kv_heads, vsh)
    return (q, k, v, kc, vc, s, pos, cos, sin), opts


def _reference(args, opts):
    with np.errstate(invalid="ignore", over="ignore"):
        return reference.rope_and_cache(*args, **opts)


VCH_CASES = [dict(T=203, QH=4, KH=2, D=64, dt=BF16), dict(T=203, QH=4, KH=2, D=128, dt=F16, cdt=FN, slot64=True),
             dict(T=203, QH=4, KH=4, D=64, dt=BF16, cdt=FNUZ, vsh=True), dict(T=203, QH=4, KH=2, D=64, dt=F32),
             dict(T=77, QH=4, KH=2, D=64, dt=F32, cdt=FN, vsh=True, slot64=True)]


@pytest.mark.parametrize("vch", [2, 4, 8])
@pytest.mark.parametrize("slots", ["runs", "random"])
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
@pytest.mark.parametrize("kw", VCH_CASES, ids=_id)
def test_host_emulation_v_channels_bitwise(kw, layout, slots, vch, emu_dir):
    """V units of RC_VCH channels on v of random bits (copies keep NaN payloads, subnormals; fp8
    quantizes them with one or per-head scales), prefill runs or random slots with invalid and huge
    values, a partial last group: bit-exact to the reference. num_sms=1: blocks of >= X tokens
    (whole groups, runs); 132 SMs: T = 77 gives small blocks (groups of fewer than X tokens)."""
    spec = make_spec(**{k: v for k, v in kw.items() if k != "vsh"}, layout=layout)
    _skip_unless_vch({"RC_VCH": vch}, spec)
    rng = np.random.default_rng(vch * 7 + len(slots))
    args, opts = _vch_problem(dict(kw, layout=layout), rng, slots)
    if slots == "runs":
        assert _run_pieces(cuda.kernel_config(contract.check_op(*args, **opts), 1, vch=vch), spec, args[5], 0) > 0
    for sms in (1, cuda.DEFAULT_SMS):
        _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=sms, defines={"RC_VCH": vch}), _reference(args, opts))


@pytest.mark.parametrize("vch", [4, 8])
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
def test_host_emulation_v_channels_stacked_layers(layout, vch, emu_dir):
    """Stacked caches with prefill runs: a run's pieces land in the operand's layer (the slot range's
    base), a layer outside [0, L) writes nothing."""
    layers, rng = 3, np.random.default_rng(13)
    spec = make_spec(T=203, QH=4, KH=2, D=64, layout=layout, NB=64, max_pos=50, layers=layers)
    q, k, v, kc, vc, _, pos, cos, sin = make_inputs(dataclasses.replace(spec, num_layers=None), rng)
    kc = np.stack([_random(rng, kc.shape, kc.dtype) for _ in range(layers)])
    vc = None if vc is None else np.stack([_random(rng, vc.shape, vc.dtype) for _ in range(layers)])
    args = (q, k, v, kc, vc, _run_slots(rng, spec.num_tokens, spec), pos, cos, sin)
    for layer in (0, 2, -1, 3):
        want = reference.rope_and_cache(*args, layout=layout, layer=np.array(layer, np.int32))
        got = run_emulation(spec, args, None, None, emu_dir, layer=layer, num_sms=1, defines={"RC_VCH": vch})
        _assert_bitwise(got, want)


def _misaligned(a):
    """a's values in a buffer starting one element past a 16-byte boundary."""
    buf = np.empty(a.size + 16 // a.itemsize, a.dtype)
    off = (-buf.ctypes.data % 16) // a.itemsize + 1
    out = buf[off:off + a.size]
    out[:] = a
    assert out.ctypes.data % 16
    return out


@pytest.mark.parametrize("slot64", [False, True])
def test_host_emulation_v_channels_misaligned_slots(slot64, emu_dir):
    """A slot buffer that is not 16-byte aligned: the run check reads the slots one by one, same bits."""
    args, opts = _vch_problem(dict(T=203, QH=4, KH=2, D=64, layout="xpacked", slot64=slot64), np.random.default_rng(2))
    args = list(args)
    args[5] = _misaligned(args[5])
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines={"RC_VCH": 4}), _reference(args, opts))


# Plausible mistakes in v_unit_xpacked_vec: (what, text in rope_cache.cu, its replacement, problem).
_V_MUTANTS = [
    ("halves of a word swapped", "c % 2 ? 0x7632 : 0x5410", "c % 2 ? 0x5410 : 0x7632", {}),
    ("tokens of a word swapped", "__byte_perm(x[2 * m].w[c / 2], x[2 * m + 1].w[c / 2]",
     "__byte_perm(x[2 * m + 1].w[c / 2], x[2 * m].w[c / 2]", {}),
    ("fp8 bytes of a word reversed", "<< (8 * b)", "<< (8 * (3 - b))", dict(dt=F16, cdt=FN)),
    ("rows of xpacked pieces", "V_ROW = LAYOUT == RC_XPACKED ? BS : X", "V_ROW = LAYOUT == RC_XPACKED ? X : BS", {}),
    ("rows of shuffled pieces", "V_ROW = LAYOUT == RC_XPACKED ? BS : X", "V_ROW = LAYOUT == RC_XPACKED ? BS : BS",
     dict(layout="xpacked_shuffled")),
    ("misaligned runs stored as pieces", "&& (sr.base + s0) % X == 0 ?", "?", {}),
    ("one slot of a run not compared", "seq = seq && (unsigned int)sv.s32[e] - (unsigned int)s0 == (unsigned int)i;",
     "seq = seq && (i == 5 || (unsigned int)sv.s32[e] - (unsigned int)s0 == (unsigned int)i);", dict(hole=True)),
    ("scalar slot loads", "static_cast<const int*>(p.slots)[tg + k * PER + e]",
     "static_cast<const int*>(p.slots)[tg + e]", dict(misaligned=True)),
    ("per-element path channel", "store_if(si >= 0, dst + c * V_ROW, to_cache(x[i].e[c], inv_v))",
     "store_if(si >= 0, dst + c * V_ROW, to_cache(x[i].e[0], inv_v))", dict(slots="random")),
]


@pytest.mark.parametrize("what,old,new,kw", _V_MUTANTS, ids=[m[0] for m in _V_MUTANTS])
def test_host_emulation_v_channels_would_catch_a_wrong_writer(what, old, new, kw, emu_dir):
    """Each plausible mistake in the RC_VCH writer, built into the host emulation, fails the checks
    the tests above make (bitwise comparison, the emulation's alignment check) on their kind of data."""
    kw = dict(kw)
    slots, misaligned, hole = (kw.pop(k, d) for k, d in (("slots", "runs"), ("misaligned", False), ("hole", False)))
    with open(os.path.join(_kernel_dir(), "cuda", "rope_cache.cu")) as f:
        text = f.read()
    assert text.count(old) == 1, f"{what}: the kernel no longer has {old!r}; update the mutant"
    base = dict(T=203, QH=4, KH=2, D=64, layout="xpacked", NB=64, max_pos=50)
    base.update(kw)
    args, opts = _vch_problem(base, np.random.default_rng(9), slots)
    args = list(args)
    spec = contract.check_op(*args, **opts)
    if hole:  # the first group: an aligned run but for one slot (in blocks no other token writes)
        bs = spec.block_size
        free = sorted(set(range(spec.num_blocks)) - {int(s) // bs for s in args[5][spec.x:] if 0 <= s < spec.num_slots})
        args[5][:spec.x] = np.arange(spec.x) + free[0] * bs
        args[5][5] = free[1] * bs + 5
    if misaligned:
        args[5] = _misaligned(args[5])
    want = _reference(args, opts)
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines={"RC_VCH": 4}), want)  # the kernel as it is
    try:
        got = _emulate(args, opts, emu_dir, num_sms=1, defines={"RC_VCH": 4}, source=text.replace(old, new))
    except AssertionError:  # the emulation's own checks (a misaligned 16-byte store)
        return
    assert not np.array_equal(got[3].view(np.uint8), np.asarray(want[3]).view(np.uint8)), f"{what}: not caught"


# Real shapes (kv heads, head_dim, dtypes) and where they run: (name, shape, layouts, token counts).
VCH_SHAPES = [("llama8b", dict(QH=32, KH=8, D=128), ("xpacked", "xpacked_shuffled"), (8192, 128, 1)),
              ("gptoss", dict(QH=8, KH=1, D=64), ("xpacked",), (8192,)),
              ("llama8b-fp8", dict(QH=32, KH=8, D=128, cdt=FN), ("xpacked",), (8192,)),
              ("llama8b-fp8", dict(QH=32, KH=8, D=128, cdt=FN), ("xpacked_shuffled",), (128,)),
              ("llama8b-f32-fnuz", dict(QH=32, KH=8, D=128, dt=F32, cdt=FNUZ), ("xpacked",), (8192,))]


def vch_compile_matrix():
    out = []
    for name, shape, layouts, ts in VCH_SHAPES:
        for layout, t, c in itertools.product(layouts, ts, (1, 2, 4, 8)):
            out.append((f"{name}-{layout}-T{t}-vch{c}", make_spec(T=t, layout=layout, **shape), c))
    return out


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_nvrtc_compiles_v_channels_without_spills(arch):
    """RC_VCH 1, 2, 4, 8 (as far as the dtype allows) at the configurations kernel_config picks for
    real shapes (prefill, mid-size, decode): a cubin, no spills, no stack; the configuration's V
    units and threads follow the channel count."""
    matrix = vch_compile_matrix()
    cfgs = [cuda.kernel_config(spec, vch=c) for _, spec, c in matrix]
    for (name, spec, c), cfg in zip(matrix, cfgs):
        d = dict(cfg.defines)
        assert d["RC_VCH"] == cuda.v_channels(spec, c) == min(c, 16 // spec.dtype.itemsize), name
        assert 32 <= cfg.threads <= max(32, -(-_units(cfg, spec) // 32) * 32), name  # no thread without a unit
    failures = spill_failures([s for _, s, _ in matrix], [n for n, _, _ in matrix], arch, cfgs=cfgs)
    assert not failures, "\n".join(failures[:5])


def test_v_channels_configuration():
    """RC_VCH is 1 unless asked (V_CHANNELS), never more than the shape allows, 1 for flash; a
    larger C leaves fewer V units (the threads of a one-token block)."""
    assert cuda.V_CHANNELS == 1
    llama = make_spec(T=8192, QH=32, KH=8, D=128, layout="xpacked")
    assert dict(cuda.kernel_config(llama).defines)["RC_VCH"] == 1
    assert dict(cuda.kernel_config(make_spec(layout="flash"), vch=8).defines)["RC_VCH"] == 1
    assert cuda.v_channels(make_spec(layout="xpacked", dt=F32), 8) == 4
    assert cuda.v_channels(make_spec(layout="xpacked", dt=F16, cdt=FN), 8) == 8
    units = [cuda._block_units(llama, 8, c)[0](16) for c in (1, 2, 4, 8)]
    assert units == [16 * 320 + 2 * 8 * 128 // c for c in (1, 2, 4, 8)]
    with pytest.raises(Exception, match="RC_VCH"):  # the kernel refuses what the shape does not allow
        cfg = cuda.kernel_config(make_spec(layout="xpacked", dt=F32))
        bad = dataclasses.replace(cfg, defines=tuple((k, 8 if k == "RC_VCH" else v) for k, v in cfg.defines))
        cuda.compile_variant(bad, "compute_90")


# ---- RC_VSEL: the V decomposition chosen per block at run time ------------------------------------
def _vsel_slots(rng, spec, tpb, kind, t=None, group=None):
    """Slots of t tokens (spec's T): sequences filling shuffled blocks from offset 0 (every group an
    aligned run), then broken by `kind` in block 1 (tokens tpb .. 2 tpb - 1), group 1 where it has
    two: "allruns", "swap" (two neighbouring slots swapped: each off by one), "invalid" (-1),
    "outofrange" (num_slots), "misaligned" (a group of an unused block from offset 1), "random"
    (distinct random slots), "mixed" (_run_slots). group: the broken group of block 1 instead
    (-1: its last)."""
    t = spec.num_tokens if t is None else t
    x, bs, nb = spec.x, spec.block_size, spec.num_blocks
    if kind == "mixed":
        return _run_slots(rng, t, spec).astype(np.int64)
    if kind == "random":
        return rng.choice(spec.num_slots, t, replace=False).astype(np.int64)
    nused = -(-t // bs)
    assert nused + 2 <= nb, "the test needs unused blocks"
    blocks = rng.permutation(nb)
    s = (blocks[:nused, None] * bs + np.arange(bs)).reshape(-1)[:t].astype(np.int64)
    free = sorted(set(range(nb)) - set(blocks[:nused].tolist()))
    group = (1 if tpb >= 2 * x else 0) if group is None else group % (tpb // x)
    j = tpb + group * x  # the broken group's first token
    if kind == "swap":
        s[j + x // 2 - 1], s[j + x // 2] = s[j + x // 2], s[j + x // 2 - 1]
    elif kind == "invalid":
        s[j + x - 1] = -1
    elif kind == "outofrange":
        s[j + x - 1] = spec.num_slots
    elif kind == "misaligned":
        s[j:j + x] = free[0] * bs + 1 + np.arange(x)
    else:
        assert kind == "allruns", kind
    return s


def _vsel_case(kw, vsel, kind, rng, tail=0, raw=True, variant=None, group=None):
    """(args, opts, spec, cfg defines) of an x-packed call whose blocks are tpb tokens (num_sms=1
    config), 4 blocks (+ tail tokens), RC_VSEL = vsel; None where the shape does not allow it."""
    kw = dict(kw)
    vsh = kw.pop("vsh", False)
    probe = make_spec(**kw, T=8192, NB=96, max_pos=50)
    tpb = dict(cuda.kernel_config(probe, 1).defines)["RC_TPB"]
    tpb = (variant or {}).get("RC_TPB", tpb)
    if cuda.v_select(probe, tpb, 1, vsel) != vsel:
        return None
    t = 4 * tpb + tail
    spec = make_spec(**kw, T=t, NB=96, max_pos=50)
    q, k, v, kc, vc, _, pos, cos, sin = make_inputs(spec, rng)
    if raw:
        v = _raw_bits(rng, v.shape, v.dtype)
    s = _vsel_slots(rng, spec, tpb, kind, group=group).astype(spec.slot_dtype)
    opts = dict(layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim, precision=spec.precision,
                table_form=spec.table_form)
    if spec.fp8:
        opts["k_scale"] = np.float32(0.37)
        opts["v_scale"] = _scales(rng, spec.kv_heads, vsh)
    return (q, k, v, kc, vc, s, pos, cos, sin), opts, spec, dict(variant or {}, RC_TPB=tpb, RC_VSEL=vsel)


VSEL_CASES = [dict(QH=4, KH=2, D=64, dt=BF16), dict(QH=4, KH=2, D=128, dt=F16, cdt=FN, slot64=True),
              dict(QH=4, KH=4, D=64, dt=BF16, cdt=FNUZ, vsh=True), dict(QH=4, KH=2, D=64, dt=F32),
              dict(QH=2, KH=1, D=64, dt=F32, cdt=FN, vsh=True, slot64=True), dict(QH=4, KH=2, D=64, dt=F16, slot64=True)]
VSEL_KINDS = ["allruns", "swap", "invalid", "outofrange", "misaligned", "random", "mixed"]


def _vsel_expect(defines, spec, slots, kind, tail):
    """What the decision must be: every block an all-run block for "allruns" (but a partial tail),
    block 1 not for the broken kinds, none for random slots."""
    cfg = cuda.KernelConfig(defines=tuple(dict(RC_TPB=defines["RC_TPB"], RC_VSEL=defines["RC_VSEL"]).items()),
                            tokens_per_block=defines["RC_TPB"], threads=0)
    blocks = _run_blocks(cfg, spec, slots, 0)
    assert len(blocks) == 4
    if kind == "allruns":
        assert blocks.all()
    elif kind == "random":
        assert not blocks.any()
    elif kind != "mixed":
        assert not blocks[1] and blocks[[0, 2, 3]].all()
    return _run_units(cfg, spec, slots, 0)


@pytest.mark.parametrize("vsel", [2, 4, 8])
@pytest.mark.parametrize("kind", VSEL_KINDS)
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
@pytest.mark.parametrize("kw", VSEL_CASES, ids=_id)
def test_host_emulation_v_select_bitwise(kw, layout, kind, vsel, emu_dir):
    """RC_VSEL: all-run blocks take the C-channel run units, any block with one broken group (two
    slots swapped, an invalid or out-of-range slot, a misaligned start) and random slots take the
    one-channel units; bit-exact to the reference (v of random bits), the emulation's count of run
    units equals the all-run blocks' (run_emulation), a partial tail block (T % TPB) never runs."""
    rng = np.random.default_rng(VSEL_KINDS.index(kind) * 100 + vsel * 10 + len(layout) + len(VSEL_CASES[0]))
    for tail, group in ((0, 0), (0, -1), (5, None)):  # the first, the last, a middle group broken
        case = _vsel_case(dict(kw, layout=layout), vsel, kind, rng, tail=tail, group=group)
        if case is None:
            pytest.skip(f"RC_VSEL={vsel}: not a configuration of {kw}")
        args, opts, spec, defines = case
        want_units = _vsel_expect(defines, spec, args[5], kind, tail)
        assert kind == "mixed" or (want_units > 0) == (kind != "random"), want_units
        got = _emulate(args, opts, emu_dir, num_sms=1, defines=defines)
        _assert_bitwise(got, _reference(args, opts))


@pytest.mark.parametrize("variant", [{"RC_TPB": 8}, {"RC_TPB": 64, "RC_VPAIRS": 0}], ids=["tpb8", "tpb64-nopairs"])
@pytest.mark.parametrize("kind", ["allruns", "invalid", "mixed"])
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
def test_host_emulation_v_select_block_sizes(layout, kind, variant, emu_dir):
    """RC_VSEL 4 with one group per block (TPB = X: no lane pairs) and with eight unpaired groups."""
    case = _vsel_case(dict(QH=4, KH=2, D=64, dt=BF16, layout=layout), 4, kind, np.random.default_rng(3),
                      tail=3, variant=variant)
    args, opts, spec, defines = case
    _vsel_expect(defines, spec, args[5], kind, 3)
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines=defines), _reference(args, opts))


@pytest.mark.parametrize("slot64", [False, True])
@pytest.mark.parametrize("kind", ["allruns", "swap"])
def test_host_emulation_v_select_misaligned_slots(slot64, kind, emu_dir):
    """A slot buffer that is not 16-byte aligned: the block's decision reads its slots one by one."""
    args, opts, spec, defines = _vsel_case(dict(QH=4, KH=2, D=64, layout="xpacked", slot64=slot64), 4, kind,
                                           np.random.default_rng(4), tail=0)
    args = list(args)
    args[5] = _misaligned(args[5])
    _vsel_expect(defines, spec, args[5], kind, 0)
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines=defines), _reference(args, opts))


@pytest.mark.parametrize("vsel", [2, 8])
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
def test_host_emulation_v_select_stacked_layers(layout, vsel, emu_dir):
    """Stacked caches, all-run slots: run blocks write the operand's layer; a layer outside [0, L)
    writes nothing and takes no run block (the decision uses the layer's slot range)."""
    layers, rng = 3, np.random.default_rng(17)
    kw = dict(QH=4, KH=2, D=64, layout=layout)
    args, opts, spec, defines = _vsel_case(kw, vsel, "allruns", rng, tail=0)
    spec = make_spec(**kw, T=spec.num_tokens, NB=96, max_pos=50, layers=layers)
    kc = np.stack([_random(rng, args[3].shape, args[3].dtype) for _ in range(layers)])
    vc = None if args[4] is None else np.stack([_random(rng, args[4].shape, args[4].dtype) for _ in range(layers)])
    args = args[:3] + (kc, vc) + args[5:]
    for layer in (0, 2, -1, 3):
        want = reference.rope_and_cache(*args, layout=layout, layer=np.array(layer, np.int32))
        got = run_emulation(spec, args, None, None, emu_dir, layer=layer, num_sms=1, defines=defines)
        _assert_bitwise(got, want)


# Plausible mistakes in the per-block choice: (what, text in rope_cache.cu, its replacement, slots kind, tail);
# the broken group of block 1 is its last one.
_VSEL_MUTANTS = [
    ("any group decides", "all = all & (run_slot(p, t0 + (i64)g * X, sr) >= 0)",
     "all = all | (run_slot(p, t0 + (i64)g * X, sr) >= 0)", "swap", 0),
    ("first group decides", "for (int g = 0; g < TPB / X; ++g) all", "for (int g = 0; g < 1; ++g) all", "invalid", 0),
    ("one slot of the group not compared", "seq = seq && (unsigned int)sv.s32[e] - (unsigned int)s0 == (unsigned int)i;",
     "seq = seq && (i == X - 1 || (unsigned int)sv.s32[e] - (unsigned int)s0 == (unsigned int)i);", "invalid", 0),
    ("last group ignored", "for (int g = 0; g < TPB / X; ++g) all", "for (int g = 0; g < TPB / X - 1; ++g) all",
     "invalid", 0),
    ("partial block may run", "if (t0 + TPB > T) return false;", "", "allruns", 5),
    ("always runs", "vrun = block_runs(p, T, t0, sr);", "vrun = true;", "random", 0),
    ("never runs", "vrun = block_runs(p, T, t0, sr);", "vrun = false;", "allruns", 0),
    ("run blocks keep the one-channel bound", "(vrun ? N_V_RUN : N_V)", "(vrun ? N_V : N_V)", "allruns", 0),
    ("other blocks get the run bound", "(vrun ? N_V_RUN : N_V)", "(vrun ? N_V_RUN : N_V_RUN)", "swap", 0),
    ("run units' channel groups", "v_idx<D / C>(u)", "v_idx<D / VSEL / 2>(u)", "allruns", 0),
    ("run slot without the layer base", "sr.base + load_index(p.slots, tg", "load_index(p.slots, tg", "layer", 0),
]


@pytest.mark.parametrize("what,old,new,kind,tail", _VSEL_MUTANTS, ids=[m[0] for m in _VSEL_MUTANTS])
def test_host_emulation_v_select_would_catch_a_wrong_choice(what, old, new, kind, tail, emu_dir):
    """Each mistake in the decision rule or the unit bound, built into the emulation, fails the
    checks above (bitwise, guard bytes, the run-unit count, the emulation's run check). The slot and
    v buffers continue past T (more runs), so reading past T would show."""
    with open(os.path.join(_kernel_dir(), "cuda", "rope_cache.cu")) as f:
        text = f.read()
    assert text.count(old) == 1, f"{what}: the kernel no longer has {old!r}; update the mutant"
    rng = np.random.default_rng(21)
    kw = dict(QH=4, KH=2, D=64, layout="xpacked")
    vsel = 4
    args, opts, spec, defines = _vsel_case(kw, vsel, "allruns" if kind == "layer" else kind, rng, tail=tail, group=-1)
    args = list(args)
    t = spec.num_tokens
    sbuf = _vsel_slots(rng, make_spec(**kw, T=t + 64, NB=96), defines["RC_TPB"], "allruns" if kind == "layer" else kind,
                       group=-1).astype(args[5].dtype)  # the runs continue past T
    args[5] = sbuf[:t]
    vbuf = np.concatenate([args[2], _raw_bits(rng, (64,) + args[2].shape[1:], args[2].dtype)])
    args[2] = vbuf[:t]
    layer, lspec = 0, spec
    if kind == "layer":
        layers = 3
        lspec = make_spec(**kw, T=t, NB=96, max_pos=50, layers=layers)
        args[3] = np.stack([_random(rng, args[3].shape, args[3].dtype) for _ in range(layers)])
        args[4] = None if args[4] is None else np.stack([_random(rng, args[4].shape, args[4].dtype) for _ in range(layers)])
        layer = 2
    def run(source, isolated=False):
        want = reference.rope_and_cache(*args, layout="xpacked", layer=None if kind != "layer" else np.array(layer, np.int32))
        got = run_emulation(lspec, args, None, None, emu_dir, layer=layer, num_sms=1, defines=defines, source=source,
                            isolated=isolated)
        _assert_bitwise(got, want)
    run(None)  # the kernel as it is
    # the mutant in a child process: a wrong unit bound may crash it (writes far outside the buffers)
    try:
        run(text.replace(old, new), isolated=True)
    except (Exception, pytest.fail.Exception):  # noqa: BLE001 - caught by a check (or the mutant does not build)
        return
    pytest.fail(f"{what}: not caught")


VSEL_SHAPES = [("llama8b", dict(QH=32, KH=8, D=128)), ("gptoss-tp8", dict(QH=8, KH=1, D=64)),
               ("gptoss-tp1", dict(QH=64, KH=8, D=64)), ("llama70b-tp8", dict(QH=8, KH=1, D=128)),
               ("llama8b-fp8", dict(QH=32, KH=8, D=128, cdt=FN)), ("gptoss-tp8-fp8", dict(QH=8, KH=1, D=64, cdt=FN)),
               ("llama70b-tp8-fp8", dict(QH=8, KH=1, D=128, cdt=FNUZ))]


@pytest.mark.parametrize("arch", ["sm_90"])
def test_nvrtc_compiles_v_select_without_spills(arch):
    """RC_VSEL 2, 4, 8 at the prefill configurations of real shapes (both x-packed layouts, bf16 and
    fp8 caches, T = 8192 and 32768; decode sizes, where it cannot apply, get 0): a cubin, no spills,
    no stack; the threads are the one-channel configuration's."""
    matrix, cfgs = [], []
    for (name, shape), layout, t, c in itertools.product(VSEL_SHAPES, ("xpacked", "xpacked_shuffled"), (8192, 32768),
                                                        (2, 4, 8)):
        spec = make_spec(T=t, layout=layout, **shape)
        cfg = cuda.kernel_config(spec, vsel=c)
        assert dict(cfg.defines)["RC_VSEL"] == c, name
        assert cfg.threads == cuda.kernel_config(spec).threads, name
        matrix.append((f"{name}-{layout}-T{t}-vsel{c}", spec))
        cfgs.append(cfg)
    assert dict(cuda.kernel_config(make_spec(T=1, layout="xpacked", QH=32, KH=8, D=128), vsel=4).defines)["RC_VSEL"] == 0
    failures = spill_failures([s for _, s in matrix], [n for n, _ in matrix], arch, cfgs=cfgs)
    assert not failures, "\n".join(failures[:5])


def test_v_select_configuration():
    """RC_VSEL is V_SELECT_CHANNELS (4; fp8 caches 2) where runs can exist, 0 for flash, RC_VCH > 1,
    blocks of fewer than X tokens (decode); the kernel refuses a value the shape does not allow."""
    assert cuda.V_SELECT_CHANNELS == 4
    one_kv_head = make_spec(T=8192, QH=8, KH=1, D=64, layout="xpacked")
    assert dict(cuda.kernel_config(one_kv_head).defines)["RC_VSEL"] == 0  # measured neutral or slower there
    assert dict(cuda.kernel_config(one_kv_head, vsel=4).defines)["RC_VSEL"] == 4
    llama = make_spec(T=8192, QH=32, KH=8, D=128, layout="xpacked")
    assert dict(cuda.kernel_config(llama).defines)["RC_VSEL"] == 4
    assert dict(cuda.kernel_config(make_spec(T=8192, QH=32, KH=8, D=128, layout="xpacked", cdt=FN)).defines)["RC_VSEL"] == 2
    assert dict(cuda.kernel_config(make_spec(T=1, QH=32, KH=8, D=128, layout="xpacked")).defines)["RC_VSEL"] == 0
    assert dict(cuda.kernel_config(llama, vsel=0).defines)["RC_VSEL"] == 0
    assert dict(cuda.kernel_config(llama, vsel=8).defines)["RC_VSEL"] == 8
    assert dict(cuda.kernel_config(llama, vsel=8, vch=2).defines)["RC_VSEL"] == 0
    assert dict(cuda.kernel_config(make_spec(T=8192, layout="flash"), vsel=8).defines)["RC_VSEL"] == 0
    assert dict(cuda.kernel_config(make_spec(T=8192, layout="xpacked", dt=F32), vsel=8).defines)["RC_VSEL"] == 4
    saved = cuda.V_SELECT_CHANNELS
    try:
        cuda.V_SELECT_CHANNELS = 2
        assert dict(cuda.kernel_config(llama).defines)["RC_VSEL"] == 2
    finally:
        cuda.V_SELECT_CHANNELS = saved
    with pytest.raises(Exception, match="RC_VSEL"):
        cfg = cuda.kernel_config(make_spec(T=8192, layout="xpacked", dt=F32))
        bad = dataclasses.replace(cfg, defines=tuple((k, 8 if k == "RC_VSEL" else v) for k, v in cfg.defines))
        cuda.compile_variant(bad, "compute_90")


# ---- QK-RMSNorm before the rotation, per-head fp8 scales ----------------------------------
# Keys of a matrix entry beyond make_spec's: the norm weights' dtypes, eps, per-head scales.
_EXTRA = ("qn", "kn", "eps", "ksh", "vsh")


def spec_of(kw):
    """The OpSpec of a matrix entry (make_spec, plus the issue-18 options of _EXTRA)."""
    spec = make_spec(**{k: v for k, v in kw.items() if k not in _EXTRA})
    qn, kn = kw.get("qn"), kw.get("kn")
    eps = float(np.float32(kw.get("eps", 1e-6))) if (qn is not None or kn is not None) else 0.0
    return dataclasses.replace(spec, q_norm_dtype=qn, k_norm_dtype=kn, norm_eps=eps,
                               k_scale_heads=kw.get("ksh", False), v_scale_heads=kw.get("vsh", False))


def norm_compile_matrix():
    """Norm variants: every layout and style, weights in q's dtype and f32, q only / k only / both,
    per-head scales; the fast lane path (R == D, a power of two) and the generic one (R < D, D = 80,
    more than 32 lanes per head)."""
    out = []
    for i, (layout, neox, combo) in enumerate(itertools.product(contract.LAYOUTS, (True, False), COMBOS)):
        dt, cdt, tdt, prec = combo
        d = (128, 64, 256, 80)[i % 4]
        if layout != "flash" and d % contract.pack_width(cdt):
            d = 128
        r = d if i % 5 else d // 2
        wdt = (dt, F32)[i % 2]
        qn, kn = [(wdt, wdt), (wdt, None), (None, wdt), (dt, F32)][i % 4]
        fp8 = cdt in contract.FP8_DTYPES
        heads = [(8, 1), (64, 4), (16, 2)][i % 3]
        out.append(dict(T=(1, 8192, 128)[i % 3], QH=heads[0], KH=heads[1], D=d, R=r, layout=layout, neox=neox, dt=dt,
                        cdt=cdt, tdt=tdt, prec=prec, full=bool(i % 2), qn=qn, kn=kn, ksh=fp8 and heads[1] > 1,
                        vsh=fp8 and heads[1] > 1 and i % 2 == 0))
    # Qwen3-32B TP8 / Qwen3-235B TP4 shapes (8/1/128, 16/1/128), "fused" native with an fp8 cache
    out.append(dict(T=8192, QH=8, KH=1, D=128, dt=BF16, tdt=F32, qn=BF16, kn=BF16))
    out.append(dict(T=1, QH=16, KH=1, D=128, dt=BF16, tdt=BF16, prec="native", qn=BF16, kn=BF16))
    out.append(dict(T=128, QH=8, KH=4, D=128, layout="xpacked_shuffled", dt=BF16, cdt=FNUZ, tdt=F32, prec="native",
                    qn=F32, kn=F32, ksh=True, vsh=True))
    return out


NORM_MATRIX = norm_compile_matrix()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_nvrtc_compiles_norm_variants_without_spills(arch):
    failures = spill_failures([spec_of(kw) for kw in NORM_MATRIX], [_id(kw) for kw in NORM_MATRIX], arch)
    assert not failures, "\n".join(failures[:5])


def _ptx(kw):
    return cuda.compile_variant(cuda.kernel_config(spec_of(kw)), "compute_90").code.decode(errors="replace")


def test_norm_instructions_in_the_ptx():
    """The fast path reduces with butterfly shuffles, the generic one without; both take the
    correctly rounded sqrt and reciprocal (never rsqrt.approx); without a norm none of it is there."""
    base = dict(T=128, QH=8, KH=1, D=128)
    plain, lanes = _ptx(base), _ptx(dict(base, qn=BF16, kn=BF16))
    generic = _ptx(dict(base, R=64, qn=BF16, kn=BF16))
    for text in (plain, lanes, generic):
        assert "rsqrt" not in text and "sqrt.approx" not in text and "rcp.approx" not in text
    assert "shfl.sync" not in plain and "sqrt" not in plain
    assert "shfl.sync.bfly" in lanes and "sqrt.rn.f32" in lanes and "rcp.rn.f32" in lanes
    assert "shfl.sync" not in generic and "sqrt.rn.f32" in generic


def _weight(rng, d, dtype):
    return (rng.standard_normal(d) * 0.5 + 1.0).astype(np.float32).astype(dtype)


def _scales(rng, kh, heads):
    return (rng.uniform(0.2, 3.0, kh) if heads else rng.uniform(0.2, 3.0, ())).astype(np.float32)


def _norm_problem(kw, rng):
    """(args, opts) of an entry: make_inputs plus the weights, eps and (per-head) scales it names."""
    spec0 = make_spec(**{k: v for k, v in kw.items() if k not in _EXTRA})
    args = make_inputs(spec0, rng)
    opts = dict(layout=spec0.layout, is_neox=spec0.is_neox, rotary_dim=spec0.rotary_dim, precision=spec0.precision,
                table_form=spec0.table_form)
    d = spec0.head_dim
    if kw.get("qn") is not None:
        opts["q_norm_weight"] = _weight(rng, d, kw["qn"])
    if kw.get("kn") is not None:
        opts["k_norm_weight"] = _weight(rng, d, kw["kn"])
    if "eps" in kw:
        opts["norm_eps"] = kw["eps"]
    if spec0.fp8:
        opts["k_scale"] = _scales(rng, spec0.kv_heads, kw.get("ksh", False))
        opts["v_scale"] = _scales(rng, spec0.kv_heads, kw.get("vsh", False))
    return args, opts


def _emulate(args, opts, emu_dir, **kw):
    spec = contract.check_op(*args, **opts)
    return run_emulation(spec, args, opts.get("k_scale"), opts.get("v_scale"), emu_dir,
                         q_norm_weight=opts.get("q_norm_weight"), k_norm_weight=opts.get("k_norm_weight"), **kw)


def _assert_bitwise(got, want):
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if _both_none(g, w):
            continue
        gb, wb = g.view(np.uint8), np.asarray(w).view(np.uint8)
        assert g.shape == w.shape, name
        if not np.array_equal(gb, wb):
            bad = np.argwhere(g.view(f"u{g.dtype.itemsize}") != np.asarray(w).view(f"u{g.dtype.itemsize}"))
            pytest.fail(f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}")


def norm_emulation_matrix():
    m = 50
    cases = [
        # fast lane path (R == D, a power of two): Qwen3 shapes and dtypes
        dict(T=37, QH=8, KH=1, D=128, dt=BF16, tdt=F32, qn=BF16, kn=BF16),
        dict(T=5, QH=4, KH=2, D=128, dt=BF16, tdt=BF16, prec="native", qn=F32, kn=F32, full=True),
        dict(T=130, QH=4, KH=2, D=64, layout="xpacked", neox=False, dt=F16, cdt=FN, tdt=F16, prec="native", qn=F16,
             ksh=True, vsh=True),
        dict(T=37, QH=4, KH=2, D=128, layout="xpacked_shuffled", dt=BF16, cdt=FNUZ, tdt=F32, prec="native", kn=F32,
             ksh=True),  # "fused": the fp8 key cache quantizes the rotated f32 values of the normalised k
        dict(T=9, QH=2, KH=2, D=256, dt=F32, tdt=F32, qn=F32, kn=F32),  # 32 lanes per head: a whole warp
        dict(T=9, QH=2, KH=1, D=128, neox=False, dt=F32, cdt=FN, tdt=BF16, qn=F32, kn=F32, full=True),  # 32 lanes
        dict(T=21, QH=4, KH=2, D=64, dt=F16, tdt=F32, prec="native", qn=F16, kn=F32, eps=1e-5),  # two weight dtypes
        dict(T=21, QH=4, KH=4, D=16, neox=False, dt=BF16, qn=F32, kn=BF16, eps=0.5),  # 2 lanes per head
        dict(T=11, QH=2, KH=1, D=8, dt=BF16, qn=BF16, kn=BF16),  # NeoX with 1 lane per head: no shuffle
        # generic path: partial rotary, D not a power of two, more than 32 lanes per head
        dict(T=37, QH=4, KH=2, D=128, R=64, layout="xpacked", dt=BF16, qn=BF16, kn=BF16),
        dict(T=37, QH=4, KH=2, D=128, R=32, neox=False, dt=BF16, cdt=FN, qn=F32, kn=BF16, ksh=True, vsh=True),
        dict(T=13, QH=4, KH=1, D=80, neox=False, dt=BF16, tdt=F32, qn=F32, kn=F32),
        dict(T=13, QH=4, KH=2, D=80, R=40, dt=F16, cdt=FN, tdt=F16, prec="native", qn=F16, vsh=True),
        dict(T=9, QH=2, KH=1, D=64, R=6, dt=F16, qn=F16, kn=F16),  # odd R/2: one-element chunks
        dict(T=9, QH=2, KH=2, D=256, neox=False, dt=F32, qn=F32, kn=F32, eps=1e-30),  # 64 chunks per head
        dict(T=9, QH=2, KH=1, D=96, dt=BF16, layout="xpacked", qn=BF16, kn=F32),
        # per-head scales alone (no norm), every layout
        dict(T=37, QH=4, KH=2, D=128, dt=BF16, cdt=FN, ksh=True, vsh=True),
        dict(T=130, QH=4, KH=4, D=64, layout="xpacked", dt=F16, cdt=FNUZ, tdt=F16, prec="native", vsh=True),
        dict(T=37, QH=8, KH=2, D=128, layout="xpacked_shuffled", neox=False, dt=BF16, cdt=FN, tdt=F32, prec="native",
             ksh=True),
        # float8_e5m2 with per-head scales, with and without the norm
        dict(T=37, QH=4, KH=2, D=128, layout="hnd", dt=BF16, cdt=E5, tdt=F32, prec="native", ksh=True, vsh=True),
        dict(T=21, QH=4, KH=2, D=64, layout="xpacked", neox=False, dt=F16, cdt=E5, tdt=F16, qn=F16, kn=F32, vsh=True),
    ]
    for c in cases:
        c.setdefault("max_pos", m)
    return cases


@pytest.mark.parametrize("kw", norm_emulation_matrix(), ids=_id)
def test_host_emulation_norm_and_head_scales_bitwise(kw, emu_dir):
    """The kernel with the norm and per-head scales, built for the host, equals the reference bit
    for bit on fresh random data; the emulated shuffle groups check their lanes (run_emulation)."""
    rng = np.random.default_rng(abs(hash(_id(kw))) % 2**32)
    args, opts = _norm_problem(kw, rng)
    spec = contract.check_op(*args, **opts)
    assert (spec.q_norm_dtype, spec.k_norm_dtype) == (kw.get("qn"), kw.get("kn"))
    assert (spec.k_scale_heads, spec.v_scale_heads) == (kw.get("ksh", False), kw.get("vsh", False))
    want = reference.rope_and_cache(*args, **opts)
    _assert_bitwise(_emulate(args, opts, emu_dir), want)
    if "q_norm_weight" in opts:  # the norm changed q: the comparison above saw it
        plain = reference.rope_and_cache(*args, **{k: v for k, v in opts.items() if k != "q_norm_weight"})
        assert not np.array_equal(plain[0].view(np.uint8), want[0].view(np.uint8))


@pytest.mark.parametrize("variant", [{"RC_TPB": 8}, {"RC_TPB": 32}, {"RC_TPB": 8, "RC_EARLY_W": 1},
                                     {"RC_TPB": 1, "RC_EARLY_W": 0}], ids=["tpb8", "tpb32", "tpb8-early-w", "tpb1-late-w"])
@pytest.mark.parametrize("neox", [True, False])
def test_host_emulation_norm_with_several_units_per_thread(variant, neox, emu_dir):
    """Blocks of several tokens (the configuration of large calls): units are grouped per head
    whatever the block size; the weights loaded early or after the sum (RC_EARLY_W) alike."""
    kw = dict(T=203, QH=8, KH=2, D=128, neox=neox, dt=BF16, qn=BF16, kn=F32, max_pos=50)
    args, opts = _norm_problem(kw, np.random.default_rng(3))
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines=variant), reference.rope_and_cache(*args, **opts))


def _special_rows(rng, t, h, d, dtype):
    """Rows of every magnitude and with specials: normal, tiny (subnormal squares and values),
    huge (squares overflow to inf: inv = 0), all zeros, one NaN, one inf, +-max."""
    f = np.finfo(dtype) if dtype != BF16 else ml_dtypes.finfo(ml_dtypes.bfloat16)
    with np.errstate(over="ignore"):
        return _special_rows_f32(rng, t, h, d, f).astype(dtype)


def _special_rows_f32(rng, t, h, d, f):
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    kind = rng.integers(0, 8, (t, h))
    x[kind == 1] *= np.float32(f.tiny) * 4
    x[kind == 2] *= np.float32(f.max) / 4
    x[kind == 3] = 0
    ti, hi = np.nonzero(kind == 4)
    x[ti, hi, rng.integers(0, d, len(ti))] = np.nan
    ti, hi = np.nonzero(kind == 5)
    x[ti, hi, rng.integers(0, d, len(ti))] = -np.inf
    ti, hi = np.nonzero(kind == 6)
    x[ti, hi, rng.integers(0, d, len(ti))] = np.float32(f.max)
    x[kind == 7] *= np.exp2(rng.integers(-30, 30, (int((kind == 7).sum()), 1))).astype(np.float32)
    return x


@pytest.mark.parametrize("dt,wdt,cdt,R,eps", [(BF16, BF16, None, 128, 1e-6), (BF16, F32, FN, 128, 1e-40),
                                              (F16, F16, FNUZ, 64, 1e-6), (F32, F32, None, 128, 1e-6),
                                              (F16, F32, None, 80, 3.0)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_host_emulation_norm_special_rows_bitwise(dt, wdt, cdt, R, eps, emu_dir):
    """NaN, inf, zero, subnormal and overflowing rows, subnormal and large eps: bit-exact, NaN bits
    included (every NaN the norm makes is canonical)."""
    rng = np.random.default_rng(23)
    d = 80 if R == 80 else 128
    kw = dict(T=40, QH=4, KH=2, D=d, R=R, dt=dt, cdt=cdt, qn=wdt, kn=wdt, eps=eps, max_pos=50)
    args, opts = _norm_problem(kw, rng)
    args = list(args)
    args[0] = _special_rows(rng, 40, 4, d, dt)
    args[1] = _special_rows(rng, 40, 2, d, dt)
    opts["q_norm_weight"][:3] = np.array([np.nan, 0, -np.inf], np.float32).astype(wdt)  # weight specials too
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    assert np.isnan(want[0].astype(np.float32)).any() and (want[0] == 0).any()
    _assert_bitwise(_emulate(args, opts, emu_dir), want)


def _other_norms(x, w, eps):
    """Plausible wrong RMSNorms of x [T, H, D] (f32): other summation orders, no rounding point 1."""
    xf = x.astype(np.float32)
    sq = xf * xf
    d = x.shape[-1]

    def finish(s, round_y=True):
        inv = np.float32(1) / np.sqrt(s / np.float32(d) + np.float32(eps))
        y = xf * inv[..., None]
        y = reference.to_dtype(y, x.dtype).astype(np.float32) if round_y else y
        return reference.to_dtype(w.astype(np.float32) * y, x.dtype)

    seq = sq[..., 0].copy()
    for i in range(1, d):
        seq = seq + sq[..., i]
    fold = sq
    while fold.shape[-1] > 1:  # folded halves: i + D/2 first (the wrong butterfly pairing)
        fold = fold[..., : fold.shape[-1] // 2] + fold[..., fold.shape[-1] // 2:]
    tree = reference.tree_sum(sq)
    return {"sequential sum": finish(seq), "folded halves": finish(fold[..., 0]), "no rounding before the weight":
            finish(tree, round_y=False)}


@pytest.mark.parametrize("dt", [F32, BF16], ids=lambda v: v.name)
def test_host_emulation_norm_would_catch_a_wrong_order_or_rounding(dt, emu_dir):
    """The data of the bitwise tests tells the spec's tree from other orders and rounding points:
    each wrong variant differs from the kernel's outputs (here pass-through channels, R = D/2, show
    the normalised values unrotated), the spec's RMSNorm equals them."""
    rng = np.random.default_rng(31)
    kw = dict(T=64, QH=4, KH=2, D=128, R=64, dt=dt, qn=F32, kn=F32, max_pos=50)
    args, opts = _norm_problem(kw, rng)
    got_q = _emulate(args, opts, emu_dir)[0][..., 64:]
    right = reference.rms_norm(args[0], opts["q_norm_weight"], 1e-6)[..., 64:]
    assert np.array_equal(got_q.view(np.uint8), right.view(np.uint8))
    for name, wrong in _other_norms(args[0], opts["q_norm_weight"], 1e-6).items():
        if (dt == F32) != (name == "no rounding before the weight"):  # r() is the identity for f32
            n = int((wrong[..., 64:].view(np.uint8) != got_q.view(np.uint8)).sum())
            assert n > 0, f"{name}: indistinguishable on this data"


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
def test_cuda_lowering_is_one_custom_call_with_every_operand(layers, monkeypatch):
    """The CUDA kernel takes all 14 operands, the layer and the norm weights' placeholders included:
    stacked caches [L, NB, ...] go to the one custom call as they are (no folding, no op on the slots
    before it). The launcher route (the kernel node's own test is below)."""
    monkeypatch.setenv(kernel_node.ENV, "0")
    text = _export_cuda("kernel", layers).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_rope_cache_gpu" in ln]
    assert len(calls) == 1, calls
    operands = calls[0].split("(", 1)[1].split(")", 1)[0]
    assert operands.count("%") == len(contract.OPERANDS) == 14, calls[0]
    assert "tensor<24x16x2x64xbf16>" not in text  # never folded to L*NB blocks
    main = text[text.index("func.func public @main"):]
    ops = set(re.findall(r"^\s*%[\w#:]+ = \"?([\w.]+)", main[:main.index("return")], re.M))
    # reshapes are layout-free bitcasts here (the layer scalar); no arithmetic on slots or layer; the
    # one optimization barrier is launcher.fence_small_operands (tests/test_rocm_arch.py checks which)
    assert ops <= {"stablehlo.custom_call", "stablehlo.constant", "stablehlo.reshape",
                   "stablehlo.optimization_barrier"}, ops
    assert main.count("stablehlo.optimization_barrier") == 1



# ---- RC_KPAIRS: the k heads' rotation units paired by token ----------------------------------------
def _xp_cases(cases):
    """The x-packed entries of an emulation matrix (flash ones moved to xpacked where D allows)."""
    out = []
    for kw in cases:
        kw = dict(kw)
        if kw.get("layout", "flash") == "flash":
            kw["layout"] = "xpacked"
        if kw["D"] % contract.pack_width(np.dtype(kw.get("cdt") or kw.get("dt", BF16))) == 0:
            out.append(kw)
    return out


@pytest.mark.parametrize("tpb", [4, 32])
@pytest.mark.parametrize("kw", _xp_cases(emulation_matrix()), ids=_id)
def test_host_emulation_kpairs_matches_reference_bitwise(kw, tpb, emu_dir):
    """The random matrix (invalid slots, clamped positions, fp8, partial rotary, both styles) with
    RC_KPAIRS: blocks of tpb tokens (T not a multiple: tail tokens, odd T: a pair without its odd
    token), bit-exact to the reference."""
    spec, args, ks, vs = _matrix_problem(kw)
    opts = dict(layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim, k_scale=ks, v_scale=vs,
                precision=spec.precision, table_form=spec.table_form)
    _assert_bitwise(run_emulation(spec, args, ks, vs, emu_dir, defines=dict(KP, RC_TPB=tpb)), _reference(args, opts))


_KP_NORM_CASES = _xp_cases(norm_emulation_matrix()) + [
    dict(T=203, QH=8, KH=1, D=128, layout="xpacked", dt=BF16, qn=BF16, kn=BF16, max_pos=50),  # Qwen3-32B TP8
    dict(T=203, QH=8, KH=2, D=128, layout="xpacked_shuffled", neox=False, dt=BF16, qn=BF16, kn=F32, max_pos=50),
    dict(T=77, QH=4, KH=4, D=128, layout="xpacked", dt=F32, cdt=FN, qn=F32, kn=F32, ksh=True, vsh=True, max_pos=50),
]


@pytest.mark.parametrize("tpb", [8, 32])
@pytest.mark.parametrize("kw", _KP_NORM_CASES, ids=_id)
def test_host_emulation_kpairs_norm_and_head_scales_bitwise(kw, tpb, emu_dir):
    """RC_KPAIRS with the QK-norm (lane butterfly: a k head's P units on every other lane, shuffles
    xor 2..P, checked by the emulated shuffle groups; P = 32: unpaired; the generic path) and
    per-head fp8 scales, bit-exact to the reference."""
    rng = np.random.default_rng(abs(hash(_id(kw))) % 2**32)
    args, opts = _norm_problem(kw, rng)
    _assert_bitwise(_emulate(args, opts, emu_dir, num_sms=1, defines=dict(KP, RC_TPB=tpb)), _reference(args, opts))


def _rot_map(lib, n):
    out = (ctypes.c_int * 3)()
    m = []
    for u in range(n):
        lib.rc_rot_unit(u, out)
        m.append(tuple(out))
    return m


def _half_sector_stores(spec, tpb, m):
    """32-byte sectors of the key cache that a warp's store of rotated k pieces writes only in part,
    over one block of tpb tokens of a prefill run (slot = token), rotation units m[u] on lane u % 32."""
    d, kh, x, bs, s_cache = spec.head_dim, spec.kv_heads, spec.x, spec.block_size, spec.cache_dtype.itemsize
    w = dict(cuda.kernel_config(spec, num_sms=1).defines)["RC_WCH"]
    p = len(m) // (tpb * (spec.q_heads + kh))
    halves = [0, d // 2] if spec.is_neox else [0]
    partial = 0
    for base in range(0, len(m), 32):
        for half in halves:  # one store instruction each
            covered = {}
            for tt, h, j in m[base:base + 32]:
                if h < spec.q_heads:
                    continue
                c = half + j * w
                e = ((((tt // bs) * kh + h - spec.q_heads) * (d // x) + c // x) * bs + tt % bs) * x + c % x
                for b in range(e * s_cache, (e + w) * s_cache):
                    covered.setdefault(b // 32, set()).add(b % 32)
            partial += sum(len(v) < 32 for v in covered.values())
    assert p > 0
    return partial


@pytest.mark.parametrize("kw", [dict(QH=32, KH=8, D=128), dict(QH=64, KH=8, D=64), dict(QH=8, KH=1, D=64),
                                dict(QH=8, KH=1, D=128, neox=False), dict(QH=4, KH=2, D=128, dt=F16, cdt=FN),
                                dict(QH=8, KH=1, D=128, qn=BF16, kn=BF16), dict(QH=4, KH=2, D=128, dt=F32, kn=F32)],
                         ids=_id)
@pytest.mark.parametrize("layout", ["xpacked", "xpacked_shuffled"])
def test_kpairs_lane_mapping(kw, layout, emu_dir):
    """The rotation units' mapping (rc_rot_unit) for RC_KPAIRS: a bijection onto (token, head, chunk);
    q units first in today's order; lanes 2m, 2m+1 are tokens 2t, 2t+1 of one (k head, chunk), so
    each warp store of k pieces fills whole 32-byte sectors of a prefill run (today's order: none)."""
    spec = spec_of(dict(kw, T=8192, layout=layout))
    tpb = 16
    for kp in (0, 1):
        d = dict(cuda.kernel_config(spec, num_sms=1, kpairs=kp).defines, RC_TPB=tpb, RC_VSEL=0)  # rotation units only
        assert ("RC_KPAIRS" in dict(cuda.kernel_config(spec, kpairs=kp).defines)) == bool(kp)
        lib = _build_emulation(cuda.KernelConfig(defines=tuple(d.items()), tokens_per_block=tpb, threads=0), emu_dir)
        assert lib.rc_kpairs() == kp
        rh, qh = spec.q_heads + spec.kv_heads, spec.q_heads
        p = cuda._rot_lanes(spec, d["RC_WCH"])
        m = _rot_map(lib, tpb * rh * p)
        assert sorted(m) == [(t, h, j) for t in range(tpb) for h in range(rh) for j in range(p)]
        if not kp:
            assert m == sorted(m)  # (token, head, chunk), chunk fastest
            assert _half_sector_stores(spec, tpb, m) > 0
            continue
        nq = tpb * qh * p
        assert m[:nq] == [(t, h, j) for t in range(tpb) for h in range(qh) for j in range(p)]
        for u in range(nq, len(m), 2):
            (t0, h0, j0), (t1, h1, j1) = m[u], m[u + 1]
            assert (h0, j0) == (h1, j1) and t0 % 2 == 0 and t1 == t0 + 1, (u, m[u], m[u + 1])
        assert _half_sector_stores(spec, tpb, m) == 0


def test_kpairs_configuration():
    """K_PAIRS is 1 (measured on the H200, backends/cuda.py): it defines RC_KPAIRS for x-packed
    layouts with an even number of tokens per block only; kpairs=0 turns it off."""
    assert cuda.K_PAIRS == 1
    big, small = dict(T=8192, QH=32, KH=8, D=128), dict(T=1, QH=32, KH=8, D=128)
    assert dict(cuda.kernel_config(make_spec(layout="xpacked", **big)).defines)["RC_KPAIRS"] == 1
    assert "RC_KPAIRS" not in dict(cuda.kernel_config(make_spec(layout="xpacked", **big), kpairs=0).defines)
    assert "RC_KPAIRS" not in dict(cuda.kernel_config(make_spec(layout="xpacked", **small)).defines)
    assert dict(cuda.kernel_config(make_spec(layout="xpacked", **big), kpairs=1).defines)["RC_KPAIRS"] == 1
    assert "RC_KPAIRS" not in dict(cuda.kernel_config(make_spec(layout="flash", **big), kpairs=1).defines)
    assert "RC_KPAIRS" not in dict(cuda.kernel_config(make_spec(layout="xpacked", **small), kpairs=1).defines)


KP_SHAPES = [("llama8b", dict(QH=32, KH=8, D=128)), ("gptoss-tp8", dict(QH=8, KH=1, D=64)),
             ("gptoss-tp1", dict(QH=64, KH=8, D=64)), ("llama70b-tp8", dict(QH=8, KH=1, D=128)),
             ("qwen3-32b-tp8-norm", dict(QH=8, KH=1, D=128, qn=BF16, kn=BF16)),
             ("llama8b-fp8-heads", dict(QH=32, KH=8, D=128, cdt=FN, ksh=True, vsh=True))]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_nvrtc_compiles_kpairs_without_spills(arch):
    """RC_KPAIRS at the configurations kernel_config picks for real shapes (prefill, mid-size; both
    x-packed layouts): a cubin, no spills, no stack."""
    matrix = [(f"{n}-{layout}-T{t}", spec_of(dict(kw, T=t, layout=layout)))
              for (n, kw), layout, t in itertools.product(KP_SHAPES, ("xpacked", "xpacked_shuffled"), (8192, 512))]
    cfgs = [cuda.kernel_config(spec, kpairs=1) for _, spec in matrix]
    assert all(dict(c.defines).get("RC_KPAIRS") == 1 for c in cfgs)
    failures = spill_failures([s for _, s in matrix], [n for n, _ in matrix], arch, cfgs=cfgs)
    assert not failures, "\n".join(failures[:5])


# ---- RC_SPLIT: a decode token's units over several blocks (grid.y) ---------------------------------
def test_split_configuration(monkeypatch):
    """One-token-per-block calls whose token has more than LATENCY_SPLIT_MIN units are split over
    grid.y = ceil(units / LATENCY_SPLIT_UNITS) blocks, sized so every thread has one unit; a token
    one block covers with one unit a thread only into idle SMs (<= SMs / 2T parts); other calls are
    one part (no RC_SPLIT define: the kernel of before)."""
    def geo(**kw):
        c = cuda.kernel_config(make_spec(**kw))
        return c.tokens_per_block, c.threads, c.parts

    assert (cuda.LATENCY_SPLIT_UNITS, cuda.LATENCY_SPLIT_MIN) == (128, 320)  # measured (backends/cuda.py)
    l8b = dict(QH=32, KH=8, D=128)
    assert geo(T=1, layout="xpacked", **l8b) == (1, 128, 11)  # 320 rotation + 1024 one-channel V units
    assert geo(T=128, layout="xpacked_shuffled", **l8b) == (1, 128, 11)
    assert geo(T=1, **l8b) == geo(T=16, **l8b) == (1, 128, 4)  # flash: 448 units
    assert geo(T=32, **l8b) == (1, 224, 2) and geo(T=64, **l8b) == (1, 448, 1)  # <= 132 / 2T parts
    assert geo(T=64, QH=8, KH=1, D=128, layout="xpacked") == (1, 288, 1)  # 272 units: one block
    assert geo(T=1, QH=16, KH=1, D=128, layout="xpacked") == (1, 416, 1)  # half-width chunks: never split
    assert geo(T=8192, layout="xpacked", **l8b)[2] == 1
    for layout in contract.LAYOUTS:  # an empty call (T = 0) configures like T = 1
        assert geo(T=0, layout=layout, **l8b) == geo(T=1, layout=layout, **l8b)
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", 0)
    assert geo(T=1, layout="xpacked", **l8b) == (1, cuda.MAX_THREADS, 1)  # off: 512 threads, several units each
    assert geo(T=1, **l8b) == (1, 448, 1)
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", 200)
    assert geo(T=8, **l8b) == (1, 160, 3)  # 448 units: 3 parts of <= 150 (threads a multiple of 32)
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", 128)
    for kw in (dict(QH=64, KH=8, D=64), dict(QH=8, KH=1, D=128), dict(QH=4, KH=1, D=256, dt=F32)):
        for layout in contract.LAYOUTS:
            spec = make_spec(T=3, layout=layout, **kw)
            c = cuda.kernel_config(spec)
            units = _units(c, spec)
            assert c.threads * c.parts >= units > c.threads * (c.parts - 1) or c.threads == 32, (kw, layout, c)


SPLIT_CASES = [  # (entry, LATENCY_SPLIT_UNITS (and no LATENCY_SPLIT_MIN) or None for the defaults)
    (dict(T=5, QH=32, KH=8, D=128, layout="xpacked"), None),  # Llama-8B decode, 3 parts
    (dict(T=3, QH=32, KH=8, D=128), 100),  # flash, 5 parts of 90 units (a part not a multiple of 32)
    (dict(T=2, QH=64, KH=8, D=64, layout="xpacked", dt=F32), None),  # the default split, f32
    (dict(T=4, QH=64, KH=8, D=64, layout="xpacked_shuffled", dt=F16, cdt=FN, ksh=True, vsh=True), None),
    (dict(T=2, QH=32, KH=4, D=128, qn=BF16, kn=BF16), None),  # norm lanes, 8 per head, 3 parts of 128
    (dict(T=3, QH=8, KH=2, D=128, R=64, qn=BF16, kn=F32, layout="xpacked", cdt=FNUZ), 64),  # generic norm path
    (dict(T=1, QH=16, KH=4, D=80, R=20, neox=False, dt=F32, prec="native", layout="flash"), 16),
]


@pytest.mark.parametrize("kw,units", SPLIT_CASES, ids=[_id(kw) + f"-u{u}" for kw, u in SPLIT_CASES])
def test_host_emulation_split_bitwise(kw, units, emu_dir, monkeypatch):
    """Decode calls whose token is split over several blocks (RC_SPLIT), bit-exact to the reference;
    the emulation checks every unit of a block ran exactly once over its parts."""
    if units is not None:  # parts of <= units, whatever the token's count
        monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", units)
        monkeypatch.setattr(cuda, "LATENCY_SPLIT_MIN", 0)
    args, opts = _norm_problem(dict(kw, max_pos=50), np.random.default_rng(len(_id(kw))))
    assert cuda.kernel_config(contract.check_op(*args, **opts)).parts > 1
    _assert_bitwise(_emulate(args, opts, emu_dir), _reference(args, opts))


@pytest.mark.parametrize("layout", ["flash", "xpacked"])
def test_host_emulation_split_stacked_layers(layout, emu_dir, monkeypatch):
    """A split decode call into stacked caches writes exactly its layer; outside [0, L) nothing."""
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", 64)
    monkeypatch.setattr(cuda, "LATENCY_SPLIT_MIN", 0)
    layers = 3
    spec = make_spec(T=4, QH=32, KH=8, D=128, layout=layout, max_pos=50, layers=layers)
    assert cuda.kernel_config(spec).parts > 1
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, slots, pos, cos, sin = make_inputs(dataclasses.replace(spec, num_layers=None), rng)
    kc = np.stack([_random(rng, kc.shape, kc.dtype) for _ in range(layers)])
    vc = None if vc is None else np.stack([_random(rng, vc.shape, vc.dtype) for _ in range(layers)])
    args = (q, k, v, kc, vc, slots, pos, cos, sin)
    for layer in (2, -1):
        want = reference.rope_and_cache(*args, layout=layout, layer=np.array(layer, np.int32))
        got = run_emulation(spec, args, None, None, emu_dir, layer=layer)
        _assert_bitwise(got, want)


@pytest.mark.parametrize("what,old,new", [
    ("every part from unit 0", "const int u0 = SPLIT > 1 ? (int)blockIdx.y * NT : 0;", "const int u0 = 0;"),
    ("stride of one part", "u < n_units; u += NT * SPLIT)", "u < n_units; u += NT)"),
    ("a part skipped", "const int u0 = SPLIT > 1 ? (int)blockIdx.y * NT : 0;",
     "if (SPLIT > 1 && blockIdx.y == 1) return;\n  const int u0 = SPLIT > 1 ? (int)blockIdx.y * NT : 0;"),
])
def test_host_emulation_split_would_catch_a_wrong_partition(what, old, new, emu_dir, monkeypatch):
    """A kernel whose parts repeat or drop units fails the emulation (duplicates write the same
    bits, so only the per-block unit check can see them)."""
    src = open(os.path.join(_kernel_dir(), "cuda", "rope_cache.cu")).read()
    assert src.count(old) == 1, what
    args, opts = _norm_problem(dict(T=3, QH=32, KH=8, D=128, layout="xpacked", max_pos=50), np.random.default_rng(3))
    assert cuda.kernel_config(contract.check_op(*args, **opts)).parts == 11
    with pytest.raises(AssertionError, match="emulated shuffles|elements differ"):
        _assert_bitwise(_emulate(args, opts, emu_dir, source=src.replace(old, new)), _reference(args, opts))


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_nvrtc_compiles_split_without_spills(arch):
    """The split decode configurations kernel_config picks for real shapes: a cubin, no spills."""
    matrix = [(f"{n}-{layout}-T{t}", spec_of(dict(kw, T=t, layout=layout)))
              for (n, kw), layout, t in itertools.product(KP_SHAPES, contract.LAYOUTS, (1, 128))]
    cfgs = [cuda.kernel_config(spec) for _, spec in matrix]
    assert sum(c.parts > 1 for c in cfgs) >= 6
    failures = spill_failures([s for _, s in matrix], [n for n, _ in matrix], arch, cfgs=cfgs)
    assert not failures, "\n".join(failures[:5])


def test_flash_blocks_halved_off_one_wave(monkeypatch):
    """Large flash calls (256-thread blocks): a grid that is one wave of resident blocks (more than
    half of SMs x PACKED_MINB) keeps UNITS_PER_BLOCK-sized blocks; a grid of several waves, or of
    under half a wave, gets blocks of half the tokens (shorter last wave, or a fuller one), unless
    the halved block leaves its threads idle in their last round of units (HALVED_BUSY_MIN)."""
    def geo(t, **kw):
        c = cuda.kernel_config(make_spec(T=t, **kw), num_sms=132)
        return c.tokens_per_block, c.threads, -(-t // c.tokens_per_block)

    assert 132 * cuda.PACKED_MINB == 528
    l70b = dict(QH=8, KH=1, D=128)  # 88 units a token: 16 tokens = 1408 units
    assert geo(8192, **l70b) == (16, cuda.PACKED_NT, 512)  # 512 blocks: one wave of 528, kept
    assert geo(32768, **l70b) == (8, cuda.PACKED_NT, 4096)  # 2048 blocks of 16 would be 3.9 waves
    assert geo(4096, **l70b) == (8, cuda.PACKED_NT, 512)  # 256 blocks of 16: under half a wave
    oss8 = dict(QH=8, KH=1, D=64)
    assert geo(8192, **oss8) == (16, cuda.PACKED_NT, 512) and geo(16384, **oss8) == (32, cuda.PACKED_NT, 512)
    assert geo(32768, QH=32, KH=8, D=128) == (2, cuda.PACKED_NT, 16384)
    q235 = dict(QH=16, KH=1, D=128)  # halved: 608 units on 256 threads, 79% busy in their rounds
    assert geo(32768, **q235) == (8, cuda.PACKED_NT, 4096)
    assert geo(8192, layout="xpacked", **l70b)[0] == 32  # x-packed: its own block size, unchanged
    monkeypatch.setattr(cuda, "HALVE_BLOCKS_OFF_WAVE", False)
    assert geo(32768, **l70b) == (16, cuda.PACKED_NT, 2048) and geo(8192, **oss8)[0] == 32  # off: as before


def test_every_fuzz_case_configures():
    """Every call shape of the fuzz set (empty calls included) gets a configuration whose threads
    and parts cover a block's units: the lowering's arithmetic on T (the split's idle-SM bound
    divides by it) never fails on a shape only the GPU fuzz run would otherwise reach."""
    import test_fuzz

    for i in range(test_fuzz.N_CASES):
        args, opts = test_fuzz.make_case(i)[:2]
        try:
            spec = contract.check_op(*args, **opts)
        except (ValueError, TypeError, NotImplementedError):
            continue  # the cases that test an error
        c = cuda.kernel_config(spec)
        units = _units(c, spec)
        assert c.threads * c.parts >= units or c.threads == cuda.MAX_THREADS, (i, c)


# ---- the kernel-node route (backends/kernel_node.py): XLA's PTX custom call, lowered here -----------


def _node_export(monkeypatch, setting, t=4, layers=None, QH=8, KH=2, D=64):
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    monkeypatch.setenv(kernel_node.ENV, setting)
    NB, BS = 8, 16
    kshape = (NB, BS, KH, D) if layers is None else (layers, NB, BS, KH, D)
    s = jax.ShapeDtypeStruct
    args = (s((t, QH, D), jnp.bfloat16), s((t, KH, D), jnp.bfloat16), s((t, KH, D), jnp.bfloat16),
            s(kshape, jnp.bfloat16), s(kshape, jnp.bfloat16), s((t,), jnp.int32), s((t,), jnp.int32),
            s((40, D // 2), jnp.float32), s((40, D // 2), jnp.float32))
    step = lambda *a: jrc.rope_and_cache(*a, impl="kernel", layer=None if layers is None else 1)  # noqa: E731
    text = jrc.export(jax.jit(step, donate_argnums=(3, 4)), platforms=["cuda"])(*args).mlir_module()
    spec = make_spec(T=t, QH=QH, KH=KH, D=D, NB=NB, BS=BS, max_pos=40, pos64=False, layers=layers)
    return text, spec


def _node_calls(text):
    return [ln for ln in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.ptx" in ln]


def _attr(line, name):
    m = re.search(rf"\b{name} = (-?\d+) : i32", line)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("t,layers,heads", [(4, None, (8, 2, 64)), (1, None, (32, 8, 128)), (300, 3, (8, 2, 64)),
                                             (1, 2, (32, 8, 128))])
def test_kernel_node_lowering_is_one_ptx_call_with_its_launch(monkeypatch, t, layers, heads):
    """Route on: exactly one `__gpu$xla.gpu.ptx` call, its config the kernel configuration's launch
    (grid = (ceil(T / tokens per block), parts, 1), its threads, no shared memory), all 14 operands,
    the caches aliased to results 2 and 3, and the PTX the node entry of 18 pointer parameters with the
    call's dims compiled in; no launcher target."""
    qh, kh, d = heads
    text, spec = _node_export(monkeypatch, "1", t, layers, qh, kh, d)
    calls = _node_calls(text)
    assert len(calls) == 1, text[:2000]
    assert "jax_rope_cache_gpu" not in text
    line = calls[0]
    cfg = cuda.kernel_config(spec)
    node = cuda.build_node_ptx(cuda.node_config(cfg, (t, layers or 8, 40)), None)[0]
    assert (_attr(line, "grid_x"), _attr(line, "grid_y"), _attr(line, "grid_z")) == (
        -(-t // node.tokens_per_block), node.parts, 1)
    assert (_attr(line, "block_x"), _attr(line, "block_y"), _attr(line, "block_z")) == (node.threads, 1, 1)
    assert _attr(line, "shared_mem_bytes") == 0
    assert 'kernel_type = "ptx"' in line and f'name = "{cuda.NODE_KERNEL_NAME}"' in line
    operands = line.split("(", 1)[1].split(")", 1)[0]
    assert operands.count("%") == len(contract.OPERANDS) == 14
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", line)
    assert sorted(aliases) == [("2", "3"), ("3", "4")], aliases
    ptx = re.search(r'kernel_data = "((?:[^"\\]|\\.)*)"', line).group(1).encode().decode("unicode_escape")
    entry = ptx[ptx.index(f".entry {cuda.NODE_KERNEL_NAME}("):]
    assert entry[:entry.index(")")].count(".param .u64") == 18
    assert f".maxntid {node.threads}, 1, 1" in entry
    assert ".entry rope_cache_kernel" not in ptx


def test_kernel_node_route_off_auto_and_fallbacks(monkeypatch):
    """Off: the launcher's target. Auto: the node where the plugin compiles the target and the driver
    takes the PTX's ISA, else the launcher; a call of zero tokens always takes the launcher; a bad
    setting is an error naming the variable."""
    text, _ = _node_export(monkeypatch, "0")
    assert not _node_calls(text) and "stablehlo.custom_call @jax_rope_cache_gpu" in text
    monkeypatch.setattr(kernel_node, "plugin_supports", lambda: True)
    monkeypatch.setattr(kernel_node, "driver_version", lambda: None)
    text, _ = _node_export(monkeypatch, "auto")
    assert len(_node_calls(text)) == 1
    monkeypatch.setattr(kernel_node, "driver_version", lambda: 12040)  # CUDA 12.4 loads PTX ISA <= 8.4
    monkeypatch.setattr(kernel_node, "ptx_isa", lambda ptx: (9, 0))
    text, _ = _node_export(monkeypatch, "auto")
    assert not _node_calls(text) and "@jax_rope_cache_gpu" in text
    text, _ = _node_export(monkeypatch, "1")  # forced: the route whatever the driver
    assert len(_node_calls(text)) == 1
    monkeypatch.setattr(kernel_node, "plugin_supports", lambda: False)
    monkeypatch.setattr(kernel_node, "driver_version", lambda: None)
    text, _ = _node_export(monkeypatch, "auto")
    assert not _node_calls(text) and "@jax_rope_cache_gpu" in text
    text, _ = _node_export(monkeypatch, "1", t=0)  # no launch of an empty grid (whatever lowers it)
    assert not _node_calls(text)
    with pytest.raises(ValueError, match=kernel_node.ENV):
        _node_export(monkeypatch, "maybe")


def test_kernel_node_plugin_detection_reads_the_library(tmp_path):
    lib = tmp_path / "xla_cuda_plugin.so"
    lib.write_bytes(b"\0" * 5000 + kernel_node.TARGET.encode() + b"\0" * 100)
    assert kernel_node.library_has_target(str(lib))
    other = tmp_path / "other_plugin.so"
    other.write_bytes(b"\0" * 5000 + b"__gpu$xla.gpu.triton")
    assert not kernel_node.library_has_target(str(other))
    assert kernel_node.driver_isa(13000) == (9, 0) and kernel_node.driver_isa(12080) == (8, 7)
    assert kernel_node.ptx_isa(b"//\n.version 8.5\n.target sm_90\n") == (8, 5)


NODE_SPECS = [dict(T=1, QH=32, KH=8, D=128), dict(T=64, QH=32, KH=8, D=128), dict(T=8192, QH=32, KH=8, D=128),
              dict(T=8192, QH=8, KH=1, D=64), dict(T=64, QH=64, KH=8, D=64, layout="xpacked"),
              dict(T=300, QH=8, KH=1, D=128, layout="xpacked_shuffled", cdt=FN, prec="native"),
              dict(T=1, QH=32, KH=8, D=128, layers=32), dict(T=4096, QH=16, KH=4, D=128, R=64, layers=4)]


@pytest.mark.parametrize("kw", NODE_SPECS, ids=_id)
def test_nvrtc_compiles_the_node_entry_without_spills(kw):
    """The node build (sm_90, the register budget ptxas meets) has no spill or stack frame, and its PTX
    holds only the node entry with the configuration's launch bound."""
    spec = make_spec(**kw)
    cfg = cuda.kernel_config(spec)
    lead = spec.num_layers if spec.num_layers is not None else spec.num_blocks
    ncfg, ptx = cuda.build_node_ptx(cuda.node_config(cfg, (spec.num_tokens, lead, spec.max_pos)), 90)
    c = cuda.compile_variant(ncfg, "sm_90")  # the build whose ptxas report fit_registers read
    assert c.code[:4] == b"\x7fELF" and cuda.NODE_KERNEL_NAME.encode() in c.code
    assert nvrtc.spills(c) == (0, 0, 0), c.log
    text = ptx.code.decode(errors="replace")
    assert text.count(".entry ") == 1 and f".entry {cuda.NODE_KERNEL_NAME}(" in text
    assert f".maxntid {ncfg.threads}, 1, 1" in text
    assert ncfg.threads == cfg.threads and ncfg.tokens_per_block == cfg.tokens_per_block


def test_node_entry_hides_its_compiled_in_dims_from_the_optimizer():
    """T, the cache rows and the table rows reach the node entry's code through three opaque moves (as
    the launcher's run-time values; folded in, the kernel ran 1.7-1.8% slower on the H200): the PTX has
    three more inline-asm blocks than the RC_NODE_FOLD_DIMS build, and its constants are not folded."""
    spec = make_spec(T=8192, QH=32, KH=8, D=128)
    cfg = cuda.kernel_config(spec)
    ncfg = cuda.node_config(cfg, (spec.num_tokens, spec.num_blocks, spec.max_pos))
    folded = dataclasses.replace(ncfg, defines=ncfg.defines + (("RC_NODE_FOLD_DIMS", 1),))
    ptx, ptx_folded = (cuda.compile_variant(c, "compute_90").code.decode() for c in (ncfg, folded))
    moves = re.findall(r"begin inline asm\s*\n\s*mov\.b64\s+(%rd\d+),\s*\1;", ptx)
    assert len(moves) == 3, moves
    assert not re.search(r"begin inline asm\s*\n\s*mov\.b64", ptx_folded)
    assert ptx.count("begin inline asm") == ptx_folded.count("begin inline asm") + 3


@pytest.mark.parametrize("kw", emulation_matrix()[::3], ids=_id)
def test_host_emulation_of_the_node_entry_matches_reference_bitwise(kw, emu_dir):
    """The node entry (pointers in custom-call order, dims compiled in), run on the host over the same
    random matrix: the same bits as the reference, no write outside the outputs."""
    spec, args, ks, vs = _matrix_problem(kw)
    want = reference.rope_and_cache(*args, layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim,
                                    precision=spec.precision, k_scale=ks, v_scale=vs, table_form=spec.table_form)
    node = {"RC_NODE": 1, "RC_NODE_T": spec.num_tokens, "RC_NODE_LEAD": args[3].shape[0],  # as cuda.node_dims
            "RC_NODE_MAX_POS": spec.max_pos}
    got = run_emulation(spec, args, ks, vs, emu_dir, defines=node)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert _both_none(g, w) or np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)), name


def test_host_emulation_of_the_node_entry_would_catch_swapped_pointers(emu_dir):
    """The check has teeth: a node entry that passes the value cache where the key cache belongs
    (same shapes in the flash layout, so nothing is written out of bounds) fails it."""
    kw = next(k for k in emulation_matrix() if k.get("layout", "flash") == "flash")
    spec, args, ks, vs = _matrix_problem(kw)
    src = open(os.path.join(_kernel_dir(), "cuda", "rope_cache.cu")).read()
    bad = src.replace("k_norm_w, q_out, k_out, kc, vc, {}}", "k_norm_w, q_out, k_out, vc, kc, {}}")
    assert bad != src
    node = {"RC_NODE": 1, "RC_NODE_T": spec.num_tokens, "RC_NODE_LEAD": spec.num_blocks,
            "RC_NODE_MAX_POS": spec.max_pos}
    want = reference.rope_and_cache(*args, layout=spec.layout, is_neox=spec.is_neox, rotary_dim=spec.rotary_dim,
                                    precision=spec.precision, k_scale=ks, v_scale=vs, table_form=spec.table_form)
    got = run_emulation(spec, args, ks, vs, emu_dir, defines=node, source=bad)
    assert not np.array_equal(np.asarray(got[2]).view(np.uint8), np.asarray(want[2]).view(np.uint8))
