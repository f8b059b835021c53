"""Writes numbered lines to a file it keeps open, like a metrics file: ``writer.py FILE [MODE] [OPEN_AT]``.

MODE is the ``open`` mode: ``w`` (default), ``a`` (append, as logs and CSV files are written) or ``r+``
(read-write, the file must exist). The file is opened at step OPEN_AT (default 0); line N is written at
step N, so an uninterrupted run leaves exactly ``line OPEN_AT`` … ``line N`` after whatever it held before.
"""

import sys
import time

path = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "w"
open_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
out = None
step = 0
while True:
    if step == open_at:
        out = open(path, mode)  # noqa: SIM115 - kept open on purpose
    if out is not None:
        out.write(f"line {step}\n")
        out.flush()
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.05)
