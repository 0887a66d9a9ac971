"""Structural tests of the GPU paths, CUDA and ROCm alike: every test runs once per GPU platform jax
has here whose kernel path is usable (skipped where there is none). Correctness against the
reference over the option matrix lives in the platform-agnostic test files, which parametrise over
impl="kernel" on CUDA and ROCm too.

What "one kernel per call" means here, measured two ways:
  * the compiled HLO of a jitted call holds exactly one custom call and no fusion or other
    kernel-launching instruction (so XLA itself launches nothing else), and
  * the launcher's own counter (jax_rope_cache._native.gpu_launch_count, incremented after each
    successful cuLaunchKernel / hipModuleLaunchKernel in the execute stage) grows by exactly one
    per executed call. A single-op executable is below XLA's command-buffer size threshold, so its
    handler runs on every call; inside a captured CUDA/HIP graph the launch is replayed without
    calling the handler and is not counted (that case is checked for correctness, not counted).
Not yet run on an AMD GPU: the ROCm parametrisation is what a ROCm host runs.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import child_env
import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from jax_rope_cache.backends import cuda, kernel_node, launcher, native, rocm


def _gpu_platforms() -> tuple[list[str], str]:
    usable, why = [], []
    for p in ("cuda", "rocm"):
        try:
            present = bool(jax.devices(p))
        except RuntimeError:
            present = False
        problem = backends.KERNEL_BACKENDS[p].missing() if present else f"jax has no {p} backend here"
        (usable.append(p) if problem is None else why.append(f"{p}: {problem}"))
    return usable, "; ".join(why)


GPU_PLATFORMS, _WHY_NOT = _gpu_platforms()
pytestmark = pytest.mark.skipif(not GPU_PLATFORMS, reason=f"no usable GPU kernel path ({_WHY_NOT})")


@pytest.fixture(params=GPU_PLATFORMS or ["none"])
def platform(request):
    return request.param


@pytest.fixture(autouse=True)
def _launcher_route(monkeypatch, request):
    """The tests of the FFI launcher (its launch counter, stages, messages, graph capture) lower CUDA
    calls to the launcher; the kernel-node route's tests (test_kernel_node_*) lower to XLA's PTX
    custom call."""
    monkeypatch.setenv(kernel_node.ENV, "1" if request.node.name.startswith("test_kernel_node") else "0")


def _dev(platform):
    return jax.devices(platform)[0]

T, QH, KH, D, BS, NB = 37, 8, 2, 128, 16, 16


def _problem(seed=0, layout="flash", t=T, platform=None):
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    q = rng.standard_normal((t, QH, D)).astype(np.float32)
    k = rng.standard_normal((t, KH, D)).astype(np.float32)
    v = rng.standard_normal((t, KH, D)).astype(np.float32)
    kc, vc = jrc.make_kv_cache(NB, BS, KH, D, bf16, layout=layout, fill="random", seed=seed)
    slots = rng.permutation(NB * BS)[:t].astype(np.int32)
    slots[::5] = -1
    pos = rng.integers(-3, 70, t).astype(np.int32)
    ang = rng.uniform(-np.pi, np.pi, (64, D // 2))
    args = [jnp.asarray(a, bf16) for a in (q, k, v)] + [kc, vc] + [jnp.asarray(slots), jnp.asarray(pos),
                                                                    jnp.asarray(np.cos(ang), jnp.float32),
                                                                    jnp.asarray(np.sin(ang), jnp.float32)]
    return jax.device_put(args, _dev(platform)) if platform else args


def _host(arrays) -> list:
    return [None if a is None else np.asarray(a) for a in arrays]  # kv_merged: no value cache


def _same(g, w) -> bool:
    """The same bits (16-bit caches), or None on both sides (kv_merged's value cache)."""
    if g is None or w is None:
        return g is None and w is None
    return np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))


def _check(got, args, layout="flash"):
    want = reference.rope_and_cache(*_host(args), layout=layout)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert _same(g, w), name


def _jitted(layout="flash"):
    def f(q, k, v, kc, vc, s, p, c, sn):
        return jrc.rope_and_cache(q, k, v, kc, vc, s, p, c, sn, layout=layout, impl="kernel")
    return jax.jit(f, donate_argnums=(3, 4))


def test_compiled_hlo_has_one_custom_call_and_nothing_else_launches(platform):
    args = _problem(platform=platform)
    compiled = _jitted().lower(*args).compile()
    hlo = compiled.as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    want = launcher.GPU_TARGET if launcher.command_buffers_enabled(platform) else launcher.GPU_TARGET_NO_GRAPH
    assert calls == [want], calls  # on ROCm the no-graph target unless JAX_ROPE_CACHE_COMMAND_BUFFERS=1
    entry = hlo[hlo.index("ENTRY"):]
    kernels = re.findall(r"= [^ ]+ (fusion|copy|scatter|gather|dynamic-update-slice|convert|add|multiply)\(",
                         entry)
    assert not kernels, f"other kernel-launching instructions in the entry computation: {kernels}"


