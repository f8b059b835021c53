"""Job networks (torpor.adapters.jobnet) on the real machine: the bridge, a job's namespace and veth pair,
removing them, listing them, job names of every shape; and real CRIU restoring a server into a job network
(``--join-ns``) and checkpointing it there again with the namespace external to the image
(``--external net[INODE]:KEY``, restored with ``--inherit-fd fd[N]:KEY``), into the same namespace or
another one.

Each test makes its own bridge (``torpt<hex>``), namespace prefix and a free 10.213.X.0/24, and sends
traffic only between this host and namespaces it made; everything is removed at the end, failed or not.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from conftest import JOBS, free_port
from torpor.adapters import jobnet, netlock
from torpor.errors import EnvironmentProblem, UsageError
from torpor.policy import addresses

CRIU = Path(sys.executable).parent / "criu"
#: the name a dump gives the job's namespace, external to the image; each restore gives it a namespace
#: under the same name, so one image restores into any job network
KEY = "jobnet"
SBIN = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"

pytestmark = [
    pytest.mark.root("to make bridges and network namespaces"),
    pytest.mark.xdist_group("jobnet"),
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("ip", path=SBIN) is None or shutil.which("nsenter") is None,
        reason="needs ip (iproute2) and nsenter (util-linux)",
    ),
]


def free_subnet(routed: list[IPv4Network], besides: tuple[IPv4Network, ...] = ()) -> IPv4Network:
    """A 10.213.X.0/24 that the machine routes nowhere (other test runs have their own)."""
    candidates = [IPv4Network(f"10.213.{x}.0/24") for x in range(64, 255)]
    free = [n for n in candidates if not addresses.overlapping(n, routed) and n not in besides]
    return random.choice(free)


def new_bridge(subnet: IPv4Network | None = None) -> jobnet.Bridge:
    tag = secrets.token_hex(3)
    probe = jobnet.Bridge(f"torpt{tag}", prefix=f"torpt{tag}-")
    return jobnet.Bridge(probe.name, subnet or free_subnet(jobnet.routed_networks(probe)), probe.prefix)


def clean(bridge: jobnet.Bridge) -> None:
    for network in jobnet.job_networks(bridge):
        jobnet.remove(network.netns)
    jobnet.remove_bridge(bridge)


@pytest.fixture
def bridge() -> Iterator[jobnet.Bridge]:
    made = new_bridge()
    try:
        jobnet.ensure_bridge(made)
        yield made
    finally:
        clean(made)


@dataclass
class Processes:
    """What a test started: killed at its end."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def server(self, port: int, log: Path, network: jobnet.JobNetwork | None = None) -> int:
        """Start tcp_server.py on ``port`` as a job (session leader, PID 1 of a PID namespace of its own),
        in ``network`` or this host's; its PID here."""
        argv = ["setsid", "unshare", "-p", "-f", "setsid", sys.executable, "-u", str(JOBS / "tcp_server.py")]
        if network is not None:
            argv = ["nsenter", f"--net={network.path}", *argv]
        with open(log, "ab") as out:  # O_APPEND: CRIU restores it after it grew
            started = subprocess.Popen([*argv, str(port)], stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self.started.append(started)
        children = Path(f"/proc/{started.pid}/task/{started.pid}/children")
        deadline = time.monotonic() + 5
        while not (text := children.read_text().split()):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.01)
        self.pids.append(int(text[0]))
        return int(text[0])

    def restored(self, pidfile: Path) -> int:
        pid = int(pidfile.read_text())
        self.pids.append(pid)
        return pid

    def end(self) -> None:
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for started in self.started:
            started.kill()
            started.wait(timeout=10)


@pytest.fixture
def processes() -> Iterator[Processes]:
    made = Processes()
    try:
        yield made
    finally:
        made.end()


