"""Benchmarks of the store (issue 3), each a ratio against raw CRIU on the same process, in one run.

1. **Stored bytes, incremental**: a process holding 1 GiB of random memory, checkpointed (durable), then
   5 % of its memory (one contiguous region) rewritten, then checkpointed again: bytes the second
   checkpoint added to the store vs the raw CRIU image of the same process.
2. **Zero pages**: a process holding 4 GiB of touched zero pages: bytes stored vs its raw CRIU image.
3. **Freeze time**: torpor's checkpoint (CRIU's frozen time, dumping into the hot tier) vs raw
   ``criu dump --leave-running`` of the same process into a folder on disk.
4. **Time until durable**: torpor's checkpoint until the destager has made it durable in the cold tier
   (the memory fully rewritten before each, so every chunk is new) vs raw dump plus fsync of every file.
5. **Restore**: ``torpor restore`` of a stopped job from its plain checkpoint, kept in the hot tier, and
   ``torpor resume`` of a hibernated job, whose image left RAM once durable (cold tier), vs raw
   ``criu restore -d`` of the same process's raw image (page cache warm).
6. **Lazy restore**: time until a 4 GiB process (random memory, printing a line every 5 ms) makes progress
   after ``torpor resume --lazy`` of its hibernated image (cold tier, memory served page by page) vs a raw
   ``criu restore`` of the same process.
7. **Destager throughput per core**: chunking + hashing + compressing + storing a 1 GiB random image with
   one worker thread, and with two.
8. **The second checkpoint against borg** (issue 16, goal 3): a 1 GiB random job has 5 % of its memory
   (one contiguous region) rewritten, then torpor checkpoints it until durable, against a raw
   ``criu dump --leave-running`` into the hot tier's tmpfs followed by ``borg create`` of that image into
   a borg repository (on the same disk as torpor's cold tier, ``--encryption none``, borg's default
   compression) that holds the image of the state before the change. Time from the command until
   durable, and the bytes each side's store grew by. The benchmark installs borg (Debian's
   ``borgbackup``) when it is missing.

Each timing is the median of ``--repeat`` runs (freeze and durable rotate which side goes first; the
raw restore goes first). Writes its section of ``docs/benchmarks.md`` between ``<!-- store:begin -->``
and ``<!-- store:end -->``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchdoc import DOC, dir_bytes, median, say, wait_for, write_section

HERE = Path(__file__).resolve().parent
CRIU_ROOT = HERE.parent / ".venv" / "criu-root"  # where `make setup` puts CRIU and its libraries
GIB = 1 << 30
MIB = 1 << 20


# -- the workload (run as a job: ``bench_store.py --workload random|zeros BYTES``) ----------------------


def workload(kind: str, size: int) -> int:
    import numpy as np

    memory = np.zeros(size, dtype=np.uint8)
    # fresh bytes in every job: one job's data must not be stored already by another's checkpoints
    rng = np.random.default_rng()
    step = 64 * MIB

    def fill(start: int, end: int) -> None:
        for at in range(start, end, step):
            stop = min(at + step, end)
            memory[at:stop] = rng.integers(0, 256, size=stop - at, dtype=np.uint8)

    if kind.startswith("random"):
        fill(0, size)
    else:
        memory[::4096] = 1  # touch every page ...
        memory[::4096] = 0  # ... and leave it zero
    changes = 0

    def change(signum: int, _frame: object) -> None:
        nonlocal changes
        if signum == signal.SIGUSR1:  # 5 %, one contiguous region
            start = (size * 2 // 5) // 4096 * 4096
            fill(start, start + size // 20)
        else:
            fill(0, size)
        changes += 1
        print(f"changed {changes}", flush=True)

    signal.signal(signal.SIGUSR1, change)
    signal.signal(signal.SIGUSR2, change)
    print("ready", flush=True)
    if kind == "random-ticking":  # progress a restore can be timed by: a line every 5 ms
        tick = 0
        while True:
            tick += 1
            print(f"tick {tick}", flush=True)
            time.sleep(0.005)
    while True:
        time.sleep(3600)


class Bench:
    def __init__(self, work: Path, repeat: int) -> None:
        from torpor.core.engine import Engine
        from torpor.settings import Settings

        self.work = work
        self.repeat = repeat
        # the default hot tier, as users get it: torpor's own huge-page tmpfs in /dev/shm
        self.settings = Settings.from_environment(home=str(work / "home"))
        self.engine = Engine(self.settings)
        self.engine.ctx.store.hot.ensure()  # type: ignore[attr-defined]
        assert self.settings.criu is not None
        self.criu = self.settings.criu
        self.n = 0
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.samples: list[str] = []  # every sample of each timed row, torpor / raw
        self.borg_version = ""  # set by the borg part

    # -- jobs and raw CRIU --

    def start(self, name: str, kind: str, size: int) -> None:
        self.engine.run(
            name,
            [sys.executable, "-u", str(Path(__file__).resolve()), "--workload", kind, str(size)],
            str(HERE),
        )
        self.wait_log(name, "ready", 600)

    def wait_log(self, name: str, text: str, timeout: float = 300) -> None:
        log = self.engine.log_path(name)
        wait_for(
            lambda: log.exists() and text in log.read_text(errors="replace"), f"{text!r} from {name}", timeout
        )

    def signal(self, name: str, sig: int) -> None:
        job = self.engine.records.job(name)
        assert job.pid
        count = self.engine.log_path(name).read_text().count("changed")
        os.kill(job.pid, sig)
        wait_for(lambda: self.engine.log_path(name).read_text().count("changed") > count, "the change", 300)

    def raw_dump(
        self, name: str, leave_running: bool = True, fsync: bool = False, into: Path | None = None
    ) -> tuple[float, float, int, Path]:
        """(frozen s, wall s incl. fsync if asked, image bytes, folder) of a raw dump of job ``name``."""
        from torpor.adapters.criu import Criu
        from torpor.adapters.criuimage import read_dump_stats

        pid = self.engine.records.job(name).pid
        self.n += 1
        images = (into or self.work) / f"raw-{self.n}"
        images.mkdir(parents=True)
        command = Criu(self.criu).dump_command(
            pid, images, self.work / f"raw-{self.n}.log", leave_running=leave_running
        )
        began = time.monotonic()
        subprocess.run(command, check=True, stdin=subprocess.DEVNULL, capture_output=True)
        if fsync:
            for entry in images.iterdir():
                fd = os.open(entry, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            fd = os.open(images, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        wall = time.monotonic() - began
        return read_dump_stats(images).frozen_s or wall, wall, dir_bytes(images), images

    def raw_restore(self, images: Path, until: Callable[[float], float] | None = None) -> float:
        from torpor.adapters.criu import COMMON_OPTIONS

        pidfile = images / "restored.pid"
        began = time.monotonic()
        subprocess.run(
            [
                str(self.criu),
                "restore",
                "--images-dir",
                str(images),
                "--log-file",
                str(images / "restore.log"),
                "--restore-detached",
                "--pidfile",
                str(pidfile),
                *COMMON_OPTIONS,
            ],
            check=True,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )
        wall = time.monotonic() - began if until is None else until(began)
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        return wall

    def checkpoint(self, name: str, hibernate: bool = False) -> tuple[float, float, str, int]:
        """(frozen s, s until durable, checkpoint id, bytes it added to the store)."""
        began = time.monotonic()
        checkpoint = self.engine.checkpoint(name, hibernate=hibernate)
        image = self.engine.wait_durable(checkpoint.id)
        durable = time.monotonic() - began
        wait_for(lambda: not self.engine.ctx.store.destager_running(), "the destager to go idle", 120)  # type: ignore[attr-defined]
        return checkpoint.freeze_s, durable, checkpoint.id, image.stored_bytes

    def add(self, what: str, torpor: str, raw: str, ratio: str, bar: str) -> None:
        self.rows.append((what, torpor, raw, ratio, bar))
        say(f"  {what}: torpor {torpor}, raw {raw}, ratio {ratio} (bar {bar})")

    def timed(self, what: str, ours: list[float], theirs: list[float], bar: str) -> None:
        """A row of medians (seconds), its samples kept for the end of the section."""
        self.add(
            what,
            f"{median(ours):.2f} s",
            f"{median(theirs):.2f} s",
            f"{median(ours) / median(theirs):.2f}x",
            bar,
        )
        listed = ", ".join(f"{x:.2f}" for x in ours) + " / " + ", ".join(f"{x:.2f}" for x in theirs)
        self.samples.append(f"- {what} (torpor / raw, s): {listed}")

    # -- the measurements --

    def incremental(self) -> None:
        say("== 1 GiB of random memory: stored bytes, freeze, durable, restore ==")
        name = "rand"
        self.start(name, "random", GIB)
        _, _, raw_bytes, raw_dir = self.raw_dump(name)
        shutil.rmtree(raw_dir)
        self.checkpoint(name)
        self.signal(name, signal.SIGUSR1)
        _, _, _, second = self.checkpoint(name)
        self.add(
            "stored bytes of the 2nd checkpoint after 5 % changed",
            f"{second / MIB:.1f} MiB",
            f"{raw_bytes / MIB:.1f} MiB",
            f"{second / raw_bytes * 100:.2f} %",
            "≤ 10 %",
        )
        freeze_t, freeze_r, freeze_rh, durable_t, durable_r = [], [], [], [], []
        # raw images on disk are deleted only after the loop, as torpor's stay in its store: this disk
        # is mounted with online discard, and a deleted GiB slows whatever writes to it next. (They are
        # deleted then: the page cache they hold would make the restores below reclaim memory.)
        on_disk: list[Path] = []
        for rep in range(self.repeat):
            self.signal(name, signal.SIGUSR2)  # every chunk new
            for side in [(rep + i) % 3 for i in range(3)]:
                settle()
                if side == 0:
                    frozen, durable, _, _ = self.checkpoint(name)
                    freeze_t.append(frozen)
                    durable_t.append(durable)
                elif side == 1:
                    frozen, wall, _, raw_dir = self.raw_dump(name, fsync=True)
                    on_disk.append(raw_dir)
                    freeze_r.append(frozen)
                    durable_r.append(wall)
                else:
                    frozen, wall, _, raw_dir = self.raw_dump(name, into=self.settings.hot_path / "raw")
                    shutil.rmtree(raw_dir)
                    freeze_rh.append(frozen)
        self.timed("freeze time (CRIU frozen)", freeze_t, freeze_r, "≤ 1.1x")
        self.timed("freeze time vs raw CRIU dumping into the same tmpfs", freeze_t, freeze_rh, "-")
        self.timed("time until durable (raw: dump + fsync)", durable_t, durable_r, "≤ 1.0x")
        for raw_dir in on_disk:
            shutil.rmtree(raw_dir)
        hot_t, cold_t, raw_t = [], [], []
        for _rep in range(self.repeat):
            frozen, wall, _, raw_dir = self.raw_dump(name)
            # hot: a plain checkpoint stays in RAM once durable; the job is stopped, then restored
            self.checkpoint(name)
            self.engine.stop(name)
            launcher_gone(self, name)
            settle(drop=False)
            raw_t.append(self.raw_restore(raw_dir))
            settle(drop=False)
            began = time.monotonic()
            self.engine.restore(name)
            hot_t.append(time.monotonic() - began)
            # deleted only now: this disk discards a deleted file's blocks, which slows its next writes
            shutil.rmtree(raw_dir)
            # cold: a hibernated image leaves RAM once durable, so its restore reads the cold tier
            _, _, hibernated, _ = self.checkpoint(name, hibernate=True)
            launcher_gone(self, name)
            self.left_ram(hibernated)
            settle(drop=False)
            began = time.monotonic()
            self.engine.restore(name)
            cold_t.append(time.monotonic() - began)
        self.timed("restore from the hot tier", hot_t, raw_t, "≤ 1.1x")
        self.timed("restore from the cold tier", cold_t, raw_t, "≤ 1.5x")
        self.engine.remove(name, force=True)

    def left_ram(self, checkpoint_id: str) -> None:
        """Wait until a hibernated image's hot copy is gone (once durable), so a restore reads the cold tier."""
        wait_for(lambda: not (self.settings.hot_path / checkpoint_id).exists(), "the image to leave RAM", 60)

    def lazy_done(self) -> bool:
        return not any(p.name.startswith("restore-") for p in self.settings.hot_path.iterdir())

    def lazy(self) -> None:
        say("== lazy restore of 4 GiB ==")
        name = "lazy"
        self.start(name, "random-ticking", 4 * GIB)
        log = self.engine.log_path(name)

        def first_progress(size: int) -> Callable[[float], float]:
            """Seconds from ``began`` until the job wrote a tick past ``size`` bytes of its log."""

            def ticked() -> bool:
                with log.open("rb") as file:
                    file.seek(size)
                    return b"tick" in file.read()

            def since(began: float) -> float:
                # every 5 ms, reading only what the job wrote since: the figure is a few tenths of a second
                wait_for(ticked, "progress after restore", 120, every=0.005)
                return time.monotonic() - began

            return since

        raw_t, lazy_t = [], []
        for _rep in range(self.repeat):
            _, _, raw_bytes, raw_dir = self.raw_dump(name)
            say(f"  raw image {raw_bytes / GIB:.2f} GiB")
            _, _, hibernated, _ = self.checkpoint(name, hibernate=True)
            launcher_gone(self, name)
            self.left_ram(hibernated)
            settle(drop=False)
            # the log's size before each restore: the hibernated job writes nothing until it runs again
            raw_t.append(self.raw_restore(raw_dir, until=first_progress(log.stat().st_size)))
            shutil.rmtree(raw_dir)
            settle(drop=False)
            size = log.stat().st_size
            began = time.monotonic()
            self.engine.restore(name, lazy=True)
            lazy_t.append(first_progress(size)(began))
            # a dump while lazy-pages still copies memory in would miss pages: let it finish first
            wait_for(self.lazy_done, "lazy-pages to finish", 300)
        self.timed("lazy restore (cold tier): time to first progress, 4 GiB", lazy_t, raw_t, "≤ 0.1x")
        self.engine.remove(name, force=True)

    def zeros(self) -> None:
        say("== 4 GiB of touched zero pages ==")
        name = "zeros"
        self.start(name, "zeros", 4 * GIB)
        _, _, raw_bytes, raw_dir = self.raw_dump(name)
        shutil.rmtree(raw_dir)
        _, _, _, stored = self.checkpoint(name)
        self.add(
            "stored bytes, 4 GiB of touched zero pages",
            f"{stored / MIB:.2f} MiB",
            f"{raw_bytes / MIB:.0f} MiB",
            f"{stored / raw_bytes * 100:.3f} %",
            "< 1 %",
        )
        self.engine.remove(name, force=True)

    def destager(self) -> None:
        say("== destager throughput ==")
        from torpor.adapters.folder import FolderBackend
        from torpor.core.store.repository import Repository

        name = "tp"
        self.start(name, "random", GIB)
        _, _, size, raw_dir = self.raw_dump(name)
        self.engine.remove(name, force=True)
        image = self.settings.hot_path / "bench-image"
        shutil.copytree(raw_dir, image)
        shutil.rmtree(raw_dir)
        for workers in (1, 2, 4):
            target = self.work / f"tp-{workers}"
            repo = Repository(FolderBackend(target), workers=workers)
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            began = time.monotonic()
            repo.write("tp", "bench", image, {})
            seconds = time.monotonic() - began
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_s = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
            shutil.rmtree(target)
            self.add(
                f"destager, {workers} thread(s): wall / per CPU-second",
                f"{size / seconds / MIB:.0f} MiB/s / {size / cpu_s / MIB:.0f} MiB/s",
                "-",
                "-",
                "-",
            )
        shutil.rmtree(image)

    def borg(self) -> None:
        from bench import rotate

        say("== the second checkpoint of 1 GiB after 5 % changed, against raw CRIU + borg ==")
        borg = borg_program()
        repo = self.work / "borg-repo"
        env = {**os.environ, "BORG_REPO": str(repo), "BORG_BASE_DIR": str(self.work / "borg-home")}
        env["BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK"] = "yes"
        subprocess.run([borg, "init", "--encryption", "none"], env=env, check=True, capture_output=True)
        version = subprocess.run([borg, "--version"], env=env, check=True, capture_output=True, text=True)
        name = "borg"
        self.start(name, "random", GIB)
        archives = 0

        def backup() -> tuple[float, int]:
            """Raw dump into the hot tier's tmpfs, then ``borg create`` of it: (s, bytes the repo grew)."""
            nonlocal archives
            before = dir_bytes(repo)
            began = time.monotonic()
            _, _, _, images = self.raw_dump(name, into=self.settings.hot_path / "raw")
            archives += 1
            # the same folder name every time, as a user backing up "the latest image" would
            staged = images.with_name("image")
            images.rename(staged)
            subprocess.run(
                [borg, "create", f"::dump-{archives}", "image"],
                env=env,
                cwd=staged.parent,
                check=True,
                capture_output=True,
            )
            seconds = time.monotonic() - began
            shutil.rmtree(staged)
            return seconds, dir_bytes(repo) - before

        self.checkpoint(name)  # both stores hold the first state
        backup()
        ours: list[float] = []
        theirs: list[float] = []
        ours_bytes: list[int] = []
        theirs_bytes: list[int] = []

        def torpor_side() -> None:
            settle()
            _, durable, _, stored = self.checkpoint(name)
            ours.append(durable)
            ours_bytes.append(stored)

        def borg_side() -> None:
            settle()
            seconds, grew = backup()
            theirs.append(seconds)
            theirs_bytes.append(grew)

        for rep in range(self.repeat):
            self.signal(name, signal.SIGUSR1)  # 5 %, one contiguous region, rewritten with new bytes
            rotate(rep, torpor_side, borg_side)
        self.engine.remove(name, force=True)
        self.timed(
            "2nd checkpoint after 5 % changed, until durable (raw: criu dump into tmpfs + borg create)",
            ours,
            theirs,
            "≤ 0.5x",
        )
        self.add(
            "bytes stored by that checkpoint (raw: bytes borg's repository grew)",
            f"{median(ours_bytes) / MIB:.1f} MiB",
            f"{median(theirs_bytes) / MIB:.1f} MiB",
            f"{median(ours_bytes) / median(theirs_bytes):.2f}x",
            "≤ 1.0x",
        )
        listed = ", ".join(f"{x / MIB:.1f}" for x in ours_bytes) + " / "
        listed += ", ".join(f"{x / MIB:.1f}" for x in theirs_bytes)
        self.samples.append(f"- bytes stored by the 2nd checkpoint (torpor / borg, MiB): {listed}")
        self.borg_version = version.stdout.strip()


