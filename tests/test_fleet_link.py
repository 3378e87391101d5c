"""The fleet link between two hosts on one machine: etcd, serf, QUIC and real anchors.

Theory of operation: one real single-member etcd (tests/fleet_services.py),
one fleet CA with hosts hA and hB enrolled, two real anchors
(tests/anchor_fixture.py, one shard each) and one fleet link process per
host (`python -m slates.fleet.link`, as the anchor will start it), each of
which starts its own serf agent (nothing answers at its serf RPC address)
on 127.0.0.1.  The module fixture brings it all up once and always tears
it down.  The tests then check, in file order: the host records in etcd
(the certificate's fingerprint, the boot id the link announced, a live
lease); forwarding from hA's fleet.sock to hB's shard (`volume.list`,
`volume.create` + `write` + `read`, a 5 MiB piece included, 16 clients at
once), and that a resend of the same (client, seq) returns the saved
reply instead of making a second volume: through the link, over a new
QUIC connection, and after hB's shard restarted; malformed and oversize
local requests; refusals (a host not enrolled as a target, a peer of this
CA not enrolled in etcd, a peer from another CA, a second link on one
runtime directory); a green made on hB appearing in etcd owned by hB's
boot; the `hosts` listing (link and CLI) with both hosts' leases and
serf's verdicts; the CLI's init and enroll; and last, that a link stopped
by SIGTERM revokes its lease and removes its socket while its peer's link
hears serf declare it failed (and refuses forwards to it at once), and
that a link ends with its anchor.  The pure parts (the config file's validation, names,
client ids, holder placement) are checked as hypothesis properties.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.errors import AccessDenied, InvalidArgument, NotFound, Unavailable, VerificationFailed
from slates.fleet import pki, quic
from slates.fleet.config import Peer
from slates.fleet.etcd import Council, HostRecord
from slates.fleet.hostconfig import FIELDS, parse_host_config
from slates.fleet.link_client import Forwarder, acall_link, call_link, link_socket
from slates.fleet.link_forward import PeerPool
from slates.fleet.link_rules import (
    MAX_HOLDERS,
    choose_holders,
    fleet_name,
    forwarded_client_id,
    split_fleet_name,
)
from slates.node.protocol import MAX_CLIENT_ID, pack
from tests.anchor_fixture import Service, start_service
from tests.fleet_services import etcd_cluster, free_port

LOCAL = "127.0.0.1"
WAIT_SECONDS = 60.0
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_SECONDS) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclasses.dataclass
class Host:
    host_id: str
    runtime: Path
    config_path: Path
    config: dict[str, Any]
    creds: pki.HostCredentials
    service: Service
    log: Path
    link: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return link_socket(self.runtime)

    def link_state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.runtime / "fleet-link.json").read_text())
        return data

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclasses.dataclass
class Pair:
    endpoints: list[str]
    ca: pki.FleetCA
    hosts: dict[str, Host]
    root: Path

    def council(self) -> Council:
        return Council(self.endpoints)


def start_link(host: Host) -> None:
    with host.log.open("ab") as log:
        host.link = subprocess.Popen(
            [sys.executable, "-m", "slates.fleet.link", "--config", str(host.config_path),
             "--runtime-dir", str(host.runtime), "--serf-profile", "local",
             "--poll-interval", "0.2", "--lease-ttl", "5"],
            stdout=log, stderr=log,
        )  # fmt: skip

    def ready() -> bool:
        if host.link is not None and host.link.poll() is not None:
            raise AssertionError(f"the link on {host.host_id} exited:\n{host.log_text()}")
        return (host.runtime / "fleet-link.json").exists()

    wait_for(f"the link on {host.host_id}", ready)


def stop_link(host: Host) -> int | None:
    if host.link is None:
        return None
    if host.link.poll() is None:
        host.link.send_signal(signal.SIGTERM)
        try:
            host.link.wait(timeout=20)
        except subprocess.TimeoutExpired:
            host.link.kill()
            host.link.wait()
    return host.link.returncode


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("fleet-link")
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(etcd_cluster(1))
        ca = pki.init_fleet(root / "ca")
        hosts: dict[str, Host] = {}
        for host_id in ("hA", "hB"):
            creds = pki.enroll(ca.directory, host_id, root / host_id / "certs", [LOCAL])
            config = {
                "host_id": host_id,
                "failure_domain": f"domain-{host_id}",
                "etcd_endpoints": etcd.endpoints,
                "serf_address": f"{LOCAL}:{free_port()}",
                "serf_rpc_address": f"{LOCAL}:{free_port()}",
                "quic_address": f"{LOCAL}:{free_port()}",
                "cert_dir": str(creds.directory),
            }
            config_path = root / host_id / "fleet.json"
            config_path.write_text(json.dumps(config))
            service = start_service(root / host_id / "run", shards=1, capacity="256MiB")
            stack.callback(service.stop)
            host = Host(
                host_id,
                service.runtime,
                config_path,
                config,
                creds,
                service,
                root / f"{host_id}.log",
            )
            stack.callback(stop_link, host)
            hosts[host_id] = host
        for host in hosts.values():  # hB starts second: its serf agent joins hA's
            start_link(host)
        yield Pair(etcd.endpoints, ca, hosts, root)


def forward_raw(host: Host, target: str, client: str, request: dict[str, Any]) -> Any:
    message = {"op": "forward", "host": target, "shard": 0, "client": client, "request": request}
    return call_link(host.socket, message)


def shard_reply(raw: Any) -> dict[str, Any]:
    assert isinstance(raw, bytes)
    reply: dict[str, Any] = msgpack.unpackb(raw, raw=False)
    return reply


# -- the fleet -------------------------------------------------------------------------------


def test_each_link_enrolls_with_its_certificate_and_a_live_lease(pair: Pair) -> None:
    with pair.council() as council:
        for host in pair.hosts.values():
            record = council.host(host.host_id)
            assert record is not None
            cert_pem = host.creds.host_cert_path.read_bytes()
            assert record.fingerprint == pki.fingerprint(cert_pem) == host.creds.fingerprint
            assert record.failure_domain == host.config["failure_domain"]
            assert record.quic_address == host.config["quic_address"]
            assert record.serf_address == host.config["serf_address"]
            assert record.boot_id == host.link_state()["boot_id"]
        boots = {h.host_id: h.link_state()["boot_id"] for h in pair.hosts.values()}
        assert council.alive_hosts() == boots
    assert boots["hA"] != boots["hB"]
    assert oct(pair.hosts["hA"].socket.stat().st_mode & 0o777) == "0o600"


async def test_forwarded_volume_list_matches_the_other_hosts_own(pair: Pair) -> None:
    import slates

    async with slates.AsyncClient(pair.hosts["hB"].runtime) as client_b:
        made = await client_b.create_volume(f"listed-{uuid.uuid4().hex[:6]}")
        own = await client_b.list_volumes()
    forwarder = Forwarder(f"list-{uuid.uuid4().hex[:8]}", pair.hosts["hA"].socket)
    listed = await forwarder.request("hB", 0, "volume.list", {})
    assert [v["id"] for v in listed] == [v["id"] for v in own]
    assert made["id"] in [v["id"] for v in listed]
    async with slates.AsyncClient(pair.hosts["hA"].runtime) as client_a:
        assert made["id"] not in [v["id"] for v in await client_a.list_volumes()]


async def test_create_write_read_on_the_other_host(pair: Pair) -> None:
    import slates

    forwarder = Forwarder(f"rw-{uuid.uuid4().hex[:8]}", pair.hosts["hA"].socket)
    name = f"remote-{uuid.uuid4().hex[:6]}"
    made = await forwarder.request(
        "hB", 0, "volume.create", {"name": name, "case_insensitive": False, "capture": False}
    )
    payload = os.urandom(3000)
    written = await forwarder.request(
        "hB",
        0,
        "write",
        {"volume": made["id"], "path": "/notes.bin", "data": payload, "offset": 0,
         "truncate": False, "create": True},
    )  # fmt: skip
    assert written["written"] == len(payload)
    read = await forwarder.request(
        "hB", 0, "read", {"volume": made["id"], "path": "/notes.bin", "offset": 0, "size": 4096}
    )
    assert bytes(read) == payload
    # A piece as large as the SDK reads (8 MiB asked, 5 MiB there) crosses in one request.
    large = os.urandom(5 << 20)
    write_args = {"volume": made["id"], "path": "/large.bin", "data": large, "offset": 0}
    await forwarder.request("hB", 0, "write", {**write_args, "truncate": True, "create": True})
    read_args = {"volume": made["id"], "path": "/large.bin", "offset": 0, "size": 8 << 20}
    assert bytes(await forwarder.request("hB", 0, "read", read_args)) == large
    async with slates.AsyncClient(pair.hosts["hB"].runtime) as client_b:
        assert await client_b.read(made["id"], "/notes.bin") == payload
        assert await client_b.read(made["id"], "/large.bin") == large
        assert [v["name"] for v in await client_b.list_volumes()].count(name) == 1


async def test_the_sdk_reaches_a_volume_of_another_host_by_its_fleet_name(pair: Pair) -> None:
    """An AsyncClient on hA's anchor names hB's volume "<id>@hB": its requests go through
    hA's link to hB's shard, and ids in results keep their host."""
    import slates

    async with slates.AsyncClient(pair.hosts["hB"].runtime) as client_b:
        made = await client_b.create_volume(f"sdk-{uuid.uuid4().hex[:6]}")
    remote = f"{made['id']}@hB"
    async with slates.AsyncClient(pair.hosts["hA"].runtime) as client_a:
        await client_a.write(remote, "/from-a", b"written from hA")
        assert await client_a.read(remote, "/from-a") == b"written from hA"
        assert [e["name"] for e in await client_a.list(remote, "/")] == ["from-a"]
    async with slates.AsyncClient(pair.hosts["hB"].runtime) as client_b:
        assert await client_b.read(made["id"], "/from-a") == b"written from hA"


async def test_concurrent_forwards_from_many_clients(pair: Pair) -> None:
    names = [f"many-{i}-{uuid.uuid4().hex[:6]}" for i in range(16)]
    made: dict[str, str] = {}

    async def one(name: str) -> None:
        forwarder = Forwarder(f"c-{name}", pair.hosts["hA"].socket)
        result = await forwarder.request("hB", 0, "volume.create", {"name": name})
        made[name] = result["id"]

    with trio.fail_after(WAIT_SECONDS):
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(one, name)
    assert len(set(made.values())) == len(names)
    listing = await acall_link(pair.hosts["hA"].socket, {"op": "hosts"})
    assert listing["peers"] == ["hB"]  # hA's link keeps its connection to hB for the next


def test_a_resent_request_gets_the_saved_reply_not_a_second_volume(pair: Pair) -> None:
    client = f"retry-{uuid.uuid4().hex[:8]}"
    name = f"once-{uuid.uuid4().hex[:6]}"
    request = {"seq": 1, "ack": 0, "op": "volume.create", "args": {"name": name}}
    first = forward_raw(pair.hosts["hA"], "hB", client, request)
    again = forward_raw(pair.hosts["hA"], "hB", client, request)
    assert shard_reply(first)["ok"] is True
    assert shard_reply(again) == shard_reply(first)
    # Another client with the same request makes its own attempt: refused, the name is taken.
    other = shard_reply(forward_raw(pair.hosts["hA"], "hB", client + "-x", request))
    assert other["ok"] is False and other["error"]["code"] == "AlreadyExists"
    listing = shard_reply(
        forward_raw(pair.hosts["hA"], "hB", client, {"seq": 2, "ack": 1, "op": "volume.list",
                                                      "args": {}})
    )  # fmt: skip
    assert [v["name"] for v in listing["result"]].count(name) == 1
    # The origin is part of the identity: hB's own forward of client's seq 1 is a new request.
    mine = shard_reply(forward_raw(pair.hosts["hB"], "hB", client, request))
    assert mine["ok"] is False and mine["error"]["code"] == "AlreadyExists"


def test_a_malformed_forward_is_refused_before_it_travels(pair: Pair) -> None:
    with pytest.raises(InvalidArgument):
        forward_raw(pair.hosts["hA"], "hB", "bad", {"seq": 0, "ack": 0, "op": "volume.list"})
    with pytest.raises(InvalidArgument):
        call_link(pair.hosts["hA"].socket, {"op": "teleport"})
    # A frame over the local bound is answered with the error, then the connection ends.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_SECONDS)
        sock.connect(str(pair.hosts["hA"].socket))
        sock.sendall(struct.pack(">I", 1 << 30))
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    refusal = msgpack.unpackb(answer[4:], raw=False)
    assert refusal["ok"] is False and refusal["error"]["code"] == "InvalidArgument"


def test_saved_replies_and_new_requests_survive_a_shard_restart(pair: Pair) -> None:
    host_a, host_b = pair.hosts["hA"], pair.hosts["hB"]
    client = f"restart-{uuid.uuid4().hex[:8]}"
    request = {"seq": 1, "ack": 0, "op": "volume.create", "args": {"name": client}}
    first = shard_reply(forward_raw(host_a, "hB", client, request))
    old = host_b.service.kill_shard(0)
    host_b.service.wait_restarted(0, old)
    # hB's line for this client finds its shard gone, says hello again under the same id.
    assert shard_reply(forward_raw(host_a, "hB", client, request)) == first
    listing = {"seq": 2, "ack": 1, "op": "volume.list", "args": {}}
    names = [v["name"] for v in shard_reply(forward_raw(host_a, "hB", client, listing))["result"]]
    assert names.count(client) == 1


async def test_a_resend_over_a_new_quic_connection_gets_the_saved_reply(pair: Pair) -> None:
    """The identity is (authenticated origin, client, seq), never the connection."""
    host_b = pair.hosts["hB"]
    address = (LOCAL, int(host_b.link_state()["quic_port"]))

    async def resolve(host: str) -> tuple[str, int]:
        assert host == "hB"
        return address

    client = f"quic-{uuid.uuid4().hex[:8]}"
    request = {"seq": 1, "ack": 0, "op": "volume.create", "args": {"name": client}}
    payload = pack({"shard": 0, "client": client, "request": request})
    with trio.fail_after(WAIT_SECONDS):
        async with trio.open_nursery() as nursery:
            pool = PeerPool(pair.hosts["hA"].creds, resolve, nursery)
            first = await pool.request("hB", payload, timeout=20)
            assert pool.connected == ["hB"]
            pool.drop("hB")
            again = await pool.request("hB", payload, timeout=20)
            pool.close()
    assert shard_reply(again) == shard_reply(first) and shard_reply(first)["ok"] is True
    # And the link of hA, the same authenticated origin, resends it with the same answer.
    assert shard_reply(forward_raw(pair.hosts["hA"], "hB", client, request)) == shard_reply(first)


def test_a_second_link_on_one_runtime_directory_is_refused(pair: Pair) -> None:
    host_a = pair.hosts["hA"]
    second = subprocess.run(
        [sys.executable, "-m", "slates.fleet.link", "--config", str(host_a.config_path),
         "--runtime-dir", str(host_a.runtime)],
        capture_output=True, text=True, timeout=WAIT_SECONDS, check=False,
    )  # fmt: skip
    assert second.returncode == 2 and "AlreadyExists" in second.stderr, second.stderr
    assert hosts_alive(call_link(host_a.socket, {"op": "hosts"})) is not None


# -- refusals --------------------------------------------------------------------------------


def test_forwarding_to_a_host_not_enrolled_is_refused(pair: Pair) -> None:
    request = {"seq": 1, "ack": 0, "op": "volume.list", "args": {}}
    with pytest.raises(NotFound, match="not enrolled"):
        forward_raw(pair.hosts["hA"], "hZ", "nobody", request)


async def test_a_peer_of_this_ca_not_enrolled_in_etcd_is_refused(pair: Pair) -> None:
    stranger = pki.enroll(pair.ca.directory, "hZ", pair.root / "hZ-certs", [LOCAL])
    host_b = pair.hosts["hB"]
    request = {"seq": 1, "ack": 0, "op": "volume.list", "args": {}}
    payload = pack({"shard": 0, "client": "c", "request": request})
    with trio.fail_after(WAIT_SECONDS):
        async with quic.connect((LOCAL, host_b.link_state()["quic_port"]), "hB", stranger) as peer:
            with pytest.raises(AccessDenied, match="not enrolled"):
                await peer.request(payload, timeout=10)


async def test_a_peer_from_another_ca_is_refused(pair: Pair) -> None:
    other = pki.init_fleet(pair.root / "other-ca")
    impostor = pki.enroll(other.directory, "hA", pair.root / "impostor", [LOCAL])
    impostor.ca_cert_path.unlink()  # it trusts our CA, so only our server's check stops it
    impostor.ca_cert_path.write_bytes(pair.ca.cert_path.read_bytes())
    port = pair.hosts["hB"].link_state()["quic_port"]
    with trio.fail_after(WAIT_SECONDS):
        with pytest.raises(AccessDenied, match="fleet's CA"):
            async with quic.connect((LOCAL, port), "hB", impostor) as peer:
                await peer.request(b"x", timeout=10)
    # And a link that dials a server from another CA refuses the server.
    with trio.fail_after(WAIT_SECONDS):
        with pytest.raises(VerificationFailed):
            async with quic.connect((LOCAL, port), "hB", pki.enroll(
                other.directory, "hQ", pair.root / "other-hQ", [LOCAL])) as peer:  # fmt: skip
                await peer.request(b"x", timeout=10)


# -- greens and hosts ------------------------------------------------------------------------


async def test_a_green_made_on_b_is_registered_in_etcd_owned_by_b(pair: Pair) -> None:
    import slates

    async with slates.AsyncClient(pair.hosts["hB"].runtime) as client_b:
        green = await client_b.create_green(f"green-{uuid.uuid4().hex[:6]}")
    name = fleet_name("hB", green)
    boot_b = pair.hosts["hB"].link_state()["boot_id"]
    with pair.council() as council:
        config = await trio.to_thread.run_sync(
            lambda: wait_for(f"{name} in etcd", lambda: council.green(name))
        )
    assert split_fleet_name(name) == ("hB", green)
    assert (config.owner.host, config.owner.boot, config.epoch) == ("hB", boot_b, 1)
    # Two hosts in two domains: 2f+1 must be odd, so hB holds it alone (f=0).
    assert config.holders.f == 0
    assert [c.peer.host for c in config.holders.candidates] == ["hB"]
    seen_from_a = await acall_link(pair.hosts["hA"].socket, {"op": "owner", "green": name})
    assert seen_from_a["owner"] == {"host": "hB", "boot": boot_b}
    assert seen_from_a["revision"] == config.revision
    with pytest.raises(NotFound):
        await acall_link(pair.hosts["hA"].socket, {"op": "owner", "green": "vol-0-999@hB"})


@dataclasses.dataclass
class Ran:
    exit_code: int
    output: str


def slates_fleet(*args: str) -> Ran:
    """`slates fleet ARGS` as its own process (stdout and stderr together)."""
    done = subprocess.run(
        [sys.executable, "-m", "slates_cli.fleet", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_SECONDS,
        check=False,
    )
    return Ran(done.returncode, done.stdout + done.stderr)


def hosts_alive(listing: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    rows = {row["host"]: row for row in listing["hosts"]}
    if set(rows) == {"hA", "hB"} and all(
        r["lease"] == "alive" and r["serf"] == "alive" for r in rows.values()
    ):
        return rows
    return None


def test_hosts_listing_from_the_link_and_the_cli(pair: Pair) -> None:
    host_a = pair.hosts["hA"]
    rows = wait_for(
        "both hosts alive in etcd and serf",
        lambda: hosts_alive(call_link(host_a.socket, {"op": "hosts"})),
    )
    assert rows["hB"]["boot_id"] == pair.hosts["hB"].link_state()["boot_id"]
    assert rows["hB"]["fingerprint"] == pair.hosts["hB"].creds.fingerprint
    via_link = slates_fleet("hosts", "--json", "--runtime-dir", str(host_a.runtime))
    assert via_link.exit_code == 0, via_link.output
    assert hosts_alive(json.loads(via_link.output)) is not None
    direct = slates_fleet("hosts", "--json", "--config", str(host_a.config_path))
    assert direct.exit_code == 0, direct.output
    assert {r["host"]: r["boot_id"] for r in json.loads(direct.output)["hosts"]} == {
        h: r["boot_id"] for h, r in rows.items()
    }
    table = slates_fleet("hosts", "--runtime-dir", str(host_a.runtime))
    assert table.exit_code == 0 and "hB" in table.output
    missing = slates_fleet("hosts", "--runtime-dir", str(pair.root / "nowhere"))
    assert missing.exit_code == 1 and "Unavailable" in missing.output


def test_cli_init_and_enroll(tmp_path: Path) -> None:
    made = slates_fleet("init", str(tmp_path / "ca"))
    assert made.exit_code == 0, made.output
    again = slates_fleet("init", str(tmp_path / "ca"))
    assert again.exit_code == 2 and "AlreadyExists" in again.output
    enrolled = slates_fleet(
        *["enroll", "h7", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "h7"),
         "--address", "10.0.0.7", "--address", "::1"],
    )  # fmt: skip
    assert enrolled.exit_code == 0, enrolled.output
    creds = pki.load_credentials(tmp_path / "h7")
    assert creds.host_id == "h7" and creds.fingerprint in enrolled.output
    bad = slates_fleet(
        *["enroll", "h_7", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "InvalidArgument" in bad.output


def test_a_stopped_link_leaves_etcd_and_its_peer_hears_serf(pair: Pair) -> None:
    """Last: it stops hB's link (SIGTERM stops its serf agent, which peers see failed)."""
    host_a, host_b = pair.hosts["hA"], pair.hosts["hB"]
    assert stop_link(host_b) == 0, host_b.log_text()
    assert not host_b.socket.exists()
    assert not (host_b.runtime / "fleet-link.json").exists()
    with pair.council() as council:
        assert "hB" not in council.alive_hosts()  # the lease was revoked, not left to lapse
        assert council.host("hB") is not None  # still enrolled

    def b_failed() -> dict[str, Any] | None:
        listing: dict[str, Any] = call_link(host_a.socket, {"op": "hosts"})
        rows = {row["host"]: row for row in listing["hosts"]}
        return listing if rows["hB"]["serf"] == "failed" else None

    listing = wait_for("hA's link to hear serf declare hB failed", b_failed)
    assert {"member": "hB", "kind": "failed"} in listing["events"]
    assert {row["host"]: row["lease"] for row in listing["hosts"]}["hB"] == "none"
    with pytest.raises(Unavailable, match="serf declares the host failed"):
        forward_raw(host_a, "hB", "after", {"seq": 1, "ack": 0, "op": "volume.list", "args": {}})


