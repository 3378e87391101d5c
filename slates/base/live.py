"""LiveDirectory: the base reader for a live source directory.

Theory of operation: a volume over a live directory reads it on demand and
never writes it.  This reader answers the three questions the volume asks
(`stat`, `list`, `read`) with plain POSIX reads.  Every read names the
fingerprint the volume pinned when it first saw the file; the reader checks
the open file against it and raises BaseDrift if the file changed, so the
volume never mixes two versions of one file.  Symbolic links in the base
are reported as links and never followed.  Paths are volume paths
("/a/b"), resolved beneath the base root; a name that would leave the root
is refused.

The base directory is opened once, when the reader is made
(slates.base.beneath.Anchored: never on a FUSE file system, never the
runtime directory or around or inside it), and every stat, list and read
walks from that fd with openat2 (no symlink, no "..", no other mount on
the way), so renaming or swapping anything on the path that named the
base changes nothing afterwards.  A mount point inside the base is listed
as a directory; stat and read of it are AccessDenied.

Called by slates.core.volume.Volume (through the BaseReader protocol) and
by slates.base.capturing.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from slates.base.beneath import Anchored, lstat_beneath
from slates.core.records import BaseEntry, Fingerprint, Kind
from slates.errors import AccessDenied, BaseDrift, InvalidArgument

__all__ = ["LiveDirectory", "kind_of_mode", "fingerprint_of"]

_KINDS = {
    stat.S_IFREG: Kind.FILE,
    stat.S_IFDIR: Kind.DIR,
    stat.S_IFLNK: Kind.SYMLINK,
    stat.S_IFIFO: Kind.FIFO,
    stat.S_IFSOCK: Kind.SOCKET,
    stat.S_IFCHR: Kind.CHAR_DEVICE,
    stat.S_IFBLK: Kind.BLOCK_DEVICE,
}


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
# Non-blocking: a fifo swapped in for a file must not stall the shard.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def kind_of_mode(mode: int) -> Kind:
    return _KINDS[stat.S_IFMT(mode)]


def fingerprint_of(st: os.stat_result) -> Fingerprint:
    return Fingerprint(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class LiveDirectory:
    """A base directory anchored once (slates.base.beneath); every read walks beneath it.

    `root` is a path (resolved once, here) or an Anchored directory the
    caller opened (then the caller closes it); `protected` are the
    directories the base must not be, hold or lie inside.
    """

    def __init__(self, root: str | Anchored, *, protected: Sequence[str] = ()) -> None:
        if isinstance(root, Anchored):
            self.anchor = root
        else:
            self.anchor = Anchored(os.path.abspath(root), protected=protected, what="base")
        self.root = self.anchor.path

    @property
    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the base directory, recorded when it was opened."""
        return self.anchor.identity

    def close(self) -> None:
        self.anchor.close()

    def _parts(self, path: str) -> list[str]:
        if not path.startswith("/"):
            raise InvalidArgument("base paths are absolute", path=path)
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise InvalidArgument("base path leaves the base directory", path=path)
        return parts

    def _open_dir(self, parts: list[str]) -> int:
        """An fd of the directory at `parts`, beneath the base: no symlink, no mount on
        the way (a directory swapped for a symlink to /etc fails here)."""
        return self.anchor.open("/".join(parts) or ".", _DIR_FLAGS)

    def stat(self, path: str) -> BaseEntry | None:
        parts = self._parts(path)
        if not parts:
            return self._entry("/", os.fstat(self.anchor.fd), "")
        try:
            fd = self.anchor.open("/".join(parts), _PATH_FLAGS)
        except OSError as exc:
            if exc.errno in _GONE:
                return None
            raise
        try:
            st = os.fstat(fd)
            target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
        finally:
            os.close(fd)
        return self._entry("/" + "/".join(parts), st, target)

    @staticmethod
    def _entry(path: str, st: os.stat_result, target: str) -> BaseEntry:
        kind = kind_of_mode(st.st_mode)
        return BaseEntry(
            path=path,
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            size=st.st_size if kind == Kind.FILE else 0,
            atime_ns=st.st_atime_ns,
            mtime_ns=st.st_mtime_ns,
            ctime_ns=st.st_ctime_ns,
            rdev=st.st_rdev,
            fingerprint=fingerprint_of(st),
            target=target,
            nlink=st.st_nlink,
        )

    def list(self, path: str) -> list[tuple[str, Kind]]:
        try:
            dir_fd = self._open_dir(self._parts(path))
        except OSError as exc:
            if exc.errno in _GONE:
                return []
            raise
        out: list[tuple[str, Kind]] = []
        try:
            with os.scandir(dir_fd) as entries:
                for entry in entries:
                    try:
                        mode = lstat_beneath(dir_fd, entry.name).st_mode
                    except FileNotFoundError:
                        continue  # removed while listing
                    except AccessDenied:
                        # A mount point: listed, but stat and read refuse to enter it.
                        mode = stat.S_IFDIR
                    out.append((entry.name, kind_of_mode(mode)))
        finally:
            os.close(dir_fd)
        return out

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        parts = self._parts(path)
        if not parts:
            raise InvalidArgument("the base directory itself has no content", path=path)
        try:
            fd = self.anchor.open("/".join(parts), _READ_FLAGS)
        except OSError as exc:
            if exc.errno in _GONE:
                raise BaseDrift("base file is gone", path=path) from None
            raise
        try:
            if fingerprint_of(os.fstat(fd)) != fingerprint:
                raise BaseDrift("base file changed since the volume first read it", path=path)
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)
