"""``make demo``: torpor checkpoints, hibernates and resumes a PyTorch training job, and proves nothing changed.

The story, told on the terminal as it happens:

1. run the training script (:mod:`torpor.apps.demo_train`) directly, without torpor: the reference;
2. start the same script as a torpor job;
3. checkpoint it while it trains (it keeps running);
4. hibernate it: checkpoint, then stop it — its processes are gone and its memory is freed;
5. resume it from the hibernation image and let it finish;
6. compare every loss (and the final weights) with the reference, and print freeze time, image size and
   restore time.

It runs on embedded defaults: a temporary state directory under /tmp (or ``TORPOR_HOME`` if set), which
it removes afterwards with the job. It drives the engine directly, and prints the ``torpor`` command that
does the same from a shell. Exit status 0 when the losses match, 1 when they differ, the error's code
when torpor fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torpor.adapters.system import private, procfs
from torpor.core.engine import Engine
from torpor.core.recordtypes import JobState
from torpor.core.store import remove_hot_tier
from torpor.errors import DemoFailed, EnvironmentProblem, TorporError
from torpor.settings import Settings

TRAIN_SCRIPT = Path(__file__).with_name("demo_train.py")
_STEP = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)$")
_DONE = re.compile(r"^done: .*weights sha256 ([0-9a-f]+)$")


@dataclass(frozen=True)
class TrainingOutput:
    """What a training run printed: loss per step (as printed) and the final weights' digest."""

    losses: dict[int, str]
    digest: str | None
    conflicts: list[int]  # steps printed twice with different losses (should never happen)


def parse_output(text: str) -> TrainingOutput:
    losses: dict[int, str] = {}
    conflicts: list[int] = []
    digest = None
    for line in text.splitlines():
        if match := _STEP.match(line.strip()):
            step, loss = int(match.group(1)), match.group(2)
            if losses.setdefault(step, loss) != loss:
                conflicts.append(step)
        elif match := _DONE.match(line.strip()):
            digest = match.group(1)
    return TrainingOutput(losses, digest, conflicts)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


