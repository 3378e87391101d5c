"""cffi (out-of-line API mode) build of slates._native: the rings and the mount bridge.

One extension holds both the shared-memory rings (ring.c) and the FUSE
mount bridge (bridge_*.c, libfuse3 low-level API + msgpack-c), so the bridge
and the Python ring code share one copy of the ring implementation.  Build
needs the libfuse3 and msgpack-c headers (Debian: libfuse3-dev,
libmsgpack-dev) liburing (liburing-dev, for FUSE-over-io_uring) and pkg-config.

setup.py finds `ffibuilder` through cffi_modules; running this file directly
builds the extension in place (slates/_native*.so) for a source checkout:

    python native/build_native.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent


def _relative(path: Path) -> str:
    # setuptools rejects absolute source paths, and setup.py runs from the
    # repository root; the script below builds from the root too.
    return os.path.relpath(path, _ROOT)


def _pkg_config(package: str, flag: str) -> list[str]:
    try:
        out = subprocess.run(
            ["pkg-config", flag, package], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


def _include_dirs(package: str, fallback: str | None = None) -> list[str]:
    dirs = [f[2:] for f in _pkg_config(package, "--cflags") if f.startswith("-I")]
    if not dirs and fallback is not None and os.path.isdir(fallback):
        dirs = [fallback]
    return dirs


def _libraries(package: str, fallback: str) -> list[str]:
    names = [f[2:] for f in _pkg_config(package, "--libs-only-l") if f.startswith("-l")]
    return names or [fallback]


# The mount bridge is split along its seams (native/bridge_internal.h says
# what each file owns); ring.c is shared with the Python ring code.
SOURCES = (
    "ring.c",
    "bridge_wire.c",
    "bridge_link.c",
    "bridge_behind.c",
    "bridge_spin.c",
    "bridge_cache.c",
    "bridge_attr.c",
    "bridge_clean.c",
    "bridge_content.c",
    "bridge_map.c",
    "bridge_prune.c",
    "bridge_meta.c",
    "bridge_meta_dir.c",
    "bridge_dirfd.c",
    "bridge_prefetch.c",
    "bridge_watch.c",
    "bridge_ops.c",
    "bridge_session.c",
    "bridge_loop.c",
    "bridge_uring.c",
    "sched_slice.c",
)
HEADERS = ("ring.h", "bridge.h", "bridge_internal.h")

ffibuilder = FFI()

ffibuilder.cdef(
    """
    #define RING_HEADER_SIZE ...
    #define RING_MIN_CAPACITY ...
    #define RING_MAX_CAPACITY ...

    typedef struct { uint64_t capacity; ...; } ring_t;

    uint64_t ring_region_size(uint64_t capacity);
    uint32_t ring_max_message(const ring_t *r);
    int ring_init(void *mem, uint64_t mem_len, uint64_t capacity);
    int ring_attach(ring_t *r, void *mem, uint64_t mem_len);
    int ring_push(ring_t *r, const uint8_t *msg, uint32_t len);
    int ring_push2(ring_t *r, const uint8_t *first, uint32_t alen, const uint8_t *body,
                   uint32_t blen);
    int ring_pop(ring_t *r, uint8_t *out, uint32_t cap);
    int ring_peek_length(ring_t *r);
    int ring_peek(ring_t *r, const uint8_t **payload);
    int ring_consume(ring_t *r);
    uint64_t ring_produced(const ring_t *r);
    uint64_t ring_consumed(const ring_t *r);
    int ring_spin_wait(ring_t *r, uint64_t spin_ns);
    int ring_prepare_park(ring_t *r);
    int ring_prepare_park_until(ring_t *r, uint32_t messages);
    void ring_unpark(ring_t *r);
    int ring_is_parked(const ring_t *r);
    int ring_notify(ring_t *r, int eventfd);
    int64_t ring_drain_eventfd(int eventfd);

    #define BRIDGE_OPCODES ...
    #define BRIDGE_WALK_ENTRIES ...
    #define BRIDGE_WALK_ENTRIES_MAX ...
    #define BRIDGE_COUNTERS ...
    #define BRIDGE_COUNTER_BYTES ...
    #define BRIDGE_STAT_ROUND_TRIPS ...
    #define BRIDGE_STAT_RECONNECTS ...
    #define BRIDGE_STAT_FAILED ...
    #define BRIDGE_STAT_CLEAN_READS ...
    #define BRIDGE_STAT_CLEAN_MISSES ...
    #define BRIDGE_STAT_META_ANSWERS ...
    #define BRIDGE_STAT_ATTR_ANSWERS ...
    #define BRIDGE_STAT_URING_REQUESTS ...
    #define BRIDGE_STAT_PREFETCHES ...
    #define BRIDGE_STAT_WATCH_INVALS ...
    #define BRIDGE_STAT_SPIN_HITS ...
    #define BRIDGE_STAT_SPIN_PARKS ...
    #define BRIDGE_STAT_READAHEADS ...
    #define BRIDGE_STAT_BEHIND_WRITES ...
    #define BRIDGE_STAT_BEHIND_REPLIES ...
    #define BRIDGE_STAT_DIRFD_LOOKUPS ...
    #define BRIDGE_STAT_MOVED_DIRS ...
    #define BRIDGE_STAT_HELD_ENTRIES ...
    #define BRIDGE_STAT_PRUNES ...
    #define BRIDGE_STAT_CONTENT_READS ...
    #define BRIDGE_STAT_REPLY_SPIN_HITS ...
    #define BRIDGE_STAT_REPLY_SPIN_MISSES ...
    #define BRIDGE_STAT_REPLY_SPIN_SKIPS ...
    #define BRIDGE_RECONNECT_SECONDS ...
    #define BRIDGE_MAX_IO ...
    #define BRIDGE_LOOP_THREADS ...
    #define BRIDGE_MAX_LOOP_THREADS ...

    int bridge_configure(const char *volume, uint64_t spin_ns);
    int bridge_attach(int req_memfd, int req_eventfd, int rep_memfd, int rep_eventfd,
                      int sock_fd);
    void bridge_detach(void);
    int bridge_request(const char *op, const uint8_t *args, uint32_t args_len, uint8_t *out,
                       uint32_t cap);
    int bridge_set_cache_timeout(double seconds);
    int bridge_set_base(int dir_fd);
    int bridge_set_threads(unsigned n);
    int bridge_set_prefetch(int on);
    int bridge_set_write_behind(int on);
    int bridge_set_readahead(int on);
    int bridge_set_walk_entries(long entries);
    void bridge_reserve_fds(void);
    int bridge_set_uring(int on);
    int bridge_uring_active(void);
    int bridge_mount(const char *mountpoint, int allow_other, int auto_unmount, int writeback);
    int bridge_run(int ready_fd);
    void bridge_exit(void);
    void bridge_unmount(void);
    int bridge_notify_inval_inode(uint64_t ino);
    int bridge_notify_inval_entry(uint64_t parent, const char *name, size_t namelen);
    int bridge_notify_inval_file(uint64_t ino);
    long bridge_prune_retry(void);
    long bridge_prune_pending(void);
    uint64_t bridge_request_count(int opcode);
    uint64_t bridge_stat(int slot);
    int bridge_set_counter_memory(void *mem, uint64_t len);
    void bridge_reset_counters(void);
    int bridge_errno_for(const char *code);
    int servers_short_slice(uint64_t ns);
    uint64_t servers_slice(void);
    int bridge_test_encode(int which, uint8_t *out, uint32_t cap, char *op_out,
                           uint32_t op_cap);
    int bridge_test_decode_attr(const uint8_t *msg, uint32_t len, int64_t *out);
    int bridge_test_absent_set(const uint64_t *ops, uint32_t n, uint64_t probe);
    int bridge_test_absent_since(uint64_t ino, int invalidate_between);
    int bridge_test_clean_since(uint64_t ino, int invalidate_between);
    int bridge_test_attr_cache(uint64_t ino, int event);
    int bridge_test_meta_map(const uint64_t *ops, uint32_t n, uint64_t probe);
    uint64_t bridge_test_cookie(const char *name, size_t len);
    int bridge_test_spin(uint64_t budget_ns, int any_rate, const uint64_t *waits,
                         const int *flags, uint32_t n, int *wanted);

    extern "Python+C" int bridge_reconnect_cb(void);
    """
)

ffibuilder.set_source(
    "slates._native",
    '#include "ring.h"\n#include "bridge.h"',
    sources=[_relative(_HERE / name) for name in SOURCES],
    include_dirs=[
        _relative(_HERE),
        *_include_dirs("fuse3", "/usr/include/fuse3"),
        *_include_dirs("msgpack"),  # Debian's headers are in /usr/include
    ],
    # msgpack-c names its C library msgpackc up to 4.x (Debian 12), msgpack-c from 6.x.
    libraries=[
        *_libraries("fuse3", "fuse3"),
        *_libraries("msgpack", "msgpackc"),
        *_libraries("liburing", "uring"),  # Debian: liburing-dev
    ],
    depends=[_relative(_HERE / name) for name in HEADERS],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
)


if __name__ == "__main__":
    # With the root as tmpdir, cffi writes slates/_native.c and the .so next
    # to the package (both git-ignored).  The .so gets the name an install
    # gives it (cffi builds for the stable ABI), so a stale copy from one
    # way of building can never shadow the other's.
    print(ffibuilder.compile(tmpdir=str(_ROOT), target="_native.abi3.so", verbose=True))
