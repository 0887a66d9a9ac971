"""Independent check: the op's fused QK-RMSNorm + RoPE against Hugging Face transformers'
Qwen3 (`Qwen3RMSNorm` on q and k per head, then `apply_rotary_pos_emb`) at real Qwen3 shapes.

tests/data/hf_qk_norm.npz holds transformers' inputs and outputs (`python tools/record_hf_qk_norm.py`
regenerates it); the test also re-runs transformers live when torch and transformers import
(JRC_REQUIRE_TRANSFORMERS=1 makes their absence a failure). Our side gets transformers' own cos/sin
rows (a "full" table, one row per token), so only the norm can differ:
  * the rotation is the same arithmetic: bfloat16 inputs with transformers' bfloat16 tables are our
    "native" rounded arithmetic (each product rounded, then the sum), float32 is "fp32";
  * the norm differs in one place, the order of the sum of squares (torch reduces with its own
    vectorised order; we use the pairwise tree of jax_rope_cache.reference). That moves S by a few
    float32 ulps, so 1 / sqrt(mean + eps) by about one, and the rounded y = r(x * inv) by at most
    one ulp of the dtype where x * inv lies next to a rounding boundary (bf16: rare), or, in
    float32, by the relative error of inv on every element (a few ulps); the weight product and
    the rotation carry that over. Bound: every element within 4 units of 2^-m times the largest
    magnitude in its row (|ours - hf| <= 4 * 2^-m * max|row|, m = 7 for bf16, 23 for float32).
    Measured on this fixture (reference, XLA path and CPU kernel alike): bf16 1 q element of
    16,384 differs (0.37 units), float32 17.6% of q elements (at most 2.16 units); k equal.
"""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import reference
from jax_rope_cache.models import presets as models
from conftest import impl_params

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_qk_norm.npz")
BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
MANTISSA = {BF16: 7, F32: 23}
T = 8
# (name, preset, tp, dtype): Qwen3-32B TP8 (8/1/128) and Qwen3-235B-A22B TP4 (16/1/128)
CASES = [("qwen3-32b-tp8-bf16", "qwen3-32b", 8, BF16), ("qwen3-235b-a22b-tp4-bf16", "qwen3-235b-a22b", 4, BF16),
         ("qwen3-32b-tp8-f32", "qwen3-32b", 8, F32)]
BOUND_ULPS = 4


def _hf():
    if os.environ.get("JRC_REQUIRE_TRANSFORMERS") == "1":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig
    from transformers.models.qwen3 import modeling_qwen3
    return torch, AutoConfig, modeling_qwen3


def make_inputs(preset: str, tp: int, dtype, seed: int):
    """Random projections q, k [T, H, D] (scaled per head, as real ones vary), norm weights [D]
    around 1 with both signs present, positions up to max_position_embeddings."""
    shape = models.preset_shape(preset, tp)
    cfg = models.preset_config(preset)
    rng = np.random.default_rng(seed)
    d = shape.head_dim
    q = rng.standard_normal((T, shape.q_heads, d)) * rng.uniform(0.05, 20, (1, shape.q_heads, 1))
    k = rng.standard_normal((T, shape.kv_heads, d)) * rng.uniform(0.05, 20, (1, shape.kv_heads, 1))
    qw, kw = rng.normal(1.0, 0.4, d), rng.normal(1.0, 0.4, d)
    pos = rng.integers(0, cfg["max_position_embeddings"], T)
    return (q.astype(dtype), k.astype(dtype), qw.astype(dtype), kw.astype(dtype), pos.astype(np.int64),
            float(cfg["rms_norm_eps"]))


def run_hf(preset: str, q, k, qw, kw, pos, eps):
    """transformers' Qwen3 attention prologue: q_norm / k_norm per head, then apply_rotary_pos_emb
    with the model's rotary embedding; returns (q_embed, k_embed [T, H, D], cos, sin [T, D]) as numpy."""
    torch, AutoConfig, mq = _hf()
    cfg = models.preset_config(preset)
    config = AutoConfig.for_model("qwen3", **{k_: v for k_, v in cfg.items() if k_ != "model_type"})
    tdt = torch.bfloat16 if q.dtype == BF16 else torch.float32
    as_torch = lambda a: torch.from_numpy(a.astype(np.float32)).to(tdt)  # noqa: E731 (exact widening)
    d = q.shape[-1]
    with torch.no_grad():
        q_norm, k_norm = mq.Qwen3RMSNorm(d, eps=eps), mq.Qwen3RMSNorm(d, eps=eps)
        q_norm.weight.data = as_torch(qw)
        k_norm.weight.data = as_torch(kw)
        qs = q_norm(as_torch(q)[None]).transpose(1, 2)  # [1, H, T, D]
        ks = k_norm(as_torch(k)[None]).transpose(1, 2)
        rot = mq.Qwen3RotaryEmbedding(config)
        cos, sin = rot(qs, torch.from_numpy(pos)[None])
        qe, ke = mq.apply_rotary_pos_emb(qs, ks, cos, sin)
    back = lambda t: t.float().numpy().astype(q.dtype)  # noqa: E731 (exact: bf16/f32 values)
    return back(qe[0].transpose(0, 1)), back(ke[0].transpose(0, 1)), back(cos[0]), back(sin[0])


