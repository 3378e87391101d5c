"""How long `slates` commands take as a user types them: start-up, create, mount.

Theory of operation.  Each command is a fresh process started the way
bench/workspaces_bench.py starts its "first touch: create + mount" row
(subprocess, stdout captured, `--json`), so its time is a user's: the
interpreter's start-up, the imports, the request and the exit.  Beside the
commands: `python -c pass` and `python -c "import click"` (the floor every
command stands on; also with the garbage collector paused, as slates_cli
pauses it while a `slates` process imports), the same create and mount
through the SDK inside this process (the service's part alone), and the
commands under `-X importtime` (which modules a command loads, and what
each costs).  Each command's wall time comes with its CPU time (user +
system, from the children's rusage), which other engineers' load on a
shared host inflates far less; and each
mount with the anchor's own account of its wait (its log line: the checks,
the bridge from job to ready byte, the state file), with its largest and
the run's first (a shard's first ring connection can be the slow one).

Trees (--tree LABEL=DIR, repeatable; default the checkout this file is in):
each is a copy of `slates` and `slates_cli`, run through PYTHONPATH, with
its own anchor (spawn_anchor from that tree, two shards, as the workspaces
benchmark starts one), so an old and a new tree can be timed in the same
run.  Rounds interleave the trees and the commands, so a change in the
machine's load falls on all of them alike; the figures are the minimum
(what the code costs) and the median (what a user sees on this host) over
--rounds.  A create is timed with a fresh name and a mount on a fresh
empty directory; each round's volume is unmounted and deleted through the
SDK afterwards, and --settle seconds pass before each timed command (as
between two commands a user types, the anchor has its spare bridge ready).

Byte code: every module of a tree must have a current .pyc, or each
command compiles it again (PYTHONDONTWRITEBYTECODE=1, which the
development shell sets, keeps it from being written: 20-40 ms a command
on the host measured).  --compile writes them first (compileall);
otherwise stale modules are named and the run goes on.

Run: `python bench/cli_bench.py [--rounds 20] [--base DIR]
[--tree before=/tmp/old --tree after=.] [--compile]` (root, for mounts).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(CHECKOUT))

from slates.node.anchor import spawn_anchor, stop_process  # noqa: E402
from slates.sdk import Client  # noqa: E402

__all__ = ["main"]

PACKAGES = ("slates", "slates_cli")
SLATES = Path(sys.executable).parent / "slates"  # the console script a user runs


@dataclass(frozen=True, slots=True)
class Tree:
    label: str
    root: Path


@dataclass(slots=True)
class Running:
    """A tree's anchor and the directories its rounds use."""

    tree: Tree
    top: Path
    anchor: subprocess.Popen[bytes]
    env: dict[str, str]
    client: Client
    serial: int = 0

    @property
    def runtime(self) -> Path:
        return self.top / "run"

    def fresh(self) -> tuple[str, Path]:
        """A volume name and an empty mount directory never used before."""
        self.serial += 1
        directory = self.top / f"mnt-{self.serial}"
        directory.mkdir()
        return f"cli-bench-{self.serial}", directory


@dataclass(slots=True)
class Samples:
    values: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    order: list[str] = field(default_factory=list)

    def add(self, row: str, label: str, seconds: float) -> None:
        if row not in self.order:
            self.order.append(row)
        self.values[(row, label)].append(seconds)


def stale_modules(root: Path) -> list[str]:
    """Modules of `root`'s packages whose byte code is missing or older than the source."""
    stale = []
    for package in PACKAGES:
        for source in sorted((root / package).rglob("*.py")):
            cached = Path(importlib.util.cache_from_source(str(source)))
            if not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime:
                stale.append(str(source.relative_to(root)))
    return stale


def compile_tree(root: Path) -> None:
    for package in PACKAGES:
        compileall.compile_dir(str(root / package), quiet=1, force=False)


def run_json(command: Sequence[str | os.PathLike[str]], env: dict[str, str], cwd: Path) -> object:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, command))} exited with {done.returncode}:\n"
            + done.stderr.decode(errors="replace")[-2000:]
        )
    return json.loads(done.stdout) if done.stdout.strip().startswith((b"{", b"[")) else None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_json(
    command: Sequence[str | os.PathLike[str]],
    env: dict[str, str],
    cwd: Path,
    samples: Samples | None = None,
    row: str = "",
    label: str = "",
) -> tuple[float, object]:
    """Run a command: its wall seconds and its JSON answer; with `samples`, both its wall
    time and its CPU time (user + system, which another engineer's load inflates less)
    are added under `row`."""
    cpu = _children_cpu()
    started = time.perf_counter()
    answer = run_json(command, env, cwd)
    seconds = time.perf_counter() - started
    if samples is not None:
        samples.add(row, label, seconds)
        samples.add(f"{row} (CPU)", label, _children_cpu() - cpu)
    return seconds, answer


def cli(running: Running, *args: str | os.PathLike[str]) -> list[str | os.PathLike[str]]:
    return [SLATES, *args, "--runtime-dir", running.runtime, "--json"]


