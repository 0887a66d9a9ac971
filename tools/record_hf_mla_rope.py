"""Regenerates tests/data/hf_mla_rope.npz: transformers' DeepSeek-V3 attention RoPE (YaRN inverse
frequencies, attention factor, cos/sin rows, rotated q_pe and k_pe) for DeepSeek-V3 and Kimi-K2 at TP8,
bf16 and f32 (tests/test_mla_hf.py). Needs torch and transformers, in a separate environment, e.g.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers ml_dtypes numpy
    PYTHONPATH=. /tmp/hfvenv/bin/python tools/record_hf_mla_rope.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_mla_hf  # noqa: E402

if __name__ == "__main__":
    out = test_mla_hf.record_hf()
    print(f"wrote {test_mla_hf.HF_FIXTURE}: {len(out) - 1} arrays, transformers {out['transformers_version']}")
