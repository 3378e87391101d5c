"""The volume against a plain in-memory model, driven by hypothesis.

Random sequences of namespace and content operations (rename while open,
hard links, truncate, sparse writes, snapshot, clone, seal, xattrs) run on
several volumes (one over a base directory, plus clones of snapshots) and
on a dict-of-dicts model.  Every result, every error class and the whole
visible tree must agree after every step; internal invariants (extent maps,
counters, charges) are checked too.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slates.core.extents import PAGE
from slates.core.host import Host
from slates.core.records import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    XATTR_CREATE,
    XATTR_REPLACE,
    BaseEntry,
    Fingerprint,
    Kind,
)
from slates.core.volume import Snapshot, Volume
from slates.errors import (
    AlreadyExists,
    DirectoryNotEmpty,
    InvalidArgument,
    IsADirectory,
    NoSuchAttribute,
    NotADirectory,
    NotFound,
    NotPermitted,
    SlatesError,
)
from tests.volume_check import check_invariants, tree

NAMES = st.sampled_from(["a", "b", "c", "dd"])
OFFSETS = st.integers(0, 4 * PAGE + 7)
DATA = st.binary(min_size=0, max_size=2 * PAGE + 5)


class MemoryBase:
    """A fixed base directory held in memory (implements BaseReader)."""

    def __init__(self, files: dict[str, bytes], dirs: list[str]) -> None:
        self.files = files
        self.dirs = {"/", *dirs}
        self.inode = {path: n for n, path in enumerate(sorted(self.files) + sorted(self.dirs), 10)}

    def _entry(self, path: str, kind: Kind, size: int) -> BaseEntry:
        fp = Fingerprint(1, self.inode[path], size, 0)
        return BaseEntry(
            path, kind, 0o644 if kind == Kind.FILE else 0o755, 0, 0, size, 0, 0, 0, 0, fp
        )

    def stat(self, path: str) -> BaseEntry | None:
        if path in self.files:
            return self._entry(path, Kind.FILE, len(self.files[path]))
        if path in self.dirs:
            return self._entry(path, Kind.DIR, 0)
        return None

    def list(self, path: str) -> list[tuple[str, Kind]]:
        prefix = path.rstrip("/") + "/"
        out = [
            (p[len(prefix) :], Kind.FILE)
            for p in self.files
            if p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]
        out += [
            (p[len(prefix) :], Kind.DIR)
            for p in self.dirs
            if p != "/" and p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]
        return out

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        assert fingerprint.inode == self.inode[path]
        return self.files[path][offset : offset + size]


BASE_FILES = {"/a": b"quality=80\ncache=off\n", "/b/c": bytes(range(256)) * 40, "/b/dd": b""}
BASE_DIRS = ["/b", "/c"]


@dataclasses.dataclass
class Node:
    kind: str
    data: bytearray = dataclasses.field(default_factory=bytearray)
    target: str = ""
    nlink: int = 1
    mode: int = 0o644
    xattrs: dict[str, bytes] = dataclasses.field(default_factory=dict)
    entries: dict[str, int] = dataclasses.field(default_factory=dict)
    parent: int = 0


class Model:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {1: Node("dir", mode=0o755, nlink=2, parent=1)}
        self.next = 2

    def add(self, node: Node) -> int:
        self.nodes[self.next] = node
        self.next += 1
        return self.next - 1

    def resolve(self, path: str) -> int:
        nid = 1
        for part in path.split("/")[1:]:
            if part:
                nid = self.nodes[nid].entries[part]
        return nid

    def paths(self, want: str | None = None) -> list[str]:
        out = ["/"] if want in (None, "dir") else []

        def walk(nid: int, prefix: str) -> None:
            for name, child in sorted(self.nodes[nid].entries.items()):
                path = f"{prefix}/{name}"
                if want is None or self.nodes[child].kind == want:
                    out.append(path)
                if self.nodes[child].kind == "dir":
                    walk(child, path)

        walk(1, "")
        return out

    def tree(self) -> dict[str, tuple[object, ...]]:
        out: dict[str, tuple[object, ...]] = {}
        for path in self.paths():
            if path == "/":
                continue
            node = self.nodes[self.resolve(path)]
            if node.kind == "file":
                out[path] = ("file", bytes(node.data), node.nlink, node.mode, node.xattrs)
            elif node.kind == "dir":
                out[path] = ("dir", node.mode, node.xattrs)
            elif node.kind == "symlink":
                out[path] = ("symlink", node.target)
            else:
                out[path] = (node.kind, node.mode)
        return out


def _model_from_base() -> Model:
    model = Model()
    for d in sorted(BASE_DIRS):
        parent = model.resolve(d.rsplit("/", 1)[0] or "/")
        nid = model.add(Node("dir", mode=0o755, nlink=2, parent=parent))
        model.nodes[parent].entries[d.rsplit("/", 1)[1]] = nid
    for f, data in sorted(BASE_FILES.items()):
        parent = model.resolve(f.rsplit("/", 1)[0] or "/")
        nid = model.add(Node("file", data=bytearray(data)))
        model.nodes[parent].entries[f.rsplit("/", 1)[1]] = nid
    return model


def _split(path: str) -> tuple[str, str]:
    head, name = path.rsplit("/", 1)
    return head or "/", name


@dataclasses.dataclass
class Workspace:
    volume: Volume
    model: Model
    handles: list[tuple[int, int]]  # (model node, volume inode) held open


class VolumeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.host = Host()
        self.base = MemoryBase(dict(BASE_FILES), BASE_DIRS)
        self.spaces = [Workspace(Volume.new(self.host, base=self.base), _model_from_base(), [])]
        self.snapshots: list[tuple[Snapshot, Model]] = []
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _space(self, data: st.DataObject) -> Workspace:
        return self.spaces[data.draw(st.integers(0, len(self.spaces) - 1), label="volume")]

    def _both(self, space: Workspace, model_op: Any, volume_op: Any) -> Any:
        """Run the model first; the volume must fail with the same class or agree."""
        try:
            expected = model_op()
        except SlatesError as exc:
            expected_error: type[SlatesError] | None = type(exc)
        else:
            expected_error = None
        try:
            result = volume_op()
        except SlatesError as exc:
            assert type(exc) is expected_error, f"volume raised {exc!r}, model {expected_error}"
            return None
        assert expected_error is None, f"volume succeeded, model raised {expected_error}"
        return result if expected is None else expected

    # -- namespace ----------------------------------------------------------

    def _add(self, space: Workspace, dir_path: str, name: str, node: Node) -> int:
        parent = space.model.nodes[space.model.resolve(dir_path)]
        if name in parent.entries:
            raise AlreadyExists("exists")
        nid = space.model.add(node)
        parent.entries[name] = nid
        if node.kind == "dir":
            node.parent = space.model.resolve(dir_path)
        return nid

    @rule(
        data=st.data(),
        name=NAMES,
        kind=st.sampled_from(["file", "dir", "symlink", "fifo"]),
        mode=st.sampled_from([0o600, 0o644, 0o755]),
    )
    def make(self, data: st.DataObject, name: str, kind: str, mode: int) -> None:
        space = self._space(data)
        dir_path = data.draw(st.sampled_from(space.model.paths("dir")))
        vol = space.volume
        t = self._tick()

        def model_op() -> None:
            node = Node(
                kind,
                mode=0o777 if kind == "symlink" else mode,
                nlink=2 if kind == "dir" else 1,
                target="t/" + name,
            )
            self._add(space, dir_path, name, node)

        def volume_op() -> None:
            parent = vol.resolve(dir_path)
            if kind == "file":
                attr = vol.create(parent, name, mode, time_ns=t)
            elif kind == "dir":
                attr = vol.mkdir(parent, name, mode, time_ns=t)
            elif kind == "symlink":
                attr = vol.symlink(parent, name, "t/" + name, time_ns=t)
            else:
                attr = vol.mknod(parent, name, Kind.FIFO, mode, time_ns=t)
            assert attr.mtime_ns == t
            assert vol.getattr(parent).mtime_ns == t

        self._both(space, model_op, volume_op)

    @rule(data=st.data(), name=NAMES)
    def link(self, data: st.DataObject, name: str) -> None:
        space = self._space(data)
        paths = space.model.paths()[1:]
        if not paths:
            return
        src = data.draw(st.sampled_from(paths))
        dir_path = data.draw(st.sampled_from(space.model.paths("dir")))

        def model_op() -> None:
            nid = space.model.resolve(src)
            parent = space.model.nodes[space.model.resolve(dir_path)]
            if name in parent.entries:
                raise AlreadyExists("exists")
            if space.model.nodes[nid].kind == "dir":
                raise NotPermitted("dir")
            parent.entries[name] = nid
            space.model.nodes[nid].nlink += 1

        def volume_op() -> None:
            space.volume.link(space.volume.resolve(src), space.volume.resolve(dir_path), name)

        self._both(space, model_op, volume_op)

    @rule(data=st.data(), as_dir=st.booleans())
    def remove(self, data: st.DataObject, as_dir: bool) -> None:
        space = self._space(data)
        paths = space.model.paths()[1:]
        if not paths:
            return
        path = data.draw(st.sampled_from(paths))
        dir_path, name = _split(path)
        model = space.model

        def model_op() -> None:
            parent = model.nodes[model.resolve(dir_path)]
            nid = parent.entries[name]
            node = model.nodes[nid]
            if as_dir:
                if node.kind == "dir" and node.entries:
                    raise DirectoryNotEmpty("x")
                if node.kind != "dir":
                    raise NotADirectory("x")
            elif node.kind == "dir":
                raise IsADirectory("x")
            del parent.entries[name]
            node.nlink = 0 if node.kind == "dir" else node.nlink - 1

        def volume_op() -> None:
            vol = space.volume
            parent = vol.resolve(dir_path)
            if as_dir:
                vol.rmdir(parent, name, time_ns=self._tick())
            else:
                vol.unlink(parent, name, time_ns=self._tick())

        self._both(space, model_op, volume_op)

    @rule(
        data=st.data(),
        new_name=NAMES,
        flags=st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]),
    )
    def rename(self, data: st.DataObject, new_name: str, flags: int) -> None:
        space = self._space(data)
        paths = space.model.paths()[1:]
        if not paths:
            return
        src = data.draw(st.sampled_from(paths))
        dst_dir = data.draw(st.sampled_from(space.model.paths("dir")))
        model = space.model

        def model_op() -> None:
            sd, sn = _split(src)
            sparent = model.nodes[model.resolve(sd)]
            nid = sparent.entries[sn]
            dparent_id = model.resolve(dst_dir)
            dparent = model.nodes[dparent_id]
            existing = dparent.entries.get(new_name)
            moved = model.nodes[nid]
            if (
                moved.kind == "dir"
                and existing is not None
                and existing != nid
                and not (flags & RENAME_EXCHANGE)
                and model.nodes[existing].kind == "dir"
                and not (self._within(model, dparent_id, nid))
                and model.nodes[existing].entries
            ):
                raise DirectoryNotEmpty("x")
            if flags & RENAME_EXCHANGE and existing is None:
                raise NotFound("x")
            if existing == nid:
                if flags & RENAME_NOREPLACE:
                    raise AlreadyExists("x")
                return
            if existing is not None and flags & RENAME_NOREPLACE:
                raise AlreadyExists("x")
            if moved.kind == "dir" and self._within(model, dparent_id, nid):
                raise InvalidArgument("x")
            replaced = model.nodes[existing] if existing is not None else None
            if flags & RENAME_EXCHANGE:
                assert existing is not None and replaced is not None
                if replaced.kind == "dir" and self._within(model, model.resolve(sd), existing):
                    raise InvalidArgument("x")
                sparent.entries[sn] = existing
                dparent.entries[new_name] = nid
                if replaced.kind == "dir":
                    replaced.parent = model.resolve(sd)
            else:
                if replaced is not None:
                    if moved.kind == "dir" and replaced.kind != "dir":
                        raise NotADirectory("x")
                    if moved.kind != "dir" and replaced.kind == "dir":
                        raise IsADirectory("x")
                    replaced.nlink = 0 if replaced.kind == "dir" else replaced.nlink - 1
                del sparent.entries[sn]
                dparent.entries[new_name] = nid
            if moved.kind == "dir":
                moved.parent = dparent_id

        def volume_op() -> None:
            vol = space.volume
            sd, sn = _split(src)
            vol.rename(
                vol.resolve(sd), sn, vol.resolve(dst_dir), new_name, flags, time_ns=self._tick()
            )

        self._both(space, model_op, volume_op)

    @staticmethod
    def _within(model: Model, nid: int, ancestor: int) -> bool:
        while nid != ancestor:
            if nid == 1:
                return False
            nid = model.nodes[nid].parent
        return True

    # -- content ------------------------------------------------------------

    def _file(self, data: st.DataObject, space: Workspace) -> tuple[int, int] | None:
        """A file to act on: either a path or a handle held open (maybe unlinked)."""
        choices: list[tuple[int, int]] = list(space.handles)
        for path in space.model.paths("file"):
            choices.append((space.model.resolve(path), space.volume.resolve(path)))
        if not choices:
            return None
        return data.draw(st.sampled_from(choices))

    @rule(data=st.data(), offset=OFFSETS, payload=DATA)
    def write(self, data: st.DataObject, offset: int, payload: bytes) -> None:
        space = self._space(data)
        target = self._file(data, space)
        if target is None:
            return
        node = space.model.nodes[target[0]]
        t = self._tick()
        written = space.volume.write(target[1], offset, payload, time_ns=t)
        assert written == len(payload)
        if payload:
            if len(node.data) < offset:
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset : offset + len(payload)] = payload
            assert space.volume.getattr(target[1]).mtime_ns == t

    @rule(data=st.data(), size=st.integers(0, 5 * PAGE + 3))
    def truncate(self, data: st.DataObject, size: int) -> None:
        space = self._space(data)
        target = self._file(data, space)
        if target is None:
            return
        node = space.model.nodes[target[0]]
        space.volume.truncate(target[1], size, time_ns=self._tick())
        if size < len(node.data):
            del node.data[size:]
        else:
            node.data.extend(bytes(size - len(node.data)))

    @rule(
        data=st.data(),
        start=OFFSETS,
        length=st.integers(0, 2 * PAGE),
        payload=st.binary(max_size=PAGE + 9),
    )
    def splice(self, data: st.DataObject, start: int, length: int, payload: bytes) -> None:
        space = self._space(data)
        target = self._file(data, space)
        if target is None:
            return
        node = space.model.nodes[target[0]]
        start = min(start, len(node.data))
        end = min(start + length, len(node.data))
        t = self._tick()
        assert space.volume.splice(target[1], start, end, payload, time_ns=t) == len(payload)
        node.data[start:end] = payload
        assert space.volume.getattr(target[1]).mtime_ns == t

    @rule(data=st.data(), offset=OFFSETS, length=st.integers(0, 4 * PAGE))
    def punch_hole(self, data: st.DataObject, offset: int, length: int) -> None:
        space = self._space(data)
        target = self._file(data, space)
        if target is None:
            return
        node = space.model.nodes[target[0]]
        space.volume.punch_hole(target[1], offset, length, time_ns=self._tick())
        end = min(offset + length, len(node.data))
        if offset < end:
            node.data[offset:end] = bytes(end - offset)

    @rule(
        data=st.data(),
        src_offset=st.sampled_from([0, 5, PAGE, 2 * PAGE]),
        dst_offset=st.sampled_from([0, 7, PAGE, 3 * PAGE]),
        length=st.integers(0, 3 * PAGE),
    )
    def copy_range(
        self, data: st.DataObject, src_offset: int, dst_offset: int, length: int
    ) -> None:
        space = self._space(data)
        source, target = self._file(data, space), self._file(data, space)
        if source is None or target is None:
            return
        src_node, dst_node = space.model.nodes[source[0]], space.model.nodes[target[0]]
        piece = bytes(src_node.data[src_offset : src_offset + length])
        overlap = (
            source[1] == target[1]
            and piece
            and src_offset < dst_offset + len(piece)
            and dst_offset < src_offset + len(piece)
        )

        def model_op() -> int:
            if overlap:
                raise InvalidArgument("overlap")
            if piece:
                if len(dst_node.data) < dst_offset:
                    dst_node.data.extend(bytes(dst_offset - len(dst_node.data)))
                dst_node.data[dst_offset : dst_offset + len(piece)] = piece
            return len(piece)

        def volume_op() -> int:
            copied = space.volume.copy_range(
                source[1], src_offset, target[1], dst_offset, length, time_ns=self._tick()
            )
            assert copied == len(piece)
            return copied

        self._both(space, model_op, volume_op)

    @rule(data=st.data(), offset=OFFSETS, size=st.integers(0, 3 * PAGE))
    def read(self, data: st.DataObject, offset: int, size: int) -> None:
        space = self._space(data)
        target = self._file(data, space)
        if target is None:
            return
        expected = bytes(space.model.nodes[target[0]].data[offset : offset + size])
        assert space.volume.read(target[1], offset, size) == expected

    @rule(data=st.data(), mode=st.sampled_from([0o600, 0o640, 0o4755]))
    def chmod(self, data: st.DataObject, mode: int) -> None:
        space = self._space(data)
        paths = [
            p
            for p in space.model.paths()
            if space.model.nodes[space.model.resolve(p)].kind in ("file", "dir")
        ]
        path = data.draw(st.sampled_from(paths))
        space.volume.setattr(space.volume.resolve(path), mode=mode, time_ns=self._tick())
        space.model.nodes[space.model.resolve(path)].mode = mode

    @rule(
        data=st.data(),
        name=st.sampled_from(["user.x", "user.y"]),
        value=st.binary(max_size=8),
        flags=st.sampled_from([0, XATTR_CREATE, XATTR_REPLACE]),
        remove=st.booleans(),
    )
    def xattr(self, data: st.DataObject, name: str, value: bytes, flags: int, remove: bool) -> None:
        space = self._space(data)
        path = data.draw(
            st.sampled_from(
                [
                    p
                    for p in space.model.paths()
                    if space.model.nodes[space.model.resolve(p)].kind in ("file", "dir")
                ]
            )
        )
        node = space.model.nodes[space.model.resolve(path)]

        def model_op() -> None:
            if remove:
                if name not in node.xattrs:
                    raise NoSuchAttribute("x")
                del node.xattrs[name]
                return
            if flags == XATTR_CREATE and name in node.xattrs:
                raise AlreadyExists("x")
            if flags == XATTR_REPLACE and name not in node.xattrs:
                raise NoSuchAttribute("x")
            node.xattrs[name] = value

        def volume_op() -> None:
            ino = space.volume.resolve(path)
            if remove:
                space.volume.removexattr(ino, name)
            else:
                space.volume.setxattr(ino, name, value, flags)

        self._both(space, model_op, volume_op)

    # -- handles ------------------------------------------------------------

    @rule(data=st.data())
    def open(self, data: st.DataObject) -> None:
        space = self._space(data)
        paths = space.model.paths("file")
        if not paths:
            return
        path = data.draw(st.sampled_from(paths))
        ino = space.volume.resolve(path)
        space.volume.retain(ino)
        space.handles.append((space.model.resolve(path), ino))

    @precondition(lambda self: any(s.handles for s in self.spaces))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        space = data.draw(st.sampled_from([s for s in self.spaces if s.handles]))
        nid, ino = space.handles.pop(data.draw(st.integers(0, len(space.handles) - 1)))
        space.volume.forget(ino)
        still_open = any(h[1] == ino for h in space.handles)
        if space.model.nodes[nid].nlink == 0 and not still_open:
            try:
                space.volume.getattr(ino)
            except NotFound:
                pass
            else:
                raise AssertionError("an unlinked inode outlived its last handle")

    # -- seal, snapshot, clone ----------------------------------------------

    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        space = self._space(data)
        pages = sum(len(b) for b in space.volume._buffers.values())
        report = space.volume.seal()
        assert not space.volume._buffers
        assert report.bytes_sealed <= pages

    @precondition(lambda self: len(self.snapshots) < 4)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        space = self._space(data)
        snap = space.volume.snapshot(f"s{len(self.snapshots)}")
        self.snapshots.append((snap, copy.deepcopy(space.model)))
        assert space.volume.unique_bytes == 0

    @precondition(lambda self: self.snapshots and len(self.spaces) < 4)
    @rule(data=st.data())
    def clone(self, data: st.DataObject) -> None:
        snap, model = data.draw(st.sampled_from(self.snapshots))
        volume = Volume.clone(snap, self.host)
        assert volume.unique_bytes == 0
        self.spaces.append(Workspace(volume, copy.deepcopy(model), []))

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data())
    def snapshot_unchanged(self, data: st.DataObject) -> None:
        snap, model = data.draw(st.sampled_from(self.snapshots))
        probe = Volume.clone(snap, self.host)
        try:
            assert tree(probe) == model.tree()
        finally:
            probe.close()

    # -- invariants ---------------------------------------------------------

    @invariant()
    def trees_agree(self) -> None:
        for space in self.spaces:
            assert tree(space.volume) == space.model.tree()
            check_invariants(space.volume)
        private = sum(
            sum(len(b) for b in s.volume._buffers.values()) + s.volume.metadata_bytes
            for s in self.spaces
        )
        assert self.host.private_bytes == private

    def teardown(self) -> None:
        for space in self.spaces:
            space.volume.close()
        assert self.host.private_bytes == 0


TestVolumeMachine = VolumeMachine.TestCase
TestVolumeMachine.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
