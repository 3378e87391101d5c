"""Anchored directories: a base or landing target opened once, every later access beneath it.

Theory of operation (DESIGN.md section 6a, "Paths").  A directory named by a
path is resolved exactly once, by `Anchored`, into a directory fd whose
(st_dev, st_ino) is recorded; nothing afterwards looks at the path again, so
swapping a symlink on the way after the check changes nothing.  Every later
access goes through `open_beneath(anchor_fd, relative, flags)`, the kernel's
openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV: no
"..", no symlink and no other mount (a FUSE mount or a bind mount inside the
directory) can be crossed.  Without openat2 (ENOSYS) the same rules are
kept by a walk one component at a time with O_NOFOLLOW, checking st_dev
and the mount id (a bind mount keeps st_dev).

The one resolution never enters a FUSE file system: before any name is
looked up inside a directory, that directory's mount (its mnt_id in
/proc/self/fdinfo, its type in /proc/self/mountinfo) is checked, so a path
into a Slates mount is refused without sending the mount a single request
(a base inside a mount served by the same shard would otherwise deadlock
it).  Symlinks on the given path are followed by hand (at most 40) with the
same check at every step.

A directory that is, holds or lies inside a protected directory (the
runtime directory, which holds the approver credential) is refused by
comparing the (dev, ino) of its ancestors (walked with "..") with the
protected directories and theirs, never strings, so a bind mount or a
second name for the runtime directory is refused too.

Errors: NotFound (the directory does not exist), InvalidArgument (not an
absolute path, not a directory), AccessDenied (FUSE, protected, or an
access that would leave the directory: EXDEV from openat2).  Other OSErrors
of `open_beneath` (ENOENT, ENOTDIR, ELOOP for a symlink on the way) are
raised as they are: callers decide whether that means "gone".

Used by slates.base.live (bases), slates.base.capturing and
slates.land.disk (landing targets).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import stat
from collections.abc import Iterator, Sequence
from types import TracebackType

from slates.errors import AccessDenied, InvalidArgument, NotFound

__all__ = [
    "Anchored",
    "open_beneath",
    "lstat_beneath",
    "is_fuse_fd",
    "protected_identities",
    "RESOLVE_BENEATH",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
]

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV
_SYSCALL_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
FUSE_SUPER_MAGIC = 0x65735546
MAX_SYMLINKS = 40  # as the kernel's own limit
MAX_DEPTH = 4096  # ancestors walked before giving up
_EAGAIN_RETRIES = 8  # openat2 answers EAGAIN when a rename raced a ".." check

_libc = ctypes.CDLL(None, use_errno=True)
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


class _Openat2:
    """Whether openat2 works here (tests turn it off to exercise the walk)."""

    available = _SYSCALL_OPENAT2 is not None


def _openat2(number: int, dir_fd: int, relative: bytes, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    for _attempt in range(_EAGAIN_RETRIES):
        fd = int(
            _libc.syscall(
                ctypes.c_long(number),
                ctypes.c_int(dir_fd),
                ctypes.c_char_p(relative),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            raise OSError(code, os.strerror(code), os.fsdecode(relative))
    raise OSError(errno.EAGAIN, "the path kept changing while it was opened")


def _walk(dir_fd: int, parts: list[str], flags: int, mode: int) -> int:
    """openat2's rules kept by hand: one component at a time, no symlink, no other mount."""
    device = (os.fstat(dir_fd).st_dev, _mount_id(dir_fd))  # a bind mount keeps st_dev
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            child = os.open(part, _PATH_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if (st.st_dev, _mount_id(fd)) != device:
                raise OSError(errno.EXDEV, "another mount on the way", part)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "a symlink on the way", part)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a directory on the way", part)
        # The last component: O_PATH first, so a mount point or a link is seen, not entered.
        probe = os.open(parts[-1], _PATH_FLAGS, dir_fd=fd)
        try:
            st = os.fstat(probe)
            if (st.st_dev, _mount_id(probe)) != device:
                raise OSError(errno.EXDEV, "another mount", parts[-1])
            if stat.S_ISLNK(st.st_mode) and not (flags & os.O_PATH and flags & os.O_NOFOLLOW):
                raise OSError(errno.ELOOP, "a symlink", parts[-1])
        finally:
            os.close(probe)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def _relative_parts(relative: str) -> list[str]:
    if relative.startswith("/") or "\0" in relative:
        raise InvalidArgument("a path beneath a directory is relative", path=relative[:200])
    parts = [p for p in relative.split("/") if p and p != "."]
    if ".." in parts:
        raise AccessDenied("the path would leave its directory", path=relative[:200])
    return parts or ["."]


