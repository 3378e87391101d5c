"""Memory soak: agents make and delete build-like trees for minutes; memory must come back.

What it does: starts an anchor (2 shards) in a temporary runtime directory
with two green volumes, one per shard, each captured from a small project.
Then 4 agents (threads, each with its own blocking Client), two per green,
loop until the time is up.  One cycle of one agent:

  create a work volume on its green's head, mount it (write-through), make
  a build-like tree in `build/` (ignored by the project's .gitignore, so it
  stays private to the work volume): FILES_PER_CYCLE files in nested
  directories, CYCLE_BYTES in all, each written in 64 KiB calls; edit one
  source file; snapshot (the tree is in the snapshot); delete the tree;
  submit (a new green version with the source edit); unmount; delete the
  work volume and its snapshot.

After every agent's first cycle the agents pause (a barrier): once each
has deleted its first volume and snapshot, the shards are collected
(`gc`) and the warm start is sampled, then the agents go on (the pause
does not count against --minutes).  The first cycle warms each shard's
heap to its allocator's high water (pymalloc arenas, glibc's free lists,
about 5 MiB a shard), which then stays flat: the cold start, sampled
before any cycle, is kept and shown, but the goal is judged against the
warm start.

Every --interval seconds a sampler reads, from /proc, the anchor's, the
shards' and the bridges' resident memory split into heap (anonymous) and
shared, and the allocated bytes of every memfd any of them holds open (the
journal, checkpoint and arena segments by name, the rings as "other"),
each memfd counted once by inode.  Physical memory is heap + memfds (file
pages such as the Python binary are left out: they are the page cache's,
shared with every other process).  Beside it, the counters the service
reports (`Client.status()`: each shard's host_physical_bytes; and each
shard's `memory` figures if the shard reports them).

At the end, once the agents' volumes and snapshots are deleted and the
shards collected (`gc`), it prints the ratio physical/counters over the run,
end versus the cold start and end versus the warm start (the goal: the
end's physical memory within 20% of the warm start), and per shard, at the
cold start, warm start and end: its anonymous RSS, its host_physical_bytes
and its own `memory` figures, to show where a difference lives.  It plots
physical memory and the counters against time, with the goal's line, to
bench/soak_memory.png (matplotlib, optional: without it the plot is skipped
with a message).  Nothing is asserted.

A failed cycle is shown with the step it failed at and the error's details
(an `internal error`'s `reason` names the shard's exception; the shard logs
its traceback).  `--keep-runtime DIR` copies the run's logs (the anchor's,
with the shards' stderr in it, and the bridges') and state files to DIR
before the temporary directory goes.

Run as root: `python bench/soak_bench.py [--minutes 20 | --quick]
[--keep-runtime DIR]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import blake3

from slates import Client
from slates.errors import NotFound, SlatesError
from slates.node.anchor import is_mounted, spawn_anchor, stop_process
from slates.node.memory import process_memory

__all__ = ["Sample", "main", "sample_memory"]

MiB = 1 << 20
FILES_PER_CYCLE = 2000
CYCLE_BYTES = 100 * MiB
WRITE_CALL = 64 << 10
SHARDS = 2
WARM_UP_SECONDS = 900.0  # the longest every agent's first cycle may take before the warm start
PNG = Path(__file__).resolve().parent / "soak_memory.png"


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- sampling --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One reading: seconds since the start, physical bytes by kind, counters."""

    at: float
    heap: int  # anonymous resident memory of the anchor, shards and bridges
    segments: dict[str, int]  # allocated bytes of memfds: journal, checkpoint, arena, other
    shared_rss: int  # their shared resident memory (the part of the memfds they map)
    counters: int  # the sum of the shards' host_physical_bytes
    reported: dict[str, int]  # the shards' own memory figures, summed (when they report them)
    processes: int
    volumes: int
    heap_by_role: dict[str, int]  # anchor, shard N, bridges
    # Per shard index: its host_physical_bytes and its own `memory` figures (arena,
    # journal, checkpoints, heap, total), as its status reported them.
    per_shard: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def physical(self) -> int:
        return self.heap + sum(self.segments.values())


