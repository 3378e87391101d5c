"""Every side-by-side benchmark in one run: `make bench` (or, as root, `python bench/run_all.py`).

In order: the ring against a unix socket (first, while nothing else runs);
one generated source tree (or a copy of --tree DIR); the workspace providers
and their workloads (bench/workspaces_bench.py); clones of one snapshot,
uncached stat latency and merges per second (bench/scaling_bench.py); then
the shard restart times (bench/restart_bench.py) and the memory soak
(bench/soak_bench.py: 4 agents for --soak-minutes, 5 by default here, so
that `make bench` stays near 15 minutes; the issue's full 20-minute run is
`python bench/soak_bench.py`, its plot bench/soak_memory.png).  Each
table is printed as soon as it is measured, with its ratios to kernel
overlayfs and to fuse-overlayfs (or to the baseline that part has: the unix
socket, git); progress goes to stderr.  At the end: every figure on which
Slates is slower (or holds more) than fuse-overlayfs, and the total time.
Everything mounted or started is unmounted and stopped, and the temporary
directory removed, however the run ends.  No figure is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import merge_bench
import scaling_bench
import workspaces_bench
from benchlib import Cleanup, MiB, Table, git_env

__all__ = ["main"]

PARTS = ("ring", "workspaces", "clones", "uncached", "merges", "restart", "soak")
SOAK_MINUTES = 5.0  # make bench's soak; the recorded 20-minute run is soak_bench.py's default
BASELINES = ("overlayfs", "fuse-overlayfs", "unix socketpair", "git merge")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _show(table: Table) -> None:
    print()
    print(table.render(ratio_to=[c for c in table.columns if c in BASELINES]), flush=True)


def _revision() -> str:
    here = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        ["git", "-C", str(here), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def _slower(table: Table, against: str = "fuse-overlayfs", who: str = "slates") -> list[str]:
    """Rows where `who` takes longer (or holds more) than `against`."""
    if against not in table.columns or who not in table.columns:
        return []
    a, w = table.columns.index(against), table.columns.index(who)
    out = []
    for label, unit, values in table.rows:
        mine, theirs = values[w], values[a]
        if mine is None or theirs is None or unit not in ("s", "ms", "us", "MiB"):
            continue
        if mine > theirs and mine - theirs > 1e-9:
            ratio = f"{mine / theirs:.2f}x" if theirs > 0 else "more (theirs is 0)"
            noise = "  (within 5%: noise on this machine)" if mine < theirs * 1.05 else ""
            out.append(
                f"  {table.name or table.title[:20]:<12} {label.strip():<38} {ratio:>8}{noise}"
            )
    return out


def _run_script(name: str, arguments: list[str]) -> None:
    """Run one of the standalone benchmarks here, its output going to ours."""
    print(flush=True)
    script = Path(__file__).resolve().parent / name
    done = subprocess.run([sys.executable, str(script), *arguments], check=False)
    if done.returncode != 0:
        print(f"{name} failed with exit code {done.returncode}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=5000, help="files in the generated tree")
    parser.add_argument("--tree", type=Path, default=None, help="use a copy of this directory")
    parser.add_argument("--rounds", type=int, default=5, help="rounds for medians")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clones", default=",".join(map(str, scaling_bench.CLONE_COUNTS)))
    parser.add_argument("--skip", default="", help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--soak-minutes", type=float, default=SOAK_MINUTES)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (800 files)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run as root: the benchmark mounts file systems and drops the page cache")
    if shutil.which("fuse-overlayfs") is None:
        parser.error("fuse-overlayfs is not installed (`make bench` installs it)")
    if args.quick:
        args.files, args.rounds, args.clones = 800, 1, "1,8"
        args.soak_minutes = min(args.soak_minutes, 2.0)
    skip = {part for part in args.skip.split(",") if part}
    began = time.monotonic()
    print(
        f"Slates side-by-side benchmarks, {datetime.date.today()}, revision {_revision()}\n"
        f"{merge_bench._machine()}",
        flush=True,
    )
    tables: list[Table] = []
    if "ring" not in skip:  # first: it forks, and wants the CPUs to itself
        _log("ring vs unix socket ...")
        tables.append(scaling_bench.bench_ring())
        _show(tables[-1])
    cleanup = Cleanup()
    top = Path(tempfile.mkdtemp(prefix="slates-bench-"))
    cleanup.remove_tree(top)
    try:
        env = git_env(top)
        ctx = scaling_bench.Context(top, cleanup, _log, env)
        _log("generating the source tree ...")
        started = time.perf_counter()
        tree = workspaces_bench.make_tree(top, args.files, args.seed, env, args.tree)
        print(
            f"\nsource tree: {len(tree.tracked):,} tracked files, {tree.size_bytes / MiB:.1f} MiB "
            f"(64 MiB of it one file), a C program of {workspaces_bench.C_UNITS + 1} files, "
            f"{tree.pytest_count} pytest tests; committed and packed by git "
            f"(made in {time.perf_counter() - started:.1f} s); "
            f"medians of {args.rounds} rounds",
            flush=True,
        )
        if "workspaces" not in skip:
            _log("workspaces ...")
            results = workspaces_bench.run_workspaces(top, tree, env, args.rounds, cleanup, _log)
            print()
            print(workspaces_bench.workspace_table(results), flush=True)
            tables.append(workspaces_bench.as_table(results))
            notes = results.notes.get("slates", {})
            if notes:
                print(
                    f"(slates shard process resident memory grew "
                    f"{notes['shard_rss_growth'] / MiB:.1f} MiB during the workloads)"
                )
        if "clones" not in skip:
            _log("clones ...")
            small = next(p for p in tree.tracked if p.startswith(tree.at("cprog/src/")))
            counts = [int(n) for n in args.clones.split(",")]
            tables.append(scaling_bench.bench_clones(ctx, tree.root, small, counts))
            _show(tables[-1])
        if "uncached" not in skip:
            _log("uncached stat latency ...")
            tables.append(scaling_bench.bench_uncached(ctx, tree.root, tree.tracked))
            _show(tables[-1])
        if "merges" not in skip:
            _log("merges ...")
            tables.append(scaling_bench.bench_merges(ctx, seed=args.seed))
            _show(tables[-1])
    finally:
        cleanup.close()
    if "restart" not in skip:  # standalone scripts: each starts and stops its own anchor
        _log("shard restarts ...")
        restart = ["--rounds", "1", "--submissions", "200", "--writes", "20000"]
        _run_script("restart_bench.py", restart if args.quick else [])
    if "soak" not in skip:
        _log(f"memory soak ({args.soak_minutes:g} min) ...")
        _run_script("soak_bench.py", ["--minutes", str(args.soak_minutes)])
    slower = [line for table in tables for line in _slower(table)]
    print("\nWhere Slates is slower than (or holds more than) fuse-overlayfs:")
    print("\n".join(slower) if slower else "  nowhere")
    print(f"\nfinished in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
