"""Independent check: the op's multimodal RoPE (M-RoPE) against Hugging Face transformers' Qwen2.5-VL
(contiguous sections) and Qwen3-VL (interleaved, with its QK-RMSNorm) at real per-shard shapes, on
positions of a text + image + text prompt (text tokens: three equal positions; image patches: one
temporal position, height and width on the patch grid).

tests/data/hf_mrope.npz holds transformers' inputs and outputs (`python tools/record_hf_mrope.py`
regenerates it where torch and transformers import); the test also re-runs transformers live when
they import (JRC_REQUIRE_TRANSFORMERS=1 makes their absence a failure).

What transformers computes: its rotary module takes position_ids [3, 1, T], computes the three
streams' cos/sin (float32) and, per rotary frequency, keeps the stream its layout assigns
(Qwen2.5-VL: `mrope_section` chunks in turn temporal, height, width; Qwen3-VL: every third frequency
from 1 below 3h height, from 2 below 3w width), duplicates them for both halves and casts to q's dtype;
then `apply_rotary_pos_emb` (rotate_half) in q's dtype.

Two comparisons per case:
  * with transformers' own table rows (its rotary module on equal positions: the 1-D rows, one per
    distinct position, as a "full" table, the positions mapped to those rows): the op chooses the
    rows per frequency by its own rule, so the assignment is checked exactly. The rotation is the
    same arithmetic (bf16 with bf16 rows: "native" rounded; f32: "fp32"): without the norm every
    element is bit-identical; with Qwen3-VL's QK-norm only the order of the sum of squares differs
    (torch's vectorised sum): every element within 4 * 2^-m * the largest |value| of its row
    (m = 7 for bf16, 23 for f32), the bound of tests/test_hf_qk_norm.py;
  * with the op's own tables (rope_tables_from_hf_config on the preset, float64 then rounded once to
    f32): the same, plus the tables' difference from transformers' float32 angles (at most
    TABLE_SLACK = 2^-11 of the row's largest |value| at these positions, below 4200).
Text tokens additionally give bit for bit the 1-D op's result on the same inputs.
"""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache.models import config as hf_config
from jax_rope_cache.models import presets
from conftest import impl_params

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_mrope.npz")
BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
MANTISSA = {BF16: 7, F32: 23}
BOUND_ULPS = 4
TABLE_SLACK = 2.0**-11
# (name, preset, tp, dtype, QK-norm)
CASES = [("qwen2.5-vl-7b-tp4-bf16", "qwen2.5-vl-7b", 4, BF16, False),
         ("qwen3-vl-8b-tp4-bf16-norm", "qwen3-vl-8b", 4, BF16, True),
         ("qwen3-vl-235b-a22b-tp8-f32", "qwen3-vl-235b-a22b", 8, F32, False),
         ("qwen3-vl-8b-tp8-f32-norm", "qwen3-vl-8b", 8, F32, True)]
CASE_IDS = [c[0] for c in CASES]
GRID = (1, 3, 4)  # an image of 3 x 4 patches (after the spatial merge), one temporal step