def test_stacked_caches_are_one_kernel_with_the_layer_read_on_the_device(platform):
    """Stacked caches [L, ...] and a traced layer: still one custom call and nothing else in the
    entry computation, one launch per call; the layer comes from device memory (one executable
    serves every layer), an out-of-range layer writes nothing."""
    layers = 4
    q, k, v, _, _, slots, pos, cos, sin = _problem(3, platform=platform)
    kc, vc = jax.device_put(jrc.make_kv_cache(NB, BS, KH, D, jnp.bfloat16, fill="random", num_layers=layers, seed=3),
                            _dev(platform))
    f = jax.jit(lambda q, k, v, kc, vc, s, p, c, sn, layer: jrc.rope_and_cache(
        q, k, v, kc, vc, s, p, c, sn, layer=layer, impl="kernel"), donate_argnums=(3, 4))
    layer0 = jnp.int32(0)
    hlo = f.lower(q, k, v, kc, vc, slots, pos, cos, sin, layer0).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert len(re.findall(r"custom_call_target=", hlo)) == 1, hlo
    assert not re.findall(r"= [^ ]+ (fusion|copy|scatter|gather|select|add|multiply|convert)\(", entry), entry
    ext = native.native_module()
    host = [np.asarray(a) for a in (q, k, v, kc, vc, slots, pos, cos, sin)]
    for layer in (2, 0, 3, 7, -1):
        want = reference.rope_and_cache(*host, layer=np.array(layer, np.int32))
        before = ext.gpu_launch_count()
        out = f(q, k, v, kc, vc, slots, pos, cos, sin, jax.device_put(jnp.int32(layer), _dev(platform)))
        jax.block_until_ready(out)
        assert ext.gpu_launch_count() - before == 1
        kc, vc = out[2], out[3]
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), out, want):
            assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16)), (layer, name)
        host[3], host[4] = np.asarray(kc), np.asarray(vc)


def test_launcher_launches_exactly_one_kernel_per_call(platform):
    ext = native.native_module()
    f = _jitted()
    args = _problem(1, platform=platform)
    q_out, k_out, kc, vc = f(*args)  # compile + first run
    jax.block_until_ready(vc)
    before = ext.gpu_launch_count()
    n = 5
    for _ in range(n):
        q_out, k_out, kc, vc = f(args[0], args[1], args[2], kc, vc, *args[5:])
    jax.block_until_ready(vc)
    assert ext.gpu_launch_count() - before == n


