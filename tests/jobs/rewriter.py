"""Rewrites a count in place in a file it keeps open read-write, as a database does: ``rewriter.py FILE``.

The file keeps its size (8 bytes): a cut cannot undo what was written after a checkpoint, so a rollback
must say so.
"""

import os
import sys
import time

fd = os.open(sys.argv[1], os.O_RDWR)
step = 0
while True:
    step += 1
    os.pwrite(fd, step.to_bytes(8, "little"), 0)
    print(f"step {step}", flush=True)
    time.sleep(0.05)
