"""Replication, durability and failover on the namespace testbed (issue 16's must-show).

Theory of operation: the module fixture brings up a private three-host
testbed (deploy/testbed under its own $SLATES_TESTBED_NAME and
$SLATES_TESTBED_DIR), whose anchors run with --fleet and so start each
host's fleet link; the links' unix sockets live in the state directory,
which every namespace shares, so the test speaks to them (and to each
anchor, through the SDK) from outside.  It always runs `down`.

In file order: a green made on h1 gets three holders; an agent's client on
h2 makes a work volume of it (on h1, through the links), writes, and
submits with durability "host": the reply says "host", and h2's and h3's
holders report the version in their committed prefix; the CLI on h2
submits a work volume of it (made by the blocking Client on h2, on h1) with
`--durability host --json`, and the blocking Client on h1 a local one; a submission
resent with the same (client, seq) over a new connection gets the original
version, and the head does not move; under `slow h2 100ms 5%` a
submission from h2 still completes (at durability host); then `kill h1`:
within 30 s (the issue's bound, a deadline for the state to be reached,
not a timing assertion) h3 reads the acknowledged content through h1's
green's fleet name (its link answers NotOwner naming h2 and the client,
AsyncClient and blocking Client, follows), etcd names h2 at epoch 2, and a new submission from h3 is
accepted by h2; last, h1 restarted (a new boot id) cannot commit a takeover
at its old epoch (EpochFenced naming h2; through its link and through `slates
fleet takeover`, while `slates fleet owner` names h2), and a request to its old id on
h1 is answered NotOwner naming h2, which an AsyncClient on h1 follows;
and a submission at durability host that cannot reach it (one holder is
h1's old boot) is answered in time with the scope it did reach, restart.
Timings are printed, never asserted.  Runs as root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import slates
from slates.errors import EpochFenced, NotOwner, SlatesError
from slates.fleet.link_client import call_link, link_socket
from slates.fleet.link_rules import fleet_name
from tests.testbed_bed import HOSTS, PYTHON, TestbedCalls, print_anchor_logs, wait_for

FAILOVER_SECONDS = 30.0  # the bound


@dataclasses.dataclass
class Bed(TestbedCalls):
    green: str = ""  # the fleet name of the green made on h1
    acknowledged: dict[str, bytes] = dataclasses.field(default_factory=dict)  # path -> bytes
    version: int = 0  # the highest version acknowledged at durability host

    def link(self, host: str, message: dict[str, Any]) -> Any:
        return call_link(link_socket(self.runtime(host)), message, timeout=60)

    def link_state(self, host: str) -> dict[str, Any] | None:
        path = self.runtime(host) / "fleet-link.json"
        if not path.exists():
            return None
        state: dict[str, Any] = json.loads(path.read_text())
        return state


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        raise AssertionError("the testbed tests run as root (network namespaces)")
    state_dir = Path(tempfile.mkdtemp(prefix="sffo-", dir="/tmp"))
    running = Bed(f"sfo{os.getpid() % 100000}", state_dir)
    try:
        up = running.call("up", "3")
        assert up.returncode == 0, f"up failed:\n{up.stdout}{up.stderr}"
        for host in HOSTS:
            wait_for(f"the link on {host}", functools.partial(running.link_state, host))
        yield running
    finally:
        print_anchor_logs(state_dir, HOSTS, last=30, words=("fleet link",))
        down = running.call("down")
        assert down.returncode == 0, down.stderr


async def submit_from(
    bed: Bed, host: str, files: dict[str, bytes], durability: str | None = "host"
) -> dict[str, Any]:
    """A work volume of the green made through `host`'s anchor, written and submitted."""
    async with slates.AsyncClient(runtime_dir=bed.runtime(host)) as client:
        work = await client.create_work(bed.green, f"w-{host}-{uuid.uuid4().hex[:6]}", at="owner")
        for path, data in files.items():
            parent = path.rpartition("/")[0]
            if parent:
                with contextlib.suppress(slates.SlatesError):  # made by an earlier version
                    await client.mkdir(work["id"], parent)
            await client.write(work["id"], path, data)
        started = time.monotonic()
        result = await client.submit(work["id"], durability=durability)
        print(f"submit from {host} ({durability}): {time.monotonic() - started:.2f} s")
        return {**result, "work": work["id"]}


def held(bed: Bed, host: str) -> dict[str, int]:
    found: dict[str, int] = bed.link(host, {"op": "hosts"})["held"]
    return found


