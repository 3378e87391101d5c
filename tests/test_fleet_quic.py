"""The fleet's QUIC transport over real UDP on 127.0.0.1, between enrolled hosts.

Hosts h1, h2 and h3 are enrolled in one fleet (a fresh CA per test); the
intruders are a self-signed host, a host of another fleet, and a client with
no certificate at all.  Every test bounds itself with trio.fail_after so a
hang fails rather than stalls, and asserts outcomes, never durations.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slates.errors import (
    AccessDenied,
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet import pki, quic, quic_link

LOCAL = "127.0.0.1"
LIMIT = 60.0  # a hang fails the test instead of stalling the run


@dataclasses.dataclass
class Fleet:
    root: Path
    ca: pki.FleetCA
    hosts: dict[str, pki.HostCredentials]


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    ca = pki.init_fleet(tmp_path / "ca")
    hosts = {
        host: pki.enroll(ca.directory, host, tmp_path / host, [LOCAL])
        for host in ("h1", "h2", "h3")
    }
    return Fleet(tmp_path, ca, hosts)


def echo_handler(calls: list[tuple[str, bytes]] | None = None) -> quic.Handler:
    async def handler(peer: str, request: bytes) -> bytes:
        if calls is not None:
            calls.append((peer, request))
        return peer.encode() + b":" + request

    return handler


def self_signed(directory: Path, host_id: str, trusted_ca: Path | None) -> pki.HostCredentials:
    """A host certificate nobody issued; `trusted_ca` is what the intruder trusts."""
    directory.mkdir()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_id)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(pki.host_dns_name(host_id))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "host.key", directory / "host.crt"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
    cert_path.write_bytes(cert_pem)
    ca_path = directory / "ca.crt"
    if trusted_ca is None:
        ca_path.write_bytes(cert_pem)
    else:
        shutil.copyfile(trusted_ca, ca_path)
    return pki.HostCredentials(
        directory, host_id, ca_path, cert_path, key_path, pki.fingerprint(cert_pem)
    )


def other_fleet_host(root: Path, host_id: str, trusted_ca: Path | None) -> pki.HostCredentials:
    """A host properly enrolled, but in another fleet; it may trust our CA besides."""
    other = pki.init_fleet(root / "other-ca")
    creds = pki.enroll(other.directory, host_id, root / f"other-{host_id}", [LOCAL])
    if trusted_ca is None:
        return creds
    creds.ca_cert_path.unlink()
    shutil.copyfile(trusted_ca, creds.ca_cert_path)
    return creds


async def test_two_hosts_exchange_requests_both_ways(fleet: Fleet) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    payloads = [b"", b"x", rng.randbytes(rng.randrange(1, 70000)), rng.randbytes(1 << 20)]
    seen: dict[str, list[tuple[str, bytes]]] = {"h1": [], "h2": []}
    h1, h2 = fleet.hosts["h1"], fleet.hosts["h2"]
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), h1, echo_handler(seen["h1"])) as server1,
            quic.serve((LOCAL, 0), h2, echo_handler(seen["h2"])) as server2,
            quic.connect((LOCAL, server2.port), "h2", h1) as to_h2,
            quic.connect((LOCAL, server1.port), "h1", h2) as to_h1,
        ):
            assert (to_h2.host_id, to_h1.host_id) == ("h2", "h1")
            for payload in payloads:
                assert await to_h2.request(payload, timeout=LIMIT) == b"h1:" + payload
                assert await to_h1.request(payload, timeout=LIMIT) == b"h2:" + payload
    # Each server learned its client's host id from the client's certificate.
    assert seen["h2"] == [("h1", p) for p in payloads]
    assert seen["h1"] == [("h2", p) for p in payloads]


async def test_many_concurrent_requests_get_their_own_replies(fleet: Fleet) -> None:
    limits = quic.TransportLimits(max_concurrent_streams=64)

    async def slow_echo(peer: str, request: bytes) -> bytes:
        await trio.sleep(random.random() / 100)  # replies come back out of order
        return request[::-1]

    replies: dict[int, bytes] = {}
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], slow_echo, limits=limits) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
        ):
            for _round in range(3):

                async def one(index: int) -> None:
                    replies[index] = await peer.request(b"request %d" % index, timeout=LIMIT)

                async with trio.open_nursery() as nursery:
                    for index in range(limits.max_concurrent_streams):
                        nursery.start_soon(one, index)
                assert replies == {
                    index: (b"request %d" % index)[::-1]
                    for index in range(limits.max_concurrent_streams)
                }
                replies.clear()


async def test_requests_over_the_concurrency_limit_are_refused(fleet: Fleet) -> None:
    limits = quic.TransportLimits(max_concurrent_streams=4)
    release = trio.Event()
    running = 0
    all_running = trio.Event()

    async def blocking(peer: str, request: bytes) -> bytes:
        nonlocal running
        running += 1
        if running == limits.max_concurrent_streams:
            all_running.set()
        await release.wait()
        return request

    results: list[bytes] = []
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], blocking, limits=limits) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
        ):

            async def one(index: int) -> None:
                results.append(await peer.request(b"%d" % index, timeout=LIMIT))

            async with trio.open_nursery() as nursery:
                for index in range(limits.max_concurrent_streams):
                    nursery.start_soon(one, index)
                await all_running.wait()
                with pytest.raises(CapacityExhausted):
                    await peer.request(b"one too many", timeout=LIMIT)
                release.set()
            assert sorted(results) == [b"%d" % i for i in range(limits.max_concurrent_streams)]
            assert await peer.request(b"after", timeout=LIMIT) == b"after"


def pattern(size: int, seed: int) -> bytes:
    block = random.Random(seed).randbytes(1 << 16)
    return (block * (size // len(block) + 1))[:size]


async def test_a_20_mib_reply_through_the_content_path(fleet: Fleet) -> None:
    size = 20 << 20
    content = pattern(size, 20)

    async def content_handler(peer: str, request: bytes) -> bytes:
        assert request == b"volume-7/chunks"
        return content

    with trio.fail_after(LIMIT * 4):
        async with (
            quic.serve(
                (LOCAL, 0), fleet.hosts["h2"], echo_handler(), content_handler=content_handler
            ) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            fetched = await peer.fetch(b"volume-7/chunks", timeout=LIMIT * 4)
            # The connection still carries ordinary requests afterwards.
            assert await peer.request(b"ping", timeout=LIMIT) == b"h1:ping"
    assert len(fetched) == size
    assert hashlib.sha256(fetched).digest() == hashlib.sha256(content).digest()


async def test_a_slow_reader_holds_at_most_one_window(fleet: Fleet) -> None:
    # Stream credit is granted as the reader consumes: with a reader slower than the
    # sender, what arrives between two reads never exceeds the window.
    limits = quic.TransportLimits(max_request_bytes=8 << 10, content_window_bytes=32 << 10)
    initial_credit = max(limits.content_window_bytes, limits.max_request_bytes + 1)
    content = pattern(1 << 20, 4)

    async def content_handler(peer: str, request: bytes) -> bytes:
        return content

    pieces: list[int] = []
    received = bytearray()
    with trio.fail_after(LIMIT * 2):
        async with (
            quic.serve(
                (LOCAL, 0),
                fleet.hosts["h2"],
                echo_handler(),
                content_handler=content_handler,
                limits=limits,
            ) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
            peer.open_content(b"all", timeout=LIMIT * 2) as reader,
        ):
            assert reader.size == len(content)
            async for piece in reader:
                pieces.append(len(piece))
                received += piece
                await trio.sleep(0.1)  # far slower than the sender
    assert bytes(received) == content
    assert max(pieces) <= initial_credit


async def test_content_over_the_limit_is_refused(fleet: Fleet) -> None:
    small = quic.TransportLimits(max_content_bytes=1 << 20)

    async def content_handler(peer: str, request: bytes) -> bytes:
        return bytes(int(request))

    with trio.fail_after(LIMIT):
        async with (
            quic.serve(
                (LOCAL, 0), fleet.hosts["h2"], echo_handler(), content_handler=content_handler
            ) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=small) as peer,
        ):
            with pytest.raises(CapacityExhausted):
                await peer.fetch(b"%d" % (2 << 20), timeout=LIMIT)
            assert await peer.fetch(b"%d" % (1 << 20), timeout=LIMIT) == bytes(1 << 20)


async def expect_refused(
    server_creds: pki.HostCredentials,
    client_creds: pki.HostCredentials,
    expected_host: str,
    error: type[SlatesError],
) -> tuple[SlatesError, quic.Server]:
    calls: list[tuple[str, bytes]] = []
    with trio.fail_after(LIMIT):
        async with quic.serve((LOCAL, 0), server_creds, echo_handler(calls)) as server:
            with pytest.raises(error) as caught:
                async with quic.connect((LOCAL, server.port), expected_host, client_creds) as peer:
                    await peer.request(b"let me in", timeout=LIMIT)
            with trio.fail_after(LIMIT):
                while not server.refusals:
                    await trio.sleep(0.01)
    assert calls == []
    return caught.value, server


@pytest.mark.parametrize("intruder", ["self-signed", "other-fleet"])
async def test_an_unenrolled_client_is_refused(fleet: Fleet, tmp_path: Path, intruder: str) -> None:
    # The intruder trusts our CA, so it accepts our server; our server refuses it.
    make: Callable[[Path, str, Path | None], pki.HostCredentials] = (
        (lambda root, host, ca: self_signed(root / "intruder", host, ca))
        if intruder == "self-signed"
        else other_fleet_host
    )
    client = make(tmp_path, "h3", fleet.ca.cert_path)
    refused, server = await expect_refused(fleet.hosts["h2"], client, "h2", AccessDenied)
    assert "fleet's CA" in refused.message
    assert "fleet's CA" in server.refusals[0].reason


@pytest.mark.parametrize("intruder", ["self-signed", "other-fleet"])
async def test_an_unenrolled_server_is_refused(fleet: Fleet, tmp_path: Path, intruder: str) -> None:
    make: Callable[[Path, str, Path | None], pki.HostCredentials] = (
        (lambda root, host, ca: self_signed(root / "intruder", host, ca))
        if intruder == "self-signed"
        else other_fleet_host
    )
    impostor = make(tmp_path, "h2", None)
    await expect_refused(impostor, fleet.hosts["h1"], "h2", VerificationFailed)


async def test_a_client_without_a_certificate_is_refused(fleet: Fleet) -> None:
    h1 = fleet.hosts["h1"]
    limits = quic.TransportLimits()
    configuration = quic_link.configuration_for(
        h1, limits, is_client=True, server_name="h2.fleet.slates"
    )
    configuration.certificate = None
    configuration.private_key = None
    ca_certificate = x509.load_pem_x509_certificate(fleet.ca.cert_path.read_bytes())
    with trio.fail_after(LIMIT):
        async with quic.serve((LOCAL, 0), fleet.hosts["h2"], echo_handler()) as server:
            with pytest.raises(AccessDenied, match="no certificate"):
                async with quic._dial(
                    (LOCAL, server.port), "h2", configuration, ca_certificate, limits
                ):
                    pass


async def test_dialing_h2_expecting_h3_is_refused(fleet: Fleet) -> None:
    refused, _ = await expect_refused(
        fleet.hosts["h2"], fleet.hosts["h1"], "h3", VerificationFailed
    )
    assert "h3.fleet.slates" in refused.message


async def test_a_timed_out_request_never_delivers_into_a_later_one(fleet: Fleet) -> None:
    release = trio.Event()
    slow_cancelled = trio.Event()

    async def handler(peer: str, request: bytes) -> bytes:
        if request == b"slow":
            try:
                await release.wait()
            except trio.Cancelled:
                slow_cancelled.set()  # the server retired the reset stream
                raise
            return b"late reply for slow"
        return b"reply for " + request

    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], handler) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            slow_stream = peer._link.conn.get_next_available_stream_id()
            with pytest.raises(Unavailable):
                await peer.request(b"slow", timeout=0.2)
            await slow_cancelled.wait()
            release.set()
            assert await peer.request(b"next", timeout=LIMIT) == b"reply for next"
            # A late frame for the retired stream (as if the reply had crossed the reset
            # on the wire) is dropped, not delivered.
            dropped = peer.late_frames_dropped
            peer._link._on_data(slow_stream, b"\x00late reply for slow", True)
            assert peer.late_frames_dropped == dropped + 1
            assert await peer.request(b"after", timeout=LIMIT) == b"reply for after"


async def test_a_raising_handler_gives_the_client_a_clear_error(fleet: Fleet) -> None:
    async def handler(peer: str, request: bytes) -> bytes:
        if request == b"bug":
            raise ValueError("the handler tripped over request 42")
        if request == b"missing":
            raise NotFound("no such volume", volume="v9")
        return request

    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], handler) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            with pytest.raises(SlatesError) as caught:
                await peer.request(b"bug", timeout=LIMIT)
            assert type(caught.value) is SlatesError
            assert "ValueError: the handler tripped over request 42" in caught.value.message
            assert caught.value.details["host"] == "h2"
            with pytest.raises(NotFound) as missing:
                await peer.request(b"missing", timeout=LIMIT)
            assert missing.value.details == {"volume": "v9"}
            assert await peer.request(b"still fine", timeout=LIMIT) == b"still fine"


async def test_sizes_are_bounded(fleet: Fleet) -> None:
    limits = quic.TransportLimits(max_request_bytes=1000, max_reply_bytes=2000)

    async def handler(peer: str, request: bytes) -> bytes:
        return bytes(int(request))

    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], handler, limits=limits) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
        ):
            with pytest.raises(InvalidArgument):
                await peer.request(b"1" * 1001, timeout=LIMIT)
            with pytest.raises(CapacityExhausted):
                await peer.request(b"2001", timeout=LIMIT)
            assert await peer.request(b"2000", timeout=LIMIT) == bytes(2000)


async def test_content_without_a_content_handler_is_not_supported(fleet: Fleet) -> None:
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], echo_handler()) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            with pytest.raises(SlatesError, match="serves no content"):
                await peer.fetch(b"x", timeout=LIMIT)


def test_limits_are_validated() -> None:
    with pytest.raises(InvalidArgument):
        quic.TransportLimits(max_concurrent_streams=0)
    with pytest.raises(InvalidArgument):
        quic.TransportLimits(handshake_timeout=-1.0)


Operation = tuple[str, int | bytes | None]
OPERATIONS: st.SearchStrategy[Operation] = st.one_of(
    st.tuples(st.just("echo"), st.binary(max_size=3000)),
    st.tuples(st.just("fail"), st.integers(0, 999)),
    st.tuples(st.just("slow"), st.none()),
    st.tuples(st.just("big"), st.sampled_from([0, 10, 49_999, 50_000, 50_001, 80_000])),
    st.tuples(st.just("blob"), st.integers(0, 300_000)),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(OPERATIONS, min_size=1, max_size=16), min_size=1, max_size=5))
def test_a_mixed_workload_matches_the_model(fleet: Fleet, batches: list[list[Operation]]) -> None:
    # Operations run in concurrent batches on one connection; the model predicts each
    # outcome (reply, error or timeout), so a reply delivered to the wrong request fails.
    limits = quic.TransportLimits(max_reply_bytes=50_000, max_concurrent_streams=16)

    async def handler(peer: str, request: bytes) -> bytes:
        op, _, arg = request.partition(b":")
        if op == b"echo":
            return arg[::-1]
        if op == b"fail":
            raise NotFound("no such thing", thing=arg.decode())
        if op == b"slow":
            await trio.sleep_forever()
        if op == b"big":
            return bytes(int(arg))
        raise InvalidArgument("unknown op")

    async def content_handler(peer: str, request: bytes) -> bytes:
        return pattern(int(request), int(request))

    async def run(peer: quic.Peer, kind: str, arg: int | bytes | None) -> None:
        if kind == "echo":
            assert isinstance(arg, bytes)
            assert await peer.request(b"echo:" + arg, timeout=LIMIT) == arg[::-1]
        elif kind == "fail":
            assert isinstance(arg, int)
            with pytest.raises(NotFound) as caught:
                await peer.request(b"fail:%d" % arg, timeout=LIMIT)
            assert caught.value.details == {"thing": str(arg)}
        elif kind == "slow":
            with pytest.raises(Unavailable):
                await peer.request(b"slow:", timeout=0.05)
        elif kind == "big":
            assert isinstance(arg, int)
            if arg > limits.max_reply_bytes:
                with pytest.raises(CapacityExhausted):
                    await peer.request(b"big:%d" % arg, timeout=LIMIT)
            else:
                assert await peer.request(b"big:%d" % arg, timeout=LIMIT) == bytes(arg)
        else:
            assert isinstance(arg, int)
            assert await peer.fetch(b"%d" % arg, timeout=LIMIT) == pattern(arg, arg)

    async def scenario() -> None:
        with trio.fail_after(LIMIT * 2):
            async with (
                quic.serve(
                    (LOCAL, 0),
                    fleet.hosts["h2"],
                    handler,
                    content_handler=content_handler,
                    limits=limits,
                ) as server,
                quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
            ):
                for batch in batches:
                    async with trio.open_nursery() as nursery:
                        for kind, arg in batch:
                            nursery.start_soon(run, peer, kind, arg)
                assert peer._link.calls == {}  # every stream retired

    trio.run(scenario)


@pytest.mark.parametrize(
    "error",
    [
        NotFound("no such volume", volume="v1"),
        CapacityExhausted("full", limit=3),
        AccessDenied("no"),
        SlatesError("plain", nested={"a": [1, 2]}),
    ],
)
def test_error_replies_keep_their_class_and_details(error: SlatesError) -> None:
    with pytest.raises(type(error)) as caught:
        quic_link.decode_reply(quic_link.error_body(error))
    assert type(caught.value) is type(error)
    assert (caught.value.message, caught.value.details) == (error.message, error.details)


async def serve_until(
    creds: pki.HostCredentials,
    handler: quic.Handler,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with quic.serve((LOCAL, 0), creds, handler) as server:
        task_status.started(server.port)
        await stop.wait()


async def test_a_server_going_away_fails_its_clients_and_a_new_connect_works(
    fleet: Fleet,
) -> None:
    entered = trio.Event()

    async def handler(peer: str, request: bytes) -> bytes:
        if request == b"wait":
            entered.set()
            await trio.sleep_forever()
        return request

    stop = trio.Event()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_until, fleet.hosts["h2"], handler, stop)
            async with quic.connect((LOCAL, port), "h2", fleet.hosts["h1"]) as peer:

                async def stop_when_entered() -> None:
                    await entered.wait()
                    stop.set()

                nursery.start_soon(stop_when_entered)
                with pytest.raises(SlatesError, match="closed"):
                    await peer.request(b"wait", timeout=LIMIT)
                with pytest.raises(SlatesError, match="closed"):
                    await peer.request(b"again", timeout=LIMIT)
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], handler) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            assert await peer.request(b"reconnected", timeout=LIMIT) == b"reconnected"


async def test_an_idle_connection_times_out(fleet: Fleet) -> None:
    limits = quic.TransportLimits(idle_timeout=0.3)
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], echo_handler(), limits=limits) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"], limits=limits) as peer,
        ):
            assert await peer.request(b"hi", timeout=LIMIT) == b"h1:hi"
            while peer._link.failure is None:
                await trio.sleep(0.1)
            with pytest.raises(SlatesError, match="Idle timeout"):
                await peer.request(b"hi", timeout=LIMIT)


async def test_dialing_a_silent_port_times_out(fleet: Fleet) -> None:
    limits = quic.TransportLimits(handshake_timeout=0.5)
    with trio.socket.socket(type=trio.socket.SOCK_DGRAM) as silent:
        await silent.bind((LOCAL, 0))
        port = silent.getsockname()[1]
        with trio.fail_after(LIMIT), pytest.raises(Unavailable):
            async with quic.connect((LOCAL, port), "h2", fleet.hosts["h1"], limits=limits):
                pass


async def test_a_full_server_refuses_more_connections(fleet: Fleet) -> None:
    full = quic.TransportLimits(max_connections=1)
    impatient = quic.TransportLimits(handshake_timeout=0.5)
    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], echo_handler(), limits=full) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as first,
        ):
            with pytest.raises(Unavailable):
                async with quic.connect(
                    (LOCAL, server.port), "h2", fleet.hosts["h3"], limits=impatient
                ):
                    pass
            assert any(r.reason == "too many connections" for r in server.refusals)
            assert await first.request(b"still here", timeout=LIMIT) == b"h1:still here"


async def test_a_cancelled_caller_cancels_the_handler(fleet: Fleet) -> None:
    entered, handler_cancelled = trio.Event(), trio.Event()

    async def handler(peer: str, request: bytes) -> bytes:
        if request == b"wait":
            entered.set()
            try:
                await trio.sleep_forever()
            finally:
                handler_cancelled.set()
        return request

    with trio.fail_after(LIMIT):
        async with (
            quic.serve((LOCAL, 0), fleet.hosts["h2"], handler) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(peer.request, b"wait", timeout=LIMIT))
                await entered.wait()
                nursery.cancel_scope.cancel()
            await handler_cancelled.wait()
            assert peer._link.calls == {}
            assert await peer.request(b"next", timeout=LIMIT) == b"next"


async def test_a_reader_leaving_early_stops_the_content(fleet: Fleet) -> None:
    async def content_handler(peer: str, request: bytes) -> bytes:
        return pattern(8 << 20, 8)

    with trio.fail_after(LIMIT):
        async with (
            quic.serve(
                (LOCAL, 0), fleet.hosts["h2"], echo_handler(), content_handler=content_handler
            ) as server,
            quic.connect((LOCAL, server.port), "h2", fleet.hosts["h1"]) as peer,
        ):
            async with peer.open_content(b"x", timeout=LIMIT) as reader:
                first = await reader.__anext__()
                assert first == pattern(8 << 20, 8)[: len(first)]
            assert peer._link.calls == {}
            assert await peer.request(b"next", timeout=LIMIT) == b"h1:next"
