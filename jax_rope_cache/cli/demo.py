"""The op alone in an inference loop: one prefill and a jitted decode loop of a model preset,
with ONE stacked [L, ...] cache per K and V updated in place by `lax.scan` over the layers
(unrolled by default, so a GPU step is straight-line code XLA can capture in one graph); the
final caches are checked against the numpy reference and the kernel is timed against the XLA path.

The inputs of layer l at step s are a pool entry scaled by a power of two (exact in bf16), so the
reference can rebuild them; slots never repeat, so the reference applies each layer's prefill and
decode tokens in one call. Presets of models with a QK-RMSNorm (Qwen3) run the op's fused norm
with random per-layer weights and the config's rms_norm_eps.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import attention as attn
from jax_rope_cache import decoder, reference
from jax_rope_cache.cli import _args
from jax_rope_cache.cli._fmt import compare_runs, progress
from jax_rope_cache.models import presets, tables

POOL = 4  # distinct decode input sets, cycled over steps


def layer_scale(layer):
    return 2.0 ** ((layer % 4) - 2)


def tables_for(preset: str, model: presets.ModelShape, max_pos: int):
    """The model's own RoPE tables (its scaling law) for presets with a config; plain RoPE otherwise.
    A multimodal-RoPE preset runs as its text tokens do: positions [T], the 1-D rotation."""
    if preset in presets.PRESETS or preset in presets.MROPE_PRESETS:
        cos, sin, _ = presets.preset_tables(preset, max_pos)
        return cos, sin
    return tables.rope_tables(max_pos, model.rotary_dim, base=10000.0)


def build(model: presets.ModelShape, batch: int, prefill: int, steps: int, layers: int, block_size: int, seed: int,
          preset: str = "tiny"):
    rng = np.random.default_rng(seed)
    cos, sin = tables_for(preset, model, 4096)
    qh, kh, d = model.q_heads, model.kv_heads, model.head_dim
    per_seq = prefill + steps
    bps = -(-per_seq // block_size)
    nb = batch * bps + 1
    blocks = rng.permutation(nb)[: batch * bps].reshape(batch, bps)  # each sequence owns random blocks
    t = np.arange(per_seq)
    seq_slots = (blocks[:, t // block_size] * block_size + t % block_size).astype(np.int32)  # [batch, per_seq]
    seq_pos = (rng.integers(0, 1024, batch)[:, None] + t[None, :]).astype(np.int32)
    x = lambda *shape: rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)  # noqa: E731
    data = dict(
        pre_q=x(batch * prefill, qh, d), pre_k=x(batch * prefill, kh, d), pre_v=x(batch * prefill, kh, d),
        pre_slots=seq_slots[:, :prefill].reshape(-1), pre_pos=seq_pos[:, :prefill].reshape(-1),
        dec_q=x(POOL, batch, qh, d), dec_k=x(POOL, batch, kh, d), dec_v=x(POOL, batch, kh, d),
        dec_slots=seq_slots[:, prefill:].T.copy(), dec_pos=seq_pos[:, prefill:].T.copy(),  # [steps, batch]
        blocks=blocks.astype(np.int32), cos=cos, sin=sin)
    if presets.preset_qk_norm_eps(preset) is not None:  # per-layer norm weights around 1, both signs
        data["q_norm_w"] = rng.normal(1.0, 0.5, (layers, d)).astype(jnp.bfloat16)
        data["k_norm_w"] = rng.normal(1.0, 0.5, (layers, d)).astype(jnp.bfloat16)
    caches = jrc.make_kv_cache(nb, block_size, kh, d, jnp.bfloat16, num_layers=layers, fill="random", seed=seed)
    return data, tuple(np.asarray(c) for c in caches)


def norm_options(d, i, eps):
    """The op's QK-RMSNorm keywords for layer i (none for a model without the norm)."""
    if eps is None:
        return {}
    return dict(q_norm_weight=d["q_norm_w"][i], k_norm_weight=d["k_norm_w"][i], norm_eps=eps)


