"""The on-disk cache of compiled code objects (jax_rope_cache.compilers.cache, used by compilers.nvrtc and compilers.flydsl):
atomic writes under a multi-process race, corrupt or truncated entries rebuilt with a warning, and
unwritable or missing folders falling back to memory with a warning.

NVRTC compiles without a GPU, so the CUDA path runs for real here; the ROCm path (FlyDSL, usually not
installed) runs with its compiler step replaced by a stub, which exercises the same cache code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import multiprocessing as mp
import os
import warnings

import pytest

from jax_rope_cache.compilers import cache as diskcache
from jax_rope_cache.compilers import flydsl, nvrtc

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")

SOURCE = 'extern "C" __global__ void jrc_probe(float* x) { x[threadIdx.x] = VALUE * threadIdx.x; }\n'


def _compile(value: int = 2):
    return nvrtc.compile_cuda(SOURCE, arch="compute_90", options=[f"-DVALUE={value}"], name="probe.cu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder and empty memory caches."""
    d = tmp_path / "cache"
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(d))
    monkeypatch.setattr(nvrtc, "_mem_cache", {})
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setattr(diskcache, "_warned", set())
    return d


def _entries(d):
    return sorted(p for p in d.iterdir() if p.is_file()) if d.exists() else []


@contextlib.contextmanager
def _no_cache_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", diskcache.CacheWarning)
        yield


# ---- format ----------------------------------------------------------------------------------------
def test_encode_decode_and_every_kind_of_damage():
    blob = diskcache.encode(b"\x7fELF" + bytes(range(256)) * 4, dict(arch="sm_90"))
    meta, payload = diskcache.decode(blob)
    assert meta["arch"] == "sm_90" and payload.startswith(b"\x7fELF") and len(payload) == 1028
    damaged = {
        "empty": b"",
        "magic": b"XXXXXXXX\n" + blob[9:],
        "truncated-in-header": blob[:20],
        "truncated-payload": blob[:-1],
        "extra-byte": blob + b"\0",
        "flipped-payload-bit": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:],
        "header-garbage": blob[:17] + b"{" * 10 + blob[27:],
    }
    for what, bad in damaged.items():
        with pytest.raises(ValueError):
            diskcache.decode(bad)
        assert what  # every kind was detected


