"""A daemon shard process: the trio driver around ShardService.

Theory of operation: the anchor starts this process with four inherited
fds: the journal, checkpoint and arena segments (anchor-owned memfds) and
the shard's listening unix socket.  On start the shard recovers: it loads
the published checkpoint, replays the journal generation after it (one
stream of events: one garbage collection, after the last), and only then
accepts connections.  For each request it asks the service for
(reply, events), appends the events to the journal as one frame (the
commit), and then replies.  A request refused CapacityExhausted while
the page area holds stale copies (published pieces since copied on
write) runs again once, after a checkpoint that frees them (`_run`): its
refusal is withdrawn unsaved, so only the second answer is kept; the
same holds while freed page space is kept warm (resident, so counted
against the host): after that checkpoint its pages go back first.  If
the journal cannot take a frame even after a checkpoint, the shard exits
without replying: the anchor restarts it, recovery drops the uncommitted
change, and the client's retry runs again.  Never reply to what is not
committed.  A request that fails with an exception that is no
SlatesError (a bug) is answered by the service as VerificationFailed
"internal error" with the exception as its `reason`; the driver runs the
service as LoggedService, which also writes the traceback to stderr (the
anchor's log), so the bug can be found.

Connections: a hello on the socket names the client; the peer's uid must
be ours or root (SO_PEERCRED).  With rings, the shard passes a ring pair's
fds with its answer and serves requests from the ring; the socket then
only carries liveness (EOF means the client is gone).  A mount's bridge
answers writes under a grant before they are applied (slates.node.grants),
so any other client's request that names a mounted volume first waits
until that mount's ring is answered up to where it was (_quiesce).  Writes
under a grant that queued in a mount's ring one after another (the shard
fell behind the writer) are applied as one write, one record and one
commit, each keeping its own reply (_write_run; grants' "Runs"): a stream
of small writes then costs the shard about 30 us a write instead of 80.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import dataclasses
import functools
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

import trio

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.records import (
    Create,
    Link,
    Mkdir,
    Mknod,
    PunchHole,
    Record,
    RemoveXattr,
    Rename,
    Rmdir,
    SetAttr,
    SetXattr,
    ShareRange,
    Splice,
    Symlink,
    Truncate,
    Unlink,
    Write,
)
from slates.core.volume import Volume
from slates.errors import (
    AccessDenied,
    CapacityExhausted,
    ConsistentBaseUnavailable,
    InvalidArgument,
    NotFound,
    SlatesError,
    SnapshotBarrierFailed,
)
from slates.node.arena import ArenaChunks
from slates.node.checkpoints import Checkpoints
from slates.node.events import Event, RecordApplied, frame_parts, from_wire, to_wire
from slates.node.grants import (
    GRANT_BYTES,
    GRANT_MARGIN,
    SCATTER_COST,
    SCATTER_EXTENTS,
    Grant,
    LinkGrant,
    cost,
    joins_run,
)
from slates.node.jobs import Io, Job, Outcome, Sent, Thrown
from slates.node.journal import PAGE, Checksummed, Journal, Segment
from slates.node.memory import (
    HEAP_KEEP_BYTES,
    heap_free_bytes,
    keep_heap,
    segment_bytes,
    shard_memory,
    trim_heap,
)
from slates.node.page_area import WARM_BYTES
from slates.node.pool import HostPool
from slates.node.principals import OPERATOR, Agents, Principal, authorize
from slates.node.protocol import (
    MAX_FRAME,
    Budget,
    FrameReader,
    Hello,
    Request,
    error_reply,
    frame,
    pack,
    parse_hello,
    parse_request,
    unpack,
    unpack_parts,
    unpack_request,
)
from slates.node.ring import Parts, RingPair, ask_short_slice, cached_spin_ns
from slates.node.runtime import Runtime
from slates.node.service import READ_ONLY_OPS, ShardService

__all__ = [
    "Shard",
    "main",
    "receive_frame",
    "send_all",
    "CHECKPOINT_EVERY_BYTES",
    "MAX_CONNECTIONS",
]

# What triggers a checkpoint, between requests (tests set them small): journal bytes
# or events since the last one (both bound the time replay takes), or private bytes
# freed since (deleted pages must not live on in the checkpoint and journal).
CHECKPOINT_EVERY_BYTES = int(os.environ.get("SLATES_CHECKPOINT_BYTES", 64 << 20))
CHECKPOINT_EVERY_EVENTS = int(os.environ.get("SLATES_CHECKPOINT_EVENTS", 20_000))
CHECKPOINT_FREED_BYTES = int(os.environ.get("SLATES_CHECKPOINT_FREED_BYTES", 64 << 20))
# Journal pages a shard keeps across checkpoints, at most (and at most 1/16 of its host).
JOURNAL_WARM_BYTES = CHECKPOINT_EVERY_BYTES
MAX_CONNECTIONS = 256
# Ops that, refused for room, may have applied records first (a path write or edit
# creates its file) and run again whole: the second run finds the file and writes it.
RERUN_AFTER_RECORDS = frozenset({"write", "edit"})
# Requests that make or delete volumes: the names file is written after them.
NAMING_OPS = frozenset({"volume.create", "volume.delete", "green.create", "work.create", "clone"})
MAX_HELLO = 64 << 10  # a hello is small; nothing bigger is read before it
HELLO_SECONDS = 5.0  # a connection that sends no hello in time is closed
MAX_AGENT_CONNECTIONS = 32  # per agent and shard; the operator has the shard's whole bound
MAX_AGENT_BUFFERED = 128 << 20  # unfinished frames of one agent's connections, together


@dataclasses.dataclass
class _Usage:
    """What one principal holds of a shard's connections."""

    budget: Budget
    connections: int = 0


