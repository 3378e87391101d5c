"""The same workloads in five kinds of workspace over one source tree, side by side.

Providers, each made from the same source directory (a git repository):
  cp -a           a full copy on the source's file system
  git worktree    `git worktree add --detach` of the committed tree
  overlayfs       kernel overlayfs, upper and work directories on a tmpfs
  fuse-overlayfs  the Debian package's overlayfs in FUSE, upper on a tmpfs
  slates          a Slates work volume whose base is the live source
                  directory (read on demand), mounted through the bridge

Two suites (--suite; default both).  "first touch": each of these on a
workspace just created, so nothing of it is cached anywhere yet (the base
directory's own pages stay warm): create + mount (for Slates the two CLI
calls a user makes, `slates volume create` and `slates mount`); the first
git status (which refreshes the copied index); the first recursive grep; the first
`find` that stats every entry; each workspace is removed after its one
workload, and the figure is the median over --rounds fresh workspaces.
"full": the workloads below, in this order, in one workspace.

Workloads, in this order, in each workspace: creating it; stat and read of
every tracked file (the first pass after creating it, then warm); reading
the 64 MiB file; writing a new 64 MiB file (1 MiB writes of seeded random
bytes, then fsync; removed after each round); git status (the first one, which refreshes the copied
index; cold, after dropping the page cache, dentries and inodes; warm);
recursive grep (cold and warm); creating, then deleting, 2,000 small files;
a 2-byte edit in the middle of the 64 MiB file (time, and the bytes the
workspace holds because of it: for Slates the host's physical bytes, for the
others the disk or tmpfs blocks of the copy / upper layer); a clean build
of a multi-file C program with `make -j2`; a small pytest suite; the bytes
the workspace holds at the end; removing it.  Warm and cold figures are
medians of --rounds rounds; each workload's output is checked (the grep
match count, the build's program output, the pytest summary, the edited
bytes), so a fast wrong answer fails the run.

The source tree is generated (seeded): --files text files of 200 B to 8 KiB
in two levels of directories, the C program, the pytest suite and the
64 MiB file, committed and packed by git.  Or --tree DIR: a copy of DIR with
the same fixtures added (under slates-bench/) and committed; a real
repository's tree, e.g. `git --git-dir=... archive HEAD | tar -x -C DIR` of
git/git (4,847 files).

Run as root: `python bench/workspaces_bench.py [--files 5000] [--rounds 3]
[--tree DIR] [--suite first-touch] [--only overlayfs,fuse-overlayfs,slates]`;
bench/run_all.py runs this and the scaling benchmarks together.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import importlib.util
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import (
    Cleanup,
    MiB,
    Table,
    cpu_seconds,
    disk_usage,
    drop_caches,
    git_env,
    median,
    mount_overlay,
    mount_tmpfs,
    rss_bytes,
    run,
    spawn_fuse_overlayfs,
    timed,
    umount,
)

import slates
import slates_cli
from slates import Client
from slates.fuse.bridge import read_counters
from slates.node.anchor import is_mounted, spawn_anchor, stop_process
from slates.node.service import shard_of

__all__ = [
    "PROVIDERS",
    "SUITES",
    "Tree",
    "as_table",
    "make_tree",
    "run_workspaces",
    "slates_requests",
    "workspace_table",
]

PROVIDERS = ("cp -a", "git worktree", "overlayfs", "fuse-overlayfs", "slates")
SUITES = ("first-touch", "full")
BIG_SIZE = 64 * MiB
EDIT_AT = 32 * MiB + 1000  # two bytes inside one page, in the middle
SMALL_FILES = 2000
NEEDLE = "SLATES_BENCH_NEEDLE"
C_UNITS = 32
PY_MODULES = 8
PY_TESTS_PER_MODULE = 6  # each parametrized over 1 value + 5 more below
_PRINTABLE = (string.ascii_letters + string.digits + " " * 12 + "\n" * 2 + "(){};=+-*/,.").encode()
_TEXT = bytes(_PRINTABLE[b % len(_PRINTABLE)] for b in range(256))
_EXTENSIONS = (".c", ".h", ".py", ".md", ".txt")


@functools.cache
def new_file_payload() -> bytes:
    """The bytes of the new 64 MiB file: seeded, so every run writes the same."""
    return random.Random(64).randbytes(BIG_SIZE)


@dataclass
class Tree:
    """The source directory and what the workloads need to know about it."""

    root: Path
    tracked: list[str]  # every tracked file, relative
    fixtures: str  # relative directory holding cprog/, pyproj/, data/ ("" = the root)
    needle_lines: int  # lines grep must find
    pytest_count: int
    program_output: str
    size_bytes: int
    entries: int = 0  # what `find` lists outside .git (the root included)
    entry_bytes: int = 0  # the regular files' sizes it prints, added up

    def at(self, relative: str) -> str:
        return os.path.join(self.fixtures, relative) if self.fixtures else relative

    @property
    def big(self) -> str:
        return self.at("data/big.bin")


def _source_files(root: Path, files: int, rng: random.Random) -> int:
    """Seeded text files in src/aNN/bN/; returns how many lines hold the needle."""
    needles = 0
    for i in range(files):
        relative = f"src/a{i // 400:02}/b{(i // 40) % 10}/f{i:05}{_EXTENSIONS[i % 5]}"
        data = bytearray(rng.randbytes(rng.randint(200, 8192)).translate(_TEXT))
        if i % 50 == 7:
            at = len(data) // 2
            data[at:at] = f"\n{NEEDLE} {i}\n".encode()
            needles += 1
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(data))
    return needles


def _c_program(root: Path) -> None:
    """A C program of C_UNITS units and its Makefile."""
    (root / "src").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "units.h").write_text(
        "#ifndef UNITS_H\n#define UNITS_H\n"
        + "".join(f"long unit{u:02}(long x);\n" for u in range(C_UNITS))
        + "#endif\n"
    )
    for u in range(C_UNITS):
        (root / "src" / f"unit{u:02}.c").write_text(
            f"""#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "units.h"

