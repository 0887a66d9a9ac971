"""Wording and progress output shared by the commands' reports."""

import sys


def relative_speed(t_other: float, t_ours: float) -> str:
    """'1.25x faster' when t_ours < t_other, '2.1x slower' otherwise (never '0.47x faster')."""
    r = t_other / t_ours
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


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
