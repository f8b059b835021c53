"""Warm starts: which template a start may come from, and whether a template is still the program it was.

Two decisions, both pure:

* :func:`warm_key` — the template a ``torpor run --warm-start`` comes from is named after what makes
  the program the same program: its argv, its environment and its working directory. A change to any of
  them is another program, and starts cold (and saves its own template).
* :func:`stale_reasons` — a template remembers the files its processes had open or mapped (the
  interpreter, its shared libraries, the script, model files) as :class:`FileStamp` s; a start from it is
  stale when any of them is gone or changed (size, modification time, inode), and runs cold instead.

Reading the stamps of the files is :mod:`torpor.adapters.system.procfs`' and the engine's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: the prefix of the templates ``--warm-start`` saves by itself (the rest is :func:`warm_key`'s)
WARM_PREFIX = "warm-"


@dataclass(frozen=True)
class FileStamp:
    """What a file was when a template was saved: enough to tell it was replaced or rewritten since."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    def to_list(self) -> list[object]:
        return [self.path, self.size, self.mtime_ns, self.inode]

    @classmethod
    def from_list(cls, raw: Sequence[object]) -> FileStamp:
        path, size, mtime_ns, inode = raw
        return cls(str(path), int(str(size)), int(str(mtime_ns)), int(str(inode)))


def warm_key(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """A short, stable name for "this command, in this environment, in this folder"."""
    text = json.dumps([list(argv), sorted(env.items()), cwd], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def warm_template_name(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The name of the template ``torpor run --warm-start`` of this command saves and starts from."""
    return WARM_PREFIX + warm_key(argv, env, cwd)


def stale_reasons(saved: Sequence[FileStamp], now: Mapping[str, FileStamp | None]) -> list[str]:
    """Why a start from a template with files ``saved`` would not be the program it was, given ``now``
    (each saved path's stamp today; None: the file is gone). Empty: it is not stale."""
    reasons = []
    for old in saved:
        new = now.get(old.path)
        if new is None:
            reasons.append(f"{old.path} is gone")
        elif new.inode != old.inode:
            reasons.append(f"{old.path} was replaced")
        elif new.size != old.size:
            reasons.append(f"{old.path} changed size ({old.size} → {new.size} bytes)")
        elif new.mtime_ns != old.mtime_ns:
            reasons.append(f"{old.path} was modified")
    return reasons


def stale_summary(reasons: Sequence[str]) -> str:
    """One line for :func:`stale_reasons`' list: the first reason, and how many more."""
    if not reasons:
        return ""
    more = f" (and {len(reasons) - 1} more file(s))" if len(reasons) > 1 else ""
    return reasons[0] + more
