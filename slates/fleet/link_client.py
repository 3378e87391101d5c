"""Clients of the fleet link's local socket, RUNTIME/fleet.sock (slates.fleet.link).

Theory of operation.  `call_link` (blocking, for the CLI) and `acall_link`
(trio, for the SDK) send one framed msgpack request and return the
result of its `{"ok": ..., "result"|"error"}` answer, raising the error it
carries; both bound the whole exchange by `timeout` (Unavailable past it)
and refuse an answer frame over MAX_ANSWER.

`Forwarder` is what an SDK client uses to reach a shard on another host:
one `ShardSession` (slates.sdk.session, rings off) per (host, shard), so a
request gets its sequence number once and keeps it on every resend.  A
resend happens when the link does not answer or answers Unavailable (a
peer unreachable for now), and when a host answers NotOwner naming the
committed owner in its details (`owner_host`): the same request then goes
to that host.  Every send names the host whose ids the request carries
(`names`: the volume's original owner), so the new owner's link can
translate them to its adopted copy (slates.fleet.link).  Both are bounded
(`attempts` sends in all, pauses growing to MAX_RESEND_PAUSE), and past
them the last error is raised.  Nothing else is retried.

Only operator clients should forward (slates.fleet.link_forward: an agent's
principal does not travel between hosts yet).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Final

import trio

from slates.errors import CapacityExhausted, InvalidArgument, NotOwner, SlatesError, Unavailable
from slates.node.protocol import FrameReader, check_ok, frame, pack, unpack
from slates.sdk.session import ShardSession

__all__ = ["Forwarder", "MAX_ANSWER", "acall_link", "call_link", "link_socket"]

MAX_ANSWER: Final = 18 << 20  # a forwarded reply is at most 17 MiB (slates.fleet.link)
RECEIVE_BYTES: Final = 1 << 16
SOCKET_NAME: Final = "fleet.sock"
RESEND_PAUSE: Final = 0.1
MAX_RESEND_PAUSE: Final = 1.0


def link_socket(runtime_dir: str | Path) -> Path:
    return Path(runtime_dir) / SOCKET_NAME


def _result(payload: bytes) -> Any:
    return check_ok(unpack(payload)).get("result")


def call_link(path: str | Path, message: dict[str, Any], *, timeout: float = 60.0) -> Any:
    """One request on the link's socket, blocking (module doc)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise Unavailable(
                "the fleet link does not answer; does the anchor run with --fleet?",
                socket=str(path),
                error=str(exc),
            ) from None
        try:
            sock.sendall(frame(pack(message)))
            reader = FrameReader(limit=MAX_ANSWER)
            while (payload := reader.next_frame()) is None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(RECEIVE_BYTES)
                if not data:
                    raise Unavailable("the fleet link closed the connection", socket=str(path))
                reader.feed(data)
        except TimeoutError:
            raise Unavailable("the fleet link did not answer in time", timeout=timeout) from None
    return _result(payload)


async def acall_link(path: str | Path, message: dict[str, Any], *, timeout: float = 60.0) -> Any:
    """One request on the link's socket, from trio (module doc)."""
    try:
        with trio.fail_after(timeout):
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with sock:
                try:
                    await sock.connect(str(path))
                except OSError as exc:
                    raise Unavailable(
                        "the fleet link does not answer; does the anchor run with --fleet?",
                        socket=str(path),
                        error=str(exc),
                    ) from None
                view = memoryview(frame(pack(message)))
                while view:
                    view = view[await sock.send(view) :]
                reader = FrameReader(limit=MAX_ANSWER)
                while (payload := reader.next_frame()) is None:
                    data = await sock.recv(RECEIVE_BYTES)
                    if not data:
                        raise Unavailable("the fleet link closed the connection", socket=str(path))
                    reader.feed(data)
    except trio.TooSlowError:
        raise Unavailable("the fleet link did not answer in time", timeout=timeout) from None
    return _result(payload)


class Forwarder:
    """Requests to shards of other hosts through the local link (module doc)."""

    def __init__(
        self,
        client_id: str,
        socket_path: str | Path,
        *,
        attempts: int = 8,
        timeout: float = 60.0,
        max_sessions: int = 1024,
        blocking: bool = False,
    ) -> None:
        if attempts < 1 or timeout <= 0 or max_sessions < 1:
            raise InvalidArgument("a forwarder makes at least one attempt, within a time")
        self.client_id = client_id
        self.socket_path = Path(socket_path)
        self.attempts = attempts
        self.timeout = timeout
        self.max_sessions = max_sessions
        self.blocking = blocking  # the blocking Client's: its coroutines never suspend
        self._sessions: dict[tuple[str, int], ShardSession] = {}
        self._locks: dict[tuple[str, int], trio.Lock] = {}

    def _session(self, key: tuple[str, int]) -> tuple[ShardSession, trio.Lock]:
        session = self._sessions.get(key)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise CapacityExhausted("forwarding to too many shards", limit=self.max_sessions)
            session = self._sessions[key] = ShardSession(self.client_id, rings=False)
            self._locks[key] = trio.Lock()
        return session, self._locks[key]

    async def request(self, host: str, shard: int, op: str, args: dict[str, Any]) -> Any:
        """Run `op` on `host`'s shard `shard`: its result, or the error it raised."""
        session, lock = self._session((host, shard))
        if self.blocking:  # one thread, one request at a time: no lock to wait on
            return await self._request(session, host, shard, op, args)
        async with lock:
            return await self._request(session, host, shard, op, args)

    async def _request(
        self, session: ShardSession, host: str, shard: int, op: str, args: dict[str, Any]
    ) -> Any:
        outgoing = session.start(op, args)
        wire = unpack(outgoing.message)
        target = host
        last: SlatesError | None = None
        for attempt in range(self.attempts):
            if attempt:
                pause = min(RESEND_PAUSE * attempt, MAX_RESEND_PAUSE)
                if self.blocking:
                    time.sleep(pause)
                else:
                    await trio.sleep(pause)
            message = {
                "op": "forward",
                "host": target,
                "shard": shard,
                "client": self.client_id,
                "request": wire,
                "names": host,  # the ids in the request are `host`'s, wherever it goes
            }
            try:
                if self.blocking:
                    reply = call_link(self.socket_path, message, timeout=self.timeout)
                else:
                    reply = await acall_link(self.socket_path, message, timeout=self.timeout)
                if not isinstance(reply, bytes):
                    raise SlatesError("the fleet link answered a forward without reply bytes")
                return session.finish(outgoing, reply)
            except Unavailable as exc:
                last = exc
                continue
            except NotOwner as exc:
                owner = exc.details.get("owner_host")
                if not isinstance(owner, str) or owner == target:
                    raise
                target, last = owner, exc
        raise last or Unavailable("no attempt was made", attempts=self.attempts)
