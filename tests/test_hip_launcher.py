"""The launcher's HIP path (kernels/ffi/gpu_launcher.cc), driven end to end on a CPU machine.

Built here with the system compilers (skipped, with the reason, where there are none):
  * tests/stubs/hip_stub.c -> a stub libamdhip64.so.7 that records hipModuleLoadData (image size,
    hash, ELF flags), hipModuleGetFunction, hipModuleLaunchKernel (grid, block, shared memory,
    stream, current device, the `extra` kernarg buffer byte for byte, and 4 bytes at each pointer
    it holds) and reports a configurable gcnArchName;
  * tests/stubs/cuda_stub.c -> a stub libcuda.so.1 that only logs (to see which driver is bound);
  * gpu_launcher.cc itself with -DJRC_LAUNCHER_TEST: the production instantiate / initialize
    stages plus execute stages that differ only in taking a constant stream (a CPU backend has no
    GPU stream), registered for platform "cpu" and run through XLA's FFI on real jax buffers.
Each scenario runs in a fresh process (the driver is bound once per process).

Checked: the ROCM handlers bind the HIP runtime even when a libcuda is loaded (and the CUDA
handler binds libcuda even when libamdhip64 is loaded); the code object is chosen by gcnArchName
(only the device's entry is loaded; an arch missing from the table is an error naming both; a
runtime that reports no arch falls back to trying each entry); for real FlyDSL code objects of
several variants, the kernarg buffer matches the code object's metadata (kernarg size, each
argument's offset: operand pointers, result pointers = the aliased caches, dim0 values), the grid
is ceil(T / tokens per block), the block is the required workgroup size, for the graph and
no-graph targets alike and on two devices; each launch runs with the call's device current (the
thread's device restored after it); a HIP runtime already loaded under a soname the launcher does
not list is bound; a code object the runtime refuses is named with its code-object version, the
ROCm that loads it and the runtime found.
"""

from __future__ import annotations

import ctypes  # noqa: F401  (used by the child script)
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import child_env
from jax_rope_cache import contract
from jax_rope_cache.backends import launcher, rocm
from jax_rope_cache.compilers import amdgpu_elf, flydsl

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
LAUNCHER_SRC = os.path.join(_ROOT, "kernels", "ffi", "gpu_launcher.cc")
TEST_STREAM = 0x5157
BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
MACH = {"gfx942": 0x4C, "gfx950": 0x4F}  # EF_AMDGPU_MACH (e_flags & 0xff) of each arch's code objects


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    cc, cxx = shutil.which("cc") or shutil.which("gcc"), shutil.which("c++") or shutil.which("g++")
    if not (cc and cxx):
        pytest.skip("no C/C++ compiler to build the HIP stub and the launcher harness")
    if not os.path.exists(LAUNCHER_SRC):
        pytest.skip("kernels/ffi/gpu_launcher.cc is not in this checkout")
    d = tmp_path_factory.mktemp("hipstub")
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
    run(cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libamdhip64.so.7", "-o",
        str(d / "libamdhip64.so.7"), os.path.join(_TESTS, "stubs", "hip_stub.c"))
    # a HIP runtime of a soname the launcher's list does not name, alone in its folder
    (d / "rocm10").mkdir()
    run(cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", '-DSTUB_SONAME="libamdhip64.so.10"',
        "-Wl,-soname,libamdhip64.so.10", "-o", str(d / "rocm10" / "libamdhip64.so.10"),
        os.path.join(_TESTS, "stubs", "hip_stub.c"))
    run(cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libcuda.so.1", "-o", str(d / "libcuda.so.1"),
        os.path.join(_TESTS, "stubs", "cuda_stub.c"))
    run(cxx, "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-DJRC_LAUNCHER_TEST", f"-I{_ROOT}",
        f"-I{jax.ffi.include_dir()}", "-o", str(d / "launcher_test.so"), LAUNCHER_SRC, "-ldl")
    return d


