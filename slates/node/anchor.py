"""The anchor: owns the shared memory, starts the shards, restarts the ones that die.

Theory of operation: small and boring on purpose, so that it does not
crash.  It creates, per shard, three memfd segments (journal, checkpoint,
arena) and a listening unix socket, and keeps all of them open for its
whole life; it starts each shard as a child process handing it those fds.
When a shard dies for any reason, the anchor starts a replacement with the
same fds: the replacement recovers from the segments, and clients queued
on the socket are served once it is ready.  The anchor never reads the
segments or the requests; it only records pids in the runtime state file.

Restarts are bounded: a shard that dies more than MAX_RESTARTS times within
RESTART_WINDOW seconds is left down and the anchor reports it and exits
non-zero rather than spinning.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from slates.errors import InvalidArgument, SlatesError
from slates.node.journal import create_segment
from slates.node.runtime import AnchorState, Runtime, ShardInfo

__all__ = [
    "Anchor",
    "MAX_RESTARTS",
    "RESTART_WINDOW",
    "JOURNAL_SIZE",
    "CHECKPOINT_SIZE",
    "parse_size",
    "run_anchor",
]

MAX_RESTARTS = 20
RESTART_WINDOW = 60.0
JOURNAL_SIZE = 4 << 30  # virtual sizes: memfds are sparse
CHECKPOINT_SIZE = 8 << 30

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
    "TIB": 1 << 40,
}


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1000' -> bytes (binary units)."""
    stripped = text.strip().upper()
    number = stripped.rstrip("BKMGTI")
    unit = stripped[len(number) :]
    try:
        value = float(number)
    except ValueError:
        raise InvalidArgument("not a size", size=text) from None
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(
            "not a size (use a positive number with B, KiB, MiB, GiB, TiB)", size=text
        )
    return int(value * _UNITS[unit])


@dataclass
class _ShardSlot:
    index: int
    fds: tuple[int, int, int, int]  # journal, checkpoint, arena, listening socket
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)


class Anchor:
    def __init__(self, runtime: Runtime, shards: int, capacity: int) -> None:
        if shards < 1:
            raise InvalidArgument("an anchor needs at least one shard", shards=shards)
        self.runtime = runtime
        self.capacity = capacity
        self.slots: list[_ShardSlot] = []
        self.stopping = False
        self.shard_count = shards
        self.on_ready: Callable[[], object] | None = None

    def _listen(self, index: int) -> socket.socket:
        path = self.runtime.shard_socket(index)
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(128)
        listener.set_inheritable(True)
        return listener

    def prepare(self) -> None:
        self.runtime.prepare()
        try:
            state = self.runtime.read_state()
        except SlatesError:
            state = None  # none, or stale: a new anchor may take the directory
        if state is not None:
            raise InvalidArgument(
                "an anchor is already running here",
                pid=state.pid,
                runtime_dir=str(self.runtime.path),
            )
        arena_size = max(self.capacity, 1 << 30)
        for index in range(self.shard_count):
            listener = self._listen(index)
            fds = (
                create_segment(f"slates-journal-{index}", JOURNAL_SIZE),
                create_segment(f"slates-checkpoint-{index}", CHECKPOINT_SIZE),
                create_segment(f"slates-arena-{index}", arena_size),
                listener.detach(),
            )
            for fd in fds:
                os.set_inheritable(fd, True)
            self.slots.append(_ShardSlot(index, fds))

    def _start(self, slot: _ShardSlot) -> None:
        journal, checkpoint, arena, listen = slot.fds
        command = [
            sys.executable, "-m", "slates.node.shard",
            "--index", str(slot.index),
            "--journal-fd", str(journal),
            "--checkpoint-fd", str(checkpoint),
            "--arena-fd", str(arena),
            "--listen-fd", str(listen),
            "--capacity", str(self.capacity // self.shard_count),
        ]  # fmt: skip
        slot.process = subprocess.Popen(command, pass_fds=slot.fds)

    def _publish(self) -> None:
        shards = tuple(
            ShardInfo(
                s.index,
                s.process.pid if s.process else 0,
                str(self.runtime.shard_socket(s.index)),
                s.restarts,
            )
            for s in self.slots
        )
        self.runtime.write_state(AnchorState(os.getpid(), shards, self.capacity))

    def run(self) -> int:
        """Start every shard and supervise until SIGTERM/SIGINT; returns an exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for slot in self.slots:
            self._start(slot)
        self._publish()
        if self.on_ready is not None:
            self.on_ready()
        _log(f"anchor {os.getpid()} serving {len(self.slots)} shards in {self.runtime.path}")
        code = 0
        while not self.stopping:
            for slot in self.slots:
                process = slot.process
                if process is None or process.poll() is None:
                    continue
                _log(f"shard {slot.index} (pid {process.pid}) exited with {process.returncode}")
                now = time.monotonic()
                slot.recent.append(now)
                while slot.recent and now - slot.recent[0] > RESTART_WINDOW:
                    slot.recent.popleft()
                if len(slot.recent) > MAX_RESTARTS:
                    _log(f"shard {slot.index} keeps dying; giving up")
                    self.stopping, code = True, 1
                    break
                slot.restarts += 1
                self._start(slot)
                self._publish()
            time.sleep(0.05)
        self._shutdown()
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.terminate()
        for slot in self.slots:
            if slot.process is not None:
                try:
                    slot.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    slot.process.kill()
                    slot.process.wait()
            self.runtime.shard_socket(slot.index).unlink(missing_ok=True)
            for fd in slot.fds:
                os.close(fd)
        self.runtime.state_file.unlink(missing_ok=True)
        _log("anchor stopped")


def _log(message: str) -> None:
    print(f"slates anchor: {message}", file=sys.stderr, flush=True)


def run_anchor(runtime: Runtime, shards: int, capacity: int, *, daemon: bool) -> int:
    """Prepare, then serve in the foreground, or detach and return once serving."""
    anchor = Anchor(runtime, shards, capacity)
    anchor.prepare()
    if not daemon:
        return anchor.run()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(ready_write)
        with os.fdopen(ready_read, "rb") as ready:
            started = ready.read(1) == b"1"
        return 0 if started else 1
    os.close(ready_read)
    os.setsid()
    log = os.open(runtime.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)

    def signal_ready() -> None:
        os.write(ready_write, b"1")
        os.close(ready_write)

    anchor.on_ready = signal_ready
    os._exit(anchor.run())
