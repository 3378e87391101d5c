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
the SDK on a private anchor), and `slates-writeback` (the same, mounted with
the kernel's writeback cache: `slates mount --writeback`). Each round makes a fresh workspace, times
only the workload, and removes the workspace; the figure is the median over
--rounds. Everything mounted or started is undone by the Cleanup stack.
Nothing is asserted; recorded figures go in bench/RESULTS.md.

For each project with a `slates` workspace it also prints, as medians over
the rounds, the kernel's requests to the bridge by opcode, the requests the
bridge had its shard answer (round_trips) and the requests the bridge
answered itself (its counters file), so a change in the mount's cost can be
traced to the requests behind it.  `--profile DIR` records every shard's
stacks with py-spy (if the venv has it) during the slates rounds, one
flame-graph file per shard and round in DIR.

Run as root: `python bench/build_bench.py --lua DIR --click DIR [--rounds 5]
[--only plain,slates] [--profile DIR]`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import resource
import shutil
import signal
import subprocess
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
from slates.fuse.bridge import read_counters
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["main"]

KINDS = ("plain", "fuse-overlayfs", "overlayfs", "slates", "slates-writeback")
PY_SPY = Path(sys.executable).parent / "py-spy"


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
        if {"slates", "slates-writeback"} & set(kinds):
            runtime = top / "slates-run"
            log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed by the cleanup)
            cleanup.push(log.close)
            anchor = spawn_anchor(runtime, shards=2, capacity="8GiB", log=log)
            cleanup.push(lambda: stop_process(anchor, timeout=30))
            self.runtime, self.anchor_pid = runtime, anchor.pid
            self.client = Client(runtime)
            cleanup.push(self.client.close)
            self.client.status()
        self.made = 0
        self.counters: dict[str, int] = {}  # the last slates workspace's bridge counters
        self.bridge_pid = 0  # the last slates workspace's bridge

    def shard_pids(self) -> list[int]:
        """The anchor's shard processes (its children running slates.node.shard)."""
        children = Path(f"/proc/{self.anchor_pid}/task/{self.anchor_pid}/children")
        pids = []
        for pid in children.read_text().split():
            with contextlib.suppress(OSError):
                if b"slates.node.shard" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
        return pids

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
        self.client.mount(volume, path, writeback=kind == "slates-writeback")
        self.bridge_pid = next(
            int(m["pid"]) for m in self.client.mounts() if m["directory"] == str(path)
        )

        def undo_slates() -> None:
            files = sorted(self.runtime.glob(f"counters-{volume}-*"))
            self.counters = read_counters(files[0]) if len(files) == 1 else {}
            self.counters["bridge_cpu_ms"] = _cpu_ms([self.bridge_pid])
            self.client.unmount(path)
            self.client.delete_volume(volume)

        return path, undo_slates


def _rounds(samples: dict[str, list[float]]) -> str:
    return "; ".join(f"{k} " + " ".join(f"{v:.2f}" for v in vs) for k, vs in samples.items())


def _medians(samples: dict[str, list[float]]) -> str:
    return " ".join(f"{k} {median(v):.2f}" for k, v in samples.items())


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's waited-for children so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _cpu_ms(pids: list[int]) -> int:
    """CPU time (user and system) the processes have used, in milliseconds."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks * 1000 // os.sysconf("SC_CLK_TCK")


def _counter_medians(rounds: list[dict[str, int]]) -> str:
    """Each counter's median over the rounds, largest first, zeros left out."""
    names = {name for one in rounds for name in one}
    medians = {name: median([float(one.get(name, 0)) for one in rounds]) for name in names}
    ranked = sorted((v, k) for k, v in medians.items() if v)
    return " ".join(f"{k}={v:.0f}" for v, k in reversed(ranked))


def _spy(pids: list[int], out: Path, name: str, round_number: int) -> list[subprocess.Popen[bytes]]:
    """py-spy recording each shard until it is sent SIGINT (none if py-spy is missing)."""
    if not PY_SPY.exists():
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                str(PY_SPY),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "500",
                "--format",
                "raw",
                "--output",
                str(out / f"{name}-round{round_number}-shard{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lua", type=Path, help="lua/lua's source tree")
    parser.add_argument("--click", type=Path, help="pallets/click's source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(KINDS))
    parser.add_argument("--profile", type=Path, help="py-spy flame graphs of the shards here")
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
            cpu: dict[str, list[float]] = {k: [] for k in kinds}  # the workload's own, s
            counters: list[dict[str, int]] = []
            checks: set[str] = set()
            for round_number in range(args.rounds):
                for kind in kinds:
                    path, undo = workspaces.make(kind, source.resolve())
                    spies: list[subprocess.Popen[bytes]] = []
                    if kind == "slates" and args.profile is not None:
                        spies = _spy(workspaces.shard_pids(), args.profile, name, round_number)
                    shards_before = _cpu_ms(workspaces.shard_pids()) if kind == "slates" else 0
                    try:
                        children = _children_cpu()
                        started = time.perf_counter()
                        checks.add(WORKLOADS[name](path))
                        samples[kind].append(time.perf_counter() - started)
                        cpu[kind].append(_children_cpu() - children)
                        shards_after = _cpu_ms(workspaces.shard_pids()) if kind == "slates" else 0
                    finally:
                        for spy in spies:
                            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                            spy.wait(timeout=60)
                        undo()
                    if kind == "slates":
                        counters.append(
                            {**workspaces.counters, "shard_cpu_ms": shards_after - shards_before}
                        )
            if len(checks) != 1:
                raise RuntimeError(f"{name}: the workspaces disagree: {sorted(checks)}")
            medians = {k: median(v) for k, v in samples.items()}
            ratio = medians["slates"] / medians["plain"] if "slates" in medians else float("nan")
            row = " ".join(f"{medians[k]:>14.2f}s" for k in kinds)
            print(f"{name:<10} {row}   {ratio:.3f}x  ({checks.pop()}, {args.rounds} rounds)")
            print(f"{'':<10} per round: " + _rounds(samples))
            for kind in ("slates", "slates-writeback"):
                if kind in samples:
                    paired = [s / p for s, p in zip(samples[kind], samples["plain"], strict=True)]
                    ratios = " ".join(f"{r:.3f}" for r in paired)
                    print(f"{'':<10} {kind}/plain per round: {ratios}")
            if "slates-writeback" in medians:
                wb = medians["slates-writeback"] / medians["plain"]
                print(f"{'':<10} slates-writeback/plain: {wb:.3f}x")
            print(f"{'':<10} workload cpu (median, s): " + _medians(cpu))
            if counters:
                print(f"{'':<10} bridge (median over rounds): {_counter_medians(counters)}")
    finally:
        cleanup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
