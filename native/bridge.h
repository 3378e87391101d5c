/*
 * The mount bridge's per-request path: a libfuse3 low-level session whose
 * callbacks forward each kernel request to the shard that owns the volume,
 * over a shared-memory ring pair (ring.h), as one msgpack request of the
 * form in slates/fuse/PROTOCOL.md, and turn the reply into a fuse_reply_*.
 *
 * One bridge per process: the state is process-global.  Several loop
 * threads answer kernel requests (bridge_set_threads), but one request to
 * the shard is in flight at a time (one thread holds the link), so the
 * acknowledgement is always "every sequence number below this one".
 *
 * Life cycle, driven from Python (slates/fuse/bridge.py):
 *   bridge_configure -> bridge_attach (after the hello) -> bridge_mount ->
 *   bridge_run (returns on SIGTERM/SIGINT/SIGHUP or an external unmount) ->
 *   bridge_unmount.
 * When the shard's socket hangs up, C detaches the rings and calls the
 * Python callback bridge_reconnect_cb(), which says hello again with the
 * same client id and calls bridge_attach with the new fds; C then resends
 * the same request bytes (same seq).  Bounded by BRIDGE_RECONNECT_SECONDS.
 *
 * Functions return 0 or a non-negative count on success and -errno on
 * failure unless stated otherwise.
 */
#ifndef SLATES_BRIDGE_H
#define SLATES_BRIDGE_H

#include <stddef.h>
#include <stdint.h>

#define BRIDGE_RECONNECT_SECONDS 60
#define BRIDGE_TIMEOUT_SECONDS 86400.0 /* entry and attribute cache lifetime */
#define BRIDGE_MAX_IO (1u << 20)       /* max_write / max_read */
#define BRIDGE_LOOP_THREADS 1          /* /dev/fuse readers (bridge_set_threads) */
#define BRIDGE_MAX_LOOP_THREADS 8
#define BRIDGE_WALK_ENTRIES 131072      /* the prefetch walk's budget (bridge_set_walk_entries) */
#define BRIDGE_WALK_ENTRIES_MAX (1l << 22)

/* Counter slots: 0..BRIDGE_OPCODES-1 count kernel requests by FUSE opcode;
 * the slots after them count bridge-wide events. */
#define BRIDGE_OPCODES 64
#define BRIDGE_STAT_ROUND_TRIPS 64 /* requests answered by the shard */
#define BRIDGE_STAT_RECONNECTS 65  /* successful re-attachments after a hangup */
#define BRIDGE_STAT_FAILED 66      /* requests given up with EIO (shard unreachable) */
#define BRIDGE_STAT_CLEAN_READS 67 /* READs served from the base, without the shard */
#define BRIDGE_STAT_CLEAN_MISSES 68 /* clean-file entries that failed their check */
#define BRIDGE_STAT_META_ANSWERS 69 /* LOOKUP/GETATTR/READLINK/ACCESS answered from the base */
#define BRIDGE_STAT_ATTR_ANSWERS 70 /* GETATTRs answered from a mutation's reply */
#define BRIDGE_STAT_URING_REQUESTS 71 /* kernel requests that came over io_uring */
#define BRIDGE_STAT_PREFETCHES 72 /* clean directories listed ahead (bridge_prefetch.c) */
#define BRIDGE_STAT_WATCH_INVALS 73 /* kept listings a base change dropped (bridge_watch.c) */
#define BRIDGE_STAT_SPIN_HITS 74 /* request waits a spin ended (bridge_spin.c) */
#define BRIDGE_STAT_SPIN_PARKS 75 /* request waits that parked (bridge_spin.c) */
#define BRIDGE_STAT_READAHEADS 76 /* clean files read ahead (bridge_prefetch.c) */
#define BRIDGE_STAT_BEHIND_WRITES 77 /* writes answered before the shard (bridge_behind.c) */
#define BRIDGE_STAT_BEHIND_REPLIES 78 /* the shard's later replies to them */
#define BRIDGE_STAT_DIRFD_LOOKUPS 79 /* LOOKUPs stat'ed from a kept base directory fd */
#define BRIDGE_STAT_MOVED_DIRS 80 /* base directories found moved (bridge_meta.c) */
#define BRIDGE_STAT_HELD_ENTRIES 81 /* listed without attributes: the kernel holds them */
#define BRIDGE_STAT_PRUNES 82 /* inodes a writeback mount asked the kernel to drop (bridge_prune.c) */
#define BRIDGE_STAT_CONTENT_READS 83 /* READs of files made here, from the bridge's copy */
#define BRIDGE_STAT_REPLY_SPIN_HITS 84 /* reply waits a spin ended (bridge_spin.c) */
#define BRIDGE_STAT_REPLY_SPIN_MISSES 85 /* reply waits that spun, then parked */
#define BRIDGE_STAT_REPLY_SPIN_SKIPS 86 /* reply waits that parked at once (crowded) */
#define BRIDGE_COUNTERS 87
#define BRIDGE_COUNTER_BYTES (BRIDGE_COUNTERS * 8)

