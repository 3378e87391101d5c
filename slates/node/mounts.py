"""Mount bridges as the anchor starts them: fresh, or the spare it keeps ready.

Theory of operation (issue 14, lever 5).  A mount waits for its bridge
process (slates.fuse.bridge), and a fresh interpreter's start-up and imports
cost more than the mount itself.  So the anchor keeps one spare: a bridge
started with `--spare`, which does its imports, ties its life to the anchor
and reads the spin calibration with no job, then waits for one JSON line (a
MountJob) on its stdin.  A mount writes its job there instead of starting a
process, then waits for the bridge's ready byte exactly as for a fresh
bridge; the anchor starts the next spare after it has answered.

A spare's start-up (an interpreter and its imports, 50-80 ms of CPU) would
run exactly when the agent's first command does: the next spare is started
the moment a mount returns.  On a two-CPU host that made a git status started
at that instant 10-15% slower (bench/RESULTS.md).  So a spare starts
deferred: at SCHED_IDLE, taking only CPU time nobody else wants, until it is
given a job or SPARE_DEFER_SECONDS pass, whichever is first; then it runs at
normal priority (`resume`), so a host kept busy (builds) delays it by that
bound and no more.  Raising a thread out of SCHED_IDLE needs CAP_SYS_NICE, so
an anchor without it starts spares at normal priority, as before.  The spare
is one thread until its job (its loop threads start after), and a thread
inherits its creator's policy, so the one call on its pid covers them all.

This module owns the bridges' processes and the facts the anchor reads
about them from /proc; the anchor (slates.node.anchor) owns the decisions:
which bridge serves which mount, when a spare is made, restarted or let go.

Invariants:
- a spare holds nothing of a mount or a shard: it is started with only its
  ready pipe, its job pipe and its log (close_fds), never connects to a
  shard before its job, and its argv names no mount point, so it never
  counts as a user of a mount, and a shard restart never waits for it;
- a spare has no file in the runtime directory: its log is unnamed until
  it serves a mount (then it is that mount's log) or dies saying something;
- a spare's job line is what slates.fuse.bridge.parse_mount_job accepts
  (`BridgeJob.line`; tests/test_anchor_spare.py checks it);
- the agent's token travels in the job or in the environment of a fresh
  bridge, never in argv, and a spare's environment has none;
- `is_bridge`, `orphan_bridges`, `users_of` and `exited_unreaped` read /proc
  only: they never stat a mount point (that asks the bridge, which may wait
  for a shard only the anchor's loop can restart).

A bridge killed with SIGKILL normally takes its FUSE connection with it:
closing its /dev/fuse fd aborts the connection, programs inside the mount get
ENOTCONN, and `clean_mountpoint` detaches the dead mount so the anchor can
mount the volume again there.  Not so when one of its threads waits on its
own mount (a request only its dead threads would answer): the process never
finishes exiting, so the fd stays open and the mount hangs.
`exited_unreaped` tells such a bridge from a live one, and `abort_mount`
aborts its connection (a forced, lazy unmount), which ends that wait.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slates.errors import SlatesError, error_from_wire

__all__ = [
    "BRIDGE_MODULE",
    "Bridge",
    "BridgeJob",
    "Spare",
    "abort_mount",
    "bridge_error",
    "clean_mountpoint",
    "exited_unreaped",
    "give_job",
    "is_bridge",
    "is_mounted",
    "let_go",
    "orphan_bridges",
    "resume",
    "retire_files",
    "start_bridge",
    "start_spare",
    "users_of",
]

BRIDGE_MODULE = "slates.fuse.bridge"
TOKEN_ENV = "SLATES_TOKEN"
SPARE_STOP_SECONDS = 10.0  # a spare waiting for its job ends at once on SIGTERM
SPARE_DEFER_SECONDS = 0.5  # a spare's start-up yields to everything else this long
CAP_SYS_NICE = 23


@dataclasses.dataclass(frozen=True, slots=True)
class Bridge:
    """A bridge process that was given its mount, and our end of its --ready-fd."""

    process: subprocess.Popen[bytes]
    ready: int  # read end: b"1" once the mount serves, EOF if it failed
    log: Path  # its stderr
    from_spare: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Spare:
    """A started bridge without a job yet (its stdin is the job pipe).

    Its stderr is an unnamed file in the runtime directory (O_TMPFILE, held by
    `log_fd`) that gets the name `log` once the spare serves a mount, or dies
    saying something: a spare leaves no file behind.  -1 where the file system
    has no unnamed files: then `log` exists from the start."""

    process: subprocess.Popen[bytes]
    ready: int
    log: Path
    log_fd: int = -1
    deferred_until: float = 0.0  # monotonic; its start-up is at SCHED_IDLE until then (0: not)


@dataclasses.dataclass(frozen=True, slots=True)
class BridgeJob:
    """One mount as a bridge is asked to serve it: by a spare's job line, or by a fresh
    bridge's arguments (the same fields, so either serves the mount the same way)."""

    volume: str
    mountpoint: str
    counters: Path
    writeback: bool = False
    allow_other: bool = False
    token: str | None = None  # an agent's mount: its bridge acts as that agent

    def line(self) -> bytes:
        """The MountJob line a spare reads (slates.fuse.bridge.parse_mount_job)."""
        job = {
            "volume": self.volume,
            "mountpoint": self.mountpoint,
            "counters": str(self.counters),
            "writeback": self.writeback,
            "allow_other": self.allow_other,
            "token": self.token,
        }
        return json.dumps(job).encode() + b"\n"

    def arguments(self) -> list[str]:
        """A fresh bridge's argv for this job (the token goes in its environment)."""
        return [
            "--volume", self.volume,
            "--mountpoint", self.mountpoint,
            "--counters", str(self.counters),
            *([] if self.writeback else ["--no-writeback-cache"]),
            *(["--allow-other"] if self.allow_other else []),
        ]  # fmt: skip


