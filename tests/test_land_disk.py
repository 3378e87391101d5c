"""Writing landings to real directories: slates.land.disk.Target.

DESIGN.md section 6: per entry, under a target lease, the three-way check
(witnessed old and disk old -> write new; disk already new -> identical;
disk other -> conflict, left alone), each entry replaced atomically so it is
old or new and never torn, and nothing written outside the target.

Sections: the three-way table; trees (deletions, new directories, symlinks,
modes, type changes, a hypothesis property from tree A to tree B); crashes
at every step of one entry (simulated by dying before the n-th mutating
system call); outside writers interleaved at exact points of a swap; the
lease; path traversal.  Every test works on its own temporary directories.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slates.land.disk as disk
from slates.errors import AccessDenied, InvalidArgument, LandingConflict
from slates.land.disk import TEMP_PREFIX, Target, state_of_bytes
from slates.land.manifest import Decision, Entry, Manifest, State, order_for_apply

RENAME_EXCHANGE = 2

# A tree: path -> ("file", bytes, mode) | ("dir", mode) | ("link", target)
Node = tuple[Any, ...]
Tree = dict[str, Node]


def file_node(data: bytes, mode: int = 0o644) -> Node:
    return ("file", data, mode)


def dir_node(mode: int = 0o755) -> Node:
    return ("dir", mode)


def link_node(target: str) -> Node:
    return ("link", target)


def state_of(node: Node | None) -> State | None:
    if node is None:
        return None
    if node[0] == "file":
        return state_of_bytes("file", node[1], node[2])
    if node[0] == "dir":
        return State("dir", None, node[1])
    return state_of_bytes("symlink", node[1].encode(), 0o777)


def content_of(node: Node | None) -> bytes | None:
    if node is None or node[0] == "dir":
        return None
    data: bytes = node[1] if node[0] == "file" else node[1].encode()
    return data


def disk_state(root: Path, path: str) -> State | None:
    """The state at root/path, computed independently of slates.land.disk."""
    full = root / path
    try:
        st_ = os.lstat(full)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(st_.st_mode)
    if stat.S_ISDIR(st_.st_mode):
        return State("dir", None, mode)
    if stat.S_ISLNK(st_.st_mode):
        return state_of_bytes("symlink", os.readlink(full).encode(), 0o777)
    assert stat.S_ISREG(st_.st_mode)
    return state_of_bytes("file", full.read_bytes(), mode)


def build(root: Path, tree: Tree) -> None:
    for path in sorted(tree):
        node, full = tree[path], root / path
        if node[0] == "dir":
            full.mkdir()
        elif node[0] == "file":
            full.write_bytes(node[1])
        else:
            full.symlink_to(node[1])
    for path in sorted(tree, reverse=True):  # modes last (and deepest first)
        node = tree[path]
        if node[0] != "link":
            os.chmod(root / path, node[-1])


def read_tree(root: Path) -> Tree:
    out: Tree = {}

    def walk(directory: Path, prefix: str) -> None:
        for item in sorted(os.scandir(directory), key=lambda e: e.name):
            path = prefix + item.name
            st_ = item.stat(follow_symlinks=False)
            if stat.S_ISLNK(st_.st_mode):
                out[path] = link_node(os.readlink(item.path))
            elif stat.S_ISDIR(st_.st_mode):
                out[path] = dir_node(stat.S_IMODE(st_.st_mode))
                walk(Path(item.path), path + "/")
            else:
                out[path] = file_node(Path(item.path).read_bytes(), stat.S_IMODE(st_.st_mode))

    walk(root, "")
    return out


def fingerprint(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable below root (names, kinds, bytes, modes, mtimes)."""
    out: dict[str, tuple[Any, ...]] = {".": (os.lstat(root).st_mtime_ns,)}
    for path, node in read_tree(root).items():
        out[path] = (*node, os.lstat(root / path).st_mtime_ns)
    return out


def manifest_between(old: Tree, new: Tree, target: Path) -> Manifest:
    entries = []
    for path in sorted(set(old) | set(new)):
        before, after = state_of(old.get(path)), state_of(new.get(path))
        if before != after:
            entries.append(Entry(path, before, after))
    return Manifest("snap-0-1", str(target), tuple(entries))


