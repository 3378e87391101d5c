"""The fleet's transport: QUIC with mutual TLS between enrolled hosts (DESIGN.md section 7).

Theory of operation.  aioquic's sans-I/O `QuicConnection` is driven from trio
over one trio UDP socket; there is no asyncio.  One `_Link` drives one
connection: a single driver task feeds it datagrams and timer expiries, drains
its events synchronously right after each input (so the stream table never
lags the connection's own state) and sends what it has to send.  Other tasks
(callers, handlers) only call the connection's non-blocking methods and then
`_Link.wake()`, which makes the driver transmit; only the driver transmits.
The client (`connect`) owns its socket; the server (`serve`) reads one socket
and routes each datagram to its connection by destination connection id
(new ids as aioquic issues them), making a connection for an Initial packet of
a full-size datagram, up to `max_connections`.

Mutual TLS, and what aioquic does not do for us.  aioquic 1.x verifies the
*server's* chain (against our `ca.crt` only, never the system store) and its
SAN against the server name, which we set to the dialed host's DNS name
(`pki.host_dns_name`), so dialing h2's address expecting h3 fails inside the
handshake.  Its server neither asks for nor verifies client certificates: the
CertificateRequest is behind a private flag ("for test purposes only") and the
server never checks the client's chain.  We therefore (1) set that flag in
`_FleetConnection._initialize`, so the client proves possession of its key in
the TLS CertificateVerify, a signature over the handshake transcript, which
aioquic does check against the presented certificate, and (2) right after the
handshake completes, before any stream is read, verify the presented
certificate ourselves against `ca.crt` (`pki.verify_host_certificate`: issuer,
signature, validity) and read the peer's host id from its CN.  A client with no
certificate, or one from another CA, is refused: the server closes the
connection with ACCESS_DENIED and a reason, which the client's `connect()`
raises as AccessDenied.  The client, having no other way to know the server has
accepted it (its own handshake ends first), waits for the server's admission: a
fixed message on the server's first unidirectional stream.  Both sides also
compare the peer certificate's CN byte for byte (DNS names are case-blind).
Session resumption is never enabled: a resumed session skips certificates.
The handler is given the peer's authenticated host id: the origin part of a
request's identity (DESIGN.md: never the connection).  These rely on aioquic
internals (`tls._request_client_certificate`, `tls._peer_certificate`,
`_close_event`, the MAX_STREAMS limits, `QuicStream` credit fields,
`_write_stream_limits`), all confined to `_FleetConnection`; it checks the TLS
ones exist, and the tests fail if any stops working.  Peers are dialed by IP
address (the fleet's configuration records addresses, and a name would have to
be resolved by someone we do not authenticate).

Streams.  Every request is its own client-initiated bidirectional stream: the
request (kind byte, payload) then FIN on one half, the reply (status byte,
body) then FIN on the other; so requests, replies and content never share a
stream, and stream ids are never reused.  A request that times out (or whose
caller is cancelled) is reset and stopped (STREAM_CANCELLED) and retired from
the table; anything arriving later on that stream finds no entry and is
dropped (counted in `late_frames_dropped`), so it can never be delivered into
a later request.  The server cancels the handler of a reset or stopped stream.

Content.  A content stream is a request whose reply is large: status, an 8-byte
length, then the bytes.  Its flow control is QUIC's own stream credit:
MAX_STREAM_DATA is an absolute offset in the stream (not an increment), and for
content streams we, not aioquic, decide it: the receiver grants
`consumed + content_window_bytes` as its reader consumes, so at most one window
is ever buffered per stream; the sender writes only up to the peer's granted
offset, so its send buffer is bounded by the same window.  (aioquic by itself
doubles the credit as data merely arrives, which bounds nothing.)

Bounds (`TransportLimits`): concurrent streams per connection (a caller over it
gets CapacityExhausted; QUIC's MAX_STREAMS is set to the same number, and the
server answers a stream beyond it with CapacityExhausted), request, reply and
content sizes (InvalidArgument for one's own oversize request, CapacityExhausted
for a peer's), connections per server, queued datagrams per connection (drops
beyond, which QUIC recovers), datagram size (1200 by default: aioquic does no
path MTU discovery), handshake and idle timeouts.  Timeouts raise
Unavailable (the peer did not answer in time).  Reconnecting is
the caller's job: a new `connect()`.

Callers: the fleet's drivers (ledger messages between hosts), and the `slates
fleet` CLI.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import enum
import ipaddress
import math
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgpack
import trio
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from C
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicPacketType, pull_quic_header
from cryptography import x509

from slates.errors import (
    AccessDenied,
    CapacityExhausted,
    InvalidArgument,
    NotSupported,
    SlatesError,
    Unavailable,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.pki import (
    HostCredentials,
    host_dns_name,
    validate_host_id,
    verify_host_certificate,
)

__all__ = [
    "ALPN",
    "Handler",
    "Peer",
    "Refusal",
    "Server",
    "TransportLimits",
    "connect",
    "serve",
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


class _FleetConnection(QuicConnection):
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


def _configuration(
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


def _close_error(event: events.ConnectionTerminated, *, by_peer_host: str | None) -> SlatesError:
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


class _Call:
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


class _Incoming:
    """The server's side of one stream: the request being collected, then its handler."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.buffer = bytearray()
        self.scope = trio.CancelScope()
        self.abandoned = False


