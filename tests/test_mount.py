"""Real FUSE mounts: differential tests against tmpfs, real tools, crashes and barriers.

These need root and /dev/fuse (CI runs as root with FUSE available).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slates import Client
from slates.errors import AccessDenied, InvalidArgument
from slates.node.anchor import is_mounted
from slates.node.mounts import is_bridge
from tests.anchor_fixture import Service, service, start_service

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)


def _digest(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        content: object = os.readlink(path) if path.is_symlink() else None
        if path.is_file() and not path.is_symlink():
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, st.st_size, content)
    return out


@contextlib.contextmanager
def mounted(client: Client, volume: str, where: Path, *, writeback: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    client.mount(volume, where, writeback=writeback)
    try:
        yield where
    finally:
        with contextlib.suppress(Exception):
            client.unmount(where)
        if is_mounted(str(where)):
            subprocess.run(["fusermount3", "-u", "-z", str(where)], check=False)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "src").mkdir(parents=True)
    (base / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    (base / "src" / "decoder.c").write_text("int decode(void) { return 80; }\n")
    (base / "README").write_text("sample\n")
    return base


def test_mount_serves_a_workspace_and_never_writes_the_base(
    service: Service, project: Path, tmp_path: Path
) -> None:
    before = _digest(project)
    with Client(service.runtime) as client:
        volume = client.create_volume("work", base=project)
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            assert sorted(os.listdir(mnt)) == ["README", "image.conf", "src"]
            assert (mnt / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
            with open(mnt / "image.conf", "r+b") as f:
                f.seek(8)
                f.write(b"90")
            assert (mnt / "image.conf").read_bytes() == b"quality=90\ncache=off\n"
            (mnt / "src" / "new.c").write_text("int x;\n")
            os.rename(mnt / "src", mnt / "source")
            os.unlink(mnt / "README")
            os.mkdir(mnt / "empty")
            os.symlink("source/new.c", mnt / "link")
            assert os.readlink(mnt / "link") == "source/new.c"
            assert (mnt / "link").read_text() == "int x;\n"
            assert sorted(os.listdir(mnt)) == ["empty", "image.conf", "link", "source"]
            status = client.status()
            assert [m["directory"] for m in status["mounts"]] == [str(mnt)]
            assert status["mounts"][0]["health"] == "serving"
            # The SDK sees the mount's writes (same volume, same rules).
            assert client.read(volume["id"], "/source/new.c") == b"int x;\n"
        assert not is_mounted(str(tmp_path / "mnt"))
        assert client.status()["mounts"] == []
    assert _digest(project) == before


def test_rename_and_unlink_while_open(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("open")
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            (mnt / "image.rs").write_bytes(b"decoder")
            ino = os.stat(mnt / "image.rs").st_ino
            with open(mnt / "image.rs", "rb") as handle:
                os.rename(mnt / "image.rs", mnt / "codec.rs")
                assert os.stat(mnt / "codec.rs").st_ino == ino
                os.unlink(mnt / "codec.rs")
                assert handle.read() == b"decoder"
            (mnt / "a").write_bytes(b"1")
            os.link(mnt / "a", mnt / "b")
            assert os.stat(mnt / "a").st_nlink == 2
            os.unlink(mnt / "a")
            assert (mnt / "b").read_bytes() == b"1"


def test_mount_refuses_bad_directories(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("refuse")
        full = tmp_path / "full"
        full.mkdir()
        (full / "x").write_bytes(b"")
        with pytest.raises(InvalidArgument):
            client.mount(volume["id"], full)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(AccessDenied):
            client.mount(volume["id"], theirs)
        assert client.status()["mounts"] == []
        assert not is_mounted(str(full)) and not is_mounted(str(theirs))


def wait_for_restart(client: Client, where: Path, dead: int, timeout: float = 60) -> int:
    """The pid of the bridge serving `where` again after bridge `dead` died.  Until then
    the mount must stay listed (health "restarting", pid `dead`, while a bridge starts
    for it): a mount that leaves the list was removed, not restarted, and fails."""
    deadline = time.monotonic() + timeout
    while True:
        mounts = [m for m in client.mounts() if m["directory"] == str(where)]
        assert mounts, f"the mount at {where} was removed instead of restarted"
        (mount,) = mounts
        if mount["pid"] != dead:  # a new pid: it serves again
            assert mount["health"] == "serving" and is_mounted(str(where)), mount
            return int(mount["pid"])
        assert mount["health"] in ("serving", "restarting"), mount
        assert time.monotonic() < deadline, f"the mount was not restarted: {mount}"
        time.sleep(0.02)


def test_a_dead_bridge_is_restarted_and_serves_what_was_written(
    service: Service, tmp_path: Path
) -> None:
    """A bridge killed with SIGKILL: the anchor mounts the same volume again on the same
    directory (README: the agent sees a pause), and what was written reads back; then
    `unmount` leaves nothing mounted and nothing listed."""
    with Client(service.runtime) as client:
        volume = client.create_volume("dies")
        where = tmp_path / "mnt"
        where.mkdir()
        info = client.mount(volume["id"], where)
        (where / "written.txt").write_bytes(b"acknowledged\n")
        os.kill(info["pid"], signal.SIGKILL)
        pid = wait_for_restart(client, where, info["pid"])
        assert (where / "written.txt").read_bytes() == b"acknowledged\n"
        assert [m["volume"] for m in client.mounts()] == [volume["id"]]
        (where / "after.txt").write_bytes(b"the restarted bridge writes too")
        assert client.read(volume["id"], "/after.txt") == b"the restarted bridge writes too"
        client.unmount(where)
        assert not is_mounted(str(where)) and client.mounts() == []
        assert not is_bridge(pid), f"the restarted bridge {pid} outlived its unmount"
    log = (service.runtime.parent / f"{service.runtime.name}.log").read_text()
    assert f"restarted the bridge for {where}" in log


def test_bytes_written_without_fsync_are_in_a_snapshot(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("barrier")
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            fd = os.open(mnt / "unsynced", os.O_CREAT | os.O_WRONLY, 0o644)
            os.write(fd, b"written just before the snapshot")
            snapshot = client.snapshot(volume["id"])  # no fsync, file still open
            os.close(fd)
        clone = client.clone(snapshot, "after")
        assert client.read(clone["id"], "/unsynced") == b"written just before the snapshot"


def test_errnos_reach_programs(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("small", bounded=256 * 1024)
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            with pytest.raises(OSError) as full, open(mnt / "big", "wb") as f:
                f.write(b"x" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
            assert full.value.errno == errno.ENOSPC
            with pytest.raises(OSError) as long_name:
                (mnt / ("n" * 300)).write_bytes(b"")
            assert long_name.value.errno == errno.ENAMETOOLONG
            with pytest.raises(FileNotFoundError):
                (mnt / "missing").read_bytes()
            os.mkdir(mnt / "d")
            (mnt / "d" / "f").write_bytes(b"")
            with pytest.raises(OSError) as not_empty:
                os.rmdir(mnt / "d")
            assert not_empty.value.errno == errno.ENOTEMPTY


def test_real_tools_work_inside_a_mount(service: Service, project: Path, tmp_path: Path) -> None:
    before = _digest(project)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "a",
        "GIT_AUTHOR_EMAIL": "a@example.invalid",
        "GIT_COMMITTER_NAME": "a",
        "GIT_COMMITTER_EMAIL": "a@example.invalid",
        "HOME": str(tmp_path),
    }

    def run(*command: str, cwd: Path) -> str:
        done = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        return done.stdout

    with Client(service.runtime) as client:
        volume = client.create_volume("tools", base=project)
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            run("git", "init", "-q", cwd=mnt)
            run("git", "add", "-A", cwd=mnt)
            run("git", "commit", "-qm", "start", cwd=mnt)
            (mnt / "image.conf").write_bytes(b"quality=90\ncache=off\n")
            assert "image.conf" in run("git", "status", "--short", cwd=mnt)
            assert "+quality=90" in run("git", "diff", cwd=mnt)
            (mnt / "src" / "main.c").write_text(
                "#include <stdio.h>\nint decode(void);\n"
                'int main(void) { printf("%d\\n", decode()); return 0; }\n'
            )
            (mnt / "Makefile").write_text(
                "app: src/main.o src/decoder.o\n\tcc -o app src/main.o src/decoder.o\n"
                "%.o: %.c\n\tcc -c -o $@ $<\n"
            )
            run("make", "-s", cwd=mnt)
            assert run("./app", cwd=mnt).strip() == "80"
            (mnt / "test_sample.py").write_text(
                "def test_one():\n    assert 1 + 1 == 2\n\n"
                "def test_two(tmp_path):\n    (tmp_path / 'x').write_text('y')\n"
            )
            out = run(
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "test_sample.py",
                cwd=mnt,
            )
            assert "2 passed" in out
    assert _digest(project) == before


def test_a_shard_restart_is_a_pause_not_an_error(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("restart")
        shard = volume["shard"]
        with mounted(client, volume["id"], tmp_path / "mnt") as mnt:
            expected: dict[str, bytes] = {}
            kills: list[int] = []
            stop = threading.Event()

            def killer() -> None:
                while len(kills) < 2 and not stop.wait(0.2):
                    with contextlib.suppress(ProcessLookupError):
                        kills.append(service.kill_shard(shard))

            thread = threading.Thread(target=killer)
            thread.start()
            try:
                i = 0
                while (len(kills) < 2 or i < 300) and i < 200_000:  # bounded
                    name = f"f{i % 17}"
                    data = os.urandom(1 + (i * 7919) % 20000)
                    with open(mnt / name, "wb") as f:
                        f.write(data)
                    expected[name] = data
                    i += 1
            finally:
                stop.set()
                thread.join()
            assert len(kills) == 2
            os.sync()
            for name, data in expected.items():
                assert (mnt / name).read_bytes() == data
            assert client.status()["shards"][shard]["restarts"] >= 1
        for name, data in expected.items():
            got = client.read(volume["id"], "/" + name)
            assert got == data, (name, len(got), len(data), got[:16].hex(), data[:16].hex())


# -- differential: the same random POSIX calls on a mount and on tmpfs --------------

NAMES = st.sampled_from(["a", "b", "c", "d/e", "d/f"])
# cap_net_raw, effective: a VFS_CAP_REVISION_2 value (the kernel checks its form)
CAPABILITY = bytes.fromhex("0100000200200000" + "00" * 12)
OPS = st.one_of(
    st.tuples(st.just("write"), NAMES, st.integers(0, 9000), st.binary(max_size=5000)),
    st.tuples(st.just("rewrite"), NAMES, st.binary(max_size=9000)),
    st.tuples(st.just("truncate"), NAMES, st.integers(0, 12000)),
    st.tuples(st.just("rename"), NAMES, NAMES),
    st.tuples(st.just("link"), NAMES, NAMES),
    st.tuples(st.just("unlink"), NAMES),
    st.tuples(st.just("mkdir"), st.sampled_from(["d", "g", "d/h"])),
    st.tuples(st.just("rmdir"), st.sampled_from(["d", "g", "d/h"])),
    st.tuples(st.just("symlink"), st.sampled_from(["target", "a", "e"]), NAMES),  # stays inside
    st.tuples(
        st.just("chmod"), NAMES, st.sampled_from([0o600, 0o644, 0o755, 0o4755, 0o6775, 0o2644])
    ),
    st.tuples(st.just("chown"), NAMES, st.sampled_from([0, 1000])),  # takes set-ID bits
    st.tuples(st.just("setcap"), NAMES),  # a write, truncate or chown takes it
    st.tuples(st.just("utime"), NAMES, st.integers(0, 10**9)),  # before 2001: set by utime
    st.tuples(st.just("open"), NAMES),
    st.tuples(st.just("pwrite"), st.integers(0, 3), st.integers(0, 5000), st.binary(max_size=300)),
    st.tuples(st.just("pread"), st.integers(0, 3), st.integers(0, 6000)),
    st.tuples(st.just("fsync"), st.integers(0, 3)),
    st.tuples(st.just("ftruncate"), st.integers(0, 3), st.integers(0, 9000)),
)


def _apply(root: Path, op: tuple[object, ...], fds: list[int]) -> object:
    kind = op[0]
    try:
        match op:
            case ("write", str(name), int(offset), bytes(data)):
                fd = os.open(root / name, os.O_CREAT | os.O_WRONLY, 0o644)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)
            case ("rewrite", str(name), bytes(data)):
                fd = os.open(root / name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                try:
                    return os.write(fd, data)
                finally:
                    os.close(fd)
            case ("truncate", str(name), int(size)):
                with contextlib.suppress(OSError):
                    if size == 0 and os.stat(root / name).st_size == 0:
                        # tmpfs leaves an empty file's times alone here; a FUSE server
                        # cannot tell this from O_TRUNC, which must set them.
                        return "skipped"
                os.truncate(root / name, size)
                return None
            case ("rename", str(src), str(dst)):
                os.rename(root / src, root / dst)
                return None
            case ("link", str(src), str(dst)):
                os.link(root / src, root / dst)
                return None
            case ("unlink", str(name)):
                os.unlink(root / name)
                return None
            case ("mkdir", str(name)):
                os.mkdir(root / name)
                return None
            case ("rmdir", str(name)):
                os.rmdir(root / name)
                return None
            case ("symlink", str(target), str(name)):
                os.symlink(target, root / name)
                return None
            case ("chmod", str(name), int(mode)):
                os.chmod(root / name, mode)
                return None
            case ("chown", str(name), int(owner)):
                os.chown(root / name, owner, owner)
                return None
            case ("setcap", str(name)):
                os.setxattr(root / name, "security.capability", CAPABILITY)
                return None
            case ("utime", str(name), int(when)):
                os.utime(root / name, ns=(when * 10**9, when * 10**9), follow_symlinks=False)
                return None
            case ("open", str(name)):
                fds.append(os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644))
                return "opened"
            case ("pwrite", int(index), int(offset), bytes(data)):
                return os.pwrite(fds[index], data, offset) if index < len(fds) else None
            case ("pread", int(index), int(offset)):
                return os.pread(fds[index], 4096, offset) if index < len(fds) else None
            case ("ftruncate", int(index), int(size)):
                if index < len(fds):
                    os.ftruncate(fds[index], size)
                return None
            case ("fsync", int(index)):
                if index < len(fds):
                    os.fsync(fds[index])
                return None
    except OSError as exc:
        return ("errno", kind, exc.errno)
    raise AssertionError(f"unknown op {op}")


def _observe(root: Path, times: bool = True) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = (
                    "file",
                    st.st_mode,
                    st.st_uid,
                    "security.capability" in os.listxattr(path),
                    st.st_size,
                    st.st_nlink,
                    st.st_mtime_ns if times and st.st_mtime_ns < 10**18 else None,
                    path.read_bytes(),
                )
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["write-through", "writeback"])
def differential(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Client, str, Path, bool]]:
    runtime = tmp_path_factory.mktemp("diff") / "run"
    running = start_service(runtime, shards=1)
    client = Client(runtime)
    where = tmp_path_factory.mktemp("diffmnt")
    try:
        volume = client.create_volume("diff")
        client.mount(volume["id"], where, writeback=request.param)
        yield client, volume["id"], where, request.param
    finally:
        with contextlib.suppress(Exception):
            client.unmount(where)
        if is_mounted(str(where)):
            subprocess.run(["fusermount3", "-u", "-z", str(where)], check=False)
        client.close()
        running.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, max_size=30))
@example(ops=[("open", "a"), ("utime", "a", 0), ("truncate", "a", 0)])  # found by CI
@example(ops=[("write", "a", 0, b"x"), ("utime", "a", 0), ("truncate", "a", 1)])
@example(ops=[("open", "a"), ("utime", "a", 0), ("ftruncate", 0, 0)])
@example(ops=[("write", "a", 0, b"x"), ("chmod", "a", 0o6775), ("chown", "a", 1000)])
@example(ops=[("open", "a"), ("setcap", "a"), ("pwrite", 0, 1, b"y"), ("chmod", "a", 0o4755)])
def test_mount_matches_tmpfs(
    differential: tuple[Client, str, Path, bool], ops: list[tuple[object, ...]]
) -> None:
    client, volume, mnt, writeback = differential
    reference = Path(tempfile.mkdtemp(dir="/dev/shm"))
    work = mnt / f"case-{time.monotonic_ns()}"
    os.mkdir(work)
    mine: list[int] = []
    theirs: list[int] = []
    try:
        for op in ops:
            got = _apply(work, op, mine)
            want = _apply(reference, op, theirs)
            assert got == want, f"{op}: mount {got!r}, tmpfs {want!r}"
        # Under the writeback cache the kernel keeps file times itself (FUSE's rule),
        # so only the write-through mode is compared on them.
        assert _observe(work, times=not writeback) == _observe(reference, times=not writeback)
        os.sync()  # the kernel's cache written back: the shard must hold the same bytes
        for path in reference.rglob("*"):
            if path.is_file() and not path.is_symlink():
                rel = "/" + str(work.relative_to(mnt) / path.relative_to(reference))
                assert client.read(volume, rel) == path.read_bytes(), rel
    finally:
        for fd in mine + theirs:
            os.close(fd)
        shutil.rmtree(reference)
        shutil.rmtree(work)


def test_changes_by_other_clients_reach_the_mount_at_once(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("shared-view")
        vid = volume["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            (mnt / "conf").write_bytes(b"quality=80\n")
            os.sync()
            assert (mnt / "conf").read_bytes() == b"quality=80\n"  # now in the page cache
            assert not (mnt / "later").exists()  # a cached negative entry
            client.write(vid, "/conf", b"90", offset=8)
            client.write(vid, "/later", b"new")
            client.mkdir(vid, "/dir")
            assert (mnt / "conf").read_bytes() == b"quality=90\n"
            assert (mnt / "later").read_bytes() == b"new"
            assert (mnt / "dir").is_dir()
            client.rename(vid, "/later", "/dir/moved")
            assert not (mnt / "later").exists()
            assert (mnt / "dir" / "moved").read_bytes() == b"new"
            client.unlink(vid, "/conf")
            assert sorted(os.listdir(mnt)) == ["dir"]


def test_an_sdk_edit_moves_bytes_under_a_mount(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("edit-view")["id"]
        client.edit(vid, "/image.conf", 0, 0, b"quality=80\n")
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            assert (mnt / "image.conf").read_bytes() == b"quality=80\n"
            client.edit(vid, "/image.conf", 0, 0, b"format=webp\n")
            assert (mnt / "image.conf").read_bytes() == b"format=webp\nquality=80\n"


def test_base_drift_reaches_programs_as_eio_and_drops_stale_pages(
    service: Service, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "big.bin").write_bytes(b"a" * (16 << 20))
    with Client(service.runtime) as client:
        vid = client.create_volume("drift", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            with open(mnt / "big.bin", "rb") as f:
                assert f.read(4096) == b"a" * 4096  # now cached by the kernel
            (base / "big.bin").write_bytes(b"b" * (16 << 20))  # the live base changes
            with open(mnt / "big.bin", "rb") as f:
                f.seek(15 << 20)
                with pytest.raises(OSError) as drift:
                    f.read(4096)  # not cached: the shard sees the drift
            assert drift.value.errno == errno.EIO
            deadline = time.monotonic() + 30
            while True:  # the invalidation follows the error; old pages must go
                try:
                    with open(mnt / "big.bin", "rb") as f:
                        f.read(4096)
                except OSError as exc:
                    assert exc.errno == errno.EIO
                    break
                assert time.monotonic() < deadline, "stale pages outlived the drift"
                time.sleep(0.05)