def land(root: Path, manifest: Manifest, new: Tree) -> dict[str, Decision]:
    out: dict[str, Decision] = {}
    with Target(str(root)) as target:
        for entry in order_for_apply(manifest.entries):
            out[entry.path], _disk = target.apply(entry, content_of(new.get(entry.path)))
    return out


def temp_names(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in dirs + files
        if n.startswith(TEMP_PREFIX)
    ]


def editor_save(path: Path, data: bytes) -> None:
    """Save the way editors do: write a temporary file beside it, then rename it over."""
    temp = path.with_name(f".{path.name}.swp")
    temp.write_bytes(data)
    os.chmod(temp, 0o644)
    os.rename(temp, path)


def in_place_save(path: Path, data: bytes) -> None:
    """Save in place: open (truncating), write, close."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# -- the three-way table ----------------------------------------------------------------

OLD, NEW, OTHER = b"quality=80\n", b"quality=90\n", b"quality=60\n"


@pytest.mark.parametrize(
    ("witnessed", "on_disk", "proposed", "expected", "after"),
    [
        (file_node(OLD), file_node(OLD), file_node(NEW), Decision.APPLY, file_node(NEW)),
        (file_node(OLD), file_node(NEW), file_node(NEW), Decision.IDENTICAL, file_node(NEW)),
        (file_node(OLD), file_node(OTHER), file_node(NEW), Decision.CONFLICT, file_node(OTHER)),
        (file_node(OLD), None, file_node(NEW), Decision.CONFLICT, None),
        (None, None, file_node(NEW), Decision.APPLY, file_node(NEW)),
        (None, file_node(OTHER), file_node(NEW), Decision.CONFLICT, file_node(OTHER)),
        (None, file_node(NEW), file_node(NEW), Decision.IDENTICAL, file_node(NEW)),
        (file_node(OLD), file_node(OLD), None, Decision.APPLY, None),
        (file_node(OLD), None, None, Decision.IDENTICAL, None),
        (file_node(OLD), file_node(OTHER), None, Decision.CONFLICT, file_node(OTHER)),
        (file_node(OLD), file_node(OLD, 0o600), file_node(NEW), Decision.CONFLICT, None),
        (file_node(OLD), dir_node(), file_node(NEW), Decision.CONFLICT, dir_node()),
        (None, dir_node(), dir_node(0o700), Decision.CONFLICT, dir_node()),
        (None, dir_node(0o700), dir_node(0o700), Decision.IDENTICAL, dir_node(0o700)),
        (link_node("a"), link_node("b"), link_node("c"), Decision.CONFLICT, link_node("b")),
    ],
)
def test_the_three_way_table(
    tmp_path: Path,
    witnessed: Node | None,
    on_disk: Node | None,
    proposed: Node | None,
    expected: Decision,
    after: Node | None,
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    if on_disk is not None:
        build(root, {"entry": on_disk})
    before = fingerprint(root)
    inode = os.lstat(root / "entry").st_ino if on_disk is not None else None
    entry = Entry("entry", state_of(witnessed), state_of(proposed))
    with Target(str(root)) as target:
        decision, seen = target.apply(entry, content_of(proposed))
    assert decision is expected
    assert seen == state_of(on_disk)  # what the disk held when it was decided
    if expected is Decision.APPLY:
        assert read_tree(root) == ({} if after is None else {"entry": after})
    else:
        assert fingerprint(root) == before  # left alone: same bytes, mode, times
        if inode is not None:
            assert os.lstat(root / "entry").st_ino == inode
    assert temp_names(root) == []


def test_a_mode_change_keeps_the_file_and_its_bytes(tmp_path: Path) -> None:
    build(tmp_path, {"run.sh": file_node(b"#!/bin/sh\n"), "d": dir_node(0o755)})
    inode = os.lstat(tmp_path / "run.sh").st_ino
    entries = (
        Entry("d", state_of(dir_node(0o755)), state_of(dir_node(0o700))),
        Entry(
            "run.sh",
            state_of(file_node(b"#!/bin/sh\n")),
            state_of(file_node(b"#!/bin/sh\n", 0o755)),
        ),
    )
    manifest = Manifest("snap-0-1", str(tmp_path), entries)
    new = {"run.sh": file_node(b"#!/bin/sh\n", 0o755), "d": dir_node(0o700)}
    assert land(tmp_path, manifest, new) == {"d": Decision.APPLY, "run.sh": Decision.APPLY}
    assert read_tree(tmp_path) == new
    assert os.lstat(tmp_path / "run.sh").st_ino == inode


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as other users")
def test_landed_entries_belong_to_the_developer_not_the_service(tmp_path: Path) -> None:
    """As root, a new entry takes its directory's owner and a replaced one keeps its
    owner; a setuid bit the manifest asks for survives the chown (set after it)."""
    build(tmp_path, {"mine.txt": file_node(b"old\n"), "src": dir_node()})
    developer, other = (47201, 47202), (47203, 47204)
    for path in (tmp_path, tmp_path / "src"):
        os.chown(path, *developer)
    os.chown(tmp_path / "mine.txt", *other)
    entries = (
        Entry("docs", None, state_of(dir_node(0o755))),
        Entry("latest", None, state_of(link_node("src/new.c"))),
        Entry("mine.txt", state_of(file_node(b"old\n")), state_of(file_node(b"new\n"))),
        Entry("src/new.c", None, state_of(file_node(b"int x;\n"))),
        Entry("tool", None, state_of(file_node(b"#!/bin/sh\n", 0o4755))),
    )
    new = {
        "mine.txt": file_node(b"new\n"),
        "src": dir_node(),
        "src/new.c": file_node(b"int x;\n"),
        "tool": file_node(b"#!/bin/sh\n", 0o4755),
        "docs": dir_node(0o755),
        "latest": link_node("src/new.c"),
    }
    manifest = Manifest("snap-0-1", str(tmp_path), entries)
    assert set(land(tmp_path, manifest, new).values()) == {Decision.APPLY}
    owners = {
        name: (os.lstat(tmp_path / name).st_uid, os.lstat(tmp_path / name).st_gid)
        for name in ("mine.txt", "src/new.c", "tool", "docs", "latest")
    }
    assert owners == {
        "mine.txt": other,
        "src/new.c": developer,
        "tool": developer,
        "docs": developer,
        "latest": developer,
    }
    assert stat.S_IMODE(os.lstat(tmp_path / "tool").st_mode) == 0o4755


# -- trees ----------------------------------------------------------------------------------

OLD_TREE: Tree = {
    "README.md": file_node(b"readme v1\n"),
    "build": dir_node(),
    "build/out.o": file_node(b"\x7fELF"),
    "build/cache": dir_node(0o700),
    "build/cache/x": file_node(b"x"),
    "docs": file_node(b"docs were a file\n"),
    "latest": link_node("build/out.o"),
    "run.sh": file_node(b"#!/bin/sh\necho hi\n", 0o644),
    "settings.conf": file_node(b"quality=80\n"),
    "src": dir_node(),
    "src/app.py": file_node(b"print('v1')\n"),
    "src/old.py": file_node(b"gone soon\n"),
    "tool": link_node("/usr/bin/true"),
}
NEW_TREE: Tree = {
    "README.md": file_node(b"readme v2\n"),
    "build": file_node(b"build is a file now\n", 0o600),
    "docs": dir_node(0o750),
    "docs/index.md": file_node(b"# docs\n"),
    "docs/img": dir_node(),
    "docs/img/logo.svg": file_node(b"<svg/>"),
    "latest": link_node("src/app.py"),
    "run.sh": file_node(b"#!/bin/sh\necho hi\n", 0o755),
    "settings.conf": file_node(b"quality=90\n"),
    "src": dir_node(0o700),
    "src/app.py": link_node("../settings.conf"),
    "src/new": dir_node(),
    "src/new/deep": dir_node(),
    "src/new/deep/file.txt": file_node(b"deep\n", 0o640),
    "tool": file_node(b"#!/bin/sh\nexit 0\n", 0o755),
}


def test_a_tree_lands_deletions_new_directories_symlinks_modes_and_type_changes(
    tmp_path: Path,
) -> None:
    build(tmp_path, OLD_TREE)
    manifest = manifest_between(OLD_TREE, NEW_TREE, tmp_path)
    outcomes = land(tmp_path, manifest, NEW_TREE)
    assert set(outcomes) == {e.path for e in manifest.entries}
    assert set(outcomes.values()) == {Decision.APPLY}
    assert read_tree(tmp_path) == NEW_TREE
    assert temp_names(tmp_path) == []


def test_landing_a_finished_manifest_again_reports_identical(tmp_path: Path) -> None:
    """What the retry after a crash does when the crash came after the last entry (before
    the landing was committed): every entry is already there, so every entry is identical.
    Here a directory became a file, so its former contents are below a file now: absent."""
    build(tmp_path, OLD_TREE)
    manifest = manifest_between(OLD_TREE, NEW_TREE, tmp_path)
    land(tmp_path, manifest, NEW_TREE)
    with Target(str(tmp_path)) as target:
        for entry in order_for_apply(manifest.entries):
            expected = state_of(NEW_TREE.get(entry.path))
            assert target.state(entry.path) == expected, entry.path
            decision, seen = target.apply(entry, content_of(NEW_TREE.get(entry.path)))
            assert (decision, seen) == (Decision.IDENTICAL, expected), entry.path
    assert read_tree(tmp_path) == NEW_TREE


def test_a_directory_with_an_outside_addition_is_not_replaced(tmp_path: Path) -> None:
    old: Tree = {"build": dir_node(), "build/out.o": file_node(b"o")}
    new: Tree = {"build": file_node(b"a file")}
    build(tmp_path, old)
    manifest = manifest_between(old, new, tmp_path)
    (tmp_path / "build" / "notes.txt").write_bytes(b"the developer's notes")
    outcomes = land(tmp_path, manifest, new)
    assert outcomes == {"build/out.o": Decision.APPLY, "build": Decision.CONFLICT}
    assert read_tree(tmp_path) == {
        "build": dir_node(),
        "build/notes.txt": file_node(b"the developer's notes"),
    }
    assert temp_names(tmp_path) == []


@pytest.mark.parametrize("parent", ["removed", "now a file"])
def test_entries_below_a_directory_that_is_gone_are_absent(tmp_path: Path, parent: str) -> None:
    """The developer removed `gone/` (or replaced it by a file): below it nothing exists,
    so a deletion there is already done and a change there is a conflict."""
    root = tmp_path / "project"
    root.mkdir()
    if parent == "now a file":
        (root / "gone").write_bytes(b"a file now")
    before = fingerprint(root)
    cases = [
        (Entry("gone/x", state_of(file_node(OLD)), None), Decision.IDENTICAL),
        (Entry("gone/sub/y", state_of(file_node(OLD)), None), Decision.IDENTICAL),
        (Entry("gone/sub", state_of(dir_node()), None), Decision.IDENTICAL),
        (Entry("gone/x", state_of(file_node(OLD)), state_of(file_node(NEW))), Decision.CONFLICT),
    ]
    with Target(str(root)) as target:
        for entry, expected in cases:
            assert target.state(entry.path) is None, entry
            assert target.apply(entry, content_of(file_node(NEW))) == (expected, None), entry
    assert fingerprint(root) == before


_names = st.sampled_from(["a", "b", "c"])
_leaves = st.one_of(
    st.builds(file_node, st.binary(max_size=12), st.sampled_from([0o644, 0o600, 0o755])),
    st.builds(link_node, st.sampled_from(["a", "../b", "/nonexistent/x", "c/d"])),
)


@st.composite
def trees(draw: st.DrawFn, depth: int = 0, prefix: str = "") -> Tree:
    out: Tree = {}
    for name in sorted(draw(st.sets(_names, max_size=3))):
        path = prefix + name
        if depth < 2 and draw(st.booleans()):
            out[path] = dir_node(draw(st.sampled_from([0o755, 0o700, 0o750])))
            out.update(draw(trees(depth + 1, path + "/")))
        else:
            out[path] = draw(_leaves)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), trees())
def test_landing_tree_a_to_tree_b_on_a_disk_holding_a_gives_b(old: Tree, new: Tree) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        build(root, old)
        manifest = manifest_between(old, new, root)
        outcomes = land(root, manifest, new)
        assert all(d is Decision.APPLY for d in outcomes.values()), outcomes
        assert read_tree(root) == new
        assert temp_names(root) == []


# -- a crash at every step of one entry --------------------------------------------------


class _Crash(BaseException):
    """The process died here (nothing after this point ran)."""


class _DyingOs:
    """slates.land.disk's view of `os`: dies before its n-th mutating call."""

    MUTATING = frozenset({"mkdir", "rmdir", "unlink", "symlink", "fsync", "chmod", "fchmod"})

    def __init__(self, die_at: int) -> None:
        self.die_at = die_at
        self.calls = 0

    def step(self) -> None:
        if self.calls == self.die_at:
            raise _Crash()
        self.calls += 1

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in self.MUTATING:
            return real

        def dying(*args: Any, **kwargs: Any) -> Any:
            self.step()
            return real(*args, **kwargs)

        return dying


