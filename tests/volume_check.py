"""Test helpers: walk a volume's visible tree and check its internal invariants."""

from __future__ import annotations

from slates.core.extents import PAGE, BaseSpan, ChunkSpan, PageSpan, stored_length
from slates.core.origin import edit_spans
from slates.core.records import Kind
from slates.core.volume import ROOT_INO, DirBody, FileBody, Volume, _metadata

__all__ = ["tree", "check_invariants"]

Observed = tuple[object, ...]


def tree(volume: Volume) -> dict[str, Observed]:
    """Every visible path with what a reader can observe of it."""
    out: dict[str, Observed] = {}

    def walk(ino: int, path: str) -> None:
        for item in volume.readdir(ino):
            child = volume.lookup(ino, item.name)
            child_path = f"{path}/{item.name}"
            if child.kind == Kind.FILE:
                data = volume.read(child.ino, 0, child.size + 10)
                out[child_path] = (
                    "file",
                    data,
                    child.nlink,
                    child.mode,
                    _xattrs(volume, child.ino),
                )
            elif child.kind == Kind.DIR:
                out[child_path] = ("dir", child.mode, _xattrs(volume, child.ino))
                walk(child.ino, child_path)
            elif child.kind == Kind.SYMLINK:
                out[child_path] = ("symlink", volume.readlink(child.ino))
            else:
                out[child_path] = (child.kind.name.lower(), child.mode)

    walk(ROOT_INO, "")
    return out


def _xattrs(volume: Volume, ino: int) -> dict[str, bytes]:
    return {name: volume.getxattr(ino, name) for name in volume.listxattr(ino)}


def check_invariants(volume: Volume) -> None:
    """Extent-map and counter invariants that every record must preserve."""
    root = volume.root
    referenced = 0
    unique = 0
    buffers_seen: set[int] = set()
    names: dict[int, int] = {}
    for ino, inode in root.inodes.items():
        body = inode.body
        if isinstance(body, DirBody):
            for entry in body.entries.values():
                names[entry.ino] = names.get(entry.ino, 0) + 1
                if entry.ino not in root.inodes:
                    raise AssertionError(f"entry {entry.name} names missing inode {entry.ino}")
                child = root.inodes[entry.ino].body
                if isinstance(child, DirBody) and child.parent != ino:
                    raise AssertionError(f"directory {entry.ino} has the wrong parent")
        if not isinstance(body, FileBody):
            continue
        end = 0
        for extent in body.extents:
            if extent.start < end or extent.length <= 0:
                raise AssertionError(f"inode {ino}: extents overlap or are empty")
            end = extent.start + extent.length
            if isinstance(extent, PageSpan):
                buffer = volume._buffers[extent.buffer_id]
                if extent.start % PAGE or extent.length % PAGE or len(buffer) != extent.length:
                    raise AssertionError(f"inode {ino}: page extent not page-aligned")
                if extent.buffer_id in buffers_seen:
                    raise AssertionError("a page buffer is shared by two extents")
                buffers_seen.add(extent.buffer_id)
                if any(buffer[max(0, body.size - extent.start) :]):
                    raise AssertionError(f"inode {ino}: page bytes beyond the size are not zero")
                unique += extent.length
            else:
                if end > body.size:
                    raise AssertionError(f"inode {ino}: a shared extent lies beyond the size")
                if isinstance(extent, ChunkSpan):
                    volume.host.get_chunk(extent.chunk_id)
                    if extent.epoch == root.epoch:
                        unique += extent.length
                elif not isinstance(extent, BaseSpan):
                    raise AssertionError("unknown extent type")
        referenced += stored_length(body.extents, body.size)
        if body.origin is not None and body.origin[0] == root.record_gen:
            pieces = body.origin[1]
            if sum(pieces[1::2]) != body.size:
                raise AssertionError(f"inode {ino}: its recorded origin is not its size")
            edit_spans(
                pieces,
                max(
                    [0] + [s + n for s, n in zip(pieces[::2], pieces[1::2], strict=True) if s >= 0]
                ),
            )
    for ino, inode in root.inodes.items():
        if inode.kind != Kind.DIR and ino != ROOT_INO:
            if names.get(ino, 0) != inode.nlink and not (
                isinstance(inode.body, FileBody) and inode.body.fingerprint is not None
            ):
                raise AssertionError(f"inode {ino}: nlink {inode.nlink} but {names.get(ino)} names")
            base_bound = isinstance(inode.body, FileBody) and inode.body.fingerprint is not None
            if inode.nlink == 0 and volume.handles(ino) == 0 and not base_bound:
                raise AssertionError(f"inode {ino} is unreachable and unheld but alive")
    if set(volume._buffers) != buffers_seen:
        raise AssertionError("page buffers leaked or missing")
    if referenced != root.referenced_bytes:
        raise AssertionError(f"referenced {root.referenced_bytes} != recomputed {referenced}")
    if unique != volume.unique_bytes:
        raise AssertionError(f"unique {volume.unique_bytes} != recomputed {unique}")
    own = sum(_metadata(inode) for ino, inode in root.inodes.items() if volume._is_own(ino))
    if own != volume.metadata_bytes:
        raise AssertionError("metadata charge does not match the inodes created")
