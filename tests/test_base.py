"""Volumes over a real live directory, base drift, and captures."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import slates.base.capturing as capture_module
from slates.base import LiveDirectory, capture
from slates.core import ROOT_INO, Host, Kind, Volume
from slates.core.records import BaseEntry, Fingerprint
from slates.errors import BaseDrift, ConsistentBaseUnavailable, InvalidArgument, NotFound
from tests.volume_check import check_invariants, tree


def _digest_tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a base write could change: bytes, modes, times, links."""
    out: dict[str, tuple[object, ...]] = {}
    for path in [*sorted(root.rglob("*")), root]:
        st = path.lstat()
        content: object = None
        if path.is_symlink():
            content = os.readlink(path)
        elif path.is_file():
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        out[str(path.relative_to(root))] = (
            st.st_mode,
            st.st_mtime_ns,
            st.st_ctime_ns,
            st.st_nlink,
            st.st_size,
            content,
        )
    return out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    src = tmp_path / "project"
    (src / "src").mkdir(parents=True)
    (src / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    (src / "src" / "image.rs").write_bytes(b"fn decode() {}\n" * 1000)
    (src / "src" / "cache.rs").write_bytes(b"fn cache() {}\n")
    (src / "link").symlink_to("src/image.rs")
    return src


class CountingReader(LiveDirectory):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads = 0
        self.stats = 0

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        self.reads += 1
        return super().read(path, fingerprint, offset, size)

    def stat(self, path: str):  # type: ignore[no-untyped-def]
        self.stats += 1
        return super().stat(path)


def test_volume_over_a_live_directory_reads_on_demand_and_never_writes(project: Path) -> None:
    before = _digest_tree(project)
    reader = CountingReader(str(project))
    volume = Volume.new(Host(), base=reader)
    assert reader.reads == 0  # creating it read no file
    ino = volume.resolve("/image.conf")
    assert reader.reads == 0  # looking a file up reads none of its content
    assert volume.read(ino, 0, 100) == b"quality=80\ncache=off\n"
    volume.write(ino, 8, b"90")
    assert volume.read(ino, 0, 100) == b"quality=90\ncache=off\n"
    src = volume.resolve("/src")
    volume.rename(ROOT_INO, "src", ROOT_INO, "source")
    volume.unlink(volume.resolve("/source"), "cache.rs")
    volume.create(volume.resolve("/source"), "new.rs")
    volume.unlink(ROOT_INO, "link")
    volume.mkdir(ROOT_INO, "src")  # a new, opaque directory where the old name was
    assert volume.readdir(volume.resolve("/src")) == []
    volume.setattr(volume.resolve("/image.conf"), mode=0o600)
    volume.truncate(volume.resolve("/source/image.rs"), 3)
    assert volume.resolve("/source") == src
    assert _digest_tree(project) == before
    assert (project / "src" / "cache.rs").read_bytes() == b"fn cache() {}\n"
    check_invariants(volume)


def test_directory_rename_is_a_redirect_and_copies_nothing(project: Path) -> None:
    reader = CountingReader(str(project))
    volume = Volume.new(Host(), base=reader)
    src = volume.resolve("/src")
    volume.rename(ROOT_INO, "src", ROOT_INO, "codec")
    info = volume.dir_info(src)
    assert info.base_path == "/src"  # the redirect
    assert "src" in volume.dir_info(ROOT_INO).whiteouts
    assert reader.reads == 0 and volume.unique_bytes == 0
    names = [item.name for item in volume.readdir(src)]
    assert names == ["cache.rs", "image.rs"]
    assert volume.read(volume.resolve("/codec/cache.rs"), 0, 100) == b"fn cache() {}\n"
    with pytest.raises(NotFound):
        volume.resolve("/src")


def test_deleting_a_base_file_is_a_whiteout(project: Path) -> None:
    volume = Volume.new(Host(), base=LiveDirectory(str(project)))
    volume.unlink(ROOT_INO, "image.conf")
    assert "image.conf" not in [item.name for item in volume.readdir(ROOT_INO)]
    assert volume.dir_info(ROOT_INO).whiteouts == ("image.conf",)
    assert (project / "image.conf").exists()
    volume.create(ROOT_INO, "image.conf")  # a new private file may take the name again
    assert volume.read(volume.resolve("/image.conf"), 0, 10) == b""


def test_base_drift_affects_only_unpinned_content(project: Path) -> None:
    volume = Volume.new(Host(), base=LiveDirectory(str(project)))
    big = volume.resolve("/src/image.rs")
    small = volume.resolve("/src/cache.rs")
    volume.read(big, 0, 10)
    volume.write(big, 0, b"// private edit\n")  # pins the first page as a private copy
    (project / "src" / "image.rs").write_bytes(b"rewritten by someone else")
    with pytest.raises(BaseDrift):
        volume.read(big, 5000, 10)
    assert volume.read(big, 0, 16) == b"// private edit\n"  # private pages stay readable
    assert volume.read(small, 0, 100) == b"fn cache() {}\n"  # untouched files unaffected
    with pytest.raises(BaseDrift):
        volume.write(big, 5000, b"x")  # copy-on-write would need the drifted bytes
    assert volume.read(big, 0, 16) == b"// private edit\n"


def test_a_file_reads_the_base_while_any_of_its_extents_does(project: Path) -> None:
    """What decides whether a write brings a scattered grant (slates.node.grants):
    none of the file's bytes may be read from the base, which a rewrite of all of them,
    or a new file, ensures; a file past the extents it may have is not looked at."""
    volume = Volume.new(Host(), base=LiveDirectory(str(project)))
    big = volume.resolve("/src/image.rs")
    assert volume.reads_base(big, 256)
    volume.write(big, 0, b"// private edit\n")  # its first page only
    assert volume.reads_base(big, 256)
    size = volume.getattr(big).size
    volume.write(big, 0, b"x" * size)  # every byte private now
    assert not volume.reads_base(big, 256)
    new = volume.create(ROOT_INO, "lapi.o").ino
    assert not volume.reads_base(new, 256)
    for page in range(4):  # holes between: four extents
        volume.write(new, page * 8192, b"y")
    assert not volume.reads_base(new, 4) and volume.reads_base(new, 3)
    assert not volume.reads_base(volume.resolve("/src"), 0)  # not a file


def test_base_drift_is_detected_for_a_snapshot_of_a_live_overlay(project: Path) -> None:
    host = Host()
    volume = Volume.new(host, base=LiveDirectory(str(project)))
    volume.resolve("/image.conf")
    snapshot = volume.snapshot("live")
    clone = Volume.clone(snapshot, host)
    (project / "image.conf").write_bytes(b"quality=60\ncache=off\n")
    with pytest.raises(BaseDrift):
        clone.read(clone.resolve("/image.conf"), 0, 100)


def test_capture_pins_every_byte(project: Path) -> None:
    host = Host()
    os.link(project / "image.conf", project / "hardlink.conf")
    snapshot = capture(str(project), host, snapshot_id="v0")
    (project / "image.conf").write_bytes(b"changed later")
    (project / "src" / "cache.rs").unlink()
    clone = Volume.clone(snapshot, host)
    assert clone.base is None
    assert clone.read(clone.resolve("/image.conf"), 0, 100) == b"quality=80\ncache=off\n"
    assert clone.read(clone.resolve("/src/cache.rs"), 0, 100) == b"fn cache() {}\n"
    assert clone.readlink(clone.resolve("/link")) == "src/image.rs"
    assert clone.resolve("/hardlink.conf") == clone.resolve("/image.conf")
    assert clone.getattr(clone.resolve("/image.conf")).nlink == 2
    assert clone.getattr(clone.resolve("/src")).kind == Kind.DIR
    expected_mtime = (project / "src").stat().st_mtime_ns
    assert clone.getattr(clone.resolve("/src")).mtime_ns != 0
    assert clone.counters().referenced_bytes == 21 + 15000 + 14
    assert expected_mtime  # the directory times were copied from the source
    check_invariants(clone)


def test_capture_matches_a_live_view(project: Path) -> None:
    host = Host()
    captured = Volume.clone(capture(str(project), host, snapshot_id="v0"), host)
    live = Volume.new(host, base=LiveDirectory(str(project)))
    assert tree(captured) == tree(live)


def test_capture_refuses_a_directory_that_changes_during_the_capture(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pieces = capture_module.CaptureReader._pieces
    calls = []

    def copy_then_edit(
        self: capture_module.CaptureReader, entry: BaseEntry
    ) -> Iterator[capture_module.Piece]:
        yield from real_pieces(self, entry)
        calls.append(entry)
        if len(calls) == 1:  # a writer edits an already-captured file
            (project / "image.conf").write_bytes(b"quality=70\ncache=off\n")

    monkeypatch.setattr(capture_module.CaptureReader, "_pieces", copy_then_edit)
    host = Host()
    with pytest.raises(ConsistentBaseUnavailable) as excinfo:
        capture(str(project), host, snapshot_id="v0")
    assert "/image.conf" in excinfo.value.details["changed"]
    assert host.private_bytes == 0  # nothing published or left charged


def test_capture_refuses_a_file_changed_while_it_is_read(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read = LiveDirectory.read

    def read_then_edit(
        self: LiveDirectory, path: str, fp: Fingerprint, offset: int, size: int
    ) -> bytes:
        if path == "/src/image.rs":
            (project / "src" / "image.rs").write_bytes(b"torn")
        return real_read(self, path, fp, offset, size)

    monkeypatch.setattr(LiveDirectory, "read", read_then_edit)
    with pytest.raises(ConsistentBaseUnavailable):
        capture(str(project), Host(), snapshot_id="v0")


def test_a_new_file_during_capture_is_detected(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pieces = capture_module.CaptureReader._pieces

    def copy_then_add(
        self: capture_module.CaptureReader, entry: BaseEntry
    ) -> Iterator[capture_module.Piece]:
        yield from real_pieces(self, entry)
        (project / "src" / "appeared.rs").write_bytes(b"new")

    monkeypatch.setattr(capture_module.CaptureReader, "_pieces", copy_then_add)
    with pytest.raises(ConsistentBaseUnavailable):
        capture(str(project), Host(), snapshot_id="v0")


def test_bad_base_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        LiveDirectory(str(tmp_path / "missing"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(InvalidArgument):
        LiveDirectory(str(tmp_path / "file"))
    live = LiveDirectory(str(tmp_path))
    with pytest.raises(InvalidArgument):
        live.stat("/../etc/passwd")
    with pytest.raises(InvalidArgument):
        live.stat("relative")


def test_base_symlinks_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    base = tmp_path / "base"
    base.mkdir()
    (base / "escape").symlink_to(outside)
    volume = Volume.new(Host(), base=LiveDirectory(str(base)))
    ino = volume.resolve("/escape")
    assert volume.getattr(ino).kind == Kind.SYMLINK
    assert volume.readlink(ino) == str(outside)
    with pytest.raises(InvalidArgument):
        volume.read(ino, 0, 10)


def test_case_insensitive_volume_finds_base_names_in_any_case(project: Path) -> None:
    volume = Volume.new(Host(), base=LiveDirectory(str(project)), case_insensitive=True)
    assert volume.read(volume.resolve("/IMAGE.CONF"), 0, 7) == b"quality"
    assert [i.name for i in volume.readdir(ROOT_INO)] == ["image.conf", "link", "src"]
