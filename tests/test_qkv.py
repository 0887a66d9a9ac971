"""rope_and_cache_qkv: the fused QKV input, through every implementation, against the numpy reference.

The kernels read q, k and v at their head offsets of the one fused buffer (the same buffer in the q,
k and v operand slots, specialised on the row stride); the structural tests prove XLA then passes
the projection's output to the custom call with no copy or slice, and that the check can tell (the
sliced call has them).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
import rocm_emulator
from conftest import Case, assert_bits_equal, flydsl_kernel_module, impl_params, make_problem, xla_bound, \
    assert_fma_close
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import cpu

BF16 = np.dtype(ml_dtypes.bfloat16)


def fuse(q, k, v, flat=True):
    """The fused tensor of q [T, QH, D], k and v [T, KH, D]: [T, (QH + 2 KH) * D] (flat) or [T, QH + 2 KH, D]."""
    x = np.concatenate([q, k, v], axis=1)
    return x.reshape(x.shape[0], -1) if flat else x


# (case, extra options): every layout, both rotation styles, partial rotary, each dtype, fp8 caches
# with scalar and per-head scales, the QK-norm, M-RoPE, stacked layers, the 3-D form
CASES = [
    (Case(T=7, QH=8, KH=2, D=64), {}),
    (Case(T=5, QH=4, KH=1, D=64, layout="xpacked", dtype="float16", is_neox=False, table="full"), {"norm": "q"}),
    (Case(T=9, QH=6, KH=3, D=32, R=16, layout="xpacked_shuffled", dtype="float32", index_dtype="int64"), {"flat": False}),
    (Case(T=6, QH=4, KH=2, D=128, layout="hnd", cache_dtype="float8_e4m3fn", precision="native",
          table_dtype="bfloat16"), {"norm": "qk", "heads_scale": True}),
    (Case(T=4, QH=2, KH=2, D=64, layout="flash", cache_dtype="float8_e4m3fnuz"), {"layers": 3}),
    (Case(T=5, QH=4, KH=2, D=64, layout="xpacked", cache_dtype="float8_e5m2", table_dtype="float32",
          precision="native"), {"heads_scale": True, "layers": 2}),
    (Case(T=8, QH=8, KH=4, D=64, layout="xpacked", precision="native"), {"mrope": (8, 12, 12), "norm": "k"}),
    (Case(T=3, QH=4, KH=2, D=80, layout="hnd", dtype="float16"), {"mrope": (16, 12, 12), "interleaved": True,
                                                                    "layers": 2, "flat": False}),
    (Case(T=6, QH=4, KH=2, D=64, layout="head_major", cache_dtype="float8_e4m3fn"), {"norm": "qk", "layers": 2}),
    (Case(T=7, QH=8, KH=2, D=128, layout="kv_merged", dtype="float32", precision="native"), {"norm": "k", "flat": False}),
]


def fused_problem(case: Case, extra: dict, seed: int):
    """(qkv, key_cache, value_cache, slots, positions, cos, sin, opts) with fresh random values."""
    args, opts = make_problem(case, seed)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    rng = np.random.default_rng(seed + 1)
    if "heads_scale" in extra:
        opts["k_scale"] = rng.uniform(0.05, 0.5, case.KH).astype(np.float32)
    dt = q.dtype
    if "q" in extra.get("norm", ""):
        opts["q_norm_weight"] = rng.uniform(0.5, 1.5, case.D).astype(dt)
    if "k" in extra.get("norm", ""):
        opts["k_norm_weight"] = rng.uniform(0.5, 1.5, case.D).astype(np.float32)
    if "mrope" in extra:
        opts["mrope_section"] = extra["mrope"]
        opts["mrope_interleaved"] = extra.get("interleaved", False)
        pos = np.stack([pos, np.roll(pos, 1), np.roll(pos, 2)])
    if "layers" in extra:
        n = extra["layers"]
        kc = np.stack([kc] + [rng.standard_normal(kc.shape).astype(kc.dtype) for _ in range(n - 1)])
        if vc is not None:  # kv_merged: K and V in kc
            vc = np.stack([vc] + [rng.standard_normal(vc.shape).astype(vc.dtype) for _ in range(n - 1)])
        opts["layer"] = n - 1
    return fuse(q, k, v, extra.get("flat", True)), kc, vc, slots, pos, cos, sin, opts


def _ids(cases):
    return [f"{c.layout}-{c.dtype}-{c.cache_dtype or 'same'}-" + "-".join(f"{k}" for k in e) for c, e in cases]


def _matrix():
    """Every case on every (platform, impl); the XLA path's compiles are slow on CPU, so the default
    tier runs it on two cases (the plain one and M-RoPE with the QK-norm) and the full tier on all."""
    out = []
    for p in impl_params():
        platform, impl = p.values
        for i, (case, extra) in enumerate(CASES):
            marks = [pytest.mark.full] if impl == "xla" and i not in (0, 5) else []
            out.append(pytest.param(platform, impl, case, extra, marks=marks, id=f"{p.id}-{_ids(CASES)[i]}"))
    return out


@pytest.mark.parametrize("platform,impl,case,extra", _matrix())
def test_fused_matches_reference(platform, impl, case, extra):
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(case, extra, seed=11)
    heads = dict(num_q_heads=case.QH, num_kv_heads=case.KH)
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, **heads, **opts)
    dev = jax.devices(platform)[0]
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    got = jrc.rope_and_cache_qkv(put(qkv), put(kc), put(vc), put(slots), put(pos), put(cos), put(sin), impl=impl,
                                 **heads, **opts)
    assert got[0].shape == (case.T, case.QH, case.D) and got[1].shape == (case.T, case.KH, case.D)
    if impl == "kernel":
        for name, g, w in zip(contract.RESULTS, got, want):
            assert_bits_equal(None if g is None else np.asarray(g), w, name)
        return
    # the XLA path: the same result as its unfused call (and so within its stated bound of the reference)
    q, k, v = reference.split_qkv(qkv, case.QH, case.KH)
    unfused = jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, impl="xla", **opts)
    for name, g, u in zip(contract.RESULTS, got, unfused):
        assert_bits_equal(*(None if a is None else np.asarray(a) for a in (g, u)), name)
    bound = xla_bound("q_out", (q, k, v, kc, vc, slots, pos, cos, sin), opts)
    assert_fma_close(np.asarray(got[0]), want[0], bound, "q_out")


def test_reference_is_the_split_call():
    case, extra = CASES[3]
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(case, extra, seed=3)
    q, k, v = reference.split_qkv(qkv, case.QH, case.KH)
    assert np.array_equal(q, qkv.reshape(case.T, -1, case.D)[:, :case.QH])
    assert np.array_equal(v, qkv.reshape(case.T, -1, case.D)[:, case.QH + case.KH:])
    a = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=case.QH,
                                     num_kv_heads=case.KH, **opts)
    b = reference.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, **opts)
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))


# ---- structure: no copy or slice of qkv before the custom call -------------------------------------
def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line.strip())
    return comps


def _defs(lines):
    out = {}
    for line in lines:
        m = re.match(r"^(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)$", line)
        if m:
            out[m.group(1)] = (m.group(2), line)
    return out


def input_producers(hlo: str, target: str = cpu.TARGET) -> list[tuple[str, str]]:
    """For the op's custom call in compiled HLO text: the (opcode, name) defining each of its q, k and
    v operands, bitcasts looked through."""
    for lines in _computations(hlo).values():
        defs = _defs(lines)
        for op, line in defs.values():
            if op == "custom-call" and f'custom_call_target="{target}"' in line:
                args = re.search(r"custom-call\((.*?)\), custom_call_target", line).group(1)
                names = [a.strip().split("%")[-1] for a in args.split(",")][:3]
                out = []
                for n in names:
                    while defs.get(n, ("", ""))[0] == "bitcast":
                        n = re.search(r"bitcast\(%([\w.\-]+)\)", defs[n][1]).group(1)
                    kind, line_n = defs.get(n, ("parameter", ""))
                    out.append((kind, n, line_n))
                return [(k, n) for k, n, _ in out], [l for _, _, l in out]
    raise AssertionError("no custom call of the op in the compiled HLO")


T, QH, KH, D, HID, NB, BS = 4, 8, 2, 64, 128, 8, 16


def _step_inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((T, HID)), dtype)
    w = jnp.asarray(rng.standard_normal((HID, (QH + 2 * KH) * D)) * 0.1, dtype)
    kc, vc = jrc.make_kv_cache(NB, BS, KH, D, dtype, fill="random")
    slots = jnp.asarray(rng.permutation(NB * BS)[:T], jnp.int32)
    return x, w, kc, vc, slots, jnp.arange(T, dtype=jnp.int32) + 3


COS, SIN = jrc.rope_tables(64, D, base=10000.0)


def fused_step(x, w, kc, vc, slots, pos):
    qkv = x @ w  # one projection: [T, (QH + 2 KH) * D]
    return jrc.rope_and_cache_qkv(qkv, kc, vc, slots, pos, COS, SIN, num_q_heads=QH, num_kv_heads=KH, impl="kernel")


def sliced_step(x, w, kc, vc, slots, pos):
    qkv = (x @ w).reshape(T, QH + 2 * KH, D)
    return jrc.rope_and_cache(qkv[:, :QH], qkv[:, QH:QH + KH], qkv[:, QH + KH:], kc, vc, slots, pos, COS, SIN,
                              impl="kernel")


def _compiled(fn, *args):
    """The program XLA compiles for the CPU (the handler's target), also on a GPU host."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return jax.jit(fn, donate_argnums=(2, 3)).lower(*jax.device_put(args, cpu)).compile().as_text()


def _the_projection(line: str) -> bool:
    """The producer is the matmul: the dot itself, or (jaxlib 0.11 on CPU, whose bf16 dot yields
    f32) the fusion that converts the dot's output to bf16; never a slice or a copy of it."""
    if "dot" in line:  # the dot, or the fusion holding it (its metadata names dot_general)
        return True
    head = line.split("=")[0]
    return "convert" in head and "fusion(" in line and "slice" not in line and "copy" not in line


def test_fused_step_passes_the_projection_to_the_call_without_a_copy():
    args = _step_inputs()
    fused = _compiled(fused_step, *args)
    producers, lines = input_producers(fused)
    names = {n for _, n in producers}
    assert len(names) == 1, producers  # one buffer in the q, k and v slots
    (n,) = names
    assert _the_projection(lines[0]), lines[0]  # the matmul's own output
    shape = lines[0].split("=")[1].split()[0]
    assert f"[{T},{(QH + 2 * KH) * D}]" in shape or f"[{T},{QH + 2 * KH},{D}]" in shape, lines[0]
    # nothing else reads the projection: no copy, slice or fusion of it anywhere
    readers = [l for l in fused.splitlines() if re.search(rf"%{re.escape(n)}[,)]", l) and not l.lstrip().startswith(
        ("%" + n + " ", "ROOT %" + n + " "))]
    assert all(" bitcast(" in l or "custom-call(" in l for l in readers), readers
    assert not re.search(r"\b(copy|slice)\(", fused[fused.index("ENTRY"):]), "a copy or slice in the fused step"
    # the check can tell: the sliced call materialises three slices of the projection before the call
    sliced = _compiled(sliced_step, *args)
    sp, sl = input_producers(sliced)
    assert len({n for _, n in sp}) == 3 and all(k in ("fusion", "slice", "copy") for k, _ in sp), sp
    assert all("slice" in l for l in sl), sl
    # and both compute the same bits
    for a, b in zip(jax.jit(fused_step)(*args), jax.jit(sliced_step)(*args)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_fused_call_in_a_layer_scan_reads_the_projection_in_place():
    """The decoder's pattern: per-layer weights and stacked caches in lax.scan; inside the loop body
    the call's q, k and v operands are the matmul's output itself."""
    L = 3
    x, w, kc, vc, slots, pos = _step_inputs()
    ws = jnp.stack([w * (i + 1) for i in range(L)])
    kcs, vcs = (jnp.stack([c] * L) for c in (kc, vc))

    def layers(x, ws, kc, vc, slots, pos):
        def one(carry, lw):
            (kc, vc), (w, i) = carry, lw
            q_out, _, kc, vc = jrc.rope_and_cache_qkv(x @ w, kc, vc, slots, pos, COS, SIN, num_q_heads=QH,
                                                      num_kv_heads=KH, layer=i, impl="kernel")
            return (kc, vc), q_out
        return jax.lax.scan(one, (kc, vc), (ws, jnp.arange(L)))

    hlo = _compiled(layers, x, ws, kcs, vcs, slots, pos)
    producers, lines = input_producers(hlo)
    assert len({n for _, n in producers}) == 1 and _the_projection(lines[0]), (producers, lines)
    (kc_out, vc_out), q_outs = jax.jit(layers)(x, ws, kcs, vcs, slots, pos)
    host = [np.asarray(a) for a in (kcs, vcs)]
    for i in range(L):
        qkv = np.asarray(x @ ws[i])
        want = reference.rope_and_cache_qkv(qkv, *host, np.asarray(slots), np.asarray(pos), COS, SIN,
                                            num_q_heads=QH, num_kv_heads=KH, layer=i)
        host = [want[2], want[3]]
        assert np.array_equal(np.asarray(q_outs[i]).view(np.uint16), want[0].view(np.uint16))
    assert np.array_equal(np.asarray(kc_out).view(np.uint16), host[0].view(np.uint16))
    assert np.array_equal(np.asarray(vc_out).view(np.uint16), host[1].view(np.uint16))


# ---- transformations ---------------------------------------------------------------------------------
def _small(seed=0, t=5, qh=4, kh=2, d=32, dtype=np.float32):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((t, (qh + 2 * kh) * d)).astype(dtype)
    kc, vc = (rng.standard_normal((8, 16, kh, d)).astype(dtype) for _ in "kv")
    slots = rng.permutation(128)[:t].astype(np.int32)
    slots[0] = -1
    pos = rng.integers(0, 40, t).astype(np.int32)
    cos, sin = jrc.rope_tables(64, d, base=10000.0)
    return qkv, kc, vc, slots, pos, cos, sin


@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_vmap_over_a_batch_of_fused_calls(impl):
    B = 3
    probs = [_small(seed=s) for s in range(B)]
    batch = [np.stack(a) for a in zip(*probs)]
    batch[5], batch[6] = probs[0][5], probs[0][6]  # shared tables
    f = jax.vmap(lambda *a: jrc.rope_and_cache_qkv(*a, num_q_heads=4, num_kv_heads=2, impl=impl),
                 in_axes=(0, 0, 0, 0, 0, None, None))
    got = jax.jit(f)(*batch)
    for b in range(B):
        want = reference.rope_and_cache_qkv(*probs[b], num_q_heads=4, num_kv_heads=2)
        for g, w in zip(got, want):
            if impl == "kernel":
                assert np.array_equal(np.asarray(g[b]), w)
            else:
                np.testing.assert_allclose(np.asarray(g[b]), w, rtol=1e-5, atol=1e-5)


def test_refs_are_written_in_place():
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=4)
    kref, vref = jax.new_ref(jnp.asarray(kc)), jax.new_ref(jnp.asarray(vc))
    step = jax.jit(lambda *a: jrc.rope_and_cache_qkv(*a, num_q_heads=4, num_kv_heads=2, impl="kernel")[:2])
    q_out, k_out = step(qkv, kref, vref, slots, pos, cos, sin)
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=4, num_kv_heads=2)
    for g, w in zip((q_out, k_out, kref[...], vref[...]), want):
        assert np.array_equal(np.asarray(g), w)


