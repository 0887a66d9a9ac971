"""Prints the ROCm build-notes tables: per variant and arch, VGPR/SGPR counts (code-object
metadata) and the global memory instructions of the ISA with their widths.

    python tools/rocm_build_notes.py --regimes --write docs/rocm.md   # the regime table, in place
    python tools/rocm_build_notes.py            # the per-variant and occupancy tables
    python tools/rocm_build_notes.py --upstream /path/to/FlyDSL/checkout   # + upstream kernel
(needs flydsl; compiles only, never launches; the regime table's instruction counts come from the
lane emulator, tests/rocm_emulator.py)
"""

import argparse
import collections
import os
import re
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # rocm_emulator

from jax_rope_cache import contract
from jax_rope_cache.backends import rocm
from jax_rope_cache.cli import aot
from jax_rope_cache.compilers import flydsl
from jax_rope_cache.models import presets

GMEM = re.compile(r"^\s*((?:buffer|global|flat)_(?:load|store)_\w+)", re.M)
WIDTH = {"byte": 1, "ubyte": 1, "sbyte": 1, "short": 2, "ushort": 2, "sshort": 2, "dword": 4, "dwordx2": 8,
         "dwordx3": 12, "dwordx4": 16, "b8": 1, "b16": 2, "b32": 4, "b64": 8, "b128": 16}


def summarize(isa: str) -> str:
    c = collections.Counter(GMEM.findall(isa))
    parts = []
    for op, n in sorted(c.items()):
        w = WIDTH.get(op.split("_")[-1], "?")
        parts.append(f"{n}x {op} ({w} B)")
    return ", ".join(parts)


VARIANTS = [  # (label, options for configs_for)
    ("flash bf16, f32 table, NeoX, fp32", dict(layouts=("flash",))),
    ("xpacked_shuffled bf16 -> fp8 e4m3fnuz, NeoX, native", dict(layouts=("xpacked_shuffled",),
                                                                cache_dtypes=("float8_e4m3fnuz",),
                                                                precisions=("native",), table_dtypes=("bfloat16",))),
    ("xpacked f16 -> fp8 e4m3fn, GPT-J, full table", dict(layouts=("xpacked",), dtypes=("float16",),
                                                         cache_dtypes=("float8_e4m3fn",), neox=(False,),
                                                         tables=("full",))),
]


def occupancy(base, co) -> str:
    """' (w_rot 4, waves_per_eu 8)' when the occupancy search built another candidate than `base`."""
    c, parts = co.config, []
    if c.w_rot != base.w_rot:
        parts.append(f"w_rot {c.w_rot}")
    if (c.w_pass, c.w_v) != (base.w_pass, base.w_v):
        parts.append(f"w_pass/w_v {c.w_pass}/{c.w_v}")
    if co.hints:
        parts += [f"{k} {v}" for k, v in co.hints.items()]
    return f" ({', '.join(parts)})" if parts else ""


def ours():
    print("| model (per shard) | variant | arch | VGPR | SGPR | NT x TPB | global memory instructions (width) |")
    print("|---|---|---|---|---|---|---|")
    for name, tp in (("llama-3.1-8b", 1), ("llama-3.1-70b", 8), ("gpt-oss-120b", 8), ("gpt-oss-120b", 1)):
        m = presets.model_shape(name, tp)
        mname = m.name
        for label, opts in VARIANTS:
            cfg = aot.configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
                                   rotary_dim=m.rotary_dim, **opts)[0]
            for co in rocm.build_code_table(cfg, ("gfx942", "gfx950"))[2]:  # the occupancy candidate built
                i, c = co.info, co.config
                isa = flydsl.isa(c, co.arch, co.hints)
                print(f"| {mname} ({m.q_heads}x{m.kv_heads}x{m.head_dim}) | {label} | {co.arch} | {i['vgpr_count']} | "
                      f"{i['sgpr_count']} | {c.nt} x {c.tpb}{occupancy(cfg, co)} | {summarize(isa)} |")
    m = presets.MODELS["llama-3.1-8b"]
    cfg = aot.configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=128, rotary_dim=64,
                           layouts=("flash",))[0]
    for co in rocm.build_code_table(cfg, ("gfx942", "gfx950"))[2]:
        i, c = co.info, co.config
        print(f"| llama-3.1-8b, partial R=64 | flash bf16 NeoX fp32 | {co.arch} | {i['vgpr_count']} | {i['sgpr_count']} | "
              f"{c.nt} x {c.tpb}{occupancy(cfg, co)} | {summarize(flydsl.isa(c, co.arch, co.hints))} |")


