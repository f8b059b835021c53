"""Benchmark workload: hold N bytes of random (incompressible, touched) memory and idle.

Run by ``scripts/bench.py`` both as a torpor job and as a plain process in its own PID namespace, so
torpor and raw CRIU dump the same kind of process. Prints ``ready`` once the memory is filled.
"""

from __future__ import annotations

import sys
import time

import numpy as np

CHUNK = 64 << 20


def main() -> int:
    size = int(sys.argv[1])
    memory = np.empty(size // 8, dtype=np.uint64)
    rng = np.random.default_rng(0)
    step = CHUNK // 8
    for start in range(0, len(memory), step):
        end = min(start + step, len(memory))
        memory[start:end] = rng.integers(0, 2**63, size=end - start, dtype=np.uint64)
    print(f"ready: {memory.nbytes} bytes of random memory", flush=True)
    beat = 0
    while True:
        time.sleep(1)
        beat += 1
        if beat % 60 == 0:
            print(f"alive {beat} s; checksum word {int(memory[beat % len(memory)])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
