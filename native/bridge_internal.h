/*
 * What the mount bridge's source files share (not part of the extension's
 * API, which is bridge.h).  The bridge is split along its seams:
 *
 *   bridge_wire.c     msgpack encoding of fs.* requests and decoding of the
 *                     shard's replies (slates/fuse/PROTOCOL.md), the errno
 *                     table; pure: no I/O, only the codec buffers below.
 *   bridge_link.c     the shard connection: the ring pair, one request
 *                     waited for at a time, the reply wait (spin, then
 *                     park), reconnect and resend; the request counters.
 *   bridge_behind.c   write-behind under the shard's grants: writes answered
 *                     before their replies, kept for a resend until then.
 *   bridge_cache.c    what the bridge answers without asking the shard: the
 *                     xattr names known to be absent, per inode.
 *   bridge_attr.c     the attributes a mutation's reply carried, answering
 *                     the GETATTR the kernel sends for them next.
 *   bridge_clean.c    READs of files whose content is wholly their base
 *                     file's, served from the base directory.
 *   bridge_meta.c     LOOKUP, GETATTR, READLINK, ACCESS and LSEEK of
 *                     untouched base entries answered from the base
 *                     directory; the kernel references of those entries;
 *                     binding them in the shard on demand; taints.
 *   bridge_meta_dir.c READDIRPLUS of clean directories from the base.
 *   bridge_map.c      the open-addressing map bridge_meta.c keeps nodes in.
 *   bridge_ops.c      the libfuse3 low-level callbacks, INIT's wishes
 *                     included: one kernel request in, at most one fs.*
 *                     round trip (a few for large reads and writes), one
 *                     fuse_reply_* out.
 *   bridge_session.c  the FUSE session: mount, the loop, signals,
 *                     invalidation notices, unmount.
 *
 *   bridge_loop.c     the loop threads reading /dev/fuse, and stopping them.
 *   bridge_uring.c    FUSE-over-io_uring (bridge_set_uring): the mount(2),
 *                     libfuse's custom transport, one pinned ring thread per
 *                     CPU running the same callbacks.
 *
 * Threads: BRIDGE_LOOP_THREADS loop threads (bridge_loop.c) read /dev/fuse
 * and run the callbacks concurrently (in io_uring mode, the ring threads of
 * bridge_uring.c run them too, under the same rules).  Everything in bridge_wire.c and
 * bridge_link.c (the link, the codec buffers, the decoded reply: the state
 * below) belongs to the thread holding the link lock: a callback that goes
 * to the shard takes it (link_lock) before it binds, taints, drops or
 * encodes anything, and keeps it until the loop has answered the request
 * (link_release), so shard requests stay one at a time, in order, and a
 * reply's lessons (clean files, marks, absent xattrs) are never taught
 * after a later mutation's drop.  Answers without the shard (bridge_meta*.c,
 * bridge_clean.c, bridge_cache.c) take only their own tables' locks and run
 * in parallel.  Lock order: link, then meta's reply gate, then the tables'
 * mutexes; nothing takes the link lock while holding another.  The Python
 * watcher thread calls only bridge_notify_inval_*, which touch the session
 * handle (libfuse's notify calls are thread-safe) and the tables (which lock).
 */
#ifndef SLATES_BRIDGE_INTERNAL_H
#define SLATES_BRIDGE_INTERNAL_H

#define _GNU_SOURCE
#define FUSE_USE_VERSION 312

#include "bridge.h"
#include "ring.h"

#include <fuse_lowlevel.h>
#include <msgpack.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define BRIDGE_INTERNAL __attribute__((visibility("hidden")))

#define NS_PER_SEC 1000000000ull
#define SHUTDOWN_GRACE_NS (10ull * NS_PER_SEC)
#define IO_HEADROOM 4096u /* request/reply envelope around data bytes */
#define BRIDGE_MAX_BACKGROUND 64u /* kernel requests in flight without a waiter */

/* -- state (one bridge per process; defined in bridge_link.c) ---------------- */

