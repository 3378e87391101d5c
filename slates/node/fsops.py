"""The fs.* operations a mount bridge sends, on one volume (slates/fuse/PROTOCOL.md).

Theory of operation: a bridge speaks the kernel's language: inode numbers,
lookup references, readdir cookies.  This module translates each fs.*
request into the volume's operation methods (which settle base names and
apply records), so every effect is a journaled record like any other
client's.  Every reply that hands the kernel an entry also takes one
lookup reference (a Retain record): the kernel may hold an unlinked file
open through it, and the volume keeps the inode until fs.forget drops the
last one.  No I/O here besides the volume's own base reads.

Clean base files: an ATTR this module answers for a regular file whose
bytes are all its base file's, unchanged (Volume.base_content), carries
`"base": [path (bin), dev, ino, size, mtime_ns]`, the base-relative path
and the fingerprint the volume pinned; `fs.base` names the base directory
(`{"root", "dev", "ino"}`, or `{}` without one).  With both, a bridge may
answer READs of that inode from the base itself, checking the open file
against the fingerprint exactly as the volume's reader does, and asks
here again on any doubt (native/bridge_clean.c).

Clean base directories: an ATTR of a directory whose every visible name is
an untouched base name (it merges a base directory, hides none, and every
entry it holds is a base entry bound under its own name) carries
`"dir": [path (bin), [bound inode, ...]]`.  With it the bridge may
answer LOOKUP, READDIRPLUS, GETATTR, READLINK, ACCESS and LSEEK of the
directory's unlisted children itself, from the base (its listings use
`cookie_of` too), naming each child by the number the volume gives a
base entry (slates.core.volume.base_ino), without binding it or counting a
kernel reference here (native/bridge_meta.c).  Before any request that
names such a child the bridge sends `fs.lookup` with `node` (the number it
gave), `fp` ([dev, ino, size, mtime_ns] as it observed the base entry),
`mode` (the type bits it observed) and `refs` (the kernel references it
counted): the entry is bound here with the fingerprint the kernel saw (so a
base file changed since reads as drift, as if bound then), and the
references are retained.
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
import stat
from typing import Any

from slates.core.extents import PAGE
from slates.core.records import Attr, BaseEntry, BindBase, Fingerprint, Kind
from slates.core.volume import MAX_FILE_SIZE, DirBody, FileBody, Volume, base_ino
from slates.errors import AlreadyExists, BaseDrift, InvalidArgument, IsADirectory, NotFound

__all__ = [
    "run_fs_op",
    "attr_map",
    "attr_reply",
    "base_root",
    "entry_size",
    "cookie_of",
    "MODE_BITS",
]

MODE_BITS = {
    Kind.FILE: stat.S_IFREG,
    Kind.DIR: stat.S_IFDIR,
    Kind.SYMLINK: stat.S_IFLNK,
    Kind.FIFO: stat.S_IFIFO,
    Kind.SOCKET: stat.S_IFSOCK,
    Kind.CHAR_DEVICE: stat.S_IFCHR,
    Kind.BLOCK_DEVICE: stat.S_IFBLK,
}
_KINDS = {bits: kind for kind, bits in MODE_BITS.items()}
SEEK_DATA = 3
SEEK_HOLE = 4
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
FALLOC_FL_ZERO_RANGE = 16
MAX_READ = 1 << 20  # the bridge's max_read; a reply then fits one ring message
# A directory with more bound entries than this gets no clean mark (the list would
# make every ATTR of it large); the shard answers its names as before.
MAX_MARK_BOUND = 4096
CAPABILITY_XATTR = "security.capability"


def attr_map(attr: Attr) -> dict[str, int]:
    return {
        "ino": attr.ino,
        "st_ino": attr.st_ino,
        "mode": MODE_BITS[attr.kind] | attr.mode,
        "nlink": attr.nlink,
        "uid": attr.uid,
        "gid": attr.gid,
        "size": attr.size,
        "blocks": attr.blocks,
        "atime_ns": attr.atime_ns,
        "mtime_ns": attr.mtime_ns,
        "ctime_ns": attr.ctime_ns,
        "rdev": attr.rdev,
    }


def attr_reply(volume: Volume, attr: Attr) -> dict[str, Any]:
    """An ATTR for the bridge: attr_map, plus "xattrs" (how many extended attributes the
    inode has: with 0 the bridge answers the kernel's probes of security.capability on
    every write itself, PROTOCOL.md), "base" when the content is the base file's and
    "dir" when every visible name of a directory is an untouched base name."""
    out: dict[str, Any] = attr_map(attr)
    inode = volume.root.inodes.get(attr.ino)
    if inode is not None:
        out["xattrs"] = len(inode.xattrs)
    if attr.kind == Kind.DIR:
        mark = clean_dir_mark(volume, attr.ino)
        if mark is not None:
            out["dir"] = mark
    clean = volume.base_content(attr.ino) if attr.kind == Kind.FILE else None
    if clean is not None:
        path, fp = clean
        out["base"] = [
            path.encode("utf-8", "surrogateescape"),
            fp.device,
            fp.inode,
            fp.size,
            fp.mtime_ns,
        ]
    return out


def clean_dir_mark(volume: Volume, ino: int) -> list[Any] | None:
    """[base path, bound inodes] of a directory the bridge may answer names in
    from the base (PROTOCOL.md), or None.  Bound inodes are listed so the bridge asks
    here for them: only the volume knows whether they changed."""
    inode = volume.root.inodes.get(ino)
    if volume.base is None or volume.root.case_insensitive or inode is None:
        return None
    body = inode.body
    if not isinstance(body, DirBody) or body.base_path is None or body.whiteouts:
        return None
    if inode.nlink == 0 or len(body.entries) > MAX_MARK_BOUND:
        return None
    bound: list[int] = []
    for entry in body.entries.values():
        child = volume.root.inodes.get(entry.ino)
        if child is None or entry.ino != base_ino(child.st_ino):
            return None  # private, or numbered otherwise: the bridge would name it wrongly
        path = posixpath.join(body.base_path, entry.name)
        if not isinstance(child.body, FileBody | DirBody) or child.body.base_path != path:
            return None  # renamed in, or a kind whose base name cannot be checked here
        bound.append(entry.ino)
    return [body.base_path.encode("utf-8", "surrogateescape"), bound]


def base_root(volume: Volume) -> dict[str, Any]:
    """The volume's base directory (path and identity), or {} when it has none."""
    root = getattr(volume.base, "root", None)
    identity = getattr(volume.base, "identity", None)
    if not isinstance(root, str) or not isinstance(identity, tuple) or len(identity) != 2:
        return {}
    dev, ino = identity
    return {"root": root.encode("utf-8", "surrogateescape"), "dev": dev, "ino": ino}


