"""The in-pod supervisor (``torpor pod -- CMD``): a pod's job hibernated instead of killed, continued
by the next pod of its identity on any node.

Where things are: a folder that every node sees (the store volume, ``--store``) holds one folder per
identity (:func:`torpor.policy.pod.identity`), and in it one *slot* per pod of that identity that
runs at once: ``slot-N/`` is a torpor state directory (records, the job's log, the cold tier of its
checkpoints), ``slot-N.lock`` is held (``flock``) by the pod that uses it, and ``slot-N.json`` says
which pod that is or was, and whether its job ended by itself. A pod holds its slot until it exits,
so two pods never run the same job: a pod whose slot is held waits (or, for an identity of
interchangeable pods, takes the next slot).

The supervisor starts the command as a torpor job, or continues the slot's job
(:func:`torpor.policy.pod.on_start`), and copies the job's new output to its own stdout (``kubectl
logs``). On SIGTERM it hibernates the job into the store (durable) and exits 0; a job that cannot be
hibernated is stopped the plain way, saying why. A job that exits by itself ends the identity: the
supervisor exits with its exit code and its checkpoints are deleted. With ``every_s`` it checkpoints
the job periodically (stretched to the overhead budget, :mod:`torpor.policy.periodic`), which is what a
pod killed without a grace period, or on a node that died, comes back from.

With an S3 cold tier (``s3_base``, the webhook's ``s3_url``) the checkpoint images of each slot go to a
prefix of its own (:func:`torpor.policy.pod.slot_cold_tier`), written into the slot's store
configuration on its first use; the store volume keeps the rest. A slot whose checkpoints were stored
elsewhere (the webhook's settings changed since) is refused, saying where they are, rather than
continued without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from torpor.adapters import kubeapi
from torpor.adapters.system import private, procfs
from torpor.core import carried
from torpor.core.engine import Engine, unsupervised
from torpor.core.podreport import Reporter
from torpor.core.records import Records
from torpor.core.recordtypes import LIVE_STATES, SUPERVISED_STATES, Job, JobState
from torpor.core.store import config as store_config
from torpor.errors import JobNotFound, TorporError, UsageError
from torpor.policy import periodic
from torpor.policy import pod as pod_policy
from torpor.policy.jobpolicy import DEFAULT_BUDGET
from torpor.settings import Settings

#: how many pods of one identity may run at once (each its own slot) when they are interchangeable
MAX_SLOTS = 64


@dataclass(frozen=True)
class PodInfo:
    """Which pod this is (from the downward API, through the environment the webhook sets)."""

    name: str = ""
    namespace: str = ""
    uid: str = ""
    node: str = ""
    #: what the job depends on (its image and volumes: torpor.policy.pod.needs); {} if not said
    needs: dict[str, Any] = field(default_factory=dict)
    #: the controller whose pod it is, ``KIND/NAME`` ("" for a bare pod)
    owner: str = ""
    #: its namespace's UID, as the webhook read it ("" where it could not)
    namespace_uid: str = ""

    @classmethod
    def from_environment(cls) -> PodInfo:
        env = os.environ
        return cls(
            env.get("TORPOR_POD_NAME") or socket.gethostname(),  # a pod's host name is its name
            env.get("TORPOR_POD_NAMESPACE", ""),
            env.get("TORPOR_POD_UID", ""),
            env.get("TORPOR_NODE_NAME", ""),
            _json_object(env.get("TORPOR_POD_NEEDS", "")),
            env.get("TORPOR_POD_OWNER", ""),
            env.get("TORPOR_POD_NAMESPACE_UID", ""),
        )

    def describe(self) -> str:
        where = f" on {self.node}" if self.node else ""
        return f"pod {self.name or '?'}{where}"


@dataclass(frozen=True)
class PodSpec:
    """What ``torpor pod`` was asked to do."""

    store: Path
    identity: str
    command: list[str]
    job: str = "main"
    #: pods of this identity are interchangeable (a Deployment's replicas): take any free slot
    interchangeable: bool = False
    every_s: float | None = None
    lazy: bool = False
    pod: PodInfo = PodInfo()
    #: the S3 cold tier each slot has a prefix of, ``s3://BUCKET[/PREFIX]``; None: the slot's folder
    s3_base: str | None = None
    #: the key that encrypts the S3 cold tier's images, used where the file exists (the namespace's
    #: Secret may have none)
    s3_key_file: Path | None = None
    #: the environment the job starts in (None: the supervisor's own)
    job_env: dict[str, str] | None = None


def identity_dir(store: Path, identity: str) -> Path:
    """The identity's folder in the pod's store, which is its namespace's own (the webhook mounts the
    namespace's folder of the volume, or the namespace's claim): ``NAME[/...]`` below it. ``UsageError``
    for an identity that is not ``NAMESPACE/NAME[/...]`` of plain names (it is made by
    :func:`torpor.policy.pod.identity`, or typed by a user)."""
    parts = identity.split("/")
    if len(parts) < 2 or any(part in ("", ".", "..") or part.startswith(".") for part in parts):
        raise UsageError(f"identity '{identity}' must be NAMESPACE/NAME[/...] of plain names")
    return store.joinpath(*parts[1:])


class Slot:
    """One slot of an identity, held by this process while it is open."""

    def __init__(self, folder: Path, n: int, fd: int) -> None:
        self.n = n
        self.home = folder / pod_policy.slot_name(n)
        self.info_path = folder / f"{pod_policy.slot_name(n)}.json"
        self._fd = fd
        self._mine: dict[str, Any] = {}

    @classmethod
    @contextlib.contextmanager
    def take(
        cls,
        folder: Path,
        interchangeable: bool,
        say: Callable[[str], None],
        deleting: Callable[[dict[str, Any]], bool] = lambda _: False,
    ) -> Iterator[Slot]:
        """Hold a slot of the identity in ``folder``: for interchangeable pods the one
        :func:`torpor.policy.pod.choose_slot` picks, else slot 0, waiting for the pod that holds it to
        end (saying so). ``deleting(holder)``: whether the pod a slot's file names is being deleted
        (Kubernetes has not yet told it to stop, or it has not yet said it hibernates)."""
        private.make_private_dirs(folder)
        if interchangeable:
            fd, n = _take_interchangeable(folder, say, deleting)
        else:
            fd, n = _take_only(folder, say)
        try:
            yield cls(folder, n, fd)
        finally:
            os.close(fd)

    def previous(self) -> dict[str, Any]:
        """What the pod that last held this slot wrote of itself ({} if none)."""
        return read_json(self.info_path)

    def record(self, pod: PodInfo, **fields: Any) -> None:
        """Say in the slot's file that ``pod`` holds it, with ``fields`` and those of earlier calls."""
        self._mine.update(fields)
        data = {
            "pod": pod.describe(),
            "name": pod.name,
            "uid": pod.uid,
            "node": pod.node,
            "owner": pod.owner,
            **self._mine,
        }
        tmp = self.info_path.with_suffix(".tmp")
        private.write_private(tmp, json.dumps(data).encode())
        os.replace(tmp, self.info_path)