MIN_APPROVER_KEY = 32  # bytes: a shorter (an empty) credential approves nothing
# Each ring carries messages up to half its capacity: 4 MiB rings hold a
# mount's 1 MiB reads and writes with their envelope, so only SDK calls
# larger than 2 MiB travel on the socket.
RING_CAPACITY = 4 << 20
TRIM_BYTES = 16 << 20  # private bytes let go before freed heap goes back to the host
JOURNAL_HEADROOM = (64 << 20) + (1 << 20)  # room for the largest frame, kept for deletions
# How long another client's request on a mounted volume waits for the mount's ring
# to be answered up to where it was when the request came (_quiesce).
BARRIER_SECONDS = 30.0
# What a nearly full journal still takes: requests that let go of memory.
RELEASING_OPS = frozenset({"volume.delete", "snapshot.delete", "gc", "unlink", "rmdir", "bye"})
RELEASING_OPS |= frozenset({"fs.unlink", "fs.rmdir", "fs.forget", "fs.destroy", "truncate"})
IO_THREADS = 4  # worker threads for long requests' I/O (captures, landings), per shard
# Ring requests that may start a write grant (slates.node.grants, Shard._grant).
GRANTING_OPS = frozenset({"fs.write", "fs.create"})
_UCRED = struct.Struct("3i")


# Tests: the file whose existence makes the shard die after its next commit (read once:
# the test sets it before the anchor starts the shard).
_CRASH_FLAG = os.environ.get("SLATES_CRASH_AFTER_COMMIT")


def _failpoint_after_commit() -> None:
    """Tests: die between committing and replying, once, when the named file exists."""
    flag = _CRASH_FLAG
    if flag and os.path.exists(flag):
        os.unlink(flag)
        _log("failpoint: crashing after a commit, before its reply")
        os._exit(9)


def _decoded(message: bytes | memoryview | Parts) -> Request:
    """A request as it came off a ring or a socket (SlatesError if it is not one)."""
    if isinstance(message, Parts):
        return parse_request(unpack_parts(message.head, message.tail))
    return parse_request(unpack_request(message))


def _principal(hello: Hello) -> Principal:
    """Whom a connection's requests run as: the agent its hello named, else the operator."""
    return OPERATOR if not hello.principal else Principal(hello.principal)


