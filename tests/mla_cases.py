"""Random MLA problems shared by the MLA tests (fresh random data, caches pre-filled with random
values, hostile slots and positions)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.mla import contract as mla_contract

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
E5 = np.dtype(ml_dtypes.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class MlaCase:
    T: int = 7
    QH: int = 4
    Dn: int = 32
    Dc: int = 64
    Dr: int = 16
    BS: int = 8
    NB: int = 6
    layout: str = "combined"
    is_neox: bool = False
    full: bool = False
    dtype: np.dtype = BF16
    table_dtype: np.dtype = F32
    cache_dtype: np.dtype | None = None  # None: dtype
    q_out_dtype: np.dtype | None = None
    index_dtype: str = "int32"
    precision: str = "fp32"
    max_pos: int = 64
    layers: int | None = None

    @property
    def id(self) -> str:
        cdt = (self.cache_dtype or self.dtype).name
        qdt = (self.q_out_dtype or self.dtype).name
        return (f"T{self.T}-h{self.QH}-n{self.Dn}c{self.Dc}r{self.Dr}-{self.layout}-{'neox' if self.is_neox else 'gptj'}-"
                f"{'full' if self.full else 'half'}-{self.dtype.name}-tab{self.table_dtype.name}-c{cdt}-q{qdt}-"
                f"{self.index_dtype}-{self.precision}" + (f"-L{self.layers}" if self.layers else ""))


def make_mla_problem(case: MlaCase, seed: int, layer=None):
    """(args, opts) for mla_rope_and_cache and its reference."""
    rng = np.random.default_rng(seed)
    dt = case.dtype
    cdt = case.cache_dtype or dt
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q_nope = normal(case.T, case.QH, case.Dn).astype(dt)
    q_pe = normal(case.T, case.QH, case.Dr).astype(dt)
    kv_c = (normal(case.T, case.Dc) * (40.0 if cdt in contract.FP8_DTYPES else 1.0)).astype(dt)  # fp8: some saturate
    k_pe = normal(case.T, case.Dr).astype(dt)
    nb = max(case.NB, -(-2 * case.T // case.BS))
    shapes = mla_contract.mla_cache_shapes(case.layout, nb, case.BS, case.Dc, case.Dr)
    if case.layers:
        shapes = tuple((case.layers,) + s for s in shapes)
    caches = tuple(normal(*s).astype(cdt) for s in shapes)
    nslots = nb * case.BS
    idt = np.dtype(case.index_dtype)
    slots = rng.permutation(nslots)[: case.T].astype(np.int64)
    bad = [-1, nslots, -(2**31), 2**31 - 1] + ([2**40, -(2**62)] if idt == np.int64 else [])
    for i in range(0, case.T, 3):
        slots[i] = bad[(i // 3) % len(bad)]
    pos = rng.integers(0, case.max_pos, case.T)
    pos[1::4] = rng.integers(case.max_pos, 10 * case.max_pos + 5, len(pos[1::4]))
    pos[2::5] = -rng.integers(1, 1000, len(pos[2::5]))
    ang = rng.uniform(-np.pi, np.pi, (case.max_pos, case.Dr if case.full else case.Dr // 2))
    cos, sin = np.cos(ang).astype(case.table_dtype), np.sin(ang).astype(case.table_dtype)
    kv_cache = caches[0] if case.layout == "combined" else caches
    args = (q_nope, q_pe, kv_c, k_pe, kv_cache, slots.astype(idt), pos.astype(idt), cos, sin)
    opts = dict(layout=case.layout, is_neox=case.is_neox, precision=case.precision,
                table_form="full" if case.full else "half")
    if cdt in contract.FP8_DTYPES:
        opts["kv_scale"] = np.float32(rng.uniform(0.05, 0.5))
    if case.q_out_dtype is not None:
        opts["q_out_dtype"] = case.q_out_dtype
        if case.q_out_dtype in contract.FP8_DTYPES:
            opts["q_scale"] = np.float32(rng.uniform(0.05, 0.5))
    if case.layers:
        opts["layer"] = layer if layer is not None else case.layers - 1
    return args, opts


def flat_outputs(out) -> list:
    """(q_out, k_pe_out, kv_cache) -> [q_out, k_pe_out, cache...] as numpy arrays."""
    q, k, c = out
    caches = c if isinstance(c, (tuple, list)) else (c,)
    return [np.asarray(q), np.asarray(k)] + [np.asarray(x) for x in caches]


# A covering set of cases for the default tier: every layout, dtype, cache dtype, q_out dtype,
# rotation style, table form, precision and index width at least once.
CASES = [
    MlaCase(),
    MlaCase(layout="split", is_neox=True, full=True, dtype=F16, table_dtype=F16, precision="native"),
    MlaCase(dtype=F32, table_dtype=BF16, cache_dtype=FN, q_out_dtype=FN, index_dtype="int64"),
    MlaCase(layout="split", dtype=BF16, table_dtype=BF16, cache_dtype=FNUZ, q_out_dtype=FNUZ, precision="native"),
    MlaCase(dtype=BF16, table_dtype=F32, cache_dtype=FN, precision="native", full=True),  # "fused": wide fp8
    MlaCase(T=5, QH=2, Dn=24, Dc=40, Dr=12, BS=4, is_neox=True, dtype=F16, table_dtype=F32, q_out_dtype=FN,
            precision="native", layers=3),
    MlaCase(T=9, QH=16, Dn=512, Dc=512, Dr=64, BS=16, NB=4),  # DeepSeek-V3 TP8 (absorbed q)
    # float8_e5m2 (vLLM's fp8_e5m2): "fused" wide fp8 in both outputs, stacked
    MlaCase(T=6, layout="split", is_neox=True, dtype=BF16, table_dtype=F32, cache_dtype=E5, q_out_dtype=E5,
            precision="native", layers=2),
]
# More float8_e5m2 for the full tier: the combined layout beside an e4m3 q_out, fp32, int64
E5M2_FULL_CASES = [
    MlaCase(dtype=F16, table_dtype=F16, cache_dtype=E5, q_out_dtype=FN, index_dtype="int64", full=True),
    MlaCase(T=9, QH=16, Dn=512, Dc=512, Dr=64, BS=16, NB=4, dtype=BF16, table_dtype=BF16, cache_dtype=E5,
            precision="native"),  # DeepSeek-V3 TP8, "rounded" arithmetic
]