def test_a_green_on_h1_gets_three_holders(bed: Bed) -> None:
    with slates.Client(bed.runtime("h1")) as h1:
        green = h1.create_green(f"green-{uuid.uuid4().hex[:6]}")
    name = fleet_name("h1", green)

    def three_holders() -> dict[str, Any] | None:
        config: dict[str, Any] = bed.link("h3", {"op": "owner", "green": name})
        hosts = {c["host"] for c in config["holders"]["candidates"]}
        return config if hosts == set(HOSTS) else None

    config = wait_for(f"{name} in etcd with three holders", three_holders)
    assert config["owner"]["host"] == "h1" and config["epoch"] == 1
    bed.green = name


def test_a_submission_from_h2_waits_for_holders_outside_h1(bed: Bed) -> None:
    files = {"/a.txt": b"hello from h2\n", "/dir/big.bin": os.urandom(5 << 20)}
    result = trio.run(submit_from, bed, "h2", files)
    assert result["ok"] and result["made_version"], result
    assert result["durability"] == "host" and "host" in result["scopes"], result
    assert result["work"].endswith("@h1")  # the work volume lives on the green's owner
    bed.acknowledged.update(files)
    bed.version = result["version"]
    position = result["version"] + 1  # ledger position of the version
    for host in ("h2", "h3"):
        assert held(bed, host)[bed.green] >= position, host


