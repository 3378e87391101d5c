"""The regional council in etcd: enrolled hosts, host liveness and green configurations.

Theory of operation (DESIGN.md section 7, "Configuration in etcd" and
"Failover").  `Council` is a thin client of etcd 3.4's v3 JSON gateway
(grpc-gateway: POST /v3/kv/range, /v3/kv/put, /v3/kv/txn,
/v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke; keys and values
base64).  It owns no state besides its HTTP connections; etcd owns the
truth.  Under `prefix` it keeps:

- ``hosts/<host>``: a `HostRecord` (certificate fingerprint, failure
  domain, boot id, QUIC and serf addresses), written at enrollment;
- ``alive/<host>``: the host's current boot id, attached to a lease the
  host keeps alive; when the lease lapses etcd deletes the key, which is
  the "etcd lease lapses" half of a failover trigger;
- ``greens/<name>``: a `GreenConfig` (owner, epoch, holder sets).

Invariants.  A green's key is created once (`create_green` is a
transaction comparing create_revision == 0).  Every later change is one
transaction (`commit_config`) that succeeds only if the key has not been
modified since the caller-visible configuration at `expected_epoch` was
read (compare mod_revision): of racing candidates exactly one wins, and a
caller holding a stale epoch changes nothing.  An owner change must move
the epoch to exactly e+1; the epoch never decreases (`check_successor`).
`GreenConfig.revision` is not stored: it is read back as the key's
mod_revision, etcd's commit index, which only grows, so "install only
newer revisions" holds across every green.  Values are msgpack maps with
a format number; a value that does not decode is VerificationFailed.

Transport.  Several endpoints (members of one etcd cluster): a request
goes to the last endpoint that answered, and on a connection failure to
the next, for at most `rounds` passes over the list with a pause between
passes; then SlatesError (no dedicated "council unavailable" error exists
in slates/errors.py yet).  Reads and plain puts are replayed on any
transport failure or gRPC Unavailable; a transaction is replayed only when
the connection was never made, since a timed-out transaction may have
committed: that case raises SlatesError with outcome="unknown" and the
caller re-reads.  Every HTTP call has bounded connect and total timeouts.

Called by the fleet link (synchronously, or from trio via
trio.to_thread.run_sync); `check_successor` and the encode/decode
functions are pure.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final

import httpx
import msgpack

from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer

__all__ = [
    "Council",
    "GreenChanges",
    "HostRecord",
    "Lease",
    "check_successor",
    "decode_green",
    "decode_host",
    "encode_green",
    "encode_host",
]

RECORD_FORMAT: Final = 1
MAX_NAME_BYTES: Final = 255
GRPC_UNAVAILABLE: Final = 14  # no leader, or the member is shutting down: try another


@dataclasses.dataclass(frozen=True, slots=True)
class HostRecord:
    host: str
    fingerprint: str
    failure_domain: str
    boot_id: str
    quic_address: str
    serf_address: str


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int


@dataclasses.dataclass(frozen=True, slots=True)
class GreenChanges:
    """Greens modified after a revision; pass `revision` to the next `changes_since`."""

    revision: int
    greens: tuple[GreenConfig, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int


# -- pure: records <-> msgpack ---------------------------------------------------------------


def encode_host(record: HostRecord) -> bytes:
    fields = dataclasses.asdict(record)
    return bytes(msgpack.packb({"format": RECORD_FORMAT, **fields}))


def decode_host(data: bytes) -> HostRecord:
    fields = _unpack_map(data, "host record")
    try:
        return HostRecord(**{f.name: _text(fields, f.name) for f in dataclasses.fields(HostRecord)})
    except TypeError as exc:
        raise VerificationFailed("a stored host record does not decode", error=str(exc)) from exc


def _encode_peer(peer: Peer) -> list[str]:
    return [peer.host, peer.boot]


def _encode_holders(holders: HolderSet | None) -> dict[str, Any] | None:
    if holders is None:
        return None
    return {
        "f": holders.f,
        "candidates": [[c.peer.host, c.peer.boot, c.domain, c.region] for c in holders.candidates],
    }


def encode_green(config: GreenConfig) -> bytes:
    """msgpack of everything but `revision`, which etcd assigns (the key's mod_revision)."""
    return bytes(
        msgpack.packb(
            {
                "format": RECORD_FORMAT,
                "green": config.green,
                "epoch": config.epoch,
                "owner": _encode_peer(config.owner),
                "holders": _encode_holders(config.holders),
                "old_holders": _encode_holders(config.old_holders),
                "mirror": _encode_holders(config.mirror),
            }
        )
    )


def decode_green(data: bytes, revision: int) -> GreenConfig:
    fields = _unpack_map(data, "green configuration")
    try:
        holders = _decode_holders(fields["holders"])
        if holders is None:
            raise VerificationFailed("a stored green configuration has no holders")
        return GreenConfig(
            green=_text(fields, "green"),
            revision=revision,
            epoch=_integer(fields, "epoch"),
            owner=_decode_peer(fields["owner"]),
            holders=holders,
            old_holders=_decode_holders(fields.get("old_holders")),
            mirror=_decode_holders(fields.get("mirror")),
        )
    except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
        raise VerificationFailed(
            "a stored green configuration does not decode", error=str(exc)
        ) from exc


def _decode_peer(raw: Any) -> Peer:
    host, boot = raw
    if not isinstance(host, str) or not isinstance(boot, str):
        raise TypeError("a peer is [host, boot] strings")
    return Peer(host, boot)


def _decode_holders(raw: Any) -> HolderSet | None:
    if raw is None:
        return None
    f = raw["f"]
    if not isinstance(f, int):
        raise TypeError("f is an integer")
    candidates = []
    for entry in raw["candidates"]:
        host, boot, domain, region = entry
        if not all(isinstance(x, str) for x in entry):
            raise TypeError("a candidate is [host, boot, domain, region] strings")
        candidates.append(Candidate(Peer(host, boot), domain, region))
    return HolderSet(f, tuple(candidates))


def _unpack_map(data: bytes, what: str) -> dict[str, Any]:
    try:
        fields = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as exc:
        raise VerificationFailed(f"a stored {what} is not msgpack", error=str(exc)) from exc
    if not isinstance(fields, dict) or fields.get("format") != RECORD_FORMAT:
        raise VerificationFailed(f"a stored {what} has an unknown format")
    fields.pop("format")
    return fields


def _text(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name)
    if not isinstance(value, str):
        raise VerificationFailed("a stored record field is not text", field=name)
    return value


def _integer(fields: dict[str, Any], name: str) -> int:
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise VerificationFailed("a stored record field is not an integer", field=name)
    return value


# -- pure: which configuration may follow which ------------------------------------------------


def check_successor(current: GreenConfig, new: GreenConfig) -> None:
    """Raise InvalidArgument unless `new` may replace `current` in one commit.

    The green keeps its name; the epoch stays or moves to exactly e+1 (the
    holder sets may change at one epoch: a joint reconfiguration); a new
    owner (another host, or the same host with a new boot id) needs e+1.
    """
    if new.green != current.green:
        raise InvalidArgument("a configuration keeps its green", green=current.green)
    match new.epoch - current.epoch:
        case 0 if new.owner == current.owner:
            return
        case 0:
            raise InvalidArgument(
                "an owner change moves the epoch to e+1", epoch=current.epoch, green=new.green
            )
        case 1:
            return
        case _:
            raise InvalidArgument(
                "the epoch moves by at most one", epoch=current.epoch, new_epoch=new.epoch
            )


# -- I/O: the gateway --------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with `prefix` (etcd's range_end)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return b"\x00"  # every key
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def _grpc_error(payload: dict[str, Any], path: str) -> SlatesError:
    error = payload.get("error")
    if isinstance(error, dict):  # a streamed reply carries {"error": {"grpc_code": ...}}
        code, message = error.get("grpc_code"), str(error.get("message", ""))
    else:
        code, message = payload.get("code"), str(payload.get("message", error))
    match code:  # gRPC status codes
        case 5:  # NOT_FOUND: e.g. an expired lease
            return NotFound(message, request=path)
        case 3:  # INVALID_ARGUMENT
            return InvalidArgument(message, request=path)
        case 8:  # RESOURCE_EXHAUSTED: etcd's space quota
            return CapacityExhausted(message, request=path)
        case _:
            return SlatesError(message or "etcd refused the request", request=path, code=code)


def _error_code(payload: dict[str, Any]) -> object:
    error = payload.get("error")
    if isinstance(error, dict):
        return error.get("grpc_code")
    return payload.get("code")


class _Gateway:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float,
        connect_timeout: float,
        rounds: int,
        backoff: float,
    ) -> None:
        if not endpoints:
            raise InvalidArgument("the council needs at least one etcd endpoint")
        if rounds < 1 or timeout <= 0 or connect_timeout <= 0 or backoff < 0:
            raise InvalidArgument("rounds, timeouts and backoff must be positive")
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        self.rounds = rounds
        self.backoff = backoff
        self.preferred = 0
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=connect_timeout), trust_env=False
        )

    def close(self) -> None:
        self.client.close()

    def call(self, path: str, body: dict[str, Any], *, replay_safe: bool) -> dict[str, Any]:
        count = len(self.endpoints)
        failures: list[str] = []
        for attempt in range(self.rounds * count):
            if attempt and attempt % count == 0:
                time.sleep(self.backoff)
            index = (self.preferred + attempt) % count
            endpoint = self.endpoints[index]
            try:
                response = self.client.post(endpoint + path, json=body)
                payload = response.json()
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failures.append(f"{endpoint}: {exc!r}")
                continue
            except (httpx.TransportError, ValueError) as exc:
                if not replay_safe:
                    raise Unavailable(
                        "an etcd transaction's outcome is unknown; re-read before retrying",
                        outcome="unknown",
                        endpoint=endpoint,
                        request=path,
                        error=repr(exc),
                    ) from exc
                failures.append(f"{endpoint}: {exc!r}")
                continue
            if not isinstance(payload, dict):
                raise SlatesError("etcd answered something other than an object", request=path)
            if response.status_code != 200 or "error" in payload:
                if replay_safe and _error_code(payload) == GRPC_UNAVAILABLE:
                    failures.append(f"{endpoint}: {payload}")
                    continue
                raise _grpc_error(payload, path)
            self.preferred = index
            return payload
        raise Unavailable(
            "no etcd endpoint answered",
            request=path,
            endpoints=list(self.endpoints),
            attempts=len(failures),
            last_error=failures[-1] if failures else "",
        )