@contextlib.contextmanager
def started(tree: Tree, scratch: Path) -> Iterator[Running]:
    top = Path(tempfile.mkdtemp(prefix=f"{tree.label}-", dir=scratch))
    env = {
        **os.environ,
        "PYTHONPATH": str(tree.root),
        "HOME": str(top),
        "LC_ALL": "C",
    }
    env.pop("SLATES_TOKEN", None)
    log = open(top / "anchor.log", "wb")  # noqa: SIM115 (closed below)
    try:
        # From the tree's root: `python -m` puts the working directory first on the path,
        # ahead of PYTHONPATH, so the anchor, its shards and bridges run that tree's code.
        with contextlib.chdir(tree.root):
            anchor = spawn_anchor(top / "run", shards=2, capacity="8GiB", log=log, env=env)
    except BaseException:
        log.close()
        raise
    try:
        client = Client(top / "run", rings=False)
        try:
            client.status()  # every shard up: a create is not the anchor's start
            yield Running(tree, top, anchor, env, client)
        finally:
            for mount in client.mounts():
                with contextlib.suppress(Exception):
                    client.unmount(mount["directory"], force=True)
            client.close()
    finally:
        stop_process(anchor, timeout=30)
        log.close()


def undo(running: Running, volume: str, directory: Path | None) -> None:
    if directory is not None:
        running.client.unmount(directory, force=True)
    running.client.delete_volume(volume)


def one_round(running: Running, samples: Samples, base: str, settle: float) -> None:
    label, env, cwd = running.tree.label, running.env, running.top
    python = sys.executable
    commands: tuple[tuple[str, list[str | os.PathLike[str]]], ...] = (
        ("python -c pass", [python, "-c", "pass"]),
        ("python -c 'import click'", [python, "-c", "import click"]),
        ("... gc paused (as slates)", [python, "-c", "import gc; gc.disable(); import click"]),
        ("slates --help", [SLATES, "--help"]),
        ("slates status --json", cli(running, "status")),
    )
    for row, command in commands:
        time.sleep(settle)
        timed_json(command, env, cwd, samples, row, label)

    # As the workspaces benchmark: create, then mount, two commands.
    name, directory = running.fresh()
    time.sleep(settle)
    command = cli(running, "volume", "create", name, "--base", base)
    created_in, created = timed_json(command, env, cwd, samples, "volume create --base", label)
    if not isinstance(created, dict):
        raise RuntimeError(f"volume create answered {created!r}")
    time.sleep(settle)
    command = cli(running, "mount", str(created["id"]), directory)
    mounted_in, _ = timed_json(command, env, cwd, samples, "mount", label)
    samples.add("create, then mount (two commands)", label, created_in + mounted_in)
    undo(running, str(created["id"]), directory)

    # Back to back, as the benchmark's row runs them (no pause between).
    name, directory = running.fresh()
    time.sleep(settle)
    started_at = time.perf_counter()
    created = run_json(cli(running, "volume", "create", name, "--base", base), env, cwd)
    if not isinstance(created, dict):
        raise RuntimeError(f"volume create answered {created!r}")
    run_json(cli(running, "mount", str(created["id"]), directory), env, cwd)
    samples.add("create + mount, back to back", label, time.perf_counter() - started_at)
    undo(running, str(created["id"]), directory)

    name, directory = running.fresh()
    time.sleep(settle)
    command = cli(running, "volume", "create", name, "--base", base, "--mount", directory)
    row = "volume create --base --mount (one command)"
    _seconds, answer = timed_json(command, env, cwd, samples, row, label)
    if not isinstance(answer, dict):
        raise RuntimeError(f"volume create --mount answered {answer!r}")
    undo(running, str(answer["id"]), directory)

    # The service's part alone: the same calls through the SDK in this process.
    name, directory = running.fresh()
    time.sleep(settle)
    started_at = time.perf_counter()
    info = running.client.create_volume(name, base=base)
    samples.add("SDK create_volume (in process)", label, time.perf_counter() - started_at)
    time.sleep(settle)
    started_at = time.perf_counter()
    running.client.mount(str(info["id"]), directory)
    samples.add("SDK mount (in process)", label, time.perf_counter() - started_at)
    undo(running, str(info["id"]), directory)


def import_profile(running: Running, base: str, runs: int) -> list[tuple[str, float, float]]:
    """The modules `volume create` loads beyond click's, by median self time (ms):
    (module, self, cumulative)."""
    own: dict[str, list[int]] = defaultdict(list)
    total: dict[str, list[int]] = defaultdict(list)
    click_modules: set[str] = set()
    probe = [sys.executable, "-X", "importtime", "-c", "import click"]
    done = subprocess.run(probe, env=running.env, capture_output=True, text=True, check=True)
    for line in done.stderr.splitlines()[1:]:
        click_modules.add(line.rsplit("|", 1)[-1].strip())
    for _ in range(runs):
        name, _directory = running.fresh()
        command = [sys.executable, "-X", "importtime", str(SLATES)]
        command += [str(a) for a in cli(running, "volume", "create", name, "--base", base)[1:]]
        done = subprocess.run(command, env=running.env, capture_output=True, text=True, check=True)
        undo(running, str(json.loads(done.stdout)["id"]), None)
        for line in done.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            own_us, total_us, module = line.removeprefix("import time:").split("|")
            if module.strip() not in click_modules:
                own[module.strip()].append(int(own_us))
                total[module.strip()].append(int(total_us))
    rows = [
        (module, statistics.median(own[module]) / 1000, statistics.median(total[module]) / 1000)
        for module in own
    ]
    return sorted(rows, key=lambda row: -row[1])


