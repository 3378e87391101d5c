"""The mount bridge process: one volume served at one directory through FUSE.

Theory of operation
-------------------
`python -m slates.fuse.bridge --runtime-dir R --volume VID --mountpoint DIR`
is one bridge process per mount.  Its per-request path is C
(native/bridge_*.c, in the slates._native extension): a libfuse3 low-level
session on one or more loop threads (loop_threads()), whose op callbacks
encode each kernel request as one msgpack `fs.*` request
(slates/fuse/PROTOCOL.md), push it onto the shared-memory request ring, spin
and then park on the reply ring's eventfd (polled together with the shard's
socket, for liveness), and turn the reply into a fuse_reply_*.  All
semantics live in the shard that owns the volume; Python only sets things up:

1. read the anchor's state file (slates.node.runtime.Runtime) and find the
   owning shard (slates.node.service.shard_of);
2. say hello on that shard's unix socket as client `bridge-<volume>-<pid>`
   with rings requested, receive the ring pair's four fds by SCM_RIGHTS and
   hand them and the socket to C (`bridge_attach`, which validates the
   memfd seals and ring headers and takes ownership);
3. probe the volume (fs.getattr of the root) so a wrong id fails here, with
   a clear error, rather than as EIO inside the mount;
4. mount (default_permissions, fsname=slates, subtype=slates; allow_other
   only on request) and run the C loop; C writes b"1" to --ready-fd once
   the kernel's INIT is answered, i.e. once the mount serves;
5. on SIGTERM, SIGINT or SIGHUP the loop ends (C's handlers), and the
   bridge unmounts and exits 0.  An external unmount also ends it cleanly.

Kernel caching is deliberate (DESIGN.md section 2): OPEN, OPENDIR and FLUSH
are answered ENOSYS (no_open, no_opendir: the kernel keeps page and
directory caches), missing names get negative entries, entry and attribute
timeouts are a day, 1 MiB requests, and readdirplus is always used (every
entry arrives with its attributes, so `find` needs no LOOKUPs).  Writeback
caching is on unless --no-writeback-cache; measured trade-off on this
kernel: with it, 1,000 4 KiB write(2)s cost 4 WRITE requests instead of
1,000, but every close() makes the kernel distrust its cached i_blocks, so
re-reading a file costs one GETATTR; without it, a pass over an unchanged
tree sends nothing once the atimes the first READs invalidated have been
re-fetched.  The xattr names the kernel and tools probe constantly
(security.capability on every write(2), ACLs and SELinux labels for
`ls -l`) are answered from a per-inode memory of absence that only the
shard teaches (its "no such attribute", an ATTR counting no xattrs, or an
inode this mount just created: native/bridge_cache.c), so they cost no
round trip after the first, and none at all for files made in the mount.
The kernel is also asked for cached symlinks, parallel directory
operations, asynchronous reads and a deeper background queue
(max_background 64).  $SLATES_BRIDGE_THREADS loop threads (default one,
native/bridge_loop.c) may read /dev/fuse: what C answers alone runs side by
side, while requests to the shard still go one at a time, because the ring
link keeps one request in flight and the shard applies a volume's requests
in order.
Directory prefetch (native/bridge_prefetch.c): once the mount serves, a C
thread has child processes list the clean directories through the mount (a
walk from the root, up to 131,072 entries: $SLATES_BRIDGE_WALK_ENTRIES,
walk_entries()), so the kernel learns their entries
from READDIRPLUS instead of a LOOKUP per name, and keeps their listings;
$SLATES_BRIDGE_PREFETCH=0 turns it off (prefetch_wanted()).  The children
walk beneath a detached clone of the mount (open_tree), so what they hold
open never makes a user's umount(8) of the mountpoint fail as busy, and no
other mount is held by them.  Once the
listings are done, the walk reads the listed directories' regular files of
up to 256 KiB through the mount (at most 64 MiB a mount; not the root's
.git), so a first grep or build finds their pages cached;
$SLATES_BRIDGE_READAHEAD=0 turns that part off (readahead_wanted()).  Every clean
directory the bridge lists is watched with inotify (native/bridge_watch.c):
a name created, removed or moved in the base drops the kernel's listing, so
kept listings follow the live base ("watch_invals" counts them).
Write-behind (native/bridge_behind.c, slates/node/grants.py): in a
write-through mount, a write that extends a file may come back with the
shard's grant for the next 8 MiB of appending writes (writes anywhere in a
file with nothing read from the base, a new one included), and those are
answered to the kernel once they are in the ring, their replies taken later
in order; $SLATES_BRIDGE_BEHIND=0 turns it off (write_behind_wanted()).
FUSE-over-io_uring (issue 14): with $SLATES_FUSE_URING=1, when the bridge
runs as root and /sys/module/fuse/parameters/enable_uring is Y (and no
--auto-unmount), C mounts with mount(2) itself and, once INIT is answered,
serves the kernel on one io_uring queue per CPU, each thread pinned to its
CPU: the kernel queues a request on its caller's CPU, so the round trip
needs no cross-CPU wake-up (native/bridge_uring.c).  The same callbacks run
there under the same rules (one shard request at a time); /dev/fuse still
carries INIT, FORGET and INTERRUPT.  Otherwise, or when the rings cannot be
set up, the /dev/fuse loop serves alone, as by default, and stderr says why.
The "uring_requests" counter counts the requests that came over the rings.
LOOKUP, GETATTR, READLINK, ACCESS, LSEEK and READDIRPLUS of untouched
base entries never reach the shard either: the shard marks directories that
hold nothing private ("dir" in an ATTR), and C answers their names from the
base directory, numbering each entry as the volume will when it binds it
(BASE_INO_START + st_ino) and counting its kernel references itself; a
request that names such an entry first binds it in the shard, with the
fingerprint the kernel saw (native/bridge_meta.c).
READs of files whose content is wholly their base file's (no private
extents, not truncated) never reach the shard: the shard's ATTRs name such
a file's base path and fingerprint, and C reads it beneath the base
directory, checking the fingerprint as the shard's base reader does
(native/bridge_clean.c); any doubt asks the shard, so BaseDrift stays the
shard's.  The base directory comes from `fs.base` at start-up: this
process anchors that path itself (slates.base.beneath.Anchored: no FUSE,
no symlink swapped in later) and uses it only if its (st_dev, st_ino) is
the one the shard anchored; otherwise, or when it cannot open it (an
agent's bridge runs as the agent), every READ asks the shard as before.
A counter per FUSE opcode (plus round trips, reconnects, failures and
READs served from the base) lives in C; with --counters FILE it is a shared file mapping that
`read_counters` reads from any process.

On unmount the bridge sends fs.destroy, so the shard drops every lookup
reference the kernel held.

Reconnection: when the shard's socket hangs up with a request outstanding
(or before one is sent), C detaches the rings and calls back into Python
(`bridge_reconnect_cb`, a cffi extern "Python+C" function), which says
hello again with the same client id and attaches the new ring pair; C then
resends the same bytes, with the same sequence number, so the shard answers
from its saved result if the request had already run.  A shard restart is
a pause, not an error; after BRIDGE_RECONNECT_SECONDS without a shard the
request fails with EIO.

Start-up cost (issue 14): a bridge is a fresh interpreter, and a mount
waits for it.  Its imports are kept to what it uses
(tests/test_cli_startup.py checks them), and the spin calibration comes
from the runtime directory's cache (slates.node.ring.cached_spin_ns), so
only the first bridge of a boot measures.  A spare bridge
(`--spare`) goes further: it starts, imports, ties its life to the anchor
and reads the calibration before it has a job, then waits for one JSON
line on --job-fd (a MountJob: volume, mountpoint, flags, the agent's
token) and mounts it as a bridge started with those arguments would; EOF
before a job ends it quietly (the anchor let its spare go).  The anchor
keeps one spare started (slates.node.mounts), so a mount pays only
connect, probe, mount and INIT (a spare also allocates C's clean-read
table while it waits: prepare_clean_reads).  A spare's argv names no
volume or mount point (they come in its job), so whoever looks for a
mount's bridge asks the anchor's state file for its pid rather than
matching argv.

Not here yet: invalidating the kernel's caches when the volume changes by
another path (needs a shard -> bridge notification channel).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import dataclasses
import errno
import json
import mmap
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from slates._native import ffi, lib
from slates.base.beneath import Anchored
from slates.errors import (
    AccessDenied,
    InvalidArgument,
    SlatesError,
    VerificationFailed,
)
from slates.node.protocol import (
    FrameReader,
    check_ok,
    frame,
    pack,
    parse_reply,
    shard_of,
    unpack,
)
from slates.node.ring import MAX_SPIN_NS, ask_short_slice, cached_spin_ns
from slates.node.runtime import Runtime

# The bridge serves one kernel request at a time, so while it waits for the
# shard's answer it has nothing else to do: spinning through the shard's usual
# service time (tens to a couple of hundred microseconds, bench/RESULTS.md)
# saves the shard an eventfd write and the bridge a wake-up per request.
REPLY_SPIN_NS = 100_000
THREADS_ENV = "SLATES_BRIDGE_THREADS"  # loop_threads()
URING_ENV = "SLATES_FUSE_URING"  # uring_wanted()
PREFETCH_ENV = "SLATES_BRIDGE_PREFETCH"  # prefetch_wanted()
READAHEAD_ENV = "SLATES_BRIDGE_READAHEAD"  # readahead_wanted()
WALK_ENV = "SLATES_BRIDGE_WALK_ENTRIES"  # walk_entries()
BEHIND_ENV = "SLATES_BRIDGE_BEHIND"  # write_behind_wanted()

__all__ = [
    "COUNTER_SLOTS",
    "HELLO_TIMEOUT",
    "OPCODES",
    "RECONNECT_SECONDS",
    "REPLY_LIMIT",
    "STATS",
    "THREADS_ENV",
    "URING_ENV",
    "PREFETCH_ENV",
    "BEHIND_ENV",
    "prefetch_wanted",
    "write_behind_wanted",
    "readahead_wanted",
    "walk_entries",
    "JOB_LIMIT",
    "Bridge",
    "MountJob",
    "check_mountpoint",
    "kernel_requests",
    "loop_threads",
    "uring_wanted",
    "KERNEL_OPS",
    "hello",
    "main",
    "parse_mount_job",
    "prepare_clean_reads",
    "read_counters",
    "read_mount_job",
    "run_bridge",
]

RECONNECT_SECONDS: int = lib.BRIDGE_RECONNECT_SECONDS
COUNTER_SLOTS: int = lib.BRIDGE_COUNTERS
HELLO_TIMEOUT = 2.0  # per attempt; C retries until RECONNECT_SECONDS
PRUNE_RETRY_SECONDS = 0.2  # the watcher's pace for pruned files still held open
REPLY_LIMIT = 16 << 20  # `Bridge.request` replies (a ring message is smaller anyway)
JOB_LIMIT = 64 << 10  # a spare's job line (paths, flags and a token: far less)
_uncleared = ffi.new_allocator(should_clear_after_alloc=False)

# The kernel's FUSE opcode numbers, for reading the counters.
OPCODES: dict[int, str] = {
    1: "LOOKUP",
    2: "FORGET",
    3: "GETATTR",
    4: "SETATTR",
    5: "READLINK",
    6: "SYMLINK",
    8: "MKNOD",
    9: "MKDIR",
    10: "UNLINK",
    11: "RMDIR",
    12: "RENAME",
    13: "LINK",
    14: "OPEN",
    15: "READ",
    16: "WRITE",
    17: "STATFS",
    18: "RELEASE",
    20: "FSYNC",
    21: "SETXATTR",
    22: "GETXATTR",
    23: "LISTXATTR",
    24: "REMOVEXATTR",
    25: "FLUSH",
    26: "INIT",
    27: "OPENDIR",
    28: "READDIR",
    29: "RELEASEDIR",
    30: "FSYNCDIR",
    31: "GETLK",
    32: "SETLK",
    33: "SETLKW",
    34: "ACCESS",
    35: "CREATE",
    36: "INTERRUPT",
    37: "BMAP",
    38: "DESTROY",
    39: "IOCTL",
    40: "POLL",
    41: "NOTIFY_REPLY",
    42: "BATCH_FORGET",
    43: "FALLOCATE",
    44: "READDIRPLUS",
    45: "RENAME2",
    46: "LSEEK",
    47: "COPY_FILE_RANGE",
    48: "SETUPMAPPING",
    49: "REMOVEMAPPING",
    50: "SYNCFS",
    51: "TMPFILE",
    52: "STATX",
}
STATS: dict[int, str] = {
    lib.BRIDGE_STAT_ROUND_TRIPS: "round_trips",
    lib.BRIDGE_STAT_RECONNECTS: "reconnects",
    lib.BRIDGE_STAT_FAILED: "failed",
    lib.BRIDGE_STAT_CLEAN_READS: "clean_reads",
    lib.BRIDGE_STAT_CLEAN_MISSES: "clean_misses",
    lib.BRIDGE_STAT_META_ANSWERS: "meta_answers",
    lib.BRIDGE_STAT_ATTR_ANSWERS: "attr_answers",
    lib.BRIDGE_STAT_URING_REQUESTS: "uring_requests",
    lib.BRIDGE_STAT_PREFETCHES: "prefetches",
    lib.BRIDGE_STAT_WATCH_INVALS: "watch_invals",
    lib.BRIDGE_STAT_SPIN_HITS: "spin_hits",
    lib.BRIDGE_STAT_SPIN_PARKS: "spin_parks",
    lib.BRIDGE_STAT_READAHEADS: "readaheads",
    lib.BRIDGE_STAT_BEHIND_WRITES: "behind_writes",
    lib.BRIDGE_STAT_BEHIND_REPLIES: "behind_replies",
    lib.BRIDGE_STAT_DIRFD_LOOKUPS: "dirfd_lookups",
    lib.BRIDGE_STAT_MOVED_DIRS: "moved_dirs",
    lib.BRIDGE_STAT_HELD_ENTRIES: "held_entries",
    lib.BRIDGE_STAT_PRUNES: "prunes",
    lib.BRIDGE_STAT_CONTENT_READS: "content_reads",
    lib.BRIDGE_STAT_REPLY_SPIN_HITS: "reply_spin_hits",
    lib.BRIDGE_STAT_REPLY_SPIN_MISSES: "reply_spin_misses",
    lib.BRIDGE_STAT_REPLY_SPIN_SKIPS: "reply_spin_skips",
}


def read_counters(path: str | os.PathLike[str]) -> dict[str, int]:
    """A bridge's counters from its --counters file: opcode names and STATS names.

    Opcodes the kernel never sent are left out; unknown opcodes read as
    "OP<n>".  The values are a racy but monotonic view of a live bridge.
    """
    data = Path(path).read_bytes()
    if len(data) < COUNTER_SLOTS * 8:
        raise InvalidArgument("not a bridge counters file", path=str(path))
    values = array.array("Q", data[: COUNTER_SLOTS * 8])
    out: dict[str, int] = {}
    for opcode in range(lib.BRIDGE_OPCODES):
        if values[opcode]:
            out[OPCODES.get(opcode, f"OP{opcode}")] = values[opcode]
    for slot, name in STATS.items():
        out[name] = values[slot]
    return out


KERNEL_OPS = (
    "LOOKUP",
    "GETATTR",
    "READ",
    "READDIR",
    "READDIRPLUS",
    "OPEN",
    "OPENDIR",
    "FLUSH",
    "RELEASE",
    "RELEASEDIR",
    "GETXATTR",
    "STATX",
    "ACCESS",
)


def kernel_requests(runtime_dir: str | os.PathLike[str]) -> int:
    """Requests the kernel sent every bridge of a runtime directory (their counter files)."""
    return sum(
        read_counters(path).get(op, 0)
        for path in Path(runtime_dir).glob("counters-*")
        for op in KERNEL_OPS
    )


def check_mountpoint(path: str | os.PathLike[str]) -> Path:
    """The mountpoint, resolved; refuses one that is not an empty directory of ours."""
    mountpoint = Path(path).resolve()
    try:
        st = mountpoint.stat()
    except FileNotFoundError:
        raise InvalidArgument("the mountpoint does not exist", path=str(mountpoint)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument("the mountpoint is not a directory", path=str(mountpoint))
    euid = os.geteuid()
    if euid != 0 and st.st_uid != euid:
        raise AccessDenied("the mountpoint belongs to another user", path=str(mountpoint))
    if any(mountpoint.iterdir()):
        raise InvalidArgument("the mountpoint is not empty", path=str(mountpoint))
    return mountpoint


def hello(
    socket_path: str,
    client_id: str,
    timeout: float,
    mount: str | None = None,
    token: str | None = None,
) -> tuple[socket.socket, list[int]]:
    """Say hello (rings requested) on a shard's socket: (socket, the ring pair's 4 fds).

    Blocking; the same exchange as the SDK's _ShardConnection._connect.  The
    caller owns the returned socket and fds.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        greeting = {"client": client_id, "rings": True, "mount": mount}
        if token is not None:
            greeting["token"] = token
        sock.sendall(frame(pack(greeting)))
        reader = FrameReader()
        while (answer := reader.next_frame()) is None:
            data, ancillary, _flags, _addr = sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize)
            )
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) // 4 * 4]))
            if not data:
                raise ConnectionResetError("the shard closed the connection during hello")
            reader.feed(data)
        check_ok(unpack(answer))
        if len(fds) != 4:
            raise VerificationFailed("the shard did not pass a ring pair", fds=len(fds))
        sock.settimeout(None)
        sock.setblocking(True)
        return sock, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise


