"""What a FUSE round trip costs on this machine when the caller and the server share a CPU.

Why this exists (issue 14, first touch): on a VM whose idle virtual CPUs
halt at once (here `haltpoll.guest_halt_poll_ns=0`), each FUSE round trip
between a caller on one CPU and the server on another pays two cross-CPU
wake-ups of a halted CPU.  With /dev/fuse the kernel hands a request to
whichever reader has waited longest, and the scheduler places the woken
caller on the idle CPU, so a server cannot keep itself next to its callers.
This benchmark shows how much that costs: the first `lstat` of every file
of a fresh workspace (every one a LOOKUP), single-threaded, in

- kernel overlayfs (no FUSE: the floor),
- fuse-overlayfs and a Slates mount, free to run anywhere (as users run),
- the same two with the caller and every server thread pinned to CPU 0
  (`sched_setaffinity`), which no product can do to its callers: what a
  per-CPU transport (FUSE over io_uring, one queue per CPU) could reach;
- a Slates mount served over FUSE-over-io_uring (a second anchor whose
  bridges get SLATES_FUSE_URING=1; the kernel's enable_uring is set to Y for
  the run and put back after it), free to run anywhere: that transport.
  Its column is left out on kernels without enable_uring.

A fresh workspace each round (nothing cached), medians, ratios to kernel
overlayfs.  Root, two or more CPUs, fuse-overlayfs installed:

    python bench/wakeup_bench.py --tree DIR --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchlib import (
    Cleanup,
    Table,
    median,
    mount_overlay,
    spawn_fuse_overlayfs,
)

from slates import Client
from slates.fuse.bridge import read_counters
from slates.node.anchor import spawn_anchor, stop_process

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")

# The child that stats every path: its own process, so that it can be pinned.
_LSTAT_ALL = """
import os, sys, time
paths = sys.stdin.read().split("\\0")[:-1]
os.chdir(sys.argv[1])
started = time.perf_counter()
for path in paths:
    os.lstat(path)
print(time.perf_counter() - started)
"""


def tree_paths(root: Path) -> list[str]:
    """Every path under root, relative, in walk order (directories before what they hold)."""
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        relative = os.path.relpath(directory, root)
        for name in sorted(dirs) + sorted(files):
            found.append(name if relative == "." else os.path.join(relative, name))
    return found


def pin(pid: int, cpu: int) -> None:
    """Pin every thread of `pid` to one CPU."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def lstat_all(where: Path, paths: list[str], cpu: int | None) -> float:
    """Seconds a single-threaded child took to lstat every path under `where`."""

    def pin_child() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    done = subprocess.run(
        [sys.executable, "-c", _LSTAT_ALL, str(where)],
        input="".join(p + "\0" for p in paths).encode(),
        capture_output=True,
        check=True,
        preexec_fn=pin_child,
    )
    return float(done.stdout)


def require_rings(runtime: Path, volume: str) -> None:
    """Raise unless the volume's bridge served its requests over io_uring (else the
    column would measure /dev/fuse: the bridge falls back when the rings fail)."""
    (path,) = runtime.glob(f"counters-{volume}-*")
    counts = read_counters(path)
    if counts["uring_requests"] < counts["LOOKUP"]:
        raise RuntimeError(f"the io_uring mount used /dev/fuse: {counts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="a source tree (e.g. git/git)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or len(os.sched_getaffinity(0)) < 2:
        print("needs root and at least two CPUs", file=sys.stderr)
        return 2
    tree = args.tree.resolve()
    paths = tree_paths(tree)
    samples: dict[str, list[float]] = {}
    cleanup = Cleanup()
    try:
        top = Path(tempfile.mkdtemp(prefix="wakeup-"))
        cleanup.remove_tree(top)
        log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed by the cleanup)
        cleanup.push(log.close)
        anchor = spawn_anchor(top / "run", shards=2, capacity="4GiB", log=log)
        cleanup.push(lambda: stop_process(anchor, timeout=30))
        client = Client(top / "run")
        cleanup.push(client.close)
        client.status()
        uring_client: Client | None = None
        if ENABLE_URING.exists():
            enable_before = ENABLE_URING.read_text().strip()
            ENABLE_URING.write_text("Y")  # bridges read it when they mount
            cleanup.push(lambda: ENABLE_URING.write_text(enable_before))
            uring_anchor = spawn_anchor(
                top / "run-uring",
                shards=2,
                capacity="4GiB",
                log=log,
                env={"SLATES_FUSE_URING": "1"},
            )
            cleanup.push(lambda: stop_process(uring_anchor, timeout=30))
            uring_client = Client(top / "run-uring")
            cleanup.push(uring_client.close)
            uring_client.status()

        def overlay(where: Path, scope: Cleanup) -> int | None:
            mount_overlay(tree, where / "upper", where / "work", where / "merged", scope)
            return None

        def fuse_overlayfs(where: Path, scope: Cleanup) -> int | None:
            lower, upper, work = tree, where / "upper", where / "work"
            process = spawn_fuse_overlayfs(lower, upper, work, where / "merged", scope)
            return process.pid

        def slates_with(
            through: Client, runtime: Path | None = None
        ) -> Callable[[Path, Cleanup], int | None]:
            """Mounts of `through`'s anchor; with its runtime, checked to be served by rings."""

            def slates(where: Path, scope: Cleanup) -> int | None:
                volume = through.create_volume(f"w{where.name}", base=tree)["id"]
                scope.push(lambda: through.delete_volume(volume))
                (where / "merged").mkdir(parents=True)
                mounted = through.mount(volume, where / "merged")
                scope.push(lambda: through.unmount(where / "merged", force=True))
                if runtime is not None:
                    scope.push(lambda: require_rings(runtime, volume))
                return int(mounted["pid"])

            return slates

        slates = slates_with(client)

        kinds: list[tuple[str, Callable[[Path, Cleanup], int | None], bool]] = [
            ("overlayfs", overlay, False),
            ("fuse-overlayfs", fuse_overlayfs, False),
            ("fuse-overlayfs, pinned", fuse_overlayfs, True),
            ("slates", slates, False),
            ("slates, pinned", slates, True),
        ]
        if uring_client is not None:
            io_uring = slates_with(uring_client, top / "run-uring")
            kinds.append(("slates, io_uring", io_uring, False))
        for round_ in range(args.rounds):
            for name, make, pinned in kinds:  # interleaved: load drifts alike for all
                where = top / f"{round_}-{len(samples.get(name, []))}-{name.replace(' ', '')}"
                where.mkdir()
                with cleanup.scope() as scope:
                    server = make(where, scope)
                    if pinned and server is not None:
                        pin(server, 0)
                    seconds = lstat_all(where / "merged", paths, 0 if pinned else None)
                samples.setdefault(name, []).append(seconds)
    finally:
        cleanup.close()
    table = Table(
        f"first lstat of each of {len(paths):,} paths in a fresh workspace, one thread "
        f"(medians of {args.rounds})",
        [name for name, _make, _pinned in kinds],
        [],
    )
    table.add("first lstat of every path", "s", [median(samples[n]) for n, _m, _p in kinds])
    table.add("per path", "us", [median(samples[n]) / len(paths) * 1e6 for n, _m, _p in kinds])
    print(table.render(ratio_to=["overlayfs"]))
    print(json.dumps({n: [round(s, 4) for s in v] for n, v in samples.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
