"""How a ``torchrun`` command is started so that it can be checkpointed: its TCPStore without libuv.

torchrun's agent hosts the rendezvous store (a c10d ``TCPStore``) on libuv, which opens an io_uring
instance, and CRIU cannot dump io_uring. PyTorch 2.13 has no switch for the agent's store: its rendezvous
backends construct ``TCPStore`` with the default, ``use_libuv=True``, and the ``USE_LIBUV`` environment
variable is read only by ``init_process_group``'s ``env://`` and ``tcp://`` stores and by
``create_c10d_store`` (libuv's own ``UV_USE_IO_URING=0`` leaves the ring it opens, measured here). So torpor
starts ``torchrun ARGS`` (also ``python -m torch.distributed.run ARGS`` and ``python PATH/torchrun ARGS``)
as ``PYTHON -c SHIM ARGS``: the shim sets ``USE_LIBUV=0``, which the workers inherit, makes
``use_libuv=False`` the default of every ``TCPStore`` the agent builds, and calls torchrun's own ``main()``
on the same arguments; a user who set ``USE_LIBUV=1`` gets torchrun unchanged. Store clients never
open io_uring (measured), so the workers need nothing else.

Which interpreter runs a ``torchrun`` console script is read from its first line by the core
(:func:`torpor.adapters.system.procfs.script_interpreter`); this module only rewrites the command.
"""

from __future__ import annotations

from collections.abc import Sequence

#: the first line of the shim: how a command torpor rewrote is recognised
SHIM_MARK = "# torpor: torchrun with its TCPStore without libuv (io_uring cannot be checkpointed)"

_SHIM = f"""{SHIM_MARK}
import os, sys
import torch.distributed as _dist
_Base = _dist.TCPStore
# an older PyTorch has no such parameter (nor libuv as its default)
if os.environ.setdefault("USE_LIBUV", "0") == "0" and "use_libuv" in (_Base.__init__.__doc__ or ""):
    class TCPStore(_Base):
        __doc__ = _Base.__doc__
        def __init__(self, *args, **kwargs):
            if len(args) < 9:  # use_libuv is the ninth parameter
                kwargs.setdefault("use_libuv", False)
            super().__init__(*args, **kwargs)
    TCPStore.__module__, TCPStore.__qualname__ = _Base.__module__, _Base.__qualname__
    for _module in list(sys.modules.values()):
        if getattr(_module, "TCPStore", None) is _Base:
            _module.TCPStore = TCPStore
sys.argv[0] = "torchrun"
from {{module}} import main
sys.exit(main())
"""

#: the modules whose ``main()`` torchrun is (``torch.distributed.launch`` is its deprecated form)
MODULES = ("torch.distributed.run", "torch.distributed.launch")

#: what ``torpor run`` says when it started a command rewritten here
NOTE = (
    "torchrun: its TCPStore runs without libuv (use_libuv=False, USE_LIBUV=0), as io_uring cannot be "
    "checkpointed; see docs/architecture.md"
)


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_python(path: str) -> bool:
    """Whether ``path`` names a Python interpreter (``python``, ``python3``, ``/usr/bin/python3.11``…)."""
    return _name(path).startswith("python")


def is_torchrun_script(command: Sequence[str]) -> bool:
    """Whether ``command`` runs the ``torchrun`` console script (its interpreter is needed to rewrite it)."""
    return bool(command) and _name(command[0]) == "torchrun"


def shim(module: str = MODULES[0]) -> str:
    """The Python source ``PYTHON -c`` runs instead of ``module``."""
    return _SHIM.format(module=module)


def without_libuv(command: Sequence[str], interpreter: Sequence[str] | None = None) -> list[str] | None:
    """``command`` rewritten to start torchrun through the shim, or None when it does not start torchrun.

    ``interpreter`` is the command line the ``torchrun`` script's first line names (needed only when
    :func:`is_torchrun_script`); a script whose interpreter is not Python is left alone (None).
    """
    if is_torchrun_script(command):
        if not interpreter or not any(is_python(word) for word in interpreter):
            return None
        return [*interpreter, "-c", shim(), *command[1:]]
    if not command or not is_python(command[0]):
        return None
    index = 1
    while index < len(command):
        word = command[index]
        if word.startswith("--"):
            index += 2 if word == "--check-hash-based-pycs" else 1
            continue
        if not word.startswith("-") and _name(word) == "torchrun":  # python PATH/torchrun ARGS
            return [*command[:index], "-c", shim(), *command[index + 1 :]]
        if not word.startswith("-") or word == "-":
            return None  # another script, or stdin
        letters = word[1:]
        for position, letter in enumerate(letters):
            if letter == "c":
                return None
            if letter in "WX":  # its value is the rest of the word, or the next word
                index += 1 if position == len(letters) - 1 else 0
                break
            if letter == "m":
                flags = [f"-{letters[:position]}"] if position else []  # "-um": keep "-u"
                module = letters[position + 1 :]
                after = index + 1
                if not module and after < len(command):
                    module, after = command[after], after + 1
                if module not in MODULES:
                    return None
                return [*command[:index], *flags, "-c", shim(module), *command[after:]]
        index += 1
    return None


def is_adapted(command: Sequence[str]) -> bool:
    """Whether ``command`` is one :func:`without_libuv` produced."""
    return any(word.startswith(SHIM_MARK) for word in command)