_CHILD = textwrap.dedent("""
    import ctypes, json, os, sys
    spec = json.loads(open(sys.argv[1]).read())
    for lib in spec.get("preload", []):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    import numpy as np, jax, jax.numpy as jnp
    from jax_rope_cache.backends.launcher import buffer_signature
    lib = ctypes.CDLL(spec["harness"])
    cap = lambda n: jax.ffi.pycapsule(getattr(lib, n))
    for name, execute, init in (("jrc_test_hip", "kGpuRopeCacheExecuteHipTest", "kGpuRopeCacheInitializeHip"),
                                ("jrc_test_hip_nograph", "kGpuRopeCacheExecuteNoGraphHipTest", "kGpuRopeCacheInitializeHip"),
                                ("jrc_test_cuda", "kGpuRopeCacheExecuteCudaTest", "kGpuRopeCacheInitializeCuda")):
        jax.ffi.register_ffi_target(name, {"instantiate": cap("kGpuRopeCacheInstantiate"), "initialize": cap(init),
                                           "execute": cap(execute)}, platform="cpu", api_version=1)
    rng = np.random.default_rng(0)
    out = []
    for call in spec["calls"]:
        os.environ.update(call.get("env", {}))
        ops = []
        for shape, dt in call["operands"]:
            dt = jnp.dtype(dt)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            ops.append(rng.integers(0, 256, n, dtype=np.uint8).view(dt).reshape(shape))
        heads = [bytes(np.ascontiguousarray(o).view(np.uint8).reshape(-1)[:4]).hex() for o in ops]
        results = [jax.ShapeDtypeStruct(ops[i].shape, ops[i].dtype) for i in call["results"]]
        aliases = {int(k): v for k, v in call.get("aliases", {}).items()}
        fn = jax.ffi.ffi_call(call["target"], results, input_output_aliases=aliases)
        a = call["attrs"]
        attrs = dict(code=bytes.fromhex(a["code"]), code_hash=np.int64(a["code_hash"]), kernel=a["kernel"],
                     grid_div=np.int64(a["grid_div"]), grid_y=np.int64(a.get("grid_y", 1)), block=np.int64(a["block"]),
                     smem=np.int64(a["smem"]),
                     signature=buffer_signature(ops, results), buffer_names=call["buffer_names"])
        dev = jax.devices()[call.get("device", 0)]
        try:
            res = jax.jit(lambda *x: fn(*x, **attrs))(*jax.device_put(ops, dev))
            jax.block_until_ready(res)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        out.append(dict(error=err, heads=heads))
    print("RESULT " + json.dumps(out))
""")


def run_harness(stubs, tmp_path, calls, preload=(), env=None):
    log = tmp_path / "hip.log"
    if log.exists():
        log.unlink()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(harness=str(stubs / "launcher_test.so"), calls=calls,
                                    preload=[str(stubs / p) for p in preload])))
    e = child_env(HIP_STUB_LOG=str(log), LD_LIBRARY_PATH=str(stubs), HIP_STUB_PEEK_WORDS="0",
                  XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                  JAX_ENABLE_X64="1")  # int64 slot_mapping / positions stay int64
    e.update(env or {})
    r = subprocess.run([sys.executable, "-P", "-c", _CHILD, str(spec)], env=e, capture_output=True, text=True,
                       timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return out, records


def fnv1a64(data: bytes) -> str:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def fake_code_object(arch: str, symbol: str = "jrc_rope_cache_0", co_version: int | None = None) -> bytes:
    """A minimal ELF64 image (header with the arch's EF_AMDGPU_MACH, the symbol as a string) whose
    section-header end marks its size, as the stub computes it; with `co_version`, an AMDHSA code
    object of that version (EI_OSABI 64, EI_ABIVERSION version - 2)."""
    body = b"\0" + symbol.encode() + b"\0" + arch.encode() + b"\0"
    h = bytearray(64)
    h[:6] = b"\x7fELF\x02\x01"
    if co_version is not None:
        h[6:9] = bytes([1, 64, co_version - 2])
    struct.pack_into("<HH", h, 0x10, 3, 0xE0)  # ET_DYN, EM_AMDGPU
    struct.pack_into("<Q", h, 0x28, 64 + len(body))  # e_shoff: no section headers, right after the body
    struct.pack_into("<I", h, 0x30, MACH.get(arch, 0x3F))
    return bytes(h) + body


def simple_call(table: bytes, target="jrc_test_hip", device=0, kernel="jrc_rope_cache_0", env=None):
    return dict(target=target, device=device, env=env or {}, operands=[[[4], "float32"]], results=[0],
                buffer_names="x,out",
                attrs=dict(code=table.hex(), code_hash=launcher.code_hash(table), kernel=kernel, grid_div=1, block=64,
                           smem=0))


def calls_of(records, name):
    return [r for r in records if r["call"] == name]


TABLE = launcher.pack_code_table([(launcher.KIND_AMDGPU, a, fake_code_object(a)) for a in ("gfx942", "gfx950")])
ENTRIES = {a: d for _, a, d in launcher.unpack_code_table(TABLE)}


@pytest.mark.parametrize("reported", ["gfx942:sramecc+:xnack-", "gfx950:sramecc+:xnack-", "gfx950"])
def test_code_object_is_chosen_by_gcn_arch_name(stubs, tmp_path, reported):
    arch = reported.split(":")[0]
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)], env={"HIP_STUB_ARCH": reported})
    assert out[0]["error"] is None, out[0]["error"]
    loads = calls_of(rec, "hipModuleLoadData")
    assert [ld["fnv1a64"] for ld in loads] == [fnv1a64(ENTRIES[arch])]  # only the device's entry is loaded
    assert loads[0]["e_flags"] & 0xFF == MACH[arch] and loads[0]["size"] == len(ENTRIES[arch])
    (launch,) = calls_of(rec, "hipModuleLaunchKernel")
    assert launch["module_fnv1a64"] == fnv1a64(ENTRIES[arch]) and launch["stream"] == TEST_STREAM
    assert not calls_of(rec, "cuInit")