struct acc{u} {{ long v[16]; }};

static long mix{u}(struct acc{u} *a, long x)
{{
    for (int i = 0; i < 16; i++) {{
        switch ((x + i) % 4) {{
        case 0: a->v[i] += x * {u + 3}; break;
        case 1: a->v[i] ^= x + {u}; break;
        case 2: a->v[i] -= x / {u + 1}; break;
        default: a->v[i] = a->v[i] * 3 + 1; break;
        }}
    }}
    long s = 0;
    for (int i = 0; i < 16; i++)
        s += a->v[i] % 1000;
    return s;
}}

long unit{u:02}(long x)
{{
    struct acc{u} a;
    memset(&a, 0, sizeof a);
    long s = 0;
    for (long k = 0; k < x; k++)
        s = (s + mix{u}(&a, k)) % 1000003;
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", s);
    return strtol(buf, NULL, 10) + {u};
}}
"""
        )
    (root / "src" / "main.c").write_text(
        '#include <stdio.h>\n#include "units.h"\n\nint main(void)\n{\n    long total = 0;\n'
        + "".join(f"    total += unit{u:02}(10);\n" for u in range(C_UNITS))
        + '    printf("total %ld\\n", total);\n    return 0;\n}\n'
    )
    (root / "Makefile").write_text(
        "CC ?= cc\nCFLAGS ?= -O2 -Wall\n"
        "SRCS := $(sort $(wildcard src/*.c))\nOBJS := $(SRCS:.c=.o)\n\n"
        "app: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n\n"
        "src/%.o: src/%.c include/units.h\n\t$(CC) $(CFLAGS) -Iinclude -c -o $@ $<\n\n"
        "clean:\n\trm -f app $(OBJS)\n\n.PHONY: clean\n"
    )


def _pytest_suite(root: Path) -> int:
    """A package and a pytest suite over it; returns the number of tests."""
    (root / "calc").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\npythonpath = .\n")
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "core.py").write_text(
        '"""Small functions for the benchmark\'s test suite."""\n\n\n'
        "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\n\n"
        "def primes(limit: int) -> list[int]:\n    sieve = [True] * (limit + 1)\n"
        "    out = []\n    for i in range(2, limit + 1):\n        if sieve[i]:\n"
        "            out.append(i)\n            for j in range(i * i, limit + 1, i):\n"
        "                sieve[j] = False\n    return out\n\n\n"
        "def words(text: str) -> dict[str, int]:\n    counts: dict[str, int] = {}\n"
        "    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
        "    return counts\n"
    )
    count = 0
    for m in range(PY_MODULES):
        lines = ["import pytest\n\nfrom calc.core import fib, primes, words\n\n"]
        for t in range(PY_TESTS_PER_MODULE):
            n = m * PY_TESTS_PER_MODULE + t
            lines.append(
                f"\n@pytest.mark.parametrize('k', [{n}, {n + 1}])\n"
                f"def test_{m}_{t}(k: int) -> None:\n"
                "    assert fib(k + 2) == fib(k + 1) + fib(k)\n"
                "    assert all(p > 1 for p in primes(50 + k))\n"
                "    assert words('a b a')['a'] == 2\n"
            )
            count += 2
        (root / "tests" / f"test_m{m}.py").write_text("".join(lines))
    return count


