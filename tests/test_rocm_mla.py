"""The MLA FlyDSL kernel (kernels/rocm/mla_cache_flydsl.py) without an AMD GPU:

1. The lane emulator (tests/rocm_emulator.py) runs the kernel's emitter lane by lane against
   byte-array memory and must be bit-exact to the MLA numpy reference: both layouts, bf16 / f16 /
   f32 inputs, bf16 / fp8 caches, fp8 q_out, NeoX and GPT-J, both precisions, stacked layers (in
   range and out of range), invalid slots, out-of-range positions, both regimes (T = 1 and a few
   hundred); a wrong kernel (mutated source) must fail it.
2. FlyDSL compiles it for gfx942 and gfx950; each code object's metadata matches the launcher:
   the kernarg segment is the parameter block (27 / 30 8-byte words), no scratch, no spills,
   <= 64 VGPRs, the required workgroup size is the launch block; the ISA keeps the separate
   roundings of "fp32" arithmetic and uses 16-byte accesses.
3. Lowering for "rocm" on this CPU machine (jax.export) is one launcher custom call carrying the
   gfx942 and gfx950 code objects, with the launch geometry of the configuration built.
4. The code-object keys: the main kernel's are what they were; the MLA kernel's cover both sources.
Heavy parametrizations are marked `full`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import re

import jax
import numpy as np
import pytest

import rocm_emulator
from conftest import assert_bits_equal, flydsl_kernel_module
from mla_cases import BF16, CASES, E5M2_FULL_CASES, F16, F32, FN, FNUZ, MlaCase, flat_outputs, make_mla_problem
from jax_rope_cache.backends import launcher
from jax_rope_cache.compilers import amdgpu_elf, flydsl
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import reference as mla_reference
from jax_rope_cache.mla import rocm_kernel

K = rocm_kernel.kernel_module()
ARCHS = ("gfx942", "gfx950")
DEEPSEEK_TP8 = dict(QH=16, Dn=512, Dc=512, Dr=64, BS=16, NB=4)

needs_flydsl = pytest.mark.skipif(not flydsl.available(),
                                  reason=f"the ROCm kernel cannot be compiled here: {flydsl.unavailable_reason()}; "
                                         f"install with: {flydsl.INSTALL_HINT}")


# ---- the lane emulator ------------------------------------------------------------------------------
def operands(args, opts):
    """The custom call's operands of a call (mla.contract.operands order) and its result buffers."""
    spec = mla_contract.check_mla(*args, **opts)
    caches = [np.ascontiguousarray(c).copy() for c in mla_contract.cache_tuple(args[4], spec.layout)]
    layer = opts.get("layer")
    ops = [np.ascontiguousarray(a) for a in args[:4]] + caches + [np.ascontiguousarray(a) for a in args[5:]] + [
        np.asarray(opts.get("kv_scale", 1.0), np.float32).reshape(()),
        np.asarray(opts.get("q_scale", 1.0), np.float32).reshape(()),
        np.asarray(0 if layer is None else int(np.asarray(layer)), np.int32).reshape(())]
    results = [np.zeros((spec.num_tokens, spec.q_heads, spec.q_dim), spec.q_out_dtype),
               np.zeros((spec.num_tokens, spec.rope_dim), spec.dtype)] + caches
    return spec, ops, results