def test_a_link_ends_with_its_anchor(pair: Pair) -> None:
    """After the one above: hA's anchor stops, so its RAM is gone and its link leaves."""
    host_a = pair.hosts["hA"]
    assert host_a.link is not None and host_a.link.poll() is None
    host_a.service.stop()
    wait_for("hA's link to end with its anchor", lambda: host_a.link.poll() is not None)  # type: ignore[union-attr]
    assert host_a.link.returncode == 0, host_a.log_text()
    assert "the anchor" in host_a.log_text() and not host_a.socket.exists()
    with pair.council() as council:
        assert council.alive_hosts() == {}


# -- pure parts ------------------------------------------------------------------------------


VALID = {
    "host_id": "h1",
    "failure_domain": "rack-1",
    "etcd_endpoints": ["http://10.0.0.1:2379"],
    "serf_address": "10.0.0.1:7946",
    "serf_rpc_address": "127.0.0.1:7373",
    "quic_address": "10.0.0.1:4433",
    "cert_dir": "/etc/slates/certs",
}
BAD_VALUES: dict[str, list[object]] = {
    "host_id": ["", "-h", "h_1", 7, "a" * 64],
    "failure_domain": ["", "a/b", "x" * 64, None, "tab\there"],
    "etcd_endpoints": [[], "http://x:1", ["ftp://x:1"], ["http://x"], [5], ["http://:80"]],
    "serf_address": ["10.0.0.1", "host:7946", "10.0.0.1:0", "0.0.0.0:7946", "10.0.0.1:99999"],
    "serf_rpc_address": ["10.0.0.1:7373", "127.0.0.1", None],
    "quic_address": ["", "10.0.0.1:x", "[::]:4433", 4433],
    "cert_dir": ["", "relative/certs", None],
}


