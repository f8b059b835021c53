"""Wake on connect: the agent holds a sleeping job's ports and resumes it at the first connection.

Each round, every job the agent hibernated for being idle, with ``--wake-on`` ports, gets a
:class:`~torpor.adapters.wake.PortHolder` on the addresses it listened on (recorded at hibernation). The
first connection resumes the job: the holder lets go of the ports (with nftables, a new connection in that
moment waits for its SYN's retransmission instead of being refused), the engine restores the job, and the
connections held meanwhile are relayed to it. A job resumed, removed or hibernated by someone else loses its
holder at the next round.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from torpor.adapters import wake
from torpor.core.recordtypes import Care, Job, JobName, JobState
from torpor.errors import TorporError

if TYPE_CHECKING:
    from torpor.apps.agent.service import Agent

log = logging.getLogger("torpor.agent")

#: how long the relay waits for the restored job to listen again
RELAY_TIMEOUT_S = 30.0


class WakeKeeper:
    """The holders of one agent; a round hook (:attr:`Agent.round_hooks`)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._holders: dict[JobName, wake.PortHolder] = {}
        #: holders whose job is back, kept until their relayed connections end
        self._retired: list[wake.PortHolder] = []
        #: why a job's ports could not be held (said once; tried again each round)
        self._failed: dict[JobName, str] = {}
        self._gate = shutil.which("nft") is not None
        for table in wake.remove_stale_gates():  # a killed agent's, from a wake under way
            log.info("removed a stale wake gate: nft table inet %s", table)

    def __call__(self, jobs: list[Job], cares: dict[JobName, Care]) -> None:
        draining = self.agent.draining() is not None
        wanted = {
            job.name: care
            for job in jobs
            if job.state == JobState.HIBERNATED
            and (care := cares.get(job.name)) is not None
            and care.hibernated_by == "idle"
            and care.policy.wake_on
            and not draining  # a draining node resumes nothing
        }
        with self._lock:
            gone = [name for name in self._holders if name not in wanted and not self.agent.is_busy(name)]
            stale = [self._holders.pop(name) for name in gone]
            self._retired = [h for h in self._retired if h.relaying or _close(h)]
            missing = [name for name in wanted if name not in self._holders]
        for holder in stale:
            holder.close()
        for name in missing:
            self._hold(name, wanted[name])

    def _hold(self, name: JobName, care: Care) -> None:
        addresses = care.listened or tuple(("127.0.0.1", port) for port in care.policy.wake_on)
        holder = wake.PortHolder(addresses, lambda: self._wake(name), gate=self._gate)
        try:
            holder.start()
        except TorporError as exc:
            # e.g. someone else took the port while the job slept: said once, tried again next round
            holder.close()
            if self._failed.get(name) != exc.message:
                self._failed[name] = exc.message
                self.agent.event(name, "wake", "cannot hold its ports", error=exc.message)
            return
        self._failed.pop(name, None)
        with self._lock:
            self._holders[name] = holder
        log.info("%s: holding %s while it sleeps", name, ", ".join(str(a) for a in holder.addresses))

    def _wake(self, name: JobName) -> None:
        """The first connection: resume ``name`` and relay what was held (in the holder's thread)."""
        with self._lock:
            holder = self._holders.get(name)
        if holder is None:
            return
        started = time.monotonic()

        def resume(_: JobName) -> dict[str, Any]:
            holder.release()
            try:
                job, checkpoint, seconds = self.agent.engine.restore(name)
            except TorporError:
                holder.close()  # the held clients see a closed connection, not a hang
                raise
            self.agent.records.mark_hibernated(name, None)
            report = holder.relay(RELAY_TIMEOUT_S)
            return {
                "checkpoint": checkpoint.id,
                "restore_s": seconds,
                "pid": job.pid,
                "relayed": report.relayed,
                "dropped": report.dropped,
                "wake_s": time.monotonic() - started,
            }

        where = ", ".join(str(a) for a in holder.addresses)
        if not self.agent.act_now(name, "resume", f"a connection on {where}", resume):
            holder.close()  # someone else works on the job (a person's resume): not ours to do
        with self._lock:
            if self._holders.get(name) is holder:
                del self._holders[name]
            self._retired.append(holder)

    def let_go(self, name: JobName) -> None:
        """Stop holding ``name``'s ports now: someone else restores it, and its sockets need them."""
        with self._lock:
            holder = self._holders.pop(name, None)
        if holder is not None:
            holder.close()

    def close(self) -> None:
        with self._lock:
            holders = [*self._holders.values(), *self._retired]
            self._holders, self._retired = {}, []
        for holder in holders:
            holder.close()


def _close(holder: wake.PortHolder) -> bool:
    holder.close()
    return False
