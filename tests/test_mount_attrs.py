"""Attributes a mutation produced answer the kernel's next GETATTR (native/bridge_attr.c).

Real anchors and mounts (root and /dev/fuse), with and without the kernel's
writeback cache.  The bridge keeps the ATTRs a mutation's reply carried (the
parent directory's after an entry is made or removed, the file's after a
write) and answers the GETATTR the kernel sends for them next; its counters
(round_trips, and the attr_answers slot, BRIDGE_STAT_ATTR_ANSWERS) show the
requests that no longer reach the shard.  Another client's change must still
be what `stat` shows through the mount as soon as that change returns, even
for an inode whose attributes the bridge was holding.
"""

from __future__ import annotations

import array
import os
import stat
from pathlib import Path

import pytest
from slates._native import lib

from slates import Client
from slates.fuse.bridge import read_counters
from slates.node.protocol import shard_of
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_mount_clean_reads import MODES

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)


def counts(service: Service, volume: str) -> dict[str, int]:
    """read_counters, plus the attribute answers' slot read from the file itself."""
    (path,) = service.runtime.glob(f"counters-{volume}-*")
    out = read_counters(path)
    raw = array.array("Q", path.read_bytes()[: lib.BRIDGE_COUNTERS * 8])
    out["attr_answers"] = raw[lib.BRIDGE_STAT_ATTR_ANSWERS]
    return out


def make_small_files(where: Path, n: int) -> None:
    """The benchmark's shape: open O_CREAT|O_EXCL, write 100 bytes, close."""
    for i in range(n):
        fd = os.open(where / f"f{i:04d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"x" * 100)
        finally:
            os.close(fd)


@MODES
def test_creating_and_removing_files_asks_the_shard_no_getattr(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    n = 200
    with Client(service.runtime) as client:
        vid = client.create_volume("attrs-count")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            (mnt / "d").mkdir()
            os.stat(mnt / "d")
            before = counts(service, vid)
            make_small_files(mnt / "d", n)
            made = counts(service, vid)
            for i in range(n):
                os.unlink(mnt / "d" / f"f{i:04d}")
            after = counts(service, vid)
            assert os.listdir(mnt / "d") == []
    create_getattrs = made.get("GETATTR", 0) - before.get("GETATTR", 0)
    create_answers = made["attr_answers"] - before["attr_answers"]
    delete_getattrs = after.get("GETATTR", 0) - made.get("GETATTR", 0)
    delete_answers = after["attr_answers"] - made["attr_answers"]
    # The kernel still asks (it invalidated the directory after each CREATE and
    # UNLINK), but the bridge answers: at most a few GETATTRs reach the shard.
    assert create_getattrs >= n // 2, (made, before)
    assert create_getattrs - create_answers <= n // 20, (made, before)
    assert delete_getattrs >= n // 2, (after, made)
    assert delete_getattrs - delete_answers <= n // 20, (after, made)
    # Per file the shard sees LOOKUP, CREATE and WRITE (writeback: and the
    # SETATTR of the times the kernel kept), then UNLINK and the kernel's FORGET
    # (writeback: after the SETATTR of the times it kept since):
    # the GETATTRs are gone from both (one more per file each, before).
    create_trips = made["round_trips"] - before["round_trips"]
    delete_trips = after["round_trips"] - made["round_trips"]
    per_file = 4 if writeback else 3
    assert create_trips <= per_file * n + n // 10, (made, before)
    assert delete_trips <= (per_file - 1) * n + n // 10, (after, made)


def _expect_stat(path: Path, client: Client, vid: str, rel: str, writeback: bool) -> None:
    """stat through the mount equals the volume's own answer (another client's view).

    With the writeback cache the kernel keeps a regular file's size and times as its
    own (fuse_get_cache_mask: it may hold writes the shard has not seen), whatever
    GETATTR answers, so those are compared only for directories there."""
    seen = os.stat(path)
    want = client.stat(vid, rel)
    got = {
        "size": seen.st_size,
        "mode": stat.S_IMODE(seen.st_mode),
        "nlink": seen.st_nlink,
        "uid": seen.st_uid,
        "gid": seen.st_gid,
        "mtime_ns": seen.st_mtime_ns,
        "ctime_ns": seen.st_ctime_ns,
    }
    if writeback and stat.S_ISREG(seen.st_mode):
        for key in ("size", "mtime_ns", "ctime_ns"):
            del got[key]
    assert got == {key: want[key] for key in got}, (rel, got, want)


@MODES
def test_another_clients_change_shows_through_a_held_attribute(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("attrs-others")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            (mnt / "d").mkdir()
            with open(mnt / "d" / "f", "wb") as f:  # the directory's ATTR is held now
                f.write(b"mine")
                f.flush()
                os.fsync(f.fileno())  # the WRITE reached the shard: the file's ATTR is held
            before = counts(service, vid)["attr_answers"]
            assert os.stat(mnt / "d" / "f").st_size == 4
            assert os.stat(mnt / "d").st_nlink >= 2
            held = counts(service, vid)["attr_answers"]
            assert held > before or writeback  # write-through: answered from what was held

            # Another client writes the file: its new size and times, at once.
            client.write(vid, "/d/f", b"another client's longer bytes", offset=0)
            _expect_stat(mnt / "d" / "f", client, vid, "/d/f", writeback)
            if not writeback:
                assert os.stat(mnt / "d" / "f").st_size == len(b"another client's longer bytes")

            # Another client changes its mode (fs.setattr, as a bridge would).
            with open(mnt / "d" / "f", "ab") as f:
                f.write(b"!")  # held again after this WRITE
            os.stat(mnt / "d" / "f")
            ino = client.stat(vid, "/d/f")["ino"]
            client.call(shard_of(vid), "fs.setattr", volume=vid, ino=ino, mode=0o600)
            assert stat.S_IMODE(os.stat(mnt / "d" / "f").st_mode) == 0o600
            _expect_stat(mnt / "d" / "f", client, vid, "/d/f", writeback)

            # Another client creates in the directory whose ATTR the bridge holds.
            with open(mnt / "d" / "g", "wb"):
                pass  # CREATE: the directory's new ATTR is held
            os.stat(mnt / "d")
            mtime = os.stat(mnt / "d").st_mtime_ns
            client.mkdir(vid, "/d/sub")
            seen = os.stat(mnt / "d")
            assert seen.st_nlink == 3
            assert seen.st_mtime_ns >= mtime
            _expect_stat(mnt / "d", client, vid, "/d", writeback)
            assert sorted(os.listdir(mnt / "d")) == ["f", "g", "sub"]
