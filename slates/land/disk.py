"""Writing a landing to the target directory: one entry at a time, each old or new.

Theory of operation (DESIGN.md sections 6 and 6a).  `Target` opens the
target directory once (slates.base.beneath.Anchored: never on FUSE, never
the runtime directory, around it or inside it; with `identity`, only the
very directory recorded at plan time), takes the target lease (an
exclusive flock on the directory, so Slates' own landings into one
directory are serialized), and reaches every entry from that fd with
openat2 (no symlink, no "..", no other mount on the way): swapping a
symlink on the target's path after it was opened changes nothing, and no
entry can be read or written outside the target.

Every entry is decided by slates.land.manifest.decide against the disk
*now* (`land_entry` also says why a conflict is one: explain's words, or
an interrupted save, a write during the swap, a vanished directory), and
replaced so that a reader sees the old or the new entry, never a torn
one: the new content is written to a temporary name beside it and
fsynced, then swapped in with renameat2(RENAME_EXCHANGE) (or
RENAME_NOREPLACE for a new name), and the directory is fsynced.  The
entry that comes out of the swap is checked again against the witness: if
someone changed the file between the decision and the swap, it is swapped
back and reported as a conflict, so an outside writer's bytes are never
replaced.  Removals move the entry aside first and check it the same way.

Names are bytes on disk: a name that is not UTF-8 (a surrogateescape
string) lands like any other.  Modes are the manifest's: a new file is
written as 0600 and gets its proposed mode only once its bytes are
durable, so setuid, setgid and sticky bits appear only when the proposed
mode carries them (the approval screen highlights those entries), never
on a half-written file.  An entry that fails while its new content is
being built removes its temporary name before the error goes on; a
temporary name left by a crash (".slates-land-...") is removed by the
next landing into that directory.  Called by slates.node.landing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import os
import posixpath
import signal
import stat
import time
from collections.abc import Iterator, Sequence
from types import TracebackType

import blake3

from slates.base.beneath import Anchored, lstat_beneath, open_beneath
from slates.errors import (
    AccessDenied,
    InvalidArgument,
    LandingConflict,
    VerificationFailed,
)
from slates.land.manifest import Decision, Entry, State, check_relative, explain, landed_mode

__all__ = ["Applied", "Target", "state_of_bytes", "TEMP_PREFIX", "LEASE_SECONDS"]

TEMP_PREFIX = ".slates-land-"
LEASE_SECONDS = 30.0
MAX_READ = 16 << 20
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)
# Why an entry conflicted, beyond explain's comparison of the disk with the witness.
INTERRUPTED = (
    "an interrupted save is at this entry's temporary name (someone's save caught"
    " mid-swap by a landing that crashed): left alone"
)
CHANGED_WHILE_LANDING = (
    "the disk entry changed while it was being landed (an outside write): their bytes were kept"
)
PARENT_GONE = "the directory holding this entry is gone from disk, or is not a directory"


@dataclasses.dataclass(frozen=True, slots=True)
class Applied:
    """What landing one entry did: the decision, the disk state it was decided on, and
    for a conflict why."""

    decision: Decision
    disk: State | None
    reason: str | None


def _renameat2(src_dir: int, src: str, dst_dir: int, dst: str, flags: int) -> None:
    if _libc.renameat2(src_dir, os.fsencode(src), dst_dir, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)


def state_of_bytes(kind: str, data: bytes, mode: int) -> State:
    return State(kind, blake3.blake3(data).hexdigest(), mode & 0o7777)


def _open_regular(dir_fd: int, name: str) -> int | None:
    """An fd of the regular file `name`, or None if it is anything else.

    Opened non-blocking (a fifo swapped in would otherwise block the shard)
    and checked on the fd itself, so what is read is what was checked.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = open_beneath(dir_fd, name, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOENT):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class _ParentGone(Exception):
    """A directory on the way to an entry is missing or is not a directory."""


def _owner_for(dir_fd: int, name: str) -> tuple[int, int] | None:
    """Whose a landed entry is: the owner of the entry it replaces, else of the directory
    it lands in (the developer's, not the service's).  None when the service is not
    root: then its files are its user's, as every file that user writes."""
    if os.geteuid() != 0:
        return None
    try:
        st = lstat_beneath(dir_fd, name)
    except (FileNotFoundError, NotADirectoryError):
        st = os.fstat(dir_fd)
    return st.st_uid, st.st_gid


def _failpoint() -> None:
    """Tests: SIGKILL this process after an entry, once (while the file named by
    SLATES_LAND_CRASH_ONCE exists)."""
    flag = os.environ.get("SLATES_LAND_CRASH_ONCE")
    if flag and os.path.exists(flag):
        os.unlink(flag)
        os.kill(os.getpid(), signal.SIGKILL)


