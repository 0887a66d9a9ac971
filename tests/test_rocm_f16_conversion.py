"""The ROCm kernel's f32 -> f16 rounding on every f32 input.

The FlyDSL kernels write f16 outputs and caches through `_Emitter.f32_to_f16_bits` (llvm fptrunc,
NaN made 0x7FFF): v_cvt_f16_f32 on gfx942, v_cvt_pk_f16_f32 on gfx950 where two values are packed
(the ISA census of tests/test_rocm_compile.py). The lane emulator computes that fptrunc with numpy,
so what the instructions do is only seen on the hardware. The check kernel
(tests/rocm_f16_check_kernel.py) runs the kernel's own f16 store path on bit patterns:

1. (FlyDSL; CPU-only CI too) it compiles for gfx942 and gfx950 with that arch's conversion
   instruction, two 8-byte arguments, no scratch;
2. (lane emulator, any machine) its indexing and packing: chunks at the edges of every range
   (zeros, subnormals, ties, the largest finite values, overflow, inf, NaN) equal numpy, and the
   comparison catches the bf16 mutant;
3. (a gfx942 / gfx950 GPU) all 2**32 f32 bit patterns, in chunks of 2**26, equal numpy's
   round-to-nearest-even f16 (NaN: 0x7FFF); the bf16 mutant run on the GPU is caught.
scripts/rocm_check.sh runs this file on an AMD GPU host and reports the F16CHECK line it prints.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import rocm_emulator
import rocm_f16_check_kernel as CK
from conftest import flydsl_kernel_module
from jax_rope_cache.compilers import amdgpu_elf, flydsl

K = flydsl_kernel_module()
ARCHS = ("gfx942", "gfx950")
NT = 256
CHUNK = 1 << 26  # patterns per launch (128 MiB of f16 results)
CHECK_KERNEL = CK.__file__
INSTR = {"gfx942": "v_cvt_f16_f32", "gfx950": "v_cvt_pk_f16_f32"}

needs_flydsl = pytest.mark.skipif(not flydsl.available(),
                                  reason=f"the ROCm kernel cannot be compiled here: {flydsl.unavailable_reason()}; "
                                         f"install with: {flydsl.INSTALL_HINT}")


def expected_f16_bits(first: int, n: int) -> np.ndarray:
    """numpy's f16 (round to nearest even, overflow to inf) of patterns first .. first + n - 1; NaN: 0x7FFF."""
    x = np.arange(n, dtype=np.uint32) + np.uint32(first)
    with np.errstate(over="ignore", invalid="ignore"):
        out = x.view(np.float32).astype(np.float16).view(np.uint16)
    out[(x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = 0x7FFF
    return out


def mismatches(got: np.ndarray, first: int) -> tuple[int, int | None]:
    """(number of patterns whose bits differ from expected_f16_bits, the first such pattern)."""
    bad = np.flatnonzero(got != expected_f16_bits(first, got.size))
    return int(bad.size), (first + int(bad[0]) if bad.size else None)


def compile_check(arch: str, mutant: str = "", isa: bool = False) -> tuple[bytes, str | None]:
    cfg = CK.RocmKernelConfig(base=flydsl.kernel_source_path(), nt=NT, mutant=mutant)
    r = flydsl.compile_module(CHECK_KERNEL, dict(base=cfg.base, nt=cfg.nt, mutant=cfg.mutant), arch, isa=isa)
    return base64.b64decode(r["code"]), r.get("isa")


# ---- 1. the check kernel's code objects ----------------------------------------------------------
@needs_flydsl
@pytest.mark.parametrize("arch", ARCHS)
def test_check_kernel_compiles_with_the_arch_conversion_instruction(arch):
    from test_rocm_compile import isa_mnemonics

    code, isa = compile_check(arch, isa=True)
    info = amdgpu_elf.kernel_info(code)
    assert info["target"].endswith(arch) and info["name"] == "jrc_f16_check_0"
    assert info["args"] == [dict(offset=0, size=8, kind="by_value"), dict(offset=8, size=8, kind="by_value")]
    assert info["kernarg_size"] == 16 and info.get("private_segment_size", 0) == 0
    ops = isa_mnemonics(isa)
    assert INSTR[arch] in ops, sorted(o for o in ops if "cvt" in o)
    assert "global_store_dwordx4" in ops


# ---- 2. the lane emulator ------------------------------------------------------------------------
EDGES = [0x00000000, 0x33000000, 0x387FE000, 0x38800000, 0x3F7FF000, 0x477FE000, 0x477FF000, 0x7F7FF000,
         0x7F800000 - 4096, 0x7FC00000, 0x80000000, 0xB3000000, 0xC77FE000, 0xFF800000 - 2048, 0xFFFFE000]


def _emulated(first: int, grid: int, mutant: str = "") -> np.ndarray:
    cfg = CK.RocmKernelConfig(base=K.__file__, nt=NT, mutant=mutant)
    out = np.zeros(grid * NT * CK.PER, np.uint16)
    (got,) = rocm_emulator.launch_raw(lambda args, d: CK.emit_kernel_body(cfg, args, d, base=K), NT, [out], [first],
                                      grid)
    return got


@pytest.mark.parametrize("first", EDGES, ids=lambda v: f"0x{v:08x}")
def test_emulated_check_kernel_writes_every_pattern_in_order(first):
    got = _emulated(first, grid=2)  # 4096 patterns, the last chunk wrapping past 0xFFFFFFFF
    assert mismatches(got, first) == (0, None)


def test_the_comparison_catches_a_wrong_conversion():
    first = 0x3F7FF000  # 1.0 and its neighbours: bf16 bits differ from f16 bits
    n, at = mismatches(_emulated(first, grid=1, mutant="bf16"), first)
    assert n > 0 and at == first
    got = _emulated(first, grid=1).copy()
    got[77] ^= 1
    assert mismatches(got, first) == (1, first + 77)


def test_expected_bits_are_numpy_round_to_nearest_even():
    x = np.array([0x3F800000, 0x3F801000, 0x3F803000, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x7FC00001,
                  0xFF800000], np.uint32)
    want = [0x3C00, 0x3C00, 0x3C02, 0x7BFF, 0x7C00, 0x0000, 0x0001, 0x7FFF, 0xFC00]
    got = [int(expected_f16_bits(int(v), 1)[0]) for v in x]
    assert got == want


# ---- 3. every f32 on a ROCm GPU ------------------------------------------------------------------
def _gpu_arch() -> str:
    import jax

    from jax_rope_cache.backends import rocm

    try:
        devices = jax.devices("rocm")
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip("no ROCm GPU here (the exhaustive check runs on AMD GPU hosts: scripts/rocm_check.sh)")
    arch = rocm.device_arch(devices[0])
    if arch not in ARCHS:
        pytest.skip(f"the ROCm GPU is {arch}: the kernels are built for gfx942 and gfx950 only")
    if not flydsl.available():
        pytest.fail(f"the check kernel needs FlyDSL on this ROCm host: {flydsl.unavailable_reason()}")
    return arch


class _Hip:
    """The HIP runtime jax loaded (else libamdhip64.so.7 / .6 / .so), through ctypes."""

    def __init__(self):
        names = ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so")
        # one already loaded first (jax's): a second HIP runtime in the process would not share its devices
        modes = (getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LAZY, os.RTLD_LAZY)
        for mode, name in ((m, n) for m in modes for n in names):
            try:
                self.lib = ctypes.CDLL(name, mode=mode)
                break
            except OSError:
                continue
        else:
            raise RuntimeError(f"no HIP runtime could be loaded (tried {', '.join(names)})")
        L, vp, sz = self.lib, ctypes.c_void_p, ctypes.c_size_t
        L.hipGetErrorString.restype = ctypes.c_char_p
        L.hipModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        L.hipModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        L.hipMalloc.argtypes = [ctypes.POINTER(vp), sz]
        L.hipFree.argtypes = [vp]
        L.hipMemcpy.argtypes = [vp, vp, sz, ctypes.c_int]
        L.hipModuleUnload.argtypes = [vp]
        L.hipModuleLaunchKernel.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]

    def __call__(self, what, *args):
        rc = getattr(self.lib, what)(*args)
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.lib.hipGetErrorString(rc).decode()} ({rc})")