struct bridge_state {
    char volume[256];
    uint64_t spin_ns;
    /* the shard connection (bridge_link.c) */
    int attached;
    ring_t req, rep;
    void *req_map, *rep_map;
    size_t req_len, rep_len;
    int req_memfd, req_evfd, rep_memfd, rep_evfd, sock;
    uint8_t *reply;
    uint32_t reply_cap;
    uint32_t reply_len; /* the last reply received, 0 when the last call got none */
    uint32_t io_chunk;  /* data bytes per fs.read/fs.write message */
    uint64_t down_since_ns; /* 0 while connected or never lost */
    /* encoding and decoding (bridge_wire.c) */
    uint64_t next_seq;
    uint64_t cur_seq;
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
    int codec_ready;
    msgpack_unpacked unp;
    int unp_live;
    const char *cur_op;
    /* A split request's raw tail (PROTOCOL.md, "Split requests"): sent after
     * sbuf, which then holds the mark, the head's length and the head. */
    const uint8_t *tail;
    uint32_t tail_len;
    /* the session (bridge_session.c) */
    struct fuse_session *se;
    int writeback;
    double cache_timeout; /* entry and attribute timeouts (bridge_set_cache_timeout) */
    volatile sig_atomic_t stop;
    uint64_t stop_ns;
};

BRIDGE_INTERNAL extern struct bridge_state g_bridge;

static inline uint64_t now_ns(int clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * NS_PER_SEC + (uint64_t)ts.tv_nsec;
}

/* Zeroed memory whose pages are written now, on allocation: calloc leaves a
 * fresh mapping on the shared zero page, and the copy-on-write fault of each
 * first store then shoots down every loop thread's TLB (an IPI per page,
 * costly in a VM).  Tables that grow while loop threads run use this. */
static inline void *zalloc_touched(size_t n, size_t size)
{
    if (size != 0 && n > SIZE_MAX / size)
        return NULL;
    void *p = malloc(n * size);
    if (p != NULL)
        memset(p, 0, n * size);
    return p;
}

static inline int64_t ts_ns(const struct timespec *ts)
{
    return (int64_t)ts->tv_sec * (int64_t)NS_PER_SEC + ts->tv_nsec;
}

/* -- bridge_wire.c ------------------------------------------------------------ */

BRIDGE_INTERNAL int errno_for(const char *code, size_t len);
BRIDGE_INTERNAL void codec_init(void);
/* Start {"seq", "ack", "op", "args": ...} with the next sequence number, up
 * to the args' value (bridge_request appends caller-encoded args). */
BRIDGE_INTERNAL void envelope_begin(const char *op);

/* Per-op request encoders: each leaves one whole request in g_bridge.sbuf. */
BRIDGE_INTERNAL void enc_lookup(uint64_t parent, const char *name);
BRIDGE_INTERNAL void enc_forget(const struct fuse_forget_data *items, size_t n);
BRIDGE_INTERNAL void enc_ino(const char *op, uint64_t ino);
/* `kill_gid`: -1, or the kernel asked for the file's set-ID bits to be killed
 * (request_kills_setid: the caller lacks CAP_FSETID, or a chown) and this is
 * the caller's group (slates/node/fsops.py: a set-group-ID bit without group
 * execute goes only for a caller outside the file's group). */
BRIDGE_INTERNAL void enc_setattr(uint64_t ino, const struct stat *attr, int to_set,
                                 int64_t kill_gid);
BRIDGE_INTERNAL void enc_mknod(uint64_t parent, const char *name, uint32_t mode, uint64_t rdev,
                               uint32_t uid, uint32_t gid);
BRIDGE_INTERNAL void enc_mkdir(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                               uint32_t gid);
BRIDGE_INTERNAL void enc_entry_name(const char *op, uint64_t parent, const char *name);
BRIDGE_INTERNAL void enc_symlink(uint64_t parent, const char *name, const char *target,
                                 uint32_t uid, uint32_t gid);
BRIDGE_INTERNAL void enc_rename(uint64_t parent, const char *name, uint64_t new_parent,
                                const char *new_name, unsigned flags);
