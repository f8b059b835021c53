"""A job serving a unix socket (as PostgreSQL or a tmux server do): it echoes what each client sends.

The echo goes through a child process over a socket pair, a unix connection inside the job that a
restore must keep. It prints "accepted" for each new client, "client gone" when one hangs up (what a
job restored with --ext-unix-sk sees of a client connected at its checkpoint), and a step every 0.1 s.
"""

import os
import select
import socket
import sys

ours, helpers = socket.socketpair()
if os.fork() == 0:
    ours.close()
    while data := helpers.recv(100):
        helpers.sendall(b"echo " + data)
    os._exit(0)
helpers.close()

server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(4)
clients: list[socket.socket] = []
step = 0
while True:
    for ready in select.select([server, *clients], [], [], 0.1)[0]:
        if ready is server:
            clients.append(server.accept()[0])
            print("accepted", flush=True)
            continue
        data = ready.recv(100)
        if data:
            ours.sendall(data)
            ready.sendall(ours.recv(200))
        else:
            print("client gone", flush=True)
            clients.remove(ready)
            ready.close()
    print(f"step {step} clients {len(clients)}", flush=True)
    step += 1
