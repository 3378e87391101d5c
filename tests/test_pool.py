"""The host-wide capacity pool: slots in shared memory, and Hosts admitting through it.

Two views of one pool in this process stand for two shards (they share the
memfd's pages exactly as two processes do); one test uses a real second
process.  State machines check the slots against a list, and two Hosts on
one pool against a model of the whole host's claims.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slates.core.host import Host
from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node.pool import MAX_SHARDS, HostPool, overshoot_bound

MiB = 1 << 20


@dataclasses.dataclass(eq=False)  # each account is itself, as a volume is: never equal by value
class _Account:
    bounded: bool
    limit: int
    charged_bytes: int = 0


def _grow(host: Host, account: _Account, nbytes: int) -> None:
    host.admit(account, nbytes)
    account.charged_bytes += nbytes
    host.charge(nbytes)


def test_admission_on_one_shard_sees_the_other_shards_bytes() -> None:
    anchor, fd = HostPool.create(100 * MiB, 2)
    try:
        first, second = HostPool.attach(fd, 0), HostPool.attach(fd, 1)
        host_a = Host(100 * MiB, reserve=0, pool=first)
        host_b = Host(100 * MiB, reserve=0, pool=second)
        a, b = _Account(False, 1 << 62), _Account(False, 1 << 62)
        host_a.open_account(a)
        host_b.open_account(b)
        _grow(host_a, a, 70 * MiB)
        assert second.others() == 70 * MiB and anchor.claimed() == 70 * MiB
        with pytest.raises(CapacityExhausted):
            host_b.admit(b, 31 * MiB)  # fits its own Host, not the host
        _grow(host_b, b, 30 * MiB)
        account_a_frees = 50 * MiB
        a.charged_bytes -= account_a_frees
        host_a.charge(-account_a_frees)
        _grow(host_b, b, 50 * MiB)  # the room the other shard gave back
        assert anchor.slots() == (20 * MiB, 80 * MiB)
        for view in (first, second):
            view.close()
    finally:
        anchor.close()
        os.close(fd)


def test_a_bounded_reservation_on_one_shard_holds_room_on_the_other() -> None:
    anchor, fd = HostPool.create(100 * MiB, 2)
    try:
        host_a = Host(100 * MiB, reserve=0, pool=HostPool.attach(fd, 0))
        host_b = Host(100 * MiB, reserve=0, pool=HostPool.attach(fd, 1))
        reserved = _Account(True, 60 * MiB)
        host_a.open_account(reserved)
        assert anchor.slots() == (60 * MiB, 0)
        dynamic = _Account(False, 1 << 62)
        host_b.open_account(dynamic)
        with pytest.raises(CapacityExhausted):
            host_b.admit(dynamic, 41 * MiB)
        with pytest.raises(CapacityExhausted):
            host_b.open_account(_Account(True, 41 * MiB))
        _grow(host_b, dynamic, 40 * MiB)
        _grow(host_a, reserved, 60 * MiB)  # inside its quota: always fits
        assert anchor.slots() == (60 * MiB, 40 * MiB)
        host_a.close_account(reserved)
        assert anchor.slots()[0] == 60 * MiB  # its bytes are still held until freed
    finally:
        anchor.close()
        os.close(fd)


def test_the_shards_overhead_counts_in_the_pool() -> None:
    anchor, fd = HostPool.create(100 * MiB, 2)
    try:
        host = Host(100 * MiB, reserve=0, pool=HostPool.attach(fd, 1))
        host.set_overhead(5 * MiB)
        assert anchor.slots() == (0, 5 * MiB)
        with pytest.raises(InvalidArgument):
            host.set_overhead(-1)
    finally:
        anchor.close()
        os.close(fd)


def test_another_process_publishes_into_its_slot() -> None:
    anchor, fd = HostPool.create(1 << 30, 3)
    try:
        os.set_inheritable(fd, True)
        script = (
            "import sys; from slates.node.pool import HostPool; "
            f"p = HostPool.attach({fd}, 2); print(p.others()); p.publish(12345)"
        )
        own = HostPool.attach(fd, 0)
        own.publish(777)
        done = subprocess.run(
            [sys.executable, "-c", script], pass_fds=(fd,), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "777"
        assert own.others() == 12345 and anchor.slots() == (777, 0, 12345)
        own.close()
    finally:
        anchor.close()
        os.close(fd)


def test_refusals() -> None:
    with pytest.raises(InvalidArgument):
        HostPool.create(0, 2)
    with pytest.raises(InvalidArgument):
        HostPool.create(MiB, MAX_SHARDS + 1)
    anchor, fd = HostPool.create(MiB, 2)
    try:
        with pytest.raises(InvalidArgument):
            HostPool.attach(fd, 2)
        with pytest.raises(InvalidArgument):
            anchor.publish(1)  # the anchor's view reads only
        with pytest.raises(InvalidArgument):
            HostPool.attach(fd, 0).publish(-1)
    finally:
        anchor.close()
        os.close(fd)
    other = os.memfd_create("not-a-pool")
    try:
        os.ftruncate(other, 4096)
        with pytest.raises(VerificationFailed):
            HostPool.attach(other, 0)
    finally:
        os.close(other)


@given(st.integers(1, MAX_SHARDS), st.integers(0, 1 << 40))
def test_overshoot_bound_is_one_request_per_other_shard(shards: int, largest: int) -> None:
    assert overshoot_bound(shards, largest) == (shards - 1) * largest
    assert overshoot_bound(1, largest) == 0


class SlotMachine(RuleBasedStateMachine):
    """publish/others on every shard's view against a list of slot values."""

    def __init__(self) -> None:
        super().__init__()
        self.shards = 4
        self.anchor, self.fd = HostPool.create(1 << 40, self.shards)
        self.views = [HostPool.attach(self.fd, i) for i in range(self.shards)]
        self.model = [0] * self.shards

    @rule(index=st.integers(0, 3), used=st.integers(0, (1 << 64) // 8))
    def publish(self, index: int, used: int) -> None:
        self.views[index].publish(used)
        self.model[index] = used

    @rule(index=st.integers(0, 3))
    def reattach(self, index: int) -> None:
        """A replacement shard attaches to the slot its predecessor left."""
        self.views[index].close()
        self.views[index] = HostPool.attach(self.fd, index)

    @invariant()
    def views_agree_with_the_model(self) -> None:
        for index, view in enumerate(self.views):
            assert view.others() == sum(self.model) - self.model[index]
        assert self.anchor.slots() == tuple(self.model)
        assert self.anchor.others() == self.anchor.claimed() == sum(self.model)

    def teardown(self) -> None:
        for view in self.views:
            view.close()
        self.anchor.close()
        os.close(self.fd)


TestSlots = SlotMachine.TestCase
TestSlots.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


class TwoHostsMachine(RuleBasedStateMachine):
    """Two shards' Hosts on one pool: each admission is refused exactly when the whole
    host's claims (own bytes, reservations, the other shard's claim) would pass it."""

    CAPACITY = 64 * MiB
    RESERVE = 4 * MiB

    def __init__(self) -> None:
        super().__init__()
        self.anchor, self.fd = HostPool.create(self.CAPACITY, 2)
        self.hosts = [
            Host(self.CAPACITY, self.RESERVE, pool=HostPool.attach(self.fd, i)) for i in range(2)
        ]
        self.accounts: list[list[_Account]] = [[], []]

    def _claim(self, shard: int) -> int:
        return sum(
            max(a.charged_bytes, a.limit) if a.bounded else a.charged_bytes
            for a in self.accounts[shard]
        )

    def _held(self, shard: int) -> int:
        return sum(a.charged_bytes for a in self.accounts[shard])

    @rule(shard=st.integers(0, 1), bounded=st.booleans(), limit=st.integers(1, 40 * MiB))
    def open_account(self, shard: int, bounded: bool, limit: int) -> None:
        account = _Account(bounded, limit if bounded else 1 << 62)
        room = self.CAPACITY - self.RESERVE - self._claim(0) - self._claim(1)
        if bounded and limit > room:
            with pytest.raises(CapacityExhausted):
                self.hosts[shard].open_account(account)
            return
        self.hosts[shard].open_account(account)
        self.accounts[shard].append(account)

    @precondition(lambda self: any(self.accounts))
    @rule(data=st.data(), nbytes=st.integers(1, 16 * MiB))
    def grow(self, data: st.DataObject, nbytes: int) -> None:
        shard = data.draw(st.sampled_from([i for i in (0, 1) if self.accounts[i]]))
        account = data.draw(st.sampled_from(self.accounts[shard]))
        other = self._claim(1 - shard)
        if account.charged_bytes + nbytes > account.limit:
            fits = False
        elif account.bounded:
            fits = self._held(shard) + other + nbytes <= self.CAPACITY
        else:
            fits = self._claim(shard) + other + nbytes <= self.CAPACITY - self.RESERVE
        if not fits:
            with pytest.raises(CapacityExhausted):
                self.hosts[shard].admit(account, nbytes)
            return
        _grow(self.hosts[shard], account, nbytes)

    @precondition(lambda self: any(a.charged_bytes for s in self.accounts for a in s))
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        held = [(s, a) for s in (0, 1) for a in self.accounts[s] if a.charged_bytes]
        shard, account = data.draw(st.sampled_from(held))
        nbytes = data.draw(st.integers(1, account.charged_bytes))
        account.charged_bytes -= nbytes
        self.hosts[shard].charge(-nbytes)

    @precondition(lambda self: any(self.accounts))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        shard = data.draw(st.sampled_from([i for i in (0, 1) if self.accounts[i]]))
        account = data.draw(st.sampled_from(self.accounts[shard]))
        self.hosts[shard].charge(-account.charged_bytes)
        self.hosts[shard].close_account(account)
        self.accounts[shard].remove(account)

    @invariant()
    def the_pool_holds_each_shards_claim(self) -> None:
        assert self.anchor.slots() == (self._claim(0), self._claim(1))
        for shard in (0, 1):
            assert self.hosts[shard].claimed_bytes == self._claim(shard)
        assert self.anchor.claimed() <= self.CAPACITY

    def teardown(self) -> None:
        self.anchor.close()
        os.close(self.fd)


TestTwoHosts = TwoHostsMachine.TestCase
TestTwoHosts.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_recovering_shard_joins_the_pool_once_rebuilt() -> None:
    anchor, fd = HostPool.create(100 * MiB, 2)
    try:
        before = HostPool.attach(fd, 0)
        before.publish(30 * MiB)  # the shard that died held this
        host = Host(100 * MiB, reserve=0)
        account = _Account(False, 1 << 62)
        host.open_account(account)
        _grow(host, account, 10 * MiB)  # a partial rebuild is not published
        assert anchor.slots() == (30 * MiB, 0)
        _grow(host, account, 20 * MiB)
        host.attach_pool(HostPool.attach(fd, 0))
        assert anchor.slots() == (30 * MiB, 0)
        host.charge(-MiB)
        assert anchor.slots() == (29 * MiB, 0)
        with pytest.raises(InvalidArgument):
            host.attach_pool(before)
    finally:
        anchor.close()
        os.close(fd)


def test_recounted_snapshot_metadata_leaves_the_pool() -> None:
    anchor, fd = HostPool.create(100 * MiB, 1)
    try:
        host = Host(100 * MiB, reserve=0, pool=HostPool.attach(fd, 0))
        host.charge(3 * MiB)
        host.hand_over_metadata(3 * MiB)  # a snapshot took the volume's inodes
        assert (host.private_bytes, host.snapshot_metadata_bytes) == (0, 3 * MiB)
        assert anchor.slots() == (3 * MiB,)
        host.recount_snapshot_metadata(MiB)  # the collection found only 1 MiB still held
        assert host.physical_bytes == MiB and anchor.slots() == (MiB,)
        with pytest.raises(InvalidArgument):
            host.recount_snapshot_metadata(-1)
    finally:
        anchor.close()
        os.close(fd)


_GREEDY_SHARD = """
import sys
from slates.core.host import Host
from slates.errors import CapacityExhausted
from slates.node.pool import HostPool

class Account:
    bounded = False
    limit = 1 << 62
    charged_bytes = 0

fd, index, capacity, step = map(int, sys.argv[1:])
host = Host(capacity, reserve=0, pool=HostPool.attach(fd, index))
account = Account()
host.open_account(account)
sys.stdin.readline()  # both start at once
try:
    while True:
        host.admit(account, step)
        account.charged_bytes += step
        host.charge(step)
except CapacityExhausted:
    print(account.charged_bytes)
"""


def test_two_processes_admitting_at_once_overshoot_by_at_most_one_request_each() -> None:
    capacity, step = 64 * MiB, 4096
    anchor, fd = HostPool.create(capacity, 2)
    try:
        os.set_inheritable(fd, True)
        arguments = [str(fd), "0", str(capacity), str(step)]
        children = []
        for index in (0, 1):
            arguments[1] = str(index)
            children.append(
                subprocess.Popen(
                    [sys.executable, "-c", _GREEDY_SHARD, *arguments],
                    pass_fds=(fd,),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for child in children:  # both go before either is read
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        outputs = [child.communicate(timeout=120)[0] for child in children]
        held = [int(output) for output in outputs]
        assert anchor.slots() == tuple(held)
        assert capacity - 2 * step < sum(held) <= capacity + overshoot_bound(2, step)
    finally:
        anchor.close()
        os.close(fd)
