"""A file made through a mount is read back from the bridge's copy, and the copy never lies.

A write-through kernel keeps a page up to date only when one write covered
all of it, so a file written in pieces (an object file, an archive, a
linker's output) is read back from the server page by page.  The bridge
keeps a copy of each file that began empty in this mount and answers those
READs itself (native/bridge_content.c).  What a user relies on: the bytes
read are the file's, whatever else happened to it: another client's write
or truncate through the SDK, a hole punched, a range copied in, a write the
volume refused, a truncate to zero and a rewrite, and more files than the
copies' bound.  Both write modes; the shard's own content is the reference.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
from pathlib import Path

import pytest

from slates import Client
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_mount_clean_reads import MODES, counters
from tests.test_mount_uring import wait_for
from tests.test_mount_writeback import SETTLE_SECONDS

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def written_in_pieces(path: Path, rng: random.Random, size: int) -> bytes:
    """An assembler's way: small unaligned writes, then a header filled in at the start."""
    content = bytearray(rng.randbytes(size))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        at = 64
        while at < size:
            piece = rng.randrange(1, 700)
            os.pwrite(fd, bytes(content[at : at + piece]), at)
            at += piece
        os.pwrite(fd, bytes(content[:64]), 0)
    finally:
        os.close(fd)
    return bytes(content)


def seeded() -> random.Random:
    """A random source whose seed the test's output shows (pytest prints it on failure)."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    return random.Random(seed)


def drop_page_cache() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


@MODES
def test_pieces_read_back_from_the_copy_and_follow_other_clients(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    rng = seeded()
    with Client(service.runtime) as client:
        vid = client.create_volume("pieces")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            content = written_in_pieces(mnt / "obj.o", rng, 50_000)
            assert (mnt / "obj.o").read_bytes() == content
            assert client.read(vid, "/obj.o") == content
            if not writeback:  # a writeback kernel kept every page it wrote
                assert counters(service, vid).get("content_reads", 0) > 0
            # Another client changes the middle and the length: the mount reads theirs.
            with open(mnt / "obj.o", "rb") as held:
                client.edit(vid, "/obj.o", 10_000, 10_100, b"THEIRS")
                content = content[:10_000] + b"THEIRS" + content[10_100:]
                assert os.pread(held.fileno(), 20, 9_998) == content[9_998:10_018]
            # A writeback kernel let the held file keep its size until the close.
            wait_for(
                lambda: (mnt / "obj.o").stat().st_size == len(content), "new size", SETTLE_SECONDS
            )
            assert (mnt / "obj.o").read_bytes() == content
            # ... and after a truncate by another client, pieces written here again.
            client.truncate(vid, "/obj.o", 1_000)
            with open(mnt / "obj.o", "r+b") as f:
                f.seek(0, os.SEEK_END)
                f.write(b"tail")
            assert (mnt / "obj.o").read_bytes() == content[:1_000] + b"tail"
            assert client.read(vid, "/obj.o") == content[:1_000] + b"tail"


@MODES
def test_every_other_change_to_a_copied_file_reads_as_the_shard_has_it(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    rng = seeded()
    with Client(service.runtime) as client:
        vid = client.create_volume("changes")["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            source = written_in_pieces(mnt / "b", rng, 9_000)
            fd = os.open(mnt / "a", os.O_CREAT | os.O_RDWR, 0o644)
            source_fd = os.open(mnt / "b", os.O_RDONLY)
            try:
                for change in (
                    lambda: os.pwrite(fd, rng.randbytes(30_000), 0),
                    lambda: os.posix_fallocate(fd, 40_000, 5_000),  # extends it
                    lambda: punch_hole(fd, 8_192, 8_192),
                    lambda: os.copy_file_range(source_fd, fd, 5_000, 0, 20_000),
                    lambda: os.ftruncate(fd, 33_333),
                    lambda: os.ftruncate(fd, 0),  # emptied here: a copy begins again
                    lambda: os.pwrite(fd, b"again", 3),
                ):
                    change()
                    os.fsync(fd)
                    drop_page_cache()
                    assert (mnt / "a").read_bytes() == client.read(vid, "/a")
            finally:
                os.close(source_fd)
                os.close(fd)
            assert (mnt / "a").read_bytes() == b"\0\0\0again"
            assert (mnt / "b").read_bytes() == source


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE), which os has no name for."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def test_a_write_the_volume_refuses_leaves_the_shards_bytes(
    service: Service, tmp_path: Path
) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("small", bounded=256 * 1024)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            fd = os.open(mnt / "big", os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                with pytest.raises(OSError) as full:
                    for index in range(1_000):
                        os.write(fd, bytes([index % 251]) * 1_000)
                assert full.value.errno == errno.ENOSPC
            finally:
                os.close(fd)
            drop_page_cache()
            assert (mnt / "big").read_bytes() == client.read(vid, "/big")


def test_more_files_than_the_copies_bound_read_back_whole(service: Service, tmp_path: Path) -> None:
    """Nine files of 8 MiB in 1,000-byte writes pass the 64 MiB bound of all copies."""
    with Client(service.runtime) as client:
        vid = client.create_volume("many")["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            expected = {}
            for index in range(9):
                data = bytes([index + 1]) * ((8 << 20) - 3)
                with open(mnt / f"f{index}", "wb", buffering=0) as f:
                    for at in range(0, len(data), 1_000):
                        f.write(data[at : at + 1_000])
                expected[f"f{index}"] = data
            drop_page_cache()
            for name, data in expected.items():
                assert (mnt / name).read_bytes() == data, name