def test_an_arch_missing_from_the_table_is_an_error_naming_both(stubs, tmp_path):
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)], env={"HIP_STUB_ARCH": "gfx90a:sramecc+:xnack-"})
    err = out[0]["error"]
    assert err and "no code object for this GPU (gfx90a)" in err and "gfx942, gfx950" in err, err
    assert not calls_of(rec, "hipModuleLoadData") and not calls_of(rec, "hipModuleLaunchKernel")


def test_a_runtime_that_reports_no_arch_tries_each_entry(stubs, tmp_path):
    env = {"HIP_STUB_ARCH": "", "HIP_STUB_ACCEPT_MACH": str(MACH["gfx950"])}
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)], env=env)
    assert out[0]["error"] is None, out[0]["error"]
    assert [(ld["fnv1a64"], ld["result"]) for ld in calls_of(rec, "hipModuleLoadData")] == [
        (fnv1a64(ENTRIES["gfx942"]), 209), (fnv1a64(ENTRIES["gfx950"]), 0)]
    env["HIP_STUB_ACCEPT_MACH"] = "0x3f"  # accepts neither
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)], env=env)
    assert "no code object loads on HIP device 0" in out[0]["error"] and "hipErrorNoBinaryForGpu" in out[0]["error"]


def test_driver_errors_come_back_with_the_hip_error_string(stubs, tmp_path):
    out, _ = run_harness(stubs, tmp_path, [simple_call(TABLE, kernel="not_in_the_image")],
                         env={"HIP_STUB_ARCH": "gfx942"})
    assert "hipModuleGetFunction(not_in_the_image) failed: hipErrorNotFound (500)" in out[0]["error"]
    out, _ = run_harness(stubs, tmp_path, [simple_call(TABLE)], env={"HIP_STUB_ARCH": "gfx942",
                                                                      "HIP_STUB_LAUNCH_ERROR": "98"})
    assert "hipModuleLaunchKernel failed: hipErrorUnknown (stub) (98)" in out[0]["error"]
    out, _ = run_harness(stubs, tmp_path, [simple_call(TABLE)], env={"HIP_STUB_ARCH": "gfx942",
                                                                      "HIP_STUB_INIT_ERROR": "100"})
    assert "hipInit" in out[0]["error"]


def test_rocm_handlers_bind_hip_even_with_libcuda_loaded(stubs, tmp_path):
    """Both runtimes in the process (the old launcher took libcuda first): the ROCM handler binds
    HIP, the CUDA handler binds libcuda."""
    calls = [simple_call(TABLE), simple_call(TABLE, target="jrc_test_cuda")]
    out, rec = run_harness(stubs, tmp_path, calls, preload=("libcuda.so.1", "libamdhip64.so.7"),
                           env={"HIP_STUB_ARCH": "gfx942"})
    assert out[0]["error"] is None, out[0]["error"]
    order = [r["call"] for r in rec]
    assert order.index("hipInit") < order.index("hipModuleLaunchKernel") < order.index("cuInit")
    assert "cuDeviceGet failed: CUDA stub error" in out[1]["error"], out[1]["error"]
    assert len(calls_of(rec, "hipModuleLaunchKernel")) == 1  # the CUDA call never reached HIP


