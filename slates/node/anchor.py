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
RESTART_WINDOW seconds is left down (its state says "failed") rather than
spinning; the other shards and the anchor keep serving.

Mounts: each is served by a bridge process (slates.fuse.bridge) the anchor
starts and supervises.  To keep a mount's wait short (issue 14) the anchor
keeps one spare bridge started (slates.node.mounts): a mount hands its job
to the spare instead of starting a process, and the next spare is started
by the loop once the mount is answered, never while a request waits, its
start-up deferred (SCHED_IDLE for at most half a second) so that it does
not compete with the agent's first command in the new mount.  A
spare that died is replaced (bounded like the link); a mount that finds
none, or a spare that dies with its job, starts a fresh bridge as before.
The spare is no mount: it is not in the state file, `gc` never reaps it,
and it is let go (by pid) when the anchor stops.  Each mount's log line
says where its wait went: the anchor's checks, the bridge (job to ready
byte), the state file.

A bridge that dies unasked (not exit 0, which is an unmount from outside)
is restarted on the same directory for the same volume: its dead FUSE
connection is detached (lazily: programs still inside it get ENOTCONN
there, since the kernel aborted that connection with the bridge's
/dev/fuse fd), and a bridge (the spare, as for any mount) mounts the
volume again, so paths under the directory serve what the shard holds,
everything acknowledged included.  Until it serves, the mount stays
listed with health "restarting" and the dead bridge's pid (a new pid
means the mount serves again), so nobody takes a restart for a removal;
no control request is answered meanwhile (the loop is restarting it).
One that dies more than MAX_BRIDGE_RESTARTS times within RESTART_WINDOW,
or whose restart fails, is removed, and the log says why; restarts are
not nested (_reap_bridges).

