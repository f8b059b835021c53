"""Job names: the one a user gives is checked, the one torpor picks is read from the command.

Pure functions of strings; looking up which names are taken is the caller's (the records).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from torpor.core.recordtypes import JobName
from torpor.errors import UsageError

#: programs that run a script: the job is named after the script, not the interpreter
_INTERPRETERS = (
    "python",
    "python3",
    "bash",
    "sh",
    "node",
    "ruby",
    "perl",
    "Rscript",
    "julia",
    "uv",
    "torchrun",
)


def name_from_command(command: list[str]) -> str:
    """``python -u train.py`` → ``train``; ``./serve`` → ``serve``."""
    program = Path(command[0]).name
    if program.rstrip("0123456789.") in _INTERPRETERS:
        for arg in command[1:]:
            if not arg.startswith("-"):
                return Path(arg).stem or program
    return program


def free_name(base: str, taken: Collection[str]) -> str:
    """``base`` made a valid name, with ``-2``, ``-3``… appended until no job in ``taken`` has it."""
    base = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in base).strip(".-") or "job"
    if base not in taken:
        return base
    n = 2
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


def check_name(name: str, what: str = "job") -> JobName:
    """``name`` as a job name (or a peer's, a template's: ``what``); UsageError unless it is 1-64 letters,
    digits, '-', '_' or '.'."""
    if not name or len(name) > 64 or not all(ch.isalnum() or ch in "-_." for ch in name) or name[0] in ".-":
        raise UsageError(
            f"bad {what} name {name!r}: use up to 64 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )
    return JobName(name)