def test_a_valid_config_parses() -> None:
    config = parse_host_config(dict(VALID))
    assert config.quic_endpoint == ("10.0.0.1", 4433)
    assert config.etcd_endpoints == ("http://10.0.0.1:2379",)
    relative = parse_host_config({**VALID, "cert_dir": "certs"}, relative_to=Path("/srv/h1"))
    assert relative.cert_dir == Path("/srv/h1/certs")
    ipv6 = parse_host_config({**VALID, "quic_address": "[fd00::1]:4433"})
    assert ipv6.quic_endpoint == ("fd00::1", 4433)


@settings(deadline=None)  # timings are never asserted, and the machine is shared
@given(st.sampled_from(sorted(BAD_VALUES)), st.data())
def test_every_bad_field_is_named(field: str, data: st.DataObject) -> None:
    value = data.draw(st.sampled_from(BAD_VALUES[field]))
    with pytest.raises(InvalidArgument) as caught:
        parse_host_config({**VALID, field: value})
    assert caught.value.details["field"] == field


@settings(deadline=None)  # timings are never asserted, and the machine is shared
@given(st.sampled_from(FIELDS))
def test_a_missing_or_unknown_field_is_named(field: str) -> None:
    with pytest.raises(InvalidArgument) as missing:
        parse_host_config({k: v for k, v in VALID.items() if k != field})
    assert missing.value.details["field"] == field
    with pytest.raises(InvalidArgument) as unknown:
        parse_host_config({**VALID, field + "_x": 1})
    assert unknown.value.details["field"] == field + "_x"


