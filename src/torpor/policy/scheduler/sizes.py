"""Memory sizes as users write them (``500M``, ``4G``, ``1.5G``, ``512Ki``) and back.

Units are binary (``K`` = 1024, as ``free``, cgroups and ``ps`` count): K, M, G, T, each optionally with
``i`` and/or ``B`` (``4G``, ``4Gi``, ``4GiB``, ``4GB`` are all 4 × 2³⁰ bytes); a plain number is bytes.
The submit path and ``torpor agent --memory-budget`` read sizes here, so both refuse the same things
with the same one-line message; the caller turns the ValueError into its own error.
"""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([KMGT]?)(?:I?B?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """The number of bytes ``text`` says; a ValueError (one line, with an example) when it is no size.

    A fraction is rounded down to whole bytes (``1.5K`` is 1536); zero is a size (the caller decides
    whether it makes sense); negative, infinite, unit-only and unknown units are refused.
    """
    match = _SIZE.fullmatch(text.strip())
    if match is None or not text.strip():
        raise ValueError(f"'{text}' is not a size: write a number and a unit, e.g. 500M, 4G, 1.5G, 512Ki")
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.upper()]
    if not math.isfinite(value):
        raise ValueError(f"'{text}' is not a finite size")
    return int(value)


def format_size(size: int) -> str:
    """``size`` bytes in the largest unit that keeps one decimal honest (``1.5G``, ``512M``, ``100``)."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit]
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.0f}{unit}" if value.is_integer() else f"{value:.1f}{unit}"
    return str(size)
