"""The client's side of the wire protocol, without I/O: what to send and what a reply means.

Theory of operation: both transports of the SDK (slates.sdk.connection over
trio, slates.sdk.blocking over plain sockets) move bytes; every rule about
those bytes is here, once.

- `ShardSession` is one client's conversation with one shard: the hello it
  opens a connection with, what the hello's answer must hold (a ring pair's
  four descriptors when rings were asked for), and request identity.  A
  request gets the next sequence number once (`start`) and keeps it across
  reconnects, so a resent request is the *same* request and the shard
  answers it from its saved result; `finish` checks that a reply answers
  the request it is paired with and raises the error it carries.  A
  transport holds its connection's lock from `start` to `finish`: one
  request at a time per connection.
- `Reconnect` is the bound on reconnecting: from the first failure of one
  request, attempts back off from RETRY_FIRST to RETRY_MOST seconds, and
  RECONNECT_SECONDS after the request began the call fails with a
  SlatesError naming the socket.  The transport reads its own clock and
  sleeps its own way; the policy takes times in and gives delays out.
- `control_message` and `control_result` are the anchor's control socket
  (mount, unmount): one framed request, one framed reply.

Nothing here opens a socket, reads a clock or sleeps.  Callers: the two
transports only.
"""

from __future__ import annotations

import _socket  # socket's C half: socket.py's enums cost a command ~3 ms at start-up
import os
import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

from slates.errors import SlatesError, VerificationFailed
from slates.wire import check_ok, frame, pack, reply_parts, unpack

__all__ = [
    "FDS_SPACE",
    "RECONNECT_SECONDS",
    "RETRY_FIRST",
    "RETRY_MOST",
    "ConnectionLost",
    "Outgoing",
    "Reconnect",
    "ShardSession",
    "control_message",
    "control_result",
    "received_fds",
]

RECONNECT_SECONDS = 30.0
"""How long one request may keep reconnecting to a shard (a restart takes far less)."""
RETRY_FIRST = 0.01
RETRY_MOST = 0.5
RING_FDS = 4
_FD_SIZE = 4  # a descriptor in SCM_RIGHTS is a C int
FDS_SPACE = _socket.CMSG_SPACE(RING_FDS * _FD_SIZE)
"""Ancillary buffer for a hello answer: room for a ring pair's four descriptors."""


class ConnectionLost(Exception):
    """The peer closed the connection (the shard died or restarts): reconnect and resend."""


class Outgoing(NamedTuple):
    """A request with its identity, ready to send (and to resend, unchanged).

    Immutable like the frozen slotted dataclasses records are elsewhere; a NamedTuple
    because every command builds this class at start-up, and a dataclass costs ~0.7 ms
    to build (its generated methods are compiled then), a NamedTuple ~0.1 ms."""

    seq: int
    message: bytes


def received_fds(ancillary: Iterable[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors passed with a message (SCM_RIGHTS), from recvmsg's ancillary data."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            whole = len(payload) // _FD_SIZE * _FD_SIZE
            fds.extend(
                int.from_bytes(payload[at : at + _FD_SIZE], sys.byteorder, signed=True)
                for at in range(0, whole, _FD_SIZE)
            )
    return fds


class ShardSession:
    """One client's requests to one shard (see the module docstring)."""

    def __init__(self, client_id: str, rings: bool, token: str | None = None) -> None:
        self.client_id = client_id
        self.rings = rings
        self.token = token
        self.next_seq = 1
        self.acked = 0

    def hello(self) -> bytes:
        """The framed hello that opens every connection (the first and each reconnect)."""
        hello: dict[str, object] = {"client": self.client_id, "rings": self.rings}
        if self.token is not None:
            hello["token"] = self.token
        return frame(pack(hello))

    def accept_hello(self, answer: bytes, fds: list[int]) -> list[int] | None:
        """The ring pair's descriptors (None without rings) from the hello's answer.

        A refusal is raised as the error the shard sent; on any failure the
        descriptors received are closed, so nothing leaks.
        """
        try:
            check_ok(unpack(answer))
            if not self.rings:
                if fds:
                    raise VerificationFailed("the shard passed descriptors nobody asked for")
                return None
            if len(fds) != RING_FDS:
                raise VerificationFailed("the shard did not pass a ring pair")
        except SlatesError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def start(self, op: str, args: dict[str, Any]) -> Outgoing:
        """The next request: a new sequence number, and the highest one fully answered."""
        seq = self.next_seq
        self.next_seq += 1
        return Outgoing(seq, pack({"seq": seq, "ack": self.acked, "op": op, "args": args}))

    def finish(self, outgoing: Outgoing, payload: bytes) -> Any:
        """The result of `outgoing` from its reply, or the error the reply carries."""
        seq, result, error = reply_parts(unpack(payload))
        if seq != outgoing.seq:
            raise VerificationFailed("a reply answered another request", expected=outgoing.seq)
        self.acked = outgoing.seq
        if error is not None:
            raise error
        return result


class Reconnect:
    """The bounded reconnect of one request (see the module docstring)."""

    def __init__(self, started: float, socket_path: str) -> None:
        self.deadline = started + RECONNECT_SECONDS
        self.socket_path = socket_path
        self.delay = RETRY_FIRST

    def after_failure(self, now: float) -> float:
        """Seconds to wait before the next attempt; SlatesError once the budget is spent."""
        if now > self.deadline:
            raise SlatesError(
                "the shard did not answer; is `slates anchor` running?", socket=self.socket_path
            )
        delay = self.delay
        self.delay = min(self.delay * 2, RETRY_MOST)
        return delay


def control_message(request: dict[str, Any]) -> bytes:
    """A framed request to the anchor's control socket."""
    return frame(pack(request))


def control_result(payload: bytes) -> Any:
    """The control reply's result, or the error it carries, raised."""
    return check_ok(unpack(payload)).get("result")
