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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


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

    def _parts(self, path: str) -> list[str]:
        if not path.startswith("/"):
            raise InvalidArgument("base paths are absolute", path=path)
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise InvalidArgument("base path leaves the base directory", path=path)
        return parts

    def _open_dir(self, parts: list[str]) -> int:
        """An fd of the directory at `parts`, walked without following any symlink.

        A directory swapped for a symlink (to /etc, say) fails here instead of
        leading the volume outside the base.
        """
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def stat(self, path: str) -> BaseEntry | None:
        parts = self._parts(path)
        if not parts:
            return self._entry("/", os.stat(self.root), "")
        try:
            dir_fd = self._open_dir(parts[:-1])
        except OSError as exc:
            if exc.errno in _GONE:
                return None
            raise
        try:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            target = os.readlink(parts[-1], dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else ""
        except OSError as exc:
            if exc.errno in _GONE:
                return None
            raise
        finally:
            os.close(dir_fd)
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
                        mode = entry.stat(follow_symlinks=False).st_mode
                    except FileNotFoundError:
                        continue  # removed while listing
                    out.append((entry.name, kind_of_mode(mode)))
        finally:
            os.close(dir_fd)
        return out

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        parts = self._parts(path)
        try:
            dir_fd = self._open_dir(parts[:-1])
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
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
