"""Remote work volumes on the testbed (slates.node.remote_ops, slates.fleet.link_remote).

Four hosts (`up 4`): a green made on h1 gets holders h1, h2 and h3; h4
holds nothing of it, so what h4 reads crosses QUIC.  In order, sharing the
bed: `work create` of h1's green on h2 (the CLI) makes the volume on h2
(h2's `volume list` has it, h1's does not) without moving file bytes;
reads on h4 through the SDK return the green's bytes, fetched from the
holders h2/h3 and never from the owner (counted by h4's link and by the
volume), a second read and a second work volume of that version fetch
nothing more; a mount on h2 reads the same bytes, is edited with `sed -i`,
a new file, a new directory and a removal, and `submit --durability host`
on h2 makes a version that h1 reads; h4's work volume of version 0 changing
the same line is answered a structured conflict; a piece damaged by the
serving holder (the links' test fault) is refused VerificationFailed with
nothing stored on h4, and read whole at the next try; a submission from h2
whose reply h1 drops once (the links' test fault) is resent by h2's link
over a new connection and answered the original version, h1 running it
once (one new version, not two); h2's shard SIGKILLed and restarted by its
anchor replays w2 onto the version it made, and w2 submits again with only
its new change; last, h1 killed, a remote work volume on h4 (made on the
head before the loss) submits to the green's new owner, which serves the
new version under the green's fleet name.  After each submission that made
a version, w2 is on that version (`rebased`), as a local work volume.
First-read throughput is printed, never asserted.  Runs as root.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slates.errors import VerificationFailed
from slates.fleet.link_client import call_link, link_socket
from slates.sdk.client import Client
from slates_cli.commands import CONFLICT_EXIT
from tests.testbed_bed import PYTHON, TestbedCalls, print_anchor_logs, wait_for

HOSTS = ("h1", "h2", "h3", "h4")
SEED = int.from_bytes(os.urandom(4), "big")
BIG = 9 << 20  # three pieces (slates.fleet.replica.CHUNK_BYTES is 4 MiB)
README_UID, README_GID, README_MTIME = 1234, 5678, 1_600_000_000_123_456_789


@dataclasses.dataclass
class Bed(TestbedCalls):
    source: Path = Path()
    green: str = ""
    green_name: str = ""
    works: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> id

    def link(self, host: str, message: dict[str, Any]) -> Any:
        return call_link(link_socket(self.runtime(host)), message, timeout=60)

    def slates(self, host: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.call("run", host, str(PYTHON), "-m", "slates_cli.main", *args)

    def json(self, host: str, *args: str) -> Any:
        done = self.slates(host, *args, "--json")
        assert done.returncode == 0, f"{host} {args}:\n{done.stdout}{done.stderr}"
        return json.loads(done.stdout)

    def client(self, host: str) -> Client:
        return Client(runtime_dir=self.runtime(host))

    def link_ready(self, host: str) -> bool:
        return (self.runtime(host) / "fleet-link.json").exists()


def _source(root: Path) -> None:
    rng = random.Random(SEED)
    (root / "src").mkdir()
    (root / "docs").mkdir()
    (root / "src" / "main.c").write_bytes(b"int main(void) {\n    return 0;\n}\n")
    (root / "README").write_bytes(b"first line\nsecond line\nthird line\n")
    os.chown(root / "README", README_UID, README_GID)
    os.utime(root / "README", ns=(README_MTIME, README_MTIME))
    (root / "docs" / "old.txt").write_bytes(b"to be removed\n")
    (root / "big.bin").write_bytes(rng.randbytes(BIG))
    os.symlink("src/main.c", root / "main-link")


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        raise AssertionError("the testbed tests run as root (network namespaces)")
    print(f"seed {SEED}")
    state_dir = Path(tempfile.mkdtemp(prefix="sfrm-", dir="/tmp"))
    running = Bed(f"sfr{os.getpid() % 100000}", state_dir)
    running.source = state_dir / "source"
    running.source.mkdir()
    _source(running.source)
    try:
        up = running.call("up", str(len(HOSTS)))
        assert up.returncode == 0, f"up failed:\n{up.stdout}{up.stderr}"
        for host in HOSTS:
            wait_for(f"the link on {host}", functools.partial(running.link_ready, host))
        made = running.json("h1", "green", "create", "g", "--base", str(running.source))
        running.green, running.green_name = f"{made['id']}@h1", "g"

        def holders_hold() -> bool:
            held = [running.link(h, {"op": "hosts"})["held"].get(running.green, 0) for h in HOSTS]
            return held[:3] == [1, 1, 1] and held[3] == 0  # version 0 is position 1

        wait_for("version 0 on h1, h2 and h3 (not h4)", holders_hold)
        yield running
    finally:
        print_anchor_logs(state_dir, HOSTS, last=20)
        down = running.call("down")
        shutil.rmtree(state_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr


def test_work_create_on_h2_makes_the_volume_on_h2(bed: Bed) -> None:
    made = bed.json("h2", "work", "create", bed.green, "w2")
    assert "@" not in made["id"] and made["remote"]["green"] == bed.green
    assert made["remote"]["version"] == 0 and made["remote"]["fetched_chunks"] == 0
    bed.works["w2"] = made["id"]
    on_h2 = {v["name"]: v for v in bed.json("h2", "volume", "list")}
    assert on_h2["w2"]["id"] == made["id"] and on_h2["w2"]["role"] == "work"
    assert "w2" not in {v["name"] for v in bed.json("h1", "volume", "list")}
    listed = bed.slates("h2", "ls", "w2", "/")
    assert listed.returncode == 0 and "big.bin" in listed.stdout and "main-link" in listed.stdout
    with bed.client("h2") as h2:  # the tree record keeps owner, group, mode and time
        readme = h2.stat(made["id"], "/README")
        source = os.stat(bed.source / "README")
    assert (readme["uid"], readme["gid"]) == (README_UID, README_GID), readme
    assert readme["mtime_ns"] == README_MTIME and readme["mode"] & 0o7777 == source.st_mode & 0o7777
    # --at owner keeps the old way: the volume is made on h1 and named <id>@h1 from here.
    owned = bed.json("h2", "work", "create", bed.green, "w2-owner", "--at", "owner")
    assert owned["id"].endswith("@h1") and "remote" not in owned, owned
    assert "w2-owner" in {v["name"] for v in bed.json("h1", "volume", "list")}
    assert "w2-owner" not in {v["name"] for v in bed.json("h2", "volume", "list")}


def test_reads_on_h4_fetch_from_the_holders_and_only_once(bed: Bed) -> None:
    before = bed.link("h4", {"op": "remote.stats"})["fetched"]
    with bed.client("h4") as h4:
        work = h4.create_work(bed.green, "w4")
        bed.works["w4"] = work["id"]
        started = time.monotonic()
        big = h4.read(work["id"], "/big.bin")
        took = time.monotonic() - started
        assert big == (bed.source / "big.bin").read_bytes()
        print(f"first read of {BIG >> 20} MiB on h4: {took:.2f} s, {BIG / took / 1e6:.1f} MB/s")
        assert h4.read(work["id"], "/README") == (bed.source / "README").read_bytes()
        assert h4.read(work["id"], "/src/main.c") == (bed.source / "src/main.c").read_bytes()
        remote = h4.show_volume(work["id"])["remote"]
        after = bed.link("h4", {"op": "remote.stats"})["fetched"]
        fetched = {h: after.get(h, 0) - before.get(h, 0) for h in after}
        assert remote["fetched_chunks"] == 5  # three pieces of big.bin, README, main.c
        assert sum(fetched.values()) == 5 and fetched.get("h1", 0) == 0, fetched
        assert h4.read(work["id"], "/big.bin") == big  # again: nothing more to fetch
        twin = h4.create_work(bed.green, "w4-twin")
        assert h4.read(twin["id"], "/big.bin") == big
        assert h4.show_volume(work["id"])["remote"]["fetched_chunks"] == 5
        assert h4.show_volume(twin["id"])["remote"]["fetched_chunks"] == 0
    assert bed.link("h4", {"op": "remote.stats"})["fetched"] == after


def test_a_mount_on_h2_is_edited_and_submitted_and_h1_reads_it(bed: Bed) -> None:
    mountpoint = Path(tempfile.mkdtemp(prefix="sfrm-mnt-", dir="/tmp"))
    try:
        bed.slates("h2", "mount", "w2", str(mountpoint)).check_returncode()
        assert (mountpoint / "big.bin").read_bytes() == (bed.source / "big.bin").read_bytes()
        assert os.readlink(mountpoint / "main-link") == "src/main.c"
        subprocess.run(["sed", "-i", "s/second line/SECOND LINE/", str(mountpoint / "README")])
        (mountpoint / "notes").mkdir()
        (mountpoint / "notes" / "new.txt").write_bytes(b"written on h2\n")
        shutil.rmtree(mountpoint / "docs")
        assert (mountpoint / "README").read_bytes() == b"first line\nSECOND LINE\nthird line\n"
    finally:
        bed.slates("h2", "unmount", str(mountpoint))
        mountpoint.rmdir()
    submitted = bed.json("h2", "submit", "w2", "--durability", "host")
    assert submitted["ok"] is True and submitted["version"] == 1, submitted
    assert submitted["durability"] == "host"
    assert {"/README", "/docs/old.txt", "/notes/new.txt"} <= set(submitted["paths"]), submitted
    with bed.client("h1") as h1:
        green = bed.green.partition("@")[0]
        assert h1.read(green, "/README") == b"first line\nSECOND LINE\nthird line\n"
        assert h1.read(green, "/notes/new.txt") == b"written on h2\n"
        assert "docs" not in {e["name"] for e in h1.list(green, "/")}
        assert not [v for v in h1.list_volumes() if v["name"].startswith("fleet-remote-")]
    assert submitted["rebased"] is True  # w2 is on the version it made
    assert bed.json("h2", "volume", "show", "w2")["remote"]["version"] == 1
    again = bed.json("h2", "submit", "w2")
    assert again["ok"] is True and again["made_version"] is False, again  # nothing new


def test_a_conflicting_submission_from_h4_comes_back_structured(bed: Bed) -> None:
    with bed.client("h4") as h4:
        work = bed.works["w4"]  # made on version 0
        h4.write(work, "/README", b"first line\nline two (h4)\nthird line\n")
        result = h4.submit(work)
    assert result["ok"] is False and result["version"] is None
    (conflict,) = result["conflicts"]
    assert conflict["path"] == "/README" and conflict["version"] == 1
    assert b"SECOND LINE" in conflict["accepted"] and b"two (h4)" in conflict["proposed"]


def test_a_damaged_piece_is_refused_and_nothing_is_stored(bed: Bed) -> None:
    with bed.client("h4") as h4:
        work = h4.create_work(bed.green, f"dmg-{uuid.uuid4().hex[:6]}")["id"]
        assert h4.stat(work, "/notes/new.txt")["size"] == len(b"written on h2\n")  # bound now
        before = h4.show_volume(work)["counters"]["host_physical_bytes"]
        for host in ("h2", "h3"):  # both holders h4 asks before the owner
            bed.link(host, {"op": "remote.damage", "count": 1})
        with pytest.raises(VerificationFailed):
            h4.read(work, "/notes/new.txt")
        shown = h4.show_volume(work)
        assert shown["remote"]["fetched_chunks"] == 0
        assert shown["counters"]["host_physical_bytes"] == before
        for host in ("h2", "h3"):
            bed.link(host, {"op": "remote.damage", "count": 0})
        assert h4.read(work, "/notes/new.txt") == b"written on h2\n"
        assert h4.show_volume(work)["remote"]["fetched_chunks"] == 1


def test_a_lost_reply_retried_over_a_new_connection_answers_the_original_version(
    bed: Bed,
) -> None:
    runs_before = bed.link("h1", {"op": "remote.stats"})["submissions"]["runs"]
    reconnects_before = _reconnects(bed, "h2")
    bed.link("h1", {"op": "remote.drop_replies", "count": 1})
    with bed.client("h2") as h2:
        h2.write(bed.works["w2"], "/retried.txt", b"sent once\n")
        result = h2.submit(bed.works["w2"], durability="host")
    assert result["ok"] is True and result["version"] == 2 and result["rebased"] is True, result
    assert result["durability"] == "host", result  # the kept reply waits too
    after = bed.link("h1", {"op": "remote.stats"})["submissions"]
    assert after["runs"] == runs_before + 1  # the retry got the kept reply, nothing ran again
    assert _reconnects(bed, "h2") > reconnects_before  # over a new connection
    with bed.client("h1") as h1:
        green = bed.green.partition("@")[0]
        assert h1.versions(green) == 2  # one new version, not two
        assert h1.read(green, "/retried.txt") == b"sent once\n"


def _reconnects(bed: Bed, host: str) -> int:
    return int(bed.link(host, {"op": "remote.stats"})["reconnects"])


def test_a_moved_remote_volume_survives_its_shard_killed(bed: Bed) -> None:
    work = bed.works["w2"]
    shard = int(work.split("-")[1])
    status = bed.json("h2", "status")
    pid = int(status["shards"][shard]["pid"])
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        found = bed.json("h2", "status")["shards"][shard]
        return bool(found["state"] == "serving" and found["pid"] != pid)

    wait_for("the shard on h2 to restart", restarted)
    shown = bed.json("h2", "volume", "show", "w2")
    assert shown["remote"]["version"] == 2, shown  # the move was journaled
    with bed.client("h2") as h2:
        assert h2.read(work, "/retried.txt") == b"sent once\n"
        h2.write(work, "/retried.txt", b"sent twice\n")
        result = h2.submit(work, durability="host")  # on the holders before h1 is killed
    assert result["ok"] is True and result["version"] == 3, result
    assert result["paths"] == ["/retried.txt"], result  # only what changed since version 2


def test_slates_rebase_moves_a_remote_volume_onto_the_head_keeping_its_edits(bed: Bed) -> None:
    with bed.client("h2") as h2, bed.client("h3") as h3:
        mine = h2.create_work(bed.green, "wr")["id"]
        start = h2.show_volume(mine)["remote"]["version"]
        h2.write(mine, "/mine.txt", b"mine\n")
        theirs = h3.create_work(bed.green, "w3")["id"]  # remote on h3 too
        h3.write(theirs, "/theirs.txt", b"theirs\n")
        assert h3.submit(theirs, durability="host")["version"] == start + 1
    moved = bed.json("h2", "rebase", "wr")
    assert moved["ok"] is True and moved["version"] == start + 1, moved
    with bed.client("h2") as h2, bed.client("h3") as h3:
        assert h2.show_volume(mine)["remote"]["version"] == start + 1
        assert h2.read(mine, "/mine.txt") == b"mine\n"  # kept
        assert h2.read(mine, "/theirs.txt") == b"theirs\n"  # the green's
        h2.write(mine, "/both.txt", b"from h2\n")
        h3.write(theirs, "/both.txt", b"from h3\n")
        assert h3.submit(theirs, durability="host")["version"] == start + 2
    refused = bed.slates("h2", "rebase", "wr", "--json")
    assert refused.returncode == CONFLICT_EXIT and "Conflict" in refused.stderr, refused
    answer = json.loads(refused.stdout)
    assert [(c["path"], c["version"]) for c in answer["conflicts"]] == [("/both.txt", start + 2)]
    shown = bed.slates("h2", "rebase", "wr")  # the table a person reads
    assert shown.returncode == CONFLICT_EXIT and "/both.txt" in shown.stdout, shown
    with bed.client("h2") as h2:
        assert h2.show_volume(mine)["remote"]["version"] == start + 1  # nothing moved
        assert h2.read(mine, "/both.txt") == b"from h2\n"


def test_after_h1_dies_a_remote_work_volume_submits_to_the_new_owner(bed: Bed) -> None:
    with bed.client("h4") as h4:
        work = h4.create_work(bed.green, "w4-after")["id"]  # on the head, before the loss
        assert h4.read(work, "/README") == b"first line\nSECOND LINE\nthird line\n"
    with bed.client("h1") as h1:
        head = h1.versions(bed.green.partition("@")[0])
    bed.ok("kill", "h1")

    def new_owner() -> str | None:
        host = str(bed.link("h4", {"op": "owner", "green": bed.green})["owner"]["host"])
        return None if host == "h1" else host

    owner = wait_for("a new owner of h1's green", new_owner, timeout=90)

    with bed.client("h4") as h4:
        h4.write(work, "/after.txt", b"after h1\n")  # local: h1's loss changes nothing here

    def submitted() -> dict[str, Any] | None:
        with bed.client("h4") as h4:
            found: dict[str, Any] = h4.submit(work)  # refused before it made a version: again
        return found

    result = wait_for("the new owner to accept h4's submission", submitted, timeout=60)
    assert result["ok"] is True and result["version"] == head + 1, result
    with bed.client(owner) as there:  # by the green's fleet name: its link translates it
        assert there.read(bed.green, "/after.txt") == b"after h1\n"
