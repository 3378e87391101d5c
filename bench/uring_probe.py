"""Measure first-LOOKUP cost: FUSE over /dev/fuse against FUSE-over-io_uring.

Theory of operation.  A measurement spike, not a test.  It builds the
standalone server native/uring_probe (no libfuse; see uring_probe.c), makes a
copy of git/git's tree under /tmp if there is none, and then, round after
round, runs every configuration once in a rotating order (the machine is
shared and noisy, so configurations are interleaved, never batched):

- ``dev``: the server over /dev/fuse, one reader thread (the bridge's default);
- ``dev-r2``: the same with two reader threads;
- ``dev-pin``: one reader, server and client pinned to CPU 0 (single-threaded
  client only): the same-CPU bound the io_uring transport should approach;
- ``uring``: the server over FUSE-over-io_uring, one queue per CPU;
- ``uring-dt``: the same, rings set up with SINGLE_ISSUER | DEFER_TASKRUN;
- ``plain``: the source directory itself.

Each FUSE run mounts a fresh instance (so every ``os.lstat`` is a first
LOOKUP), stats the mount root untimed (INIT and, for io_uring, ring
registration complete before that GETATTR is answered), then times
``os.lstat`` of every non-directory of the tree with 1 or N client threads.
The server's CPU time over the timed part is read from ``/proc/PID/stat``
(utime+stime, 10 ms ticks) and, finer, from the sum of
``/proc/PID/task/*/schedstat`` run times.  ``enable_uring`` is set to Y only
while an io_uring instance initialises and is always put back to N.  Every
mount is detached, every server waited for (killed by pid if it lingers) and
every temp directory removed, also on error.  Prints one table of medians.

Run as root: ``.venv/bin/python bench/uring_probe.py --runs 7``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_SRC = REPO / "native" / "uring_probe"
ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
GIT_MIRROR = Path("/work/.mirror/git+git/repo")
DEFAULT_TREE = Path("/tmp/us-tree")
MNT_DETACH = 2
SERVER_START_TIMEOUT_S = 10.0
SERVER_EXIT_TIMEOUT_S = 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One measured configuration."""

    name: str
    transport: str  # "dev", "uring" or "plain"
    threads: int
    readers: int = 1
    pinned: bool = False
    defer_taskrun: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """One timed run of one configuration."""

    config: Config
    seconds: float
    server_cpu_stat_ms: float
    server_cpu_sched_ms: float
    server_stats: str
    machine_idle_pct: float  # both CPUs, over the timed part: how quiet the machine was


def build(out_dir: Path) -> Path:
    """Compile the server into out_dir; return the binary's path."""
    binary = out_dir / "uring_probe"
    subprocess.run(
        ["make", "-s", "-C", str(SERVER_SRC), f"OUT={binary}"],
        check=True,
    )
    return binary