CHANGES: dict[str, tuple[Node | None, Node | None]] = {
    "file->file": (file_node(OLD), file_node(NEW)),
    "new file": (None, file_node(NEW, 0o640)),
    "delete file": (file_node(OLD), None),
    "mode": (file_node(OLD), file_node(OLD, 0o755)),
    "file->symlink": (file_node(OLD), link_node("elsewhere")),
    "symlink->file": (link_node("elsewhere"), file_node(NEW)),
    "symlink->symlink": (link_node("a"), link_node("b")),
    "new dir": (None, dir_node(0o755)),
    "new group-writable dir": (None, dir_node(0o775)),
    "delete dir": (dir_node(), None),
    "dir mode": (dir_node(0o755), dir_node(0o700)),
    "file->dir": (file_node(OLD), dir_node()),
    "dir->file": (dir_node(), file_node(NEW)),
    "symlink->dir": (link_node("elsewhere"), dir_node()),
    "dir->symlink": (dir_node(), link_node("elsewhere")),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_crash_at_any_step_leaves_old_or_new_and_the_retry_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    old, new = CHANGES[change]
    root = tmp_path / "t"
    entry = Entry("sub/entry", state_of(old), state_of(new))
    real_renameat2 = disk._renameat2
    for die_at in range(64):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        build(root, {"sub": dir_node(), **({} if old is None else {"sub/entry": old})})
        dying = _DyingOs(die_at)

        def renameat2(src_dir: int, src: str, dst_dir: int, dst: str, flags: int) -> None:
            dying.step()  # noqa: B023 - this attempt's counter
            real_renameat2(src_dir, src, dst_dir, dst, flags)

        monkeypatch.setattr(disk, "os", dying)
        monkeypatch.setattr(disk, "_renameat2", renameat2)
        try:
            with Target(str(root)) as target:
                decision, _ = target.apply(entry, content_of(new))
        except _Crash:
            crashed = True
        else:
            crashed = False
        finally:
            monkeypatch.setattr(disk, "os", os)
            monkeypatch.setattr(disk, "_renameat2", real_renameat2)
        if not crashed:
            assert decision is Decision.APPLY
            assert disk_state(root, "sub/entry") == state_of(new)
            assert die_at > 0
            return
        now = disk_state(root, "sub/entry")
        assert now in (state_of(old), state_of(new)), (
            f"{change}: a crash before mutating call #{die_at} left {now} at the entry"
        )
        with Target(str(root)) as target:  # the next attempt
            decision, _ = target.apply(entry, content_of(new))
        assert decision in (Decision.APPLY, Decision.IDENTICAL), (change, die_at)
        assert disk_state(root, "sub/entry") == state_of(new)
        assert temp_names(root) == []
    raise AssertionError("the entry never finished")


# -- outside writers at exact points of a swap --------------------------------------------


Save = Callable[[Path, bytes], None]
SAVES: dict[str, Save] = {"editor": editor_save, "in place": in_place_save}


def racing_renameat2(
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> None:
    """Run `before`/`after` around the first swap (the first renameat2 call) of a landing."""
    real = disk._renameat2
    seen: list[int] = []

    def renameat2(src_dir: int, src: str, dst_dir: int, dst: str, flags: int) -> None:
        seen.append(flags)
        if len(seen) == 1 and before is not None:
            before()
        real(src_dir, src, dst_dir, dst, flags)
        if len(seen) == 1 and after is not None:
            after()

    monkeypatch.setattr(disk, "_renameat2", renameat2)


@pytest.mark.parametrize("save", list(SAVES))
def test_a_save_between_the_decision_and_the_swap_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: str
) -> None:
    (tmp_path / "f").write_bytes(OLD)
    racing_renameat2(monkeypatch, before=lambda: SAVES[save](tmp_path / "f", b"writer v1"))
    with Target(str(tmp_path)) as target:
        decision, seen = target.apply(
            Entry("f", state_of(file_node(OLD)), state_of(file_node(NEW))), NEW
        )
    assert seen == state_of(file_node(OLD))  # it was the witness when it was decided
    assert decision is Decision.CONFLICT
    assert (tmp_path / "f").read_bytes() == b"writer v1"
    assert temp_names(tmp_path) == []


@pytest.mark.parametrize("save", list(SAVES))
def test_a_save_right_after_the_swap_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: str
) -> None:
    (tmp_path / "f").write_bytes(OLD)
    racing_renameat2(monkeypatch, after=lambda: SAVES[save](tmp_path / "f", b"writer v1"))
    with Target(str(tmp_path)) as target:
        decision, _ = target.apply(
            Entry("f", state_of(file_node(OLD)), state_of(file_node(NEW))), NEW
        )
    assert decision is Decision.APPLY  # the swap took the witness; the writer came after
    assert (tmp_path / "f").read_bytes() == b"writer v1"


