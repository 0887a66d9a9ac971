"""Regenerates tests/data/hf_mrope.npz: transformers' multimodal RoPE (Qwen2.5-VL sections, Qwen3-VL
interleaved with its QK-RMSNorm) on seeded inputs at per-shard Qwen2.5-VL-7B, Qwen3-VL-8B and
Qwen3-VL-235B-A22B shapes, with the positions of a text + image + text prompt (needs torch +
transformers; the cases and inputs are tests/test_hf_mrope.py's).

    python tools/record_hf_mrope.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_hf_mrope  # noqa: E402

if __name__ == "__main__":
    out = test_hf_mrope.record_hf()
    size = os.path.getsize(test_hf_mrope.FIXTURE)
    print(f"wrote {test_hf_mrope.FIXTURE}: {len(test_hf_mrope.CASES)} cases, {size // 1024} KiB, "
          f"transformers {out['transformers_version']}, torch {out['torch_version']}")
