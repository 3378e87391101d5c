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

Events (journaled by the service): ["plan", manifest wire],
["grant", token, manifest id], ["grant_used", token].  Plans and grants
are bounded (MAX_PLANS, oldest dropped).  Disk work goes through
slates.land.disk; everything else here is bookkeeping.
"""

from __future__ import annotations

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
from slates.land.disk import Target, state_of_bytes
from slates.land.manifest import (
    Decision,
    Entry,
    Manifest,
    State,
    check_relative,
    manifest_from_wire,
    order_for_apply,
)

__all__ = ["LandingDesk", "MAX_PLANS", "walk_tree"]

MAX_PLANS = 1024
Emit = Callable[[list[Any]], None]


def walk_tree(root: Root) -> dict[str, int]:
    """Every visible path (relative, no leading slash) and its inode number."""
    out: dict[str, int] = {}
    stack: list[tuple[int, str]] = [(ROOT_INO, "")]
    while stack:
        ino, prefix = stack.pop()
        body = root.inodes[ino].body
        if not isinstance(body, DirBody):
            continue
        for entry in body.entries.values():
            path = f"{prefix}{entry.name}"
            out[path] = entry.ino
            stack.append((entry.ino, path + "/"))
    return out


class LandingDesk:
    def __init__(self, approver_key: bytes | None) -> None:
        self.plans: dict[str, Manifest] = {}
        self.grants: dict[str, list[Any]] = {}  # token -> [manifest id, used]
        self._grant_key = (
            None
            if approver_key is None
            else blake3.blake3(
                approver_key, derive_key_context="slates 2026 landing grants"
            ).digest()
        )
        self._approver_key = approver_key

    # -- events -------------------------------------------------------------------

    def apply_event(self, event: list[Any]) -> None:
        match event:
            case ["plan", list(raw)]:
                manifest = manifest_from_wire(raw)
                self.plans.pop(manifest.manifest_id, None)
                self.plans[manifest.manifest_id] = manifest
                while len(self.plans) > MAX_PLANS:
                    oldest = next(iter(self.plans))
                    del self.plans[oldest]
                    for token in [t for t, g in self.grants.items() if g[0] == oldest]:
                        del self.grants[token]
            case ["grant", str(token), str(manifest_id)]:
                self.grants[token] = [manifest_id, False]
            case ["grant_used", str(token)]:
                if token in self.grants:  # a plan evicted since takes its grants along
                    self.grants[token][1] = True
            case _:
                raise VerificationFailed("unknown landing event", event=repr(event)[:80])

    def to_wire(self) -> dict[str, Any]:
        return {
            "plans": [m.to_wire() for m in self.plans.values()],
            "grants": {token: list(grant) for token, grant in self.grants.items()},
        }

    def restore(self, raw: dict[str, Any]) -> None:
        self.plans = {}
        for item in raw["plans"]:
            manifest = manifest_from_wire(item)
            self.plans[manifest.manifest_id] = manifest
        self.grants = {str(t): [str(g[0]), bool(g[1])] for t, g in raw["grants"].items()}

    # -- plans --------------------------------------------------------------------

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
    ) -> Manifest:
        """The manifest that takes the witness to the proposal (restricted to `paths`)."""
        before, after = walk_tree(witness), walk_tree(proposal)
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
        manifest = Manifest(source, target, tuple(entries))
        return manifest.select(paths) if paths else manifest

    def register(self, manifest: Manifest, emit: Emit) -> Manifest:
        emit(["plan", manifest.to_wire()])
        return manifest

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
    ) -> dict[str, Any]:
        """Apply an approved manifest entry by entry; the grant is used once it is done."""
        self.check_grant(manifest.manifest_id, token)
        outcomes: list[dict[str, Any]] = []
        with Target(manifest.target) as target:
            pending = order_for_apply(manifest.entries)
            for index, entry in enumerate(pending):
                try:
                    body = None
                    if entry.proposed is not None and entry.proposed.kind != "dir":
                        body = content(entry.path)
                    decision, disk = target.apply(entry, body)
                except (OSError, SlatesError) as exc:
                    outcomes.append(_outcome(entry, "failed", None, reason=str(exc)))
                    outcomes += [_outcome(e, "not attempted", None) for e in pending[index + 1 :]]
                    break
                word = {
                    Decision.APPLY: "applied",
                    Decision.IDENTICAL: "identical",
                    Decision.CONFLICT: "conflict",
                }[decision]
                outcomes.append(_outcome(entry, word, disk))
            target.finish()
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

    @staticmethod
    def read_base(manifest: Manifest, path: str) -> bytes | None:
        """What the disk holds now at one of the manifest's entries (nothing else)."""
        entry = _entry_at(manifest, path)
        with Target(manifest.target, lease=False) as target:
            return target.read(entry)

    @staticmethod
    def observe(manifest: Manifest, paths: list[str] | None) -> dict[str, State | None]:
        """The disk's state now for the manifest's entries (or the chosen ones)."""
        entries = [e.path for e in (manifest.select(paths) if paths else manifest).entries]
        if paths and not entries:
            raise InvalidArgument("no entry of the manifest is at these paths", paths=paths[:8])
        observed: dict[str, State | None] = {}
        with Target(manifest.target, lease=False) as target:
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


def _outcome(entry: Entry, outcome: str, disk: State | None, **extra: Any) -> dict[str, Any]:
    return {
        "path": entry.path,
        "outcome": outcome,
        "witnessed": None if entry.witnessed is None else entry.witnessed.to_wire(),
        "disk": None if disk is None else disk.to_wire(),
        "proposed": None if entry.proposed is None else entry.proposed.to_wire(),
        **extra,
    }
