"""``argparse`` value types shared by the ``pisa-attn`` commands.

Each one rejects a bad value with ``argparse.ArgumentTypeError``, so the command stops with
``error: argument --flag: ...`` (exit 2) before any work starts. No torch import here: the parsers
are built before the command's work is.
"""

from __future__ import annotations

import argparse
import os


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def density(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"density must be in (0, 1], got {text}")
    return value


def block_size(text: str) -> int:
    value = int_at_least(16)(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"block size must be a power of two >= 16, got {value}")
    return value


def head_dim(text: str) -> int:
    value = int_at_least(16)(text)
    if value > 256 or value % 2:
        raise argparse.ArgumentTypeError(f"head dim must be even and in [16, 256], got {value}")
    return value


def comma_list(item):
    """``"a,b,c"`` -> a tuple of ``item(a), item(b), item(c)``; at least one entry."""

    def parse(text: str) -> tuple:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(item(x) for x in parts)

    return parse


def one_of(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r} (no such file)")
    return text


def existing_file_or(word: str):
    """``word`` itself, or the path of a file that exists."""

    def parse(text: str) -> str:
        if text != word and not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"expected {word!r} or an existing file, got {text!r} (no such file)")
        return text

    return parse
