"""A shard's landing desk: plans, grants and applying approved manifests to disk.

Theory of operation (DESIGN.md section 6).  A plan compares a proposal
root (a green version, or a snapshot of a work volume) with the witness
root (the green volume's version 0, captured from the developer's
directory) path by path, and registers the resulting manifest under its
BLAKE3 id.  Plans are immutable: `rewitness` registers a new manifest.

A grant is issued only to a caller presenting the approver credential
(the anchor writes it, owner-only, into the runtime directory; the SDK
and the MCP server have no call that sends it).  The grant token is a
keyed BLAKE3 of the manifest id and the approver's fresh nonce under a key
derived from the credential, so it names one manifest and cannot be made
without the credential; each approval makes a new grant.  A grant is
used once: `apply` marks it used when its landing is committed;
a landing cut short by a crash leaves the grant unused, and the retry
finishes the remaining entries (the finished ones are then identical).

Merged content.  `rewitness --merge` proposes bytes that exist in no
snapshot (the agents' change merged with the developer's outside edit),
and witnesses the disk's bytes of that moment (the base of a later
merge).  The desk holds such content keyed by its BLAKE3 for the
manifests that name it (slates.land.held; `content` reads it): the
proposal of an entry is looked up there first, and a landing writes
exactly those bytes (the disk layer checks them against the approved
hash again).  Held content comes with its plan event, so the journal and
checkpoints keep it across a shard restart; a plan registered later that
names the same hash (a plain rewitness of a merged manifest) holds it
too, and a blob is kept while some plan holds it.  The store is bounded
(MAX_HELD_BLOBS, MAX_HELD_BYTES): beyond it the oldest plans that hold
content are dropped with their grants (their ids then give NotFound, as
for any plan dropped by MAX_PLANS), and one merge that alone exceeds the
bounds is refused (CapacityExhausted) before it is journaled.

Events (journaled by the service): ["plan", manifest wire] or ["plan",
{"manifest": wire, "held": {BLAKE3: bytes}}], ["grant", token, manifest
id], ["grant_used", token].  Plans and grants are bounded (MAX_PLANS,
oldest dropped).  Disk work goes through slates.land.disk; everything
else here is bookkeeping.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from typing import Any

import blake3

from slates.core.records import Kind
from slates.core.volume import ROOT_INO, DirBody, FileBody, Root, SymlinkBody
from slates.errors import (
    AccessDenied,
    GrantInvalid,
    InvalidArgument,
    NotFound,
    NotSupported,
    SlatesError,
    VerificationFailed,
)
from slates.land.disk import Applied, Target, state_of_bytes
from slates.land.held import HeldContent
from slates.land.manifest import (
    Decision,
    Entry,
    Manifest,
    State,
    check_relative,
    explain,
    manifest_from_wire,
    order_for_apply,
)
from slates.node.jobs import Io, JobBody

__all__ = ["LandingDesk", "MAX_PLANS", "MAX_HELD_BLOBS", "MAX_HELD_BYTES", "walk_tree"]

MAX_PLANS = 1024
MAX_HELD_BLOBS = 256
MAX_HELD_BYTES = 32 << 20
Emit = Callable[[list[Any]], None]


Private = Callable[[str, bool], bool]  # (path, is a directory) -> never landed


def walk_tree(root: Root, private: Private | None = None) -> dict[str, int]:
    """Every visible path (relative, no leading slash) and its inode number; a private
    path (and everything below a private directory) is left out."""
    out: dict[str, int] = {}
    stack: list[tuple[int, str]] = [(ROOT_INO, "")]
    while stack:
        ino, prefix = stack.pop()
        body = root.inodes[ino].body
        if not isinstance(body, DirBody):
            continue
        for entry in body.entries.values():
            path = f"{prefix}{entry.name}"
            is_dir = isinstance(root.inodes[entry.ino].body, DirBody)
            if private is not None and private(path, is_dir):
                continue
            out[path] = entry.ino
            stack.append((entry.ino, path + "/"))
    return out


def _digests(manifest: Manifest) -> set[str]:
    """The content hashes a manifest names (witnessed or proposed files)."""
    return {
        state.digest
        for entry in manifest.entries
        for state in (entry.witnessed, entry.proposed)
        if state is not None and state.kind == "file" and state.digest is not None
    }


class LandingDesk:
    def __init__(
        self,
        approver_key: bytes | None,
        *,
        max_held_blobs: int = MAX_HELD_BLOBS,
        max_held_bytes: int = MAX_HELD_BYTES,
        protected: tuple[str, ...] = (),
    ) -> None:
        self.protected = protected  # directories no target may reach (the runtime directory)
        self.plans: dict[str, Manifest] = {}
        self.grants: dict[str, list[Any]] = {}  # token -> [manifest id, used]
        self.held = HeldContent(max_held_blobs, max_held_bytes)
        self._grant_key = (
            None
            if approver_key is None
            else blake3.blake3(
                approver_key, derive_key_context="slates 2026 landing grants"
            ).digest()
        )
        self._approver_key = approver_key
        self.landing: set[str] = set()  # grants whose landing is running now (not journaled)

    # -- events -------------------------------------------------------------------

    def apply_event(self, event: list[Any]) -> None:
        match event:
            case ["plan", list(raw)]:
                self._add_plan(manifest_from_wire(raw), {})
            case ["plan", {"manifest": list(raw), "held": dict(held)}]:
                self._add_plan(manifest_from_wire(raw), held)
            case ["grant", str(token), str(manifest_id)]:
                self.grants[token] = [manifest_id, False]
            case ["grant_used", str(token)]:
                if token in self.grants:  # a plan evicted since takes its grants along
                    self.grants[token][1] = True
            case _:
                raise VerificationFailed("unknown landing event", event=repr(event)[:80])

    def _add_plan(self, manifest: Manifest, blobs: dict[str, bytes]) -> None:
        manifest_id = manifest.manifest_id
        self.held.add(manifest_id, _digests(manifest), blobs)
        self.plans.pop(manifest_id, None)
        self.plans[manifest_id] = manifest
        while len(self.plans) > MAX_PLANS:
            self._drop_plan(next(iter(self.plans)))
        while self.held.over_bounds():
            # The oldest plan holding content goes (never the one just added: a merge
            # that alone exceeds the bounds is refused before it is journaled).
            oldest = next((m for m in self.plans if self.held.holds(m) and m != manifest_id), None)
            if oldest is None:
                break
            self._drop_plan(oldest)

    def _drop_plan(self, manifest_id: str) -> None:
        del self.plans[manifest_id]
        for token in [t for t, g in self.grants.items() if g[0] == manifest_id]:
            del self.grants[token]
        self.held.release(manifest_id)

    def to_wire(self) -> dict[str, Any]:
        return {
            "plans": [m.to_wire() for m in self.plans.values()],
            "grants": {token: list(grant) for token, grant in self.grants.items()},
            "held": self.held.to_wire(),
        }

    def restore(self, raw: dict[str, Any]) -> None:
        self.plans = {}
        for item in raw["plans"]:
            manifest = manifest_from_wire(item)
            self.plans[manifest.manifest_id] = manifest
        self.grants = {str(t): [str(g[0]), bool(g[1])] for t, g in raw["grants"].items()}
        self.held = HeldContent(self.held.max_blobs, self.held.max_bytes)
        if "held" in raw:  # checkpoints from before merged content have none
            self.held.restore(raw["held"])

    # -- plans --------------------------------------------------------------------

    def sources(self) -> set[str]:
        """The snapshots the registered plans land from (they must be kept)."""
        return {manifest.source for manifest in self.plans.values()}

    def manifest(self, manifest_id: str) -> Manifest:
        found = self.plans.get(manifest_id)
        if found is None:
            raise NotFound("no such landing plan", manifest=manifest_id)
        return found

    @staticmethod
    def plan(
        witness: Root,
        proposal: Root,
        source: str,
        target: str,
        read: Callable[[Root, int], bytes],
        paths: list[str] | None,
        private: Private | None = None,
        target_identity: tuple[int, int] | None = None,
    ) -> Manifest:
        """The manifest that takes the witness to the proposal (restricted to `paths`);
        private paths (`private(path, is_dir)`) are never part of it."""
        before, after = walk_tree(witness, private), walk_tree(proposal, private)
        entries: list[Entry] = []
        for path in sorted(set(before) | set(after)):
            old_ino, new_ino = before.get(path), after.get(path)
            old = None if old_ino is None else witness.inodes[old_ino]
            new = None if new_ino is None else proposal.inodes[new_ino]
            if old is new:
                continue  # the very same inode object: untouched
            old_state = None if old_ino is None else _state(witness, old_ino, read)
            new_state = None if new_ino is None else _state(proposal, new_ino, read)
            if old_state != new_state:
                entries.append(Entry(path, old_state, new_state))
        manifest = Manifest(source, target, tuple(entries), target_identity)
        return manifest.select(paths) if paths else manifest

    def register(
        self, manifest: Manifest, emit: Emit, held: dict[str, bytes] | None = None
    ) -> Manifest:
        """Journal a plan; `held`: content it names that no snapshot holds (by BLAKE3)."""
        fresh = self.held.fresh(_digests(manifest), held or {})
        if fresh:
            emit(["plan", {"manifest": manifest.to_wire(), "held": fresh}])
        else:
            emit(["plan", manifest.to_wire()])
        return manifest

    def content(self, state: State | None) -> bytes | None:
        """The held content of a file state (merged proposals and their witnesses), if any."""
        if state is None or state.kind != "file" or state.digest is None:
            return None
        return self.held.get(state.digest)

    # -- grants and landing -------------------------------------------------------

    def grant(self, manifest_id: str, credential: Any, nonce: Any, emit: Emit) -> str:
        if self._approver_key is None or self._grant_key is None:
            raise AccessDenied("this shard has no approver credential configured")
        if not isinstance(credential, bytes) or not hmac.compare_digest(
            credential, self._approver_key
        ):
            raise AccessDenied("the approver credential is wrong")
        if not (
            isinstance(nonce, str)
            and 16 <= len(nonce) <= 64
            and all(c in "0123456789abcdef" for c in nonce)
        ):
            raise InvalidArgument("a grant needs a fresh nonce of 16 to 64 hex digits")
        self.manifest(manifest_id)
        token = blake3.blake3(f"{manifest_id}:{nonce}".encode(), key=self._grant_key).hexdigest()
        if token in self.grants and self.grants[token][1]:
            raise GrantInvalid("this grant was used already", manifest=manifest_id)
        emit(["grant", token, manifest_id])
        return token

    def _target(self, manifest: Manifest, *, lease: bool = False) -> Target:
        """The manifest's target, opened beneath the directory it was planned for."""
        return Target(
            manifest.target,
            lease=lease,
            protected=self.protected,
            identity=manifest.target_identity,
        )

    def check_grant(self, manifest_id: str, token: Any) -> None:
        grant = self.grants.get(token) if isinstance(token, str) else None
        if grant is None:
            raise GrantInvalid("no such grant")
        if grant[0] != manifest_id:
            raise GrantInvalid("the grant approves another manifest", manifest=manifest_id)
        if grant[1]:
            raise GrantInvalid("the grant was used already", manifest=manifest_id)

    def land(
        self,
        manifest: Manifest,
        token: str,
        content: Callable[[str], bytes | None],
        emit: Emit,
    ) -> JobBody:
        """Apply an approved manifest entry by entry; the grant is used once it is done.

        A job (slates.node.jobs): opening the target and writing each entry run
        off the shard's loop, the entries' bytes are read from the volume on it
        (one at a time, so a landing never holds more than one file's bytes).
        While it runs, its grant cannot be used by another request."""
        self.check_grant(manifest.manifest_id, token)
        if token in self.landing:
            raise GrantInvalid("the grant is being used", manifest=manifest.manifest_id)
        self.landing.add(token)
        outcomes: list[dict[str, Any]] = []
        try:
            target = yield Io(lambda: self._target(manifest, lease=True))
            try:
                pending = order_for_apply(manifest.entries)
                for index, entry in enumerate(pending):
                    body = None
                    failed: Exception | None = None
                    try:
                        if entry.proposed is not None and entry.proposed.kind != "dir":
                            body = content(entry.path)
                    except SlatesError as exc:
                        failed = exc
                    if failed is None:
                        done, failed = yield Io(functools.partial(_attempt, target, entry, body))
                    if failed is not None:
                        outcomes.append(_outcome(entry, "failed", None, reason=str(failed)))
                        outcomes += [
                            _outcome(e, "not attempted", None, reason=f"{entry.path} failed first")
                            for e in pending[index + 1 :]
                        ]
                        break
                    word = {
                        Decision.APPLY: "applied",
                        Decision.IDENTICAL: "identical",
                        Decision.CONFLICT: "conflict",
                    }[done.decision]
                    extra = {} if done.reason is None else {"reason": done.reason}
                    outcomes.append(_outcome(entry, word, done.disk, **extra))
                yield Io(target.finish)
            finally:
                target.close()  # the lease goes with the fd; closing does not wait on the disk
        finally:
            self.landing.discard(token)
        emit(["grant_used", token])
        conflicts = sum(1 for o in outcomes if o["outcome"] == "conflict")
        complete = all(o["outcome"] in ("applied", "identical") for o in outcomes)
        return {
            "manifest": manifest.manifest_id,
            "target": manifest.target,
            "complete": complete,
            "conflicts": conflicts,
            "entries": outcomes,
        }

    def read_base(self, manifest: Manifest, path: str) -> bytes | None:
        """What the disk holds now at one of the manifest's entries (nothing else)."""
        entry = _entry_at(manifest, path)
        with self._target(manifest) as target:
            return target.read(entry)

    def check(self, manifest: Manifest) -> list[dict[str, Any]]:
        """What landing each entry would do if it were approved now ("apply", "identical",
        "conflict" or "fail"), and why a conflict or failure would be one (for the approval
        screen; reads the disk, changes nothing)."""
        out: list[dict[str, Any]] = []
        with self._target(manifest) as target:
            for entry in manifest.entries:
                try:
                    disk = target.state(entry.path)
                except (OSError, SlatesError) as exc:  # e.g. a symlinked directory on the way
                    out.append(_outcome(entry, "fail", None, reason=str(exc)))
                    continue
                decision, reason = explain(entry.witnessed, disk, entry.proposed)
                word = {
                    Decision.APPLY: "apply",
                    Decision.IDENTICAL: "identical",
                    Decision.CONFLICT: "conflict",
                }[decision]
                out.append(
                    _outcome(entry, word, disk, **({} if reason is None else {"reason": reason}))
                )
        return out

    def disk_states(self, manifest: Manifest, paths: set[str]) -> dict[str, State | None]:
        """The disk's state now at these entries (a fifo or device shows as kind "other")."""
        with self._target(manifest) as target:
            return {e.path: target.state(e.path) for e in manifest.entries if e.path in paths}

    def observe(self, manifest: Manifest, paths: list[str] | None) -> dict[str, State | None]:
        """The disk's state now for the manifest's entries (or the chosen ones)."""
        entries = [e.path for e in (manifest.select(paths) if paths else manifest).entries]
        if paths and not entries:
            raise InvalidArgument("no entry of the manifest is at these paths", paths=paths[:8])
        observed: dict[str, State | None] = {}
        with self._target(manifest) as target:
            for path in entries:
                state = target.state(path)
                if state is not None and state.kind not in ("file", "dir", "symlink"):
                    raise InvalidArgument(
                        "the disk holds a fifo, device or socket at this entry", path=path
                    )
                observed[path] = state
        return observed


