"""Safe administration (issue 13, item 6): what someone still uses is not deleted silently.

A green volume with live work volumes, or with versions no landing has
written to disk, and a mounted volume are refused by `volume delete`
unless forced; names are unique among the host's live volumes.  In-process
for the rules, a real mount for the mounted case.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slates import Client
from slates.errors import AlreadyExists, InvalidArgument
from slates.fuse.bridge import kernel_requests
from tests.anchor_fixture import Service as Anchor
from tests.anchor_fixture import service
from tests.test_merge_service import Service
from tests.test_mount import mounted

__all__ = ["service"]


def test_a_green_with_work_volumes_or_unlanded_versions_is_not_deleted_unless_forced() -> None:
    svc = Service()
    green = svc.green({"/a": b"a\n"})  # version 1 holds /a
    work = svc.work(green)
    refused = svc.raw("volume.delete", volume=green)
    assert refused["ok"] is False and "work volumes" in refused["error"]["message"], refused
    for each in [w for w, (g, _v) in svc.svc.works.items() if g == green]:
        assert svc.raw("volume.delete", volume=each)["ok"]  # also the one that made v1
    assert work not in svc.svc.volumes
    refused = svc.raw("volume.delete", volume=green)
    assert refused["ok"] is False and "never landed" in refused["error"]["message"], refused
    assert green in svc.svc.greens  # nothing changed
    assert svc.raw("volume.delete", volume=green, force=True)["ok"]
    assert green not in svc.svc.greens and green not in svc.svc.volumes


def test_an_empty_green_and_a_plain_volume_are_deleted_at_once() -> None:
    svc = Service()
    green = svc.call("green.create", name="g")["id"]
    plain = svc.call("volume.create", name="p")["id"]
    assert svc.raw("volume.delete", volume=green)["ok"]
    assert svc.raw("volume.delete", volume=plain)["ok"]


@pytest.mark.parametrize("op", ["green.create", "volume.create"])
def test_names_are_unique_among_live_volumes(op: str) -> None:
    svc = Service()
    first = svc.call(op, name="main")["id"]
    again = svc.raw(op, name="main")
    assert again["ok"] is False and again["error"]["code"] == "AlreadyExists", again
    if op == "green.create":  # a work volume cannot take its green's name either
        assert svc.raw("work.create", green=first, name="main")["ok"] is False
    assert svc.raw("volume.delete", volume=first, force=True)["ok"]
    assert svc.raw(op, name="main")["ok"]  # free again once deleted


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)
def test_a_mounted_volume_is_not_deleted_unless_forced(service: Anchor, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("mounted")["id"]
        with mounted(client, volume, tmp_path / "mnt") as where:
            (where / "f").write_bytes(b"kept\n")
            with pytest.raises(InvalidArgument, match="mounted"):
                client.delete_volume(volume)
            assert (where / "f").read_bytes() == b"kept\n"
        client.delete_volume(volume)  # unmounted: it goes
        assert volume not in {v["id"] for v in client.list_volumes()}


def test_a_green_prunes_versions_nothing_needs_and_keeps_the_rest() -> None:
    svc = Service()
    green = svc.call("green.create", name="g", keep=2)["id"]
    old = svc.work(green)  # starts from v0 and stays: v0 is kept anyway
    for number in range(6):
        work = svc.work(green)
        svc.call("write", volume=work, path=f"/f{number}", data=b"x")
        assert svc.submit(work)["ok"]
        svc.raw("volume.delete", volume=work, force=True)
    listed = {v["version"]: v["pruned"] for v in svc.call("versions", green=green)["versions"]}
    assert listed == {0: False, 1: False, 2: False, 3: False, 4: False, 5: False, 6: False}
    svc.raw("volume.delete", volume=old, force=True)  # now nothing starts from v0's successors
    assert svc.call("gc")["pruned"] == {green: [1, 2, 3, 4]}
    listed = {v["version"]: v["pruned"] for v in svc.call("versions", green=green)["versions"]}
    assert listed == {0: False, 1: True, 2: True, 3: True, 4: True, 5: False, 6: False}
    refused = svc.raw("work.create", green=green, name="late", version=2)
    assert refused["ok"] is False and refused["error"]["code"] == "NotFound", refused
    refused = svc.raw("changed_since", green=green, version=0)
    assert refused["ok"] is False and "pruned" in refused["error"]["message"], refused
    assert svc.call("changed_since", green=green, version=5) == ["/f5"]
    assert svc.read(green, "/f0") == b"x"  # the head keeps everything it holds
    assert_same_after_replay(svc)


def assert_same_after_replay(svc: Service) -> None:
    replayed = svc.replayed()
    assert [v.snapshot_id for v in replayed.greens[next(iter(replayed.greens))]] == [
        v.snapshot_id for v in svc.svc.greens[next(iter(svc.svc.greens))]
    ]
    assert set(replayed.snapshots) == set(svc.svc.snapshots)


def test_a_snapshot_is_deleted_unless_something_needs_it() -> None:
    svc = Service()
    volume = svc.call("volume.create", name="v")["id"]
    svc.call("write", volume=volume, path="/f", data=b"kept")
    snap = svc.call("snapshot", volume=volume)["id"]
    clone = svc.call("clone", snapshot=snap, name="c")["id"]
    refused = svc.raw("snapshot.delete", snapshot=snap)
    assert refused["ok"] is False and "cloned" in refused["error"]["message"], refused
    assert svc.raw("snapshot.delete", snapshot=snap, force=True)["ok"]
    assert snap not in svc.svc.snapshots
    assert svc.read(clone, "/f") == b"kept"  # the clone keeps what it shares
    green = svc.call("green.create", name="g")["id"]
    version0 = svc.svc.greens[green][0].snapshot_id
    refused = svc.raw("snapshot.delete", snapshot=version0)
    assert refused["ok"] is False and "green" in refused["error"]["message"], refused
    missing = svc.raw("snapshot.delete", snapshot="snap-0-999")
    assert missing["error"]["code"] == "NotFound"


def test_names_are_unique_across_the_shards_of_a_host(service: Anchor) -> None:
    """Clones and work volumes live on their snapshot's or green's shard, not their
    name's: the SDK asks the other shards too, so a second `dup` is refused wherever
    it would go, and nothing is made."""
    with Client(service.runtime) as client:
        first = client.create_volume("dup")["id"]
        here = first.split("-")[1]
        green = next(  # a green on the other shard
            g for n in range(64) if (g := client.create_green(f"green{n}")).split("-")[1] != here
        )
        other = next(
            v["id"]
            for n in range(64)
            if (v := client.create_volume(f"plain{n}"))["id"].split("-")[1] != here
        )
        snapshot = client.snapshot(other)
        before = {v["id"] for v in client.list_volumes()}
        with pytest.raises(AlreadyExists, match=first):
            client.create_work(green, "dup")
        with pytest.raises(AlreadyExists, match=first):
            client.clone(snapshot, "dup")
        with pytest.raises(AlreadyExists, match=first):
            client.create_green("dup")
        assert {v["id"] for v in client.list_volumes()} == before
        client.delete_volume(first)
        assert client.create_work(green, "dup")["name"] == "dup"  # free once deleted


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)
def test_mounts_leave_no_files_behind_in_the_runtime_directory(
    service: Anchor, tmp_path: Path
) -> None:
    """Each mount's bridge has a counters file and a log: once unmounted, its counters
    are added into one `counters-retired` and an empty log goes (the soak left 466
    files in 20 minutes)."""
    with Client(service.runtime) as client:
        volume = client.create_volume("files")["id"]
        for round_ in range(3):
            with mounted(client, volume, tmp_path / f"mnt{round_}") as where:
                (where / f"f{round_}").write_bytes(b"x")
                during = kernel_requests(service.runtime)
            after = kernel_requests(service.runtime)
            assert after >= during > 0  # totals over the directory never go back
    left = sorted(
        p.name for p in service.runtime.iterdir() if p.name.startswith(("counters-", "bridge-"))
    )
    assert left == ["counters-retired"], left