def emulate(args, opts, cfg=None, module=K):
    spec, ops, results = operands(args, opts)
    cfg = cfg or rocm_kernel.kernel_config(spec, module)
    assert len(ops) + len(results) + len(ops) == module.kernel_args(cfg)
    aliases = mla_contract.cache_aliases(spec.layout)
    got = rocm_emulator.launch(module, cfg, ops, results, {r: a for a, r in aliases.items()},
                               grid=-(-spec.num_tokens // cfg.tpb), grid_y=cfg.parts)
    return got


def check(args, opts, cfg=None, module=K):
    got = emulate(args, opts, cfg, module)
    want = flat_outputs(mla_reference.mla_rope_and_cache(*args, **opts))
    for name, g, w in zip(("q_out", "k_pe_out", "cache0", "cache1"), got, want):
        assert_bits_equal(g, w, name)


def regime_config(args, opts, regime):
    spec = mla_contract.check_mla(*args, **opts)
    cfg = rocm_kernel.kernel_config(spec, K, num_tokens=1 if regime == "latency" else 1 << 16)
    assert cfg.latency == (regime == "latency")
    return cfg


EMU_CASES = [c for c in CASES if c.Dn < 512] + [
    MlaCase(T=1, layout="split", is_neox=True, cache_dtype=FN, q_out_dtype=FN),
    MlaCase(T=300, QH=2, Dn=16, Dc=32, Dr=8, BS=4, NB=160, layout="combined", cache_dtype=FNUZ, precision="native",
            table_dtype=BF16, index_dtype="int64"),
]


# (case, regime): a call of more than LATENCY_TOKENS tokens gets the bandwidth configuration only
EMU_PARAMS = [pytest.param(c, r, id=f"{c.id}-{r}") for c in EMU_CASES for r in ("latency", "bandwidth")
              if r == "bandwidth" or c.T <= K.LATENCY_TOKENS]


@pytest.mark.parametrize("case,regime", EMU_PARAMS)
def test_emulated_kernel_matches_reference(case, regime):
    args, opts = make_mla_problem(case, seed=31)
    check(args, opts, regime_config(args, opts, regime))


DEEPSEEK_CASES = [
    MlaCase(T=3, **DEEPSEEK_TP8),
    MlaCase(T=2, **DEEPSEEK_TP8, layout="split", cache_dtype=FNUZ, q_out_dtype=FN, precision="native",
            table_dtype=BF16, is_neox=True, full=True),
]


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=[c.id for c in DEEPSEEK_CASES])
def test_emulated_deepseek_decode(case):
    """DeepSeek-V3 TP8 (absorbed q: Dn = Dc = 512): the latency configuration spreads a token over
    grid.y parts (one unit per lane)."""
    args, opts = make_mla_problem(case, seed=32)
    cfg = regime_config(args, opts, "latency")
    assert cfg.parts > 1 and cfg.tpb == 1
    check(args, opts, cfg)


FULL_CASES = [
    MlaCase(T=300, **DEEPSEEK_TP8),
    MlaCase(T=260, **DEEPSEEK_TP8, layout="split", cache_dtype=FN, q_out_dtype=FNUZ, index_dtype="int64"),
    MlaCase(T=33, QH=8, Dn=128, Dc=512, Dr=64, BS=64, NB=2, dtype=F16, is_neox=True, full=True, precision="native"),
    MlaCase(T=17, QH=3, Dn=40, Dc=24, Dr=6, BS=3, NB=20, dtype=F32, is_neox=True, cache_dtype=FN),  # odd half
    MlaCase(T=11, QH=2, Dn=20, Dc=12, Dr=4, BS=5, dtype=BF16, table_dtype=F16, precision="native", layers=2),
]


@pytest.mark.full
@pytest.mark.parametrize("case,regime", [pytest.param(c, r, id=f"{c.id}-{r}") for c in FULL_CASES + CASES + E5M2_FULL_CASES
                                         for r in ("latency", "bandwidth") if r == "bandwidth" or c.T <= K.LATENCY_TOKENS])
def test_emulated_kernel_matches_reference_full(case, regime):
    args, opts = make_mla_problem(case, seed=33)
    check(args, opts, regime_config(args, opts, regime))


@pytest.mark.parametrize("layout", ["combined", "split"])
def test_emulated_stacked_layers(layout):
    """Stacked caches [L, NB, ...]: the layer comes from its operand on the device; one in range
    writes exactly that layer, one outside [0, L) writes nothing."""
    case = MlaCase(T=9, layers=3, layout=layout, cache_dtype=FN if layout == "split" else None)
    for layer in (1, 0, -1, 3, 2**31 - 1):
        args, opts = make_mla_problem(case, seed=34, layer=np.array(layer, np.int32))
        cfg = regime_config(args, opts, "latency")
        assert cfg.layer_blocks == np.asarray(mla_contract.cache_tuple(args[4], layout)[0]).shape[1]
        check(args, opts, cfg)


@pytest.mark.parametrize("candidate", [1, 2])
def test_emulated_occupancy_candidates(candidate):
    """The narrower candidates (the lowering may take them) compute the same bits."""
    case = MlaCase(T=6, QH=4, Dn=64, Dc=64, Dr=32, is_neox=candidate == 2, cache_dtype=FN, q_out_dtype=FNUZ)
    args, opts = make_mla_problem(case, seed=35)
    for regime in ("latency", "bandwidth"):
        cands = rocm_kernel.occupancy_candidates(regime_config(args, opts, regime), K)
        cfg = cands[-1][0]
        assert cfg.w < cands[0][0].w and cfg.rw < cands[0][0].rw
        check(args, opts, cfg)


def _mutant(tmp_path, old, new):
    """The kernel module with `old` replaced by `new` in its source or, where it is not there, in
    the copy of its base (rope_cache_flydsl.py: the rotation both kernels share) beside it."""
    src_dir = os.path.dirname(K.__file__)
    with open(K.__file__) as f:
        src = f.read()
    with open(os.path.join(src_dir, "rope_cache_flydsl.py")) as f:
        base = f.read()
    if src.count(old) == 1:
        src = src.replace(old, new)
    else:
        assert src.count(old) == 0 and base.count(old) == 1, old
        base = base.replace(old, new)
    (tmp_path / "rope_cache_flydsl.py").write_text(base)
    path = tmp_path / "mla_cache_flydsl.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"_mla_mutant_{abs(hash(new))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("what,old,new", [
    ("sin's sign", "ya.append(E.arith.subf(E.arith.mulf(xa[i], ca[i]), E.arith.mulf(xb[i], sa[i])))",
     "ya.append(E.arith.addf(E.arith.mulf(xa[i], ca[i]), E.arith.mulf(xb[i], sa[i])))"),
    ("latent chunk offset", "el = E.add(E.mul(st[\"s\"], c64(ROW0)), E.ext64(E.mul(st[\"jl\"], c32(W))))",
     "el = E.mul(st[\"s\"], c64(ROW0))"),
    ("slot bound", "E.cmp(\"slt\", s, num_slots)", "E.cmp(\"sle\", s, num_slots)"),
])
def test_emulator_catches_a_wrong_kernel(what, old, new, tmp_path):
    case = MlaCase(T=9, BS=8, NB=2)  # slots == NB*BS present; copy and rotation units in one iteration
    args, opts = make_mla_problem(case, seed=36)
    check(args, opts)
    bad = _mutant(tmp_path, old, new)
    with pytest.raises((AssertionError, IndexError), match="differ|beyond|past a buffer|in no buffer"):
        check(args, opts, rocm_kernel.kernel_config(mla_contract.check_mla(*args, **opts), bad), bad)


# ---- compiled code objects ------------------------------------------------------------------------------
def spec_of(case: MlaCase, T: int):
    args, opts = make_mla_problem(dataclasses.replace(case, T=min(case.T, 4)), seed=0)
    return dataclasses.replace(mla_contract.check_mla(*args, **opts), num_tokens=T)


def check_code_object(o, symbol):
    cfg = o.config
    info = amdgpu_elf.kernel_info(o.code)
    n = K.kernel_args(cfg)
    assert n == (30 if cfg.split else 27)
    assert info["target"].endswith(o.arch), info["target"]
    assert info["args"] == [dict(offset=8 * i, size=8, kind="by_value") for i in range(n)], info["args"]
    assert info["kernarg_size"] == 8 * n
    assert info["private_segment_size"] == 0, "scratch memory used"
    assert info["vgpr_spill_count"] == 0 and info["sgpr_spill_count"] == 0
    assert info["vgpr_count"] <= 64, f"{info['vgpr_count']} VGPRs (> 64: fewer than 8 waves per SIMD)"
    assert info["sgpr_count"] <= 102
    assert info["group_segment_size"] == 0 and info["agpr_count"] == 0 and info["wavefront_size"] == 64
    assert list(info["reqd_workgroup_size"]) == [cfg.nt, 1, 1]
    assert info["name"] == symbol == "jrc_mla_cache_0"
    return info


COMPILE_DEFAULT = [
    MlaCase(**DEEPSEEK_TP8),
    MlaCase(**DEEPSEEK_TP8, layout="split", cache_dtype=FNUZ, q_out_dtype=FN, precision="native", is_neox=True,
            layers=61, index_dtype="int64"),
]
COMPILE_FULL = CASES + [
    MlaCase(QH=128, Dn=128, Dc=512, Dr=64, BS=64, dtype=F16, is_neox=True, full=True),  # TP1, q not absorbed
    MlaCase(QH=8, Dn=512, Dc=512, Dr=64, BS=1, dtype=F32, cache_dtype=FN, index_dtype="int64", layers=61),
    MlaCase(**DEEPSEEK_TP8, cache_dtype=FN, table_dtype=BF16, precision="native", full=True),
]


def _compile_both(case, T):
    cfg = rocm_kernel.kernel_config(spec_of(case, T), K)
    assert cfg.latency == (T <= 256)
    table, symbol, objs = rocm_kernel.build_code_table(cfg, ARCHS)
    assert [o.arch for o in objs] == list(ARCHS) and len({o.config for o in objs}) == 1
    assert launcher.unpack_code_table(table) == [(launcher.KIND_AMDGPU, a, o.code) for a, o in zip(ARCHS, objs)]
    return [check_code_object(o, symbol) for o in objs]


@needs_flydsl
@pytest.mark.parametrize("T", [1, 8192], ids=["latency", "bandwidth"])
@pytest.mark.parametrize("case", COMPILE_DEFAULT, ids=[c.id for c in COMPILE_DEFAULT])
def test_compiles_for_both_archs(case, T):
    _compile_both(case, T)


@needs_flydsl
@pytest.mark.full
@pytest.mark.parametrize("T", [1, 200, 8192])
@pytest.mark.parametrize("case", COMPILE_FULL, ids=[c.id for c in COMPILE_FULL])
def test_compiles_for_both_archs_full(case, T):
    _compile_both(case, T)


FMA = re.compile(r"^\s*(v_(?:pk_)?(?:fma|fmac|mac)\w*|v_mad_(?:f|mix|legacy)\w*|v_fma_mix\w*|v_dot\w*)\s", re.M)


def _fma_outside_division(isa: str) -> list[str]:
    """Float FMA-like instructions, except those of the IEEE division of 1/scale (v_div_scale ..
    v_div_fixup)."""
    out, inside = [], False
    for line in isa.splitlines():
        op = line.strip().split(" ")[0]
        if op.startswith("v_div_scale_f32"):
            inside = True
        elif inside and op.startswith("v_div_fixup_f32"):
            inside = False
        elif FMA.match(line) and not inside:
            out.append(line.strip())
    return out


@needs_flydsl
@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full)])
def test_isa_roundings_and_wide_accesses(arch):
    """fp32 arithmetic (with an fp8 cache and q_out: the 1/scale divisions) has no fused float
    multiply-add; "fused" native arithmetic has its FMA; 16-byte buffer loads and stores; f32
    denormals kept (the descriptor's FLOAT_DENORM_MODE: flush none)."""
    plain = MlaCase(**DEEPSEEK_TP8, cache_dtype=FN, q_out_dtype=FN)
    fused = MlaCase(**DEEPSEEK_TP8, precision="native", table_dtype=F32)
    for case, want_fma in ((plain, False), (fused, True)):
        isa = flydsl.isa(rocm_kernel.kernel_config(spec_of(case, 8192), K), arch)
        assert "s_endpgm" in isa and "scratch_" not in isa
        assert bool(_fma_outside_division(isa)) == want_fma, _fma_outside_division(isa)[:8]
        ops = set(re.findall(r"^\s*((?:buffer|global)_(?:load|store)_\w+)", isa, re.M))
        assert {"buffer_load_dwordx4", "buffer_store_dwordx4"} <= ops, ops
        modes = dict(re.findall(r"^\s*\.amdhsa_(float_denorm_mode_32|float_denorm_mode_16_64)\s+(\d+)", isa, re.M))
        assert modes == {"float_denorm_mode_32": "3", "float_denorm_mode_16_64": "3"}, modes


