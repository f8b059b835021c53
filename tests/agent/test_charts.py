"""The page's charts and the memory history they draw, as units.

The charts are SVG text: each must parse as XML (``xml.etree``), hold no script and no reference to
anything outside it, escape every label (job names are user input), and draw something sensible with no
sample, one sample, a flat line, a gap and sizes far beyond a machine's. The history keeps an hour of
samples per job and no more.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from torpor.apps.agent import charts
from torpor.apps.agent.charts import CHECKPOINT, HIBERNATE, Mark
from torpor.apps.agent.history import MemoryHistory, Sample

SVG = "{http://www.w3.org/2000/svg}"
NOW = 1_800_000_000.0
HOSTILE = "<script>alert('x')</script>&\"job\""
MIB = 1 << 20


def parsed(svg: str) -> ET.Element:
    """The chart as XML, checked for what it must never hold."""
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    for element in root.iter():
        assert element.tag.removeprefix(SVG) not in {"script", "foreignObject", "image", "use", "a"}
        for name, value in element.attrib.items():
            assert "href" not in name and not name.startswith("on"), (element.tag, name)
            assert "url(" not in value and "javascript:" not in value
    return root


def texts(root: ET.Element, tag: str) -> list[str]:
    return ["".join(element.itertext()) for element in root.iter(f"{SVG}{tag}")]


def polyline_points(root: ET.Element) -> list[list[tuple[float, float]]]:
    return [
        [(float(x), float(y)) for x, y in (p.split(",") for p in line.attrib["points"].split())]
        for line in root.iter(f"{SVG}polyline")
    ]


def test_a_memory_chart_draws_the_hour_with_its_checkpoints_and_hibernations_told_apart() -> None:
    samples = [(NOW - 3600 + 60 * n, (100 + n) * MIB) for n in range(61)]
    marks = [
        Mark(NOW - 1800, CHECKPOINT, "checkpoint 0123456789ab: image 300 MiB"),
        Mark(NOW - 600, HIBERNATE, "hibernate 89abcdef0123: image 301 MiB"),
        Mark(NOW - 7200, CHECKPOINT, "an hour before the window"),
    ]
    root = parsed(charts.memory_chart("train", samples, marks, NOW))
    title = texts(root, "title")[0]
    assert (
        title
        == "Memory of train over the last hour: now 160.0 MiB, peak 160.0 MiB; 1 checkpoint(s), 1 hibernation(s)"
    )
    assert root.attrib["aria-label"] == title
    [line] = polyline_points(root)
    assert len(line) == 61 and line[0][0] < line[-1][0]
    assert line[-1][1] < line[0][1]  # more memory is higher up
    groups = [g for g in root.iter(f"{SVG}g") if "mark" in g.attrib.get("class", "")]
    kinds = [g.attrib["class"] for g in groups]
    assert kinds == ["mark checkpoint", "mark hibernate"]
    tooltips = [texts(g, "title")[0] for g in groups]
    assert tooltips == ["checkpoint 0123456789ab: image 300 MiB", "hibernate 89abcdef0123: image 301 MiB"]
    # a checkpoint is a dot, a hibernation a triangle, each in its own colour; the legend names all three
    assert groups[0].find(f"{SVG}circle") is not None and groups[1].find(f"{SVG}path") is not None
    words = texts(root, "text")
    assert {"memory", "checkpoint", "hibernation"} <= set(words)
    assert words[:3] == ["0 B", "100 MiB", "200 MiB"] and "now" in words and "-60 min" in words


def test_every_label_of_a_chart_is_escaped() -> None:
    svg = charts.memory_chart(HOSTILE, [(NOW, 5 * MIB)], [Mark(NOW - 5, HIBERNATE, HOSTILE)], NOW)
    assert "<script>" not in svg
    root = parsed(svg)
    assert texts(root, "title")[0].startswith(f"Memory of {HOSTILE} over")
    assert HOSTILE in texts(root, "title")
    bar = charts.budget_bar(10 * MIB, [(HOSTILE, 6 * MIB)])
    assert "<script>" not in bar
    root = parsed(bar)
    assert f"{HOSTILE}: 6.0 MiB" in texts(root, "title")
    assert HOSTILE in texts(root, "text")  # wide enough to be named inside its segment


def test_no_sample_one_sample_a_flat_line_and_a_gap() -> None:
    empty = parsed(charts.memory_chart("idle", [], [], NOW))
    assert "no memory samples in this hour" in texts(empty, "text")
    assert not polyline_points(empty) and texts(empty, "text")[:3] == ["0 B", "512 KiB", "1 MiB"]

    one = parsed(charts.memory_chart("new", [(NOW - 3, 42 * MIB)], [], NOW))
    assert not polyline_points(one) and len(list(one.iter(f"{SVG}circle"))) == 2  # its dot, the legend's

    flat = parsed(charts.memory_chart("flat", [(NOW - 60 * n, 64 * MIB) for n in range(10)], [], NOW))
    [line] = polyline_points(flat)
    assert len({y for _, y in line}) == 1 and line[0][1] > 22  # level, and below the top of the chart

    # the agent was stopped for ten minutes: two runs, not a line drawn through the time it did not look
    gap = [(NOW - 1800 + 5 * n, MIB) for n in range(10)] + [(NOW - 900 + 5 * n, MIB) for n in range(10)]
    assert len(polyline_points(parsed(charts.memory_chart("gap", gap, [], NOW)))) == 2


def test_huge_and_odd_values_stay_on_the_chart() -> None:
    huge = 3 << 60  # 3 EiB: no machine has it, the chart must not break on it
    root = parsed(charts.memory_chart("huge", [(NOW - 10, huge), (NOW, huge // 2), (NOW + 99, -5)], [], NOW))
    [line] = polyline_points(root)
    assert len(line) == 2 and all(22 <= y <= 140 for _, y in line)
    assert charts.nice_ceiling(huge) >= huge
    many = [Mark(NOW - n, CHECKPOINT, f"c{n}") for n in range(charts.MAX_MARKS + 50)]
    marked = parsed(charts.memory_chart("busy", [], many, NOW))
    assert (
        sum(1 for g in marked.iter(f"{SVG}g") if g.attrib.get("class") == "mark checkpoint")
        == charts.MAX_MARKS
    )


@pytest.mark.parametrize(
    ("peak", "ceiling"),
    [
        (0, MIB),
        (1, 2),
        (300 * MIB, 500 * MIB),
        (600 * MIB, 750 * MIB),
        (800 * MIB, 1 << 30),  # not "1000 MiB"
        (1000 * MIB, 2 << 30),
        (2 << 30, int(2.5 * (1 << 30))),
        (900 << 40, 1000 << 40),  # no unit beyond TiB
    ],
)
def test_a_charts_top_is_a_round_size_above_its_peak(peak: int, ceiling: int) -> None:
    assert charts.nice_ceiling(peak) == ceiling


def test_the_budget_bar_holds_each_job_then_what_is_free() -> None:
    gib = 1 << 30
    root = parsed(charts.budget_bar(10 * gib, [("a", 3 * gib), ("b", 1 * gib)], 5 * gib))
    assert texts(root, "title")[0] == "Memory budget 10.0 GiB: held 5.0 GiB (50%), free 5.0 GiB"
    tips = texts(root, "title")[1:]
    assert tips == ["free: 5.0 GiB", "a: 3.0 GiB", "b: 1.0 GiB", "other jobs (not submitted): 1.0 GiB"]
    rects = [r for r in root.iter(f"{SVG}rect")]
    widths = [float(r.attrib["width"]) for r in rects]
    assert widths[0] == pytest.approx(558) and widths[1] == pytest.approx(558 * 0.3, abs=0.1)
    assert {"held 5.0 GiB (50%)", "free 5.0 GiB of 10.0 GiB"} <= set(texts(root, "text"))

    over = parsed(charts.budget_bar(gib, [("big", 3 * gib)]))
    assert texts(over, "title")[0].endswith("free 0 B, over by 2.0 GiB")
    assert any(r.attrib.get("fill") == charts.OVER_COLOUR for r in over.iter(f"{SVG}rect"))
    nothing = parsed(charts.budget_bar(0, []))
    assert texts(nothing, "title")[0] == "Memory budget 0 B: held 0 B, free 0 B"


def test_the_history_keeps_an_hour_of_samples_per_job_at_its_pace() -> None:
    history = MemoryHistory(window_s=60, every_s=5)
    assert history.due(NOW)
    history.record(NOW, {"a": 1, "b": 2})
    assert not history.due(NOW + 4.9) and history.due(NOW + 5)
    for n in range(1, 30):
        history.record(NOW + 5 * n, {"a": n})
    kept = history.samples()
    assert set(kept) == {"a"}  # b's last sample left the window: b is gone
    assert kept["a"][-1] == Sample(NOW + 145, 29) and kept["a"][0].at >= NOW + 145 - 60
    assert len(kept["a"]) <= 60 / 5 + 1
    assert history.due(NOW - 100)  # the clock went back: sample again
