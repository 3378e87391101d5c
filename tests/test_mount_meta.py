"""Clean base metadata: LOOKUP, GETATTR, READLINK of untouched base entries answered by
the bridge from the base (native/bridge_meta.c), and everything else still the shard's.

Real anchors and mounts (root and /dev/fuse), every test with and without the
kernel's writeback cache.  The bridge's counters tell answers given from the base
(meta_answers) from LOOKUPs the shard answered; the differential test runs the
same operations, through the mount and by another client (the SDK), against a
tmpfs copy of a live base tree with nested directories and symlinks, comparing
metadata as well as bytes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slates import Client
from slates.base.live import LiveDirectory
from slates.core import ROOT_INO, Host, Volume
from slates.core.volume import base_ino
from slates.errors import SlatesError
from slates.fuse.bridge import PREFETCH_ENV, read_counters
from slates.node.fsops import run_fs_op
from tests.anchor_fixture import Service, service, start_service
from tests.test_mount import mounted
from tests.test_mount_clean_reads import MODES, live_mount
from tests.test_mount_prefetch import wait_for

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)


def counters(runtime: Path, volume: str) -> dict[str, int]:
    (path,) = runtime.glob(f"counters-{volume}-*")
    return read_counters(path)


def make_tree(root: Path, rng: random.Random, *, hard_link: bool = True) -> None:
    """Nested directories, files of a few sizes, symlinks and (optionally) a hard link."""
    for rel in ("a", "d/b", "d/e/c", "d/e/f"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.randbytes(rng.choice([1, 100, 4096, 5000])))
    os.symlink("a", root / "l")
    os.symlink("../a", root / "d" / "l2")
    if hard_link:
        os.link(root / "d" / "b", root / "d" / "e" / "hard")
    (root / "d" / "e" / "f").chmod(0o600)


def shape(path: Path) -> object:
    """What lstat shows that a mount must agree with tmpfs on (a directory's size and
    link count are the file system's own)."""
    try:
        s = os.lstat(path)
    except OSError as exc:
        return ("error", exc.errno)
    kind = stat.S_IFMT(s.st_mode)
    if kind == stat.S_IFDIR:
        return (kind, stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid)
    return (kind, stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid, s.st_size, s.st_nlink)


def listing(root: Path) -> dict[str, object]:
    """Every entry under root (relative path -> shape, content or link target)."""
    out: dict[str, object] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(root))
            out[rel] = shape(path)
            if path.is_symlink():
                out[rel + " ->"] = os.readlink(path)
            elif path.is_file():
                out[rel + " bytes"] = path.read_bytes()
    return out


@MODES
@pytest.mark.parametrize("prefetch", [False, True], ids=["lookups", "prefetched"])
def test_a_fresh_tree_is_stated_and_read_without_the_shard_binding_it(
    tmp_path: Path, writeback: bool, prefetch: bool
) -> None:
    """Looked up name by name (prefetch off: each a LOOKUP the bridge answers), or
    listed ahead by the bridge's prefetch (its READDIRPLUS answers them, and the
    kernel looks up only the name that does not exist): either way from the base."""
    base = tmp_path / "base"
    base.mkdir()
    make_tree(base, random.Random(1))
    if prefetch:
        # Entries changed within two seconds come in listings without attributes
        # (bridge_meta.c, changing()): let the tree settle.
        time.sleep(2.1)
    service = start_service(tmp_path / "run", env={PREFETCH_ENV: str(int(prefetch))})
    try:
        with Client(service.runtime) as client:
            vid = client.create_volume("meta", base=base)["id"]
            before = client.counters(vid)
            with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
                if prefetch:  # the walk lists the root, d and d/e
                    wait_for(lambda: counters(service.runtime, vid)["prefetches"] == 3)
                seen = counters(service.runtime, vid)
                names = ("a", "l", "d", "d/b", "d/l2", "d/e", "d/e/c", "d/e/f", "d/e/hard", "no")
                for rel in names:  # looked up one by one, as git status does
                    assert shape(mnt / rel) == shape(base / rel), rel
                    if (base / rel).is_symlink():
                        assert os.readlink(mnt / rel) == os.readlink(base / rel)
                    elif (base / rel).is_file():
                        s, b = os.lstat(mnt / rel), os.lstat(base / rel)
                        assert (s.st_ino, s.st_mtime_ns, s.st_ctime_ns) == (
                            b.st_ino,
                            b.st_mtime_ns,
                            b.st_ctime_ns,
                        )
                        assert (mnt / rel).read_bytes() == (base / rel).read_bytes()
                now = counters(service.runtime, vid)
                lookups = now.get("LOOKUP", 0) - seen.get("LOOKUP", 0)
                if prefetch:
                    assert lookups == 1, (seen, now)  # "no": a listing names what exists
                    assert now["meta_answers"] >= len(names) - 1
                else:
                    assert now["meta_answers"] - seen["meta_answers"] >= len(names) - 1
                    assert lookups >= len(names)
                # Every name was answered from the base: the shard bound none of them.
                assert client.counters(vid)["metadata_bytes"] == before["metadata_bytes"]
                # At most the root's attributes and its mark went to the shard.
                assert now["round_trips"] - seen["round_trips"] <= 2, (seen, now)
                assert listing(mnt) == listing(base)
                assert client.stat(vid, "/d/e/c")["size"] == (base / "d/e/c").stat().st_size
    finally:
        service.stop()


