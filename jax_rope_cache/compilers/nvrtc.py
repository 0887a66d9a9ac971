"""NVRTC through ctypes: CUDA C++ source -> cubin (and PTX), cached in memory and on disk.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (what `jax[cuda13]`/`jax[cuda12]` install:
site-packages/nvidia/cu13/lib or nvidia/cuda_nvrtc/lib) or from a system CUDA (`libnvrtc.so*` on
the loader path, $CUDA_HOME/lib64). No GPU is needed to compile.

Cache: key = sha256(source, every header, options, target arch, NVRTC version); values are the
compiled bytes plus the compiler log. In memory per process, and on disk under
$JAX_ROPE_CACHE_DIR or ~/.cache/jax_rope_cache, one file per entry with a checksum, written
atomically (jax_rope_cache.compilers.cache: concurrent processes never see half a file; a corrupt entry
is rebuilt with a warning; an unwritable folder falls back to memory with a warning). Set
JAX_ROPE_CACHE_DIR to an empty string to disable the disk cache.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import os
import re
import struct
import sys
import threading

from jax_rope_cache.compilers import cache

__all__ = ["NvrtcError", "NvrtcUnavailable", "Compiled", "available", "version", "supported_archs",
           "compile_cuda", "spill_bytes", "spills", "stack_frame_bytes"]


class NvrtcUnavailable(RuntimeError):
    """No usable NVRTC library was found."""


class NvrtcError(RuntimeError):
    """NVRTC rejected the source; the message holds the compiler log."""


_lock = threading.Lock()
_lib = None
_lib_error: str | None = None
_mem_cache: dict[str, "Compiled"] = {}
_key_locks: dict[str, threading.Lock] = {}


def _candidate_paths() -> list[tuple[str, str | None]]:
    """(libnvrtc path, libnvrtc-builtins path or None), best first."""
    out = []
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    for root in roots:
        for sub in ("nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/cuda_nvrtc/lib"):
            d = os.path.join(root, sub)
            libs = sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)
            builtins = sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*")), reverse=True)
            libs = [p for p in libs if "builtins" not in p]
            if libs:
                out.append((libs[0], builtins[0] if builtins else None))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not home:
            continue
        for d in (os.path.join(home, "lib64"), os.path.join(home, "lib")):
            libs = [p for p in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)
                    if "builtins" not in p]
            builtins = sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*")), reverse=True)
            if libs:
                out.append((libs[0], builtins[0] if builtins else None))
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        out.append((name, None))
    return out


def _load():
    global _lib, _lib_error
    with _lock:
        if _lib is not None or _lib_error is not None:
            return _lib
        errors = []
        override = os.environ.get("JAX_ROPE_CACHE_NVRTC")
        candidates = [(override, None)] if override else _candidate_paths()
        for path, builtins in candidates:
            try:
                if builtins:  # libnvrtc dlopens its builtins by soname: make them global first
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                major, minor = ctypes.c_int(), ctypes.c_int()
                if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
                    raise OSError("nvrtcVersion failed")
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            _configure(lib)
            lib._jrc_version = (major.value, minor.value)
            lib._jrc_path = path
            _lib = lib
            return lib
        _lib_error = "; ".join(errors[-4:]) or "no candidate"
        return None


def _configure(lib) -> None:
    p, c = ctypes.c_void_p, ctypes.c_char_p
    lib.nvrtcGetErrorString.restype = c
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), c, c, ctypes.c_int,
                                       ctypes.POINTER(c), ctypes.POINTER(c)]
    lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(c)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    for name in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize", "nvrtcGetPTXSize"):
        getattr(lib, name).argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    for name in ("nvrtcGetProgramLog", "nvrtcGetCUBIN", "nvrtcGetPTX"):
        getattr(lib, name).argtypes = [p, ctypes.c_char_p]


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str:
    _load()
    return _lib_error or ""


def require():
    lib = _load()
    if lib is None:
        raise NvrtcUnavailable(
            "rope_and_cache: NVRTC (the CUDA runtime compiler) was not found "
            f"({_lib_error}); install it with `pip install nvidia-cuda-nvrtc` "
            "(jax[cuda13] installs it too) or put a CUDA toolkit's libnvrtc on the loader path")
    return lib


def version() -> tuple[int, int]:
    return require()._jrc_version


def supported_archs() -> list[int]:
    """Compute capabilities (e.g. 90) this NVRTC can emit machine code for."""
    lib = require()
    n = ctypes.c_int()
    if lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) != 0:
        return []
    arr = (ctypes.c_int * n.value)()
    lib.nvrtcGetSupportedArchs(arr)
    return sorted(arr)


@dataclasses.dataclass(frozen=True)
class Compiled:
    arch: str          # "sm_90" (cubin) or "compute_90" (PTX)
    code: bytes        # cubin ELF, or PTX text (NUL-terminated)
    log: str           # compiler log (ptxas -v lines when asked)
    key: str           # cache key (hex)
    from_disk: bool = False

    @property
    def is_ptx(self) -> bool:
        return self.arch.startswith("compute_")


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def spill_bytes(log: str) -> tuple[int, int, int]:
    """(spill stores, spill loads, stack frame) summed over the ptxas -v lines of a log."""
    st = ld = stack = 0
    for m in _SPILL.finditer(log):
        st += int(m.group(1))
        ld += int(m.group(2))
    for m in _STACK.finditer(log):
        stack += int(m.group(1))
    return st, ld, stack


_EIATTR_FRAME_SIZE = 0x11  # .nv.info attribute: (function symbol, stack frame bytes); spills live in the frame


def stack_frame_bytes(cubin: bytes) -> int | None:
    """The largest stack frame of the cubin's functions, from its .nv.info sections (what ptxas -v
    reports as "bytes stack frame"; spilled registers live there, so 0 means no spills), or None
    when the ELF holds no such record."""
    if cubin[:5] != b"\x7fELF\x02":
        return None
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    frames = []
    for name, _, _, _, off, size in heads:
        if not cubin[names_at + name:].startswith(b".nv.info"):
            continue
        data, i = cubin[off:off + size], 0
        while i + 4 <= len(data):  # entries: format, attribute, then a value by format
            fmt, attr = data[i], data[i + 1]
            if fmt == 4:  # size-prefixed value
                n, = struct.unpack_from("<H", data, i + 2)
                if attr == _EIATTR_FRAME_SIZE and n == 8:
                    frames.append(struct.unpack_from("<I", data, i + 8)[0])
                i += 4 + n
            elif fmt in (2, 3):
                i += 4
            elif fmt == 1:
                i += 2
            else:
                break
    return max(frames) if frames else None


def spills(c: "Compiled") -> tuple[int, int, int]:
    """(spill stores, spill loads, stack frame) of an sm_XY build: ptxas' -v report where the log has
    one, else (0, 0, frame) from the cubin. NVRTC 13.0 prints no report for a program it already
    built in this process (measured on the H200 host), so a rebuild's log can be empty of it."""
    if "ptxas" in c.log:
        return spill_bytes(c.log)
    frame = stack_frame_bytes(c.code)
    if frame is None:
        raise NvrtcError(f"no ptxas report in the log and no stack-frame record in the {c.arch} cubin")
    return 0, 0, frame


