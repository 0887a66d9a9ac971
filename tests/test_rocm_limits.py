"""The FlyDSL kernels' 32-bit buffer limits, on the CPU (no GPU, no allocation of the large buffers).

A buffer access adds a 32-bit offset to its descriptor's base and checks it against a 32-bit
num_records: a cos/sin table of 4 GiB or more would make a row's offset wrap onto another row
(kernels/rocm/rope_cache_flydsl.py, "32-bit limits"). So:

1. Lowering for "rocm" with abstract shapes (jax.ShapeDtypeStruct, nothing allocated): a table just
   below 4 GiB lowers to the kernel; one of 4 GiB or more is refused at lowering: impl="kernel"
   raises a ValueError naming cos/sin, the table's bytes, the 4 GiB limit and ROCm; impl=None
   warns once and lowers the XLA path. Both ops (rope_and_cache, mla_rope_and_cache).
2. The lane emulator with a stand-in table of 4 GiB - 1 row (rows made on demand): the kernels read
   its last rows bit-exact to the reference. At exactly 4 GiB the last row's access is partly past
   num_records (the emulator stops), and past it a row's offset wraps onto another row: what the
   refusal prevents.
3. The per-workgroup descriptors (q, k, v, outputs, indices): span_problem's limit, the refusal and
   the occupancy candidates it drops; an access partly in range stops the emulator.
"""

from __future__ import annotations

import dataclasses
import re
import types
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, flydsl_kernel_module, make_problem, reference_op
from mla_cases import MlaCase, make_mla_problem
from test_rocm_arch import _embedded_archs, fake_compiler  # noqa: F401 (fake_compiler: a fixture)
import jax_rope_cache as jrc
from jax_rope_cache import contract
from jax_rope_cache.backends import native, rocm
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import reference as mla_reference
from jax_rope_cache.mla import rocm_kernel

K = flydsl_kernel_module()
KM = rocm_kernel.kernel_module()
GIB4 = 1 << 32
BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
S = jax.ShapeDtypeStruct


def test_the_limit_is_4_gib_in_both_kernels():
    assert K.TABLE_BYTES_LIMIT == KM.TABLE_BYTES_LIMIT == GIB4
    assert K.OOB_OFFSET == KM.OOB_OFFSET == 0x7FFFFFF0


# ---- 1. lowering ---------------------------------------------------------------------------------
def _main_args(rows, width, tdt, T=4, QH=4, KH=1, D=128):
    return (S((T, QH, D), BF16), S((T, KH, D), BF16), S((T, KH, D), BF16), S((8, 16, KH, D), BF16),
            S((8, 16, KH, D), BF16), S((T,), jnp.int32), S((T,), jnp.int32), S((rows, width), tdt),
            S((rows, width), tdt))


def _lower_main(impl, rows, width, tdt, calls=1):
    def step(q, k, v, kc, vc, slots, pos, cos, sin):
        outs = []
        for i in range(calls):
            q_out, _, kc, vc = jrc.rope_and_cache(q + i, k, v, kc, vc, slots, pos, cos, sin, impl=impl,
                                                  table_form=_form(width))
            outs.append(q_out)
        return outs, kc, vc

    jitted = jax.jit(step, donate_argnums=(3, 4))
    return jitted.trace(*_main_args(rows, width, tdt)).lower(lowering_platforms=("rocm",)).as_text()


def _form(width, d=128):
    return "full" if width == d else "half"


# (table width, dtype): f32 "full" R = 128 (512-byte rows), bf16 "half" R = 128 (128-byte rows)
MAIN_TABLES = [(128, F32), (64, BF16)]


