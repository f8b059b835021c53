"""``scripts/bench_migrate.py``: how long ``torpor migrate`` stops a job and how long it takes in all,
against the pipeline a user builds from CRIU by hand, both to a second node over the same link (issue 30).

The second node is a network namespace of this script's own, joined to this one by a veth pair (its
own /30), with its own ``torpor agent`` serving TLS on its address, its own state directory, store
key and hot tier. For each size (default 1 and 4 GiB of random, touched memory:
``scripts/bench_memory.py``) and each rate at which the job rewrites it (default 0 % and 1 % of it a
second), ``--repeat`` times (default 3), rotating which goes first:

- **by hand**: the same kind of process in its own PID namespace; ``criu dump -t PID -D DIR`` into a
  tmpfs, the folder sent as a tar stream over a TCP connection across the veth to a receiver on the
  node, which unpacks it into a tmpfs there, and ``criu restore -d -D DIR`` on the node (``ip netns
  exec``). The anchor.
- **torpor**: ``torpor migrate NAME --to node`` of a job of this machine's state directory: a checkpoint
  while it runs, its chunks sent, then the job hibernated and only what changed sent, and the node's
  agent resumes it; and the same with ``--lazy`` (the node resumes it before all of its memory is
  in, fetching the rest as it is touched or in the background).

*Downtime* is the job's own: the workload ticks every 5 ms and prints every gap longer than 20 ms, by the
wall clock (a restored tree's monotonic clock goes on from its dump: ``scripts/bench_memory.py``); the
largest is the downtime (for torpor the first gap, the checkpoint while it runs, is its plain checkpoint
freeze). *Total* is the wall time of the whole (the ``torpor migrate`` command; the three commands by
hand). The link's bandwidth is measured in the same run (1 GiB through one TCP connection across the
veth), so that total time can be set against the image's size over it.

Writes its section of ``docs/benchmarks.md`` between ``<!-- migrate:begin -->`` and ``<!-- migrate:end -->``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench import GIB, RawProcess, machine, machine_table, rotate, workspace
from benchdoc import median, publish, say, wait_for

from torpor.adapters import jobnet
from torpor.adapters.criu import Criu
from torpor.adapters.system import ownprocess
from torpor.policy.addresses import overlapping
from torpor.settings import Settings

HERE = Path(__file__).resolve().parent
TORPOR = str(Path(sys.executable).with_name("torpor"))
PORT = 7788
#: the goals of issue 30: downtime at most this times the hand pipeline's, and at most the plain
#: checkpoint's freeze plus this many seconds; total at most this times the image's size over the link
DOWNTIME_BAR, FREEZE_MARGIN_S, TOTAL_BAR = 0.1, 0.5, 1.5
GAP = re.compile(r"^gap (\d+\.\d+) s$", re.M)

#: run on the node: take one TCP connection on PORT+1 and unpack the tar stream it brings into argv[2]
#: ("-" : count the bytes and drop them); print what it got
RECEIVER = """
import socket, sys, tarfile
server = socket.create_server((sys.argv[1], int(sys.argv[3])))
print("listening", flush=True)
connection, _ = server.accept()
stream = connection.makefile("rb", buffering=1 << 20)
if sys.argv[2] == "-":
    total = 0
    while piece := stream.read(1 << 20):
        total += len(piece)
    print(total, flush=True)
else:
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(sys.argv[2], filter="fully_trusted")
    print("done", flush=True)