The spin calibration (slates.node.ring.cached_spin_ns) is done once here,
before the shards start, so no bridge of this boot measures it.
"""

from __future__ import annotations

import contextlib
import grp
import json
import math
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from slates.errors import (
    AccessDenied,
    AlreadyExists,
    InvalidArgument,
    NotADirectory,
    NotFound,
    SlatesError,
)
from slates.node.journal import create_segment
from slates.node.memory import default_segment_sizes, ram_bytes
from slates.node.mounts import (
    Bridge,
    BridgeJob,
    Spare,
    abort_mount,
    bridge_error,
    clean_mountpoint,
    exited_unreaped,
    give_job,
    is_bridge,
    is_mounted,
    let_go,
    orphan_bridges,
    resume,
    retire_files,
    start_bridge,
    start_spare,
    users_of,
)
from slates.node.pool import HostPool
from slates.node.principals import OPERATOR, Agents, Principal
from slates.node.protocol import MAX_TOKEN, FrameReader, frame, pack, unpack
from slates.node.runtime import AnchorState, MountInfo, Runtime, ShardInfo, pid_alive

__all__ = [
    "Anchor",
    "MAX_RESTARTS",
    "RESTART_WINDOW",
    "parse_size",
    "run_anchor",
    "is_mounted",
    "spawn_anchor",
    "stop_process",
]

MAX_RESTARTS = 20
MAX_BRIDGE_RESTARTS = 5  # per mount within RESTART_WINDOW
RESTART_WINDOW = 60.0


def _within_window(times: deque[float], now: float) -> deque[float]:
    """`times` without those older than RESTART_WINDOW before `now` (dropped in place)."""
    while times and now - times[0] > RESTART_WINDOW:
        times.popleft()
    return times


_UCRED = struct.Struct("3i")
CONTROL_SECONDS = 2.0
MAX_CONTROL_FRAME = 64 << 10  # control requests are small
BRIDGE_START_SECONDS = 60.0
BRIDGE_EXIT_SECONDS = 10.0  # for a bridge whose FUSE connection was aborted to let it exit
# For a bridge whose directory a user unmounted, before mounting its volume again: it
# exits within about 50 ms, unless a lazy umount left files of it open (then it serves
# them on, and the new mount is refused as "already mounted").
ENDED_BRIDGE_SECONDS = 2.0
STUCK_CHECK_SECONDS = 1.0  # how often bridges are looked at for an exit waitpid cannot see

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


MountHealth = Literal["serving", "restarting"]


@dataclass
class _Mount:
    directory: str
    volume: str
    process: subprocess.Popen[bytes]
    uid: int = 0
    writeback: bool = False
    restarts: deque[float] = field(default_factory=deque)
    allow_other: bool = False
    principal: Principal = OPERATOR
    token: str | None = None  # an agent's mount: its bridge acts as that agent
    counters: Path | None = None  # the bridge's --counters file
    log: Path | None = None  # its stderr
    # "serving", or "restarting" while a bridge is being started again for it after its
    # bridge died (`process` is still the dead one then: a new pid means it serves).
    health: MountHealth = "serving"


@dataclass
class _ShardSlot:
    index: int
    fds: tuple[int, int, int, int]  # journal, checkpoint, arena, listening socket (-1: closed)
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)
    failed: bool = False


class Anchor:
    def __init__(
        self,
        runtime: Runtime,
        shards: int,
        capacity: int,
        allow_roots: tuple[str, ...] = (),
        agent_group: int | None = None,
        fleet: str | None = None,
    ) -> None:
        if shards < 1:
            raise InvalidArgument("an anchor needs at least one shard", shards=shards)
        for root in allow_roots:
            if not os.path.isabs(root) or not os.path.isdir(root):
                raise InvalidArgument("an allowed root is an existing directory", root=root)
        self.allow_roots = tuple(os.path.realpath(root) for root in allow_roots)
        self.runtime = runtime
        self.capacity = capacity
        self.slots: list[_ShardSlot] = []
        self.stopping = False
        self.shard_count = shards
        self.on_ready: Callable[[], object] | None = None
        self.mounts: dict[str, _Mount] = {}  # by directory
        self.exit_code = 0
        self.control: socket.socket | None = None
        # Agents running as other users reach the sockets through this group; their
        # tokens, not their uids, say who they are.
        self.agent_group = agent_group
        self.agents = Agents(runtime.path)
        # With a fleet configuration, the fleet link (slates.fleet.link) joins this host
        # to the fleet; it is supervised like a shard.
        if fleet is not None and not os.path.isfile(fleet):
            raise InvalidArgument("the fleet configuration is not a file", fleet=fleet)
        self.fleet = os.path.realpath(fleet) if fleet is not None else None
        self.link: subprocess.Popen[bytes] | None = None
        self.link_starts: deque[float] = deque()
        self.link_failed = False
        self.pool: HostPool | None = None  # the host's capacity, shared by the shards
        self.pool_fd = -1
        self.spare: Spare | None = None  # a started bridge waiting for its mount
        self.spare_deaths: deque[float] = deque()  # spares that died without a job
        self.spare_failed = False
        self.restarting = False  # _reap_bridges is at work (it is not re-entered)
        self.stuck_check = 0.0  # when bridges were last looked at for exited_unreaped

    def _open_to_agents(self, path: Path) -> None:
        if self.agent_group is None:
            os.chmod(path, 0o600)
        else:
            os.chown(path, -1, self.agent_group)
            os.chmod(path, 0o660)

    def _listen(self, index: int) -> socket.socket:
        path = self.runtime.shard_socket(index)
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        self._open_to_agents(path)
        listener.listen(128)
        listener.set_inheritable(True)
        return listener

    def prepare(self) -> None:
        self.runtime.prepare(group=self.agent_group)
        self.runtime.ensure_approver_key()
        self._report_dead_predecessor()
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
        # A fence table of an earlier boot's fleet link names greens gone with its RAM.
        (self.runtime.path / "fleet-fence.msgpack").unlink(missing_ok=True)
        # Virtual sizes (memfds are sparse), derived from the capacity and the machine's RAM.
        sizes = default_segment_sizes(self.capacity, self.shard_count, ram_bytes())
        self.pool, self.pool_fd = HostPool.create(self.capacity, self.shard_count)
        os.set_inheritable(self.pool_fd, True)
        for index in range(self.shard_count):
            listener = self._listen(index)
            fds = (
                create_segment(f"slates-journal-{index}", sizes.journal),
                create_segment(f"slates-checkpoint-{index}", sizes.checkpoint),
                create_segment(f"slates-arena-{index}", sizes.arena),
                listener.detach(),
            )
            for fd in fds:
                os.set_inheritable(fd, True)
            self.slots.append(_ShardSlot(index, fds))
        path = self.runtime.anchor_socket
        path.unlink(missing_ok=True)
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control.bind(str(path))
        self._open_to_agents(path)
        self.control.listen(16)
        self.control.settimeout(0.05)

    def _start(self, slot: _ShardSlot) -> None:
        journal, checkpoint, arena, listen = slot.fds
        command = [
            sys.executable, "-m", "slates.node.shard",
            "--index", str(slot.index),
            "--journal-fd", str(journal),
            "--checkpoint-fd", str(checkpoint),
            "--arena-fd", str(arena),
            "--listen-fd", str(listen),
            "--capacity", str(self.capacity),  # one pool for the host: see --pool-fd
            "--pool-fd", str(self.pool_fd),
            "--approver-key", str(self.runtime.approver_key_file),
            *(arg for root in self.allow_roots for arg in ("--allow-root", root)),
        ]  # fmt: skip
        slot.process = subprocess.Popen(command, pass_fds=(*slot.fds, self.pool_fd))

    def _close_listener(self, slot: _ShardSlot) -> None:
        """A shard left down takes its socket with it: a client's connect is refused at
        once (and one waiting in the backlog is reset) instead of saying a hello that
        nobody will answer."""
        journal, checkpoint, arena, listen = slot.fds
        if listen < 0:
            return
        os.close(listen)
        self.runtime.shard_socket(slot.index).unlink(missing_ok=True)
        slot.fds = (journal, checkpoint, arena, -1)

    def _publish(self) -> None:
        shards = tuple(
            ShardInfo(
                s.index,
                s.process.pid if s.process else 0,
                str(self.runtime.shard_socket(s.index)),
                s.restarts,
                "failed" if s.failed else "serving",
            )
            for s in self.slots
        )
        mounts = tuple(
            MountInfo(m.directory, m.volume, m.process.pid, m.health) for m in self.mounts.values()
        )
        self.runtime.write_state(AnchorState(os.getpid(), shards, self.capacity, mounts))

    def run(self) -> int:
        """Start every shard and supervise until SIGTERM/SIGINT; returns an exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # Calibrated before the shards start, on a quiet host, and left in the runtime
        # directory for every bridge (spare or fresh) of this boot.  Imported here: the
        # ring module loads the native extension, which parse_size's users never need.
        from slates.node.ring import cached_spin_ns

        cached_spin_ns(self.runtime.path)
        for slot in self.slots:
            self._start(slot)
        self._publish()
        self._start_link()  # after the state file: the link reads it to find the shards
        if self.on_ready is not None:
            self.on_ready()
        _log(f"anchor {os.getpid()} serving {len(self.slots)} shards in {self.runtime.path}")
        while not self.stopping:
            self._supervise()
            self._keep_spare()
            self._serve_control()
        self._shutdown()
        return self.exit_code

    def _supervise(self) -> None:
        """Restart dead shards and clean up dead bridges (never blocks)."""
        for slot in self.slots:
            process = slot.process
            if process is None or process.poll() is None:
                continue
            _log(f"shard {slot.index} (pid {process.pid}) exited with {process.returncode}")
            now = time.monotonic()
            slot.recent.append(now)
            if len(_within_window(slot.recent, now)) > MAX_RESTARTS:
                # Only this shard's volumes are lost to it: the others keep serving.
                _log(f"shard {slot.index} keeps dying; it is left down, the others go on")
                slot.failed = True
                slot.process = None
                self._close_listener(slot)
                self._publish()
                continue
            slot.restarts += 1
            self._start(slot)
            self._publish()
        self._reap_bridges()
        if self.link is not None and self.link.poll() is not None:
            _log(f"the fleet link (pid {self.link.pid}) exited with {self.link.returncode}")
            self.link = None
            self._start_link()

    def _start_link(self) -> None:
        """Start the fleet link (bounded restarts: one that keeps dying stays down, and this
        host serves its own volumes without the fleet)."""
        if self.fleet is None or self.stopping:
            return
        now = time.monotonic()
        if len(_within_window(self.link_starts, now)) > MAX_RESTARTS:
            if not self.link_failed:
                _log("the fleet link keeps dying; this host goes on without the fleet")
                self.link_failed = True
            return
        self.link_starts.append(now)
        command = [
            sys.executable, "-m", "slates.fleet.link",
            "--config", self.fleet,
            "--runtime-dir", str(self.runtime.path),
        ]  # fmt: skip
        self.link = subprocess.Popen(command)

    # -- mounts ---------------------------------------------------------------

    def _serve_control(self) -> None:
        """Answer at most one control request (waits up to 50 ms for one)."""
        assert self.control is not None
        try:
            conn, _address = self.control.accept()
        except (TimeoutError, InterruptedError):
            return
        with conn:
            conn.settimeout(CONTROL_SECONDS)  # a silent client cannot hold up supervision
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                _pid, uid, _gid = _UCRED.unpack(creds)
                reader = FrameReader(MAX_CONTROL_FRAME)
                deadline = time.monotonic() + CONTROL_SECONDS
                while (payload := reader.next_frame()) is None:
                    # The whole request within the deadline, not each byte: a client
                    # sending a byte at a time cannot hold up supervision.
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SlatesError("the control request did not arrive in time")
                    conn.settimeout(left)
                    data = conn.recv(65536)
                    if not data:
                        return
                    reader.feed(data)
                request = unpack(payload)
                try:
                    result = self._control(request, uid)
                    reply = {"ok": True, "result": result}
                except SlatesError as exc:
                    reply = {"ok": False, "error": exc.to_wire()}
                conn.sendall(frame(pack(reply)))
            except (OSError, SlatesError) as exc:
                _log(f"control connection failed: {exc}")

    def _principal(self, uid: int, token: object) -> Principal:
        """Who asks: the agent its token names, else the operator (our own user or
        root, with no token); anyone else (a member of the agent group) is refused."""
        if token is not None:
            if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN:
                raise InvalidArgument("a token is a string of 1 to 256 characters")
            return self.agents.authenticate(token)
        if uid not in (0, os.geteuid()):
            raise AccessDenied("this service belongs to another user; present a token", uid=uid)
        return OPERATOR

    def _control(self, request: dict[str, object], uid: int) -> object:
        principal = self._principal(uid, request.get("token"))
        token = request.get("token") if not principal.is_operator else None
        match request.get("op"):
            case "mount":
                volume, directory = request.get("volume"), request.get("directory")
                if not isinstance(volume, str) or not isinstance(directory, str):
                    raise InvalidArgument("mount needs a volume and a directory")
                writeback = request.get("writeback", False)
                allow_other = request.get("allow_other", False)
                if not isinstance(writeback, bool) or not isinstance(allow_other, bool):
                    raise InvalidArgument("writeback and allow_other are true or false")
                return self._mount(
                    volume,
                    directory,
                    uid,
                    writeback,
                    allow_other=allow_other,
                    principal=principal,
                    token=token if isinstance(token, str) else None,
                )
            case "unmount":
                directory = request.get("directory")
                if not isinstance(directory, str):
                    raise InvalidArgument("unmount needs a directory")
                force = request.get("force", False)
                if not isinstance(force, bool):
                    raise InvalidArgument("force is true or false")
                # Never stat the mount point itself: that asks the bridge, which
                # may be waiting for a shard only this loop can restart.
                head, name = os.path.split(os.path.normpath(directory))
                path = os.path.join(os.path.realpath(head), name)
                mount = self.mounts.get(path)
                if (
                    mount is not None
                    and not principal.is_operator
                    and (mount.principal != principal or mount.uid != uid)
                ):
                    raise AccessDenied(
                        "that mount belongs to another principal",
                        directory=path,
                        principal=principal.label,
                    )
                return self._unmount(path, force=force)
            case "gc":
                if not principal.is_operator:
                    raise AccessDenied("only the operator collects", principal=principal.label)
                return self._reap_orphans()
            case _:
                raise InvalidArgument("unknown control operation")

    def _mount(
        self,
        volume: str,
        directory: str,
        uid: int,
        writeback: bool = False,
        *,
        allow_other: bool = False,
        principal: Principal = OPERATOR,
        token: str | None = None,
    ) -> dict[str, object]:
        """Start a bridge serving `volume` at `directory` (which the asker owns).

        A mount asked by another user than the bridge's is opened to other users
        (allow_other), or its asker could not enter it; default_permissions makes
        the kernel check every access against the files' modes and owners.  An
        agent's bridge presents the agent's token, so the shard authorizes its
        requests as that agent's (a green mounts read-only for it)."""
        asked = time.monotonic()
        allow_other = allow_other or uid != os.geteuid()
        path = os.path.realpath(directory)
        self._forget_ended(path, volume)
        if path in self.mounts or is_mounted(path):
            raise AlreadyExists("something is already mounted there", directory=path)
        for other in self.mounts.values():
            if other.volume == volume:  # kernel references are counted per volume
                raise AlreadyExists("the volume is already mounted", directory=other.directory)
        _check_directory(path, uid)
        job = self._job(volume, path, writeback, allow_other, token)
        handed = time.monotonic()
        process, log = self._serve(job)
        served = time.monotonic()
        self.mounts[path] = _Mount(
            path,
            volume,
            process,
            uid,
            writeback,
            allow_other=allow_other,
            principal=principal,
            token=token,
            counters=job.counters,
            log=log,
        )
        self._publish()
        # Where a mount's wait went (issue 14): the checks, the bridge, the state file.
        checks, bridge, state = handed - asked, served - handed, time.monotonic() - served
        _log(
            f"mounted {volume} at {path} (bridge pid {process.pid}; checks {checks * 1e3:.1f} "
            f"ms, bridge ready {bridge * 1e3:.1f} ms, state file {state * 1e3:.1f} ms)"
        )
        return {"directory": path, "volume": volume, "pid": process.pid}

    def _job(
        self, volume: str, path: str, writeback: bool, allow_other: bool, token: str | None
    ) -> BridgeJob:
        counters = self.runtime.path / f"counters-{volume}-{time.time_ns()}"
        return BridgeJob(volume, path, counters, writeback, allow_other, token)

    def _serve(self, job: BridgeJob) -> tuple[subprocess.Popen[bytes], Path]:
        """A bridge serving `job` (the spare, else a fresh one; a fresh one once more if
        the spare was killed holding it): its process and log, once its mount serves.
        Raises the bridge's own error, with nothing of the attempt left behind."""
        bridge = self._bridge_for(job)
        started = self._wait_ready(bridge)
        if started == "failed" and self._spare_was_killed(bridge):
            # Not the mount's fault (the spare said nothing): a fresh bridge tries it once.
            _log(f"the spare bridge (pid {bridge.process.pid}) died with its job")
            bridge.log.unlink(missing_ok=True)
            self._clean_mountpoint(job.mountpoint)
            bridge = start_bridge(self.runtime.path, job, self._bridge_log())
            started = self._wait_ready(bridge)
        if started == "ready":
            return bridge.process, bridge.log
        _wait_or_kill(bridge.process, 30)
        message = _read_log(bridge.log)
        bridge.log.unlink(missing_ok=True)
        job.counters.unlink(missing_ok=True)
        self._clean_mountpoint(job.mountpoint)
        if started == "killed":
            # Its own words would say nothing of why: it was killed before it served.
            details: dict[str, object] = {"directory": job.mountpoint}
            if message:
                details["output"] = message[-2000:]
            if self.stopping:
                reason = "the anchor is stopping"
            else:
                reason = f"it was not ready within {BRIDGE_START_SECONDS:.0f} s"
            raise SlatesError(f"the mount bridge was stopped before it served: {reason}", **details)
        error = bridge_error(message)
        if type(error) is SlatesError:  # not its own words: say at least how it ended
            error.details["exit_code"] = bridge.process.returncode
        raise error

    def _bridge_log(self) -> Path:
        return self.runtime.path / f"bridge-{os.getpid()}-{len(self.mounts)}-{time.time_ns()}.log"

    def _bridge_for(self, job: BridgeJob) -> Bridge:
        """The spare given `job`, else (none, or it died) a fresh bridge started for it."""
        spare, self.spare = self.spare, None
        if spare is not None:
            bridge = give_job(spare, job)
            if bridge is not None:
                return bridge
            code = let_go(spare)
            _log(f"the spare bridge (pid {spare.process.pid}) was gone ({code}); starting one")
        return start_bridge(self.runtime.path, job, self._bridge_log())

    def _spare_was_killed(self, bridge: Bridge) -> bool:
        """Whether a spare that failed its job was killed before it could say why (a
        signal not ours, an empty log), rather than refusing the mount itself."""
        if not bridge.from_spare or self.stopping:
            return False
        _wait_or_kill(bridge.process, 30)
        code = bridge.process.returncode
        return code < 0 and not _read_log(bridge.log).strip()

    def _keep_spare(self) -> None:
        """Have one spare bridge started (called by the loop between requests: starting
        one is a fork and exec; its start-up runs in it, and nobody waits for it)."""
        if self.stopping or self.spare_failed:
            return
        if self.spare is not None:
            if self.spare.process.poll() is None:
                self.spare = resume(self.spare, now=time.monotonic())
                return
            dead, self.spare = self.spare, None
            code = let_go(dead)
            _log(f"the spare bridge (pid {dead.process.pid}) exited with {code}")
            now = time.monotonic()
            self.spare_deaths.append(now)
            if len(_within_window(self.spare_deaths, now)) > MAX_RESTARTS:
                _log("spare bridges keep dying; each mount starts its own bridge")
                self.spare_failed = True
                return
        try:
            self.spare = start_spare(self.runtime.path, self._bridge_log())
        except OSError as exc:  # no fds or processes left: mounts start their own
            _log(f"could not start a spare bridge: {exc}")
            self.spare_failed = True

    def _wait_ready(self, bridge: Bridge) -> Literal["ready", "failed", "killed"]:
        """Wait for the bridge's b"1", supervising the shards meanwhile (it may need one):
        "failed" when it ended without one; one not ready within BRIDGE_START_SECONDS, or
        when the anchor stops, is killed."""
        deadline = time.monotonic() + BRIDGE_START_SECONDS
        with os.fdopen(bridge.ready, "rb", buffering=0) as ready:
            while time.monotonic() < deadline and not self.stopping:
                readable, _, _ = select.select([ready], [], [], 0.05)
                if readable:  # EOF (no "1") when the bridge fails
                    return "ready" if ready.read(1) == b"1" else "failed"
                self._supervise()
        bridge.process.kill()
        return "killed"

    def _unmount(self, path: str, *, force: bool = True) -> dict[str, object]:
        mount = self.mounts.get(path)
        if mount is None:
            raise NotFound("no Slates mount there", directory=path)
        # The bridge's own prefetch reader (native/bridge_prefetch.c) is not a user.
        if not force and (users := users_of(path, besides=mount.process.pid)):
            raise InvalidArgument(
                "the mount is in use (a process has a file or directory open there); "
                "close it, or unmount with --force to detach it lazily",
                directory=path,
                pids=users[:20],
            )
        del self.mounts[path]
        mount.process.terminate()  # the bridge unmounts cleanly on SIGTERM
        self._wait_exit(mount.process, BRIDGE_START_SECONDS)
        self._clean_mountpoint(path)
        self._retire_files(mount)
        self._publish()
        _log(f"unmounted {path}")
        return {"directory": path, "volume": mount.volume}

    def _retire_files(self, mount: _Mount) -> None:
        retire_files(self.runtime.path, mount.counters, mount.log)

    def _wait_exit(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait for a child to exit, supervising the shards meanwhile (it may need one)."""
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            self._supervise()
            time.sleep(0.02)
        if process.poll() is None:
            process.kill()
            process.wait()

    def _reap_bridges(self) -> None:
        """A bridge that died unasked is started again on its directory (bounded, like
        shards): the agent in the mount sees a pause, and its open files fail.

        Not re-entered: a restart waits for its bridge supervising the shards, and that
        wait must not restart (or remove) a mount whose restart is the one waiting; a
        second mount found dead meanwhile is restarted once the first is done."""
        if self.restarting:
            return
        self.restarting = True
        now = time.monotonic()
        look_for_stuck = now - self.stuck_check >= STUCK_CHECK_SECONDS  # /proc reads: rarely
        if look_for_stuck:
            self.stuck_check = now
        try:
            for path, mount in list(self.mounts.items()):
                # A restart above may have ended or replaced this entry since the list.
                if self.mounts.get(path) is not mount:
                    continue
                if mount.process.poll() is None:
                    if not look_for_stuck or not exited_unreaped(mount.process.pid):
                        continue  # serving
                    self._unstick(mount)
                self._bridge_died(mount)
        finally:
            self.restarting = False

    def _forget_ended(self, path: str, volume: str) -> None:
        """Before a mount at `path` or of `volume`: one there or of it whose bridge has
        exited, or whose directory is no longer mounted (a user's umount(8): its bridge
        exits once the kernel lets the connection go, moments later), is waited for
        (bounded) and reaped now, not at the next supervision round; otherwise mounting
        again right after a umount was refused as "already mounted", every time."""
        ending = [
            mount
            for mount in self.mounts.values()
            if (mount.directory == path or mount.volume == volume)
            and (mount.process.poll() is not None or not is_mounted(mount.directory))
        ]
        if not ending:
            return
        deadline = time.monotonic() + ENDED_BRIDGE_SECONDS
        while any(m.process.poll() is None for m in ending) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._reap_bridges()

    def _unstick(self, mount: _Mount) -> None:
        """A bridge that exited but cannot be reaped, because one of its threads waits on
        its own mount (mounts.exited_unreaped): its mount hangs until the connection is
        aborted, which lets that thread, and so the bridge, end (waited for, bounded)."""
        process = mount.process
        how = abort_mount(mount.directory)
        _log(
            f"bridge for {mount.directory} (pid {process.pid}) exited but a thread of it "
            f"waits on its own mount; its FUSE connection was aborted ({how})"
        )
        deadline = time.monotonic() + BRIDGE_EXIT_SECONDS
        while process.poll() is None and time.monotonic() < deadline:
            self._supervise()  # (this restart is not re-entered: see _reap_bridges)
            time.sleep(0.02)

    def _bridge_died(self, mount: _Mount) -> None:
        """Restart `mount`'s dead bridge, keeping the mount listed ("restarting") the
        while, or remove the mount saying why: it unmounted itself, the anchor stops,
        it died more than MAX_BRIDGE_RESTARTS times within RESTART_WINDOW, or the
        restart failed."""
        path, dead = mount.directory, mount.process
        last_words = _read_log(mount.log).strip() if mount.log is not None else ""
        status = "an exit status not yet given" if dead.returncode is None else dead.returncode
        _log(
            f"bridge for {path} (pid {dead.pid}) exited with {status}"
            f"{': ' + last_words[-500:] if last_words else ''}"
        )
        self._clean_mountpoint(path)  # the dead connection's mount: detached (lazily)
        self._retire_files(mount)
        now = time.monotonic()
        reason = None
        if dead.returncode == 0:
            reason = "it unmounted itself (fusermount -u)"  # not a failure
        elif self.stopping:
            reason = "the anchor is stopping"
        elif len(_within_window(mount.restarts, now)) >= MAX_BRIDGE_RESTARTS:
            reason = (
                f"it keeps dying ({len(mount.restarts) + 1} times within "
                f"{RESTART_WINDOW:.0f} s); the volume stays unmounted"
            )
        if reason is not None:
            self._remove_mount(mount, reason)
            return
        mount.restarts.append(now)
        mount.health = "restarting"  # listed with the dead bridge's pid until one serves
        self._publish()
        job = self._job(mount.volume, path, mount.writeback, mount.allow_other, mount.token)
        try:
            _check_directory(path, mount.uid)
            process, log = self._serve(job)
        except SlatesError as exc:
            details = ", ".join(f"{k}={v!r}" for k, v in exc.details.items())
            self._remove_mount(mount, f"it could not be mounted again: {exc} {details}".strip())
            return
        mount.process, mount.counters, mount.log = process, job.counters, log
        mount.health = "serving"
        _log(f"restarted the bridge for {path} (pid {process.pid})")  # said before it shows
        self._publish()

    def _remove_mount(self, mount: _Mount, reason: str) -> None:
        # Said before the state file shows it: whoever sees it gone can read why.
        _log(f"removed the mount of {mount.volume} at {mount.directory}: {reason}")
        if self.mounts.get(mount.directory) is mount:
            del self.mounts[mount.directory]
        self._clean_mountpoint(mount.directory)
        self._publish()

    def _reap_orphans(self) -> dict[str, object]:
        """`slates gc`: kill bridges of this runtime directory that serve no mount of ours
        and detach their mounts, and detach mounts this anchor records whose bridge died."""
        served = {m.process.pid for m in self.mounts.values()}
        if self.spare is not None:
            served.add(self.spare.process.pid)  # ours, waiting for a mount
        orphans = orphan_bridges(self.runtime.path, served)
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stale = [d for d in orphans.values() if d and d not in self.mounts and is_mounted(d)]
        for directory in stale:
            self._clean_mountpoint(directory)
        self._reap_bridges()  # our own dead bridges: their mounts restarted or cleaned
        return {"bridges": sorted(orphans), "mounts": sorted(stale)}

    def _report_dead_predecessor(self) -> None:
        """An anchor that died took its volumes with its RAM: say so, with their names
        (from the shards' volume files), and clean the mounts and files it left."""
        try:
            data = json.loads(self.runtime.state_file.read_text())
            pid = int(data["pid"])
            mounts = [(str(m["directory"]), int(m["pid"])) for m in data.get("mounts", [])]
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            return
        if pid_alive(pid):
            return  # prepare refuses: it is still running
        names: list[str] = []
        for listing in sorted(self.runtime.path.glob("shard-*.volumes.json")):
            with contextlib.suppress(json.JSONDecodeError, TypeError, OSError):
                names += [str(name) for name in json.loads(listing.read_text())]
            listing.unlink(missing_ok=True)
        for directory, bridge in mounts:
            if is_bridge(bridge):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(bridge, signal.SIGKILL)  # an orphan serving nothing
            self._clean_mountpoint(directory)
        lost = {"pid": pid, "volumes": sorted(names), "mounts": [d for d, _ in mounts]}
        self.runtime.lost_file.write_text(json.dumps(lost))
        os.chmod(self.runtime.lost_file, 0o600)
        self.runtime.state_file.unlink(missing_ok=True)
        _log(
            f"the previous anchor (pid {pid}) died; lost with its RAM: {len(names)} volumes"
            f"{': ' + ', '.join(sorted(names)[:20]) if names else ''}"
            f"{' ...' if len(names) > 20 else ''}; cleaned {len(mounts)} stale mounts"
        )

    @staticmethod
    def _clean_mountpoint(path: str) -> None:
        clean_mountpoint(path)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        if self.spare is not None:
            spare, self.spare = self.spare, None
            let_go(spare)
        for path in list(self.mounts):
            self._unmount(path)
        if self.control is not None:
            self.control.close()
            self.runtime.anchor_socket.unlink(missing_ok=True)
        if self.link is not None and self.link.poll() is None:
            self.link.terminate()  # it revokes its lease and stops its serf agent first
            try:
                self.link.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.link.kill()
                self.link.wait()
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
                if fd >= 0:  # a failed shard's listener is closed already
                    os.close(fd)
        if self.pool is not None:
            self.pool.close()
            os.close(self.pool_fd)
        self.runtime.state_file.unlink(missing_ok=True)
        _log("anchor stopped")


def _check_directory(path: str, uid: int) -> None:
    """Refuse a mount point that is not an empty directory of `uid`'s, named by its real
    path (checked again when a mount is restarted: it may have changed in between)."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or os.path.realpath(path) != path:
            raise InvalidArgument("the mount point is not its real path", directory=path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectory("the mount point is not a directory", directory=path)
        if st.st_uid != uid:
            raise AccessDenied("the mount directory belongs to another user", directory=path)
        if os.listdir(path):
            raise InvalidArgument("the mount directory is not empty", directory=path)
    except FileNotFoundError:
        raise NotFound("the mount directory does not exist", directory=path) from None
    except OSError as exc:  # e.g. ENOTCONN: a dead FUSE mount someone else left there
        raise InvalidArgument(
            "the mount directory cannot be read", directory=path, reason=exc.strerror
        ) from None


def _read_log(path: Path) -> str:
    """A bridge's log, "" if it has none (its name could not be given: see mounts)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _wait_or_kill(process: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _log(message: str) -> None:
    print(f"slates anchor: {message}", file=sys.stderr, flush=True)


def run_anchor(
    runtime: Runtime,
    shards: int,
    capacity: int,
    *,
    daemon: bool,
    allow_roots: tuple[str, ...] = (),
    agent_group: str | None = None,
    fleet: str | None = None,
) -> int:
    """Prepare, then serve in the foreground, or detach and return once serving.

    `allow_roots`: where agents' bases and landing targets may lie; `agent_group`
    (a group name or number): the group whose members may reach the sockets; `fleet`: a
    fleet configuration file (slates.fleet.hostconfig) this host joins the fleet with."""
    group = None if agent_group is None else group_id(agent_group)
    anchor = Anchor(runtime, shards, capacity, allow_roots, group, fleet)
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


def group_id(name: str) -> int:
    """A group name or number as a gid."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise NotFound("no such group", group=name) from None


def spawn_anchor(
    runtime: Path,
    *,
    shards: int,
    capacity: str,
    log: IO[bytes] | int = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
    allow_roots: tuple[str, ...] = (),
    agent_group: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start `slates anchor` as a child process and return once it serves (demos, tests)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "slates_cli.main", "anchor", "--runtime-dir", str(runtime),
         "--shards", str(shards), "--capacity", capacity,
         *(arg for root in allow_roots for arg in ("--allow-root", root)),
         *(["--agent-group", agent_group] if agent_group is not None else [])],
        stdout=log,
        stderr=log,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not (runtime / "anchor.json").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise SlatesError("the anchor did not start", runtime_dir=str(runtime))
        time.sleep(0.02)
    return process


def stop_process(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns once it has exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
