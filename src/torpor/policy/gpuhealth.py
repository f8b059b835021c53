"""When a GPU's readings warrant moving its jobs off it, and when a reading is a spike that passes.

The agent reads each GPU through NVML every round (:mod:`torpor.adapters.nvml`) and keeps the last few
minutes of readings; :func:`judge` says, from those alone, whether the GPU is failing:

- it has fallen off the bus (NVML says the GPU is lost): at once;
- an XID the driver reports for failing hardware (:data:`HARDWARE_XIDS`: double-bit ECC, row remapping,
  NVLink, GSP, fallen off the bus…): at once. XIDs a program causes itself (13, 31, 43, 45: an illegal
  address, a page fault, a reset channel) are the program's, not the GPU's, and do not count;
- uncorrectable ECC errors counted since the first reading kept: at once;
- its temperature at or above its slowdown threshold in every reading for :data:`HOT_FOR_S`: a spike
  shorter than that is watched, not acted on.

What the agent does then (hibernate the jobs on that GPU into the durable tier) is the agent's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: XIDs that mean the GPU itself is failing (NVIDIA's XID catalogue): 48 double-bit ECC, 63/64 row
#: remapping, 74 NVLink, 79 fallen off the bus, 92 excessive single-bit ECC, 94/95 contained and
#: uncontained ECC, 119/120 GSP timeouts and errors, 140 ECC unrecovered
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
#: how long a GPU must stay at its slowdown temperature before its jobs are moved off it
HOT_FOR_S = 60.0
#: how much history the agent keeps per GPU
KEEP_S = 600.0


@dataclass(frozen=True)
class Reading:
    """One GPU read at ``at`` (epoch seconds); None: NVML could not tell (not supported by this GPU).

    ``xids``: the critical XID events since the reading before; ``ecc_uncorrected``: NVML's volatile
    count (since the driver loaded); ``lost``: the GPU has fallen off the bus."""

    uuid: str
    at: float
    temperature_c: float | None = None
    slowdown_c: float | None = None
    xids: tuple[int, ...] = ()
    ecc_uncorrected: int | None = None
    lost: bool = False


@dataclass(frozen=True)
class Verdict:
    """``evacuate``: move the GPU's jobs off it, because of ``reason``; else ``watching`` says what is
    being waited out (a hot spike), or None for a healthy GPU."""

    uuid: str
    evacuate: bool = False
    reason: str | None = None
    watching: str | None = None


def trim(readings: Sequence[Reading], now: float, keep_s: float = KEEP_S) -> list[Reading]:
    """The readings to keep: those of the last ``keep_s``."""
    return [reading for reading in readings if reading.at >= now - keep_s]


def judge(readings: Sequence[Reading], now: float, hot_for_s: float = HOT_FOR_S) -> Verdict:
    """Whether the GPU of ``readings`` (its own, oldest first, not empty) is failing at ``now``."""
    latest = readings[-1]
    uuid = latest.uuid
    if latest.lost:
        return Verdict(uuid, True, "the GPU has fallen off the bus")
    xids = [xid for reading in readings for xid in reading.xids if xid in HARDWARE_XIDS]
    if xids:
        return Verdict(uuid, True, f"XID {xids[-1]}: the driver reports failing hardware")
    counts = [r.ecc_uncorrected for r in readings if r.ecc_uncorrected is not None]
    if counts and counts[-1] > counts[0]:
        return Verdict(uuid, True, f"{counts[-1] - counts[0]} uncorrectable ECC error(s)")
    hot_since = _hot_since(readings)
    if hot_since is None:
        return Verdict(uuid)
    assert latest.temperature_c is not None and latest.slowdown_c is not None
    heat = f"{latest.temperature_c:.0f} °C, slowdown at {latest.slowdown_c:.0f} °C"
    if now - hot_since >= hot_for_s:
        return Verdict(uuid, True, f"hot for {now - hot_since:.0f} s ({heat})")
    return Verdict(uuid, watching=f"hot for {now - hot_since:.0f} s of {hot_for_s:.0f} s ({heat})")


def _hot_since(readings: Sequence[Reading]) -> float | None:
    """When the run of readings at or above the slowdown threshold that ends with the latest began."""
    since = None
    for reading in reversed(readings):
        if reading.temperature_c is None or reading.slowdown_c is None:
            break
        if reading.temperature_c < reading.slowdown_c:
            break
        since = reading.at
    return since