def shard_major(q, k, v, tp):
    """The fused tensor a column-parallel QKV projection gives over `tp` shards: shard s's columns
    hold its q heads, then its k heads, then its v heads: [T, tp * (QH/tp + 2 KH/tp) * D]."""
    t, d = q.shape[0], q.shape[2]
    parts = [np.concatenate([a.reshape(t, tp, -1, d)[:, s] for a in (q, k, v)], axis=1) for s in range(tp)]
    return np.concatenate([p.reshape(t, -1) for p in parts], axis=1)


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_map_splits_a_shard_major_fused_tensor(tp):
    from jax.sharding import NamedSharding, PartitionSpec as P
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    rng = np.random.default_rng(9)
    t, qh, kh, d = 6, 8, 4, 32
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (qh, kh, kh))
    kc, vc = (rng.standard_normal((8, 16, kh, d)).astype(np.float32) for _ in "kv")
    slots, pos = rng.permutation(128)[:t].astype(np.int32), rng.integers(0, 60, t).astype(np.int32)
    cos, sin = jrc.rope_tables(64, d, base=10000.0)
    heads, cache = P(None, "tp"), P(None, None, "tp")
    fn = jax.shard_map(lambda *a: jrc.rope_and_cache_qkv(*a, num_q_heads=qh // tp, num_kv_heads=kh // tp,
                                                         impl="kernel"),
                       mesh=mesh, in_specs=(heads, cache, cache, P(), P(), P(), P()),
                       out_specs=(heads, heads, cache, cache))
    host = (shard_major(q, k, v, tp), kc, vc, slots, pos, cos, sin)
    specs = (heads, cache, cache, P(), P(), P(), P())
    got = jax.jit(fn)(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(host, specs)])
    want = reference.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin)
    for name, g, w in zip(contract.RESULTS, got, want):
        assert np.array_equal(np.asarray(g), w), name