def _lock(folder: Path, n: int) -> int:
    return private.open_private(folder / f"{pod_policy.slot_name(n)}.lock", os.O_RDWR | os.O_CREAT)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take_only(folder: Path, say: Callable[[str], None]) -> tuple[int, int]:
    fd = _lock(folder, 0)
    if not _try_lock(fd):
        holder = read_json(folder / f"{pod_policy.slot_name(0)}.json")
        say(f"waiting for {holder.get('pod', 'another pod')} to let go of this identity")
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, 0


def _take_interchangeable(
    folder: Path, say: Callable[[str], None], deleting: Callable[[dict[str, Any]], bool]
) -> tuple[int, int]:
    while True:
        free: dict[int, int] = {}  # the free slots' locks, held while we look
        views = []
        try:
            for lock in folder.glob("slot-*.lock"):
                number = lock.stem.removeprefix("slot-")
                if not number.isdigit() or int(number) >= MAX_SLOTS:
                    continue
                n, fd = int(number), _lock(folder, int(number))
                if _try_lock(fd):
                    free[n] = fd
                else:
                    os.close(fd)
                info = read_json(folder / f"{pod_policy.slot_name(n)}.json")
                held = n not in free
                stopping = held and ("stopping_at" in info or deleting(info))
                views.append(pod_policy.SlotView(n, not held, bool(info) and "ended" not in info, stopping))
            choice = pod_policy.choose_slot(views)
            if choice.n >= MAX_SLOTS:
                raise UsageError(f"all {MAX_SLOTS} slots of this identity are held by running pods")
            if choice.n in free:
                return free.pop(choice.n), choice.n
            fd = _lock(folder, choice.n)
            if choice.wait:
                holder = read_json(folder / f"{pod_policy.slot_name(choice.n)}.json")
                say(f"waiting for {holder.get('pod', 'another pod')} to hibernate its job, to continue it")
                for other in free.values():  # not kept from other pods while we wait
                    os.close(other)
                free.clear()
                fcntl.flock(fd, fcntl.LOCK_EX)
                return fd, choice.n
            if _try_lock(fd):  # a new slot
                return fd, choice.n
            os.close(fd)  # another pod made it just now: look again
        finally:
            for fd in free.values():
                os.close(fd)