BRIDGE_INTERNAL void enc_link(uint64_t ino, uint64_t new_parent, const char *new_name);
/* `asking`: "behind", a grant for the new file's writes (bridge_behind.c). */
BRIDGE_INTERNAL void enc_create(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                                uint32_t gid, int exclusive, int asking);
BRIDGE_INTERNAL void enc_read(uint64_t ino, uint64_t offset, uint64_t size);
/* fs.write; `kill_gid` as enc_setattr's. */
BRIDGE_INTERNAL void enc_write(uint64_t ino, uint64_t offset, const void *data, size_t len,
                               int64_t kill_gid);
/* fs.write asking for a grant ("behind": bridge_behind.c), and one sent under it
 * ("granted", no attrs). */
BRIDGE_INTERNAL void enc_write_asking(uint64_t ino, uint64_t offset, const void *data, size_t len,
                                      int64_t kill_gid);
BRIDGE_INTERNAL void enc_write_granted(uint64_t ino, uint64_t offset, const void *data,
                                       size_t len, int64_t kill_gid);
/* Mutations' encoders ask for the ATTRs they produce ("attrs": true,
 * slates/node/fsops.py; bridge_attr.c keeps them). */
BRIDGE_INTERNAL void enc_statfs(void);
BRIDGE_INTERNAL void enc_readdir(uint64_t ino, uint64_t offset, int plus, uint64_t limit);
BRIDGE_INTERNAL void enc_setxattr(uint64_t ino, const char *name, const void *value, size_t size,
                                  int flags);
BRIDGE_INTERNAL void enc_ino_name(const char *op, uint64_t ino, const char *name);
BRIDGE_INTERNAL void enc_fallocate(uint64_t ino, int mode, uint64_t offset, uint64_t length,
                                   int64_t kill_gid);
BRIDGE_INTERNAL void enc_lseek(uint64_t ino, uint64_t offset, int whence);
BRIDGE_INTERNAL void enc_copy_file_range(uint64_t ino_in, uint64_t off_in, uint64_t ino_out,
                                         uint64_t off_out, uint64_t length, int64_t kill_gid);
BRIDGE_INTERNAL void enc_access(uint64_t ino, int mask);
BRIDGE_INTERNAL void enc_destroy(void);
/* fs.lookup binding a node the bridge answered itself (bridge_meta.c). */
BRIDGE_INTERNAL void enc_bind(uint64_t parent, const char *name, uint64_t node,
                              const struct stat *seen, uint64_t refs);

/* Reading decoded replies. */
BRIDGE_INTERNAL const msgpack_object *mp_get(const msgpack_object *map, const char *key);
BRIDGE_INTERNAL int mp_int(const msgpack_object *o, int64_t *out);
BRIDGE_INTERNAL int mp_uint(const msgpack_object *o, uint64_t *out);
BRIDGE_INTERNAL int mp_bytes(const msgpack_object *o, const char **p, uint32_t *n);
/* An ATTR map to a struct stat (0 or EIO); *node gets the kernel node id. */
BRIDGE_INTERNAL int attr_from_node(const msgpack_object *o, struct stat *st, fuse_ino_t *node);
BRIDGE_INTERNAL int attr_from(const msgpack_object *o, struct stat *st);
/* 1 when an ATTR says its inode has no extended attributes at all (the
 * optional "xattrs" count is 0); 0 when it has some or does not say. */
BRIDGE_INTERNAL int attr_has_no_xattrs(const msgpack_object *o);
BRIDGE_INTERNAL int result_count(const msgpack_object *res, const char *key, int64_t *out);
/* Decode a reply into g_bridge.unp: 0 with *result (ok), a positive errno
 * (error reply), or -EBADMSG; *seq gets its sequence number. */
BRIDGE_INTERNAL int decode_reply(const uint8_t *buf, size_t len, uint64_t *seq,
                                 const msgpack_object **result, int log);

/* -- bridge_spin.c ------------------------------------------------------------ */

/* One loop thread's adaptive spin (see bridge_spin.c): spin up to budget_ns
 * while enough recent spins caught a request (otherwise every 8th wait
 * probes) and no recent spin was crowded off its CPU.  Zero it, then set
 * budget_ns (0: never spin). */
struct spin_policy {
    uint64_t budget_ns;
    uint32_t miss_rate; /* of 256; 0: every recent spin hit (a fresh policy) */
    uint32_t backoff;   /* waits left without a spin after a crowded one */
    uint32_t skipped;   /* waits without a spin since the last probe */
    int any_rate;       /* spin whatever the hit rate (only crowding stops it) */
};
/* read(2) of the O_NONBLOCK /dev/fuse fd that waits for a request: spins
 * first when `p` says so, then polls; read's result and errno. */
