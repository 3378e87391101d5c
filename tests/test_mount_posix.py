"""The rest of the POSIX surface through a real mount: flags, holes, xattrs, fifos, statfs."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from slates import Client
from slates.errors import SnapshotBarrierFailed
from slates.fuse.bridge import kernel_requests
from slates.sdk.client import _run_to_end
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

_LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def renameat2(src: Path, dst: Path, flags: int) -> None:
    if _LIBC.renameat2(AT_FDCWD, bytes(src), AT_FDCWD, bytes(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    _LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if _LIBC.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def test_posix_surface_through_a_mount(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("posix", bounded=64 << 20)
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            (mnt / "a").write_bytes(b"A")
            (mnt / "b").write_bytes(b"B")
            with pytest.raises(OSError) as exists:
                renameat2(mnt / "a", mnt / "b", RENAME_NOREPLACE)
            assert exists.value.errno == errno.EEXIST
            renameat2(mnt / "a", mnt / "b", RENAME_EXCHANGE)
            assert (mnt / "a").read_bytes() == b"B" and (mnt / "b").read_bytes() == b"A"

            # Holes: SEEK_DATA / SEEK_HOLE and punching.
            fd = os.open(mnt / "sparse", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                os.pwrite(fd, b"x" * 8192, 1 << 20)
                assert os.lseek(fd, 0, os.SEEK_DATA) == 1 << 20
                assert os.lseek(fd, 1 << 20, os.SEEK_HOLE) == (1 << 20) + 8192
                fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, 1 << 20, 4096)
                assert os.pread(fd, 4096, 1 << 20) == bytes(4096)
                assert os.pread(fd, 4, (1 << 20) + 4096) == b"xxxx"
                assert os.fstat(fd).st_size == (1 << 20) + 8192
            finally:
                os.close(fd)

            # copy_file_range between two files of the volume.
            payload = os.urandom(64 * 1024)
            (mnt / "src").write_bytes(payload)
            with open(mnt / "src", "rb") as src, open(mnt / "dst", "wb") as dst:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), len(payload))
            assert copied == len(payload)
            assert (mnt / "dst").read_bytes() == payload

            # Extended attributes.
            os.setxattr(mnt / "src", "user.origin", b"agent-1")
            assert os.getxattr(mnt / "src", "user.origin") == b"agent-1"
            assert "user.origin" in os.listxattr(mnt / "src")
            os.removexattr(mnt / "src", "user.origin")
            with pytest.raises(OSError) as missing:
                os.getxattr(mnt / "src", "user.origin")
            assert missing.value.errno == errno.ENODATA

            # A fifo, chmod/chown/utime, statfs showing the quota.
            os.mkfifo(mnt / "pipe", 0o600)
            assert stat.S_ISFIFO(os.lstat(mnt / "pipe").st_mode)
            os.chmod(mnt / "src", 0o600)
            os.chown(mnt / "src", 1234, 5678)
            os.utime(mnt / "src", ns=(10**18, 2 * 10**18))
            st = os.stat(mnt / "src")
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 1234, 5678)
            assert st.st_mtime_ns == 2 * 10**18
            fs = os.statvfs(mnt)
            assert fs.f_blocks * fs.f_frsize == 64 << 20
            assert 0 < fs.f_bavail < fs.f_blocks

            # Hard links and stable inode numbers across renames.
            os.link(mnt / "src", mnt / "src2")
            ino = os.stat(mnt / "src").st_ino
            os.mkdir(mnt / "d")
            os.rename(mnt / "src2", mnt / "d" / "moved")
            assert os.stat(mnt / "d" / "moved").st_ino == ino
            assert os.stat(mnt / "src").st_nlink == 2


def test_with_writeback_cached_writes_never_look_like_holes(
    service: Service, tmp_path: Path
) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("wb")
        where = tmp_path / "mnt"
        where.mkdir()
        client.mount(volume["id"], where, writeback=True)
        try:
            fd = os.open(where / "sparse", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                os.pwrite(fd, b"x" * 8192, 1 << 20)
                # The shard may not have these bytes yet: the kernel answers from its
                # own size (all data), never a hole over cached writes.
                assert os.lseek(fd, 0, os.SEEK_DATA) == 0
                assert os.lseek(fd, 0, os.SEEK_HOLE) == (1 << 20) + 8192
            finally:
                os.close(fd)
        finally:
            client.unmount(where)


def test_a_bridge_that_cannot_finish_fails_the_snapshot(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slates.sdk.client as sdk

    monkeypatch.setattr(sdk, "BARRIER_SECONDS", 2.0)
    with Client(service.runtime) as client:
        volume = client.create_volume("stuck")
        with mounted(client, volume["id"], tmp_path / "mnt", writeback=True) as mnt:
            bridge = client.status()["mounts"][0]["pid"]
            fd = os.open(mnt / "dirty", os.O_CREAT | os.O_WRONLY, 0o644)
            os.write(fd, b"cached, not yet written back")
            os.kill(bridge, signal.SIGSTOP)  # the bridge can no longer answer the kernel
            try:
                with pytest.raises(SnapshotBarrierFailed):
                    client.snapshot(volume["id"])
            finally:
                os.kill(bridge, signal.SIGCONT)
                os.close(fd)
            assert client.status()["shards"][volume["shard"]]["snapshots"] == []


def test_without_writeback_a_warm_tree_sends_no_requests(service: Service, tmp_path: Path) -> None:
    base = tmp_path / "tree"
    for d in range(5):
        (base / f"d{d}").mkdir(parents=True)
        for f in range(40):
            (base / f"d{d}" / f"f{f}.c").write_bytes(os.urandom(100 + f * 37))
    with Client(service.runtime) as client:
        volume = client.create_volume("warm", base=base)
        where = tmp_path / "mnt"
        where.mkdir()
        client.mount(volume["id"], where)  # no writeback: the default
        try:
            passes = []
            for _ in range(4):
                before = kernel_requests(service.runtime)
                subprocess.run(
                    "find . -type f -print0 | xargs -0 cat > /dev/null",
                    shell=True,
                    cwd=where,
                    check=True,
                )
                passes.append(kernel_requests(service.runtime) - before)
            assert passes[0] > 0
            assert passes[3] == 0, f"requests per pass: {passes}"
            # Without the writeback cache the shard sees every write, so holes are precise.
            fd = os.open(where / "sparse", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                os.pwrite(fd, b"x" * 4096, 1 << 20)
                assert os.lseek(fd, 0, os.SEEK_DATA) == 1 << 20
                assert os.lseek(fd, 1 << 20, os.SEEK_HOLE) == (1 << 20) + 4096
            finally:
                os.close(fd)
        finally:
            client.unmount(where)


def test_unmount_is_refused_while_in_use_unless_forced(service: Service, tmp_path: Path) -> None:
    from slates.errors import InvalidArgument
    from slates.node.anchor import is_mounted

    with Client(service.runtime) as client:
        volume = client.create_volume("busy")
        where = tmp_path / "mnt"
        where.mkdir()
        client.mount(volume["id"], where)
        handle = open(where / "held", "wb")  # noqa: SIM115 - held open on purpose
        try:
            with pytest.raises(InvalidArgument):
                client.unmount(where)
            assert is_mounted(str(where))
            handle.write(b"still served")
            handle.flush()
        finally:
            handle.close()
        client.unmount(where)
        assert not is_mounted(str(where))
        assert client.read(volume["id"], "/held") == b"still served"


def test_a_volume_mounts_again_right_after_a_users_umount(service: Service, tmp_path: Path) -> None:
    """umount(8) returns before the bridge has exited and the anchor has heard of it;
    mounting the volume again at once, there or elsewhere, must not be refused as
    "already mounted" (it was, every time), and the content is the same."""
    from slates.node.anchor import is_mounted

    with Client(service.runtime) as client:
        volume = client.create_volume("again")["id"]
        here, there = tmp_path / "here", tmp_path / "there"
        here.mkdir()
        there.mkdir()
        client.mount(volume, here)
        (here / "f").write_bytes(b"kept")
        previous = here
        for where in (here, there, there, here):
            done = subprocess.run(["umount", str(previous)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            client.mount(volume, where)  # at once: no wait for the old bridge
            assert (where / "f").read_bytes() == b"kept"
            assert [m["directory"] for m in client.mounts()] == [str(where)]
            previous = where
        client.unmount(here)
        assert not is_mounted(str(here)) and not is_mounted(str(there))


def test_unmount_while_the_shard_is_down_does_not_stall_supervision(
    service: Service, tmp_path: Path
) -> None:
    import threading

    with Client(service.runtime) as client:
        volume = client.create_volume("stall")
        where = tmp_path / "mnt"
        where.mkdir()
        client.mount(volume["id"], where)
        (where / "f").write_bytes(b"data")
        pid = service.shard_pids()[volume["shard"]]
        os.kill(pid, signal.SIGSTOP)  # a hung shard...
        outcome: list[object] = []

        def unmount() -> None:
            with Client(service.runtime) as other:
                try:
                    outcome.append(
                        _run_to_end(
                            other._async._anchor(
                                {"op": "unmount", "directory": str(where), "force": False}
                            )
                        )
                    )
                except Exception as exc:  # recorded, then asserted below
                    outcome.append(exc)

        thread = threading.Thread(target=unmount)
        thread.start()
        os.kill(pid, signal.SIGKILL)  # ...that then dies: the anchor must still restart it
        service.wait_restarted(volume["shard"], pid)
        thread.join(timeout=120)
        assert not thread.is_alive() and outcome, "the unmount never finished"
        assert client.read(volume["id"], "/f") == b"data"
