"""A job that prints a counter; with an argument N it exits with status N after a few steps."""

import sys
import time

exit_after = int(sys.argv[1]) if len(sys.argv) > 1 else None
step = 0
while True:
    print(f"step {step}", flush=True)
    step += 1
    if exit_after is not None and step >= 5:
        sys.exit(exit_after)
    time.sleep(0.1)