BRIDGE_INTERNAL ssize_t spin_read(int fd, void *buf, size_t len, struct spin_policy *p);
/* The policy itself: whether to spin for this wait, and what the wait did. */
BRIDGE_INTERNAL int spin_wanted(struct spin_policy *p);
BRIDGE_INTERNAL void spin_noted(struct spin_policy *p, int spun, int hit, int crowded);
/* A wait for a reply in `ring`: spins (ring_spin_wait) when `p` says so; 1
 * when a message came while it spun, 0 when the caller should park. */
BRIDGE_INTERNAL int spin_ring(ring_t *ring, struct spin_policy *p);

/* -- bridge_link.c ------------------------------------------------------------ */

/* The link lock (see "Threads" above): link_lock takes it unless this thread
 * holds it already; link_release gives it back if held (the loop, after each
 * kernel request; entry points called from Python, before they return). */
BRIDGE_INTERNAL void link_lock(void);
BRIDGE_INTERNAL void link_release(void);
/* Count one event in a counter slot (bridge.h's BRIDGE_STAT_* or an opcode). */
BRIDGE_INTERNAL void bridge_count(int slot);
/* Send the request in g_bridge.sbuf and wait for its reply, reconnecting and
 * resending the same bytes when the shard goes away: 0 with *result, or a
 * positive errno.  *result points into g_bridge.unp until the next call. */
BRIDGE_INTERNAL int link_call(const msgpack_object **result);
/* Push the request in g_bridge.sbuf (and its tail) without waiting: 0, or
 * -EPIPE / -EMSGSIZE; no reconnect (bridge_behind.c's early answers). */
BRIDGE_INTERNAL int link_push_current(void);
/* Push one saved request again, as it was (bridge_behind.c's resend). */
BRIDGE_INTERNAL int link_push_bytes(const uint8_t *msg, uint32_t len);
/* Wait for the reply to the oldest write answered early: 0 once it is taken,
 * or -EPIPE (the link is then detached: the next link_call reconnects). */
BRIDGE_INTERNAL int link_wait_oldest(void);

/* -- bridge_behind.c ---------------------------------------------------------- */

/* Whether this mount asks for grants (write-behind on, write-through cache). */
BRIDGE_INTERNAL int behind_wanted(void);
/* The grant ends (any request other than a write under it or a read is being
 * sent). */
BRIDGE_INTERNAL void behind_end_grant(void);
/* A synchronous write's or create's `result`, when it carries "grant": N,
 * granted N more from `end` on inode `ino` (writes anywhere in it when it
 * carries "scatter": C too, each counting C beyond its bytes: a file with no
 * base content). */
BRIDGE_INTERNAL void behind_granted(uint64_t ino, uint64_t end, const msgpack_object *result);
/* Send this write under the grant and answer it early: 1 when sent (answer
 * the kernel now), 0 when it must go the usual way. */
BRIDGE_INTERNAL int behind_try(uint64_t ino, uint64_t off, const char *buf, size_t size,
                               int64_t kill_gid);
/* The latched error of a write answered early to `ino` (0: none), cleared. */
BRIDGE_INTERNAL int behind_take_error(uint64_t ino);
/* The reply wait's hook: 1 when `seq` is the oldest early-answered write's
 * reply (taken here), else 0. */
BRIDGE_INTERNAL int link_take_behind(uint64_t seq, int status, const msgpack_object *result);
/* The seq of the oldest early-answered write, 0 when none. */
BRIDGE_INTERNAL uint64_t behind_oldest(void);
/* How many early-answered writes, still unanswered, were sent before `seq`:
 * their replies come first. */
BRIDGE_INTERNAL unsigned behind_before(uint64_t seq);
/* The "ack" a request of sequence `seq` carries: below every unanswered write. */
BRIDGE_INTERNAL uint64_t link_ack(uint64_t seq);
/* Around a detach and the next hello (see bridge_behind.c). */
BRIDGE_INTERNAL void behind_save(void);
BRIDGE_INTERNAL int behind_resend(void);

