"""One host's place in the fleet: the `--fleet CONFIG` file, parsed and validated.

Theory of operation.  `slates anchor --fleet CONFIG` and the fleet link
(`python -m slates.fleet.link --config CONFIG`) read one JSON object with
exactly the fields the testbed writes (deploy/testbed/testbed_plan.py's
`fleet_config`): `host_id`, `failure_domain`, `etcd_endpoints`,
`serf_address`, `serf_rpc_address`, `quic_address` and `cert_dir`, and
optionally `lease_ttl` (seconds, 2..300: how long etcd keeps the host's
alive key after its last keepalive; the link's default, 10, without it).
`parse_host_config` turns such an object into a frozen `HostConfig`,
checking every field and naming the one that is wrong (InvalidArgument
with field=...); an unknown field is refused too, so a typo never goes
unnoticed.  `load_host_config` reads the file (NotFound if absent).

Rules: the host id is a DNS label (slates.fleet.pki.validate_host_id, as
its certificate names it); a failure domain is 1..63 printable characters
without '/'; etcd endpoints are 1..16 http(s) URLs with a host and a port;
the serf gossip and QUIC addresses are IP:port (peers are dialed by
address, never by a name nobody authenticated; port 0 is refused since
others must reach us there), and serf's RPC address is a loopback IP:port
(serf's RPC is unauthenticated); `cert_dir` is an absolute path, or a
relative one resolved against the config file's directory when loaded.

Pure except `load_host_config`.  Callers: slates.fleet.link, slates_cli/fleet.py,
the anchor.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import urllib.parse
from pathlib import Path
from typing import Any, Final

from slates.errors import InvalidArgument, NotFound
from slates.fleet.pki import validate_host_id

__all__ = [
    "HostConfig",
    "MAX_CONFIG_BYTES",
    "load_host_config",
    "parse_address",
    "parse_host_config",
]

MAX_CONFIG_BYTES: Final = 64 << 10
MAX_ENDPOINTS: Final = 16
MAX_DOMAIN: Final = 63
FIELDS: Final = (
    "host_id",
    "failure_domain",
    "etcd_endpoints",
    "serf_address",
    "serf_rpc_address",
    "quic_address",
    "cert_dir",
)
OPTIONAL_FIELDS: Final = ("lease_ttl",)
MAX_LEASE_TTL: Final = 300


@dataclasses.dataclass(frozen=True, slots=True)
class HostConfig:
    host_id: str
    failure_domain: str
    etcd_endpoints: tuple[str, ...]
    serf_address: str  # IP:port of the serf agent's gossip
    serf_rpc_address: str  # loopback IP:port of the serf agent's RPC
    quic_address: str  # IP:port the fleet link serves QUIC on
    cert_dir: Path
    lease_ttl: int | None = None  # None: the link's own default

    @property
    def quic_endpoint(self) -> tuple[str, int]:
        return parse_address(self.quic_address, "quic_address")


def parse_address(text: object, field: str, *, loopback: bool = False) -> tuple[str, int]:
    """(IP, port) from "IP:port" or "[IPv6]:port"; InvalidArgument naming `field`."""
    if not isinstance(text, str) or ":" not in text:
        raise InvalidArgument("an address is IP:port", field=field, value=repr(text))
    host, _, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
        port = int(port_text, 10)
    except ValueError:
        raise InvalidArgument("an address is IP:port", field=field, value=repr(text)) from None
    if not 0 < port < 65536:
        raise InvalidArgument("a port is 1..65535", field=field, value=repr(text))
    if loopback and not ip.is_loopback:
        raise InvalidArgument("this address must be a loopback address", field=field)
    if ip.is_unspecified:
        raise InvalidArgument("peers cannot reach an unspecified address", field=field)
    return str(ip), port


def _host_id(raw: object) -> str:
    if not isinstance(raw, str):
        raise InvalidArgument("host_id is a string", field="host_id")
    try:
        return validate_host_id(raw)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field="host_id", value=repr(raw)) from None


def _failure_domain(raw: object) -> str:
    if (
        not isinstance(raw, str)
        or not 0 < len(raw) <= MAX_DOMAIN
        or not raw.isprintable()
        or "/" in raw
    ):
        raise InvalidArgument(
            f"a failure domain is 1..{MAX_DOMAIN} printable characters without '/'",
            field="failure_domain",
        )
    return raw


def _endpoints(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_ENDPOINTS:
        raise InvalidArgument(
            f"etcd_endpoints is a list of 1..{MAX_ENDPOINTS} URLs", field="etcd_endpoints"
        )
    endpoints: list[str] = []
    for entry in raw:
        if not isinstance(entry, str):
            raise InvalidArgument("an etcd endpoint is a URL", field="etcd_endpoints")
        url = urllib.parse.urlsplit(entry)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise InvalidArgument(
                "an etcd endpoint is http(s)://HOST:PORT",
                field="etcd_endpoints",
                value=repr(entry),
            )
        if entry not in endpoints:
            endpoints.append(entry)
    return tuple(endpoints)


def _cert_dir(raw: object, relative_to: Path | None) -> Path:
    if not isinstance(raw, str) or not raw:
        raise InvalidArgument("cert_dir is a path", field="cert_dir")
    path = Path(raw)
    if not path.is_absolute():
        if relative_to is None:
            raise InvalidArgument("cert_dir is an absolute path", field="cert_dir")
        path = relative_to / path
    return path


def parse_host_config(data: object, *, relative_to: Path | None = None) -> HostConfig:
    """A `HostConfig` from the decoded JSON object; InvalidArgument naming the bad field."""
    if not isinstance(data, dict):
        raise InvalidArgument("the fleet config is a JSON object")
    unknown = sorted(str(k) for k in data if k not in FIELDS + OPTIONAL_FIELDS)
    if unknown:
        raise InvalidArgument("unknown field in the fleet config", field=unknown[0])
    for name in FIELDS:
        if name not in data:
            raise InvalidArgument("missing field in the fleet config", field=name)
    fields: dict[str, Any] = data
    serf = fields["serf_address"]
    quic = fields["quic_address"]
    rpc = fields["serf_rpc_address"]
    parse_address(serf, "serf_address")
    parse_address(quic, "quic_address")
    parse_address(rpc, "serf_rpc_address", loopback=True)
    return HostConfig(
        host_id=_host_id(fields["host_id"]),
        failure_domain=_failure_domain(fields["failure_domain"]),
        etcd_endpoints=_endpoints(fields["etcd_endpoints"]),
        serf_address=serf,
        serf_rpc_address=rpc,
        quic_address=quic,
        cert_dir=_cert_dir(fields["cert_dir"], relative_to),
        lease_ttl=_lease_ttl(fields.get("lease_ttl")),
    )


def _lease_ttl(raw: object) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or not 2 <= raw <= MAX_LEASE_TTL:
        raise InvalidArgument(f"lease_ttl is 2..{MAX_LEASE_TTL} seconds", field="lease_ttl")
    return raw


def load_host_config(path: str | os.PathLike[str]) -> HostConfig:
    """Read and parse the fleet config file at `path`."""
    file = Path(path)
    try:
        with file.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise NotFound("no fleet config file", path=str(file)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidArgument("the fleet config is too large", limit=MAX_CONFIG_BYTES)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(
            "the fleet config is not JSON", path=str(file), error=str(exc)
        ) from None
    return parse_host_config(data, relative_to=file.resolve().parent)