host_ids = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
client_ids = st.text(min_size=1, max_size=MAX_CLIENT_ID)


@settings(deadline=None)  # timings are never asserted, and the machine is shared
@given(host_ids, st.from_regex(r"(vol|snap)-[0-9]{1,3}-[0-9]{1,6}", fullmatch=True))
def test_fleet_names_round_trip(host: str, local_id: str) -> None:
    assert split_fleet_name(fleet_name(host, local_id)) == (host, local_id)


@settings(deadline=None)  # timings are never asserted, and the machine is shared
@given(host_ids, host_ids, client_ids, client_ids)
def test_forwarded_client_ids_are_bounded_stable_and_distinct(
    origin_a: str, origin_b: str, client_a: str, client_b: str
) -> None:
    first = forwarded_client_id(origin_a, client_a)
    assert 0 < len(first) <= MAX_CLIENT_ID
    assert forwarded_client_id(origin_a, client_a) == first
    if (origin_a, client_a) != (origin_b, client_b):
        assert forwarded_client_id(origin_b, client_b) != first


records = st.builds(
    HostRecord,
    host=host_ids,
    fingerprint=st.just("f" * 64),
    failure_domain=st.sampled_from(["d1", "d2", "d3", "d4", "d5"]),
    boot_id=st.sampled_from(["b1", "b2"]),
    quic_address=st.just("10.0.0.1:4433"),
    serf_address=st.just("10.0.0.1:7946"),
)