/* -- bridge_cache.c ----------------------------------------------------------- */

/* The key of (ino, name) when `name` is one of the probed xattr names, else 0. */
BRIDGE_INTERNAL uint64_t absent_key(uint64_t ino, const char *name);
BRIDGE_INTERNAL int absent_has(uint64_t key);
BRIDGE_INTERNAL void absent_remove(uint64_t key);
/* Invalidation epoch: read it before asking the shard; absent_add_since and
 * absent_mark_inode then record nothing if an invalidation ran meanwhile. */
BRIDGE_INTERNAL uint64_t absent_epoch(void);
BRIDGE_INTERNAL void absent_add_since(uint64_t key, uint64_t epoch);
/* Every probed name is absent on `ino` (the shard said it has no xattrs). */
BRIDGE_INTERNAL void absent_mark_inode(uint64_t ino, uint64_t epoch);
/* Forget every probed name's absence for one inode (and start a new epoch). */
BRIDGE_INTERNAL void absent_forget_inode(uint64_t ino);

/* -- bridge_attr.c ------------------------------------------------------------ */

/* Invalidation epoch of the attribute table: read it before asking the
 * shard; attr_note then records nothing if an invalidation ran. */
BRIDGE_INTERNAL uint64_t attr_epoch(void);
/* Forget one inode's attributes (before a request that may change them). */
BRIDGE_INTERNAL void attr_drop(uint64_t ino);
/* Forget every inode's attributes and start a new epoch (before UNLINK,
 * RMDIR, RENAME; on a reconnect). */
BRIDGE_INTERNAL void attr_drop_all(void);
/* Forget one inode and start a new epoch (the shard invalidated it). */
BRIDGE_INTERNAL void attr_invalidate(uint64_t ino);
/* Keep an ATTR map a mutation's reply carried (NULL or not a map: nothing),
 * unless an invalidation ran since `epoch`. */
BRIDGE_INTERNAL void attr_note(const msgpack_object *attr, uint64_t epoch);
/* Answer a GETATTR from the table: 1 when replied, 0 for the shard. */
BRIDGE_INTERNAL int attr_answer(fuse_req_t req, uint64_t ino);

/* -- bridge_clean.c ----------------------------------------------------------- */

/* Invalidation epoch of the clean-file table: read it before asking the
 * shard; clean_note_attr then records nothing if an invalidation ran. */
BRIDGE_INTERNAL uint64_t clean_epoch(void);
/* Learn from an ATTR of `ino`: its "base" field records the inode as a
 * clean base file; an ATTR without one drops what was known. */
BRIDGE_INTERNAL void clean_note_attr(uint64_t ino, const msgpack_object *attr, uint64_t epoch);
/* Forget one inode (the loop thread, before a request that may change it). */
BRIDGE_INTERNAL void clean_drop(uint64_t ino);
/* Forget one inode and start a new epoch (the shard invalidated it). */
BRIDGE_INTERNAL void clean_invalidate(uint64_t ino);
/* Serve a READ from the base: the byte count with *out pointing at them
 * (this thread's buffer, valid until its next call), or -1 when the shard
 * must answer.  Any loop thread, without the link lock. */
BRIDGE_INTERNAL long clean_read(uint64_t ino, uint64_t off, size_t size, const char **out);

/* A loop thread ends: free its read buffer. */
BRIDGE_INTERNAL void clean_thread_done(void);
/* The base directory fd (bridge_set_base), or -1. */
BRIDGE_INTERNAL int clean_base_fd(void);
/* Open the entry at base-relative `path` ("" the directory itself) beneath
 * `dir_fd` as the bridge always does: openat2 with RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV and O_NOFOLLOW | O_CLOEXEC added to
 * `flags`; the fd, or -1 with errno (ENOSYS, no openat2, turns clean reads
 * off). */
BRIDGE_INTERNAL int base_open(int dir_fd, const char *path, int flags);
/* Record `ino` as a clean base file at `path` with the fingerprint in `st`,
 * unless an invalidation ran since `epoch`. */
BRIDGE_INTERNAL void clean_learn(uint64_t ino, const char *path, const struct stat *st,
                                 uint64_t epoch);

