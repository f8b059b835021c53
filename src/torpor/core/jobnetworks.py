"""A job's network of its own (``--own-network``): its address, its namespace, kept as long as the job is.

A copy of a server started with ``--own-network`` runs in a network namespace of its own, with an
address on torpor's bridge (:mod:`torpor.adapters.jobnet`). Its address is picked
(:func:`torpor.policy.addresses.pick_address`) among those no job network on the machine has, one
pick at a time (a lock file of the state directory, and the namespaces themselves say which are
taken, whatever state directory made them), and noted in the job's origin. The namespace lives as long as
the job is on record: a hibernated job comes back into it, and after a reboot it is made again with
the same address; ``torpor rm`` removes it.

CRIU sees it so: a job restored from an image saved in the machine's network joins the namespace
(``--join-ns``); a job that lives in it is dumped with the namespace external to its image
(``--external net[INODE]:KEY``, :func:`dump_options`) and restored with it handed over as a descriptor
(``--inherit-fd fd[N]:KEY``: :data:`NET_KEY`).
"""

from __future__ import annotations

import contextlib
import hashlib
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from torpor.adapters import jobnet
from torpor.adapters.system import private, procfs
from torpor.errors import EnvironmentProblem, UsageError
from torpor.policy import addresses
from torpor.settings import Settings

#: the key CRIU names a job's network namespace by in its images (``--external net[INODE]:KEY``)
NET_KEY = "torpor-net"


def dump_options(pid: int) -> tuple[str, ...]:
    """The ``criu dump`` options for the tree rooted at ``pid``: its network namespace external to the
    image when it is not this process's own (a job network), nothing otherwise."""
    theirs, ours = procfs.net_namespace_inode(pid), procfs.net_namespace_inode("self")
    if theirs is None or theirs == ours:
        return ()
    return ("--external", f"net[{theirs}]:{NET_KEY}")


class Networks:
    """The job networks of one state directory, on the bridge its settings name."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # the namespaces of this state directory's jobs are named after it, so two never share a name
        home = hashlib.sha256(str(settings.home).encode()).hexdigest()[:6]
        try:
            subnet = IPv4Network(settings.net_subnet)
        except ValueError as exc:
            raise UsageError(f"TORPOR_SUBNET {settings.net_subnet!r} is not an IPv4 network: {exc}") from None
        self.bridge = jobnet.Bridge(settings.net_bridge, subnet, prefix=f"torpor-{home}-")
        #: every state directory's job networks on the machine (they share the bridge and its addresses)
        self.everyone = jobnet.Bridge(settings.net_bridge, subnet, prefix="torpor-")

    def path(self, job: str) -> Path:
        return jobnet.netns_path(jobnet.netns_name(self.bridge, job))

    def create(self, job: str) -> tuple[Path, IPv4Address]:
        """A new network for ``job``: its namespace's path and its address."""
        with self._one_at_a_time():
            jobnet.ensure_bridge(self.bridge)
            taken = {n.address for n in jobnet.job_networks(self.everyone) if n.address is not None}
            address = addresses.pick_address(self.bridge.subnet, taken)
            if address is None:
                raise EnvironmentProblem(addresses.full_reason(self.bridge.subnet))
            network = jobnet.create(self.bridge, job, address)
        return network.path, address

    def ensure(self, job: str, address: str) -> Path:
        """``job``'s network, made again with its ``address`` if it is gone (the machine restarted)."""
        path = self.path(job)
        if path.exists():
            return path
        with self._one_at_a_time():
            jobnet.ensure_bridge(self.bridge)
            if not path.exists():
                jobnet.create(self.bridge, job, IPv4Address(address))
        return path

    def remove(self, job: str) -> None:
        jobnet.remove(jobnet.netns_name(self.bridge, job))

    def _one_at_a_time(self) -> contextlib.AbstractContextManager[None]:
        return private.locked(self.settings.home / "networks.lock")