def test_export_keeps_one_call_reading_the_fused_buffer():
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=6)
    step = jax.jit(lambda *a: jrc.rope_and_cache_qkv(*a, num_q_heads=4, num_kv_heads=2, impl="kernel"))
    exp = jrc.export(step, platforms=["cpu"])(qkv, kc, vc, slots, pos, cos, sin)
    text = exp.mlir_module()
    assert text.count(f"@{cpu.TARGET}") == 1 or text.count(cpu.TARGET) >= 1
    call = re.search(r"stablehlo.custom_call @jax_rope_cache_cpu\(([^)]*)\)", text).group(1)
    first = [a.strip() for a in call.split(",")][:3]
    assert len(set(first)) == 1, first  # the one fused value in the q, k and v slots
    with jax.default_device(jax.devices("cpu")[0]):  # exported for the CPU: run there also on a GPU host
        got = exp.call(qkv, kc, vc, slots, pos, cos, sin)
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=4, num_kv_heads=2)
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want))


def test_zero_tokens():
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=2)
    got = jrc.rope_and_cache_qkv(qkv[:0], kc, vc, slots[:0], pos[:0], cos, sin, num_q_heads=4, num_kv_heads=2)
    assert got[0].shape == (0, 4, 32) and got[1].shape == (0, 2, 32)
    assert np.array_equal(np.asarray(got[2]), kc) and np.array_equal(np.asarray(got[3]), vc)


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,exc,words", [
    (dict(qkv=np.zeros((5, 7 * 32 + 4), np.float32)), ValueError, ["qkv", "divisible by QH + 2 KH", "8"]),
    (dict(qkv=np.zeros((5, 7, 32), np.float32)), ValueError, ["qkv", "[T, QH + 2 KH, D]", "8 heads"]),
    (dict(qkv=np.zeros((5, 8, 32, 1), np.float32)), ValueError, ["qkv", "rank 2", "rank 3"]),
    (dict(qkv=np.zeros((5, 256), np.int32)), TypeError, ["qkv", "dtype", "int32"]),
    (dict(num_q_heads=4.0), TypeError, ["num_q_heads", "int"]),
    (dict(num_kv_heads=0), ValueError, ["num_kv_heads", ">= 1"]),
    (dict(num_q_heads=3, num_kv_heads=2, qkv=np.zeros((5, 7 * 32), np.float32)), ValueError,
     ["q", "multiple of KH=2"]),
    (dict(slots=np.zeros(4, np.int32)), ValueError, ["slot_mapping", "[T]"]),
    (dict(kc=np.zeros((8, 16, 3, 32), np.float32)), ValueError, ["key_cache"]),
])
def test_errors_name_the_argument(change, exc, words):
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=1)
    a = dict(qkv=qkv, kc=kc, vc=vc, slots=slots, pos=pos, num_q_heads=4, num_kv_heads=2)
    a.update(change)
    with pytest.raises(exc) as e:
        jrc.rope_and_cache_qkv(a["qkv"], a["kc"], a["vc"], a["slots"], a["pos"], cos, sin,
                               num_q_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"])
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(exc):  # the reference says the same
        reference.rope_and_cache_qkv(a["qkv"], a["kc"], a["vc"], a["slots"], a["pos"], cos, sin,
                                     num_q_heads=a["num_q_heads"], num_kv_heads=a["num_kv_heads"])


def test_deleted_qkv_is_named():
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=1)
    x = jnp.asarray(qkv)
    x.delete()
    with pytest.raises(ValueError, match="qkv: expected a live array"):
        jrc.rope_and_cache_qkv(x, kc, vc, slots, pos, cos, sin, num_q_heads=4, num_kv_heads=2)


