"""How the CLI shows things: sizes, ages, tables, JSON, and progress lines on stderr."""

from __future__ import annotations

import argparse
import json
import sys
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
