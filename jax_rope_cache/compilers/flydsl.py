"""FlyDSL as a compiler only: RocmKernelConfig + arch -> AMDGPU code object, with no GPU present.

* Where a code object comes from, in order: this process's memory; a bundle file (`compile
  --bundle`, found through $JAX_ROPE_CACHE_ROCM_BUNDLE or as `*.jrcbundle` in the cache's rocm/
  folder); the disk cache (one file per entry); else FlyDSL compiles it. The first three need
  neither flydsl nor torch installed: a deployment host only needs the precompiled entries.
* Key = sha256(format tag, kernel source, compile driver (flydsl_worker.py), config, arch): what
  determines the bytes, all of it known without FlyDSL. The FlyDSL version that built an entry
  is recorded in its header (not in the key: a host without FlyDSL could not compute it).
* Compiling runs in a child process (compilers/flydsl_worker.py, started on first need and kept
  for the process's later compiles), so FlyDSL, its MLIR libraries and torch never load into the
  user's JAX process. The child gives FlyDSL a stand-in `torch` module (all flydsl 0.5 needs to
  compile), so no torch install is needed; JAX_ROPE_CACHE_FLYDSL_TORCH=real makes it import the
  real one instead.
* FlyDSL links with `$ROCM_PATH/llvm/bin/ld.lld` (default /opt/rocm). Where no ROCm LLD exists, a
  private toolkit folder is provisioned once under the cache directory: llvm/bin/ld.lld is a small
  wrapper running the LLD of the `ziglang` pip package (or an `ld.lld` found on PATH), and
  amdgcn/bitcode is empty (the kernel calls no device library). ROCM_PATH points there in the
  child only; the user sets nothing.
* Disk entries: JAX_ROPE_CACHE_DIR or ~/.cache/jax_rope_cache ("" disables the disk), one file per
  entry with a checksum, written atomically; corrupt entries are rebuilt and an unwritable folder
  falls back to memory, both with a warning (jax_rope_cache.compilers.cache).
"""

import atexit
import base64
import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from jax_rope_cache.compilers import amdgpu_elf, cache

SUPPORTED_ARCHS = ("gfx942", "gfx950")
# The one FlyDSL release the kernel builds with: the compile process (flydsl_worker.py) uses its
# internal APIs (_compile_only, _last_compiled, _ir_text, _create_mlir_context), which change
# between releases without notice. pyproject.toml's `rocm` extra pins the same version.
FLYDSL_VERSION = "0.5.0"
INSTALL_HINT = (f"pip install 'flydsl=={FLYDSL_VERSION}' ziglang  (or: pip install 'jax_rope_cache[rocm]'); "
                "torch is not needed")
PRECOMPILE_HINT = ("or precompile on a build machine (`python -m jax_rope_cache compile ... --bundle FILE`) and "
                   "point JAX_ROPE_CACHE_ROCM_BUNDLE at the file")
KEY_TAG = "jrc-rocm-2"
BUNDLE_MAGIC_KIND = "jax_rope_cache rocm bundle"
BUNDLE_SUFFIX = ".jrcbundle"
WORKER_TIMEOUT_S = float(os.environ.get("JAX_ROPE_CACHE_FLYDSL_TIMEOUT", "600"))

_lock = threading.RLock()
_mem: dict = {}


class FlyDSLUnavailable(RuntimeError):
    pass


_warned: set = set()


def _warn_once(kind: str, where: str, message: str) -> None:
    with _lock:
        if (kind, where) in _warned:
            return
        _warned.add((kind, where))
    warnings.warn(message, cache.CacheWarning, stacklevel=3)


class FlyDSLError(RuntimeError):
    """FlyDSL (in the child process) failed to compile a configuration."""


@dataclasses.dataclass(frozen=True)
class CodeObject:
    arch: str
    code: bytes
    symbol: str           # kernel symbol to load (e.g. "jrc_rope_cache_0")
    info: dict            # amdgpu_elf.kernel_info
    key: str
    from_disk: bool = False
    origin: str = "compiled"  # "compiled", "disk" or "bundle:<path>"
    config: object = None     # the RocmKernelConfig it was compiled from
    hints: dict | None = None  # FlyDSL compile hints it was compiled with (e.g. {"waves_per_eu": 8})


