"""Scaling side by side: clones, merges, the ring, and uncached FUSE latency.

1. Clones of one snapshot.  Slates: the source tree captured into a volume
   (every byte in the host's chunk store), one snapshot of it, then 1, 8, 64
   and 256 clones (fresh ones for each count); each clone then writes 2
   bytes into one small file, so it owns one private page.  The same for
   kernel overlayfs and fuse-overlayfs: that many mounts over the tree, each
   with its own upper directory on one tmpfs, and the same 2-byte write
   (which copies the whole small file up).  Figures: the median time to make
   one workspace; the bytes the host holds because of them (Slates: the
   host's physical bytes; overlayfs: the tmpfs blocks of the upper
   directories, the kernel's own memory not counted; fuse-overlayfs: the
   same plus the processes' proportional set size); the bytes the
   workspaces can read (Slates: the sum of the clones' referenced bytes;
   the overlays: the tree's size for each mount); and, for Slates, how much
   the owning shard process's resident memory grew, which the host's
   accounting does not include.
2. Merges per second for 1, 10 and 100 agents, each editing a file no other
   agent touches: Slates submissions into a green volume (bench/merge_bench.py's
   own run and checks, on a smaller tree), against git on the same tree:
   one branch per agent, merged one after another with `git merge --no-ff`
   in a checkout, and with `git merge-tree --write-tree` plus `commit-tree`
   (no checkout: what a merge service would run).
3. The ring round trip against a unix socketpair round trip
   (bench/ring_bench.py's measurements, 64 B and 4 KiB messages).
4. Per-operation FUSE latency with the kernel's caches out of the way:
   stat(2) of each file of a few directories (relative to an open directory
   descriptor: one name lookup each).  fuse-overlayfs with `-o timeout=0`
   and a Slates bridge started with --uncached (entry and attribute timeouts
   0): every stat reaches the file system process.  The cached figures and
   the plain directory and kernel overlayfs are shown beside them.

Run as root: `python bench/scaling_bench.py` (bench/run_all.py runs everything).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import merge_bench
import ring_bench
import trio
from benchlib import (
    Cleanup,
    MiB,
    Table,
    disk_usage,
    git_env,
    median,
    mount_overlay,
    mount_tmpfs,
    pss_bytes,
    rss_bytes,
    run,
    spawn_fuse_overlayfs,
    umount,
)
from workspaces_bench import make_tree

from slates import Client
from slates.fuse.bridge import read_counters
from slates.node.anchor import is_mounted, spawn_anchor, stop_process
from slates.node.ring import calibrate_spin
from slates.node.service import shard_of

__all__ = [
    "CLONE_COUNTS",
    "bench_clones",
    "bench_merges",
    "bench_ring",
    "bench_uncached",
]

CLONE_COUNTS = (1, 8, 64, 256)
AGENTS = (1, 10, 100)
MERGE_FILES = 1000
STAT_NAMES = 2000  # names stat'ed per pass in the latency test
STAT_ROUNDS = 5


@dataclass
class Context:
    top: Path
    cleanup: Cleanup
    log: Callable[[str], None]
    env: dict[str, str]


@contextlib.contextmanager
def _anchor(ctx: Context, name: str, shards: int = 2) -> Iterator[tuple[Path, Client]]:
    """An anchor in ctx.top/name and a client of it; both stopped however we leave."""
    runtime = ctx.top / name
    with ctx.cleanup.scope() as scope:
        log = open(ctx.top / f"{name}.log", "wb")  # noqa: SIM115 (closed by the scope)
        scope.push(log.close)
        anchor = spawn_anchor(runtime, shards=shards, capacity="16GiB", log=log)
        scope.push(lambda: stop_process(anchor, timeout=30))
        client = Client(runtime)
        scope.push(client.close)
        client.status()  # every shard started and connected before anything is timed
        yield runtime, client


def _shard(client: Client, index: int) -> dict[str, Any]:
    shard: dict[str, Any] = client.status()["shards"][index]
    return shard


# -- 1. clones --------------------------------------------------------------------------


def _apparent_size(tree: Path) -> int:
    """Bytes of every regular file under `tree` (.git included: Slates captures it too)."""
    total = 0
    for directory, _dirs, files in os.walk(tree):
        for name in files:
            st = os.lstat(os.path.join(directory, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def bench_clones(
    ctx: Context, tree: Path, small: str, counts: Sequence[int] = CLONE_COUNTS
) -> Table:
    """Clones (Slates) vs mounts (overlayfs, fuse-overlayfs) of one tree; see the docstring."""
    tree_bytes = _apparent_size(tree)
    columns = ["overlayfs", "fuse-overlayfs", "slates"]
    table = Table(
        "Clones of one snapshot (overlays: mounts of one lower tree); each writes 2 bytes\n"
        "(bytes added: Slates the host's physical bytes; overlayfs the upper tmpfs blocks, "
        "kernel memory not counted; fuse-overlayfs those plus its processes' PSS)",
        columns,
        [],
        "clones",
    )
    values: dict[str, dict[str, float]] = {c: {} for c in columns}
    units: dict[str, str] = {}
    rows: list[str] = []

    def put(column: str, row: str, unit: str, value: float) -> None:
        if row not in units:
            units[row] = unit
            rows.append(row)
        values[column][row] = value

    # Slates
    with _anchor(ctx, "clones-run") as (_runtime, client):
        started = time.perf_counter()
        source = client.create_volume("clone-source", base=tree, capture=True)
        capture_s = time.perf_counter() - started
        snapshot = client.snapshot(source["id"])
        shard = shard_of(snapshot)
        pid = int(_shard(client, shard)["pid"])
        ctx.log(f"  slates: captured the tree in {capture_s:.1f} s; snapshot {snapshot}")
        for n in counts:
            physical = int(_shard(client, shard)["host_physical_bytes"])
            rss = rss_bytes(pid)
            latencies, clones = [], []
            for i in range(n):
                started = time.perf_counter()
                clone = client.clone(snapshot, f"clone-{n}-{i}")
                latencies.append(time.perf_counter() - started)
                clones.append(str(clone["id"]))
            for clone_id in clones:
                client.write(clone_id, "/" + small, b"xy", offset=10)
            referenced = sum(int(client.counters(c)["referenced_bytes"]) for c in clones)
            added = int(_shard(client, shard)["host_physical_bytes"]) - physical
            rss_growth = rss_bytes(pid) - rss
            for clone_id in clones:
                client.delete_volume(clone_id)
            put("slates", f"{n:>3} clones: time per clone", "ms", median(latencies) * 1000)
            put("slates", f"{n:>3} clones: bytes added", "MiB", added / MiB)
            put("slates", f"{n:>3} clones: bytes readable", "MiB", referenced / MiB)
            put("slates", f"{n:>3} clones: shard RSS growth", "MiB", rss_growth / MiB)
            ctx.log(f"  slates: {n} clones")
    # The overlays: n mounts of the same lower tree, one tmpfs for every upper.
    for column in ("overlayfs", "fuse-overlayfs"):
        for n in counts:
            with ctx.cleanup.scope() as scope:
                tmpfs = ctx.top / "clone-tmpfs"
                mount_tmpfs(tmpfs, "8g", scope)
                scope.push(lambda: shutil.rmtree(ctx.top / "clone-mnt", ignore_errors=True))
                latencies, processes = [], []
                for i in range(n):
                    upper, work = tmpfs / f"u{i}", tmpfs / f"w{i}"
                    merged = ctx.top / "clone-mnt" / f"m{i}"
                    started = time.perf_counter()
                    if column == "overlayfs":
                        mount_overlay(tree, upper, work, merged, scope)
                    else:
                        processes.append(spawn_fuse_overlayfs(tree, upper, work, merged, scope))
                    latencies.append(time.perf_counter() - started)
                for i in range(n):
                    with open(ctx.top / "clone-mnt" / f"m{i}" / small, "r+b") as f:
                        f.seek(10)
                        f.write(b"xy")
                added = disk_usage(tmpfs) + sum(pss_bytes(p.pid) for p in processes)
                put(column, f"{n:>3} clones: time per clone", "ms", median(latencies) * 1000)
                put(column, f"{n:>3} clones: bytes added", "MiB", added / MiB)
                put(column, f"{n:>3} clones: bytes readable", "MiB", n * tree_bytes / MiB)
            ctx.log(f"  {column}: {n} mounts")
    for row in rows:
        table.add(row, units[row], [values[c].get(row) for c in columns])
    table.title += f"\n(Slates captured the tree, .git included, in {capture_s:.1f} s first)"
    return table


# -- 2. merges -------------------------------------------------------------------------


def _git_baseline(
    ctx: Context, source: Path, contents: dict[str, bytes], agents: Sequence[int], seed: int
) -> dict[int, list[tuple[float, float]]]:
    """Per agent count, for `git merge` and for `git merge-tree` (each on fresh branches):
    (merges per second, median seconds of one merge)."""
    env = ctx.env
    repo = ctx.top / "git-merge"
    shutil.copytree(source, repo)
    run(["git", "init", "-q", "-b", "main"], repo, env)
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-q", "-m", "base"], repo, env)
    rng = random.Random(seed + 2)
    chosen = rng.sample(sorted(contents), 2 * sum(agents))
    out: dict[int, list[tuple[float, float]]] = {}
    used = 0
    for n in agents:
        rates = []
        for mode in ("merge", "merge-tree"):
            paths = chosen[used : used + n]
            used += n
            edits = [
                merge_bench._edit_for(p, contents[p], f"git-{mode}-{n}-{i}")
                for i, p in enumerate(paths)
            ]
            head = run(["git", "rev-parse", "HEAD"], repo, env).strip()
            stream = bytearray()
            for i, edit in enumerate(edits):
                message = f"agent {i}".encode()
                stream += (
                    (
                        f"commit refs/heads/{mode}-{n}-{i}\n"
                        "committer bench <bench@example.invalid> 0 +0000\n"
                        f"data {len(message)}\n"
                    ).encode()
                    + message
                    + b"\n"
                )
                stream += f"from {head}\nM 100644 inline {edit.path.lstrip('/')}\n".encode()
                stream += f"data {len(edit.expected)}\n".encode() + edit.expected + b"\n"
            subprocess.run(
                ["git", "fast-import", "--quiet"],
                cwd=repo,
                env=env,
                input=bytes(stream),
                check=True,
            )
            branches = [f"{mode}-{n}-{i}" for i in range(n)]
            latencies = []
            started = time.perf_counter()
            for branch in branches:
                one = time.perf_counter()
                if mode == "merge":
                    run(["git", "merge", "-q", "--no-ff", "--no-edit", branch], repo, env)
                else:
                    tree = run(["git", "merge-tree", "--write-tree", "main", branch], repo, env)
                    commit = run(
                        ["git", "commit-tree", tree.split()[0], "-p", "main", "-p", branch,
                         "-m", f"merge {branch}"],
                        repo,
                        env,
                    ).strip()  # fmt: skip
                    run(["git", "update-ref", "refs/heads/main", commit], repo, env)
                latencies.append(time.perf_counter() - one)
            rates.append((n / (time.perf_counter() - started), median(latencies)))
            if mode == "merge-tree":
                run(["git", "reset", "-q", "--hard", "main"], repo, env)
            for edit in edits:
                if (repo / edit.path.lstrip("/")).read_bytes() != edit.expected:
                    raise RuntimeError(f"git {mode}: {edit.path} does not hold its edits")
        out[n] = rates
        ctx.log(f"  git: {n} branches merged")
    return out


def bench_merges(ctx: Context, agents: Sequence[int] = AGENTS, seed: int = 1) -> Table:
    source = ctx.top / "merge-source"
    (ctx.top / "merge").mkdir()
    contents = merge_bench._tree(source, MERGE_FILES, random.Random(seed))
    with merge_bench._anchor(ctx.top / "merge", 2) as runtime:
        green_s, rows = trio.run(merge_bench._run, runtime, source, contents, list(agents), seed)
    ctx.log(f"  slates: merges done (green volume captured in {green_s:.2f} s)")
    git = _git_baseline(ctx, source, contents, agents, seed)
    columns = ["git merge", "git merge-tree", "slates sequential", "slates concurrent"]
    table = Table(
        f"Merges per second, non-conflicting submissions ({MERGE_FILES:,} files; "
        "each agent edits its own file twice)",
        columns,
        [],
        "merges",
    )
    for n in agents:
        by_mode = {r.mode: r for r in rows if r.agents == n}
        table.add(
            f"{n:>3} agents: merges per second",
            "1/s",
            [
                git[n][0][0],
                git[n][1][0],
                n / by_mode["sequential"].submit_s,
                n / by_mode["concurrent"].submit_s if "concurrent" in by_mode else None,
            ],
        )
        table.add(
            f"{n:>3} agents: one merge, median",
            "ms",
            [
                git[n][0][1] * 1000,
                git[n][1][1] * 1000,
                median(by_mode["sequential"].latencies) * 1000,
                median(by_mode["concurrent"].latencies) * 1000 if "concurrent" in by_mode else None,
            ],
        )
    return table


# -- 3. ring ---------------------------------------------------------------------------


def bench_ring() -> Table:
    """bench/ring_bench.py's round trips, with this process pinned as ring_bench.main pins it."""
    spin_ns = calibrate_spin()
    affinity = os.sched_getaffinity(0)
    if ring_bench.CLIENT_CPU is not None:
        os.sched_setaffinity(0, {ring_bench.CLIENT_CPU})
    try:
        results = {}
        for size in ring_bench.SIZES:
            results[(size, "unix socketpair")] = ring_bench.bench_socketpair(size)
            results[(size, "ring, spin")] = ring_bench.bench_ring("ring", size, spin_ns)
            results[(size, "ring, park only")] = ring_bench.bench_ring("ring", size, 0)
    finally:
        os.sched_setaffinity(0, affinity)
    columns = ["unix socketpair", "ring, spin", "ring, park only"]
    table = Table(
        f"Ring vs unix socket round trips (msgpack, spin budget {spin_ns / 1000:.1f} us)",
        columns,
        [],
        "ring",
    )
    for size in ring_bench.SIZES:
        label = f"{size} B" if size < 1024 else f"{size // 1024} KiB"
        got = [results[(size, c)] for c in columns]
        table.add(f"{label}: round trip, median", "us", [r.median_us for r in got])
        table.add(f"{label}: round trip, p99", "us", [r.p99_us for r in got])
        table.add(f"{label}: pipelined", "msg/s", [r.msgs_per_s for r in got])
    return table


