"""Clean base reads: READs of unchanged base files are served by the bridge from the base.

Real anchors and mounts (root and /dev/fuse).  The bridge's counters tell
READs served from the base (clean_reads) from those that went to the shard;
`posix_fadvise(DONTNEED)` drops a file's cached pages so the next read is a
READ the bridge must answer again.  Every test runs with and without the
kernel's writeback cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slates._native import lib

from slates import Client
from slates.base.live import LiveDirectory
from slates.core import ROOT_INO, Host, Volume
from slates.errors import SlatesError
from slates.fuse.bridge import read_counters
from slates.node.fsops import run_fs_op
from tests.anchor_fixture import Service, service, start_service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

MODES = pytest.mark.parametrize("writeback", [False, True], ids=["write-through", "writeback"])


def counters(service: Service, volume: str) -> dict[str, int]:
    (path,) = service.runtime.glob(f"counters-{volume}-*")
    return read_counters(path)


def uncached_read(path: Path) -> bytes:
    """The file's bytes with its cached pages dropped first: the kernel sends READs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def make_tree(base: Path, seed: int) -> dict[str, bytes]:
    """Files of awkward sizes (page edges, more than one READ) in nested directories."""
    rng = random.Random(seed)
    sizes = [1, 17, 4095, 4096, 4097, 65536, 300_001, (1 << 20) + 3, (3 << 20) + 5]
    files: dict[str, bytes] = {}
    for i, size in enumerate(sizes):
        rel = f"d{i % 3}/sub{i % 2}/f{i}.bin"
        files[rel] = rng.randbytes(size)
    files["top.txt"] = b"hello base\n"
    files["empty"] = b""
    for rel, data in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    odd = os.fsencode(str(base)) + b"/caf\xe9-latin1.txt"  # not UTF-8
    with open(odd, "wb") as f:
        f.write(b"odd name\n")
    return files


def test_the_clean_table_records_nothing_across_an_invalidation() -> None:
    """A reply taught after an invalidation ran is not recorded (the watcher's race)."""
    assert lib.bridge_test_clean_since(40, 0) == 1
    assert lib.bridge_test_clean_since(40, 1) == 0


