"""The errors map: every error torpor defines can cross the launcher → CLI boundary by name and keeps its
class (and so its exit status) on the other side."""

from __future__ import annotations

import importlib
import pkgutil

import torpor
from torpor import errors
from torpor.adapters.slurm import SlurmCommandFailed

#: modules that are programs torpor runs as a job, not part of torpor: they need PyTorch
JOB_SCRIPTS = {"torpor.apps.demo_train"}


def all_subclasses(cls: type[errors.TorporError]) -> set[type[errors.TorporError]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *all_subclasses(sub)}
    return found


def test_every_torpor_error_is_in_the_map_by_its_name() -> None:
    for module in pkgutil.walk_packages(torpor.__path__, "torpor."):
        # a __main__ module runs its program when imported; what it raises is imported from elsewhere
        if module.name not in JOB_SCRIPTS and not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
    defined = {cls for cls in all_subclasses(errors.TorporError) if cls.__module__.startswith("torpor.")}
    assert {errors.SlurmCommandFailed, errors.DemoFailed} <= defined
    mapped = set(errors._BY_NAME.values())
    # a private class (tiered.py's _HotCopyCorrupt) is a marker inside one module, named by no caller
    public = {cls for cls in defined if not cls.__name__.startswith("_")}
    missing = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in public - mapped)
    assert missing == []
    assert all(errors._BY_NAME[cls.__name__] is cls for cls in public)


def test_slurm_command_failed_lives_in_errors_and_is_still_importable_from_the_adapter() -> None:
    assert SlurmCommandFailed is errors.SlurmCommandFailed
    again = errors.from_dict(SlurmCommandFailed("scontrol: error: Invalid job id", details=["x"]).to_dict())
    assert type(again) is SlurmCommandFailed and again.exit_code == 3 and again.details == ["x"]
    assert errors.from_dict(errors.DemoFailed("timed out waiting for step 3").to_dict()).exit_code == 1
