"""Grows to TARGET MiB in steps of STEP MiB every PAUSE seconds, holds it HOLD seconds, then prints the
BLAKE2b digest of everything it allocated and exits 0: a job whose output says whether it lost any memory.

Every block is deterministic (``grower.block(i)``), so a test computes the expected digest itself.
"""

import hashlib
import sys
import time


def block(index: int) -> bytes:
    """1 MiB that differs for every index and does not compress (SHAKE-128 of the index, ~4 ms)."""
    return hashlib.shake_128(index.to_bytes(8, "little")).digest(1 << 20)


def expected(target_mib: int) -> str:
    digest = hashlib.blake2b()
    for index in range(target_mib):
        digest.update(block(index))
    return digest.hexdigest()


def main() -> None:
    target, step, pause, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    held: list[bytearray] = []
    print(f"growing to {target} MiB", flush=True)
    while len(held) < target:
        for _ in range(min(step, target - len(held))):
            held.append(bytearray(block(len(held))))
        print(f"holding {len(held)} MiB", flush=True)
        time.sleep(pause)
    time.sleep(hold)
    digest = hashlib.blake2b()
    for chunk in held:
        digest.update(chunk)
    print(f"done {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