def ask(address: IPv4Address | str, port: int, wait_s: float = 5.0) -> tuple[int, str]:
    """Connect to the server at ``address``; how many connections it answered, and its network namespace."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((str(address), port), timeout=2) as connection:
                answer = connection.makefile().readline().split()
                return int(answer[0]), answer[1]
        except ConnectionRefusedError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def net(inode: int) -> str:
    return f"net:[{inode}]"


def ip_json(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True, env={"PATH": SBIN})
    return list(json.loads(done.stdout or "[]"))


def ipv4_of(*args: str) -> list[str]:
    return [
        f"{info['local']}/{info['prefixlen']}"
        for link in ip_json("-4", *args)
        for info in link["addr_info"]  # type: ignore[attr-defined]
    ]


# the bridge


def test_a_bridge_is_made_up_with_the_subnet_s_first_address_and_forwards_nothing(
    bridge: jobnet.Bridge,
) -> None:
    jobnet.ensure_bridge(bridge)  # a second time: nothing changes
    assert ipv4_of("addr", "show", "dev", bridge.name) == [str(bridge.address)]
    assert str(bridge.address) == f"{bridge.subnet.network_address + 1}/24"
    (link,) = ip_json("-d", "link", "show", "dev", bridge.name)
    assert "UP" in link["flags"]  # type: ignore[operator]
    assert link["linkinfo"]["info_kind"] == "bridge"  # type: ignore[index]
    assert Path(f"/proc/sys/net/ipv4/conf/{bridge.name}/forwarding").read_text() == "0\n"
    assert bridge.subnet in jobnet.routed_networks(jobnet.Bridge("torptnone", bridge.subnet))
    assert bridge.subnet not in jobnet.routed_networks(bridge)  # its own route is no clash


def test_a_bridge_whose_subnet_overlaps_a_route_elsewhere_is_refused_in_one_line(
    bridge: jobnet.Bridge,
) -> None:
    for subnet in (bridge.subnet, IPv4Network(f"{bridge.subnet.network_address}/23", strict=False)):
        other = jobnet.Bridge(bridge.name + "x", subnet, prefix=bridge.prefix + "x-")
        try:
            with pytest.raises(EnvironmentProblem) as refused:
                jobnet.ensure_bridge(other)
            message = str(refused.value)
            assert f"overlaps {bridge.subnet}" in message and "choose another subnet" in message
            assert "\n" not in message
            assert not Path(f"/sys/class/net/{other.name}").exists()
        finally:
            jobnet.remove_bridge(other)


def test_a_link_of_that_name_that_is_not_a_bridge_or_has_another_address_is_refused(
    bridge: jobnet.Bridge,
) -> None:
    elsewhere = free_subnet(jobnet.routed_networks(bridge), besides=(bridge.subnet,))
    veth = jobnet.Bridge(bridge.name + "v", elsewhere)
    subprocess.run(
        ["ip", "link", "add", veth.name, "type", "veth", "peer", "name", bridge.name + "w"],
        check=True,
        env={"PATH": SBIN},
    )
    try:
        with pytest.raises(EnvironmentProblem, match="is a network link but not a bridge"):
            jobnet.ensure_bridge(veth)
    finally:
        jobnet.remove_bridge(veth)  # its peer goes with it
    moved = jobnet.Bridge(bridge.name, elsewhere, bridge.prefix)  # the same bridge, configured elsewhere
    with pytest.raises(EnvironmentProblem, match=f"has {bridge.address}, not {moved.address}"):
        jobnet.ensure_bridge(moved)


def test_bad_bridge_settings_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="bad bridge name"):
        jobnet.Bridge("a-bridge-name-too-long")
    with pytest.raises(UsageError, match="bad subnet"):
        jobnet.Bridge(subnet="10.213.0.1/24")  # type: ignore[arg-type]  # host bits set
    with pytest.raises(UsageError, match="too small"):
        jobnet.Bridge(subnet="10.213.0.0/31")  # type: ignore[arg-type]
    assert jobnet.Bridge(subnet="10.213.8.0/22").subnet == IPv4Network("10.213.8.0/22")  # type: ignore[arg-type]


# job networks


def test_a_job_network_serves_on_its_own_address_to_the_host(
    bridge: jobnet.Bridge, processes: Processes, tmp_path: Path
) -> None:
    address = addresses.pick_address(bridge.subnet, [])
    assert address == bridge.subnet.network_address + 2
    made = jobnet.create(bridge, "serve", address)
    assert made == jobnet.JobNetwork(
        jobnet.netns_name(bridge, "serve"), jobnet.host_link_name(made.netns), address
    )
    assert jobnet.job_networks(bridge) == [made]
    inside = ipv4_of("-n", made.netns, "addr", "show")
    assert inside == ["127.0.0.1/8", f"{address}/24"]
    (route,) = ip_json("-4", "-n", made.netns, "route", "show", "default")
    assert route["gateway"] == str(bridge.address.ip) and route["dev"] == "eth0"
    (host_end,) = ip_json("link", "show", "dev", made.host_link)
    assert host_end["master"] == bridge.name and "UP" in host_end["flags"]  # type: ignore[operator]

    inode = jobnet.netns_inode(made.netns)
    port = free_port()
    pid = processes.server(port, tmp_path / "serve.log", made)
    assert ask(address, port) == (1, net(inode))
    assert os.readlink(f"/proc/{pid}/ns/net") == net(inode)
    fd = jobnet.open_netns(made.netns)
    try:
        assert os.fstat(fd).st_ino == inode
    finally:
        os.close(fd)


def test_two_clones_listen_on_one_port_each_on_its_own_address(
    bridge: jobnet.Bridge, processes: Processes, tmp_path: Path
) -> None:
    port = free_port()
    made = []
    for job in ("clone", "clone-2"):
        taken = [n.address for n in jobnet.job_networks(bridge) if n.address is not None]
        address = addresses.pick_address(bridge.subnet, taken)
        assert address is not None
        made.append(jobnet.create(bridge, job, address))
        processes.server(port, tmp_path / f"{job}.log", made[-1])
    assert [n.address for n in made] == [bridge.subnet.network_address + 2, bridge.subnet.network_address + 3]
    for network in made:
        assert ask(network.address or "", port) == (1, net(jobnet.netns_inode(network.netns)))


def test_every_job_name_gives_a_namespace_and_a_short_link_of_its_own(bridge: jobnet.Bridge) -> None:
    names = ["a", "x" * 64, "v1.2_b-3", "A", "a.", "a_"]
    links = {jobnet.host_link_name(jobnet.netns_name(bridge, name)) for name in names}
    assert len(links) == len(names) and all(len(link) <= 15 for link in links)
    for bad in ("", "a/b", "..", "x" * 65, "a b"):
        with pytest.raises(ValueError):
            jobnet.netns_name(bridge, bad)
    first = bridge.subnet.network_address + 2
    for n, name in enumerate(["x" * 64, "v1.2_b-3"]):
        made = jobnet.create(bridge, name, first + n)
        assert made.path == Path("/run/netns") / f"{bridge.prefix}{name}" and made.path.exists()
    assert [n.address for n in jobnet.job_networks(bridge)] == [first + 1, first]  # by name


def test_removing_a_job_network_is_idempotent_and_the_listing_forgets_it(
    bridge: jobnet.Bridge, processes: Processes, tmp_path: Path
) -> None:
    made = jobnet.create(bridge, "gone", bridge.subnet.network_address + 2)
    pid = processes.server(free_port(), tmp_path / "gone.log", made)
    jobnet.remove(made.netns)  # while a process lives in it: it keeps the namespace, off the bridge
    jobnet.remove(made.netns)
    jobnet.remove(jobnet.netns_name(bridge, "never-made"))
    assert jobnet.job_networks(bridge) == []
    assert not made.path.exists() and not Path(f"/sys/class/net/{made.host_link}").exists()
    assert os.readlink(f"/proc/{pid}/ns/net").startswith("net:[")
    with pytest.raises(EnvironmentProblem, match="is gone"):
        jobnet.netns_inode(made.netns)
    with pytest.raises(EnvironmentProblem, match="is gone"):
        jobnet.open_netns(made.netns)


def test_a_step_that_fails_leaves_nothing_and_the_error_is_ip_s_own_line(bridge: jobnet.Bridge) -> None:
    unmade = jobnet.Bridge(bridge.name + "n", bridge.subnet, bridge.prefix)  # never ensured: no such link
    with pytest.raises(EnvironmentProblem) as failed:
        jobnet.create(unmade, "half", bridge.subnet.network_address + 2)
    message = str(failed.value)
    assert message.startswith(
        f"'ip link set {jobnet.host_link_name(bridge.prefix + 'half')} master {unmade.name} up'"
    )
    assert "failed: " in message and "\n" not in message
    assert isinstance(failed.value.__cause__, subprocess.CalledProcessError)
    assert jobnet.job_networks(bridge) == []
    assert not Path(f"/sys/class/net/{jobnet.host_link_name(bridge.prefix + 'half')}").exists()

    made = jobnet.create(bridge, "twice", bridge.subnet.network_address + 2)
    with pytest.raises(EnvironmentProblem, match="has a network already"):
        jobnet.create(bridge, "twice", bridge.subnet.network_address + 3)
    assert jobnet.job_networks(bridge) == [made]  # the refusal touched nothing of the first
    with pytest.raises(ValueError):
        jobnet.create(bridge, "bridge-address", bridge.address.ip)


# CRIU and job networks


def criu(images: Path, *args: str, log: str, pass_fds: tuple[int, ...] = (), check: bool = True) -> str:
    """Run CRIU (``-D images -o log -v4``); the log."""
    done = subprocess.run(
        [str(CRIU), *args, "-D", str(images), "-o", log, "-v4"],
        capture_output=True,
        text=True,
        timeout=60,
        pass_fds=pass_fds,
        check=False,
    )
    text = (images / log).read_text(errors="replace")
    if check:
        assert done.returncode == 0, "\n".join(line for line in text.splitlines() if "Error" in line)
    return text


DUMP = ("dump", "--tcp-established", "--file-locks", "--network-lock", "nftables")
RESTORE = ("restore", "-d", "--tcp-close", "--file-locks")


def lock_tables_in(network: jobnet.JobNetwork) -> list[str]:
    listed = subprocess.run(
        ["nsenter", f"--net={network.path}", "nft", "list", "tables"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": SBIN},
    )
    return [line for line in listed.stdout.splitlines() if "CRIU-" in line]


@pytest.fixture
def template(processes: Processes, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A server saved in this host's network (as ``torpor run --from-template`` finds it): its images, its
    port; it answered once before it was saved."""
    port = free_port()
    pid = processes.server(port, tmp_path / "template.log")
    assert ask("127.0.0.1", port)[0] == 1
    images = tmp_path / "template"
    images.mkdir()
    try:
        criu(images, *DUMP, "-t", str(pid), log="dump.log")
        yield images, port
    finally:
        if (run := netlock.run_id(images / "dump.log")) is not None:
            netlock.release(run)  # a restore that never came leaves the lock in this host's network


