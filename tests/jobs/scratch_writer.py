"""A job that keeps a file of its own open and appends each step's number to it, and prints the step:
the scratch data a containerised job writes in its container's file system."""

import sys
import time

with open(sys.argv[1], "a") as scratch:
    step = 0
    while True:
        scratch.write(f"{step}\n")
        scratch.flush()
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.1)
