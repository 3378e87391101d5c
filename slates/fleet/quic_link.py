"""One QUIC connection between enrolled fleet hosts: the aioquic seam and its driver.

Theory of operation: `FleetConnection` is aioquic's sans-I/O QuicConnection
with the one change mutual TLS needs (the server asks for the client's
certificate; slates.fleet.quic's theory of operation says why and how the
client is then checked); `Link` drives one such connection from trio over a
UDP socket: it feeds datagrams in, sends what the connection wants sent,
fires its timers, keeps each stream's `Call` (a request or a content
transfer) and grants content credit as an absolute offset.  The wire
constants, the limits record and the small codecs of requests, replies and
errors live here too.  Used only by slates.fleet.quic (the client `Peer`
and the `Server`), which is the public face.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import enum
import ipaddress
import math
import struct
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgpack
import trio
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode
from cryptography import x509

from slates.errors import (
    AccessDenied,
    CapacityExhausted,
    InvalidArgument,
    NotSupported,
    SlatesError,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.pki import (
    HostCredentials,
    verify_host_certificate,
)

__all__ = [
    "ADMISSION",
    "ALPN",
    "CONNECTION_ID_LENGTH",
    "CONTENT_HEADER",
    "Call",
    "CloseCode",
    "FleetConnection",
    "Handler",
    "Incoming",
    "KIND_CONTENT",
    "KIND_REQUEST",
    "Link",
    "MAX_DATAGRAM",
    "RECENT_REFUSALS",
    "Refusal",
    "SMALLEST_INITIAL_DATAGRAM",
    "STATUS_ERROR",
    "STATUS_OK",
    "StreamCode",
    "TransportLimits",
    "ca_certificate_of",
    "close_error",
    "configuration_for",
    "decode_reply",
    "error_body",
    "ip_address_of",
    "lone_errors",
]

ALPN = "slates-fleet/1"
ADMISSION = b"slates-fleet admitted/1"
SMALLEST_INITIAL_DATAGRAM = 1200
CONNECTION_ID_LENGTH = 8
MAX_DATAGRAM = 65536
RECENT_REFUSALS = 64

KIND_REQUEST = 0x01
KIND_CONTENT = 0x02
STATUS_OK = 0x00
STATUS_ERROR = 0x01
CONTENT_HEADER = struct.Struct("!BQ")  # status, content length


class CloseCode(enum.IntEnum):
    """Application error codes of CONNECTION_CLOSE."""

    NORMAL = 0x0
    ACCESS_DENIED = 0x1
    VERIFICATION_FAILED = 0x2
    PROTOCOL = 0x3


class StreamCode(enum.IntEnum):
    """Application error codes of RESET_STREAM and STOP_SENDING."""

    CANCELLED = 0x10
    TOO_LARGE = 0x11


Handler = Callable[[str, bytes], Awaitable[bytes]]


@dataclasses.dataclass(frozen=True, slots=True)
class TransportLimits:
    """Every bound of the transport; both ends should agree on the sizes."""

    max_concurrent_streams: int = 64
    max_request_bytes: int = 1 << 20
    max_reply_bytes: int = 4 << 20
    max_content_bytes: int = 256 << 20
    content_window_bytes: int = 1 << 20
    handshake_timeout: float = 5.0
    idle_timeout: float = 30.0
    max_connections: int = 128
    queued_datagrams: int = 512
    # QUIC's safe minimum; raise it only where the path MTU is known (1452 on Ethernet/IPv4):
    # aioquic does no path MTU discovery, and a datagram too large for the path is lost.
    max_datagram_bytes: int = 1200

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise InvalidArgument("transport limits are positive", limit=field.name)
        if self.max_concurrent_streams > 1000:
            raise InvalidArgument("at most 1000 concurrent streams per connection")
        if self.content_window_bytes < 16384:
            raise InvalidArgument("the content window is at least 16 KiB")
        if not 1200 <= self.max_datagram_bytes <= 65000:
            raise InvalidArgument("QUIC datagrams are 1200..65000 bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """A connection the server refused, for operators and tests."""

    address: tuple[str, int]
    reason: str


# ---- the aioquic seam ----------------------------------------------------------------------


class FleetConnection(QuicConnection):
    """QuicConnection plus what aioquic keeps private (see the module doc)."""

    def __init__(
        self, *, configuration: QuicConfiguration, max_streams: int, **kwargs: Any
    ) -> None:
        super().__init__(configuration=configuration, **kwargs)
        self._credit: dict[int, int] = {}
        # QUIC's MAX_STREAMS (fixed at 128 in aioquic) becomes our concurrency bound; the
        # only unidirectional stream is the server's admission.
        for limit, value in (
            (self._local_max_streams_bidi, max_streams),
            (self._local_max_streams_uni, 1),
        ):
            limit.value = limit.sent = value

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        for name in ("_request_client_certificate", "_peer_certificate"):
            if not hasattr(self.tls, name):
                raise NotSupported(f"this aioquic lacks tls.Context.{name}: cannot do mutual TLS")
        if not self._is_client:
            self.tls._request_client_certificate = True

    def peer_certificate(self) -> x509.Certificate | None:
        certificate = self.tls._peer_certificate
        return certificate if isinstance(certificate, x509.Certificate) else None

    def closing_event(self) -> events.ConnectionTerminated | None:
        """The close under way (ours or the peer's), before aioquic reports it at the end."""
        return self._close_event

    def manage_credit(self, stream_id: int, offset: int) -> None:
        """Own the stream's receive credit from now on: the peer may send up to `offset`."""
        previous = self._credit.get(stream_id, 0)
        self._credit[stream_id] = max(previous, offset)

    def forget_credit(self, stream_id: int) -> None:
        self._credit.pop(stream_id, None)

    def stream_exists(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def send_credit(self, stream_id: int) -> int:
        """The absolute offset up to which the peer lets us send on the stream (0: gone)."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else int(stream.max_stream_data_remote)

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        granted = self._credit.get(stream.stream_id)
        if granted is None:
            super()._write_stream_limits(builder=builder, space=space, stream=stream)
            return
        if granted > stream.max_stream_data_local:
            stream.max_stream_data_local = granted
        # aioquic's own method would also double the credit as data arrives; with our
        # credit never below what we already sent, it only sends the frame.
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            saved = stream.receiver.highest_offset
            stream.receiver.highest_offset = 0  # keeps aioquic from doubling it
            try:
                super()._write_stream_limits(builder=builder, space=space, stream=stream)
            finally:
                stream.receiver.highest_offset = saved


def configuration_for(
    creds: HostCredentials, limits: TransportLimits, *, is_client: bool, server_name: str | None
) -> QuicConfiguration:
    configuration = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        idle_timeout=limits.idle_timeout,
        max_data=max(16 << 20, 2 * limits.content_window_bytes),
        max_stream_data=max(limits.content_window_bytes, limits.max_request_bytes + 1),
        server_name=server_name,
        connection_id_length=CONNECTION_ID_LENGTH,
        max_datagram_size=limits.max_datagram_bytes,
    )
    configuration.load_cert_chain(creds.host_cert_path, creds.host_key_path)
    configuration.load_verify_locations(cadata=creds.ca_cert_path.read_bytes())
    return configuration


def close_error(event: events.ConnectionTerminated, *, by_peer_host: str | None) -> SlatesError:
    code, reason = event.error_code, event.reason_phrase
    details: dict[str, Any] = {"error_code": code, "reason": reason}
    if by_peer_host is not None:
        details["peer"] = by_peer_host
    application = event.frame_type is None
    if application and code == CloseCode.ACCESS_DENIED:
        return AccessDenied(f"the peer refused this host: {reason}", **details)
    if application and code == CloseCode.VERIFICATION_FAILED:
        return VerificationFailed(f"peer verification failed: {reason}", **details)
    if QuicErrorCode.CRYPTO_ERROR <= code <= QuicErrorCode.CRYPTO_ERROR + 0xFF:
        alert = code - QuicErrorCode.CRYPTO_ERROR
        return VerificationFailed(f"TLS handshake failed (alert {alert}): {reason}", **details)
    return SlatesError(f"the connection closed: {reason or 'code ' + hex(code)}", **details)


# ---- one connection ------------------------------------------------------------------------


class Call:
    """The client's side of one stream: a reply being collected, or content being read."""

    def __init__(self, stream_id: int, kind: int, limit: int) -> None:
        self.stream_id = stream_id
        self.kind = kind
        self.limit = limit
        self.buffer = bytearray()
        self.ended = False
        self.error: SlatesError | None = None
        self.changed = trio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class Incoming:
    """The server's side of one stream: the request being collected, then its handler."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.buffer = bytearray()
        self.scope = trio.CancelScope()
        self.abandoned = False


class Link:
    """Drives one QuicConnection (module doc: only the driver task transmits)."""

    def __init__(
        self,
        conn: FleetConnection,
        sock: trio.socket.SocketType,
        address: tuple[str, int],
        limits: TransportLimits,
        ca_certificate: x509.Certificate,
        *,
        expected_host_id: str | None,
    ) -> None:
        self.conn = conn
        self.sock = sock
        self.address = address
        self.limits = limits
        self.ca_certificate = ca_certificate
        self.expected_host_id = expected_host_id
        self.is_client = expected_host_id is not None
        self.peer_host_id: str | None = None
        self.admitted = trio.Event()
        self.failure: SlatesError | None = None
        self.finished = trio.Event()
        self.calls: dict[int, Call] = {}
        self.incoming: dict[int, Incoming] = {}
        self.ready_requests: collections.deque[Incoming] = collections.deque()
        self.request_ready = trio.Event()
        self.progress = trio.Event()
        self.late_frames_dropped = 0
        self.on_connection_id: Callable[[bytes, bool], None] = lambda cid, issued: None
        self.refused: str | None = None
        self._admission_buffer = bytearray()
        self._wake_pending = False
        self._timer_scope: trio.CancelScope | None = None
        self._has_path = self.is_client

    # -- driver --

    def wake(self) -> None:
        self._wake_pending = True
        if self._timer_scope is not None:
            self._timer_scope.deadline = -math.inf

    async def drive(self, inbound: trio.abc.ReceiveChannel[tuple[bytes, Any]] | None) -> None:
        """Run the connection until it terminates; `inbound` is None for a client (own socket)."""
        try:
            while not self.finished.is_set():
                self._wake_pending = False
                await self._transmit()
                self._surface_close()
                if self._wake_pending or self.finished.is_set():
                    continue
                timer = self.conn.get_timer()
                with trio.CancelScope(deadline=math.inf if timer is None else timer) as scope:
                    self._timer_scope = scope
                    if inbound is None:
                        data, source = await self.sock.recvfrom(MAX_DATAGRAM)
                        if source[:2] != self.address[:2]:
                            continue  # not our peer: QUIC would drop it anyway
                    else:
                        data, source = await inbound.receive()
                    self.conn.receive_datagram(data, source, now=trio.current_time())
                    self._has_path = True
                    self._process_events()
                self._timer_scope = None
                if scope.cancelled_caught and not self.finished.is_set():
                    # Either the timer fired or a wake() cut the wait short (then: transmit).
                    now, timer = trio.current_time(), self.conn.get_timer()
                    if timer is not None and now >= timer:
                        self.conn.handle_timer(now=now)
                        self._process_events()
        finally:
            self._timer_scope = None
            if not self.finished.is_set():
                self._terminate(SlatesError("the connection's driver stopped"))

    async def _transmit(self) -> None:
        if not self._has_path:
            return  # a server's connection has no path before its first datagram
        for data, destination in self.conn.datagrams_to_send(now=trio.current_time()):
            # A send error is as good as a lost datagram: QUIC retransmits or idles out.
            with contextlib.suppress(OSError):
                await self.sock.sendto(data, destination)

    def close(self, code: CloseCode, reason: str) -> None:
        self.conn.close(error_code=int(code), reason_phrase=reason)
        self.wake()

    async def shutdown(self) -> None:
        """Send our close and stop, without lingering for the closing period."""
        if not self.finished.is_set():
            self.conn.close(error_code=int(CloseCode.NORMAL), reason_phrase="closing")
            with trio.CancelScope(shield=True):
                await self._transmit()
            self._terminate(SlatesError("the connection was closed by this host"))

    def _surface_close(self) -> None:
        # aioquic reports a close (ours or the peer's) only after the closing period;
        # callers learn of it at once, while the driver keeps answering until then.
        closing = self.conn.closing_event()
        if closing is not None and self.failure is None:
            self._fail(close_error(closing, by_peer_host=self.peer_host_id))

    def _terminate(self, error: SlatesError) -> None:
        self._fail(error)
        self.finished.set()

    def _fail(self, error: SlatesError) -> None:
        """Every caller and handler learns `error`; the driver may go on (closing period)."""
        if self.failure is None:
            self.failure = error
        for call in self.calls.values():
            if call.error is None:
                call.error = error
            call.notify()
        for incoming in self.incoming.values():
            incoming.scope.cancel()
        self.admitted.set()  # wakes connect(), which then sees the failure
        self.request_ready.set()
        self.progress.set()

    # -- events --

    def _process_events(self) -> None:
        while (event := self.conn.next_event()) is not None:
            match event:
                case events.HandshakeCompleted():
                    self._authenticate()
                case events.StreamDataReceived():
                    self._on_data(event.stream_id, event.data, event.end_stream)
                case events.StreamReset() | events.StopSendingReceived():
                    self._on_abort(event.stream_id)
                case events.ConnectionIdIssued():
                    self.on_connection_id(event.connection_id, True)
                case events.ConnectionIdRetired():
                    self.on_connection_id(event.connection_id, False)
                case events.ConnectionTerminated():
                    self._terminate(close_error(event, by_peer_host=self.peer_host_id))
                case events.ProtocolNegotiated() | events.PingAcknowledged():
                    pass  # ALPN is checked by TLS itself; we send no pings
                case _:
                    self._refuse(CloseCode.PROTOCOL, f"unexpected {type(event).__name__}")
        self._surface_close()
        if not self.is_client:
            self._sweep_abandoned()
        self.progress.set()
        self.progress = trio.Event()

    def _sweep_abandoned(self) -> None:
        # An abandoned stream keeps its entry (so its late frames are recognised as
        # late) until aioquic discards the stream; QUIC's MAX_STREAMS bounds how many.
        for stream_id in [sid for sid, inc in self.incoming.items() if inc.abandoned]:
            if not self.conn.stream_exists(stream_id):
                del self.incoming[stream_id]

    def _authenticate(self) -> None:
        certificate = self.conn.peer_certificate()
        if certificate is None:
            self._refuse(CloseCode.ACCESS_DENIED, "the peer presented no certificate")
            return
        now = datetime.datetime.now(datetime.UTC)
        try:
            host_id = verify_host_certificate(certificate, self.ca_certificate, now)
        except VerificationFailed as exc:
            self._refuse(CloseCode.ACCESS_DENIED, exc.message)
            return
        if self.is_client and host_id != self.expected_host_id:
            self._refuse(
                CloseCode.VERIFICATION_FAILED,
                f"dialed host {self.expected_host_id!r} but the peer is {host_id!r}",
            )
            return
        self.peer_host_id = host_id
        if not self.is_client:
            admission_stream = self.conn.get_next_available_stream_id(is_unidirectional=True)
            self.conn.send_stream_data(admission_stream, ADMISSION, end_stream=True)
            self.admitted.set()

    def _refuse(self, code: CloseCode, reason: str) -> None:
        self.refused = reason
        self.conn.close(error_code=int(code), reason_phrase=reason)
        self.wake()

    def _on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if self.peer_host_id is None or self.refused is not None:
            self._refuse(CloseCode.PROTOCOL, "stream data before authentication")
            return
        # Stream ids: 0 mod 4 the client's bidirectional (requests), 3 the server's first
        # unidirectional (the admission); the protocol has no other streams.
        match (self.is_client, stream_id % 4, stream_id):
            case (True, 3, 3):
                self._on_admission(data, end_stream)
            case (True, 0, _):
                call = self.calls.get(stream_id)
                if call is None:
                    self.late_frames_dropped += 1  # a retired stream: never redelivered
                else:
                    self._on_reply_data(call, data, end_stream)
            case (False, 0, _):
                self._on_request_data(stream_id, data, end_stream)
            case _:
                self._refuse(CloseCode.PROTOCOL, f"no such stream in this protocol: {stream_id}")

    def _on_admission(self, data: bytes, end_stream: bool) -> None:
        self._admission_buffer += data
        if len(self._admission_buffer) > len(ADMISSION):
            self._refuse(CloseCode.PROTOCOL, "malformed admission")
        elif end_stream:
            if bytes(self._admission_buffer) != ADMISSION:
                self._refuse(CloseCode.PROTOCOL, "malformed admission")
            else:
                self.admitted.set()

    def _on_reply_data(self, call: Call, data: bytes, end_stream: bool) -> None:
        call.buffer += data
        if len(call.buffer) > call.limit:
            call.error = CapacityExhausted(
                "the peer's reply exceeds the limit", limit=call.limit, stream=call.stream_id
            )
            self.retire(call.stream_id, abort=True)
        elif end_stream:
            call.ended = True
        call.notify()

    def _on_request_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        incoming = self.incoming.get(stream_id)
        if incoming is None:
            incoming = self.incoming[stream_id] = Incoming(stream_id)
        if incoming.abandoned:
            self.late_frames_dropped += 1
            return
        incoming.buffer += data
        if len(incoming.buffer) > self.limits.max_request_bytes + 1:
            # Answer, stop the rest, and keep the entry (abandoned) so that what is still in
            # flight is recognised as late rather than as a new request.
            error = CapacityExhausted(
                "the request exceeds the limit", limit=self.limits.max_request_bytes
            )
            self.conn.send_stream_data(stream_id, error_body(error), end_stream=True)
            self.conn.stop_stream(stream_id, int(StreamCode.TOO_LARGE))
            incoming.abandoned = True
            incoming.buffer = bytearray()
            self.wake()
        elif end_stream:
            self.ready_requests.append(incoming)
            self.request_ready.set()

    def _on_abort(self, stream_id: int) -> None:
        if self.is_client:
            call = self.calls.get(stream_id)
            if call is None:
                self.late_frames_dropped += 1
                return
            if call.error is None and not call.ended:
                call.error = SlatesError("the peer abandoned the stream", stream=stream_id)
            call.notify()
            return
        incoming = self.incoming.get(stream_id)
        if incoming is not None:
            incoming.abandoned = True
            incoming.scope.cancel()

    # -- streams, used by Peer and Server --

    def retire(self, stream_id: int, *, abort: bool) -> None:
        """Forget a stream; with `abort`, reset our half and stop the peer's (STREAM_CANCELLED)."""
        self.calls.pop(stream_id, None)
        self.conn.forget_credit(stream_id)
        if abort and not self.finished.is_set():
            with contextlib.suppress(ValueError, RuntimeError):  # already finished or reset
                self.conn.reset_stream(stream_id, int(StreamCode.CANCELLED))
            with contextlib.suppress(ValueError, RuntimeError):
                self.conn.stop_stream(stream_id, int(StreamCode.CANCELLED))
        self.wake()

    def send_error(self, incoming: Incoming, error: SlatesError) -> None:
        self.send_final(incoming, error_body(error))

    def send_final(self, incoming: Incoming, body: bytes) -> None:
        if incoming.abandoned or self.failure is not None:
            return  # the client cancelled it: nobody will read it
        try:
            self.conn.send_stream_data(incoming.stream_id, body, end_stream=True)
        except (ValueError, RuntimeError):
            incoming.abandoned = True  # reset by the peer in the meantime
            return
        self.incoming.pop(incoming.stream_id, None)
        self.wake()


def error_body(error: SlatesError) -> bytes:
    packed: bytes = msgpack.packb(error.to_wire(), use_bin_type=True)
    return bytes([STATUS_ERROR]) + packed


def decode_reply(body: bytes) -> bytes:
    if not body:
        raise SlatesError("empty reply")
    if body[0] == STATUS_OK:
        return body[1:]
    if body[0] == STATUS_ERROR:
        try:
            wire = msgpack.unpackb(body[1:], raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise SlatesError("malformed error reply") from exc
        if not isinstance(wire, dict):
            raise SlatesError("malformed error reply")
        raise error_from_wire(wire)
    raise SlatesError("unknown reply status", status=body[0])


@contextlib.contextmanager
def lone_errors() -> Iterator[None]:
    """A nursery wraps errors in a group; a lone error reaches our callers as itself."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves: list[BaseException] = []
        pending: list[BaseException] = [group]
        while pending:
            item = pending.pop()
            if isinstance(item, BaseExceptionGroup):
                pending.extend(item.exceptions)
            else:
                leaves.append(item)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def ip_address_of(host: str) -> str:
    """Peers are dialed by IP address (the fleet's configuration records them), never a name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError as exc:
        raise InvalidArgument("a fleet address is an IP address", address=repr(host)) from exc


def ca_certificate_of(creds: HostCredentials) -> x509.Certificate:
    return x509.load_pem_x509_certificate(creds.ca_cert_path.read_bytes())