def make_tree(
    top: Path, files: int, seed: int, env: dict[str, str], from_dir: Path | None = None
) -> Tree:
    """The source repository under top/source (generated, or a copy of from_dir plus fixtures)."""
    root = top / "source"
    rng = random.Random(seed)
    needles = 0
    if from_dir is None:
        root.mkdir(parents=True)
        needles = _source_files(root, files, rng)
        fixtures = ""
    else:
        run(["cp", "-a", from_dir, root])
        # Git cannot hold an empty directory (an archived submodule leaves one), so a
        # git-worktree workspace would lack it: every kind starts from what git tracks.
        run(
            ["find", ".", "-depth", "-type", "d", "-empty", "-not", "-path", "./.git/*", "-delete"],
            root,
            env,
        )
        fixtures = "slates-bench"
        found = run(["grep", "-rIc", "--exclude-dir=.git", NEEDLE, "."], root, env, ok_codes=(0, 1))
        needles = sum(int(line.rsplit(":", 1)[1]) for line in found.splitlines())
    base = root / fixtures
    _c_program(base / "cprog")
    tests = _pytest_suite(base / "pyproj")
    (base / "data").mkdir(parents=True)
    (base / "data" / "big.bin").write_bytes(rng.randbytes(BIG_SIZE))
    (base / "data" / "notes.txt").write_text(f"{NEEDLE} one\nnothing\n{NEEDLE} two\n")
    needles += 2
    (base / ".gitignore").write_text("*.o\n/cprog/app\n__pycache__/\n.pytest_cache/\n")
    if (root / ".git").exists() and not (root / ".git").is_dir():
        (root / ".git").unlink()  # a worktree's or submodule's link: never commit through it
    if not (root / ".git").exists():
        run(["git", "init", "-q", "-b", "main"], root, env)
    run(["git", "add", "-A"], root, env)
    # No automatic gc after a large commit: it would race the explicit one below.
    commit = ["git", "-c", "gc.auto=0", "commit", "-q", "--no-verify", "-m", "benchmark tree"]
    run(commit, root, env)
    run(["git", "gc", "-q"], root, env)
    tracked = run(["git", "ls-files", "-z"], root, env).split("\0")
    # Regular files only (a --tree may track symlinks or submodules).
    tracked = [p for p in tracked if p and (root / p).is_file() and not (root / p).is_symlink()]
    # The program's expected output, from one build in a scratch copy.
    scratch = top / "cprog-check"
    shutil.copytree(base / "cprog", scratch)
    run(["make", "-s", "-j2"], scratch, env)
    output = run([scratch / "app"], scratch, env).strip()
    shutil.rmtree(scratch)
    size = sum((root / path).stat().st_size for path in tracked)
    entries, entry_bytes = find_stat(root, env)
    return Tree(root, tracked, fixtures, needles, tests, output, size, entries, entry_bytes)


def find_stat(root: Path, env: dict[str, str]) -> tuple[int, int]:
    """`find` over `root` outside .git, stat-ing every entry (type, size, inode, mtime):
    (entries, regular files' sizes added up; directory sizes differ between file systems)."""
    printf = "%y %s %i %T@\\n"
    out = run(["find", ".", "-path", "./.git", "-prune", "-o", "-printf", printf], root, env)
    fields = [line.split(" ", 2) for line in out.splitlines()]
    return len(fields), sum(int(size) for kind, size, _ in fields if kind == "f")