class _Link:
    """Drives one QuicConnection (module doc: only the driver task transmits)."""

    def __init__(
        self,
        conn: _FleetConnection,
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
        self.calls: dict[int, _Call] = {}
        self.incoming: dict[int, _Incoming] = {}
        self.ready_requests: collections.deque[_Incoming] = collections.deque()
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
            self._fail(_close_error(closing, by_peer_host=self.peer_host_id))

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
                    self._terminate(_close_error(event, by_peer_host=self.peer_host_id))
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

    def _on_reply_data(self, call: _Call, data: bytes, end_stream: bool) -> None:
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
            incoming = self.incoming[stream_id] = _Incoming(stream_id)
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
            self.conn.send_stream_data(stream_id, _error_body(error), end_stream=True)
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

    def send_error(self, incoming: _Incoming, error: SlatesError) -> None:
        self.send_final(incoming, _error_body(error))

    def send_final(self, incoming: _Incoming, body: bytes) -> None:
        if incoming.abandoned or self.failure is not None:
            return  # the client cancelled it: nobody will read it
        try:
            self.conn.send_stream_data(incoming.stream_id, body, end_stream=True)
        except (ValueError, RuntimeError):
            incoming.abandoned = True  # reset by the peer in the meantime
            return
        self.incoming.pop(incoming.stream_id, None)
        self.wake()


# ---- the client ----------------------------------------------------------------------------


class Peer:
    """A connection to one enrolled host, as its client (`connect`)."""

    def __init__(self, link: _Link) -> None:
        self._link = link

    @property
    def host_id(self) -> str:
        return str(self._link.peer_host_id)

    @property
    def late_frames_dropped(self) -> int:
        """Stream frames that arrived for retired streams (and were not delivered)."""
        return self._link.late_frames_dropped

    def _check_open(self) -> None:
        if self._link.failure is not None:
            raise self._link.failure

    def _open(self, kind: int, payload: bytes, limit: int) -> _Call:
        self._check_open()
        if len(payload) > self._link.limits.max_request_bytes:
            raise InvalidArgument(
                "the request exceeds the limit",
                size=len(payload),
                limit=self._link.limits.max_request_bytes,
            )
        if len(self._link.calls) >= self._link.limits.max_concurrent_streams:
            raise CapacityExhausted(
                "too many requests in flight on this connection",
                limit=self._link.limits.max_concurrent_streams,
            )
        conn = self._link.conn
        stream_id = conn.get_next_available_stream_id()
        call = self._link.calls[stream_id] = _Call(stream_id, kind, limit)
        if kind == KIND_CONTENT:
            conn.manage_credit(stream_id, self._link.limits.content_window_bytes)
        conn.send_stream_data(stream_id, bytes([kind]) + payload, end_stream=True)
        self._link.wake()
        return call

    async def request(self, payload: bytes, *, timeout: float) -> bytes:
        """Send one request and return its reply; the handler's error is raised as itself."""
        call = self._open(KIND_REQUEST, payload, self._link.limits.max_reply_bytes + 1)
        finished = False
        try:
            with trio.fail_after(timeout):
                while call.error is None and not call.ended:
                    await call.changed.wait()
            finished = True
        except trio.TooSlowError:
            raise Unavailable(
                "the peer did not answer in time", host=self.host_id, timeout=timeout
            ) from None
        finally:
            self._link.retire(call.stream_id, abort=not finished)
        if call.error is not None:
            raise call.error
        return _decode_reply(bytes(call.buffer))

    @contextlib.asynccontextmanager
    async def open_content(self, payload: bytes, *, timeout: float) -> AsyncIterator[ContentReader]:
        """A large reply read piece by piece under QUIC stream credit (module doc)."""
        limit = self._link.limits.max_content_bytes + CONTENT_HEADER.size
        call = self._open(KIND_CONTENT, payload, limit)
        finished = False
        try:
            with trio.fail_after(timeout):
                reader = ContentReader(self._link, call)
                await reader._read_header()
                yield reader
                finished = reader.done
        except trio.TooSlowError:
            raise Unavailable(
                "the peer did not send the content in time", host=self.host_id, timeout=timeout
            ) from None
        finally:
            self._link.retire(call.stream_id, abort=not finished)

    async def fetch(self, payload: bytes, *, timeout: float) -> bytes:
        """The whole content for `payload` (at most `max_content_bytes`)."""
        async with self.open_content(payload, timeout=timeout) as reader:
            pieces = [piece async for piece in reader]
        return b"".join(pieces)


class ContentReader:
    """Content arriving on one stream; each piece consumed grants the sender more credit."""

    def __init__(self, link: _Link, call: _Call) -> None:
        self._link = link
        self._call = call
        self.size = 0
        self.received = 0
        self.done = False
        self._consumed_offset = 0  # stream offset our reader has taken, header included
        self._granted = link.limits.content_window_bytes

    async def _wait(self) -> None:
        call = self._call
        if call.error is not None:
            raise call.error
        await call.changed.wait()

    async def _read_header(self) -> None:
        call = self._call
        while len(call.buffer) < 1 or (
            call.buffer[0] == STATUS_OK and len(call.buffer) < CONTENT_HEADER.size
        ):
            if call.ended:
                raise SlatesError("the content stream ended inside its header")
            await self._wait()
        if call.buffer[0] != STATUS_OK:
            while not call.ended:
                if len(call.buffer) > self._link.limits.max_reply_bytes:
                    raise CapacityExhausted("the peer's error reply exceeds the limit")
                await self._wait()
            _decode_reply(bytes(call.buffer))
            raise SlatesError("malformed content reply")
        _, self.size = CONTENT_HEADER.unpack_from(call.buffer)
        if self.size > self._link.limits.max_content_bytes:
            raise CapacityExhausted(
                "the content exceeds the limit",
                size=self.size,
                limit=self._link.limits.max_content_bytes,
            )
        del call.buffer[: CONTENT_HEADER.size]
        self._consumed(CONTENT_HEADER.size)

    def _consumed(self, count: int) -> None:
        self._consumed_offset += count
        window = self._link.limits.content_window_bytes
        if self._granted - self._consumed_offset < window // 2:
            self._granted = self._consumed_offset + window  # an absolute offset, as in QUIC
            self._link.conn.manage_credit(self._call.stream_id, self._granted)
            self._link.wake()

    def __aiter__(self) -> ContentReader:
        return self

    async def __anext__(self) -> bytes:
        call = self._call
        while not call.buffer:
            if self.done or (call.ended and self.received == self.size):
                self.done = True
                raise StopAsyncIteration
            if call.ended:
                raise SlatesError(
                    "the content stream ended early", size=self.size, received=self.received
                )
            await self._wait()
        piece = bytes(call.buffer)
        call.buffer.clear()
        self.received += len(piece)
        if self.received > self.size:
            raise VerificationFailed("the peer sent more content than it announced")
        self._consumed(len(piece))
        return piece


def _error_body(error: SlatesError) -> bytes:
    packed: bytes = msgpack.packb(error.to_wire(), use_bin_type=True)
    return bytes([STATUS_ERROR]) + packed


def _decode_reply(body: bytes) -> bytes:
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
def _lone_errors() -> Iterator[None]:
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


def _ip_address(host: str) -> str:
    """Peers are dialed by IP address (the fleet's configuration records them), never a name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError as exc:
        raise InvalidArgument("a fleet address is an IP address", address=repr(host)) from exc


def _ca_certificate(creds: HostCredentials) -> x509.Certificate:
    return x509.load_pem_x509_certificate(creds.ca_cert_path.read_bytes())


@contextlib.asynccontextmanager
async def connect(
    address: tuple[str, int],
    expected_host_id: str,
    creds: HostCredentials,
    *,
    limits: TransportLimits | None = None,
) -> AsyncIterator[Peer]:
    """Dial `address`, which must be the enrolled host `expected_host_id`, and admit us."""
    limits = limits or TransportLimits()
    validate_host_id(expected_host_id)
    configuration = _configuration(
        creds, limits, is_client=True, server_name=host_dns_name(expected_host_id)
    )
    async with _dial(
        address, expected_host_id, configuration, _ca_certificate(creds), limits
    ) as peer:
        yield peer


@contextlib.asynccontextmanager
async def _dial(
    address: tuple[str, int],
    expected_host_id: str,
    configuration: QuicConfiguration,
    ca_certificate: x509.Certificate,
    limits: TransportLimits,
) -> AsyncIterator[Peer]:
    target = (_ip_address(address[0]), int(address[1]))
    ip = ipaddress.ip_address(target[0])
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        # A loopback peer is reached from the loopback: the socket listens nowhere else.
        local = ("::1" if ip.version == 6 else "127.0.0.1") if ip.is_loopback else ""
        await sock.bind((local or ("::" if ip.version == 6 else "0.0.0.0"), 0))
        conn = _FleetConnection(
            configuration=configuration, max_streams=limits.max_concurrent_streams
        )
        link = _Link(conn, sock, target, limits, ca_certificate, expected_host_id=expected_host_id)
        conn.connect(target, now=trio.current_time())
        with _lone_errors():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.drive, None)
                try:
                    try:
                        with trio.fail_after(limits.handshake_timeout):
                            await link.admitted.wait()
                    except trio.TooSlowError:
                        raise Unavailable(
                            "the peer did not complete the handshake in time",
                            host=expected_host_id,
                            timeout=limits.handshake_timeout,
                        ) from None
                    if link.failure is not None:
                        raise link.failure
                    yield Peer(link)
                finally:
                    await link.shutdown()
                    nursery.cancel_scope.cancel()


# ---- the server ----------------------------------------------------------------------------


class Server:
    """A listening endpoint (`serve`); `port` is the bound UDP port."""

    def __init__(
        self,
        sock: trio.socket.SocketType,
        creds: HostCredentials,
        handler: Handler,
        content_handler: Handler | None,
        limits: TransportLimits,
        nursery: trio.Nursery,
    ) -> None:
        self._sock = sock
        self._configuration = _configuration(creds, limits, is_client=False, server_name=None)
        self._ca_certificate = _ca_certificate(creds)
        self._handler = handler
        self._content_handler = content_handler
        self._limits = limits
        self._nursery = nursery
        self._routes: dict[bytes, tuple[_Link, trio.MemorySendChannel[tuple[bytes, Any]]]] = {}
        self._links: set[_Link] = set()
        self.host_id = creds.host_id
        self.port: int = sock.getsockname()[1]
        self.refusals: collections.deque[Refusal] = collections.deque(maxlen=RECENT_REFUSALS)
        self.datagrams_dropped = 0

    @property
    def connections(self) -> int:
        return len(self._links)

    async def listen(self) -> None:
        while True:
            data, source = await self._sock.recvfrom(MAX_DATAGRAM)
            self._route(data, source)

    def _route(self, data: bytes, source: Any) -> None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CONNECTION_ID_LENGTH)
        except ValueError:
            self.datagrams_dropped += 1
            return
        route = self._routes.get(header.destination_cid)
        if route is None:
            if (
                header.packet_type != QuicPacketType.INITIAL
                or len(data) < SMALLEST_INITIAL_DATAGRAM
                or header.version not in self._configuration.supported_versions
            ):
                self.datagrams_dropped += 1
                return
            if len(self._links) >= self._limits.max_connections:
                self.datagrams_dropped += 1
                self.refusals.append(Refusal(tuple(source[:2]), "too many connections"))
                return
            route = self._accept(header.destination_cid, source)
        try:
            route[1].send_nowait((data, source))
        except trio.WouldBlock:
            self.datagrams_dropped += 1  # a full queue is a lost datagram: QUIC recovers

    def _accept(
        self, original_cid: bytes, source: Any
    ) -> tuple[_Link, trio.MemorySendChannel[tuple[bytes, Any]]]:
        conn = _FleetConnection(
            configuration=self._configuration,
            max_streams=self._limits.max_concurrent_streams,
            original_destination_connection_id=original_cid,
        )
        link = _Link(
            conn,
            self._sock,
            tuple(source[:2]),
            self._limits,
            self._ca_certificate,
            expected_host_id=None,
        )
        send, receive = trio.open_memory_channel[tuple[bytes, Any]](self._limits.queued_datagrams)
        route = (link, send)
        self._routes[original_cid] = route
        self._routes[conn.host_cid] = route

        def on_connection_id(cid: bytes, issued: bool) -> None:
            if issued:
                self._routes[cid] = route
            else:
                self._routes.pop(cid, None)

        link.on_connection_id = on_connection_id
        self._links.add(link)
        self._nursery.start_soon(self._serve_link, link, receive)
        return route

    async def _serve_link(
        self, link: _Link, inbound: trio.MemoryReceiveChannel[tuple[bytes, Any]]
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.drive, inbound)
                with trio.move_on_after(self._limits.handshake_timeout):
                    await link.admitted.wait()
                if not link.admitted.is_set():
                    link.close(CloseCode.ACCESS_DENIED, "handshake timeout")
                    link.refused = "handshake timeout"
                if link.failure is None and link.peer_host_id is not None:
                    await self._dispatch(link, nursery)
                await link.finished.wait()
                nursery.cancel_scope.cancel()
        finally:
            if link.refused is not None or link.peer_host_id is None:
                reason = link.refused or (link.failure.message if link.failure else "unknown")
                self.refusals.append(Refusal(link.address, reason))
            for cid in [cid for cid, (owner, _) in self._routes.items() if owner is link]:
                del self._routes[cid]
            self._links.discard(link)

    async def _dispatch(self, link: _Link, nursery: trio.Nursery) -> None:
        running: set[int] = set()
        while link.failure is None:
            while link.ready_requests:
                incoming = link.ready_requests.popleft()
                if incoming.abandoned:
                    continue
                if len(running) >= self._limits.max_concurrent_streams:
                    link.send_error(
                        incoming,
                        CapacityExhausted(
                            "too many requests in flight at the server",
                            limit=self._limits.max_concurrent_streams,
                        ),
                    )
                    continue
                running.add(incoming.stream_id)
                nursery.start_soon(self._answer, link, incoming, running)
            link.request_ready = trio.Event()
            if not link.ready_requests:
                await link.request_ready.wait()

    async def _answer(self, link: _Link, incoming: _Incoming, running: set[int]) -> None:
        peer = str(link.peer_host_id)
        body = bytes(incoming.buffer)
        incoming.buffer = bytearray()
        try:
            with incoming.scope:
                if not body or body[0] not in (KIND_REQUEST, KIND_CONTENT):
                    link.send_error(incoming, InvalidArgument("unknown request kind"))
                elif body[0] == KIND_REQUEST:
                    await self._answer_request(link, incoming, peer, body[1:])
                else:
                    await self._answer_content(link, incoming, peer, body[1:])
        finally:
            running.discard(incoming.stream_id)

    async def _call_handler(
        self, link: _Link, incoming: _Incoming, handler: Handler, peer: str, payload: bytes
    ) -> bytes | None:
        try:
            return await handler(peer, payload)
        except SlatesError as exc:
            link.send_error(incoming, exc)
        except Exception as exc:
            link.send_error(
                incoming,
                SlatesError(
                    f"the handler on {self.host_id} raised {type(exc).__name__}: {exc}",
                    host=self.host_id,
                    exception=type(exc).__name__,
                ),
            )
        return None

    async def _answer_request(
        self, link: _Link, incoming: _Incoming, peer: str, payload: bytes
    ) -> None:
        reply = await self._call_handler(link, incoming, self._handler, peer, payload)
        if reply is None:
            return
        if len(reply) > self._limits.max_reply_bytes:
            link.send_error(
                incoming,
                CapacityExhausted(
                    "the reply exceeds the limit",
                    size=len(reply),
                    limit=self._limits.max_reply_bytes,
                ),
            )
            return
        link.send_final(incoming, bytes([STATUS_OK]) + reply)

    async def _answer_content(
        self, link: _Link, incoming: _Incoming, peer: str, payload: bytes
    ) -> None:
        if self._content_handler is None:
            link.send_error(incoming, NotSupported("this host serves no content"))
            return
        content = await self._call_handler(link, incoming, self._content_handler, peer, payload)
        if content is None:
            return
        if len(content) > self._limits.max_content_bytes:
            link.send_error(
                incoming,
                CapacityExhausted(
                    "the content exceeds the limit",
                    size=len(content),
                    limit=self._limits.max_content_bytes,
                ),
            )
            return
        stream_id = incoming.stream_id
        header = CONTENT_HEADER.pack(STATUS_OK, len(content))
        link.conn.send_stream_data(stream_id, header)
        written, sent = len(header), 0
        piece_limit = 256 << 10
        view = memoryview(content)
        while sent < len(content):
            if incoming.abandoned or link.failure is not None:
                return
            allowed = link.conn.send_credit(stream_id) - written  # peer's absolute offset
            if allowed <= 0:
                await link.progress.wait()
                continue
            piece = view[sent : sent + min(allowed, piece_limit)]
            link.conn.send_stream_data(stream_id, bytes(piece))
            written += len(piece)
            sent += len(piece)
            link.wake()
            await trio.lowlevel.checkpoint()
        link.send_final(incoming, b"")


@contextlib.asynccontextmanager
async def serve(
    bind: tuple[str, int],
    creds: HostCredentials,
    handler: Handler,
    *,
    content_handler: Handler | None = None,
    limits: TransportLimits | None = None,
) -> AsyncIterator[Server]:
    """Listen on `bind` for enrolled hosts; `handler(peer_host_id, request)` answers requests."""
    limits = limits or TransportLimits()
    family = (
        socket.AF_INET6
        if ipaddress.ip_address(_ip_address(bind[0])).version == 6
        else socket.AF_INET
    )
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        await sock.bind(bind)
        with _lone_errors():
            async with trio.open_nursery() as nursery:
                server = Server(sock, creds, handler, content_handler, limits, nursery)
                nursery.start_soon(server.listen)
                try:
                    yield server
                finally:
                    for link in list(server._links):
                        await link.shutdown()
                    nursery.cancel_scope.cancel()