/* Grow the fd table now to hold the base directory fds LOOKUPs keep
 * (bridge_dirfd.c), while the process has one thread: growing it later, with
 * threads, waits for an RCU grace period.  Once; bridge_configure calls it
 * too. */
void bridge_reserve_fds(void);

/* Volume id and the ring spin budget (ns).  Call once, first. */
int bridge_configure(const char *volume, uint64_t spin_ns);

/* Take ownership of a ring pair's fds (request memfd, request eventfd, reply
 * memfd, reply eventfd) and the shard's socket: validate the memfd seals
 * and headers, map both rings.  On failure every fd given is closed. */
int bridge_attach(int req_memfd, int req_eventfd, int rep_memfd, int rep_eventfd, int sock_fd);

/* Unmap the rings and close their fds and the socket (idempotent). */
void bridge_detach(void);

/* One request with caller-encoded args (a msgpack map that includes
 * "volume"), through the same send/wait/reconnect path the callbacks use.
 * Copies the whole reply message into `out`; returns its length. */
int bridge_request(const char *op, const uint8_t *args, uint32_t args_len, uint8_t *out,
                   uint32_t cap);

/* Entry and attribute cache lifetime in seconds, 0 to BRIDGE_TIMEOUT_SECONDS
 * (the default); 0 makes the kernel ask for every lookup and stat (the
 * benchmarks' uncached latency).  Call before bridge_mount. */
int bridge_set_cache_timeout(double seconds);

/* The base directory's fd (taken over; -1: none) for serving READs of
 * files whose content is wholly their base file's (bridge_clean.c).  Call
 * before bridge_mount; -EBUSY after, -ENOTDIR for a non-directory. */
int bridge_set_base(int dir_fd);

/* How many threads read /dev/fuse and answer requests, 1 to
 * BRIDGE_MAX_LOOP_THREADS (default BRIDGE_LOOP_THREADS); requests that go to
 * the shard still go one at a time.  Call before bridge_mount. */
int bridge_set_threads(unsigned n);
/* List a clean directory through the mount when the kernel first looks a
 * name up in it (default on; before bridge_mount): 0 or -EBUSY. */
int bridge_set_prefetch(int on);
/* Write-behind under the shard's grants (bridge_behind.c); before mounting. */
int bridge_set_write_behind(int on);
/* With prefetch, also read the walked directories' small regular files
 * through the mount once their listings are done (default on; before
 * bridge_mount): 0 or -EBUSY. */
int bridge_set_readahead(int on);
/* With prefetch, how many entries the walk lists at most (default
 * BRIDGE_WALK_ENTRIES; before bridge_mount): 0, -EINVAL past
 * BRIDGE_WALK_ENTRIES_MAX, or -EBUSY. */
int bridge_set_walk_entries(long entries);

/* Serve the kernel over FUSE-over-io_uring (bridge_uring.c) when `on` and
 * the process is root and /sys/module/fuse/parameters/enable_uring is Y
 * (else, or with auto_unmount, the /dev/fuse loop alone, as by default; the
 * reason is logged).  Call before bridge_mount; -EBUSY after. */
int bridge_set_uring(int on);
/* 1 while every io_uring queue's thread has submitted its entries
 * registration and not ended (a refused registration ends it), else 0. */
int bridge_uring_active(void);

/* Create the session and mount it on `mountpoint`. */
int bridge_mount(const char *mountpoint, int allow_other, int auto_unmount, int writeback);

/* Serve until told to stop, on the configured number of threads (the
 * calling one included).  Writes "1" to ready_fd (then closes it) once the
 * kernel's INIT has been answered; -1 for none.  Installs handlers for
 * SIGTERM, SIGINT and SIGHUP that end the loop, and restores the previous
 * ones before returning (every other loop thread joined). */
int bridge_run(int ready_fd);

/* Make bridge_run return (safe from a signal handler). */
void bridge_exit(void);

/* Unmount and destroy the session (idempotent). */
void bridge_unmount(void);
int bridge_notify_inval_inode(uint64_t ino);
int bridge_notify_inval_entry(uint64_t parent, const char *name, size_t namelen);
/* A regular file another client changed: bridge_notify_inval_inode, and in a writeback
 * mount, the kernel's inode dropped once nothing holds it (bridge_prune.c). */
int bridge_notify_inval_file(uint64_t ino);
/* Ask again for every pruned inode the kernel has not forgotten; how many wait, or -errno. */
long bridge_prune_retry(void);
/* How many pruned inodes the kernel has not forgotten yet. */
long bridge_prune_pending(void);

/* Counters: kernel requests by opcode, and the BRIDGE_STAT_* slots. */
uint64_t bridge_request_count(int opcode);
uint64_t bridge_stat(int slot);
/* Keep the counters in caller memory (e.g. a shared file mapping, so other
 * processes can read them); at least BRIDGE_COUNTER_BYTES, 8-aligned.  The
 * current values are copied over. */
int bridge_set_counter_memory(void *mem, uint64_t len);
void bridge_reset_counters(void);

/* errno for a slates.errors code (EIO for unknown codes). */
int bridge_errno_for(const char *code);