def _entry_at(manifest: Manifest, path: str) -> str:
    """`path` if it is one of the manifest's entries: reads of the disk stop there."""
    wanted = check_relative(path.strip("/"))
    if not any(entry.path == wanted for entry in manifest.entries):
        raise InvalidArgument("not an entry of this manifest", path=wanted)
    return wanted


def _state(root: Root, ino: int, read: Callable[[Root, int], bytes]) -> State:
    inode = root.inodes[ino]
    body = inode.body
    if isinstance(body, DirBody):
        return State("dir", None, inode.mode & 0o7777)
    if isinstance(body, SymlinkBody):
        return state_of_bytes("symlink", body.target.encode("utf-8", "surrogateescape"), 0o777)
    if isinstance(body, FileBody):
        return state_of_bytes("file", read(root, ino), inode.mode)
    raise NotSupported(f"a {Kind(inode.kind).name.lower()} cannot be landed", ino=ino)


def _attempt(
    target: Target, entry: Entry, body: bytes | None
) -> tuple[Applied | None, Exception | None]:
    """Land one entry (in a worker thread): what it did, or why it failed."""
    try:
        return target.land_entry(entry, body), None
    except (OSError, SlatesError) as exc:
        return None, exc


def _outcome(entry: Entry, outcome: str, disk: State | None, **extra: Any) -> dict[str, Any]:
    return {
        "path": entry.path,
        "outcome": outcome,
        "witnessed": None if entry.witnessed is None else entry.witnessed.to_wire(),
        "disk": None if disk is None else disk.to_wire(),
        "proposed": None if entry.proposed is None else entry.proposed.to_wire(),
        **extra,
    }