def _memfds(pid: int, seen: dict[tuple[int, int], tuple[str, int]]) -> None:
    """Every memfd `pid` holds open, by (dev, inode): (kind, allocated bytes)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(entry.path)
                if not target.startswith("/memfd:"):
                    continue
                st = os.stat(entry.path)  # follows the link to the memfd itself
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            name = target.removeprefix("/memfd:")
            kind = next(
                (k for k in ("journal", "checkpoint", "arena") if f"slates-{k}-" in name), "other"
            )
            seen[(st.st_dev, st.st_ino)] = (kind, st.st_blocks * 512)


def _pids(runtime: Path) -> list[tuple[str, int]]:
    """(role, pid) of the anchor, each shard and each bridge."""
    state = json.loads((runtime / "anchor.json").read_text())
    pids = [("anchor", int(state["pid"]))]
    pids += [(f"shard {s['index']}", int(s["pid"])) for s in state["shards"] if s.get("pid")]
    pids += [("bridges", int(m["pid"])) for m in state.get("mounts", []) if m.get("pid")]
    return pids


def sample_memory(runtime: Path, client: Client, started: float) -> Sample:
    heap = shared = 0
    memfds: dict[tuple[int, int], tuple[str, int]] = {}
    pids = _pids(runtime)
    by_role: dict[str, int] = {}
    for role, pid in pids:
        try:
            figures = process_memory(pid)
        except NotFound:
            continue
        heap += figures["anon"]
        by_role[role] = by_role.get(role, 0) + figures["anon"]
        shared += figures["shmem"]
        _memfds(pid, memfds)
    segments = {"journal": 0, "checkpoint": 0, "arena": 0, "other": 0}
    for kind, nbytes in memfds.values():
        segments[kind] += nbytes
    status = client.status()
    counters = sum(int(s.get("host_physical_bytes", 0)) for s in status["shards"])
    reported: dict[str, int] = {}
    per_shard: dict[int, dict[str, int]] = {}
    for shard in status["shards"]:
        figures = per_shard.setdefault(int(shard.get("shard", len(per_shard))), {})
        figures["host_physical_bytes"] = int(shard.get("host_physical_bytes", 0))
        for key, value in (shard.get("memory") or {}).items():
            if isinstance(value, int):
                reported[key] = reported.get(key, 0) + value
                figures[key] = value
    volumes = sum(len(s.get("volumes", [])) for s in status["shards"])
    return Sample(
        time.monotonic() - started,
        heap,
        segments,
        shared,
        counters,
        reported,
        len(pids),
        volumes,
        by_role,
        per_shard,
    )


class Sampler(threading.Thread):
    def __init__(self, runtime: Path, interval: float, started: float) -> None:
        super().__init__(daemon=True)
        self.runtime = runtime
        self.interval = interval
        self.started = started
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with Client(self.runtime) as client:
            while not self.stop.is_set():
                try:
                    self.samples.append(sample_memory(self.runtime, client, self.started))
                except Exception as exc:  # a sample lost is a gap in the plot, not the end
                    _log(f"sample failed: {type(exc).__name__}: {exc}")
                self.stop.wait(self.interval)


def _trim_probe(runtime: Path, client: Client, started: float) -> Sample | None:
    """How much of the shards' heap is memory malloc holds free: trim it (gdb), sample."""
    if shutil.which("gdb") is None:
        _log("gdb is not installed: no malloc_trim probe")
        return None
    state = json.loads((runtime / "anchor.json").read_text())
    for shard in state["shards"]:
        subprocess.run(
            ["gdb", "-p", str(shard["pid"]), "-batch", "-ex", "call (int) malloc_trim(0)"],
            capture_output=True,
            check=False,
            timeout=120,
        )
    return sample_memory(runtime, client, started)


# -- the agents ------------------------------------------------------------------------


def _project(root: Path) -> None:
    """A small project: sources, a Makefile, and a .gitignore that ignores build/."""
    (root / "src").mkdir(parents=True)
    (root / ".gitignore").write_text("build/\n*.o\n")
    (root / "Makefile").write_text("all:\n\t@echo built\n")
    for index in range(40):
        (root / "src" / f"unit{index}.c").write_text(
            f"int unit{index}(int x) {{\n    return x + {index};\n}}\n" * 20
        )


def _shard_of_name(name: str) -> int:
    # The SDK's rule for where a named green lives (slates.sdk.client: _home).
    return int.from_bytes(blake3.blake3(name.encode()).digest()[:8], "big") % SHARDS