# ---- NVRTC (real compiles) -------------------------------------------------------------------------
@needs_nvrtc
def test_roundtrip_one_file_per_entry(cache):
    with _no_cache_warnings():
        a = _compile()
    files = _entries(cache)
    assert [p.name for p in files] == [a.key + ".cubin.jrc"] and not a.from_disk
    nvrtc._mem_cache.clear()
    b = _compile()
    assert b.from_disk and b.code == a.code and b.arch == a.arch


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_entry_is_detected_rebuilt_and_rewritten(cache, damage):
    a = _compile()
    (path,) = _entries(cache)
    blob = path.read_bytes()
    path.write_bytes({"truncate": blob[: len(blob) // 2], "flip": blob[:-5] + bytes([blob[-5] ^ 0x40]) + blob[-4:],
                      "garbage": os.urandom(len(blob)), "empty": b""}[damage])
    nvrtc._mem_cache.clear()
    with pytest.warns(diskcache.CacheWarning, match="corrupt code-object cache entry"):
        b = _compile()
    assert not b.from_disk and b.code == a.code  # compiled again, same result
    meta, payload = diskcache.decode(path.read_bytes())  # and the entry is whole again
    assert payload == a.code
    nvrtc._mem_cache.clear()
    with _no_cache_warnings():
        assert _compile().from_disk


@needs_nvrtc
def test_unwritable_folder_falls_back_to_memory(cache, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(diskcache.tempfile, "mkstemp", refuse)  # what a read-only mount does
    with pytest.warns(diskcache.CacheWarning, match="cannot write to the code-object cache .*Read-only"):
        a = _compile()
    assert not _entries(cache)
    with _no_cache_warnings():  # one warning per folder, then the memory cache serves
        assert _compile() is a
        b = _compile(3)  # another key: compiles, still no warning
    assert b.code != a.code


@needs_nvrtc
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_falls_back_to_memory(cache):
    cache.mkdir()
    cache.chmod(0o555)
    try:
        with pytest.warns(diskcache.CacheWarning, match="cannot write"):
            a = _compile()
        assert a.code and not _entries(cache)
    finally:
        cache.chmod(0o755)


@needs_nvrtc
def test_missing_folder_is_created(cache):
    deep = cache / "a" / "b"
    os.environ["JAX_ROPE_CACHE_DIR"] = str(deep)
    with _no_cache_warnings():
        a = _compile()
    assert [p.name for p in _entries(deep)] == [a.key + ".cubin.jrc"]


@needs_nvrtc
def test_folder_that_cannot_exist_falls_back_to_memory(cache):
    cache.parent.joinpath("a_file").write_text("not a folder")
    os.environ["JAX_ROPE_CACHE_DIR"] = str(cache.parent / "a_file" / "cache")
    with pytest.warns(diskcache.CacheWarning, match="cannot write"):
        a = _compile()
    assert a.code
    with _no_cache_warnings():
        assert _compile() is a


@needs_nvrtc
def test_empty_setting_disables_the_disk(cache, monkeypatch):
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", "")
    with _no_cache_warnings():
        a = _compile()
    assert not a.from_disk and not cache.exists()


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(diskcache, "_warned", set())

    def crash(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diskcache.os, "replace", crash)
    with pytest.warns(diskcache.CacheWarning, match="No space"):
        assert not diskcache.write(str(tmp_path), "k.jrc", b"payload", {})
    assert list(tmp_path.iterdir()) == []  # neither the entry nor a half-written temporary


def _race_worker(folder, barrier, queue, values):
    os.environ["JAX_ROPE_CACHE_DIR"] = folder
    import hashlib
    import warnings as w

    from jax_rope_cache.compilers import nvrtc as nv

    out = []
    try:
        with w.catch_warnings():
            w.simplefilter("error")
            for value in values:
                barrier.wait(timeout=120)  # every process starts each compile at the same moment
                nv._mem_cache.clear()
                c = nv.compile_cuda(SOURCE, arch="compute_90", options=[f"-DVALUE={value}"], name="probe.cu")
                out.append((value, c.key, hashlib.sha256(c.code).hexdigest()))
        queue.put(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


@needs_nvrtc
def test_processes_compiling_the_same_keys_at_once(cache):
    """4 processes compile the same 6 keys in lock step: every compile succeeds, every process gets
    the same code, and each key ends as one intact file (no temporaries left)."""
    ctx = mp.get_context("spawn")
    nproc, values = 4, list(range(10, 16))
    barrier, queue = ctx.Barrier(nproc), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(cache), barrier, queue, values)) for _ in range(nproc)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(status == "ok" for status, _ in results), results
    per_process = [r for _, r in results]
    assert all(r == per_process[0] for r in per_process), "processes disagree on the compiled code"
    files = _entries(cache)
    assert sorted(p.name for p in files) == sorted(k + ".cubin.jrc" for _, k, _ in per_process[0])
    import hashlib
    want = {k: h for _, k, h in per_process[0]}
    for p in files:
        _, payload = diskcache.decode(p.read_bytes())
        assert hashlib.sha256(payload).hexdigest() == want[p.name.split(".")[0]]
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


# ---- FlyDSL (compiler stubbed: the cache code is the same) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Cfg:
    d: int = 64

    def key(self) -> str:
        return f"cfg-{self.d}"


@pytest.fixture
def fake_flydsl(cache, monkeypatch):
    compiles = []

    def compile_now(cfg, arch, dump_dir=None):
        compiles.append((cfg, arch))
        return b"\x7fELF-fake-" + arch.encode() + bytes(cfg.d)

    monkeypatch.setattr(flydsl, "require", lambda: None)
    monkeypatch.setattr(flydsl, "_compile_now", compile_now)
    monkeypatch.setattr(flydsl, "_source_hash", lambda *kernel: "test-source")
    monkeypatch.setattr(flydsl, "flydsl_version", lambda: "0.0-test")
    monkeypatch.setattr(flydsl.amdgpu_elf, "kernel_info", lambda code: {"name": "jrc_rope_cache_0"})
    return compiles


def test_flydsl_roundtrip_corruption_and_fallback(cache, fake_flydsl, monkeypatch):
    with _no_cache_warnings():
        a = flydsl.compile_config(_Cfg(), "gfx942")
    (path,) = _entries(cache / "rocm")
    assert path.name == a.key + ".hsaco.jrc" and len(fake_flydsl) == 1
    flydsl._mem.clear()
    b = flydsl.compile_config(_Cfg(), "gfx942")
    assert b.from_disk and b.code == a.code and len(fake_flydsl) == 1
    # truncated: detected, rebuilt, rewritten
    path.write_bytes(path.read_bytes()[:-3])
    flydsl._mem.clear()
    with pytest.warns(diskcache.CacheWarning, match="corrupt"):
        c = flydsl.compile_config(_Cfg(), "gfx942")
    assert not c.from_disk and c.code == a.code and len(fake_flydsl) == 2
    assert diskcache.decode(path.read_bytes())[1] == a.code
    # unwritable: memory only, one warning
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(cache / "rocm" / path.name / "sub"))  # under a file
    with pytest.warns(diskcache.CacheWarning, match="cannot write"):
        d = flydsl.compile_config(_Cfg(96), "gfx950")
    with _no_cache_warnings():
        assert flydsl.compile_config(_Cfg(96), "gfx950") is d