def test_grid_y_reaches_the_launch_and_is_range_checked(stubs, tmp_path):
    """grid_y (RC_SPLIT's parts) is the launch's grid.y; outside 1 .. 65535 the call fails, no launch."""
    calls = []
    for gy in (3, 0, 65536):
        c = simple_call(TABLE)
        c["attrs"]["grid_y"] = gy
        calls.append(c)
    out, rec = run_harness(stubs, tmp_path, calls, env={"HIP_STUB_ARCH": "gfx942"})
    assert out[0]["error"] is None, out[0]["error"]
    assert [x["grid"] for x in calls_of(rec, "hipModuleLaunchKernel")] == [[4, 3, 1]]
    assert [o["error"] and "bad launch attributes: 'grid_y' must be 1..65535, got" in o["error"] for o in out[1:]] == [
        True, True], out


def test_modules_load_once_per_device(stubs, tmp_path):
    calls = [simple_call(TABLE, device=d) for d in (0, 3, 0, 3)] + [simple_call(TABLE, "jrc_test_hip_nograph", 3)]
    out, rec = run_harness(stubs, tmp_path, calls, env={"HIP_STUB_ARCH": "gfx950"})
    assert all(o["error"] is None for o in out), out
    assert [ld["device"] for ld in calls_of(rec, "hipModuleLoadData")] == [0, 3]
    assert [x["module_device"] for x in calls_of(rec, "hipModuleLaunchKernel")] == [0, 3, 0, 3, 3]


def test_each_launch_runs_with_its_device_current_and_restores_the_thread_device(stubs, tmp_path):
    """Newer HIP runtimes refuse a launch (hipErrorInvalidResourceHandle) when the calling thread's
    current device is not the stream's; the stub does too. XLA's thread may sit on any device: the
    launcher makes the call's device current for the launch and switches back after it."""
    calls = [simple_call(TABLE, device=d) for d in (5, 2, 0, 5)] + [simple_call(TABLE, "jrc_test_hip_nograph", 2)]
    out, rec = run_harness(stubs, tmp_path, calls, env={"HIP_STUB_ARCH": "gfx942"})
    assert [o["error"] for o in out] == [None] * len(calls), out
    launches = calls_of(rec, "hipModuleLaunchKernel")
    assert [x["module_device"] for x in launches] == [5, 2, 0, 5, 2]
    assert all(x["device"] == x["module_device"] and x["result"] == 0 for x in launches), launches
    # around every launch on a device other than the thread's (0): set it, launch, set 0 back
    for i, r in enumerate(rec):
        if r["call"] == "hipModuleLaunchKernel" and r["device"] != 0:
            assert rec[i - 1] == {"call": "hipSetDevice", "device": r["device"]}, rec[i - 3:i + 2]
            assert rec[i + 1] == {"call": "hipSetDevice", "device": 0}, rec[i - 1:i + 3]
    # on the thread's own device no switch happens
    i = next(i for i, r in enumerate(rec) if r["call"] == "hipModuleLaunchKernel" and r["device"] == 0)
    assert rec[i - 1]["call"] != "hipSetDevice" or rec[i - 1]["device"] == 0


def test_a_hip_runtime_already_loaded_under_another_soname_is_bound(stubs, tmp_path):
    """A process whose PJRT plugin loaded libamdhip64.so.10 (a ROCm newer than the launcher's name
    list): the launcher binds that copy, found among the loaded objects, not a name on disk."""
    rocm10 = stubs / "rocm10" / "libamdhip64.so.10"
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)], preload=(str(rocm10),),
                           env={"HIP_STUB_ARCH": "gfx942", "LD_LIBRARY_PATH": str(stubs / "rocm10")})
    assert out[0]["error"] is None, out[0]["error"]
    assert [r["lib"] for r in calls_of(rec, "hipInit")] == ["libamdhip64.so.10"]
    assert len(calls_of(rec, "hipModuleLaunchKernel")) == 1
    # not loaded and not on the name list: an error naming what was looked for
    out, rec = run_harness(stubs, tmp_path, [simple_call(TABLE)],
                           env={"HIP_STUB_ARCH": "gfx942", "LD_LIBRARY_PATH": str(stubs / "rocm10")})
    assert "the HIP runtime (libamdhip64.so, loaded or .so.7 / .so.6) could not be loaded" in out[0]["error"]
    assert not rec