@pytest.mark.parametrize("save", list(SAVES))
def test_a_writer_saving_before_and_after_the_swap_keeps_its_last_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: str
) -> None:
    """The swap takes the writer's first save; its second save lands on the name (over
    the proposal) before the swapped-out file is checked.  Swapping back must not throw
    the second save away."""
    path = tmp_path / "f"
    path.write_bytes(OLD)
    racing_renameat2(
        monkeypatch,
        before=lambda: SAVES[save](path, b"writer v1"),
        after=lambda: SAVES[save](path, b"writer v2"),
    )
    with Target(str(tmp_path)) as target:
        decision, _ = target.apply(
            Entry("f", state_of(file_node(OLD)), state_of(file_node(NEW))), NEW
        )
    assert decision is Decision.CONFLICT
    assert path.read_bytes() == b"writer v2", "the writer's last save was lost"


@pytest.mark.parametrize("save", list(SAVES))
def test_a_writer_racing_a_deletion_keeps_its_last_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: str
) -> None:
    path = tmp_path / "f"
    path.write_bytes(OLD)
    racing_renameat2(monkeypatch, before=lambda: SAVES[save](path, b"writer v1"))
    with Target(str(tmp_path)) as target:
        decision, _ = target.apply(Entry("f", state_of(file_node(OLD)), None), None)
    assert decision is Decision.CONFLICT
    assert path.read_bytes() == b"writer v1"
    assert temp_names(tmp_path) == []


