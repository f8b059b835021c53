"""Holds a TCP connection to 127.0.0.1:PORT and counts: ``tcp_client.py PORT``."""

import socket
import sys
import time

conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.1)