# ---- the lowering for ROCm on this machine ----------------------------------------------------------------
@needs_flydsl
def test_lowering_for_rocm_is_one_launcher_call_with_both_archs():
    import jax_rope_cache as jrc
    from jax_rope_cache import api
    from test_rocm_compile import custom_calls

    case = MlaCase(T=4, **DEEPSEEK_TP8, layout="split", cache_dtype=FN)
    args, opts = make_mla_problem(case, seed=37)

    def step(*a):
        return jrc.mla_rope_and_cache(*a, **opts, impl="kernel")

    exp = jax.export.export(jax.jit(step), platforms=["rocm"], disabled_checks=api.DISABLED_EXPORT_CHECKS)(*args)
    text = exp.mlir_module()
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) in ([launcher.GPU_TARGET], [launcher.GPU_TARGET_NO_GRAPH])
    assert "output_operand_aliases" in text and "operand_index = 4" in text and "operand_index = 5" in text
    (_, attrs), = [c for c in custom_calls(exp) if c[0].startswith("jax_rope_cache_gpu")]
    entries = launcher.unpack_code_table(attrs["code"])
    assert [(k, a) for k, a, _ in entries] == [(launcher.KIND_AMDGPU, "gfx942"), (launcher.KIND_AMDGPU, "gfx950")]
    cfg = rocm_kernel.build_code_table(rocm_kernel.kernel_config(mla_contract.check_mla(*args, **opts), K),
                                       ARCHS)[2][0].config
    assert attrs["kernel"] == b"jrc_mla_cache_0"
    assert (attrs["block"], attrs["grid_div"], attrs["grid_y"], attrs["smem"]) == (cfg.nt, cfg.tpb, cfg.parts, 0)
    assert cfg.latency and cfg.parts > 1
    for _, arch, code in entries:
        assert amdgpu_elf.kernel_info(code)["kernarg_size"] == 240  # split: 13 operands, 4 results, 13 dims


