"""What every storage backend adapter shares: the rule for object names.

The store names its objects like ``packs/ab/ab12…``; each backend (a folder in :mod:`.folder`, a bucket in
:mod:`.s3`) maps a name onto its own namespace and must refuse one that could escape it. The rule lives
here, once, so that both adapters import it without importing each other; the backend contract itself
(the ``Backend`` protocol) is the store's, in :mod:`torpor.core.store.backend`.
"""

from __future__ import annotations


def check_name(name: str) -> str:
    """Object names are relative paths of plain parts: nothing a backend could escape its root with."""
    parts = name.split("/")
    if not name or any(not part or part in (".", "..") or part.startswith(".") for part in parts):
        raise ValueError(f"bad object name {name!r}")
    return name
