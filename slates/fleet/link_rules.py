"""The fleet link's rules, without I/O: names, messages, identities and placement.

Theory of operation.  The fleet link (slates.fleet.link) moves bytes; what
those bytes must be, and every choice it makes from records, is here:

- Fleet names.  Volume ids are local to a host ("vol-0-3" exists on every
  host), so across the fleet a volume is named by its id and its original
  owner host: `fleet_name("h1", "vol-0-3") == "vol-0-3@h1"`; this is the
  green's key in etcd (`greens/vol-0-3@h1`).  The name never changes when
  ownership moves: etcd's GreenConfig says who owns it now.
- Messages.  The local socket (RUNTIME/fleet.sock) takes framed msgpack
  maps `{"op": "forward" | "hosts" | "owner" | "durable" | "takeover",
  ...}` (`parse_local`); a forward crosses QUIC as `{"shard", "client",
  "request"}` plus `names` when the ids it carries are another host's
  (`remote_payload` / `parse_remote`), a durability wait as `{"kind":
  "durable", ...}` (`durable_payload` / `parse_remote_durable`), ledger
  messages as `{"kind": "ledger", ...}` (slates.fleet.link_replicate).
  `volume_refs` finds the ids a request carries (its `volume` and `green`
  arguments).  Both validate everything: the
  request is a wire request (seq, ack, op, args: slates.node.protocol's
  rules), the shard a small integer, the client id 1..128 characters.
- Identity.  A forwarded request runs on the remote shard as client
  `forwarded_client_id(origin, client)`: the origin host is the one the
  QUIC handshake authenticated, never a field of the message, so one host
  cannot replay another's requests or read its saved replies; the same
  (origin, client) always maps to the same id, so a retry after a lost
  reply or a new connection gets the saved reply.  On an adopted green's
  new owner the client is `adopted_client_id(names, client)`: its
  requests for another host's ids are numbered apart from its others.
- Placement.  `choose_holders` picks a new green's 2f+1 holder candidates:
  this host first, then enrolled hosts in other failure domains (alive
  ones first, then by host id), at most MAX_HOLDERS, an odd number, so f
  follows (1 or 2 hosts: f=0, this host alone; 3 or more: f=1).
- Listing.  `host_listing` joins etcd's host records, etcd's alive keys and
  serf's verdicts into the rows `slates fleet hosts` shows.

Callers: slates.fleet.link, slates.fleet.link_forward, slates_cli/fleet.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

from slates.errors import InvalidArgument
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.etcd import HostRecord
from slates.fleet.pki import validate_host_id
from slates.node.protocol import MAX_CLIENT_ID, parse_request
from slates.sdk.names import VOLUME_ID

__all__ = [
    "DEFAULT_REGION",
    "Durable",
    "adopted_client_id",
    "Forward",
    "MAX_DURABLE_SECONDS",
    "SCOPES",
    "Takeover",
    "LocalRequest",
    "MAX_HOLDERS",
    "MAX_SHARDS",
    "RemoteForward",
    "choose_holders",
    "first_config",
    "fleet_name",
    "forwarded_client_id",
    "host_listing",
    "parse_local",
    "parse_remote",
    "durable_payload",
    "parse_remote_durable",
    "remote_payload",
    "split_fleet_name",
    "volume_refs",
]

MAX_HOLDERS: Final = 3
MAX_SHARDS: Final = 1024
DEFAULT_REGION: Final = "default"  # fleet.json names no region yet: every host is in one
FORWARDED_PREFIX: Final = "fl."
SCOPES: Final = ("restart", "host", "region")
MAX_DURABLE_SECONDS: Final = 120.0
ID_KEYS: Final = ("volume", "green")  # the request arguments that name volumes by id


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """`{"op": "forward"}` on the local socket: run `request` on `host`'s shard `shard`."""

    host: str
    shard: int
    client: str
    request: dict[str, Any]
    names: str = ""  # the host whose ids the request names ("": `host` itself)


@dataclasses.dataclass(frozen=True, slots=True)
class Durable:
    """`{"op": "durable"}`: wait until `version` of work volume `work`'s green reaches
    `scope`; `host` is the work volume's host ("": this one)."""

    host: str
    shard: int
    work: str
    version: int
    scope: str
    timeout: float


