"""The child process that runs FlyDSL for jax_rope_cache (started by compilers/flydsl.py).

Run as a script (`python -P flydsl_worker.py`), never imported by the package: it imports no
jax_rope_cache module, so FlyDSL (and whatever FlyDSL imports) loads into this process only, never
into the user's JAX process. `-P` matters: this folder holds a module named flydsl.py.

torch: flydsl.compiler imports torch at module level but compiling a kernel from integer
arguments uses nothing of it beyond a few names (torch.Tensor and torch.cuda.Stream as registry
keys, the dtype objects as dict keys). Unless JAX_ROPE_CACHE_FLYDSL_TORCH=real, this process
installs a small stand-in module under the name `torch` before importing flydsl, so compiling
needs no torch install and never loads a second HIP runtime (tests/test_rocm_compile.py checks
that the stand-in gives the same bytes as a real torch).

Protocol: one JSON object per line on stdin, one JSON reply per line on the original stdout
(anything FlyDSL prints goes to stderr). First reply: {"ready": true, "flydsl": version,
"torch": "stub" | version}. Requests:
  {"op": "compile", "kernel": path, "config": {...RocmKernelConfig fields}, "arch": "gfx942",
   "rocm_path": folder with llvm/bin/ld.lld, "isa": false, "hints": {"waves_per_eu": 8} (optional)}
-> {"ok": true, "code": base64 code object, "isa": text or null}
   {"ok": false, "error": "Type: message", "traceback": text}
EOF on stdin ends the process.
"""

import base64
import importlib.util
import json
import os
import sys
import tempfile
import traceback
import types
import warnings

# What each compile sets (process-wide; the worker handles one request at a time).
_ENV_KEYS = ("ROCM_PATH", "FLYDSL_GPU_ARCH", "ARCH", "COMPILE_ONLY", "FLYDSL_RUNTIME_ENABLE_CACHE",
             "FLYDSL_DEBUG_DUMP_ASM", "FLYDSL_DUMP_DIR")


def install_torch_stub() -> None:
    """A module named `torch` with exactly the names flydsl 0.5 touches while compiling."""
    torch = types.ModuleType("torch")
    torch.__version__ = "0+jax_rope_cache.stub"
    torch.__path__ = []  # a package, so `import torch.x` fails cleanly instead of oddly

    class Tensor:  # registry key only: nothing here ever is a torch tensor
        pass

    class dtype:
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return f"torch.{self.name}"

    torch.Tensor = Tensor
    torch.dtype = dtype
    for name in ("float16", "bfloat16", "float32", "float64", "bool", "uint8", "int8", "int16", "int32", "int64",
                 "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz"):
        setattr(torch, name, dtype(name))
    cuda = types.ModuleType("torch.cuda")

    class Stream:
        pass

    cuda.Stream = Stream
    cuda.is_available = lambda: False
    cuda.is_initialized = lambda: False
    cuda.is_current_stream_capturing = lambda: False
    torch.cuda = cuda
    sys.modules["torch"] = torch
    sys.modules["torch.cuda"] = cuda


_kernels: dict = {}


def kernel_module(path: str):
    st = os.stat(path)
    k = (path, st.st_mtime_ns, st.st_size)
    mod = _kernels.get(k)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_jrc_rocm_kernel_{len(_kernels)}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        _kernels[k] = mod
    return mod


def binary_from_artifact(artifact) -> bytes:
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu
    from flydsl.compiler.jit_function import _create_mlir_context

    with _create_mlir_context():
        module = ir.Module.parse(artifact._ir_text)
        for op in module.body.operations:
            if op.operation.name == "gpu.binary":
                objs = op.attributes["objects"]
                return bytes(gpu.ObjectAttr(objs[0]).object)
    raise RuntimeError("FlyDSL produced no gpu.binary")


def _compile_hints(hints: dict):
    """FlyDSL compile hints for this compile (e.g. {"waves_per_eu": 8}: the AMDGPU backend then keeps
    the kernel to the registers of 8 waves per SIMD, amdgpu-waves-per-eu)."""
    import contextlib

    if not hints:
        return contextlib.nullcontext()
    from flydsl.compiler.kernel_function import CompilationContext

    return CompilationContext.compile_hints(hints)


def compile_one(req: dict) -> dict:
    import flydsl.expr as fx

    K = kernel_module(req["kernel"])
    cfg = K.RocmKernelConfig(**req["config"])
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    with tempfile.TemporaryDirectory() as dump:
        try:
            os.environ["ROCM_PATH"] = req["rocm_path"]
            os.environ["FLYDSL_GPU_ARCH"] = req["arch"]
            os.environ["ARCH"] = req["arch"]
            os.environ["FLYDSL_RUNTIME_ENABLE_CACHE"] = "0"  # the parent caches code objects itself
            os.environ.pop("COMPILE_ONLY", None)
            if req.get("isa"):
                os.environ["FLYDSL_DEBUG_DUMP_ASM"] = "1"
                os.environ["FLYDSL_DUMP_DIR"] = dump
            hints = dict(req.get("hints") or {})
            with warnings.catch_warnings(), _compile_hints(hints):
                warnings.simplefilter("ignore")
                launch = K.build_launcher(cfg)
                n = K.launch_args(cfg) if hasattr(K, "launch_args") else K.NUM_ARGS  # more with extra operands
                launch._compile_only(*[fx.Int64(0)] * n)
            code = binary_from_artifact(launch._last_compiled[1])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        isa = None
        if req.get("isa"):
            texts = []
            for root, _dirs, files in os.walk(dump):
                for name in sorted(files):
                    if name.endswith((".s", ".asm", ".isa")) or "isa" in name.lower():
                        with open(os.path.join(root, name)) as f:
                            texts.append(f.read())
            isa = "\n".join(texts)
    return {"ok": True, "code": base64.b64encode(code).decode(), "isa": isa}


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # FlyDSL's own prints must not corrupt the reply stream
    torch_mode = os.environ.get("JAX_ROPE_CACHE_FLYDSL_TORCH", "stub").strip().lower()

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        if torch_mode != "real":
            install_torch_stub()
        import flydsl.compiler  # noqa: F401
        import flydsl.expr  # noqa: F401
        from importlib.metadata import version

        try:
            fv = version("flydsl")
        except Exception:  # noqa: BLE001
            fv = "unknown"
        send({"ready": True, "flydsl": fv, "torch": "stub" if torch_mode != "real" else sys.modules["torch"].__version__,
              "pid": os.getpid()})
    except BaseException as e:  # noqa: BLE001
        send({"ready": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") != "compile":
                raise ValueError(f"unknown request {req.get('op')!r}")
            send(compile_one(req))
        except Exception as e:  # noqa: BLE001
            send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    main()
