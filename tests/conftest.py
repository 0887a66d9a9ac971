"""Shared test helpers: which (platform, impl) pairs exist here, random problems, bitwise checks.

Tests never assume the platform: they ask jax which backends exist and parametrise over them, so
the same files run on CPU (CI), on CUDA and on ROCm hosts.
"""

from __future__ import annotations

import dataclasses
import os

# Eight host devices for the tensor-parallel tests; must be set before jax starts its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

from jax_rope_cache import gpu_env  # noqa: E402

gpu_env.capture_plugin_errors()  # before jax loads its backends: a GPU plugin's load error is only logged

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_rope_cache import backends, contract, reference  # noqa: E402
from jax_rope_cache.backends import native  # noqa: E402

FULL_SWEEP = os.environ.get("JRC_FULL_SWEEP") == "1"

# Test tiers (./scripts/run_tests.sh sets JRC_TEST_TIER; plain pytest runs the default tier). The
# default tier runs every test function not marked `full`; of the compile and emulation matrices
# below it runs every k-th case of each parametrized function (the first always); the full tier runs
# all of them. A test named by its node id (file::test[case]) always runs.
TIER = os.environ.get("JRC_TEST_TIER", "default")
MATRIX_SAMPLE = {"test_rocm_compile.py": 8, "test_cuda_compile.py": 4, "test_rocm_emulated.py": 3,
                 "test_qk_norm.py": 2, "test_rope_tables.py": 2}


def tier_sample(seq, step: int = 4) -> list:
    """A matrix that one test walks: every step-th entry in the default tier, all in the full tier."""
    seq = list(seq)
    return seq if TIER == "full" else seq[::step]

# A suite that silently lost its native kernel would pass on the XLA path alone.
if native.native_module() is None and os.environ.get("JRC_ALLOW_NO_NATIVE") != "1":
    raise RuntimeError("jax_rope_cache._native did not import: run the tests against the installed package "
                       "(scripts/run_tests.sh), or set JRC_ALLOW_NO_NATIVE=1 to test the XLA path alone")



def _gpu_kernels_missing() -> list[str]:
    """GPU platforms jax has here whose native kernel cannot be built (the suite would run their
    numerics on the XLA path only, and pass)."""
    out = []
    for name in ("cuda", "rocm"):
        try:
            present = bool(jax.devices(name))
        except RuntimeError:
            present = False
        problem = backends.KERNEL_BACKENDS[name].missing() if present else None
        if present and problem is None and name == "rocm":
            from jax_rope_cache.backends import rocm

            try:
                rocm.lowering_archs()  # the devices' gfx archs: one without a kernel (gfx90a, gfx1100...)
            except rocm.UnsupportedArch as e:
                problem = f"a gfx942 or gfx950 GPU ({e})"
        if problem is not None:
            out.append(f"{name}: needs {problem}")
    return out


# A run asked for a GPU (JRC_JAX_EXTRA=rocm* / cuda*, as scripts/run_tests.sh installs it) must not
# pass on the CPU because jax's GPU plugin failed to load (jax logs that and carries on).
if (_asked := gpu_env.asked_platform()) and (_why := gpu_env.missing_backend_message(_asked)):
    raise RuntimeError(_why)


# On a GPU host, a kernel that cannot be built must fail the run, not shrink it.
if (_missing := _gpu_kernels_missing()) and os.environ.get("JRC_ALLOW_NO_GPU_KERNEL") != "1":
    raise RuntimeError("jax has a GPU backend here but its jax_rope_cache kernel cannot be built ("
                       + "; ".join(_missing) + "); install what is missing, or set JRC_ALLOW_NO_GPU_KERNEL=1 to test "
                       "the XLA path alone on it")


def pytest_collection_modifyitems(config, items):
    if TIER == "full" or any("::" in str(a) for a in config.args):
        return
    keep, drop, seen = [], [], {}
    for item in items:
        step = MATRIX_SAMPLE.get(item.path.name)
        if item.get_closest_marker("full") is not None:
            drop.append(item)
        elif step and hasattr(item, "callspec"):
            key = (item.path.name, item.originalname)
            n = seen[key] = seen.get(key, -1) + 1
            (keep if n % step == 0 else drop).append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """The library warns once per process and message; each test sees its own first warning."""
    from jax_rope_cache import primitive

    primitive._warned.clear()
    yield


