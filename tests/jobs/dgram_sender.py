"""A job that sends "msg N" every 0.1 s on a unix datagram socket connected to an outside address (as a
program logging to /dev/log does), and prints "sent N" or the error."""

import socket
import sys
import time

sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sender.connect(sys.argv[1])
count = 0
while True:
    try:
        sender.send(f"msg {count}".encode())
        print(f"sent {count}", flush=True)
    except OSError as exc:
        print(f"send failed: {exc}", flush=True)
    count += 1
    time.sleep(0.1)