def open_beneath(anchor_fd: int, relative: str, flags: int, mode: int = 0) -> int:
    """An fd for `relative` beneath the directory `anchor_fd`, never leaving it.

    No "..", no symlink anywhere on the way (ELOOP; with O_PATH | O_NOFOLLOW a
    final symlink is opened itself), no other mount (AccessDenied).
    """
    parts = _relative_parts(relative)
    if not flags & os.O_PATH:
        # RESOLVE_NO_SYMLINKS refuses a final symlink with ELOOP; O_NOFOLLOW with
        # O_DIRECTORY would say ENOTDIR instead, which reads as "gone".
        flags &= ~os.O_NOFOLLOW
    try:
        if _Openat2.available and _SYSCALL_OPENAT2 is not None:
            try:
                return _openat2(
                    _SYSCALL_OPENAT2, anchor_fd, os.fsencode("/".join(parts)), flags, mode
                )
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
                _Openat2.available = False
        if parts == ["."]:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=anchor_fd)
        return _walk(anchor_fd, parts, flags, mode)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise AccessDenied(
                "the path crosses into another file system (a mount inside the directory)",
                path=relative[:200],
            ) from None
        raise


def lstat_beneath(dir_fd: int, relative: str) -> os.stat_result:
    """lstat of `relative` beneath `dir_fd`; a mount point there is AccessDenied (a plain
    fstatat would enter the mounted file system, which may be a FUSE mount that hangs)."""
    fd = open_beneath(dir_fd, relative, _PATH_FLAGS)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


# -- file system types, without asking the file system -----------------------------


def _mount_types() -> dict[int, str]:
    types: dict[int, str] = {}
    with open("/proc/self/mountinfo", "rb") as table:
        for line in table:
            fields = line.split()
            if b"-" in fields:
                types[int(fields[0])] = os.fsdecode(fields[fields.index(b"-") + 1])
    return types


