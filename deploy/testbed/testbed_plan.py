"""The testbed's records and plans: pure functions, no I/O (deploy/testbed/testbed.py runs them).

Theory of operation.  A `Testbed` is what state.json holds: its hosts
(`plan_hosts`: h1..hN, addresses 10.250.0.(10+I), etcd members on h1..h3),
the pids of each running host's daemons (a host without pids is down;
`host_transition` is the only way between the two), how many times each
booted, the partition cuts and the slowed links.  From these records the
functions here derive the daemons' command lines (`etcd_argv`,
`serf_argv`), each host's fleet config (`fleet_config`), which hosts may not
hear which (`blocked_peers`) and the nft transaction that says so
(`nft_script`), and read the user's delays and losses.  Invariants: host ids
are h1..hN with distinct addresses in one /24; a cut separates exactly the
pairs with one host on each side, so blocking is symmetric and irreflexive;
`nft_script` always replaces the whole table (one transaction), so applying
it twice is applying it once.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from slates.errors import AlreadyExists, InvalidArgument, NotFound

SUBNET = ipaddress.IPv4Network("10.250.0.0/24")
FIRST_HOST_OFFSET = 10
MAX_HOSTS = 200
ETCD_MEMBERS = 3
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
SERF_PORT = 7946
SERF_RPC = "127.0.0.1:7373"
QUIC_PORT = 4433
LEASE_TTL = 5  # seconds: the hosts' alive keys in etcd (fleet.json's lease_ttl)
BRIDGE = "slates-br0"
HOST_IFACE = "eth0"
NFT_TABLE = "slates_testbed"
DELAY_PATTERN = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
LOSS_PATTERN = re.compile(r"^\d+(\.\d+)?%$")
HOST_PATTERN = re.compile(r"^h([1-9][0-9]*)$")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    id: str
    index: int
    address: str
    netns: str
    etcd_member: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Cut:
    """One partition: `side` on one side, every other host on the other."""

    side: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Slow:
    """How a host's link is slowed: `method` netem (tc) or relay (delay_relay.py, its pid)."""

    delay: str
    loss: str
    method: str
    relay_pid: int = 0
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Testbed:
    name: str
    hosts: tuple[Host, ...]
    pids: Mapping[str, Mapping[str, int]]  # host id -> daemon -> pid
    boots: Mapping[str, int]  # host id -> how many times its services started
    cuts: tuple[Cut, ...]
    slowed: Mapping[str, Slow]

    def host(self, host_id: str) -> Host:
        for host in self.hosts:
            if host.id == host_id:
                return host
        raise NotFound(f"no host {host_id} in the testbed", host=host_id)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
            "pids": {h: dict(p) for h, p in self.pids.items()},
            "boots": dict(self.boots),
            "cuts": [sorted(c.side) for c in self.cuts],
            "slowed": {h: dataclasses.asdict(s) for h, s in self.slowed.items()},
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> Testbed:
        hosts = data["hosts"]
        pids = data["pids"]
        boots = data["boots"]
        cuts = data["cuts"]
        slowed = data["slowed"]
        if not (
            isinstance(hosts, list)
            and isinstance(pids, dict)
            and isinstance(boots, dict)
            and isinstance(cuts, list)
            and isinstance(slowed, dict)
        ):
            raise InvalidArgument("state.json is not a testbed's state")
        return Testbed(
            name=str(data["name"]),
            hosts=tuple(Host(**h) for h in hosts),
            pids={str(h): {str(d): int(p) for d, p in ps.items()} for h, ps in pids.items()},
            boots={str(h): int(b) for h, b in boots.items()},
            cuts=tuple(Cut(frozenset(str(x) for x in side)) for side in cuts),
            slowed={str(h): Slow(**s) for h, s in slowed.items()},
        )


def plan_hosts(name: str, count: int) -> tuple[Host, ...]:
    if not 1 <= count <= MAX_HOSTS:
        raise InvalidArgument(f"a testbed has 1..{MAX_HOSTS} hosts", count=count)
    return tuple(
        Host(
            id=f"h{i}",
            index=i,
            address=str(SUBNET.network_address + FIRST_HOST_OFFSET + i),
            netns=f"{name}-h{i}",
            etcd_member=i <= ETCD_MEMBERS,
        )
        for i in range(1, count + 1)
    )


def bridge_netns(name: str) -> str:
    return f"{name}-tb"


def etcd_endpoints(hosts: Sequence[Host]) -> list[str]:
    return [f"http://{h.address}:{ETCD_CLIENT_PORT}" for h in hosts if h.etcd_member]


