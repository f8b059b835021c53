"""A server on 0.0.0.0:PORT (as a model server on port 8000): it answers each connection with how many it
has answered so far and the network namespace it lives in (``net:[INODE]``), then hangs up.

The count lives in its memory, so a restored server that goes on counting is the one that was saved.
"""

import os
import socket
import sys

server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen(8)
print("listening", flush=True)
answered = 0
while True:
    client, _ = server.accept()
    answered += 1
    client.sendall(f"{answered} {os.readlink('/proc/self/ns/net')}\n".encode())
    client.close()