/* -- bridge_content.c ----------------------------------------------------------- */

/* Invalidations so far: read it before sending the request that empties a file. */
BRIDGE_INTERNAL uint64_t content_epoch(void);
/* `ino` is an empty regular file now (a CREATE, a SETATTR to size 0 sent at
 * `epoch`): keep a copy of its content from here on. */
BRIDGE_INTERNAL void content_start(uint64_t ino, uint64_t epoch);
/* Bytes the shard applied or promised to `ino`, in the order sent (link lock). */
BRIDGE_INTERNAL void content_write(uint64_t ino, uint64_t off, const void *data, size_t n);
/* `ino`'s new size after a SETATTR (link lock). */
BRIDGE_INTERNAL void content_resize(uint64_t ino, uint64_t size);
/* Any other change to `ino`'s content, or its FORGET: no copy any more. */
BRIDGE_INTERNAL void content_drop(uint64_t ino);
/* Another client changed `ino` (watcher thread): no copy, and no copy begun
 * from a request sent before this. */
BRIDGE_INTERNAL void content_invalidate(uint64_t ino);
/* Answer a READ from `ino`'s copy: 1 if answered, 0 if there is none. */
BRIDGE_INTERNAL int content_read(fuse_req_t req, uint64_t ino, uint64_t off, size_t size);

/* -- bridge_prune.c ------------------------------------------------------------ */

/* Writeback mounts: ask the kernel to drop `ino`'s inode, now and (pending
 * until its FORGET) again at each bridge_prune_retry.  0 or -errno. */
BRIDGE_INTERNAL int prune_note(uint64_t ino);
/* The kernel forgot `ino`: nothing to ask for any more. */
BRIDGE_INTERNAL void prune_forgotten(uint64_t ino);

/* -- bridge_map.c ------------------------------------------------------------- */

/* An open-addressing map from a key (never 0) to a pointer; zeroed = empty. */
struct u64map {
    uint64_t *keys;
    void **values;
    size_t cap, len;
};
BRIDGE_INTERNAL void *map_get(const struct u64map *m, uint64_t key);
/* 0, or -ENOMEM (the map is unchanged). */
BRIDGE_INTERNAL int map_put(struct u64map *m, uint64_t key, void *value);
BRIDGE_INTERNAL void map_del(struct u64map *m, uint64_t key);

/* -- bridge_meta.c ------------------------------------------------------------ */

/* Invalidation epoch of the clean metadata: read it before asking the shard. */
BRIDGE_INTERNAL uint64_t meta_epoch(void);
/* The shard answers for this node from now on (a change to it; for a
 * directory, to its names).  Either thread. */
BRIDGE_INTERNAL void meta_taint(uint64_t node);
/* Answer from the base when the request is about an untouched base entry:
 * 1 when replied, 0 when the shard must answer. */
BRIDGE_INTERNAL int meta_lookup(fuse_req_t req, uint64_t parent, const char *name);
BRIDGE_INTERNAL int meta_getattr(fuse_req_t req, uint64_t ino);
BRIDGE_INTERNAL int meta_readlink(fuse_req_t req, uint64_t ino);
BRIDGE_INTERNAL int meta_access(fuse_req_t req, uint64_t ino);
BRIDGE_INTERNAL int meta_lseek(fuse_req_t req, uint64_t ino, uint64_t off, int whence);
/* A regular file answered from the base and unchanged since: 1 with its
 * base-relative path and the stat it was answered with (bridge_clean.c reads
 * it as a clean file), else 0. */
BRIDGE_INTERNAL int meta_base_file(uint64_t ino, char *path, size_t cap, struct stat *seen);
/* The kernel forgot `nlookup` references: how many of them the shard holds. */
BRIDGE_INTERNAL uint64_t meta_forget(uint64_t ino, uint64_t nlookup);
/* Learn from a shard's ATTR of `node` (`entry`: it came as an ENTRY, one
 * more kernel reference), unless a taint ran since `epoch`. */
BRIDGE_INTERNAL void meta_note_attr(uint64_t node, const msgpack_object *attr, uint64_t epoch,
                                    int entry);