def test_the_cli_on_h2_submits_with_durability_host(bed: Bed) -> None:
    with slates.Client(bed.runtime("h2")) as h2:  # the blocking Client forwards too
        work = h2.create_work(bed.green, f"cli-{uuid.uuid4().hex[:6]}", at="owner")["id"]
        h2.write(work, "/cli.txt", b"from the cli on h2\n")
    assert work.endswith("@h1")
    done = bed.call(
        "run", "h2", str(PYTHON), "-m", "slates_cli.main", "submit", work, "--durability", "host",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    reply = json.loads(done.stdout)
    assert reply["durability"] == "host" and reply["version"] == bed.version + 1, reply
    bed.version = reply["version"]
    bed.acknowledged["/cli.txt"] = b"from the cli on h2\n"
    table = bed.call(
        "run", "h2", str(PYTHON), "-m", "slates_cli.main", "submit", work, "--durability", "host"
    )
    assert table.returncode == 0 and "nothing to submit" in table.stdout, table.stdout


def test_a_blocking_client_on_h1_waits_for_host_durability_too(bed: Bed) -> None:
    local = bed.green.removesuffix("@h1")
    with slates.Client(bed.runtime("h1")) as h1:
        work = h1.create_work(local, f"local-{uuid.uuid4().hex[:6]}")["id"]
        h1.write(work, "/local.txt", b"a local work volume on h1\n")
        result = h1.submit(work, durability="host")
    assert result["durability"] == "host" and result["version"] == bed.version + 1, result
    bed.version = result["version"]
    bed.acknowledged["/local.txt"] = b"a local work volume on h1\n"


def test_a_lost_reply_resent_over_a_new_connection_returns_the_original_version(bed: Bed) -> None:
    local = bed.green.removesuffix("@h1")
    with slates.Client(bed.runtime("h1")) as h1:
        work = h1.create_work(local, f"lost-{uuid.uuid4().hex[:6]}")["id"]
        h1.write(work, "/lost.txt", b"submitted once\n")
    client = f"lost-{uuid.uuid4().hex[:8]}"
    submit = {"seq": 1, "ack": 0, "op": "submit", "args": {"volume": work}}
    message = {"op": "forward", "host": "h1", "shard": 0, "client": client, "request": submit}
    first = msgpack.unpackb(bed.link("h2", message), raw=False)  # each call: a new connection
    assert first["ok"] is True and first["result"]["made_version"], first
    again = msgpack.unpackb(bed.link("h2", message), raw=False)  # the reply "was lost"
    assert again["result"]["version"] == first["result"]["version"]
    with slates.Client(bed.runtime("h1")) as h1:
        assert h1.versions(local) == first["result"]["version"]  # nothing ran twice
    bed.version = first["result"]["version"]
    bed.acknowledged["/lost.txt"] = b"submitted once\n"


def test_under_a_slow_lossy_link_submissions_complete(bed: Bed) -> None:
    bed.ok("slow", "h2", "100ms", "5%")
    try:
        result = trio.run(submit_from, bed, "h2", {"/slow.txt": b"through a slow link\n"})
    finally:
        bed.ok("slow", "h2", "off")
    assert result["ok"] and result["durability"] == "host", result
    bed.version = result["version"]
    bed.acknowledged["/slow.txt"] = b"through a slow link\n"


def test_after_h1_is_killed_h3_reads_and_h2_accepts(bed: Bed) -> None:
    bed.ok("kill", "h1")
    killed = time.monotonic()
    left = FAILOVER_SECONDS

    async def read_all() -> dict[str, bytes] | None:
        async with slates.AsyncClient(runtime_dir=bed.runtime("h3")) as client:
            if await client.versions(bed.green) < bed.version:
                return None
            return {p: await client.read(bed.green, p) for p in bed.acknowledged}

    found = wait_for(
        "h3 to read the acknowledged version after h1's loss",
        lambda: trio.run(read_all),
        timeout=left,
    )
    assert found == bed.acknowledged
    with slates.Client(bed.runtime("h3")) as h3:  # the blocking Client follows NotOwner too
        assert h3.read(bed.green, "/a.txt") == bed.acknowledged["/a.txt"]
    left = FAILOVER_SECONDS - (time.monotonic() - killed)
    config = bed.link("h3", {"op": "owner", "green": bed.green})
    assert config["owner"]["host"] == "h2" and config["epoch"] == 2, config
    result = wait_for(
        "a submission from h3 accepted by the new owner",
        lambda: trio.run(functools.partial(submit_from, durability=None), bed, "h3",
                         {"/after.txt": b"after the failover\n"}),
        timeout=max(left, 1.0),
    )  # fmt: skip
    assert result["ok"] and result["version"] == bed.version + 1, result
    assert result["work"].endswith("@h2")  # made by the new owner
    print(f"failover done {time.monotonic() - killed:.1f} s after the kill")
    bed.version = result["version"]
    bed.acknowledged["/after.txt"] = b"after the failover\n"


def test_the_restarted_h1_is_fenced_and_redirects(bed: Bed) -> None:
    old = bed.link("h2", {"op": "hosts"})
    old_boot = {r["host"]: r["boot_id"] for r in old["hosts"]}["h1"]
    bed.ok("start", "h1")
    state = wait_for(
        "h1's new link",
        lambda: (s := bed.link_state("h1")) is not None and s["boot_id"] != old_boot and s,
    )
    assert state["boot_id"] != old_boot
    with pytest.raises(EpochFenced) as fenced:
        bed.link("h1", {"op": "takeover", "green": bed.green, "epoch": 1})
    assert fenced.value.details["owner_host"] == "h2"
    cli = bed.call(
        "run", "h1", str(PYTHON), "-m", "slates_cli.main", "fleet", "takeover", bed.green,
        "--epoch", "1",
    )  # fmt: skip
    assert cli.returncode == 1 and "EpochFenced" in cli.stderr, cli.stdout + cli.stderr
    shown = bed.call("run", "h1", str(PYTHON), "-m", "slates_cli.main", "fleet", "owner", bed.green)
    assert json.loads(shown.stdout)["owner"]["host"] == "h2", shown.stdout + shown.stderr
    local = bed.green.removesuffix("@h1")
    read = {"seq": 1, "ack": 0, "op": "read", "args": {"volume": local, "path": "/a.txt"}}
    message = {"op": "forward", "host": "h1", "shard": 0, "client": "old-id", "request": read}
    refused = wait_for(
        "h1's link to answer NotOwner for its old id",
        lambda: _raised(lambda: bed.link("h1", message), NotOwner),
    )
    assert refused.details["owner_host"] == "h2"

    async def read_on_h1() -> bytes:
        async with slates.AsyncClient(runtime_dir=bed.runtime("h1")) as client:
            return await client.read(bed.green, "/after.txt")

    assert trio.run(read_on_h1) == bed.acknowledged["/after.txt"]


def test_a_scope_not_reached_in_time_is_reported_as_what_was(bed: Bed) -> None:
    # The holders are still h1's old boot (gone), h2 and h3: outside the new owner h2 only
    # h3 holds, one short of f+1, so `host` cannot be reached; the reply says `restart`.
    async def submit() -> dict[str, Any]:
        async with slates.AsyncClient(runtime_dir=bed.runtime("h3")) as client:
            work = await client.create_work(bed.green, f"short-{uuid.uuid4().hex[:6]}", at="owner")
            await client.write(work["id"], "/short.txt", b"one holder short\n")
            result: dict[str, Any] = await client.submit(
                work["id"], durability="host", durability_timeout=3
            )
            return result

    result = trio.run(submit)
    assert result["ok"] and result["made_version"], result
    assert (result["durability"], result["scopes"]) == ("restart", ["restart"]), result


def _raised(call: Callable[[], Any], kind: type[SlatesError]) -> SlatesError | None:
    try:
        call()
    except kind as exc:
        return exc
    return None
