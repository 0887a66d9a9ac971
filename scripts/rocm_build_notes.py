"""Prints the ROCm build-notes tables: per variant and arch, VGPR/SGPR counts (code-object
metadata) and the global memory instructions of the ISA with their widths.

    python scripts/rocm_build_notes.py            # our kernel
    python scripts/rocm_build_notes.py --upstream /path/to/FlyDSL/checkout   # + upstream kernel
(needs flydsl; compiles only, never launches)
"""

import argparse
import collections
import os
import re
import sys
import tempfile

import numpy as np

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


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--upstream")
    a = p.parse_args()
    ours()
    occupancy_table()
    if a.upstream:
        upstream(a.upstream)
