"""slates.merge: the pure merge engine (no I/O): byte-range composition, mapping, conflicts.

ranges.py is the first part: edits of one file.  Green volumes, namespace
operations and submit/rebase build on it (issue 5).
"""

from slates.merge.ranges import RangeConflict, Replace, apply, compose, rebase

__all__ = ["RangeConflict", "Replace", "apply", "compose", "rebase"]