def _green_names() -> list[str]:
    """Two green names, one homed on each shard."""
    names: dict[int, str] = {}
    for counter in range(1000):
        name = f"soak-green-{counter}"
        names.setdefault(_shard_of_name(name), name)
        if len(names) == SHARDS:
            break
    return [names[index] for index in sorted(names)]


@dataclasses.dataclass
class AgentStats:
    cycles: int = 0
    files: int = 0
    written: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Schedule:
    """When the agents stop, and the pause after every agent's first cycle.

    Each agent, once its first cycle is over (its volume and snapshot deleted, or
    its failure cleaned up), waits at `warmed`; the main thread waits there too,
    collects and samples the warm start while the agents are quiet, extends the
    deadline by the pause and sets `resume`.  A barrier broken by its timeout
    (an agent that never got through its first cycle) means no warm start.
    """

    deadline: float
    warmed: threading.Barrier
    resume: threading.Event = dataclasses.field(default_factory=threading.Event)

    def first_cycle_over(self) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            self.warmed.wait(timeout=WARM_UP_SECONDS)
        self.resume.wait(timeout=WARM_UP_SECONDS)


def _one_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SlatesError) and exc.details:
        text += f" {exc.details!r}"
    return text


def describe(exc: BaseException) -> str:
    """An error with everything it carries: a SlatesError's details name the cause
    (an internal error's `reason` is the shard's real exception), and the error it
    interrupted, if any (an unmount failing after a failed step)."""
    text = _one_error(exc)
    if exc.__context__ is not None and not exc.__suppress_context__:
        text += f" (while handling {_one_error(exc.__context__)})"
    return text