/* Before a request naming `node` (or (parent, name)) goes to the shard:
 * bind it there if only the bridge knows it.  0 or a positive errno. */
BRIDGE_INTERNAL int meta_prepare(uint64_t node);
/* Whether READDIRPLUS of `dir` may be answered from the base (a clean
 * directory); *epoch gets the epoch to check the answers against. */
BRIDGE_INTERNAL int meta_listable(uint64_t dir, uint64_t *epoch);
/* One listed name of a clean directory (`dir_fd`: the base directory as
 * listed), answered from the base as a lookup would be (one kernel reference
 * counted here): 1 with *e filled, 0 when the shard must answer, -1 when the
 * name is gone from the base. */
BRIDGE_INTERNAL int meta_dirent(uint64_t dir, int dir_fd, const char *name, uint64_t epoch,
                                struct fuse_entry_param *e);
/* Whether the kernel holds `dir`'s entry `name` (base inode `base_ino`) as
 * this file answered it: a listing may then give it without attributes. */
BRIDGE_INTERNAL int meta_kernel_holds(uint64_t dir, const char *name, uint64_t base_ino);
/* Take the lock if no taint ran since `epoch` (1), else 0; meta_unlock after
 * replying, so the reply reaches the kernel before any later invalidation. */
BRIDGE_INTERNAL int meta_lock_if(uint64_t epoch);
BRIDGE_INTERNAL void meta_unlock(void);
/* fstat of the entry at a base-relative path, beneath the base: 0 or -errno. */
BRIDGE_INTERNAL int meta_stat_beneath(const char *path, struct stat *st);
/* lstat of `name` (one component) in a directory fd opened beneath the base
 * (the listing's): as strong as meta_stat_beneath from that directory -
 * nothing followed, -EXDEV for another device (a mount point). */
BRIDGE_INTERNAL int meta_stat_at(int dir_fd, const char *name, struct stat *st);
/* Whether bridge_prefetch.c may list the base directory at `path` (base-
 * relative, its path in the mount while it is clean): its node id (once: it
 * is claimed) when the bridge answers it as a clean directory, else 0. */
BRIDGE_INTERNAL uint64_t meta_claim_listing(const char *path);
/* The base path of a directory node (malloc'ed) and its parent node, or NULL. */
BRIDGE_INTERNAL char *meta_dir_path(uint64_t dir, uint64_t *parent);
/* The base path of `name` in a directory node (malloc'ed), or NULL. */
BRIDGE_INTERNAL char *meta_child_path(uint64_t dir, const char *name);

/* -- bridge_dirfd.c (base directory fds for LOOKUPs) ----------------------------- */

struct dirfd;
/* An O_PATH fd of the base directory at `path` beneath `base_fd` (as
 * meta_stat_beneath resolves it), holding one reference, stamped with
 * `events` (watch_events() before the caller checked the watches); NULL when
 * it cannot be opened or too many are open. */
BRIDGE_INTERNAL struct dirfd *dirfd_open(int base_fd, const char *path, uint64_t events);
BRIDGE_INTERNAL int dirfd_fd(const struct dirfd *d);
BRIDGE_INTERNAL uint64_t dirfd_events(const struct dirfd *d);
/* One more reference (taken while another is held). */
BRIDGE_INTERNAL struct dirfd *dirfd_get(struct dirfd *d);
/* Drop a reference (NULL: nothing); the last closes the fd. */
BRIDGE_INTERNAL void dirfd_put(struct dirfd *d);

/* -- bridge_meta_dir.c -------------------------------------------------------- */

/* READDIRPLUS of a clean directory answered wholly from the base (names,
 * cookies as fsops.py's, attributes): 1 when replied, 0 for the shard. */
BRIDGE_INTERNAL int meta_readdirplus(fuse_req_t req, uint64_t dir, size_t size, uint64_t off);
BRIDGE_INTERNAL uint64_t meta_cookie(const char *name, size_t len);
BRIDGE_INTERNAL int meta_prepare_child(uint64_t parent, const char *name);

/* -- bridge_prefetch.c --------------------------------------------------------- */

/* Where the mount is (bridge_mount, before the loop starts): 0 or -errno. */
BRIDGE_INTERNAL int prefetch_set_mountpoint(const char *mountpoint);
/* After INIT is answered, before the mount is announced: hold a detached clone
 * of the mount for the readers (if a mountpoint was set and the bridge may). */
