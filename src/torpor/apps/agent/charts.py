"""The page's small charts, drawn on the server as inline SVG: a job's memory over the last hour with its
checkpoints and hibernations marked, and the node's memory budget held against free.

Each is a pure function of its data returning the text of one ``<svg>`` element: no script, no reference
to anything outside it (no ``href``, font or image), and every label through :func:`html.escape` (job
names are user input). A chart says what it shows in its ``<title>`` (read out by screen readers, shown as
a tooltip), and each mark and segment has its own. The colours are mid tones that read on a light and a
dark background; text is ``currentColor``, the page's.

What it leaves to others: the samples (:mod:`torpor.apps.agent.history`), where a chart goes on the page
(:mod:`torpor.apps.agent.web`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from torpor.apps.render import human_bytes

#: the kinds of :class:`Mark`: a checkpoint the job ran on through, a hibernation that stopped it
CHECKPOINT, HIBERNATE = "checkpoint", "hibernate"

MEMORY_COLOUR = "#3a7bd5"
CHECKPOINT_COLOUR = "#2a9d5c"
HIBERNATE_COLOUR = "#d0771e"
#: alternate shades of the held part of the budget bar, one segment a job
HELD_COLOURS = ("#3a7bd5", "#6a9be3")
OVER_COLOUR = "#d33"
GRID_COLOUR = "#8886"
#: marks drawn on one chart at most, the newest (a job checkpointed every second has 3600 an hour)
MAX_MARKS = 240

_FONT = 'font-family="system-ui, sans-serif" font-size="11"'


@dataclass(frozen=True)
class Mark:
    """Something that happened to the job at ``at``: a :data:`CHECKPOINT` or a :data:`HIBERNATE`."""

    at: float
    kind: str
    #: what its tooltip says (the checkpoint's id, image size…)
    label: str


def memory_chart(
    job: str,
    samples: Sequence[tuple[float, int]],
    marks: Sequence[Mark],
    now: float,
    *,
    window_s: float = 3600.0,
    gap_s: float = 60.0,
    width: int = 560,
    height: int = 160,
) -> str:
    """``job``'s memory over the ``window_s`` before ``now``: an area under a line through ``samples``
    (time, bytes), broken where two samples are more than ``gap_s`` apart (no agent sampled), with a
    dashed line and a dot at each checkpoint and a triangle at each hibernation of ``marks``."""
    left, right, top, bottom = 64, 8, 22, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    start = now - window_s
    shown = sorted((at, max(0, int(size))) for at, size in samples if start <= at <= now)
    peak = max((size for _, size in shown), default=0)
    ceiling = nice_ceiling(peak)
    base = top + plot_h

    def x(at: float) -> float:
        return left + (at - start) / window_s * plot_w

    def y(size: int) -> float:
        return base - size / ceiling * plot_h

    parts = [_open(width, height, _memory_title(job, shown, marks, start, now))]
    for fraction in (0.0, 0.5, 1.0):  # the grid, and the sizes it stands for
        level = base - fraction * plot_h
        parts.append(
            f'<line x1="{left}" y1="{level:.1f}" x2="{width - right}" y2="{level:.1f}" '
            f'stroke="{GRID_COLOUR}" stroke-width="1"/>'
            f'<text x="{left - 6}" y="{level + 4:.1f}" text-anchor="end" fill="currentColor" {_FONT}>'
            f"{_e(short_size(round(ceiling * fraction)))}</text>"
        )
    ticks = 4
    for n in range(ticks + 1):
        at = start + window_s * n / ticks
        ago = round((now - at) / 60)
        anchor = "start" if n == 0 else "end" if n == ticks else "middle"
        parts.append(
            f'<text x="{x(at):.1f}" y="{height - 5}" text-anchor="{anchor}" fill="currentColor" '
            f'{_FONT} opacity="0.75">{"now" if ago == 0 else f"-{ago} min"}</text>'
        )
    for run in _runs(shown, gap_s):
        points = " ".join(f"{x(at):.1f},{y(size):.1f}" for at, size in run)
        if len(run) == 1:
            (at, size) = run[0]
            parts.append(f'<circle cx="{x(at):.1f}" cy="{y(size):.1f}" r="2.5" fill="{MEMORY_COLOUR}"/>')
            continue
        parts.append(
            f'<polygon points="{x(run[0][0]):.1f},{base:.1f} {points} {x(run[-1][0]):.1f},{base:.1f}" '
            f'fill="{MEMORY_COLOUR}" fill-opacity="0.18" stroke="none"/>'
            f'<polyline points="{points}" fill="none" stroke="{MEMORY_COLOUR}" stroke-width="1.6" '
            'stroke-linejoin="round"/>'
        )
    if not shown:
        parts.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2 + 4:.1f}" text-anchor="middle" '
            f'fill="currentColor" opacity="0.6" {_FONT}>no memory samples in this hour</text>'
        )
    inside = sorted((mark for mark in marks if start <= mark.at <= now), key=lambda mark: mark.at)
    for mark in inside[-MAX_MARKS:]:
        parts.append(_mark(mark, x(mark.at), top, base))
    parts.append(_legend(width - right, 13))
    parts.append("</svg>")
    return "".join(parts)


def budget_bar(
    budget: int, held_by: Sequence[tuple[str, int]], held: int | None = None, *, width: int = 560
) -> str:
    """The node's memory ``budget`` as one bar: what each job of ``held_by`` (name, bytes) holds, then
    what is free. ``held``: the total held, when more than the jobs named (jobs started with ``torpor
    run`` hold memory too); a budget held beyond its size shows the excess in red."""
    parts_held = [(name, max(0, int(size))) for name, size in held_by if size > 0]
    named = sum(size for _, size in parts_held)
    total_held = max(named, int(held) if held is not None else named)
    if total_held > named:
        parts_held.append(("other jobs (not submitted)", total_held - named))
    free = max(0, budget - total_held)
    scale = max(budget, total_held, 1)
    left, bar_top, bar_h = 1, 20, 22
    bar_w = width - 2
    height = bar_top + bar_h + 6
    share = f" ({total_held / budget:.0%})" if budget > 0 else ""
    title = (
        f"Memory budget {human_bytes(budget)}: held {human_bytes(total_held)}{share}, free {human_bytes(free)}"
        + (f", over by {human_bytes(total_held - budget)}" if total_held > budget else "")
    )
    out = [_open(width, height, title)]
    out.append(
        f'<text x="{left}" y="13" fill="currentColor" {_FONT}>held {_e(human_bytes(total_held))}{_e(share)}</text>'
        f'<text x="{width - 1}" y="13" text-anchor="end" fill="currentColor" {_FONT}>free '
        f"{_e(human_bytes(free))} of {_e(human_bytes(budget))}</text>"
    )
    out.append(
        f'<rect x="{left}" y="{bar_top}" width="{bar_w}" height="{bar_h}" rx="3" fill="{GRID_COLOUR}" '
        f'fill-opacity="0.35"><title>free: {_e(human_bytes(free))}</title></rect>'
    )
    at = float(left)
    for n, (name, size) in enumerate(parts_held):
        segment = size / scale * bar_w
        inside = max(0.0, min(segment, left + budget / scale * bar_w - at))  # within the budget
        over = segment - inside
        label = f"{name}: {human_bytes(size)}"
        colour = HELD_COLOURS[n % len(HELD_COLOURS)]
        out.append(f"<g><title>{_e(label)}</title>")
        if inside > 0:
            out.append(
                f'<rect x="{at:.1f}" y="{bar_top}" width="{inside:.1f}" height="{bar_h}" fill="{colour}"/>'
            )
        if over > 0:
            out.append(
                f'<rect x="{at + inside:.1f}" y="{bar_top}" width="{over:.1f}" height="{bar_h}" '
                f'fill="{OVER_COLOUR}"/>'
            )
        if segment > 7 * len(name) + 10:  # the name inside, where it fits
            out.append(f'<text x="{at + 5:.1f}" y="{bar_top + 15}" fill="#fff" {_FONT}>{_e(name)}</text>')
        out.append("</g>")
        at += segment
    if total_held > budget > 0:
        edge = left + budget / scale * bar_w
        out.append(
            f'<line x1="{edge:.1f}" y1="{bar_top - 3}" x2="{edge:.1f}" y2="{bar_top + bar_h + 3}" '
            'stroke="currentColor" stroke-width="2"/>'
        )
    out.append("</svg>")
    return "".join(out)


def nice_ceiling(peak: int) -> int:
    """A round size at or above ``peak`` (with a little room) for a chart's top: 1, 2, 2.5, 5 or 7.5 times
    a power of ten of the unit (KiB, MiB, GiB, TiB) ``peak`` is counted in; 1 MiB for nothing."""
    if peak <= 0:
        return 1 << 20
    wanted, unit = peak * 1.05, 1
    while unit < 1 << 40 and wanted >= unit * 1000:  # 1000 MiB reads better as 1 GiB than as 1000 MiB
        unit *= 1024
    wanted /= unit
    power = 1.0
    while True:
        for step in (1.0, 2.0, 2.5, 5.0, 7.5):
            if step * power >= wanted:
                # 1000 MiB reads as 1 GiB that it is not: the next unit's 1 instead (where there is one)
                top = 1024 if step * power >= 1000 and unit < 1 << 40 else step * power
                return max(int(top * unit), peak)
        power *= 10


def short_size(n: int) -> str:
    """A size for an axis: ``human_bytes`` without a ``.0`` (``500 MiB``, ``2.5 GiB``)."""
    return human_bytes(n).replace(".0 ", " ")


def _open(width: int, height: int, title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{_e(title)}"><title>{_e(title)}</title>'
    )


def _memory_title(
    job: str, shown: Sequence[tuple[float, int]], marks: Sequence[Mark], start: float, now: float
) -> str:
    counts = {CHECKPOINT: 0, HIBERNATE: 0}
    for mark in marks:
        if start <= mark.at <= now and mark.kind in counts:
            counts[mark.kind] += 1
    memory = (
        f"now {human_bytes(shown[-1][1])}, peak {human_bytes(max(s for _, s in shown))}"
        if shown
        else "no samples"
    )
    return (
        f"Memory of {job} over the last hour: {memory}; "
        f"{counts[CHECKPOINT]} checkpoint(s), {counts[HIBERNATE]} hibernation(s)"
    )


def _runs(shown: Sequence[tuple[float, int]], gap_s: float) -> list[list[tuple[float, int]]]:
    """``shown`` cut where two samples are more than ``gap_s`` apart."""
    runs: list[list[tuple[float, int]]] = []
    for sample in shown:
        if runs and sample[0] - runs[-1][-1][0] <= gap_s:
            runs[-1].append(sample)
        else:
            runs.append([sample])
    return runs


def _mark(mark: Mark, x: float, top: float, base: float) -> str:
    colour = HIBERNATE_COLOUR if mark.kind == HIBERNATE else CHECKPOINT_COLOUR
    if mark.kind == HIBERNATE:
        shape = f'<path d="M{x - 5:.1f},{top - 2:.1f} L{x + 5:.1f},{top - 2:.1f} L{x:.1f},{top + 6:.1f} Z" fill="{colour}"/>'
    else:
        shape = f'<circle cx="{x:.1f}" cy="{top + 1:.1f}" r="3.5" fill="{colour}"/>'
    return (
        f'<g class="mark {_e(mark.kind)}"><title>{_e(mark.label)}</title>'
        f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{base:.1f}" stroke="{colour}" '
        'stroke-width="1" stroke-dasharray="3 2" opacity="0.8"/>'
        f"{shape}</g>"
    )


def _legend(right: float, y: float) -> str:
    """Memory, checkpoint and hibernation keys, ending at ``right``."""
    items = (
        (f'<rect x="0" y="-7" width="12" height="7" fill="{MEMORY_COLOUR}" fill-opacity="0.5"/>', "memory"),
        (f'<circle cx="5" cy="-4" r="3.5" fill="{CHECKPOINT_COLOUR}"/>', "checkpoint"),
        (f'<path d="M0,-8 L10,-8 L5,0 Z" fill="{HIBERNATE_COLOUR}"/>', "hibernation"),
    )
    widths = [16 + 6.2 * len(text) + 12 for _, text in items]
    at = right - sum(widths)
    out = []
    for (key, text), step in zip(items, widths, strict=True):
        out.append(
            f'<g transform="translate({at:.1f},{y:.1f})">{key}'
            f'<text x="16" y="0" fill="currentColor" {_FONT}>{text}</text></g>'
        )
        at += step
    return "".join(out)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