def borg_program() -> str:
    """borg's path, installing Debian's ``borgbackup`` first where it is missing."""
    found = shutil.which("borg")
    if found is None:
        say("  installing borg (Debian's borgbackup) for this benchmark")
        script = HERE / "apt-install.sh"
        subprocess.run(
            ["bash", "-c", f'source "{script}" && debian_install bench_store borgbackup'], check=True
        )
        found = shutil.which("borg")
    if found is None:
        raise SystemExit("bench_store: borg is not on PATH after installing borgbackup")
    return found


def settle(drop: bool = True) -> None:
    """Start each measurement from the same state: nothing dirty, no page cache to reclaim first.

    The page cache of this machine fills with earlier images; a measurement that must first reclaim it
    (or that pays for the discards of a deleted image at its fsync) says more about what ran before
    than about itself. Then the programs it runs are read once, so it finds them in the page cache as
    it would on a machine in use.
    ``drop=False`` (restores): only the sync. Memory the page cache gave back is slow to touch again on
    this virtual machine, and a restore from the cold tier touches twice as much fresh memory as a raw
    one (the restore folder, then the process): dropping the cache before it would measure the host.
    """
    os.sync()
    if not drop:
        return
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1")
    # programs stay cached on a machine in use: read back CRIU and the modules a destager imports
    subprocess.run([sys.executable, "-c", "import torpor.core.store.destager"], check=True)
    if CRIU_ROOT.is_dir():
        for path in [p for p in CRIU_ROOT.rglob("*") if p.is_file()]:
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def launcher_gone(bench: Bench, name: str) -> None:
    """Wait for a hibernated job's launcher to exit before restoring it (see scripts/bench.py)."""
    from torpor.adapters.system import procfs

    pid = bench.engine.records.job(name).launcher_pid
    if pid:
        wait_for(lambda: not procfs.is_alive(pid), "the launcher to exit", 30)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--workload":
        return workload(sys.argv[2], int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--only", choices=["incremental", "lazy", "zeros", "destager", "borg"], action="append"
    )
    args = parser.parse_args()
    from torpor.adapters.system import ownprocess

    ownprocess.become_subreaper()  # raw `criu restore -d` trees are re-parented to us, so we can reap them
    work = Path(tempfile.mkdtemp(prefix="torpor-bench-store-", dir="/var/tmp"))
    bench = Bench(work, args.repeat)
    started = time.monotonic()
    try:
        for part in args.only or ["incremental", "lazy", "zeros", "destager", "borg"]:
            getattr(bench, part)()
    finally:
        for job in bench.engine.records.jobs():
            with contextlib.suppress(Exception):
                bench.engine.remove(job.name, force=True)
        shutil.rmtree(work, ignore_errors=True)
        bench.engine.ctx.store.hot.remove_all()  # type: ignore[attr-defined]
    lines = [
        "## Store (issue 3)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench_store.py --repeat "
        f"{args.repeat}` in {time.monotonic() - started:.0f} s on {os.cpu_count()} cores; cold tier: a folder on "
        f"{work.parent} (disk), hot tier: torpor's own tmpfs in /dev/shm (4 KiB pages); timings are medians; freeze and durable samples alternate which side goes first, restores take raw CRIU first.",
        "",
        "| measurement | torpor | raw CRIU | ratio | bar |",
        "|---|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in bench.rows],
        "",
        "Reading the numbers:",
        "",
        "- *Freeze*: torpor's freeze is CRIU's own dump into the hot tier, a tmpfs torpor mounts with 4 KiB "
        "pages (`huge=never`, see docs/store.md), while torpor holds the CPUs quick to wake; raw CRIU "
        "dumps to disk, and in the second row into the same tmpfs, without that hold.",
        "- *Durable*: a destager starts as the dump begins. While CRIU holds the job stopped before it "
        "gathers the pages, one idle-priority thread "
        "reads the pages CRIU will dump from the job itself and stores them as chunks; while CRIU writes, "
        "another stores the pieces already written. When the dump ends the destager hashes every piece "
        "of the image (finding those chunks stored), compresses (where that saves an eighth) and appends "
        "the others to ~32 MiB pack files, written around the page cache (the image of a checkpoint "
        "stays in RAM), and makes them durable with one syncfs before the manifest goes in. Both sides write the same 1 GiB to this disk (random memory does not "
        "compress); torpor first dumps into RAM.",
        "- *Restore*, hot tier: the image is linked into the restore folder; everything but the memory "
        "pages is verified before CRIU starts, the pages while CRIU reads them, and a CRIU action script "
        "holds the restored job at its post-restore step until the verdict. Cold tier: `criu restore "
        "--stream` reads every file from torpor's image streamer; the pages come straight from the "
        "store's pack files: each chunk is read into a small ring of buffers, verified there, and lent to "
        "CRIU's pipe by reference (vmsplice), so CRIU copies it once, into the process. "
        "The job's launcher is forked from the CLI, not started as a new interpreter.",
        "- *Lazy restore*: only what CRIU reads itself is fetched first (a few MiB); the job then runs "
        "while torpor's page server answers CRIU's lazy-pages daemon chunk by chunk from the store, each "
        "chunk verified before a byte of it is handed over; while the daemon starts, the launcher reads "
        "the image's pagemaps, writes the pages CRIU reads itself and starts fetching the job's small "
        "regions of memory (its heap, its interpreter's objects: what it touches first) into its cache; "
        "after that only a stream of requests (the daemon copying the rest) is fetched ahead, not a page "
        "fault (docs/store.md). *First progress* is the job's first line after the "
        "restore began, polled every 5 ms; torpor is timed through its Python API (the `torpor` command "
        "adds 0.2-0.3 s here for its interpreter and imports).",
        *(
            [
                "- *Against borg*: the raw side is what a user without torpor would script for an "
                "incremental, deduplicated backup of a checkpoint: `criu dump` into tmpfs, then "
                f"`borg create` ({bench.borg_version}, `--encryption none`, its default chunker and "
                "compression) into a repository holding the previous image. Borg reads, chunks and "
                "hashes the whole image again; torpor's destager hashes it in 1 MiB pieces cut at the "
                "image's page boundaries and stores only the chunks it has not seen.",
            ]
            if bench.borg_version
            else []
        ),
        "",
        "Every sample, in the order taken (this virtual machine's page cache and memory make single runs "
        "vary; read these before a single ratio):",
        "",
        *bench.samples,
    ]
    write_section("store", "\n".join(lines))
    say(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
