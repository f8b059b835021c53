"""How the CLI shows things: sizes, ages, tables, JSON, and progress lines on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence

from torpor.policy.scheduler import format_size


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def size_or_dash(n: int | None) -> str:
    """A size as the scheduler's commands write it (``4G``, ``1.5G``: what ``--memory`` takes), or ``-``."""
    return "-" if n is None else format_size(int(n))


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def human_duration(seconds: float) -> str:
    """A duration for a person, to about three figures: ``850 µs``, ``10.9 ms``, ``3.2 s``, ``4 min 12 s``,
    ``2 h 5 min``, ``3 d 4 h`` (a part that is zero is left out: ``10 min``, not ``10 min 0 s``)."""
    if seconds != seconds or abs(seconds) == float("inf"):  # NaN, infinite: not a duration
        return str(seconds)
    if seconds < 0:
        return "-" + human_duration(-seconds)
    if seconds == 0:
        return "0 s"
    for scale, unit in ((1e-6, "µs"), (1e-3, "ms")):
        if float(text := _figures(seconds / scale)) < 1000:
            return f"{text} {unit}"
    if float(text := f"{seconds:.1f}" if round(seconds, 1) < 10 else f"{seconds:.0f}") < 60:
        return f"{text} s"
    whole = round(seconds)
    for big, small, big_unit, small_unit in (
        (60, 1, "min", "s"),
        (3600, 60, "h", "min"),
        (86400, 3600, "d", "h"),
    ):
        rounded = round(whole / small) * small  # to the smaller unit: 2 h 4 min 40 s is 2 h 5 min
        first, rest = divmod(rounded, big)
        if big == 86400 or first < (60 if big < 3600 else 24):
            return f"{first} {big_unit}" + (f" {rest // small} {small_unit}" if rest else "")
    raise AssertionError("unreachable")


def _figures(value: float) -> str:
    """``value`` to about three figures: 0.5, 1.23, 10.9, 432."""
    if round(value, 2) < 1:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    if round(value, 2) < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if round(value, 1) < 100 else f"{value:.0f}"


def human_time(at: float) -> str:
    """A moment as local time, to the second: ``2026-12-03 14:05:09``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def human_ago(seconds: float) -> str:
    """How long ago, for a person: ``just now``, ``5 s ago``, ``4 min 12 s ago``; ``in 3 s`` ahead."""
    if abs(seconds) < 1:
        return "just now"
    whole = round(abs(seconds))  # to the second: "3 s ago", not "3.2 s ago"
    text = f"{whole} s" if whole < 60 else human_duration(whole)
    return f"in {text}" if seconds < 0 else f"{text} ago"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def emit_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines on stderr, unless ``-q``."""

    def show(text: str) -> None:
        if not args.quiet:
            print(f"  … {text}", file=sys.stderr, flush=True)

    return show
