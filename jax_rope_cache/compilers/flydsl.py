"""FlyDSL as a compiler only: RocmKernelConfig + arch -> AMDGPU code object, with no GPU present.

* FlyDSL (`pip install flydsl`; it imports torch at module level, any build works) is imported
  lazily; `available()` / `unavailable_reason()` tell whether it can be used.
* FlyDSL links with `$ROCM_PATH/llvm/bin/ld.lld` (default /opt/rocm). Where no ROCm LLD exists, a
  private toolkit folder is provisioned once under the cache directory: llvm/bin/ld.lld is a small
  wrapper running the LLD of the `ziglang` pip package (or an `ld.lld` found on PATH), and
  amdgcn/bitcode is empty (the kernel calls no device library). ROCM_PATH points there only
  while this module compiles; the user sets nothing.
* Targets are chosen per compile (FLYDSL_GPU_ARCH / ARCH set during the call, under a lock), so
  one process compiles gfx942 and gfx950.
* Cache: key = sha256(kernel source, config, arch, flydsl version); in memory and on disk
  (JAX_ROPE_CACHE_DIR or ~/.cache/jax_rope_cache, "" disables the disk): one file per entry with a
  checksum, written atomically; corrupt entries are rebuilt and an unwritable folder falls back to
  memory, both with a warning (jax_rope_cache.compilers.cache).
"""

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading

from jax_rope_cache.compilers import amdgpu_elf, cache

SUPPORTED_ARCHS = ("gfx942", "gfx950")
INSTALL_HINT = ("pip install 'flydsl==0.5.0' torch ziglang  (or: pip install 'jax_rope_cache[rocm]'); "
                "torch is imported by flydsl.compiler, any build of it works")

_lock = threading.RLock()
_mem: dict = {}


