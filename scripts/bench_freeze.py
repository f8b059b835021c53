"""``scripts/bench_freeze.py``: how long a checkpoint freezes a job without a TCP socket, torpor against the
plain ``criu dump -t PID --leave-running`` of the same kind of process into the same tmpfs (issue 16), as
CRIU counts it and as the job feels it, and where the time of one freeze goes.

For each size (default 1 and 4 GiB of random, touched memory: ``scripts/bench_memory.py``) a torpor job
and a plain process in its own PID namespace (``unshare --pid --fork setsid python …``) are checkpointed
in turn, ``--repeat`` times (default 5), rotating which of the four kinds goes first:

- **plain CRIU**: ``criu dump -t PID --leave-running -D DIR -o LOG``, DIR on the tmpfs of torpor's hot
  tier: the command a user would type (CRIU's default verbosity), the anchor.
- **plain CRIU, CPUs held**: that command while the benchmark holds the CPUs quick to wake as torpor
  does (``ownprocess.cpu_wakeups_held``): what that alone is worth.
- **torpor's former options**: the same process dumped with the options torpor used for every job
  before it looked for TCP sockets (``-v4 --tcp-established --file-locks --network-lock nftables
  --ghost-limit 1G``), into the same tmpfs: what torpor's freeze was.
- **torpor**: ``Engine.checkpoint`` of the job (the launcher's dump into the hot tier and the commit).

*Frozen* is CRIU's own figure from its ``stats-dump`` image, on every side. *Felt* is the job's own: the
workload runs a 5 ms loop and prints every gap longer than 20 ms; the largest after a checkpoint is what
it felt. The profile splits one ``-v4`` log of each 1 GiB kind (plain CRIU run once more with ``-v4``)
into CRIU's steps by their timestamps.

Steadiness (issue 16, goal 5): a training process (``scripts/bench_train.py serve --tick``: the 84 M
parameter MLP with Adam, a step then 0.5 s of sleep, and a thread ticking every 5 ms) is checkpointed
``--steadiness`` times (default 10): the first half each after the last is durable and the destager idle,
the second half back to back (the next right after the last returned, while the destager still stores it).
Every freeze it felt is kept; the bar is the worst ≤ 2× the median. ``torch.save`` of its state into
/dev/shm, timed as often, is the reference for how steady a framework checkpoint is.

Writes its section of ``docs/benchmarks.md`` between ``<!-- freeze:begin -->`` and ``<!-- freeze:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import (
    CRIU_LOG_LINE,
    GIB,
    RawProcess,
    Samples,
    TorporJob,
    filesystem_of,
    machine,
    machine_table,
    raw_folder_in_hot_tier,
    rotate,
    spread,
    workspace,
)
from benchdoc import DOC, median, publish, say

from torpor.adapters.criu import Criu
from torpor.adapters.criuimage import read_dump_stats
from torpor.adapters.system import ownprocess
from torpor.core.engine import Engine
from torpor.settings import Settings

HERE = Path(__file__).resolve().parent
#: the bars of issue 16, goal 1 (no TCP socket): 0.5x, and 0.8x with a profile of what stands in the way
BAR, FALLBACK_BAR = 0.5, 0.8
#: goal 5: the worst freeze a training job feels over its checkpoints, at most this times the median
STEADY_BAR = 2.0
#: CRIU's steps, in the order its log enters them: (step, the text of the line that starts it)
STEPS: tuple[tuple[str, str], ...] = (
    ("start: kernel probes, options (not frozen)", ""),
    ("collect and freeze the tree", "Dumping processes"),
    ("network lock", "net: Lock network"),
    ("task state, parasite in", "Dumping task (pid"),
    ("memory pages", "Dumping pages"),
    ("core, mm, files after the pages", "Dumping core"),
    ("post-dump: torpor reading the last pages", "Running post-dump scripts"),
    ("network unlock", "net: Unlock network"),
    ("thaw and finish (not frozen)", "Unfreezing tasks"),
)


#: the kinds of dump measured, and their names in the report
KINDS: dict[str, str] = {
    "plain": "plain CRIU",
    "held": "plain CRIU, CPUs held",
    "former": "torpor's former options",
    "torpor": "torpor",
}


def profile(log: Path) -> dict[str, float]:
    """Seconds spent in each of :data:`STEPS` according to the timestamps of a CRIU ``-v4`` log: each
    line's time until the next is its step's. Steps only move forward; one the log never enters is 0."""
    spent = {step: 0.0 for step, _ in STEPS}
    current, previous = 0, None
    for line in log.read_text(errors="replace").splitlines():
        match = CRIU_LOG_LINE.match(line)
        if match is None:
            continue
        at, text = float(match.group(1)), match.group(2)
        if previous is not None:
            spent[STEPS[current][0]] += at - previous
        for index in range(current + 1, len(STEPS)):
            if text.startswith(STEPS[index][1]):
                current = index
                break
        previous = at
    return spent


class Felt:
    """The largest pause a workload reported in its log (``gap S s`` lines) since the last look."""

    def __init__(self, log: Callable[[], Path]) -> None:
        self.log = log
        self.offset = 0

    def skip(self) -> None:
        self.offset = self.log().stat().st_size

    def largest(self) -> float:
        time.sleep(0.1)  # the first tick after the thaw prints the gap
        with open(self.log(), "rb") as file:
            file.seek(self.offset)
            text = file.read().decode(errors="replace")
            self.offset = file.tell()
        gaps = [float(m.group(1)) for m in re.finditer(r"^gap (\d+\.\d+) s$", text, re.MULTILINE)]
        return max(gaps, default=0.0)


@dataclass
class Side:
    frozen: Samples = field(default_factory=Samples)
    felt: Samples = field(default_factory=Samples)
    #: the command's whole time, for its caller (torpor only: the memory set aside before the freeze)
    total: Samples = field(default_factory=Samples)


@dataclass
class SizeResult:
    size: int
    plain: Side = field(default_factory=Side)
    held: Side = field(default_factory=Side)
    former: Side = field(default_factory=Side)
    torpor: Side = field(default_factory=Side)
    profiles: dict[str, dict[str, float]] = field(default_factory=dict)

    def sides(self) -> list[tuple[str, Side]]:
        return [(kind, getattr(self, kind)) for kind in KINDS]


def plain_dump(criu: Path, pid: int, images: Path, log: Path, verbose: bool = False) -> float:
    """``criu dump -t PID --leave-running`` into ``images``; returns CRIU's frozen seconds."""
    command = [str(criu), "dump", "-t", str(pid), "--leave-running", "-D", str(images), "-o", str(log)]
    subprocess.run(
        [*command, *(["-v4"] if verbose else [])], check=True, stdin=subprocess.DEVNULL, capture_output=True
    )
    return read_dump_stats(images).frozen_s


