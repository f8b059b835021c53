"""Holds MIB mebibytes of touched, incompressible memory, then counts: a job whose dump takes a while."""

import os
import sys
import time

mib = int(sys.argv[1])
block = os.urandom(1 << 20)
held = [bytearray(block) for _ in range(mib)]
print(f"holding {mib} MiB", flush=True)
step = 0
while True:
    held[step % mib][0] = step % 256
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.1)