/* Tests: encode the request each callback would send for fixed sample
 * arguments (`which` indexes the ops, see bridge_wire.c); returns the length,
 * -ENOENT past the last one.  The op name is copied to op_out. */
int bridge_test_encode(int which, uint8_t *out, uint32_t cap, char *op_out, uint32_t op_cap);
/* Tests: decode a reply; 0 and the ATTR's 11 fields in protocol order (ino,
 * mode, nlink, uid, gid, size, blocks, atime_ns, mtime_ns, ctime_ns, rdev)
 * for an ok reply whose result is an ATTR, or the mapped errno for an error
 * reply, or -EBADMSG. */
int bridge_test_decode_attr(const uint8_t *msg, uint32_t len, int64_t *out);
/* Tests: apply adds (key) and removes (~key) to the absent-xattr set, then
 * whether it holds `probe`. */
int bridge_test_absent_set(const uint64_t *ops, uint32_t n, uint64_t probe);
/* Tests: mark every probed name absent on `ino` with the epoch read first,
 * after an invalidation of another inode when `invalidate_between`; then
 * whether security.capability is known absent on `ino`. */
int bridge_test_absent_since(uint64_t ino, int invalidate_between);

/* Tests: teach `ino` as a clean file with the epoch read first, after an
 * invalidation of another inode when `invalidate_between`; then whether
 * it is known (1/0), or -errno. */
int bridge_test_clean_since(uint64_t ino, int invalidate_between);
/* The attribute table's lifetime rules (bridge_attr.c): whether an entry
 * recorded for `ino` is known after `event` (see the function). */
int bridge_test_attr_cache(uint64_t ino, int event);
/* Tests: apply adds (key) and removes (~key) to a scratch node map
 * (bridge_meta.c), then whether it holds `probe` (or -ENOMEM). */
int bridge_test_meta_map(const uint64_t *ops, uint32_t n, uint64_t probe);
/* Tests: the readdir cookie the bridge gives a name it lists from the base. */
uint64_t bridge_test_cookie(const char *name, size_t len);
/* The spin policy (bridge_spin.c) over `n` waits, the loop threads' or
 * (any_rate) the reply wait's: wanted[i] is whether it
 * spun for wait i (which took waits[i] ns: a hit if that is within the
 * budget; flags[i] & 2: the spin was crowded off its CPU); returns whether
 * it would spin next. */
int bridge_test_spin(uint64_t budget_ns, int any_rate, const uint64_t *waits, const int *flags,
                     uint32_t n, int *wanted);

/* Implemented in Python (cffi extern "Python+C"): say hello again and call
 * bridge_attach.  Returns 0 or -errno. */
int bridge_reconnect_cb(void);

/* FUSE opcodes (the kernel's numbering), for counters. */
enum {
    BRIDGE_OP_LOOKUP = 1,
    BRIDGE_OP_FORGET = 2,
    BRIDGE_OP_GETATTR = 3,
    BRIDGE_OP_SETATTR = 4,
    BRIDGE_OP_READLINK = 5,
    BRIDGE_OP_SYMLINK = 6,
    BRIDGE_OP_MKNOD = 8,
    BRIDGE_OP_MKDIR = 9,
    BRIDGE_OP_UNLINK = 10,
    BRIDGE_OP_RMDIR = 11,
    BRIDGE_OP_RENAME = 12,
    BRIDGE_OP_LINK = 13,
    BRIDGE_OP_OPEN = 14,
    BRIDGE_OP_READ = 15,
    BRIDGE_OP_WRITE = 16,
    BRIDGE_OP_STATFS = 17,
    BRIDGE_OP_RELEASE = 18,
    BRIDGE_OP_FSYNC = 20,
    BRIDGE_OP_SETXATTR = 21,
    BRIDGE_OP_GETXATTR = 22,
    BRIDGE_OP_LISTXATTR = 23,
    BRIDGE_OP_REMOVEXATTR = 24,
    BRIDGE_OP_FLUSH = 25,
    BRIDGE_OP_INIT = 26,
    BRIDGE_OP_OPENDIR = 27,
    BRIDGE_OP_READDIR = 28,
    BRIDGE_OP_RELEASEDIR = 29,
    BRIDGE_OP_FSYNCDIR = 30,
    BRIDGE_OP_ACCESS = 34,
    BRIDGE_OP_CREATE = 35,
    BRIDGE_OP_INTERRUPT = 36,
    BRIDGE_OP_DESTROY = 38,
    BRIDGE_OP_BATCH_FORGET = 42,
    BRIDGE_OP_FALLOCATE = 43,
    BRIDGE_OP_READDIRPLUS = 44,
    BRIDGE_OP_RENAME2 = 45,
    BRIDGE_OP_LSEEK = 46,
    BRIDGE_OP_COPY_FILE_RANGE = 47,
};

/* The calling thread's scheduler slice request (native/sched_slice.c): 0 or
 * -errno; and the slice it has now, in ns (0 when unknown). */
int servers_short_slice(uint64_t ns);
uint64_t servers_slice(void);

#endif
