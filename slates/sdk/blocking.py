"""The blocking transport: Client's connections to shards and to the anchor, without trio.

Theory of operation: the same conversation as slates.sdk.connection (what
is sent and what a reply means is slates.sdk.session's, shared by both),
over plain blocking sockets on the caller's thread.  A shard connection is
opened on first use: hello, the ring pair when rings were asked for, then
one request at a time (a threading lock, so threads may share a Client).
Without rings the connection's first request, when small (ALONG_MOST),
goes in the same send as the hello (the shard reads its stream in order,
and a refused hello discards what follows), so a command's first request
to a shard costs one round trip, not two.  The same request to several
shards (`request_each`: a name looked up, the volumes listed) is sent on
every connection before any reply is awaited.  Closing sends each socket
connection's goodbye and closes the connection without awaiting the answer:
the shard reads the goodbye from the stream after the client's end (a
stream keeps what was sent before it ends), forgets the client, and its
answer meets a closed socket, which the shard takes as any client's end.
A command is done that much sooner, and the answer carries nothing it
could use.  A ring connection's goodbye is answered over its ring, awaited.
If the shard dies or the connection breaks, the request reconnects and is
resent unchanged, within slates.sdk.session.Reconnect's bound; a request
interrupted otherwise (KeyboardInterrupt, a corrupt ring) closes its
connection, so no late reply can meet the next request.

Waiting for a reply over rings: the reply ring is waited on in slices
(`Ring.receive_blocking` with a timeout growing from WATCH_FIRST to
WATCH_MOST seconds), and between slices the socket is polled, because a
reply too large for the ring comes as a socket frame and the socket's end
means the shard died.  A reply that comes on the socket is therefore seen
at most WATCH_MOST seconds late; ring replies are seen at once.  Waiting
for room in a full request ring also watches the socket.

Every coroutine here runs to its end without suspending (there is no event
loop underneath), which is what lets slates.sdk.client.Client drive
AsyncClient's coroutines synchronously.  slates.node.ring (and with it the
C extension) and select are imported only by connections that use rings,
and syncfs (ctypes) only by calls that write a mount back.
"""

from __future__ import annotations

import _socket  # socket's C half: socket.py's enums cost a command ~3 ms at start-up
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from slates.errors import SlatesError
from slates.sdk.session import (
    FDS_SPACE,
    ConnectionLost,
    Outgoing,
    Reconnect,
    ShardSession,
    control_message,
    control_result,
    received_fds,
)
from slates.wire import FrameReader, frame

if TYPE_CHECKING:
    import select

__all__ = ["BYE_SECONDS", "BlockingShardConnection", "BlockingTransport"]

BYE_SECONDS = 5.0
"""How long closing waits for a shard's answer to goodbye."""
WATCH_FIRST = 0.001
WATCH_MOST = 0.02
RING_FULL_WAIT = 0.0005
ALONG_MOST = 16 << 10
"""The largest first request that rides in the hello's send: the shard reads a hello's
stream with a 64 KiB frame limit (slates.node.shard.MAX_HELLO), which a frame behind
the hello must fit too; a larger one waits for the hello's answer."""
_RECV = 1 << 16


