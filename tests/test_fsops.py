"""The fs.* operations a mount bridge uses, on a volume, without the kernel."""

from __future__ import annotations

import stat

import pytest

from slates.core import ROOT_INO, Host, Volume
from slates.core.extents import PAGE
from slates.errors import AlreadyExists, InvalidArgument, NoSuchOffset, NotFound
from slates.node.fsops import cookie_of, entry_size, run_fs_op
from tests.volume_check import check_invariants


def fs(volume: Volume, op: str, **args: object) -> object:
    return run_fs_op(volume, "fs." + op, dict(args), 1000)


def make(volume: Volume, name: str, data: bytes = b"") -> int:
    attr = fs(
        volume,
        "create",
        parent=ROOT_INO,
        name=name,
        mode=stat.S_IFREG | 0o644,
        uid=0,
        gid=0,
        exclusive=True,
    )
    assert isinstance(attr, dict)
    ino = int(attr["ino"])
    if data:
        fs(volume, "write", ino=ino, offset=0, data=data)
    return ino


def test_entries_take_lookup_references_and_forget_releases_them() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f", b"x")
    assert volume.handles(ino) == 1  # create answered an entry
    fs(volume, "lookup", parent=ROOT_INO, name="f")
    assert volume.handles(ino) == 2
    fs(volume, "unlink", parent=ROOT_INO, name="f")
    assert fs(volume, "read", ino=ino, offset=0, size=10) == b"x"  # open through the kernel
    fs(volume, "forget", items=[[ino, 2]])
    with pytest.raises(NotFound):
        fs(volume, "getattr", ino=ino)
    check_invariants(volume)


def test_destroy_drops_every_reference() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f")
    fs(volume, "unlink", parent=ROOT_INO, name="f")
    fs(volume, "destroy")
    with pytest.raises(NotFound):
        fs(volume, "getattr", ino=ino)


def test_readdir_cookies_survive_removals_between_calls() -> None:
    volume = Volume.new(Host())
    names = [f"n{i:03}" for i in range(60)]
    for name in names:
        make(volume, name)
    seen: list[str] = []
    offset = 0
    while True:
        page = fs(
            volume,
            "readdir",
            ino=ROOT_INO,
            offset=offset,
            plus=False,
            limit_bytes=8 * entry_size("n000", False),
        )
        assert isinstance(page, list)
        if not page:
            break
        for name, _mode, _ino, cookie, _attr in page:
            seen.append(name)
            offset = cookie
            if name not in (".", ".."):
                fs(volume, "unlink", parent=ROOT_INO, name=name)  # rm -rf's pattern
    assert sorted(n for n in seen if n not in (".", "..")) == names
    assert volume.readdir(ROOT_INO) == []
    assert cookie_of("a") > 2


def test_readdirplus_answers_attributes_and_fits_the_budget() -> None:
    volume = Volume.new(Host())
    for i in range(5):
        make(volume, f"file{i}", b"abc")
    budget = entry_size(".", True) + entry_size("..", True) + 2 * entry_size("file0", True)
    page = fs(volume, "readdir", ino=ROOT_INO, offset=0, plus=True, limit_bytes=budget)
    assert isinstance(page, list) and len(page) == 4
    for _name, mode, ino, _cookie, attr in page[2:]:
        assert attr["ino"] == ino and attr["size"] == 3 and stat.S_ISREG(mode)
        assert volume.handles(ino) == 2  # create + readdirplus


def test_setattr_truncates_and_sets_times_and_mode() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f", b"hello world")
    attr = fs(volume, "setattr", ino=ino, size=5, mode=0o600, mtime_ns=42, atime_ns=7)
    assert isinstance(attr, dict)
    assert attr["size"] == 5 and attr["mode"] == stat.S_IFREG | 0o600
    assert attr["mtime_ns"] == 42 and attr["atime_ns"] == 7


def test_create_without_exclusive_opens_an_existing_file() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f", b"data")
    with pytest.raises(AlreadyExists):
        make(volume, "f")
    attr = fs(
        volume, "create", parent=ROOT_INO, name="f", mode=0o644, uid=0, gid=0, exclusive=False
    )
    assert isinstance(attr, dict) and attr["ino"] == ino


def test_seek_data_and_hole() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "sparse")
    fs(volume, "write", ino=ino, offset=4 * PAGE, data=b"x" * PAGE)
    fs(volume, "setattr", ino=ino, size=10 * PAGE)
    assert fs(volume, "lseek", ino=ino, offset=0, whence=3) == 4 * PAGE
    assert fs(volume, "lseek", ino=ino, offset=4 * PAGE, whence=4) == 5 * PAGE
    assert fs(volume, "lseek", ino=ino, offset=6 * PAGE, whence=4) == 6 * PAGE
    with pytest.raises(NoSuchOffset):
        fs(volume, "lseek", ino=ino, offset=6 * PAGE, whence=3)
    with pytest.raises(NoSuchOffset):
        fs(volume, "lseek", ino=ino, offset=10 * PAGE, whence=4)


def test_punch_hole_frees_whole_pages_and_zeroes_the_edges() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f", b"a" * (8 * PAGE))
    before = volume.unique_bytes
    fs(volume, "fallocate", ino=ino, mode=1 | 2, offset=100, length=5 * PAGE)
    data = volume.read(ino, 0, 8 * PAGE)
    assert data == b"a" * 100 + bytes(5 * PAGE) + b"a" * (3 * PAGE - 100)
    assert volume.unique_bytes == before - 4 * PAGE  # pages 1-4 dropped
    assert volume.getattr(ino).size == 8 * PAGE
    with pytest.raises(InvalidArgument):
        fs(volume, "fallocate", ino=ino, mode=2, offset=0, length=PAGE)  # needs KEEP_SIZE
    fs(volume, "fallocate", ino=ino, mode=0, offset=0, length=20 * PAGE)
    assert volume.getattr(ino).size == 20 * PAGE
    check_invariants(volume)


def test_copy_file_range_shares_sealed_pages_instead_of_copying() -> None:
    host = Host()
    volume = Volume.new(host)
    src = make(volume, "src", bytes(range(256)) * (16 * PAGE // 256))
    dst = make(volume, "dst")
    volume.seal()
    chunks = host.chunk_bytes
    copied = fs(
        volume, "copy_file_range", ino_in=src, off_in=0, ino_out=dst, off_out=0, length=16 * PAGE
    )
    assert copied == 16 * PAGE
    assert host.chunk_bytes == chunks and host.private_bytes == volume.metadata_bytes
    assert volume.read(dst, 0, 16 * PAGE) == volume.read(src, 0, 16 * PAGE)
    fs(volume, "write", ino=dst, offset=0, data=b"!")  # copy-on-write, src unchanged
    assert volume.read(src, 0, 1) == b"\x00"
    check_invariants(volume)


def test_statfs_reports_the_volume_quota() -> None:
    from slates.core import Capacity

    volume = Volume.new(Host(), capacity=Capacity.reserved(64 * PAGE))
    make(volume, "f", b"x" * PAGE)
    info = fs(volume, "statfs")
    assert isinstance(info, dict)
    assert info["blocks"] == 64 and 0 < info["bfree"] < 64 and info["bsize"] == PAGE


def test_unknown_and_malformed_fs_requests_are_invalid() -> None:
    volume = Volume.new(Host())
    with pytest.raises(InvalidArgument):
        fs(volume, "frobnicate")
    with pytest.raises(InvalidArgument):
        fs(volume, "getattr", ino="1")
    with pytest.raises(InvalidArgument):
        fs(volume, "forget", items=[[1]])
