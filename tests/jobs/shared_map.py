"""Counts steps in its memory and in a file it maps MAP_SHARED (its first 4 bytes): ``shared_map.py FILE``.

The count lives in the file's first byte (the page cache), not in the process's own memory: CRIU does
not copy such pages into the image (they are the file's), so a restore sees the file as it is then.
"""

import mmap
import sys
import time

path = sys.argv[1]
with open(path, "r+b") as handle:
    mapped = mmap.mmap(handle.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
step = 0  # in the process's own memory, which CRIU does copy
while True:
    step += 1
    count = int.from_bytes(mapped[:4], "little") + 1  # the same count, kept in the file
    mapped[:4] = count.to_bytes(4, "little")
    print(f"step {step} file {count}", flush=True)
    time.sleep(0.05)
