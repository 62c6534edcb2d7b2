"""Command-line values the benchmarks share: comma-separated lists of numbers, checked where argparse reads them,
so a bad value stops the command at once with argparse's usage line and a message saying what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def number_list(kind: type[int] | type[float], low: float, high: float | None = None,
                low_open: bool = False) -> Callable[[str], list]:
    """An argparse `type` for "a,b,c": a non-empty list of `kind`, each >= `low` (> `low` when `low_open`) and
    <= `high` when given."""
    above = f"> {low}" if low_open else f">= {low}"
    expected = f"comma-separated {kind.__name__}s {above}" + (f" and <= {high}" if high is not None else "")

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not values or any((v <= low if low_open else v < low) or (high is not None and v > high) for v in values):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    return parse


positive_ints = number_list(int, 1)


def positive_int(text: str) -> int:
    """An argparse `type` for one whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value