def test_without_flydsl_kernel_raises_and_default_falls_back(monkeypatch, tmp_path):
    import jax_rope_cache as jrc
    from jax_rope_cache import api

    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_ROPE_CACHE_ROCM_BUNDLE", raising=False)
    monkeypatch.setattr(flydsl, "_mem", {})
    monkeypatch.setattr(flydsl, "available", lambda: False)
    monkeypatch.setattr(flydsl, "unavailable_reason", lambda: "the Python package 'flydsl' is not installed")
    args, opts = make_mla_problem(MlaCase(T=3), seed=38)

    def export(impl):
        return jax.export.export(jax.jit(lambda *a: jrc.mla_rope_and_cache(*a, **opts, impl=impl)),
                                 platforms=["rocm"], disabled_checks=api.DISABLED_EXPORT_CHECKS)(*args)

    with pytest.raises(RuntimeError, match=r"pip install .flydsl"):
        export("kernel")
    with pytest.warns(RuntimeWarning, match="XLA"):
        exp = export(None)
    assert "stablehlo.custom_call" not in exp.mlir_module()


# ---- cache keys ----------------------------------------------------------------------------------------------
def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_code_object_keys():
    """The main kernel's key is sha256 over (tag, sha256(sha(its source) + sha(the driver)), config,
    arch), as before the MLA kernel; the MLA kernel's covers its own source and the main one's."""
    main = flydsl_kernel_module()
    from conftest import make_spec
    from jax_rope_cache.backends import rocm

    cfg = rocm.kernel_config(make_spec(T=8), main)
    src = hashlib.sha256((_sha(flydsl.kernel_source_path()) + _sha(flydsl.worker_path())).encode()).hexdigest()
    h = hashlib.sha256()
    for part in (flydsl.KEY_TAG, src, cfg.key(), "gfx942"):
        h.update(part.encode() + b"\0\1")
    assert flydsl.key_for(cfg, "gfx942") == h.hexdigest()
    mla = rocm_kernel.kernel_config(spec_of(MlaCase(), 8), K)
    assert flydsl.kernel_of(mla) == "mla_cache" and flydsl.kernel_of(cfg) == "rope_cache"
    both = hashlib.sha256((_sha(flydsl.kernel_source_path("mla_cache")) + _sha(flydsl.kernel_source_path())
                           + _sha(flydsl.worker_path())).encode()).hexdigest()
    assert flydsl._source_hash("mla_cache") == both
    assert len({flydsl.key_for(mla, a) for a in ARCHS} | {flydsl.key_for(cfg, a) for a in ARCHS}) == 4