class Demo:
    def __init__(self, engine: Engine, steps: int, pace: float, data_mib: int) -> None:
        self.engine = engine
        self.steps = steps
        self.pace = pace
        self.data_mib = data_mib
        taken = {job.name for job in engine.records.jobs()}
        self.name = next(n for n in (f"demo-train{s}" for s in ("", *range(2, 100))) if n not in taken)
        self.started = time.monotonic()

    # -- narration ------------------------------------------------------------------------------------

    def say(self, text: str = "") -> None:
        print(text, flush=True)

    def chapter(self, number: int, title: str, command: str | None = None) -> None:
        self.say()
        self.say(f"[{number}/6] {title}")
        if command:
            self.say(f"      $ {command}")

    def note(self, text: str) -> None:
        self.say(f"      {text}")

    # -- the job's log --------------------------------------------------------------------------------

    def log(self) -> str:
        try:
            text = self.engine.log_path(self.name).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[: text.rfind("\n") + 1]  # complete lines only: the job may be mid-print

    def last_step(self) -> int:
        losses = parse_output(self.log()).losses
        return max(losses) if losses else 0

    def wait(self, done: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            job = self.engine.status(self.name).job
            # the job may have ended between done() and status(): what it did before ending counts
            if job.state in (JobState.EXITED, JobState.FAILED) and not done():
                raise DemoFailed(
                    f"the training job {job.state} while waiting for {what}",
                    details=self.log().splitlines()[-5:],
                )
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out waiting for {what}", details=self.log().splitlines()[-5:])
            time.sleep(0.1)

    def wait_step(self, step: int) -> None:
        self.wait(lambda: self.last_step() >= step, f"step {step}")

    # -- the story ------------------------------------------------------------------------------------

    def train_command(self, pace: float) -> list[str]:
        return [
            sys.executable,
            "-u",
            str(TRAIN_SCRIPT),
            "--steps",
            str(self.steps),
            "--pace",
            str(pace),
            "--data-mib",
            str(self.data_mib),
        ]

    def run(self) -> int:
        steps = self.steps
        info = self.engine.ctx.criu.require()  # fail before the reference run, not halfway through
        self.say("torpor demo: make a running PyTorch training job preemptible, without changing it")
        self.say(f"CRIU {info.version} at {info.path}")
        self.say(f"state directory: {self.engine.settings.home}")

        self.chapter(1, "The reference: the training script run directly, without torpor")
        command = self.train_command(0.0)
        self.note("$ " + " ".join(["python", *command[1:]]))
        began = time.monotonic()
        reference_run = subprocess.run(
            command, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
        )
        if reference_run.returncode != 0:
            raise DemoFailed(
                f"the reference training run failed (exit {reference_run.returncode})",
                details=reference_run.stderr.splitlines()[-5:],
            )
        reference = parse_output(reference_run.stdout)
        self.note(
            f"{len(reference.losses)} steps in {time.monotonic() - began:.1f} s; "
            f"last loss {reference.losses.get(steps)}"
        )

        command = self.train_command(self.pace)
        self.chapter(
            2,
            f"Start the same script as a torpor job (it sleeps {self.pace} s per step so we can watch)",
            f"torpor run --name {self.name} -- python -u {TRAIN_SCRIPT.name} --pace {self.pace} ...",
        )
        job = self.engine.run(self.name, command, os.getcwd())
        self.note(f"job '{self.name}' runs detached in its own PID namespace (pid {job.pid})")
        at = steps * 3 // 10
        self.wait_step(at)
        self.note(
            f"it is training: step {self.last_step()}, loss {parse_output(self.log()).losses[at]} at {at}"
        )

        self.chapter(3, "Checkpoint it while it trains", f"torpor checkpoint {self.name}")
        checkpointed_at = self.last_step()
        checkpoint = self.engine.checkpoint(self.name)
        self.note(
            f"checkpoint {checkpoint.id}: the job was frozen for {checkpoint.freeze_s:.2f} s; "
            f"image {mib(checkpoint.size_bytes)}"
        )
        before = self.last_step()
        self.wait_step(before + 5)
        self.note(f"and it kept running: step {before} -> {self.last_step()}")

        self.wait_step(steps * 11 // 20)
        self.chapter(
            4, "Hibernate it: checkpoint, then stop it to free its memory", f"torpor hibernate {self.name}"
        )
        status = self.engine.status(self.name)
        pid = status.job.pid
        assert pid is not None
        members = procfs.namespace_members(pid)
        rss = status.rss_bytes or 0
        self.note(f"before: {len(members)} process(es) (pids {members}), {mib(rss)} resident")
        hibernation = self.engine.checkpoint(self.name, hibernate=True)
        frozen_at = self.last_step()
        alive = [p for p in members if procfs.is_alive(p)]
        self.note(
            f"after: hibernated at step {frozen_at} as {hibernation.id} ({mib(hibernation.size_bytes)}); "
            f"processes alive: {len(alive)} -> {mib(rss)} of memory freed"
        )
        if alive:
            raise DemoFailed(f"hibernation left processes running: {alive}")
        self.note(f"the image waits in torpor's RAM hot tier ({self.engine.settings.hot_path}) while a")
        self.note("background process stores it on disk; once it is there, the RAM copy is dropped too")
        time.sleep(2)
        self.note(f"2 s later the log still ends at step {self.last_step()}: nothing runs, nothing is lost")
        self.note(f"image {hibernation.id}: {self.engine.ctx.store.state(hibernation.id).state_text}")

        self.chapter(5, "Resume it from its image", f"torpor resume {self.name}")
        job, _, restore_s = self.engine.restore(self.name)
        self.note(f"restored in {restore_s:.2f} s (new pid {job.pid}); it goes on from step {frozen_at + 1}")
        self.wait(
            lambda: self.engine.status(self.name).job.state in (JobState.EXITED, JobState.FAILED),
            "the job to finish",
            timeout=steps * (self.pace + 1) + 60,
        )
        job = self.engine.status(self.name).job
        self.note(f"the job finished: {job.state}, exit code {job.exit_code}")

        self.chapter(6, "Compare with the uninterrupted run")
        resumed = parse_output(self.log())
        same = [s for s in range(1, steps + 1) if resumed.losses.get(s) == reference.losses.get(s)]
        differ = [s for s in range(1, steps + 1) if resumed.losses.get(s) != reference.losses.get(s)]
        digest_ok = resumed.digest is not None and resumed.digest == reference.digest
        self.say()
        self.say(f"      {'step':>6}  {'uninterrupted':>14}  {'under torpor':>14}")
        for step in sorted({1, checkpointed_at, frozen_at, frozen_at + 1, steps, *differ[:5]}):
            mark = "" if step not in differ else "   <- differs"
            labels = {
                checkpointed_at: "  (checkpoint)",
                frozen_at: "  (hibernated)",
                frozen_at + 1: "  (resumed)",
            }
            self.say(
                f"      {step:>6}  {reference.losses.get(step, '-'):>14}  {resumed.losses.get(step, '-'):>14}"
                f"{mark or labels.get(step, '')}"
            )
        self.say()
        self.note(f"identical losses: {len(same)} of {steps} steps")
        self.note(
            f"final weights sha256: {'identical' if digest_ok else 'DIFFERENT'} "
            f"({(resumed.digest or 'missing')[:16]}…)"
        )

        self.say()
        rows = [
            ("checkpoint (job kept running)", checkpoint.freeze_s, checkpoint.size_bytes, None),
            ("hibernate (job stopped)", hibernation.freeze_s, hibernation.size_bytes, restore_s),
        ]
        self.say(f"      {'':<30}  {'frozen':>8}  {'image':>9}  {'restore':>8}")
        for label, freeze, size, restore in rows:
            restore_text = f"{restore:.2f} s" if restore is not None else "-"
            self.say(f"      {label:<30}  {freeze:>6.2f} s  {mib(size):>9}  {restore_text:>8}")

        self.say()
        ok = not differ and digest_ok and not resumed.conflicts and job.exit_code == 0
        if ok:
            self.say(
                f"OK: after a checkpoint, a hibernation and a resume, the job printed exactly the losses of "
                f"the uninterrupted run ({time.monotonic() - self.started:.0f} s in all)."
            )
            return 0
        self.say(
            f"FAILED: the losses differ at {len(differ)} step(s) {differ[:10]}"
            + (
                f", steps printed twice with different losses {resumed.conflicts[:10]}"
                if resumed.conflicts
                else ""
            )
            + ("" if digest_ok else ", the final weights differ")
            + (f", exit code {job.exit_code}" if job.exit_code != 0 else "")
        )
        return 1

    def clean_up(self) -> None:
        # let the background destager finish storing the images before they are deleted under it
        with contextlib.suppress(TorporError):
            for checkpoint in self.engine.checkpoints(self.name):
                self.engine.wait_durable(checkpoint.id)
        with contextlib.suppress(TorporError):
            self.engine.remove(self.name, force=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torpor.apps.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds the job sleeps per step")
    parser.add_argument("--data-mib", type=int, default=128, help="in-memory data set size (MiB)")
    parser.add_argument("--keep", action="store_true", help="keep the job and its state directory")
    args = parser.parse_args(argv)

    if os.geteuid() != 0:
        print(
            "torpor demo: needs root (CRIU checkpoints and restores processes): run it with sudo",
            file=sys.stderr,
        )
        return EnvironmentProblem.exit_code
    own_home = not os.environ.get("TORPOR_HOME")
    home = Path(tempfile.mkdtemp(prefix="torpor-demo-")) if own_home else None
    caller_umask = os.umask(private.PRIVATE_UMASK)  # as the CLI: torpor's files private, the job's not
    settings = dataclasses.replace(
        Settings.from_environment(home=str(home) if home else None), job_umask=caller_umask
    )
    demo: Demo | None = None
    try:
        engine = Engine(settings)
        demo = Demo(engine, args.steps, args.pace, args.data_mib)
        return demo.run()
    except TorporError as exc:
        print(f"torpor demo: {exc.message}", file=sys.stderr)
        for line in exc.details:
            print(f"  {line}", file=sys.stderr)
        return exc.exit_code
    finally:
        if not args.keep:
            if demo is not None:
                demo.clean_up()
            if home is not None:
                shutil.rmtree(home, ignore_errors=True)
                remove_hot_tier(settings)  # it lives in RAM, outside home
        elif home is not None:
            print(f"kept the state directory {home} (TORPOR_HOME={home} torpor ps)")


if __name__ == "__main__":
    sys.exit(main())
