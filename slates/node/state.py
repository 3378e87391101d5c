"""A shard's state and the one way it changes: applying journal events.

Theory of operation: everything a shard knows (volumes and their names,
snapshots, saved replies and acknowledgements, owners, the green/work
ledger, the landing desk's plans) lives in a ShardState, and changes only
by `_apply_event` (slates.node.events: one typed record per kind) or by a
volume applying a record, which its hook turns into a RecordApplied.  An
event is applied before it is kept (`_emit`), so one that fails is never
journaled; records and VolumeReset are applied as they happen, so only
replay applies them here.  `replay` rebuilds the state from committed
events after a crash (an event that cannot be applied now fails only its
volume); `checkpoint`/`restore` save and load the whole state, so replay
reads only the events after the last checkpoint.  `collect_garbage` frees
the chunks no volume or snapshot names, keeping what the `kept_chunks`
hook names (the service's remote bases); `withdraw_refusal` forgets a
refused request's saved reply so the driver may run it again
(slates.node.shard).

ShardService (slates.node.service) is the subclass that turns requests
into events; this module does no I/O of its own (the base reader it is
given reads source directories, for volumes over live bases).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack

from slates.core import checkpoint
from slates.core.checkpoint import PageStore
from slates.core.host import Host
from slates.core.records import Record, TakeSnapshot, decode, encoded_parts
from slates.core.volume import BaseReader, Capacity, Snapshot, Volume, held
from slates.errors import (
    AccessDenied,
    InvalidArgument,
    MissingContent,
    SlatesError,
    VerificationFailed,
    error_from_wire,
)
from slates.node import events as journal
from slates.node.events import (
    ClientBound,
    ClientEnded,
    Event,
    GrantIssued,
    GrantUsed,
    GreenMade,
    OwnerSet,
    PlanRegistered,
    RecordApplied,
    RepliesAcked,
    ReplySaved,
    SnapshotDeleted,
    VersionLanded,
    VersionMade,
    VersionsPruned,
    VolumeCloned,
    VolumeDropped,
    VolumeMade,
    VolumeReset,
    WorkHeld,
    WorkMade,
    WorkRebased,
)
from slates.node.landing import LandingDesk
from slates.node.ledger import WORK_INO_SHIFT, Ledger, Version

__all__ = ["ShardState", "GARBAGE_BATCH_BYTES"]

GARBAGE_BATCH_BYTES = 4 << 20
_META_LENGTH = struct.Struct("<Q")  # a shard checkpoint starts with its meta's length


def _nothing_to_adopt() -> None:
    """The state keeps nothing of a published checkpoint (its store does)."""


class ShardState:
    def __init__(
        self,
        index: int,
        host: Host,
        open_base: Callable[[str], BaseReader],
        approver_key: bytes | None = None,
        protected: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.host = host
        self.open_base = open_base
        self.volumes: dict[str, Volume] = {}
        self.names: dict[str, str] = {}  # volume id -> name
        self.base_keys: dict[str, str | None] = {}
        # Bases a request opened (once) for the volume it makes: its event takes them.
        self.opening: dict[str, BaseReader] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.failed: dict[str, SlatesError] = {}  # volumes recovery could not rebuild
        self.results: dict[str, dict[int, dict[str, Any]]] = {}
        self.acked: dict[str, int] = {}
        self.next_id = 1
        # Bytes that retired volumes may have left unreferenced: their own
        # content since their last snapshot (older content belongs to snapshots).
        self.garbage_bytes = 0
        self.ledger = Ledger()  # green volumes' versions, work volumes' roles
        self.origins: dict[str, str] = {}  # volume id -> the snapshot it was cloned from
        self.owners: dict[str, str] = {}  # volume id -> the agent that made it (operator: absent)
        self.client_principals: dict[str, str] = {}  # client id -> its principal's name
        # Invalidations for mounts whose volume moved onto another version.
        self.moved: dict[str, list[list[Any]]] = {}
        # Directories no base and no landing may reach: the runtime directory,
        # which holds the approver credential.
        self.protected = tuple(os.path.realpath(p) for p in protected)
        self.desk = LandingDesk(approver_key, protected=self.protected)
        self._events: list[Event] = []  # the current request's, in order
        # The records applied by the current request, for the driver's cache
        # invalidations (so it need not decode the journal events again).
        self.applied: list[tuple[str, Record]] = []

    @property
    def greens(self) -> dict[str, list[Version]]:
        """Green volume id -> its versions (read only)."""
        return self.ledger.greens

    @property
    def works(self) -> dict[str, tuple[str, int]]:
        """Work volume id -> (its green, the version it is based on): a copy."""
        return {vid: (work.green, work.role.base) for vid, work in self.ledger.works.items()}

    @property
    def green_sources(self) -> dict[str, str | None]:
        """Green volume id -> the directory it captured (read only)."""
        return self.ledger.sources

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: Event | list[Any]) -> None:
        """Apply an event, then keep it for the journal.  The landing desk hands its
        events over in their wire form."""
        if not isinstance(event, Event):
            event = journal.from_wire(event)
        # Applied first: an event that fails (a quota refused) is never journaled.
        self._apply_event(event, live=True)
        self._events.append(event)

    def _watch(self, vid: str, volume: Volume) -> None:
        def on_applied(record: Record, result: object) -> None:
            # In parts: a large write's data is journaled as the same object, not joined
            # into a copy of the record first (events.RecordApplied, frame_parts).
            parts = encoded_parts(record)
            encoded = parts[0] if len(parts) == 1 else tuple(parts)
            self._events.append(RecordApplied(vid, encoded))
            self.applied.append((vid, record))
            self._after_record(record, result)

        volume.on_applied = on_applied

    def _after_record(self, record: Record, result: object) -> None:
        if isinstance(record, TakeSnapshot) and isinstance(result, Snapshot):
            self.snapshots[result.snapshot_id] = result
            self._saw_id(result.snapshot_id)

    def _saw_id(self, object_id: str) -> None:
        """Ids are never reused, also after replay."""
        self.next_id = max(self.next_id, int(object_id.rsplit("-", 1)[1]) + 1)

    # -- events -----------------------------------------------------------------

    def replay(self, events: Iterable[Event]) -> int:
        """Apply committed events (recovery); replies are not produced again.  Returns
        how many were applied.

        Replay never stops the shard: an event that cannot be applied now (its
        base directory was deleted, say) fails only its volume, which then
        answers every request with that error until it is deleted.  Pass the
        whole journal after the checkpoint as one stream (the shard does): the
        collection runs once, after its last event, since an earlier one could
        free content that a later event names again (a chunk stored before the
        event that uses it).
        """
        replayed = 0
        for event in events:
            replayed += 1
            try:
                self._apply_event(event, live=False)
            except SlatesError as exc:
                if not isinstance(event, (VolumeMade, VolumeCloned)):
                    raise
                self.names.setdefault(event.vid, event.name)
                base_key = event.base_key if isinstance(event, VolumeMade) else None
                self.base_keys.setdefault(event.vid, base_key)
                self.failed[event.vid] = exc
                self._saw_id(event.vid)
        self.collect_garbage(force=True)
        return replayed

    def withdraw_refusal(
        self, client: str, seq: int, events: list[Event], *, records: bool = False
    ) -> list[Event] | None:
        """Forget the saved reply of a refused request, so it may run again: returns its
        other events, still to commit (the client's binding or acknowledgement; with
        `records`, the records it applied before its refusal too), or None, withdrawing
        nothing, when it did more than that."""
        rest = [
            e
            for e in events
            if not (isinstance(e, ReplySaved) and (e.client, e.seq) == (client, seq))
        ]
        allowed = (
            (ClientBound, RepliesAcked, RecordApplied) if records else (ClientBound, RepliesAcked)
        )
        refused = len(events) - len(rest) == 1
        if not refused or not all(isinstance(e, allowed) for e in rest):
            return None
        saved = self.results[client]
        del saved[seq]
        if not saved:
            del self.results[client]
        return rest

    def _base_of(self, event: VolumeMade) -> BaseReader:
        """The base a new volume reads: the one its request opened (`opening`), else the
        directory at its path, which must still be the very directory it was made over."""
        assert event.base_key is not None
        reader = self.opening.pop(event.base_key, None) or self.open_base(event.base_key)
        identity = getattr(reader, "identity", None)
        if event.base_identity and identity is not None and tuple(identity) != event.base_identity:
            close = getattr(reader, "close", None)
            if close is not None:
                close()
            raise AccessDenied(
                "the base directory is not the one the volume was made over",
                base=event.base_key,
            )
        return reader

    def _apply_event(self, event: Event, *, live: bool) -> None:
        """Apply one event.  Records and resets take effect as they happen, so only
        replay applies them here; an event of any other kind is an error."""
        match event:
            # Every mutating request saves its reply and most acknowledge earlier ones:
            # those two come first (the classes are disjoint, so the order changes
            # nothing but the number of isinstance checks a request pays).
            case ReplySaved():
                self.results.setdefault(event.client, {})[event.seq] = event.reply
            case RepliesAcked():
                self.acked[event.client] = max(self.acked.get(event.client, 0), event.upto)
                saved = self.results.get(event.client, {})
                for seq in [s for s in saved if s <= event.upto]:
                    del saved[seq]
            case VolumeMade():
                base_key = event.base_key
                volume = Volume.new(
                    self.host,
                    base=None if base_key is None else self._base_of(event),
                    capacity=Capacity(event.bounded, event.limit),
                    case_insensitive=event.case_insensitive,
                    mode=event.mode,
                    uid=event.uid,
                    gid=event.gid,
                    time_ns=event.time_ns,
                )
                self._add_volume(event.vid, event.name, base_key, volume)
                self._saw_id(event.vid)
            case VolumeCloned():
                self._apply_clone(event)
                self._saw_id(event.vid)
            case RecordApplied() if not live:
                self._replay_record(event)
            case VolumeReset() if not live:
                self._replay_reset(event)
            case PlanRegistered() | GrantIssued() | GrantUsed():
                self.desk.apply_event(journal.to_wire(event))
            case GreenMade():
                self.ledger.apply(event)
                green_volume = self.volumes[event.vid]
                green_volume.number_from(green_volume.root.next_ino, 1 << WORK_INO_SHIFT)
            case WorkMade():
                self.ledger.apply(event)
                if event.vid not in self.failed:
                    self.volumes[event.vid].number_from(event.start, event.limit)
            case VersionMade() | WorkRebased() | WorkHeld() | VersionLanded():
                self.ledger.apply(event)
            case VersionsPruned():
                for snapshot_id in self.ledger.apply(event):
                    self.snapshots.pop(snapshot_id, None)
                self.garbage_bytes += GARBAGE_BATCH_BYTES  # their chunks may be free now
            case VolumeDropped():
                vid = event.vid
                self.owners.pop(vid, None)
                self.origins.pop(vid, None)
                self.ledger.drop(vid)
                dropped = self.volumes.pop(vid, None)
                self.names.pop(vid, None)
                self.base_keys.pop(vid, None)
                self.failed.pop(vid, None)
                if dropped is not None:
                    self._retire(dropped)  # collected after the drop is committed
            case ClientEnded():
                self.results.pop(event.client, None)
                self.acked.pop(event.client, None)
                self.client_principals.pop(event.client, None)
            case ClientBound():
                self.client_principals[event.client] = event.principal
            case OwnerSet():
                self.owners[event.vid] = event.principal
            case SnapshotDeleted():
                self.snapshots.pop(event.snapshot_id, None)
                self.garbage_bytes += GARBAGE_BATCH_BYTES
            case _:
                raise VerificationFailed("unknown journal event", event=repr(event)[:80])

    def _apply_clone(self, event: VolumeCloned) -> None:
        snapshot = self.snapshots.get(event.snapshot_id)
        if snapshot is None:
            self.names[event.vid] = event.name
            self.base_keys[event.vid] = None
            self.failed[event.vid] = MissingContent(
                "the snapshot it was cloned from is lost", snapshot=event.snapshot_id
            )
            return
        volume = Volume.clone(snapshot, self.host, Capacity(event.bounded, event.limit))
        key = getattr(snapshot.base, "root", None) if snapshot.base is not None else None
        self._add_volume(event.vid, event.name, key, volume)
        self.origins[event.vid] = event.snapshot_id

    def _replay_record(self, event: RecordApplied) -> None:
        if event.vid in self.failed:
            return
        record = decode(event.encoded)
        volume = self.volumes[event.vid]
        hook, volume.on_applied = volume.on_applied, None  # replay journals nothing
        try:
            result = volume.apply(record)
        except SlatesError as exc:
            self.failed[event.vid] = VerificationFailed(
                "replaying the journal failed", volume=event.vid, reason=str(exc)
            )
            return
        finally:
            volume.on_applied = hook
        self._after_record(record, result)

    def _replay_reset(self, event: VolumeReset) -> None:
        if event.vid in self.failed:
            return
        old = self.volumes[event.vid]
        try:
            fresh = Volume.clone(
                self.snapshots[event.snapshot_id], self.host, Capacity(old.bounded, old.limit)
            )
        except SlatesError as exc:  # it fitted when it ran; the volume fails alone
            self.failed[event.vid] = exc
            return
        fresh.number_from(*old.numbering)
        fresh.adopt_handles(old, set(event.remade))
        # Its key names the base it reads now: a remote volume moved onto a version
        # reads that version's (as the live move set it, slates.node.remote_ops).  A
        # reset over the same directory keeps the key as its request spelled it.
        root = getattr(fresh.base, "root", None)
        if isinstance(root, str) and root != getattr(old.base, "root", None):
            self.base_keys[event.vid] = root
        self._retire(old)
        self.volumes[event.vid] = fresh
        self._watch(event.vid, fresh)

    def _add_volume(self, vid: str, name: str, base_key: str | None, volume: Volume) -> None:
        self.volumes[vid] = volume
        self.names[vid] = name
        self.base_keys[vid] = base_key
        self._watch(vid, volume)

    def _retire(self, volume: Volume) -> None:
        self.garbage_bytes += volume.unique_bytes
        volume.close()

    def collect_garbage(self, *, force: bool = False) -> None:
        """Free chunks no volume or snapshot refers to, and recount the metadata only
        snapshots hold (call once the drop is committed).

        A collection walks every distinct inode on the shard, so it runs once
        retired volumes may have left GARBAGE_BATCH_BYTES behind (or when
        forced): at most that much waits to be freed, and a submission does
        not pay for a walk of the whole ledger.
        """
        if not self.garbage_bytes or (self.garbage_bytes < GARBAGE_BATCH_BYTES and not force):
            return
        self.garbage_bytes = 0
        found = held(self.volumes.values(), [s.root for s in self.snapshots.values()])
        self.host.collect([found.chunk_ids, set(self.kept_chunks())])
        self.host.recount_snapshot_metadata(found.shared_metadata)

    def kept_chunks(self) -> Iterable[bytes]:
        """Chunks a collection keeps though no extent names them (a subclass's: the
        service keeps what remote bases fetched); called once per collection."""
        return ()

    # -- views ----------------------------------------------------------------

    def info(self, vid: str) -> dict[str, Any]:
        volume = self.volumes[vid]
        counters = volume.counters()
        role, green, version = self.ledger.role_view(vid)
        return {
            "id": vid,
            "name": self.names[vid],
            "shard": self.index,
            "base": self.base_keys[vid],
            "bounded": volume.bounded,
            "limit": volume.limit,
            "role": role,
            "green": green,
            "version": version,
            "counters": {
                "referenced_bytes": counters.referenced_bytes,
                "unique_bytes": counters.unique_bytes,
                "metadata_bytes": counters.metadata_bytes,
                "charged_bytes": counters.charged_bytes,
                "host_physical_bytes": counters.host_physical_bytes,
            },
        }

    def status(self) -> dict[str, Any]:
        return {
            "shard": self.index,
            "volumes": [self.info(vid) for vid in sorted(self.volumes)],
            "snapshots": sorted(self.snapshots),
            "failed": {vid: error.to_wire() for vid, error in self.failed.items()},
            "host_physical_bytes": self.host.physical_bytes,
        }

    # -- checkpoints ----------------------------------------------------------

    def checkpoint(self) -> bytes:
        """The checkpoint of `checkpoint_pieces`, joined (tests and tools)."""
        return b"".join(self.checkpoint_pieces())

    def checkpoint_pieces(self) -> Iterator[bytes | bytearray]:
        """The shard's checkpoint, in pieces: [meta length u64][meta][core state blob].

        The core state ends with the private page buffers themselves
        (slates.core.checkpoint): write the pieces out before anything changes.
        """
        yield self._meta()
        yield from checkpoint.dump_state_pieces(
            self.volumes, self.snapshots, self._base_key, host=self.host
        )

    def checkpoint_document(self, pages: PageStore) -> tuple[bytes, Callable[[], None]]:
        """The shard's checkpoint with its page buffers placed in `pages` (the shard's
        checkpoint segment): [meta length u64][meta][core document], and what to call
        once it is published (here nothing: the store freezes what it placed itself;
        a subclass adds its own)."""
        document = checkpoint.dump_placed(
            self.volumes, self.snapshots, self._base_key, pages, host=self.host
        )
        return self._meta() + document, _nothing_to_adopt

    def _meta(self) -> bytes:
        """[meta length u64][meta]: everything but the volumes and snapshots."""
        meta = {
            "names": self.names,
            "base_keys": self.base_keys,
            "results": {c: list(r.items()) for c, r in self.results.items()},
            "acked": self.acked,
            "next_id": self.next_id,
            "failed": {vid: error.to_wire() for vid, error in self.failed.items()},
            "owners": self.owners,
            "origins": self.origins,
            "client_principals": self.client_principals,
            "landing": self.desk.to_wire(),
            **self.ledger.to_wire(),
        }
        head: bytes = msgpack.packb(meta, use_bin_type=True, unicode_errors="surrogateescape")
        return _META_LENGTH.pack(len(head)) + head

    @staticmethod
    def _base_key(base: BaseReader) -> str:
        root = getattr(base, "root", None)
        if not isinstance(root, str):
            raise InvalidArgument("this base reader cannot be checkpointed")
        return root

    def restore(self, blob: bytes | memoryview, pages: PageStore | None = None) -> None:
        """Load a checkpoint: a blob of `checkpoint`, or a document of
        `checkpoint_document` with the store its buffers were placed in."""
        view = memoryview(blob)
        try:
            (length,) = _META_LENGTH.unpack_from(view, 0)
            if length > len(view) - _META_LENGTH.size:
                raise ValueError("the checkpoint's meta runs past its end")
            meta = msgpack.unpackb(
                view[_META_LENGTH.size : _META_LENGTH.size + length],
                raw=False,
                strict_map_key=False,
                unicode_errors="surrogateescape",
            )
            loaded = checkpoint.load_state(
                view[_META_LENGTH.size + length :], self.host, self.open_base, pages=pages
            )
            self.names = dict(meta["names"])
            self.base_keys = dict(meta["base_keys"])
            self.results = {
                c: {int(s): r for s, r in items} for c, items in meta["results"].items()
            }
            self.acked = {c: int(a) for c, a in meta["acked"].items()}
            self.next_id = int(meta["next_id"])
            failed = dict(meta["failed"])
            ledger = Ledger.from_wire(meta)
            self.owners = {str(v): str(n) for v, n in meta["owners"].items()}
            self.origins = {str(v): str(o) for v, o in meta["origins"].items()}
            self.client_principals = {str(c): str(n) for c, n in meta["client_principals"].items()}
            self.desk.restore(meta["landing"])
        except (KeyError, TypeError, ValueError, struct.error, InvalidArgument) as exc:
            raise VerificationFailed("the checkpoint is malformed", reason=str(exc)) from None
        self.failed = {vid: error_from_wire(wire) for vid, wire in failed.items()}
        self.ledger = ledger
        self.failed.update(loaded.failures)
        self.snapshots = dict(loaded.snapshots)
        self.volumes = dict(loaded.volumes)
        for vid, volume in self.volumes.items():
            self._watch(vid, volume)
