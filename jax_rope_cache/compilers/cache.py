"""What both kernel compilers share: where the kernel sources are, and the on-disk cache of compiled
code objects (NVRTC for CUDA, FlyDSL for ROCm).

`cache_dir()`: $JAX_ROPE_CACHE_DIR, or ~/.cache/jax_rope_cache when unset; "" disables the disk
cache (None). `find_source(rel)`: a file under kernels/, installed with the package or in a checkout.

One entry is one file, `<dir>/<key><suffix>`:

    b"JRCDISK1\\n"  magic
    uint64 LE       length of the JSON header
    JSON header     {"sha256": hex of the payload, "size": payload length, ...caller metadata}
    payload         the code object

* Writes are atomic: the entry is written to a temporary file in the same folder and renamed over
  the final name (os.replace), so a reader sees no file or a whole file. Two processes compiling
  the same key both succeed; the last rename wins and either version is complete.
* Reads check the magic, the header and the payload's length and sha256. A truncated or corrupt
  entry is reported with a RuntimeWarning, removed, and the caller compiles again (and rewrites).
* Only a regular file (a symlink to one is followed) of at most MAX_ENTRY bytes is read, opened
  non-blocking: a FIFO, a device (/dev/zero), a socket or a directory in an entry's place, an
  oversized file, a header nested too deeply for the JSON parser, or one without the keys the
  caller needs (`required`) is a corrupt entry like any other (warning, removed, rebuilt).
* A cache folder that cannot be created, read or written (read-only, a file in the way, a full
  disk) gives one RuntimeWarning per folder; the code objects then live in memory only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import tempfile
import threading
import warnings

MAGIC = b"JRCDISK1\n"
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jax_rope_cache
_HEADER_LEN = struct.Struct("<Q")
_MAX_HEADER = 1 << 24
MAX_ENTRY = 1 << 28  # 256 MiB: far above any code object (a few MiB at most)

_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


class CacheWarning(RuntimeWarning):
    """A problem with the on-disk code-object cache (the op still works: it compiles again)."""


def _warn_once(kind: str, where: str, message: str) -> None:
    with _warn_lock:
        if (kind, where) in _warned:
            return
        _warned.add((kind, where))
    warnings.warn(message, CacheWarning, stacklevel=3)


def cache_dir() -> str | None:
    """The code-object cache folder, or None when JAX_ROPE_CACHE_DIR is "" (disk cache off)."""
    d = os.environ.get("JAX_ROPE_CACHE_DIR")
    if d is None:
        d = os.path.join(os.path.expanduser("~"), ".cache", "jax_rope_cache")
    return d or None


def find_source(rel: str) -> str:
    """Path of kernels/<rel>: shipped inside the package (installed) or beside it (a checkout)."""
    for base in (os.path.join(_PKG_DIR, "kernels"), os.path.join(os.path.dirname(_PKG_DIR), "kernels")):
        p = os.path.join(base, rel)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"rope_and_cache: kernel source kernels/{rel} is not installed with jax_rope_cache "
                            f"(looked under {_PKG_DIR}/kernels); reinstall the package")


def encode(payload: bytes, meta: dict) -> bytes:
    header = dict(meta, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
    h = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _HEADER_LEN.pack(len(h)) + h + payload


def decode(blob: bytes, required: dict | None = None) -> tuple[dict, bytes]:
    """(header, payload) of an entry; ValueError saying what is wrong when it is not intact.
    `required` maps header keys the caller reads to their type: a missing or mistyped one is damage."""
    if not blob.startswith(MAGIC):
        raise ValueError("bad magic (not a cache entry, or a different format version)")
    at = len(MAGIC)
    if len(blob) < at + _HEADER_LEN.size:
        raise ValueError("truncated header")
    (n,) = _HEADER_LEN.unpack_from(blob, at)
    at += _HEADER_LEN.size
    if n > _MAX_HEADER or len(blob) < at + n:
        raise ValueError("truncated header")
    try:
        header = json.loads(blob[at: at + n])
    except RecursionError:
        raise ValueError("unreadable header (nested too deeply)") from None
    except ValueError as e:
        raise ValueError(f"unreadable header ({e})") from None
    if not isinstance(header, dict) or "sha256" not in header or "size" not in header:
        raise ValueError("header without checksum")
    if not isinstance(header["sha256"], str) or not isinstance(header["size"], int) or isinstance(header["size"], bool):
        raise ValueError("header with a checksum or size of the wrong type")
    payload = blob[at + n:]
    if len(payload) != header["size"]:
        raise ValueError(f"payload of {len(payload)} bytes, expected {header['size']} (truncated?)")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise ValueError("payload checksum mismatch")
    for key, kind in (required or {}).items():
        if key not in header:
            raise ValueError(f"header without {key!r}")
        if not isinstance(header[key], kind):
            raise ValueError(f"header {key!r} is a {type(header[key]).__name__}, expected a {kind.__name__}")
    return header, payload


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str, limit: int = MAX_ENTRY) -> bytes:
    """The bytes of `path` when it is a regular file (a symlink to one is followed) of at most
    `limit` bytes; ValueError saying what it is otherwise. Never blocks on a FIFO or reads an
    endless device; OSError when it cannot be opened."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{_file_kind(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise ValueError(f"{st.st_size} bytes, more than an entry may hold ({limit})")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)  # what was opened (the path may have been swapped since the stat)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{_file_kind(st.st_mode)}, not a regular file")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ValueError(f"more than an entry may hold ({limit} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def discard(folder: str, name: str, why: str) -> None:
    """Reports entry `name` of `folder` as corrupt (CacheWarning) and removes it."""
    path = os.path.join(folder, name)
    warnings.warn(f"rope_and_cache: corrupt code-object cache entry {path!r} ({why}); removing it and "
                  "compiling again", CacheWarning, stacklevel=3)
    with contextlib.suppress(OSError):
        os.unlink(path)


def read(folder: str | None, name: str, required: dict | None = None) -> tuple[dict, bytes] | None:
    """The intact entry `name` of `folder`, or None (absent, unreadable or corrupt: then warned).
    `required`: header keys (-> type) the caller reads; an entry without them is corrupt."""
    if not folder:
        return None
    path = os.path.join(folder, name)
    try:
        blob = read_regular(path)
    except (FileNotFoundError, NotADirectoryError):  # absent (a folder that cannot exist warns on write)
        return None
    except ValueError as e:
        discard(folder, name, str(e))
        return None
    except OSError as e:
        _warn_once("read", folder, f"rope_and_cache: cannot read the code-object cache {folder!r} "
                                   f"({type(e).__name__}: {e}); compiling again, keeping results in memory")
        return None
    try:
        return decode(blob, required)
    except ValueError as e:
        discard(folder, name, str(e))
        return None


def write(folder: str | None, name: str, payload: bytes, meta: dict) -> bool:
    """Writes entry `name` atomically; False (after one warning per folder) where it cannot."""
    if not folder:
        return False
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + name)
        with os.fdopen(fd, "wb") as f:
            f.write(encode(payload, meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, name))
        tmp = None
        return True
    except OSError as e:
        _warn_once("write", folder, f"rope_and_cache: cannot write to the code-object cache {folder!r} "
                                    f"({type(e).__name__}: {e}); compiled code objects stay in memory only "
                                    "(set JAX_ROPE_CACHE_DIR to a writable folder, or to '' to silence this)")
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
