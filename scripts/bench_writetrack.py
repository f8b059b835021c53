"""Benchmark: what tracking a running process's writes costs (adapters/writetrack.py, issue 31's building
block), against the same process untracked in the same run.

1. A CPU training loop (bench_train.py's MLP and Adam, no pause between steps): its step times while
   untracked and while tracked (scanned once a second, as pre-copy rounds would), phases alternated.
2. A process holding 1 GiB and 4 GiB of touched private memory: how long ``track`` takes (the
   userfaultfd made inside it, every mapping registered and write-protected), a scan when nothing was
   written, and a scan after 1,000 scattered pages were written (the pages it found must be exactly
   those).

Run as root: ``python scripts/bench_writetrack.py [--no-write]``; writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench import GIB, machine, machine_table
from benchdoc import median, publish, say

from torpor.adapters import writetrack
from torpor.adapters.criu import Criu
from torpor.settings import find_criu

PAGE = mmap.PAGESIZE
HERE = Path(__file__).resolve().parent

# bench_train.py's model, trained without a pause; one line per step: its duration in seconds
TRAINER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from bench_train import build, train_step
    torch.set_num_threads(1)
    model, optimizer = build(int(sys.argv[2]), int(sys.argv[3]))
    while True:
        began = time.perf_counter()
        train_step(model, optimizer, int(sys.argv[3]))
        print(time.perf_counter() - began, flush=True)
    """
)

# SIZE bytes of private memory, every page touched; then on each line of stdin, writes one byte into each
# page it names and answers "ok"
HOLDER = textwrap.dedent(
    """
    import ctypes, mmap, sys
    size = int(sys.argv[1])
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for at in range(0, size, 1 << 26):
        area[at:at + (1 << 26)] = bytes(range(256)) * ((1 << 26) // 256)
    print(ctypes.addressof(ctypes.c_char.from_buffer(area)), flush=True)
    for line in sys.stdin:
        for page in line.split():
            area[int(page) * mmap.PAGESIZE] ^= 1
        print("ok", flush=True)
    """
)


def training(layers: int, hidden: int, steps: int, phases: int) -> dict[str, list[float]]:
    """Step times of one training process, ``phases`` untracked and tracked phases of ``steps`` each."""
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(HERE), str(layers), str(hidden)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    times: dict[str, list[float]] = {"untracked": [], "tracked": [], "scan_s": [], "scanned_pages": []}
    try:
        for _ in range(5):  # warm-up
            process.stdout.readline()
        for phase in range(2 * phases):
            if phase % 2 == 0:
                times["untracked"] += [float(process.stdout.readline()) for _ in range(steps)]
                continue
            with writetrack.track(process.pid) as tracker:
                last = time.monotonic()
                for _ in range(steps):
                    times["tracked"].append(float(process.stdout.readline()))
                    if time.monotonic() - last >= 1.0:  # a round's scan, once a second
                        began = time.perf_counter()
                        found = tracker.written()
                        times["scan_s"].append(time.perf_counter() - began)
                        times["scanned_pages"].append(sum(r.length for r in found) / PAGE)
                        last = time.monotonic()
    finally:
        process.kill()
        process.communicate()
    return times


def holding(size: int, written: int) -> dict[str, float]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        base = int(process.stdout.readline())
        began = time.perf_counter()
        tracker = writetrack.track(process.pid)
        result = {"track_s": time.perf_counter() - began}
        with tracker:
            began = time.perf_counter()
            tracker.written()
            result["idle_scan_s"] = time.perf_counter() - began
            pages = size // PAGE
            chosen = sorted({(n * 7919) % pages for n in range(written)})
            process.stdin.write(" ".join(map(str, chosen)) + "\n")
            process.stdin.flush()
            assert process.stdout.readline() == "ok\n"
            began = time.perf_counter()
            found = tracker.written()
            result["scan_s"] = time.perf_counter() - began
            inside = [
                (at - base) // PAGE
                for r in found
                for at in range(max(r.start, base), min(r.start + r.length, base + size), PAGE)
            ]
            if inside != chosen:
                raise SystemExit(
                    f"the scan found {len(inside)} pages of the area, not the {len(chosen)} written"
                )
            result["found"] = len(inside)
    finally:
        process.kill()
        process.communicate()
    return result


def render(times: dict[str, list[float]], held: dict[int, dict[str, float]], layers: int, hidden: int) -> str:
    untracked, tracked = median(times["untracked"]), median(times["tracked"])
    lines = [
        "## Tracking a running job's writes: `adapters/writetrack.py` (`scripts/bench_writetrack.py`)",
        "",
        "Pre-copied checkpoints track a job only from their first round to their freeze (issue 31; "
        "`scripts/bench_precopy.py`): this measures what tracking costs meanwhile. Tracking is a userfaultfd "
        "made inside the process through ptrace, write-protection in asynchronous mode (the kernel resolves "
        "each first write to a protected page itself) and PAGEMAP_SCAN.",
        "",
        f"A CPU training loop (bench_train.py's MLP, {layers} layers of {hidden}, Adam; one thread, no pause), "
        f"its step times in alternated phases, scanned once a second while tracked:",
        "",
        "| | median step | steps |",
        "|---|---|---|",
        f"| untracked | {untracked * 1000:.1f} ms | {len(times['untracked'])} |",
        f"| tracked | {tracked * 1000:.1f} ms ({tracked / untracked:.3f}×, goal ≤ 1.1×) | {len(times['tracked'])} |",
        "",
        f"Each scan of the tracked trainer (pages written since the one before, protected again): median "
        f"{median(times['scan_s']) * 1000:.1f} ms for a median of {median(times['scanned_pages']):,.0f} pages "
        f"({len(times['scan_s'])} scans). Tracking is not free for a job that rewrites its memory: after "
        "each scan, the first write to each page it protected again is a fault the kernel resolves "
        "itself; between scans it costs nothing.",
        "",
        "A process holding touched private memory, then 1,000 scattered pages written (found exactly):",
        "",
        "| memory | track (inject, register, protect) | scan, nothing written | scan, 1,000 pages written |",
        "|---|---|---|---|",
        *(
            f"| {size / GIB:g} GiB | {r['track_s'] * 1000:.1f} ms | {r['idle_scan_s'] * 1000:.2f} ms | "
            f"{r['scan_s'] * 1000:.2f} ms |"
            for size, r in held.items()
        ),
        "",
        "### Every sample (ms)",
        "",
        *(
            f"- {kind} steps: {', '.join(f'{t * 1000:.1f}' for t in times[kind])}"
            for kind in ("untracked", "tracked")
        ),
        f"- scans of the tracked trainer: {', '.join(f'{t * 1000:.1f}' for t in times['scan_s'])}",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="steps in each phase")
    parser.add_argument("--phases", type=int, default=3, help="untracked and tracked phases, each")
    parser.add_argument("--sizes", default="1,4", help="GiB held by the second benchmark's process")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not write it")
    args = parser.parse_args()
    problem = writetrack.probe()
    if problem:
        raise SystemExit(f"bench_writetrack: writes cannot be tracked here: {problem}")
    times = training(args.layers, args.hidden, args.steps, args.phases)
    say(f"untracked steps: {times['untracked']}\ntracked steps: {times['tracked']}")
    held = {}
    for size in (int(float(s) * GIB) for s in args.sizes.split(",")):
        held[size] = holding(size, 1000)
        say(f"{size / GIB:g} GiB: {held[size]}")
    criu = Criu(find_criu(None))
    section = render(times, held, args.layers, args.hidden) + "\n" + machine_table(machine(criu)) + "\n"
    publish("writetrack", section, print_only=args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