def end_processes(engine: Engine, name: str, previous: dict[str, Any], say: Callable[[str], None]) -> None:
    """Make sure nothing of job ``name`` runs any more, its slot being held by the caller.

    The pod that ran it (``previous``: what it wrote of itself) is gone. Its processes went with it,
    and the pids the record names are someone else's here: another machine, another boot, or another
    PID namespace (another container, even on this node). The record is marked failed without them.
    Only where the caller sees the same PID namespace on the same boot (outside containers) can they
    have outlived their supervisor: they are stopped."""
    job = engine.records.job(name)
    if previous.get("where") != _here():
        if job.state in SUPERVISED_STATES or job.pid is not None:
            why = f"its {previous.get('pod', 'pod')} went away"
            engine.records.set_fields(job.name, pid=None, pid_ticks=None, launcher_pid=None, message=why)
            if job.state in SUPERVISED_STATES:
                engine.records.transition(job.name, {job.state}, JobState.FAILED)
        return
    job = engine.reconcile(job)
    if job.state in LIVE_STATES or unsupervised(job):
        say(f"stopping what is left of the job of {previous.get('pod', 'the previous pod')}")
        engine.stop(job.name)


def _has_checkpoints(home: Path) -> bool:
    """Whether the state directory ``home`` has a checkpoint of any job."""
    if not (home / "torpor.db").is_file():
        return False
    records = Records(home / "torpor.db")
    return any(records.checkpoints(job.name) for job in records.jobs())


def read_json(path: Path) -> dict[str, Any]:
    try:
        return _json_object(path.read_text())
    except OSError:
        return {}