_MODULES_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax, jax.numpy as jnp
    import jax_rope_cache as jrc
    from jax_rope_cache import reference
    from jax_rope_cache.backends import native
    native = native.native_module()
    PLATFORM = sys.argv[1]
    rng = np.random.default_rng(0)

    def problem(d):
        q = rng.standard_normal((5, 4, d)).astype(jnp.bfloat16)
        k = rng.standard_normal((5, 2, d)).astype(jnp.bfloat16)
        kc, vc = (np.asarray(a) for a in jrc.make_kv_cache(4, 16, 2, d, fill="random"))
        slots = rng.permutation(64)[:5].astype(np.int32); pos = rng.integers(0, 8, 5).astype(np.int32)
        ang = rng.uniform(-np.pi, np.pi, (8, d // 2))  # true rotations: 32 layers stay finite
        return [q, k, k, kc, vc, slots, pos, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)]

    def step(args, op):  # one layer: rotated q/k feed the next layer, the caches carry over
        q, k, kc, vc = op(*args)
        return [q, k, args[2], kc, vc] + list(args[5:])

    def layers(a, b):  # 32 call sites of configuration a (D=64) and 32 of b (D=128)
        for _ in range(32):
            a, b = step(a, jrc.rope_and_cache), step(b, jrc.rope_and_cache)
        return a, b

    print("MODULES_AT_START", native.gpu_module_count())
    f = jax.jit(layers)
    for i, dev in enumerate(jax.devices(PLATFORM)[:2]):
        a, b = problem(64), problem(128)
        want = a
        for _ in range(32):
            want = step(want, reference.rope_and_cache)
        da, db = jax.device_put((a, b), dev)
        for _ in range(4):
            got, _ = f(da, db)
        exact = all(np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
                    for g, w in zip(got, want))
        jrc.rope_and_cache(*db)  # an eager call of configuration b: the same code object again
        print("DEVICE", i, "MODULES", native.gpu_module_count(), "LAUNCHES", native.gpu_launch_count(),
              "EXACT", exact)
""")


def test_modules_load_once_per_code_object_and_device(platform):
    """In a fresh process, per device (up to two): 64 call sites of two configurations (two code
    objects) executed four times, then one eager call: exactly 2 modules per device, results exact."""
    r = subprocess.run([sys.executable, "-P", "-c", _MODULES_SCRIPT, platform], env=child_env(), capture_output=True,
                       text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines()]
    assert ["MODULES_AT_START", "0"] in lines, r.stdout
    per_device = [line for line in lines if line[:1] == ["DEVICE"]]
    assert per_device, r.stdout
    for i, line in enumerate(per_device):
        assert int(line[3]) == 2 * (i + 1), f"device {i}: {line[3]} modules loaded in total, want {2 * (i + 1)}"
        assert int(line[5]) > 0, "the kernel never launched"
        assert line[7] == "True", r.stdout


def test_caches_are_aliased_in_the_compiled_hlo_on_gpu(platform):
    args = _problem(platform=platform)
    compiled = _jitted().lower(*args).compile()
    hlo = compiled.as_text()
    assert "input_output_alias=" in hlo
    cache_shape = "bf16[%d,%d,%d,%d]" % (NB, BS, KH, D)
    assert not re.search(r"= %s\{[^}]*\} copy\(" % re.escape(cache_shape), hlo), "a cache-shaped copy"
    cache_bytes = NB * BS * KH * D * 2
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes


@pytest.mark.parametrize("layout", ["flash", "xpacked", "xpacked_shuffled", "head_major", "kv_merged"])
def test_graph_replay_reads_indices_from_device(layout, platform):
    """Unrolled calls in one jit (XLA captures them into a command buffer / CUDA graph); the same
    executable run twice with different slots and positions must follow the device data."""
    n = 6

    @functools.partial(jax.jit, donate_argnums=(3, 4))
    def step(q, k, v, kc, vc, slots, pos, c, s):
        outs = []
        for i in range(n):
            qo, ko, kc, vc = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], pos[i], c, s, layout=layout,
                                                impl="kernel")
            outs.append(qo)
        return outs, kc, vc

    for seed in (3, 4):
        rng = np.random.default_rng(seed)
        base = _problem(seed, layout, t=8, platform=platform)
        kc0, vc0 = _host(base[3:5])
        q = rng.standard_normal((n, 8, QH, D)).astype(jnp.bfloat16)
        k = rng.standard_normal((n, 8, KH, D)).astype(jnp.bfloat16)
        v = rng.standard_normal((n, 8, KH, D)).astype(jnp.bfloat16)
        slots = rng.permutation(NB * BS)[: n * 8].reshape(n, 8).astype(np.int32)
        pos = rng.integers(0, 64, (n, 8)).astype(np.int32)
        q, k, v, slots, pos = jax.device_put((q, k, v, slots, pos), _dev(platform))
        outs, kc, vc = step(q, k, v, base[3], base[4], slots, pos, base[7], base[8])
        kw, vw = kc0, vc0
        cos, sin = np.asarray(base[7]), np.asarray(base[8])
        for i in range(n):
            qw, _, kw, vw = reference.rope_and_cache(*(np.asarray(a[i]) for a in (q, k, v)), kw, vw,
                                                     np.asarray(slots[i]), np.asarray(pos[i]), cos, sin, layout=layout)
            assert np.array_equal(np.asarray(outs[i]).view(np.uint16), qw.view(np.uint16))
        assert _same(kc, kw) and _same(vc, vw)


def test_loop_indexed_operands_replay_from_the_graph(platform):
    """A decode loop that indexes its slots and positions per step (slots[i, l] inside a fori_loop,
    4 calls per step): after the first execution XLA replays the captured graph (0 launcher
    executes per execution; before the operand fence, a dynamic-slice fusion around the call made
    XLA re-record it every step) and every step follows the device data, bit-exact. 64 tokens per
    call: a 256-byte int32 slice, like the demo's, which XLA's rewriter takes (it skips slices
    that are not a multiple of 128 bytes)."""
    steps, layers, t, nb = 4, 4, 64, 64
    rng = np.random.default_rng(11)
    kc0, vc0 = (np.asarray(a) for a in jrc.make_kv_cache(nb, BS, KH, D, jnp.bfloat16, fill="random", seed=11))
    ang = rng.uniform(-np.pi, np.pi, (64, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    q = rng.standard_normal((t, QH, D)).astype(jnp.bfloat16)
    k = rng.standard_normal((t, KH, D)).astype(jnp.bfloat16)
    v = rng.standard_normal((t, KH, D)).astype(jnp.bfloat16)
    slots = rng.permutation(nb * BS)[: steps * layers * t].reshape(steps, layers, t).astype(np.int32)
    pos = rng.integers(0, 64, (steps, layers, t)).astype(np.int32)

    @functools.partial(jax.jit, donate_argnums=(3, 4))
    def loop(q, k, v, kc, vc, slots, pos, c, s):
        def body(i, carry):
            kc, vc = carry
            for layer in range(layers):
                _, _, kc, vc = jrc.rope_and_cache(q, k, v, kc, vc, slots[i, layer], pos[i, layer], c, s, impl="kernel")
            return kc, vc
        return jax.lax.fori_loop(0, steps, body, (kc, vc))

    dev = _dev(platform)
    args = jax.device_put((q, k, v), dev)
    idx = jax.device_put((slots, pos, cos, sin), dev)
    kc, vc = loop(*args, *jax.device_put((kc0, vc0), dev), *idx)
    jax.block_until_ready(kc)
    ext = native.native_module()
    before = ext.gpu_launch_count()
    kc, vc = loop(*args, kc, vc, *idx)  # the same slots again: the same cache slots rewritten
    jax.block_until_ready(kc)
    assert ext.gpu_launch_count() == before, "the launcher ran again: the graph was re-recorded"
    kw, vw = kc0, vc0
    for i in range(steps):
        for layer in range(layers):
            _, _, kw, vw = reference.rope_and_cache(q, k, v, kw, vw, slots[i, layer], pos[i, layer], cos, sin)
    assert np.array_equal(np.asarray(kc).view(np.uint16), kw.view(np.uint16))
    assert np.array_equal(np.asarray(vc).view(np.uint16), vw.view(np.uint16))


_SWITCH_SCRIPT = textwrap.dedent("""
    import re, sys, numpy as np, jax, jax.numpy as jnp
    import jax_rope_cache as jrc
    from jax_rope_cache import reference
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 1, 64)), jnp.bfloat16)
    kc, vc = jrc.make_kv_cache(4, 16, 1, 64, fill="random")
    s = jnp.arange(4, dtype=jnp.int32); p = jnp.arange(4, dtype=jnp.int32)
    c = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    args = jax.device_put((q, k, k, kc, vc, s, p, c, c), jax.devices(sys.argv[1])[0])
    host = [np.asarray(a) for a in args]
    f = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel"))
    print("TARGETS", re.findall(r'custom_call_target="([^"]+)"', f.lower(*args).compile().as_text()))
    got = f(*args)
    want = reference.rope_and_cache(*host)
    print("EQUAL", all(np.array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16)) for g, w in zip(got, want)))
