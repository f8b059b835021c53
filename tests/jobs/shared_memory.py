"""A job whose processes share most of their memory: SHARED_MIB of a MAP_SHARED anonymous region and
PRIVATE_MIB of private memory touched before fork (copy-on-write), then CHILDREN forked children.

Usage: shared_memory.py SHARED_MIB PRIVATE_MIB CHILDREN. Prints "ready" once every child runs.
"""

import mmap
import os
import sys
import time

shared_mib, private_mib, children = (int(a) for a in sys.argv[1:4])
shared = mmap.mmap(-1, shared_mib << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
private = bytearray(private_mib << 20)
for offset in range(0, shared_mib << 20, 4096):
    shared[offset] = 1
for offset in range(0, private_mib << 20, 4096):
    private[offset] = 1
pids = []
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        while True:
            time.sleep(1)
    pids.append(pid)
print("ready", flush=True)
step = 0
while True:
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.5)