def _mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
            for line in info:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _statfs_type(fd: int) -> int:
    buffer = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
    if _libc.fstatfs(ctypes.c_int(fd), buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(ctypes.c_long.from_buffer(buffer).value)


class _MountTable:
    """/proc/self/mountinfo, read again once when a mount id is not in it yet."""

    def __init__(self) -> None:
        self.types: dict[int, str] | None = None

    def is_fuse(self, fd: int) -> bool:
        mount = _mount_id(fd)
        if mount is None:  # no /proc: ask the file system (safe only if it is not FUSE)
            return _statfs_type(fd) == FUSE_SUPER_MAGIC
        if self.types is None or mount not in self.types:
            self.types = _mount_types()
        kind = self.types.get(mount)
        if kind is None:
            raise AccessDenied("cannot tell which file system holds the directory")
        return kind in ("fuse", "fuseblk") or kind.startswith("fuse.")


def is_fuse_fd(fd: int) -> bool:
    """Whether `fd` lies on a FUSE file system (asked of the kernel's mount table)."""
    return _MountTable().is_fuse(fd)


# -- resolving a path once ----------------------------------------------------------


def _refuse_fuse(table: _MountTable, fd: int, what: str, path: str) -> None:
    if table.is_fuse(fd):
        raise AccessDenied(
            f"the {what} is on a FUSE file system (a Slates mount, say); bases and"
            " landing targets must be ordinary directories",
            path=path,
        )


def _resolve_once(path: str, what: str) -> int:
    """An O_PATH fd of what `path` names, symlinks followed by hand, never looking a
    name up inside a FUSE directory."""
    table = _MountTable()
    pending = [p for p in path.split("/") if p]
    pending.reverse()  # a stack: the next component last
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    try:
        while pending:
            name = pending.pop()
            if name == ".":
                continue
            _refuse_fuse(table, fd, what, path)  # before anything is asked of it
            try:
                child = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise NotFound(f"the {what} directory does not exist", path=path) from None
            except NotADirectoryError:
                raise InvalidArgument(f"the {what} is not a directory", path=path) from None
            _refuse_fuse(table, child, what, path)  # the root of a mount, before fstat
            mode = os.fstat(child).st_mode
            if stat.S_ISLNK(mode):
                links += 1
                if links > MAX_SYMLINKS:
                    os.close(child)
                    raise InvalidArgument(f"too many symlinks in the {what} path", path=path)
                target = os.readlink("", dir_fd=child)
                os.close(child)
                pending.extend(reversed([p for p in target.split("/") if p]))
                if target.startswith("/"):
                    top = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    os.close(fd)
                    fd = top
                continue
            os.close(fd)
            fd = child
            if pending and not stat.S_ISDIR(mode):
                raise InvalidArgument(f"the {what} is not a directory", path=path)
        _refuse_fuse(table, fd, what, path)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _chain(fd: int) -> list[tuple[int, int]]:
    """(dev, ino) of the directory `fd` and of every ancestor up to "/" (by "..")."""
    out: list[tuple[int, int]] = []
    current = os.dup(fd)
    try:
        for _level in range(MAX_DEPTH):
            st = os.fstat(current)
            identity = (st.st_dev, st.st_ino)
            if out and out[-1] == identity:
                return out  # ".." of "/" is "/"
            out.append(identity)
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
            os.close(current)
            current = parent
    finally:
        os.close(current)
    raise InvalidArgument("a directory nested too deeply", depth=MAX_DEPTH)


def protected_identities(protected: Sequence[str]) -> list[list[tuple[int, int]]]:
    """For each protected directory that exists, its chain of (dev, ino) (itself first)."""
    chains = []
    for path in protected:
        try:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # nothing there to protect
        try:
            chains.append(_chain(fd))
        finally:
            os.close(fd)
    return chains


def _refuse_protected(fd: int, protected: Sequence[str], what: str, path: str) -> None:
    mine = _chain(fd)
    for theirs in protected_identities(protected):
        if theirs[0] in mine or mine[0] in theirs:
            raise AccessDenied(f"the {what} would reach Slates' runtime directory", path=path)


class Anchored:
    """A directory opened once: `fd` (O_RDONLY | O_DIRECTORY) and its `identity`.

    `path` is kept for messages only; nothing opens it again.
    """

    def __init__(self, path: str, *, protected: Sequence[str] = (), what: str = "directory"):
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"the {what} is an absolute directory path", path=str(path))
        found = _resolve_once(path, what)
        try:
            st = os.fstat(found)  # not FUSE: checked by _resolve_once
            if not stat.S_ISDIR(st.st_mode):
                raise InvalidArgument(f"the {what} is not a directory", path=path)
            _refuse_protected(found, protected, what, path)
            self.fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=found)
        finally:
            os.close(found)
        opened = os.fstat(self.fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            os.close(self.fd)
            raise AccessDenied(f"the {what} changed while it was opened", path=path)
        self.identity: tuple[int, int] = (st.st_dev, st.st_ino)
        self.path = path
        self.what = what

    def open(self, relative: str, flags: int, mode: int = 0) -> int:
        return open_beneath(self.fd, relative, flags, mode)

    def lstat(self, relative: str) -> os.stat_result:
        if relative.strip("/") in ("", "."):
            return os.fstat(self.fd)
        return lstat_beneath(self.fd, relative)

    def reopen(self) -> int:
        """A new open file description of the directory (its own flock, say)."""
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)

    def lies_within(self, roots: Sequence[str]) -> bool:
        """Whether this directory is one of `roots` or lies inside one, by (dev, ino) of
        its ancestors (for `anchor --allow-root`; a root that does not exist holds nothing)."""
        mine = _chain(self.fd)
        return any(theirs[0] in mine for theirs in protected_identities(roots))

    def expect(self, identity: Sequence[int] | None) -> None:
        """Refuse unless this is the directory with `identity` (recorded at plan time)."""
        if identity is not None and tuple(identity) != self.identity:
            raise AccessDenied(
                f"the {self.what} is no longer the directory that was planned", path=self.path
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Anchored:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@contextlib.contextmanager
def anchored(
    path: str | Anchored, *, protected: Sequence[str] = (), what: str = "directory"
) -> Iterator[Anchored]:
    """`path` anchored for the duration (an Anchored given is used, not closed)."""
    if isinstance(path, Anchored):
        yield path
        return
    anchor = Anchored(path, protected=protected, what=what)
    try:
        yield anchor
    finally:
        anchor.close()