""")


@pytest.mark.parametrize("value,target", [("0", launcher.GPU_TARGET_NO_GRAPH), ("1", launcher.GPU_TARGET),
                                          ("", None)])
def test_command_buffer_switch(value, target, platform):
    """Both targets run the kernel bit-exactly (the graph target: XLA may capture and replay it);
    unset, CUDA uses the graph target and ROCm the no-graph one (HIP graphs are opt-in)."""
    if target is None:
        target = launcher.GPU_TARGET if platform == "cuda" else launcher.GPU_TARGET_NO_GRAPH
    env = child_env(JAX_ROPE_CACHE_COMMAND_BUFFERS=value)
    r = subprocess.run([sys.executable, "-P", "-c", _SWITCH_SCRIPT, platform], env=env, capture_output=True, text=True,
                       timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"TARGETS ['{target}']" in r.stdout, r.stdout
    assert "EQUAL True" in r.stdout, r.stdout


def _launch_raw(table: bytes, code_hash: int, platform: str, declared=(4,)):
    """Runs the launcher directly on a hand-made code-object table (no op, 4 floats); `declared`:
    the dims its signature attribute declares for the operand and the result."""
    x = jax.device_put(jnp.ones((4,), jnp.float32), _dev(platform))
    call = jax.ffi.ffi_call(launcher.GPU_TARGET_NO_GRAPH, jax.ShapeDtypeStruct((4,), jnp.float32))
    launcher.register_gpu_targets(native.native_module())
    spec = jax.ShapeDtypeStruct(declared, jnp.float32)
    fn = jax.jit(lambda a: call(a, code=table, code_hash=np.int64(code_hash), kernel="rope_cache_kernel",
                                grid_div=np.int64(1), grid_y=np.int64(1), block=np.int64(32), smem=np.int64(0),
                                signature=launcher.buffer_signature([spec], [spec]), buffer_names="x,out"))
    jax.block_until_ready(fn(x))


def test_initialize_checks_every_buffer_against_the_signature(platform):
    """Hardening: buffers other than the signature's are rejected at the initialize stage,
    naming the buffer, before any module is loaded (the table here would not even load)."""
    table = launcher.pack_code_table([(launcher.KIND_CUBIN, "sm_10", b"\x7fELF-not-a-real-cubin")])
    with pytest.raises(Exception, match=r"gpu launcher: x: expected element type 11 dims \[8\]"):
        _launch_raw(table, 777, platform, declared=(8,))


def _device_arch(platform) -> str | None:
    if platform == "cuda":
        cc, _ = cuda._local_cuda_arch()
        return f"sm_{cc}"
    return rocm.device_arch(_dev(platform))


def test_wrong_arch_code_object_is_a_clear_error(platform):
    """A code-object table with no entry for this GPU fails with the device's arch in the message."""
    if platform == "cuda":
        table = launcher.pack_code_table([(launcher.KIND_CUBIN, "sm_10", b"\x7fELF-not-a-real-cubin")])
        match = r"no code object for this GPU \(sm_\d+\).*sm_10"
    else:  # the launcher reads the device's gcnArchName: an entry for another gfx is never loaded
        table = launcher.pack_code_table([(launcher.KIND_AMDGPU, "gfx000", b"\x7fELF" + b"\0" * 60)])
        arch = _device_arch(platform)
        match = rf"no code object for this GPU \({arch}\).*gfx000" if arch else r"no code object loads on HIP device.*gfx000"
    with pytest.raises(Exception, match=match):
        _launch_raw(table, 12345, platform)