@pytest.mark.criu
def test_a_server_saved_in_the_host_s_network_is_restored_into_a_job_network(
    bridge: jobnet.Bridge, processes: Processes, template: tuple[Path, int], tmp_path: Path
) -> None:
    images, port = template
    clone = jobnet.create(bridge, "clone", bridge.subnet.network_address + 2)
    pidfile = tmp_path / "clone.pid"
    criu(images, *RESTORE, "--pidfile", str(pidfile), "--join-ns", f"net:{clone.path}", log="restore.log")
    pid = processes.restored(pidfile)
    assert os.readlink(f"/proc/{pid}/ns/net") == net(jobnet.netns_inode(clone.netns))
    assert ask(clone.address or "", port) == (2, net(jobnet.netns_inode(clone.netns)))
    with pytest.raises(ConnectionRefusedError):
        ask("127.0.0.1", port, wait_s=0)  # not in this host's network any more
    run = netlock.run_id(images / "dump.log")
    assert run is not None and netlock.lock_tables(run) == []  # the restore released the lock of the dump


@pytest.mark.criu
def test_a_server_in_a_job_network_is_checkpointed_with_that_network_external_and_restored_into_any(
    bridge: jobnet.Bridge, processes: Processes, template: tuple[Path, int], tmp_path: Path
) -> None:
    images, port = template
    first = jobnet.create(bridge, "first", bridge.subnet.network_address + 2)
    second = jobnet.create(bridge, "second", bridge.subnet.network_address + 3)
    inode = jobnet.netns_inode(first.netns)
    pidfile = tmp_path / "first.pid"
    criu(images, *RESTORE, "--pidfile", str(pidfile), "--join-ns", f"net:{first.path}", log="restore.log")
    pid = processes.restored(pidfile)
    assert ask(first.address or "", port) == (2, net(inode))

    # a checkpoint that leaves it running, its namespace not in the image
    saved = tmp_path / "saved"
    saved.mkdir()
    external = ("--external", f"net[{inode}]:{KEY}")
    log = criu(saved, *DUMP, "-t", str(pid), "--leave-running", *external, log="dump.log")
    assert f"The net[{inode}] netns is external" in log
    assert not list(saved.glob("netdev-*.img"))  # without --external CRIU saves the veth and addresses too
    assert ask(first.address or "", port) == (3, net(inode))

    # --join-ns does not stand for the external namespace: its key must be given an fd
    failed = criu(
        saved,
        *RESTORE,
        "--pidfile",
        str(tmp_path / "no.pid"),
        "--join-ns",
        f"net:{second.path}",
        log="no.log",
        check=False,
    )
    assert f"Unable to find an external netns: {KEY}" in failed

    # restored into another job network: a second clone, counting on from the checkpoint
    fd = jobnet.open_netns(second.netns)
    try:
        criu(
            saved,
            *RESTORE,
            "--pidfile",
            str(tmp_path / "second.pid"),
            "--inherit-fd",
            f"fd[{fd}]:{KEY}",
            log="restore-second.log",
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    processes.restored(tmp_path / "second.pid")
    assert ask(second.address or "", port) == (3, net(jobnet.netns_inode(second.netns)))
    assert ask(first.address or "", port) == (4, net(inode))

    # hibernated (not left running) and resumed in its own network
    hibernated = tmp_path / "hibernated"
    hibernated.mkdir()
    criu(hibernated, *DUMP, "-t", str(pid), *external, log="dump.log")
    has_nft = shutil.which("nft", path=SBIN) is not None
    if has_nft:  # the network lock lives in the job's namespace, where its sockets are
        assert len(lock_tables_in(first)) == 1
    fd = jobnet.open_netns(first.netns)
    try:
        criu(
            hibernated,
            *RESTORE,
            "--pidfile",
            str(tmp_path / "resumed.pid"),
            "--inherit-fd",
            f"fd[{fd}]:{KEY}",
            log="restore.log",
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    resumed = processes.restored(tmp_path / "resumed.pid")
    assert os.readlink(f"/proc/{resumed}/ns/net") == net(inode)
    assert ask(first.address or "", port) == (5, net(inode))
    if has_nft:
        assert lock_tables_in(first) == []  # the restore released it there