_MOUNT_PHASES = re.compile(
    r"mounted .* \(bridge pid \d+; checks ([\d.]+) ms, bridge ready ([\d.]+) ms, "
    r"state file ([\d.]+) ms\)"
)


PHASES = ("checks", "bridge ready", "state file")


def mount_phases(running: Running) -> list[tuple[float, float, float]]:
    """The anchor's own account of each mount's wait (its log line, where it gives one):
    (checks, bridge ready, state file) in ms."""
    text = (running.top / "anchor.log").read_text(errors="replace")
    return [(float(a), float(b), float(c)) for a, b, c in _MOUNT_PHASES.findall(text)]


def report(samples: Samples, labels: list[str]) -> None:
    width = max(len(row) for row in samples.order) + 2
    head = "".join(f"{label + ' min / median':>24}" for label in labels)
    print(f"{'ms':<{width}}{head}")
    print("-" * (width + 24 * len(labels)))
    for row in samples.order:
        cells = []
        for label in labels:
            values = samples.values.get((row, label), [])
            if not values:
                cells.append(f"{'':>24}")
                continue
            low, middle = min(values) * 1000, statistics.median(values) * 1000
            cells.append(f"{f'{low:.1f} / {middle:.1f}':>24}")
        print(f"{row:<{width}}{''.join(cells)}")


def parse_tree(text: str) -> Tree:
    label, _, directory = text.rpartition("=")
    root = Path(directory).resolve()
    if not all((root / package).is_dir() for package in PACKAGES):
        raise argparse.ArgumentTypeError(f"{root} holds no slates and slates_cli")
    return Tree(label or root.name, root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--base", default="/tmp/trees/git", help="the volumes' base directory")
    parser.add_argument("--settle", type=float, default=0.3, help="seconds before each command")
    parser.add_argument("--tree", type=parse_tree, action="append", default=[])
    parser.add_argument("--compile", action="store_true", help="byte-compile each tree first")
    parser.add_argument("--imports", type=int, default=5, help="-X importtime runs (0: none)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root (it mounts)")
    if not os.path.isdir(args.base):
        parser.error(f"no base directory {args.base}")
    trees: list[Tree] = args.tree or [Tree("this", CHECKOUT)]
    if len({tree.label for tree in trees}) != len(trees):
        parser.error("give each --tree its own label")
    for tree in trees:
        if args.compile:
            compile_tree(tree.root)
        stale = stale_modules(tree.root)
        if stale:
            named = ", ".join(stale[:8]) + (" ..." if len(stale) > 8 else "")
            print(f"{tree.label}: no current byte code for {len(stale)} modules: {named}")
    scratch = Path(tempfile.mkdtemp(prefix="cli-bench-"))
    samples = Samples()
    loads = [os.getloadavg()[0]]
    try:
        with contextlib.ExitStack() as stack:
            running = [stack.enter_context(started(tree, scratch)) for tree in trees]
            for round_ in range(args.rounds):
                order = running if round_ % 2 == 0 else running[::-1]
                for each in order:
                    one_round(each, samples, args.base, args.settle)
            loads.append(os.getloadavg()[0])
            profiles = {each.tree.label: import_profile(each, args.base, args.imports)
                        for each in running if args.imports > 0}  # fmt: skip
            phases = {each.tree.label: mount_phases(each) for each in running}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.rounds} rounds, load average {loads[0]:.2f} -> {loads[-1]:.2f}, base {args.base}")
    report(samples, [tree.label for tree in trees])
    for label, measured in phases.items():
        if not measured:
            continue  # a tree whose anchor does not say
        print(f"\n{label}: the anchor's side of {len(measured)} mounts (its log), "
              "ms min / median / max, and the run's first mount")  # fmt: skip
        for name, column in zip(PHASES, zip(*measured, strict=True), strict=True):
            print(f"  {name:<14}{min(column):6.1f} / {statistics.median(column):.1f} / "
                  f"{max(column):.1f}   first {column[0]:.1f}")  # fmt: skip
    for label, rows in profiles.items():
        print(f"\n{label}: `volume create` imports beyond `import click`, median of "
              f"{args.imports} (-X importtime, ms self / cumulative; the top 15)")  # fmt: skip
        for module, own, total in rows[:15]:
            print(f"  {own:6.2f} {total:7.2f}  {module}")
        print(f"  {sum(own for _, own, _ in rows):6.2f}          all of them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
