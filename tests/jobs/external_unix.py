"""A job connected to a unix socket outside its tree: CRIU refuses to dump it (a real dump failure)."""

import socket
import sys
import time

conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[1])
step = 0
while True:
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.1)