def run_on_gpu(arch: str, mutant: str = "", chunk: int = CHUNK, firsts=None) -> dict:
    """The check kernel on HIP device 0 over chunks of `chunk` patterns starting at `firsts`
    (default: every f32 pattern): {"arch", "inputs", "mismatches", "first_mismatch"}."""
    code, _ = compile_check(arch, mutant)
    hip = _Hip()
    hip("hipSetDevice", 0)
    module, fn, dev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    host = np.empty(chunk, np.uint16)
    total, first_bad, done = 0, None, 0
    try:
        hip("hipModuleLoadData", ctypes.byref(module), code)
        hip("hipModuleGetFunction", ctypes.byref(fn), module, b"jrc_f16_check_0")
        hip("hipMalloc", ctypes.byref(dev), chunk * 2)
        kernarg = (ctypes.c_uint64 * 2)()
        size = ctypes.c_size_t(ctypes.sizeof(kernarg))
        extra = (ctypes.c_void_p * 5)(1, ctypes.cast(kernarg, ctypes.c_void_p),  # HIP_LAUNCH_PARAM_BUFFER_POINTER
                                      2, ctypes.cast(ctypes.pointer(size), ctypes.c_void_p),  # _BUFFER_SIZE
                                      3)  # HIP_LAUNCH_PARAM_END
        for first in range(0, 1 << 32, chunk) if firsts is None else firsts:
            kernarg[0], kernarg[1] = dev.value, first
            hip("hipModuleLaunchKernel", fn, chunk // (NT * CK.PER), 1, 1, NT, 1, 1, 0, None, None, extra)
            hip("hipDeviceSynchronize")
            hip("hipMemcpy", host.ctypes.data, dev, chunk * 2, 2)  # hipMemcpyDeviceToHost
            n, at = mismatches(host, first)
            total += n
            first_bad = first_bad if first_bad is not None else at
            done += 1
    finally:
        if dev.value:
            hip.lib.hipFree(dev)
        if module.value:
            hip.lib.hipModuleUnload(module)
    return dict(arch=arch, inputs=done * chunk, mismatches=total, first_mismatch=first_bad)


def test_f16_rounding_on_every_f32_input_on_the_gpu():
    arch = _gpu_arch()
    res = run_on_gpu(arch)
    print("F16CHECK " + json.dumps(res), flush=True)  # scripts/rocm_check.sh reports this line
    assert res["inputs"] == 1 << 32
    assert res["mismatches"] == 0, (f"{res['mismatches']} of 2**32 f32 inputs round to other f16 bits on {arch} "
                                    f"(first 0x{res['first_mismatch']:08x})")


def test_the_gpu_check_catches_a_wrong_conversion():
    arch = _gpu_arch()
    res = run_on_gpu(arch, mutant="bf16", firsts=[0x3F800000 - CHUNK // 2])  # around 1.0
    assert res["mismatches"] > 0


# ---- the host side against the stub HIP runtime (tests/stubs/hip_stub.c), on any machine ----------------
_STUB_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_rocm_f16_conversion as t
res = t.run_on_gpu("gfx942", chunk=1 << 14, firsts=[0x3F800000, 0x80000000, 0xFFFFC000])
print("RESULT " + json.dumps(res))
"""


@needs_flydsl
def test_the_gpu_driver_against_the_stub_hip_runtime(tmp_path):
    """What the GPU test hands HIP: the check kernel's code object and symbol, one buffer of a chunk's
    results, per chunk one launch (grid of chunk / (NT * PER) workgroups of NT lanes, the 16-byte
    kernarg block: the buffer's address, then the chunk's first pattern), a synchronisation and a
    device-to-host copy of the chunk; then the buffer and module freed. The stub runs no kernel, so
    the buffer keeps its zeros, which the comparison reports."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the HIP stub")
    tests = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libamdhip64.so.7", "-o",
                    str(tmp_path / "libamdhip64.so.7"), os.path.join(tests, "stubs", "hip_stub.c")], check=True)
    log = tmp_path / "hip.log"
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), HIP_STUB_LOG=str(log), HIP_STUB_PEEK_WORDS="1",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-P", "-c", _STUB_CHILD, tests], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert res["inputs"] == 3 << 14 and res["mismatches"] > 0 and res["first_mismatch"] == 0x3F800000
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    names = [c["call"] for c in calls]
    per_chunk = ["hipModuleLaunchKernel", "hipDeviceSynchronize", "hipMemcpy"]
    assert names == ["hipSetDevice", "hipModuleLoadData", "hipModuleGetFunction", "hipMalloc"] + per_chunk * 3 + [
        "hipFree", "hipModuleUnload"], names
    code, _ = compile_check("gfx942")
    loaded = calls[1]
    assert loaded["result"] == 0 and loaded["size"] == len(code)
    assert calls[2] == dict(call="hipModuleGetFunction", name="jrc_f16_check_0", module_fnv1a64=loaded["fnv1a64"],
                            result=0)
    assert calls[3]["size"] == 2 << 14
    launches = [c for c in calls if c["call"] == "hipModuleLaunchKernel"]
    addrs = set()
    for c, first in zip(launches, (0x3F800000, 0x80000000, 0xFFFFC000)):
        assert (c["grid"], c["block"], c["shmem"], c["kernel_params"], c["extra_ended"], c["result"]) == (
            [(1 << 14) // (NT * CK.PER), 1, 1], [NT, 1, 1], 0, False, True, 0)
        assert c["kernarg_size"] == 16 and c["peek"] == ["00000000"]  # word 0 points at the zeroed buffer
        addr, got_first = struct.unpack("<QQ", bytes.fromhex(c["kernarg"]))
        assert got_first == first
        addrs.add(addr)
    assert len(addrs) == 1
    copies = [c for c in calls if c["call"] == "hipMemcpy"]
    assert all((c["size"], c["kind"]) == (2 << 14, 2) for c in copies)
