"""Fencing at the owner on the namespace testbed: a cut-off owner stops making versions.

Theory of operation: the module fixture brings up a private three-host
testbed (as tests/test_fleet_failover.py does: its own $SLATES_TESTBED_NAME
and $SLATES_TESTBED_DIR, the links' sockets in the shared state directory,
`down` always).  In file order: a green made on h1 gets three holders and a
first version at durability host; a local work volume on h1 is written;
`partition h1` cuts h1 off (its etcd member loses its quorum, so its link's
keepalives fail): h2 takes the green over at epoch 2 (serf's verdict, h1's
lease lapsed, recovery from the holders h2 and h3), and then a local
client's submission on h1 is refused with EpochFenced, while h1's green
stays at its version; after `heal` h1's link reads etcd again, its shard
answers NotOwner naming h2, etcd still names h2 at epoch 2 (h1 does not
come back as owner, even once its lease is renewed), and h2 accepts new
submissions of the green.  Last, a remote submission from h3's link to h2
(identity `request`) makes a version at durability host whose every reply
h2 drops; `kill h2`; the same submission resent to the new owner (h1 or h3,
epoch 3) is answered with the original version (`recovered`, nothing run
again) and the head does not move.  Timings are printed, never asserted.  Runs as root.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slates
from slates.errors import EpochFenced, NotOwner, SlatesError
from slates.fleet.link_client import call_link, link_socket
from slates.fleet.link_rules import fleet_name
from tests.testbed_bed import HOSTS, TestbedCalls, print_anchor_logs, wait_for

TAKEOVER_SECONDS = 90.0  # a deadline for the state to be reached, not a timing assertion


@dataclasses.dataclass
class Bed(TestbedCalls):
    green: str = ""  # the fleet name of the green made on h1
    work: str = ""  # a local work volume of it on h1, written before the partition
    version: int = 0  # h1's green's head before the partition

    def link(self, host: str, message: dict[str, Any]) -> Any:
        return call_link(link_socket(self.runtime(host)), message, timeout=60)

    @property
    def local(self) -> str:
        return self.green.removesuffix("@h1")


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        raise AssertionError("the testbed tests run as root (network namespaces)")
    state_dir = Path(tempfile.mkdtemp(prefix="sffe-", dir="/tmp"))
    running = Bed(f"sfe{os.getpid() % 100000}", state_dir)
    try:
        up = running.call("up", "3")
        assert up.returncode == 0, f"up failed:\n{up.stdout}{up.stderr}"
        for host in HOSTS:
            state = running.runtime(host) / "fleet-link.json"
            wait_for(f"the link on {host}", state.exists)
        yield running
    finally:
        print_anchor_logs(state_dir, HOSTS, last=30, words=("fleet link", "fence"))
        running.call("heal")
        down = running.call("down")
        assert down.returncode == 0, down.stderr


def _submit_on(bed: Bed, host: str, work: str) -> dict[str, Any]:
    with slates.Client(bed.runtime(host)) as client:
        result: dict[str, Any] = client.submit(work)
        return result


def _refused(bed: Bed, kind: type[SlatesError]) -> SlatesError | None:
    try:
        _submit_on(bed, "h1", bed.work)
    except kind as exc:
        return exc
    raise AssertionError("the cut-off owner accepted a submission")


def _versions(bed: Bed) -> int:
    with slates.Client(bed.runtime("h1")) as h1:
        return int(h1.versions(bed.local))


def test_a_green_on_h1_is_held_by_three_hosts(bed: Bed) -> None:
    with slates.Client(bed.runtime("h1")) as h1:
        green = h1.create_green(f"green-{uuid.uuid4().hex[:6]}")
    bed.green = fleet_name("h1", green)

    def three_holders() -> dict[str, Any] | None:
        config: dict[str, Any] = bed.link("h3", {"op": "owner", "green": bed.green})
        hosts = {c["host"] for c in config["holders"]["candidates"]}
        return config if hosts == set(HOSTS) else None

    wait_for(f"{bed.green} in etcd with three holders", three_holders)
    with slates.Client(bed.runtime("h1")) as h1:
        work = h1.create_work(green, f"first-{uuid.uuid4().hex[:6]}")["id"]
        h1.write(work, "/first.txt", b"before the partition\n")
        result = h1.submit(work, durability="host")
        assert result["durability"] == "host", result
        bed.work = h1.create_work(green, f"cut-{uuid.uuid4().hex[:6]}")["id"]
        h1.write(bed.work, "/cut.txt", b"written on h1, submitted while cut off\n")
    bed.version = result["version"]


def test_a_cut_off_owner_refuses_its_local_clients_once_h2_took_over(bed: Bed) -> None:
    bed.ok("partition", "h1")

    def h2_owns() -> bool:
        config = bed.link("h2", {"op": "owner", "green": bed.green})
        return bool(config["owner"]["host"] == "h2" and config["epoch"] == 2)

    wait_for("h2 to own h1's green at epoch 2", h2_owns, timeout=TAKEOVER_SECONDS)
    refused = _refused(bed, EpochFenced)  # h1 cannot read etcd: its lease proves nothing
    assert refused is not None and refused.details.get("green") == bed.local, refused
    assert _versions(bed) == bed.version  # nothing changed on h1's green
    with slates.Client(bed.runtime("h1")) as h1:
        assert h1.read(bed.local, "/first.txt") == b"before the partition\n"  # reads go on


def test_after_heal_h1_redirects_to_h2_and_stays_fenced(bed: Bed) -> None:
    bed.ok("heal")
    refused = wait_for(
        "h1's shard to answer NotOwner naming h2",
        functools.partial(_raised_not_owner, bed),
        timeout=TAKEOVER_SECONDS,
    )
    assert refused.details["owner_host"] == "h2", refused.details

    def lease_renewed() -> bool:
        rows = bed.link("h2", {"op": "hosts"})["hosts"]
        return any(r["host"] == "h1" and r["lease"] == "alive" for r in rows)

    wait_for("h1's lease to live again", lease_renewed, timeout=TAKEOVER_SECONDS)
    config = bed.link("h1", {"op": "owner", "green": bed.green})
    assert (config["owner"]["host"], config["epoch"]) == ("h2", 2), config
    again = _refused(bed, NotOwner)  # a renewed lease does not make h1 the owner again
    assert again is not None and again.details["owner_host"] == "h2"
    assert _versions(bed) == bed.version

    def h2_accepts() -> dict[str, Any]:
        with slates.Client(bed.runtime("h2")) as h2:
            adopted = bed.green  # the new owner serves it under its fleet name
            work = h2.create_work(adopted, f"new-{uuid.uuid4().hex[:6]}", at="owner")["id"]
            h2.write(work, "/after.txt", b"the new owner's\n")
            result: dict[str, Any] = h2.submit(work)
            return result

    result = wait_for("a submission accepted by h2", h2_accepts, timeout=TAKEOVER_SECONDS)
    assert result["ok"] and result["version"] == bed.version + 1, result
    bed.version = result["version"]


def test_a_retry_after_the_owner_died_gets_the_original_version(bed: Bed) -> None:
    # h3's link submits for h3 (a remote submission, identity `request`) to the owner h2,
    # which makes the version, waits until it is on the holders, and drops every reply.
    identity = f"retry-{uuid.uuid4().hex[:8]}"
    data = b"made once, before the owner died\n"
    message = {
        "op": "remote.submit",
        "green": bed.green,
        "version": bed.version,
        "ops": [["write", {"path": "/retried.txt", "data": data, "truncate": True}]],
        "request": identity,
        "durability": "host",
        "durability_timeout": 60,
    }
    runs = bed.link("h2", {"op": "remote.stats"})["submissions"]["runs"]
    bed.link("h2", {"op": "remote.drop_replies", "count": 100})
    with pytest.raises(SlatesError) as lost:
        bed.link("h3", message)  # every resend's reply lost
    ran = bed.link("h2", {"op": "remote.stats"})["submissions"]["runs"]
    assert ran == runs + 1, f"h2 ran {ran - runs} submissions; h3 was told {lost.value!r}"
    with slates.Client(bed.runtime("h3")) as h3:
        assert h3.versions(bed.green) == bed.version + 1  # made, on h2
    made = bed.version + 1
    bed.ok("kill", "h2")

    def new_owner() -> str | None:
        config = bed.link("h3", {"op": "owner", "green": bed.green})
        owner = config["owner"]["host"]
        return owner if config["epoch"] == 3 and owner != "h2" else None

    owner = wait_for("a new owner at epoch 3", new_owner, timeout=TAKEOVER_SECONDS)
    # The same submission again.  With h2's holder gone only one holder is outside the
    # new owner, so `host` cannot be reached: a short wait, and the reply says what was.
    retry = {**message, "durability_timeout": 3}
    again = wait_for(
        "the retry answered by the new owner",
        lambda: bed.link("h3", retry),
        timeout=TAKEOVER_SECONDS,
    )
    assert again["ok"] and again["version"] == made and again.get("recovered"), again
    assert again["durability"] == "restart", again
    stats = bed.link(owner, {"op": "remote.stats"})["submissions"]
    assert stats["runs"] == 0 and stats["recovered"] == 1, stats  # nothing ran again
    with slates.Client(bed.runtime("h3")) as h3:
        assert h3.versions(bed.green) == made  # the head did not move
        assert h3.read(bed.green, "/retried.txt") == data


def _raised_not_owner(bed: Bed) -> SlatesError | None:
    try:
        _submit_on(bed, "h1", bed.work)
    except NotOwner as exc:
        return exc
    except EpochFenced:
        return None  # not yet: h1's link has not read etcd since the heal
    raise AssertionError("the cut-off owner accepted a submission")
