"""Argument checks shared by the command-line tools: every bad value ends in argparse's one-line
`error: ...` and exit status 2, never a traceback or a run that prints nonsense (numpy only).

Type functions (`positive_int`, `one_of(...)`, `csv_of(...)`) check one value as argparse reads it;
`parse_args(parser, argv)` also checks what only the combination says (a preset split over --tp
shards).
"""

from __future__ import annotations

import argparse

from jax_rope_cache.models import presets


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = parse.__qualname__ = what
    parse.__doc__ = f"An integer >= {minimum}."
    return parse


# token counts, steps, layers, block sizes, repeats, TP degrees; prefill tokens (0: decode only)
positive_int = _int_at_least(1, "positive_int")
nonnegative_int = _int_at_least(0, "nonnegative_int")


def output_prefix(text: str) -> str:
    """A path prefix whose folder exists (files <prefix>.json etc. are written there)."""
    import os

    folder = os.path.dirname(text) or "."
    if not text or os.path.basename(text) == "" or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a file prefix in an existing folder, got {text!r}")
    return text


def one_of(choices, what: str = "value"):
    """A type function accepting exactly one of `choices` (listed in the error)."""
    choices = tuple(choices)

    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected a {what} among {', '.join(choices)}; got {text!r}")
        return text

    check.__name__ = what  # argparse names the type in some messages
    return check


def csv_of(item, what: str = "list"):
    """A comma-separated, non-empty tuple, each element through the type function `item`."""

    def check(text: str) -> tuple:
        parts = [x for x in text.split(",") if x]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated {what}, got {text!r}")
        return tuple(item(x) for x in parts)

    check.__name__ = what
    return check


def preset_name(text: str) -> str:
    """A model preset of `jax_rope_cache.models.presets.MODELS`."""
    return one_of(sorted(presets.MODELS), "preset")(text)


def check_model_shards(parser: argparse.ArgumentParser, names, tp: int) -> None:
    """Each preset in `names` must split over `tp` shards; else argparse's error naming --tp."""
    for name in ([names] if isinstance(names, str) else list(names)):
        try:
            presets.model_shape(name, tp)
        except ValueError as e:
            parser.error(f"argument --tp: {name} cannot be split over {tp} shards ({e})")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """parser.parse_args plus the checks of a combination: --preset (one or a list) with --tp."""
    args = parser.parse_args(argv)
    if getattr(args, "preset", None) and getattr(args, "tp", None) is not None:
        check_model_shards(parser, args.preset, args.tp)
    return args
