"""Policy: pure scheduling decisions from a state snapshot (admit, hibernate, resume, migrate); no I/O.

Empty for now: the embedded scheduler arrives with its own issue.
"""