def _environment(token: str | None) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token is not None:
        environment[TOKEN_ENV] = token
    return environment


def _open_log(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)


def _unnamed_log(directory: Path) -> int:
    """An unnamed file in `directory` (it vanishes with its last fd unless linked), or -1
    where the file system cannot make one."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        return -1


def _name_log(spare: Spare) -> None:
    """Give the spare's unnamed log its name (once: the caller drops the Spare)."""
    if spare.log_fd < 0:
        return
    try:
        # Should this fail, the mount serves all the same; only its diagnostics are lost.
        with contextlib.suppress(OSError):
            directory = os.open(spare.log.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                # A dir fd makes os.link call linkat(AT_SYMLINK_FOLLOW), which links
                # the unnamed file itself; plain link(2) would not follow /proc's link.
                os.link(
                    f"/proc/self/fd/{spare.log_fd}",
                    spare.log.name,
                    dst_dir_fd=directory,
                    follow_symlinks=True,
                )
            finally:
                os.close(directory)
    finally:
        os.close(spare.log_fd)


def _can_resume() -> bool:
    """Whether this process may raise a thread out of SCHED_IDLE (CAP_SYS_NICE)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


def _defer(process: subprocess.Popen[bytes]) -> float:
    """Put a spare just started at SCHED_IDLE: the monotonic time until which it stays
    so, or 0.0 when it runs at normal priority (it could not be raised again, or the
    call failed: deferring is only a matter of speed)."""
    if not _can_resume():
        return 0.0
    try:
        os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return 0.0
    return time.monotonic() + SPARE_DEFER_SECONDS


def resume(spare: Spare, *, now: float | None = None) -> Spare:
    """The spare at normal priority if it is deferred and due (`now` past its deadline;
    None: at once, as when it gets its job), else the spare unchanged."""
    if spare.deferred_until == 0.0 or (now is not None and now < spare.deferred_until):
        return spare
    with contextlib.suppress(ProcessLookupError):  # it died: its poll will say so
        os.sched_setscheduler(spare.process.pid, os.SCHED_OTHER, os.sched_param(0))
    return dataclasses.replace(spare, deferred_until=0.0)


def start_spare(runtime: Path, log: Path) -> Spare:
    """Start a spare bridge of `runtime`, deferred (see the module's docstring); it
    waits for its job on its stdin.  `log` is the name its stderr gets once it serves
    (or dies saying why)."""
    log_fd = _unnamed_log(runtime)
    ready_read, ready_write = os.pipe()
    command = [
        sys.executable, "-m", BRIDGE_MODULE, "--spare",
        "--runtime-dir", str(runtime),
        "--ready-fd", str(ready_write),
    ]  # fmt: skip
    try:
        stderr = log_fd if log_fd >= 0 else _open_log(log)
        try:
            process = subprocess.Popen(
                command,
                pass_fds=(ready_write,),
                stdin=subprocess.PIPE,
                stderr=stderr,
                env=_environment(None),
            )
        finally:
            if stderr != log_fd:
                os.close(stderr)
    except BaseException:
        os.close(ready_read)
        if log_fd >= 0:
            os.close(log_fd)
        raise
    finally:
        os.close(ready_write)
    return Spare(process, ready_read, log, log_fd, _defer(process))


def give_job(spare: Spare, job: BridgeJob) -> Bridge | None:
    """Hand `job` to the spare, at normal priority first (its mount is waited for);
    None when it is gone (the caller starts a bridge instead, and must let this spare
    go)."""
    stdin = spare.process.stdin
    if stdin is None or spare.process.poll() is not None:
        return None
    resume(spare)
    try:
        stdin.write(job.line())  # far below a pipe's buffer: never blocks
        stdin.close()
    except (BrokenPipeError, ValueError):  # it died since the poll, or the pipe is closed
        return None
    _name_log(spare)  # a mount's log, retired with it as a fresh bridge's is
    return Bridge(spare.process, spare.ready, spare.log, from_spare=True)


def let_go(spare: Spare, timeout: float = SPARE_STOP_SECONDS) -> int:
    """End a spare that has no job (EOF on its job pipe, then SIGTERM, SIGKILL after
    `timeout`), close our ends and drop its log if it said nothing; its exit code."""
    process = spare.process
    if process.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    os.close(spare.ready)
    if spare.log_fd >= 0:
        if os.fstat(spare.log_fd).st_size:
            _name_log(spare)  # its last words stay, as a crashed bridge's do
        else:
            os.close(spare.log_fd)
    with contextlib.suppress(OSError):
        if not spare.log.stat().st_size:
            spare.log.unlink()
    return process.returncode


def start_bridge(runtime: Path, job: BridgeJob, log: Path) -> Bridge:
    """Start a fresh bridge for `job`, as a spare given it would serve it."""
    ready_read, ready_write = os.pipe()
    command = [
        sys.executable, "-m", BRIDGE_MODULE,
        "--runtime-dir", str(runtime),
        "--ready-fd", str(ready_write),
        *job.arguments(),
    ]  # fmt: skip
    try:
        with os.fdopen(_open_log(log), "wb") as out:  # read back on failure
            process = subprocess.Popen(
                command, pass_fds=(ready_write,), stderr=out, env=_environment(job.token)
            )
    except BaseException:
        os.close(ready_read)
        raise
    finally:
        os.close(ready_write)
    return Bridge(process, ready_read, log, from_spare=False)


def retire_files(runtime: Path, counters: Path | None, log: Path | None) -> None:
    """A gone bridge's files must not pile up in the runtime directory (a day of
    agents makes thousands of mounts): its counters are added into one
    `counters-retired` file, so totals over the directory stay what they were,
    and its log goes unless it says something (a crash's diagnostics stay)."""
    if counters is not None and counters.exists():
        retired = runtime / "counters-retired"
        mine = array.array("Q")
        with contextlib.suppress(ValueError):  # a torn file: nothing to add
            mine.frombytes(counters.read_bytes())
        if retired.exists():
            total = array.array("Q", retired.read_bytes())
            if len(total) == len(mine):
                mine = array.array("Q", (a + b for a, b in zip(total, mine, strict=True)))
        temp = retired.with_name(".counters-retired.tmp")
        temp.write_bytes(mine.tobytes())
        temp.replace(retired)
        counters.unlink()
    if log is not None and log.exists() and not log.stat().st_size:
        log.unlink()


def clean_mountpoint(path: str) -> None:
    """Detach a mount whose bridge is gone, so no stale mount is left behind."""
    if is_mounted(path):
        subprocess.run(
            ["fusermount3", "-u", "-z", path],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


_MNT_FORCE = 1
_MNT_DETACH = 2


def exited_unreaped(pid: int) -> bool:
    """Whether process `pid` (our child, which waitpid cannot reap yet) has exited all
    the same: its main thread is a zombie while another of its threads is still in the
    kernel.  A bridge killed while one of its threads waits on its own mount (a request
    that only the dead threads would have answered) stays so for good: its /dev/fuse fd
    is never closed, so the kernel never aborts the connection; abort_mount ends it."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == "Z"


def abort_mount(path: str) -> str:
    """Abort the FUSE connection mounted at `path` and detach it, whatever its server
    does: every request waiting on it fails (ECONNABORTED), so a bridge stuck on its
    own mount can exit.  As root, umount2(MNT_FORCE | MNT_DETACH) (the kernel's
    fuse_umount_begin aborts the connection); otherwise the connection's `abort` file
    under /sys/fs/fuse/connections, where fusectl is mounted, then a lazy unmount.
    Says which it did, for the log."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(os.fsencode(path), _MNT_FORCE | _MNT_DETACH) == 0:
            return "forced unmount"
        reason = os.strerror(ctypes.get_errno())
    else:
        reason = "not root"
    device = _mount_device(path)
    how = f"no forced unmount ({reason})"
    if device is not None:
        with contextlib.suppress(OSError):
            Path(f"/sys/fs/fuse/connections/{device}/abort").write_text("1")
            how = f"aborted connection {device}"
    clean_mountpoint(path)
    return f"{how}, lazy unmount"


def _mount_device(path: str) -> int | None:
    """The minor device number of the mount at `path` (a FUSE connection's number in
    /sys/fs/fuse/connections), from /proc/self/mountinfo; None if nothing is mounted."""
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == path:
                found = int(fields[2].split(":")[1])  # the last one mounted there is on top
    return found


def orphan_bridges(runtime: Path, served: set[int]) -> dict[int, str]:
    """Bridges of this runtime directory whose pid is not in `served` (the anchor's
    mounts' and its spare's): a previous anchor's, or one whose start the anchor gave
    up on: pid -> mount point."""
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in served:
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if BRIDGE_MODULE.encode() not in argv:
            continue
        options = dict(itertools.pairwise(argv))
        if options.get(b"--runtime-dir") == os.fsencode(str(runtime)):
            found[int(entry.name)] = os.fsdecode(options.get(b"--mountpoint", b""))
    return found


def users_of(path: str, *, besides: int = 0) -> list[int]:
    """Processes with a cwd, root, open file or mapping under `path` (read from /proc,
    which names paths without asking the mounted file system anything), but for
    process `besides` and its children (a bridge and its prefetch reader)."""
    prefix = path.rstrip("/") + "/"
    users: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        if besides and besides in (int(entry.name), _parent_of(entry.name)):
            continue
        links: list[str] = []
        with contextlib.suppress(OSError):
            links += [
                os.readlink(f"/proc/{entry.name}/cwd"),
                os.readlink(f"/proc/{entry.name}/root"),
            ]
            links += [os.readlink(fd.path) for fd in os.scandir(f"/proc/{entry.name}/fd")]
            with open(f"/proc/{entry.name}/maps", encoding="utf-8", errors="replace") as maps:
                links += [line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line]
        if any(link == path or link.startswith(prefix) for link in links):
            users.append(int(entry.name))
    return users


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the state first), or None when
    the process is gone (the name, in parentheses, may hold spaces)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def _parent_of(pid: str) -> int:
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[1])  # the field after the state


def is_bridge(pid: int) -> bool:
    """Whether `pid` is a mount bridge of Slates (never another process that took its pid)."""
    try:
        return BRIDGE_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def is_mounted(path: str) -> bool:
    """Whether something is mounted at `path` (a dead FUSE mount fails stat, so ask the kernel)."""
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 1 and _unescape(fields[1]) == path:
                return True
    return False


def _unescape(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as octal escapes.
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def bridge_error(message: str) -> SlatesError:
    """The bridge's own error line ("error: Code: message") as that error."""
    for line in reversed(message.strip().splitlines()):
        for prefix in ("error: ", "slates-bridge: "):
            rest = line.removeprefix(prefix)
            if rest != line and ": " in rest:
                code, text = rest.split(": ", 1)
                if code.isidentifier():
                    return error_from_wire({"code": code, "message": text})
    return SlatesError("the mount bridge failed to start", output=message[-2000:])
