"""Pruning by policy, against a model, and the pattern that found its bug (issue 13).

The soak (bench/soak_bench.py: two agents per green, each cycle a work
volume made on the head, one edit, submit, delete) saw one submit answer
`internal error` (`KeyError: ''` in green_ops._prepare) at the 98th
submission of each green: the other agent's submission had just pruned the
version this work volume was based on.  `Ledger.prunable` pruned
`ledger[1:limit]` with `limit = min(len(ledger) - keep, *bases)`, which is
negative while the green has fewer versions than `keep`, and a negative
slice end counts from the end: with keep=100 and 99 versions every version
but v0 and the head went, live work volumes' bases among them.

Here: the rule itself, as a property against a plain model (nothing below
the last `keep` nor at or after a live work volume's base is pruned, never
v0), and the soak's pattern in an in-process ShardService with the default
keep (100), every submission accepted.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.merge.submission import DEFAULT_KEEP, GreenPolicy
from slates.node.events import GreenMade, VersionMade, WorkMade
from slates.node.ledger import WORK_INO_SHIFT, Ledger
from slates.node.protocol import Request
from slates.node.service import ShardService
from tests.jobs_inline import finish

GREEN = "vol-0-1"


def _ledger(versions: int, keep: int, bases: list[int]) -> Ledger:
    """A green with `versions` versions and one live work volume per base."""
    ledger = Ledger()
    ledger.apply(GreenMade(GREEN, "snap-0-1", None, GreenPolicy(keep=keep)))
    for number in range(1, versions):
        ledger.apply(VersionMade(GREEN, f"snap-0-{number + 1}", number - 1, "", (), ()))
    for serial, base in enumerate(bases, start=1):
        start = serial << WORK_INO_SHIFT
        limit = (serial + 1) << WORK_INO_SHIFT
        ledger.apply(WorkMade(f"vol-0-{100 + serial}", GREEN, base, start, limit))
    return ledger


@settings(max_examples=300, deadline=None)
@given(
    keep=st.integers(1, 12),
    versions=st.integers(1, 30),
    data=st.data(),
)
def test_pruning_keeps_the_last_keep_versions_and_every_live_base(
    keep: int, versions: int, data: st.DataObject
) -> None:
    bases = data.draw(st.lists(st.integers(0, versions - 1), max_size=3), label="bases")
    pruned = _ledger(versions, keep, bases).prunable(GREEN, set())
    # The model: versions 1 .. limit-1, where limit is the first version to keep.
    limit = min([versions - keep, *bases])
    assert pruned == list(range(1, limit)), (versions, keep, bases, pruned)
    assert not set(pruned) & set(bases)
    assert all(number < versions - keep for number in pruned)


class _Shard:
    """One in-process ShardService, requests numbered as a client numbers them."""

    def __init__(self) -> None:
        self.service = ShardService(0, Host(), LiveDirectory)
        self.seq = 0
        self.now = 1_000_000_000

    def raw(self, op: str, **args: Any) -> dict[str, Any]:
        self.seq += 1
        self.now += 1_000
        request = Request(self.seq, self.seq - 1, op, args)
        reply, _events = finish(self.service, *self.service.handle("soak", request, self.now))
        return reply

    def call(self, op: str, **args: Any) -> Any:
        reply = self.raw(op, **args)
        assert reply["ok"], f"{op} {args!r}: {reply['error']!r}"
        return reply["result"]


def test_two_agents_on_one_green_submit_past_keep_versions_as_the_soak_does() -> None:
    shard = _Shard()
    green = str(shard.call("green.create", name="green")["id"])
    setup = str(shard.call("work.create", green=green, name="setup")["id"])
    shard.call("write", volume=setup, path="/unit.c", data=b"int unit;\n")
    assert shard.call("submit", volume=setup)["made_version"]
    shard.call("volume.delete", volume=setup)
    # Two agents, always one work volume each; they take turns submitting, so the
    # one that waits is based on the head before the other's submission.
    works = [str(shard.call("work.create", green=green, name=f"a{n}-0")["id"]) for n in (0, 1)]
    for turn in range(DEFAULT_KEEP + 20):
        agent = turn % 2
        work = works[agent]
        shard.call("write", volume=work, path=f"/agent{agent}-{turn}.c", data=b"x\n")
        reply = shard.raw("submit", volume=work)
        versions = len(shard.service.ledger.greens[green])
        assert reply["ok"], f"submission {turn} at {versions} versions: {reply['error']!r}"
        shard.call("volume.delete", volume=work)
        works[agent] = str(shard.call("work.create", green=green, name=f"a{agent}-{turn}")["id"])
    ledger = shard.service.ledger.greens[green]
    kept = [v.number for v in ledger if v.snapshot_id]
    assert kept[0] == 0 and kept[1:] == list(range(len(ledger) - DEFAULT_KEEP, len(ledger)))
