"""The mount bridge without the real shard: its errno table, its msgpack codec,
and real mounts served by a small in-process stand-in shard.

The stand-in (`FakeShard`) speaks the real hello + ring protocol and answers
the fs.* operations of slates/fuse/PROTOCOL.md from a core Volume, so these
tests exercise the whole C path (kernel -> libfuse -> ring -> reply) and the
reconnect-and-resend logic before the daemon shards serve fs.* themselves.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slates._native import ffi, lib

from slates import errors
from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.volume import PRIVATE_ST_INO, Volume
from slates.errors import AlreadyExists, InvalidArgument, NotFound, SlatesError
from slates.fuse.bridge import WALK_ENV, read_counters, walk_entries
from slates.node.fsops import MODE_BITS, attr_map, cookie_of
from slates.node.protocol import (
    FrameReader,
    error_reply,
    frame,
    ok_reply,
    pack,
    parse_hello,
    parse_request,
    unpack,
    unpack_request,
)
from slates.node.ring import RingPair
from slates.node.runtime import AnchorState, Runtime, ShardInfo
from tests.anchor_fixture import stop_process
from tests.test_mount_prefetch import children_of

VOLUME = "vol-0-1"


# -- the errno table ------------------------------------------------------------


def _error_classes() -> list[type[errors.SlatesError]]:
    found: list[type[errors.SlatesError]] = []
    pending: list[type[errors.SlatesError]] = [errors.SlatesError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_errno_table_matches_every_error_class() -> None:
    classes = _error_classes()
    assert len(classes) >= 27
    for cls in classes:
        expected = getattr(errno, cls.errno_name)
        assert lib.bridge_errno_for(cls.code.encode()) == expected, cls.code
    assert lib.bridge_errno_for(b"SomethingNew") == errno.EIO


def test_error_replies_decode_to_errnos() -> None:
    for cls in _error_classes():
        message = pack(error_reply(3, cls("boom", path="/x")))
        out = ffi.new("int64_t[11]")
        assert lib.bridge_test_decode_attr(message, len(message), out) == getattr(
            errno, cls.errno_name
        )


# -- the codec ------------------------------------------------------------------


def _encoded(which: int) -> tuple[str, dict[str, Any]] | None:
    out = ffi.new("uint8_t[]", 1 << 16)
    op = ffi.new("char[]", 64)
    n = lib.bridge_test_encode(which, out, len(out), op, len(op))
    if n == -errno.ENOENT:
        return None
    assert n > 0
    message = unpack_request(bytes(ffi.buffer(out, n)))  # a split request too
    assert isinstance(message, dict)
    return ffi.string(op).decode(), message


# Mutations ask for the attributes they produce (slates/node/fsops.py, native/bridge_attr.c).
ATTRS: dict[str, Any] = {"attrs": True}

EXPECTED: list[tuple[str, dict[str, Any]]] = [
    ("fs.lookup", {"parent": 1, "name": "héllo"}),
    ("fs.lookup", {"parent": 1, "name": b"\xff\xfe"}),
    ("fs.forget", {"items": [[5, 2], [7, 1]]}),
    ("fs.getattr", {"ino": 5}),
    (
        "fs.setattr",
        {
            "ino": 5,
            "mode": 0o640,
            "uid": 1000,
            "gid": 1001,
            "size": 4096,
            "atime_ns": 1_000_000_001,
            "mtime_ns": None,  # UTIME_NOW: checked against the clock
        },
    ),
    ("fs.readlink", {"ino": 9}),
    (
        "fs.mknod",
        {"parent": 1, "name": "fifo", "mode": stat.S_IFIFO | 0o644, "rdev": 0, "uid": 1, "gid": 2}
        | ATTRS,
    ),
    ("fs.mkdir", {"parent": 1, "name": "d", "mode": 0o755, "uid": 1, "gid": 2} | ATTRS),
    ("fs.unlink", {"parent": 1, "name": "f"} | ATTRS),
    ("fs.rmdir", {"parent": 1, "name": "d"} | ATTRS),
    (
        "fs.symlink",
        {"parent": 1, "name": "l", "target": "../target", "uid": 1, "gid": 2} | ATTRS,
    ),
    (
        "fs.rename",
        {"parent": 1, "name": "a", "new_parent": 2, "new_name": "b", "flags": 1} | ATTRS,
    ),
    ("fs.link", {"ino": 5, "new_parent": 2, "new_name": "h"} | ATTRS),
    (
        "fs.create",
        {"parent": 1, "name": "c", "mode": 0o600, "uid": 1, "gid": 2, "exclusive": True} | ATTRS,
    ),
    ("fs.read", {"ino": 5, "offset": 4096, "size": 65536}),
    ("fs.write", {"ino": 5, "offset": 10, "data": b"hello\x00world"} | ATTRS),
    ("fs.fsync", {"ino": 5}),
    ("fs.statfs", {}),
    ("fs.readdir", {"ino": 1, "offset": 0, "plus": True, "limit_bytes": 4096}),
    ("fs.setxattr", {"ino": 5, "name": "user.k", "value": b"v\x00", "flags": 1}),
    ("fs.getxattr", {"ino": 5, "name": "user.k"}),
    ("fs.listxattr", {"ino": 5}),
    ("fs.removexattr", {"ino": 5, "name": "user.k"}),
    ("fs.fallocate", {"ino": 5, "mode": 1, "offset": 0, "length": 8192} | ATTRS),
    ("fs.lseek", {"ino": 5, "offset": 100, "whence": 3}),
    (
        "fs.copy_file_range",
        {"ino_in": 5, "off_in": 0, "ino_out": 6, "off_out": 4096, "length": 1 << 30} | ATTRS,
    ),
    ("fs.access", {"ino": 5, "mask": 4}),
    (
        "fs.create",
        {"parent": 1, "name": "c", "mode": 0o644, "uid": 1, "gid": 2, "exclusive": False} | ATTRS,
    ),
    (
        "fs.create",
        {"parent": 1, "name": "c", "mode": 0o600, "uid": 1, "gid": 2, "exclusive": True}
        | ATTRS
        | {"behind": True},
    ),
    # The kernel asked that set-ID bits go (FUSE_HANDLE_KILLPRIV_V2: the writer lacks
    # CAP_FSETID, or a chown): "kill" is the caller's group.
    (
        "fs.write",
        {"ino": 5, "offset": 10, "data": b"hello\x00world", "granted": True, "kill": 1001},
    ),
    ("fs.setattr", {"ino": 5, "kill": 0, "uid": 1000, "size": 4096}),
]


def test_c_requests_decode_as_the_protocol_says() -> None:
    assert lib.bridge_configure(b"vol-3-7", 0) == 0
    previous = None
    for which, (op, args) in enumerate(EXPECTED):
        got = _encoded(which)
        assert got is not None, which
        got_op, message = got
        assert got_op == op
        assert set(message) == {"seq", "ack", "op", "args"}
        assert message["op"] == op
        assert message["ack"] == message["seq"] - 1
        if previous is not None:
            assert message["seq"] == previous + 1
        previous = message["seq"]
        want = {"volume": "vol-3-7", **args}
        if want.get("mtime_ns", 0) is None:
            assert abs(message["args"]["mtime_ns"] - time.time_ns()) < 60 * 10**9
            want["mtime_ns"] = message["args"]["mtime_ns"]
        assert message["args"] == want, op
        # The shard's own decoder takes it as a request.
        request = parse_request(unpack(bytes(msgpack.packb(message, use_bin_type=True))))
        assert request.op == op
    assert _encoded(len(EXPECTED)) is None


ATTR_FIELDS = (
    "ino",
    "mode",
    "nlink",
    "uid",
    "gid",
    "size",
    "blocks",
    "atime_ns",
    "mtime_ns",
    "ctime_ns",
    "rdev",
)


@pytest.mark.parametrize(
    "attr",
    [
        {
            "ino": 42,
            "mode": stat.S_IFREG | 0o644,
            "nlink": 2,
            "uid": 1000,
            "gid": 1000,
            "size": 1 << 40,
            "blocks": 8,
            "atime_ns": 1_700_000_000_123_456_789,
            "mtime_ns": -1_500_000_001,  # before the epoch
            "ctime_ns": 0,
            "rdev": 0,
        },
        {
            "ino": 2**62,
            "mode": stat.S_IFCHR | 0o600,
            "nlink": 1,
            "uid": 0,
            "gid": 0,
            "size": 0,
            "blocks": 0,
            "atime_ns": 1,
            "mtime_ns": 2,
            "ctime_ns": 3,
            "rdev": (1 << 8) | 3,
        },
    ],
)
def test_attr_replies_decode(attr: dict[str, int]) -> None:
    message = pack(ok_reply(9, attr))
    out = ffi.new("int64_t[11]")
    assert lib.bridge_test_decode_attr(message, len(message), out) == 0
    assert dict(zip(ATTR_FIELDS, list(out), strict=True)) == attr


def test_absent_xattr_set() -> None:
    def run(ops: list[int], probe: int) -> bool:
        items = ffi.new("uint64_t[]", [op & (2**64 - 1) for op in ops])
        return bool(lib.bridge_test_absent_set(items, len(ops), probe))

    keys = [(ino << 3) | 1 for ino in range(1, 5000)]
    assert run(keys, keys[1234])  # grows past its first table
    assert not run([], (9999 << 3) | 1)
    # Removing any key keeps every other one reachable (backward-shift deletion).
    removed = set(keys[::3])
    assert not run([~k for k in removed], keys[0])
    for k in keys[:600]:
        assert run([], k) == (k not in removed)
    assert run([keys[0]], keys[0])


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=400),
    probe=st.integers(1, 300),
)
def test_the_node_map_holds_what_a_set_holds(ops: list[tuple[bool, int]], probe: int) -> None:
    # bridge_meta.c's map (adds and backward-shift removals) against a set.
    model: set[int] = set()
    encoded = []
    for add, key in ops:
        key = key * 0x10001  # spread over the table's homes
        if add:
            model.add(key)
        else:
            model.discard(key)
        encoded.append(key if add else ~key & (2**64 - 1))
    items = ffi.new("uint64_t[]", encoded or [0])
    assert lib.bridge_test_meta_map(items, len(encoded), probe * 0x10001) == (
        probe * 0x10001 in model
    )


@settings(max_examples=300, deadline=None)
@given(name=st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and 0 not in b))
def test_the_bridge_and_the_shard_agree_on_readdir_cookies(name: bytes) -> None:
    # A listing the bridge answers from the base may be continued by the shard.
    text = name.decode("utf-8", "surrogateescape")
    assert lib.bridge_test_cookie(name, len(name)) == cookie_of(text)


def test_absence_learned_across_an_invalidation_is_not_recorded() -> None:
    # The watcher thread's invalidation between a request and its reply must
    # win: the loop thread records nothing learned from before it.
    assert lib.bridge_test_absent_since(70001, 0) == 1
    assert lib.bridge_test_absent_since(70011, 1) == 0


def test_the_attribute_table_keeps_an_entry_only_while_it_is_true() -> None:
    # bridge_attr.c: kept when nothing happened (or another inode was dropped);
    # not recorded across an invalidation; gone after a drop, a drop-all or the
    # shard's invalidation of the inode.
    assert lib.bridge_test_attr_cache(90001, 0) == 1
    assert lib.bridge_test_attr_cache(90001, 5) == 1
    for event in (1, 2, 3, 4):
        assert lib.bridge_test_attr_cache(90001, event) == 0, event


def test_malformed_replies_are_rejected() -> None:
    out = ffi.new("int64_t[11]")
    for bad in (b"", b"\xc1", pack({"ok": True}), msgpack.packb([1, 2]), pack(ok_reply(1, {}))):
        assert lib.bridge_test_decode_attr(bad, len(bad), out) == -errno.EBADMSG


# -- a stand-in shard -------------------------------------------------------------

_KIND_BITS = MODE_BITS
_KIND_OF = {bits: kind for kind, bits in _KIND_BITS.items()}


def _name(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if not isinstance(value, str):
        raise InvalidArgument("a name is str or bin")
    return value


class FakeShard:
    """Shard 0 of a runtime directory, answering fs.* from one Volume (threads)."""

    def __init__(self, runtime: Path, base: Path) -> None:
        self.runtime = Runtime(runtime)
        self.runtime.prepare()
        self.volume = Volume.new(Host(), base=LiveDirectory(str(base)))
        self.lookups: dict[int, int] = {}
        self.negative_lookups = 0
        self.seen: list[tuple[str, int, str]] = []  # (client, seq, op) as received
        self.saved: dict[tuple[str, int], bytes] = {}
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.hold = threading.Event()  # set: take requests but do not answer them
        # True: lookups' ATTRs carry the optional "xattrs" count (PROTOCOL.md).
        self.xattr_counts = False
        path = str(self.runtime.shard_socket(0))
        self.runtime.write_state(
            AnchorState(os.getpid(), (ShardInfo(0, os.getpid(), path, 0),), 1 << 30)
        )

    # lifecycle
    def start(self) -> None:
        path = self.runtime.shard_socket(0)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(16)
        self.listener = listener
        self.stopping.clear()
        thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        """Like a crash: every connection drops; saved results survive (the journal)."""
        self.stopping.set()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            thread.join(timeout=10)
        self.threads = []
        for conn in self.conns:
            conn.close()
        self.conns = []

    def _accept(self, listener: socket.socket) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader()
        while (hello_frame := reader.next_frame()) is None:
            data = conn.recv(4096)
            if not data:
                return
            reader.feed(data)
        client = parse_hello(unpack(hello_frame)).client
        answer = frame(pack({"ok": True, "shard": 0, "pid": os.getpid(), "rings": True}))
        with RingPair.create() as pair:
            fds = array.array("i", pair.fds)
            conn.sendmsg([answer], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            while not self.stopping.is_set():
                readable, _, _ = select.select([conn], [], [], 0)
                if readable:
                    return  # the bridge hung up (or we were shut down)
                message = pair.requests.receive_blocking(timeout=0.05)
                if message is None:
                    continue
                request = parse_request(unpack_request(message))
                with self.lock:
                    self.seen.append((client, request.seq, request.op))
                while self.hold.is_set() and not self.stopping.is_set():
                    time.sleep(0.01)
                if self.stopping.is_set():
                    return  # die with the request unanswered
                reply = self._answer(client, request.seq, request.op, request.args)
                while not pair.replies.push(reply):
                    time.sleep(0.0005)

    def _answer(self, client: str, seq: int, op: str, args: dict[str, Any]) -> bytes:
        key = (client, seq)
        with self.lock:
            if key in self.saved:
                return self.saved[key]
            try:
                reply = pack(ok_reply(seq, self._run(op, args)))
            except SlatesError as exc:
                reply = pack(error_reply(seq, exc))
            self.saved[key] = reply
            return reply

    def _retain(self, ino: int, n: int = 1) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + n

    def _run(self, op: str, args: dict[str, Any]) -> Any:
        v = self.volume
        now = time.time_ns()
        if args.get("volume") != VOLUME:
            raise NotFound("no such volume")
        match op:
            case "fs.lookup":
                try:
                    a = v.lookup(args["parent"], _name(args["name"]))
                except NotFound:
                    self.negative_lookups += 1
                    raise
                self._retain(a.ino)
                if self.xattr_counts:
                    return {**attr_map(a), "xattrs": len(v.listxattr(a.ino))}
                return attr_map(a)
            case "fs.forget":
                for ino, n in args["items"]:
                    self.lookups[ino] = self.lookups.get(ino, 0) - n
                return {}
            case "fs.getattr":
                return attr_map(v.getattr(args["ino"]))
            case "fs.setattr":
                ino = args["ino"]
                if "size" in args:
                    v.truncate(ino, args["size"], time_ns=now)
                fields = ("mode", "uid", "gid", "atime_ns", "mtime_ns")
                changes = {k: args[k] for k in fields if k in args}
                if changes:
                    return attr_map(v.setattr(ino, time_ns=now, **changes))
                return attr_map(v.getattr(ino))
            case "fs.readlink":
                return v.readlink(args["ino"])
            case "fs.mknod":
                mode = args["mode"]
                a = v.mknod(
                    args["parent"],
                    _name(args["name"]),
                    _KIND_OF[stat.S_IFMT(mode)],
                    stat.S_IMODE(mode),
                    args["rdev"],
                    uid=args["uid"],
                    gid=args["gid"],
                    time_ns=now,
                )
                self._retain(a.ino)
                return attr_map(a)
            case "fs.mkdir":
                a = v.mkdir(
                    args["parent"],
                    _name(args["name"]),
                    args["mode"],
                    uid=args["uid"],
                    gid=args["gid"],
                    time_ns=now,
                )
                self._retain(a.ino)
                return attr_map(a)
            case "fs.unlink":
                v.unlink(args["parent"], _name(args["name"]), time_ns=now)
                return {}
            case "fs.rmdir":
                v.rmdir(args["parent"], _name(args["name"]), time_ns=now)
                return {}
            case "fs.symlink":
                a = v.symlink(
                    args["parent"],
                    _name(args["name"]),
                    _name(args["target"]),
                    uid=args["uid"],
                    gid=args["gid"],
                    time_ns=now,
                )
                self._retain(a.ino)
                return attr_map(a)
            case "fs.rename":
                v.rename(
                    args["parent"],
                    _name(args["name"]),
                    args["new_parent"],
                    _name(args["new_name"]),
                    args["flags"],
                    time_ns=now,
                )
                return {}
            case "fs.link":
                a = v.link(args["ino"], args["new_parent"], _name(args["new_name"]), time_ns=now)
                self._retain(a.ino)
                return attr_map(a)
            case "fs.create":
                parent, name = args["parent"], _name(args["name"])
                try:
                    a = v.create(
                        parent,
                        name,
                        args["mode"],
                        uid=args["uid"],
                        gid=args["gid"],
                        time_ns=now,
                    )
                except AlreadyExists:
                    if args["exclusive"]:
                        raise
                    a = v.lookup(parent, name)
                self._retain(a.ino)
                return attr_map(a)
            case "fs.read":
                return v.read(args["ino"], args["offset"], args["size"])
            case "fs.write":
                return v.write(args["ino"], args["offset"], args["data"], time_ns=now)
            case "fs.fsync" | "fs.access" | "fs.destroy":
                return {}
            case "fs.statfs":
                return {
                    "bsize": 4096,
                    "frsize": 4096,
                    "blocks": 1 << 18,
                    "bfree": 1 << 17,
                    "bavail": 1 << 17,
                    "files": 1 << 20,
                    "ffree": 1 << 19,
                    "namemax": 255,
                }
            case "fs.readdir":
                return self._readdir(args["ino"], args["offset"], args["plus"])
            case "fs.setxattr":
                v.setxattr(
                    args["ino"], _name(args["name"]), args["value"], args["flags"], time_ns=now
                )
                return {}
            case "fs.getxattr":
                return v.getxattr(args["ino"], _name(args["name"]))
            case "fs.listxattr":
                return v.listxattr(args["ino"])
            case "fs.removexattr":
                v.removexattr(args["ino"], _name(args["name"]), time_ns=now)
                return {}
            case "fs.lseek":
                size = v.getattr(args["ino"]).size
                return args["offset"] if args["whence"] == 3 else size
            case "fs.fallocate":
                ino, end = args["ino"], args["offset"] + args["length"]
                if args["mode"] == 0 and v.getattr(ino).size < end:
                    v.truncate(ino, end, time_ns=now)
                return {}
            case "fs.copy_file_range":
                data = v.read(args["ino_in"], args["off_in"], args["length"])
                return v.write(args["ino_out"], args["off_out"], data, time_ns=now)
            case _:
                raise InvalidArgument("unknown operation", op=op)

    def _readdir(self, ino: int, offset: int, plus: bool) -> list[Any]:
        """Every entry from `offset` on, ignoring limit_bytes (the bridge must cope)."""
        v = self.volume
        here = v.getattr(ino)
        entries: list[Any] = [[".", stat.S_IFDIR, ino, 1, None], ["..", stat.S_IFDIR, ino, 2, None]]
        for index, item in enumerate(v.readdir(ino), start=3):
            a = v.lookup(ino, item.name)  # binds base names: every entry has an inode
            attr = None
            if plus:
                self._retain(a.ino)
                attr = attr_map(a)
            entries.append([item.name, _KIND_BITS[a.kind], a.ino, index, attr])
        del here
        return [e for e in entries if e[3] > offset]


# -- mounts served by the stand-in ------------------------------------------------

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)


def _mounted(path: Path) -> bool:
    with open("/proc/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


class MountedBridge:
    def __init__(self, process: subprocess.Popen[bytes], mountpoint: Path, counters: Path) -> None:
        self.process = process
        self.mountpoint = mountpoint
        self.counters = counters

    def counts(self) -> dict[str, int]:
        return read_counters(self.counters)

    def stop(self) -> int | None:
        stop_process(self.process)
        if _mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        return self.process.returncode


def start_bridge(
    runtime: Path, mountpoint: Path, volume: str = VOLUME, *extra: str
) -> MountedBridge:
    counters = runtime.parent / f"{mountpoint.name}.counters"
    read_end, write_end = os.pipe()
    log = open(runtime.parent / f"{mountpoint.name}.bridge.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slates.fuse.bridge",
            "--runtime-dir",
            str(runtime),
            "--volume",
            volume,
            "--mountpoint",
            str(mountpoint),
            "--ready-fd",
            str(write_end),
            "--counters",
            str(counters),
            *extra,
        ],
        pass_fds=(write_end,),
        stdout=log,
        stderr=log,
    )
    os.close(write_end)
    log.close()
    bridge = MountedBridge(process, mountpoint, counters)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        signal_byte = os.read(read_end, 1) if ready else b""
    finally:
        os.close(read_end)
    if signal_byte != b"1":
        # The bridge closes the ready pipe before it reports why: let it finish first.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        bridge.stop()
        text = (runtime.parent / f"{mountpoint.name}.bridge.log").read_text()
        raise AssertionError(f"the bridge did not come up: {text}")
    # Once the mount serves, the prefetch walk (native/bridge_prefetch.c) lists the
    # root through this fake shard; a test that holds the shard's next request must not
    # catch the walk's instead, so the walk ends first (its reader process with it).
    deadline = time.monotonic() + 30
    while bridge.counts().get("prefetches", 0) < 1 or children_of(process.pid):
        if time.monotonic() > deadline:
            bridge.stop()
            raise AssertionError("the bridge's prefetch walk did not end")
        time.sleep(0.01)
    return bridge


def _tree_digest(root: Path) -> dict[str, tuple[int, int, str]]:
    out: dict[str, tuple[int, int, str]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = ""
        if path.is_file() and not path.is_symlink():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeShard, Path]]:
    base = tmp_path / "base"
    (base / "src" / "pkg").mkdir(parents=True)
    (base / "README").write_text("hello from the base\n")
    (base / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    for i in range(60):
        (base / "src" / "pkg" / f"f{i:03}.txt").write_bytes(os.urandom(100 + i * 97))
    (base / "big.bin").write_bytes(os.urandom(3 << 20))
    os.symlink("README", base / "link")
    shard = FakeShard(tmp_path / "run", base)
    shard.start()
    try:
        yield shard, base
    finally:
        shard.stop()


@pytest.fixture
def mount(fake: tuple[FakeShard, Path], tmp_path: Path) -> Iterator[MountedBridge]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    bridge = start_bridge(tmp_path / "run", mountpoint)
    try:
        yield bridge
    finally:
        bridge.stop()
        assert not _mounted(mountpoint)


def _sh(cwd: Path, script: str) -> str:
    done = subprocess.run(
        ["bash", "-ec", script], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_fuse
def test_mount_serves_posix_basics(fake: tuple[FakeShard, Path], mount: MountedBridge) -> None:
    shard, base = fake
    before = _tree_digest(base)
    m = mount.mountpoint
    assert sorted(os.listdir(m)) == ["README", "big.bin", "link", "src"]
    assert (m / "README").read_text() == "hello from the base\n"
    assert (m / "big.bin").read_bytes() == (base / "big.bin").read_bytes()
    assert os.readlink(m / "link") == "README"
    assert (m / "src" / "pkg" / "f059.txt").read_bytes() == (
        base / "src" / "pkg" / "f059.txt"
    ).read_bytes()
    _sh(
        m,
        """
        echo new > new.txt
        mkdir -p d/e
        mv new.txt d/e/moved.txt
        echo more >> README
        rm src/main.c
        mv src/pkg src/renamed
        ln d/e/moved.txt hard
        ln -s d/e/moved.txt soft
        chmod 600 hard
        truncate -s 3 big.bin
        mkfifo fifo
        touch -d '2001-02-03 04:05:06' README
        setfattr -n user.k -v val hard 2>/dev/null || python3 -c \
            "import os; os.setxattr('hard', 'user.k', b'val')"
        """,
    )
    assert (m / "d" / "e" / "moved.txt").read_text() == "new\n"
    assert (m / "README").read_text() == "hello from the base\nmore\n"
    assert not (m / "src" / "main.c").exists()
    assert sorted(os.listdir(m / "src")) == ["renamed"]
    assert len(os.listdir(m / "src" / "renamed")) == 60
    assert os.stat(m / "hard").st_ino == os.stat(m / "d" / "e" / "moved.txt").st_ino
    assert os.stat(m / "hard").st_nlink == 2
    assert stat.S_IMODE(os.stat(m / "d" / "e" / "moved.txt").st_mode) == 0o600
    assert os.readlink(m / "soft") == "d/e/moved.txt"
    assert (m / "big.bin").read_bytes() == (base / "big.bin").read_bytes()[:3]
    assert stat.S_ISFIFO(os.stat(m / "fifo").st_mode)
    assert time.gmtime(os.stat(m / "README").st_mtime)[:3] == (2001, 2, 3)
    assert os.getxattr(m / "hard", "user.k") == b"val"
    assert "user.k" in os.listxattr(m / "hard")
    os.removexattr(m / "hard", "user.k")
    with pytest.raises(OSError) as info:
        os.getxattr(m / "hard", "user.k")
    assert info.value.errno == errno.ENODATA
    with pytest.raises(FileNotFoundError):
        (m / "nope").read_text()
    with pytest.raises(FileExistsError):
        os.open(m / "README", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with pytest.raises(OSError) as info:
        os.rmdir(m / "d")
    assert info.value.errno == errno.ENOTEMPTY
    os.rename(m / "soft", m / "d" / "soft2")
    with pytest.raises(FileExistsError):
        os.link(m / "hard", m / "README")
    sv = os.statvfs(m)
    assert sv.f_blocks == 1 << 18 and sv.f_namemax == 255
    # A large write and read back, through several ring messages each.
    blob = os.urandom((5 << 20) + 123)
    (m / "blob").write_bytes(blob)
    os.sync()
    assert hashlib.sha256((m / "blob").read_bytes()).digest() == hashlib.sha256(blob).digest()
    # The volume (not just the kernel's cache) holds it.
    ino = os.stat(m / "blob").st_ino - PRIVATE_ST_INO  # a new file: not a base number
    assert shard.volume.read(ino, 0, len(blob) + 1) == blob
    assert _tree_digest(base) == before, "the base directory was written"
    assert all(n >= 0 for n in shard.lookups.values()), "the kernel forgot more than it looked up"
    counts = mount.counts()
    # The first ENOSYS teaches the kernel (no_open, no_opendir); an open that raced
    # it sends one more: the bridge's prefetch reader opens directories meanwhile.
    assert counts.get("OPEN", 0) <= 1 and counts.get("OPENDIR", 0) <= 2
    assert counts.get("FLUSH", 0) <= 1


def _asked(shard: FakeShard, op: str) -> int:
    with shard.lock:
        return sum(1 for seen in shard.seen if seen[2] == op)


def _no_attribute(path: Path, name: str) -> bool:
    try:
        os.getxattr(path, name)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            return True
        raise
    return False


@needs_fuse
def test_probed_xattrs_known_absent(fake: tuple[FakeShard, Path], mount: MountedBridge) -> None:
    """security.* probes are answered by the bridge only when the shard told it absence."""
    shard, _base = fake
    m = mount.mountpoint
    # A base file: the first probe asks the shard, the second does not.
    assert _no_attribute(m / "README", "security.capability")
    assert _asked(shard, "fs.getxattr") == 1
    assert _no_attribute(m / "README", "security.capability")
    assert _asked(shard, "fs.getxattr") == 1
    # A file made through the mount has no xattrs: neither a probe nor the
    # kernel's own security.capability check on write(2) asks the shard.
    with open(m / "made", "xb", buffering=0) as f:
        f.write(b"one")
        f.write(b"two")
    assert _no_attribute(m / "made", "security.capability")
    os.mkdir(m / "dir")
    assert _no_attribute(m / "dir", "security.selinux")
    assert _asked(shard, "fs.getxattr") == 1
    # A security.* name set through the mount is no longer "absent"; removed, it is again.
    os.setxattr(m / "made", "security.selinux", b"label\0")
    assert os.getxattr(m / "made", "security.selinux") == b"label\0"
    assert _asked(shard, "fs.getxattr") == 2
    os.removexattr(m / "made", "security.selinux")
    assert _no_attribute(m / "made", "security.selinux")
    assert _asked(shard, "fs.getxattr") == 3
    assert _no_attribute(m / "made", "security.selinux")
    assert _asked(shard, "fs.getxattr") == 3
    # A hard link names an existing inode: what it holds is not assumed.
    os.setxattr(m / "made", "security.selinux", b"kept")
    os.link(m / "made", m / "other-name")
    assert os.getxattr(m / "other-name", "security.selinux") == b"kept"
    # An ATTR that counts the inode's xattrs tells absence with no probe at all...
    shard.xattr_counts = True
    assert _no_attribute(m / "src" / "main.c", "security.capability")
    assert _asked(shard, "fs.getxattr") == 4
    # ... and presence too: a counted inode that has some is still asked.
    with shard.lock:
        ino = shard.volume.lookup(1, "big.bin").ino
        shard.volume.setxattr(ino, "security.selinux", b"set-by-another", 0, time_ns=1)
    assert os.getxattr(m / "big.bin", "security.selinux") == b"set-by-another"
    assert _asked(shard, "fs.getxattr") == 5


WARM_PASS = (
    "find . -type f -print0 | xargs -0 cat > /dev/null; find . > /dev/null; ls -R > /dev/null"
)


# How the bridge waited for the requests counted beside them (bridge_spin.c),
# not requests of their own.
WAIT_COUNTERS = frozenset(
    {"spin_hits", "spin_parks", "reply_spin_hits", "reply_spin_misses", "reply_spin_skips"}
)


def warm_passes(mount: MountedBridge, passes: int = 3) -> list[dict[str, int]]:
    """Counters sent by each pass of WARM_PASS (plus a missing-name probe)."""
    sent: list[dict[str, int]] = []
    for _ in range(passes):
        before = mount.counts()
        _sh(mount.mountpoint, WARM_PASS)
        with pytest.raises(FileNotFoundError):
            (mount.mountpoint / "missing").stat()
        after = mount.counts()
        sent.append(
            {
                k: after[k] - before.get(k, 0)
                for k in after
                if after[k] != before.get(k, 0) and k not in WAIT_COUNTERS
            }
        )
    return sent


def _files_and_dirs(root: Path) -> tuple[int, int]:
    files = sum(1 for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return files, 1 + sum(1 for p in root.rglob("*") if p.is_dir() and not p.is_symlink())


@needs_fuse
def test_warm_passes_write_through(fake: tuple[FakeShard, Path], tmp_path: Path) -> None:
    """Without writeback caching, a warm pass sends nothing once atimes are refreshed.

    The cold pass's READs invalidate the kernel's cached atime, so the next
    stat of each file and directory (cat fstat()s its input) asks once more.
    """
    _shard, base = fake
    mountpoint = tmp_path / "wt"
    mountpoint.mkdir()
    mount = start_bridge(tmp_path / "run", mountpoint, VOLUME, "--no-writeback-cache")
    try:
        cold, second, third = warm_passes(mount)
    finally:
        mount.stop()
    files, dirs = _files_and_dirs(base)
    assert cold.get("READ", 0) > 0 and cold.get("READDIRPLUS", 0) > 0
    assert set(second) <= {"GETATTR", "round_trips"}, second
    assert second.get("GETATTR", 0) <= files + dirs
    assert third == {}, f"a warm pass sent {third}"


@needs_fuse
def test_warm_passes_writeback(fake: tuple[FakeShard, Path], mount: MountedBridge) -> None:
    """With writeback caching, every close makes the kernel distrust i_blocks,
    so a warm pass costs one GETATTR per file it opens, and nothing else."""
    _shard, base = fake
    cold, second, third = warm_passes(mount)
    files, dirs = _files_and_dirs(base)
    assert cold.get("READ", 0) > 0
    for sent in (second, third):
        assert set(sent) <= {"GETATTR", "round_trips"}, sent
        assert sent.get("GETATTR", 0) <= files + dirs


@needs_fuse
def test_shard_restart_is_a_pause(fake: tuple[FakeShard, Path], mount: MountedBridge) -> None:
    shard, _base = fake
    m = mount.mountpoint
    fd = os.open(m / "log", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"a" * 1000)
        os.fsync(fd)
        # The next request is taken but not answered; the shard then "dies".
        shard.hold.set()
        done = threading.Event()
        failure: list[BaseException] = []

        def sync() -> None:
            try:
                os.write(fd, b"b" * 1000)
                os.fsync(fd)
            except BaseException as exc:
                failure.append(exc)
            done.set()

        seen_before = len(shard.seen)
        worker = threading.Thread(target=sync)
        worker.start()
        deadline = time.monotonic() + 10
        while len(shard.seen) == seen_before:
            assert time.monotonic() < deadline, "the write never reached the shard"
            time.sleep(0.01)
        held = shard.seen[seen_before]
        assert held[2] == "fs.write", held
        shard.stop()
        shard.hold.clear()
        time.sleep(0.3)
        assert not done.is_set(), "the request failed instead of waiting"
        shard.start()
        assert done.wait(30)
        worker.join()
        assert failure == []
    finally:
        os.close(fd)
    assert (m / "log").read_bytes() == b"a" * 1000 + b"b" * 1000
    # The same (client, seq) came again after the reconnect.
    assert [s for s in shard.seen if s[:2] == held[:2]] == [held, held]
    assert mount.counts()["reconnects"] >= 1


@needs_fuse
def test_sigterm_unmounts_and_exits_zero(fake: tuple[FakeShard, Path], tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt2"
    mountpoint.mkdir()
    bridge = start_bridge(tmp_path / "run", mountpoint)
    try:
        assert _mounted(mountpoint)
        assert (mountpoint / "README").exists()
        bridge.process.send_signal(signal.SIGTERM)
        assert bridge.process.wait(timeout=20) == 0
        assert not _mounted(mountpoint)
    finally:
        bridge.stop()


@needs_fuse
def test_refuses_missing_volume_and_busy_mountpoint(
    fake: tuple[FakeShard, Path], tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt3"
    mountpoint.mkdir()
    with pytest.raises(AssertionError, match="NotFound"):
        start_bridge(tmp_path / "run", mountpoint, volume="vol-0-99")
    (mountpoint / "x").write_text("")
    with pytest.raises(AssertionError, match="not empty"):
        start_bridge(tmp_path / "run", mountpoint)
    assert not _mounted(mountpoint)


def test_the_walk_budget_is_the_environments_within_its_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """$SLATES_BRIDGE_WALK_ENTRIES sets how many entries a mount's prefetch walk lists
    (native/bridge_prefetch.c); a value that is no count, or past the bound, is the
    caller's error, and C refuses one past the bound too."""
    monkeypatch.delenv(WALK_ENV, raising=False)
    assert walk_entries() == lib.BRIDGE_WALK_ENTRIES == 131072
    monkeypatch.setenv(WALK_ENV, "2048")
    assert walk_entries() == 2048
    monkeypatch.setenv(WALK_ENV, "0")  # no walk
    assert walk_entries() == 0
    for bad in ("-1", "many", "1e3", str(lib.BRIDGE_WALK_ENTRIES_MAX + 1)):
        monkeypatch.setenv(WALK_ENV, bad)
        with pytest.raises(InvalidArgument):
            walk_entries()
    assert lib.bridge_set_walk_entries(-1) == -errno.EINVAL
    assert lib.bridge_set_walk_entries(lib.BRIDGE_WALK_ENTRIES_MAX + 1) == -errno.EINVAL
    assert lib.bridge_set_walk_entries(lib.BRIDGE_WALK_ENTRIES) == 0  # no mount here: idle
