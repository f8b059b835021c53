"""Adapters: the only code that touches external systems (CRIU, the kernel's /proc, GPU drivers).

Each translates that system's failures into torpor's own exceptions, keeping the original as the cause.
"""