def test_a_file_created_meanwhile_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    racing_renameat2(monkeypatch, before=lambda: (tmp_path / "f").write_bytes(b"mine"))
    with Target(str(tmp_path)) as target:
        decision, seen = target.apply(Entry("f", None, state_of(file_node(NEW))), NEW)
    assert seen is None and decision is Decision.CONFLICT
    assert (tmp_path / "f").read_bytes() == b"mine"
    assert temp_names(tmp_path) == []


def test_reading_the_disk_during_a_landing_leaves_the_landing_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_base and rewitness read without the lease (another shard may serve them
    while this one lands into the same directory); a read must not remove the
    landing's temporary file from under it."""
    (tmp_path / "f").write_bytes(OLD)
    (tmp_path / "g").write_bytes(b"another file")

    def reader() -> None:
        assert Target(str(tmp_path), lease=False).read("g") == b"another file"

    racing_renameat2(monkeypatch, before=reader)
    with Target(str(tmp_path)) as target:
        decision, _ = target.apply(
            Entry("f", state_of(file_node(OLD)), state_of(file_node(NEW))), NEW
        )
    assert decision is Decision.APPLY
    assert (tmp_path / "f").read_bytes() == NEW


# -- the lease ----------------------------------------------------------------------------------


def test_the_lease_serializes_landings_into_one_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "LEASE_SECONDS", 0.2)
    with Target(str(tmp_path)):
        with pytest.raises(LandingConflict):
            Target(str(tmp_path))
        Target(str(tmp_path), lease=False).close()  # reading needs no lease
    with Target(str(tmp_path)):
        pass


