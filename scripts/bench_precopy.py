"""``scripts/bench_precopy.py``: how long a pre-copied checkpoint (issue 31) freezes a job, against the
plain ``criu dump -t PID --leave-running`` of the same kind of process and torpor's whole dump, in the
same run.

For each size (default 1 and 4 GiB of random, touched memory) and each rate at which the job rewrites
it (default 0 %, 1 % and 10 % a second: ``scripts/bench_memory.py SIZE RATE``, which rewrites its
memory in order, wrapping around), three processes run side by side and are checkpointed in turn,
``--repeat`` times (default 5), rotating which goes first:

- **raw CRIU**: a plain process in its own PID namespace, ``criu dump -t PID --leave-running -D DIR``
  into the tmpfs of torpor's hot tier (CRIU's default verbosity): the anchor;
- **torpor, whole**: a torpor job started with ``TORPOR_PRECOPY=0``: the whole memory dumped while
  frozen (today's checkpoint);
- **torpor, pre-copied**: a torpor job started with ``TORPOR_PRECOPY=1``: rounds while it runs, then a
  freeze for what it wrote since the last.

*Felt* is the job's own figure: the workload ticks every 5 ms and prints each gap over 20 ms; the
largest after a checkpoint is its freeze. *Frozen* is CRIU's, from its ``stats-dump`` image. *Total*
is ``Engine.checkpoint``'s time, command to committed. Each torpor checkpoint is waited on until it is
durable and the destager idle (its bytes stored are kept), then deleted, so every checkpoint is a
job's first: nothing is taken over from an older one. Samples come as fast as that allows (several
seconds apart), not every 30 s: the rates are per second, so the rounds meet the same writes.

CRIU's own pre-copy by hand (``criu pre-dump --track-mem``, then ``criu dump --prev-images-dir
--track-mem``) is tried once per size on the raw process; where the kernel lacks soft-dirty bits CRIU
refuses it, and its words are reported instead of figures.

The profile: where one pre-copied 4 GiB checkpoint (rate 1 %/s, the last sample) spent its time,
from torpor's progress lines and CRIU's ``-v4`` timestamps of its dump.

Steadiness: ``--steady`` (default 10) pre-copied checkpoints of a 1 GiB job rewriting 1 %/s, the first
half each after the last is durable, the second half back to back; the bar: the worst felt ≤ 2× the
median.

Training: ``--training`` (default 5) checkpoints each of two training processes
(``scripts/bench_train.py serve --tick``), one whole, one pre-copied, alternated: a step rewrites all
of its memory, and the bar is a freeze ≤ 1.1× the whole dump's.

Writes its sections of ``docs/benchmarks.md``: ``precopy`` (the memory jobs, the profile, steadiness;
``--sizes ""`` skips them) and ``precopy-training``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
    GIB,
    RawProcess,
    Samples,
    machine,
    machine_table,
    raw_folder_in_hot_tier,
    rotate,
    spread,
    workspace,
)
from bench_freeze import STEPS, Felt, plain_dump, profile
from benchdoc import DOC, publish, say, wait_for

from torpor.adapters.criu import Criu
from torpor.adapters.criuimage import read_dump_stats
from torpor.adapters.system import ownprocess
from torpor.core.engine import Engine
from torpor.core.recordtypes import CheckpointId
from torpor.settings import Settings

HERE = Path(__file__).resolve().parent
KINDS = ("raw", "whole", "precopy")
LABELS = {"raw": "raw `criu dump`", "whole": "torpor, whole", "precopy": "torpor, pre-copied"}
#: issue 31's goals for 4 GiB: the felt freeze of a pre-copied checkpoint against raw CRIU's, by rate
GOALS = {0.0: 0.02, 0.01: 0.05, 0.10: 0.2}
STEADY_BAR = 2.0
TOTAL_BAR = 2.0
TRAIN_BAR = 1.1


@dataclass
class Side:
    frozen: Samples = field(default_factory=Samples)
    felt: Samples = field(default_factory=Samples)
    total: Samples = field(default_factory=Samples)
    stored: Samples = field(default_factory=Samples)  # bytes the destager stored
    rounds: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


@dataclass
class Config:
    size: int
    rate: float
    sides: dict[str, Side] = field(default_factory=lambda: {kind: Side() for kind in KINDS})

    @property
    def label(self) -> str:
        return f"{self.size / GIB:g} GiB, {self.rate:.0%}/s"


@dataclass
class Run:
    configs: list[Config] = field(default_factory=list)
    by_hand: dict[int, str] = field(default_factory=dict)  # size -> what CRIU's own pre-copy gave
    marks: list[tuple[float, str]] = field(default_factory=list)  # the profiled checkpoint's progress
    criu_steps: dict[str, float] = field(default_factory=dict)
    steady: Side | None = None
    steady_back: Side | None = None
    training: dict[str, Side] = field(default_factory=dict)  # "whole", "precopy"


class Job:
    """A torpor job of ``bench_memory.py``, checkpointed by :meth:`checkpoint` (then deleted)."""

    def __init__(self, engine: Engine, name: str, command: list[str]) -> None:
        self.engine, self.name = engine, name
        engine.run(name, command, str(HERE))
        log = engine.log_path(name)
        wait_for(lambda: log.exists() and "ready" in log.read_text(errors="replace"), f"{name} ready")
        self.felt = Felt(lambda: engine.log_path(name))

    def checkpoint(self, side: Side, marks: list[tuple[float, str]] | None = None, wait: bool = True) -> str:
        """One checkpoint, its figures added to ``side``; ``wait``: until durable and the destager idle,
        then deleted (else its id is returned, to be waited on and deleted by the caller)."""
        self.felt.skip()
        began = time.monotonic()

        def progress(text: str) -> None:
            if marks is not None:
                marks.append((time.monotonic() - began, text))

        checkpoint = self.engine.checkpoint(self.name, progress=progress)
        side.total.add(time.monotonic() - began)
        side.frozen.add(checkpoint.freeze_s)
        side.felt.add(self.felt.largest())
        side.rounds.append(checkpoint.rounds)
        if wait:
            self.settle(checkpoint.id, side)
        return checkpoint.id

    def settle(self, checkpoint_id: str, side: Side) -> None:
        image = self.engine.wait_durable(CheckpointId(checkpoint_id))
        side.stored.add(image.stored_bytes)
        store = self.engine.ctx.store
        wait_for(lambda: not store.destager_running(), "the destager to go idle", 300)
        store.delete(CheckpointId(checkpoint_id))
        self.engine.records.delete_checkpoint(CheckpointId(checkpoint_id))

    def criu_log(self) -> Path:
        logs = (self.engine.settings.job_dir(self.name) / "criu").glob("dump-*.log")
        return max(logs, key=lambda p: p.stat().st_mtime)

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.remove(self.name, force=True)


def by_hand(criu: Path, pid: int, hot: Path, work: Path) -> str:
    """CRIU's own pre-copy of ``pid``: a pre-dump, then the dump against it; its frozen seconds (CRIU's
    stats), or CRIU's refusal in its own words."""
    pre, final = hot / "by-hand-pre", hot / "by-hand-dump"
    for folder in (pre, final):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    try:
        command = [str(criu), "pre-dump", "-t", str(pid), "--track-mem", "-D", str(pre)]
        done = subprocess.run(
            [*command, "-o", str(work / "pre-dump.log")], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            log = (work / "pre-dump.log").read_text(errors="replace").splitlines()
            errors = [m.group(1) for line in log if (m := re.search(r"Error \([^)]*\): (.*)", line))]
            return (
                f"refused: {errors[0] if errors else done.stderr.strip() or 'exit ' + str(done.returncode)}"
            )
        subprocess.run(
            [
                str(criu),
                "dump",
                "-t",
                str(pid),
                "--leave-running",
                "--track-mem",
                "-D",
                str(final),
                "--prev-images-dir",
                "../by-hand-pre",
                "-o",
                str(work / "dump-after-pre.log"),
            ],
            check=True,
            capture_output=True,
        )
        return f"{read_dump_stats(final).frozen_s:.3f} s frozen"
    finally:
        for folder in (pre, final):
            shutil.rmtree(folder, ignore_errors=True)


def bench_config(
    engines: dict[str, Engine], criu: Path, work: Path, hot: Path, config: Config, repeat: int, run: Run
) -> None:
    size, rate = config.size, config.rate
    command = [sys.executable, "-u", str(HERE / "bench_memory.py"), str(size), str(rate)]
    tag = f"{size >> 20}m-{round(rate * 100)}"
    say(f"\n== {config.label} ==")
    raw = RawProcess(criu, work, command, f"raw-{tag}")
    jobs: dict[str, Job] = {}
    try:
        raw.wait_ready()
        raw_felt = Felt(lambda: raw.log)
        for kind in ("whole", "precopy"):
            jobs[kind] = Job(engines[kind], f"{kind}-{tag}", command)
        say("  all three ready; a warm-up checkpoint each")
        (hot / "warm").mkdir()
        try:
            plain_dump(criu, raw.pid, hot / "warm", work / "warm.log")
        finally:
            shutil.rmtree(hot / "warm")
        for job in jobs.values():
            job.checkpoint(Side())
        count = 0

        def raw_side() -> None:
            nonlocal count
            count += 1
            images = hot / f"raw-{count}"
            images.mkdir()
            raw_felt.skip()
            began = time.monotonic()
            try:
                frozen = plain_dump(criu, raw.pid, images, work / f"raw-{count}.log")
            finally:
                shutil.rmtree(images)
            side = config.sides["raw"]
            side.total.add(time.monotonic() - began)
            side.frozen.add(frozen)
            side.felt.add(raw_felt.largest())

        def torpor_side(kind: str) -> None:
            profiled = kind == "precopy" and size == max(c.size for c in run.configs) and rate == 0.01
            marks: list[tuple[float, str]] = []
            jobs[kind].checkpoint(config.sides[kind], marks)
            if profiled:  # the last such sample is the one kept
                run.marks = marks
                run.criu_steps = profile(jobs[kind].criu_log())

        for rep in range(repeat):
            rotate(rep, raw_side, lambda: torpor_side("whole"), lambda: torpor_side("precopy"))
            say(
                "  "
                + ", ".join(
                    f"{kind} felt {side.felt.values[-1]:.3f} s (frozen {side.frozen.values[-1]:.3f} s)"
                    for kind, side in config.sides.items()
                )
                + f"; rounds {[f'{b >> 20} MiB' for b, _ in config.sides['precopy'].rounds[-1]]}"
            )
        if size not in run.by_hand:
            run.by_hand[size] = by_hand(criu, raw.pid, hot, work)
            say(f"  CRIU's own pre-copy by hand: {run.by_hand[size]}")
    finally:
        raw.kill()
        for job in jobs.values():
            job.remove()


def bench_steady(engine: Engine, count: int, run: Run) -> None:
    """``count`` pre-copied checkpoints of a 1 GiB job rewriting 1 %/s: half spaced, half back to back."""
    command = [sys.executable, "-u", str(HERE / "bench_memory.py"), str(GIB), "0.01"]
    say(f"\n== steadiness: {count} pre-copied checkpoints of 1 GiB at 1 %/s, half back to back ==")
    job = Job(engine, "steady", command)
    spaced, back = Side(), Side()
    try:
        job.checkpoint(Side())
        for _ in range(count - count // 2):
            job.checkpoint(spaced)
        taken = [job.checkpoint(back, wait=False) for _ in range(count // 2)]
        for checkpoint_id in taken:
            job.settle(checkpoint_id, back)
        say(f"  spaced felt {spread(spaced.felt, 3)} s; back to back {spread(back.felt, 3)} s")
    finally:
        job.remove()
    run.steady, run.steady_back = spaced, back


def bench_training(engines: dict[str, Engine], count: int, run: Run) -> None:
    """``count`` checkpoints each of two training processes, one whole, one pre-copied, alternated."""
    command = [sys.executable, "-u", str(HERE / "bench_train.py"), "serve", "--tick"]
    say(f"\n== training: {count} checkpoints each, whole and pre-copied, alternated ==")
    jobs: dict[str, Job] = {}
    sides = {kind: Side() for kind in ("whole", "precopy")}
    try:
        for kind in sides:
            jobs[kind] = Job(engines[kind], f"train-{kind}", command)
        for job in jobs.values():
            job.checkpoint(Side())

        def side(kind: str) -> Callable[[], None]:
            def take() -> None:
                jobs[kind].checkpoint(sides[kind])

            return take

        for rep in range(count):
            rotate(rep, side("whole"), side("precopy"))
            say(
                "  "
                + ", ".join(f"{kind} felt {each.felt.values[-1]:.3f} s" for kind, each in sides.items())
                + f"; rounds {[f'{b >> 20} MiB' for b, _ in sides['precopy'].rounds[-1]]}"
            )
    finally:
        for job in jobs.values():
            job.remove()
    run.training = sides


# -- the section ------------------------------------------------------------------------------------


def _x(a: float, b: float) -> str:
    return f"{a / b:.3f}×" if b else "-"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.0f} KiB"


def render(run: Run, repeat: int, took_s: float, described: list[tuple[str, str]]) -> str:
    out = [
        "## Pre-copied checkpoints: the freeze for what the job changed (`scripts/bench_precopy.py`)",
        "",
        f"Written on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, in {took_s / 60:.0f} min, on the "
        f"machine below. Each figure is the median of {repeat} samples, the three kinds alternated (all "
        "samples below). Felt: the largest gap the job's own 5 ms loop saw; frozen: CRIU's stats. Every "
        "dump went into the tmpfs of torpor's hot tier. Each torpor checkpoint was a job's first (the one "
        "before deleted), waited on until durable.",
        "",
        "| memory, rewritten | raw `criu dump` felt | torpor whole felt | pre-copied felt | pre-copied ÷ raw "
        "(goal) | pre-copied ÷ whole | frozen (CRIU): raw / whole / pre-copied | rounds (median copied) | "
        "total: whole / pre-copied | stored: whole / pre-copied |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in run.configs:
        raw, whole, pre = (config.sides[kind] for kind in KINDS)
        goal = GOALS.get(config.rate) if config.size >= 4 * GIB else None
        ratio = pre.felt.median / raw.felt.median if raw.felt.median else float("inf")
        verdict = f" (≤ {goal}: {'met' if ratio <= goal else 'NOT met'})" if goal is not None else ""
        counts = sorted(len(r) for r in pre.rounds)
        copied = sorted(sum(b for b, _ in r) for r in pre.rounds)
        out.append(
            f"| {config.label} | {raw.felt.median:.3f} s | {whole.felt.median:.3f} s | "
            f"{pre.felt.median:.3f} s | {ratio:.3f}×{verdict} | {_x(pre.felt.median, whole.felt.median)} | "
            f"{raw.frozen.median:.3f} / {whole.frozen.median:.3f} / {pre.frozen.median:.3f} s | "
            f"{counts[len(counts) // 2] if counts else 0} ({_mib(copied[len(copied) // 2] if copied else 0)}) | "
            f"{whole.total.median:.2f} / {pre.total.median:.2f} s "
            f"({_x(pre.total.median, whole.total.median)}, goal ≤ {TOTAL_BAR:g}×) | "
            f"{_mib(whole.stored.median)} / {_mib(pre.stored.median)} |"
        )
    out += [
        "",
        "CRIU's own pre-copy by hand (`criu pre-dump --track-mem`, then `criu dump --prev-images-dir "
        "--track-mem`), tried on the raw process:",
        "",
    ]
    out += [f"- {size / GIB:g} GiB: {said}" for size, said in sorted(run.by_hand.items())]
    if run.marks:
        out += [
            "",
            "### Where one pre-copied 4 GiB checkpoint (1 %/s) spent its time",
            "",
            "torpor's progress lines, seconds since the command began:",
            "",
            "| at | line |",
            "|---|---|",
        ]
        out += [f"| {at:.3f} s | {text.replace('|', '/')} |" for at, text in run.marks]
        out += [
            "",
            "CRIU's `-v4` timestamps of its dump (the freeze lies between *collect and freeze* and "
            "*resume the tree*):",
            "",
            "| step | s |",
            "|---|---|",
        ]
        out += [f"| {step} | {run.criu_steps.get(step, 0.0):.3f} |" for step, _ in STEPS]
    if run.steady is not None and run.steady_back is not None:
        felt = run.steady.felt.values + run.steady_back.felt.values
        mid = sorted(felt)[len(felt) // 2]
        worst = max(felt)
        out += [
            "",
            "### Steadiness: pre-copied checkpoints of 1 GiB at 1 %/s",
            "",
            f"Felt: median {mid:.3f} s, worst {worst:.3f} s ({_x(worst, mid)}, goal ≤ {STEADY_BAR:g}×: "
            f"{'met' if worst <= STEADY_BAR * mid else 'NOT met'}); spaced {spread(run.steady.felt, 3)} s; "
            f"back to back {spread(run.steady_back.felt, 3)} s.",
        ]
    out += ["", "### Every sample (seconds)", ""]
    for config in run.configs:
        for kind in KINDS:
            side = config.sides[kind]
            out.append(
                f"- {config.label}, {LABELS[kind]}: felt {spread(side.felt, 3)}; frozen {spread(side.frozen, 3)}; "
                f"total {spread(side.total)}"
            )
        rounds = "; ".join(
            " + ".join(f"{_mib(b)} in {s:.2f} s" for b, s in r) or "none"
            for r in config.sides["precopy"].rounds
        )
        out.append(f"- {config.label}, the rounds of each pre-copied checkpoint: {rounds}")
    out += ["", machine_table(described), ""]
    return "\n".join(out)


def render_training(run: Run, count: int, described: list[tuple[str, str]]) -> str:
    whole, pre = run.training["whole"], run.training["precopy"]
    counts = sorted(len(r) for r in pre.rounds)
    felt = _x(pre.felt.median, whole.felt.median)
    met = "met" if pre.felt.median <= TRAIN_BAR * whole.felt.median else "NOT met"
    rounds = "; ".join(" + ".join(f"{_mib(b)} in {s:.2f} s" for b, s in r) or "none" for r in pre.rounds)
    return "\n".join(
        [
            "## Pre-copied checkpoints of a training process (`scripts/bench_precopy.py`)",
            "",
            f"Written on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the machine below. Two "
            "training processes (`scripts/bench_train.py serve --tick`: the 84 M parameter MLP with Adam, a "
            "step then 0.5 s of sleep, a thread ticking every 5 ms), one started with `TORPOR_PRECOPY=0`, one "
            f"with pre-copy, checkpointed in turn, {count} times each (medians; every sample below). A step "
            "rewrites all of the weights and the optimizer's state, and the sleep after it leaves them at rest: "
            "the rounds shrink while the job sleeps and stop where a step rewrites them all, so the freeze is "
            "short or, at worst, a whole dump's. The issue's bar: a freeze no longer than the whole dump's "
            "(≤ 1.1×).",
            "",
            "| | felt | frozen (CRIU) | total | stored | rounds |",
            "|---|---|---|---|---|---|",
            f"| torpor, whole | {whole.felt.median:.3f} s | {whole.frozen.median:.3f} s | "
            f"{whole.total.median:.2f} s | {_mib(whole.stored.median)} | - |",
            f"| torpor, pre-copied | {pre.felt.median:.3f} s ({felt}, goal ≤ {TRAIN_BAR:g}×: {met}) | "
            f"{pre.frozen.median:.3f} s | {pre.total.median:.2f} s ({_x(pre.total.median, whole.total.median)}) | "
            f"{_mib(pre.stored.median)} | {counts[len(counts) // 2] if counts else 0} |",
            "",
            f"- whole: felt {spread(whole.felt, 3)}; frozen {spread(whole.frozen, 3)}; total {spread(whole.total)}",
            f"- pre-copied: felt {spread(pre.felt, 3)}; frozen {spread(pre.frozen, 3)}; total {spread(pre.total)}",
            f"- the rounds of each pre-copied checkpoint: {rounds}",
            "",
            machine_table(described),
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1,4", help="GiB of memory")
    parser.add_argument("--rates", default="0,0.01,0.1", help="fractions of the memory rewritten a second")
    parser.add_argument("--steady", type=int, default=10, help="checkpoints for steadiness (0: skip)")
    parser.add_argument(
        "--training", type=int, default=5, help="checkpoints of each training process (0: skip; needs torch)"
    )
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        say("bench_precopy needs root (CRIU dumps processes)")
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
        engines = {kind: Engine(dataclasses.replace(settings, precopy=kind == "precopy")) for kind in KINDS}
        run = Run()
        run.configs = [
            Config(int(float(size) * GIB), float(rate))
            for size in args.sizes.split(",")
            if size
            for rate in args.rates.split(",")
            if rate
        ]
        with raw_folder_in_hot_tier(engines["whole"]) as hot:
            for config in run.configs:
                bench_config(engines, settings.criu, work, hot, config, args.repeat, run)
            if args.steady:
                bench_steady(engines["precopy"], args.steady, run)
            if args.training:
                bench_training(engines, args.training, run)
        described = machine(criu)
        if run.configs:
            publish(
                "precopy",
                render(run, args.repeat, time.monotonic() - started, described),
                args.doc,
                args.no_write,
            )
        if run.training:
            publish(
                "precopy-training", render_training(run, args.training, described), args.doc, args.no_write
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
