"""ShardState's collection hook (`kept_chunks`) and one collection per replay.

A chunk no extent names is freed by a collection unless the hook keeps it;
the shard replays its whole journal as one stream, so however many frames
left garbage, the replay collects once, after the last.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.node.events import Event
from slates.node.service import ShardService
from slates.node.shard import Shard, unpack_events
from slates.node.state import GARBAGE_BATCH_BYTES, ShardState
from tests.test_shard_recovery import Segments, call


class Keeping(ShardState):
    def __init__(self, keep: set[bytes]) -> None:
        super().__init__(0, Host(), LiveDirectory)
        self.keep = keep
        self.asked = 0

    def kept_chunks(self) -> Iterable[bytes]:
        self.asked += 1
        return iter(self.keep)  # any iterable, read once


def test_a_collection_keeps_what_the_hook_names_and_frees_the_rest() -> None:
    state = Keeping(set())
    kept, _ = state.host.put_chunk(b"kept by the hook")
    loose, _ = state.host.put_chunk(b"named by nothing")
    state.keep.add(kept)
    state.garbage_bytes = GARBAGE_BATCH_BYTES
    state.collect_garbage()
    assert state.asked == 1
    assert state.host.has_chunk(kept) and not state.host.has_chunk(loose)
    state.collect_garbage(force=True)  # nothing retired since: no walk, no question
    assert state.asked == 1


def test_the_base_state_keeps_nothing_extra() -> None:
    state = ShardState(0, Host(), LiveDirectory)
    assert list(state.kept_chunks()) == []
    loose, _ = state.host.put_chunk(b"named by nothing")
    state.garbage_bytes = 1
    state.collect_garbage(force=True)
    assert not state.host.has_chunk(loose)


def test_the_service_hook_keeps_no_remote_piece_without_remote_bases() -> None:
    service = ShardService(0, Host(), LiveDirectory)
    assert set(service.kept_chunks()) == set()


def test_recovery_collects_once_after_the_whole_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    segments = Segments()
    try:
        shard = segments.shard()
        shard.recover()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        files: dict[str, bytes] = {}
        seq = 1
        for index in range(3):  # each deletion, its own frame, leaves garbage behind
            seq += 1
            files[f"/f{index}"] = os.urandom(5000)
            call(shard, seq, "write", volume=vid, path=f"/f{index}", data=files[f"/f{index}"])
            seq += 1
            snapshot = call(shard, seq, "snapshot", volume=vid)["id"]
            seq += 1
            call(shard, seq, "snapshot.delete", snapshot=snapshot)

        collections: list[int] = []
        collect = ShardService.collect_garbage

        def counted(self: ShardService, *, force: bool = False) -> Any:
            if self.garbage_bytes and (force or self.garbage_bytes >= GARBAGE_BATCH_BYTES):
                collections.append(self.garbage_bytes)
            return collect(self, force=force)

        monkeypatch.setattr(ShardService, "collect_garbage", counted)
        restarted = segments.shard()
        assert restarted.recover() == len(_journal_events(restarted))
        assert len(collections) == 1, collections
        assert collections[0] >= 3 * GARBAGE_BATCH_BYTES  # all three deletions', at once
        assert restarted.service.garbage_bytes == 0
        for path, data in files.items():
            seq += 1
            assert call(restarted, seq, "read", "reader", volume=vid, path=path) == data
    finally:
        for fd in segments.fds:
            os.close(fd)


def _journal_events(shard: Shard) -> list[Event]:
    return [event for payload in shard.journal.entries() for event in unpack_events(payload)]