def make_programs(layers: int, steps: int, impl: str, unroll: bool = True, norm_eps=None):
    scales = jnp.asarray([layer_scale(i) for i in range(layers)], jnp.bfloat16)

    def prefill(d, kc, vc):
        def layer_fn(carry, i):
            kc, vc, acc = carry
            s = scales[i]
            q_out, _, kc, vc = jrc.rope_and_cache(d["pre_q"] * s, d["pre_k"] * s, d["pre_v"] * s, kc, vc,
                                                  d["pre_slots"], d["pre_pos"], d["cos"], d["sin"], impl=impl,
                                                  layer=i, **norm_options(d, i, norm_eps))
            return (kc, vc, acc + jnp.sum(q_out, dtype=jnp.float32)), None
        (kc, vc, acc), _ = jax.lax.scan(layer_fn, (kc, vc, jnp.float32(0)), jnp.arange(layers), unroll=unroll)
        return kc, vc, acc

    def decode(d, kc, vc):
        def step(n, carry):
            def layer_fn(carry, i):
                kc, vc, acc = carry
                s, j = scales[i], n % POOL
                q_out, _, kc, vc = jrc.rope_and_cache(
                    d["dec_q"][j] * s, d["dec_k"][j] * s, d["dec_v"][j] * s, kc, vc, d["dec_slots"][n],
                    d["dec_pos"][n], d["cos"], d["sin"], impl=impl, layer=i, **norm_options(d, i, norm_eps))
                # Consume all of q_out (as attention would), so XLA cannot skip part of the rotation.
                return (kc, vc, acc + jnp.sum(q_out, dtype=jnp.float32)), None
            carry, _ = jax.lax.scan(layer_fn, carry, jnp.arange(layers), unroll=unroll)
            return carry
        return jax.lax.fori_loop(0, steps, step, (kc, vc, jnp.float32(0)))

    return jax.jit(prefill, donate_argnums=(1, 2)), jax.jit(decode, donate_argnums=(1, 2))