# ---- ahead-of-time compilation (`compile --mla-preset / --mla-heads`) --------------------------------
def test_mla_presets_compile_what_their_calls_look_up():
    """`compile --mla-preset deepseek-v3 --tp 8` builds the configurations a decode call (absorbed q_nope,
    T <= 256: latency) and a prefill-sized call (bandwidth) of that shard look up, both layouts."""
    from jax_rope_cache.cli import aot

    built = aot.mla_preset_configs("deepseek-v3", 8)
    assert len(built) == 4 and {(c.qh, c.dn, c.dc, c.dr, c.neox) for c in built} == {(16, 512, 512, 64, False)}
    for layout in ("combined", "split"):
        case = MlaCase(QH=16, Dn=512, Dc=512, Dr=64, BS=16, layout=layout)
        for T in (4, 4096):
            assert rocm_kernel.kernel_config(spec_of(case, T), K) in built, (layout, T)
    plain = aot.mla_preset_configs("deepseek-v3", 8, nope=("plain",), layouts=("combined",), regimes=("latency",))
    assert [c.dn for c in plain] == [128]
    fp8 = aot.mla_configs_for(q_heads=4, nope_dim=32, latent_dim=64, rope_dim=16, layouts=("split",), block_sizes=(8,),
                              cache_dtypes=("float8_e4m3fn",), q_out_dtypes=("same", "float8_e4m3fn"),
                              regimes=("bandwidth",))
    fp8_case = MlaCase(layout="split", cache_dtype=FN, q_out_dtype=FN)
    assert len(fp8) == 2 and rocm_kernel.kernel_config(spec_of(fp8_case, 4096), K) in fp8
    with pytest.raises(ValueError, match="cache_dtypes: expected 'same'"):
        aot.mla_configs_for(q_heads=4, nope_dim=32, latent_dim=64, rope_dim=16, cache_dtypes=("float16",))
    with pytest.raises(ValueError, match="layout"):
        aot.mla_configs_for(q_heads=4, nope_dim=32, latent_dim=64, rope_dim=16, layouts=("flash",))