def _key(source: str, headers: dict[str, str], options: list[str], arch: str) -> str:
    h = hashlib.sha256()
    ver = version()
    for part in (f"nvrtc {ver[0]}.{ver[1]}", arch, "\0".join(options), source):
        h.update(part.encode())
        h.update(b"\0\1")
    for name in sorted(headers):
        h.update(name.encode() + b"\0" + headers[name].encode() + b"\0\1")
    return h.hexdigest()


def _disk_read(key: str) -> Compiled | None:
    entry = cache.read(cache.cache_dir(), key + ".cubin.jrc", required={"arch": str})
    if entry is None:
        return None
    meta, code = entry
    log = meta.get("log", "")
    return Compiled(arch=meta["arch"], code=code, log=log if isinstance(log, str) else "", key=key, from_disk=True)


def _disk_write(c: Compiled) -> None:
    # One file, written atomically with a checksum (jax_rope_cache.compilers.cache); an unwritable
    # folder only costs a recompilation next time (warned once).
    cache.write(cache.cache_dir(), c.key + ".cubin.jrc", c.code, dict(arch=c.arch, log=c.log, nvrtc=list(version())))


def _compile_now(source: str, headers: dict[str, str], options: list[str], arch: str, name: str) -> tuple[bytes, str]:
    lib = require()
    prog = ctypes.c_void_p()
    names = list(headers)
    hdr_src = (ctypes.c_char_p * max(1, len(names)))(*[headers[n].encode() for n in names])
    hdr_names = (ctypes.c_char_p * max(1, len(names)))(*[n.encode() for n in names])
    err = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(names),
                                 hdr_src, hdr_names)
    if err:
        raise NvrtcError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(err).decode()}")
    try:
        opts = [f"--gpu-architecture={arch}"] + list(options)
        copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        err = lib.nvrtcCompileProgram(prog, len(opts), copts)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if err:
            raise NvrtcError(f"NVRTC failed to compile {name} for {arch} "
                             f"({lib.nvrtcGetErrorString(err).decode()}), options {opts}:\n{log}")
        if arch.startswith("sm_"):
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
            out = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetCUBIN(prog, out)
        else:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
            out = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetPTX(prog, out)
        return out.raw[: n.value], log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cuda(source: str, *, arch: str, options=(), headers: dict[str, str] | None = None,
                 name: str = "kernel.cu") -> Compiled:
    """Compiles `source` for `arch` ("sm_90": cubin, "compute_90": PTX), through both caches."""
    headers = dict(headers or {})
    options = list(options)
    key = _key(source, headers, options, arch)
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # one build per key at a time: a second thread waits and takes the first's result
        c = _mem_cache.get(key)
        if c is not None:
            return c
        c = _disk_read(key)
        if c is None:
            code, log = _compile_now(source, headers, options, arch, name)
            c = Compiled(arch=arch, code=code, log=log, key=key)
            _disk_write(c)
        _mem_cache[key] = c
        return c
