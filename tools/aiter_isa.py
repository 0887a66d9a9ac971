#!/usr/bin/env python3
"""Which arithmetic does AITER's Triton RoPE kernel compile to, per GPU arch? (no GPU needed)

Compiles AITER's `_fused_qk_rope_reshape_and_cache_kernel` ahead of time with the installed Triton
for AMD (gfx942, gfx950) and NVIDIA (sm_90) targets, for each (input, table) dtype pair, and prints
the floating-point instructions of the result: whether the rotation `x * cos + x_rotated * sin`
becomes an FMA (and in which precision) or separate multiplies and adds. That decides which
formula AITER computes, hence what "native" precision must be to be bit-compatible on that arch.

AITER's source is third-party: it is never part of this repository. Put a copy of the files listed
in ../shared/peers/README.md (step 2, ROCm/aiter at the commit measured there) plus empty
__init__.py files in a git-ignored folder and run:
    PYTHONPATH=.peers/aiter_src python tools/aiter_isa.py [--archs gfx942,gfx950,90]
AMD targets need an ld.lld: TRITON_HIP_LLD_PATH (the ROCm FlyDSL toolkit wrapper works, e.g.
~/.cache/jax_rope_cache/rocm-toolkit-*/llvm/bin/ld.lld).
"""

from __future__ import annotations

import argparse
import itertools
import re


def compile_one(kernel, arch: str, xdt: str, tdt: str, neox: bool, block_h: int) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)
    ptrs = {"q_ptr": xdt, "k_ptr": xdt, "v_ptr": xdt, "pos_ptr": "i64", "cos_ptr": tdt, "sin_ptr": tdt,
            "key_cache_ptr": xdt, "value_cache_ptr": xdt, "slot_mapping_ptr": "i64", "q_out_ptr": xdt,
            "k_out_ptr": xdt, "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
    # Llama-3.1-8B heads (32/8/128), flash layout, bf16 cache, NeoX or GPT-J, as the wrapper launches it
    consts = dict(QH_PER_KH=4, QH=32, KH=8, REUSE_FREQS_FRONT_PART=True, IS_NEOX=neox, BLOCK_D_pe=128,
                  BLOCK_D_HALF_pe=64, BLOCK_SIZE=16, X_SIZE=0, SCALE_K_WIDTH=1, FLASH_LAYOUT=True,
                  VALUE_SHUFFLE_LAYOUT=False, HAVE_POS=False, HAVE_K_SCALE=False, HAVE_V_SCALE=False,
                  HAVE_ZEROS=False, UPCAST_OPERAND=False, BLOCK_H=block_h, KH_BLOCK=max(1, block_h // 4),
                  offs_ptr=None, zeros_out_ptr=None)
    sig = {n: "constexpr" if n in consts else ("*" + ptrs[n] if n in ptrs else "i32") for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs={n: consts[n] for n in kernel.arg_names
                                                                          if n in consts})
    k = triton.compile(src, target=target, options={"num_warps": 1})
    if arch.startswith("gfx"):
        ops = re.findall(r"^\s*(v_\w+)", k.asm["amdgcn"], re.M)
        return sorted(set(o for o in ops if re.search(r"fma|fmac|mac_f|mad_f|mul_f|add_f|sub_f", o)))
    ops = re.findall(r"^\s*((?:fma|mul|add|sub)\.[\w.]+)", k.asm["ptx"], re.M)
    return sorted(set(o for o in ops if re.search(r"f16|bf16|f32", o)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="gfx942,gfx950,90")
    p.add_argument("--block-h", type=int, default=1, help="BLOCK_H (the wrapper uses up to 16 for large T)")
    a = p.parse_args(argv)
    import triton
    from aiter.ops.triton._triton_kernels.fusions.fused_kv_cache import _fused_qk_rope_reshape_and_cache_kernel

    print(f"triton {triton.__version__}; AITER _fused_qk_rope_reshape_and_cache_kernel, BLOCK_H={a.block_h}")
    for arch, (xdt, tdt), style in itertools.product(a.archs.split(","), [("bf16", "bf16"), ("fp16", "fp16"),
                                                                           ("bf16", "fp32"), ("fp16", "fp32")],
                                                     ("neox", "gptj")):
        ops = compile_one(_fused_qk_rope_reshape_and_cache_kernel, arch, xdt, tdt, style == "neox", a.block_h)
        print(f"{arch:7s} x {xdt} table {tdt} {style}: {' '.join(ops)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
