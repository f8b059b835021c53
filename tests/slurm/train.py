"""A deterministic stand-in for a training job: each step mixes the step number into a running hash.

Prints ``step N <hash>`` per step and ``final <hash>`` at the end, so an interrupted-and-restored run can
be compared line for line with an uninterrupted one. Options: ``--steps``, ``--step-s`` (sleep per step),
``--memory-mb`` (resident memory it holds, filled with data derived from the seed), ``--startup-s`` (a
slow start, like loading a model) and ``--stamp`` (append the wall-clock time to each step line, for
benchmarks).
"""

from __future__ import annotations

import argparse
import hashlib
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--memory-mb", type=int, default=0)
    parser.add_argument("--startup-s", type=float, default=0.0)
    parser.add_argument("--stamp", action="store_true")
    args = parser.parse_args()

    block = hashlib.sha256(b"torpor").digest() * 32  # 1 KiB
    weights = bytearray(block * (args.memory_mb * 1024))
    for i in range(0, len(weights), 4096):
        weights[i] = i // 4096 % 251
    time.sleep(args.startup_s)  # "loading the model"
    state = hashlib.sha256(bytes(weights[:4096])).hexdigest()
    print(f"ready {state[:16]}", flush=True)
    for step in range(args.steps):
        digest = hashlib.sha256(f"{state}:{step}".encode())
        if weights:
            offset = (step * 4096) % len(weights)
            digest.update(bytes(weights[offset : offset + 4096]))
        state = digest.hexdigest()
        stamp = f" {time.time():.3f}" if args.stamp else ""
        print(f"step {step} {state[:16]}{stamp}", flush=True)
        time.sleep(args.step_s)
    print(f"final {state}", flush=True)


if __name__ == "__main__":
    main()