def test_driver_error_message_surfaces(platform):
    """A corrupt code object for the right arch: the driver's own load error comes back."""
    arch = _device_arch(platform)
    if platform == "rocm" and arch is None:
        pytest.skip("the ROCm device does not report its gfx arch")
    kind = launcher.KIND_CUBIN if platform == "cuda" else launcher.KIND_AMDGPU
    table = launcher.pack_code_table([(kind, arch, b"\x7fELF" + b"\0" * 60)])
    with pytest.raises(Exception, match=r"cuModuleLoadData" if platform == "cuda" else r"hipModuleLoadData"):
        _launch_raw(table, 54321, platform)


# ---- QK-RMSNorm before the rotation, per-head fp8 scales ----------------------------------
# What only a GPU tests: the shuffle butterfly itself (masks, lanes, convergence; the host emulation
# rebuilds the other lanes), the packed bf16 multiplies of "native" bf16 tables (sm_90) and the
# hardware conversions on the normalised values, and several units per thread in large calls.
_BF16, _F16, _F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
_FN, _FNUZ = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e4m3fnuz)

_NORM_CASES = {
    # Qwen3-32B TP8 (8/1/128), f32 tables, both norms with bf16 weights: the lane butterfly, 8 lanes per head
    "qwen3-32b-tp8": dict(QH=8, KH=1, D=128, qn=_BF16, kn=_BF16),
    # Qwen3-235B TP4 (16/1/128), x-packed shuffled fp8, "native" bf16 tables (packed multiplies on sm_90)
    "qwen3-235b-tp4-native": dict(QH=16, KH=1, D=128, layout="xpacked_shuffled", cdt=_FN, tdt=_BF16, prec="native",
                                  qn=_BF16, kn=_BF16),
    # Qwen3-235B TP1 (64/4/128): "fused" native, f32 weights, per-head k and v scales, x-packed fp8
    "qwen3-235b-fused-heads": dict(QH=64, KH=4, D=128, layout="xpacked", cdt=_FNUZ, tdt=_F32, prec="native",
                                   qn=_F32, kn=_F32, ksh=True, vsh=True),
    # f32, GPT-J: 32 lanes per head (a whole warp); k norm only
    "f32-gptj-32lanes": dict(QH=8, KH=2, D=128, dt=_F32, neox=False, kn=_F32),
    # generic paths: partial rotary (R < D), D = 80, two weight dtypes
    "partial-rotary": dict(QH=8, KH=2, D=128, R=64, qn=_BF16, kn=_F32, cdt=_FN, ksh=True),
    "d80-gptj-f16": dict(QH=4, KH=2, D=80, dt=_F16, neox=False, tdt=_F16, prec="native", qn=_F16, kn=_F32),
}