def _bits(a):
    return a.view(np.uint16) if a.dtype == BF16 else a.view(np.uint32)


def record_hf() -> dict:
    """Runs transformers on every case and writes FIXTURE."""
    import transformers

    out = {"transformers_version": np.asarray(transformers.__version__)}
    for i, (name, preset, tp, dt) in enumerate(CASES):
        q, k, qw, kw, pos, eps = make_inputs(preset, tp, dt, seed=i)
        qe, ke, cos, sin = run_hf(preset, q, k, qw, kw, pos, eps)
        for key, a in dict(q=q, k=k, qw=qw, kw=kw, q_embed=qe, k_embed=ke, cos=cos, sin=sin).items():
            out[f"{name}/{key}"] = _bits(a)
        out[f"{name}/pos"], out[f"{name}/eps"] = pos, np.asarray(eps)
    np.savez_compressed(FIXTURE, **out)
    return out


def _load(name, dt):
    data = np.load(FIXTURE)
    get = lambda key: data[f"{name}/{key}"].view(dt)  # noqa: E731
    return ({key: get(key) for key in ("q", "k", "qw", "kw", "q_embed", "k_embed", "cos", "sin")},
            data[f"{name}/pos"], float(data[f"{name}/eps"]))


def ours(a, eps, platform="cpu", impl=None):
    """The op on transformers' inputs, with transformers' cos/sin rows as a full table (row t = token t)."""
    q, k = a["q"], a["k"]
    t, kh, d = k.shape
    kc, vc = (np.zeros(s, q.dtype) for s in jrc.cache_shapes("flash", 1, 16, kh, d, q.dtype))
    args = (q, k, k, kc, vc, np.full(t, -1, np.int32), np.arange(t, dtype=np.int32), a["cos"], a["sin"])
    opts = dict(precision="native" if q.dtype == BF16 else "fp32", q_norm_weight=a["qw"], k_norm_weight=a["kw"],
                norm_eps=eps, table_form="full")
    if impl is None:
        return reference.rope_and_cache(*args, **opts)[:2]
    dev = jax.devices(platform)[0]
    out = jrc.rope_and_cache(*jax.device_put(args, dev), **{**opts, "q_norm_weight": jax.device_put(a["qw"], dev),
                                                             "k_norm_weight": jax.device_put(a["kw"], dev)}, impl=impl)
    return [np.asarray(o) for o in out[:2]]


def excess(got, want) -> float:
    """max |got - want| over the bound's unit (2^-m * the row's largest |want|): <= BOUND_ULPS passes."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    unit = 2.0 ** -MANTISSA[want.dtype] * np.abs(w).max(axis=-1, keepdims=True)
    return float((np.abs(g - w) / unit).max())


IMPLS = [("reference", None, None)] + [(f"{p.values[0]}-{p.values[1]}", p.values[0], p.values[1])
                                       for p in impl_params()]


@pytest.mark.parametrize("name,preset,tp,dt", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("which,platform,impl", IMPLS, ids=[i[0] for i in IMPLS])
def test_matches_recorded_transformers(name, preset, tp, dt, which, platform, impl):
    a, pos, eps = _load(name, dt)
    q_out, k_out = ours(a, eps, platform, impl)
    for label, got, want in (("q", q_out, a["q_embed"]), ("k", k_out, a["k_embed"])):
        e = excess(got, want)
        assert e <= BOUND_ULPS, f"{name} {which} {label}: {e:.2f} ulps of the row maximum"
    # the bound is not vacuous: without the norm (or with the weights swapped) it is far off
    a2 = dict(a, qw=a["kw"], kw=a["qw"])
    assert excess(ours(a2, eps)[0], a["q_embed"]) > 20 * BOUND_ULPS


def test_fixture_inputs_are_the_seeded_ones():
    for i, (name, preset, tp, dt) in enumerate(CASES):
        a, pos, eps = _load(name, dt)
        q, k, qw, kw, pos2, eps2 = make_inputs(preset, tp, dt, seed=i)
        for key, v in dict(q=q, k=k, qw=qw, kw=kw).items():
            assert np.array_equal(_bits(v), _bits(a[key])), (name, key)
        assert np.array_equal(pos, pos2) and eps == eps2 == 1e-6


@pytest.mark.parametrize("name,preset,tp,dt", CASES, ids=[c[0] for c in CASES])
def test_live_transformers(name, preset, tp, dt):
    """transformers now (when importable) on the same inputs: within the bound of our op, and its
    cos/sin rows are the recorded ones."""
    i = [c[0] for c in CASES].index(name)
    q, k, qw, kw, pos, eps = make_inputs(preset, tp, dt, seed=i)
    qe, ke, cos, sin = run_hf(preset, q, k, qw, kw, pos, eps)
    a, _, _ = _load(name, dt)
    assert np.array_equal(_bits(cos), _bits(a["cos"])) and np.array_equal(_bits(sin), _bits(a["sin"]))
    live = dict(a, q_embed=qe, k_embed=ke)
    q_out, k_out = ours(live, eps)
    assert excess(q_out, qe) <= BOUND_ULPS and excess(k_out, ke) <= BOUND_ULPS