def child_env(*, path=(), drop=(), **set_vars) -> dict[str, str]:
    """The environment of a child Python process (sys.executable) that must import the jax_rope_cache
    this process imported: os.environ without the variables in `drop`, with `set_vars`, and
    PYTHONPATH = `path`, then the folder holding this process's package (unless it is a site folder,
    which the child finds by itself; a checkout imported through PYTHONPATH, the current folder or
    an installation's own path otherwise would be lost: the children run with -P), then the
    inherited PYTHONPATH (a cluster's jax and its plugins may be there)."""
    import site

    import jax_rope_cache

    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(set_vars)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_rope_cache.__file__)))
    site_dirs = {os.path.realpath(d) for d in site.getsitepackages() + [site.getusersitepackages()]}
    entries = [str(p) for p in path]
    if os.path.realpath(pkg_parent) not in site_dirs:
        entries.append(pkg_parent)
    entries += [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e not in entries]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    return env


def platforms() -> list[str]:
    found = []
    for name in ("cpu", "cuda", "rocm"):
        try:
            if jax.devices(name):
                found.append(name)
        except RuntimeError:
            pass
    return found


def impl_params() -> list:
    """(platform, impl) pairs: the XLA path everywhere, the native kernel where one exists."""
    out = []
    for p in platforms():
        out.append(pytest.param(p, "xla", id=f"{p}-xla"))
        if p in backends.kernel_platforms():
            out.append(pytest.param(p, "kernel", id=f"{p}-kernel"))
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    T: int = 7
    QH: int = 8
    KH: int = 2
    D: int = 128
    R: int | None = None
    BS: int = 16
    NB: int = 6
    layout: str = "flash"
    is_neox: bool = True
    table: str = "half"
    dtype: str = "bfloat16"
    table_dtype: str = "float32"
    cache_dtype: str | None = None  # None: same as dtype
    index_dtype: str = "int32"
    precision: str = "fp32"
    max_pos: int = 64
    X: int | None = None  # X of an x-packed layout (None: 16 // cache itemsize)

    @property
    def id(self) -> str:
        return (f"T{self.T}-h{self.QH}x{self.KH}-D{self.D}-R{self.R or self.D}-BS{self.BS}-{self.layout}-"
                f"{'neox' if self.is_neox else 'gptj'}-{self.table}-{self.dtype}-{self.table_dtype}-"
                f"{self.cache_dtype or 'same'}-{self.index_dtype}-{self.precision}"
                + (f"-X{self.X}" if self.X is not None else ""))