# The FlyDSL kernels: name -> their source files under kernels/. The first is the builder the compile
# driver loads; every file listed is part of the kernel's cache key (the MLA builder emits with the
# main kernel's helpers). A configuration names its kernel by the class attribute KERNEL (the main
# kernel's RocmKernelConfig has none).
MAIN_KERNEL = "rope_cache"
KERNEL_SOURCES = {
    MAIN_KERNEL: ("rocm/rope_cache_flydsl.py",),
    "mla_cache": ("rocm/mla_cache_flydsl.py", "rocm/rope_cache_flydsl.py"),
}


def kernel_of(cfg) -> str:
    """The kernel (KERNEL_SOURCES) a configuration belongs to."""
    return getattr(type(cfg), "KERNEL", MAIN_KERNEL)


@functools.cache
def kernel_source_path(kernel: str = MAIN_KERNEL) -> str:
    if kernel not in KERNEL_SOURCES:
        raise ValueError(f"kernel: expected one of {sorted(KERNEL_SOURCES)}, got {kernel!r}")
    return cache.find_source(KERNEL_SOURCES[kernel][0])


def worker_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "flydsl_worker.py")


@functools.cache
def kernel_module(path: str | None = None, kernel: str = MAIN_KERNEL):
    """The builder module of `kernel` (default kernels/rocm/rope_cache_flydsl.py; `path`: that file
    elsewhere), importable without flydsl."""
    path = path or kernel_source_path(kernel)
    name = "jax_rope_cache._rocm_kernel" + ("" if kernel == MAIN_KERNEL else "_" + kernel)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _probe() -> tuple[bool, str]:
    """Whether this process can compile (FlyDSL findable, an LLD, the sources): nothing is imported."""
    try:
        kernel_source_path()
    except FileNotFoundError as e:
        return False, str(e)
    if importlib.util.find_spec("flydsl") is None:
        return False, "the Python package 'flydsl' is not installed"
    problem = version_problem(flydsl_version())
    if problem:
        return False, problem
    if _find_lld() is None:
        return False, "no ld.lld found (no ROCm LLVM, no `ziglang` package, no ld.lld on PATH)"
    return True, ""


def available() -> bool:
    """True when this process can COMPILE (precompiled entries work without it)."""
    return _probe()[0]


def unavailable_reason() -> str:
    return _probe()[1]


def require() -> None:
    if not available():
        raise FlyDSLUnavailable(f"compiling the ROCm kernel needs FlyDSL ({unavailable_reason()}); install it with: "
                                f"{INSTALL_HINT}")


def version_problem(installed: str) -> str | None:
    """Why an installed FlyDSL release cannot build the kernel (None for the supported one)."""
    if installed == FLYDSL_VERSION:
        return None
    return (f"FlyDSL {installed} is installed, but the kernel is built with FlyDSL {FLYDSL_VERSION} exactly (the "
            f"compile step uses internal FlyDSL APIs that differ between releases): pip install "
            f"'flydsl=={FLYDSL_VERSION}' (a separate virtual environment works), or precompile on a machine that has "
            f"it (`python -m jax_rope_cache compile ... --bundle FILE`) and point JAX_ROPE_CACHE_ROCM_BUNDLE at the "
            "file here")


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
    """FlyDSL's environment for compiling `arch` IN THIS PROCESS (process-wide; for scripts that run
    FlyDSL themselves, e.g. tools/rocm_build_notes.py --upstream; the package compiles in the child)."""
    keys = ("ROCM_PATH", "FLYDSL_GPU_ARCH", "ARCH", "COMPILE_ONLY", "FLYDSL_RUNTIME_ENABLE_CACHE")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        os.environ["ROCM_PATH"] = toolkit_root()
        os.environ["FLYDSL_GPU_ARCH"] = arch
        os.environ["ARCH"] = arch
        os.environ["FLYDSL_RUNTIME_ENABLE_CACHE"] = "0"
        os.environ.pop("COMPILE_ONLY", None)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- the child process ----------------------------------------------------------------------------