@dataclasses.dataclass(frozen=True, slots=True)
class Takeover:
    """`{"op": "takeover", "green": NAME, "epoch": E}`: commit this host as owner at E+1."""

    green: str
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class LocalRequest:
    """`{"op": "hosts"}` or `{"op": "owner", "green": NAME}` on the local socket."""

    op: str
    green: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteForward:
    """A forward as it arrives over QUIC; the origin is the authenticated peer."""

    origin: str
    shard: int
    client: str
    request: dict[str, Any]
    names: str = ""  # the host whose ids the request names ("": the serving host)


# -- names -------------------------------------------------------------------------------------


def fleet_name(host: str, local_id: str) -> str:
    """The fleet-wide name of a host's volume: "<id>@<host>"."""
    validate_host_id(host)
    if not local_id or "@" in local_id or "/" in local_id:
        raise InvalidArgument("a local id has no '@' or '/'", id=local_id)
    return f"{local_id}@{host}"


def split_fleet_name(name: str) -> tuple[str, str]:
    """(original owner host, local id) from a fleet name."""
    local_id, at, host = name.rpartition("@")
    if not at or not local_id:
        raise InvalidArgument("a fleet name is <id>@<host>", name=name)
    return validate_host_id(host), local_id


def forwarded_client_id(origin: str, client: str) -> str:
    """The client id a forwarded request has on the remote shard (module doc: Identity)."""
    validate_host_id(origin)
    _check_client(client)
    readable = f"{FORWARDED_PREFIX}{origin}.{client}"
    if len(readable) <= MAX_CLIENT_ID and not client.startswith("#"):
        return readable  # "#" marks the hashed form below: no readable id can take it
    digest = hashlib.sha256(client.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return f"{FORWARDED_PREFIX}{origin}.#{digest}"


def adopted_client_id(names: str, client: str) -> str:
    """The client id, on an adopted green's new shard, of a client's requests that name
    host `names`'s ids (deterministic, so a resend finds its saved reply)."""
    validate_host_id(names)
    _check_client(client)
    readable = f"{names}~{client}"
    if len(readable) <= MAX_CLIENT_ID and not client.startswith("#"):
        return readable
    digest = hashlib.sha256(client.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return f"{names}~#{digest}"


# -- messages ----------------------------------------------------------------------------------


def _check_client(client: object) -> str:
    if not isinstance(client, str) or not 0 < len(client) <= MAX_CLIENT_ID:
        raise InvalidArgument(f"a client id is 1..{MAX_CLIENT_ID} characters", field="client")
    return client


def _check_shard(shard: object) -> int:
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < MAX_SHARDS:
        raise InvalidArgument(f"a shard is 0..{MAX_SHARDS - 1}", field="shard")
    return shard


def _check_request(request: object) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise InvalidArgument("a forwarded request is a wire request map", field="request")
    parse_request(request)  # seq, ack, op, args as a shard expects them
    return request


def _names(message: Mapping[str, Any], field: str = "names") -> str:
    names = message.get(field, "")
    if not isinstance(names, str):
        raise InvalidArgument("names is a host id", field=field)
    return validate_host_id(names) if names else ""


def _durable(message: Mapping[str, Any]) -> Durable:
    version, scope, timeout = message.get("version"), message.get("scope"), message.get("timeout")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidArgument("durable names a version", field="version")
    if scope not in SCOPES:
        raise InvalidArgument(f"a durability scope is one of {', '.join(SCOPES)}", scope=scope)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_DURABLE_SECONDS:
        raise InvalidArgument(f"durable waits 0..{MAX_DURABLE_SECONDS} s", field="timeout")
    work = message.get("work")
    if not isinstance(work, str) or not work or "@" in work:
        raise InvalidArgument("durable names a local work volume id", field="work")
    return Durable(
        _names(message, "host"),
        _check_shard(message.get("shard")),
        work,
        version,
        str(scope),
        float(timeout),
    )


def parse_local(message: Mapping[str, Any]) -> Forward | LocalRequest | Durable | Takeover:
    """A request on the local socket, validated."""
    match message.get("op"):
        case "forward":
            host = message.get("host")
            if not isinstance(host, str):
                raise InvalidArgument("forward names a host", field="host")
            return Forward(
                validate_host_id(host),
                _check_shard(message.get("shard")),
                _check_client(message.get("client")),
                _check_request(message.get("request")),
                _names(message),
            )
        case "hosts":
            return LocalRequest("hosts")
        case "owner":
            green = message.get("green")
            if not isinstance(green, str) or not green:
                raise InvalidArgument("owner names a green", field="green")
            return LocalRequest("owner", green)
        case "durable":
            return _durable(message)
        case "takeover":
            green, epoch = message.get("green"), message.get("epoch")
            if not isinstance(green, str) or not green:
                raise InvalidArgument("takeover names a green", field="green")
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
                raise InvalidArgument("takeover names the epoch it expects", field="epoch")
            return Takeover(green, epoch)
        case op:
            raise InvalidArgument("unknown fleet link op", op=repr(op))


def remote_payload(forward: Forward) -> dict[str, Any]:
    """What crosses QUIC for a forward (the origin is the connection's authenticated peer)."""
    payload = {"shard": forward.shard, "client": forward.client, "request": forward.request}
    if forward.names and forward.names != forward.host:
        payload["names"] = forward.names
    return payload


def durable_payload(durable: Durable) -> dict[str, Any]:
    """What crosses QUIC for a durability wait on the work volume's host."""
    return {
        "kind": "durable",
        "shard": durable.shard,
        "work": durable.work,
        "version": durable.version,
        "scope": durable.scope,
        "timeout": durable.timeout,
    }


def parse_remote(origin: str, message: Mapping[str, Any]) -> RemoteForward:
    """A forward received over QUIC from the authenticated host `origin`, validated."""
    return RemoteForward(
        validate_host_id(origin),
        _check_shard(message.get("shard")),
        _check_client(message.get("client")),
        _check_request(message.get("request")),
        _names(message),
    )


def parse_remote_durable(message: Mapping[str, Any]) -> Durable:
    """A durability wait received over QUIC (for a work volume of this host)."""
    return _durable({**message, "host": ""})


def volume_refs(request: Mapping[str, Any]) -> dict[str, str]:
    """The arguments of a wire request that name volumes by local id (key -> id)."""
    args = request.get("args")
    if not isinstance(args, dict):
        return {}
    return {
        key: value
        for key in ID_KEYS
        if isinstance(value := args.get(key), str) and VOLUME_ID.fullmatch(value)
    }


# -- placement ---------------------------------------------------------------------------------


def choose_holders(
    own: HostRecord, enrolled: Iterable[HostRecord], alive: Mapping[str, str]
) -> HolderSet:
    """A new green's holder candidates (module doc: Placement).

    `alive` is etcd's host -> boot id of live leases; a host counts as alive
    when its live boot is the one it enrolled with.
    """
    chosen = [own]
    domains = {own.failure_domain}
    hosts = {own.host}
    others = sorted(
        (r for r in enrolled if r.host != own.host),
        key=lambda r: (alive.get(r.host) != r.boot_id, r.host),
    )
    for record in others:
        if len(chosen) == MAX_HOLDERS:
            break
        if record.failure_domain in domains or record.host in hosts:
            continue
        chosen.append(record)
        domains.add(record.failure_domain)
        hosts.add(record.host)
    count = len(chosen) if len(chosen) % 2 else len(chosen) - 1
    candidates = tuple(
        Candidate(Peer(r.host, r.boot_id), r.failure_domain, DEFAULT_REGION) for r in chosen[:count]
    )
    return HolderSet((count - 1) // 2, candidates)


def first_config(
    green: str, own: HostRecord, enrolled: Iterable[HostRecord], alive: Mapping[str, str]
) -> GreenConfig:
    """A green's first configuration: owned by this host and boot at epoch 1.

    `revision` is a placeholder: etcd assigns it (the key's mod_revision).
    """
    return GreenConfig(
        green=green,
        revision=1,
        epoch=1,
        owner=Peer(own.host, own.boot_id),
        holders=choose_holders(own, enrolled, alive),
    )


# -- listing -----------------------------------------------------------------------------------


def host_listing(
    records: Iterable[HostRecord], alive: Mapping[str, str], serf: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Rows for `slates fleet hosts`: each enrolled host, its lease and serf's verdict.

    `serf` is member name -> status (alive, failed, left); a host serf has
    not reported is "unknown".  `lease` is "alive" when etcd's alive key
    holds the boot id the host enrolled with, "stale" for another boot,
    "none" without one.
    """
    rows = []
    for record in sorted(records, key=lambda r: r.host):
        live_boot = alive.get(record.host)
        lease = "none" if live_boot is None else "alive" if live_boot == record.boot_id else "stale"
        rows.append(
            {
                "host": record.host,
                "failure_domain": record.failure_domain,
                "boot_id": record.boot_id,
                "quic_address": record.quic_address,
                "serf_address": record.serf_address,
                "fingerprint": record.fingerprint,
                "lease": lease,
                "serf": serf.get(record.host, "unknown"),
            }
        )
    return rows
