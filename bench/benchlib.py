"""Helpers shared by the side-by-side benchmarks (workspaces_bench, scaling_bench, run_all).

Nothing here measures anything by itself: running commands, dropping the
page cache, mounting and unmounting what a benchmark made (always undone by
the Cleanup stack, whatever happens), measuring disk and process memory, and
printing tables with ratios.  Requires root (mounts, drop_caches).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slates.node.anchor import is_mounted

__all__ = [
    "Cleanup",
    "Table",
    "cpu_seconds",
    "disk_usage",
    "drop_caches",
    "fmt_bytes",
    "git_env",
    "median",
    "mount_overlay",
    "mounts_under",
    "mount_tmpfs",
    "pss_bytes",
    "rss_bytes",
    "run",
    "spawn_fuse_overlayfs",
    "timed",
    "umount",
    "wait_mounted",
]

MiB = 1 << 20


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def timed(action: Callable[[], object]) -> float:
    """Seconds `action` took (wall clock)."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def git_env(home: Path) -> dict[str, str]:
    """An environment in which git ignores the machine's and the user's configuration."""
    return {
        **os.environ,
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "bench",
        "GIT_AUTHOR_EMAIL": "bench@example.invalid",
        "GIT_COMMITTER_NAME": "bench",
        "GIT_COMMITTER_EMAIL": "bench@example.invalid",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "LC_ALL": "C",
    }


def run(
    command: Sequence[str | os.PathLike[str]],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    *,
    ok_codes: tuple[int, ...] = (0,),
    timeout: float = 600.0,
) -> str:
    """Run a command to completion; its stdout, or RuntimeError with its stderr."""
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode not in ok_codes:
        raise RuntimeError(
            f"{' '.join(str(p) for p in command)} exited with {done.returncode} in {cwd}:\n"
            + done.stderr.decode(errors="replace")[-2000:]
            + done.stdout.decode(errors="replace")[-1000:]
        )
    return done.stdout.decode(errors="replace")


def drop_caches() -> None:
    """Write back, then drop the page cache, dentries and inodes (every file system)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_usage(path: Path) -> int:
    """Bytes allocated under `path` (st_blocks, each inode once), like `du -s --block-size=1`."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _status_field(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    return _status_field(pid, "VmRSS")


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages divided among the processes that map them."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:.2f}"