# ---- the CPU handler checks a fused call's operands itself ---------------------------------------------
def _direct(q, k, v, q_out_heads, k_out_heads, kc, vc, slots, pos, cos, sin):
    from jax_rope_cache.backends import native
    native.register_target(cpu.TARGET, native.native_module().cpu_handler, "cpu")
    t, d = q.shape[0], q.shape[2]
    outs = (jax.ShapeDtypeStruct((t, q_out_heads, d), q.dtype), jax.ShapeDtypeStruct((t, k_out_heads, d), q.dtype),
            jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype))
    call = jax.ffi.ffi_call(cpu.TARGET, outs, input_output_aliases={3: 2, 4: 3})
    one, lay, none = np.ones((), np.float32), np.zeros((), np.int32), np.zeros(1, np.float32)
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler: run there also on a GPU host
        return jax.block_until_ready(call(
            q, k, v, kc, vc, slots, pos, cos, sin, one, one, lay, none, none, layout=np.int64(0), is_neox=True,
            rotary_dim=np.int64(d), native=False, q_norm=False, k_norm=False, norm_eps=np.float32(0),
            mrope=np.int64(0), mrope_t=np.int64(0), mrope_h=np.int64(0), mrope_w=np.int64(0),
            rotary_tail=False, norm_type=np.int64(0), norm_after=False, q_gate=False, rope_switch=False,
            floor_scale=np.int64(0)))


