"""Wording and progress output shared by the commands' reports."""

import sys

import numpy as np


def relative_speed(t_other: float, t_ours: float) -> str:
    """'1.25x faster' when t_ours < t_other, '2.1x slower' otherwise (never '0.47x faster')."""
    r = t_other / t_ours
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


def compare_runs(t_other: list[float], t_ours: list[float]) -> str:
    """The median ratio with its run-to-run range; 'within noise' when the range crosses 1.

    The range pairs each side's fastest run with the other's slowest, so it spans every ratio the
    runs could support."""
    mid = float(np.median(t_other)) / float(np.median(t_ours))
    lo, hi = min(t_other) / max(t_ours), max(t_other) / min(t_ours)
    spread = f"runs {lo:.2f}-{hi:.2f}x, {len(t_ours)} + {len(t_other)} timed"
    if lo <= 1 <= hi:
        return f"within noise (median {mid:.2f}x; {spread})"
    return f"{relative_speed(mid, 1.0)} ({spread})"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on stderr, only when it is a terminal (logs stay clean)."""
    if not sys.stderr.isatty():
        return
    width = 30
    done = int(width * i / max(1, n))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<40}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()