# -- 4. uncached latency -------------------------------------------------------------


def _stat_names(tree: Path, tracked: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Directories (relative) and file names in them, about STAT_NAMES names in all."""
    by_dir: dict[str, list[str]] = {}
    for path in tracked:
        directory, _, name = path.rpartition("/")
        by_dir.setdefault(directory, []).append(name)
    chosen: list[tuple[str, list[str]]] = []
    total = 0
    for directory, names in sorted(by_dir.items(), key=lambda item: -len(item[1])):
        if total >= STAT_NAMES:
            break
        chosen.append((directory, names))
        total += len(names)
    return chosen


def _stat_pass(root: Path, names: list[tuple[str, list[str]]]) -> tuple[float, int]:
    """(seconds, stat calls) for one pass."""
    fds = [os.open(root / directory, os.O_RDONLY | os.O_DIRECTORY) for directory, _ in names]
    try:
        count = 0
        started = time.perf_counter()
        for fd, (_directory, files) in zip(fds, names, strict=True):
            for name in files:
                os.stat(name, dir_fd=fd)
            count += len(files)
        return time.perf_counter() - started, count
    finally:
        for fd in fds:
            os.close(fd)


def _per_stat_us(root: Path, names: list[tuple[str, list[str]]]) -> float:
    _stat_pass(root, names)  # the first pass fills the caches of everything below
    samples = []
    for _ in range(STAT_ROUNDS):
        seconds, count = _stat_pass(root, names)
        samples.append(seconds / count * 1e6)
    return median(samples)


def _spawn_bridge(
    runtime: Path, volume: str, mountpoint: Path, counters: Path, scope: Cleanup
) -> subprocess.Popen[bytes]:
    """A bridge with --uncached, started the way the anchor starts one (which has no such flag)."""
    ready_read, ready_write = os.pipe()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "slates.fuse.bridge",
            "--runtime-dir", str(runtime),
            "--volume", volume,
            "--mountpoint", str(mountpoint),
            "--ready-fd", str(ready_write),
            "--counters", str(counters),
            "--no-writeback-cache",
            "--uncached",
        ],
        pass_fds=(ready_write,),
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(ready_write)

    def stop() -> None:
        stop_process(process, timeout=30)
        if is_mounted(str(mountpoint)):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)

    scope.push(stop)
    with os.fdopen(ready_read, "rb", buffering=0) as ready:
        if ready.read(1) != b"1":
            raise RuntimeError("the --uncached bridge did not start")
    return process


def bench_uncached(ctx: Context, tree: Path, tracked: Sequence[str]) -> Table:
    names = _stat_names(tree, tracked)
    count = sum(len(files) for _, files in names)
    columns = ["plain directory", "overlayfs", "fuse-overlayfs", "slates"]
    cached: dict[str, float] = {}
    uncached: dict[str, float] = {}
    per_stat_requests = 0.0
    cached["plain directory"] = _per_stat_us(tree, names)
    with ctx.cleanup.scope() as scope:
        tmpfs = ctx.top / "latency-tmpfs"
        mount_tmpfs(tmpfs, "1g", scope)
        merged = ctx.top / "latency-ovl"
        mount_overlay(tree, tmpfs / "u0", tmpfs / "w0", merged, scope)
        cached["overlayfs"] = _per_stat_us(merged, names)
        umount(merged)
        for timeout, into in ((None, cached), (0.0, uncached)):
            fuse = ctx.top / f"latency-fuse-{timeout}"
            process = spawn_fuse_overlayfs(
                tree, tmpfs / f"u-{timeout}", tmpfs / f"w-{timeout}", fuse, scope, timeout=timeout
            )
            into["fuse-overlayfs"] = _per_stat_us(fuse, names)
            subprocess.run(["fusermount3", "-u", str(fuse)], check=True)
            process.wait(timeout=30)
    ctx.log("  overlays measured")
    with _anchor(ctx, "latency-run") as (runtime, client), ctx.cleanup.scope() as scope:
        plain = ctx.top / "latency-slates"
        plain.mkdir()
        volume = str(client.create_volume("latency", base=tree)["id"])
        client.mount(volume, plain)

        def unmount() -> None:
            if is_mounted(str(plain)):
                client.unmount(plain, force=True)

        scope.push(unmount)
        cached["slates"] = _per_stat_us(plain, names)
        client.unmount(plain)
        bare = ctx.top / "latency-slates-uncached"
        bare.mkdir()
        other = str(client.create_volume("latency-uncached", base=tree)["id"])
        counters = runtime / "counters-uncached"
        _spawn_bridge(runtime, other, bare, counters, scope)
        before = read_counters(counters)["round_trips"]
        _stat_pass(bare, names)
        per_stat_requests = (read_counters(counters)["round_trips"] - before) / count
        uncached["slates"] = _per_stat_us(bare, names)
        by_op = read_counters(counters)
    ctx.log("  slates measured")
    ops = ", ".join(
        f"{op} {by_op[op]:,}" for op in ("LOOKUP", "GETATTR", "READDIRPLUS") if op in by_op
    )
    table = Table(
        f"stat(2) latency per call, {count:,} files in {len(names)} directories "
        f"(median of {STAT_ROUNDS} passes after one warm-up pass)",
        columns,
        [],
        "stat latency",
    )
    table.add("stat, kernel caches on", "us", [cached.get(c) for c in columns])
    table.add("stat, entry/attr caching off", "us", [uncached.get(c) for c in columns])
    table.add("  requests per uncached stat", "", [None, None, None, per_stat_requests])
    table.title += f"\n(uncached Slates bridge counters: {ops}; kernel file systems have no"
    table.title += " uncached mode: n/a)"
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--parts", default="ring,clones,uncached,merges")
    parser.add_argument("--clones", default=",".join(map(str, CLONE_COUNTS)))
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run as root (mounts and drop_caches)")
    parts = args.parts.split(",")
    began = time.monotonic()
    tables: list[Table] = []
    if "ring" in parts:
        tables.append(bench_ring())
    cleanup = Cleanup()
    top = Path(tempfile.mkdtemp(prefix="slates-scaling-bench-"))
    cleanup.remove_tree(top)
    try:
        ctx = Context(top, cleanup, print, git_env(top))
        tree = make_tree(top, args.files, args.seed, ctx.env)
        small = next(p for p in tree.tracked if p.startswith("src/"))
        if "clones" in parts:
            counts = [int(n) for n in args.clones.split(",")]
            tables.append(bench_clones(ctx, tree.root, small, counts))
        if "uncached" in parts:
            tables.append(bench_uncached(ctx, tree.root, tree.tracked))
        if "merges" in parts:
            tables.append(bench_merges(ctx))
    finally:
        cleanup.close()
    for table in tables:
        print()
        print(table.render(ratio_to=[c for c in table.columns if c in _BASELINES]))
    print(f"finished in {time.monotonic() - began:.1f} s")


_BASELINES = ("overlayfs", "fuse-overlayfs", "unix socketpair", "git merge")

if __name__ == "__main__":
    main()