class Bridge:
    """The Python half of one bridge process (the C half is process-global)."""

    def __init__(
        self,
        runtime: Runtime,
        volume: str,
        client_id: str | None = None,
        token: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.volume = volume
        self.shard = shard_of(volume)
        # Random per process: a recycled pid must not inherit an old bridge's requests.
        self.client_id = client_id or f"bridge-{volume}-{os.getpid()}-{os.urandom(6).hex()}"
        self._counters: mmap.mmap | None = None
        self._counters_buffer: Any = None
        self.mounted = False
        self.stopping = False
        self.watching = threading.Event()
        # An agent's mount acts as that agent: the anchor hands its token over in
        # the environment or a spare's job (never argv); the shard authorizes every request.
        self.token = token or os.environ.get("SLATES_TOKEN") or None

    def configure(self, spin_ns: int | None = None) -> None:
        """Set the reply spin: long enough to cover a typical request in the shard
        (REPLY_SPIN_NS), so the shard's answer rarely needs an eventfd wake-up, or
        `spin_ns` (0 to MAX_SPIN_NS) when given.  The wake-up cost comes from the
        runtime directory's calibration cache (slates.node.ring.cached_spin_ns),
        so only the first bridge of a boot pays for measuring it."""
        if spin_ns is None:
            spin = max(cached_spin_ns(self.runtime.path), REPLY_SPIN_NS)
        elif 0 <= spin_ns <= MAX_SPIN_NS:
            spin = spin_ns
        else:
            raise InvalidArgument(
                "the reply spin is 0 to MAX_SPIN_NS nanoseconds", spin_ns=spin_ns, most=MAX_SPIN_NS
            )
        rc = lib.bridge_configure(self.volume.encode(), spin)
        if rc < 0:
            raise InvalidArgument("bad volume id for the bridge", volume=self.volume)

    def use_threads(self, count: int) -> None:
        """How many threads read /dev/fuse (before `mount`); see loop_threads."""
        if lib.bridge_set_threads(count) < 0:
            raise InvalidArgument(
                "the bridge's loop threads are 1 to BRIDGE_MAX_LOOP_THREADS",
                threads=count,
                most=lib.BRIDGE_MAX_LOOP_THREADS,
            )

    def use_counter_file(self, path: str | os.PathLike[str]) -> None:
        """Keep the C counters in `path` (created or reset), readable by read_counters."""
        size = lib.BRIDGE_COUNTER_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._counters = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._counters_buffer = ffi.from_buffer(self._counters)
        if lib.bridge_set_counter_memory(self._counters_buffer, size) < 0:
            raise InvalidArgument("cannot place the counters", path=str(path))

    def _socket_path(self) -> str:
        state = self.runtime.read_state()
        for info in state.shards:
            if info.index == self.shard:
                return info.socket
        raise InvalidArgument("the volume names a shard this host does not have", shard=self.shard)

    def connect(self, timeout: float = HELLO_TIMEOUT) -> None:
        """One hello; hands the ring pair and the socket to C."""
        sock, fds = hello(self._socket_path(), self.client_id, timeout, self.volume, self.token)
        sock_fd = sock.detach()
        rc = lib.bridge_attach(fds[0], fds[1], fds[2], fds[3], sock_fd)  # C owns them now
        if rc < 0:
            raise VerificationFailed("cannot attach the shard's ring pair", reason=os.strerror(-rc))

    def connect_with_retry(self, seconds: float = RECONNECT_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        delay = 0.01
        while True:
            try:
                self.connect()
                return
            except (OSError, SlatesError) as exc:
                if isinstance(exc, SlatesError) and not isinstance(exc, VerificationFailed):
                    raise
                if time.monotonic() > deadline:
                    raise SlatesError(
                        "the shard did not answer; is `slates anchor` running?",
                        volume=self.volume,
                        reason=str(exc),
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def watch(self) -> threading.Thread:
        """Start the watcher: the shard's invalidations for this volume, applied to the kernel.

        A second connection to the shard (no rings) that only listens: when
        another client (the SDK, a rebase) changes the volume, the shard sends
        the inodes and names the kernel must forget, and waits for this
        acknowledgement before it answers that client, so a program in the
        mount sees the change as soon as its author does.
        """
        thread = threading.Thread(target=self._watch_forever, name="slates-watch", daemon=True)
        thread.start()
        if not self.watching.wait(RECONNECT_SECONDS):
            raise SlatesError("the shard did not accept the watch connection", volume=self.volume)
        return thread

    def _watch_forever(self) -> None:
        delay = 0.01
        while not self.stopping:
            try:
                self._watch_once()
                delay = 0.01
            except (OSError, SlatesError) as exc:
                if self.stopping:
                    return
                print(f"slates-bridge: watcher reconnecting ({exc})", file=sys.stderr)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _watch_once(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self._socket_path())
            greeting = {"client": self.client_id, "watch": self.volume}
            if self.token is not None:
                greeting["token"] = self.token
            sock.sendall(frame(pack(greeting)))
            reader = FrameReader()
            first = True
            while not self.stopping:
                while (payload := reader.next_frame()) is None:
                    # A writeback mount's pruned files still held open are asked for
                    # again while they wait (native/bridge_prune.c).
                    sock.settimeout(PRUNE_RETRY_SECONDS if lib.bridge_prune_pending() else None)
                    try:
                        data = sock.recv(1 << 16)
                    except TimeoutError:
                        lib.bridge_prune_retry()
                        continue
                    if not data:
                        raise ConnectionResetError("the shard closed the watch connection")
                    reader.feed(data)
                message = unpack(payload)
                if first:
                    first = False
                    check_ok(message)
                    self.watching.set()
                    continue
                self._invalidate(message.get("inval"))
                sock.settimeout(None)
                sock.sendall(frame(pack({"ack": message.get("id")})))

    @staticmethod
    def _invalidate(notes: Any) -> None:
        if not isinstance(notes, list):
            raise VerificationFailed("malformed invalidation")
        for note in notes:
            match note:
                case ["inode", int(ino)]:
                    rc = lib.bridge_notify_inval_inode(ino)
                case ["file", int(ino)]:
                    rc = lib.bridge_notify_inval_file(ino)
                case ["entry", int(parent), str(name)]:
                    raw = os.fsencode(name)
                    rc = lib.bridge_notify_inval_entry(parent, raw, len(raw))
                case _:
                    raise VerificationFailed("malformed invalidation", note=repr(note)[:80])
            if rc < 0:
                print(
                    f"slates-bridge: invalidation {note} failed: {os.strerror(-rc)}",
                    file=sys.stderr,
                )

    def use_base(self) -> bool:
        """Hand C the volume's base directory for clean reads; False when there is none
        to use (no base, a shard without `fs.base`, not ours to open, not the same one).

        Call before `mount`.  The path comes from the shard, but only the directory
        the shard itself anchored is accepted: same (st_dev, st_ino).
        """
        try:
            info = self.request("fs.base")
        except SlatesError:
            return False  # an older shard, or an agent not allowed to ask
        if not isinstance(info, dict) or not info:
            return False
        root, dev, ino = info.get("root"), info.get("dev"), info.get("ino")
        if not isinstance(root, bytes) or not isinstance(dev, int) or not isinstance(ino, int):
            raise VerificationFailed("malformed fs.base reply")
        try:
            anchor = Anchored(os.fsdecode(root), what="base")
        except (OSError, SlatesError):
            return False
        try:
            if anchor.identity != (dev, ino):
                return False
            fd = os.dup(anchor.fd)
        finally:
            anchor.close()
        rc = lib.bridge_set_base(fd)  # C owns fd now, whatever it answers
        if rc < 0:
            raise SlatesError("cannot use the base directory", reason=os.strerror(-rc))
        return True

    def request(self, op: str, **args: Any) -> Any:
        """One request through the C path (the probe, and tests); raises the reply's error."""
        payload = pack({"volume": self.volume, **args})
        out = _uncleared("uint8_t[]", REPLY_LIMIT)
        n = lib.bridge_request(op.encode(), payload, len(payload), out, len(out))
        if n < 0:
            raise SlatesError("the shard did not answer", op=op, reason=os.strerror(-n))
        reply = parse_reply(unpack(bytes(ffi.buffer(out, n))))
        if reply.error is not None:
            raise reply.error
        return reply.result

    def mount(
        self,
        mountpoint: str | os.PathLike[str],
        *,
        allow_other: bool = False,
        auto_unmount: bool = False,
        writeback: bool = True,
    ) -> None:
        rc = lib.bridge_mount(
            str(mountpoint).encode(), int(allow_other), int(auto_unmount), int(writeback)
        )
        if rc < 0:
            raise SlatesError("cannot mount", mountpoint=str(mountpoint), reason=os.strerror(-rc))
        self.mounted = True

    def serve(self, ready_fd: int = -1) -> None:
        rc = lib.bridge_run(ready_fd)
        if rc < 0:
            raise SlatesError("the FUSE session failed", reason=os.strerror(-rc))

    def close(self) -> None:
        lib.bridge_unmount()
        self.mounted = False

    def __enter__(self) -> Bridge:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_ACTIVE: Bridge | None = None


def bridge_reconnect_cb() -> int:
    """Called from C (extern "Python+C") when the shard hung up: one hello."""
    bridge = _ACTIVE
    if bridge is None:
        return -errno.ENOTCONN
    try:
        bridge.connect()
    except (OSError, SlatesError) as exc:
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ECONNREFUSED
        return -code
    return 0


def _reconnect_crashed(
    exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
) -> int:
    print(f"slates-bridge: reconnect failed: {exc!r}", file=sys.stderr, flush=True)
    return -errno.EIO


if __name__ != "__main__":
    # Only the canonical module registers: under `python -m`, this file also
    # runs as __main__, whose _ACTIVE would be a different variable.
    ffi.def_extern(name="bridge_reconnect_cb", onerror=_reconnect_crashed)(bridge_reconnect_cb)


def run_bridge(
    runtime_dir: str | os.PathLike[str] | None,
    volume: str,
    mountpoint: str | os.PathLike[str],
    *,
    ready_fd: int = -1,
    allow_other: bool = False,
    auto_unmount: bool = False,
    writeback: bool = True,
    counters: str | os.PathLike[str] | None = None,
    uncached: bool = False,
    spin_ns: int | None = None,
    token: str | None = None,
) -> None:
    """Connect, probe, mount, serve until told to stop, unmount.

    uncached=True sets the kernel's entry and attribute timeouts to 0, so
    every lookup and stat reaches the shard (for measuring per-request
    latency, bench/scaling_bench.py); the default keeps them for a day.
    spin_ns, when given, replaces the calibrated reply spin (Bridge.configure);
    token, when given, is the agent's (else $SLATES_TOKEN).
    """
    global _ACTIVE
    where = check_mountpoint(mountpoint)
    # Here, not at start: a spare's priority is raised (slates.node.mounts.resume)
    # before its job, and that resets the slice.  Before the loop's threads: they
    # inherit it.
    refused = ask_short_slice()
    if refused is not None:
        print(f"slates-bridge: no short scheduler slice ({refused})", file=sys.stderr)
    bridge = Bridge(Runtime(runtime_dir), volume, token=token)
    bridge.configure(spin_ns)
    bridge.use_threads(loop_threads())
    if uring_wanted() and lib.bridge_set_uring(1) < 0:
        raise InvalidArgument("cannot ask for FUSE-over-io_uring after mounting")
    if lib.bridge_set_prefetch(int(prefetch_wanted())) < 0:
        raise InvalidArgument("cannot change directory prefetch after mounting")
    if lib.bridge_set_readahead(int(readahead_wanted())) < 0:
        raise InvalidArgument("cannot change read-ahead after mounting")
    if lib.bridge_set_walk_entries(walk_entries()) < 0:
        raise InvalidArgument("cannot change the prefetch walk's budget after mounting")
    if lib.bridge_set_write_behind(int(write_behind_wanted())) < 0:
        raise InvalidArgument("cannot change write-behind after mounting")
    if uncached and lib.bridge_set_cache_timeout(0.0) < 0:
        raise InvalidArgument("cannot turn the kernel's entry and attribute caches off")
    if counters is not None:
        bridge.use_counter_file(counters)
    _ACTIVE = bridge
    try:
        bridge.connect_with_retry()
        root = bridge.request("fs.getattr", ino=1)
        if not isinstance(root, dict) or not stat.S_ISDIR(int(root.get("mode", 0))):
            raise VerificationFailed("the volume's root is not a directory", volume=volume)
        bridge.use_base()
        with bridge:
            bridge.mount(
                where, allow_other=allow_other, auto_unmount=auto_unmount, writeback=writeback
            )
            fd, ready_fd = ready_fd, -1  # bridge_run always closes it
            bridge.watch()
            try:
                bridge.serve(fd)
            finally:
                bridge.stopping = True
    finally:
        _ACTIVE = None
        if ready_fd >= 0:
            os.close(ready_fd)  # EOF without b"1": the caller learns the mount failed


def loop_threads() -> int:
    """The /dev/fuse reader threads: $SLATES_BRIDGE_THREADS, else BRIDGE_LOOP_THREADS.

    Requests answered in C (clean base metadata and reads) then run side by
    side; requests that go to the shard still go one at a time.  The default
    is one: on the 2-vCPU host measured (first touch of git/git), a second
    reader bought no time for git status and cost the bridge CPU for grep -r
    (cross-CPU wake-ups); more cores may want more.
    """
    raw = os.environ.get(THREADS_ENV, "")
    if not raw:
        return int(lib.BRIDGE_LOOP_THREADS)
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"{THREADS_ENV} is a thread count", value=raw) from None


def uring_wanted() -> bool:
    """Whether $SLATES_FUSE_URING asks for FUSE-over-io_uring ("1"; unset, "" or "0": no).

    Asking is not enough: C uses it only as root with the kernel's enable_uring
    set, and logs why not otherwise (native/bridge_uring.c).  It is not taken
    unasked even where the host offers it: a bridge SIGKILLed over the rings once
    left a request of its prefetch reader waiting on the detached connection until
    the connection was aborted by hand (bench/RESULTS.md), which /dev/fuse never does.
    """
    return _env_switch(URING_ENV, default=False)


def prefetch_wanted() -> bool:
    """Whether clean directories are listed ahead of their callers
    (native/bridge_prefetch.c): $SLATES_BRIDGE_PREFETCH "0" turns it off."""
    return _env_switch(PREFETCH_ENV, default=True)


def write_behind_wanted() -> bool:
    """Whether a write-through mount answers writes the shard granted before the
    shard's reply (native/bridge_behind.c): $SLATES_BRIDGE_BEHIND "0" turns it off."""
    return _env_switch(BEHIND_ENV, default=True)


def readahead_wanted() -> bool:
    """Whether the prefetch walk also reads the small regular files of the
    directories it listed (native/bridge_prefetch.c): $SLATES_BRIDGE_READAHEAD
    "0" turns it off."""
    return _env_switch(READAHEAD_ENV, default=True)


def walk_entries() -> int:
    """How many entries the prefetch walk lists at most (native/bridge_prefetch.c):
    $SLATES_BRIDGE_WALK_ENTRIES, else BRIDGE_WALK_ENTRIES; at most
    BRIDGE_WALK_ENTRIES_MAX."""
    raw = os.environ.get(WALK_ENV, "")
    if not raw:
        return int(lib.BRIDGE_WALK_ENTRIES)
    try:
        entries = int(raw)
    except ValueError:
        entries = -1
    if not 0 <= entries <= int(lib.BRIDGE_WALK_ENTRIES_MAX):
        raise InvalidArgument(
            f"{WALK_ENV} is an entry count up to {int(lib.BRIDGE_WALK_ENTRIES_MAX)}", value=raw
        )
    return entries


def _env_switch(name: str, *, default: bool) -> bool:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise InvalidArgument(f"{name} is 1 or 0", value=raw)


@dataclasses.dataclass(frozen=True, slots=True)
class MountJob:
    """What a spare bridge is asked to serve: run_bridge's arguments, as one JSON object."""

    volume: str
    mountpoint: str
    counters: str | None = None
    allow_other: bool = False
    auto_unmount: bool = False
    writeback: bool = True
    uncached: bool = False
    spin_ns: int | None = None
    token: str | None = None


_JOB_TYPES: dict[str, tuple[type, ...]] = {
    "volume": (str,),
    "mountpoint": (str,),
    "counters": (str, type(None)),
    "allow_other": (bool,),
    "auto_unmount": (bool,),
    "writeback": (bool,),
    "uncached": (bool,),
    "spin_ns": (int, type(None)),
    "token": (str, type(None)),
}


def parse_mount_job(line: bytes) -> MountJob:
    """A spare's job from its JSON line; InvalidArgument for anything else (unknown or
    missing fields, wrong types: bool is not an int here)."""
    try:
        fields = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument("a mount job is one JSON object") from None
    if not isinstance(fields, dict):
        raise InvalidArgument("a mount job is one JSON object")
    unknown = sorted(set(fields) - set(_JOB_TYPES))
    if unknown:
        raise InvalidArgument("unknown mount job fields", fields=unknown)
    for name in ("volume", "mountpoint"):
        if name not in fields:
            raise InvalidArgument("a mount job names its volume and mountpoint", missing=name)
    for name, value in fields.items():
        kinds = _JOB_TYPES[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise InvalidArgument("a mount job field has the wrong type", field=name)
    return MountJob(**fields)


def read_mount_job(fd: int) -> MountJob | None:
    """Wait for one job line on `fd` (at most JOB_LIMIT bytes); None on EOF before any."""
    line = bytearray()
    while b"\n" not in line:
        chunk = os.read(fd, JOB_LIMIT + 1 - len(line))
        if not chunk:
            if not line:
                return None
            raise InvalidArgument("the mount job ended before its newline")
        line += chunk
        if len(line) > JOB_LIMIT and b"\n" not in line:
            raise InvalidArgument("the mount job is too long", most=JOB_LIMIT)
    job, _, rest = bytes(line).partition(b"\n")
    if rest:
        raise InvalidArgument("a spare takes one mount job")
    return parse_mount_job(job)


def prepare_clean_reads() -> None:
    """Allocate C's clean-read table now, with no base set (a spare, before its job).

    bridge_set_base allocates and touches the table (CLEAN_SLOTS entries, 3 MiB)
    on first use, which costs a mount 2-8 ms on the host measured; a spare pays
    it while it waits.  The base directory it is given for that ("/") is unset
    at once, so until use_base sets the volume's, no READ is served from a base.
    """
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    if lib.bridge_set_base(fd) == 0:  # C owns fd now, whatever it answers
        lib.bridge_set_base(-1)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _end_with_the_anchor() -> None:
    """When the anchor dies (its RAM, and so the volume, with it), this bridge gets
    SIGHUP and unmounts (lazily if the mount is busy) rather than answer EIO forever."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGHUP, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        print("slates-bridge: cannot tie this bridge's life to the anchor's", file=sys.stderr)
    if os.getppid() != parent:  # it died before the tie was made
        raise SystemExit("slates-bridge: the anchor is already gone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slates-bridge", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-dir", default=None)
    parser.add_argument("--volume", default=None, help="required unless --spare")
    parser.add_argument("--mountpoint", default=None, help="required unless --spare")
    parser.add_argument(
        "--spare",
        action="store_true",
        help="start now, then mount the job (one JSON line, MountJob) read from --job-fd",
    )
    parser.add_argument("--job-fd", type=int, default=0, help="where a spare reads its job")
    parser.add_argument("--ready-fd", type=int, default=-1)
    parser.add_argument("--allow-other", action="store_true")
    parser.add_argument("--auto-unmount", action="store_true")
    parser.add_argument(
        "--no-writeback-cache",
        action="store_true",
        help="write through to the shard on every write(2) (no dirty pages in the kernel)",
    )
    parser.add_argument("--counters", default=None, help="file to keep the request counters in")
    parser.add_argument(
        "--uncached",
        action="store_true",
        help="entry and attribute timeouts 0: every lookup and stat asks the shard (benchmarks)",
    )
    parser.add_argument(
        "--spin-ns",
        type=int,
        default=None,
        help="reply spin in nanoseconds (default: the calibrated wake-up cost, at least 100 us)",
    )
    args = parser.parse_args(argv)
    if args.spare == (args.volume is not None or args.mountpoint is not None):
        parser.error("give --volume and --mountpoint, or --spare (its job names them)")
    if not args.spare and (args.volume is None or args.mountpoint is None):
        parser.error("give both --volume and --mountpoint")
    # Before the C loop owns the signals, a SIGTERM must still unwind (and unmount).
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    _end_with_the_anchor()
    try:
        if args.spare:
            # The first spare of a boot calibrates here, before any mount waits for it.
            cached_spin_ns(Runtime(args.runtime_dir).path)
            prepare_clean_reads()
            lib.bridge_reserve_fds()  # while it has one thread (native/bridge_dirfd.c)
            job = read_mount_job(args.job_fd)
            if job is None:
                return 0  # the anchor let its spare go
        else:
            job = MountJob(
                args.volume,
                args.mountpoint,
                counters=args.counters,
                allow_other=args.allow_other,
                auto_unmount=args.auto_unmount,
                writeback=not args.no_writeback_cache,
                uncached=args.uncached,
                spin_ns=args.spin_ns,
            )
        run_bridge(
            args.runtime_dir,
            job.volume,
            job.mountpoint,
            ready_fd=args.ready_fd,
            allow_other=job.allow_other,
            auto_unmount=job.auto_unmount,
            writeback=job.writeback,
            counters=job.counters,
            uncached=job.uncached,
            spin_ns=job.spin_ns,
            token=job.token,
        )
    except SlatesError as exc:
        details = " ".join(f"{k}={v}" for k, v in exc.details.items())
        print(f"slates-bridge: {exc.code}: {exc.message} {details}".rstrip(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    from slates.fuse import bridge as _canonical  # the module whose callback C calls

    try:
        with contextlib.suppress(BrokenPipeError):
            sys.exit(_canonical.main())
    finally:
        # Leaving (a spare the anchor let go, say, as the anchor stops it): a SIGTERM now
        # has nothing left to unwind, and _terminate raising it inside the interpreter's
        # shutdown would only print "Exception ignored" into the bridge's log.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
