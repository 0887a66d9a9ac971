"""Wording shared by the commands' reports."""


def relative_speed(t_other: float, t_ours: float) -> str:
    """'1.25x faster' when t_ours < t_other, '2.1x slower' otherwise (never '0.47x faster')."""
    r = t_other / t_ours
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