@pytest.mark.parametrize("reported", ["gfx942", ""])
def test_a_refused_code_object_names_its_version_and_the_rocm_it_needs(stubs, tmp_path, reported):
    """A ROCm < 6.3 runtime refuses code-object v6: the error says which version the code object is,
    which ROCm loads it, and which runtime this process has (version, path)."""
    table = launcher.pack_code_table([(launcher.KIND_AMDGPU, a, fake_code_object(a, co_version=6))
                                      for a in ("gfx942", "gfx950")])
    env = {"HIP_STUB_ARCH": reported, "HIP_STUB_MAX_CO_VERSION": "5", "HIP_STUB_RUNTIME_VERSION": "60241134"}
    out, rec = run_harness(stubs, tmp_path, [simple_call(table)], env=env)
    err = out[0]["error"]
    assert err and "hipErrorNoBinaryForGpu" in err, err
    assert "AMDHSA code-object v6, which the HIP runtime of ROCm >= 6.3 loads" in err, err
    assert "this process's HIP runtime: 6.2.41134 (libamdhip64.so.7)" in err, err
    assert not calls_of(rec, "hipModuleLaunchKernel")
    env["HIP_STUB_MAX_CO_VERSION"] = "6"  # a ROCm >= 6.3 runtime loads it
    out, _ = run_harness(stubs, tmp_path, [simple_call(table)], env=env)
    assert out[0]["error"] is None, out[0]["error"]


# ---- real FlyDSL code objects: the kernarg buffer against the metadata -----------------------------
VARIANTS = [
    dict(name="flash-bf16-neox-fp32", T=37, QH=8, KH=1, D=64, layout="flash", dt=BF16, cdt=BF16, tdt=F32),
    dict(name="shuffled-bf16-fp8fnuz-native", T=5, QH=32, KH=8, D=128, layout="xpacked_shuffled", dt=BF16, cdt=FNUZ,
         tdt=BF16, prec="native"),
    dict(name="xpacked-f16-fp8fn-gptj-full-int64", T=70, QH=4, KH=2, D=64, layout="xpacked", dt=F16, cdt=FN, tdt=F16,
         neox=False, full=True, idx=np.int64),
    dict(name="stacked-flash-f32-partial", T=3, QH=2, KH=2, D=128, R=64, layout="flash", dt=F32, cdt=F32, tdt=F32,
         layers=4),
    dict(name="hnd-bf16-fp8e5m2-native", T=9, QH=8, KH=2, D=128, layout="hnd", dt=BF16, cdt=np.dtype(ml_dtypes.float8_e5m2),
         tdt=F32, prec="native"),
]


def variant_operands(v):
    """The 14 operands (shape, dtype) of the custom call for variant `v`, and its OpSpec."""
    T, QH, KH, D, NB, BS = v["T"], v["QH"], v["KH"], v["D"], 6, 16
    R = v.get("R") or D
    w = R if v.get("full") else R // 2
    kc, vc = contract.cache_shapes(v["layout"], NB, BS, KH, D, v["cdt"])
    if v.get("layers"):
        kc, vc = (v["layers"],) + tuple(kc), (v["layers"],) + tuple(vc)
    idx = np.dtype(v.get("idx", np.int32))
    shapes = [((T, QH, D), v["dt"]), ((T, KH, D), v["dt"]), ((T, KH, D), v["dt"]), (tuple(kc), v["cdt"]),
              (tuple(vc), v["cdt"]), ((T,), idx), ((T,), idx), ((64, w), v["tdt"]), ((64, w), v["tdt"])]
    fp8 = v["cdt"] in contract.FP8_DTYPES
    s = jax.ShapeDtypeStruct
    spec = contract.check_op(*[s(sh, dt) for sh, dt in shapes], layout=v["layout"], is_neox=v.get("neox", True),
                             rotary_dim=R, k_scale=0.5 if fp8 else None, v_scale=0.25 if fp8 else None,
                             precision=v.get("prec", "fp32"),
                             layer=np.zeros((), np.int32) if v.get("layers") else None,
                             table_form="full" if v.get("full") else "half")
    shapes += [((), F32), ((), F32), ((), np.dtype(np.int32)), ((1,), F32), ((1,), F32)]  # scales, layer, norm weights
    return [[list(sh), np.dtype(dt).name] for sh, dt in shapes], spec