def test_cpu_handler_reads_a_direct_fused_call_and_refuses_bad_dims():
    qkv, kc, vc, slots, pos, cos, sin = _small(seed=8)
    x = qkv.reshape(5, 8, 32)
    got = _direct(x, x, x, 4, 2, kc, vc, slots, pos, cos, sin)
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=4, num_kv_heads=2)
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want))
    with pytest.raises(Exception, match="q: expected dims"):  # 8 heads is not 4 + 2 * 3
        _direct(x, x, x, 4, 3, np.zeros((8, 16, 3, 32), np.float32), np.zeros((8, 16, 3, 32), np.float32), slots,
                pos, cos, sin)
    with pytest.raises(Exception, match="v: expected dims"):  # v not the fused tensor
        _direct(x, x, x[:, :2], 4, 2, kc, vc, slots, pos, cos, sin)
    with pytest.raises(Exception, match="k: expected dims"):
        _direct(x, x[:, :6], x, 4, 2, kc, vc, slots, pos, cos, sin)


# ---- the CUDA kernel (host emulation of both entries) and the FlyDSL kernel (lane emulator) ----------
def _spec(qkv, kc, vc, slots, pos, cos, sin, opts, qh, kh):
    t, _, _, d = contract.check_qkv(qkv, qh, kh)
    views = [jax.ShapeDtypeStruct((t, h, d), qkv.dtype) for h in (qh, kh, kh)]
    import dataclasses
    return dataclasses.replace(contract.check_op(*views, kc, vc, slots, pos, cos, sin, **opts), qkv=True)