class _Worker:
    """One FlyDSL child process (compilers/flydsl_worker.py), one request at a time."""

    def __init__(self):
        env = dict(os.environ)
        # The child imports what this process can import (flydsl may sit on a path added at run time).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.pid_owner = os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-P", worker_path()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, close_fds=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        hello = self._read(WORKER_TIMEOUT_S)
        if not hello.get("ready"):
            self.close()
            raise FlyDSLUnavailable(f"compiling the ROCm kernel needs FlyDSL, which failed to start in the compile "
                                    f"process ({hello.get('error')}); install it with: {INSTALL_HINT}"
                                    f"{self._tail(hello.get('traceback', ''))}")
        self.flydsl = hello.get("flydsl", "unknown")
        self.torch = hello.get("torch")

    def _tail(self, extra: str = "") -> str:
        try:
            self.log.seek(0)
            text = self.log.read().decode(errors="replace")
        except (OSError, ValueError):
            text = ""
        text = (text + "\n" + extra).strip()
        return f"\n--- compile process output (last lines) ---\n{text[-3000:]}" if text else ""

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                self.close()
                raise FlyDSLError(f"the FlyDSL compile process did not answer within {timeout:.0f} s "
                                  f"(JAX_ROPE_CACHE_FLYDSL_TIMEOUT){self._tail()}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                rc = self.proc.wait()
                self.close()
                raise FlyDSLError(f"the FlyDSL compile process exited (status {rc}){self._tail()}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def request(self, req: dict) -> dict:
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            self.close()
            raise FlyDSLError(f"the FlyDSL compile process is gone ({e}){self._tail()}") from None
        return self._read(WORKER_TIMEOUT_S)

    def alive(self) -> bool:
        return self.proc.poll() is None and os.getpid() == self.pid_owner

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sel.close()
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.proc.kill()
                self.proc.wait(timeout=5)


_worker: _Worker | None = None


def _get_worker() -> _Worker:
    global _worker
    if _worker is None or not _worker.alive():
        _worker = _Worker()
    return _worker


@atexit.register
def shutdown_worker() -> None:
    """Ends the compile process (it also ends by itself when this process's pipe closes)."""
    global _worker
    w, _worker = _worker, None
    if w is not None and os.getpid() == w.pid_owner:
        w.close()


def worker_pid() -> int | None:
    """The compile process's pid while one runs (for tests)."""
    return _worker.proc.pid if _worker is not None and _worker.alive() else None


def _run_compile(cfg, arch: str, isa: bool = False, hints: dict | None = None) -> dict:
    return compile_module(kernel_source_path(kernel_of(cfg)), dataclasses.asdict(cfg), arch, isa, hints,
                          what=cfg.key())


def compile_module(path: str, config: dict, arch: str, isa: bool = False, hints: dict | None = None,
                   what: str | None = None) -> dict:
    """Compiles the kernel of the FlyDSL builder module at `path` (what the compile child calls:
    RocmKernelConfig(**config), build_launcher, NUM_ARGS) for `arch`, uncached: {"code": base64
    code object, "isa": text or None, "flydsl": version}. The package's kernels go through
    compile_config; this also serves check kernels kept outside the package (tests/)."""
    require()
    req = dict(op="compile", kernel=path, config=config, arch=arch, rocm_path=toolkit_root(), isa=bool(isa),
               hints=dict(hints or {}))
    with _lock:
        w = _get_worker()
        r = w.request(req)
        version = w.flydsl
    if not r.get("ok"):
        raise FlyDSLError(f"FlyDSL failed to compile {what or path} for {arch}: {r.get('error')}\n"
                          f"{r.get('traceback', '')}")
    r["flydsl"] = version
    return r


def _compile_now(cfg, arch: str, dump_dir: str | None = None, hints: dict | None = None) -> bytes:
    """Compiles `cfg` for `arch` in the child process (no cache)."""
    del dump_dir
    return base64.b64decode(_run_compile(cfg, arch, hints=hints)["code"])


# ---- keys, bundles, disk ------------------------------------------------------------------------------
def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.cache
def _source_hash(kernel: str = MAIN_KERNEL) -> str:
    """What determines the bytes besides the config and arch: the kernel's sources and the compile
    driver (for the main kernel: sha256(sha(rope_cache_flydsl.py) + sha(flydsl_worker.py)), as
    before the MLA kernel existed, so its keys and bundles stay valid)."""
    shas = "".join(_file_sha(cache.find_source(f)) for f in KERNEL_SOURCES[kernel])
    return hashlib.sha256((shas + _file_sha(worker_path())).encode()).hexdigest()


def _key(cfg, arch: str, hints: dict | None = None) -> str:
    h = hashlib.sha256()
    parts = [KEY_TAG, _source_hash(kernel_of(cfg)), cfg.key(), arch] + ([json.dumps(hints, sort_keys=True)] if hints else [])
    for part in parts:
        h.update(part.encode() + b"\0\1")
    return h.hexdigest()


def key_for(cfg, arch: str, hints: dict | None = None) -> str:
    """The cache / bundle key of `cfg` for `arch` (computable without FlyDSL)."""
    return _key(cfg, arch, hints)


def bundle_paths() -> list[str]:
    """Bundle files consulted by lookups: $JAX_ROPE_CACHE_ROCM_BUNDLE (os.pathsep-separated files or
    folders), then every *.jrcbundle in the cache folder's rocm/."""
    out = []
    for p in os.environ.get("JAX_ROPE_CACHE_ROCM_BUNDLE", "").split(os.pathsep):
        p = p.strip()
        if not p:
            continue
        if os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(p, "*" + BUNDLE_SUFFIX)))
        elif os.path.isfile(p):
            out.append(p)
        else:
            _warn_once("bundle", p, f"rope_and_cache: the ROCm code-object bundle {p!r} "
                                          "(JAX_ROPE_CACHE_ROCM_BUNDLE) does not exist")
    d = cache.cache_dir()
    if d:
        out += sorted(glob.glob(os.path.join(d, "rocm", "*" + BUNDLE_SUFFIX)))
    return list(dict.fromkeys(out))


