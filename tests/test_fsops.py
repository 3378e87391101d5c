"""The fs.* operations a mount bridge uses, on a volume, without the kernel."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core import ROOT_INO, Host, Volume
from slates.core.extents import PAGE
from slates.errors import AlreadyExists, InvalidArgument, NoSuchOffset, NotFound, SlatesError
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


def _plain(reply: object) -> dict[str, object]:
    """fs.getattr's answer without the optional hints (clean base, xattr count; the
    count is checked by test_every_attr_reply_counts_the_xattrs_getxattr_finds)."""
    assert isinstance(reply, dict)
    return {k: v for k, v in reply.items() if k not in ("base", "dir", "xattrs")}


XATTR_STEPS = st.lists(
    st.tuples(st.sampled_from(("set", "remove")), st.sampled_from(("user.a", "user.b"))),
    max_size=8,
)


@settings(max_examples=50, deadline=None)
@given(XATTR_STEPS)
def test_every_attr_reply_counts_the_xattrs_getxattr_finds(
    steps: list[tuple[str, str]],
) -> None:
    """The bridge answers the kernel's xattr probes itself when an ATTR says `xattrs: 0`
    (PROTOCOL.md): every ATTR reply's count is what listxattr (and getxattr) find."""
    volume = Volume.new(Host())
    entry = fs(volume, "create", parent=ROOT_INO, name="f", mode=0o644, uid=0, gid=0)
    assert isinstance(entry, dict) and entry["xattrs"] == 0
    ino = int(entry["ino"])
    for op, name in steps:
        if op == "set":
            fs(volume, "setxattr", ino=ino, name=name, value=b"v", flags=0)
        else:
            try:
                fs(volume, "removexattr", ino=ino, name=name)
            except SlatesError:
                continue  # it had none of that name
        names = fs(volume, "listxattr", ino=ino)
        assert isinstance(names, list)
        for reply in (
            fs(volume, "getattr", ino=ino),
            fs(volume, "lookup", parent=ROOT_INO, name="f"),
            fs(volume, "setattr", ino=ino, mode=0o600),
        ):
            assert isinstance(reply, dict) and reply["xattrs"] == len(names)
        listed = fs(volume, "readdir", ino=ROOT_INO, offset=0, plus=True, limit_bytes=1 << 16)
        assert isinstance(listed, list)
        (plus,) = [item[4] for item in listed if item[0] == "f"]
        assert plus["xattrs"] == len(names)


MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ("create", "mkdir", "symlink", "link", "write", "unlink", "rename", "fallocate", "copy")
        ),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=25,
)


@given(MUTATIONS)
@settings(max_examples=60, deadline=None)
def test_a_mutation_asked_for_attrs_returns_what_getattr_answers_next(
    steps: list[tuple[str, int, int]],
) -> None:
    volume = Volume.new(Host())
    sub = fs(volume, "mkdir", parent=ROOT_INO, name="sub", mode=0o755, uid=0, gid=0)
    assert isinstance(sub, dict)
    dirs = [ROOT_INO, int(sub["ino"])]
    files: list[int] = [make(volume, "seed", b"seed")]
    for now, (op, a, b) in enumerate(steps, start=2000):
        parent, other = dirs[a % 2], dirs[b % 2]
        name, new_name = f"n{a}", f"n{b}"
        file = files[(a + b) % len(files)]
        args: dict[str, object]
        match op:
            case "create":
                args = {"parent": parent, "name": name, "mode": 0o644, "uid": 0, "gid": 0}
            case "mkdir":
                args = {"parent": parent, "name": name, "mode": 0o755, "uid": 0, "gid": 0}
            case "symlink":
                args = {"parent": parent, "name": name, "target": "t", "uid": 0, "gid": 0}
            case "link":
                args = {"ino": file, "new_parent": other, "new_name": new_name}
            case "write":
                args = {"ino": file, "offset": a * 100, "data": b"w" * (b + 1)}
            case "unlink":
                args = {"parent": parent, "name": name}
            case "rename":
                args = {
                    "parent": parent,
                    "name": name,
                    "new_parent": other,
                    "new_name": new_name,
                    "flags": 0,
                }
            case "fallocate":
                args = {"ino": file, "mode": 0, "offset": 0, "length": 4096 * (a + 1)}
            case _:
                args = {
                    "ino_in": files[0],
                    "off_in": 0,
                    "ino_out": file,
                    "off_out": b * 10,
                    "length": 4,
                }
        fs_op = "copy_file_range" if op == "copy" else op
        try:
            reply = run_fs_op(volume, "fs." + fs_op, {**args, "attrs": True}, now)
        except SlatesError:
            continue  # refused (exists, not found, not empty...): nothing changed
        assert isinstance(reply, dict), (op, reply)
        if op in ("create", "link") and stat.S_ISREG(int(reply["mode"])):
            files.append(int(reply["ino"]))
        expected = {
            "parent_attr": args.get("parent", args.get("new_parent")),
            "new_parent_attr": args.get("new_parent") if op == "rename" else None,
            "attr": args.get("ino", args.get("ino_out"))
            if op in ("write", "fallocate", "copy")
            else None,
        }
        if op in ("write", "fallocate", "copy"):
            expected["parent_attr"] = None
        for key, ino in expected.items():
            if ino is None:
                assert key not in reply, (op, key)
                continue
            assert reply[key] == _plain(fs(volume, "getattr", ino=ino)), (op, key)
    check_invariants(volume)