def make_attention_programs(layers: int, steps: int, impl: str, attention: str, block_size: int, prefill: int,
                            heads: tuple[int, int], interpret: bool, norm_eps=None):
    """The same loop with each decode layer's q_out read by `attention` over the sequences' blocks
    (keys in slot order: a sequence's t-th token sits at its t-th slot), on one cache per layer in
    the layout that attention reads, written through the model client's op call
    (decoder.rope_and_write). Programs take and return the tuple (k_0, v_0, k_1, v_1, ...)."""
    qh, kh = heads
    layout = attn.layout_of(attention) or "flash"
    scales = [layer_scale(i) for i in range(layers)]

    def write(d, caches, i, q, k, v, slots, pos):
        s = jnp.bfloat16(scales[i])
        qkv = jnp.concatenate([q * s, k * s, v * s], axis=1).reshape(q.shape[0], -1)
        q_out, _, mine = decoder.rope_and_write(qkv, caches[2 * i:2 * i + 2], slots, pos, d["cos"], d["sin"],
                                                layout=layout, layer=None, num_q_heads=qh, num_kv_heads=kh,
                                                impl=impl, **norm_options(d, i, norm_eps))
        return q_out, caches[:2 * i] + tuple(mine) + caches[2 * i + 2:]

    def prefill_fn(d, caches):
        acc = jnp.float32(0)
        for i in range(layers):
            q_out, caches = write(d, caches, i, d["pre_q"], d["pre_k"], d["pre_v"], d["pre_slots"], d["pre_pos"])
            acc = acc + jnp.sum(q_out, dtype=jnp.float32)
        return caches, acc

    def decode_fn(d, caches):
        bt = d["blocks"]
        batch = bt.shape[0]
        if attention != "gather":
            pages = attn.page_table(bt, attn.page_width(attention, bt.shape[1], block_size, qh // kh))

        def step(n, carry):
            caches, acc = carry
            j = n % POOL
            lengths = jnp.full((batch,), prefill + 1, jnp.int32) + n
            for i in range(layers):
                q_out, caches = write(d, caches, i, d["dec_q"][j], d["dec_k"][j], d["dec_v"][j], d["dec_slots"][n],
                                      d["dec_pos"][n])
                if attention == "gather":
                    keys, values = attn.gather_blocks(caches[2 * i:2 * i + 2], None, bt, layout)
                    o = attn.attend(q_out[:, None], keys, values, (lengths - 1)[:, None])
                else:
                    o = attn.paged_decode(attention, q_out, caches[2 * i], caches[2 * i + 1], pages, lengths,
                                          block_size=block_size, interpret=interpret)
                acc = acc + jnp.sum(o, dtype=jnp.float32)
            return caches, acc
        return jax.lax.fori_loop(0, steps, step, (caches, jnp.float32(0)))

    return jax.jit(prefill_fn, donate_argnums=(1,)), jax.jit(decode_fn, donate_argnums=(1,))


def layer_caches(caches, attention: str) -> tuple:
    """Stacked flash numpy caches -> one cache per layer in `attention`'s layout: (k_0, v_0, k_1, ...)."""
    hm = attn.layout_of(attention) == "head_major"
    return tuple(c[i].transpose(2, 0, 1, 3) if hm else c[i] for i in range(caches[0].shape[0]) for c in caches)


def stacked_flash(caches, attention: str) -> tuple:
    """The inverse of layer_caches, as numpy arrays."""
    hm = attn.layout_of(attention) == "head_major"
    per = [np.asarray(c) for c in caches]
    return tuple(np.stack([c.transpose(1, 2, 0, 3) if hm else c for c in per[j::2]]) for j in (0, 1))


def checked_layers(layers: int, check: int | None) -> list[int]:
    """All layers, or `check` of them spread over the stack (first and last included)."""
    if check is None or check >= layers:
        return list(range(layers))
    return sorted({int(round(i * (layers - 1) / max(1, check - 1))) for i in range(check)})


def reference_caches(data, caches, layers: list[int], steps: int, norm_eps=None):
    """What the caches must hold afterwards in `layers`, from the numpy reference."""
    kc, vc = caches
    out_k, out_v = kc.copy(), vc.copy()
    f32 = np.float32
    for layer in layers:
        s = f32(layer_scale(layer))
        sc = lambda a: (a.astype(f32) * s).astype(a.dtype)  # noqa: E731
        pick = np.arange(steps) % POOL
        q = np.concatenate([sc(data["pre_q"]), sc(data["dec_q"][pick]).reshape((-1,) + data["pre_q"].shape[1:])])
        k = np.concatenate([sc(data["pre_k"]), sc(data["dec_k"][pick]).reshape((-1,) + data["pre_k"].shape[1:])])
        v = np.concatenate([sc(data["pre_v"]), sc(data["dec_v"][pick]).reshape((-1,) + data["pre_v"].shape[1:])])
        slots = np.concatenate([data["pre_slots"], data["dec_slots"].reshape(-1)])
        pos = np.concatenate([data["pre_pos"], data["dec_pos"].reshape(-1)])
        _, _, out_k[layer], out_v[layer] = reference.rope_and_cache(q, k, v, kc[layer], vc[layer], slots, pos,
                                                                    data["cos"], data["sin"],
                                                                    **norm_options(data, layer, norm_eps))
    return out_k, out_v


def run(preset="llama-3.1-8b", tp=8, batch=64, prefill=128, steps=256, layers=32, block_size=16, repeats=3, seed=0,
        check_layers=None, unroll=True, attention=None):
    model = presets.model_shape(preset, tp)
    norm_eps = presets.preset_qk_norm_eps(preset)
    data, caches = build(model, batch, prefill, steps, layers, block_size, seed, preset)
    dev = jax.devices()[0]
    fused = "" if norm_eps is None else f", QK-RMSNorm fused (eps {norm_eps:g}, random weights)"
    read = "q_out summed" if attention is None else \
        f"q_out read by {attention} attention over {attn.layout_of(attention) or 'flash'} caches, one per layer"
    print(f"device {dev.platform} ({dev.device_kind}); {model.name}: heads {model.q_heads}/{model.kv_heads}, "
          f"D={model.head_dim}{fused}; {layers} layers ({caches[0].nbytes * 2 / 2**20:.0f} MiB of caches; {read}), "
          f"batch {batch}, prefill {prefill}/seq, {steps} decode steps")
    ddata = jax.device_put(data, dev)
    check = checked_layers(layers, check_layers)
    phases, phase = 1 + 2 * (1 + repeats), 0
    progress(phase, phases, "numpy reference")
    want_k, want_v = reference_caches(data, caches, check, steps, norm_eps)
    want_k, want_v = want_k[check], want_v[check]
    if attention is not None:
        attn.check_platform(attention, dev)

    def programs(impl):
        """(prefill, decode, caches on the device, back to stacked flash numpy) for `impl`."""
        if attention is None:
            pre, dec = make_programs(layers, steps, impl, unroll, norm_eps)
            wrap = lambda f: lambda d, c: (lambda r: (r[:2], r[2]))(f(d, *c))  # noqa: E731
            return wrap(pre), wrap(dec), lambda: jax.device_put(caches, dev), lambda c: tuple(map(np.asarray, c))
        pre, dec = make_attention_programs(layers, steps, impl, attention, block_size, prefill,
                                           (model.q_heads, model.kv_heads), attn.interpret_on(dev), norm_eps)
        return (pre, dec, lambda: jax.device_put(layer_caches(caches, attention), dev),
                lambda c: stacked_flash(c, attention))

    timing, runs, exact = {}, {}, {}
    for impl in ("kernel", "xla"):
        prefill_fn, decode_fn, fresh, back = programs(impl)
        phase += 1
        progress(phase, phases, f"{impl}: compile + first run")
        c, _ = prefill_fn(ddata, fresh())
        c, _ = decode_fn(ddata, c)  # compiles both; first full run
        got_k, got_v = (x[check] for x in back(c))
        exact[impl] = (np.array_equal(got_k.view(np.uint16), want_k.view(np.uint16)),
                       np.array_equal(got_v.view(np.uint16), want_v.view(np.uint16)))
        close = np.allclose(got_k.astype(np.float32), want_k.astype(np.float32), rtol=2**-7, atol=2**-7)
        exact[impl] += (close,)
        t_pre, t_dec = [], []
        for r in range(repeats):
            phase += 1
            progress(phase, phases, f"{impl}: timed run {r + 1}/{repeats}")
            c = fresh()
            jax.block_until_ready(c)
            t0 = time.perf_counter()
            c, _ = prefill_fn(ddata, c)
            jax.block_until_ready(c)
            t1 = time.perf_counter()
            c, _ = decode_fn(ddata, c)
            jax.block_until_ready(c)
            t_pre.append(t1 - t0)
            t_dec.append(time.perf_counter() - t1)
        timing[impl] = (float(np.median(t_pre)), float(np.median(t_dec)))
        runs[impl] = (t_pre, t_dec)
        del c

    progress(phases, phases, "done")
    ok = all(exact["kernel"][:2]) and exact["xla"][2] and exact["xla"][1]
    describe = lambda e: "bit-exact" if all(e[:2]) else "within bf16 rounding" if e[2] and e[1] else "MISMATCH"  # noqa
    print(f"final caches ({len(check)} of {layers} layers) vs numpy reference: kernel {describe(exact['kernel'])}, xla {describe(exact['xla'])}")
    print(f"{'impl':<8}{'prefill':>12}{'decode step':>14}{'per op':>10}{'decode tok/s':>15}")
    for impl, (tp_, td) in timing.items():
        print(f"{impl:<8}{tp_ * 1e3:>10.1f}ms{td / steps * 1e6:>12.0f}us{td / steps / layers * 1e6:>8.1f}us"
              f"{batch * steps / td:>15,.0f}")
    k, x = runs["kernel"], runs["xla"]
    print(f"kernel vs xla: decode step {compare_runs(x[1], k[1])}; prefill {compare_runs(x[0], k[0])}")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_rope_cache demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The op alone in an inference loop: one prefill and a jitted decode loop over a model "
                    "preset's shapes on the default device, the final caches checked against the numpy "
                    "reference, the kernel and the XLA path timed side by side.")
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(presets.MODELS), help="model shape")
    p.add_argument("--tp", type=_args.positive_int, default=8, help="tensor-parallel degree: the heads of one shard")
    p.add_argument("--batch", type=_args.positive_int, default=64, help="sequences (one token each per decode step)")
    p.add_argument("--prefill", type=_args.nonnegative_int, default=128, help="prefill tokens per sequence")
    p.add_argument("--steps", type=_args.positive_int, default=256, help="decode steps")
    p.add_argument("--layers", type=_args.positive_int, default=32, help="layers of the stacked caches")
    p.add_argument("--block-size", type=_args.positive_int, default=16, help="cache block size (slots per block)")
    p.add_argument("--check-layers", type=_args.positive_int, default=None,
                   help="compare only this many layers (default all)")
    p.add_argument("--no-unroll", action="store_true",
                   help="keep the layer scan rolled (a while loop: on GPUs one host round trip per layer)")
    p.add_argument("--attention", default="none", choices=("none",) + attn.ATTENTIONS,
                   help="what reads each decode layer's q_out: none (summed: the op alone), or a decode attention "
                        "over the caches the op wrote, one cache per layer in its layout (pallas_gpu / pallas_tpu: "
                        "head_major; interpreted on the CPU)")
    a = _args.parse_args(p, argv)
    ok = run(a.preset, a.tp, a.batch, a.prefill, a.steps, a.layers, a.block_size, check_layers=a.check_layers,
             unroll=not a.no_unroll, attention=None if a.attention == "none" else a.attention)
    raise SystemExit(0 if ok else 1)