def ensure_tree(tree: Path) -> None:
    """Extract git/git's HEAD into tree unless it is already there."""
    if tree.is_dir() and any(tree.iterdir()):
        return
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(
        ["git", f"--git-dir={GIT_MIRROR}", "archive", "HEAD"], stdout=subprocess.PIPE
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError("git archive failed")


def list_files(tree: Path) -> list[str]:
    """Relative paths of every non-directory under tree, in walk order."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(tree):
        # a symlink to a directory is listed as a directory but is not walked
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = sorted(d for d in dirnames if d not in links)
        rel = os.path.relpath(dirpath, tree)
        for name in sorted(filenames + links):
            found.append(name if rel == "." else os.path.join(rel, name))
    return found


def lstat_all(root: str, files: Sequence[str], threads: int, pin_cpu: int | None) -> float:
    """Seconds to lstat root/f for every f, split over threads (stride)."""
    paths = [os.path.join(root, f) for f in files]
    barrier = threading.Barrier(threads + 1)

    def work(part: Sequence[str]) -> None:
        if pin_cpu is not None:
            os.sched_setaffinity(0, {pin_cpu})  # pid 0: this thread only
        barrier.wait()
        for p in part:
            os.lstat(p)

    workers = [threading.Thread(target=work, args=(paths[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def server_cpu_ms(pid: int) -> tuple[float, float]:
    """(utime+stime from /proc/PID/stat, sum of thread schedstat run time), in ms."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    sched_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            sched_ns += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread ended between listing and reading
    return ticks * 1000.0 / CLOCK_TICKS, sched_ns / 1e6


def cpu_jiffies() -> tuple[int, int]:
    """(idle+iowait, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def idle_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


def set_enable_uring(on: bool) -> None:
    ENABLE_URING.write_text("Y" if on else "N")


def detach(mountpoint: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(mountpoint.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: not mounted (the server never mounted)
            print(f"umount2 {mountpoint}: {os.strerror(err)}", file=sys.stderr)


def run_fuse(cfg: Config, binary: Path, tree: Path, files: Sequence[str]) -> RunResult:
    """Mount a fresh server, time the lstats, unmount; see the module docstring."""
    mountpoint = tempfile.mkdtemp(prefix="us-mnt-", dir="/tmp")
    argv = [str(binary), "--readers", str(cfg.readers)]
    if cfg.transport == "uring":
        argv.append("--uring")
    if cfg.defer_taskrun:
        argv.append("--defer-taskrun")
    argv += [str(tree), mountpoint]
    if cfg.pinned:
        argv = ["taskset", "-c", "0", *argv]
    proc: subprocess.Popen[str] | None = None
    try:
        if cfg.transport == "uring":
            set_enable_uring(True)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.stdout is None:
            raise RuntimeError("no pipe from the server")
        line = proc.stdout.readline()
        if not line.startswith("mounted "):
            raise RuntimeError(f"server did not mount: {line!r}")
        # Untimed: waits for INIT (and, over io_uring, every queue registered).
        subprocess.run(
            ["stat", "-c", "%i", mountpoint],
            check=True,
            capture_output=True,
            timeout=SERVER_START_TIMEOUT_S,
        )
        if cfg.transport == "uring":
            set_enable_uring(False)
        cpu0 = server_cpu_ms(proc.pid)
        jiffies0 = cpu_jiffies()
        seconds = lstat_all(mountpoint, files, cfg.threads, 0 if cfg.pinned else None)
        jiffies1 = cpu_jiffies()
        cpu1 = server_cpu_ms(proc.pid)
    finally:
        if cfg.transport == "uring":
            set_enable_uring(False)
        detach(mountpoint)
        stats = ""
        if proc is not None:
            try:
                _, err = proc.communicate(timeout=SERVER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own child, by pid
                _, err = proc.communicate()
            stats = " ".join(ln for ln in err.splitlines() if ln.startswith("stats "))
        os.rmdir(mountpoint)
    return RunResult(
        cfg, seconds, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], stats, idle_pct(jiffies0, jiffies1)
    )


def run_plain(cfg: Config, tree: Path, files: Sequence[str]) -> RunResult:
    jiffies0 = cpu_jiffies()
    seconds = lstat_all(str(tree), files, cfg.threads, None)
    return RunResult(cfg, seconds, 0.0, 0.0, "", idle_pct(jiffies0, cpu_jiffies()))


def configs(threads: Sequence[int]) -> list[Config]:
    out: list[Config] = []
    for t in threads:
        out.append(Config(f"dev t{t}", "dev", t))
        out.append(Config(f"dev-r2 t{t}", "dev", t, readers=2))
        if t == 1:
            out.append(Config(f"dev-pin t{t}", "dev", t, pinned=True))
        out.append(Config(f"uring t{t}", "uring", t))
        out.append(Config(f"uring-dt t{t}", "uring", t, defer_taskrun=True))
        out.append(Config(f"plain t{t}", "plain", t))
    return out


def print_table(results: Sequence[RunResult], order: Sequence[Config], nfiles: int) -> None:
    print(f"\nos.lstat of {nfiles} files, fresh mount per run; medians (min-max) over runs")
    head = (
        f"{'config':<14} {'runs':>4} {'ms':>8} {'min-max ms':>15} "
        f"{'us/file':>8} {'srv cpu stat ms':>15} {'srv cpu sched ms':>16} {'idle%':>6}"
    )
    print(head)
    print("-" * len(head))
    for cfg in order:
        mine = [r for r in results if r.config == cfg]
        if not mine:
            continue
        ms = [r.seconds * 1000 for r in mine]
        med = statistics.median(ms)
        stat_ms = statistics.median(r.server_cpu_stat_ms for r in mine)
        sched_ms = statistics.median(r.server_cpu_sched_ms for r in mine)
        idle = statistics.median(r.machine_idle_pct for r in mine)
        span = f"{min(ms):.0f}-{max(ms):.0f}"
        cpu_cols = (
            f"{stat_ms:>15.0f} {sched_ms:>16.1f}" if cfg.transport != "plain" else f"{'':>32}"
        )
        print(
            f"{cfg.name:<14} {len(mine):>4} {med:>8.1f} {span:>15} "
            f"{med * 1000 / nfiles:>8.1f} {cpu_cols} {idle:>6.0f}"
        )
    print("\nevery run, sorted (ms):")
    for cfg in order:
        ms = sorted(r.seconds * 1000 for r in results if r.config == cfg)
        print(f"  {cfg.name:<14} " + " ".join(f"{m:.0f}" for m in ms))
    print("\nserver request counts (last run of each FUSE config):")
    for cfg in order:
        mine = [r for r in results if r.config == cfg and r.server_stats]
        if mine:
            print(f"  {cfg.name:<14} {mine[-1].server_stats}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    parser.add_argument("--threads", default="1,4", help="client thread counts, comma-separated")
    parser.add_argument("--keep-tree", action="store_true", help="do not remove the tree copy")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (mount(2), enable_uring)", file=sys.stderr)
        return 2
    if not ENABLE_URING.exists():
        print("this kernel has no FUSE-over-io_uring", file=sys.stderr)
        return 2
    threads = [int(t) for t in args.threads.split(",")]
    made_tree = not args.tree.exists()
    build_dir = Path(tempfile.mkdtemp(prefix="us-build-", dir="/tmp"))
    results: list[RunResult] = []
    try:
        binary = build(build_dir)
        ensure_tree(args.tree)
        files = list_files(args.tree)
        order = configs(threads)
        for rnd in range(args.runs):
            shift = rnd % len(order)
            for cfg in order[shift:] + order[:shift]:
                if cfg.transport == "plain":
                    res = run_plain(cfg, args.tree, files)
                else:
                    res = run_fuse(cfg, binary, args.tree, files)
                results.append(res)
                print(
                    f"round {rnd} {cfg.name:<14} {res.seconds * 1000:8.1f} ms "
                    f"srv {res.server_cpu_sched_ms:6.1f} ms idle {res.machine_idle_pct:3.0f}%",
                    flush=True,
                )
        print(
            f"\ncommand: {' '.join(sys.argv)}   kernel {os.uname().release}, {os.cpu_count()} CPUs"
        )
        print_table(results, order, len(files))
    finally:
        set_enable_uring(False)
        shutil.rmtree(build_dir, ignore_errors=True)
        if made_tree and not args.keep_tree:
            shutil.rmtree(args.tree, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