def test_without_the_flag_mutations_answer_as_before() -> None:
    volume = Volume.new(Host())
    ino = make(volume, "f")
    assert fs(volume, "write", ino=ino, offset=0, data=b"abc") == 3
    assert fs(volume, "fallocate", ino=ino, mode=0, offset=0, length=8192) == {}
    entry = fs(volume, "link", ino=ino, new_parent=ROOT_INO, new_name="g")
    assert isinstance(entry, dict) and "parent_attr" not in entry
    assert fs(volume, "unlink", parent=ROOT_INO, name="g") == {}
    reply = fs(volume, "write", ino=ino, offset=0, data=b"abcd", attrs=True)
    assert reply == {"written": 4, "attr": _plain(fs(volume, "getattr", ino=ino))}


CAPABILITY = bytes.fromhex("0100000200200000" + "00" * 12)
OWNER_GROUP, OTHER_GROUP = 100, 200

# (request, its kill, the file's mode before) -> the mode after; the file's group is
# OWNER_GROUP.  A kill is the caller's group: the kernel sends one when the caller
# lacks CAP_FSETID (writes, truncates, fallocates, copies) and on every chown.
KILLS = [
    ("write", None, 0o6777, 0o6777),  # a caller with CAP_FSETID keeps them
    ("write", OTHER_GROUP, 0o6777, 0o0777),
    ("write", OWNER_GROUP, 0o6777, 0o0777),  # group-executable: setgid goes anyway
    ("write", OWNER_GROUP, 0o2666, 0o2666),  # not executable, caller in the group
    ("write", OTHER_GROUP, 0o2666, 0o0666),  # ... outside it
    ("truncate", OTHER_GROUP, 0o4755, 0o0755),
    ("truncate", None, 0o4755, 0o4755),
    ("fallocate", OTHER_GROUP, 0o6777, 0o0777),
    ("copy", OTHER_GROUP, 0o6777, 0o0777),
    ("chown", OWNER_GROUP, 0o6755, 0o0755),
    ("chown", OTHER_GROUP, 0o2644, 0o2644),  # a chown takes setgid only when executable
]


def _change(volume: Volume, ino: int, request: str, kill: int | None) -> None:
    extra = {} if kill is None else {"kill": kill}
    match request:
        case "write":
            fs(volume, "write", ino=ino, offset=1, data=b"y", **extra)
        case "truncate":
            fs(volume, "setattr", ino=ino, size=0, **extra)
        case "fallocate":
            fs(volume, "fallocate", ino=ino, mode=0, offset=0, length=8192, **extra)
        case "copy":
            source = make(volume, "source", b"copied")
            fs(
                volume,
                "copy_file_range",
                ino_in=source,
                off_in=0,
                ino_out=ino,
                off_out=0,
                length=6,
                **extra,
            )
        case "chown":
            fs(volume, "setattr", ino=ino, uid=7, **extra)


@pytest.mark.parametrize(("request_", "kill", "before", "after"), KILLS)
def test_a_change_through_a_mount_takes_capabilities_and_set_id_bits_as_linux_does(
    request_: str, kill: int | None, before: int, after: int
) -> None:
    """The bridge claims FUSE_HANDLE_KILLPRIV_V2: these are the shard's to drop."""
    volume = Volume.new(Host())
    ino = make(volume, "tool", b"x")
    fs(volume, "setattr", ino=ino, mode=before, gid=OWNER_GROUP)
    volume.setxattr(ino, "security.capability", CAPABILITY)
    _change(volume, ino, request_, kill)
    assert stat.S_IMODE(volume.getattr(ino).mode) == after
    assert volume.listxattr(ino) == []  # whoever the caller: always
    check_invariants(volume)


def test_a_directory_keeps_its_bits_and_an_unasked_request_its_capability() -> None:
    volume = Volume.new(Host())
    attr = fs(volume, "mkdir", parent=ROOT_INO, name="d", mode=0o2775, uid=0, gid=0)
    assert isinstance(attr, dict)
    fs(volume, "setattr", ino=int(attr["ino"]), uid=7, kill=OTHER_GROUP)
    assert stat.S_IMODE(volume.getattr(int(attr["ino"])).mode) == 0o2775
    ino = make(volume, "tool", b"x")
    volume.setxattr(ino, "security.capability", CAPABILITY)
    fs(volume, "setattr", ino=ino, mode=0o755)  # a chmod changes no content, no owner
    fs(volume, "read", ino=ino, offset=0, size=1)
    assert volume.listxattr(ino) == ["security.capability"]
