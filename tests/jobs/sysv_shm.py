"""A job holding SysV IPC objects, the state that lives in an IPC namespace (PostgreSQL attaches such a
segment): a shared-memory segment (shmget/shmat), a semaphore set and a message queue.

It fills the segment with a pattern and queues one message, prints the objects' ids, then every 0.3 s
bumps a counter kept in the segment and the semaphore's value and prints ``step N shm=… sem=… digest=…``
(the digest of the rest of the segment); after STEPS steps it takes the message back and prints it.
So a test sees each object's contents survive a checkpoint, a hibernation and a resume.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
IPC_NOWAIT = 0o4000
SETVAL, GETVAL = 16, 12
SIZE = 4 << 20

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


class Sembuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


class Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 64)]


def check(result: int, what: str) -> int:
    if result == -1:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    shm = check(libc.shmget(IPC_PRIVATE, SIZE, IPC_CREAT | 0o600), "shmget")
    address = libc.shmat(shm, None, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        sys.exit(f"shmat: {os.strerror(ctypes.get_errno())}")
    segment = (ctypes.c_ubyte * SIZE).from_address(address)
    ctypes.memmove(address, hashlib.sha256(b"torpor").digest() * (SIZE // 32), SIZE)
    counter = ctypes.c_uint64.from_address(address)
    sem = check(libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600), "semget")
    check(libc.semctl(sem, 0, SETVAL, ctypes.c_int(0)), "semctl SETVAL")
    queue = check(libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600), "msgget")
    check(libc.msgsnd(queue, ctypes.byref(Message(1, b"queued before")), 64, 0), "msgsnd")
    print(f"ids shm={shm} sem={sem} msg={queue}", flush=True)
    for step in range(1, steps + 1):
        counter.value = step
        check(libc.semop(sem, ctypes.byref(Sembuf(0, 1, 0)), 1), "semop")
        value = check(libc.semctl(sem, 0, GETVAL, ctypes.c_int(0)), "semctl GETVAL")
        digest = hashlib.sha256(bytes(segment)[8:]).hexdigest()[:16]
        print(f"step {step} shm={counter.value} sem={value} digest={digest}", flush=True)
        time.sleep(0.3)
    received = Message()
    check(libc.msgrcv(queue, ctypes.byref(received), 64, 0, IPC_NOWAIT), "msgrcv")
    print(f"message {received.mtext.decode()}", flush=True)


if __name__ == "__main__":
    main()
