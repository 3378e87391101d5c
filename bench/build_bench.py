"""Real projects' builds and tests in a workspace, side by side with the plain copy.

What it does: for each project given (a directory holding its source tree,
e.g. `git --git-dir=<mirror> archive HEAD | tar -x -C DIR`), it runs the
project's own workload in fresh workspaces of each kind, interleaved round
by round so load drifts hit every kind alike:

  lua    `make -j2` of lua/lua's makefile (a clean build), checked by running
         the built `./lua -v`
  click  pallets/click's test suite, `python -m pytest -q -p no:cacheprovider
         tests` with the tree's `src/` first on the path, checked by its
         "N passed" line (the same N in every workspace)

Workspaces: `plain` (cp -a of the tree onto this file system: the baseline),
`fuse-overlayfs` and `overlayfs` (upper on a tmpfs) for context, and
`slates` (a volume over the live tree, mounted through the bridge, made by
the SDK on a private anchor). Each round makes a fresh workspace, times
only the workload, and removes the workspace; the figure is the median over
--rounds. Everything mounted or started is undone by the Cleanup stack.
Nothing is asserted; recorded figures go in bench/RESULTS.md.

Run as root: `python bench/build_bench.py --lua DIR --click DIR [--rounds 5]
[--only plain,slates]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    Cleanup,
    median,
    mount_overlay,
    mount_tmpfs,
    run,
    spawn_fuse_overlayfs,
    umount,
)

from slates import Client
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["main"]

KINDS = ("plain", "fuse-overlayfs", "overlayfs", "slates")


def _lua(workspace: Path) -> str:
    run(["make", "-s", "-j2"], workspace, timeout=900)
    out = run(["./lua", "-v"], workspace)
    if not out.startswith("Lua "):
        raise RuntimeError(f"the built lua said {out!r}")
    return "built"


def _click(workspace: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(workspace / "src"), "PYTHONDONTWRITEBYTECODE": ""}
    out = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        workspace,
        env,
        ok_codes=(0, 1),  # a test this machine cannot run fails the same everywhere
        timeout=900,
    )
    found = re.search(r"(\d+) passed", out)
    if found is None:
        raise RuntimeError(f"pytest said {out[-300:]!r}")
    return f"{found.group(1)} passed"


WORKLOADS: dict[str, Callable[[Path], str]] = {"lua": _lua, "click": _click}


class Workspaces:
    """Makes and removes one fresh workspace of a kind over a source tree."""

    def __init__(self, top: Path, cleanup: Cleanup, kinds: list[str]) -> None:
        self.top, self.cleanup = top, cleanup
        if {"overlayfs", "fuse-overlayfs"} & set(kinds):
            self.tmpfs = top / "tmpfs"
            mount_tmpfs(self.tmpfs, "8g", cleanup)
        if "slates" in kinds:
            runtime = top / "slates-run"
            log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed by the cleanup)
            cleanup.push(log.close)
            anchor = spawn_anchor(runtime, shards=2, capacity="8GiB", log=log)
            cleanup.push(lambda: stop_process(anchor, timeout=30))
            self.client = Client(runtime)
            cleanup.push(self.client.close)
            self.client.status()
        self.made = 0

    def make(self, kind: str, source: Path) -> tuple[Path, Callable[[], None]]:
        self.made += 1
        path = self.top / "ws" / f"{kind}-{self.made}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "plain":
            run(["cp", "-a", source, path])
            return path, lambda: shutil.rmtree(path)
        if kind in ("overlayfs", "fuse-overlayfs"):
            upper = self.tmpfs / f"upper-{self.made}"
            work = self.tmpfs / f"work-{self.made}"
            if kind == "overlayfs":
                mount_overlay(source, upper, work, path, self.cleanup)
            else:
                spawn_fuse_overlayfs(source, upper, work, path, self.cleanup)

            def undo_overlay() -> None:
                umount(path)
                shutil.rmtree(upper)
                shutil.rmtree(work)

            return path, undo_overlay
        path.mkdir()
        volume = str(self.client.create_volume(f"build-{self.made}", base=source)["id"])
        self.client.mount(volume, path)

        def undo_slates() -> None:
            self.client.unmount(path)
            self.client.delete_volume(volume)

        return path, undo_slates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lua", type=Path, help="lua/lua's source tree")
    parser.add_argument("--click", type=Path, help="pallets/click's source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(KINDS))
    args = parser.parse_args(argv)
    kinds = [k for k in args.only.split(",") if k]
    if not set(kinds) <= set(KINDS) or "plain" not in kinds:
        parser.error(f"--only: choose from {', '.join(KINDS)}, plain included")
    projects = {name: path for name, path in (("lua", args.lua), ("click", args.click)) if path}
    if not projects:
        parser.error("give --lua DIR and/or --click DIR")
    cleanup = Cleanup()
    top = Path(tempfile.mkdtemp(prefix="slates-build-bench-"))
    cleanup.push(lambda: shutil.rmtree(top, ignore_errors=True))
    try:
        workspaces = Workspaces(top, cleanup, kinds)
        print(f"{'workload':<10} " + " ".join(f"{k:>15}" for k in kinds) + "   slates/plain")
        for name, source in projects.items():
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            checks: set[str] = set()
            for _round in range(args.rounds):
                for kind in kinds:
                    path, undo = workspaces.make(kind, source.resolve())
                    try:
                        started = time.perf_counter()
                        checks.add(WORKLOADS[name](path))
                        samples[kind].append(time.perf_counter() - started)
                    finally:
                        undo()
            if len(checks) != 1:
                raise RuntimeError(f"{name}: the workspaces disagree: {sorted(checks)}")
            medians = {k: median(v) for k, v in samples.items()}
            ratio = medians["slates"] / medians["plain"] if "slates" in medians else float("nan")
            row = " ".join(f"{medians[k]:>14.2f}s" for k in kinds)
            print(f"{name:<10} {row}   {ratio:.3f}x  ({checks.pop()}, {args.rounds} rounds)")
    finally:
        cleanup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
