"""The SDK's file operations by path: read, stat, list, write, edit, mkdir, rename, ...

Theory of operation: each request names its file by an absolute path in
the volume (the mount bridge's fs.* operations, by inode, are in
slates.node.fsops).  `run_path_op` resolves the path, checks the
arguments (InvalidArgument before anything changes) and calls the
volume; every change is a record the volume applies, which the service
journals through the volume's hook.  No I/O here.  Called by
ShardService for the ops in PATH_OPS.
"""

from __future__ import annotations

import posixpath
from typing import Any

from slates.core.records import Attr, Kind
from slates.core.volume import Volume
from slates.errors import InvalidArgument, IsADirectory, NotFound
from slates.node.args import int_arg as _int_arg
from slates.node.args import path_arg as _path_arg
from slates.node.args import str_arg as _str_arg

__all__ = ["run_path_op", "PATH_OPS", "MAX_READ_BYTES"]

MAX_READ_BYTES = 16 << 20  # one reply stays well under the 64 MiB frame limit
PATH_OPS = frozenset(
    {"read", "stat", "list", "readlink", "write", "edit", "truncate", "mkdir", "symlink"}
    | {"unlink", "rmdir", "rename"}
)


def attr_dict(attr: Attr) -> dict[str, Any]:
    return {
        "ino": attr.ino,
        "st_ino": attr.st_ino,
        "kind": attr.kind.name.lower(),
        "mode": attr.mode,
        "nlink": attr.nlink,
        "uid": attr.uid,
        "gid": attr.gid,
        "size": attr.size,
        "mtime_ns": attr.mtime_ns,
        "ctime_ns": attr.ctime_ns,
    }


def run_path_op(volume: Volume, op: str, args: dict[str, Any], now: int) -> Any:
    match op:
        case "read":
            ino = volume.resolve(_path_arg(args))
            size = args.get("size")
            limit = volume.getattr(ino).size if size is None else _int_arg(args, "size")
            if limit > MAX_READ_BYTES:
                raise InvalidArgument("read at most 16 MiB at a time", size=limit)
            return volume.read(ino, _int_arg(args, "offset", 0), limit)
        case "stat":
            return attr_dict(volume.getattr(volume.resolve(_path_arg(args))))
        case "list":
            ino = volume.resolve(_path_arg(args))
            return [
                {"name": item.name, "kind": item.kind.name.lower()} for item in volume.readdir(ino)
            ]
        case "readlink":
            return volume.readlink(volume.resolve(_path_arg(args)))
        case "write":
            return _write(volume, args, now)
        case "edit":
            return _edit(volume, args, now)
        case "truncate":
            volume.truncate(volume.resolve(_path_arg(args)), _int_arg(args, "size"), time_ns=now)
            return {}
        case "mkdir":
            parent, name = _parent(volume, _path_arg(args))
            mode = _int_arg(args, "mode", 0o755)
            return attr_dict(volume.mkdir(parent, name, mode, time_ns=now))
        case "symlink":
            parent, name = _parent(volume, _path_arg(args))
            target = _str_arg(args, "target")
            return attr_dict(volume.symlink(parent, name, target, time_ns=now))
        case "unlink":
            parent, name = _parent(volume, _path_arg(args))
            volume.unlink(parent, name, time_ns=now)
            return {}
        case "rmdir":
            parent, name = _parent(volume, _path_arg(args))
            volume.rmdir(parent, name, time_ns=now)
            return {}
        case "rename":
            src_parent, src_name = _parent(volume, _path_arg(args, "src"))
            dst_parent, dst_name = _parent(volume, _path_arg(args, "dst"))
            volume.rename(src_parent, src_name, dst_parent, dst_name, time_ns=now)
            return {}
        case _:
            raise InvalidArgument("unknown operation", op=op)


def _parent(volume: Volume, path: str) -> tuple[int, str]:
    head, name = posixpath.split(path)
    if not name:
        raise InvalidArgument("the root has no parent", path=path)
    return volume.resolve(head), name


def _file_and_data(volume: Volume, args: dict[str, Any], now: int) -> tuple[int, bytes]:
    """The file at args' path (created when absent, unless create is false) and args' data."""
    path = _path_arg(args)
    data = args.get("data")
    if not isinstance(data, bytes):
        raise InvalidArgument("data must be bytes")
    parent, name = _parent(volume, path)
    try:
        ino = volume.lookup(parent, name).ino
    except NotFound:
        if not args.get("create", True):
            raise
        ino = volume.create(parent, name, _int_arg(args, "mode", 0o644), time_ns=now).ino
    if volume.getattr(ino).kind == Kind.DIR:
        raise IsADirectory("is a directory", path=path)
    return ino, data


def _write(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    ino, data = _file_and_data(volume, args, now)
    if args.get("truncate", False):
        volume.truncate(ino, 0, time_ns=now)
    written = volume.write(ino, _int_arg(args, "offset", 0), data, time_ns=now)
    return {"written": written, "ino": ino}


def _edit(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    """Replace [start, end) of a file with data (creating the file when absent)."""
    start, end = _int_arg(args, "start"), _int_arg(args, "end")
    parent, name = _parent(volume, _path_arg(args))
    try:
        volume.lookup(parent, name)
    except NotFound:
        if (start, end) != (0, 0):  # checked before the file is created
            raise InvalidArgument("a new file is edited at [0, 0)", start=start, end=end) from None
    ino, data = _file_and_data(volume, args, now)
    volume.splice(ino, start, end, data, time_ns=now)
    return {"size": volume.getattr(ino).size}