@MODES
def test_a_base_tree_reads_without_the_shard(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    seed = random.randrange(1 << 32)
    base = tmp_path / "base"
    files = make_tree(base, seed)
    with Client(service.runtime) as client:
        vid = client.create_volume("clean", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            for rel, data in files.items():
                assert (mnt / rel).read_bytes() == data, (rel, seed)
            odd = os.fsencode(str(mnt)) + b"/caf\xe9-latin1.txt"
            with open(odd, "rb") as f:
                assert f.read() == b"odd name\n"
            seen = counters(service, vid)
    assert seen.get("READ", 0) >= len(files), (seen, seed)
    # Every READ the kernel sent was answered from the base; none reached the shard.
    assert seen["clean_reads"] == seen["READ"], (seen, seed)
    assert seen["clean_misses"] == 0, (seen, seed)


@MODES
def test_writes_through_the_mount_are_read_back(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "conf").write_bytes(b"quality=80\ncache=off\n")
    (base / "log").write_bytes(b"one\n")
    (base / "blob").write_bytes(b"a" * 10000)
    (base / "cut").write_bytes(b"b" * 10000)
    with Client(service.runtime) as client:
        vid = client.create_volume("edits", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            for name in ("conf", "log", "blob", "cut"):
                assert uncached_read(mnt / name) == (base / name).read_bytes()
            subprocess.run(["sed", "-i", "s/80/90/", str(mnt / "conf")], check=True)
            with open(mnt / "log", "ab") as f:
                f.write(b"two\n")
            with open(mnt / "blob", "r+b") as f:  # same size, same file: only the bytes change
                f.seek(5000)
                f.write(b"XYZ")
            os.truncate(mnt / "cut", 3000)
            os.sync()
            assert uncached_read(mnt / "conf") == b"quality=90\ncache=off\n"
            assert uncached_read(mnt / "log") == b"one\ntwo\n"
            assert uncached_read(mnt / "blob") == b"a" * 5000 + b"XYZ" + b"a" * 4997
            assert uncached_read(mnt / "cut") == b"b" * 3000
            assert client.read(vid, "/blob") == b"a" * 5000 + b"XYZ" + b"a" * 4997
    assert (base / "conf").read_bytes() == b"quality=80\ncache=off\n"  # the base is untouched
    assert (base / "blob").read_bytes() == b"a" * 10000


@MODES
def test_an_sdk_write_reads_through_the_mount_at_once(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "image.conf").write_bytes(b"quality=80\n" * 1000)
    with Client(service.runtime) as client:
        vid = client.create_volume("sdk", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            assert uncached_read(mnt / "image.conf") == b"quality=80\n" * 1000
            before = counters(service, vid)["clean_reads"]
            assert before > 0
            client.write(vid, "/image.conf", b"99", offset=8)
            expected = b"quality=99\n" + b"quality=80\n" * 999
            assert (mnt / "image.conf").read_bytes() == expected
            assert uncached_read(mnt / "image.conf") == expected
            assert counters(service, vid)["clean_reads"] == before  # the shard answered


@MODES
def test_a_base_file_changed_on_disk_is_drift_as_before(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "inplace").write_bytes(b"a" * 8192)
    (base / "replaced").write_bytes(b"c" * 8192)
    with Client(service.runtime) as client:
        vid = client.create_volume("drift", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            assert uncached_read(mnt / "inplace") == b"a" * 8192
            assert uncached_read(mnt / "replaced") == b"c" * 8192
            with open(base / "inplace", "r+b") as f:  # same inode, new mtime
                f.write(b"b" * 8192)
            (base / "replaced.new").write_bytes(b"d" * 8192)
            os.rename(base / "replaced.new", base / "replaced")  # a new inode at the path
            for name in ("inplace", "replaced"):
                with pytest.raises(OSError) as drift:
                    uncached_read(mnt / name)
                assert drift.value.errno == errno.EIO, name
            assert counters(service, vid)["clean_misses"] >= 1


@MODES
def test_a_base_file_swapped_for_a_symlink_is_not_followed(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "secret").write_bytes(b"x" * 100)
    shadow = Path("/etc/shadow").read_bytes()
    with Client(service.runtime) as client:
        vid = client.create_volume("swap", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            assert uncached_read(mnt / "secret") == b"x" * 100  # looked up and taught
            (base / "secret").unlink()
            (base / "secret").symlink_to("/etc/shadow")
            with pytest.raises(OSError) as drift:
                got = uncached_read(mnt / "secret")
                assert got != shadow
            assert drift.value.errno == errno.EIO


@MODES
def test_an_unlinked_file_held_open_still_reads(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "held").write_bytes(b"kept" * 5000)
    with Client(service.runtime) as client:
        vid = client.create_volume("held", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            fd = os.open(mnt / "held", os.O_RDONLY)
            try:
                client.unlink(vid, "/held")
                assert not (mnt / "held").exists()
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 20000, 0) == b"kept" * 5000
            finally:
                os.close(fd)
    assert (base / "held").exists()


# -- differential: a live base under the mount against a tmpfs copy of it ------------

NAMES = ("f0", "f1", "f2", "f3")
SIZES = st.sampled_from([1, 100, 4095, 4096, 4097, 20_000, 70_001])
OFFSETS = st.integers(0, 80_000)
DATA = st.binary(min_size=1, max_size=9000)
FILE_OPS = st.one_of(
    st.tuples(st.just("read"), st.sampled_from(NAMES)),
    st.tuples(st.just("pread"), st.sampled_from(NAMES), OFFSETS, st.integers(1, 70_000)),
    st.tuples(st.just("pwrite"), st.sampled_from(NAMES), OFFSETS, DATA),
    st.tuples(st.just("append"), st.sampled_from(NAMES), DATA),
    st.tuples(st.just("truncate"), st.sampled_from(NAMES), OFFSETS),
    st.tuples(st.just("rename"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("unlink"), st.sampled_from(NAMES)),
    st.tuples(st.just("sdk_write"), st.sampled_from(NAMES), OFFSETS, DATA),
)


def _file_op(root: Path, op: tuple[Any, ...]) -> object:
    """One operation on one tree (the mount or the reference): a comparable outcome."""
    try:
        match op:
            case ("read", name):
                return uncached_read(root / name)
            case ("pread", name, offset, size):
                fd = os.open(root / name, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return os.pread(fd, size, offset)
                finally:
                    os.close(fd)
            case ("pwrite", name, offset, data) | ("sdk_write", name, offset, data):
                fd = os.open(root / name, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)
            case ("append", name, data):
                with open(root / name, "ab") as f:
                    return f.write(data)
            case ("truncate", name, size):
                os.truncate(root / name, size)
                return None
            case ("rename", old, new):
                os.rename(root / old, root / new)
                return None
            case ("unlink", name):
                os.unlink(root / name)
                return None
    except OSError as exc:
        return ("error", exc.errno)
    raise AssertionError(f"unknown op {op!r}")


@contextlib.contextmanager
def live_mount(
    top: Path, name: str, *, writeback: bool
) -> Iterator[tuple[Client, str, Path, Path]]:
    """A service of its own and a volume over an empty live base, mounted: (client,
    volume id, base, mount); the tests add base files as they go."""
    base = top / "base"
    base.mkdir()
    running = start_service(top / "run")
    client = Client(running.runtime)
    try:
        vid = client.create_volume(name, base=base)["id"]
        with mounted(client, vid, top / "mnt", writeback=writeback) as mnt:
            yield client, vid, base, mnt
    finally:
        client.close()
        running.stop()


@pytest.fixture(scope="module", params=[False, True], ids=["write-through", "writeback"])
def live_base_mount(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Client, str, Path, Path, bool]]:
    top = tmp_path_factory.mktemp("cleandiff")
    with live_mount(top, "cleandiff", writeback=request.param) as (client, vid, base, mnt):
        yield client, vid, base, mnt, request.param


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(SIZES, min_size=4, max_size=4), ops=st.lists(FILE_OPS, max_size=20))
def test_a_live_base_reads_like_tmpfs(
    live_base_mount: tuple[Client, str, Path, Path, bool],
    sizes: list[int],
    ops: list[tuple[Any, ...]],
) -> None:
    client, vid, base, mnt, writeback = live_base_mount
    case = f"case-{time.monotonic_ns()}"
    reference = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (base / case).mkdir()  # a new base directory appears under the live mount
        for name, size in zip(NAMES, sizes, strict=True):
            data = random.Random(f"{case}{name}").randbytes(size)
            (base / case / name).write_bytes(data)
            (reference / name).write_bytes(data)
        for op in ops:
            if op[0] == "sdk_write":
                _tag, name, offset, data = op
                if writeback and (reference / name).exists():
                    # Under the writeback cache the kernel keeps a regular file's size
                    # itself (FUSE's rule): another client's write that moves the end
                    # is not seen by the mount, with or without clean reads.  Here the
                    # SDK writes only inside the file.
                    size = (reference / name).stat().st_size
                    data = data[: max(0, size - offset)]
                    if not data:
                        continue
                    op = (_tag, name, offset, data)
                want = _file_op(reference, op)
                outcome = "written"
                try:
                    client.write(vid, f"/{case}/{name}", data, offset=offset, create=False)
                except SlatesError:
                    outcome = "refused"
                assert (outcome == "refused") == (want == ("error", errno.ENOENT)), op
                continue
            got = _file_op(mnt / case, op)
            want = _file_op(reference, op)
            assert got == want, f"{op}: mount {got!r}, tmpfs {want!r}"
        os.sync()
        for path in reference.iterdir():
            assert uncached_read(mnt / case / path.name) == path.read_bytes(), path.name
            assert client.read(vid, f"/{case}/{path.name}") == path.read_bytes(), path.name
        assert sorted(os.listdir(mnt / case)) == sorted(os.listdir(reference))
    finally:
        shutil.rmtree(reference)


# -- the shard's side: which ATTRs name a clean base file (no mount) -----------------

VOLUME_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 3 * 4096), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("truncate"), st.sampled_from([0, 1, 4096, 9000, 9001, 3 * 4096])),
        st.tuples(st.just("punch"), st.integers(0, 2 * 4096), st.integers(1, 4096)),
        st.tuples(st.just("chmod"), st.integers(0, 0o777)),
        st.tuples(st.just("seal")),
        st.tuples(st.just("rename")),
    ),
    max_size=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(size=st.sampled_from([0, 1, 4096, 9000]), ops=VOLUME_OPS)
def test_an_attr_names_its_base_file_only_while_the_bytes_are_the_base_files(
    tmp_path_factory: pytest.TempPathFactory, size: int, ops: list[tuple[Any, ...]]
) -> None:
    top = tmp_path_factory.mktemp("attrs")
    data = random.Random(size).randbytes(size)
    (top / "file").write_bytes(data)
    live = LiveDirectory(str(top))
    try:
        volume = Volume.new(Host(), base=live)
        ino = volume.lookup(ROOT_INO, "file").ino
        touched = False  # a write or hole over the base bytes, or a cut into them
        untouched = True  # nothing but metadata, renames, seals, growing and shrinking back
        now_size = size
        current = "file"
        for op in ops:
            match op:
                case ("write", offset, chunk):
                    volume.write(ino, offset, chunk)
                    touched = touched or offset < size
                    untouched = False
                case ("truncate", new_size):  # growing and shrinking back restores it
                    volume.truncate(ino, new_size)
                    touched = touched or new_size < size
                    now_size = new_size
                case ("punch", offset, length):
                    if offset < size:
                        volume.punch_hole(ino, offset, length)
                        touched = True
                        untouched = False
                case ("chmod", mode):
                    volume.setattr(ino, mode=mode)
                case ("seal",):
                    volume.seal()
                case ("rename",):  # a renamed clean file still reads its base path
                    new = "moved" if current == "file" else "file"
                    volume.rename(ROOT_INO, current, ROOT_INO, new, 0)
                    current = new
        reply = run_fs_op(volume, "fs.getattr", {"ino": ino}, 0)
        if size == 0 or touched or now_size != size:
            assert "base" not in reply, (reply, ops)
        elif untouched:
            assert "base" in reply, (reply, ops)
        if "base" in reply:  # sound: the bytes are the base file's, under that fingerprint
            path, dev, st_ino, pinned_size, mtime_ns = reply["base"]
            st = os.stat(os.fsencode(str(top)) + path)
            assert (dev, st_ino, pinned_size, mtime_ns) == (
                st.st_dev,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
            assert volume.read(ino, 0, size + 1) == data == (top / "file").read_bytes()
        assert run_fs_op(volume, "fs.base", {}, 0) == {
            "root": os.fsencode(str(top)),
            "dev": live.identity[0],
            "ino": live.identity[1],
        }
    finally:
        live.close()
