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
import ipaddress
import socket
from collections.abc import AsyncIterator
from typing import Any

import trio
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from C
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from cryptography import x509

from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    NotSupported,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.pki import (
    HostCredentials,
    host_dns_name,
    validate_host_id,
)
from slates.fleet.quic_link import (
    ALPN,
    CONNECTION_ID_LENGTH,
    CONTENT_HEADER,
    KIND_CONTENT,
    KIND_REQUEST,
    MAX_DATAGRAM,
    RECENT_REFUSALS,
    SMALLEST_INITIAL_DATAGRAM,
    STATUS_OK,
    Call,
    CloseCode,
    FleetConnection,
    Handler,
    Incoming,
    Link,
    Refusal,
    TransportLimits,
    ca_certificate_of,
    configuration_for,
    decode_reply,
    ip_address_of,
    lone_errors,
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

# ---- the client ----------------------------------------------------------------------------


class Peer:
    """A connection to one enrolled host, as its client (`connect`)."""

    def __init__(self, link: Link) -> None:
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

    def _open(self, kind: int, payload: bytes, limit: int) -> Call:
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
        call = self._link.calls[stream_id] = Call(stream_id, kind, limit)
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
        return decode_reply(bytes(call.buffer))

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

    def __init__(self, link: Link, call: Call) -> None:
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
            decode_reply(bytes(call.buffer))
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
    configuration = configuration_for(
        creds, limits, is_client=True, server_name=host_dns_name(expected_host_id)
    )
    async with _dial(
        address, expected_host_id, configuration, ca_certificate_of(creds), limits
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
    target = (ip_address_of(address[0]), int(address[1]))
    ip = ipaddress.ip_address(target[0])
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        # A loopback peer is reached from the loopback: the socket listens nowhere else.
        local = ("::1" if ip.version == 6 else "127.0.0.1") if ip.is_loopback else ""
        await sock.bind((local or ("::" if ip.version == 6 else "0.0.0.0"), 0))
        conn = FleetConnection(
            configuration=configuration, max_streams=limits.max_concurrent_streams
        )
        link = Link(conn, sock, target, limits, ca_certificate, expected_host_id=expected_host_id)
        conn.connect(target, now=trio.current_time())
        with lone_errors():
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
        self._configuration = configuration_for(creds, limits, is_client=False, server_name=None)
        self._ca_certificate = ca_certificate_of(creds)
        self._handler = handler
        self._content_handler = content_handler
        self._limits = limits
        self._nursery = nursery
        self._routes: dict[bytes, tuple[Link, trio.MemorySendChannel[tuple[bytes, Any]]]] = {}
        self._links: set[Link] = set()
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
    ) -> tuple[Link, trio.MemorySendChannel[tuple[bytes, Any]]]:
        conn = FleetConnection(
            configuration=self._configuration,
            max_streams=self._limits.max_concurrent_streams,
            original_destination_connection_id=original_cid,
        )
        link = Link(
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
        self, link: Link, inbound: trio.MemoryReceiveChannel[tuple[bytes, Any]]
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

    async def _dispatch(self, link: Link, nursery: trio.Nursery) -> None:
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

    async def _answer(self, link: Link, incoming: Incoming, running: set[int]) -> None:
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
        self, link: Link, incoming: Incoming, handler: Handler, peer: str, payload: bytes
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
        self, link: Link, incoming: Incoming, peer: str, payload: bytes
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
        self, link: Link, incoming: Incoming, peer: str, payload: bytes
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
        if ipaddress.ip_address(ip_address_of(bind[0])).version == 6
        else socket.AF_INET
    )
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        await sock.bind(bind)
        with lone_errors():
            async with trio.open_nursery() as nursery:
                server = Server(sock, creds, handler, content_handler, limits, nursery)
                nursery.start_soon(server.listen)
                try:
                    yield server
                finally:
                    for link in list(server._links):
                        await link.shutdown()
                    nursery.cancel_scope.cancel()