def bench_size(engine: Engine, criu: Path, work: Path, hot: Path, size: int, repeat: int) -> SizeResult:
    command = [sys.executable, "-u", str(HERE / "bench_memory.py"), str(size)]
    say(f"\n== {size / GIB:g} GiB of random memory, no TCP socket ==")
    result = SizeResult(size)
    raw = RawProcess(criu, work, command, f"raw-{size >> 20}m")
    job = TorporJob(engine, f"freeze-{size >> 20}m", command)
    raw_felt, job_felt = Felt(lambda: raw.log), Felt(lambda: engine.log_path(job.name))
    count = 0
    last_logs: dict[str, Path] = {}
    try:
        raw.wait_ready()
        job.wait_ready()
        say("  both ready; one warm-up dump each")
        job.checkpoint(hibernate=False)
        raw.dump(leave_running=True, into=hot)

        def plain(key: str, verbose: bool = False) -> float:
            nonlocal count
            count += 1
            images, log = hot / f"plain-{count}", work / f"plain-{count}.log"
            images.mkdir()
            try:
                frozen = plain_dump(criu, raw.pid, images, log, verbose)
            finally:
                shutil.rmtree(images)
            last_logs[key] = log
            return frozen

        def plain_side() -> None:
            raw_felt.skip()
            result.plain.frozen.add(plain("plain"))
            result.plain.felt.add(raw_felt.largest())

        def held_side() -> None:
            raw_felt.skip()
            with ownprocess.cpu_wakeups_held():
                result.held.frozen.add(plain("held"))
            result.held.felt.add(raw_felt.largest())

        def former_side() -> None:
            raw_felt.skip()
            frozen, _, _ = raw.dump(leave_running=True, into=hot, tcp=True)  # the lock included
            result.former.frozen.add(frozen)
            result.former.felt.add(raw_felt.largest())
            last_logs["former"] = raw.work / f"dump-{raw.count}.log"

        def torpor_side() -> None:
            job_felt.skip()
            frozen, total, _, _ = job.checkpoint(hibernate=False)
            result.torpor.frozen.add(frozen)
            result.torpor.total.add(total)
            result.torpor.felt.add(job_felt.largest())
            logs = sorted(
                (engine.settings.job_dir(job.name) / "criu").glob("dump-*.log"),
                key=lambda p: p.stat().st_mtime,
            )
            last_logs["torpor"] = logs[-1]

        for rep in range(repeat):
            rotate(rep, plain_side, held_side, former_side, torpor_side)
            say(
                "  "
                + ", ".join(
                    f"{label} frozen {side.frozen.values[-1]:.3f} s (felt {side.felt.values[-1]:.3f} s)"
                    for label, side in result.sides()
                )
            )
        plain("plain", verbose=True)  # once more each with -v4, for their profiles
        with ownprocess.cpu_wakeups_held():
            plain("held", verbose=True)
        result.profiles = {kind: profile(log) for kind, log in last_logs.items()}
    finally:
        raw.kill()
        job.remove()
    return result