def prompt_positions(base: int, before: int = 5, after: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """([3, T] positions, text mask [T]) of `before` text tokens, an image of GRID patches and `after`
    text tokens, starting at `base` (as transformers' get_rope_index lays them out: the image's
    positions start after the text, each axis by its patch index; the text after it continues
    from the largest image position + 1)."""
    _, gh, gw = GRID
    text0 = base + np.arange(before)
    start = base + before
    hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    image = np.stack([np.full(gh * gw, start), start + hh.ravel(), start + ww.ravel()])
    text1 = image.max() + 1 + np.arange(after)
    pos = np.concatenate([np.broadcast_to(text0, (3, before)), image, np.broadcast_to(text1, (3, after))], axis=1)
    text = np.concatenate([np.ones(before, bool), np.zeros(gh * gw, bool), np.ones(after, bool)])
    return pos.astype(np.int64), text


def make_inputs(preset: str, tp: int, dtype, norm: bool, seed: int):
    """q, k [T, H, D] (scaled per head), norm weights [D] (around 1, both signs), positions [3, T]."""
    shape = presets.preset_shape(preset, tp)
    rng = np.random.default_rng(seed)
    pos, text = prompt_positions(base=int(rng.integers(0, 4096)))
    t, d = pos.shape[1], shape.head_dim
    q = rng.standard_normal((t, shape.q_heads, d)) * rng.uniform(0.05, 20, (1, shape.q_heads, 1))
    k = rng.standard_normal((t, shape.kv_heads, d)) * rng.uniform(0.05, 20, (1, shape.kv_heads, 1))
    qw, kw = rng.normal(1.0, 0.4, d), rng.normal(1.0, 0.4, d)
    if not norm:
        qw = kw = np.ones(d)
    return q.astype(dtype), k.astype(dtype), qw.astype(dtype), kw.astype(dtype), pos, text


def _hf():
    if os.environ.get("JRC_REQUIRE_TRANSFORMERS") == "1":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return torch


def _hf_modules(preset: str):
    """(rotary embedding, RMSNorm class, apply_rotary_pos_emb) of the preset's transformers model."""
    cfg = presets.preset_config(preset)
    rope = cfg["rope_scaling"]
    params = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"]), "mrope_section": list(rope["mrope_section"])}
    if cfg["model_type"] == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as c, modeling_qwen2_5_vl as m

        conf = c.Qwen2_5_VLTextConfig(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                                      num_key_value_heads=cfg["num_key_value_heads"],
                                      max_position_embeddings=cfg["max_position_embeddings"], rope_parameters=params)
        return m.Qwen2_5_VLRotaryEmbedding(conf), m.Qwen2_5_VLRMSNorm, m.apply_rotary_pos_emb
    from transformers.models.qwen3_vl import configuration_qwen3_vl as c, modeling_qwen3_vl as m

    params["mrope_interleaved"] = True
    conf = c.Qwen3VLTextConfig(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                               num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                               max_position_embeddings=cfg["max_position_embeddings"], rope_parameters=params)
    return m.Qwen3VLTextRotaryEmbedding(conf), m.Qwen3VLTextRMSNorm, m.apply_rotary_pos_emb


def run_hf(preset: str, q, k, qw, kw, pos, norm: bool, eps: float):
    """transformers' attention prologue: (QK-norm,) rotary module on positions [3, 1, T], then
    apply_rotary_pos_emb. Returns (q_embed, k_embed [T, H, D], uniq positions [U], cos_rows, sin_rows
    [U, D]: the module's rows for each distinct position on all three streams) as numpy."""
    torch = _hf()
    rot, rms, apply = _hf_modules(preset)
    tdt = torch.bfloat16 if q.dtype == BF16 else torch.float32
    as_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(tdt)  # noqa: E731 (exact widening)
    d = q.shape[-1]
    with torch.no_grad():
        qs, ks = as_torch(q)[None], as_torch(k)[None]  # [1, T, H, D]
        if norm:
            q_norm, k_norm = rms(d, eps=eps), rms(d, eps=eps)
            q_norm.weight.data, k_norm.weight.data = as_torch(qw), as_torch(kw)
            qs, ks = q_norm(qs), k_norm(ks)
        qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)  # [1, H, T, D]
        cos, sin = rot(qs, torch.from_numpy(pos)[:, None, :])
        qe, ke = apply(qs, ks, cos, sin)
        uniq = np.unique(pos)
        ucos, usin = rot(qs, torch.from_numpy(np.broadcast_to(uniq, (3, len(uniq))).copy())[:, None, :])
    back = lambda t: t.float().numpy().astype(q.dtype)  # noqa: E731 (exact: bf16/f32 values)
    return back(qe[0].transpose(0, 1)), back(ke[0].transpose(0, 1)), uniq, back(ucos[0]), back(usin[0])


def _bits(a):
    return a.view(np.uint16) if a.dtype == BF16 else a.view(np.uint32)


def record_hf() -> dict:
    """Runs transformers on every case and writes FIXTURE."""
    import torch
    import transformers

    out = {"transformers_version": np.asarray(transformers.__version__), "torch_version": np.asarray(torch.__version__)}
    for i, (name, preset, tp, dt, norm) in enumerate(CASES):
        q, k, qw, kw, pos, text = make_inputs(preset, tp, dt, norm, seed=i)
        eps = float(presets.preset_config(preset)["rms_norm_eps"])
        qe, ke, uniq, ucos, usin = run_hf(preset, q, k, qw, kw, pos, norm, eps)
        for key, a in dict(q=q, k=k, qw=qw, kw=kw, q_embed=qe, k_embed=ke, cos_rows=ucos, sin_rows=usin).items():
            out[f"{name}/{key}"] = _bits(a)
        out[f"{name}/pos"], out[f"{name}/text"], out[f"{name}/uniq"] = pos, text, uniq
        out[f"{name}/eps"] = np.asarray(eps)
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    np.savez_compressed(FIXTURE, **out)
    return out


def _load(name, dt):
    data = np.load(FIXTURE)
    get = lambda key: data[f"{name}/{key}"].view(dt)  # noqa: E731
    arrays = {key: get(key) for key in ("q", "k", "qw", "kw", "q_embed", "k_embed", "cos_rows", "sin_rows")}
    return arrays, data[f"{name}/pos"], data[f"{name}/text"], data[f"{name}/uniq"], float(data[f"{name}/eps"])