def _log(message: str) -> None:
    print(f"slates shard[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


class LoggedService(ShardService):
    """The service as the driver runs it: a bug (an exception that is no SlatesError,
    answered as VerificationFailed "internal error") leaves its traceback in the log."""

    def on_internal_error(self, client: str, request: Request, error: Exception) -> None:
        trace = "".join(traceback.format_exception(error)).rstrip()
        _log(f"internal error in {request.op} (client {client}, seq {request.seq}):\n{trace}")


class RingLink:
    """One ring pair a client is served on: its write grant (slates.node.grants), and
    how far its requests are answered (a position of the request ring: _quiesce)."""

    __slots__ = ("done_to", "grant", "live", "pair")

    def __init__(self, pair: RingPair) -> None:
        self.pair = pair
        self.grant = LinkGrant()
        self.done_to = 0
        self.live = True


class Shard:
    def __init__(
        self,
        index: int,
        journal_fd: int,
        checkpoint_fd: int,
        arena_fd: int,
        capacity: int,
        approver_key: bytes | None = None,
        protected: tuple[str, ...] = (),
        allow_roots: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.journal = Journal(Segment(journal_fd))
        self.checkpoints = Checkpoints(Segment(checkpoint_fd))
        # Page buffers live in the checkpoint segment's page area (slates.node.page_area).
        self.host = Host(
            capacity=capacity,
            chunks=ArenaChunks(Segment(arena_fd)),
            pages=self.checkpoints.pages,
        )
        self.service = LoggedService(
            index,
            self.host,
            functools.partial(LiveDirectory, protected=protected),
            approver_key,
            protected=protected,
            allow_roots=allow_roots,
        )
        self.connections = 0
        self.watchers: dict[str, set[Watcher]] = {}
        self.pending: dict[str, list[list[Any]]] = {}
        self.drifted: dict[str, list[list[Any]]] = {}
        # Writes queued under a grant applied as one (_write_run), since start: counted
        # for status.
        self.write_runs = {"runs": 0, "writes": 0}
        self.background: trio.Nursery | None = None
        self.agents = Agents(protected[0]) if protected else None
        self.runtime = Runtime(protected[0]) if protected else None
        # The anchor calibrated the rings' spin before starting the shards and left it in
        # the runtime directory: reading it here spares the first ring hello a ~20 ms
        # calibration of its own (default_spin_ns, for a shard without one).
        self.spin_ns = cached_spin_ns(self.runtime.path) if self.runtime else None
        # The ring links of each mounted volume's bridges (_quiesce waits for them).
        self.ring_links: dict[str, set[RingLink]] = {}
        self.usage: dict[str, _Usage] = {}
        self.io_threads = trio.CapacityLimiter(IO_THREADS)  # jobs' I/O off the loop
        self.segment_fds = (journal_fd, checkpoint_fd, arena_fd)
        # The journal's and checkpoints' allocated bytes as last read, and the segments'
        # resident_changes then (-1: never read).
        self.segment_held = (0, 0)
        self.segment_marks = (-1, -1)
        # Room kept for deletions and the largest frame (a small segment keeps a quarter).
        self.journal_headroom = min(JOURNAL_HEADROOM, self.journal.segment.size // 4)
        # Journal pages kept across checkpoints, and freed page-area space kept resident
        # for reuse (both counted against the host as segment pages, so bounded by it).
        self.journal_warm = min(JOURNAL_WARM_BYTES, capacity // 16)
        self.checkpoints.pages.warm_limit = min(WARM_BYTES, capacity // 16)
        self.trim_mark = 0  # the most private bytes held since the heap was last trimmed
        self.events_since = 0  # events committed since the last checkpoint
        self.private_peak = 0  # the most private bytes held since the last checkpoint

    def write_names(self) -> None:
        """The volumes' names, for the next anchor to report should the host's RAM go
        with this one (RUNTIME/shard-N.volumes.json; written atomically)."""
        if self.runtime is None:
            return
        path = self.runtime.volumes_file(self.index)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(sorted(set(self.service.names.values()))))
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)

    # -- recovery and commits -------------------------------------------------

    def recover(self) -> int:
        """Rebuild state from the checkpoint and journal; returns events replayed."""
        published = self.checkpoints.read()
        generation = 0
        if published is not None:
            generation, document = published
            self.service.restore(document, self.checkpoints)
            self.checkpoints.loaded()  # its free map: what the loaded buffers do not use
        replayed = 0
        if self.journal.generation == generation:
            # One stream, frame after frame: the replay collects once, after its end.
            replayed = self.service.replay(
                event for payload in self.journal.entries() for event in unpack_events(payload)
            )
        elif self.journal.generation == generation - 1:
            self.journal.start_generation(generation)  # the checkpoint already covers it
        else:
            raise SystemExit(
                f"journal generation {self.journal.generation} does not follow "
                f"checkpoint generation {generation}"
            )
        self.checkpoints.pages.take_crcs()  # the replayed data's: its frames are written
        # Room held for requests in flight (a mount's write grant) was held by links
        # that died with the old process: nothing can use it now.
        for volume in self.service.volumes.values():
            if volume.inflight_bytes:
                volume.release_inflight(volume.inflight_bytes)
        self.events_since = replayed  # the journal holds them until the next checkpoint
        self.private_peak = self.host.private_bytes
        self._account_segments()
        return replayed

    def memory(self) -> dict[str, int]:
        """What this shard really holds: arena, journal and checkpoint pages, and heap."""
        figures = shard_memory(*self.segment_fds)
        # Of those (not added to the total again): freed space kept resident for reuse,
        # the page area's warm space and the journal's pages past its committed frames.
        journal = self.journal
        resident_past = figures["journal"] - PAGE - journal.committed
        figures["warm"] = self.checkpoints.pages.area.warm_bytes + max(0, resident_past)
        return figures

    def _account_segments(self) -> None:
        """The journal's and checkpoints' pages count against the host's capacity: all
        of them but the live page buffers', which the host counts as private bytes.  A
        segment's allocated bytes are read (fstat) only once its resident pages may have
        changed (Segment.resident_changes), not after every request."""
        journal_bytes, checkpoint_bytes = self.segment_held
        journal_mark, checkpoint_mark = self.segment_marks
        if self.journal.segment.resident_changes != journal_mark:
            journal_mark = self.journal.segment.resident_changes
            journal_bytes = segment_bytes(self.segment_fds[0])
        if self.checkpoints.segment.resident_changes != checkpoint_mark:
            checkpoint_mark = self.checkpoints.segment.resident_changes
            checkpoint_bytes = segment_bytes(self.segment_fds[1])
        self.segment_held = (journal_bytes, checkpoint_bytes)
        self.segment_marks = (journal_mark, checkpoint_mark)
        held = checkpoint_bytes - self.checkpoints.pages.live_bytes
        self.host.set_overhead(journal_bytes + max(0, held))

    def _trim(self) -> None:
        """Give freed heap back to the host once enough private bytes were let go and
        more of the heap is free than it keeps for reuse (memory.keep_heap)."""
        self.trim_mark = max(self.trim_mark, self.host.private_bytes)
        if self.trim_mark - self.host.private_bytes > TRIM_BYTES:
            free = heap_free_bytes()
            if free is None or free > HEAP_KEEP_BYTES:
                trim_heap()
            self.trim_mark = self.host.private_bytes

    def checkpoint(self) -> None:
        """Publish a checkpoint and start the journal's next generation.  One that does
        not fit its segment is skipped (logged): the journal keeps everything, and the
        shard goes on serving, refusing new work once the journal is short of room."""
        generation = self.journal.generation + 1
        try:
            self.checkpoints.write(generation, self.service.checkpoint_document)
        except CapacityExhausted as exc:
            _log(f"cannot checkpoint ({exc}); the journal keeps every event")
            return
        self.journal.start_generation(generation, keep=self.journal_warm)
        self.events_since = 0
        self.private_peak = self.host.private_bytes
        self._account_segments()

    def _checkpoint_due(self) -> bool:
        self.private_peak = max(self.private_peak, self.host.private_bytes)
        pages = self.checkpoints.pages
        return (
            self.journal.room < self.journal_headroom
            # Pieces copied on write leave their published copies to the next checkpoint:
            # it frees them before they crowd out new pages.
            or pages.stale_bytes > min(CHECKPOINT_FREED_BYTES, self.host.capacity // 16)
            or (pages.stale_bytes > 0 and pages.area.free_bytes < self.checkpoints.area_bytes // 8)
            or self.journal.committed > CHECKPOINT_EVERY_BYTES
            or self.events_since > CHECKPOINT_EVERY_EVENTS
            # Freed bytes wait in the journal and the old checkpoint, counted against the
            # host, until the next checkpoint: a small host cannot wait for 64 MiB.
            or self.private_peak - self.host.private_bytes
            > min(CHECKPOINT_FREED_BYTES, self.host.capacity // 16)
        )

    def commit(self, events: list[Event]) -> None:
        crcs = self.checkpoints.pages.take_crcs()  # taken at every commit: none kept longer
        if not events:
            return
        # A record held in parts (a write's large data, events.RecordApplied) goes into
        # the frame without being copied into a packed message first, its data marked
        # with the CRC the page area computed as it copied it; a commit of small events
        # is packed in one call.
        payload: list[bytes | Checksummed] | bytes
        if any(type(e) is RecordApplied and type(e.record) is tuple for e in events):
            payload = _checksummed(frame_parts(events), crcs)
        else:
            payload = pack({"events": [to_wire(event) for event in events]})
        # No checkpoint here: the service state already holds this request's
        # effects, which must reach the journal, not a checkpoint, first.
        self.events_since += len(events)
        try:
            self.journal.append(payload)
        except SlatesError as exc:
            _log(f"cannot commit to the journal ({exc}); exiting so recovery drops the change")
            os._exit(3)
        _failpoint_after_commit()
        self._account_segments()

    def handle(
        self,
        hello: Hello,
        message: bytes | memoryview | Parts,
        link: LinkGrant | None = None,
    ) -> bytes | Job:
        """One request's packed reply, or the job a long request became (see answer).
        `link` is the write grant of the ring the request came on (slates.node.grants)."""
        try:
            request = _decoded(message)
        except SlatesError as exc:
            if link is not None:
                self._release_grant(link.end())
            return pack(error_reply(0, exc))
        return self._handle_request(hello, request, link)

    def _handle_request(
        self, hello: Hello, request: Request, link: LinkGrant | None = None
    ) -> bytes | Job:
        """`handle` of a decoded request."""
        under: Grant | None = None
        if link is not None:
            ended, covered = link.receive(request.op, request.args)
            self._release_grant(ended)
            data = request.args.get("data")
            # Promised room, but never past what the journal can still take whole (a
            # frame that does not fit ends the shard: commit).
            if covered and isinstance(data, bytes) and self.journal.room > 2 * len(data) + PAGE:
                under = ended
        if self._checkpoint_due():
            self.checkpoint()  # between requests: the state is exactly the journal's
        if (
            self.journal.room < self.journal_headroom
            and request.op not in RELEASING_OPS
            and under is None  # its room was promised
        ):
            # Near full even after a checkpoint: refuse new work, keep reads and deletes.
            full = CapacityExhausted(
                "the journal is nearly full: delete volumes or snapshots to make room",
                room=self.journal.room,
            )
            if request.op not in READ_ONLY_OPS:
                return pack(error_reply(request.seq, full))
        granting = link is not None and request.op in GRANTING_OPS
        charged = self._charged(request) if granting else 0
        reply = self._run(hello, request)
        if isinstance(reply, Job):
            return reply
        if granting and link is not None:
            reply = self._grant(link, request, reply, under, charged)
        return self._answered(request, reply)

    def _charged(self, request: Request) -> int:
        vid = request.args.get("volume")
        volume = self.service.volumes.get(vid) if isinstance(vid, str) else None
        return volume.charged_bytes if volume is not None else 0

    def _release_grant(self, grant: Grant | None) -> None:
        """Give back the room a grant held (a deleted volume gave it back already)."""
        if grant is None:
            return
        volume = self.service.volumes.get(grant.volume)
        if volume is not None and volume.inflight_bytes >= grant.held:
            volume.release_inflight(grant.held)

    def _grant(
        self,
        link: LinkGrant,
        request: Request,
        reply: dict[str, Any],
        under: Grant | None,
        charged: int,
    ) -> dict[str, Any]:
        """After a write: promise the next writes (slates.node.grants).  For a write
        that asked: anywhere in its file when none of it is read from the base (of at
        most SCATTER_EXTENTS extents), else from the write's end when that is the
        file's.  For one under a grant: what is left of it (its room less what the
        write was charged).  After a create that asked: the writes anywhere in the
        empty file it made (or found)."""
        args = request.args
        result = reply.get("result")
        if reply.get("error") is not None:
            return reply
        vid = args["volume"]  # a request that succeeded named its volume
        volume = self.service.volumes.get(vid)
        if volume is None:
            return reply
        if request.op == "fs.create":
            if args.get("behind") is not True or not isinstance(result, dict):
                return reply
            if result.get("size") != 0:
                return reply  # an existing file's end may need its base's last page
            return self._offer(link, vid, volume, int(result["ino"]), 0, reply, result, True)
        data = args.get("data")
        if not isinstance(data, bytes):
            return reply
        ino, end = int(args["ino"]), int(args["offset"]) + len(data)
        if under is not None:
            self._hold_rest(link, volume, under, end, cost(under, len(data)), charged)
            return reply  # a write under a grant: the bridge counts what is left itself
        if args.get("behind") is not True or not isinstance(result, dict):
            return reply
        try:
            scattered = not volume.reads_base(ino, SCATTER_EXTENTS)
            if not scattered and volume.getattr(ino).size != end:
                return reply  # not an append, and the next write may need the base
        except SlatesError:
            return reply
        return self._offer(link, vid, volume, ino, end, reply, result, scattered)

    def _hold_rest(
        self, link: LinkGrant, volume: Volume, grant: Grant, end: int, spent: int, charged: int
    ) -> None:
        """After writes under `grant` that took `spent` of it and ended at `end`: what
        is left of it held for the next ones, less the room the volume charged them
        (its charged bytes were `charged` before); nothing when nothing is left."""
        left = grant.left - spent
        held = grant.held - (volume.charged_bytes - charged)
        if left > 0 and held >= left:
            self._hold(link, grant.volume, volume, grant.ino, end, left, held, grant.scattered)

    def _offer(
        self,
        link: LinkGrant,
        vid: str,
        volume: Volume,
        ino: int,
        end: int,
        reply: dict[str, Any],
        result: dict[str, Any],
        scattered: bool,
    ) -> dict[str, Any]:
        """A fresh grant of GRANT_BYTES for writes to `ino` from `end` (anywhere in it:
        `scattered`), added to `reply`'s result, when the journal and the volume have
        room for it."""
        if self.journal.room < self.journal_headroom + 2 * GRANT_BYTES:
            return reply  # the journal could not take the promised writes
        held = GRANT_BYTES + GRANT_MARGIN
        if not self._hold(link, vid, volume, ino, end, GRANT_BYTES, held, scattered):
            return reply
        # A new reply: the saved one (a retry's answer) must not carry an old grant.
        granted = (
            {"grant": GRANT_BYTES, "scatter": SCATTER_COST} if scattered else {"grant": GRANT_BYTES}
        )
        return {**reply, "result": {**result, **granted}}

    @staticmethod
    def _hold(
        link: LinkGrant,
        vid: str,
        volume: Volume,
        ino: int,
        end: int,
        left: int,
        held: int,
        scattered: bool,
    ) -> bool:
        """Hold `held` bytes of `volume`'s room and make them `link`'s grant of `left`
        for writes to `ino` from `end` (or anywhere: `scattered`); False when the
        volume cannot."""
        try:
            volume.admit_inflight(held)
        except CapacityExhausted:
            return False
        link.offer(vid, ino, end, left, held, scattered=scattered)
        return True

    def _run(self, hello: Hello, request: Request) -> dict[str, Any] | Job:
        """Run one request and commit its events.  One refused for room that stale page
        copies hold runs again once after a checkpoint (which frees them), if what it
        did before its refusal is nothing, or what its second run finds done."""
        principal = _principal(hello)
        reply, events = self.service.handle(hello.client, request, time.time_ns(), principal)
        if self._room_after_checkpoint(reply):
            kept = self.service.withdraw_refusal(
                hello.client, request.seq, events, records=request.op in RERUN_AFTER_RECORDS
            )
            if kept is not None:
                self.commit(kept)  # its records too: the state holds them
                applied = self.service.applied
                self.checkpoint()  # one that does not fit is skipped: the run fails again
                # Freed space kept warm counts against the host: its pages go back too.
                if self.checkpoints.pages.cool():
                    self._account_segments()
                reply, events = self.service.handle(
                    hello.client, request, time.time_ns(), principal
                )
                self.service.applied[:0] = applied  # the mounts hear of both runs' records
        self.commit(events)
        return reply

    def _room_after_checkpoint(self, reply: dict[str, Any] | Job) -> bool:
        """Whether `reply` refused a request for room a checkpoint would make: the page
        area or the host was full while stale copies (pieces copied on write, whose
        published originals only the next checkpoint frees) wait, or while freed space
        kept warm (resident, so counted against the host) could go back."""
        pages = self.checkpoints.pages
        if isinstance(reply, Job) or (pages.stale_bytes == 0 and pages.area.warm_bytes == 0):
            return False
        error = reply.get("error")
        return isinstance(error, dict) and error.get("code") == "CapacityExhausted"

    async def answer(
        self, hello: Hello, message: bytes | memoryview | Parts, link: LinkGrant | None = None
    ) -> bytes:
        """The packed reply to one request; a long request's job runs to its end here,
        its I/O in worker threads and other connections' requests between its steps."""
        if self.ring_links and hello.mount is None:  # (a bridge's own: no wait)
            refused = await self._quiesce(message)
            if refused is not None:
                return refused
        return await self._finished(self.handle(hello, message, link))

    async def _answer_request(self, hello: Hello, request: Request, link: LinkGrant) -> bytes:
        """`answer` of a request a mount's ring brought, decoded (a mount's requests
        never wait for other mounts: _quiesce)."""
        return await self._finished(self._handle_request(hello, request, link))

    async def _finished(self, outcome: bytes | Job) -> bytes:
        """A request's packed reply: a long request's job run to its end first."""
        try:
            while isinstance(outcome, Job):
                outcome = await self._advance(outcome)
        finally:
            if isinstance(outcome, Job):  # cancelled (the client left): clean up after it
                self.commit(self.service.abandon(outcome))
        return outcome

    def _write_run(self, hello: Hello, run: list[Request], link: LinkGrant) -> list[bytes] | None:
        """Writes under the link's grant that queued one after another, applied as one
        write (slates.node.grants, "Runs"): each one's packed reply, or None with
        nothing changed when they must go one by one."""
        grant = link.grant
        total = sum(len(request.args["data"]) for request in run)
        if grant is None or self._checkpoint_due() or self.journal.room <= 2 * total + PAGE:
            return None
        volume = self.service.volumes.get(grant.volume)
        if volume is None:
            return None
        ended, _covered = link.receive(run[0].op, run[0].args)
        self._release_grant(ended)
        charged = volume.charged_bytes
        principal = _principal(hello)
        outcome = self.service.handle_write_run(hello.client, run, time.time_ns(), principal)
        if outcome is None:  # as it was: the grant held again, the writes one by one
            self._hold(link, grant.volume, volume, grant.ino, grant.end, grant.left,
                       grant.held, grant.scattered)  # fmt: skip
            return None
        replies, events = outcome
        self.commit(events)
        self.write_runs["runs"] += 1
        self.write_runs["writes"] += len(run)
        if all(reply.get("error") is None for reply in replies):
            last = run[-1].args
            spent = sum(cost(grant, len(request.args["data"])) for request in run)
            self._hold_rest(link, volume, grant, last["offset"] + len(last["data"]), spent, charged)
        # One record for the run: its invalidations and collection come with the first.
        return [self._answered(run[0], replies[0])] + [pack(reply) for reply in replies[1:]]

    async def _quiesce(self, message: bytes | memoryview | Parts) -> bytes | None:
        """Before another client's request that names a mounted volume: wait until each
        mount of that volume has had every request it had pushed by now answered.  A
        mount answers writes under a grant before the shard applies them
        (slates.node.grants); without this wait a read could miss a write a program
        already saw succeed, a snapshot could miss it, and a write could be overtaken
        by one answered before it.  None, or the packed refusal when a mount's ring
        does not drain within BARRIER_SECONDS."""
        pending = [
            (vid, ring, target)
            for vid, rings in self.ring_links.items()
            for ring in rings
            if ring.live and ring.done_to < (target := ring.pair.requests.positions()[0])
        ]
        if not pending:
            return None  # the usual case: every mount's ring is answered
        raw = message.head if isinstance(message, Parts) else bytes(message)
        # (a byte search for the volume's id, not a decode of every request: a
        # false match only waits for a ring that is being answered anyway)
        waits = [(ring, target) for vid, ring, target in pending if vid.encode() in raw]
        deadline = trio.current_time() + BARRIER_SECONDS
        while any(ring.live and ring.done_to < target for ring, target in waits):
            if trio.current_time() > deadline:
                try:
                    seq = _decoded(message).seq
                except SlatesError:
                    return None  # handle refuses it
                stuck = SnapshotBarrierFailed("a mount's requests were not all applied in time")
                return pack(error_reply(seq, stuck))
            await trio.sleep(0.001)
        return None

    async def _advance(self, job: Job) -> bytes | Job:
        waiting = job.waiting
        sent: Outcome
        if isinstance(waiting, Io):
            try:
                sent = Sent(await trio.to_thread.run_sync(waiting.fn, limiter=self.io_threads))
            except SlatesError as exc:
                sent = Thrown(exc)
            except OSError as exc:
                sent = Thrown(ConsistentBaseUnavailable("the disk failed", reason=str(exc)))
        else:
            await trio.lowlevel.checkpoint()  # others' requests run now
            sent = Sent()
        if self._checkpoint_due():
            self.checkpoint()
        reply, events = self.service.step(job, sent, time.time_ns())
        self.commit(events)
        if isinstance(reply, Job):
            return reply
        return self._answered(job.request, reply)

    def _answered(self, request: Request, reply: dict[str, Any]) -> bytes:
        """After a request's end: names, garbage, invalidations; the reply, packed."""
        if request.op in NAMING_OPS:
            self.write_names()
        self.service.collect_garbage()
        self._trim()
        if request.op == "status" and isinstance(reply.get("result"), dict):
            # Freed request buffers go back first: the heap figure is what it holds.
            trim_heap()
            reply["result"]["memory"] = self.memory()
            reply["result"]["write_runs"] = dict(self.write_runs)  # runs, writes in them
        for vid, notes in invalidations(self.service.applied).items():
            self.pending.setdefault(vid, []).extend(notes)
        for vid, notes in self.service.take_moved().items():
            self.pending.setdefault(vid, []).extend(notes)
        error = reply.get("error")
        if (
            request.op == "fs.read"
            and isinstance(error, dict)
            and error.get("code") == "BaseDrift"
            and isinstance(request.args.get("volume"), str)
            and isinstance(request.args.get("ino"), int)
        ):
            # Pages cached from before the drift must not mix with errors after it.
            vid, ino = request.args["volume"], request.args["ino"]
            self.drifted.setdefault(vid, []).append(["file", ino])
        packed = pack(reply)
        if len(packed) > MAX_FRAME - 1024:
            too_large = InvalidArgument("the reply is too large; ask for less", size=len(packed))
            packed = pack(error_reply(request.seq, too_large))
        return packed

    async def deliver(self, client: str) -> None:
        """Tell the watchers (mount bridges) what changed, before the change is answered.

        A bridge is not told of its own requests: its kernel made them.  A
        watcher that does not acknowledge within WATCH_SECONDS is dropped (its
        connection closed, so the bridge reconnects and starts clean).
        """
        pending, self.pending = self.pending, {}
        for vid, notes in pending.items():
            for watcher in list(self.watchers.get(vid, ())):
                if watcher.client != client:
                    await watcher.notify(notes)
        drifted, self.drifted = self.drifted, {}
        for vid, notes in drifted.items():
            for watcher in list(self.watchers.get(vid, ())):
                # Every mount, the reader's own included; not awaited, since that
                # bridge is waiting for this reply before it can answer anything.
                if self.background is not None:
                    self.background.start_soon(watcher.notify, notes)

    # -- connections ----------------------------------------------------------

    async def serve(self, listener: trio.socket.SocketType) -> None:
        async with trio.open_nursery() as nursery:
            self.background = nursery
            while True:
                conn, _address = await listener.accept()
                if self.connections >= MAX_CONNECTIONS:
                    conn.close()  # bounded: a refused client retries later
                    continue
                nursery.start_soon(self._connection, conn)

    async def _connection(self, conn: trio.socket.SocketType) -> None:
        self.connections += 1
        try:
            with conn:
                await self._converse(conn)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:  # one connection's failure never ends the shard
            _log(f"connection failed: {type(exc).__name__}: {exc}")
        finally:
            self.connections -= 1

    async def _converse(self, conn: trio.socket.SocketType) -> None:
        reader = FrameReader(MAX_HELLO)
        try:
            with trio.move_on_after(HELLO_SECONDS) as waiting:
                hello_frame = await receive_frame(conn, reader)
            if waiting.cancelled_caught or hello_frame is None:
                return  # a client that says nothing in time holds no connection
            hello = self._authenticate(parse_hello(unpack(hello_frame)), self._check_peer(conn))
            usage = self.usage.setdefault(hello.principal, _Usage(Budget(MAX_AGENT_BUFFERED)))
            if hello.principal and usage.connections >= MAX_AGENT_CONNECTIONS:
                raise CapacityExhausted(
                    "this agent has too many connections open", limit=MAX_AGENT_CONNECTIONS
                )
        except SlatesError as exc:
            await send_all(conn, frame(pack(error_reply(0, exc))))
            return
        reader.limit = MAX_FRAME
        if hello.principal:  # agents' unfinished frames count, together, against their budget
            reader.charge_to(usage.budget)
        usage.connections += 1
        try:
            await self._serve(conn, reader, hello)
        finally:
            usage.connections -= 1
            reader.release()

    async def _serve(self, conn: trio.socket.SocketType, reader: FrameReader, hello: Hello) -> None:
        answer = frame(
            pack({"ok": True, "shard": self.index, "pid": os.getpid(), "rings": hello.rings})
        )
        if hello.watch is not None:
            if hello.watch not in self.service.volumes:
                missing = NotFound("no such volume to watch", volume=hello.watch)
                await send_all(conn, frame(pack(error_reply(0, missing))))
                return
            await send_all(conn, answer)
            await self._watch(conn, reader, hello.client, hello.watch)
            return
        if not hello.rings:
            await send_all(conn, answer)
            while (message := await receive_frame(conn, reader)) is not None:
                reply = await self.answer(hello, message)
                await self.deliver(hello.client)
                await send_all(conn, frame(reply))
            return
        if hello.mount is not None:
            self.service.mounted[hello.mount] = self.service.mounted.get(hello.mount, 0) + 1
        try:
            await self._serve_rings(conn, reader, hello, answer)
        finally:
            if hello.mount is not None:  # the bridge is gone: so are the kernel's references
                left = self.service.mounted.pop(hello.mount, 1) - 1
                if left:
                    self.service.mounted[hello.mount] = left
                self.commit(self.service.release_mount(hello.mount))

    async def _serve_rings(
        self, conn: trio.socket.SocketType, reader: FrameReader, hello: Hello, answer: bytes
    ) -> None:
        with RingPair.create(RING_CAPACITY, spin_ns=self.spin_ns) as pair:
            fds = array.array("i", pair.fds)
            await conn.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            async with trio.open_nursery() as nursery:
                # Messages too large for a ring travel as frames on the socket;
                # the socket's end is also the client's end.
                nursery.start_soon(self._socket_requests, conn, reader, hello, nursery.cancel_scope)
                ring = RingLink(pair)
                if hello.mount is not None:  # a mount's: barriers wait for it
                    self.ring_links.setdefault(hello.mount, set()).add(ring)
                try:
                    await self._serve_ring(conn, pair, hello, ring)
                finally:
                    self._release_grant(ring.grant.end())
                    ring.live = False
                    if hello.mount is not None:
                        links = self.ring_links.get(hello.mount, set())
                        links.discard(ring)
                        if not links:
                            self.ring_links.pop(hello.mount, None)
            self._drain(hello, pair)

    def _drain(self, hello: Hello, pair: RingPair) -> None:
        """The client is gone: apply what it left in the request ring, in order.  A
        bridge answers writes under a grant before they are applied (slates.node.grants),
        so those must not die with it.  Their replies have no reader."""
        while (message := pair.requests.pop_request()) is not None:
            outcome = self.handle(hello, message)
            if isinstance(outcome, Job):  # a long request nobody waits for
                self.commit(self.service.abandon(outcome))

    async def _serve_ring(
        self, conn: trio.socket.SocketType, pair: RingPair, hello: Hello, ring: RingLink
    ) -> None:
        """Answer the ring's requests in order, one at a time, but for a mount's writes
        under its grant that queued one after another: those go as one (_write_run)."""
        while True:
            message = await pair.requests.receive_request()
            produced, taken = pair.requests.positions()
            if hello.mount is None or ring.grant.grant is None or produced == taken:
                reply = await self.answer(hello, message, ring.grant)
                await self._replied(conn, pair, hello, ring, taken, [reply])
                continue
            try:
                first = _decoded(message)
            except SlatesError:
                reply = await self.answer(hello, message, ring.grant)  # its refusal, as ever
                await self._replied(conn, pair, hello, ring, taken, [reply])
                continue
            # More queued: take the writes that continue this one's run (each decoded
            # before the next is taken, since a taken message's view is reused).
            run, at = [first], [taken]
            grant = ring.grant.grant
            after: tuple[Request | bytes | Parts, int] | None = None
            if first.op == "fs.write" and joins_run(grant, [], first.args):
                while (following := pair.requests.pop_request()) is not None:
                    position = pair.requests.positions()[1]
                    try:
                        request = _decoded(following)
                    except SlatesError:
                        raw = following if isinstance(following, Parts) else bytes(following)
                        after = (raw, position)
                        break
                    if request.op != "fs.write" or not joins_run(
                        grant, [r.args for r in run], request.args
                    ):
                        after = (request, position)
                        break
                    run.append(request)
                    at.append(position)
            replies = self._write_run(hello, run, ring.grant) if len(run) > 1 else None
            if replies is not None:
                await self._replied(conn, pair, hello, ring, at[-1], replies)
            else:
                for request, position in zip(run, at, strict=True):
                    reply = await self._answer_request(hello, request, ring.grant)
                    await self._replied(conn, pair, hello, ring, position, [reply])
            if after is not None:
                leftover, position = after
                if isinstance(leftover, Request):
                    reply = await self._answer_request(hello, leftover, ring.grant)
                else:
                    reply = await self.answer(hello, leftover, ring.grant)
                await self._replied(conn, pair, hello, ring, position, [reply])

    async def _replied(
        self,
        conn: trio.socket.SocketType,
        pair: RingPair,
        hello: Hello,
        ring: RingLink,
        taken: int,
        replies: list[bytes],
    ) -> None:
        """After requests up to ring position `taken` were answered: the barrier's mark,
        the watchers told, and the replies sent, in order."""
        ring.done_to = taken
        await self.deliver(hello.client)
        for reply in replies:
            if len(reply) > pair.replies.max_message:
                await send_all(conn, frame(reply))
                continue
            while not pair.replies.push(reply):
                await trio.sleep(0.0005)  # bounded ring: wait for the client to drain

    async def _socket_requests(
        self,
        conn: trio.socket.SocketType,
        reader: FrameReader,
        hello: Hello,
        scope: trio.CancelScope,
    ) -> None:
        while (message := await receive_frame(conn, reader)) is not None:
            reply = await self.answer(hello, message)
            await self.deliver(hello.client)
            await send_all(conn, frame(reply))
        scope.cancel()

    async def _watch(
        self, conn: trio.socket.SocketType, reader: FrameReader, client: str, vid: str
    ) -> None:
        watcher = Watcher(conn, client)
        self.watchers.setdefault(vid, set()).add(watcher)
        try:
            # A watcher reconnecting after a restart may have missed changes:
            # everything the kernel holds is refreshed once.
            held = self.service.volumes[vid].held_inodes()
            if held:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watcher.notify, [["inode", ino] for ino in held])
                    nursery.start_soon(self._acks, conn, reader, watcher)
                return
            await self._acks(conn, reader, watcher)
        finally:
            self.watchers[vid].discard(watcher)

    @staticmethod
    async def _acks(conn: trio.socket.SocketType, reader: FrameReader, watcher: Watcher) -> None:
        while (message := await receive_frame(conn, reader)) is not None:
            watcher.acknowledged(unpack(message))

    def _check_peer(self, conn: trio.socket.SocketType) -> int:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        _pid, uid, _gid = _UCRED.unpack(creds)
        return int(uid)

    def _authenticate(self, hello: Hello, uid: int) -> Hello:
        """The peer's principal: the agent its token names, else the operator (the
        anchor's own user or root, with no token)."""
        if hello.token is not None:
            if self.agents is None:
                raise AccessDenied("this service has no agents")
            principal = self.agents.authenticate(hello.token)
            for vid in (hello.watch, hello.mount):
                if vid is not None:  # an agent's bridge serves only a volume it may use
                    authorize(
                        principal,
                        "fs.getattr",
                        {"volume": vid},
                        self.service.owners,
                        self.service.greens,
                    )
            return dataclasses.replace(hello, token=None, principal=principal.name)
        if uid not in (0, os.geteuid()):
            raise AccessDenied("this service belongs to another user", peer_uid=uid)
        return hello


async def receive_frame(conn: trio.socket.SocketType, reader: FrameReader) -> bytes | None:
    """The next frame from a socket, or None at end of stream."""
    while (pending := reader.next_frame()) is None:
        data = await conn.recv(1 << 16)
        if not data:
            return None
        reader.feed(data)
    return pending


async def send_all(conn: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await conn.send(view)
        view = view[sent:]


WATCH_SECONDS = 10.0


class Watcher:
    """A bridge's notification connection: invalidations out, acknowledgements back."""

    def __init__(self, conn: trio.socket.SocketType, client: str) -> None:
        self.conn = conn
        self.client = client
        self.sent = 0
        self.acked = 0
        self.changed = trio.Event()
        self.lock = trio.Lock()  # one notification at a time on the socket
        self.dead = False

    async def notify(self, notes: list[list[Any]]) -> None:
        if self.dead:
            return
        async with self.lock:
            self.sent += 1
            number = self.sent
            with trio.move_on_after(WATCH_SECONDS):  # the send too: a watcher may not read
                try:
                    await send_all(self.conn, frame(pack({"inval": notes, "id": number})))
                    while self.acked < number:
                        await self.changed.wait()
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            if self.acked < number:
                self.dead = True
                self.conn.close()  # a watcher that cannot keep up starts over

    def acknowledged(self, message: dict[str, Any]) -> None:
        ack = message.get("ack")
        if isinstance(ack, int) and self.acked < ack <= self.sent:
            self.acked = ack
            self.changed.set()
            self.changed = trio.Event()


def invalidations(applied: list[tuple[str, Record]]) -> dict[str, list[list[Any]]]:
    """What a kernel caching a volume must forget after these records were applied.

    ["inode", ino] drops an inode's cached attributes and data;
    ["file", ino] does that for a regular file whose content or size changed, and a
    writeback mount's bridge also has the kernel drop the inode itself once nothing
    holds it, since that kernel keeps a file's size through every reply
    (native/bridge_prune.c);
    ["entry", parent, name] drops a cached name (also a negative one).
    """
    out: dict[str, list[list[Any]]] = {}
    for vid, record in applied:
        notes = out.setdefault(vid, [])
        match record:
            case (
                Write(ino=ino)
                | Truncate(ino=ino)
                | PunchHole(ino=ino)
                | ShareRange(dst_ino=ino)
                | Splice(ino=ino)
            ):
                notes.append(["file", ino])
            case SetAttr(ino=ino) | SetXattr(ino=ino) | RemoveXattr(ino=ino):
                notes.append(["inode", ino])
            case Create(parent=p, name=n) | Mkdir(parent=p, name=n) | Symlink(parent=p, name=n):
                notes += [["entry", p, n], ["inode", p]]
            case Mknod(parent=p, name=n) | Unlink(parent=p, name=n) | Rmdir(parent=p, name=n):
                notes += [["entry", p, n], ["inode", p]]
            case Link(ino=ino, parent=p, name=n):
                notes += [["entry", p, n], ["inode", p], ["inode", ino]]
            case Rename(parent=p, name=n, new_parent=q, new_name=m):
                notes += [["entry", p, n], ["entry", q, m], ["inode", p], ["inode", q]]
            case _:
                pass  # bindings, references, seals and snapshots change nothing visible
    return {vid: notes for vid, notes in out.items() if notes}


def _checksummed(
    parts: list[bytes], crcs: dict[int, tuple[bytes, int]]
) -> list[bytes | Checksummed]:
    """A frame's `parts` (events.frame_parts), each that is the very bytes object whose
    CRC the page area computed as it copied it (SegmentPages.take_crcs: a write's data)
    marked Checksummed, found by identity: no byte of it is read again for the journal."""
    if not crcs:
        return list(parts)
    out: list[bytes | Checksummed] = []
    for part in parts:
        known = crcs.get(id(part))
        out.append(Checksummed(part, known[1]) if known is not None and known[0] is part else part)
    return out


def unpack_events(payload: bytes) -> list[Event]:
    """A journal frame's events (slates.node.events; VerificationFailed for a malformed one)."""
    message = unpack(payload)
    events = message.get("events")
    if not isinstance(events, list):
        raise InvalidArgument("malformed journal frame")
    return [from_wire(event) for event in events]


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this shard if the anchor dies (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
        _log("could not tie this shard's life to the anchor's")
    if os.getppid() == 1:
        raise SystemExit("the anchor is already gone")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="slates-shard")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--journal-fd", type=int, required=True)
    parser.add_argument("--checkpoint-fd", type=int, required=True)
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--pool-fd", type=int, default=None, help="the host's capacity pool")
    parser.add_argument("--approver-key", default=None, help="the approver credential file")
    parser.add_argument(
        "--allow-root", action="append", default=[], help="where agents' bases may lie"
    )
    args = parser.parse_args(argv)
    _die_with_parent()
    refused = ask_short_slice()  # before trio starts its threads: they inherit it
    if refused is not None:
        _log(f"could not ask for a short scheduler slice ({refused}): requests may wait for a CPU")
    if not keep_heap():  # each 1 MiB request's buffers would fault fresh pages in
        _log("could not set malloc's thresholds: large requests fault fresh heap pages")
    key = None
    protected: tuple[str, ...] = ()
    if args.approver_key:
        with open(args.approver_key, "rb") as credential:
            key = credential.read().strip()
        if len(key) < MIN_APPROVER_KEY:
            _log("the approver credential is too short: no landing can be approved")
            key = None
        protected = (os.path.dirname(os.path.abspath(args.approver_key)),)
    shard = Shard(
        args.index,
        args.journal_fd,
        args.checkpoint_fd,
        args.arena_fd,
        args.capacity,
        key,
        protected,
        tuple(args.allow_root),
    )
    started = time.monotonic()
    replayed = shard.recover()
    shard.commit(shard.service.abandoned_captures())  # the last shard's unfinished jobs
    if args.pool_fd is not None:  # only now: until recovered, its slot keeps the old figure
        shard.host.attach_pool(HostPool.attach(args.pool_fd, args.index))
    shard.write_names()
    _log(
        f"shard {args.index} recovered {len(shard.service.volumes)} volumes, "
        f"{replayed} events, in {time.monotonic() - started:.3f}s"
    )
    listener = trio.socket.from_stdlib_socket(socket.socket(fileno=args.listen_fd))
    trio.run(shard.serve, listener)


if __name__ == "__main__":
    main()
