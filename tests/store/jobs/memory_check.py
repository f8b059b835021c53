"""Holds MIB mebibytes of random memory and prints its digest every second: lost pages would show."""

import hashlib
import os
import sys
import time

memory = bytearray(os.urandom(int(sys.argv[1]) << 20))
while True:
    print(f"digest {hashlib.blake2b(memory).hexdigest()[:32]}", flush=True)
    time.sleep(1)