# -- path traversal --------------------------------------------------------------------------


@pytest.fixture
def escape(tmp_path: Path) -> tuple[Path, Path]:
    """A target whose subdirectory `sub` on disk is a symlink to a directory outside it."""
    root, outside = tmp_path / "project", tmp_path / "outside"
    build(
        outside.parent,
        {"outside": dir_node(), "outside/f": file_node(OLD), "outside/d": dir_node()},
    )
    root.mkdir()
    (root / "sub").symlink_to(outside)
    (root / "a").mkdir()
    (root / "a" / "b").symlink_to("../../outside")
    return root, outside


@pytest.mark.parametrize(
    "entry",
    [
        Entry("sub/f", state_of(file_node(OLD)), state_of(file_node(NEW))),  # would match
        Entry("sub/f", state_of(file_node(OLD)), None),
        Entry("sub/new", None, state_of(file_node(NEW))),
        Entry("sub/newdir", None, state_of(dir_node())),
        Entry("sub/d", state_of(dir_node()), state_of(dir_node(0o700))),
        Entry("sub/d", state_of(dir_node()), None),
        Entry("a/b/f", state_of(file_node(OLD)), state_of(file_node(NEW))),
        Entry("a/b/d/x", None, state_of(file_node(NEW))),
    ],
    ids=lambda e: f"{e.path}:{'delete' if e.proposed is None else e.proposed.kind}",
)
def test_a_symlinked_directory_on_the_way_is_refused(
    escape: tuple[Path, Path], entry: Entry
) -> None:
    root, outside = escape
    before = fingerprint(outside)
    with Target(str(root)) as target:
        with pytest.raises(AccessDenied):
            target.apply(entry, None if entry.proposed is None else NEW)
        with pytest.raises(AccessDenied):
            target.state(entry.path)
        with pytest.raises(AccessDenied):
            target.read(entry.path)
    assert fingerprint(outside) == before
    assert os.path.islink(root / "sub")