"""


@dataclass
class Runs:
    """The samples of one way of running ``torpor migrate`` (plain, or ``--lazy``)."""

    down: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    freeze: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    #: each phase of each move, from its progress lines: {phase: [seconds, ...]}
    phases: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Case:
    size: int
    rate: float
    hand_down: list[float] = field(default_factory=list)
    hand_total: list[float] = field(default_factory=list)
    hand_bytes: list[int] = field(default_factory=list)
    #: plain ``torpor migrate``, and ``--lazy``
    torpor: Runs = field(default_factory=Runs)
    lazy: Runs = field(default_factory=Runs)


class Node:
    """A second node: a network namespace on a veth pair, its torpor agent serving TLS on its address."""

    def __init__(self, work: Path) -> None:
        routed = jobnet.routed_networks(jobnet.Bridge("torpor-unused"))
        while True:
            subnet = ipaddress.IPv4Network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/30")
            if not overlapping(subnet, routed):
                break
        tag = uuid.uuid4().hex[:6]
        self.netns, self.link = f"tbench-{tag}", f"tbm{tag}"  # not torpor-*: the jobs' own
        self.mine, self.address = (str(a) for a in subnet.hosts())
        self.work = work
        self.agent: subprocess.Popen[bytes] | None = None
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", f"tbn{tag}")
        _ip("link", "set", f"tbn{tag}", "netns", self.netns)
        _ip("addr", "add", f"{self.mine}/30", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("-n", self.netns, "addr", "add", f"{self.address}/30", "dev", f"tbn{tag}")
        _ip("-n", self.netns, "link", "set", f"tbn{tag}", "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        self.env = _env(work / "node-home", f"/dev/shm/torpor-bench-node-{tag}")
        self.via = ("ip", "netns", "exec", self.netns)

    def serve(self, here: dict[str, str]) -> None:
        """Start the node's agent (TLS, a token) and add it to ``here``'s peers as ``node``."""
        cert, key, token = self.work / "node.pem", self.work / "node.key", self.work / "token"
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
                *("-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1"),
                *("-subj", "/CN=torpor bench node", "-addext", f"subjectAltName=IP:{self.address}"),
            ],
            check=True,
            capture_output=True,
        )
        token.write_text(uuid.uuid4().hex + "\n")
        for path in (key, token):
            path.chmod(0o600)
        flags = ["--listen", f"{self.address}:{PORT}", "--tls-cert", str(cert), "--tls-key", str(key)]
        with open(self.work / "node-agent.log", "ab") as log:
            self.agent = subprocess.Popen(
                [*self.via, TORPOR, "agent", *flags, "--token-file", str(token), "--memory-budget", "16G"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        url = f"https://{self.address}:{PORT}"
        add = [TORPOR, "peers", "add", "node", url, "--token-file", str(token), "--ca-file", str(cert)]
        wait_for(
            lambda: subprocess.run(add, env=here, capture_output=True).returncode == 0,
            "the node's agent",
            60,
            0.5,
        )

    def receive(self, into: str) -> subprocess.Popen[str]:
        """A receiver on the node for one connection, ready to take it."""
        receiver = subprocess.Popen(
            [*self.via, sys.executable, "-c", RECEIVER, self.address, into, str(PORT + 1)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == "listening"
        return receiver

    def bandwidth(self, total: int = GIB) -> float:
        """Bytes per second through one TCP connection to the node."""
        receiver = self.receive("-")
        piece = os.urandom(1 << 20)
        began = time.monotonic()
        with socket.create_connection((self.address, PORT + 1)) as sender:
            for _ in range(total // len(piece)):
                sender.sendall(piece)
        got = int(receiver.communicate(timeout=120)[0].strip())
        assert got == total, (got, total)
        return total / (time.monotonic() - began)

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.agent.wait(60)
            if self.agent.poll() is None:
                self.agent.kill()
        subprocess.run(["ip", "link", "del", self.link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _env(home: Path, hot: str) -> dict[str, str]:
    return {**os.environ, "TORPOR_HOME": str(home), "TORPOR_HOT_DIR": hot}


def _torpor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TORPOR, *args], env=env, check=True, capture_output=True, text=True)


def gaps(text: str) -> list[float]:
    """The gaps the workload felt after it was ready, in order."""
    return [float(g) for g in GAP.findall(text.split("ready", 1)[-1])]


def workload(size: int, rate: float) -> list[str]:
    return [sys.executable, "-u", str(HERE / "bench_memory.py"), str(size), str(rate)]


def by_hand(case: Case, criu: Path, node: Node, work: Path) -> None:
    raw = RawProcess(criu, work, workload(case.size, case.rate), f"hand-{uuid.uuid4().hex[:6]}")
    here = Path(f"/dev/shm/torpor-bench-hand-{uuid.uuid4().hex[:6]}")
    there = Path(f"/dev/shm/torpor-bench-there-{uuid.uuid4().hex[:6]}")
    here.mkdir()
    try:
        raw.wait_ready()
        time.sleep(2)
        receiver = node.receive(str(there))
        began = time.monotonic()
        raw.dump(leave_running=False, into=here)
        assert raw.last_image is not None
        image = raw.last_image
        with (
            socket.create_connection((node.address, PORT + 1)) as sender,
            sender.makefile("wb", buffering=1 << 20) as stream,
            tarfile.open(fileobj=stream, mode="w|") as tar,
        ):
            tar.add(image, arcname=image.name)
        assert receiver.communicate(timeout=600)[0].strip() == "done"
        case.hand_bytes.append(sum(f.stat().st_size for f in image.iterdir()))
        shutil.rmtree(image)
        raw.last_image = there / image.name
        raw.restore(via=node.via)
        case.hand_total.append(time.monotonic() - began)
        wait_for(lambda: len(gaps(raw.log.read_text())) >= 1, "the restored workload to tick", 60)
        time.sleep(1)
        case.hand_down.append(max(gaps(raw.log.read_text())))
    finally:
        raw.kill()
        shutil.rmtree(here, ignore_errors=True)
        shutil.rmtree(there, ignore_errors=True)


def with_torpor(case: Case, here: dict[str, str], node: Node, lazy: bool) -> None:
    runs = case.lazy if lazy else case.torpor
    name = f"m{uuid.uuid4().hex[:6]}"
    _torpor(here, "run", "--name", name, "--", *workload(case.size, case.rate))
    try:
        wait_for(lambda: "ready" in _torpor(here, "logs", name).stdout, f"{name} to be ready", 300, 0.5)
        time.sleep(2)
        began = time.monotonic()
        moved = json.loads(_timed_migrate(here, name, runs, lazy))
        runs.total.append(time.monotonic() - began)
        runs.sent.append(int(moved["sent_bytes"]))
        wait_for(
            lambda: len(gaps(_torpor(node.env, "logs", name).stdout)) >= 2, f"{name} to tick there", 60, 0.5
        )
        time.sleep(1)
        felt = gaps(_torpor(node.env, "logs", name).stdout)
        runs.freeze.append(felt[0])
        runs.down.append(max(felt))
    finally:
        subprocess.run([TORPOR, "rm", "--force", name], env=node.env, capture_output=True, check=False)
        subprocess.run([TORPOR, "rm", "--force", name], env=here, capture_output=True, check=False)


#: the progress lines of ``torpor migrate`` that end each phase of a move, and the phase they end
PHASES = (
    ("sending it to peer", "checkpoint while it runs, made durable"),
    ("hibernating it", "its chunks sent"),
    ("sending what changed since", "hibernated (stopped from here), made durable"),
    ("handing it over to peer", "what changed sent, log and records"),
    (None, "go: the peer restores it"),
)


def _timed_migrate(here: dict[str, str], name: str, runs: Runs, lazy: bool) -> str:
    """``torpor migrate NAME --to node --json`` (``--lazy``), timing its phases by its progress lines;
    its stdout."""
    command = [TORPOR, "migrate", name, "--to", "node", "--json", *(["--lazy"] if lazy else [])]
    process = subprocess.Popen(command, env=here, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None and process.stdout is not None
    mark = time.monotonic()
    phase = 0
    for line in process.stderr:
        if phase < len(PHASES) - 1 and PHASES[phase][0] in line:
            runs.phases.setdefault(PHASES[phase][1], []).append(time.monotonic() - mark)
            mark, phase = time.monotonic(), phase + 1
    out = process.stdout.read()
    if process.wait() != 0:
        raise RuntimeError(f"torpor migrate failed: {out}")
    runs.phases.setdefault(PHASES[-1][1], []).append(time.monotonic() - mark)
    return out


def render(
    cases: list[Case], bandwidth: float, repeat: int, took: float, described: list[tuple[str, str]]
) -> str:
    lines = [
        "## Migration to another node: `torpor migrate` vs `criu dump`, copy, `criu restore` by hand "
        "(`scripts/bench_migrate.py`)",
        "",
        f"The other node is a network namespace joined by a veth pair; its link carried "
        f"{bandwidth / GIB:.2f} GiB/s through one TCP connection in this run. Medians of {repeat} runs each "
        f"(every sample below); {took / 60:.0f} min in all. Downtime is the largest gap the job felt in its "
        "own 5 ms loop, timed by the wall clock (CRIU restores a tree into a time namespace whose "
        "monotonic clock goes on from the dump: timed by it, the copy between dump and restore went "
        "unseen, and the figures before 2026-12-07 left it out); torpor's *freeze* is the first, its "
        "checkpoint while it runs.",
        "",
        "| job | torpor migrate | downtime: torpor | by hand | ratio (goal ≤ 0.1) | torpor's freeze + 0.5 s | "
        "total: torpor | by hand | size / link (goal: torpor ≤ 1.5×) | sent: torpor | by hand |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for case, way, runs in _ways(cases):
        down, hand = median(runs.down), median(case.hand_down)
        freeze, total = median(runs.freeze), median(runs.total)
        ideal = case.size / bandwidth
        label = f"{case.size / GIB:g} GiB, {case.rate:.0%}/s rewritten"
        lines.append(
            f"| {label} | {way} | {down:.2f} s | {hand:.2f} s | {down / hand:.2f}× | "
            f"{freeze + FREEZE_MARGIN_S:.2f} s | {total:.1f} s | {median(case.hand_total):.1f} s | "
            f"{ideal:.1f} s ({total / ideal:.1f}×) | {median([float(b) for b in runs.sent]) / GIB:.2f} GiB | "
            f"{median([float(b) for b in case.hand_bytes]) / GIB:.2f} GiB |"
        )
        met = [
            f"downtime {down / hand:.2f}× by hand's ({'met' if down <= DOWNTIME_BAR * hand else 'NOT met'})",
            f"≤ freeze + 0.5 s ({'met' if down <= freeze + FREEZE_MARGIN_S else 'NOT met'})",
            f"total {total / ideal:.1f}× size/link ({'met' if total <= TOTAL_BAR * ideal else 'NOT met'})",
        ]
        verdicts.append(f"- {label}, {way}: " + "; ".join(met))
    lines += ["", "Against the goals of issue 30:", "", *verdicts, "", "### Where torpor's time goes", ""]
    lines += [
        "Medians of each phase of `torpor migrate`, from its progress lines (seconds):",
        "",
        "| job | torpor migrate | " + " | ".join(what for _, what in PHASES) + " |",
        "|---|---|" + "---|" * len(PHASES),
    ]
    for case, way, runs in _ways(cases):
        label = f"{case.size / GIB:g} GiB, {case.rate:.0%}/s"
        lines.append(
            f"| {label} | {way} | "
            + " | ".join(f"{median(runs.phases.get(w, [])):.2f}" for _, w in PHASES)
            + " |"
        )
    lines += ["", "### Every sample (seconds)", ""]
    for case in cases:
        label = f"{case.size / GIB:g} GiB, {case.rate:.0%}/s"
        samples = [
            (f"torpor {way} {what}", values)
            for _, way, runs in _ways([case])
            for what, values in (("downtime", runs.down), ("freeze", runs.freeze), ("total", runs.total))
        ]
        samples += [("by hand downtime", case.hand_down), ("by hand total", case.hand_total)]
        for what, values in samples:
            lines.append(f"- {label}, {what}: " + ", ".join(f"{v:.3f}" for v in values))
    return "\n".join([*lines, "", machine_table(described), ""])


def _ways(cases: list[Case]) -> Iterator[tuple[Case, str, Runs]]:
    """Each case with each way torpor moved it that has samples: plain, then ``--lazy``."""
    for case in cases:
        for way, runs in (("plain", case.torpor), ("--lazy", case.lazy)):
            if runs.down:
                yield case, way, runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", default="1,4", help="GiB of memory of the job")
    parser.add_argument("--rates", default="0,0.01", help="fractions of its memory it rewrites a second")
    parser.add_argument(
        "--ways", default="plain,lazy", help="how torpor migrates: plain, lazy (--lazy), or both"
    )
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()
    named = [way.strip() for way in args.ways.split(",") if way.strip()]
    if not named or set(named) - {"plain", "lazy"}:
        say(f"--ways: plain, lazy or both, not {args.ways!r}")
        return 2
    ways = [way == "lazy" for way in named]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks clean up
    if os.geteuid() != 0:
        say("the migration benchmark needs root (CRIU, network namespaces)")
        return 3
    ownprocess.become_subreaper()  # raw `criu restore -d` trees are re-parented to us, so we can reap them
    started = time.monotonic()
    with workspace(args.keep) as work, _node(work) as node:
        here = _env(work / "home", f"/dev/shm/torpor-bench-src-{uuid.uuid4().hex[:6]}")
        settings = Settings.from_environment(home=here["TORPOR_HOME"])
        if settings.criu is None:
            say("criu not found: run 'make setup'")
            return 3
        criu = Criu(settings.criu)
        try:
            node.serve(here)
            bandwidth = node.bandwidth()
            say(f"link: {bandwidth / GIB:.2f} GiB/s")
            cases = [
                Case(int(float(size) * GIB), float(rate))
                for size in args.sizes.split(",")
                for rate in args.rates.split(",")
            ]
            for case in cases:
                for rep in range(args.repeat):
                    rotate(
                        rep,
                        lambda c=case: by_hand(c, settings.criu, node, work),
                        *(lambda c=case, lazy=lazy: with_torpor(c, here, node, lazy) for lazy in ways),
                    )
                say(
                    f"{case.size / GIB:g} GiB, {case.rate:.0%}/s: downtime torpor {case.torpor.down} "
                    f"--lazy {case.lazy.down} by hand {case.hand_down}; total torpor {case.torpor.total} "
                    f"--lazy {case.lazy.total} by hand {case.hand_total}"
                )
            section = render(cases, bandwidth, args.repeat, time.monotonic() - started, machine(criu))
        finally:
            node.close()
            for env in (here, node.env):  # the hot tiers live in RAM, outside the work folder
                shutil.rmtree(env["TORPOR_HOT_DIR"], ignore_errors=True)
    publish("migrate", section, print_only=args.no_write)
    return 0


@contextlib.contextmanager
def _node(work: Path) -> Iterator[Node]:
    node = Node(work)
    try:
        yield node
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main())
