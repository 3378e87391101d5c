"""The deterministic simulator: thousands of seeded schedules, exact replay, teeth.

`test_seeded_schedules` is the CI run (2,000 schedules of 3-5 hosts under
the default fault mix; any failure names its seed, which replays with
`python -m slates.fleet.sim --seed S`).  The mutation tests break one
rule of the protocol at a time and require the simulator to notice within
a few hundred schedules, so the invariants cannot silently stop checking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from slates.fleet import holder, ledger, messages, node, owner, recovery, results, sim
from slates.fleet.config import HolderSet
from slates.fleet.world import DEFAULT_MIX, NO_FAULTS
from slates.merge.ranges import Replace, apply

CI_SCHEDULES = 2000


def test_seeded_schedules() -> None:
    summary = sim.run_many(range(CI_SCHEDULES), DEFAULT_MIX, stop_on_failure=False)
    print(sim.report(summary, DEFAULT_MIX, 0.0))
    assert summary.failures == [], summary.failures[:3]
    assert summary.schedules == CI_SCHEDULES
    total = summary.total
    # The faults really happened and the protocol still made progress through them.
    assert total.ram_losses and total.partitions and total.clock_jumps and total.rots
    assert total.failovers and total.transfers and total.joints and total.false_suspicions
    assert total.acked > CI_SCHEDULES and total.reads_ok and total.corrupted


def test_a_replay_of_one_seed_is_exact() -> None:
    for seed in (5, 77, 1234):
        assert sim.run(seed) == sim.run(seed)


def test_messages_survive_their_wire_form_in_the_simulator() -> None:
    for seed in range(40):
        assert sim.run(seed, wire=True) == sim.run(seed)


def test_cli_replays_a_seed_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "schedules: 1" in out and "failures: 0" in out and "round trips" in out


def test_fault_free_commits_take_two_or_three_round_trips() -> None:
    """Place, Fetch and Propose each cost a round trip; a holder that already has
    the chunks skips the fetch."""
    latencies: set[float] = set()
    for seed in range(30):
        latencies |= {round(x / NO_FAULTS.mean_rtt, 6) for x in sim.run(seed, NO_FAULTS).latencies}
    assert latencies <= {2.0, 3.0} and 3.0 in latencies


Patch = pytest.MonkeyPatch


def _break_quorum(mp: Patch) -> None:
    mp.setattr(HolderSet, "quorum", lambda self, acks: len(self.peers & set(acks)) >= self.f)


def _break_fencing(mp: Patch) -> None:
    mp.setattr(holder.Holder, "_authority", lambda self, message: "")


def _adopt_the_first_promise(mp: Patch) -> None:
    adopt = recovery.adopt
    mp.setattr(recovery, "adopt", lambda promises: adopt(list(promises)[:1]))


def _forget_boot_ids(mp: Patch) -> None:
    receive = node.Node.receive

    def by_host(self: node.Node, message: messages.Message, now: float) -> list[messages.Outgoing]:
        machine = self.owners.get(message.green)
        config = machine.config if machine is not None else None
        if config is not None and isinstance(message, (messages.Accepted, messages.Promise)):
            for member in config.members():
                if member.host == message.sender.host:
                    message = dataclasses.replace(message, sender=member)
        return receive(self, message, now)

    mp.setattr(node.Node, "receive", by_host)


def _serve_without_verifying(mp: Patch) -> None:
    def unverified(base: bytes, value: ledger.Value, chunks: ledger.ChunkStore) -> bytes:
        edits = [Replace(e.start, e.end, chunks.raw()[e.chunk]) for e in value.edits]
        return apply(base, edits)

    mp.setattr(holder, "recompute", unverified)


def _forget_saved_results(mp: Patch) -> None:
    mp.setattr(results.Results, "lookup", lambda self, request: None)


def _report_unknown_lag_as_zero(mp: Patch) -> None:
    mp.setattr(
        owner.Owner,
        "mirror_lag",
        lambda self: 0 if self.config is not None and self.config.mirror is not None else None,
    )


def _claim_host_scope_at_commit(mp: Patch) -> None:
    scopes = owner.Owner.scopes

    def claimed(self: owner.Owner, version: int) -> tuple[str, ...]:
        reached = scopes(self, version)
        if "restart" in reached and "host" not in reached:
            return (reached[0], "host", *reached[1:])
        return reached

    mp.setattr(owner.Owner, "scopes", claimed)


def _retire_without_catch_up(mp: Patch) -> None:
    def ready(self: owner.Owner) -> list[messages.Outgoing]:
        if self.config is None or not self.config.joint or self.state != owner.State.SERVING:
            return []
        joint_ready = messages.JointReady(self.me, self.green, self.config.revision)
        return [messages.Outgoing("council", joint_ready)]

    mp.setattr(owner.Owner, "_joint_ready", ready)


def _skip_reaccepting(mp: Patch) -> None:
    finish = owner.Owner._gather_or_finish

    def skipped(self: owner.Owner, now: float) -> list[messages.Outgoing]:
        out = finish(self, now)
        if self.state == owner.State.SERVING:
            self._fixed.clear()
        return out

    mp.setattr(owner.Owner, "_gather_or_finish", skipped)


MUTATIONS: dict[str, Callable[[Patch], None]] = {
    "commit on f acknowledgements": _break_quorum,
    "holders ignore epochs": _break_fencing,
    "successor adopts one promise": _adopt_the_first_promise,
    "a new boot id counts as the old holder": _forget_boot_ids,
    "holders serve without recomputing": _serve_without_verifying,
    "retries are executed again": _forget_saved_results,
    "unknown mirror lag reported as zero": _report_unknown_lag_as_zero,
    "host scope claimed at commit": _claim_host_scope_at_commit,
    "old set retired before the new holds the prefix": _retire_without_catch_up,
    "successor serves without re-accepting": _skip_reaccepting,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_simulator_catches_a_broken_rule(mutation: str, monkeypatch: Patch) -> None:
    MUTATIONS[mutation](monkeypatch)
    summary = sim.run_many(range(400), DEFAULT_MIX, stop_on_failure=True)
    assert summary.failures, f"{mutation}: 400 schedules found nothing"


@pytest.mark.parametrize("seed", [16739, 23538, 30419])
def test_regression_schedules_found_by_a_hundred_thousand_seeds(seed: int) -> None:
    """`make sim SEEDS=100000` found these (an old quorum chose a position the owner
    had not heard of, then the old set was retired: see test_fleet_owner's
    test_regression_joint_ready_waits_for_a_position_placed_before_the_joint_seed_30419).
    They stay in CI as schedules, beside that scripted scenario."""
    sim.run(seed)
