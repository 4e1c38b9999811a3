"""Argparse types for flag values: sizes (512M), durations (30d), rates (40G), positive numbers."""

from __future__ import annotations

import argparse
import re


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_duration(text: str) -> float:
    """'3600', '90s', '30m', '12h', '30d' -> seconds (>= 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 90s, 30m, 12h, 30d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_rate(text: str) -> float:
    """A positive rate: 4.8e12, 40G, 989T."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    scale = units.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 4.8e12 or 40G, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def tier_shares_arg(text: str) -> str:
    """`interactive=70,standard=25,batch=5` or `strict`, checked (inferd/engine/tier_shares.py) and written out
    canonically."""
    from ..engine.tier_shares import TierShares

    try:
        return str(TierShares.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