@pytest.mark.skipif(not flydsl.available(), reason=f"needs FlyDSL for real code objects: {flydsl.unavailable_reason()}")
def test_kernarg_buffer_matches_the_code_object_metadata(stubs, tmp_path):
    calls, expect = [], []
    for v in VARIANTS:
        operands, spec = variant_operands(v)
        cfg = rocm.kernel_config(spec)
        table, symbol, objs = rocm.build_code_table(cfg, ("gfx942", "gfx950"))
        cfg = objs[0].config or cfg
        attrs = dict(code=table.hex(), code_hash=launcher.code_hash(table), kernel=symbol, grid_div=cfg.tpb,
                     grid_y=cfg.split, block=cfg.nt, smem=0)
        for target, device in (("jrc_test_hip", 0), ("jrc_test_hip_nograph", 0), ("jrc_test_hip", 2)):
            calls.append(dict(target=target, device=device, operands=operands, results=[0, 1, 3, 4],
                              aliases={"3": 2, "4": 3}, attrs=attrs, buffer_names=launcher.BUFFER_NAMES))
            expect.append((v, operands, cfg, symbol, {o.arch: o for o in objs}))
    for arch in ("gfx942", "gfx950"):
        out, rec = run_harness(stubs, tmp_path, calls, env={"HIP_STUB_ARCH": f"{arch}:sramecc+:xnack-",
                                                            "HIP_STUB_ACCEPT_MACH": str(MACH[arch]),
                                                            "HIP_STUB_PEEK_WORDS": "14"})  # the operand pointers
        launches = calls_of(rec, "hipModuleLaunchKernel")
        assert [o["error"] for o in out] == [None] * len(calls), out
        assert len(launches) == len(calls)
        for o, launch, (v, operands, cfg, symbol, objs) in zip(out, launches, expect):
            co = objs[arch]
            info = amdgpu_elf.kernel_info(co.code)
            assert launch["name"] == symbol == info["name"]
            assert launch["module_fnv1a64"] == fnv1a64(co.code), "not the device's code object"
            assert launch["grid"] == [math.ceil(v["T"] / cfg.tpb), cfg.split, 1] and cfg.tpb >= 1
            assert launch["block"] == list(info["reqd_workgroup_size"]) == [cfg.nt, 1, 1]
            assert launch["shmem"] == info["group_segment_size"] == 0
            assert launch["stream"] == TEST_STREAM and not launch["kernel_params"] and launch["extra_ended"]
            kernarg = bytes.fromhex(launch["kernarg"])
            assert launch["kernarg_size"] == len(kernarg) == info["kernarg_size"], v["name"]
            words = {}
            for i, a in enumerate(info["args"]):
                assert a["size"] == 8 and a["offset"] + 8 <= len(kernarg), a
                words[i] = struct.unpack_from("<Q", kernarg, a["offset"])[0]
            n_ops, n_res = len(operands), 4
            assert len(words) == 2 * n_ops + n_res
            # operand pointers reach the operands' data (host memory on this CPU backend)
            assert launch["peek"][:n_ops] == o["heads"], v["name"]
            # results: q_out, k_out fresh; key/value cache results ARE the operand buffers (aliased)
            assert words[n_ops + 2] == words[3] and words[n_ops + 3] == words[4]
            assert len({words[i] for i in range(n_ops)} | {words[n_ops], words[n_ops + 1]}) == n_ops + 2
            # then dim0 of every operand (1 for scalars)
            assert [words[n_ops + n_res + i] for i in range(n_ops)] == [sh[0] if sh else 1 for sh, _ in operands]
        loads = calls_of(rec, "hipModuleLoadData")
        assert [(ld["device"], ld["e_flags"] & 0xFF) for ld in loads] == [(0, MACH[arch]), (2, MACH[arch])] * len(VARIANTS)