@MODES
def test_names_looked_up_before_their_directory_is_listed_are_listed_without_a_stat(
    tmp_path: Path, writeback: bool
) -> None:
    """git's lstat racing the walk: names a caller looked up before anyone listed
    their directory come in the listing without attributes (the kernel keeps the
    entries it has, so the bridge neither stats them again nor counts another
    reference); the other names come with theirs.  Afterwards no name needs a
    LOOKUP, the shard answered nothing, and everything reads as the base."""
    base = tmp_path / "base"
    (base / "d" / "sub").mkdir(parents=True)
    names = [f"f{i:02}" for i in range(20)]
    for i, name in enumerate(names):
        (base / "d" / name).write_bytes(b"x" * i)
    os.symlink("f01", base / "d" / "link")
    time.sleep(2.1)  # settled: a listing gives attributes (bridge_meta.c, changing())
    stated = [*names[::2], "link", "sub"]
    service = start_service(tmp_path / "run", env={PREFETCH_ENV: "0"})
    try:
        with Client(service.runtime) as client:
            vid = client.create_volume("held", base=base)["id"]
            with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
                for name in stated:  # one LOOKUP each
                    assert shape(mnt / "d" / name) == shape(base / "d" / name), name
                seen = counters(service.runtime, vid)
                assert sorted(os.listdir(mnt / "d")) == sorted(os.listdir(base / "d"))
                listed = counters(service.runtime, vid)
                assert listed.get("held_entries", 0) - seen.get("held_entries", 0) == len(stated), (
                    seen,
                    listed,
                )
                for name in os.listdir(base / "d"):  # all known now: held or listed
                    assert shape(mnt / "d" / name) == shape(base / "d" / name), name
                now = counters(service.runtime, vid)
                assert now.get("LOOKUP", 0) == listed.get("LOOKUP", 0), (listed, now)
                assert now["round_trips"] == seen["round_trips"], (seen, now)
                assert listing(mnt) == listing(base)
    finally:
        service.stop()


@MODES
def test_an_unlinked_file_held_open_keeps_its_inode_through_the_mount(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "d").mkdir()
    (base / "d" / "held").write_bytes(b"kept" * 3000)
    with Client(service.runtime) as client:
        vid = client.create_volume("held", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            fd = os.open(mnt / "d" / "held", os.O_RDWR)
            try:
                os.unlink(mnt / "d" / "held")
                assert not (mnt / "d" / "held").exists()
                assert os.fstat(fd).st_nlink == 0
                os.pwrite(fd, b"KEPT", 0)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 12000, 0) == b"KEPT" + b"kept" * 2999
                assert os.fstat(fd).st_size == 12000
            finally:
                os.close(fd)
            assert os.listdir(mnt / "d") == []
    assert (base / "d" / "held").read_bytes() == b"kept" * 3000


