"""Writes numbered lines to a file it keeps open for writing (not appending), like a metrics file."""

import sys
import time

out = open(sys.argv[1], "w")  # noqa: SIM115 - kept open on purpose
step = 0
while True:
    out.write(f"line {step}\n")
    out.flush()
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.05)
