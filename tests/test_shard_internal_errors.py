"""A shard's internal error leaves its traceback in the shard's log (what the soak needed).

The service answers an exception that is no SlatesError as VerificationFailed
"internal error" with the exception's type and text as `reason`; the driver
(slates.node.shard's LoggedService) also writes the traceback to stderr,
which the anchor's log collects.  Driven in-process: a Shard over fresh
memfd segments, a fault injected into the service's op dispatch, then the
same shard serving the next request as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from slates.node.protocol import Hello, pack, unpack
from slates.node.shard import Shard

MiB = 1 << 20


@pytest.fixture
def shard() -> Iterator[Shard]:
    fds = []
    for name, size in (("journal", 8 * MiB), ("checkpoint", 16 * MiB), ("arena", 8 * MiB)):
        fd = os.memfd_create(f"test-soak-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds.append(fd)
    try:
        made = Shard(0, fds[0], fds[1], fds[2], 64 * MiB)
        made.recover()
        yield made
    finally:
        for fd in fds:
            os.close(fd)


def _ask(shard: Shard, seq: int, op: str, **args: Any) -> dict[str, Any]:
    request = pack({"seq": seq, "ack": 0, "op": op, "args": args})
    packed = shard.handle(Hello("test", False), request)
    assert isinstance(packed, bytes)
    reply: dict[str, Any] = unpack(packed)
    return reply


def test_an_internal_error_is_answered_with_its_reason_and_logged_with_its_traceback(
    shard: Shard, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatch = shard.service._run

    def broken(op: str, args: dict[str, Any], now: int) -> Any:
        if op == "volume.create":
            raise KeyError("a missing key")  # a bug: no SlatesError
        return dispatch(op, args, now)

    monkeypatch.setattr(shard.service, "_run", broken)
    reply = _ask(shard, 1, "volume.create", name="one")
    assert reply["ok"] is False
    assert reply["error"]["code"] == "VerificationFailed"
    assert reply["error"]["message"] == "internal error"
    reason = "KeyError: 'a missing key'"
    assert reply["error"]["details"] == {"op": "volume.create", "reason": reason}
    log = capsys.readouterr().err
    assert "internal error in volume.create (client test, seq 1)" in log
    assert "Traceback (most recent call last):" in log
    assert "in broken" in log and "KeyError: 'a missing key'" in log

    # The shard goes on: the next request is served as before, and logs nothing.
    monkeypatch.setattr(shard.service, "_run", dispatch)
    again = _ask(shard, 2, "volume.create", name="two")
    assert again["ok"] is True, again
    assert "internal error" not in capsys.readouterr().err


def test_a_slates_error_is_an_answer_not_a_log_entry(
    shard: Shard, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = _ask(shard, 1, "volume.delete", volume="vol-0-404")
    assert reply["ok"] is False and reply["error"]["code"] == "NotFound"
    assert "internal error" not in capsys.readouterr().err