@settings(deadline=None)  # timings are never asserted, and the machine is shared
@given(
    records,
    st.lists(records, max_size=8, unique_by=lambda r: r.host),
    st.dictionaries(host_ids, st.sampled_from(["b1", "b2"])),
)
def test_holders_are_odd_distinct_and_start_with_the_owner(
    own: HostRecord, others: list[HostRecord], alive: dict[str, str]
) -> None:
    others = [r for r in others if r.host != own.host]
    holders = choose_holders(own, [own, *others], alive)  # HolderSet checks distinctness
    candidates = holders.candidates
    assert candidates[0].peer == Peer(own.host, own.boot_id)
    assert len(candidates) == 2 * holders.f + 1 <= MAX_HOLDERS
    domains = {r.failure_domain for r in others} - {own.failure_domain}
    assert len(candidates) == (3 if len(domains) >= 2 else 1)
    if len(candidates) == 3:  # alive hosts are preferred: as many as their domains allow
        live = [r for r in others if alive.get(r.host) == r.boot_id]
        live_domains = {r.failure_domain for r in live} - {own.failure_domain}
        live_hosts = {r.host for r in live}
        chosen_live = sum(c.peer.host in live_hosts for c in candidates[1:])
        assert chosen_live == min(2, len(live_domains))


def test_an_optional_lease_ttl_is_checked() -> None:
    assert parse_host_config(dict(VALID)).lease_ttl is None
    assert parse_host_config({**VALID, "lease_ttl": 5}).lease_ttl == 5
    for bad in (1, 301, "5", True, 2.5):
        with pytest.raises(InvalidArgument) as caught:
            parse_host_config({**VALID, "lease_ttl": bad})
        assert caught.value.details["field"] == "lease_ttl"