class FlyDSLUnavailable(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class CodeObject:
    arch: str
    code: bytes
    symbol: str           # kernel symbol to load (e.g. "jrc_rope_cache_0")
    info: dict            # amdgpu_elf.kernel_info
    key: str
    from_disk: bool = False


@functools.cache
def kernel_source_path() -> str:
    return cache.find_source("rocm/rope_cache_flydsl.py")


@functools.cache
def kernel_module(path: str | None = None):
    """The kernel builder module (kernels/rocm/rope_cache_flydsl.py), importable without flydsl."""
    path = path or kernel_source_path()
    spec = importlib.util.spec_from_file_location("jax_rope_cache._rocm_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _probe() -> tuple[bool, str]:
    try:
        kernel_source_path()
    except FileNotFoundError as e:
        return False, str(e)
    for name in ("flydsl", "torch"):
        if importlib.util.find_spec(name) is None:
            return False, f"the Python package {name!r} is not installed"
    try:
        import flydsl.compiler  # noqa: F401
        import flydsl.expr  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"importing flydsl failed: {type(e).__name__}: {e}"
    if _find_lld() is None:
        return False, "no ld.lld found (no ROCm LLVM, no `ziglang` package, no ld.lld on PATH)"
    return True, ""


def available() -> bool:
    return _probe()[0]


def unavailable_reason() -> str:
    return _probe()[1]


def require() -> None:
    ok, why = _probe()
    if not ok:
        raise FlyDSLUnavailable(f"compiling the ROCm kernel needs FlyDSL ({why}); install it with: {INSTALL_HINT}")


def flydsl_version() -> str:
    from importlib.metadata import version

    try:
        return version("flydsl")
    except Exception:  # noqa: BLE001
        return "unknown"


# ---- the linker -------------------------------------------------------------------------------
def _rocm_roots() -> list[str]:
    return [r for r in (os.environ.get("ROCM_PATH"), "/opt/rocm") if r]


def _find_lld():
    """('rocm', root) when a ROCm LLVM exists, ('zig', None) / ('path', exe) otherwise, or None."""
    for root in _rocm_roots():
        if os.path.isfile(os.path.join(root, "llvm", "bin", "ld.lld")):
            return ("rocm", root)
    if importlib.util.find_spec("ziglang") is not None:
        return ("zig", None)
    for name in ("ld.lld", "ld.lld-21", "ld.lld-20", "ld.lld-19", "ld.lld-18"):
        exe = shutil.which(name)
        if exe:
            return ("path", exe)
    return None


@functools.cache
def toolkit_root() -> str:
    """A folder with llvm/bin/ld.lld (and amdgcn/bitcode) for FlyDSL's ROCDL linker step."""
    found = _find_lld()
    if found is None:
        raise FlyDSLUnavailable("compiling the ROCm kernel needs an ld.lld: install ROCm, or "
                                "`pip install ziglang`, or put ld.lld on PATH")
    kind, where = found
    if kind == "rocm":
        return where
    if kind == "zig":
        cmd = f'exec "{sys.executable}" -m ziglang ld.lld "$@"'
    else:
        cmd = f'exec "{where}" "$@"'
    tag = hashlib.sha256(cmd.encode()).hexdigest()[:12]
    script = f"#!/bin/sh\n{cmd}\n"
    bases = [b for b in (cache.cache_dir(), tempfile.gettempdir()) if b]
    for i, base in enumerate(bases):  # an unwritable cache folder falls back to the temp folder
        root = os.path.join(base, f"rocm-toolkit-{tag}")
        try:
            _write_wrapper(root, script)
            break
        except OSError:
            if i == len(bases) - 1:
                raise
    return root


def _write_wrapper(root: str, script: str) -> None:
    lld = os.path.join(root, "llvm", "bin", "ld.lld")
    os.makedirs(os.path.dirname(lld), exist_ok=True)
    os.makedirs(os.path.join(root, "amdgcn", "bitcode"), exist_ok=True)
    try:
        with open(lld) as f:
            same = f.read() == script
    except OSError:
        same = False
    if not same:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(lld))
        with os.fdopen(fd, "w") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        os.replace(tmp, lld)


@contextlib.contextmanager
def _compile_env(arch: str):
    """Environment for one compile (process-wide: callers hold _lock)."""
    keys = ("ROCM_PATH", "FLYDSL_GPU_ARCH", "ARCH", "COMPILE_ONLY", "FLYDSL_RUNTIME_ENABLE_CACHE")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        os.environ["ROCM_PATH"] = toolkit_root()
        os.environ["FLYDSL_GPU_ARCH"] = arch
        os.environ["ARCH"] = arch
        os.environ["FLYDSL_RUNTIME_ENABLE_CACHE"] = "0"  # this module caches the code objects itself
        os.environ.pop("COMPILE_ONLY", None)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- compile ------------------------------------------------------------------------------------
@functools.cache
def _source_hash() -> str:
    with open(kernel_source_path(), "rb") as f:
        src = f.read()
    with open(os.path.abspath(__file__), "rb") as f:
        src += f.read()
    return hashlib.sha256(src).hexdigest()


def _key(cfg, arch: str) -> str:
    h = hashlib.sha256()
    for part in ("jrc-rocm-1", _source_hash(), cfg.key(), arch, flydsl_version()):
        h.update(part.encode() + b"\0\1")
    return h.hexdigest()


def _binary_from_artifact(artifact) -> bytes:
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


def _compile_now(cfg, arch: str, dump_dir: str | None = None) -> bytes:
    import warnings

    import flydsl.expr as fx

    K = kernel_module()
    with _compile_env(arch):
        if dump_dir:
            os.environ["FLYDSL_DEBUG_DUMP_ASM"] = "1"
            os.environ["FLYDSL_DUMP_DIR"] = dump_dir
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                launch = K.build_launcher(cfg)
                launch._compile_only(*[fx.Int64(0)] * K.NUM_ARGS)
            artifact = launch._last_compiled[1]
        finally:
            if dump_dir:
                os.environ.pop("FLYDSL_DEBUG_DUMP_ASM", None)
                os.environ.pop("FLYDSL_DUMP_DIR", None)
    return _binary_from_artifact(artifact)


def _disk_read(key: str) -> CodeObject | None:
    d = cache.cache_dir()
    folder = os.path.join(d, "rocm") if d else None
    entry = cache.read(folder, key + ".hsaco.jrc", required={"arch": str})
    if entry is None:
        return None
    meta, code = entry
    try:
        info = amdgpu_elf.kernel_info(code)
    except amdgpu_elf.CodeObjectError as e:  # checksummed, but not a code object the launcher can use
        cache.discard(folder, key + ".hsaco.jrc", f"payload is not a usable code object: {e}")
        return None
    return CodeObject(arch=meta["arch"], code=code, symbol=info["name"], info=info, key=key, from_disk=True)


def _disk_write(co: CodeObject, cfg) -> None:
    # One file, written atomically with a checksum (jax_rope_cache.compilers.cache); an unwritable
    # folder only costs a recompilation next time (warned once).
    d = cache.cache_dir()
    meta = dict(arch=co.arch, flydsl=flydsl_version(), config=dataclasses.asdict(cfg))
    cache.write(os.path.join(d, "rocm") if d else None, co.key + ".hsaco.jrc", co.code, meta)


def compile_config(cfg, arch: str) -> CodeObject:
    """The code object of `cfg` for `arch` ("gfx942" / "gfx950"), through the caches."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    key = _key(cfg, arch)
    co = _mem.get(key)
    if co is not None:
        return co
    co = _disk_read(key)
    if co is None:
        require()
        with _lock:
            co = _mem.get(key)
            if co is not None:
                return co
            code = _compile_now(cfg, arch)
        info = amdgpu_elf.kernel_info(code)
        co = CodeObject(arch=arch, code=code, symbol=info["name"], info=info, key=key)
        _disk_write(co, cfg)
    _mem[key] = co
    return co


def isa(cfg, arch: str) -> str:
    """The final ISA text of `cfg` for `arch` (compiles again; for build notes and tests)."""
    require()
    with _lock, tempfile.TemporaryDirectory() as d:
        _compile_now(cfg, arch, dump_dir=d)
        texts = []
        for root, _dirs, files in os.walk(d):
            for name in sorted(files):
                if name.endswith((".s", ".asm", ".isa")) or "isa" in name.lower():
                    with open(os.path.join(root, name)) as f:
                        texts.append(f.read())
        return "\n".join(texts)