@needs_flydsl
def test_compile_cli_precompiles_mla_shapes(tmp_path, monkeypatch, capsys):
    """`compile --mla-heads` fills the disk cache and a bundle; then a host without FlyDSL lowers that
    shape's calls (decode- and prefill-sized) from them, compiling nothing."""
    from jax_rope_cache.cli import aot

    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(flydsl, "_mem", {})
    bundle = tmp_path / "mla.jrcbundle"
    aot.main(["--arch", ",".join(ARCHS), "--mla-heads", "4,32,64,16", "--mla-layout", "split", "--block-size", "8",
              "--bundle", str(bundle)])
    err = capsys.readouterr().err
    assert "4 code objects (2 configurations x 2 archs)" in err, err
    assert len(list((tmp_path / "cache" / "rocm").glob("*.hsaco.jrc"))) == 4 and bundle.stat().st_size > 0
    monkeypatch.setattr(flydsl, "_compile_now", lambda *a, **k: pytest.fail("compiled instead of using the cache"))
    monkeypatch.setattr(flydsl, "available", lambda: False)
    for source, env in (("disk", {}), ("bundle", {"JAX_ROPE_CACHE_DIR": str(tmp_path / "empty"),
                                                  "JAX_ROPE_CACHE_ROCM_BUNDLE": str(bundle)})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for T in (3, 4096):
            monkeypatch.setattr(flydsl, "_mem", {})
            cfg = rocm_kernel.kernel_config(spec_of(MlaCase(layout="split"), T), K)
            _, _, objs = rocm_kernel.build_code_table(cfg, ARCHS)
            assert [o.arch for o in objs] == list(ARCHS) and all(o.from_disk for o in objs), (source, T)
            assert all(o.origin.startswith(source) for o in objs), [o.origin for o in objs]
    with pytest.raises(SystemExit):
        aot.main(["--mla-heads", "4,32,64"])
    assert "--mla-heads: expected QH,Dn,Dc,Dr" in capsys.readouterr().err