@pytest.mark.parametrize("width,tdt", MAIN_TABLES, ids=["f32-full", "bf16-half"])
def test_a_table_just_below_4_gib_lowers_to_the_kernel(fake_compiler, width, tdt):  # noqa: F811
    rows = GIB4 // (width * tdt.itemsize) - 1
    spec = contract.check_op(*_main_args(rows, width, tdt), table_form=_form(width))
    assert rocm.table_bytes(spec) == GIB4 - width * tdt.itemsize
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _embedded_archs(_lower_main("kernel", rows, width, tdt)) == ["gfx942", "gfx950"]
        assert _embedded_archs(_lower_main(None, rows, width, tdt)) == ["gfx942", "gfx950"]


@pytest.mark.parametrize("extra_rows", [0, 1, 1 << 20])
@pytest.mark.parametrize("width,tdt", MAIN_TABLES, ids=["f32-full", "bf16-half"])
def test_a_table_of_4_gib_or_more_is_refused_at_lowering(fake_compiler, width, tdt, extra_rows):  # noqa: F811
    rows = GIB4 // (width * tdt.itemsize) + extra_rows
    nbytes = rows * width * tdt.itemsize
    with pytest.raises(ValueError) as e:
        _lower_main("kernel", rows, width, tdt)
    msg = str(e.value)
    assert msg.startswith("rope_and_cache: impl='kernel' on ROCm: cos/sin: expected tables of less than 4 GiB"), msg
    assert f"got [{rows}, {width}] {tdt.name} = {nbytes} bytes each" in msg and "4294967296 bytes" in msg, msg
    assert "use impl=None" in msg
    assert not fake_compiler  # refused before anything was compiled
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        text = _lower_main(None, rows, width, tdt, calls=2)
    assert _embedded_archs(text) is None  # the XLA path
    mine = [str(x.message) for x in w if "cos/sin" in str(x.message)]
    assert len(mine) == 1, mine  # one warning for the two calls
    assert re.search(r"falling back to the XLA implementation on ROCm: it needs buffers its 32-bit offsets can "
                     rf"address \(cos/sin: .*{nbytes} bytes each\)", mine[0]), mine[0]


def _mla_args(rows, width, tdt):
    args, opts = make_mla_problem(MlaCase(T=4, QH=4, Dn=128, Dc=128, Dr=64, layout="split"), seed=1)
    avals = [jax.tree.map(lambda a: S(np.shape(a), np.asarray(a).dtype), a) for a in args]
    avals[7] = avals[8] = S((rows, width), tdt)
    return avals, dict(opts, table_form=_form(width, 64))


def _lower_mla(impl, rows, width, tdt):
    avals, opts = _mla_args(rows, width, tdt)
    return jax.jit(lambda *a: jrc.mla_rope_and_cache(*a, **opts, impl=impl)).trace(*avals).lower(
        lowering_platforms=("rocm",)).as_text()


def test_mla_tables_refused_from_4_gib(fake_compiler):  # noqa: F811
    width = 64  # Dr = 64, "full" f32 table: 256-byte rows
    below, at = GIB4 // 256 - 1, GIB4 // 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _embedded_archs(_lower_mla("kernel", below, width, F32)) == ["gfx942", "gfx950"]
    with pytest.raises(ValueError, match=rf"^mla_rope_and_cache: impl='kernel' on ROCm: cos/sin: expected tables of "
                                         rf"less than 4 GiB .*got \[{at}, 64\] float32 = {GIB4} bytes each"):
        _lower_mla("kernel", at, width, F32)
    with pytest.warns(RuntimeWarning, match=r"mla_rope_and_cache: falling back to the XLA implementation on ROCm.*cos/sin"):
        assert _embedded_archs(_lower_mla(None, at, width, F32)) is None


# ---- 2. the lane emulator with a stand-in table --------------------------------------------------
def _angles(r: int, width: int) -> np.ndarray:
    return np.float64(r) * 1e-3 + np.arange(width) * 0.37  # distinct for every row


def _stand_ins(rows, width, dtype):
    row = lambda fn: lambda r: fn(_angles(r, width)).astype(dtype)  # noqa: E731
    return rocm_emulator.RowTable((rows, width), dtype, row(np.cos)), rocm_emulator.RowTable((rows, width), dtype,
                                                                                            row(np.sin))


