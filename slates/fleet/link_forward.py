"""The fleet link's forwarding: requests from this host to a peer's shard, and back.

Theory of operation.  Two halves, both driven from trio by slates.fleet.link:

- `PeerPool` (origin side) keeps at most one QUIC connection per peer host
  (slates.fleet.quic.connect, expecting that host id, at the address its
  etcd HostRecord names), at most `max_peers` of them.  Each connection
  lives in a task of the link's nursery that holds `connect()` open until
  the connection fails or is dropped.  `request` sends one forward and
  returns the reply bytes; when the connection fails or the peer does not
  answer in time (Unavailable, or the transport's plain SlatesError) it
  drops the connection, re-reads the host's record and resends the *same*
  bytes, at most `attempts` times and all of them within the call's
  `timeout`: the request keeps its (client, seq), so
  the remote shard answers a retry from its saved reply and nothing runs
  twice.  Other errors (the peer's handler refused, AccessDenied,
  VerificationFailed, our own oversize request) are raised as they are.
- `ShardLines` (serving side) runs a forwarded request against this host's
  own shard as a client, in the raw wire protocol the mount bridge's
  `hello` speaks, without rings: a hello naming the client, then one
  framed request and one framed reply at a time.  It keeps one line (unix
  socket) per (origin host, client, shard), at most `max_lines`; past that
  the least recently used idle line is closed (its saved replies stay in
  the shard, keyed by the client id, so a later retry still finds them)
  and with every line busy the request gets CapacityExhausted.  A line
  whose shard hangs up (a shard restart) reconnects with the same client
  id and resends, bounded by `attempts` and the request's deadline; a line
  interrupted mid-request is closed, never reused with a reply in flight.

Only the operator's requests are forwarded (this session): the link
connects to its shards as the anchor's own user, without a token, so a
forwarded request runs with the operator's rights on the serving host.  An
agent's principal does not yet travel between hosts; the SDK forwards only
operator clients.

Callers: slates.fleet.link.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from slates.errors import (
    CapacityExhausted,
    NotFound,
    SlatesError,
    Unavailable,
)
from slates.fleet.link_rules import RemoteForward, forwarded_client_id
from slates.fleet.pki import HostCredentials
from slates.fleet.quic import Peer, TransportLimits, connect
from slates.node.protocol import FrameReader, check_ok, frame, pack, unpack
from slates.node.runtime import Runtime

__all__ = ["PeerPool", "ShardLines"]

RECEIVE_BYTES: Final = 1 << 16
RETRY_PAUSE: Final = 0.05


def _retryable(error: SlatesError) -> bool:
    """A lost connection or a silent peer: resending the same request is safe."""
    return isinstance(error, Unavailable) or type(error) is SlatesError


# -- origin side -------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _PeerSlot:
    host: str
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    closed: trio.Event = dataclasses.field(default_factory=trio.Event)
    peer: Peer | None = None
    error: SlatesError | None = None


Resolver = Callable[[str], Awaitable[tuple[str, int]]]


class PeerPool:
    """QUIC connections to peer hosts (module doc)."""

    def __init__(
        self,
        creds: HostCredentials,
        resolve: Resolver,
        nursery: trio.Nursery,
        *,
        limits: TransportLimits | None = None,
        max_peers: int = 64,
        attempts: int = 3,
    ) -> None:
        self._creds = creds
        self._resolve = resolve
        self._nursery = nursery
        self._limits = limits or TransportLimits()
        self._max_peers = max_peers
        self._attempts = attempts
        self._slots: dict[str, _PeerSlot] = {}
        self.reconnects = 0

    @property
    def connected(self) -> list[str]:
        return sorted(h for h, s in self._slots.items() if s.peer is not None)

    async def _hold(self, slot: _PeerSlot) -> None:
        try:
            address = await self._resolve(slot.host)
            async with connect(address, slot.host, self._creds, limits=self._limits) as peer:
                slot.peer = peer
                slot.ready.set()
                await slot.closed.wait()
        except SlatesError as exc:
            slot.error = exc
        except OSError as exc:
            slot.error = Unavailable("cannot reach the peer", host=slot.host, error=str(exc))
        finally:
            slot.peer = None
            slot.ready.set()
            if self._slots.get(slot.host) is slot:
                del self._slots[slot.host]

    async def _peer(self, host: str) -> Peer:
        slot = self._slots.get(host)
        if slot is None:
            if len(self._slots) >= self._max_peers:
                raise CapacityExhausted(
                    "connected to as many peers as allowed", limit=self._max_peers
                )
            # The slot first, so concurrent callers share one resolution and one connection.
            slot = self._slots[host] = _PeerSlot(host)
            self._nursery.start_soon(self._hold, slot)
        await slot.ready.wait()
        if slot.peer is None:
            raise slot.error or Unavailable("the connection to the peer ended", host=host)
        return slot.peer

    def drop(self, host: str) -> None:
        slot = self._slots.pop(host, None)
        if slot is not None:
            slot.closed.set()

    async def request(self, host: str, payload: bytes, *, timeout: float) -> bytes:
        """Send `payload` to `host`'s link; retries a lost connection (module doc).

        `timeout` bounds the whole call, every attempt together."""
        deadline = trio.current_time() + timeout
        last: SlatesError | None = None
        for attempt in range(self._attempts):
            if attempt:
                self.reconnects += 1
                await trio.sleep(RETRY_PAUSE * attempt)
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            try:
                with trio.fail_after(remaining):
                    peer = await self._peer(host)
                return await peer.request(payload, timeout=deadline - trio.current_time())
            except trio.TooSlowError:
                self.drop(host)
                last = Unavailable("the peer did not answer in time", host=host)
            except SlatesError as exc:
                if not _retryable(exc):
                    raise
                self.drop(host)
                last = exc
        raise Unavailable(
            "the peer host did not answer",
            host=host,
            attempts=self._attempts,
            timeout=timeout,
            last_error=None if last is None else last.message,
        )

    def close(self) -> None:
        for host in list(self._slots):
            self.drop(host)


# -- serving side ------------------------------------------------------------------------------


class _ConnectionLost(Exception):
    """The shard hung up (it died or restarts): reconnect and resend."""


class _Line:
    """One client's connection to one local shard."""

    def __init__(self, shard: int, client_id: str) -> None:
        self.shard = shard
        self.client_id = client_id
        self.sock: trio.socket.SocketType | None = None
        self.reader = FrameReader()
        self.lock = trio.Lock()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def _receive_frame(self) -> bytes:
        if self.sock is None:
            raise _ConnectionLost()
        while (message := self.reader.next_frame()) is None:
            data = await self.sock.recv(RECEIVE_BYTES)
            if not data:
                raise _ConnectionLost()
            self.reader.feed(data)
        return message

    async def _send(self, data: bytes) -> None:
        if self.sock is None:
            raise _ConnectionLost()
        view = memoryview(data)
        while view:
            sent = await self.sock.send(view)
            view = view[sent:]

    async def connect(self, path: str) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.connect(path)
            self.sock = sock
            self.reader = FrameReader()
            await self._send(frame(pack({"client": self.client_id, "rings": False})))
            check_ok(unpack(await self._receive_frame()))
        except BaseException:
            sock.close()
            self.sock = None
            raise

    async def exchange(self, path: Callable[[], str], message: bytes, attempts: int) -> bytes:
        for attempt in range(attempts):
            if attempt:
                await trio.sleep(RETRY_PAUSE * attempt)
            try:
                if self.sock is None:
                    await self.connect(path())
                await self._send(frame(message))
                return await self._receive_frame()
            except (OSError, _ConnectionLost, trio.BrokenResourceError):
                self.close()
        raise Unavailable("the shard did not answer", shard=self.shard, attempts=attempts)


