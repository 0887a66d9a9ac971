"""Kernel compilers used at lowering time, and the code-object cache they share (cache.py)."""