BRIDGE_INTERNAL void prefetch_hold_mount(void);
/* After INIT is answered: start the listing thread (if a mountpoint was set). */
BRIDGE_INTERNAL void prefetch_start(void);
/* A READ came from process `pid`: unless it is a reader's, it earns read-ahead. */
BRIDGE_INTERNAL void prefetch_note_read(uint32_t pid);
/* No more listings (the bridge stops); idempotent, never waits for the thread. */
BRIDGE_INTERNAL void prefetch_stop(void);

/* -- bridge_session.c (the INIT reply) ----------------------------------------- */

struct iovec;
struct fuse_init_out;
/* A request read from the kernel: the flags an INIT offered (remembered for
 * its reply), else 0. */
BRIDGE_INTERNAL uint64_t init_seen(const void *buf, ssize_t n);
/* When the reply in iov is INIT's: *out is it, with the flags libfuse leaves
 * out added (FUSE_PARALLEL_DIROPS), and 1; else 0. */
BRIDGE_INTERNAL int init_patch(const struct iovec *iov, int count, struct fuse_init_out *out);
/* A request read from the kernel, before libfuse takes it (which drops the
 * flags below): notes whether it is a WRITE or SETATTR that asks for set-ID
 * bits to be killed (FUSE_WRITE_KILL_SUIDGID, FATTR_KILL_SUIDGID). */
BRIDGE_INTERNAL void request_seen(const void *buf, size_t n);
/* Whether the request this thread is serving asked that (request_seen). */
BRIDGE_INTERNAL int request_kills_setid(void);
/* Whether process `pid` (a request's caller) lacks CAP_FSETID, so a change of
 * a file's content kills its set-ID bits; 1 when that cannot be read.  For
 * the requests whose kill the kernel does not flag (FALLOCATE, COPY_FILE_RANGE). */
BRIDGE_INTERNAL int caller_lacks_fsetid(uint32_t pid);

/* -- bridge_watch.c ----------------------------------------------------------- */

/* After INIT is answered: start the watch thread (inotify on clean base dirs). */
BRIDGE_INTERNAL void watch_start(void);
/* No more invalidations (the bridge stops); idempotent, never waits. */
BRIDGE_INTERNAL void watch_stop(void);
/* Watch the base directory open at `dir_fd` for `node`'s names (before any is
 * read): its generation (from 1), or 0 when it is not watched. */
BRIDGE_INTERNAL uint64_t watch_dir(uint64_t node, int dir_fd);
/* The generation of a watched directory, or 0 when it is not watched. */
BRIDGE_INTERNAL uint64_t watch_gen(uint64_t node);
/* Events the watches took so far (and their thread's end): a change of any
 * watched directory's names, or of a watched directory itself. */
BRIDGE_INTERNAL uint64_t watch_events(void);
/* A listing of `node` raced an invalidation: invalidate it again shortly. */
BRIDGE_INTERNAL void watch_recheck(uint64_t node);

/* -- bridge_loop.c ------------------------------------------------------------- */

/* Interrupt a thread with SIGTERM until it ends, and join it. */
BRIDGE_INTERNAL void bridge_join_thread(pthread_t tid);

/* -- bridge_uring.c ------------------------------------------------------------ */

/* Mount `se` itself with io_uring's transport when asked and allowed: 0
 * (mounted), 1 (not used: mount the ordinary way), or -errno. */
BRIDGE_INTERNAL int uring_mount(struct fuse_session *se, const char *mountpoint, int allow_other,
                                int auto_unmount);
/* After INIT is answered: start the ring threads; how many (0: none). */
BRIDGE_INTERNAL int uring_start(void);
/* Stop and join the ring threads (idempotent). */
BRIDGE_INTERNAL void uring_stop(void);
/* Detach the mount uring_mount made (before fuse_session_destroy). */
BRIDGE_INTERNAL void uring_unmount(void);

/* -- bridge_ops.c ------------------------------------------------------------- */

BRIDGE_INTERNAL extern const struct fuse_lowlevel_ops bridge_ops;

#endif