# -- providers ------------------------------------------------------------------------


class Provider:
    """One kind of workspace: create it at `self.path`, measure what it holds, remove it."""

    name = ""

    def __init__(self, top: Path, tree: Tree, env: dict[str, str], cleanup: Cleanup) -> None:
        self.top, self.tree, self.env, self.cleanup = top, tree, env, cleanup
        self.path = top / "ws" / self.name.replace(" ", "-")

    def prepare(self) -> None:
        """Whatever is set up once, outside the creation time (tmpfs, anchor)."""

    def before_create(self) -> None:
        """The benchmark's own bookkeeping before each creation, outside its time."""

    def create(self) -> None:
        raise NotImplementedError

    def private_bytes(self) -> int:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError

    def notes(self) -> dict[str, Any]:
        return {}

    def server_pids(self) -> dict[str, int]:
        """The processes serving the workspace, by the row label their CPU time gets."""
        return {}


class CopyProvider(Provider):
    name = "cp -a"

    def create(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cleanup.remove_tree(self.path)
        run(["cp", "-a", self.tree.root, self.path])

    def private_bytes(self) -> int:
        return disk_usage(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path)


class WorktreeProvider(Provider):
    name = "git worktree"

    def create(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        root, env = self.tree.root, self.env

        def undo() -> None:
            run(["git", "worktree", "remove", "--force", self.path], root, env, ok_codes=(0, 128))
            shutil.rmtree(self.path, ignore_errors=True)
            run(["git", "worktree", "prune"], root, env)

        self.cleanup.push(undo)
        run(["git", "worktree", "add", "-q", "--detach", self.path, "HEAD"], root, env)

    def private_bytes(self) -> int:
        admin = self.tree.root / ".git" / "worktrees" / self.path.name
        return disk_usage(self.path) + disk_usage(admin)

    def remove(self) -> None:
        run(["git", "worktree", "remove", "--force", self.path], self.tree.root, self.env)


class OverlayProvider(Provider):
    name = "overlayfs"

    def prepare(self) -> None:
        self.tmpfs = self.top / "tmpfs" / self.name
        mount_tmpfs(self.tmpfs, "8g", self.cleanup)
        self.upper, self.work = self.tmpfs / "upper", self.tmpfs / "work"

    def create(self) -> None:
        mount_overlay(self.tree.root, self.upper, self.work, self.path, self.cleanup)

    def private_bytes(self) -> int:
        return disk_usage(self.upper)

    def remove(self) -> None:
        umount(self.path)
        shutil.rmtree(self.upper)
        shutil.rmtree(self.work)


class FuseOverlayProvider(OverlayProvider):
    name = "fuse-overlayfs"

    def create(self) -> None:
        self.process = spawn_fuse_overlayfs(
            self.tree.root, self.upper, self.work, self.path, self.cleanup
        )

    def remove(self) -> None:
        umount(self.path)
        self.process.wait(timeout=30)
        shutil.rmtree(self.upper)
        shutil.rmtree(self.work)

    def notes(self) -> dict[str, Any]:
        return {"pid": self.process.pid}

    def server_pids(self) -> dict[str, int]:
        return {"FUSE server CPU": self.process.pid}


class SlatesProvider(Provider):
    name = "slates"

    def prepare(self) -> None:
        # The CLI calls are timed: byte code left stale by an edit (or never written,
        # under PYTHONDONTWRITEBYTECODE) would be compiled again in every one of them.
        for package in (slates, slates_cli):
            compileall.compile_dir(str(Path(str(package.__file__)).parent), quiet=1)
        self.runtime = self.top / "slates-run"
        log = open(self.top / "anchor.log", "wb")  # noqa: SIM115 (closed by the cleanup)
        self.cleanup.push(log.close)
        self.anchor = spawn_anchor(self.runtime, shards=2, capacity="8GiB", log=log)
        self.cleanup.push(lambda: stop_process(self.anchor, timeout=30))
        self.client = Client(self.runtime)
        self.cleanup.push(self.client.close)
        self.client.status()  # every shard started and connected: creation is not startup
        self.volume = ""
        self.shard = 0
        self.bridge_pid = 0
        self.baseline = 0
        self.before: dict[int, int] = {}
        self.shard_pid = 0
        self.rss_before = 0

    def _shard_status(self) -> dict[str, Any]:
        shard: dict[str, Any] = self.client.status()["shards"][self.shard]
        return shard

    def before_create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.before = {s["shard"]: s["host_physical_bytes"] for s in self.client.status()["shards"]}

    def cli(self, *args: str | Path) -> dict[str, Any]:
        """One `slates` command, as a user types it; its --json answer."""
        slates = Path(sys.executable).parent / "slates"
        where = ("--runtime-dir", str(self.runtime), "--json")
        answer: dict[str, Any] = json.loads(run([slates, *args, *where], self.top, self.env))
        return answer

    def create(self) -> None:
        # Two CLI calls, start-up included.  Nothing of the volume exists yet: which
        # shard will own it is known only after.
        volume = self.cli("volume", "create", "bench-workspace", "--base", self.tree.root)
        self.volume = str(volume["id"])
        self.cleanup.push(self._undo_volume)
        mounted = self.cli("mount", self.volume, self.path)
        self.bridge_pid = int(mounted["pid"])
        self.cleanup.push(self._undo_mount)
        self.shard = shard_of(self.volume)
        self.baseline = self.before[self.shard]

    def _undo_volume(self) -> None:
        if self.volume in {v["id"] for v in self.client.list_volumes()}:
            self.client.delete_volume(self.volume)

    def _undo_mount(self) -> None:
        if is_mounted(str(self.path)):
            self.client.unmount(self.path, force=True)

    def after_create(self) -> None:
        status = self._shard_status()
        self.shard_pid = int(status["pid"])
        self.rss_before = rss_bytes(self.shard_pid)

    def private_bytes(self) -> int:
        return int(self._shard_status()["host_physical_bytes"]) - self.baseline

    def server_pids(self) -> dict[str, int]:
        return {
            "FUSE server CPU": self.bridge_pid,
            "shard CPU": int(self._shard_status()["pid"]),
        }

    def remove(self) -> None:
        self.client.unmount(self.path)
        self.client.delete_volume(self.volume)

    def notes(self) -> dict[str, Any]:
        return {
            "volume": self.volume,
            "shard_pid": self.shard_pid,
            "shard_rss_growth": rss_bytes(self.shard_pid) - self.rss_before,
        }


PROVIDER_CLASSES: tuple[type[Provider], ...] = (
    CopyProvider,
    WorktreeProvider,
    OverlayProvider,
    FuseOverlayProvider,
    SlatesProvider,
)


def slates_requests(runtime: Path) -> Counter[str]:
    """Every bridge's counters in a runtime directory, added up: kernel requests by
    opcode name, and round_trips (requests a shard answered)."""
    total: Counter[str] = Counter()
    for path in runtime.glob("counters-*"):
        total.update(read_counters(path))
    return total


# -- workloads ------------------------------------------------------------------------


class Failed(RuntimeError):
    """A workload's result was wrong."""


@dataclass
class Results:
    values: dict[str, dict[str, float]] = field(default_factory=dict)  # provider -> row -> value
    units: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    requests: dict[str, Counter[str]] = field(default_factory=dict)  # Slates: row -> counters
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def put(self, provider: str, row: str, unit: str, value: float) -> None:
        if row not in self.units:
            self.units[row] = unit
            self.order.append(row)
        self.values.setdefault(provider, {})[row] = value


class Runner:
    def __init__(
        self,
        provider: Provider,
        tree: Tree,
        results: Results,
        rounds: int,
        log: Callable[[str], None],
        settle: float = 0.0,
    ) -> None:
        self.p, self.tree, self.results, self.rounds, self.log = (
            provider,
            tree,
            results,
            rounds,
            log,
        )
        self.settle = settle  # seconds between the mount and a first-touch workload
        self.ws = str(provider.path)
        self.paths = [os.path.join(self.ws, rel) for rel in tree.tracked]
        big = os.path.join(self.ws, tree.big)
        self.small = [p for p in self.paths if p != big]
        self.big = big
        self.write_payload = new_file_payload()

    def requests(self) -> Counter[str]:
        runtime = getattr(self.p, "runtime", None)
        return slates_requests(runtime) if runtime is not None else Counter()

    def put(self, row: str, unit: str, value: float, requests: Counter[str] | None = None) -> None:
        self.results.put(self.p.name, row, unit, value)
        if requests is not None and isinstance(self.p, SlatesProvider):
            self.results.requests[row] = requests

    def record(self, row: str, unit: str, action: Callable[[], float]) -> float:
        before = self.requests()
        value = action()
        self.put(row, unit, value, self.requests() - before)
        return value

    def repeat(self, row: str, action: Callable[[], object], *, cold: bool = False) -> float:
        def measure() -> float:
            samples = []
            for _ in range(self.rounds):
                if cold:
                    drop_caches()
                samples.append(timed(action))
            return median(samples)

        return self.record(row, "s", measure)

    # The workloads themselves.

    def stat_all(self) -> None:
        for path in self.paths:
            os.stat(path)

    def read_all(self) -> None:
        total = 0
        for path in self.small:
            fd = os.open(path, os.O_RDONLY)
            try:
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
            finally:
                os.close(fd)
        if total != self.tree.size_bytes - BIG_SIZE:
            raise Failed(f"{self.p.name}: read {total} bytes")

    def read_big(self) -> None:
        total = 0
        with open(self.big, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
        if total != BIG_SIZE:
            raise Failed(f"{self.p.name}: read {total} bytes of the 64 MiB file")

    def write_new_big(self) -> None:
        """Write a new 64 MiB file (1 MiB writes), fsync it, check its size, remove it."""
        name = os.path.join(self.ws, "slates-bench-new.bin")
        payload = self.write_payload
        with open(name, "xb", buffering=0) as f:
            for at in range(0, BIG_SIZE, 1 << 20):
                f.write(payload[at : at + (1 << 20)])
            os.fsync(f.fileno())
        if os.stat(name).st_size != BIG_SIZE:
            raise Failed(f"{self.p.name}: the new 64 MiB file has the wrong size")

    def timed_write_new_big(self) -> float:
        name = os.path.join(self.ws, "slates-bench-new.bin")
        try:
            return timed(self.write_new_big)
        finally:
            os.unlink(name)

    def git_status(self) -> None:
        out = run(["git", "status", "--porcelain"], self.p.path, self.p.env)
        if out.strip():
            raise Failed(f"{self.p.name}: git status is not clean:\n{out[:500]}")

    def grep(self) -> None:
        out = run(["grep", "-rIn", "--exclude-dir=.git", NEEDLE, "."], self.p.path, self.p.env)
        found = len(out.splitlines())
        if found != self.tree.needle_lines:
            raise Failed(f"{self.p.name}: grep found {found}, expected {self.tree.needle_lines}")

    def find(self) -> None:
        found = find_stat(self.p.path, self.p.env)
        if found != (self.tree.entries, self.tree.entry_bytes):
            raise Failed(
                f"{self.p.name}: find saw {found}, expected "
                f"{(self.tree.entries, self.tree.entry_bytes)}"
            )

    def first_touch(self) -> None:
        """Each workload once on a workspace just created (then removed), --rounds times."""
        p, log = self.p, self.log
        p.prepare()
        workloads: tuple[tuple[str, Callable[[], None]], ...] = (
            ("first touch: git status", self.git_status),
            ("first touch: grep -r", self.grep),
            ("first touch: find, stat every entry", self.find),
        )
        creates: list[float] = []
        create_requests: Counter[str] = Counter()
        for row, action in workloads:
            samples: list[float] = []
            cpu: dict[str, list[float]] = {}
            requests: Counter[str] = Counter()
            for _ in range(self.rounds):
                p.before_create()
                before = self.requests()
                creates.append(timed(p.create))
                create_requests += self.requests() - before
                time.sleep(self.settle)  # an agent's first command, a moment later
                pids = p.server_pids()
                cpu_before = {label: cpu_seconds(pid) for label, pid in pids.items()}
                before = self.requests()
                samples.append(timed(action))
                requests += self.requests() - before
                for label, pid in pids.items():
                    cpu.setdefault(label, []).append(cpu_seconds(pid) - cpu_before[label])
                p.remove()
            self.put(row, "s", median(samples), requests)
            for label in ("FUSE server CPU", "shard CPU"):
                if label in cpu:
                    self.put(f"  {label}, {row.split(': ', 1)[1]}", "s", median(cpu[label]))
            log(f"  {p.name}: {row} done")
        self.put("first touch: create + mount", "s", median(creates), create_requests)

    def small_files(self, round_: int) -> tuple[float, float, Counter[str], Counter[str]]:
        """(seconds to create, seconds to delete, requests for each) for SMALL_FILES files."""
        scratch = os.path.join(self.ws, f"scratch-{round_}")
        payload = b"x" * 100
        names = [os.path.join(scratch, f"f{i:04}.txt") for i in range(SMALL_FILES)]
        first = self.requests()
        started = time.perf_counter()
        os.mkdir(scratch)
        for name in names:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, payload)
            os.close(fd)
        created = time.perf_counter() - started
        second = self.requests()
        if len(os.listdir(scratch)) != SMALL_FILES:
            raise Failed(f"{self.p.name}: created files missing")
        third = self.requests()
        started = time.perf_counter()
        for name in names:
            os.unlink(name)
        os.rmdir(scratch)
        deleted = time.perf_counter() - started
        return created, deleted, second - first, self.requests() - third

    def edit_big(self) -> None:
        with open(self.big, "r+b", buffering=0) as f:
            f.seek(EDIT_AT)
            f.write(b"xy")

    def build(self) -> None:
        cprog = os.path.join(self.ws, self.tree.at("cprog"))
        run(["make", "-s", "-j2"], Path(cprog), self.p.env)

    def check_build(self) -> None:
        cprog = Path(self.ws, self.tree.at("cprog"))
        output = run([cprog / "app"], cprog, self.p.env).strip()
        if output != self.tree.program_output:
            raise Failed(f"{self.p.name}: the program printed {output!r}")
        run(["make", "-s", "clean"], cprog, self.p.env)

    def pytest(self) -> None:
        pyproj = Path(self.ws, self.tree.at("pyproj"))
        out = run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], pyproj, self.p.env
        )
        if f"{self.tree.pytest_count} passed" not in out:
            raise Failed(f"{self.p.name}: pytest said {out[-300:]}")

    def all(self) -> None:
        p, log = self.p, self.log
        p.prepare()
        p.before_create()
        self.record("create workspace", "s", lambda: timed(p.create))
        if isinstance(p, SlatesProvider):
            p.after_create()
        log(f"  {p.name}: created")
        self.record("stat every file, first pass", "s", lambda: timed(self.stat_all))
        self.repeat("stat every file, warm", self.stat_all)
        self.record("read every file, first pass", "s", lambda: timed(self.read_all))
        self.repeat("read every file, warm", self.read_all)
        self.repeat("read the 64 MiB file", self.read_big)
        self.record(
            "write a new 64 MiB file (fsync)",
            "s",
            lambda: median([self.timed_write_new_big() for _ in range(self.rounds)]),
        )
        self.record("git status, first (index refresh)", "s", lambda: timed(self.git_status))
        self.repeat("git status, cold", self.git_status, cold=True)
        self.repeat("git status, warm", self.git_status)
        self.repeat("grep -r, cold", self.grep, cold=True)
        self.repeat("grep -r, warm", self.grep)
        log(f"  {p.name}: read-only workloads done")
        created: list[float] = []
        deleted: list[float] = []
        create_requests: Counter[str] = Counter()
        delete_requests: Counter[str] = Counter()
        for round_ in range(self.rounds):
            c, d, rc, rd = self.small_files(round_)
            created.append(c)
            deleted.append(d)
            create_requests += rc
            delete_requests += rd
        self.put("create 2,000 small files", "s", median(created), create_requests)
        self.put("delete 2,000 small files", "s", median(deleted), delete_requests)
        before = p.private_bytes()
        self.record("2-byte edit in the 64 MiB file", "s", lambda: timed(self.edit_big))
        added = p.private_bytes() - before
        self.put("  bytes held because of the edit", "MiB", added / MiB)
        with open(self.big, "rb") as f:
            f.seek(EDIT_AT - 1)
            if f.read(4)[1:3] != b"xy":
                raise Failed(f"{p.name}: the edit is not there")
        samples: list[float] = []
        requests: Counter[str] = Counter()
        for _ in range(self.rounds):
            counted = self.requests()
            samples.append(timed(self.build))
            requests += self.requests() - counted
            self.check_build()
        self.put("make -j2, clean build", "s", median(samples), requests)
        self.repeat(f"pytest, {self.tree.pytest_count} tests", self.pytest)
        self.put("bytes the workspace holds at the end", "MiB", p.private_bytes() / MiB)
        self.results.notes[p.name] = p.notes()
        log(f"  {p.name}: writing workloads done")
        self.record("remove workspace", "s", lambda: timed(p.remove))