class ShardLines:
    """Forwarded requests run against this host's shards (module doc)."""

    def __init__(self, runtime: Runtime, *, max_lines: int = 256, attempts: int = 20) -> None:
        self._runtime = runtime
        self._max_lines = max_lines
        self._attempts = attempts
        self._lines: collections.OrderedDict[tuple[str, str, int], _Line] = (
            collections.OrderedDict()
        )

    @property
    def open_lines(self) -> int:
        return len(self._lines)

    def _socket_path(self, shard: int) -> str:
        state = self._runtime.read_state()
        for info in state.shards:
            if info.index == shard:
                if info.state != "serving":
                    raise Unavailable("the shard is down", shard=shard, state=info.state)
                return info.socket
        raise NotFound("this host has no such shard", shard=shard, shards=len(state.shards))

    def _line(self, key: tuple[str, str, int]) -> _Line:
        line = self._lines.get(key)
        if line is not None:
            self._lines.move_to_end(key)
            return line
        if len(self._lines) >= self._max_lines:
            idle = next((k for k, v in self._lines.items() if not v.lock.locked()), None)
            if idle is None:
                raise CapacityExhausted("every forwarding line is busy", limit=self._max_lines)
            self._lines.pop(idle).close()
        line = self._lines[key] = _Line(key[2], forwarded_client_id(key[0], key[1]))
        return line

    async def run(self, forward: RemoteForward, *, timeout: float) -> bytes:
        """The shard's reply bytes to `forward.request`, run as the forwarded client."""
        self._socket_path(forward.shard)  # an unknown or failed shard is refused up front
        line = self._line((forward.origin, forward.client, forward.shard))
        message = pack(forward.request)
        async with line.lock:
            try:
                with trio.fail_after(timeout):
                    return await line.exchange(
                        lambda: self._socket_path(forward.shard), message, self._attempts
                    )
            except trio.TooSlowError:
                line.close()  # a reply may still be on its way: never reuse this socket
                raise Unavailable(
                    "the shard did not answer in time", shard=forward.shard, timeout=timeout
                ) from None
            except BaseException:
                line.close()
                raise

    def close(self) -> None:
        for line in self._lines.values():
            line.close()
        self._lines.clear()