def upstream(root):
    """Upstream ROCm/FlyDSL fused_rope_cache_kernel compiled the same way (COMPILE_ONLY)."""
    import torch

    sys.path.insert(0, root)
    from kernels.attention.fused_rope_cache_kernel import build_fused_rope_cache_module

    print("\n| model | upstream variant | arch | VGPR | SGPR | global memory instructions (width) |")
    print("|---|---|---|---|---|---|")
    for name, tp in (("llama-3.1-8b", 1), ("llama-3.1-70b", 8), ("gpt-oss-120b", 8), ("gpt-oss-120b", 1)):
        m = presets.model_shape(name, tp)
        mname = m.name
        for flash in (True, False):
            for arch in ("gfx942", "gfx950"):
                T, NB, BS, D = 4, 8, 16, m.head_dim
                with tempfile.TemporaryDirectory() as d, flydsl._compile_env(arch):
                    os.environ.update(COMPILE_ONLY="1", FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=d,
                                      FLYDSL_RUNTIME_ENABLE_CACHE="0")
                    try:
                        fn = build_fused_rope_cache_module(head_dim=D, num_q_heads=m.q_heads,
                                                           num_kv_heads=m.kv_heads, block_size=BS,
                                                           flash_layout=flash, dtype_str="bf16")
                        bf = torch.bfloat16
                        q = torch.zeros(T, m.q_heads, D, dtype=bf)
                        k = torch.zeros(T, m.kv_heads, D, dtype=bf)
                        kc = torch.zeros((NB, BS, m.kv_heads, D) if flash else (NB, m.kv_heads, D // 16, BS, 16),
                                         dtype=bf)
                        vc = torch.zeros((NB, BS, m.kv_heads, D) if flash else (NB, m.kv_heads, D, BS), dtype=bf)
                        cos = torch.zeros(64, D // 2, dtype=bf)
                        idx = torch.zeros(T, dtype=torch.int32)
                        one = torch.ones(1, dtype=torch.float32)
                        fn(q, k, k.clone(), idx, cos, cos.clone(), idx.clone(), kc, vc, q.clone(), k.clone(), T,
                           one, one.clone())
                        isa = ""
                        for r, _, files in os.walk(d):
                            for f in files:
                                if f.endswith(".s"):
                                    isa += open(os.path.join(r, f)).read()
                    finally:
                        for kk in ("COMPILE_ONLY", "FLYDSL_DEBUG_DUMP_ASM", "FLYDSL_DUMP_DIR",
                                   "FLYDSL_RUNTIME_ENABLE_CACHE"):
                            os.environ.pop(kk, None)
                v = re.search(r"\.vgpr_count:\s+(\d+)", isa)
                s = re.search(r"\.sgpr_count:\s+(\d+)", isa)
                print(f"| {mname} | {'flash' if flash else 'x-packed'} bf16 NeoX | {arch} | {v and v.group(1)} | "
                      f"{s and s.group(1)} | {summarize(isa)} |")


OCCUPANCY_VARIANTS = VARIANTS + [
    ("flash bf16, bf16 table, NeoX, native (upstream's config)", dict(layouts=("flash",), table_dtypes=("bfloat16",),
                                                                     precisions=("native",))),
    ("xpacked bf16, bf16 table, NeoX, native (upstream's config)", dict(layouts=("xpacked",),
                                                                       table_dtypes=("bfloat16",),
                                                                       precisions=("native",))),
]


def occupancy_table():
    """Per variant and arch: the configuration as made (VGPRs, spills) and the occupancy candidate
    the lowering builds (backends/rocm.occupancy_candidates)."""
    print("\n| model (per shard) | variant | arch | VGPR as made (spill, scratch B) | built | VGPR built |")
    print("|---|---|---|---|---|---|")
    for name, tp in (("llama-3.1-8b", 1), ("llama-3.1-70b", 8), ("gpt-oss-120b", 8), ("gpt-oss-120b", 1)):
        m = presets.model_shape(name, tp)
        for label, opts in OCCUPANCY_VARIANTS:
            cfg = aot.configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
                                  rotary_dim=m.rotary_dim, **opts)[0]
            for co in rocm.build_code_table(cfg, ("gfx942", "gfx950"))[2]:
                base = flydsl.compile_config(cfg, co.arch).info
                i = co.info
                print(f"| {m.name} ({m.q_heads}x{m.kv_heads}x{m.head_dim}) | {label} | {co.arch} | "
                      f"{base['vgpr_count']} ({base['vgpr_spill_count']}, {base['private_segment_size']}) | "
                      f"{occupancy(cfg, co).strip(' ()') or 'as made'} | {i['vgpr_count']} |")


# ---- the regime table: latency (decode, T = 1) vs bandwidth (T = 8192) configurations ----------
REGIME_SHAPES = [("llama-3.1-8b", 1, False), ("llama-3.1-70b", 8, False), ("gpt-oss-120b", 8, False),
                 ("gpt-oss-120b", 1, False), ("qwen3-32b", 8, False), ("qwen3-32b", 8, True),
                 ("qwen3-235b-a22b", 4, False), ("qwen3-235b-a22b", 4, True)]
REGIME_T = (("decode T=1", 1), ("T=8192", 8192))
MARK_BEGIN, MARK_END = "<!-- rocm_build_notes.py --regimes: begin -->", "<!-- rocm_build_notes.py --regimes: end -->"


def _operands(cfg, T):
    """The custom call's 14 operands for a call of T tokens of `cfg` (bf16 data, f32 tables, every
    token written to its own slot)."""
    rng = np.random.default_rng(0)
    dtype = {c: np.dtype(d) for d, c in contract.DTYPE_CODES.items()}
    dt, cdt, tdt = dtype[cfg.dt], dtype[cfg.cache_dt], dtype[cfg.tab_dt]
    q, k, v = (rng.standard_normal((T, h, cfg.d)).astype(np.float32).astype(dt) for h in (cfg.qh, cfg.kh, cfg.kh))
    nb = -(-T // cfg.bs)
    layout = [n for n, lt in contract.LAYOUT_TABLE.items() if lt.code == cfg.layout][0]
    kshape, vshape = contract.cache_shapes(layout, nb, cfg.bs, cfg.kh, cfg.d, cdt)
    tw = cfg.r if cfg.full_table else cfg.r // 2
    idx = np.arange(T, dtype=np.int64 if cfg.slot64 else np.int32)
    pos = (np.arange(T) % 64).astype(np.int64 if cfg.pos64 else np.int32)
    tab = rng.uniform(-1, 1, (64, tw)).astype(tdt)
    one = np.ones((), np.float32)
    w = [rng.uniform(0.5, 2, cfg.d).astype(np.float32).astype(dt) if code >= 0 else np.zeros(1, np.float32)
         for code in (cfg.q_norm, cfg.k_norm)]
    return [q, k, v, np.zeros(kshape, cdt), np.zeros(vshape, cdt), idx, pos, tab, tab.copy(), one, one.copy(),
            np.zeros((), np.int32)] + w


def memory_per_element(cfg, T):
    """(vector memory instructions per q/k/v element, of them q/k/v data only, data bytes per data
    instruction) of one call of T tokens, counted in the lane emulator: every buffer/global load and
    store each lane executes (the emitted program; the ISA issues one per lane the same way, its
    waterfall loops around VGPR-selected descriptors aside) over the q/k/v elements the call moves
    (q, k, v read; q_out, k_out, key and value cache written: (2 QH + 4 KH) D per token)."""
    import rocm_emulator as em

    counts, addrs = collections.Counter(), []
    real = (em.rocdl.raw_ptr_buffer_load, em.rocdl.raw_ptr_buffer_store, em.llvm.StoreOp, em.Machine.alloc)

    def note(addr, nbytes):
        lanes = int(np.count_nonzero(em.M.mask[-1]))
        data = addr[0] if isinstance(addr, tuple) else None
        data = em.M.buffer(data)[0] in addrs[:5] + addrs[14:16] if data is not None else True  # caches: global
        counts["all"] += lanes
        if data:
            counts["data"] += lanes
            counts["bytes"] += lanes * nbytes

    def alloc(self, arr):
        a = real[3](self, arr)
        addrs.append(a)
        return a

    def load(ty, rsrc, off, soff):
        note(rsrc.a, em._nbytes(ty))
        return real[0](ty, rsrc, off, soff)

    def store(val, rsrc, off, soff):
        note(rsrc.a, em._nbytes(val.ty))
        return real[1](val, rsrc, off, soff)

    def gstore(val, ptr, alignment=None):
        note(None, em._nbytes(val.ty))
        return real[2](val, ptr, alignment)

    em.rocdl.raw_ptr_buffer_load, em.rocdl.raw_ptr_buffer_store = staticmethod(load), staticmethod(store)
    em.llvm.StoreOp, em.Machine.alloc = staticmethod(gstore), alloc
    try:
        em.run(flydsl.kernel_module(), cfg, _operands(cfg, T))
    finally:
        em.rocdl.raw_ptr_buffer_load, em.rocdl.raw_ptr_buffer_store = staticmethod(real[0]), staticmethod(real[1])
        em.llvm.StoreOp, em.Machine.alloc = staticmethod(real[2]), real[3]
    elems = T * (2 * cfg.qh + 4 * cfg.kh) * cfg.d
    return counts["all"] / elems, counts["data"] / elems, counts["bytes"] / max(1, counts["data"])


def regime_table() -> str:
    out = ["| model (per shard) | QK-norm | call | layout | regime: NT x TPB (x parts), q/k access | VGPR gfx942 / gfx950 | "
           "SGPR gfx942 / gfx950 | vmem instr / element (all; q/k/v data) | data B / instr |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, tp, norm in REGIME_SHAPES:
        m = presets.model_shape(name, tp)
        for call, T in REGIME_T:
            for layout in ("flash", "xpacked"):
                base = aot.configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
                                       rotary_dim=m.rotary_dim, layouts=(layout,),
                                       norm_eps=1e-6 if norm else None)[0]
                cfg = rocm.kernel_config(base, num_tokens=T)
                objs = rocm.build_code_table(cfg, ("gfx942", "gfx950"))[2]
                c = objs[0].config  # the occupancy candidate built (one for both archs)
                tokens = c.tpb if c.tpb > 1 else 1  # bandwidth: one full workgroup = the steady state
                per, data, width = memory_per_element(c, min(T, tokens))
                regime = "latency" if c.latency else "bandwidth"
                hints = "".join(f", {k} {v}" for k, v in (objs[0].hints or {}).items())
                access = c.w_rot * 2  # bf16 bytes per q/k rotation access (x2 chunks for NeoX)
                parts = f" x {c.split} parts" if getattr(c, "split", 1) > 1 else ""  # phase split (grid.y)
                out.append(
                    f"| {m.name} ({m.q_heads}x{m.kv_heads}x{m.head_dim}) | {'q+k' if norm else '-'} | {call} | "
                    f"{'x-packed' if layout == 'xpacked' else layout} | {regime}: {c.nt} x {c.tpb}{parts}, {access} B{hints} | "
                    f"{' / '.join(str(o.info['vgpr_count']) for o in objs)} | "
                    f"{' / '.join(str(o.info['sgpr_count']) for o in objs)} | {per:.3f}; {data:.3f} | {width:.1f} |")
    return "\n".join(out)


def write_between_markers(path, text):
    doc = open(path).read()
    i, j = doc.index(MARK_BEGIN) + len(MARK_BEGIN), doc.index(MARK_END)
    with open(path, "w") as f:
        f.write(doc[:i] + "\n" + text + "\n" + doc[j:])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--upstream")
    p.add_argument("--regimes", action="store_true", help="the latency / bandwidth table only")
    p.add_argument("--write", metavar="BUILD_NOTES.md", help="with --regimes: replace the table between its markers")
    a = p.parse_args()
    if a.regimes:
        table = regime_table()
        if a.write:
            write_between_markers(a.write, table)
        print(table)
    else:
        ours()
        occupancy_table()
        if a.upstream:
            upstream(a.upstream)
