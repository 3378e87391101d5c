"""The seeded protocol fuzzer (tests/protocol_fuzz.py) within CI's budget.

Two fixed seeds and one drawn afresh (printed on failure, so it replays)
run a bounded number of hostile rounds each against a real anchor; after
every round a well-behaved client must still be served by every shard and
no shard may have restarted.  `make fuzz` runs many more.
"""

from __future__ import annotations

import random

import pytest

from tests.anchor_fixture import Service, service
from tests.protocol_fuzz import fuzz

__all__ = ["service"]

ROUNDS = 400
FRESH_SEED = random.SystemRandom().randrange(2**32)


@pytest.mark.parametrize("seed", [1, 2, FRESH_SEED])
def test_hostile_clients_do_not_stall_or_crash_the_service(service: Service, seed: int) -> None:
    fuzz(service, seed, ROUNDS)  # raises with the seed and round of a finding