def _norm_problem(case, t, seed, special=False):
    c = dict(dict(layout="flash", dt=_BF16, cdt=None, tdt=_F32, prec="fp32", neox=True, R=None, qn=None, kn=None,
                  ksh=False, vsh=False), **case)
    rng = np.random.default_rng(seed)
    qh, kh, d, dt = c["QH"], c["KH"], c["D"], c["dt"]
    cdt = c["cdt"] or dt
    r = c["R"] or d
    nb = max(8, -(-t // BS) + 4)

    def rows(h):
        x = rng.standard_normal((t, h, d)).astype(np.float32) * 2
        if special:  # zero, tiny (subnormal squares), huge (squares overflow), NaN and inf rows
            kind = rng.integers(0, 6, (t, h))
            x[kind == 1] = 0
            x[kind == 2] *= np.float32(2.0 ** -70)
            with np.errstate(over="ignore"):
                x[kind == 3] *= np.float32(np.finfo(np.float32).max if dt == _F32 else 2.0 ** 120)
            x[kind == 4, 3] = np.nan
            x[kind == 5, d - 1] = np.inf
        with np.errstate(over="ignore"):
            return x.astype(dt)

    q, k = rows(qh), rows(kh)
    v = (rng.standard_normal((t, kh, d)) * (100 if cdt in (_FN, _FNUZ) else 1)).astype(np.float32).astype(dt)
    kshape, vshape = contract.cache_shapes(c["layout"], nb, BS, kh, d, cdt)
    kc = rng.standard_normal(kshape).astype(np.float32).astype(cdt)
    vc = rng.standard_normal(vshape).astype(np.float32).astype(cdt)
    slots = rng.permutation(nb * BS)[:t].astype(np.int32)
    slots[::7] = -1
    pos = rng.integers(-3, 70, t).astype(np.int32)
    ang = rng.uniform(-np.pi, np.pi, (64, r // 2))
    cos, sin = np.cos(ang).astype(c["tdt"]), np.sin(ang).astype(c["tdt"])
    opts = dict(layout=c["layout"], is_neox=c["neox"], rotary_dim=r, precision=c["prec"], norm_eps=1e-6)
    for name, wdt in (("q_norm_weight", c["qn"]), ("k_norm_weight", c["kn"])):
        if wdt is not None:
            opts[name] = (rng.standard_normal(d) * 0.5 + 1).astype(np.float32).astype(wdt)
    if cdt in (_FN, _FNUZ):
        opts["k_scale"] = rng.uniform(0.2, 3.0, kh if c["ksh"] else ()).astype(np.float32)
        opts["v_scale"] = rng.uniform(0.2, 3.0, kh if c["vsh"] else ()).astype(np.float32)
    return [q, k, v, kc, vc, slots, pos, cos, sin], opts


def _norm_supported(platform):
    want = {"q_norm", "k_norm", "k_scale_heads", "v_scale_heads"}
    if not want <= set(backends.KERNEL_BACKENDS[platform].SUPPORTS):
        pytest.skip(f"the {platform} kernel does not implement the norm / per-head scales yet")


def _run_norm(host, opts, platform, calls=1):
    """Runs the op `calls` times (jitted, impl="kernel", caches donated) from the same inputs;
    returns the last outputs and the launches counted per call."""
    ext = native.native_module()
    arrays = {k: v for k, v in opts.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in opts.items() if k not in arrays}
    f = jax.jit(lambda q, k, v, kc, vc, s, p, c, sn, arr: jrc.rope_and_cache(q, k, v, kc, vc, s, p, c, sn, **arr,
                                                                            **static, impl="kernel"),
                donate_argnums=(3, 4))
    counts, out = [], None
    for _ in range(calls):
        args, arr = jax.device_put(([jnp.asarray(a) for a in host], arrays), _dev(platform))
        jax.block_until_ready(args)
        before = ext.gpu_launch_count()
        out = jax.block_until_ready(f(*args, arr))
        counts.append(ext.gpu_launch_count() - before)
    return out, counts, f


def _bitwise(got, want):
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        u = f"u{g.dtype.itemsize}"
        bad = np.argwhere(g.view(u) != w.view(u))
        assert not len(bad), f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("t", [1, 37, 2000])
@pytest.mark.parametrize("case", list(_NORM_CASES), ids=str)
def test_norm_and_head_scales_bitwise_one_launch(case, t, platform):
    """The fused norm (and per-head fp8 scales) on the GPU: every output bit for bit equal to the
    reference, on fresh random data, one kernel launch per call; the norm really changed q/k. The
    x-packed cases at T = 2000 run the k heads' units paired by token (RC_KPAIRS), so their K norm
    takes the strided butterfly, which the host emulation cannot check (shuffle masks)."""
    _norm_supported(platform)
    host, opts = _norm_problem(_NORM_CASES[case], t, seed=t)
    if platform == "cuda" and t == 2000 and _NORM_CASES[case].get("layout", "flash") != "flash":
        cfg = cuda.kernel_config(contract.check_op(*host, **opts), cuda._local_cuda_arch()[1])
        assert dict(cfg.defines).get("RC_KPAIRS") == 1, cfg
    want = reference.rope_and_cache(*host, **opts)
    got, counts, _ = _run_norm(host, opts, platform, calls=2)
    assert counts == [1, 1], counts
    _bitwise(got, want)
    plain = reference.rope_and_cache(*host, **{k: v for k, v in opts.items() if not k.endswith("norm_weight")})
    which = 0 if "q_norm_weight" in opts else 1
    assert not np.array_equal(np.asarray(plain[which]).view(np.uint8), np.asarray(want[which]).view(np.uint8))


@pytest.mark.parametrize("case", ["qwen3-32b-tp8", "qwen3-235b-tp4-native", "f32-gptj-32lanes", "partial-rotary"])
def test_norm_special_rows_bitwise(case, platform):
    """Zero, subnormal-square, overflowing, NaN and inf rows: the same bits as the reference
    (canonical NaNs included)."""
    _norm_supported(platform)
    host, opts = _norm_problem(_NORM_CASES[case], 300, seed=9, special=True)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*host, **opts)
    got, counts, _ = _run_norm(host, opts, platform)
    assert counts == [1]
    _bitwise(got, want)


def test_norm_call_is_one_custom_call(platform):
    """With both norms and per-head scales the compiled call is still one custom call and nothing
    else (the weights and scales are plain operands, no op on them before the kernel)."""
    _norm_supported(platform)
    host, opts = _norm_problem(_NORM_CASES["qwen3-235b-fused-heads"], 37, seed=1)
    _, _, f = _run_norm(host, opts, platform)
    arrays = {k: v for k, v in opts.items() if isinstance(v, np.ndarray)}
    args, arr = jax.device_put(([jnp.asarray(a) for a in host], arrays), _dev(platform))
    hlo = f.lower(*args, arr).compile().as_text()
    assert len(re.findall(r"custom_call_target=", hlo)) == 1, hlo
    entry = hlo[hlo.index("ENTRY"):]
    assert not re.findall(r"= [^ ]+ (fusion|copy|scatter|gather|select|add|multiply|convert)\(", entry), entry


# ---- decode tokens split over several blocks (RC_SPLIT, grid.y) -------------------------------------
_SPLIT_CASES = {
    # Llama-3.1-8B (32/8/128) x-packed decode: 1344 units a token, 11 blocks of 128 threads
    "llama8b-xpacked": dict(QH=32, KH=8, D=128, layout="xpacked"),
    # GPT-OSS TP1 (64/8/64) x-packed shuffled fp8 with per-head scales: 7 blocks
    "gptoss-tp1-shuffled-fp8": dict(QH=64, KH=8, D=64, layout="xpacked_shuffled", cdt=_FN, ksh=True, vsh=True),
    # flash, Llama-8B: 4 blocks of 112 units (128 threads); and 3 of 150 (160 threads)
    "llama8b-flash": dict(QH=32, KH=8, D=128),
    "llama8b-flash-u200": dict(QH=32, KH=8, D=128, split_units=200),
    # QK-norm lanes across parts: Qwen3-235B TP1 shapes, f32 weights, x-packed fp8
    "qwen3-235b-split": dict(QH=64, KH=4, D=128, layout="xpacked", cdt=_FNUZ, qn=_F32, kn=_F32, ksh=True),
}


@pytest.mark.parametrize("t", [1, 16, 37, 130])
@pytest.mark.parametrize("case", list(_SPLIT_CASES), ids=str)
def test_split_decode_bitwise_one_launch(case, t, platform, monkeypatch):
    """A decode call whose token's work is split over grid.y blocks: every output bit for bit equal
    to the reference on fresh random data, one launch per call. The configuration splits where it
    should: CUDA (RC_SPLIT) x-packed at every T here, flash only at T <= 16; ROCm by phase (rotation
    | V workgroups) at every T here."""
    _norm_supported(platform)
    c = dict(_SPLIT_CASES[case])
    if "split_units" in c:
        monkeypatch.setattr(cuda, "LATENCY_SPLIT_UNITS", c.pop("split_units"))
    host, opts = _norm_problem(c, t, seed=t + 100)
    spec = contract.check_op(*host, **opts)
    if platform == "cuda":
        cfg = cuda.kernel_config(spec, cuda._local_cuda_arch()[1])
        flash = c.get("layout", "flash") == "flash"
        assert cfg.tokens_per_block == 1 and (cfg.parts > 1) == (t <= 16 or not flash), cfg  # flash: idle SMs only
    else:
        cfg = rocm.kernel_config(spec)
        assert cfg.latency and cfg.split > 1, cfg
    want = reference.rope_and_cache(*host, **opts)
    got, counts, _ = _run_norm(host, opts, platform, calls=2)
    assert counts == [1, 1], counts
    _bitwise(got, want)


# ---- the kernel-node route (backends/kernel_node.py): XLA's PTX custom call --------------------------
def _node_platform(platform):
    if platform != "cuda":
        pytest.skip("the kernel-node route is the CUDA lowering's")
    if not kernel_node.plugin_supports():
        pytest.skip(f"this jaxlib's CUDA plugin ({kernel_node.plugin_library()}) lacks {kernel_node.TARGET}")


NODE_NB = 32  # cache blocks of the node tests (512 slots: room for T = 300 distinct slots)


def _node_problem(t, seed, layers=None, shape=(QH, KH, D), layout="flash"):
    qh, kh, d = shape
    NB = NODE_NB
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), bf16) for h in (qh, kh, kh))
    kc, vc = jrc.make_kv_cache(NB, BS, kh, d, bf16, fill="random", seed=seed, num_layers=layers, layout=layout)
    slots = rng.permutation(NB * BS)[:t].astype(np.int32)
    slots[::7] = np.resize(np.array([-1, NB * BS, 2**30, -(2**31)], np.int32), len(slots[::7]))
    pos = rng.integers(-3, 70, t).astype(np.int32)
    ang = rng.uniform(-np.pi, np.pi, (64, d // 2))
    return [q, k, v, kc, vc, jnp.asarray(slots), jnp.asarray(pos), jnp.asarray(np.cos(ang), jnp.float32),
            jnp.asarray(np.sin(ang), jnp.float32)]


@pytest.mark.parametrize("layout", ["flash", "xpacked", "head_major", "kv_merged"])
@pytest.mark.parametrize("t,shape", [(37, (QH, KH, D)), (1, (32, 8, 128)), (300, (32, 8, 128))])
def test_kernel_node_is_one_ptx_call_aliased_and_bitwise(layout, t, shape, platform):
    """One `__gpu$xla.gpu.ptx` custom call (nothing else launches in the entry computation), the caches
    aliased in place, results bit-exact to the reference on fresh random data with out-of-range slots
    and positions (T = 1: the decode split over several blocks; T = 300: several tokens per block)."""
    _node_platform(platform)
    qh, kh, d = shape
    args = jax.device_put(_node_problem(t, 11 + t, shape=shape), _dev(platform))
    if layout != "flash":
        args[3], args[4] = jax.device_put(jrc.make_kv_cache(NODE_NB, BS, kh, d, jnp.bfloat16, layout=layout,
                                                            fill="random", seed=t), _dev(platform))
    f = jax.jit(lambda *a: jrc.rope_and_cache(*a, layout=layout, impl="kernel"), donate_argnums=(3, 4))
    hlo = f.lower(*args).compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', hlo) == [kernel_node.TARGET], hlo[:3000]
    assert "input_output_alias" in hlo
    entry = hlo[hlo.index("ENTRY"):]
    assert not re.findall(r"= [^ ]+ (fusion|copy|scatter|gather|dynamic-update-slice|convert)\(", entry), entry
    want = reference.rope_and_cache(*_host(args), layout=layout)
    got = f(*args)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert _same(g, w), name


@pytest.mark.parametrize("layout", ["flash", "head_major", "kv_merged"])
def test_kernel_node_stacked_layers_read_on_the_device(layout, platform):
    """Stacked caches and a traced layer through the kernel node: one executable for every layer, an
    out-of-range layer writes nothing (head_major: [L, KH, NB, BS, D], a layer's heads apart)."""
    _node_platform(platform)
    q, k, v, kc, vc, slots, pos, cos, sin = jax.device_put(_node_problem(29, 5, layers=4, layout=layout),
                                                           _dev(platform))
    f = jax.jit(lambda q, k, v, kc, vc, s, p, c, sn, layer: jrc.rope_and_cache(
        q, k, v, kc, vc, s, p, c, sn, layer=layer, layout=layout, impl="kernel"), donate_argnums=(3, 4))
    host = _host((q, k, v, kc, vc, slots, pos, cos, sin))
    for layer in (2, 0, 3, 4, -1):
        want = reference.rope_and_cache(*host, layer=np.array(layer, np.int32), layout=layout)
        out = f(q, k, v, kc, vc, slots, pos, cos, sin, jax.device_put(jnp.int32(layer), _dev(platform)))
        kc, vc = out[2], out[3]
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), out, want):
            assert _same(g, w), (layer, name)
        host[3], host[4] = _host((kc, vc))
    text = f.lower(q, k, v, kc, vc, slots, pos, cos, sin, jnp.int32(0)).compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text) == [kernel_node.TARGET]