def wait_mounted(path: Path, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not is_mounted(str(path)):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the file system for {path} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} was not mounted within {timeout} s")
        time.sleep(0.0005)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mounts)."""
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 1:
                point = fields[1].replace("\\040", " ")
                if point == prefix or point.startswith(prefix + "/"):
                    found.append(point)
    return found


def umount(path: Path) -> None:
    """Unmount if mounted; lazily if busy (never leaves a mount behind)."""
    if not is_mounted(str(path)):
        return
    done = subprocess.run(["umount", str(path)], capture_output=True, check=False)
    if done.returncode != 0 and is_mounted(str(path)):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def mount_tmpfs(path: Path, size: str, cleanup: Cleanup) -> None:
    path.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path])
    cleanup.push(lambda: umount(path))


def mount_overlay(lower: Path, upper: Path, work: Path, merged: Path, cleanup: Cleanup) -> None:
    """Kernel overlayfs (the caller made upper and work on one file system)."""
    for directory in (upper, work, merged):
        directory.mkdir(parents=True, exist_ok=True)
    run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={lower},upperdir={upper},workdir={work}",
            merged,
        ]
    )
    cleanup.push(lambda: umount(merged))


def spawn_fuse_overlayfs(
    lower: Path,
    upper: Path,
    work: Path,
    merged: Path,
    cleanup: Cleanup,
    *,
    timeout: float | None = None,
) -> subprocess.Popen[bytes]:
    """fuse-overlayfs in the foreground (so we own its pid), returned once mounted.

    timeout=0 sets its kernel entry and attribute timeouts to 0 (caching off).
    """
    for directory in (upper, work, merged):
        directory.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if timeout is not None:
        options += f",timeout={timeout:g}"
    process = subprocess.Popen(
        ["fuse-overlayfs", "-f", "-o", options, str(merged)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        if is_mounted(str(merged)):
            subprocess.run(["fusermount3", "-u", str(merged)], capture_output=True, check=False)
        if is_mounted(str(merged)):
            subprocess.run(["fusermount3", "-u", "-z", str(merged)], capture_output=True)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    cleanup.push(stop)
    wait_mounted(merged, process, 30)
    return process


class Cleanup:
    """A stack of undo actions, run newest first; every one runs even if another fails."""

    def __init__(self) -> None:
        self._actions: list[Callable[[], object]] = []

    def push(self, action: Callable[[], object]) -> Callable[[], object]:
        self._actions.append(action)
        return action

    def run_one(self, action: Callable[[], object]) -> None:
        """Run one pushed action now (and forget it)."""
        self._actions.remove(action)
        action()

    def close(self) -> None:
        errors: list[BaseException] = []
        while self._actions:
            action = self._actions.pop()
            try:
                action()
            except Exception as exc:  # keep undoing the rest
                errors.append(exc)
        if errors:
            raise RuntimeError(f"cleanup failed: {errors!r}")

    def remove_tree(self, path: Path) -> None:
        """Remove `path` at cleanup, after detaching anything still mounted under it."""

        def remove() -> None:
            for mountpoint in sorted(mounts_under(path), reverse=True):
                subprocess.run(["umount", "-l", mountpoint], capture_output=True, check=False)
            shutil.rmtree(path, ignore_errors=True)

        self.push(remove)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Cleanup]:
        inner = Cleanup()
        try:
            yield inner
        finally:
            inner.close()


@dataclass
class Table:
    """Rows of figures under named columns, printed with ratio tables to chosen columns."""

    title: str
    columns: list[str]
    rows: list[tuple[str, str, list[float | None]]]  # (label, unit, one value per column)
    name: str = ""  # a short name for summaries

    def add(self, label: str, unit: str, values: Sequence[float | None]) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"{label}: {len(values)} values for {len(self.columns)} columns")
        self.rows.append((label, unit, list(values)))

    def render(self, ratio_to: Sequence[str] = (), digits: int = 3) -> str:
        width = max([len(c) for c in self.columns] + [9]) + 2
        label_w = max([len(r[0]) for r in self.rows] + [8]) + 1
        unit_w = max([len(r[1]) for r in self.rows] + [4]) + 1
        lines = [self.title]

        def header(extra: str) -> str:
            return (
                f"{'':<{label_w}}{extra:<{unit_w}}" + "".join(f"{c:>{width}}" for c in self.columns)
            ).rstrip()

        lines.append(header("unit"))
        lines.append("-" * (label_w + unit_w + width * len(self.columns)))
        for label, unit, values in self.rows:
            cells = "".join(_cell(v, width, digits) for v in values)
            lines.append(f"{label:<{label_w}}{unit:<{unit_w}}{cells}")
        for target in ratio_to:
            index = self.columns.index(target)
            lines.append("")
            lines.append(f"ratio to {target} (value / {target} value; below 1 = less)")
            lines.append(header(""))
            lines.append("-" * (label_w + unit_w + width * len(self.columns)))
            for label, _unit, values in self.rows:
                base = values[index]
                cells = "".join(_cell(_ratio(v, base), width, 2, suffix="x") for v in values)
                lines.append(f"{label:<{label_w}}{'':<{unit_w}}{cells}")
        return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    if base == 0:
        return None if value != 0 else 1.0
    return value / base


def _cell(value: float | None, width: int, digits: int, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'n/a':>{width}}"
    text = f"{value:,.{digits}f}{suffix}" if abs(value) < 1e6 else f"{value:,.0f}{suffix}"
    if len(text) >= width:
        text = f"{value:.3g}{suffix}"
    return f"{text:>{width}}"
