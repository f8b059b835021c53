"""A job whose start-up takes a while, as a model server's or a trainer's does (loading, building its
tables): it computes START_S seconds' worth of tables (up to 128 MiB, kept), says ``ready``, then works
in steps of 0.1 s.

usage: slow_start.py START_S
"""

import hashlib
import signal
import sys
import time

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

start_s = float(sys.argv[1])
began = time.monotonic()
tables = []
digest = b"torpor"
while time.monotonic() - began < start_s:
    for _ in range(2000):
        digest = hashlib.sha256(digest).digest()
    if len(tables) < 128:
        tables.append(digest * (1 << 15))  # 1 MiB
print(f"ready after {time.monotonic() - began:.1f} s", flush=True)
step = 0
while True:
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.1)
