"""Volume references: the one rule by which a person or an agent names a volume.

Theory of operation.  A reference is either a volume id (`vol-<shard>-<n>`),
used as is without asking the service (the id names its shard, and the
shard answers NotFound for an id it does not hold), or a name, looked up
among the listed volumes.  A name must match exactly one volume: none is
NotFound, several is InvalidArgument naming the ids to choose from.  With a
`role` ("green", "work" or "volume") only volumes of that role count, so a
green volume and a work volume may share a name; a name that matches only
volumes of another role is NotFound saying what it does name.  Errors name
the candidates (bounded to MAX_CANDIDATES) so the caller can correct the
reference.

`pick_volume` is the pure rule (a reference and a volume listing in, an id
out); `AsyncClient.resolve` and `Client.resolve` (slates.sdk.client) list
the volumes only when the reference is not an id.  Callers: the CLI
(`slates ... VOLUME` arguments), the MCP server's tools, and SDK users.
Ids are not checked against the role: the service refuses an operation on
a volume of the wrong role itself (e.g. "not a work volume").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from slates.errors import InvalidArgument, NotFound

__all__ = [
    "MAX_CANDIDATES",
    "ROLES",
    "Role",
    "VOLUME_ID",
    "check_reference",
    "is_volume_id",
    "pick_volume",
]

VOLUME_ID = re.compile(r"vol-\d+-\d+")
Role = Literal["green", "work", "volume"]
ROLES: frozenset[str] = frozenset({"green", "work", "volume"})
MAX_CANDIDATES = 10
"""Most candidates an error lists (a host may hold thousands of volumes)."""


def is_volume_id(ref: str) -> bool:
    """True when `ref` has the form of a volume id (it is then never looked up by name)."""
    return VOLUME_ID.fullmatch(ref) is not None


def check_reference(ref: object, role: object = None) -> None:
    """InvalidArgument unless `ref` is a non-empty string and `role` one of ROLES (or None)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument("a volume reference is a volume id or a name", volume=str(ref))
    if role is not None and role not in ROLES:
        raise InvalidArgument(
            f"a role is one of {', '.join(sorted(ROLES))}", role=str(role), roles=sorted(ROLES)
        )


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_CANDIDATES])
    more = len(items) - MAX_CANDIDATES
    return shown + (f" and {more} more" if more > 0 else "")


def pick_volume(ref: str, volumes: Iterable[Mapping[str, Any]], role: Role | None = None) -> str:
    """The id that `ref` names among `volumes` (each with `id`, `name` and `role`).

    An id is returned as is; a name must match exactly one volume (of `role`,
    when given).  NotFound when none does, InvalidArgument when several do.
    """
    check_reference(ref, role)
    if is_volume_id(ref):
        return ref
    listing = list(volumes)
    named = [v for v in listing if v.get("name") == ref]
    wanted = named if role is None else [v for v in named if v.get("role", "volume") == role]
    what = "volume" if role is None else f"{role} volume"
    if not wanted:
        if named:  # the name exists, but only for volumes of another role
            others = [f"{v['id']} ({v.get('role', 'volume')})" for v in named]
            raise NotFound(
                f"no {what} is named {ref!r}; it names {_listed(others)}",
                volume=ref,
                role=str(role),
                candidates=[str(v["id"]) for v in named][:MAX_CANDIDATES],
            )
        names = sorted(
            {str(v.get("name")) for v in listing if role is None or v.get("role", "volume") == role}
        )
        known = f"; the {what}s here are named {_listed(names)}" if names else ""
        raise NotFound(
            f"no {what} has the id or name {ref!r}{known}",
            volume=ref,
            names=names[:MAX_CANDIDATES],
        )
    if len(wanted) > 1:
        ids = sorted(str(v["id"]) for v in wanted)
        raise InvalidArgument(
            f"{len(ids)} {what}s are named {ref!r} ({_listed(ids)}); use an id",
            name=ref,
            ids=ids[:MAX_CANDIDATES],
        )
    return str(wanted[0]["id"])
