"""Principals: who asks, and what each may do (DESIGN.md section 6a).

Theory of operation.  The operator runs the anchor; a client of the
operator's own user (or root) that presents no token acts as the operator,
with every right.  Each agent gets its own credential: `slates agent add
NAME` makes a random token, prints it once and keeps only its BLAKE3 in
RUNTIME/agents.json (0600, written atomically).  A client presents it in
its hello (`SLATES_TOKEN`, `AsyncClient(token=...)`, `slates mcp
--token-file`) and then acts as `agent:NAME`.

`Agents` reads and writes that file (the CLI adds and removes agents, every
shard authenticates against it, rereading it when it changed).  `authorize`
is the rule, pure: given the principal, the operation, and who owns the
volume it names, it raises AccessDenied or returns.  An agent may create
work volumes and volumes without a base (or over a base under a root the
operator allowed: `anchor --allow-root`), use its own volumes, read green
volumes, submit and rebase its own work and request landing plans (into an
allowed root, for its own work); it may not create or delete greens, name
other bases, use another principal's volumes, or grant and apply a landing.
Called by slates.node.shard (hello) and slates.node.service (every
request); the CLI manages the file.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

from slates.errors import AccessDenied, AlreadyExists, InvalidArgument, NotFound

__all__ = [
    "AGENTS_FILE",
    "OPERATOR",
    "Principal",
    "Agents",
    "authorize",
    "AGENT_OPS",
    "GREEN_READS",
    "FS_READS",
    "FS_WRITES",
]

AGENTS_FILE = "agents.json"
MAX_AGENTS = 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """The operator (name "") or one agent."""

    name: str = ""

    @property
    def is_operator(self) -> bool:
        return not self.name

    @property
    def label(self) -> str:
        return "operator" if self.is_operator else f"agent:{self.name}"


OPERATOR = Principal()

# A mount's requests (the agent's own bridge asks them): reads, and the rest.
FS_READS = frozenset(
    {"fs.lookup", "fs.forget", "fs.destroy", "fs.getattr", "fs.readlink", "fs.read"}
    | {"fs.readdir", "fs.statfs", "fs.getxattr", "fs.listxattr", "fs.lseek", "fs.access"}
    | {"fs.fsync", "fs.base"}
)
FS_WRITES = frozenset(
    {"fs.setattr", "fs.mknod", "fs.mkdir", "fs.unlink", "fs.rmdir", "fs.symlink", "fs.rename"}
    | {"fs.link", "fs.create", "fs.write", "fs.setxattr", "fs.removexattr", "fs.fallocate"}
    | {"fs.copy_file_range"}
)
# What an agent may do with a green volume it does not own: read it (a mount of it too).
GREEN_READS = frozenset(
    {"read", "list", "stat", "readlink", "volume.show", "versions", "changed_since"}
    | {"work.create", "land.plan"}
    | FS_READS
)
# What an agent may do with its own volumes (anything a client can ask of a volume).
OWN_VOLUME_OPS = frozenset(
    {"read", "list", "stat", "readlink", "volume.show", "volume.delete", "snapshot", "seal"}
    | {"write", "edit", "truncate", "mkdir", "symlink", "unlink", "rmdir", "rename"}
    | {"submit", "rebase", "land.plan", "counters"}
    | FS_READS
    | FS_WRITES
)
# Operations that name no volume and that an agent may ask.
AGENT_OPS = frozenset(
    {"status", "volume.list", "volume.create", "bye"}
    | {"land.show", "land.read_base", "land.content", "land.check", "land.rewitness"}
)


def authorize(
    principal: Principal,
    op: str,
    args: dict[str, Any],
    owner_of: dict[str, str],
    greens: frozenset[str] | set[str] | dict[str, Any],
    allowed: Callable[[object], bool] = lambda _path: False,
) -> None:
    """Raise AccessDenied unless `principal` may ask `op` with `args`.

    `owner_of` maps volume ids to their owners' names ("" for the operator);
    `greens` holds the green volumes' ids; `allowed(path)` says whether a base
    or a landing target lies under a root the operator allowed agents
    (`anchor --allow-root`).
    """
    if principal.is_operator:
        return
    target = args.get("volume", args.get("green"))
    if op in AGENT_OPS:
        base = args.get("base")
        if op == "volume.create" and (args.get("from") or (base is not None and not allowed(base))):
            raise AccessDenied(
                "an agent's base lies under a root the operator allowed (anchor --allow-root)",
                base=str(base),
                principal=principal.label,
            )
        return
    if op == "land.plan" and target not in greens and not allowed(args.get("target")):
        raise AccessDenied(
            "an agent's landing target lies under a root the operator allowed",
            target=str(args.get("target")),
            principal=principal.label,
        )
    if not isinstance(target, str):
        raise AccessDenied("agents may not do that", op=op, principal=principal.label)
    if owner_of.get(target) == principal.name:
        if op in OWN_VOLUME_OPS:
            return
        raise AccessDenied("agents may not do that", op=op, principal=principal.label)
    if target in greens and op in GREEN_READS:
        return
    raise AccessDenied(
        "that volume belongs to another principal", volume=target, principal=principal.label
    )


def hash_token(token: str) -> str:
    return str(blake3.blake3(token.encode("utf-8", "surrogateescape")).hexdigest())


class Agents:
    """The agents' credentials in RUNTIME/agents.json: {name: token hash}."""

    def __init__(self, runtime: str | os.PathLike[str]) -> None:
        self.path = Path(runtime) / AGENTS_FILE
        self._seen: tuple[int, int] | None = None
        self._hashes: dict[str, str] = {}

    def _load(self) -> dict[str, str]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen, self._hashes = None, {}
            return self._hashes
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._seen:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in data.items()
            ):
                raise InvalidArgument("the agents file is malformed", path=str(self.path))
            self._seen, self._hashes = stamp, data
        return self._hashes

    def _save(self, hashes: dict[str, str]) -> None:
        temporary = self.path.with_name(f".{AGENTS_FILE}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(hashes, out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)

    def names(self) -> list[str]:
        return sorted(self._load())

    def add(self, name: str) -> str:
        """A new agent; returns its token (shown once, kept only as a hash)."""
        if not _NAME.fullmatch(name):
            raise InvalidArgument(
                "an agent name is 1-64 letters, digits, '_', '.' or '-'", name=name
            )
        hashes = dict(self._load())
        if name in hashes:
            raise AlreadyExists("there is an agent of that name", name=name)
        if len(hashes) >= MAX_AGENTS:
            raise InvalidArgument(f"at most {MAX_AGENTS} agents", count=len(hashes))
        token = f"slates-{name}-{secrets.token_urlsafe(32)}"
        hashes[name] = hash_token(token)
        self._save(hashes)
        return token

    def remove(self, name: str) -> None:
        hashes = dict(self._load())
        if name not in hashes:
            raise NotFound("no agent of that name", name=name)
        del hashes[name]
        self._save(hashes)

    def authenticate(self, token: str) -> Principal:
        """The agent whose token this is, or AccessDenied."""
        digest = hash_token(token)
        for name, known in self._load().items():
            if hmac.compare_digest(known, digest):
                return Principal(name)
        raise AccessDenied("the token names no agent of this service")