def entry_size(name: str, plus: bool) -> int:
    """Bytes a directory entry takes in the kernel's buffer (fuse_dirent[plus])."""
    size = (24 + len(name.encode("utf-8", "surrogateescape")) + 7) & ~7
    return size + (128 if plus else 0)


@functools.lru_cache(maxsize=1 << 16)  # listings ask for the same names again and again
def cookie_of(name: str) -> int:
    """A readdir cookie: stable per name, so removals never make a listing skip.

    64-bit FNV-1a of the name's bytes, as native/bridge_meta.c computes it for the
    listings it answers from the base: a listing the shard continues must agree."""
    h = 0xCBF29CE484222325
    for byte in name.encode("utf-8", "surrogateescape"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return (h >> 1) | 4  # above "." (1) and ".." (2)


def _int(args: dict[str, Any], key: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{key} must be a non-negative integer", field=key)
    return value


def _opt(args: dict[str, Any], key: str) -> int | None:
    return None if args.get(key) is None else _int(args, key)


def _name(args: dict[str, Any], key: str = "name") -> str:
    value = args.get(key)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a name", field=key)
    return value


def _entry(volume: Volume, attr: Attr) -> dict[str, Any]:
    volume.retain(attr.ino)
    return attr_reply(volume, attr)


def _attrs_of(volume: Volume, args: dict[str, Any], **inos: int) -> dict[str, Any]:
    """The ATTRs of `inos` after a mutation, when the request asked for them (`attrs`).

    Read after the mutation has been applied: an inode that is gone by then (nothing
    the bridge could ask about) is left out rather than failing a done mutation."""
    if args.get("attrs") is not True:
        return {}
    out: dict[str, Any] = {}
    for key, ino in inos.items():
        try:
            out[key] = attr_map(volume.getattr(ino))
        except NotFound:
            continue
    return out


def _entry_with_parent(
    volume: Volume, args: dict[str, Any], attr: Attr, parent: int
) -> dict[str, Any]:
    out = _entry(volume, attr)
    out.update(_attrs_of(volume, args, parent_attr=parent))
    return out


def _with_file_attr(volume: Volume, args: dict[str, Any], key: str, count: int, ino: int) -> Any:
    """A count result (`written`, `copied`), as {key: count, "attr": ...} when asked."""
    extra = _attrs_of(volume, args, attr=ino)
    if not extra:
        return count
    return {key: count, **extra}


def run_fs_op(volume: Volume, op: str, args: dict[str, Any], now: int) -> Any:
    """Run one fs.* operation on `volume` at time `now`."""
    match op:
        # What a build sends most first (the cases are distinct names: the order
        # changes only the comparisons each request pays).
        case "fs.write":
            data = args.get("data")
            if not isinstance(data, bytes):
                raise InvalidArgument("data must be bytes")
            ino = _int(args, "ino")
            written = volume.write(ino, _int(args, "offset"), data, time_ns=now)
            _drop_privileges(volume, ino, _opt(args, "kill"), now)
            return _with_file_attr(volume, args, "written", written, ino)
        case "fs.read":
            size = min(_int(args, "size"), MAX_READ)
            return volume.read(_int(args, "ino"), _int(args, "offset"), size)
        case "fs.lookup" if "node" in args:
            return _bind_node(volume, args)
        case "fs.lookup":
            return _entry(volume, volume.lookup(_int(args, "parent"), _name(args)))
        case "fs.forget":
            items = args.get("items")
            if not isinstance(items, list | tuple):
                raise InvalidArgument("items must be a list of [ino, count]")
            for item in items:
                if not isinstance(item, list | tuple) or len(item) != 2:
                    raise InvalidArgument("items must be a list of [ino, count]")
                ino, count = item
                held = volume.handles(ino)
                if held:
                    volume.forget(ino, min(count, held))
            return {}
        case "fs.destroy":
            for ino in volume.held_inodes():
                volume.forget(ino, volume.handles(ino))
            return {}
        case "fs.getattr":
            return attr_reply(volume, volume.getattr(_int(args, "ino")))
        case "fs.base":
            return base_root(volume)
        case "fs.setattr":
            return _setattr(volume, args, now)
        case "fs.readlink":
            return volume.readlink(_int(args, "ino"))
        case "fs.mknod":
            return _mknod(volume, args, now)
        case "fs.mkdir":
            gid, inherits = _group_of_new(volume, args)
            attr = volume.mkdir(
                _int(args, "parent"),
                _name(args),
                (_int(args, "mode") & 0o7777) | (stat.S_ISGID if inherits else 0),
                uid=_int(args, "uid"),
                gid=gid,
                time_ns=now,
            )
            return _entry_with_parent(volume, args, attr, _int(args, "parent"))
        case "fs.unlink":
            volume.unlink(_int(args, "parent"), _name(args), time_ns=now)
            return _attrs_of(volume, args, parent_attr=_int(args, "parent"))
        case "fs.rmdir":
            volume.rmdir(_int(args, "parent"), _name(args), time_ns=now)
            return _attrs_of(volume, args, parent_attr=_int(args, "parent"))
        case "fs.symlink":
            attr = volume.symlink(
                _int(args, "parent"),
                _name(args),
                _name(args, "target"),
                uid=_int(args, "uid"),
                gid=_group_of_new(volume, args)[0],
                time_ns=now,
            )
            return _entry_with_parent(volume, args, attr, _int(args, "parent"))
        case "fs.rename":
            volume.rename(
                _int(args, "parent"),
                _name(args),
                _int(args, "new_parent"),
                _name(args, "new_name"),
                _int(args, "flags"),
                time_ns=now,
            )
            return _attrs_of(
                volume,
                args,
                parent_attr=_int(args, "parent"),
                new_parent_attr=_int(args, "new_parent"),
            )
        case "fs.link":
            attr = volume.link(
                _int(args, "ino"), _int(args, "new_parent"), _name(args, "new_name"), time_ns=now
            )
            return _entry_with_parent(volume, args, attr, _int(args, "new_parent"))
        case "fs.create":
            return _create(volume, args, now)
        case "fs.fsync":
            volume.getattr(_int(args, "ino"))
            return {}  # acknowledged writes are already committed to the journal
        case "fs.statfs":
            return _statfs(volume)
        case "fs.readdir":
            return _readdir(volume, args)
        case "fs.setxattr":
            value = args.get("value")
            if not isinstance(value, bytes):
                raise InvalidArgument("value must be bytes")
            volume.setxattr(_int(args, "ino"), _name(args), value, _int(args, "flags"), time_ns=now)
            return {}
        case "fs.getxattr":
            return volume.getxattr(_int(args, "ino"), _name(args))
        case "fs.listxattr":
            return volume.listxattr(_int(args, "ino"))
        case "fs.removexattr":
            volume.removexattr(_int(args, "ino"), _name(args), time_ns=now)
            return {}
        case "fs.fallocate":
            _fallocate(volume, args, now)
            _drop_privileges(volume, _int(args, "ino"), _opt(args, "kill"), now)
            return _attrs_of(volume, args, attr=_int(args, "ino"))
        case "fs.lseek":
            return volume.seek(_int(args, "ino"), _int(args, "offset"), _seek_whence(args))
        case "fs.copy_file_range":
            copied = volume.copy_range(
                _int(args, "ino_in"),
                _int(args, "off_in"),
                _int(args, "ino_out"),
                _int(args, "off_out"),
                _int(args, "length"),
                time_ns=now,
            )
            _drop_privileges(volume, _int(args, "ino_out"), _opt(args, "kill"), now)
            return _with_file_attr(volume, args, "copied", copied, _int(args, "ino_out"))
        case "fs.access":
            volume.getattr(_int(args, "ino"))
            return {}  # permissions are checked by the kernel (default_permissions)
        case _:
            raise InvalidArgument("unknown operation", op=op)


def _bind_node(volume: Volume, args: dict[str, Any]) -> dict[str, Any]:
    """A base entry the bridge answered itself, bound at the number it gave (PROTOCOL.md)."""
    node, refs = _int(args, "node"), _int(args, "refs")
    fp = args.get("fp")
    if (
        not isinstance(fp, list | tuple)
        or len(fp) != 4
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in fp)
    ):
        raise InvalidArgument("fp must be [dev, ino, size, mtime_ns]", field="fp")
    seen = Fingerprint(fp[0], fp[1], fp[2], fp[3])
    if node != base_ino(seen.inode):
        raise InvalidArgument("the node is not the base entry's number", node=node)
    if node not in volume.root.inodes:
        parent, name = _int(args, "parent"), _name(args)
        base_path = volume.dir_info(parent).base_path
        entry = None
        if volume.base is not None and base_path is not None:
            entry = volume.base.stat(posixpath.join(base_path, name))
        if entry is None:
            raise BaseDrift("the base entry the kernel holds is gone", name=name)
        if MODE_BITS[entry.kind] != stat.S_IFMT(_int(args, "mode")):
            raise BaseDrift("the base entry the kernel holds changed its type", name=name)
        if entry.fingerprint != seen:
            entry = _as_seen(entry, seen)
        volume.apply(BindBase(parent, name, entry))
        if node not in volume.root.inodes:
            raise BaseDrift("the base entry is bound under another number", node=node)
    if refs:
        volume.retain(node, refs)
    return attr_reply(volume, volume.getattr(node))


def _as_seen(entry: BaseEntry, seen: Fingerprint) -> BaseEntry:
    """A base entry that changed since the bridge saw it, bound as the kernel saw it: a
    file keeps the fingerprint (and size) observed, so its reads are drift, as they
    would be had it been bound then; a directory or symlink keeps only its identity."""
    now = entry.fingerprint
    if entry.kind == Kind.FILE:
        return dataclasses.replace(entry, fingerprint=seen, size=seen.size)
    if (now.device, now.inode) != (seen.device, seen.inode):
        raise BaseDrift("the base entry the kernel holds was replaced", path=entry.path)
    return entry


def _seek_whence(args: dict[str, Any]) -> str:
    whence = _int(args, "whence")
    if whence == SEEK_DATA:
        return "data"
    if whence == SEEK_HOLE:
        return "hole"
    raise InvalidArgument("lseek supports SEEK_DATA and SEEK_HOLE here", whence=whence)


def _setattr(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    ino = _int(args, "ino")
    size = _opt(args, "size")
    if size is not None:
        volume.truncate(ino, size, time_ns=now)
    chown = "uid" in args or "gid" in args
    if size is not None or chown:  # before a mode set with them
        _drop_privileges(volume, ino, _opt(args, "kill"), now, chown=chown)
    mode = _opt(args, "mode")
    changes = {
        "mode": None if mode is None else mode & 0o7777,
        "uid": _opt(args, "uid"),
        "gid": _opt(args, "gid"),
        "atime_ns": _opt(args, "atime_ns"),
        "mtime_ns": _opt(args, "mtime_ns"),
    }
    if any(value is not None for value in changes.values()):
        return attr_reply(volume, volume.setattr(ino, time_ns=now, **changes))
    return attr_reply(volume, volume.getattr(ino))


def _drop_privileges(
    volume: Volume, ino: int, kill_gid: int | None, now: int, *, chown: bool = False
) -> None:
    """What Linux takes from a file whose content or owner changes, which the bridge
    leaves to this module (it claims FUSE_HANDLE_KILLPRIV_V2, so the kernel need not
    ask for security.capability before every write): the capability xattr always;
    and when the kernel asked for set-ID bits to go (`kill_gid`, the caller's group:
    a caller without CAP_FSETID, or any chown), the set-user-ID bit, and the
    set-group-ID bit of a group-executable file or (not for a chown) of a file whose
    group is not the caller's.  Linux keeps that last bit for a caller in the file's
    group by a supplementary group too; the bridge sends only the caller's own group
    (reading each writer's groups would cost more than the round trip this saves), so
    such a caller loses it: the safe side.  (When the kernel did this for FUSE, it
    took that bit only from group-executable files, so a caller outside the group
    kept it where tmpfs drops it: tests/test_agent_users.py's "sgnox" step.)
    Directories keep theirs.  Records only what changes, so a file without any of it
    costs one lookup."""
    inode = volume.root.inodes.get(ino)
    if inode is None or inode.kind == Kind.DIR:
        return
    if CAPABILITY_XATTR in inode.xattrs:
        volume.removexattr(ino, CAPABILITY_XATTR, time_ns=now)
    mode = inode.mode
    if kill_gid is None or not mode & (stat.S_ISUID | stat.S_ISGID):
        return
    kept = mode & ~stat.S_ISUID
    if mode & stat.S_IXGRP or (not chown and kill_gid != inode.gid):
        kept &= ~stat.S_ISGID
    if kept != mode:
        volume.setattr(ino, mode=kept, time_ns=now)


def _group_of_new(volume: Volume, args: dict[str, Any]) -> tuple[int, bool]:
    """The group a new entry gets, and whether its directory passes setgid on (POSIX: in
    a setgid directory new entries take the directory's group, new directories its
    setgid bit too; elsewhere the creator's group)."""
    parent = volume.getattr(_int(args, "parent"))
    if parent.mode & stat.S_ISGID:
        return parent.gid, True
    return _int(args, "gid"), False


def _mknod(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    mode = _int(args, "mode")
    kind = _KINDS.get(stat.S_IFMT(mode))
    parent, name, uid = _int(args, "parent"), _name(args), _int(args, "uid")
    gid = _group_of_new(volume, args)[0]
    if kind is None:
        raise InvalidArgument("unknown file type", mode=mode)
    if kind == Kind.FILE:
        attr = volume.create(parent, name, mode & 0o7777, uid=uid, gid=gid, time_ns=now)
    elif kind == Kind.DIR:
        raise InvalidArgument("mknod does not make directories")
    else:
        attr = volume.mknod(
            parent, name, kind, mode & 0o7777, _int(args, "rdev"), uid=uid, gid=gid, time_ns=now
        )
    return _entry_with_parent(volume, args, attr, parent)


def _create(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    parent, name = _int(args, "parent"), _name(args)
    try:
        attr = volume.create(
            parent,
            name,
            _int(args, "mode") & 0o7777,
            uid=_int(args, "uid"),
            gid=_group_of_new(volume, args)[0],
            time_ns=now,
        )
    except AlreadyExists:
        if args.get("exclusive", True):
            raise
        attr = volume.lookup(parent, name)
        if attr.kind == Kind.DIR:
            raise IsADirectory("is a directory", name=name) from None
    return _entry_with_parent(volume, args, attr, parent)


def _statfs(volume: Volume) -> dict[str, int]:
    counters = volume.counters()
    limit = min(counters.limit_bytes, counters.host_capacity_bytes)
    free = max(0, limit - counters.charged_bytes)
    if not counters.bounded:
        free = min(free, max(0, counters.host_capacity_bytes - counters.host_physical_bytes))
    blocks = min(limit // PAGE, (1 << 62) // PAGE)
    return {
        "bsize": PAGE,
        "frsize": PAGE,
        "blocks": blocks,
        "bfree": min(free // PAGE, blocks),
        "bavail": min(free // PAGE, blocks),
        "files": 1 << 32,
        "ffree": (1 << 32) - len(volume.root.inodes),
        "namemax": 255,
    }


def _readdir(volume: Volume, args: dict[str, Any]) -> list[list[Any]]:
    ino, offset, plus = _int(args, "ino"), _int(args, "offset"), bool(args.get("plus"))
    budget = min(_int(args, "limit_bytes"), 1 << 20)  # bounded, whatever the client asks
    parent = volume.parent_of(ino)
    entries: list[tuple[int, str, int, int]] = [
        (1, ".", stat.S_IFDIR, ino),
        (2, "..", stat.S_IFDIR, parent),
    ]
    entries += sorted(
        (cookie_of(item.name), item.name, MODE_BITS[item.kind], item.ino)
        for item in volume.readdir(ino)
    )
    out: list[list[Any]] = []
    for cookie, name, mode_bits, child in entries:
        if cookie <= offset:
            continue
        cost = entry_size(name, plus)
        if cost > budget:
            break
        budget -= cost
        attr: dict[str, Any] | None = None
        if plus and name not in (".", ".."):
            try:
                attr = _entry(volume, volume.lookup(ino, name))
            except NotFound:
                continue  # vanished from the base since it was listed
            child = attr["ino"]
        out.append([name, mode_bits, child, cookie, attr])
    return out


def _fallocate(volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
    ino, mode = _int(args, "ino"), _int(args, "mode")
    offset, length = _int(args, "offset"), _int(args, "length")
    if length == 0 or offset + length > MAX_FILE_SIZE:
        raise InvalidArgument("invalid fallocate range")
    size = volume.getattr(ino).size
    if mode & ~(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
        raise InvalidArgument("unsupported fallocate mode", mode=mode)
    if mode & FALLOC_FL_PUNCH_HOLE:
        if not mode & FALLOC_FL_KEEP_SIZE:
            raise InvalidArgument("punching a hole needs FALLOC_FL_KEEP_SIZE")
        volume.punch_hole(ino, offset, length, time_ns=now)
        return {}
    if mode & FALLOC_FL_ZERO_RANGE:
        volume.punch_hole(ino, offset, length, time_ns=now)
    if not mode & FALLOC_FL_KEEP_SIZE and offset + length > size:
        volume.truncate(ino, offset + length, time_ns=now)  # RAM needs no preallocation
    return {}
