"""Regenerates tests/data/hf_rope.npz: Hugging Face transformers' RoPE inverse frequencies and attention
factors for every scaling-law case and preset of tests/test_rope_tables.py (needs torch + transformers).

    python tools/record_hf_rope.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_rope_tables  # noqa: E402

if __name__ == "__main__":
    out = test_rope_tables.record_hf()
    print(f"wrote {test_rope_tables.HF_FIXTURE}: {len(out) - 2} arrays, transformers {out['transformers_version']}")
