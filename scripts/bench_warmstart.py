"""Benchmark: warm starts against cold starts of real servers, from the command to the first answer.

Two servers run as torpor jobs on loopback (tests/jobs): ``embed_server.py`` (all-MiniLM-L6-v2 behind
uvicorn: its cold start imports torch, transformers and sentence-transformers and loads the model) and
``weights_server.py`` (reads a weights file of random bytes, default 2 GiB, into memory and hashes it; the
file lives in /var/tmp and is deleted at the end). For each, ``--samples`` times (default 5), rotating
which goes first:

- **cold**: ``torpor run -- python SERVER``;
- **eager**: ``torpor run --from-template T``, T saved (``torpor template save``) from the first cold
  job once it answered, that job removed first (a clone listens on its source's port);
- **lazy**: ``torpor run --from-template T --lazy``: the job runs before its memory is in.

Each is timed from the start of the ``torpor`` command to the first answered request (``GET /health``, or
``GET /`` for the weights server; a new connection tried every 5 ms), and the command's own time is kept
beside it: the restore's share. Each start's answer is checked against the cold server's (the embedding of
a text, bit for bit; the digest of the weights). Then **clones**: 1, and ``--clones`` (default 8) at once,
of the embedding server's template with ``--own-network``, each polled on its own address until all
answer. Every sample is written to the doc.

Goals: eager or lazy ≥ 20× shorter than cold for the embedding server, lazy ≥ 50× for the 2 GiB weights
server, 8 clones all answering within 2× one clone's time.

Until ``torpor template`` exists this measures the cold starts only, and says so. Writes its section of
``docs/benchmarks.md`` between ``<!-- warmstart:begin -->`` and ``<!-- warmstart:end -->``.
usage: bench_warmstart.py [--samples N] [--weights-size 2G] [--clones 8] [--only embed,weights,clones]
       [--no-doc] [--save FILE] [--render FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from bench import machine, machine_table
from benchdoc import median, publish, say

from torpor.adapters import jobnet
from torpor.adapters.criu import Criu
from torpor.core.engine import Engine
from torpor.core.store.hot import HotTier
from torpor.settings import Settings, find_criu

TORPOR = str(Path(sys.executable).parent / "torpor")
#: the bridge and subnet of the clones' own networks: traffic goes only to the namespaces torpor makes on it
BRIDGE = "torpbench0"
SUBNET = "10.213.250.0/24"
JOBS = Path(__file__).resolve().parent.parent / "tests" / "jobs"
GIB = 2**30
MIB = 2**20
POLL_S = 0.005
CONNECT_S = (
    0.05  # a connection not accepted by then is tried anew (a SYN dropped meanwhile is not waited out)
)
START_TIMEOUT_S = 300.0
MEASUREMENTS = ("embed", "weights", "clones")
GOALS = {"embed": 20.0, "weights": 50.0}
FLEET_GOAL = 2.0
TEXT = "a checkpoint of a running job, kept as a start point"


@dataclass
class Sample:
    server: str  # embed | weights
    kind: str  # cold | eager | lazy
    first_answer_s: float  # the torpor command's start → the first answered request
    command_s: float  # the torpor command's own time
    same: bool | None  # the same answer as the cold server's first (None: not compared)
    said: str = ""  # the command's line, for where the job came from
    restore_s: float | None = None  # the restore's own time, as the command says it ("… in 0.30 s")
    tier: str = ""  # where the template's image was: "RAM" (the hot tier) or "disk" (the cold tier only)


@dataclass
class Template:
    name: str
    save_s: float
    said: str
    checkpoint: str = ""


@dataclass
class Fleet:
    clones: int
    all_answer_s: float  # the commands' start → the last clone's first answer
    firsts: list[float]  # each clone's first answer
    commands: list[float]  # each command's own time
    same: bool  # every clone gave the cold embedding


@dataclass
class Results:
    samples: list[Sample] = field(default_factory=list)
    templates: dict[str, Template] = field(default_factory=dict)
    fleets: list[Fleet] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: ``torpor ps --json`` on the state directory, timed: what any torpor command costs here at least
    floor: list[float] = field(default_factory=list)


# -- talking to a server -------------------------------------------------------------------------------------


def answer(host: str, port: int, path: str) -> bytes | None:
    """The body of ``GET path`` if it answers 200 now, else None (refused, reset, no server yet)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_S) as conn:
            conn.settimeout(START_TIMEOUT_S)  # once accepted, a lazy job may fault its pages in first
            conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = bytearray()
            while chunk := conn.recv(65536):
                data += chunk
    except OSError:
        return None
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.") and head.split(b" ", 2)[1:2] == [b"200"] else None