def _build_tree(where: Path, rng: random.Random, files: int, total: int) -> int:
    """Nested directories of object-like files, `total` bytes in `files` files."""
    payload = rng.randbytes(WRITE_CALL)
    sizes = [total // files] * files
    written = 0
    for index, size in enumerate(sizes):
        directory = where / f"d{index % 20}" / f"e{index % 7}"
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / f"obj{index}.o", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left > 0:
                piece = min(left, WRITE_CALL)
                left -= os.write(fd, payload[:piece])
            written += size
        finally:
            os.close(fd)
    return written


def _agent(
    runtime: Path,
    top: Path,
    green: str,
    number: int,
    schedule: Schedule,
    stats: AgentStats,
    files: int,
    cycle_bytes: int,
) -> None:
    rng = random.Random(number)
    first = True
    with Client(runtime) as client:
        while time.monotonic() < schedule.deadline:
            cycle = stats.cycles
            name = f"agent{number}-c{cycle}"
            mnt = top / f"mnt-{number}"
            mnt.mkdir(exist_ok=True)
            work = snapshot = None
            step = "create_work"
            try:
                work = client.create_work(green, name)["id"]
                step = "mount"
                client.mount(work, mnt)
                try:
                    step = "build tree"
                    stats.written += _build_tree(mnt / "build", rng, files, cycle_bytes)
                    stats.files += files
                    step = "edit"
                    source = mnt / "src" / f"unit{(number * 10 + cycle) % 40}.c"
                    with open(source, "a") as handle:
                        handle.write(f"/* agent {number} cycle {cycle} */\n")
                    step = "snapshot"
                    snapshot = client.snapshot(work)
                    step = "delete tree"
                    shutil.rmtree(mnt / "build")
                    step = "submit"
                    client.submit(work)
                    step = "unmount"
                finally:  # an unmount failing after another step's failure names both
                    client.unmount(mnt)
                step = "delete_volume"
                client.delete_volume(work)
                work = None
                step = "delete_snapshot"
                client.delete_snapshot(snapshot)
                snapshot = None
                stats.cycles += 1
            except Exception as exc:  # recorded and shown; the agent goes on
                stats.errors.append(
                    f"cycle {cycle} at {step} (volume {work}, snapshot {snapshot}): {describe(exc)}"
                )
                _log(f"agent {number}: {stats.errors[-1]}")
                if is_mounted(str(mnt)):
                    with contextlib.suppress(Exception):
                        client.unmount(mnt, force=True)
                if work is not None:
                    with contextlib.suppress(Exception):
                        client.delete_volume(work, force=True)
                if snapshot is not None:
                    with contextlib.suppress(Exception):
                        client.delete_snapshot(snapshot, force=True)
                if len(stats.errors) > 20:
                    _log(f"agent {number}: too many errors, stopping")
                    if first:
                        schedule.first_cycle_over()
                    return
                time.sleep(1)
            if first:
                first = False
                schedule.first_cycle_over()


# -- the report ------------------------------------------------------------------------


def _plot(samples: list[Sample], path: Path, title: str, warm: Sample | None) -> str:
    try:  # an optional dependency of this benchmark alone: loaded by name, typed Any
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "matplotlib is not installed (`.venv/bin/pip install matplotlib`): no plot"
    minutes = [s.at / 60 for s in samples]
    figure, axes = plt.subplots(figsize=(11, 6))
    stacks = [
        ("heap (anon RSS)", [s.heap / MiB for s in samples]),
        ("arena", [s.segments["arena"] / MiB for s in samples]),
        ("journal", [s.segments["journal"] / MiB for s in samples]),
        ("checkpoints", [s.segments["checkpoint"] / MiB for s in samples]),
        ("rings, other memfds", [s.segments["other"] / MiB for s in samples]),
    ]
    axes.stackplot(
        minutes,
        *[values for _label, values in stacks],
        labels=[label for label, _values in stacks],
        alpha=0.6,
    )
    axes.plot(
        minutes,
        [s.counters / MiB for s in samples],
        color="black",
        linewidth=2,
        label="counters: host_physical_bytes",
    )
    if any(s.reported.get("total") for s in samples):
        axes.plot(
            minutes,
            [s.reported.get("total", 0) / MiB for s in samples],
            color="red",
            linestyle="--",
            linewidth=1.5,
            label="shards' reported memory total",
        )
    if warm is not None:  # the goal's reference: end within 20% of the warm start
        axes.axvline(warm.at / 60, color="grey", linestyle=":", linewidth=1)
        axes.axhline(
            warm.physical * 1.2 / MiB,
            color="green",
            linestyle=":",
            linewidth=1.5,
            label=f"goal: warm start + 20% ({warm.physical * 1.2 / MiB:.0f} MiB)",
        )
    axes.set_xlabel("minutes")
    axes.set_ylabel("MiB")
    axes.set_title(title)
    axes.legend(loc="upper left", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot: {path}"


def _change(end: Sample, base: Sample) -> float:
    return (end.physical - base.physical) / base.physical


def _shard_table(rows: list[tuple[str, Sample]]) -> None:
    """Per shard: its process's anonymous RSS (read from /proc here), its counter and
    its own `memory` figures (kernel-read by the shard)."""
    keys = ("heap", "arena", "journal", "checkpoints", "total")
    print(
        f"{'per shard (MiB)':<32}{'anon rss':>10}{'counter':>10}"
        + "".join(f"{'mem ' + key[:5]:>11}" for key in keys)
    )
    for label, sample in rows:
        for index, figures in sorted(sample.per_shard.items()):
            anon = sample.heap_by_role.get(f"shard {index}", 0)
            print(
                f"{label + f', shard {index}':<32}{anon / MiB:>10.1f}"
                f"{figures.get('host_physical_bytes', 0) / MiB:>10.1f}"
                + "".join(
                    f"{figures[key] / MiB:>11.1f}" if key in figures else f"{'-':>11}"
                    for key in keys
                )
            )


def _report(
    samples: list[Sample],
    cold: Sample,
    warm: Sample | None,
    end: Sample,
    stats: list[AgentStats],
) -> None:
    print(
        f"agents: {len(stats)}, cycles: {sum(s.cycles for s in stats)} "
        f"({', '.join(str(s.cycles) for s in stats)}), files written: "
        f"{sum(s.files for s in stats):,}, bytes written: "
        f"{sum(s.written for s in stats) / MiB:,.0f} MiB, "
        f"errors: {sum(len(s.errors) for s in stats)}"
    )
    for agent, agent_stats in enumerate(stats):
        for error in agent_stats.errors:
            print(f"  agent {agent}: {error}")
    peak = max(samples, key=lambda s: s.physical)
    print(
        f"{'':<24}{'physical':>12}{'heap':>10}{'arena':>10}{'journal':>10}"
        f"{'ckpt':>10}{'other':>10}{'counters':>12}{'ratio':>8}"
    )
    rows = [("cold start", cold)]
    if warm is not None:
        rows.append(("warm start (cycle 1)", warm))
    rows += [("peak", peak), ("end (deleted, gc)", end)]
    for label, s in rows:
        ratio = f"{s.physical / s.counters:.2f}" if s.counters else "-"
        print(
            f"{label:<24}{s.physical / MiB:>10.1f}Mi{s.heap / MiB:>8.1f}Mi"
            f"{s.segments['arena'] / MiB:>8.1f}Mi{s.segments['journal'] / MiB:>8.1f}Mi"
            f"{s.segments['checkpoint'] / MiB:>8.1f}Mi{s.segments['other'] / MiB:>8.1f}Mi"
            f"{s.counters / MiB:>10.1f}Mi{ratio:>8}"
        )
    running = [s for s in samples if s.counters]
    if running:
        ratios = sorted(s.physical / s.counters for s in running)
        print(
            f"physical / counters over the run: median {ratios[len(ratios) // 2]:.2f}, "
            f"min {ratios[0]:.2f}, max {ratios[-1]:.2f} ({len(ratios)} samples)"
        )
    reporting = [s for s in samples if s.reported.get("total")]
    if reporting:
        ratios = sorted(s.physical / s.reported["total"] for s in reporting)
        print(
            f"physical / the shards' reported memory (status 'memory' total; the anchor's and "
            f"bridges' own memory is not in it): median {ratios[len(ratios) // 2]:.2f}, "
            f"min {ratios[0]:.2f}, max {ratios[-1]:.2f}"
        )
    quiet = [row for row in rows if row[0] != "peak"]
    for label, s in quiet:
        roles = ", ".join(f"{role} {nbytes / MiB:.1f}" for role, nbytes in s.heap_by_role.items())
        print(f"heap by process at the {label} (MiB): {roles}")
    _shard_table(quiet)
    print(
        f"end vs cold start: {end.physical / MiB:.1f} MiB vs {cold.physical / MiB:.1f} MiB "
        f"({_change(end, cold):+.1%}; the cold start is before any cycle warmed the heap)"
    )
    if warm is None:
        print("no warm start (an agent never finished its first cycle): the goal is not judged")
        return
    change = _change(end, warm)
    verdict = "within" if abs(change) <= 0.20 else "NOT within"
    print(
        f"end vs warm start (the goal, within 20%): {end.physical / MiB:.1f} MiB vs "
        f"{warm.physical / MiB:.1f} MiB ({change:+.1%}): {verdict} 20% of the warm start"
    )


def _quiet_sample(client: Client, runtime: Path, started: float, settle: float) -> Sample:
    """Collect (prune, free, trim), let the shards settle, then sample."""
    client.gc()
    time.sleep(settle)
    return sample_memory(runtime, client, started)


def _warm_start(
    schedule: Schedule, client: Client, runtime: Path, started: float, settle: float
) -> Sample | None:
    """Wait for every agent's first cycle, sample while they wait, then let them go on."""
    paused = time.monotonic()
    try:
        schedule.warmed.wait(timeout=WARM_UP_SECONDS)
    except threading.BrokenBarrierError:
        _log("an agent did not finish its first cycle in time: no warm start")
        schedule.resume.set()
        return None
    try:
        return _quiet_sample(client, runtime, started, settle)
    finally:
        schedule.deadline += time.monotonic() - paused  # the pause is not soak time
        schedule.resume.set()


def _keep_runtime(top: Path, keep: Path) -> None:
    """Copy the run's logs (the anchor's, with the shards' stderr in it, the bridges')
    and state files to `keep`: regular files only, never the approver credential."""
    for directory, _subdirs, names in os.walk(top):
        if Path(directory).is_relative_to(top / "project") or "/mnt-" in directory:
            continue
        for name in names:
            source = Path(directory) / name
            if name == "approver.key" or not source.is_file() or source.is_symlink():
                continue
            target = keep / source.relative_to(top)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    _log(f"kept the run's logs and state files in {keep}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="2 minutes")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--files", type=int, default=FILES_PER_CYCLE, help="files per cycle")
    parser.add_argument("--cycle-mib", type=int, default=CYCLE_BYTES // MiB)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--capacity", default="8GiB")
    parser.add_argument(
        "--png", type=Path, default=None, help="bench/soak_memory.png (-Nmin for other lengths)"
    )
    parser.add_argument(
        "--probe-trim",
        action="store_true",
        help="at the end, call malloc_trim(0) in each shard with gdb and sample again",
    )
    parser.add_argument(
        "--keep-runtime",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy the run's logs (anchor, shards, bridges) and state files to DIR",
    )
    args = parser.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        parser.error("run as root with /dev/fuse: the agents work in FUSE mounts")
    keep = args.keep_runtime
    if keep is not None and keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        parser.error(f"--keep-runtime {args.keep_runtime}: not an empty directory")
    minutes = 2.0 if args.quick else args.minutes
    if args.png is None:  # a shorter run never replaces the recorded 20-minute plot
        args.png = PNG if minutes == 20 else PNG.with_name(f"soak_memory-{minutes:g}min.png")
    top = Path(tempfile.mkdtemp(prefix="slates-soak-"))
    runtime = top / "run"
    anchor = None
    sampler = None
    try:
        _project(top / "project")
        with open(top / "anchor.log", "wb") as log:
            anchor = spawn_anchor(runtime, shards=SHARDS, capacity=args.capacity, log=log)
        with Client(runtime) as client:
            greens = [client.create_green(name, base=top / "project") for name in _green_names()]
            started = time.monotonic()
            cold = _quiet_sample(client, runtime, started, 1.0)
            sampler = Sampler(runtime, args.interval, started)
            sampler.samples.append(cold)
            sampler.start()
            _log(
                f"soak: {args.agents} agents for {minutes:g} min; cold start physical "
                f"{cold.physical / MiB:.1f} MiB, counters {cold.counters / MiB:.1f} MiB"
            )
            schedule = Schedule(
                deadline=time.monotonic() + minutes * 60,
                warmed=threading.Barrier(args.agents + 1),
            )
            stats = [AgentStats() for _ in range(args.agents)]
            threads = [
                threading.Thread(
                    target=_agent,
                    args=(
                        runtime,
                        top,
                        greens[n % len(greens)],
                        n,
                        schedule,
                        stats[n],
                        args.files,
                        args.cycle_mib * MiB,
                    ),
                    daemon=True,
                )
                for n in range(args.agents)
            ]
            for thread in threads:
                thread.start()
            warm = _warm_start(schedule, client, runtime, started, args.interval)
            if warm is not None:
                _log(
                    f"warm start (every agent's first cycle done, deleted, gc): physical "
                    f"{warm.physical / MiB:.1f} MiB, counters {warm.counters / MiB:.1f} MiB"
                )
            shown = time.monotonic()
            while any(thread.is_alive() for thread in threads):
                time.sleep(1)
                if time.monotonic() - shown >= 30 and sampler.samples:
                    shown = time.monotonic()
                    last = sampler.samples[-1]
                    _log(
                        f"{last.at / 60:.1f} min: physical {last.physical / MiB:.0f} MiB, "
                        f"counters {last.counters / MiB:.0f} MiB, volumes {last.volumes}, "
                        f"cycles {sum(s.cycles for s in stats)}"
                    )
            for thread in threads:
                thread.join()
            end = _quiet_sample(client, runtime, started, args.interval)
            _log("agents done; collected")
            sampler.stop.set()
            sampler.join()
            samples = [*sampler.samples, end]
            trimmed = _trim_probe(runtime, client, started) if args.probe_trim else None
        title = (
            f"Slates soak: {args.agents} agents, {minutes:g} min, "
            f"{args.cycle_mib} MiB and {args.files} files per cycle"
        )
        print(title)
        _report(samples, cold, warm, end, stats)
        if trimmed is not None:
            print(
                f"after malloc_trim(0) in each shard (gdb): physical "
                f"{trimmed.physical / MiB:.1f} MiB, heap {trimmed.heap / MiB:.1f} MiB "
                f"(the rest of the end's heap was free memory malloc kept)"
            )
        print(_plot(samples, args.png, title, warm))
    finally:
        if sampler is not None:
            sampler.stop.set()
        if anchor is not None:
            stop_process(anchor, timeout=60)
        for mnt in top.glob("mnt-*"):
            if is_mounted(str(mnt)):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        if args.keep_runtime is not None:
            _keep_runtime(top, args.keep_runtime)
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
