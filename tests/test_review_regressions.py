"""Regressions for problems a review found in the core (each failed before its fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slates.base import LiveDirectory
from slates.core import ROOT_INO, Capacity, Host, Volume
from slates.core.extents import PAGE
from slates.errors import CapacityExhausted, NotFound, NotSupported, OutOfRange, TooBig
from tests.test_volume_model import MemoryBase
from tests.volume_check import check_invariants


def test_deeply_nested_record_is_refused_without_crashing() -> None:
    program = (
        "import msgpack\n"
        "from slates.core.records import decode\n"
        "from slates.errors import InvalidArgument\n"
        "p = msgpack.packb(msgpack.ExtType(1, b''))\n"
        "for _ in range(400):\n"
        "    inner = msgpack.packb(['Write', msgpack.ExtType(2, p)])\n"
        "    p = msgpack.packb(msgpack.ExtType(1, inner))\n"
        "try:\n"
        "    decode(p)\n"
        "except InvalidArgument:\n"
        "    print('refused')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"


def test_sealing_content_equal_to_inherited_content_keeps_unique_exact() -> None:
    host = Host()
    volume = Volume.new(host)
    a = volume.create(ROOT_INO, "a").ino
    volume.write(a, 0, b"x" * 1200)
    snapshot = volume.snapshot("s")
    clone = Volume.clone(snapshot, host, Capacity.reserved(64 * PAGE))
    b = clone.create(ROOT_INO, "b").ino
    clone.write(b, 0, b"x" * 1200)  # the same bytes as inherited /a
    clone.seal()
    check_invariants(clone)
    assert clone.unique_bytes == 1200
    clone.unlink(ROOT_INO, "a")
    clone.unlink(ROOT_INO, "b")
    check_invariants(clone)
    assert clone.unique_bytes == 0 and clone.charged_bytes >= 0


def test_a_reused_base_inode_number_is_not_taken_for_a_hard_link() -> None:
    base = MemoryBase({"/a": b"aaaa", "/b": b"bbbbbb"}, [])
    base.inode["/b"] = base.inode["/a"]  # the file system reused /a's inode number
    volume = Volume.new(Host(), base=base)
    a = volume.resolve("/a")
    volume.write(a, 0, b"PRIV")
    b = volume.resolve("/b")
    assert b != a
    assert volume.read(b, 0, 100) == b"bbbbbb"


def test_a_write_through_one_base_hard_link_is_seen_through_the_other(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"original")
    os.link(tmp_path / "x", tmp_path / "y")
    volume = Volume.new(Host(), base=LiveDirectory(str(tmp_path)))
    x = volume.resolve("/x")
    assert volume.getattr(x).nlink == 2
    volume.write(x, 0, b"EDITED!!")
    volume.unlink(ROOT_INO, "x")
    y = volume.resolve("/y")
    assert y == x
    assert volume.read(y, 0, 100) == b"EDITED!!"
    assert (tmp_path / "y").read_bytes() == b"original"


def test_a_base_directory_swapped_for_a_symlink_does_not_lead_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    base = tmp_path / "base"
    (base / "conf").mkdir(parents=True)
    (base / "conf" / "app.conf").write_bytes(b"ok")
    volume = Volume.new(Host(), base=LiveDirectory(str(base)))
    conf = volume.resolve("/conf")
    (base / "conf" / "app.conf").unlink()
    (base / "conf").rmdir()
    (base / "conf").symlink_to(outside)
    assert volume.readdir(conf) == []
    with pytest.raises(NotFound):
        volume.lookup(conf, "secret")


def test_a_snapshot_does_not_count_open_unlinked_files() -> None:
    host = Host()
    volume = Volume.new(host)
    ino = volume.create(ROOT_INO, "tmp").ino
    volume.write(ino, 0, b"z" * 10000)
    volume.retain(ino)
    volume.unlink(ROOT_INO, "tmp")
    clone = Volume.clone(volume.snapshot("s"), host)
    assert clone.counters().referenced_bytes == 0
    check_invariants(clone)
    check_invariants(volume)


def test_xattrs_are_charged_and_checked_like_linux() -> None:
    volume = Volume.new(Host(), capacity=Capacity.reserved(64 * 1024))
    ino = volume.create(ROOT_INO, "f").ino
    volume.setxattr(ino, "user.a", b"v" * 30000)
    with pytest.raises(CapacityExhausted):
        volume.setxattr(ino, "user.b", b"v" * 40000)
    assert volume.listxattr(ino) == ["user.a"]
    with pytest.raises(OutOfRange):
        volume.setxattr(ino, "", b"")
    with pytest.raises(NotSupported):
        volume.setxattr(ino, "nonamespace", b"")
    with pytest.raises(TooBig):
        volume.setxattr(ino, "user.big", b"v" * (64 * 1024 + 1))
    check_invariants(volume)


def test_non_utf8_names_travel_through_records() -> None:
    from slates.core.records import decode, encode

    journal: list[bytes] = []
    volume = Volume.new(Host())
    volume.on_applied = lambda record, result: journal.append(encode(record))
    name = os.fsdecode(b"caf\xe9.txt")
    volume.create(ROOT_INO, name)
    replica = Volume.new(Host())
    for payload in journal:
        replica.apply(decode(payload))
    assert [item.name for item in replica.readdir(ROOT_INO)] == [name]
