"""Helpers shared by merge tests: what `git merge-file` makes of three versions of a file."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

__all__ = ["git_merge"]


def git_merge(
    base: bytes, ours: bytes, theirs: bytes, *, compare_texts: bool = True
) -> bytes | None:
    """What `git merge-file` makes of two versions of a base; None if it conflicts
    (or refuses, as it does for binary content).

    By default git also settles overlapping changes whose texts turn out equal (its
    conflict refinement); compare_texts=False merges changed line ranges only (git
    caps that refinement off for `--diff3`, whose clean output is the same)."""
    with tempfile.TemporaryDirectory() as directory:
        paths = [Path(directory) / name for name in ("ours", "base", "theirs")]
        for path, content in zip(paths, (ours, base, theirs), strict=True):
            path.write_bytes(content)
        style = [] if compare_texts else ["--diff3"]
        done = subprocess.run(
            ["git", "merge-file", "-p", *style, *map(str, paths)], capture_output=True, check=False
        )
        return done.stdout if done.returncode == 0 else None