def etcd_argv(host: Host, hosts: Sequence[Host], name: str, data_dir: Path) -> list[str]:
    peers = ",".join(f"{h.id}=http://{h.address}:{ETCD_PEER_PORT}" for h in hosts if h.etcd_member)
    return [
        "etcd",
        f"--name={host.id}",
        f"--data-dir={data_dir}",
        f"--listen-peer-urls=http://{host.address}:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://{host.address}:{ETCD_PEER_PORT}",
        f"--listen-client-urls=http://{host.address}:{ETCD_CLIENT_PORT},"
        f"http://127.0.0.1:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://{host.address}:{ETCD_CLIENT_PORT}",
        f"--initial-cluster={peers}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={name}-testbed",
        # A loaded two-core machine: slower heartbeats keep elections rare.
        "--heartbeat-interval=200",
        "--election-timeout=2000",
        "--logger=zap",
        "--log-level=warn",
    ]


def serf_argv(host: Host, hosts: Sequence[Host]) -> list[str]:
    joins = [f"-retry-join={h.address}:{SERF_PORT}" for h in hosts if h.id != host.id]
    return [
        "serf",
        "agent",
        f"-node={host.id}",
        f"-bind={host.address}:{SERF_PORT}",
        f"-rpc-addr={SERF_RPC}",
        "-retry-interval=1s",
        "-log-level=warn",
        *joins,
    ]


def fleet_config(host: Host, hosts: Sequence[Host], cert_dir: Path) -> dict[str, object]:
    """What the host's anchor is given with --fleet (the contract with its reader)."""
    return {
        "host_id": host.id,
        "failure_domain": host.id,
        "etcd_endpoints": etcd_endpoints(hosts),
        "serf_address": f"{host.address}:{SERF_PORT}",
        "serf_rpc_address": SERF_RPC,
        "quic_address": f"{host.address}:{QUIC_PORT}",
        "cert_dir": str(cert_dir),
        # A short lease: etcd renews every lease when its leader changes (a killed host
        # may have been the leader), so a host's loss shows in etcd a lease's life later.
        "lease_ttl": LEASE_TTL,
    }


def blocked_peers(hosts: Iterable[str], cuts: Iterable[Cut]) -> dict[str, frozenset[str]]:
    """For each host, the hosts it may not exchange packets with: those across any cut."""
    names = list(hosts)
    cut_list = list(cuts)
    return {
        a: frozenset(b for b in names if any((a in c.side) != (b in c.side) for c in cut_list))
        for a in names
    }


def nft_script(blocked_addresses: Iterable[str]) -> str:
    """An nft transaction replacing the testbed's table with one dropping those addresses.

    Packets are dropped as they arrive, never as they leave: a drop on output
    fails the sender's own call (EPERM), which serf and etcd take for a local
    fault and do not count against the peer, unlike a packet lost in the
    network.  Every host on each side of a cut drops the other side's
    packets, so both directions are cut."""
    script = f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
    addresses = sorted(blocked_addresses)
    if not addresses:
        return script
    listed = ", ".join(addresses)
    return script + (
        f"table inet {NFT_TABLE} {{\n"
        "  chain input { type filter hook input priority 0; policy accept;\n"
        f"    ip saddr {{ {listed} }} drop\n  }}\n"
        "}\n"
    )


def host_transition(host_id: str, running: bool, command: str) -> bool:
    """Whether the host runs after `command` (kill, start); any other pair is an error."""
    match (running, command):
        case (True, "kill"):
            return False
        case (False, "start"):
            return True
        case (True, "start"):
            raise AlreadyExists(f"{host_id} is running: kill it first", host=host_id)
        case (False, "kill"):
            raise InvalidArgument(f"{host_id} is down already: start it first", host=host_id)
        case _:
            raise InvalidArgument("not a host command", command=command)


def parse_host_id(text: str) -> str:
    if not HOST_PATTERN.match(text):
        raise InvalidArgument("a host is named h1, h2, ...", host=text)
    return text


def link_ends(name: str, host: Host) -> list[tuple[str, str]]:
    """(namespace, device) of both ends of the host's link."""
    return [(host.netns, HOST_IFACE), (bridge_netns(name), f"veth-{host.id}")]


def delay_seconds(delay: str) -> float:
    if not DELAY_PATTERN.match(delay):
        raise InvalidArgument("a delay is a number with us, ms or s (e.g. 100ms)", delay=delay)
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if delay.endswith(unit):
            return float(delay.removesuffix(unit)) * scale
    raise InvalidArgument("a delay is a number with us, ms or s (e.g. 100ms)", delay=delay)


def loss_fraction(loss: str) -> float:
    if not LOSS_PATTERN.match(loss) or float(loss[:-1]) > 100:
        raise InvalidArgument("a loss is a percentage from 0% to 100% (e.g. 5%)", loss=loss)
    return float(loss[:-1]) / 100


def relay_devices(host: Host) -> tuple[str, str, str]:
    """The host's link end, and the relay's veth pair: its own end, the bridge's end."""
    return f"veth-{host.id}", f"dl-{host.id}", f"db-{host.id}"