def ours(a, pos, cos, sin, preset, norm, eps, platform="cpu", impl=None, mrope=True):
    """The op on the recorded inputs with the given table (row = what `pos` indexes); caches are a
    small flash cache the tokens are written to (checked elsewhere)."""
    info = hf_config.rope_tables_from_hf_config(presets.preset_config(preset), max_pos=8)[2]
    t, kh, d = a["k"].shape
    dt = a["q"].dtype
    kc, vc = (np.zeros((2, 16, kh, d), dt) for _ in range(2))
    opts = dict(info.op_options()) if mrope else dict(rotary_dim=info.rotary_dim, is_neox=info.is_neox)
    opts["table_form"] = "full"  # transformers' rows, and our tables built with form="full"
    if norm:
        opts.update(q_norm_weight=a["qw"], k_norm_weight=a["kw"], norm_eps=eps)
    opts["precision"] = "native" if dt == BF16 and cos.dtype == BF16 else "fp32"
    dev = jax.devices(platform)[0]
    fn = jax.jit(lambda *x: jrc.rope_and_cache(*x, impl=impl, **opts))
    args = (a["q"], a["k"], a["k"], kc, vc, np.arange(t, dtype=np.int32), pos.astype(np.int32), cos, sin)
    q_out, k_out, *_ = fn(*jax.device_put(args, dev))
    return np.asarray(q_out), np.asarray(k_out)


def check_bound(got, want, dt, slack=0.0, what=""):
    """|got - want| <= (BOUND_ULPS * 2^-m + slack) * max|row| per (token, head) row."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = np.abs(w).max(axis=-1, keepdims=True)
    err = np.abs(g - w)
    bound = (BOUND_ULPS * 2.0**-MANTISSA[dt] + slack) * scale
    assert (err <= bound).all(), f"{what}: max {float((err / np.maximum(scale, 1e-30)).max()):.3g} of the row's max"
    return err


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("name,preset,tp,dt,norm", CASES, ids=CASE_IDS)
def test_matches_transformers_with_its_rows(name, preset, tp, dt, norm, platform, impl):
    a, pos, text, uniq, eps = _load(name, dt)
    rows = np.searchsorted(uniq, pos)  # positions -> rows of transformers' own table
    q_out, k_out = ours(a, rows, a["cos_rows"], a["sin_rows"], preset, norm, eps, platform, impl)
    for got, want, what in ((q_out, a["q_embed"], "q"), (k_out, a["k_embed"], "k")):
        if norm:
            check_bound(got, want, dt, what=what)
        elif impl == "kernel" or dt == BF16:
            np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)
        else:  # the XLA path in f32: its documented FMA bound (2 f32 ulps of the row's largest input)
            check_bound(got, want, dt, what=what)
    # the image tokens' streams differ, so a one-stream rotation would not match
    assert not (pos[1] == pos[0]).all() and not (pos[2] == pos[0]).all()


@pytest.mark.parametrize("name,preset,tp,dt,norm", CASES, ids=CASE_IDS)
def test_matches_transformers_with_our_tables(name, preset, tp, dt, norm):
    a, pos, _, _, eps = _load(name, dt)
    cos, sin, info = hf_config.rope_tables_from_hf_config(presets.preset_config(preset), max_pos=int(pos.max()) + 1,
                                                          form="full")
    assert info.mrope_section == tuple(presets.preset_config(preset)["rope_scaling"]["mrope_section"])
    q_out, k_out = ours(a, pos, cos, sin, preset, norm, eps)
    check_bound(q_out, a["q_embed"], dt, TABLE_SLACK, "q")
    check_bound(k_out, a["k_embed"], dt, TABLE_SLACK, "k")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("name,preset,tp,dt,norm", CASES[:2], ids=CASE_IDS[:2])
def test_text_tokens_are_1d_rope_bit_for_bit(name, preset, tp, dt, norm, platform, impl):
    a, pos, text, uniq, eps = _load(name, dt)
    rows = np.searchsorted(uniq, pos)
    m_q, m_k = ours(a, rows, a["cos_rows"], a["sin_rows"], preset, norm, eps, platform, impl)
    p_q, p_k = ours(a, rows[0], a["cos_rows"], a["sin_rows"], preset, norm, eps, platform, impl, mrope=False)
    np.testing.assert_array_equal(_bits(m_q[text]), _bits(p_q[text]))
    np.testing.assert_array_equal(_bits(m_k[text]), _bits(p_k[text]))
    assert not np.array_equal(_bits(m_q[~text]), _bits(p_q[~text]))  # image tokens differ


@pytest.mark.parametrize("name,preset,tp,dt,norm", CASES, ids=CASE_IDS)
def test_fixture_is_what_transformers_computes_now(name, preset, tp, dt, norm):
    _hf()
    a, pos, _, uniq, eps = _load(name, dt)
    qe, ke, u, ucos, usin = run_hf(preset, a["q"], a["k"], a["qw"], a["kw"], pos, norm, eps)
    np.testing.assert_array_equal(u, uniq)
    for got, key in ((qe, "q_embed"), (ke, "k_embed"), (ucos, "cos_rows"), (usin, "sin_rows")):
        np.testing.assert_array_equal(_bits(got), _bits(a[key]), err_msg=f"{key}: transformers changed; re-record")


def test_fixture_inputs_are_the_seeded_ones():
    for i, (name, preset, tp, dt, norm) in enumerate(CASES):
        a, pos, text, _, _ = _load(name, dt)
        q, k, qw, kw, p, tx = make_inputs(preset, tp, dt, norm, seed=i)
        np.testing.assert_array_equal(_bits(q), _bits(a["q"]))
        np.testing.assert_array_equal(p, pos)
        np.testing.assert_array_equal(tx, text)