@MODES
def test_another_clients_changes_reach_names_the_bridge_answered(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    make_tree(base, random.Random(2))
    with Client(service.runtime) as client:
        vid = client.create_volume("others", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            assert shape(mnt / "d" / "e" / "c") == shape(base / "d" / "e" / "c")
            assert os.listdir(mnt / "d" / "e") is not None
            client.write(vid, "/d/new", b"fresh")  # a private name in a clean directory
            assert (mnt / "d" / "new").read_bytes() == b"fresh"
            client.unlink(vid, "/d/e/c")
            assert not (mnt / "d" / "e" / "c").exists()
            client.rename(vid, "/a", "/d/e/moved")
            assert not (mnt / "a").exists()
            assert (mnt / "d" / "e" / "moved").read_bytes() == (base / "a").read_bytes()
            client.mkdir(vid, "/d/e/sub")
            assert (mnt / "d" / "e" / "sub").is_dir()
            assert sorted(os.listdir(mnt / "d" / "e")) == ["f", "hard", "moved", "sub"]


def invalidated_past(runtime: Path, volume: str, invals: int) -> bool:
    """Whether the bridge's watches dropped more listings than `invals` so far."""
    return counters(runtime, volume).get("watch_invals", 0) > invals


@MODES
def test_a_directory_replaced_in_the_base_is_looked_up_by_its_path(
    service: Service, tmp_path: Path, writeback: bool
) -> None:
    """The bridge stats a clean directory's names from a fd it keeps of the base
    directory (native/bridge_dirfd.c).  Once the base directory at that path, or one
    above it, is moved away and another made in its place, a name is looked up in the
    new one, as the path says (and as the shard would), never in the old."""
    base = tmp_path / "base"
    base.mkdir()
    make_tree(base, random.Random(3))
    time.sleep(2.1)  # settled: the walk's listings carry attributes
    with Client(service.runtime) as client:
        vid = client.create_volume("moved", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            wait_for(lambda: counters(service.runtime, vid).get("prefetches", 0) == 3)
            seen = counters(service.runtime, vid)
            for rel in ("d/e/none", "d/none"):  # LOOKUPs from the kept fds of d/e and d
                assert shape(mnt / rel) == ("error", errno.ENOENT)
            now = counters(service.runtime, vid)
            assert now["dirfd_lookups"] - seen.get("dirfd_lookups", 0) == 2, (seen, now)
            for old, made in (("d/e", "d/e/first"), ("d", "d/e/second")):
                invals = counters(service.runtime, vid).get("watch_invals", 0)
                (base / old).rename(base / f"{old}-old")
                (base / made).parent.mkdir(parents=True, exist_ok=True)
                (base / made).write_bytes(b"made after the mount\n")
                wait_for(functools.partial(invalidated_past, service.runtime, vid, invals))
                assert shape(mnt / made) == shape(base / made), made
                assert (mnt / made).read_bytes() == b"made after the mount\n"
            # A fd opened again after the change serves the next names.
            seen = counters(service.runtime, vid)
            assert shape(mnt / "d/e/second-none") == ("error", errno.ENOENT)
            assert counters(service.runtime, vid)["dirfd_lookups"] > seen["dirfd_lookups"]


def names_under(root: Path) -> dict[str, list[str]]:
    """Each directory under root (relative) -> its sorted names."""
    return {os.path.relpath(top, root): sorted(dirs + files) for top, dirs, files in os.walk(root)}


@MODES
@pytest.mark.parametrize("moved", ["d/e", "d"])
def test_a_directory_renamed_in_the_base_lists_what_its_new_name_holds(
    service: Service, tmp_path: Path, writeback: bool, moved: str
) -> None:
    """The bridge numbers a base directory by its inode.  When the base renames a
    directory the mount has seen, untouched (and makes another in its place), the
    kernel finds the same number under the new name: the mount must list, look up and
    read there what the base now holds at that name, and at the old name what the new
    directory holds, down to the directories below it (their paths moved with it)."""
    base = tmp_path / "base"
    base.mkdir()
    make_tree(base, random.Random(4), hard_link=False)
    (base / "d" / "e" / "sub").mkdir()
    (base / "d" / "e" / "sub" / "deep").write_bytes(b"deep\n")
    time.sleep(2.1)  # settled: the walk's listings carry attributes
    with Client(service.runtime) as client:
        vid = client.create_volume("renamed", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt", writeback=writeback) as mnt:
            wait_for(lambda: counters(service.runtime, vid).get("prefetches", 0) == 4)
            assert names_under(mnt) == names_under(base)
            assert (mnt / "d/e/sub/deep").read_bytes() == b"deep\n"
            invals = counters(service.runtime, vid).get("watch_invals", 0)
            (base / moved).rename(base / f"{moved}-renamed")
            (base / "d/e/sub").mkdir(parents=True)
            (base / "d/e/sub/other").write_bytes(b"made after the mount\n")
            wait_for(functools.partial(invalidated_past, service.runtime, vid, invals))
            # The watch drops the kernel's entries as its events come (a moment):
            wait_for(lambda: names_under(mnt) == names_under(base), timeout=20)
            assert counters(service.runtime, vid)["moved_dirs"] > 0  # the numbers followed
            assert (mnt / "d/e/sub/other").read_bytes() == b"made after the mount\n"
            deep = Path(f"{moved}-renamed", "sub" if moved == "d/e" else "e/sub", "deep")
            assert (mnt / deep).read_bytes() == b"deep\n"
            assert shape(mnt / deep.parent.parent / "c") == shape(base / deep.parent.parent / "c")


# -- differential: a live base tree under the mount against a tmpfs copy -----------------

PATHS = ("a", "b", "l", "d/b", "d/x", "d/l2", "d/e", "d/e/c", "d/e/f", "d/e/hard", "d/e/g")
DATA = st.binary(min_size=1, max_size=6000)
OPS = st.one_of(
    st.tuples(st.just("stat"), st.sampled_from(PATHS)),
    st.tuples(st.just("readlink"), st.sampled_from(PATHS)),
    st.tuples(st.just("listdir"), st.sampled_from(("", "d", "d/e"))),
    st.tuples(st.just("read"), st.sampled_from(PATHS)),
    st.tuples(st.just("write"), st.sampled_from(PATHS), DATA),
    st.tuples(st.just("chmod"), st.sampled_from(PATHS), st.integers(0o400, 0o777)),
    st.tuples(st.just("rename"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("unlink"), st.sampled_from(PATHS)),
    st.tuples(st.just("rmdir"), st.sampled_from(PATHS)),
    st.tuples(st.just("mkdir"), st.sampled_from(PATHS)),
    st.tuples(st.just("link"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("symlink"), st.sampled_from(PATHS)),
    st.tuples(st.just("sdk_write"), st.sampled_from(PATHS), DATA),
    st.tuples(st.just("sdk_unlink"), st.sampled_from(PATHS)),
)


def _op(root: Path, op: tuple[Any, ...]) -> object:
    """One operation on one tree (the mount or the reference): a comparable outcome."""
    try:
        match op:
            case ("stat", p):
                return shape(root / p)
            case ("readlink", p):
                return os.readlink(root / p)
            case ("listdir", p):
                return sorted(os.listdir(root / p))
            case ("read", p):
                return (root / p).read_bytes()
            case ("write", p, data) | ("sdk_write", p, data):
                fd = os.open(root / p, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, 0)
                finally:
                    os.close(fd)
            case ("chmod", p, mode):
                os.chmod(root / p, mode)
                return None
            case ("rename", p, q):
                os.rename(root / p, root / q)
                return None
            case ("unlink", p) | ("sdk_unlink", p):
                os.unlink(root / p)
                return None
            case ("rmdir", p):
                os.rmdir(root / p)
                return None
            case ("mkdir", p):
                os.mkdir(root / p)
                return None
            case ("link", p, q):
                os.link(root / p, root / q, follow_symlinks=False)
                return None
            case ("symlink", p):
                os.symlink("target", root / p)
                return None
    except OSError as exc:
        return ("error", exc.errno)
    raise AssertionError(f"unknown op {op!r}")


def _sdk(client: Client, vid: str, case: str, reference: Path, op: tuple[Any, ...]) -> None:
    """Another client's change, made in the volume and in the reference alike (paths
    are not followed through symlinks by the SDK: those are left out)."""
    if (reference / op[1]).is_symlink():
        return
    want = _op(reference, op)
    path = f"/{case}/{op[1]}"
    try:
        if op[0] == "sdk_write":
            client.write(vid, path, op[2], offset=0, create=False)
        else:
            client.unlink(vid, path)
        outcome: object = None if op[0] == "sdk_unlink" else len(op[2])
    except SlatesError:
        outcome = "refused"
    assert (outcome == "refused") == isinstance(want, tuple), (op, want)


@pytest.fixture(scope="module", params=[False, True], ids=["write-through", "writeback"])
def live_tree_mount(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Client, str, Path, Path, bool, Path]]:
    top = tmp_path_factory.mktemp("metadiff")
    with live_mount(top, "metadiff", writeback=request.param) as (client, vid, base, mnt):
        yield client, vid, base, mnt, request.param, top / "run"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), ops=st.lists(OPS, max_size=16))
def test_a_live_base_tree_behaves_like_tmpfs(
    live_tree_mount: tuple[Client, str, Path, Path, bool, Path],
    seed: int,
    ops: list[tuple[Any, ...]],
) -> None:
    client, vid, base, mnt, writeback, runtime = live_tree_mount
    case = f"case-{time.monotonic_ns()}"
    reference = Path(tempfile.mkdtemp(dir="/dev/shm")) / case
    try:
        # A new base tree appears under the mount.  No base hard link: another client's
        # unlink of one name does not invalidate the other name's cached link count
        # (the shard's invalidations name the directory, not the inode).
        make_tree(base / case, random.Random(seed), hard_link=False)
        shutil.copytree(base / case, reference, symlinks=True)
        for op in ops:
            if op[0].startswith("sdk_"):
                if op[0] == "sdk_write" and writeback:
                    # Under the writeback cache the kernel keeps a regular file's size
                    # itself: another client's write that moves the end is not seen.
                    target = reference / op[1]
                    if not target.is_file() or target.is_symlink():
                        continue
                    data = op[2][: target.stat().st_size]
                    if not data:
                        continue
                    op = (op[0], op[1], data)
                _sdk(client, vid, case, reference, op)
                continue
            got = _op(mnt / case, op)
            want = _op(reference, op)
            assert got == want, f"seed {seed}: {op}: mount {got!r}, tmpfs {want!r}"
        os.sync()
        assert listing(mnt / case) == listing(reference), f"seed {seed}"
        # The new tree's own name, at least, was answered from the base.
        assert counters(runtime, vid)["meta_answers"] > 0
    finally:
        shutil.rmtree(reference.parent)


# -- the shard's side: the clean mark is a promise about every unlisted name (no mount) --

NAMES = ("a", "b", "c", "new")
MARK_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), st.sampled_from(NAMES)),
        st.tuples(st.just("chmod"), st.sampled_from(NAMES)),
        st.tuples(st.just("write"), st.sampled_from(NAMES)),
        st.tuples(st.just("create"), st.sampled_from(NAMES)),
        st.tuples(st.just("unlink"), st.sampled_from(NAMES)),
        st.tuples(st.just("rename"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    ),
    max_size=6,
)


def bridge_view(base: Path, name: str) -> dict[str, int] | None:
    """What native/bridge_meta.c answers for a name of a clean directory."""
    try:
        s = os.lstat(base / name)
    except FileNotFoundError:
        return None
    kind = stat.S_IFMT(s.st_mode)
    return {
        "ino": base_ino(s.st_ino),
        "st_ino": s.st_ino,
        "mode": s.st_mode,
        "nlink": 1 if kind == stat.S_IFDIR else s.st_nlink,
        "uid": s.st_uid,
        "gid": s.st_gid,
        "size": s.st_size if kind in (stat.S_IFREG, stat.S_IFLNK) else 0,
        "blocks": (s.st_size + 511) // 512 if kind == stat.S_IFREG else 0,
        "atime_ns": s.st_atime_ns,
        "mtime_ns": s.st_mtime_ns,
        "ctime_ns": s.st_ctime_ns,
        "rdev": 0,
    }


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=MARK_OPS)
def test_a_clean_mark_promises_what_the_volume_answers(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]]
) -> None:
    top = tmp_path_factory.mktemp("mark")
    for name in ("a", "b"):
        (top / name).write_bytes(name.encode() * 100)
    (top / "c").mkdir()
    live = LiveDirectory(str(top))
    try:
        volume = Volume.new(Host(), base=live)
        for op in ops:
            with contextlib.suppress(SlatesError):
                match op:
                    case ("lookup", name):
                        volume.lookup(ROOT_INO, name)
                    case ("chmod", name):
                        volume.setattr(volume.lookup(ROOT_INO, name).ino, mode=0o600)
                    case ("write", name):
                        volume.write(volume.lookup(ROOT_INO, name).ino, 0, b"x")
                    case ("create", name):
                        volume.create(ROOT_INO, name)
                    case ("unlink", name):
                        volume.unlink(ROOT_INO, name)
                    case ("rename", old, new):
                        volume.rename(ROOT_INO, old, ROOT_INO, new, 0)
        mark = run_fs_op(volume, "fs.getattr", {"ino": ROOT_INO}, 0).get("dir")
        private = volume.dir_info(ROOT_INO).whiteouts or any(
            base_ino(volume.getattr(item.ino).st_ino) != item.ino
            for item in volume.readdir(ROOT_INO)
            if item.ino
        )
        assert (mark is None) == bool(private), (ops, mark)
        if mark is None:
            return
        path, bound = mark
        assert path == b"/"
        for name in NAMES:  # an unlisted name is exactly its base entry, or absent
            want = bridge_view(top, name)
            try:
                got = run_fs_op(volume, "fs.getattr", {"ino": volume.lookup(ROOT_INO, name).ino}, 0)
            except SlatesError:
                assert want is None, (name, ops)
                continue
            if got["ino"] in bound:
                continue  # the bridge asks the shard for these
            assert want is not None and {k: got[k] for k in want} == want, (name, ops)
    finally:
        live.close()