@dataclass
class Steadiness:
    """Checkpoints of one training job: spaced (each after the last is durable) and back to back."""

    spaced: Side = field(default_factory=Side)
    back_to_back: Side = field(default_factory=Side)
    quiet_s: float = 0.0  # the largest gap the job felt in 3 s without a checkpoint
    save_s: Samples = field(default_factory=Samples)  # torch.save of its state into /dev/shm

    @property
    def felt(self) -> list[float]:
        return self.spaced.felt.values + self.back_to_back.felt.values


def bench_steadiness(engine: Engine, count: int) -> Steadiness:
    script = str(HERE / "bench_train.py")
    say(f"\n== steadiness: {count} checkpoints of a training process, half of them back to back ==")
    result = Steadiness()
    saved = Path("/dev/shm") / f"torpor-bench-state-{os.getpid()}.pt"
    try:
        out = subprocess.run(
            [sys.executable, script, "save", str(saved), "--repeat", str(count)],
            check=True,
            capture_output=True,
            text=True,
        )
    finally:
        saved.unlink(missing_ok=True)
    for run in json.loads(out.stdout.strip().splitlines()[-1])["runs"]:
        result.save_s.add(run["save_s"])
    say("  torch.save into /dev/shm: " + spread(result.save_s) + " s")
    job = TorporJob(engine, "steady-train", [sys.executable, "-u", script, "serve", "--tick"])
    felt = Felt(lambda: engine.log_path(job.name))
    try:
        job.wait_ready()
        felt.skip()
        time.sleep(3)
        result.quiet_s = felt.largest()
        job.checkpoint(hibernate=False)  # warm-up
        for _ in range(count - count // 2):
            felt.skip()
            # returns once durable, the destager idle; kept, so that the next takes over its memory in RAM
            frozen, total, _, _ = job.checkpoint(hibernate=False, keep=True)
            result.spaced.frozen.add(frozen)
            result.spaced.total.add(total)
            result.spaced.felt.add(felt.largest())
        taken = []
        for _ in range(count // 2):
            felt.skip()
            began = time.monotonic()
            checkpoint = engine.checkpoint(job.name)
            result.back_to_back.total.add(time.monotonic() - began)
            result.back_to_back.frozen.add(checkpoint.freeze_s)
            result.back_to_back.felt.add(felt.largest())
            taken.append(checkpoint.id)
        for checkpoint_id in taken:
            engine.wait_durable(checkpoint_id)
        say(
            f"  felt without a checkpoint {result.quiet_s:.3f} s; spaced "
            + spread(result.spaced.felt, 3)
            + " s; back to back "
            + spread(result.back_to_back.felt, 3)
            + " s"
        )
    finally:
        job.remove()
    return result


def render_steadiness(steady: Steadiness) -> list[str]:
    felt = steady.felt
    middle = median(felt)
    worst = max(felt)
    save = steady.save_s
    verdict = "met" if worst <= STEADY_BAR * middle else "not met"
    rows = [
        ("spaced (each after the last is durable)", steady.spaced),
        ("back to back (the last still being stored)", steady.back_to_back),
    ]
    return [
        "### Steadiness: checkpoints of a training process (goal 5)",
        "",
        f"`scripts/bench_train.py serve --tick` as a torpor job: the 84 M parameter MLP with Adam, a step "
        f"then 0.5 s of sleep, and a thread ticking every 5 ms. {len(felt)} checkpoints: the first "
        f"{len(steady.spaced.felt.values)} each after the last was durable and the destager idle (each "
        "kept, the one before deleted, as a job checkpointed every so often keeps its last: the next "
        "writes its pages over that copy's memory in RAM), the next "
        f"{len(steady.back_to_back.felt.values)} back to back. *Felt* is the largest gap of the job's own "
        f"loop around each; without a checkpoint it felt at most {steady.quiet_s:.3f} s in 3 s.",
        "",
        "| checkpoints | frozen (CRIU): median | felt: median | felt: worst | total: median | total: worst |",
        "|---|---|---|---|---|---|",
        *[
            f"| {label} | {side.frozen.median:.3f} s | {side.felt.median:.3f} s | {max(side.felt.values):.3f} s "
            f"| {side.total.median:.3f} s | {max(side.total.values):.3f} s |"
            for label, side in rows
        ],
        f"| all {len(felt)} | | {middle:.3f} s | {worst:.3f} s | | |",
        f"| reference: `torch.save` of its state into /dev/shm, {len(save.values)} times | | "
        f"{save.median:.3f} s | {max(save.values):.3f} s | | |",
        "",
        f"**Goal 5 (worst felt ≤ {STEADY_BAR:g}× the median): {verdict}** ({worst / middle:.2f}×; "
        f"`torch.save`: {max(save.values) / save.median:.2f}×).",
        "",
        "Why a freeze could be slow, and what torpor does about it: this virtual machine hands free memory "
        "back to its host (virtio-balloon free page reporting, `/sys/module/page_reporting`), and touching "
        "such memory again costs a fault in the host (by hand: 2 GiB of fresh memory took 1.5–7.8 s to "
        "touch). A dump that writes its image into memory allocated as it goes, as a plain `criu dump` "
        "does, pays that while the job is frozen: back to back, with the last copies still in RAM, torpor "
        "froze this job up to 8.6 s that way (docs/benchmarks.md before 2026-12-02). torpor now has the "
        "memory for each dump's pages before the freeze (the memory of the job's last copy in RAM, taken "
        "over, where that copy is durable; else a file of zeros as large as the job's anonymous memory, "
        "written then, in the hot tier) and CRIU streams the pages to torpor, which copies them over it: "
        "the host's faults, if any, land in *total*, before the freeze, not in *frozen*.",
        "",
        "- felt, spaced: " + spread(steady.spaced.felt, 3),
        "- felt, back to back: " + spread(steady.back_to_back.felt, 3),
        "- frozen (CRIU), spaced / back to back: "
        + spread(steady.spaced.frozen, 3)
        + " / "
        + spread(steady.back_to_back.frozen, 3),
        "- torch.save: " + spread(save, 3),
        "",
    ]


def render(
    results: list[SizeResult],
    repeat: int,
    places: dict[str, str],
    took_s: float,
    described: list[tuple[str, str]],
    steady: Steadiness | None = None,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "## Freeze without a TCP socket: torpor vs the plain `criu dump` (`scripts/bench_freeze.py`)",
        "",
        f"Written on {when}, in {took_s / 60:.0f} min, on the machine below. Every figure is the median of "
        f"{repeat} samples, the four kinds alternated (all samples below). Every dump went into the tmpfs of "
        f"torpor's hot tier ({places['hot']}).",
        "",
        machine_table(described),
        "",
        "- **plain CRIU**: `criu dump -t PID --leave-running -D DIR -o LOG`, the command a user would type, on "
        "a plain process in its own PID namespace holding the same memory: the anchor.",
        "- **plain CRIU, CPUs held**: the same command while this benchmark holds the CPUs quick to wake, as "
        "torpor does (a PM QoS request of 0 µs on `/dev/cpu_dma_latency`, `ownprocess.cpu_wakeups_held`): "
        "what that alone is worth.",
        "- **torpor's former options**: that process dumped as torpor dumped every job before it looked for "
        "TCP sockets (`-v4 --tcp-established --file-locks --network-lock nftables --ghost-limit 1G`), CPUs "
        "not held.",
        "- **torpor**: `torpor checkpoint` of a job with no TCP socket: dumped without the TCP options and "
        "without the network lock (`-v4 --file-locks --ghost-limit 1G`), the CPUs held quick to wake, and "
        "streamed (`--stream`): CRIU hands the pages to torpor by reference, and torpor copies them into "
        "memory it set aside (wrote with zeros) before the freeze; CRIU's post-dump script keeps the job "
        "frozen until torpor has read them all.",
        "- *frozen*: CRIU's own figure (its `stats-dump` image); *felt*: the largest gap the job's own 5 ms "
        "loop saw around the checkpoint; *total*: how long `torpor checkpoint` took for its caller, the "
        "memory set aside before the freeze included.",
        "",
        "| memory | "
        + " | ".join(f"frozen: {name}" for name in KINDS.values())
        + " | **torpor / plain** | former / plain | felt: plain | felt: torpor | worst felt / median: torpor "
        "| total: torpor |",
        "|---|" + "---|" * (len(KINDS) + 6),
    ]
    for r in results:
        t, p, f = r.torpor, r.plain, r.former
        lines.append(
            f"| {r.size / GIB:g} GiB | "
            + " | ".join(f"{side.frozen.median:.3f} s" for _, side in r.sides())
            + f" | **{t.frozen.median / p.frozen.median:.2f}×** | {f.frozen.median / p.frozen.median:.2f}× "
            f"| {p.felt.median:.3f} s | {t.felt.median:.3f} s | {max(t.felt.values) / t.felt.median:.2f}× "
            f"| {t.total.median:.3f} s |"
        )
    lines.append("")
    if results:
        worst = max(r.torpor.frozen.median / r.plain.frozen.median for r in results)
        verdict = (
            "met" if worst <= BAR else ("met at the fallback bar" if worst <= FALLBACK_BAR else "not met")
        )
        lines += [
            f"**Goal 1 (freeze ≤ {BAR}× the plain command; ≤ {FALLBACK_BAR}× with a profile of what stands in "
            f"the way): {verdict}** (worst {worst:.2f}×).",
            "",
        ]
    for r in results:
        if "torpor" not in r.profiles:
            continue
        spent = r.profiles["torpor"]
        frozen = sum(v for step, v in spent.items() if "not frozen" not in step)
        pages = spent["memory pages"]
        tail = spent["post-dump: torpor reading the last pages"]
        lines.append(
            f"What torpor's freeze is made of at {r.size / GIB:g} GiB: CRIU's memory pages step is "
            f"{pages:.2f} s of the {frozen:.2f} s its profiled dump was frozen ({pages / frozen:.0%}): CRIU "
            "handing each page to torpor by reference while torpor reads it into memory set aside and "
            f"mapped before the freeze ({r.size / GIB / pages:.1f} GiB/s here); the post-dump wait for the last pages "
            f"took {tail * 1000:.0f} ms. The rest of the command ({r.torpor.total.median:.2f} s in all, "
            "median) is spent before and after the freeze: mostly writing the memory set aside, at the "
            "speed this virtual machine gives memory it took back from its host (each measured checkpoint "
            "is deleted before the next, so none finds an older copy in RAM whose memory it could take "
            "over, as a job's next checkpoint does)."
        )
        lines.append("")
    for r in results:
        kinds = [k for k in KINDS if k in r.profiles]
        if not kinds:
            continue
        lines += [
            f"### Where one {r.size / GIB:g} GiB dump's time goes (CRIU's -v4 timestamps)",
            "",
            "| step | "
            + " | ".join(KINDS[k] + (" (-v4)" if k in ("plain", "held") else "") for k in kinds)
            + " |",
            "|---|" + "---|" * len(kinds),
        ]
        for step, _ in STEPS:
            lines.append(f"| {step} | " + " | ".join(f"{r.profiles[k][step]:.3f} s" for k in kinds) + " |")
        lines.append("")
    if steady is not None:
        lines += render_steadiness(steady)
    lines += ["### Every sample (seconds)", ""]
    for r in results:
        for kind, side in r.sides():
            lines.append(
                f"- {r.size / GIB:g} GiB, {KINDS[kind]}: frozen "
                + spread(side.frozen, 3)
                + "; felt "
                + spread(side.felt, 3)
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1,4", help="GiB of memory")
    parser.add_argument(
        "--steadiness", type=int, default=10, help="checkpoints of a training job (0: skip; needs torch)"
    )
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        say("bench_freeze needs root (CRIU dumps processes)")
        return 3
    ownprocess.become_subreaper()
    started = time.monotonic()
    with workspace(False) as work:
        settings = Settings.from_environment(home=str(work / "home"))
        if settings.criu is None:
            say("criu not found: run 'make setup'")
            return 3
        criu = Criu(settings.criu)
        criu.require()
        engine = Engine(settings)
        with raw_folder_in_hot_tier(engine) as hot:
            places = {"hot": filesystem_of(settings.hot_path)}
            results = [
                bench_size(engine, settings.criu, work, hot, int(float(size) * GIB), args.repeat)
                for size in args.sizes.split(",")
                if size
            ]
            steady = bench_steadiness(engine, args.steadiness) if args.steadiness else None
        section = render(results, args.repeat, places, time.monotonic() - started, machine(criu), steady)
    publish("freeze", section, args.doc, args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
