"""torpor: transparent checkpoint, restore and hibernation of running workloads.

Layers (see DESIGN.md): ``apps`` (CLI) call ``policy`` and ``core``; ``core`` (engine, launcher, store,
records) calls ``adapters`` (CRIU, GPU, the running system). Errors and settings are shared by all.
"""

__version__ = "0.1.0"