def embedding(host: str, port: int) -> list[float]:
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/embed", json.dumps({"text": TEXT}), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        body = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"POST /embed answered {reply.status}: {body[:200]!r}")
        return list(json.loads(body)["embedding"])
    finally:
        connection.close()


@dataclass(frozen=True)
class Server:
    name: str
    argv: tuple[str, ...]  # the server's command, --port added
    path: str  # what is polled
    port: int
    host: str = "127.0.0.1"

    def command(self) -> list[str]:
        return [sys.executable, "-u", *self.argv, "--port", str(self.port)]

    def fingerprint(self, host: str | None = None) -> Any:
        """What must be the same on every start: the embedding of TEXT, or the weights' digest."""
        host = host or self.host
        if self.name == "embed":
            return embedding(host, self.port)
        body = answer(host, self.port, "/")
        return None if body is None else json.loads(body)["digest"]


# -- the state directory -------------------------------------------------------------------------------------


class Node:
    """A private state directory and its hot tier in /dev/shm; :meth:`close` removes jobs, templates, both."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.hot = Path("/dev/shm") / f"torpor-bench-warm-{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "TORPOR_HOME": str(self.home),
            "TORPOR_HOT_DIR": str(self.hot),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            # the clones' networks on a bridge of the benchmark's own, removed with it (close)
            "TORPOR_BRIDGE": BRIDGE,
            "TORPOR_SUBNET": SUBNET,
        }
        helped = self.torpor("run", "--help").stdout
        self.templates_exist = "--from-template" in helped
        self.own_network = "--own-network" in helped
        self.settings = Settings(home=self.home, criu=find_criu(None), hot_dir=self.hot)
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """A local engine on the same state directory, to wait for an image to be durable."""
        if self._engine is None:
            self._engine = Engine(self.settings)
        return self._engine

    def save_template(self, name: str, job: str) -> Template:
        """``torpor template save NAME JOB``, then until its image is durable and the destager idle: its
        storing does not land in the starts measured next."""
        began = time.monotonic()
        said = self.torpor("template", "save", name, job).stdout.strip()
        took = time.monotonic() - began
        checkpoint = self.template_checkpoint(name)
        self.engine.wait_durable(checkpoint)  # type: ignore[arg-type]
        return Template(name, took, said, checkpoint)

    def template_checkpoint(self, name: str) -> str:
        for template in json.loads(self.torpor("template", "ls", "--json").stdout):
            if template["name"] == name:
                return str(template["checkpoint"])
        raise RuntimeError(f"no template {name} after torpor template save")

    def tier(self, checkpoint: str) -> str:
        return "RAM" if HotTier(self.settings.hot_path).record(checkpoint) is not None else "disk"

    def torpor(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [TORPOR, *args], capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"torpor {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def jobs(self) -> list[dict[str, Any]]:
        return list(json.loads(self.torpor("ps", "--json").stdout))

    def log(self, name: str) -> str:
        return self.torpor("logs", name, check=False).stdout

    def remove(self, name: str) -> None:
        self.torpor("rm", "--force", name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for job in self.jobs():
                self.torpor("rm", "--force", job["name"], check=False)
        if self.templates_exist:
            with contextlib.suppress(Exception):
                for template in json.loads(self.torpor("template", "ls", "--json").stdout):
                    self.torpor("template", "rm", template["name"], check=False)
        shutil.rmtree(self.hot, ignore_errors=True)
        with contextlib.suppress(Exception):
            jobnet.remove_bridge(jobnet.Bridge(BRIDGE, IPv4Network(SUBNET)))


@dataclass
class Started:
    first_answer_s: float
    command_s: float
    said: str
    name: str


def timed_start(node: Node, server: Server, name: str, args: list[str], host: str | None = None) -> Started:
    """Run ``torpor run --name NAME ARGS`` and poll the server from the command's start until it answers;
    the command's own time is taken by a thread meanwhile (``--lazy``'s may end after the first answer)."""
    host = host or server.host
    began = time.monotonic()
    command = subprocess.Popen(
        [TORPOR, "run", "--name", name, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=node.env,
    )
    output: list[str] = []
    ended: list[float] = []

    def wait() -> None:
        out, err = command.communicate()
        ended.append(time.monotonic())
        output[:] = [out, err]

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    deadline = began + START_TIMEOUT_S
    while answer(host, server.port, server.path) is None:
        if ended and command.returncode != 0:
            raise RuntimeError(
                f"torpor run {' '.join(args)} exited {command.returncode}: {output[1].strip()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{name} did not answer within {START_TIMEOUT_S:.0f} s:\n{node.log(name)[-2000:]}"
            )
        time.sleep(POLL_S)
    first = time.monotonic() - began
    waiter.join(START_TIMEOUT_S)
    if command.returncode != 0:
        raise RuntimeError(f"torpor run {' '.join(args)} exited {command.returncode}: {output[1].strip()}")
    said = output[0].strip().splitlines()[-1] if output[0].strip() else ""
    return Started(first, ended[0] - began, said, name)


# -- the measurements ----------------------------------------------------------------------------------------


def command_floor(node: Node, samples: int) -> list[float]:
    """``torpor ps --json`` timed ``samples`` times: the interpreter's start, torpor's import, one read."""
    found = []
    for _ in range(samples):
        began = time.monotonic()
        node.torpor("ps", "--json")
        found.append(time.monotonic() - began)
    return found


def measure_server(node: Node, server: Server, samples: int, results: Results) -> None:
    """``samples`` cold starts and, with templates, as many eager and lazy starts from one template."""
    kinds = ["cold", "eager", "lazy"] if node.templates_exist else ["cold"]
    template = f"bench-{server.name}"
    reference: Any = None
    count = 0
    for round_ in range(samples):
        # the first round starts cold (its job becomes the template); the later ones rotate the order
        order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)] if round_ else kinds
        for kind in order:
            count += 1
            name = f"{server.name}-{kind}-{count}"
            args = ["--", *server.command()] if kind == "cold" else ["--from-template", template]
            if kind == "lazy":
                args.append("--lazy")
            tier = "" if kind == "cold" else node.tier(results.templates[template].checkpoint)
            started = timed_start(node, server, name, args)
            found = server.fingerprint()
            if reference is None:
                reference = found
            restored = re.search(r"from template '[^']*' in (\d+(?:\.\d+)?) s", started.said)
            sample = Sample(
                server.name,
                kind,
                started.first_answer_s,
                started.command_s,
                found == reference,
                started.said,
                None if restored is None else float(restored.group(1)),
                tier,
            )
            say(describe(sample))
            results.samples.append(sample)
            if kind == "cold" and node.templates_exist and template not in results.templates:
                results.templates[template] = node.save_template(template, name)
                say(f"  template {template}: {results.templates[template].said}")
            node.remove(name)
    if node.templates_exist:
        node.torpor("template", "rm", template)


def describe(sample: Sample) -> str:
    restore = (
        "" if sample.restore_s is None else f", restore {sample.restore_s:.2f} s (image in {sample.tier})"
    )
    return (
        f"  {sample.server} {sample.kind}: first answer {sample.first_answer_s:.3f} s, command "
        f"{sample.command_s:.3f} s{restore}, same answer: {sample.same}"
    )


def address_of(node: Node, name: str, said: str) -> str | None:
    """The clone's own address: from ``torpor ps --json``, else from the command's line; None if neither
    has one (the clone shares the machine's network)."""
    for job in node.jobs():
        if job["name"] == name:
            for key in ("address", "ip", "network_address"):
                value = job.get(key)
                if isinstance(value, str) and value:
                    return value.split("/", 1)[0]
    found = re.search(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b", said)
    return None if found is None else found.group(1)


def start_fleet(node: Node, server: Server, template: str, count: int, reference: Any, tag: str) -> Fleet:
    """``count`` clones with --own-network, their commands started at once; each polled on its own address
    from the moment its command returned (the address is known then) until it answers."""
    began = time.monotonic()
    names = [f"clone-{tag}-{i}" for i in range(count)]
    commands = [
        subprocess.Popen(
            [TORPOR, "run", "--name", name, "--from-template", template, "--own-network"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=node.env,
        )
        for name in names
    ]
    firsts: list[float] = [0.0] * count
    own: list[float] = [0.0] * count
    hosts: list[str] = [""] * count
    errors: list[str] = []

    def follow(i: int) -> None:
        try:
            out, err = commands[i].communicate(timeout=START_TIMEOUT_S)
            own[i] = time.monotonic() - began
            if commands[i].returncode != 0:
                raise RuntimeError(f"exited {commands[i].returncode}: {err.strip()}")
            host = address_of(node, names[i], out)
            if host is None:
                raise RuntimeError(f"no address of its own in torpor ps --json nor in {out.strip()!r}")
            hosts[i] = host
            deadline = began + START_TIMEOUT_S
            while answer(hosts[i], server.port, server.path) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer on {hosts[i]}:{server.port}")
                time.sleep(POLL_S)
            firsts[i] = time.monotonic() - began
        except Exception as exc:  # reported below, for every clone that failed
            errors.append(f"{names[i]}: {exc}")

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(START_TIMEOUT_S + 10)
    try:
        if errors:
            raise RuntimeError("clones failed: " + "; ".join(errors))
        same = all(server.fingerprint(host) == reference for host in hosts)
        return Fleet(count, max(firsts), firsts, own, same)
    finally:
        for name in names:
            node.torpor("rm", "--force", name, check=False)


def clones_missing(node: Node) -> str | None:
    """Why the clones cannot be measured with this torpor (before any is started), or None."""
    if not node.templates_exist:
        return "`torpor template` does not exist in this torpor yet"
    if not node.own_network:
        return (
            "`torpor run --own-network` does not exist in this torpor yet: clones of one server cannot "
            "listen on the same port side by side"
        )
    return None


def measure_clones(node: Node, server: Server, count: int, repeats: int, results: Results) -> None:
    """1 and ``count`` clones at once, ``repeats`` times each, of a template of ``server`` bound to
    0.0.0.0: a clone in a network of its own answers on its address there, not on the machine's loopback."""
    template = "bench-fleet"
    source = "fleet-source"
    timed_start(node, server, source, ["--", *server.command(), "--host", "0.0.0.0"])
    reference = server.fingerprint()
    node.save_template(template, source)
    node.remove(source)
    try:
        # --own-network may be accepted before it gives a clone an address: one clone tells
        probe = node.torpor("run", "--name", "fleet-probe", "--from-template", template, "--own-network")
        own = address_of(node, "fleet-probe", probe.stdout)
        node.remove("fleet-probe")
        if own is None:
            why = (
                "`torpor run --own-network` is accepted, but the clone it started had no address of its own "
                f"(none in `torpor ps --json` nor in {probe.stdout.strip()!r}): clones of one server cannot "
                "listen on the same port side by side yet"
            )
            results.notes.append(why)
            say(f"bench_warmstart: clones not measured: {why}")
            return
        for i in range(repeats):
            for n in (1, count) if i % 2 == 0 else (count, 1):
                fleet = start_fleet(node, server, template, n, reference, f"{i}-{n}")
                say(
                    f"  {n} clone(s): all answered after {fleet.all_answer_s:.3f} s (same answer: {fleet.same})"
                )
                results.fleets.append(fleet)
    finally:
        node.torpor("template", "rm", template, check=False)


# -- the report ----------------------------------------------------------------------------------------------


def of(results: Results, server: str, kind: str) -> list[Sample]:
    return [s for s in results.samples if s.server == server and s.kind == kind]


def server_section(results: Results, server: str, title: str) -> list[str]:
    cold = median([s.first_answer_s for s in of(results, server, "cold")])
    lines = [
        title,
        "",
        "| start | first answer | command | restore (the command's figure) | restore / first answer | cold / this |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("cold", "eager", "lazy"):
        found = of(results, server, kind)
        if not found:
            continue
        first = median([s.first_answer_s for s in found])
        command = median([s.command_s for s in found])
        restores = [s.restore_s for s in found if s.restore_s is not None]
        restore = f"{median(restores):.3f} s" if restores else "-"
        share = f"{median(restores) / first:.0%}" if restores else "-"
        ratio = "-" if kind == "cold" else f"**{cold / first:.1f}×**"
        lines.append(f"| {kind} | {first:.3f} s | {command:.3f} s | {restore} | {share} | {ratio} |")
    goal = GOALS[server]
    bullets = []
    if of(results, server, "eager"):
        kinds = ("eager", "lazy") if server == "embed" else ("lazy",)
        for kind in kinds:
            ratio = cold / median([s.first_answer_s for s in of(results, server, kind)])
            verdict = "met" if ratio >= goal else "missed"
            bullets.append(f"- **Goal: {kind} ≥ {goal:.0f}× shorter than cold: {ratio:.1f}×, {verdict}.**")
        bar = f"- The goal's bar is {cold / goal:.3f} s from the command to the first answer"
        if results.floor:
            bar += (
                f"; `torpor ps --json`, which starts the interpreter, imports torpor and reads the records, took "
                f"{median(results.floor):.3f} s here (median of {len(results.floor)}): any start through the "
                "`torpor` command pays that first"
            )
        bullets.append(bar + ".")
        if template := results.templates.get(f"bench-{server}"):
            bullets.append(
                f"- The template: `torpor template save` took {template.save_s:.2f} s and said: {template.said}"
            )
    else:
        bullets.append("- Not measured from a template: `torpor template` does not exist in this torpor yet.")
    differing = [s for s in results.samples if s.server == server and s.same is False]
    bullets.append(
        "- Every start answered as the first cold one did."
        if not differing
        else f"- **{len(differing)} start(s) answered differently from the first cold one.**"
    )
    lines += ["", *bullets]
    lines += [
        "",
        "| # | start | first answer | command | restore | image in | same answer | the command said |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate([s for s in results.samples if s.server == server]):
        restore = "-" if s.restore_s is None else f"{s.restore_s:.2f} s"
        same = "yes" if s.same else "no" if s.same is False else "-"
        lines.append(
            f"| {i + 1} | {s.kind} | {s.first_answer_s:.3f} s | {s.command_s:.3f} s | {restore} | "
            f"{s.tier or '-'} | {same} | {s.said or '-'} |"
        )
    return lines


def fleet_section(results: Results, meta: dict[str, Any]) -> list[str]:
    lines = ["### Clones of the embedding server started at once, each on its own network", ""]
    if not results.fleets:
        lines.append(f"Not measured: {results.notes[-1] if results.notes else 'none asked for'}.")
        return lines
    count = meta["clones"]
    one = median([f.all_answer_s for f in results.fleets if f.clones == 1])
    many = median([f.all_answer_s for f in results.fleets if f.clones == count])
    verdict = "met" if many <= FLEET_GOAL * one else "missed"
    lines += [
        f"`torpor run --from-template T --own-network` {count} times at once, each clone polled on its own "
        "address from when its command returned, against one clone alone timed the same way.",
        "",
        f"- **{count} clones all answered after {many:.3f} s, one clone after {one:.3f} s: "
        f"{many / one:.2f}×**; goal ≤ {FLEET_GOAL:.0f}×: {verdict} (medians).",
        "",
        "| # | clones | all answered | each clone's first answer | each command | same answer |",
        "|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(results.fleets):
        firsts = ", ".join(f"{x:.2f}" for x in sorted(f.firsts))
        commands = ", ".join(f"{x:.2f}" for x in sorted(f.commands))
        lines.append(
            f"| {i + 1} | {f.clones} | {f.all_answer_s:.3f} s | {firsts} s | {commands} s | {'yes' if f.same else 'no'} |"
        )
    return lines


def section(results: Results, meta: dict[str, Any]) -> str:
    size = meta["weights_bytes"]
    lines = [
        "## Warm starts: a server from its template vs its cold start (`scripts/bench_warmstart.py`)",
        "",
        f"Written on {meta['at']}, in {meta['took_s'] / 60:.0f} min, on the machine below; a private state "
        "directory in /tmp (its cold tier on disk), its hot tier in /dev/shm; real jobs, real CRIU, servers on "
        f"127.0.0.1. {meta['samples']} samples of each start, rotating which went first (all below). Load "
        f"average (1 min) {meta['load'][0]:.2f} at the start and {meta['load'][1]:.2f} at the end.",
        "",
        machine_table(meta["machine"]),
        "",
        "- *first answer*: from the start of the `torpor run` command to the first request answered (a new "
        "connection tried every 5 ms, each given 50 ms to be accepted): `GET /health` of the embedding "
        "server, `GET /` of the weights server. *command*: the `torpor run` command's own time, interpreter "
        "start and import of torpor included; with `--from-template` it returns once the restored job runs, "
        "with `--lazy` once all of its memory is in (the job runs, and may answer, before). *restore*: what the "
        "command says the restore took (`from template 'T' in N s`). *cold / this*: the cold start's median "
        "first answer over this start's.",
        "- *cold*: `torpor run -- python SERVER`. *eager*: `torpor run --from-template T`, T saved by "
        "`torpor template save` from the first cold job once it answered (the benchmark then waited until its "
        "image was durable), that job then removed (a clone listens on its source's port). *lazy*: the same "
        "with `--lazy`. *image in*: where the template's image was at the start: the RAM tier (and the disk), "
        "or the disk only.",
        "- *same answer*: the embedding of one text (bit for bit) or the weights' digest, against the first "
        "cold start's.",
        "",
    ]
    if "embed" in meta["measured"]:
        lines += [
            *server_section(
                results,
                "embed",
                "### The embedding server: all-MiniLM-L6-v2 behind uvicorn (`tests/jobs/embed_server.py`)",
            ),
            "",
        ]
    if "weights" in meta["measured"]:
        lines += [
            *server_section(
                results,
                "weights",
                f"### The weights server: {size / GIB:.2f} GiB of random bytes read and hashed "
                "(`tests/jobs/weights_server.py`)",
            ),
            "",
        ]
    if "clones" in meta["measured"]:
        lines += [*fleet_section(results, meta), ""]
    return "\n".join(lines)


def save(path: Path, results: Results, meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"results": asdict(results), "meta": meta}, indent=1))


def load(path: Path) -> tuple[Results, dict[str, Any]]:
    raw = json.loads(path.read_text())
    r = raw["results"]
    results = Results(
        [Sample(**s) for s in r["samples"]],
        {k: Template(**t) for k, t in r["templates"].items()},
        [Fleet(**f) for f in r["fleets"]],
        list(r["notes"]),
        list(r.get("floor", [])),
    )
    meta = raw["meta"]
    meta["machine"] = [tuple(pair) for pair in meta["machine"]]
    return results, meta


def parse_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": MIB, "G": GIB}
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", text, re.I)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2G, 512M)")
    return int(float(found.group(1)) * units[found.group(2).upper()])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def weights_file(size: int) -> Iterator[Path]:
    """A file of ``size`` random bytes in /var/tmp, deleted after."""
    path = Path("/var/tmp") / f"torpor-bench-weights-{uuid.uuid4().hex[:8]}.bin"
    try:
        subprocess.run(
            [sys.executable, str(JOBS / "weights_server.py"), "--make", str(path), "--size", str(size)],
            check=True,
        )
        yield path
    finally:
        path.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=5, help="starts of each kind per server (default 5)")
    parser.add_argument("--weights-size", type=parse_size, default=2 * GIB, help="default 2G")
    parser.add_argument("--clones", type=int, default=8, help="clones started at once (default 8)")
    parser.add_argument(
        "--clone-repeats", type=int, default=3, help="samples of 1 and of N clones (default 3)"
    )
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="which measurements, comma-separated")
    parser.add_argument("--no-doc", action="store_true", help="print the section, do not write the doc")
    parser.add_argument("--save", type=Path, help="also write every sample to this JSON file")
    parser.add_argument("--render", type=Path, help="measure nothing: write the section from --save's file")
    args = parser.parse_args()
    if args.render:
        publish("warmstart", section(*load(args.render)), print_only=args.no_doc)
        return 0
    wanted = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(MEASUREMENTS))
    if unknown:
        parser.error(
            f"--only: no measurement named {', '.join(unknown)} (there are {', '.join(MEASUREMENTS)})"
        )
    if args.samples < 1 or args.clones < 1 or args.clone_repeats < 1:
        parser.error("--samples, --clones and --clone-repeats: 1 or more")
    if os.geteuid() != 0:
        print("bench_warmstart: cannot run: CRIU needs root", file=sys.stderr)
        return 3
    criu_path = find_criu(None)
    if criu_path is None:
        print("bench_warmstart: criu not found: run 'make setup'", file=sys.stderr)
        return 3
    # SIGTERM (make's, a CI's) ends the run through the finally blocks: no job, template or file left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    results = Results()
    with tempfile.TemporaryDirectory(prefix="torpor-bench-warm-") as tmp:
        os.chmod(tmp, 0o700)
        node = Node(Path(tmp))
        try:
            if not node.templates_exist:
                results.notes.append("`torpor template` does not exist in this torpor yet: cold starts only")
                say(f"bench_warmstart: {results.notes[-1]}")
            results.floor = command_floor(node, 5)
            embed = Server("embed", (str(JOBS / "embed_server.py"),), "/health", free_port())
            if "embed" in wanted:
                say("the embedding server:")
                measure_server(node, embed, args.samples, results)
            if "weights" in wanted:
                say(f"the weights server, {args.weights_size / GIB:.2f} GiB:")
                with weights_file(args.weights_size) as path:
                    weights = Server(
                        "weights", (str(JOBS / "weights_server.py"), str(path)), "/", free_port()
                    )
                    measure_server(node, weights, args.samples, results)
            if "clones" in wanted:
                why = clones_missing(node)
                if why is None:
                    say(f"clones: 1 and {args.clones} at once:")
                    measure_clones(node, embed, args.clones, args.clone_repeats, results)
                else:
                    results.notes.append(why)
                    say(f"bench_warmstart: clones not measured: {why}")
        finally:
            node.close()
    meta = {
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(Criu(criu_path)),
        "took_s": time.monotonic() - started,
        "load": [load_start, os.getloadavg()[0]],
        "samples": args.samples,
        "weights_bytes": args.weights_size,
        "clones": args.clones,
        "measured": wanted,
    }
    if args.save:
        save(args.save, results, meta)
    publish("warmstart", section(results, meta), print_only=args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