class BlockingShardConnection:
    """One client's connection to one shard, on blocking sockets (see the module docstring)."""

    def __init__(self, path: str, session: ShardSession) -> None:
        self.path = path
        self.session = session
        self.sock: _socket.socket | None = None
        self.pair: Any = None  # a slates.node.ring.RingPair once connected with rings
        self.reader = FrameReader()
        self.lock = threading.Lock()

    def _connect(self, first: bytes) -> bool:
        """Connect and say hello.  Without rings a request `first` of at most ALONG_MOST
        bytes rides in the hello's send (the shard reads it after the hello, from the same
        stream), saving a round trip; True then, and its reply is the next frame."""
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        along = not self.session.rings and len(first) <= ALONG_MOST
        try:
            sock.connect(self.path)
            sock.sendall(self.session.hello() + frame(first) if along else self.session.hello())
            self.reader = FrameReader()
            fds: list[int] = []
            while (answer := self.reader.next_frame()) is None:
                data, ancillary, _flags, _addr = sock.recvmsg(_RECV, FDS_SPACE)
                fds.extend(received_fds(ancillary))
                if not data:
                    raise ConnectionLost()
                self.reader.feed(data)
            ring_fds = self.session.accept_hello(answer, fds)
            if ring_fds is not None:
                from slates.node.ring import RingPair

                self.pair = RingPair.attach(ring_fds)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        return along

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _sent_along(self) -> bytes:
        """The reply to the request that rode in the hello's send."""
        if self.sock is None:
            raise ConnectionLost()
        return self._read_frame(self.sock)

    def _read_frame(self, sock: _socket.socket) -> bytes:
        while (payload := self.reader.next_frame()) is None:
            data = sock.recv(_RECV)
            if not data:
                raise ConnectionLost()
            self.reader.feed(data)
        return payload

    def _socket_frame(self, sock: _socket.socket, watch: select.poll) -> bytes | None:
        """A frame that came on the socket meanwhile (None if none yet), without blocking."""
        while watch.poll(0):
            data = sock.recv(_RECV)
            if not data:
                raise ConnectionLost()
            self.reader.feed(data)
            if (payload := self.reader.next_frame()) is not None:
                return payload
        return self.reader.next_frame()

    def _exchange(self, message: bytes, deadline: float | None = None) -> bytes:
        """Send `message` and wait for its reply; TimeoutError past `deadline` (monotonic)."""
        sock = self.sock
        if sock is None:
            raise ConnectionLost()
        if self.pair is None:
            if deadline is not None:
                sock.settimeout(max(0.0, deadline - time.monotonic()))
            sock.sendall(frame(message))
            return self._read_frame(sock)
        import select  # here: only ring connections watch their socket

        pair = self.pair
        watch = select.poll()
        watch.register(sock, select.POLLIN)
        if len(message) > pair.requests.max_message:
            sock.sendall(frame(message))  # too large for the ring: a socket frame
        else:
            while not pair.requests.push(message):
                if (early := self._socket_frame(sock, watch)) is not None:
                    return early
                _check(deadline)
                time.sleep(RING_FULL_WAIT)  # bounded ring: the shard drains it
        step = WATCH_FIRST
        while True:
            received: bytes | None = pair.replies.receive_blocking(step)
            if received is not None:
                return received
            if (large := self._socket_frame(sock, watch)) is not None:
                return large
            _check(deadline)
            step = min(step * 2, WATCH_MOST)

    def request(self, op: str, args: dict[str, Any]) -> Any:
        with self.lock:
            outgoing = self.session.start(op, args)
            return self.session.finish(outgoing, self._deliver(outgoing))

    def _deliver(self, outgoing: Outgoing) -> bytes:
        """Send `outgoing` and await its reply, reconnecting and resending it unchanged
        within Reconnect's bound (under the caller's hold of `lock`)."""
        reconnect = Reconnect(time.monotonic(), self.path)
        while True:
            try:
                if self.sock is None and self._connect(outgoing.message):
                    return self._sent_along()
                return self._exchange(outgoing.message)
            except (OSError, ConnectionLost):
                self.close()
                time.sleep(reconnect.after_failure(time.monotonic()))
            except BaseException:
                self.close()  # a half-done exchange must not meet the next request
                raise

    def send_early(self, outgoing: Outgoing) -> bool:
        """Send `outgoing` without awaiting its reply (under the caller's hold of
        `lock`), connecting first if need be (it rides in the hello's send when small):
        True once sent on a socket connection, its reply then the next frame to come.
        False when not sent: a ring connection, or the send failed (the connection is
        closed then); `reply` sends it in the ordinary way."""
        if self.session.rings:
            return False
        try:
            if self.sock is None and self._connect(outgoing.message):
                return True
            if self.sock is None:
                raise ConnectionLost()
            self.sock.settimeout(None)
            self.sock.sendall(frame(outgoing.message))
            return True
        except (OSError, ConnectionLost):
            self.close()
            return False
        except BaseException:
            self.close()
            raise

    def reply(self, outgoing: Outgoing, sent: bool) -> bytes:
        """The reply to `outgoing`, which `send_early` sent (`sent`) or did not: then,
        or if the connection breaks meanwhile, it is sent (again, unchanged) as any
        request is."""
        if sent and self.sock is not None:
            try:
                return self._read_frame(self.sock)
            except (OSError, ConnectionLost):
                self.close()
            except BaseException:
                self.close()
                raise
        return self._deliver(outgoing)

    def send_bye(self, deadline: float) -> Outgoing | None:
        """Goodbye's first half, under the caller's hold of `lock`.  On a socket
        connection it is sent now and the connection closed, its answer not awaited
        (the shard reads it all the same: see the module docstring), so None; a ring
        connection's goodbye is sent in `finish_bye`.  None too when no connection is
        open (no reconnect: a shard that restarted has forgotten this client already)."""
        if self.sock is None:
            return None
        outgoing = self.session.start("bye", {})
        if self.pair is not None:
            return outgoing
        with contextlib.suppress(OSError):
            self.sock.settimeout(max(0.0, deadline - time.monotonic()))
            self.sock.sendall(frame(outgoing.message))
        self.close()
        return None

    def finish_bye(self, outgoing: Outgoing | None, deadline: float) -> None:
        """Goodbye's second half, on a ring connection: sent, its answer awaited until
        `deadline`; then disconnect."""
        with contextlib.suppress(SlatesError, OSError, ConnectionLost):
            if outgoing is not None and self.sock is not None:
                payload = self._exchange(outgoing.message, deadline)
                self.session.finish(outgoing, payload)
        self.close()


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError()


