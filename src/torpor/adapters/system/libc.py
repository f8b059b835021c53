"""The C library through ctypes, for the system calls Python 3.11 lacks, and their failures as OSError.

The other modules of :mod:`torpor.adapters.system` call it; nothing else does.
"""

from __future__ import annotations

import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
