"""``make bench``: torpor's checkpoint and restore against raw CRIU and against ``torch.save``/``torch.load``.

Measured in one run; each measurement is repeated (``--repeat``, default 3) and reported as the median
(every sample is listed too):

1. A process holding 1 GiB and 4 GiB of random (touched, incompressible) memory
   (``scripts/bench_memory.py``), run as a torpor job and as a plain process in its own PID namespace
   (``unshare --pid --fork setsid python …``) that raw ``criu dump``/``criu restore`` handle with the
   options torpor's CRIU adapter uses. Checkpoints (``--leave-running``) of the two are interleaved,
   rotating which goes first; raw CRIU dumps both into a folder on disk (the issue's anchor) and into
   the RAM file system of torpor's hot tier (to tell torpor's own overhead from where it writes). Then
   hibernate + restore, each side alone on the machine: ``criu dump`` + ``criu restore -d`` vs
   ``torpor hibernate`` + ``torpor resume``. Measured: frozen time (CRIU's own, from its stats-dump
   image, on every side), the command's total time, the time until torpor's image is durable, image
   size, restore time.
2. A CPU training process (``scripts/bench_train.py``: an MLP of 5 × Linear(4096, 4096) with Adam,
   84 M parameters, about 1 GB of model + optimizer state): ``torch.save`` and ``torch.load`` of that state
   and a fresh-process restart from the file, vs torpor's checkpoint and resume of the running process,
   plus raw ``criu dump`` of the same process.

After every torpor checkpoint the benchmark waits until the image is durable and the destager is idle,
so that background work does not land in the next measurement.

Writes its section of ``docs/benchmarks.md`` between ``<!-- core:begin -->`` and ``<!-- core:end -->``
(creating the file, with a description of the machine, if it does not exist).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchdoc import DOC, cpu_model, dir_bytes, median, memory_total, publish, say, wait_for

from torpor.adapters.criu import GHOST_LIMIT, NO_TCP_DUMP_OPTIONS, Criu
from torpor.adapters.criuimage import read_dump_stats
from torpor.adapters.imagestreamer import ImageStreamer
from torpor.adapters.system import ownprocess, procfs
from torpor.core.engine import Engine
from torpor.core.store import remove_hot_tier
from torpor.settings import Settings

HERE = Path(__file__).resolve().parent
GIB = 2**30
FREEZE_BAR = 1.10  # issue 2: torpor adds at most 10 % to raw CRIU's freeze time
KEEP = False  # --keep: leave jobs and CRIU logs behind for a post-mortem


@dataclass
class Samples:
    """Repeated measurements of one quantity."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return median(self.values)


@dataclass
class DumpSamples:
    freeze_s: Samples = field(default_factory=Samples)
    total_s: Samples = field(default_factory=Samples)
    image_bytes: Samples = field(default_factory=Samples)
    #: torpor only: from the command's start until the image is durable in the cold tier
    durable_s: Samples = field(default_factory=Samples)

    def add(self, freeze_s: float, total_s: float, image_bytes: int, durable_s: float | None = None) -> None:
        self.freeze_s.add(freeze_s)
        self.total_s.add(total_s)
        self.image_bytes.add(float(image_bytes))
        if durable_s is not None:
            self.durable_s.add(durable_s)


# -- raw CRIU ------------------------------------------------------------------------------------------


