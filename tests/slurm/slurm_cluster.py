"""A throwaway one-node Slurm cluster on loopback: munged, slurmctld and slurmd in a private folder.

Used by the Slurm tests (a session fixture) and by ``scripts/bench_slurm.py``. Everything lives under one
folder (config, munge key and socket, state, logs) and nothing of the machine's own Slurm or munge setup
is read or changed: client commands find the config through ``SLURM_CONF``, which :meth:`Cluster.env`
sets. The settings that make it fast come from DESIGN.md (``sched_interval=1``, ``cred_expire=5``…).

Partitions: ``low`` (default, PriorityTier 1, preempted by requeue with a 20 s grace time) and ``high``
(PriorityTier 10, never preempted). The node has every CPU of the machine, so one job that asks for all
of them (``--exclusive``) in ``high`` preempts anything running in ``low``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SBIN = "/usr/local/sbin:/usr/sbin:/sbin"

CONF = """\
ClusterName=torpor-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state/ctld
SlurmdSpoolDir={root}/state/d
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=low  Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1  PreemptMode=REQUEUE GraceTime=20
PartitionName=high Nodes={host} Default=NO  MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
SchedulerParameters=batch_sched_delay=0,sched_interval=1
"""


class ClusterError(RuntimeError):
    """The test cluster did not come up or did not answer as expected."""


def slurm_available() -> str | None:
    """Why a cluster cannot run here (``None`` when it can)."""
    if os.geteuid() != 0:
        return "the Slurm tests run the daemons as root"
    path = os.pathsep.join([os.environ.get("PATH", ""), SBIN])
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue"):
        if shutil.which(tool, path=path) is None:
            return f"{tool} not installed (scripts/install-slurm.sh installs slurm-wlm and munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    root: Path
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), SBIN])
        env.update(extra or {})
        return env

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        for sub in ("munge", "state/ctld", "state/d", "run", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        memory_mb = max(1000, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20) - 2048)
        self.conf.write_text(
            CONF.format(
                host=self.host,
                root=self.root,
                ctld_port=_free_port(),
                d_port=_free_port(),
                cpus=os.cpu_count() or 1,
                memory_mb=memory_mb,
            )
        )
        munge = self.root / "munge"
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={self.root}/log/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            "munged",
        )
        self._wait(lambda: (munge / "munge.socket").exists(), 10, "munged did not create its socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], "slurmd")
        self._wait(self._node_idle, timeout, "the node did not become idle")

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in reversed(self.processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()
        # a job step whose slurmd went away can linger: end the ones of this cluster
        needle = f"SLURM_CONF={self.conf}\0".encode()
        for entry in Path("/proc").iterdir():
            try:
                if (
                    entry.name.isdigit()
                    and (entry / "comm").read_text().startswith("slurmstepd")
                    and needle in (entry / "environ").read_bytes()
                ):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    def _spawn(self, argv: list[str], name: str) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - owned by the child
        with out:
            self.processes.append(
                subprocess.Popen(
                    argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
                )
            )

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise ClusterError(f"{process.args[0]} exited ({process.returncode}): {self.log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(f"{what} within {timeout:.0f} s: {self.log_tail()}")

    def _node_idle(self) -> bool:
        result = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
        states = set(result.stdout.split())
        return result.returncode == 0 and bool(states) and states <= {"idle", "mixed", "allocated"}

    def log_tail(self, lines: int = 15) -> str:
        text = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out"):
            path = self.root / "log" / name
            if path.exists():
                text.append(f"--- {name}")
                text += path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)

    # -- client commands ----------------------------------------------------------------------------

    def run(
        self, argv: list[str], check: bool = True, timeout: float = 30, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv, env=self.env(env), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, args: list[str], env: Mapping[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once Slurm has forgotten the job)."""
        try:
            result = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        except subprocess.TimeoutExpired:  # slurmctld busy (a loaded machine): ask again later
            return {"JobState": "UNKNOWN"}
        if result.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for token in result.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "GONE")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = self.state(job_id)
        while state not in states:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"job {job_id} is {state}, not {sorted(states)}, after {timeout:.0f} s\n"
                    + self.job_summary(job_id)
                )
            time.sleep(0.1)
            state = self.state(job_id)
        return state

    def job_summary(self, job_id: str) -> str:
        return self.run(["scontrol", "show", "job", job_id], check=False).stdout + self.log_tail(8)


@contextlib.contextmanager
def running_cluster(root: Path) -> Iterator[Cluster]:
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
