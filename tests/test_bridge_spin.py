"""The adaptive spins of the bridge's waits (native/bridge_spin.c): for the kernel's next
request, and (crowding alone) for a shard's reply.

The policy is pure arithmetic over what its caller saw, so it is checked here
through bridge_test_spin against a model written from its rule (spin while at
least an eighth of the recent spins caught the message; otherwise probe every
eighth wait; a spin crowded off its CPU parks for SPIN_BACKOFF waits), and on
the shapes that motivated it: a stream of quick requests keeps spinning, and
so does one whose replies straddle the budget; replies that always outlast it
(the shard's writes in a build) stop costing a spin each; quick waits after
an idle spell spin again after one probe; and a crowded spin backs off.
The reply wait's policy (any_rate) keeps spinning whatever the hit rate, as a
stream of creates on an idle host needs, and backs off only when crowded.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from slates._native import ffi, lib

BUDGET = 40_000  # ns, about the calibrated wake-up cost on the VM measured
SPIN_WEIGHT = 8
SPIN_MIN_RATE = 32
SPIN_PROBE = 8
SPIN_BACKOFF = 64
CROWDED = 2


@dataclass(slots=True)
class Model:
    budget: int
    any_rate: bool = False
    miss_rate: int = 0  # of 256
    backoff: int = 0
    skipped: int = 0

    def wanted(self) -> bool:
        if self.budget == 0 or self.backoff > 0:
            return False
        if self.any_rate or 256 - self.miss_rate >= SPIN_MIN_RATE:
            return True
        self.skipped += 1
        if self.skipped < SPIN_PROBE:
            return False
        self.skipped = 0
        return True

    def noted(self, spun: bool, hit: bool, crowded: bool) -> None:
        if spun:
            miss = 0 if hit else 256
            self.miss_rate = (self.miss_rate * (SPIN_WEIGHT - 1) + miss) // SPIN_WEIGHT
        if crowded:
            self.backoff = SPIN_BACKOFF
        elif not spun and self.backoff > 0:
            self.backoff -= 1


def decisions(
    budget: int, waits: list[tuple[int, int]], *, any_rate: bool = False
) -> tuple[list[bool], bool]:
    """What the C policy decided for each wait, and whether it would spin next."""
    n = len(waits)
    times = ffi.new("uint64_t[]", [w for w, _ in waits] or [0])
    flags = ffi.new("int[]", [f for _, f in waits] or [0])
    wanted = ffi.new("int[]", max(n, 1))
    after = lib.bridge_test_spin(budget, int(any_rate), times, flags, n, wanted)
    return [bool(wanted[i]) for i in range(n)], bool(after)


@settings(max_examples=300, deadline=None)
@given(
    budget=st.sampled_from([0, 1, BUDGET, 100_000]),
    waits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=10**9), st.sampled_from([0, CROWDED])),
        max_size=200,
    ),
    any_rate=st.booleans(),
)
def test_the_policy_follows_its_rule(
    budget: int, waits: list[tuple[int, int]], any_rate: bool
) -> None:
    model = Model(budget, any_rate)
    expected = []
    for waited, flag in waits:
        spun = model.wanted()
        expected.append(spun)
        model.noted(spun, spun and waited <= budget, bool(flag & CROWDED))
    assert decisions(budget, waits, any_rate=any_rate) == (expected, model.wanted())


def test_a_stream_of_quick_requests_keeps_spinning() -> None:
    wanted, after = decisions(BUDGET, [(15_000, 0)] * 100)
    assert all(wanted) and after


def test_replies_that_straddle_the_budget_keep_spinning() -> None:
    # Unlinks one after another: a third of the shard's replies come within a spin.
    wanted, after = decisions(BUDGET, [(20_000, 0), (90_000, 0), (150_000, 0)] * 30)
    assert all(wanted) and after


def test_replies_that_outlast_the_budget_stop_costing_a_spin_each() -> None:
    # The shard's writes in a build: ~230 us each.
    wanted, _after = decisions(BUDGET, [(230_000, 0)] * 400)
    assert all(wanted[:16])
    assert sum(wanted[16:]) <= len(wanted[16:]) // SPIN_PROBE + 1  # the probes only


def test_quick_waits_after_an_idle_spell_spin_again_after_one_probe() -> None:
    waits = [(60 * 10**9, 0)] * 30 + [(10_000, 0)] * 20
    wanted, after = decisions(BUDGET, waits)
    assert not wanted[30]
    first = wanted.index(True, 30)  # the next probe
    assert first <= 30 + SPIN_PROBE
    assert all(wanted[first:]) and after


def test_a_crowded_spin_parks_for_a_while() -> None:
    waits = [(10_000, 0)] * 5 + [(10_000, CROWDED)] + [(10_000, 0)] * SPIN_BACKOFF
    wanted, after = decisions(BUDGET, waits)
    assert all(wanted[:6])
    assert not any(wanted[6:])
    assert after  # the back-off is over, and the spins were hits


def test_no_budget_never_spins() -> None:
    wanted, after = decisions(0, [(1, 0)] * 10)
    assert not any(wanted) and not after


def test_the_reply_wait_spins_whatever_the_hit_rate() -> None:
    # Creates on an idle host: the shard's replies outlast the spin, which still
    # keeps the vCPU from halting before they come (bench/RESULTS.md).
    wanted, after = decisions(BUDGET, [(300_000, 0)] * 200, any_rate=True)
    assert all(wanted) and after


def test_the_reply_wait_parks_at_once_while_its_spins_are_crowded() -> None:
    # A build: the compilers take the spinning thread's CPU.
    waits = [(60_000, CROWDED)] + [(60_000, 0)] * SPIN_BACKOFF + [(60_000, 0)] * 3
    wanted, after = decisions(BUDGET, waits, any_rate=True)
    assert wanted[0] and not any(wanted[1 : 1 + SPIN_BACKOFF])
    assert all(wanted[1 + SPIN_BACKOFF :]) and after
