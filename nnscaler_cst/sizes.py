"""Byte sizes as people write them (`24GiB`, `80GB`, `512MiB`, `4.5e9`) and as we print them."""
from __future__ import annotations

import re

# Decimal prefixes are powers of 1000 (as device sheets count: "A100 80GB"), binary ones of 1024.
_UNITS = {"": 1, "b": 1,
          "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int | float) -> float:
    """Bytes in ``text``; ValueError naming the accepted forms when it is not a positive size."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _SIZE.fullmatch(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size: write bytes (4.5e9) or a number with a unit "
                             "(512MiB, 24GiB, 80GB)")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def format_bytes(value: float) -> str:
    """``4.27 MiB``: three significant figures in the largest binary unit below the value."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"