@pytest.mark.parametrize(
    "path", ["../outside/f", "/etc/passwd", "sub/../../outside/f", "a//f", "."]
)
def test_a_hand_made_entry_leaving_the_target_is_refused(
    escape: tuple[Path, Path], path: str
) -> None:
    root, outside = escape
    before = fingerprint(outside)
    with Target(str(root)) as target, pytest.raises(InvalidArgument):
        target.apply(Entry(path, state_of(file_node(OLD)), state_of(file_node(NEW))), NEW)
    assert fingerprint(outside) == before


def test_a_witnessed_symlink_is_replaced_not_followed(escape: tuple[Path, Path]) -> None:
    root, outside = escape
    (root / "link").symlink_to(outside / "f")  # the witness: a link to a file outside
    (root / "dirlink").symlink_to(outside / "d")
    before = fingerprint(outside)
    entries = [
        Entry("dirlink", state_of(link_node(str(outside / "d"))), None),
        Entry("link", state_of(link_node(str(outside / "f"))), state_of(file_node(NEW))),
    ]
    with Target(str(root)) as target:
        assert target.apply(entries[0], None)[0] is Decision.APPLY
        assert target.apply(entries[1], NEW)[0] is Decision.APPLY
    assert not os.path.lexists(root / "dirlink")
    assert not os.path.islink(root / "link") and (root / "link").read_bytes() == NEW
    assert fingerprint(outside) == before


@pytest.mark.parametrize(
    ("witnessed", "proposed", "planted"),
    [
        (file_node(OLD), file_node(NEW), "f"),  # the link's target holds the witnessed bytes
        (None, file_node(NEW), "absent"),  # a dangling link: following it would create it
        (dir_node(), dir_node(0o700), "d"),
        (file_node(OLD), None, "f"),
    ],
)
def test_a_symlink_planted_at_an_entry_is_a_conflict_and_not_followed(
    escape: tuple[Path, Path], witnessed: Node | None, proposed: Node | None, planted: str
) -> None:
    root, outside = escape
    (root / "entry").symlink_to(outside / planted)
    before = fingerprint(outside)
    with Target(str(root)) as target:
        decision, seen = target.apply(
            Entry("entry", state_of(witnessed), state_of(proposed)), content_of(proposed)
        )
    assert decision is Decision.CONFLICT
    assert seen == state_of(link_node(str(outside / planted)))
    assert os.readlink(root / "entry") == str(outside / planted)
    assert fingerprint(outside) == before
    assert not (outside / "absent").exists()
    assert (outside / "f").read_bytes() == OLD