class Target:
    """A target directory under the lease; use as a context manager."""

    def __init__(
        self,
        path: str | Anchored,
        *,
        lease: bool = True,
        protected: Sequence[str] = (),
        identity: Sequence[int] | None = None,
    ) -> None:
        """`path`: the target (opened once here) or an Anchored directory the caller
        opened and keeps; `protected`: directories it must not reach; `identity`: the
        (st_dev, st_ino) recorded at plan time, refused if the directory is another."""
        if isinstance(path, str) and not os.path.isabs(path):
            raise InvalidArgument("the target must be an absolute directory", target=path)
        if isinstance(path, Anchored):
            anchor = path
        else:
            anchor = Anchored(path, protected=protected, what="target")
        try:
            anchor.expect(identity)
            self.fd = anchor.reopen()  # its own open file: its own lease
        finally:
            if anchor is not path:
                anchor.close()
        self.identity = anchor.identity
        self.path = anchor.path
        self._pending_modes: list[tuple[str, int]] = []
        self._leased = lease
        if lease:
            self._lease()

    def _lease(self) -> None:
        deadline = time.monotonic() + LEASE_SECONDS
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise LandingConflict(
                        "another landing holds the target's lease", target=self.path
                    ) from None
                time.sleep(0.05)

    def close(self) -> None:
        os.close(self.fd)  # releases the lease

    def __enter__(self) -> Target:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- walking ----------------------------------------------------------------

    @contextlib.contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        """The directory fd holding `path` and the entry's name (no symlink on the way).

        Raises _ParentGone when a component is missing or not a directory
        (the entry is then absent), AccessDenied when one is a symlink.
        """
        parts = check_relative(path).split("/")
        try:
            fd = open_beneath(self.fd, "/".join(parts[:-1]) or ".", _DIR_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise AccessDenied("a path component on disk is a symlink", path=path) from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise _ParentGone(path) from None
            raise
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    @staticmethod
    def _state_at(dir_fd: int, name: str) -> State | None:
        try:
            st = lstat_beneath(dir_fd, name)
        except FileNotFoundError:
            return None
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            return State("dir", None, mode)
        if stat.S_ISLNK(st.st_mode):
            return state_of_bytes("symlink", os.fsencode(os.readlink(name, dir_fd=dir_fd)), 0o777)
        if not stat.S_ISREG(st.st_mode):
            return State("other", "", mode)  # never equal to a manifest state
        fd = _open_regular(dir_fd, name)
        if fd is None:
            return State("other", "", mode)  # replaced by something else meanwhile
        try:
            digest = blake3.blake3()
            while chunk := os.read(fd, 1 << 20):
                digest.update(chunk)
        finally:
            os.close(fd)
        return State("file", digest.hexdigest(), mode)

    def state(self, path: str) -> State | None:
        try:
            with self._parent(path) as (dir_fd, name):
                return self._state_at(dir_fd, name)
        except (FileNotFoundError, _ParentGone):
            return None

    def read(self, path: str) -> bytes | None:
        """What the disk holds at `path` now (None when absent); a symlink gives its target."""
        try:
            with self._parent(path) as (dir_fd, name):
                st = lstat_beneath(dir_fd, name)
                if stat.S_ISLNK(st.st_mode):
                    return os.fsencode(os.readlink(name, dir_fd=dir_fd))
                if stat.S_ISDIR(st.st_mode):
                    raise InvalidArgument("a directory has no content", path=path)
                if st.st_size > MAX_READ:
                    raise InvalidArgument("read_base reads at most 16 MiB", path=path)
                fd = _open_regular(dir_fd, name)
                if fd is None:
                    raise InvalidArgument(
                        "not a regular file (a fifo, device or socket)", path=path
                    )
                try:
                    return os.read(fd, MAX_READ + 1)[:MAX_READ]
                finally:
                    os.close(fd)
        except (FileNotFoundError, _ParentGone):
            return None

    # -- applying -----------------------------------------------------------------

    def apply(self, entry: Entry, content: bytes | None) -> tuple[Decision, State | None]:
        """Land one entry (content: the proposed bytes or link target); returns what happened."""
        done = self.land_entry(entry, content)
        return done.decision, done.disk

    def land_entry(self, entry: Entry, content: bytes | None) -> Applied:
        """`apply`, with the reason for a conflict."""
        try:
            with self._parent(entry.path) as (dir_fd, name):
                if not self._recover(dir_fd, name, entry):
                    return Applied(Decision.CONFLICT, self._state_at(dir_fd, name), INTERRUPTED)
                disk = self._state_at(dir_fd, name)
                decision, reason = explain(entry.witnessed, disk, entry.proposed)
                if decision is Decision.APPLY:
                    decision = self._replace(dir_fd, name, entry, content)
                    os.fsync(dir_fd)
                    _failpoint()
                    if decision is Decision.CONFLICT:
                        reason = CHANGED_WHILE_LANDING
                return Applied(decision, disk, reason)
        except _ParentGone:
            # Its directory is gone: the entry is absent, and nothing can be put there.
            decision, reason = explain(entry.witnessed, None, entry.proposed)
            if decision is Decision.APPLY:
                return Applied(Decision.CONFLICT, None, PARENT_GONE)
            return Applied(decision, None, reason)

    def _temp_name(self, name: str) -> str:
        digest = blake3.blake3(name.encode("utf-8", "surrogateescape")).hexdigest()
        return f"{TEMP_PREFIX}{digest[:24]}"

    def _recover(self, dir_fd: int, name: str, entry: Entry) -> bool:
        """Deal with what a landing that crashed left at this entry's temporary name.

        Our own leftovers (the witness moved aside, a proposal or an empty
        directory being built) are removed.  Anything else is someone's save
        caught mid-swap: it goes back to the name if ours took its place, and
        the entry is a conflict (False); nothing of theirs is ever removed.
        """
        temp = self._temp_name(name)
        leftover = self._state_at(dir_fd, temp)
        if leftover is None:
            return True
        proposed = entry.proposed
        ours = (
            leftover in (entry.witnessed, proposed)
            or (leftover.kind == "dir" and self._is_empty_dir(dir_fd, temp))
            # Our proposal's bytes, still 0600: a write that had not set its mode yet.
            or (
                proposed is not None
                and (leftover.kind, leftover.digest, leftover.mode)
                == (proposed.kind, proposed.digest, 0o600)
            )
        )
        if ours:
            self._discard(dir_fd, temp)
            return True
        if self._state_at(dir_fd, name) == entry.proposed:
            _renameat2(dir_fd, temp, dir_fd, name, _RENAME_EXCHANGE)
            self._discard(dir_fd, temp)
        return False

    @staticmethod
    def _is_empty_dir(dir_fd: int, name: str) -> bool:
        fd = open_beneath(dir_fd, name, _DIR_FLAGS)
        try:
            return not os.listdir(fd)
        finally:
            os.close(fd)

    def _replace(self, dir_fd: int, name: str, entry: Entry, content: bytes | None) -> Decision:
        """Put the proposal at `name` in one atomic step; the witness is checked after it."""
        proposed, witnessed = entry.proposed, entry.witnessed
        temp = self._temp_name(name)
        if proposed is None:
            return self._remove(dir_fd, name, temp, witnessed)
        if (
            witnessed is not None
            and witnessed.kind == proposed.kind
            and witnessed.digest == proposed.digest
        ):
            return self._chmod(dir_fd, name, proposed, entry.path)
        if proposed.kind != "dir" and (
            content is None or state_of_bytes(proposed.kind, content, 0).digest != proposed.digest
        ):
            raise VerificationFailed(
                "the content to write is not the approved proposal", path=entry.path
            )
        self._build(dir_fd, temp, entry.path, proposed, content or b"")
        if witnessed is None:
            try:
                _renameat2(dir_fd, temp, dir_fd, name, _RENAME_NOREPLACE)
            except FileExistsError:
                self._discard(dir_fd, temp)
                return Decision.CONFLICT  # something appeared meanwhile: leave it
            except BaseException:
                self._discard_built(dir_fd, temp)
                raise
            return Decision.APPLY
        try:
            _renameat2(dir_fd, temp, dir_fd, name, _RENAME_EXCHANGE)  # any kinds
        except FileNotFoundError:
            self._discard(dir_fd, temp)
            return Decision.CONFLICT  # removed meanwhile
        except BaseException:
            self._discard_built(dir_fd, temp)  # nothing was swapped: temp is ours alone
            raise
        return self._settle(dir_fd, name, temp, witnessed, proposed)

    def _settle(
        self, dir_fd: int, name: str, temp: str, witnessed: State, proposed: State
    ) -> Decision:
        """After a swap, `temp` holds what was at `name` an instant ago.

        Still the witness: it is removed and the entry is applied.  Anything
        else was written by someone meanwhile: their newest bytes go back to
        the name (or stay there if they already wrote it again), and only our
        own file or a save of theirs that their later save replaced is removed.
        """
        if self._state_at(dir_fd, temp) == witnessed:
            try:
                self._discard(dir_fd, temp)
                return Decision.APPLY
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    raise  # a directory that gained entries is given back below
        for _attempt in range(4):
            if self._state_at(dir_fd, name) != proposed:
                # They wrote at the name after our swap: that is their newest.
                with contextlib.suppress(OSError):
                    self._discard(dir_fd, temp)
                return Decision.CONFLICT
            _renameat2(dir_fd, temp, dir_fd, name, _RENAME_EXCHANGE)
            if self._state_at(dir_fd, temp) == proposed:
                self._discard(dir_fd, temp)  # our own file
                return Decision.CONFLICT
            # They wrote again just before the swap back: their newest is in temp now.
            _renameat2(dir_fd, temp, dir_fd, name, _RENAME_EXCHANGE)
        return Decision.CONFLICT  # a busy writer: their bytes stay; a temporary name may remain

    def _build(self, dir_fd: int, temp: str, path: str, proposed: State, content: bytes) -> None:
        """The whole new entry under the temporary name; on any failure the temporary
        name is removed before the error goes on (nothing half-built stays behind)."""
        owner = _owner_for(dir_fd, posixpath.basename(path))
        try:
            if proposed.kind == "dir":
                os.mkdir(temp, 0o700, dir_fd=dir_fd)
                if owner is not None:
                    os.chown(temp, *owner, dir_fd=dir_fd, follow_symlinks=False)
                self._set_dir_mode(dir_fd, temp, path, proposed.mode)
            else:
                self._write_temp(dir_fd, temp, proposed, content, owner)
        except BaseException:
            self._discard_built(dir_fd, temp)
            raise

    def _discard_built(self, dir_fd: int, temp: str) -> None:
        """Remove what this landing built at `temp` after a failure (the error that
        caused it is the one reported; a directory is empty: nothing went into it yet)."""
        with contextlib.suppress(OSError):
            self._discard(dir_fd, temp)

    def _write_temp(
        self,
        dir_fd: int,
        temp: str,
        proposed: State,
        content: bytes,
        owner: tuple[int, int] | None = None,
    ) -> None:
        if proposed.kind == "symlink":
            os.symlink(os.fsdecode(content), temp, dir_fd=dir_fd)
            if owner is not None:
                os.chown(temp, *owner, dir_fd=dir_fd, follow_symlinks=False)
            return
        # 0600 while it is written: the proposed mode (setuid, say) only on whole bytes.
        fd = os.open(
            temp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            if owner is not None:  # before the mode: a chown clears setuid and setgid bits
                os.fchown(fd, *owner)
            os.fchmod(fd, landed_mode(proposed))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _discard(self, dir_fd: int, name: str) -> None:
        if stat.S_ISDIR(lstat_beneath(dir_fd, name).st_mode):
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)

    def _remove(self, dir_fd: int, name: str, temp: str, witnessed: State | None) -> Decision:
        try:
            _renameat2(dir_fd, name, dir_fd, temp, _RENAME_NOREPLACE)
        except FileNotFoundError:
            return Decision.CONFLICT
        if self._state_at(dir_fd, temp) != witnessed:
            try:  # put it back; if the name was taken meanwhile, that save is their newest
                _renameat2(dir_fd, temp, dir_fd, name, _RENAME_NOREPLACE)
            except FileExistsError:
                with contextlib.suppress(OSError):
                    self._discard(dir_fd, temp)
            return Decision.CONFLICT
        try:
            self._discard(dir_fd, temp)
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            _renameat2(dir_fd, temp, dir_fd, name, _RENAME_NOREPLACE)  # something was added
            return Decision.CONFLICT
        return Decision.APPLY

    def _set_dir_mode(self, dir_fd: int, temp: str, path: str, mode: int) -> None:
        """A new directory's mode, exactly (whatever the umask); one that would
        keep this landing from writing inside it is set by `finish`, at the end."""
        if mode & 0o300 == 0o300:
            os.chmod(temp, mode, dir_fd=dir_fd)  # exactly: also clears an inherited setgid
        else:
            self._pending_modes.append((path, mode))

    def finish(self) -> None:
        """Apply the directory modes held back until the entries inside were written."""
        for path, mode in sorted(self._pending_modes, key=lambda pm: -pm[0].count("/")):
            with contextlib.suppress(_ParentGone, OSError), self._parent(path) as (dir_fd, name):
                fd = open_beneath(dir_fd, name, _DIR_FLAGS)
                try:
                    os.fchmod(fd, mode)  # the manifest's mode: special bits only if it has them
                finally:
                    os.close(fd)
        self._pending_modes.clear()

    def _chmod(self, dir_fd: int, name: str, proposed: State, path: str) -> Decision:
        if proposed.kind == "symlink":
            return Decision.APPLY  # links have no mode of their own
        if proposed.kind == "dir" and proposed.mode & 0o300 != 0o300:
            self._pending_modes.append((path, proposed.mode))
            return Decision.APPLY
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        fd = open_beneath(dir_fd, name, flags | (os.O_DIRECTORY if proposed.kind == "dir" else 0))
        try:
            os.fchmod(fd, landed_mode(proposed))
        finally:
            os.close(fd)
        return Decision.APPLY
