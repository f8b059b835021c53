"""Benchmark workload: hold N bytes of random (incompressible, touched) memory and idle, or rewrite a
fraction of it every second.

``bench_memory.py BYTES [RATE]``. Run by ``scripts/bench.py`` both as a torpor job and as a plain
process in its own PID namespace, so torpor and raw CRIU dump the same kind of process. Prints ``ready``
once the memory is filled; then it ticks every 5 ms and prints ``gap S s`` for every tick that came more
than 20 ms late: how long a checkpoint froze it, as the job itself feels it (``scripts/bench_freeze.py``
and ``scripts/bench_migrate.py`` read these). With RATE (a fraction, ``0.01``: 1 % a second), each tick
also rewrites the next RATE × 5 ms of the memory, in order, wrapping around.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

CHUNK = 64 << 20
TICK_S = 0.005
GAP_S = 0.020


def main() -> int:
    size = int(sys.argv[1])
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    memory = np.empty(size // 8, dtype=np.uint64)
    rng = np.random.default_rng(0)
    step = CHUNK // 8
    for start in range(0, len(memory), step):
        end = min(start + step, len(memory))
        memory[start:end] = rng.integers(0, 2**63, size=end - start, dtype=np.uint64)
    print(f"ready: {memory.nbytes} bytes of random memory", flush=True)
    per_tick = int(len(memory) * rate * TICK_S)
    at = 0

    def rewrite() -> None:
        nonlocal at
        end = min(at + per_tick, len(memory))
        memory[at:end] += 1
        at = 0 if end == len(memory) else end

    tick(
        lambda: print(f"alive; checksum word {int(memory[int(time.time()) % len(memory)])}", flush=True),
        rewrite if per_tick else None,
    )
    return 0


def tick(beat: Callable[[], None] | None = None, work: Callable[[], None] | None = None) -> None:
    """Forever: every 5 ms, print how late a tick came when it was more than 20 ms late, after ``work``
    (if any); ``beat`` once a minute. (``scripts/bench_train.py serve --tick`` runs it in a thread.)

    Timed by the wall clock, not the monotonic one: ``criu restore`` puts a tree it restores into a new
    time namespace whose monotonic and boot-time clocks go on from the moment of the dump, so a gap
    measured by them leaves out the time between the dump and the restore (a copy to another node)."""
    last = beat_at = time.time()
    while True:
        time.sleep(TICK_S)
        if work is not None:
            work()
        now = time.time()
        if now - last > GAP_S:
            print(f"gap {now - last - TICK_S:.3f} s", flush=True)
        last = now
        if beat is not None and now - beat_at >= 60:
            beat_at = now
            beat()


if __name__ == "__main__":
    sys.exit(main())