def run_workspaces(
    top: Path,
    tree: Tree,
    env: dict[str, str],
    rounds: int,
    cleanup: Cleanup,
    log: Callable[[str], None],
    only: tuple[str, ...] = PROVIDERS,
    suites: tuple[str, ...] = SUITES,
    settle: float = 0.0,
) -> Results:
    results = Results()
    for suite in SUITES:
        if suite not in suites:
            continue
        for cls in PROVIDER_CLASSES:
            if cls.name not in only:
                continue
            with cleanup.scope() as scope:
                provider = cls(top, tree, env, scope)
                runner = Runner(provider, tree, results, rounds, log, settle)
                if suite == "first-touch":
                    runner.first_touch()
                else:
                    runner.all()
    return results


def as_table(results: Results) -> Table:
    columns = [p for p in PROVIDERS if p in results.values]
    table = Table(
        "Workspaces: one source tree, the same workloads in each\n"
        "(cold = after sync and drop_caches; bytes held: Slates the host's physical bytes, "
        "the others the disk or tmpfs blocks of the copy / upper layer)",
        columns,
        [],
        "workspaces",
    )
    for row in results.order:
        table.add(row, results.units[row], [results.values[p].get(row) for p in columns])
    return table


def workspace_table(results: Results) -> str:
    """The figures, their ratios to the overlays, and the Slates bridge's request counts."""
    table = as_table(results)
    ratios = [c for c in ("overlayfs", "fuse-overlayfs") if c in table.columns]
    text = table.render(ratio_to=ratios)
    if results.requests:
        lines = [
            "",
            "",
            "Slates: requests the bridge sent the shard per workload (all rounds), "
            "and the most frequent kernel requests",
        ]
        for row in results.order:
            if row in results.requests:
                counts = results.requests[row]
                ops = [
                    f"{op} {n:,}"
                    for op, n in counts.most_common()
                    if op
                    not in ("round_trips", "reconnects", "failed", "clean_reads", "clean_misses")
                ]
                top = ", ".join(ops[:4])
                lines.append(f"  {row:<40}{counts['round_trips']:>8,}  {top}")
        text += "\n".join(lines)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--tree", type=Path, default=None, help="use a copy of this directory")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default=",".join(PROVIDERS))
    parser.add_argument("--suite", default=",".join(SUITES), help="first-touch, full, or both")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds between a fresh workspace's mount and its first-touch workload "
        "(default 0: the instant the mount returns)",
    )
    args = parser.parse_args()
    suites = tuple(args.suite.split(","))
    if not set(suites) <= set(SUITES):
        parser.error(f"--suite: choose from {', '.join(SUITES)}")
    if os.geteuid() != 0:
        parser.error("run as root (mounts and drop_caches)")
    began = time.monotonic()
    cleanup = Cleanup()
    top = Path(tempfile.mkdtemp(prefix="slates-ws-bench-"))
    cleanup.remove_tree(top)
    try:
        env = git_env(top)
        tree = make_tree(top, args.files, args.seed, env, args.tree)
        print(f"tree: {len(tree.tracked):,} tracked files, {tree.size_bytes / MiB:.1f} MiB")
        if args.settle:
            print(f"first touch {args.settle:g} s after each mount returns")
        results = run_workspaces(
            top,
            tree,
            env,
            args.rounds,
            cleanup,
            print,
            tuple(args.only.split(",")),
            suites,
            args.settle,
        )
    finally:
        cleanup.close()
    print(workspace_table(results))
    print(f"finished in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