def _compact(pos, rows, width, dtype):
    """The rows the clamped positions read, as a small table, and the positions into it (the
    reference's view of the stand-in table)."""
    clamped = np.clip(pos.astype(np.int64), 0, rows - 1)
    used, idx = np.unique(clamped, return_inverse=True)
    cos = np.stack([np.cos(_angles(int(r), width)) for r in used]).astype(dtype)
    sin = np.stack([np.sin(_angles(int(r), width)) for r in used]).astype(dtype)
    return cos, sin, idx.astype(pos.dtype), set(int(r) for r in used)


def _main_emulated(rows, positions, regime):
    case = Case(T=len(positions), QH=2, KH=1, D=128, table="full", dtype="bfloat16", table_dtype="float32")
    args, opts = make_problem(case, seed=3)
    pos = np.asarray(positions, np.int32)
    cos_t, sin_t = _stand_ins(rows, 128, F32)
    ops = rocm_emulator.custom_call_operands(list(args[:6]) + [pos] + list(args[7:]), opts)
    ops[7], ops[8] = cos_t, sin_t
    spec = contract.check_op(*args, **opts)
    cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.latency == (regime == "latency")
    got = rocm_emulator.run(K, cfg, ops)
    cos, sin, idx, used = _compact(pos, rows, 128, F32)
    want = reference_op(*args[:6], idx, cos, sin, **opts)
    return got, want, used, cos_t.rows_read | sin_t.rows_read


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
def test_emulated_kernel_reads_the_last_rows_of_a_table_just_below_4_gib(regime):
    rows = GIB4 // 512 - 1  # f32 "full" rows of R = 128: 512 bytes; the table is 4 GiB - 512 bytes
    got, want, used, read = _main_emulated(rows, [rows - 1, rows - 2, 0, 2**31 - 1, -5, 4096], regime)
    assert used == {rows - 1, rows - 2, 0, 4096} and read >= used
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, name)


def test_emulated_kernel_at_and_past_4_gib_reads_the_wrong_row():
    """What the refusal at lowering prevents: at exactly 4 GiB the last row's last access is cut by
    the 32-bit num_records (partly in range: the emulator stops); past it, the row of position
    2**23 + 5 wraps onto row 5."""
    rows = GIB4 // 512
    with pytest.raises(AssertionError, match="partly in range"):
        _main_emulated(rows, [rows - 1, 3], "latency")
    got, want, used, read = _main_emulated(rows + 64, [rows + 5, 3], "latency")
    assert rows + 5 not in read and 5 in read
    assert not np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16))


