"""Real mounts served over FUSE-over-io_uring (issue 14; native/bridge_uring.c).

Each test runs an anchor whose bridges get SLATES_FUSE_URING=1 and, for the
test's duration only, sets the kernel's /sys/module/fuse/parameters/
enable_uring to Y (root; the fixture puts the previous value back).  The
bridge's "uring_requests" counter proves the requests came over the rings:
a bridge that fell back to /dev/fuse counts none there.  Needs root,
/dev/fuse, a kernel with FUSE-over-io_uring (6.14+) and git.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slates import Client
from slates.fuse.bridge import URING_ENV, read_counters
from slates.node.anchor import is_mounted
from tests.anchor_fixture import Service, start_service
from tests.test_mount import mounted

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0 or not ENABLE_URING.exists(),
    reason="FUSE-over-io_uring needs /dev/fuse, root and a 6.14+ kernel (enable_uring)",
)


@contextlib.contextmanager
def uring_enabled(value: str = "Y") -> Iterator[None]:
    """enable_uring = value while the block runs; the previous value afterwards."""
    before = ENABLE_URING.read_text().strip()
    ENABLE_URING.write_text(value)
    try:
        yield
    finally:
        ENABLE_URING.write_text(before)


@pytest.fixture
def uring_service(tmp_path: Path) -> Iterator[Service]:
    with uring_enabled():
        running = start_service(tmp_path / "run", env={URING_ENV: "1"})
        try:
            yield running
        finally:
            running.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "src" / "deep").mkdir(parents=True)
    (base / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    (base / "src" / "decoder.c").write_text("int decode(void) { return 80; }\n")
    (base / "src" / "deep" / "table.h").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (base / "README").write_text("sample\n")
    return base


def counters(service: Service, volume: str) -> dict[str, int]:
    (path,) = service.runtime.glob(f"counters-{volume}-*")
    return read_counters(path)


def git(where: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(where),
    }
    done = subprocess.run(
        ["git", "-C", str(where), *args], check=True, capture_output=True, text=True, env=env
    )
    return done.stdout


def wait_for(predicate: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_mount_serves_base_files_and_changes_over_the_rings(
    uring_service: Service, project: Path, tmp_path: Path
) -> None:
    with Client(uring_service.runtime) as client:
        volume = client.create_volume("work", base=project)["id"]
        where = tmp_path / "mnt"
        with mounted(client, volume, where, writeback=True) as mnt:
            # base files: lstat, readdir, read (1 MiB: one full-size READ reply)
            assert sorted(os.listdir(mnt)) == ["README", "image.conf", "src"]
            assert os.lstat(mnt / "src" / "deep" / "table.h").st_size == 256 * 4096
            assert (mnt / "src" / "deep" / "table.h").read_bytes() == bytes(range(256)) * 4096
            assert (mnt / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
            # writes, creates, renames, unlinks, sed -i
            with open(mnt / "image.conf", "r+b") as f:
                f.seek(8)
                f.write(b"90")
            (mnt / "src" / "new.c").write_text("int x;\n")
            (mnt / "big.bin").write_bytes(os.urandom(3 << 20))  # several 1 MiB WRITEs
            os.rename(mnt / "src", mnt / "source")
            os.unlink(mnt / "README")
            subprocess.run(
                ["sed", "-i", "s/cache=off/cache=on/", str(mnt / "image.conf")], check=True
            )
            assert (mnt / "image.conf").read_bytes() == b"quality=90\ncache=on\n"
            assert sorted(os.listdir(mnt)) == ["big.bin", "image.conf", "source"]
            assert client.read(volume, "/source/new.c") == b"int x;\n"
            assert client.read(volume, "/big.bin") == (mnt / "big.bin").read_bytes()
            # git init && git add -A && git commit, inside
            git(mnt, "init", "-q")
            git(mnt, "add", "-A")
            git(mnt, "commit", "-q", "-m", "first")
            assert git(mnt, "status", "--porcelain") == ""
            assert "first" in git(mnt, "log", "--oneline")
            seen = counters(uring_service, volume)
            assert seen["uring_requests"] > 0
            assert seen["failed"] == 0
            # every LOOKUP came over a ring: /dev/fuse carries only INIT,
            # FORGET, BATCH_FORGET and INTERRUPT once the rings serve
            assert seen["uring_requests"] >= seen["LOOKUP"] > 0
        assert not is_mounted(str(where))


def test_another_clients_write_reaches_the_mount(
    uring_service: Service, project: Path, tmp_path: Path
) -> None:
    with Client(uring_service.runtime) as client:
        volume = client.create_volume("inval", base=project)["id"]
        # without the writeback cache: the kernel then takes sizes from the shard
        with mounted(client, volume, tmp_path / "mnt", writeback=False) as mnt:
            assert (mnt / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
            assert sorted(os.listdir(mnt / "src")) == ["decoder.c", "deep"]
            with Client(uring_service.runtime) as other:
                other.edit(volume, "/image.conf", 0, 0, b"format=webp\n")
                other.write(volume, "/src/added.c", b"int y;\n")
            wait_for(
                lambda: (
                    (mnt / "image.conf").read_bytes() == b"format=webp\nquality=80\ncache=off\n"
                ),
                "the new content in the mount",
            )
            wait_for(lambda: (mnt / "src" / "added.c").exists(), "the new name in the mount")
            assert counters(uring_service, volume)["uring_requests"] > 0


def test_the_mount_serves_after_a_shard_restart(
    uring_service: Service, project: Path, tmp_path: Path
) -> None:
    with Client(uring_service.runtime) as client:
        volume = client.create_volume("crash", base=project)["id"]
        with mounted(client, volume, tmp_path / "mnt", writeback=True) as mnt:
            (mnt / "kept.txt").write_text("before\n")
            os.sync()
            for index in range(len(uring_service.shard_pids())):
                old = uring_service.kill_shard(index)
                uring_service.wait_restarted(index, old)
            (mnt / "after.txt").write_text("after\n")
            assert (mnt / "after.txt").read_text() == "after\n"
            assert (mnt / "kept.txt").read_text() == "before\n"
            assert "after.txt" in os.listdir(mnt)
            seen = counters(uring_service, volume)
            assert seen["uring_requests"] > 0
            assert seen["reconnects"] >= 1


def bridge_running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for the anchor to reap it does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False
    return "\nState:\tZ" not in status


def test_an_external_unmount_ends_the_rings_and_the_bridge(
    uring_service: Service, project: Path, tmp_path: Path
) -> None:
    with Client(uring_service.runtime) as client:
        volume = client.create_volume("umount", base=project)["id"]
        where = tmp_path / "mnt"
        where.mkdir()
        pid = int(client.mount(volume, where)["pid"])
        try:
            assert sorted(os.listdir(where)) == ["README", "image.conf", "src"]
            (where / "made.txt").write_text("x\n")
            assert counters(uring_service, volume)["uring_requests"] > 0
            subprocess.run(["umount", str(where)], check=True)
            wait_for(lambda: not bridge_running(pid), "the bridge to exit", seconds=30.0)
            assert not is_mounted(str(where))
        finally:
            if is_mounted(str(where)):
                subprocess.run(["umount", "-l", str(where)], check=False)
        assert client.read(volume, "/made.txt") == b"x\n"


def test_asking_without_the_kernels_consent_serves_over_dev_fuse(
    project: Path, tmp_path: Path
) -> None:
    """SLATES_FUSE_URING=1 with enable_uring N: today's path, no request over a ring."""
    with uring_enabled("N"):
        service = start_service(tmp_path / "run", env={URING_ENV: "1"})
        try:
            with Client(service.runtime) as client:
                volume = client.create_volume("refused", base=project)["id"]
                with mounted(client, volume, tmp_path / "mnt", writeback=True) as mnt:
                    assert sorted(os.listdir(mnt)) == ["README", "image.conf", "src"]
                    (mnt / "made.txt").write_text("x\n")
                    assert (mnt / "made.txt").read_text() == "x\n"
                    seen = counters(service, volume)
                    assert seen["LOOKUP"] > 0
                    assert seen["uring_requests"] == 0
        finally:
            service.stop()


def test_the_rings_are_used_only_when_asked(project: Path, tmp_path: Path) -> None:
    """Even where the host offers them (enable_uring Y), SLATES_FUSE_URING unset or
    "0" serves over /dev/fuse; "1" takes the rings."""
    cases = (("Y", "", False), ("Y", "0", False), ("Y", "1", True))
    for n, (enabled, asked, rings) in enumerate(cases):
        with uring_enabled(enabled):
            service = start_service(tmp_path / f"run{n}", env={URING_ENV: asked})
            try:
                with Client(service.runtime) as client:
                    volume = client.create_volume(f"auto{n}", base=project)["id"]
                    with mounted(client, volume, tmp_path / f"mnt{n}") as mnt:
                        assert sorted(os.listdir(mnt)) == ["README", "image.conf", "src"]
                        (mnt / "made.txt").write_text("x\n")
                        assert (mnt / "made.txt").read_text() == "x\n"
                        assert (mnt / "src" / "decoder.c").read_bytes().startswith(b"int")
                        seen = counters(service, volume)
                        assert (seen["uring_requests"] > 0) == rings, (enabled, asked, seen)
            finally:
                service.stop()