def _json_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class Supervisor:
    """Runs one pod's job through its life (see the module's docstring)."""

    def __init__(
        self,
        spec: PodSpec,
        settings: Settings,
        out: IO[bytes] | None = None,
        api: kubeapi.KubeAPI | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.out = out if out is not None else sys.stdout.buffer
        self.report = Reporter(spec.pod.namespace, spec.pod.name, spec.pod.uid, api, self.say)
        self.stopping = threading.Event()
        self._done = threading.Event()
        self._tried_at: float | None = None

    def say(self, text: str) -> None:
        print(f"torpor pod: {text}", file=sys.stderr, flush=True)

    def tell(self, reason: str, text: str, warning: bool = False) -> None:
        """Say ``text``, and make it an event on the pod."""
        self.say(text)
        self.report.event(reason, text, warning)

    def request_stop(self, *_: object) -> None:
        self.stopping.set()

    def run(self) -> int:
        """Start or continue the job, supervise it, and return the pod's exit code."""
        folder = identity_dir(self.spec.store, self.spec.identity)
        taken = Slot.take(
            folder, self.spec.interchangeable, lambda text: self.tell("Waiting", text), self.report.deleting
        )
        with taken as slot:
            settings = self._slot_settings(slot)
            previous = slot.previous()
            ours = self.spec.pod.namespace_uid
            if pod_policy.remade_namespace(previous.get("namespace_uid"), ours):
                previous = {**previous, "remade_namespace": True}
            namespace_uid = ours or previous.get("namespace_uid") or ""  # unknown here: kept as it was
            slot.record(
                self.spec.pod,
                started_at=time.time(),
                where=_here(),
                needs=self.spec.pod.needs,
                namespace_uid=namespace_uid,
            )
            engine = Engine(settings)
            offset = self._start(engine, slot, previous)
            follower = threading.Thread(target=self._follow, args=(engine, offset), daemon=True)
            follower.start()
            try:
                return self._supervise(engine, slot)
            finally:
                self._done.set()
                follower.join(timeout=5)

    # -- starting ----------------------------------------------------------------------------------------

    def _slot_settings(self, slot: Slot) -> Settings:
        """The settings of the slot's state directory: with an S3 cold tier, the slot's own prefix of it
        (and the key, where the pod has one), checked against what the slot's checkpoints were stored
        with."""
        settings = replace(self.settings, home=slot.home)
        if self.spec.s3_base is None:
            return settings
        try:
            url = pod_policy.slot_cold_tier(self.spec.s3_base, self.spec.identity, slot.n)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        store_env = {**settings.store_env, "TORPOR_STORE": url}
        key = self.spec.s3_key_file
        if key is not None and key.exists():
            store_env["TORPOR_KEY_FILE"] = str(key)
        settings = replace(settings, store_env=store_env)
        self._check_store(settings, slot)
        return settings

    def _check_store(self, settings: Settings, slot: Slot) -> None:
        """Refuse, saying why, a slot whose checkpoints this pod could not read: they were stored with
        another cold tier, endpoint or key than this pod's (the webhook's S3 settings or the Secret
        changed since), or with a key file this pod does not have. A slot without checkpoints has
        nothing to lose: its store configuration becomes this pod's."""
        home = settings.home
        current = store_config.load(home)
        if current is None:  # the slot's first use: the engine writes it from store_env
            return
        differences = store_config.disagreements(current, settings.store_env, home)
        if differences and not _has_checkpoints(home):
            store_config.save(home, current.replace(**store_config.from_variables(settings.store_env, home)))
            return
        what = f"the checkpoints of {pod_policy.slot_name(slot.n)} of {self.spec.identity}"
        for differs in differences:
            fix = differs.fix.replace("torpor ", f"torpor --home {home} ", 1)
            self._refuse(
                f"{what} were stored with {differs.configured} ({differs.file}), but this pod has "
                f"{differs.variable}={differs.given} (the webhook's settings or the Secret changed?): "
                f"put the setting back, or move the checkpoints and run '{fix}'"
            )
        if current.key_file is not None and not current.key_file.exists():
            self._refuse(
                f"{what} are encrypted with the key file {current.key_file}, which this pod does not "
                "have (the Secret's 'key' is gone?): put the key back"
            )

    def _refuse(self, text: str) -> None:
        self.report.event("StoreRefused", text, warning=True)
        raise UsageError(text)

    def _start(self, engine: Engine, slot: Slot, previous: dict[str, Any]) -> int:
        """Start or continue the slot's job; returns the offset of its log to copy from."""
        name = self.spec.job
        try:
            job = engine.records.job(name)
        except JobNotFound:
            job = None
        checkpoint = engine.records.latest_checkpoint(job.name) if job is not None else None
        action = pod_policy.on_start(
            None if job is None else str(job.state), checkpoint is not None, "ended" in previous
        )
        if job is not None and action != pod_policy.Start.RESUME:
            self._end_previous(engine, previous)
        if action != pod_policy.Start.COLD and previous.get("remade_namespace"):
            self.tell(
                "StartedCold",
                "not restoring the job of the slot: its checkpoints are of an earlier namespace of this "
                "name, deleted since (its UID differs); they are removed, and the command starts cold",
                warning=True,
            )
            action = pod_policy.Start.COLD
        differs = pod_policy.mismatch(previous.get("needs") or {}, self.spec.pod.needs)
        if action != pod_policy.Start.COLD and differs is not None:
            self.tell(
                "StartedCold",
                f"not restoring the job of {previous.get('pod', 'the previous pod')}: {differs}; starting cold",
                warning=True,
            )
            action = pod_policy.Start.COLD
        if action != pod_policy.Start.COLD and checkpoint is not None:
            age = time.time() - checkpoint.created_at
            taken = f" taken on {previous['node']}" if previous.get("node") else ""
            try:
                offset = self._log_size(engine)
                # the files it writes in its pod's own file systems, as it left them (a new node has none)
                carried.put_back(slot.home, engine.settings.job_dir(name), checkpoint.id, self.say)
                engine.restore(name, lazy=self.spec.lazy, progress=self.say, warn=self.say)
                how = "resumed its hibernated job" if action == pod_policy.Start.RESUME else "recovered"
                self.tell("Restored", f"{how}: restored from {checkpoint.id}{taken} {_ago(age)} ago")
                return offset
            except TorporError as exc:
                self.tell(
                    "StartedCold",
                    f"cannot restore {checkpoint.id}: {exc.message}; starting the command cold",
                    warning=True,
                )
        if job is not None:
            engine.remove(name)
            if "ended" in previous:
                self.say("the job ended in an earlier pod: starting the command cold")
        engine.run(name, self.spec.command, os.getcwd(), env=self.spec.job_env)
        return 0

    def _end_previous(self, engine: Engine, previous: dict[str, Any]) -> None:
        end_processes(engine, self.spec.job, previous, self.say)

    def _log_size(self, engine: Engine) -> int:
        try:
            return engine.log_path(self.spec.job).stat().st_size
        except (OSError, TorporError):
            return 0

    # -- supervising ------------------------------------------------------------------------------------

    def _supervise(self, engine: Engine, slot: Slot) -> int:
        name = self.spec.job
        while True:
            if self.stopping.wait(0.2):
                return self._hibernate(engine, slot)
            job = engine.reconcile(engine.records.job(name))
            if job.state not in SUPERVISED_STATES:
                return self._ended(engine, slot, job)
            if self.spec.every_s and job.state == JobState.RUNNING:
                self._maybe_checkpoint(engine, job.started_at or job.created_at)

    def _ended(self, engine: Engine, slot: Slot, job: Job) -> int:
        """The job exited by itself: that ends the identity (its checkpoints go, the next pod starts
        cold), and the pod exits with the job's code."""
        code = job.exit_code if job.exit_code is not None else 1
        self.say(f"the job ended by itself (exit code {code}{_because(job.message)})")
        slot.record(self.spec.pod, ended=code, ended_at=time.time())
        engine.remove(job.name)
        return code

    def _maybe_checkpoint(self, engine: Engine, running_since: float) -> None:
        assert self.spec.every_s
        checkpoints = engine.records.checkpoints(self.spec.job)
        # a checkpoint that failed is tried again an interval later, not at once
        tried = [t for t in (checkpoints[-1].created_at if checkpoints else None, self._tried_at) if t]
        freezes = [c.freeze_s for c in checkpoints]
        due = periodic.next_due(
            self.spec.every_s, DEFAULT_BUDGET, freezes, max(tried, default=None), running_since
        )
        if time.time() < due:
            return
        self._tried_at = time.time()
        try:
            checkpoint = engine.checkpoint(self.spec.job, warn=self.say)
            self.say(f"periodic checkpoint {checkpoint.id}: frozen {checkpoint.freeze_s:.3f} s")
            self.report.checkpointed(checkpoint.created_at)
        except TorporError as exc:
            self.say(f"periodic checkpoint failed: {exc.message}")

    def _hibernate(self, engine: Engine, slot: Slot) -> int:
        name = self.spec.job
        job = engine.reconcile(engine.records.job(name))
        deadline = time.monotonic() + 30
        while job.state in LIVE_STATES - {JobState.RUNNING} and time.monotonic() < deadline:
            time.sleep(0.1)  # starting, or a periodic checkpoint: let it settle
            job = engine.reconcile(engine.records.job(name))
        if job.state not in SUPERVISED_STATES:  # it ended by itself just now
            return self._ended(engine, slot, job)
        if job.state != JobState.RUNNING:
            self.say(f"asked to stop; the job is still {job.state}")
            return pod_policy.STOPPED_EXIT
        self.say("asked to stop: hibernating the job")
        slot.record(self.spec.pod, stopping_at=time.time())  # a replacement waits for it, to continue it
        try:
            checkpoint = engine.checkpoint(name, hibernate=True, progress=self.say, warn=self.say)
            engine.wait_durable(checkpoint.id, progress=self.say)
        except TorporError as exc:
            self.tell(
                "HibernateFailed",
                f"cannot hibernate the job, stopping it instead: {exc.message}",
                warning=True,
            )
            for line in exc.details:
                self.say(f"  {line}")
            with contextlib.suppress(TorporError):
                engine.stop(name)
            return pod_policy.STOPPED_EXIT
        try:  # what it wrote in this pod's own file systems would not be on the next pod's node
            carried.keep(slot.home, engine.settings.job_dir(name), checkpoint.id, self.spec.store, self.say)
        except OSError as exc:
            self.tell(
                "FilesNotKept", f"the files the job writes in this pod were not kept: {exc}", warning=True
            )
        slot.record(self.spec.pod, hibernated=checkpoint.id, hibernated_at=time.time())
        self.tell(
            "Hibernated",
            f"hibernated by torpor: checkpoint {checkpoint.id}, frozen {checkpoint.freeze_s:.3f} s, "
            f"{checkpoint.size_bytes / 2**20:.0f} MiB",
        )
        self.report.checkpointed(checkpoint.created_at)
        return pod_policy.exit_after_hibernation(self.spec.pod.owner)

    def _follow(self, engine: Engine, offset: int) -> None:
        """Copy the job's output from ``offset`` to our stdout while we run."""
        try:
            handle = open(engine.log_path(self.spec.job), "rb")  # noqa: SIM115 - kept open while following
        except (OSError, TorporError):
            return
        with handle:
            handle.seek(offset)
            while True:
                done = self._done.is_set()  # before the read: what was written until then is copied
                chunk = handle.read(1 << 16)
                if chunk:
                    with contextlib.suppress(OSError):
                        self.out.write(chunk)
                        self.out.flush()
                elif done:
                    return
                else:
                    time.sleep(0.1)


def _here() -> str:
    """Where pids mean what they say: this boot of this machine, and this PID namespace."""
    return f"{procfs.boot_id()} {procfs.own_pid_namespace()}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _because(message: str | None) -> str:
    return f": {message}" if message else ""


def install_signal_handlers(supervisor: Supervisor) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.request_stop)