EMU_CASES = CASES[:6]


@pytest.mark.parametrize("node", [False, True], ids=["launcher", "node"])
@pytest.mark.parametrize("case,extra", EMU_CASES, ids=_ids(EMU_CASES))
def test_cuda_host_emulation_fused_bitwise(case, extra, node, tmp_path_factory):
    import test_cuda_compile as tcc
    from jax_rope_cache.backends import cuda
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(case, extra, seed=21)
    spec = _spec(qkv, kc, vc, slots, pos, cos, sin, opts, case.QH, case.KH)
    x = qkv.reshape(case.T, case.QH + 2 * case.KH, case.D)
    layer = opts.get("layer", 0)
    defines = None
    if node:
        cfg = cuda.kernel_config(spec, cuda.DEFAULT_SMS)
        t, lead, maxp = case.T, kc.shape[0], cos.shape[0]
        defines = dict(cuda.node_config(cfg, (t, lead, maxp)).defines)
    got = tcc.run_emulation(spec, (x, x, x, kc, vc, slots, pos, cos, sin), opts.get("k_scale"), opts.get("v_scale"),
                            str(tmp_path_factory.mktemp("emu")), layer=layer, defines=defines,
                            q_norm_weight=opts.get("q_norm_weight"), k_norm_weight=opts.get("k_norm_weight"))
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=case.QH,
                                        num_kv_heads=case.KH, **opts)
    for name, g, w in zip(contract.RESULTS, got, want):
        assert_bits_equal(g, w, name)


