"""A job with several threads, a child process, a file it keeps writing and a TCP connection.

The parent listens on loopback; a forked child connects and sends numbered messages which the parent
checks arrive in order and echoes back. Two threads count in memory. Every 0.1 s the parent appends a
status line to ``DATA_FILE`` (kept open for writing) and prints one to stdout. Any broken invariant
prints ``ERROR`` and exits 1, so a test can tell a faithful restore from a damaged one.
"""

import os
import socket
import sys
import threading
import time

data_path = sys.argv[1]
counters = [0, 0]


def count(index: int) -> None:
    while True:
        counters[index] += 1
        time.sleep(0.01)


server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.bind(("127.0.0.1", 0))
server.listen(1)
port = server.getsockname()[1]

child = os.fork()
if child == 0:
    server.close()
    conn = socket.create_connection(("127.0.0.1", port))
    n = 0
    while True:
        conn.sendall(f"{n}\n".encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                print("ERROR child: connection closed", flush=True)
                os._exit(1)
            reply += chunk
        if int(reply) != n:
            print(f"ERROR child: echo {reply!r} for {n}", flush=True)
            os._exit(1)
        n += 1
        time.sleep(0.02)

conn, _ = server.accept()
for i in range(2):
    threading.Thread(target=count, args=(i,), daemon=True).start()

data = open(data_path, "w")  # noqa: SIM115 - kept open on purpose: CRIU must carry it across
expected = 0
buffer = b""
tick = time.monotonic()
while True:
    chunk = conn.recv(64)
    if not chunk:
        print("ERROR parent: connection closed", flush=True)
        sys.exit(1)
    buffer += chunk
    while b"\n" in buffer:
        line, buffer = buffer.split(b"\n", 1)
        if int(line) != expected:
            print(f"ERROR parent: got {line!r}, expected {expected}", flush=True)
            sys.exit(1)
        conn.sendall(line + b"\n")
        expected += 1
    if time.monotonic() - tick > 0.1:
        tick = time.monotonic()
        status = f"messages {expected} threads {counters[0]} {counters[1]} child {child}"
        data.write(status + "\n")
        data.flush()
        print(status, flush=True)
