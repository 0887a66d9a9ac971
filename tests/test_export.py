"""`jax_rope_cache.export`: a donated decode step exported for every platform in one call, carrying
each platform's kernel, round-tripping through serialize/deserialize and running (CPU here) bit-exact
to the reference."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends
from conftest import Case, assert_bits_equal, make_problem, reference_op

pytest.importorskip("flatbuffers", reason="Exported.serialize() needs flatbuffers (the [test] extra)")

# The custom-call target of each platform's kernel (CUDA: the kernel node where the plugin takes it).
TARGETS = {"cpu": ("jax_rope_cache_cpu",), "cuda": ("jax_rope_cache_gpu", "__gpu$xla.gpu.ptx"),
           "rocm": ("jax_rope_cache_gpu",)}


def _platforms():
    # every platform whose kernel can be built in this process (CI: all three, no GPU needed)
    return [p for p in ("cpu", "cuda", "rocm") if p in backends.kernel_platforms()]


@pytest.mark.parametrize("layout", ["xpacked", "head_major", "kv_merged"])
def test_export_for_every_platform_in_one_call_and_round_trip(layout):
    """kv_merged: the exported function takes its one array (value_cache None) and returns None there."""
    platforms = _platforms()
    assert "cpu" in platforms
    args, opts = make_problem(Case(T=5, QH=8, KH=2, D=64, layout=layout), seed=61)
    static = {k: v for k, v in opts.items() if k in ("layout", "is_neox", "rotary_dim", "precision")}
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **static, impl="kernel"), donate_argnums=(3, 4))
    exp = jrc.export(step, platforms=platforms)(*args)
    assert tuple(exp.platforms) == tuple(platforms)
    text = exp.mlir_module()
    for p in platforms:
        assert any(t in text for t in TARGETS[p]), f"no {p} kernel in the exported module"
    restored = jax.export.deserialize(exp.serialize())
    got = [None if o is None else np.asarray(o) for o in restored.call(*args)]
    want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, name)


def test_export_without_the_helper_names_the_missing_check():
    args, opts = make_problem(Case(T=3, QH=4, KH=2, D=64), seed=62)
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel"))
    with pytest.raises(ValueError, match="jax_rope_cache_cpu"):
        jax.export.export(step, platforms=["cpu"])(*args)
    names = {str(c).split(":", 1)[1] for c in jrc.DISABLED_EXPORT_CHECKS}
    assert names == {"jax_rope_cache_cpu", "jax_rope_cache_cpu_token_scales", "jax_rope_cache_mla_cpu",
                     "jax_rope_cache_gpu", "jax_rope_cache_gpu_nograph", "__gpu$xla.gpu.ptx"}, names


@pytest.mark.skipif("cuda" not in backends.kernel_platforms(), reason="the CUDA kernel cannot be built here")
def test_export_of_the_kernel_node_route_round_trips(monkeypatch):
    """With the kernel-node route on, the CUDA lowering is XLA's PTX custom call: jrc.export allows it,
    plain jax.export names it as the check to disable, and the serialized module keeps the PTX."""
    from jax_rope_cache.backends import kernel_node

    monkeypatch.setenv(kernel_node.ENV, "1")
    args, opts = make_problem(Case(T=6, QH=8, KH=2, D=64), seed=63)
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel"), donate_argnums=(3, 4))
    exp = jrc.export(step, platforms=["cuda"])(*args)
    text = jax.export.deserialize(exp.serialize()).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.ptx") == 1
    assert "jax_rope_cache_gpu" not in text and ".entry rope_cache_node" in text
    with pytest.raises(ValueError, match=re.escape(kernel_node.TARGET)):
        jax.export.export(jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel")), platforms=["cuda"])(*args)


@pytest.mark.parametrize("layout", ["combined", "split"])
def test_export_mla_on_cpu_round_trips(layout):
    """`jrc.export` of a donated MLA step on CPU: the MLA handler's custom call is allowed, and the
    deserialized program runs bit-exact to the MLA reference (fp8 cache and q_out in one layout)."""
    from mla_cases import FN, FNUZ, MlaCase, flat_outputs, make_mla_problem
    from jax_rope_cache.mla import reference as mla_reference

    fp8 = layout == "split"
    case = MlaCase(T=6, layout=layout, cache_dtype=FNUZ if fp8 else None, q_out_dtype=FN if fp8 else None,
                   is_neox=fp8, layers=2 if fp8 else None)
    args, opts = make_mla_problem(case, seed=63)
    step = jax.jit(lambda *a: jrc.mla_rope_and_cache(*a, **opts, impl="kernel"), donate_argnums=(4,))
    with pytest.raises(ValueError, match="jax_rope_cache_mla_cpu"):
        jax.export.export(step, platforms=["cpu"])(*args)
    exp = jrc.export(step, platforms=["cpu"])(*args)
    assert re.findall(r"stablehlo\.custom_call @(\w+)", exp.mlir_module()) == ["jax_rope_cache_mla_cpu"]
    restored = jax.export.deserialize(exp.serialize())
    with jax.default_device(jax.devices("cpu")[0]):  # exported for the CPU: run there also on a GPU host
        got = flat_outputs(restored.call(*args))
    want = flat_outputs(mla_reference.mla_rope_and_cache(*args, **opts))
    for name, g, w in zip(("q_out", "k_pe_out", "cache0", "cache1"), got, want):
        assert_bits_equal(g, w, name)