def test_cuda_fused_variant_is_its_own_key_and_compiles():
    from jax_rope_cache.backends import cuda
    from jax_rope_cache.compilers import nvrtc
    case, extra = CASES[0]
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(case, extra, seed=2)
    spec = _spec(qkv, kc, vc, slots, pos, cos, sin, opts, case.QH, case.KH)
    import dataclasses
    fused, plain = cuda.kernel_config(spec, 132), cuda.kernel_config(dataclasses.replace(spec, qkv=False), 132)
    assert dict(fused.defines).get("RC_QKV") == 1 and "RC_QKV" not in dict(plain.defines)
    assert [d for d in fused.defines if d[0] != "RC_QKV"] == list(plain.defines)
    if nvrtc.unavailable_reason():
        pytest.skip(f"no NVRTC here: {nvrtc.unavailable_reason()}")
    c = cuda.compile_variant(fused, "sm_90")
    assert not any(nvrtc.spills(c)), c.log


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("case,extra", EMU_CASES, ids=_ids(EMU_CASES))
def test_rocm_lane_emulator_fused_bitwise(case, extra, regime):
    from jax_rope_cache.backends import rocm
    K = flydsl_kernel_module()
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(case, extra, seed=31)
    spec = _spec(qkv, kc, vc, slots, pos, cos, sin, opts, case.QH, case.KH)
    cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.qkv and cfg.latency == (regime == "latency")
    x = qkv.reshape(case.T, case.QH + 2 * case.KH, case.D)
    operands = rocm_emulator.custom_call_operands((x, x, x, kc, vc, slots, pos, cos, sin), opts,
                                                  layer=opts.get("layer", 0))
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, operands)
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=case.QH,
                                        num_kv_heads=case.KH, **opts)
    for name, g, w in zip(contract.RESULTS, got, want):
        assert_bits_equal(g, w, name)