def num_blocks(case: Case) -> int:
    """The blocks of make_problem's caches: case.NB, or more to leave room for T unique valid slots."""
    return max(case.NB, -(-2 * case.T // case.BS))


def make_problem(case: Case, seed: int):
    """Fresh random inputs: caches pre-filled with random values, slots a random permutation with
    -1, >= NB*BS and huge values mixed in, positions partly out of range."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(getattr(ml_dtypes, case.dtype, None) or case.dtype)
    cdt = dt if case.cache_dtype is None else np.dtype(getattr(ml_dtypes, case.cache_dtype))
    tdt = np.dtype(getattr(ml_dtypes, case.table_dtype, None) or case.table_dtype)
    idt = np.dtype(case.index_dtype)
    r = case.R or case.D
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = (normal(case.T, h, case.D).astype(dt) for h in (case.QH, case.KH, case.KH))
    nb = num_blocks(case)
    kshape, vshape = contract.cache_shapes(case.layout, nb, case.BS, case.KH, case.D, cdt, case.X)
    kc = normal(*kshape).astype(cdt)
    vc = None if vshape is None else normal(*vshape).astype(cdt)  # a merged layout: K and V in kc
    nslots = nb * case.BS
    slots = rng.permutation(nslots)[: case.T].astype(np.int64)
    if case.T < nslots:  # invalid slots must not hide valid ones that are still free
        bad = [-1, nslots, -(2**31), 2**31 - 1] + ([2**40, -(2**62)] if idt == np.int64 else [])
        for i in range(0, case.T, 3):
            slots[i] = bad[(i // 3) % len(bad)]
    pos = rng.integers(0, case.max_pos, case.T)
    pos[1::4] = rng.integers(case.max_pos, 10 * case.max_pos + 5, len(pos[1::4]))
    pos[2::5] = -rng.integers(1, 1000, len(pos[2::5]))
    ang = rng.uniform(-np.pi, np.pi, (case.max_pos, r if case.table == "full" else r // 2))
    cos, sin = np.cos(ang).astype(tdt), np.sin(ang).astype(tdt)
    fp8 = cdt in contract.FP8_DTYPES
    scales = dict(k_scale=np.float32(rng.uniform(0.05, 0.5)), v_scale=np.float32(rng.uniform(0.05, 0.5))) if fp8 else {}
    args = (q, k, v, kc, vc, slots.astype(idt), pos.astype(idt), cos, sin)
    opts = dict(layout=case.layout, is_neox=case.is_neox, rotary_dim=case.R, precision=case.precision,
                table_form=case.table, **scales)
    return args, opts


def make_spec(*, T=64, QH=4, KH=2, D=128, R=None, layout="flash", neox=True, dt=np.dtype(ml_dtypes.bfloat16),
              cdt=None, tdt=np.dtype(np.float32), full=False, prec="fp32", BS=16, NB=24, max_pos=64, slot64=False,
              pos64=True, layers=None, X=None) -> contract.OpSpec:
    """The OpSpec of a call with these shapes (no arrays): for compile-only tests of the kernels.
    `layers`: stacked caches [layers, NB, ...] (the spec of a call with a traced layer); `X`: X of
    an x-packed layout (None: the default)."""
    r = R or D
    cdt = np.dtype(cdt or dt)
    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, NB, BS, KH, D, cdt, X)
    if layers is not None:
        kc, vc = (layers,) + tuple(kc), None if vc is None else (layers,) + tuple(vc)
    w = r if full else r // 2
    fp8 = cdt in contract.FP8_DTYPES
    idx = lambda b: np.int64 if b else np.int32  # noqa: E731
    return contract.check_op(s((T, QH, D), dt), s((T, KH, D), dt), s((T, KH, D), dt), s(kc, cdt),
                          None if vc is None else s(vc, cdt),
                          s((T,), idx(slot64)), s((T,), idx(pos64)), s((max_pos, w), tdt), s((max_pos, w), tdt),
                          layout=layout, is_neox=neox, rotary_dim=r, k_scale=1.0 if fp8 else None,
                          v_scale=1.0 if fp8 else None, precision=prec,
                          layer=None if layers is None else np.zeros((), np.int32),
                          table_form="full" if full else "half")


def to_host(outs) -> list:
    """The op's outputs as numpy arrays; None stays None (a merged layout's absent value cache)."""
    return [None if o is None else np.asarray(o) for o in outs]


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """Maps float bit patterns to integers whose difference counts ulps (sign-magnitude -> two's)."""
    a = np.asarray(a)
    nbits = a.dtype.itemsize * 8
    u = a.view({8: np.uint8, 16: np.uint16, 32: np.uint32}[nbits]).astype(np.int64)
    sign = 1 << (nbits - 1)
    return np.where(u & sign, -(u & (sign - 1)), u)


def ulp_diff(a, b) -> np.ndarray:
    if a is None and b is None:  # a merged layout's absent value cache
        return np.zeros((), np.int64)
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return np.abs(ordered_bits(a) - ordered_bits(b))


def assert_bits_equal(got, want, what: str):
    if got is None or want is None:  # a merged layout's absent value cache: None on both sides
        assert got is None and want is None, (what, type(got), type(want))
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    d = ulp_diff(got, want)
    bad = np.argwhere(d != 0)
    assert len(bad) == 0, f"{what}: {len(bad)} of {d.size} elements differ, first at {tuple(bad[0])}, max {d.max()} ulp"


def assert_within_ulp(got, want, what: str, ulps: int = 1):
    d = ulp_diff(got, want)
    assert d.max(initial=0) <= ulps, f"{what}: max {d.max()} ulp > {ulps} ({int((d > ulps).sum())} elements)"


def assert_fma_close(got, want, bound, what: str, ulps_allowed: int = 1):
    """Each element within `ulps_allowed` ulps of the output dtype, or within `bound` (broadcastable)
    in absolute terms: an FMA moves a difference of two products by up to one f32 ulp of the larger
    product, which under cancellation is many ulps of the (small) result in any dtype."""
    if got is None or want is None:
        assert got is None and want is None, (what, type(got), type(want))
        return
    got, want = np.asarray(got), np.asarray(want)
    ulps = ulp_diff(got, want)
    g, w = got.astype(np.float64), want.astype(np.float64)
    # equal infinities (0 ulps apart) have no difference: NaN, as IEEE subtraction gives, without its warning
    same_inf = np.isinf(g) & (g == w)
    err = np.abs(np.subtract(g, w, out=np.full(g.shape, np.nan), where=~same_inf))
    ok = (ulps <= ulps_allowed) | (err <= bound)
    assert ok.all(), (f"{what}: {int((~ok).sum())} elements beyond {ulps_allowed} ulp and the FMA bound, "
                      f"max {ulps.max()} ulp")


def flydsl_kernel_module():
    """The FlyDSL kernel builder (importable without flydsl): the installed source, else the repo's."""
    from jax_rope_cache.compilers import flydsl

    try:
        return flydsl.kernel_module()
    except FileNotFoundError:
        return flydsl.kernel_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels",
                                                 "rocm", "rope_cache_flydsl.py"))


