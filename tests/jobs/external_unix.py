"""A job connected to a unix socket outside its tree: a dump without --ext-unix-sk fails on it.

It prints each message the outside end sends ("got ..."), and "peer closed" once that end is gone (what
a job restored with --ext-unix-sk sees), and a step every 0.1 s either way.
"""

import select
import socket
import sys

conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[1])
open_ = True
step = 0
while True:
    print(f"step {step}", flush=True)
    step += 1
    readable = select.select([conn] if open_ else [], [], [], 0.1)[0]
    if readable:
        data = conn.recv(100)
        if data:
            print(f"got {data.decode()}", flush=True)
        else:
            print("peer closed", flush=True)
            open_ = False
    elif not open_:
        select.select([], [], [], 0.1)