@pytest.mark.parametrize("T", [8, 4096], ids=["latency", "bandwidth"])
def test_flydsl_fused_variant_compiles_for_both_archs(T):
    """The FlyDSL kernel of a fused call (Qwen3-like heads, the QK-norm, an fp8 x-packed cache) builds
    for gfx942 and gfx950 within the occupancy budget; its key differs from the separate-input one."""
    from jax_rope_cache.backends import rocm
    from jax_rope_cache.compilers import flydsl
    import test_rocm_compile as trc
    import dataclasses
    if not flydsl.available():
        pytest.skip("flydsl is not installed")
    case, extra = CASES[3]
    qkv, kc, vc, slots, pos, cos, sin, opts = fused_problem(dataclasses.replace(case, T=T), extra, seed=4)
    spec = _spec(qkv, kc, vc, slots, pos, cos, sin, opts, case.QH, case.KH)
    cfg, plain = rocm.kernel_config(spec), rocm.kernel_config(dataclasses.replace(spec, qkv=False))
    assert cfg.qkv and not plain.qkv and cfg.key() != plain.key()
    assert plain.key() == dataclasses.replace(cfg, qkv=False).key()
    table, symbol, objs = rocm.build_code_table(cfg, trc.ARCHS)
    assert [o.arch for o in objs] == list(trc.ARCHS)
    for o in objs:
        trc.check_code_object(o.code, o.arch, o.config, symbol)


@pytest.mark.parametrize("route", ["launcher", "node"])
def test_cuda_lowering_passes_the_fused_buffer_in_the_q_k_v_slots(route, monkeypatch):
    """Lowered for "cuda" here (jax.export): both routes (the FFI launcher with its buffer signature,
    XLA's PTX kernel node with its entry unchanged) get the one fused value as operands 0, 1 and 2."""
    from jax_rope_cache.backends import kernel_node, launcher
    from jax_rope_cache.compilers import nvrtc
    if nvrtc.unavailable_reason():
        pytest.skip(f"no NVRTC here: {nvrtc.unavailable_reason()}")
    monkeypatch.setenv(kernel_node.ENV, "1" if route == "node" else "0")
    s = jax.ShapeDtypeStruct
    t, qh, kh, d = 4, 8, 2, 64
    args = (s((t, (qh + 2 * kh) * d), jnp.bfloat16), s((8, 16, kh, d), jnp.bfloat16), s((8, 16, kh, d), jnp.bfloat16),
            s((t,), jnp.int32), s((t,), jnp.int32), s((32, d // 2), jnp.float32), s((32, d // 2), jnp.float32))
    step = lambda *a: jrc.rope_and_cache_qkv(*a, num_q_heads=qh, num_kv_heads=kh, impl="kernel")  # noqa: E731
    text = jrc.export(jax.jit(step, donate_argnums=(1, 2)), platforms=["cuda"])(*args).mlir_module()
    target = kernel_node.TARGET if route == "node" else launcher.GPU_TARGET
    calls = [ln for ln in text.splitlines() if f"stablehlo.custom_call @{target}" in ln
             or f'stablehlo.custom_call @"{target}"' in ln]
    assert len(calls) == 1, calls
    operands = [o.strip() for o in calls[0].split("(", 1)[1].split(")", 1)[0].split(",")]
    assert len(operands) == 14 and len(set(operands[:3])) == 1, operands
    assert f"tensor<{t}x{qh + 2 * kh}x{d}xbf16>" in calls[0]
    if route == "node":
        assert "rope_cache_node" in text  # the same entry, its 18 pointer parameters
