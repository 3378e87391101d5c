"""Another client's size change reaches a mount, also one with the kernel's writeback cache.

With FUSE's writeback cache the kernel owns a regular file's size: it ignores
the size in every reply for an inode it holds, and an inode invalidation
drops pages but not the size.  So the shard's note for a changed file
(["file", ino]) has a writeback mount's bridge ask the kernel to drop the
inode (FUSE_NOTIFY_PRUNE, native/bridge_prune.c); its next lookup brings the
new size.  A file held open then keeps its old size until it is closed, and
the bridge asks again until the kernel lets the inode go.  Both write modes:
a write-through mount takes the shard's size from every reply.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slates import Client
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_mount_clean_reads import MODES, counters
from tests.test_mount_uring import wait_for

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

LONG = b"".join(b"line %04d\n" % i for i in range(600))
SETTLE_SECONDS = 10.0  # how long a released file may keep its old size (a retry per 0.2 s)


@MODES
def test_sdk_writes_that_grow_and_shrink_a_file_reach_the_mount(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("sizes")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            (mnt / "made-here").write_bytes(LONG)  # written through this mount's kernel
            client.write(vid, "/made-there", b"short\n")
            assert (mnt / "made-there").read_bytes() == b"short\n"
            for path, content in (
                ("/made-here", b"shrunk\n"),  # shorter than the kernel's size
                ("/made-there", LONG),  # longer
                ("/made-there", b""),
            ):
                client.write(vid, path, content, truncate=True)
                where = mnt / path.lstrip("/")
                assert where.stat().st_size == len(content), (path, len(content))
                assert where.read_bytes() == content
            # A truncate through the SDK's edit: the mount sees the shorter file too.
            client.edit(vid, "/made-here", 3, 7, b"")
            assert (mnt / "made-here").read_bytes() == b"shr"
            pruned = counters(service, vid).get("prunes", 0)
            assert (pruned > 0) == writeback, pruned


@MODES
def test_a_file_held_open_gets_the_new_size_once_it_is_closed(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("held")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            (mnt / "log").write_bytes(LONG)
            with open(mnt / "log", "rb") as held:
                client.write(vid, "/log", b"rotated\n", truncate=True)
                if not writeback:
                    assert os.fstat(held.fileno()).st_size == len(b"rotated\n")
                    assert held.read() == b"rotated\n"
                # A writeback kernel keeps the held inode's size: no assertion on it.
            wait_for(
                lambda: (mnt / "log").stat().st_size == len(b"rotated\n"),
                "new size",
                SETTLE_SECONDS,
            )
            assert (mnt / "log").read_bytes() == b"rotated\n"
            # Writes through the mount after all that land where they should.
            with open(mnt / "log", "ab") as appending:
                appending.write(b"more\n")
            assert client.read(vid, "/log") == b"rotated\nmore\n"
            assert (mnt / "log").read_bytes() == b"rotated\nmore\n"
