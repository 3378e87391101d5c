"""The bridge's adaptive spin (native/bridge_spin.c): when a wait spins first.

The policy is pure arithmetic over the waits its caller measured, so it is
checked here through bridge_test_spin against a model written from its
rule (an average of the waits as a spinner would have seen them, within the
budget; a preempted spin parks for SPIN_BACKOFF waits), and on the shapes
that motivated it: a stream of quick requests keeps spinning, replies that
always outlast the budget (the shard's writes in a build) stop costing a
spin within a few waits, and a spin that took another task's CPU backs off.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from slates._native import ffi, lib

BUDGET = 40_000  # ns, about the calibrated wake-up cost on the VM measured
SPIN_CAP = 4
SPIN_BACKOFF = 64
PARKED, PREEMPTED = 1, 2


@dataclass(slots=True)
class Model:
    budget: int
    avg: int = 0
    backoff: int = 0

    def wanted(self) -> bool:
        return self.budget > 0 and self.backoff == 0 and self.avg <= self.budget

    def noted(self, waited: int, parked: bool, preempted: bool) -> None:
        seen = max(0, waited - self.budget) if parked else waited
        seen = min(seen, SPIN_CAP * self.budget)
        self.avg = (self.avg * 3 + seen) // 4
        if preempted:
            self.backoff = SPIN_BACKOFF
        elif self.backoff > 0 and parked:
            self.backoff -= 1


def decisions(budget: int, waits: list[tuple[int, int]]) -> tuple[list[bool], bool]:
    """What the C policy decided before each wait, and whether it would spin next."""
    n = len(waits)
    times = ffi.new("uint64_t[]", [w for w, _ in waits] or [0])
    flags = ffi.new("int[]", [f for _, f in waits] or [0])
    wanted = ffi.new("int[]", max(n, 1))
    after = lib.bridge_test_spin(budget, times, flags, n, wanted)
    return [bool(wanted[i]) for i in range(n)], bool(after)


@settings(max_examples=300, deadline=None)
@given(
    budget=st.sampled_from([0, 1, BUDGET, 100_000]),
    waits=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=10**9),
            st.sampled_from([0, PARKED, PREEMPTED, PARKED | PREEMPTED]),
        ),
        max_size=200,
    ),
)
def test_the_policy_follows_its_rule(budget: int, waits: list[tuple[int, int]]) -> None:
    model = Model(budget)
    expected = []
    for waited, flag in waits:
        expected.append(model.wanted())
        model.noted(waited, bool(flag & PARKED), bool(flag & PREEMPTED))
    assert decisions(budget, waits) == (expected, model.wanted())


def test_a_stream_of_quick_requests_keeps_spinning() -> None:
    wanted, after = decisions(BUDGET, [(15_000, 0)] * 100)
    assert all(wanted) and after


def test_replies_that_outlast_the_budget_stop_costing_spins() -> None:
    # The shard's writes in a build: ~230 us each, every one parked after its spin.
    wanted, after = decisions(BUDGET, [(230_000, PARKED)] * 50)
    assert wanted[:1] == [True]
    assert not any(wanted[3:]) and not after


def test_quick_waits_after_a_long_idle_spell_spin_again() -> None:
    # A shell left idle for a minute, then grep streams READs: each one parked
    # (the policy said no) but came soon after the wake-up it cost.
    waits = [(60 * 10**9, PARKED)] * 5 + [(BUDGET + 10_000, PARKED)] * 10
    wanted, after = decisions(BUDGET, waits)
    assert not wanted[5]
    assert after and wanted[-1]


def test_a_preempted_spin_parks_for_a_while() -> None:
    waits = [(10_000, 0)] * 5 + [(10_000, PREEMPTED)] + [(BUDGET, PARKED)] * SPIN_BACKOFF
    wanted, after = decisions(BUDGET, waits)
    assert all(wanted[:6])
    assert not any(wanted[6:])
    assert after  # the back-off is over, and the waits were quick


def test_no_budget_never_spins() -> None:
    wanted, after = decisions(0, [(1, 0)] * 10)
    assert not any(wanted) and not after