def test_emulated_mla_kernel_reads_the_last_rows_of_a_table_just_below_4_gib():
    from test_rocm_mla import operands

    rows = GIB4 // 256 - 1  # Dr = 64, f32 "full": 256-byte rows
    case = MlaCase(T=4, QH=2, Dn=32, Dc=64, Dr=64, full=True, layout="combined")
    args, opts = make_mla_problem(case, seed=5)
    pos = np.array([rows - 1, 7, rows + 100, rows - 2], np.int32)
    args = args[:6] + (pos,) + args[7:]
    spec, ops, results = operands(args, opts)
    names = mla_contract.operands(spec.layout)
    cos_t, sin_t = _stand_ins(rows, 64, F32)
    ops[names.index("cos")], ops[names.index("sin")] = cos_t, sin_t
    cfg = rocm_kernel.kernel_config(spec, KM)
    got = rocm_emulator.launch(KM, cfg, ops, results, {r: a for a, r in mla_contract.cache_aliases(spec.layout).items()},
                               grid=-(-spec.num_tokens // cfg.tpb), grid_y=cfg.parts)
    cos, sin, idx, used = _compact(pos, rows, 64, F32)
    assert used == {rows - 1, rows - 2, 7} and (cos_t.rows_read >= used)
    want = mla_reference.mla_rope_and_cache(*args[:6], idx, cos, sin, **opts)
    from mla_cases import flat_outputs

    for name, g, w in zip(("q_out", "k_pe_out", "cache"), got, flat_outputs(want)):
        assert_bits_equal(g, w, name)


# ---- 3. the per-workgroup descriptors -------------------------------------------------------------
def test_span_problem_is_the_workgroup_rows_against_the_out_of_range_offset():
    cfg = rocm.kernel_config(contract.kernel_codes(contract.check_op(*_main_args(64, 64, F32))), K)  # bandwidth
    row = cfg.qh * cfg.d * 2  # q / q_out rows, bf16
    assert K.span_problem(cfg) is None
    fits = dataclasses.replace(cfg, tpb=K.OOB_OFFSET // row)
    assert K.span_problem(fits) is None
    over = dataclasses.replace(cfg, tpb=K.OOB_OFFSET // row + 1)
    assert K.span_problem(over) == (f"q_out: {over.tpb} token row(s) of {row} bytes per workgroup "
                                    f"({over.tpb * row} bytes), more than the 2147483632 bytes one 32-bit buffer "
                                    "descriptor addresses")
    qkv = dataclasses.replace(over, qkv=True)  # the fused rows are the widest
    assert K.span_problem(qkv).startswith("q / k / v (fused QKV):")
    mla = rocm_kernel.kernel_config(mla_contract.kernel_codes(mla_contract.check_mla(*_mla_args(64, 32, F32)[0],
                                                                                     **_mla_args(64, 32, F32)[1])), KM)
    assert KM.span_problem(mla) is None
    assert KM.span_problem(dataclasses.replace(mla, tpb=1 << 30)).startswith("q_out: ")


def test_a_workgroup_span_over_the_limit_is_refused_and_its_candidates_dropped():
    spec = contract.check_op(*_main_args(64, 64, F32))
    cfg = rocm.kernel_config(spec, K)
    rocm.refuse_buffer_limits(spec, cfg, K)  # fits: nothing raised
    over = dataclasses.replace(cfg, tpb=K.OOB_OFFSET)
    with pytest.raises(native.KernelUnavailable) as e:
        rocm.refuse_buffer_limits(spec, over, K)
    assert isinstance(e.value.__cause__, ValueError)
    assert str(e.value.__cause__).startswith("rope_and_cache: impl='kernel' on ROCm: q_out: ")
    # a latency configuration's bandwidth fallbacks hold more token rows: one over the limit is dropped
    wide = types.SimpleNamespace(**{n: getattr(K, n) for n in dir(K) if not n.startswith("__")})
    wide.span_problem = lambda c: "too wide" if c.tpb > 1 else None
    cands = rocm.occupancy_candidates(cfg, wide)
    assert cfg.latency and cands[0] == (cfg, None) and all(c.tpb == 1 for c, _ in cands)
    assert any(c.tpb > 1 for c, _ in rocm.occupancy_candidates(cfg, K))


def test_an_access_partly_in_range_stops_the_emulator(monkeypatch):
    """Descriptors 2 bytes short of their rows: the last row's 16-byte accesses straddle
    num_records, which the emulator refuses to model (it zeroed the whole access before)."""
    args, opts = make_problem(Case(T=3, QH=2, KH=1, D=64), seed=2)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    rocm_emulator.run(K, cfg, rocm_emulator.custom_call_operands(args, opts))  # as built: fine
    original = K._Emitter.rsrc
    monkeypatch.setattr(K._Emitter, "rsrc", lambda self, addr, n: original(self, addr, self.sub(n, self.i64c(2))))
    with pytest.raises(AssertionError, match="partly in range"):
        rocm_emulator.run(K, cfg, rocm_emulator.custom_call_operands(args, opts))