class BlockingTransport:
    """slates.sdk.transport.Transport on blocking sockets (see the module docstring)."""

    def __init__(self, client_id: str, rings: bool, token: str | None) -> None:
        self.client_id = client_id
        self.rings = rings
        self.token = token
        self.shards: list[BlockingShardConnection] = []

    def open(self, sockets: Sequence[str]) -> None:
        self.shards = [
            BlockingShardConnection(path, ShardSession(self.client_id, self.rings, self.token))
            for path in sockets
        ]

    async def request(self, shard: int, op: str, args: dict[str, Any]) -> Any:
        return self.shards[shard].request(op, args)

    async def request_each(self, shards: Sequence[int], op: str, args: dict[str, Any]) -> list[Any]:
        """The same request to each of `shards`, sent to every socket connection before
        any reply is awaited (one wait for them all, not one per shard); each reply is
        read before any error is raised, so none is left to meet a later request."""
        connections = [self.shards[index] for index in shards]
        with contextlib.ExitStack() as held:
            for connection in connections:
                held.enter_context(connection.lock)
            outgoings = [connection.session.start(op, args) for connection in connections]
            try:
                sent = [c.send_early(o) for c, o in zip(connections, outgoings, strict=True)]
                payloads = [
                    c.reply(o, early)
                    for c, o, early in zip(connections, outgoings, sent, strict=True)
                ]
            except BaseException:
                for connection in connections:  # replies may be on their way: start afresh
                    connection.close()
                raise
            results: list[Any] = []
            refused: SlatesError | None = None
            for connection, outgoing, payload in zip(connections, outgoings, payloads, strict=True):
                try:
                    results.append(connection.session.finish(outgoing, payload))
                except SlatesError as error:
                    refused = refused or error
            if refused is not None:
                raise refused
            return results

    async def control(self, path: str, request: dict[str, Any]) -> Any:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            try:
                sock.connect(path)
            except OSError:
                raise SlatesError(
                    "the anchor does not answer; is `slates anchor` running?", socket=path
                ) from None
            sock.sendall(control_message(request))
            reader = FrameReader()
            while (payload := reader.next_frame()) is None:
                data = sock.recv(_RECV)
                if not data:
                    raise SlatesError("the anchor closed the connection")
                reader.feed(data)
        finally:
            sock.close()
        return control_result(payload)

    async def syncfs(self, directory: str, timeout: float | None) -> None:
        from slates.sdk.transport import syncfs  # here: only unmount and snapshots need it

        if timeout is None:
            syncfs(directory)
            return
        # A worker thread, so a mount that never finishes writing back cannot hold the
        # caller past `timeout`; the thread is abandoned then (it ends with the syncfs).
        failure: list[BaseException] = []

        def run() -> None:
            try:
                syncfs(directory)
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)

        worker = threading.Thread(target=run, name="slates-syncfs", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise TimeoutError()
        if failure:
            raise failure[0]

    async def close(self) -> None:
        """Goodbye to every connected shard, at most BYE_SECONDS in all: each socket
        connection's goodbye is sent (and not awaited) before any ring connection's
        answer is awaited, so closing waits for the slowest shard rather than for each
        in turn."""
        deadline = time.monotonic() + BYE_SECONDS
        with contextlib.ExitStack() as held:
            for shard in self.shards:
                held.enter_context(shard.lock)
            sent = [(shard, shard.send_bye(deadline)) for shard in self.shards]
            for shard, outgoing in sent:
                shard.finish_bye(outgoing, deadline)