_bundles: dict = {}  # path -> ((mtime_ns, size), {key: (meta, code)})


def _bundle_index(path: str) -> dict:
    try:
        st = os.stat(path)
    except OSError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _bundles.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    index = {}
    try:
        with open(path, "rb") as f:
            header, payload = cache.decode(f.read())
        if header.get("kind") != BUNDLE_MAGIC_KIND:
            raise ValueError("not a jax_rope_cache ROCm bundle")
        for e in header["entries"]:
            code = payload[e["offset"]:e["offset"] + e["size"]]
            if len(code) != e["size"] or hashlib.sha256(code).hexdigest() != e["sha256"]:
                raise ValueError(f"entry {e['key'][:12]} damaged")
            index[e["key"]] = (e, code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        _warn_once("bundle", path, f"rope_and_cache: ignoring the ROCm code-object bundle {path!r} "
                                         f"({type(e).__name__}: {e})")
        index = {}
    _bundles[path] = (stamp, index)
    return index


def _bundle_read(key: str) -> CodeObject | None:
    for path in bundle_paths():
        hit = _bundle_index(path).get(key)
        if hit is not None:
            meta, code = hit
            info = amdgpu_elf.kernel_info(code)
            return CodeObject(arch=meta["arch"], code=code, symbol=info["name"], info=info, key=key, from_disk=True,
                              origin=f"bundle:{path}")
    return None


def write_bundle(path: str, objects) -> str:
    """Writes the CodeObjects `objects` as ONE bundle file (atomically); returns the path."""
    entries, blobs, offset = [], [], 0
    seen = set()
    for co in objects:
        if co.key in seen:
            continue
        seen.add(co.key)
        entries.append(dict(key=co.key, arch=co.arch, offset=offset, size=len(co.code), symbol=co.symbol,
                            sha256=hashlib.sha256(co.code).hexdigest()))
        blobs.append(co.code)
        offset += len(co.code)
    meta = dict(kind=BUNDLE_MAGIC_KIND, format=1, key_tag=KEY_TAG, source=_source_hash(), entries=entries,
                flydsl=flydsl_version())
    blob = cache.encode(b"".join(blobs), meta)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=BUNDLE_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


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
    return CodeObject(arch=meta["arch"], code=code, symbol=info["name"], info=info, key=key, from_disk=True,
                      origin="disk")


def _disk_write(co: CodeObject, cfg, version: str | None = None) -> None:
    # One file, written atomically with a checksum (jax_rope_cache.compilers.cache); an unwritable
    # folder only costs a recompilation next time (warned once).
    d = cache.cache_dir()
    meta = dict(arch=co.arch, flydsl=version or flydsl_version(), config=dataclasses.asdict(cfg))
    cache.write(os.path.join(d, "rocm") if d else None, co.key + ".hsaco.jrc", co.code, meta)


def ensure_on_disk(co: CodeObject, cfg) -> None:
    """Writes `co` to the disk cache unless its entry is there (for `compile`, whose job is to fill
    the cache even with code objects this process already held in memory or read from a bundle)."""
    d = cache.cache_dir()
    if d and not os.path.exists(os.path.join(d, "rocm", co.key + ".hsaco.jrc")):
        _disk_write(co, cfg)


def lookup(cfg, arch: str, hints: dict | None = None) -> CodeObject | None:
    """The code object of `cfg` for `arch` if one is precompiled or cached (never compiles)."""
    key = _key(cfg, arch, hints)
    co = _mem.get(key)
    if co is None:
        co = _bundle_read(key) or _disk_read(key)
        if co is not None:
            co = dataclasses.replace(co, config=cfg, hints=hints or None)
            _mem[key] = co
    return co


def compile_config(cfg, arch: str, hints: dict | None = None) -> CodeObject:
    """The code object of `cfg` for `arch` ("gfx942" / "gfx950"), compiled with FlyDSL compile
    `hints` (None: none): memory, bundles, disk, else compiled."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    co = lookup(cfg, arch, hints)
    if co is not None:
        return co
    key = _key(cfg, arch, hints)
    try:
        require()
    except FlyDSLUnavailable:
        d = cache.cache_dir()
        where = [f"the bundles {bundle_paths()}" if bundle_paths() else "no bundle (JAX_ROPE_CACHE_ROCM_BUNDLE unset)",
                 f"the cache {os.path.join(d, 'rocm')}" if d else "no disk cache (JAX_ROPE_CACHE_DIR='')"]
        raise FlyDSLUnavailable(
            f"compiling the ROCm kernel needs FlyDSL ({unavailable_reason()}), and no precompiled code object matches "
            f"this configuration for {arch} (key {key[:16]}; looked in {' and '.join(where)}); install FlyDSL with: "
            f"{INSTALL_HINT}; {PRECOMPILE_HINT}") from None
    with _lock:
        co = _mem.get(key)
        if co is not None:
            return co
        code = _compile_now(cfg, arch, hints=hints) if hints else _compile_now(cfg, arch)
        info = amdgpu_elf.kernel_info(code)
        co = CodeObject(arch=arch, code=code, symbol=info["name"], info=info, key=key, config=cfg,
                        hints=hints or None)
        _disk_write(co, cfg, _worker.flydsl if _worker is not None else None)
        _mem[key] = co
    return co


def isa(cfg, arch: str, hints: dict | None = None) -> str:
    """The final ISA text of `cfg` for `arch` (compiles again; for build notes and tests)."""
    return _run_compile(cfg, arch, isa=True, hints=hints)["isa"] or ""


def choose(candidates, archs, fits) -> list[CodeObject]:
    """The code objects (one per arch) of the first candidate (cfg, hints) whose code objects all
    satisfy `fits(info)`; if none does, those of the first candidate.

    With FlyDSL here, candidates are compiled in order (through the caches) until one fits. Without
    it, only what is precompiled is looked at: candidates whose code objects are not all there are
    skipped, and the first complete one that fits (else the first complete one) is taken. A build
    machine's bundle holds the chosen candidate only, so a deployment host picks the same one."""
    compiling = available()
    first = None
    for cfg, hints in candidates:
        if compiling:
            objs = [compile_config(cfg, a, hints) for a in archs]
        else:
            objs = [lookup(cfg, a, hints) for a in archs]
            if any(o is None for o in objs):
                continue
        if first is None:
            first = objs
        if all(fits(o.info) for o in objs):
            return objs
    if first is not None:
        return first
    cfg, hints = candidates[0]
    return [compile_config(cfg, a, hints) for a in archs]  # raises FlyDSLUnavailable, naming what is missing