def test_kernel_node_chain_replays_with_moving_inputs(platform):
    """Eight calls in one jit (a command buffer: XLA records the kernel nodes once and updates their
    arguments) executed with inputs rotating through 20 sets of buffers (addresses change every
    execution): after every execution the caches and the last call's outputs equal the reference's."""
    _node_platform(platform)
    n, t, sets = 8, 16, 20
    dev = _dev(platform)
    caches = jax.device_put(list(jrc.make_kv_cache(NODE_NB, BS, KH, D, jnp.bfloat16, fill="random", seed=9)), dev)
    pool = [jax.device_put(_node_problem(t, 100 + i)[:3] + _node_problem(t, 100 + i)[5:7], dev) for i in range(sets)]
    cos, sin = jax.device_put(_node_problem(t, 1)[7:], dev)

    def chain(q, k, v, s, p, kc, vc):
        for i in range(n):  # call i writes the valid slots shifted by 16 i (distinct in a call), skips the rest
            shifted = jnp.where((s >= 0) & (s < NODE_NB * BS), (s + 16 * i) % (NODE_NB * BS), s)
            qo, ko, kc, vc = jrc.rope_and_cache(q, k, v, kc, vc, shifted, p, cos, sin, impl="kernel")
        return qo, ko, kc, vc

    f = jax.jit(chain, donate_argnums=(5, 6))
    assert re.findall(r'custom_call_target="([^"]+)"', f.lower(*pool[0], *caches).compile().as_text()) == \
        [kernel_node.TARGET] * n
    hc = [np.asarray(c) for c in caches]
    for step in range(sets + 4):
        q, k, v, s, p = pool[step % sets]
        hs = np.asarray(s)
        for i in range(n):
            want = reference.rope_and_cache(np.asarray(q), np.asarray(k), np.asarray(v), hc[0], hc[1],
                                            np.where((hs >= 0) & (hs < NODE_NB * BS), (hs + 16 * i) % (NODE_NB * BS),
                                                     hs), np.asarray(p),
                                            np.asarray(cos), np.asarray(sin))
            hc = [want[2], want[3]]
        out = f(q, k, v, s, p, *caches)
        caches = [out[2], out[3]]
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), out, want):
            assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16)), (step, name)