def _check_name(name: str, what: str) -> None:
    raw = name.encode()
    if not raw or len(raw) > MAX_NAME_BYTES or "/" in name or "\x00" in name:
        raise InvalidArgument(f"a {what} name is 1-255 bytes without '/' or NUL", name=name)


class Council:
    """The fleet's view of etcd; see the module docstring."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = "/slates/",
        *,
        timeout: float = 7.5,
        connect_timeout: float = 1.0,
        rounds: int = 2,
        backoff: float = 0.2,
        max_records: int = 10_000,
    ) -> None:
        """`timeout` bounds each HTTP call; keep it above etcd's own request timeout
        (5 s + 2 election timeouts) so a slow commit is answered rather than abandoned."""
        if not prefix.endswith("/"):
            raise InvalidArgument("the council prefix ends with '/'", prefix=prefix)
        if max_records < 1:
            raise InvalidArgument("max_records is at least 1")
        self.prefix = prefix.encode()
        self.max_records = max_records
        self._gateway = _Gateway(
            endpoints,
            timeout=timeout,
            connect_timeout=connect_timeout,
            rounds=rounds,
            backoff=backoff,
        )

    def close(self) -> None:
        self._gateway.close()

    def __enter__(self) -> Council:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- keys

    def _key(self, kind: str, name: str) -> bytes:
        _check_name(name, kind)
        return self.prefix + f"{kind}/{name}".encode()

    def _kind_prefix(self, kind: str) -> bytes:
        return self.prefix + f"{kind}/".encode()

    # -- raw operations

    def _get(self, key: bytes) -> _KeyValue | None:
        payload = self._gateway.call("/v3/kv/range", {"key": _b64(key)}, replay_safe=True)
        found = [_parse_kv(kv) for kv in payload.get("kvs", [])]
        return found[0] if found else None

    def _list(self, prefix: bytes, *, min_mod_revision: int = 0) -> tuple[int, list[_KeyValue]]:
        body: dict[str, Any] = {
            "key": _b64(prefix),
            "range_end": _b64(_prefix_end(prefix)),
            "limit": str(self.max_records),
        }
        if min_mod_revision:
            body["min_mod_revision"] = str(min_mod_revision)
        payload = self._gateway.call("/v3/kv/range", body, replay_safe=True)
        if payload.get("more"):
            raise CapacityExhausted(
                "more council records than the listing bound",
                prefix=prefix.decode(),
                max_records=self.max_records,
            )
        revision = int(payload.get("header", {}).get("revision", 0))
        return revision, [_parse_kv(kv) for kv in payload.get("kvs", [])]

    def _put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._gateway.call("/v3/kv/put", body, replay_safe=True)

    def _txn(self, compare: list[dict[str, Any]], key: bytes, value: bytes) -> bool:
        body = {
            "compare": compare,
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        }
        payload = self._gateway.call("/v3/kv/txn", body, replay_safe=False)
        return bool(payload.get("succeeded", False))  # proto3 JSON omits false

    # -- hosts

    def enroll_host(self, record: HostRecord) -> None:
        """Record (or replace, e.g. with a new boot id) an enrolled host."""
        self._put(self._key("hosts", record.host), encode_host(record))

    def host(self, host: str) -> HostRecord | None:
        kv = self._get(self._key("hosts", host))
        return None if kv is None else decode_host(kv.value)

    def hosts(self) -> list[HostRecord]:
        _, kvs = self._list(self._kind_prefix("hosts"))
        return [decode_host(kv.value) for kv in kvs]

    # -- liveness

    def grant_lease(self, ttl: int) -> Lease:
        if ttl < 1:
            raise InvalidArgument("a lease lives at least one second", ttl=ttl)
        payload = self._gateway.call("/v3/lease/grant", {"TTL": str(ttl)}, replay_safe=True)
        return Lease(int(payload["ID"]), int(payload.get("TTL", 0)))

    def keepalive(self, lease: Lease) -> int:
        """Renew `lease`; returns its new TTL.  NotFound once it has expired or was revoked."""
        payload = self._gateway.call("/v3/lease/keepalive", {"ID": str(lease.id)}, replay_safe=True)
        ttl = int(payload.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise NotFound("the lease has expired", lease=lease.id)
        return ttl

    def revoke_lease(self, lease: Lease) -> None:
        """Drop `lease` and every key attached to it (a host leaving on purpose)."""
        self._gateway.call("/v3/lease/revoke", {"ID": str(lease.id)}, replay_safe=True)

    def mark_alive(self, host: str, boot_id: str, lease: Lease) -> None:
        """Put the host's alive key under `lease`; NotFound if the lease has expired."""
        self._put(self._key("alive", host), boot_id.encode(), lease.id)

    def alive_revision(self, host: str) -> tuple[str | None, int]:
        """The boot id under the host's alive key (None without one) and the key's
        mod_revision (0 without one), for `commit_config`'s `alive_unchanged`."""
        kv = self._get(self._key("alive", host))
        return (None, 0) if kv is None else (kv.value.decode(), kv.mod_revision)

    def alive_hosts(self) -> dict[str, str]:
        """Host -> boot id, for every host whose lease is still alive."""
        start = len(self._kind_prefix("alive"))
        _, kvs = self._list(self._kind_prefix("alive"))
        return {kv.key[start:].decode(): kv.value.decode() for kv in kvs}

    # -- greens

    def create_green(self, config: GreenConfig) -> bool:
        """Store the first configuration of a green; False if the green already exists."""
        key = self._key("greens", config.green)
        compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return self._txn([compare], key, encode_green(config))

    def green(self, name: str) -> GreenConfig | None:
        kv = self._get(self._key("greens", name))
        return None if kv is None else decode_green(kv.value, kv.mod_revision)

    def greens(self) -> list[GreenConfig]:
        return list(self.changes_since(0).greens)

    def changes_since(self, revision: int) -> GreenChanges:
        """Every green whose configuration was committed after `revision` (0: all).

        A level-triggered poll: it reads current values, so it needs no
        watch stream and is unaffected by etcd's history compaction.
        """
        if revision < 0:
            raise InvalidArgument("revisions are not negative", revision=revision)
        current, kvs = self._list(self._kind_prefix("greens"), min_mod_revision=revision + 1)
        return GreenChanges(current, tuple(decode_green(kv.value, kv.mod_revision) for kv in kvs))

    def commit_config(
        self,
        new: GreenConfig,
        expected_epoch: int,
        alive_unchanged: tuple[str, int] | None = None,
    ) -> bool:
        """Replace the green's configuration if it still stands at `expected_epoch`.

        False when the stored epoch is not `expected_epoch` or another
        commit lands between our read and our transaction (someone else
        won).  The transaction compares the key's mod_revision with the
        one read, so it succeeds only over exactly the configuration that
        was checked.  `new.revision` is ignored (etcd assigns it).
        `alive_unchanged` = (host, mod_revision from `alive_revision`): the
        transaction also requires that host's alive key to be as read (0:
        still absent), so an old owner that put its alive key back under a
        new lease meanwhile stops the takeover (slates.fleet.fencing).
        """
        key = self._key("greens", new.green)
        kv = self._get(key)
        if kv is None:
            raise NotFound("no such green in the council", green=new.green)
        current = decode_green(kv.value, kv.mod_revision)
        if current.epoch != expected_epoch:
            return False
        check_successor(current, new)
        compare = [
            {
                "key": _b64(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(kv.mod_revision),
            }
        ]
        if alive_unchanged is not None:
            host, revision = alive_unchanged
            compare.append(
                {
                    "key": _b64(self._key("alive", host)),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(revision),
                }
            )
        return self._txn(compare, key, encode_green(new))


def _parse_kv(raw: dict[str, Any]) -> _KeyValue:
    return _KeyValue(
        key=_unb64(raw["key"]),
        value=_unb64(raw.get("value", "")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
    )
