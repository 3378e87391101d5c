"""The SDK's Forwarder follows NotOwner with the same request id, within its budget.

A stand-in fleet link (a trio unix socket speaking the link's framed
msgpack) answers forwards from a script: NotOwner naming another host,
Unavailable, or the shard's reply.  The Forwarder must resend the very
same wire request (seq and ack) to the named host, keep `names` = the
volume's original host, stop after `attempts` sends, and not follow a
NotOwner that names the host it just asked.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from slates.errors import NotOwner, Unavailable
from slates.fleet.link_client import Forwarder
from slates.node.protocol import FrameReader, frame, pack, unpack


def not_owner(host: str) -> dict[str, Any]:
    return {"ok": False, "error": NotOwner("moved", owner_host=host).to_wire()}


async def serve_script(
    path: Path,
    script: list[Any],
    seen: list[dict[str, Any]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen(8)
    task_status.started()  # listening: the client's first connection is accepted
    with listener:
        while script:
            conn, _ = await listener.accept()
            with conn:
                reader = FrameReader(limit=1 << 20)
                while (message := reader.next_frame()) is None:
                    reader.feed(await conn.recv(65536))
                request = unpack(message)
                seen.append(request)
                answer = script.pop(0)
                if answer == "Unavailable":
                    answer = {"ok": False, "error": Unavailable("not now").to_wire()}
                elif answer == "reply":
                    wire = request["request"]
                    reply = pack({"seq": wire["seq"], "ok": True, "result": {"n": len(seen)}})
                    answer = {"ok": True, "result": reply}
                await conn.send(frame(pack(answer)))


async def run(tmp_path: Path, script: list[Any], attempts: int = 4) -> tuple[Any, list[Any]]:
    seen: list[dict[str, Any]] = []
    path = tmp_path / "fleet.sock"
    outcome: Any = None
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_script, path, list(script), seen)
        forwarder = Forwarder("client-1", path, attempts=attempts, timeout=5)
        try:
            outcome = await forwarder.request("h1", 0, "read", {"volume": "vol-0-1"})
        except (NotOwner, Unavailable) as exc:
            outcome = exc
        nursery.cancel_scope.cancel()
    return outcome, seen


async def test_not_owner_is_followed_with_the_same_request(tmp_path: Path) -> None:
    outcome, seen = await run(tmp_path, [not_owner("h2"), "Unavailable", "reply"])
    assert outcome == {"n": 3}
    assert [m["host"] for m in seen] == ["h1", "h2", "h2"]
    assert all(m["names"] == "h1" for m in seen)
    assert len({(m["request"]["seq"], m["request"]["ack"]) for m in seen}) == 1


@pytest.mark.parametrize("attempts", [1, 3])
async def test_the_retry_budget_is_bounded(tmp_path: Path, attempts: int) -> None:
    script: list[Any] = [not_owner(f"h{n + 2}") for n in range(attempts + 2)]
    outcome, seen = await run(tmp_path, script, attempts)
    assert isinstance(outcome, NotOwner)
    assert len(seen) == attempts


async def test_a_not_owner_naming_the_asked_host_is_raised(tmp_path: Path) -> None:
    outcome, seen = await run(tmp_path, [not_owner("h1"), "reply"])
    assert isinstance(outcome, NotOwner) and len(seen) == 1
