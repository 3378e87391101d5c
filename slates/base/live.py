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

Called by slates.core.volume.Volume (through the BaseReader protocol) and
by slates.base.capturing.
"""

from __future__ import annotations

import errno
import os
import stat

from slates.core.records import BaseEntry, Fingerprint, Kind
from slates.errors import BaseDrift, InvalidArgument, NotFound

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


def kind_of_mode(mode: int) -> Kind:
    return _KINDS[stat.S_IFMT(mode)]


def fingerprint_of(st: os.stat_result) -> Fingerprint:
    return Fingerprint(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class LiveDirectory:
    def __init__(self, root: str) -> None:
        root = os.path.abspath(root)
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise NotFound("base directory does not exist", path=root) from None
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidArgument("base is not a directory", path=root)
        self.root = root

    def _host_path(self, path: str) -> str:
        if not path.startswith("/"):
            raise InvalidArgument("base paths are absolute", path=path)
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise InvalidArgument("base path leaves the base directory", path=path)
        return os.path.join(self.root, *parts)

    def stat(self, path: str) -> BaseEntry | None:
        host_path = self._host_path(path)
        try:
            st = os.lstat(host_path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = kind_of_mode(st.st_mode)
        target = os.readlink(host_path) if kind == Kind.SYMLINK else ""
        return BaseEntry(
            path="/" + "/".join(p for p in path.split("/") if p),
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
        )

    def list(self, path: str) -> list[tuple[str, Kind]]:
        out: list[tuple[str, Kind]] = []
        try:
            with os.scandir(self._host_path(path)) as entries:
                for entry in entries:
                    try:
                        mode = entry.stat(follow_symlinks=False).st_mode
                    except FileNotFoundError:
                        continue  # removed while listing
                    out.append((entry.name, kind_of_mode(mode)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return out

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        host_path = self._host_path(path)
        try:
            fd = os.open(host_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise BaseDrift("base file is gone", path=path) from None
            raise
        try:
            if fingerprint_of(os.fstat(fd)) != fingerprint:
                raise BaseDrift("base file changed since the volume first read it", path=path)
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)
