"""Fleet links on the namespace testbed: forwarding between hosts, and a host's loss.

Theory of operation: the module fixture brings up a private three-host
testbed (deploy/testbed, under its own $SLATES_TESTBED_NAME and
$SLATES_TESTBED_DIR, so it meets no other testbed) and starts a fleet link
on each host with `run hI .venv/bin/python -m slates.fleet.link --config
hI/fleet.json --runtime-dir hI/runtime`, inside the host's network
namespace, where it attaches to the host's serf agent and talks to the
three etcd members; unless `slates anchor` offers --fleet, in which case
the testbed passed it and the test uses the link the anchor started.  The links' unix sockets live
in the state directory, which every namespace shares, so the test speaks
to them from outside.  The fixture always stops the links it started (by
pid) and runs `down`.

In file order: the three hosts are enrolled with live leases and serf sees
them alive; a request forwarded from h2 to h1's shard runs there (a
volume h1's own SDK then lists) and h1's green is registered in etcd with
three holders in three failure domains (f=1); `kill h1` takes every
process of h1 at once, and h2's link reports h1 failed (serf) and its lease
gone while etcd on h2 and h3 still answers (h3 reads h1's green's
configuration through its link: h1's at epoch 1, or h2's at epoch 2 once
h2 took it over, and etcd on h2 is healthy from h3), and a
forward to h1 is refused at once with Unavailable (serf's verdict).
Timings are printed, never asserted.  Runs as root.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

import slates
from slates.errors import Unavailable
from slates.fleet.link_client import call_link, link_socket
from slates.fleet.link_rules import fleet_name
from tests.testbed_bed import HOSTS, PYTHON, TESTBED, TestbedCalls, wait_for


@functools.cache
def anchor_takes_fleet() -> bool:
    """Whether `slates anchor` offers --fleet (then the testbed passes it, and the anchor
    starts the link)."""
    done = subprocess.run(
        [str(PYTHON), "-m", "slates_cli.main", "anchor", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    return "--fleet" in done.stdout


@dataclasses.dataclass
class Bed(TestbedCalls):
    links: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)
    green: str | None = None  # the fleet name of the green made on h1

    def socket(self, host: str) -> Path:
        return link_socket(self.runtime(host))

    def link_log(self, host: str) -> Path:
        return self.state_dir / host / "logs" / "fleet-link-test.log"

    def start_link(self, host: str) -> None:
        if anchor_takes_fleet():
            return  # the testbed gave the anchor --fleet: it runs the host's link itself
        with self.link_log(host).open("ab") as log:
            self.links[host] = subprocess.Popen(
                [str(TESTBED / "run"), host, str(PYTHON), "-m", "slates.fleet.link",
                 "--config", str(self.state_dir / host / "fleet.json"),
                 "--runtime-dir", str(self.runtime(host))],
                env=self.env, stdout=log, stderr=log,
            )  # fmt: skip

    def link_ready(self, host: str) -> bool:
        process = self.links.get(host)
        if process is not None and process.poll() is not None:
            log = self.link_log(host).read_text(errors="replace")
            raise AssertionError(f"the link on {host} exited {process.returncode}:\n{log}")
        return (self.runtime(host) / "fleet-link.json").exists()

    def stop_links(self) -> None:
        for process in self.links.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.links.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def hosts(self, on: str) -> dict[str, Any]:
        listing: dict[str, Any] = call_link(self.socket(on), {"op": "hosts"})
        return listing

    def rows(self, on: str) -> dict[str, dict[str, Any]]:
        return {row["host"]: row for row in self.hosts(on)["hosts"]}


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        raise AssertionError("the testbed tests run as root (network namespaces)")
    state_dir = Path(tempfile.mkdtemp(prefix="sflt-", dir="/tmp"))
    running = Bed(f"sfl{os.getpid()}", state_dir)
    started = time.monotonic()
    try:
        up = running.call("up", "3")
        assert up.returncode == 0, f"up failed:\n{up.stdout}{up.stderr}"
        print(f"up 3: {time.monotonic() - started:.1f} s")
        for host in HOSTS:
            running.start_link(host)
        for host in HOSTS:
            wait_for(f"the link on {host}", functools.partial(running.link_ready, host))
        yield running
    finally:
        running.stop_links()
        down = running.call("down")
        assert down.returncode == 0, down.stderr


def all_alive(bed: Bed, on: str) -> dict[str, dict[str, Any]] | None:
    rows = bed.rows(on)
    if set(rows) == set(HOSTS) and all(
        r["lease"] == "alive" and r["serf"] == "alive" for r in rows.values()
    ):
        return rows
    return None


def test_three_hosts_enrolled_alive_and_seen_by_serf(bed: Bed) -> None:
    for host in HOSTS:
        rows = wait_for(
            f"{host}'s link to see every host alive", functools.partial(all_alive, bed, host)
        )
        boots = {h: r["boot_id"] for h, r in rows.items()}
        for other in HOSTS:
            state = json.loads((bed.runtime(other) / "fleet-link.json").read_text())
            assert boots[other] == state["boot_id"]
    assert len({r["failure_domain"] for r in bed.rows("h1").values()}) == 3


def test_a_request_forwarded_from_h2_runs_on_h1(bed: Bed) -> None:
    name = f"from-h2-{uuid.uuid4().hex[:6]}"
    client = f"tb-{uuid.uuid4().hex[:8]}"
    request = {"seq": 1, "ack": 0, "op": "volume.create", "args": {"name": name}}
    message = {"op": "forward", "host": "h1", "shard": 0, "client": client, "request": request}
    started = time.monotonic()
    raw = call_link(bed.socket("h2"), message)
    print(f"first forward h2 -> h1: {time.monotonic() - started:.3f} s")
    reply = msgpack.unpackb(raw, raw=False)
    assert reply["ok"] is True, reply
    with slates.Client(bed.runtime("h1")) as h1:
        listed = {v["id"]: v["name"] for v in h1.list_volumes()}
    assert listed.get(reply["result"]["id"]) == name
    with slates.Client(bed.runtime("h2")) as h2:
        assert name not in [v["name"] for v in h2.list_volumes()]


def test_a_green_on_h1_gets_three_holders_in_three_domains(bed: Bed) -> None:
    with slates.Client(bed.runtime("h1")) as h1:
        green = h1.create_green(f"green-{uuid.uuid4().hex[:6]}")
    name = fleet_name("h1", green)

    def registered() -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = call_link(bed.socket("h3"), {"op": "owner", "green": name})
        except slates.SlatesError:
            return None
        return found

    config = wait_for(f"{name} in etcd, seen from h3", registered)
    assert config["owner"]["host"] == "h1" and config["epoch"] == 1
    holders = config["holders"]
    assert holders["f"] == 1
    assert {c["host"] for c in holders["candidates"]} == set(HOSTS)
    assert len({c["domain"] for c in holders["candidates"]}) == 3
    bed.green = name


def test_killing_h1_is_seen_by_serf_on_h2_while_etcd_answers(bed: Bed) -> None:
    started = time.monotonic()
    bed.ok("kill", "h1")
    print(f"kill h1: {time.monotonic() - started:.1f} s")

    def h1_failed() -> dict[str, Any] | None:
        row = bed.rows("h2")["h1"]
        return row if row["serf"] == "failed" else None

    wait_for("serf on h2 to declare h1 failed (through h2's link)", h1_failed)
    assert {"member": "h1", "kind": "failed"} in bed.hosts("h2")["events"]
    wait_for(
        "h1's lease to lapse in etcd (seen from h2)",
        lambda: bed.rows("h2")["h1"]["lease"] == "none",
    )
    # etcd on h2 and h3 still has a quorum: h3's link reads h1's green's configuration.
    assert bed.green is not None, "the green test runs first"
    config = call_link(bed.socket("h3"), {"op": "owner", "green": bed.green})
    # h2, the first live holder candidate, takes the green over (tests/test_fleet_failover.py).
    assert (config["owner"]["host"], config["epoch"]) in (("h1", 1), ("h2", 2)), config
    assert bed.rows("h3")["h2"]["serf"] == "alive"
    request = {"seq": 1, "ack": 0, "op": "volume.list", "args": {}}
    message = {
        "op": "forward",
        "host": "h1",
        "shard": 0,
        "client": "after-kill",
        "request": request,
    }
    started = time.monotonic()
    with pytest.raises(Unavailable, match="serf declares the host failed"):
        call_link(bed.socket("h2"), message)
    print(f"forward to a dead h1 refused after {time.monotonic() - started:.1f} s")