def xla_bound(name, args, opts):
    """The XLA path's FMA tolerance per output: 2 f32 ulps of the largest input the element came
    from (tables are bounded by 1); caches of fp8 scaled by 1/k_scale."""
    eps = 2.0**-22
    if name == "q_out":
        return eps * np.abs(args[0].astype(np.float32)).max(axis=-1, keepdims=True)
    if name == "k_out":
        return eps * np.abs(args[1].astype(np.float32)).max(axis=-1, keepdims=True)
    inv = 1.0 / float(opts.get("k_scale", 1.0))
    return eps * inv * float(np.abs(args[1].astype(np.float32)).max(initial=0))


reference_op = reference.rope_and_cache


# ---- special values (NaN with payloads and signs, infinities, zeros, subnormals, extremes) ----------
_NAN_BITS = {  # quiet, negative with a payload, signalling: none of them the canonical pattern
    np.dtype(ml_dtypes.bfloat16): (0x7FC0, 0xFFC1, 0x7F81),
    np.dtype(np.float16): (0x7E00, 0xFE01, 0x7C01),
    np.dtype(np.float32): (0x7FC00000, 0xFFC00001, 0x7F800001),
}
_UINT_OF = {2: np.uint16, 4: np.uint32}


def special_values(dtype, extremes: bool = True) -> np.ndarray:
    """Values of `dtype` covering every class: three non-canonical NaNs, +-inf, +-0, the smallest
    subnormal and normal, ordinary values, and (extremes) +-max, whose products overflow."""
    dtype = np.dtype(dtype)
    fi = ml_dtypes.finfo(dtype)
    nans = np.array(_NAN_BITS[dtype], _UINT_OF[dtype.itemsize]).view(dtype)
    vals = [np.inf, -np.inf, 0.0, -0.0, float(fi.smallest_subnormal), -float(fi.smallest_normal), 1.0, -1.5, 0.7]
    if extremes:
        vals += [float(fi.max), -float(fi.max)]
    return np.concatenate([nans, np.array(vals, np.float64).astype(dtype)])


def special_problem(dtype, table_dtype, cache_dtype=None, precision="native", extremes=True, seed=0):
    """A call whose rotary pairs take every combination of special values in x, its partner, cos
    and sin: token t uses table row t = (cos, sin) combination t, head h holds (x_a, x_b)
    combination h in channels 0, 1 (NeoX and GPT-J pair them alike at R = 2), and channels 2, 3
    carry specials through unrotated. v = k. Returns (args, opts) as make_problem does."""
    dt, tdt = np.dtype(dtype), np.dtype(table_dtype)
    cdt = dt if cache_dtype is None else np.dtype(cache_dtype)
    xs, ts = special_values(dt, extremes), special_values(tdt, extremes)
    n, m = len(xs), len(ts)
    xa, xb = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    ca, sa = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    T, H = m * m, n * n
    q = np.empty((T, H, 4), dt)
    q[:, :, 0], q[:, :, 1] = xs[xa.ravel()][None, :], xs[xb.ravel()][None, :]
    rng = np.random.default_rng(seed)
    q[:, :, 2:] = xs[rng.integers(0, n, (T, H, 2))]
    k = q[:, ::-1].copy()  # other (x_a, x_b) combinations per token than q's heads
    cos, sin = ts[ca.ravel()][:, None], ts[sa.ravel()][:, None]
    bs = 16
    nb = -(-T // bs)
    kshape, vshape = contract.cache_shapes("flash", nb, bs, H, 4, cdt)
    kc = rng.standard_normal(kshape).astype(np.float32).astype(cdt)
    vc = rng.standard_normal(vshape).astype(np.float32).astype(cdt)
    slots = rng.permutation(nb * bs)[:T].astype(np.int32)
    pos = np.arange(T, dtype=np.int32)
    opts = dict(layout="flash", is_neox=True, rotary_dim=2, precision=precision)
    if cdt in contract.FP8_DTYPES:
        opts.update(k_scale=np.float32(0.37), v_scale=np.float32(1.9))
    return (q, k, k.copy(), kc, vc, slots, pos, cos, sin), opts


def canonical_nan_violations(a) -> int:
    """How many NaNs of `a` are not the canonical pattern (reference.CANONICAL_NAN)."""
    a = np.asarray(a)
    nan = np.isnan(a.astype(np.float32))
    bits = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    return int((bits[nan] != reference.CANONICAL_NAN[a.dtype]).sum())
