"""Directory prefetch (native/bridge_prefetch.c): once a mount serves, the bridge lists
its clean directories through the mount, so the kernel learns their entries from
READDIRPLUS and a caller's lstat of each name needs no LOOKUP.

The listings it read are kept (no READDIRPLUS when a caller lists a walked
directory), and follow the live base: the bridge watches each clean directory it
lists (native/bridge_watch.c) and drops the kernel's listing when a name is
created, removed or moved there; names the kernel already holds keep BaseDrift's
rules.

Real anchors and mounts (root and /dev/fuse).  What is checked is what a user can
tell: names stated and directories listed after the walk cost no LOOKUP, no
READDIRPLUS and no shard request; small files read ahead then cost no READ and no
GETATTR (and a base file changed after its read-ahead reads as before, then as
drift once its pages are dropped); names added, removed and renamed in the base
after the walk show in listings, however often the directory was listed before;
the walk stops at its budget and lists nothing on demand; past a bound, files
are read ahead only for callers who read; changes made in the
mount while the walk runs end exactly as on tmpfs; an unmount in the middle of a
walk is clean, and so is a user's umount(8) then (never "target is busy").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slates import Client
from slates.fuse.bridge import READAHEAD_ENV, WALK_ENV, read_counters
from slates.node.anchor import is_mounted
from slates.node.mounts import exited_unreaped
from tests.anchor_fixture import Service, service, start_service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

WALK_ENTRIES = 2048  # the budget the budget test gives its bridges ($SLATES_BRIDGE_WALK_ENTRIES)
# Directories given to readers and not yet listed when the budget is crossed: one
# reader a CPU (PREFETCH_READERS_MAX 4), each holding PREFETCH_QUEUE 4 jobs.
IN_FLIGHT = min(os.cpu_count() or 1, 4) * 4


def counters(runtime: Path, volume: str) -> dict[str, int]:
    (path,) = runtime.glob(f"counters-{volume}-*")
    return read_counters(path)


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def settled(runtime: Path, volume: str) -> int:
    """Wait until the walk has listed no new directory and read no file ahead for a
    while; how many directories it listed."""
    last, since = (-1, -1), time.monotonic()
    while time.monotonic() - since < 0.5:
        seen = counters(runtime, volume)
        now = (seen.get("prefetches", 0), seen.get("readaheads", 0))
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.02)
    return last[0]


@contextlib.contextmanager
def walked(runtime: Path, name: str, base: Path, where: Path) -> Iterator[tuple[str, Path]]:
    """A fresh volume over `base`, mounted at `where`, once its walk has settled."""
    with Client(runtime) as client:
        vid = client.create_volume(name, base=base)["id"]
        with mounted(client, vid, where) as mnt:
            settled(runtime, vid)
            yield vid, mnt


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
    ]


_CACHESTAT = 451  # x86_64 and aarch64 (Linux 6.5)


def cached_pages(fd: int) -> tuple[int, int]:
    """The file's pages in the page cache, and those evicted (cachestat(2)).

    This host reclaims cold pages by itself (DAMON's "pageout" scheme, kdamond), so
    a page read ahead may be gone by the time a test reads it; a test that counts
    READs asks first."""
    libc = ctypes.CDLL(None, use_errno=True)
    span, stat_ = _CachestatRange(0, 0), _Cachestat()
    if libc.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat_), 0) != 0:
        raise OSError(ctypes.get_errno(), "cachestat")
    return stat_.cache, stat_.evicted


def make_tree(root: Path, dirs: int, files: int) -> list[str]:
    """dirs directories of files small files each (two levels), in index order."""
    names: list[str] = []
    for d in range(dirs):
        sub = root / f"top{d % 4}" / f"dir{d:03}"
        sub.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            (sub / f"f{f:03}.c").write_bytes(f"{d}/{f}\n".encode())
            names.append(f"top{d % 4}/dir{d:03}/f{f:03}.c")
    # A base entry changed within two seconds may be changing still: listings give
    # it without attributes (bridge_meta.c, changing()).  This tree has settled.
    time.sleep(2.1)
    return sorted(names)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    base = tmp_path / "base"
    yield base, make_tree(base, 12, 25)


def test_names_stated_after_the_walk_need_no_lookup_and_no_shard(
    service: Service, tree: tuple[Path, list[str]], tmp_path: Path
) -> None:
    base, names = tree
    with Client(service.runtime) as client:
        vid = client.create_volume("walked", base=base)["id"]
        before = client.counters(vid)
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            listed = settled(service.runtime, vid)
            assert listed == 1 + 4 + 12  # the root, top0..3 and every dirNNN
            seen = counters(service.runtime, vid)
            for rel in names:  # as git status's preload threads do
                st, b = os.lstat(mnt / rel), os.lstat(base / rel)
                assert (st.st_size, st.st_ino, st.st_mtime_ns) == (
                    b.st_size,
                    b.st_ino,
                    b.st_mtime_ns,
                )
            for where in sorted({str(Path(rel).parent) for rel in names}):  # as find does
                assert sorted(os.listdir(mnt / where)) == sorted(os.listdir(base / where))
            now = counters(service.runtime, vid)
            assert now.get("LOOKUP", 0) == seen.get("LOOKUP", 0), (seen, now)
            assert now.get("READDIRPLUS", 0) == seen.get("READDIRPLUS", 0), (seen, now)
            assert now["round_trips"] == seen["round_trips"]
            # The walk's entries are the bridge's: the shard bound none of them.
            assert client.counters(vid)["metadata_bytes"] == before["metadata_bytes"]
            assert (mnt / names[7]).read_bytes() == (base / names[7]).read_bytes()


def listed_as_base(mnt: Path, base: Path, where: Path | str) -> Callable[[], bool]:
    """Whether the mount lists `where` as the base does: the bridge's watch drops a
    kept listing as soon as inotify tells it (asynchronously: waited for)."""
    return lambda: sorted(os.listdir(mnt / where)) == sorted(os.listdir(base / where))


def test_kept_listings_follow_the_live_base(
    service: Service, tree: tuple[Path, list[str]], tmp_path: Path
) -> None:
    base, names = tree
    with Client(service.runtime) as client:
        vid = client.create_volume("relist", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            settled(service.runtime, vid)
            where, other = Path(names[0]).parent, Path(names[-1]).parent
            for _ in range(2):  # kept: listed again from the kernel's copy
                assert listed_as_base(mnt, base, where)()
            (base / where / "added.c").write_bytes(b"new\n")  # after the walk listed it
            (base / "added-top").mkdir()
            wait_for(listed_as_base(mnt, base, where), 10)
            assert (mnt / where / "added.c").read_bytes() == b"new\n"
            wait_for(listed_as_base(mnt, base, ""), 10)
            assert (mnt / "added-top").is_dir()
            # Removed and replaced in the base: the listing follows at once (what the
            # kernel already holds of those names keeps BaseDrift's rules, as before:
            # tests/test_mount_clean_reads.py).
            gone, replaced = base / names[-1], base / names[-2]
            gone.unlink()
            replaced.with_name("new.c").write_bytes(b"replacement\n")
            os.rename(replaced.with_name("new.c"), replaced)
            wait_for(listed_as_base(mnt, base, other), 10)
            # A directory added after the walk is watched once listed: a directory
            # made and removed in it shows in its listing and goes.
            assert os.listdir(mnt / "added-top") == []
            (base / "added-top" / "inner").mkdir()
            wait_for(listed_as_base(mnt, base, "added-top"), 10)
            assert (mnt / "added-top" / "inner").is_dir()
            (base / "added-top" / "inner").rmdir()
            wait_for(listed_as_base(mnt, base, "added-top"), 10)
            (base / "added-top").rename(base / "renamed-top")
            wait_for(listed_as_base(mnt, base, ""), 10)
            assert (mnt / "renamed-top").is_dir()
            assert counters(service.runtime, vid).get("watch_invals", 0) >= 6


def test_the_walk_stops_at_its_budget_and_lists_nothing_on_demand(tmp_path: Path) -> None:
    """Past its budget the walk stops, and a directory it left costs its LOOKUPs as
    without prefetch: listing each directory a caller enters raced that caller's own
    lookups of the same names (bench/RESULTS.md, the 100,000-file tree).  The budget
    is set small here ($SLATES_BRIDGE_WALK_ENTRIES), so a small tree passes it."""
    base = tmp_path / "base"
    names = make_tree(base, 40, 100)  # 4,000 files: past this walk's budget
    dirs = sorted({str(Path(rel).parent) for rel in names})
    small = start_service(tmp_path / "run", env={WALK_ENV: str(WALK_ENTRIES)})
    try:
        walk_past_its_budget(small, base, dirs, tmp_path / "mnt")
    finally:
        small.stop()


def walk_past_its_budget(service: Service, base: Path, dirs: list[str], mountpoint: Path) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("big", base=base)["id"]
        with mounted(client, vid, mountpoint) as mnt:
            listed = settled(service.runtime, vid)
            assert 5 < listed < 1 + 4 + len(dirs)  # it stopped near WALK_ENTRIES entries
            # The one that crossed it, and those already given to readers then.
            assert (listed - 5) * 102 <= WALK_ENTRIES + IN_FLIGHT * 102
            # Find a directory the walk left: its first name costs a LOOKUP.
            for where in dirs:
                before = counters(service.runtime, vid).get("LOOKUP", 0)
                os.lstat(mnt / where / "f000.c")
                if counters(service.runtime, vid).get("LOOKUP", 0) > before:
                    break
            else:
                raise AssertionError("the walk listed every directory")
            seen = counters(service.runtime, vid)
            for f in range(1, 100):
                st, b = os.lstat(mnt / where / f"f{f:03}.c"), os.lstat(base / where / f"f{f:03}.c")
                assert (st.st_ino, st.st_size) == (b.st_ino, b.st_size)
            now = counters(service.runtime, vid)
            assert now.get("LOOKUP", 0) - seen.get("LOOKUP", 0) == 99
            assert settled(service.runtime, vid) == listed


def test_changes_made_while_the_walk_runs_end_as_on_tmpfs(service: Service, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    base = tmp_path / "base"
    names = make_tree(base, 60, 60)
    reference = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        shutil.copytree(base, reference / "t", symlinks=True)
        with Client(service.runtime) as client:
            vid = client.create_volume("racing", base=base)["id"]
            with mounted(client, vid, tmp_path / "mnt") as mnt:
                for step in range(120):  # at once, while the walk lists the tree
                    for root in (mnt, reference / "t"):
                        _change(root, names, step, random.Random(f"{seed}-{step}"))
                assert _tree(mnt) == _tree(reference / "t"), f"seed {seed}"
                settled(service.runtime, vid)
                assert _tree(mnt) == _tree(reference / "t"), f"seed {seed}"
    finally:
        shutil.rmtree(reference)


def _change(root: Path, names: list[str], step: int, rng: random.Random) -> None:
    rel = rng.choice(names)
    kind = rng.choice(["write", "patch", "unlink", "rename-dir", "create", "mkdir"])
    target = root / rel
    if kind == "write" and target.exists():
        target.write_bytes(rng.randbytes(rng.choice([0, 10, 5000])))
    elif kind == "patch" and target.exists():  # in place, as the read-ahead may read it
        with open(target, "r+b") as f:
            f.seek(rng.choice([0, 1, 4095]))
            f.write(rng.randbytes(rng.choice([1, 3, 4097])))
    elif kind == "unlink" and target.exists():
        target.unlink()
    elif kind == "rename-dir" and target.parent.exists():
        target.parent.rename(target.parent.with_name(f"{target.parent.name}-r{step}"))
    elif kind == "create" and target.parent.exists():
        (target.parent / f"new{step}.c").write_bytes(b"made\n")
    elif kind == "mkdir" and target.parent.exists():
        (target.parent / f"sub{step}").mkdir()


def _tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs:
            out[str(Path(top, name).relative_to(root))] = None
        for name in files:
            path = Path(top, name)
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def test_small_files_are_read_ahead_so_reading_and_stating_them_costs_nothing(
    service: Service, tree: tuple[Path, list[str]], tmp_path: Path
) -> None:
    base, names = tree
    (base / "big.bin").write_bytes(b"b" * (300 << 10))  # past PREFETCH_FILE_MAX
    (base / ".git" / "objects").mkdir(parents=True)
    (base / ".git" / "objects" / "blob").write_bytes(b"git's own\n")
    (base / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    time.sleep(2.1)  # settled (bridge_meta.c, changing())
    with walked(service.runtime, "ahead", base, tmp_path / "mnt") as (vid, mnt):
        seen = counters(service.runtime, vid)
        assert seen["readaheads"] == len(names), seen  # not big.bin, nothing of .git
        reclaimed = 0
        for rel in names:  # as grep -r does: open, fstat, read to the end
            with open(mnt / rel, "rb") as f:
                st = os.fstat(f.fileno())
                cached, _evicted = cached_pages(f.fileno())
                before = counters(service.runtime, vid).get("READ", 0)
                assert f.read() == (base / rel).read_bytes(), rel
                if cached == 0:  # the host reclaimed the pages read ahead (see cached_pages)
                    reclaimed += 1
                else:
                    assert counters(service.runtime, vid).get("READ", 0) == before, rel
            assert st.st_size == (base / rel).stat().st_size
        assert reclaimed <= len(names) // 10, f"{reclaimed} of {len(names)} files were not cached"
        now = counters(service.runtime, vid)
        for kind in ("GETATTR", "LOOKUP", "round_trips"):
            assert now.get(kind, 0) == seen.get(kind, 0), (kind, seen, now)
        assert (mnt / "big.bin").read_bytes() == b"b" * (300 << 10)
        assert (mnt / ".git" / "objects" / "blob").read_bytes() == b"git's own\n"
        assert counters(service.runtime, vid)["READ"] > now.get("READ", 0)


def test_read_ahead_can_be_turned_off(tree: tuple[Path, list[str]], tmp_path: Path) -> None:
    base, names = tree
    off = start_service(tmp_path / "run", env={READAHEAD_ENV: "0"})
    try:
        with Client(off.runtime) as client:
            vid = client.create_volume("not-ahead", base=base)["id"]
            with mounted(client, vid, tmp_path / "mnt") as mnt:
                listed = settled(off.runtime, vid)
                assert listed == 1 + 4 + 12  # the listings still are
                seen = counters(off.runtime, vid)
                assert seen.get("readaheads", 0) == 0 and seen.get("READ", 0) == 0, seen
                assert (mnt / names[0]).read_bytes() == (base / names[0]).read_bytes()
                assert counters(off.runtime, vid)["READ"] == 1
    finally:
        off.stop()


def test_a_base_file_changed_after_it_was_read_ahead_is_drift_once_its_pages_go(
    service: Service, tree: tuple[Path, list[str]], tmp_path: Path
) -> None:
    base, names = tree
    with walked(service.runtime, "ahead-drift", base, tmp_path / "mnt") as (_vid, mnt):
        rel = names[0]
        original = (base / rel).read_bytes()
        # Read now, so the host's reclaim (see cached_pages) has not taken the pages
        # read ahead, or takes them back in, before the base changes.
        assert (mnt / rel).read_bytes() == original
        with open(base / rel, "r+b") as f:  # same inode, new bytes and mtime
            f.write(b"X" * len(original))
        # The pages read ahead are the original's, as a read before the change
        # would have left them; once they are dropped, BaseDrift rules as before.
        assert (mnt / rel).read_bytes() == original
        fd = os.open(mnt / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with pytest.raises(OSError) as drift:
                os.read(fd, 1 << 16)
            assert drift.value.errno == errno.EIO
        finally:
            os.close(fd)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a bridge's: its prefetch readers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def bridge_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or exited_unreaped(pid)


@pytest.mark.parametrize("how", ["slates unmount", "umount(8)"])
def test_an_unmount_in_the_middle_of_a_walk_is_clean(
    service: Service, tmp_path: Path, how: str
) -> None:
    """Unmounted while the walk runs, through Slates or by a user's umount(8): nothing
    stays mounted or listed, and the bridge exits.  umount(8) refuses a mount that
    anything holds open, even for a moment; the walk's readers hold the mount's
    directories and files open a moment at a time, but beneath a detached clone of
    the mount, and the bridge watches the mount table without touching the
    mountpoint, so a user's umount succeeds whether it comes while a reader walks
    or the instant the mount returns."""
    base = tmp_path / "base"
    make_tree(base, 100, 100)
    with Client(service.runtime) as client:
        vid = client.create_volume("cut", base=base)["id"]
        for round_ in range(3 if how == "slates unmount" else 20):
            where = tmp_path / f"mnt{round_}"
            where.mkdir()
            bridge = int(client.mount(vid, where)["pid"])
            try:
                if how == "slates unmount":
                    client.unmount(where)  # the walk has barely begun
                else:
                    if round_ < 3:
                        wait_for(lambda: children_of(bridge) != [])  # noqa: B023 (a reader walks)
                    done = subprocess.run(["umount", str(where)], capture_output=True, text=True)
                    assert done.returncode == 0, (round_, done.stderr)
                assert not is_mounted(str(where)) and os.listdir(where) == []
                wait_for(lambda: client.mounts() == [], 30)
                assert not Path(f"/proc/{bridge}").exists() or exited_unreaped(bridge)
            finally:
                if is_mounted(str(where)):
                    subprocess.run(["umount", "-l", str(where)], check=False)
        leftover = subprocess.run(["mount"], capture_output=True, text=True, check=True).stdout
        assert str(tmp_path) not in leftover


def test_another_mounts_umount_ends_it_while_this_mount_walks(
    service: Service, tmp_path: Path
) -> None:
    """The walk's readers hold only their own mount (a detached clone of it), never a
    copy of the host's others: another volume, mounted before them and unmounted by a
    user's umount(8) while they walk, has its bridge exit at once, not when this walk
    ends.  The readers are stopped (SIGSTOP) for the while, so the walk cannot end
    first; a reader in a mount namespace of its own would keep the other mount's
    connection, and its bridge, alive until then."""
    base = tmp_path / "base"
    make_tree(base, 100, 100)
    small = tmp_path / "small"
    small.mkdir()
    (small / "f").write_bytes(b"f\n")
    with Client(service.runtime) as client:
        other = client.create_volume("other", base=small)["id"]
        elsewhere = tmp_path / "other"
        elsewhere.mkdir()
        other_bridge = int(client.mount(other, elsewhere)["pid"])  # before the readers start
        vid = client.create_volume("walking", base=base)["id"]
        where = tmp_path / "walking"
        where.mkdir()
        bridge = int(client.mount(vid, where)["pid"])
        readers: list[int] = []
        try:
            wait_for(lambda: children_of(bridge) != [])
            readers = children_of(bridge)
            for reader in readers:
                os.kill(reader, signal.SIGSTOP)
            done = subprocess.run(["umount", str(elsewhere)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            wait_for(lambda: bridge_gone(other_bridge), 30)
            assert all(Path(f"/proc/{reader}").exists() for reader in readers)  # still walking
            for reader in readers:
                os.kill(reader, signal.SIGCONT)
            done = subprocess.run(["umount", str(where)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            wait_for(lambda: client.mounts() == [], 30)
            wait_for(lambda: bridge_gone(bridge), 30)
        finally:
            for reader in readers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(reader, signal.SIGCONT)
            for mountpoint in (where, elsewhere):
                if is_mounted(str(mountpoint)):
                    subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        leftover = subprocess.run(["mount"], capture_output=True, text=True, check=True).stdout
        assert str(tmp_path) not in leftover


# What a mount reads ahead unasked, and the callers' READs that lift that bound
# (native/bridge_prefetch.c, PREFETCH_FILES_FREE and PREFETCH_DEMAND_READS).
FREE_FILES = 8192
DEMAND_READS = 1024


def test_read_ahead_past_its_free_part_waits_for_callers_who_read(
    service: Service, tmp_path: Path
) -> None:
    """A mount nobody reads reads ahead at most FREE_FILES files, then waits with no
    reader alive (it may wait for ever), and another mount's bridge still exits
    after its umount(8).  The waiting mount itself still ends through
    Slates or a user's umount(8).  Once callers have sent DEMAND_READS READs (a grep
    or a build reading its way through the tree), every other listed file is read
    ahead too."""
    base = tmp_path / "base"
    names = make_tree(base, 40, 250)  # 10,000 files
    assert len(names) - FREE_FILES > DEMAND_READS  # reading them all lifts the bound
    small = tmp_path / "small"
    small.mkdir()
    (small / "f").write_bytes(b"f\n")
    with Client(service.runtime) as client:
        for how in ("umount(8)", "slates unmount"):
            other = client.create_volume(f"other-{how[0]}", base=small)["id"]
            elsewhere = tmp_path / f"other-{how[0]}"
            elsewhere.mkdir()
            other_bridge = int(client.mount(other, elsewhere)["pid"])  # before the walk's readers
            vid = client.create_volume(f"idle-{how[0]}", base=base)["id"]
            where = tmp_path / f"idle-{how[0]}"
            where.mkdir()
            bridge = int(client.mount(vid, where)["pid"])
            try:
                # The readers read ahead at SCHED_IDLE: on a busy host this takes a while.
                wait_for(
                    lambda: counters(service.runtime, vid).get("readaheads", 0) >= FREE_FILES,  # noqa: B023
                    180,
                )
                settled(service.runtime, vid)
                assert counters(service.runtime, vid)["readaheads"] == FREE_FILES, how
                wait_for(lambda: children_of(bridge) == [])  # noqa: B023 (no reader waits)
                done = subprocess.run(["umount", str(elsewhere)], capture_output=True, text=True)
                assert done.returncode == 0, done.stderr
                wait_for(lambda: bridge_gone(other_bridge), 30)  # noqa: B023
                if how == "umount(8)":
                    done = subprocess.run(["umount", str(where)], capture_output=True, text=True)
                    assert done.returncode == 0, done.stderr
                else:
                    client.unmount(where)
                wait_for(lambda: client.mounts() == [], 30)
                assert bridge_gone(bridge)
            finally:
                for mountpoint in (where, elsewhere):
                    if is_mounted(str(mountpoint)):
                        subprocess.run(["umount", "-l", str(mountpoint)], check=False)

        read = client.create_volume("read", base=base)["id"]
        with mounted(client, read, tmp_path / "read") as mnt:
            settled(service.runtime, read)
            for rel in names:  # as grep -r does: the files not read ahead send READs
                assert (mnt / rel).read_bytes() == (base / rel).read_bytes(), rel
            wait_for(lambda: counters(service.runtime, read)["readaheads"] == len(names))


def test_a_bridge_killed_in_the_middle_of_a_walk_exits(service: Service, tmp_path: Path) -> None:
    """The listings are read by a child process, not a thread of the bridge: a FUSE
    request the bridge has taken cannot be abandoned by its caller even on SIGKILL,
    so a thread of its own waiting on its mount would keep a killed bridge (and its
    mount) from ever ending."""
    base = tmp_path / "base"
    make_tree(base, 100, 100)
    with Client(service.runtime) as client:
        vid = client.create_volume("killed", base=base)["id"]
        where = tmp_path / "mnt"
        where.mkdir()
        pid = int(client.mount(vid, where)["pid"])
        try:
            wait_for(lambda: children_of(pid) != [])  # the reader, walking
            readers = children_of(pid)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not Path(f"/proc/{pid}").exists() or exited_unreaped(pid), 20)
            wait_for(lambda: not any(Path(f"/proc/{r}").exists() for r in readers), 20)
        finally:
            with contextlib.suppress(Exception):
                client.unmount(where)
            if is_mounted(str(where)):
                subprocess.run(["fusermount3", "-u", "-z", str(where)], check=False)


def test_lookups_in_one_directory_are_not_serialized(
    service: Service, tree: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """libfuse 3.14 leaves FUSE_PARALLEL_DIROPS out of its INIT reply; the bridge's
    transport adds it (native/bridge_session.c), so the kernel takes no directory lock
    around a LOOKUP: with the bridge stopped, three lookups of names in one directory
    all wait for their own answer, none for the directory's lock."""
    base, names = tree
    where = Path(names[0]).parent
    with Client(service.runtime) as client:
        vid = client.create_volume("parallel", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            settled(service.runtime, vid)
            pid = next(m["pid"] for m in client.mounts() if m["volume"] == vid)
            os.kill(pid, signal.SIGSTOP)
            lookups = [
                subprocess.Popen(
                    ["stat", str(mnt / where / f"absent{i}")], stderr=subprocess.DEVNULL
                )
                for i in range(3)
            ]
            try:

                def waits() -> list[str]:
                    return [Path(f"/proc/{p.pid}/wchan").read_text() for p in lookups]

                wait_for(
                    lambda: all(w in ("request_wait_answer", "fuse_lock_inode") for w in waits()),
                    10,
                )
                time.sleep(0.2)  # a serialized lookup would be on the lock by now
                assert waits() == ["request_wait_answer"] * 3
            finally:
                os.kill(pid, signal.SIGCONT)
                for p in lookups:
                    p.wait(timeout=30)