class RawProcess:
    """A workload in its own PID namespace and session, dumped and restored by plain ``criu`` commands."""

    def __init__(self, criu: Path, work: Path, command: list[str], name: str) -> None:
        self.criu = criu
        self.work = work / name
        self.work.mkdir(parents=True)
        self.log = self.work / "output.log"
        self.count = 0
        with open(self.log, "ab") as log:
            self.unshare = subprocess.Popen(
                ["unshare", "--pid", "--fork", "setsid", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
        wait_for(lambda: children.read_text().strip() != "", "the raw workload to start", 10)
        self.pid = int(children.read_text().split()[0])
        self.restored = False  # a restored root is our child (we are a subreaper), not unshare's
        self.last_criu_s = 0.0  # CRIU's own time in the last restore, from its log
        self.last_image: Path | None = None
        self.killed = False

    def wait_ready(self, text: str = "ready") -> None:
        wait_for(lambda: text in self.log.read_text(errors="replace"), f"{text!r} from the raw workload")

    def _options(self) -> list[str]:
        return ["-v4", *NO_TCP_DUMP_OPTIONS]

    def dump(
        self, leave_running: bool, into: Path | None = None, tcp: bool = False
    ) -> tuple[float, float, int]:
        """(frozen s, wall s, image bytes) of one ``criu dump`` into a new folder under ``into`` (default:
        the work folder, on disk), with the options torpor uses for a tree without a TCP socket (``tcp``:
        for one with, the network lock included); a ``--leave-running`` image is deleted afterwards."""
        self.count += 1
        images = (into or self.work) / f"dump-{self.count}"
        images.mkdir()
        command = Criu(self.criu).dump_command(
            self.pid, images, self.work / f"dump-{self.count}.log", leave_running=leave_running, tcp=tcp
        )
        began = time.monotonic()
        subprocess.run(command, check=True, stdin=subprocess.DEVNULL, capture_output=True)
        wall = time.monotonic() - began
        stats = read_dump_stats(images)
        size = dir_bytes(images)
        if leave_running:
            shutil.rmtree(images)
        else:
            self._reap()
            self.last_image = images
        return stats.frozen_s or wall, wall, size

    def restore(self, streamed: bool = False, via: tuple[str, ...] = ()) -> float:
        """Restore the last (killing) dump with ``criu restore -d``; returns its wall time (CRIU's own, from
        its log, goes to ``last_criu_s``). ``streamed``: ``criu restore --stream``, every file served from
        the folder by torpor's image streamer as it is (spliced, no copy, nothing verified): what CRIU's
        stream mode itself costs, the mode torpor restores from its cold tier in. ``via``: the command
        to run CRIU through (``ip netns exec NS``: restored on another node)."""
        images = self.last_image
        assert images is not None, "restore() follows a dump(leave_running=False)"
        pidfile = self.work / f"restore-{self.count}.pid"
        command = [
            *via,
            str(self.criu),
            "restore",
            "--images-dir",
            "." if streamed else str(images),
            "--log-file",
            str(self.work / f"restore-{self.count}.log"),
            "--restore-detached",
            "--pidfile",
            str(pidfile),
            *self._options(),
            *(["--stream"] if streamed else []),
        ]
        streamer = ImageStreamer(images) if streamed else None
        if streamer is not None:
            streamer.start()
        try:
            began = time.monotonic()
            subprocess.run(
                command,
                check=True,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd=images if streamed else None,
            )
            wall = time.monotonic() - began
        finally:
            if streamer is not None:
                streamer.stop()
        self.last_criu_s = criu_log_seconds(self.work / f"restore-{self.count}.log")
        self.pid = int(pidfile.read_text().strip())
        self.restored = True
        shutil.rmtree(images)
        return wall

    def _reap(self) -> None:
        if self.restored:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        else:
            self.unshare.wait(timeout=60)

    def kill(self) -> None:
        if self.killed:
            return  # never signal a pid again once ours is gone: it may belong to someone else now
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._reap()
        if self.unshare.poll() is None:
            self.unshare.kill()
            self.unshare.wait()
        shutil.rmtree(self.work, ignore_errors=True)


# -- torpor ----------------------------------------------------------------------------------------------


class TorporJob:
    def __init__(self, engine: Engine, name: str, command: list[str]) -> None:
        self.engine = engine
        self.name = name
        #: the checkpoint kept (see ``checkpoint``): the job's last one, in RAM until the next takes it over
        self.kept: str | None = None
        engine.run(name, command, str(HERE))

    def wait_ready(self, text: str = "ready") -> None:
        log = self.engine.log_path(self.name)
        wait_for(
            lambda: log.exists() and text in log.read_text(errors="replace"), f"{text!r} from {self.name}"
        )

    def _forget(self, checkpoint_id: str) -> None:
        """Delete a measured checkpoint so that repeated runs do not fill the disk."""
        self.engine.ctx.store.delete(checkpoint_id)
        self.engine.records.delete_checkpoint(checkpoint_id)

    def checkpoint(self, hibernate: bool, keep: bool = False) -> tuple[float, float, int, float]:
        """(frozen s, wall s, image bytes, s until durable) of one checkpoint or hibernation.

        A checkpoint is deleted once measured, unless ``keep``: then it stays the job's last one (the one
        kept before is deleted), and the job's next checkpoint writes its pages over that one's memory in
        RAM, as a job's periodic checkpoints do. Without it there is no older copy, and each checkpoint
        writes zeros over fresh memory before its freeze, as a job's first one does."""
        began = time.monotonic()
        checkpoint = self.engine.checkpoint(self.name, hibernate=hibernate)
        wall = time.monotonic() - began
        # The destager stores the image in the cold tier in the background; wait for it so that its
        # work (chunking, compressing, hashing on our 2 cores) does not land in the next measurement.
        self.engine.wait_durable(checkpoint.id)
        durable = time.monotonic() - began
        store = self.engine.ctx.store
        wait_for(lambda: not store.destager_running(), "the destager to go idle", 120)
        if hibernate:
            self.hibernated = checkpoint.id
        elif keep:
            if self.kept is not None:
                self._forget(self.kept)
            self.kept = checkpoint.id
        else:
            self._forget(checkpoint.id)
        return checkpoint.freeze_s, wall, checkpoint.size_bytes, durable

    def resume(self, spans: RestoreSpans | None = None) -> float:
        """``torpor resume`` of the last hibernation: its wall time; ``spans`` gets where that time went."""
        marks: list[tuple[float, str]] = []
        began = time.monotonic()
        self.engine.restore(self.name, progress=lambda text: marks.append((time.monotonic(), text)))
        ended = time.monotonic()
        if spans is not None:
            spans.add(began, marks, ended, self.engine.ctx.criu_log(self.name, "restore", self.hibernated))
        self._forget(self.hibernated)
        return ended - began

    def pid(self) -> int:
        pid = self.engine.status(self.name).job.pid
        assert pid is not None
        return pid

    def rss(self) -> int:
        return self.engine.status(self.name).rss_bytes or 0

    def remove(self) -> None:
        if KEEP:
            return
        with contextlib.suppress(Exception):
            self.engine.remove(self.name, force=True)


#: where the time of ``torpor resume`` goes: (span, the progress message that ends it; None: the return)
RESTORE_SPANS: tuple[tuple[str, str | None], ...] = (
    ("launcher started, the old tree checked gone", "fetching checkpoint"),
    ("image opened, metadata verified, the job's files and sockets prepared", "restoring with criu"),
    ("`criu restore` with the pages verified as CRIU reads them, until the job runs", None),
)


#: a line of CRIU's -v4 log: "(SS.UUUUUU) text", seconds since CRIU started
CRIU_LOG_LINE = re.compile(r"^\((\d+\.\d+)\)\s?(.*)$", re.MULTILINE)


def criu_log_seconds(log: Path) -> float:
    """CRIU's own run time: the last timestamp of its ``-v4`` log (0 when it has none)."""
    stamps = CRIU_LOG_LINE.findall(log.read_text(errors="replace"))
    return float(stamps[-1][0]) if stamps else 0.0


@dataclass
class RestoreSpans:
    """torpor resume's time split by its progress messages (RESTORE_SPANS), and CRIU's own share of it."""

    spans: dict[str, Samples] = field(default_factory=lambda: {name: Samples() for name, _ in RESTORE_SPANS})
    criu_s: Samples = field(default_factory=Samples)

    def add(self, began: float, marks: list[tuple[float, str]], ended: float, log: Path) -> None:
        at = began
        for name, until in RESTORE_SPANS:
            end = ended if until is None else next((t for t, text in marks if text.startswith(until)), at)
            self.spans[name].add(end - at)
            at = end
        self.criu_s.add(criu_log_seconds(log) if log.exists() else 0.0)


def rotate(rep: int, *actions: Callable[[], None]) -> None:
    """Run all of ``actions``, starting with a different one on each repetition."""
    for i in range(len(actions)):
        actions[(rep + i) % len(actions)]()


# -- 1. memory ---------------------------------------------------------------------------------------------


@dataclass
class MemoryResult:
    size: int
    rss: int = 0
    raw_ckpt: DumpSamples = field(default_factory=DumpSamples)
    raw_hot_ckpt: DumpSamples = field(default_factory=DumpSamples)
    torpor_ckpt: DumpSamples = field(default_factory=DumpSamples)
    raw_hib: DumpSamples = field(default_factory=DumpSamples)
    torpor_hib: DumpSamples = field(default_factory=DumpSamples)
    #: hibernations right after a durable checkpoint, whose copy in RAM they take over
    torpor_hib_taken: DumpSamples = field(default_factory=DumpSamples)
    raw_restore: Samples = field(default_factory=Samples)
    raw_restore_criu: Samples = field(default_factory=Samples)  # CRIU's own time, from its log
    #: raw restores while another process hashes 1 MiB pieces with BLAKE3, as torpor verifies what it reads
    raw_restore_busy: Samples = field(default_factory=Samples)
    #: raw restores in CRIU's stream mode (``criu restore --stream``), the files spliced from the folder
    raw_restore_streamed: Samples = field(default_factory=Samples)
    torpor_restore: Samples = field(default_factory=Samples)
    torpor_restore_spans: RestoreSpans = field(default_factory=RestoreSpans)


def bench_memory(engine: Engine, criu: Path, work: Path, hot: Path, size: int, repeat: int) -> MemoryResult:
    command = [sys.executable, "-u", str(HERE / "bench_memory.py"), str(size)]
    label = f"{size / GIB:g} GiB"
    say(f"\n== a process holding {label} of random memory ==")
    result = MemoryResult(size)
    raw = RawProcess(criu, work, command, f"raw-{size // 2**20}m")
    job = TorporJob(engine, f"mem-{size // 2**20}m", command)
    try:
        raw.wait_ready()
        job.wait_ready()
        result.rss = job.rss()
        say(f"  both ready; torpor job resident {result.rss / GIB:.2f} GiB; one warm-up checkpoint each")
        raw.dump(leave_running=True)
        job.checkpoint(hibernate=False)
        for rep in range(repeat):

            def raw_ckpt() -> None:
                result.raw_ckpt.add(*raw.dump(leave_running=True))

            def raw_hot_ckpt() -> None:
                result.raw_hot_ckpt.add(*raw.dump(leave_running=True, into=hot))

            def torpor_ckpt() -> None:
                result.torpor_ckpt.add(*job.checkpoint(hibernate=False))

            rotate(rep, raw_ckpt, raw_hot_ckpt, torpor_ckpt)
            say(
                f"  checkpoint {rep + 1}: frozen raw {result.raw_ckpt.freeze_s.values[-1]:.2f} s, "
                f"raw into {hot.parent} {result.raw_hot_ckpt.freeze_s.values[-1]:.2f} s, "
                f"torpor {result.torpor_ckpt.freeze_s.values[-1]:.2f} s; total raw "
                f"{result.raw_ckpt.total_s.values[-1]:.2f} s, torpor {result.torpor_ckpt.total_s.values[-1]:.2f} s"
            )
        # Hibernate and restore: each side alone on the machine with its process, so that neither pays for
        # the other's memory (an image in torpor's RAM hot tier cannot be reclaimed like page cache).
        job.remove()
        for rep in range(repeat):
            result.raw_hib.add(*raw.dump(leave_running=False))
            result.raw_restore.add(raw.restore())
            result.raw_restore_criu.add(raw.last_criu_s)
            raw.dump(leave_running=False)
            with hashing_beside():
                result.raw_restore_busy.add(raw.restore())
            raw.dump(leave_running=False)
            result.raw_restore_streamed.add(raw.restore(streamed=True))
            say(
                f"  raw hibernate+restore {rep + 1}: frozen {result.raw_hib.freeze_s.values[-1]:.2f} s, "
                f"restore {result.raw_restore.values[-1]:.2f} s; with a core hashing beside it "
                f"{result.raw_restore_busy.values[-1]:.2f} s; streamed "
                f"{result.raw_restore_streamed.values[-1]:.2f} s"
            )
        wait_for(lambda: procfs.is_alive(raw.pid), "the raw workload to run after its restore", 10)
        raw.kill()
        job = TorporJob(engine, f"mem-{size // 2**20}m-2", command)
        job.wait_ready()
        for rep in range(repeat):
            result.torpor_hib.add(*job.checkpoint(hibernate=True))
            result.torpor_restore.add(job.resume(result.torpor_restore_spans))
            # as a job checkpointed every so often is hibernated: its last checkpoint is durable, in RAM
            job.checkpoint(hibernate=False, keep=True)
            result.torpor_hib_taken.add(*job.checkpoint(hibernate=True))
            job.resume()
            say(
                f"  torpor hibernate+resume {rep + 1}: frozen {result.torpor_hib.freeze_s.values[-1]:.2f} s, "
                f"restore {result.torpor_restore.values[-1]:.2f} s; right after a checkpoint: frozen "
                f"{result.torpor_hib_taken.freeze_s.values[-1]:.2f} s"
            )
        wait_for(lambda: procfs.is_alive(job.pid()), "the torpor job to run after its resume", 10)
    finally:
        raw.kill()
        job.remove()
    return result


#: a process that hashes 1 MiB of memory with BLAKE3 over and over, on one core, until it is killed
HASH_LOOP = (
    "import os, blake3\n"
    "piece = os.urandom(1 << 20)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    blake3.blake3(piece).digest()\n"
)


@contextlib.contextmanager
def hashing_beside() -> Iterator[None]:
    """One core kept busy as torpor's verification keeps it while CRIU restores (BLAKE3 over 1 MiB pieces)."""
    hasher = subprocess.Popen([sys.executable, "-c", HASH_LOOP], stdout=subprocess.PIPE, text=True)
    try:
        assert hasher.stdout is not None and hasher.stdout.readline().strip() == "ready"
        yield
    finally:
        hasher.kill()
        hasher.wait()


# -- 2. training state -------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    params: int = 0
    rss: int = 0
    save_s: Samples = field(default_factory=Samples)
    save_fsync_s: Samples = field(default_factory=Samples)  # torch.save into a file, then fsync
    load_s: Samples = field(default_factory=Samples)
    save_bytes: int = 0
    restart_s: Samples = field(default_factory=Samples)
    #: the job's next checkpoints (each over its last one's memory in RAM)
    torpor_ckpt: DumpSamples = field(default_factory=DumpSamples)
    #: the job's first checkpoint (no older copy: memory written with zeros before the freeze)
    torpor_first: DumpSamples = field(default_factory=DumpSamples)
    raw_ckpt: DumpSamples = field(default_factory=DumpSamples)
    raw_hot_ckpt: DumpSamples = field(default_factory=DumpSamples)
    torpor_restore: Samples = field(default_factory=Samples)


def bench_training(engine: Engine, criu: Path, work: Path, hot: Path, repeat: int) -> TrainResult:
    say("\n== a training process: 84M-parameter MLP + Adam ==")
    script = str(HERE / "bench_train.py")
    result = TrainResult()
    saved = work / "state.pt"
    out = subprocess.run(
        [sys.executable, script, "save", str(saved), "--repeat", str(repeat)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    result.params = report["params"]
    for run in report["runs"]:
        result.save_s.add(run["save_s"])
        result.save_fsync_s.add(run["save_fsync_s"])
        result.load_s.add(run["load_s"])
        result.save_bytes = run["bytes"]
    say(
        f"  torch.save {result.save_bytes / 1e9:.2f} GB: {result.save_s.median:.2f} s; "
        f"torch.load + load_state_dict {result.load_s.median:.2f} s; "
        f"torch.save + fsync {result.save_fsync_s.median:.2f} s"
    )
    for _ in range(repeat):
        began = time.monotonic()
        subprocess.run([sys.executable, script, "restart", str(saved)], check=True, capture_output=True)
        result.restart_s.add(time.monotonic() - began)
    saved.unlink()
    say(f"  restart of a fresh process from the file: {result.restart_s.median:.2f} s")

    job = TorporJob(engine, "train", [sys.executable, "-u", script, "serve"])
    try:
        job.wait_ready()
        result.rss = job.rss()
        result.torpor_first.add(*job.checkpoint(hibernate=False, keep=True))  # also the warm-up
        raw_dump_of(criu, work, job.pid(), "warm-up")
        for rep in range(repeat):

            def torpor_ckpt() -> None:
                result.torpor_ckpt.add(*job.checkpoint(hibernate=False, keep=True))

            def raw_ckpt(tag: str = f"disk-{rep}") -> None:
                result.raw_ckpt.add(*raw_dump_of(criu, work, job.pid(), tag))

            def raw_hot_ckpt(tag: str = f"hot-{rep}") -> None:
                result.raw_hot_ckpt.add(*raw_dump_of(criu, hot, job.pid(), tag))

            rotate(rep, torpor_ckpt, raw_ckpt, raw_hot_ckpt)
            say(
                f"  checkpoint {rep + 1}: frozen torpor {result.torpor_ckpt.freeze_s.values[-1]:.2f} s, "
                f"raw criu {result.raw_ckpt.freeze_s.values[-1]:.2f} s, "
                f"raw criu into {hot.parent} {result.raw_hot_ckpt.freeze_s.values[-1]:.2f} s"
            )
        for rep in range(repeat):
            job.checkpoint(hibernate=True)
            result.torpor_restore.add(job.resume())
            say(f"  hibernate + resume {rep + 1}: restore {result.torpor_restore.values[-1]:.2f} s")
    finally:
        job.remove()
    return result


def raw_dump_of(criu: Path, work: Path, pid: int, tag: str) -> tuple[float, float, int]:
    """A raw ``criu dump --leave-running`` of a process torpor supervises (the same process, same state)."""
    images = work / f"train-raw-{tag}"
    images.mkdir()
    command = Criu(criu).dump_command(
        pid, images, work / f"train-raw-{tag}.log", leave_running=True, tcp=False
    )
    began = time.monotonic()
    subprocess.run(command, check=True, stdin=subprocess.DEVNULL, capture_output=True)
    wall = time.monotonic() - began
    stats = read_dump_stats(images)
    size = dir_bytes(images)
    shutil.rmtree(images)
    return stats.frozen_s or wall, wall, size


# -- the report ----------------------------------------------------------------------------------------------


def machine(criu: Criu) -> list[tuple[str, str]]:
    cpu = cpu_model() or "unknown"
    total = memory_total()
    mem = "unknown" if total is None else f"{total / GIB:.1f} GiB"
    distro = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                distro = line.split("=", 1)[1].strip('"')
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return [
        ("CPU", cpu),
        ("cores", str(os.cpu_count())),
        ("memory", mem),
        ("kernel", platform.release()),
        ("OS", distro),
        ("CRIU", criu.info().version),
        ("Python", platform.python_version()),
        ("PyTorch", torch_version),
    ]


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def secs(samples: Samples) -> str:
    return f"{samples.median:.2f} s"


def ratio(a: Samples, b: Samples) -> str:
    return f"{a.median / b.median:.2f}×" if b.median else "-"


def spread(samples: Samples, digits: int = 2) -> str:
    """Every sample, in the order taken, with ``digits`` decimals."""
    return ", ".join(f"{v:.{digits}f}" for v in samples.values)


def render(
    memory: list[MemoryResult],
    train: TrainResult | None,
    repeat: int,
    criu_version: str,
    places: dict[str, str],
    seconds: float,
    described: list[tuple[str, str]],
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    options = " ".join([*NO_TCP_DUMP_OPTIONS, "--ghost-limit", GHOST_LIMIT, "-v4"])
    lines = [
        "## Core: torpor vs raw CRIU and vs torch.save",
        "",
        f"Written by `make bench` (`scripts/bench.py`) on {when}, in {seconds / 60:.0f} min, on the machine "
        f"below, CRIU {criu_version}. Every number is the median of {repeat} runs (all samples "
        "at the end); torpor and its anchors ran interleaved in the same run, rotating which went first, "
        "after one warm-up dump each (except hibernate + restore, see below). Raw CRIU used the options torpor's adapter uses "
        f"for a tree without a TCP socket (`{options}`), without holding the CPUs quick to wake as torpor does "
        "(`docs/architecture.md`), on a comparable process in its own PID namespace "
        "(`unshare --pid --fork setsid python …`).",
        "",
        machine_table(described),
        "",
        f"- **raw CRIU** dumps into a folder on disk ({places['disk']}): the plain way to use CRIU, the anchor "
        "of the issue's bar. The images land in the page cache; nothing is fsynced.",
        f"- **raw CRIU → RAM** dumps into the file system of torpor's hot tier ({places['hot']}), so that "
        "what torpor itself adds can be told from where it writes.",
        "- **torpor** dumps into its hot tier (RAM): CRIU streams the image to it (`criu dump --stream`), "
        "the pages by reference, and torpor copies them there, for a checkpoint into memory it set aside "
        "and mapped before the freeze (its job's last copy in RAM, or else zeros written then); then `put` commits "
        "the image (a rename); a "
        "destager process then chunks, hashes, compresses and stores it in the cold tier on disk. *Durable* "
        "is the time until then (the benchmark waits for it, and for the destager to go idle, before the "
        "next measurement, so that its work does not land in someone else's numbers).",
        "- *Frozen* is CRIU's own frozen time from its stats-dump image, the same measure on every side. "
        "*Total* is how long the command took for its caller (for torpor: the round trip to the job's "
        "launcher, the memory set aside for a checkpoint, the dump, and the commit to the hot tier). torpor's *restore* includes fetching the "
        "image from the store, verifying every byte against its hash (the memory pages while CRIU reads "
        "them; the job runs only once they passed), and starting a launcher that runs `criu restore`. "
        "torpor is timed through its Python API, as the agent calls it: the `torpor` command adds the "
        "start of its interpreter and the import of torpor (0.2-0.3 s on this machine).",
        "",
        "The machine has 2 cores and is a virtual one; page-cache writeback makes dumps "
        "to disk vary: ratios move between runs, so read the samples at the end before a single number.",
        "",
    ]
    if memory:
        lines += [
            "### A process holding random (touched, incompressible) memory",
            "",
            "`checkpoint` leaves the job running (`--leave-running`); the three kinds ran interleaved. "
            "`hibernate` stops it (no `--leave-running`) and it is then restored (`criu restore -d` / "
            "`torpor resume`); for these each side ran alone on the machine with its own process, so that "
            "neither paid for the other's memory (an image in torpor's RAM hot tier cannot be reclaimed "
            "like page cache). *Hibernate* has no copy of the job in RAM to take over (its last "
            "hibernation's went once durable), so its pages go into memory allocated as they come; "
            "*hibernate after a checkpoint* follows a durable checkpoint of the job, as a job checkpointed "
            "every so often is hibernated, and writes its pages over that checkpoint's copy in RAM "
            "(raw CRIU's column is the same raw hibernation). Each hibernation is resumed before the next.",
            "",
            "| memory | operation | frozen: raw CRIU | frozen: raw CRIU → RAM | frozen: torpor "
            "| torpor / raw | torpor / raw → RAM | total: raw | total: torpor | durable: torpor "
            "| image: raw | image: torpor |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in memory:
            label = f"{m.size / GIB:g} GiB"
            rows: tuple[tuple[str, DumpSamples, DumpSamples | None, DumpSamples], ...] = (
                ("checkpoint", m.raw_ckpt, m.raw_hot_ckpt, m.torpor_ckpt),
                ("hibernate", m.raw_hib, None, m.torpor_hib),
                ("hibernate after a checkpoint", m.raw_hib, None, m.torpor_hib_taken),
            )
            for name, raw, hot, tor in rows:
                lines.append(
                    f"| {label} | {name} | {secs(raw.freeze_s)} | {secs(hot.freeze_s) if hot else '-'} | "
                    f"{secs(tor.freeze_s)} | **{ratio(tor.freeze_s, raw.freeze_s)}** | "
                    f"{ratio(tor.freeze_s, hot.freeze_s) if hot else '-'} | {secs(raw.total_s)} | "
                    f"{secs(tor.total_s)} | {secs(tor.durable_s)} | {gib(raw.image_bytes.median)} | "
                    f"{gib(tor.image_bytes.median)} |"
                )
        lines += [
            "",
            "| memory | restore: raw `criu restore -d` | restore: `torpor resume` | torpor / raw "
            "| raw, one core hashing beside it | that / raw | raw, streamed | that / raw | torpor / that |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m in memory:
            lines.append(
                f"| {m.size / GIB:g} GiB | {secs(m.raw_restore)} | {secs(m.torpor_restore)} | "
                f"{ratio(m.torpor_restore, m.raw_restore)} | {secs(m.raw_restore_busy)} | "
                f"{ratio(m.raw_restore_busy, m.raw_restore)} | {secs(m.raw_restore_streamed)} | "
                f"{ratio(m.raw_restore_streamed, m.raw_restore)} | "
                f"{ratio(m.torpor_restore, m.raw_restore_streamed)} |"
            )
        lines += [
            "",
            "torpor verifies every byte it reads back (BLAKE3) while CRIU restores; on a machine of two "
            "cores that takes the core CRIU does not use. *Raw, one core hashing beside it* is the same "
            "raw restore while another process hashes 1 MiB pieces of memory with BLAKE3 on one core, "
            "nothing else: what sharing the machine with that work alone costs CRIU here.",
            "",
            "A hibernation's copy leaves RAM once durable (hibernating is for freeing memory), so "
            "`torpor resume` reads the cold tier, in CRIU's stream mode: torpor reads each chunk into a "
            "buffer of its own, verifies it and hands it to CRIU's pipe by reference. In that mode CRIU "
            "reads the pages in its own process into memory it maps there, and moves that memory into the "
            "job; without it, CRIU's restorer reads the file straight into place. *Raw, streamed* is the "
            "raw restore in stream mode, each file spliced to CRIU from the folder as it is (no copy, "
            "nothing verified): what the mode itself costs CRIU here; *torpor / that* is what torpor "
            "adds to it.",
        ]
        lines += [
            "",
            "Where the time of `torpor resume` goes (medians; the spans end at its progress messages), "
            "against the time raw CRIU's own `-v4` log spans in its restore:",
            "",
            "| memory | " + " | ".join(name for name, _ in RESTORE_SPANS) + " | of which CRIU's own run "
            "| raw: `criu restore -d` | raw: CRIU's own run |",
            "|---|" + "---|" * (len(RESTORE_SPANS) + 3),
        ]
        for m in memory:
            spans = m.torpor_restore_spans
            lines.append(
                f"| {m.size / GIB:g} GiB | "
                + " | ".join(secs(spans.spans[name]) for name, _ in RESTORE_SPANS)
                + f" | {secs(spans.criu_s)} | {secs(m.raw_restore)} | {secs(m.raw_restore_criu)} |"
            )
        lines += ["", *verdict(memory), ""]
    if train is not None:
        lines += [
            "### A training process vs framework checkpointing",
            "",
            f"An MLP of 5 × Linear(4096, 4096) with Adam: {train.params / 1e6:.0f} M parameters; "
            f"`torch.save` of model + optimizer state writes {train.save_bytes / 1e9:.2f} GB. The training "
            "process (one intra-op thread; a step, then 0.5 s of sleep, repeatedly) is "
            f"{gib(train.rss)} resident: weights, gradients, Adam's two moments and PyTorch itself, all of "
            "which the image holds. `torch.save` blocks training for its whole duration, so its time is "
            "compared with the time the job is frozen. File and images go to the page cache or RAM, "
            "nothing fsynced, except for the two durable rows: `torch.save` into a file on the same disk "
            "as torpor's cold tier, then `fsync`, and torpor's checkpoint until its destager made it "
            "durable (one `syncfs`); the second is compared with the first.",
            "",
            "The torpor checkpoints measured are the job's next ones, as a job checkpointed every so often "
            "takes them: its last checkpoint stays (the one before is deleted), so its copy in RAM is "
            "there, and the new checkpoint writes its pages over that copy's memory; the destager stores "
            "only the chunks that changed since (here nearly all of the weights and Adam's state). The "
            "job's first checkpoint, with no older copy, writes zeros over fresh memory before its freeze "
            "instead: its own row (one sample, also the warm-up).",
            "",
            "| checkpoint | time | bytes | vs torch.save |",
            "|---|---|---|---|",
            f"| `torch.save` (model + optimizer state_dict) | {secs(train.save_s)} | "
            f"{train.save_bytes / GIB:.2f} GiB | 1.00× |",
            f"| torpor checkpoint: job frozen | {secs(train.torpor_ckpt.freeze_s)} | "
            f"{gib(train.torpor_ckpt.image_bytes.median)} | **{ratio(train.torpor_ckpt.freeze_s, train.save_s)}** |",
            f"| the job's first torpor checkpoint: job frozen | {secs(train.torpor_first.freeze_s)} | "
            f"{gib(train.torpor_first.image_bytes.median)} | {ratio(train.torpor_first.freeze_s, train.save_s)} |",
            f"| torpor checkpoint: total (job running again, image in the hot tier) | "
            f"{secs(train.torpor_ckpt.total_s)} | | {ratio(train.torpor_ckpt.total_s, train.save_s)} |",
            f"| `torch.save` + fsync: durable | {secs(train.save_fsync_s)} | "
            f"{train.save_bytes / GIB:.2f} GiB | {ratio(train.save_fsync_s, train.save_s)} |",
            f"| torpor checkpoint: durable in the cold tier | {secs(train.torpor_ckpt.durable_s)} | | "
            f"{ratio(train.torpor_ckpt.durable_s, train.save_s)}; "
            f"**{ratio(train.torpor_ckpt.durable_s, train.save_fsync_s)} `torch.save` + fsync** |",
            f"| the job's first torpor checkpoint: durable | {secs(train.torpor_first.durable_s)} | | "
            f"{ratio(train.torpor_first.durable_s, train.save_s)}; "
            f"{ratio(train.torpor_first.durable_s, train.save_fsync_s)} `torch.save` + fsync |",
            f"| raw `criu dump` of the same process: frozen | {secs(train.raw_ckpt.freeze_s)} | "
            f"{gib(train.raw_ckpt.image_bytes.median)} | {ratio(train.raw_ckpt.freeze_s, train.save_s)} |",
            f"| raw `criu dump` → RAM of the same process: frozen | {secs(train.raw_hot_ckpt.freeze_s)} | "
            f"{gib(train.raw_hot_ckpt.image_bytes.median)} | {ratio(train.raw_hot_ckpt.freeze_s, train.save_s)} |",
            "",
            "| restore | time | vs torch.load |",
            "|---|---|---|",
            f"| `torch.load` + `load_state_dict` into the live model and optimizer | {secs(train.load_s)} | 1.00× |",
            "| a fresh process: start Python, import torch, build the model, load the file | "
            f"{secs(train.restart_s)} | {ratio(train.restart_s, train.load_s)} |",
            "| `torpor resume` of the hibernated process (everything, as it was) | "
            f"{secs(train.torpor_restore)} | {ratio(train.torpor_restore, train.load_s)} |",
            "",
            f"torpor's frozen time is {ratio(train.torpor_ckpt.freeze_s, train.save_s)} `torch.save`'s "
            "(DESIGN.md aims for ≤ 0.5×), and "
            f"{ratio(train.torpor_ckpt.freeze_s, train.raw_ckpt.freeze_s)} raw CRIU's on the same process "
            f"({ratio(train.torpor_ckpt.freeze_s, train.raw_hot_ckpt.freeze_s)} raw CRIU's into RAM). "
            "Its time until durable is "
            f"{ratio(train.torpor_ckpt.durable_s, train.save_fsync_s)} `torch.save` + fsync's (issue 16 aims "
            "for ≤ 1.5×). A resumed torpor job needs no restart: compare its restore with the "
            "fresh-process row.",
            "",
        ]
    samples: dict[str, tuple[Samples, ...]] = {}
    for m in memory:
        label = f"{m.size / GIB:g} GiB"
        samples[f"{label} checkpoint, frozen (raw / raw → RAM / torpor)"] = (
            m.raw_ckpt.freeze_s,
            m.raw_hot_ckpt.freeze_s,
            m.torpor_ckpt.freeze_s,
        )
        samples[f"{label} checkpoint, total (raw / torpor) and torpor durable"] = (
            m.raw_ckpt.total_s,
            m.torpor_ckpt.total_s,
            m.torpor_ckpt.durable_s,
        )
        samples[f"{label} hibernate, frozen (raw / torpor / torpor after a checkpoint)"] = (
            m.raw_hib.freeze_s,
            m.torpor_hib.freeze_s,
            m.torpor_hib_taken.freeze_s,
        )
        samples[f"{label} restore (raw / torpor / raw, one core hashing beside it / raw, streamed)"] = (
            m.raw_restore,
            m.torpor_restore,
            m.raw_restore_busy,
            m.raw_restore_streamed,
        )
        samples[f"{label} restore, CRIU's own run (raw / torpor)"] = (
            m.raw_restore_criu,
            m.torpor_restore_spans.criu_s,
        )
        samples[f"{label} torpor resume, by span"] = tuple(m.torpor_restore_spans.spans.values())
    if train is not None:
        samples["training: torch.save / torch.load / fresh-process restart / torch.save + fsync"] = (
            train.save_s,
            train.load_s,
            train.restart_s,
            train.save_fsync_s,
        )
        samples["training: frozen (torpor / raw / raw → RAM)"] = (
            train.torpor_ckpt.freeze_s,
            train.raw_ckpt.freeze_s,
            train.raw_hot_ckpt.freeze_s,
        )
        samples["training: torpor total / durable / resume"] = (
            train.torpor_ckpt.total_s,
            train.torpor_ckpt.durable_s,
            train.torpor_restore,
        )
        samples["training: the job's first torpor checkpoint, frozen / total / durable"] = (
            train.torpor_first.freeze_s,
            train.torpor_first.total_s,
            train.torpor_first.durable_s,
        )
    lines += ["<details><summary>All samples (seconds)</summary>", ""]
    for what, groups in samples.items():
        lines.append(f"- {what}: " + " / ".join(spread(group) for group in groups))
    lines += ["", "</details>"]
    return "\n".join(lines)


def verdict(memory: list[MemoryResult]) -> list[str]:
    """The issue's bar, stated plainly: torpor's frozen time vs raw CRIU's (to disk)."""
    ratios = [
        (f"{m.size / GIB:g} GiB {name}", tor.freeze_s.median / raw.freeze_s.median)
        for m in memory
        for name, raw, tor in (
            ("checkpoint", m.raw_ckpt, m.torpor_ckpt),
            ("hibernate", m.raw_hib, m.torpor_hib),
        )
        if raw.freeze_s.median
    ]
    hot = [
        m.torpor_ckpt.freeze_s.median / m.raw_hot_ckpt.freeze_s.median
        for m in memory
        if m.raw_hot_ckpt.freeze_s.median
    ]
    hot_text = ""
    if hot:
        span = (
            f"{min(hot):.2f}×"
            if f"{min(hot):.2f}" == f"{max(hot):.2f}"
            else f"{min(hot):.2f}–{max(hot):.2f}×"
        )
        hot_text = f" Against raw CRIU dumping into the same RAM file system as torpor the ratio is {span}"
        if max(hot) <= FREEZE_BAR:
            hot_text += (
                ": what torpor saves is the copy into memory allocated while the job is frozen (torpor sets "
                "that memory aside before the freeze); claiming the job and committing the image happen "
                "outside the frozen window"
            )
        hot_text += "."
    over = [f"{what} ({r:.2f}×)" for what, r in ratios if r > FREEZE_BAR]
    if over:
        return [
            "**Bar (torpor adds at most 10 % to raw CRIU's freeze time): not met** for "
            f"{', '.join(over)}.{hot_text}"
        ]
    worst = max(ratios, key=lambda item: item[1])
    return [
        "**Bar (torpor adds at most 10 % to raw CRIU's freeze time): met**: the worst median ratio is "
        f"{worst[1]:.2f}× ({worst[0]}).{hot_text}"
    ]


def machine_table(described: list[tuple[str, str]]) -> str:
    return "\n".join(["| machine | |", "|---|---|", *(f"| {key} | {value} |" for key, value in described)])


def filesystem_of(path: Path) -> str:
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
                best, kind = parts[1], f"{parts[2]} at {parts[1]}"
    return kind


@contextlib.contextmanager
def raw_folder_in_hot_tier(engine: Engine, keep: bool = False) -> Iterator[Path]:
    """A folder for raw CRIU's dumps in the file system of torpor's hot tier (RAM), which is made (torpor's
    own tmpfs mounted) first; afterwards the folder goes, and the hot tier too unless ``keep``."""
    engine.ctx.store.hot.ensure()  # type: ignore[attr-defined]  # mounts torpor's own tmpfs there
    hot = engine.settings.hot_path / "bench.raw"  # a name with a dot is never taken for a leftover
    hot.mkdir(parents=True)
    try:
        yield hot
    finally:
        shutil.rmtree(hot, ignore_errors=True)
        if not keep:  # the hot tier lives in RAM outside the work folder
            remove_hot_tier(engine.settings)


@contextlib.contextmanager
def workspace(keep: bool) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="torpor-bench-"))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", default="1,4", help="GiB of memory for the raw-CRIU comparison")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (CRIU logs)")
    args = parser.parse_args()
    global KEEP
    KEEP = args.keep
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks stop the workloads
    if os.geteuid() != 0:
        say("make bench needs root (CRIU dumps and restores processes)")
        return 3
    ownprocess.become_subreaper()  # raw `criu restore -d` trees are re-parented to us, so we can reap them
    started = time.monotonic()
    with workspace(args.keep) as work:
        settings = Settings.from_environment(home=str(work / "home"))
        if settings.criu is None:
            say("criu not found: run 'make setup'")
            return 3
        criu = Criu(settings.criu)
        version = criu.require().version
        engine = Engine(settings)
        say(f"work folder {work} ({filesystem_of(work)}), criu {version} at {settings.criu}")
        # raw CRIU also dumps into the file system of torpor's hot tier (RAM), to tell torpor's own
        # overhead from the cost of where it writes
        with raw_folder_in_hot_tier(engine, keep=args.keep) as hot:
            places = {"disk": filesystem_of(work), "hot": filesystem_of(settings.hot_path)}
            memory = [
                bench_memory(engine, settings.criu, work, hot, int(float(size) * GIB), args.repeat)
                for size in args.sizes.split(",")
                if size
            ]
            train = (
                None if args.skip_training else bench_training(engine, settings.criu, work, hot, args.repeat)
            )
        section = render(
            memory, train, args.repeat, version, places, time.monotonic() - started, machine(criu)
        )
    publish("core", section, args.doc, args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
