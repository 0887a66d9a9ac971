"""Regenerates tests/data/hf_qk_norm.npz: transformers' Qwen3 q_norm / k_norm (Qwen3RMSNorm) then
apply_rotary_pos_emb on seeded inputs at Qwen3-32B TP8 and Qwen3-235B-A22B TP4 shapes, bfloat16
and float32 (needs torch + transformers; the cases and inputs are tests/test_hf_qk_norm.py's).

    python tools/record_hf_qk_norm.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_hf_qk_norm  # noqa: E402

if __name__ == "__main__":
    out = test_hf_qk_norm.record_hf()
    size = os.path.getsize(test_hf_qk_norm.FIXTURE)
    print(f"wrote {test_hf_qk_norm.FIXTURE}: {len(test_hf_qk_norm.CASES)} cases, {size // 1024} KiB, "
          f"transformers {out['transformers_version']}")
