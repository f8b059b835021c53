"""A process holding an io_uring instance, as libuv's (PyTorch's TCPStore) does: CRIU cannot dump it.

usage: io_uring_job.py fd|mapped — ``fd`` keeps the ring's descriptor open; ``mapped`` maps its submission
ring and closes the descriptor (the ring lives on in the mapping). Then it counts, one line a tick.
"""

import ctypes
import mmap
import os
import struct
import sys
import time

IO_URING_SETUP = 425  # x86-64
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params
fd = libc.syscall(IO_URING_SETUP, 4, params)
if fd < 0:
    sys.exit(f"io_uring_setup: {os.strerror(ctypes.get_errno())}")
if sys.argv[1] == "mapped":
    sq_entries = struct.unpack_from("I", params, 0)[0]
    array = struct.unpack_from("I", params, 40 + 6 * 4)[0]  # sq_off.array
    ring = mmap.mmap(fd, array + sq_entries * 4, mmap.MAP_SHARED, offset=0)
    os.close(fd)
print(f"ready {os.readlink(f'/proc/self/fd/{fd}') if sys.argv[1] == 'fd' else 'mapped'}", flush=True)
tick = 0
while True:
    print(f"tick {tick}", flush=True)
    tick += 1
    time.sleep(0.05)
