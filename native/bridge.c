/* See bridge.h for the life cycle and slates/fuse/PROTOCOL.md for the wire
 * format.  Everything here runs on one thread: the FUSE loop calls an op
 * callback, the callback encodes one request, round-trips it to the shard
 * and replies to the kernel before the loop reads the next request. */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 312

#include "bridge.h"
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <msgpack.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define NS_PER_SEC 1000000000ull
#define SHUTDOWN_GRACE_NS (10ull * NS_PER_SEC)
#define IO_HEADROOM 4096u /* request/reply envelope around data bytes */

/* -- state ------------------------------------------------------------------ */

static struct {
    char volume[256];
    uint64_t spin_ns;
    /* the shard connection */
    int attached;
    ring_t req, rep;
    void *req_map, *rep_map;
    size_t req_len, rep_len;
    int req_memfd, req_evfd, rep_memfd, rep_evfd, sock;
    uint8_t *reply;
    uint32_t reply_cap;
    uint32_t reply_len; /* the last reply received, 0 when the last call got none */
    uint32_t io_chunk; /* data bytes per fs.read/fs.write message */
    uint64_t next_seq;
    uint64_t cur_seq;
    uint64_t down_since_ns; /* 0 while connected or never lost */
    /* encoding and decoding */
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
    int codec_ready;
    msgpack_unpacked unp;
    int unp_live;
    const char *cur_op;
    /* the session */
    struct fuse_session *se;
    int writeback;
    double cache_timeout; /* entry and attribute timeouts (bridge_set_cache_timeout) */
    volatile sig_atomic_t stop;
    uint64_t stop_ns;
} g = {
    .req_memfd = -1,
    .req_evfd = -1,
    .rep_memfd = -1,
    .rep_evfd = -1,
    .sock = -1,
    .next_seq = 1,
    .cache_timeout = BRIDGE_TIMEOUT_SECONDS,
};

static uint64_t g_local_counts[BRIDGE_COUNTERS];
static uint64_t *g_counts = g_local_counts;

static void count(int slot)
{
    if (slot >= 0 && slot < BRIDGE_COUNTERS)
        __atomic_fetch_add(&g_counts[slot], 1, __ATOMIC_RELAXED);
}

static uint64_t now_ns(int clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * NS_PER_SEC + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* -- errors ----------------------------------------------------------------- */

static const struct {
    const char *code;
    int err;
} ERRNO_TABLE[] = {
    {"SlatesError", EIO},
    {"InvalidArgument", EINVAL},
    {"NotFound", ENOENT},
    {"AlreadyExists", EEXIST},
    {"NotADirectory", ENOTDIR},
    {"IsADirectory", EISDIR},
    {"DirectoryNotEmpty", ENOTEMPTY},
    {"NameTooLong", ENAMETOOLONG},
    {"NotPermitted", EPERM},
    {"NoSuchAttribute", ENODATA},
    {"FileTooLarge", EFBIG},
    {"OutOfRange", ERANGE},
    {"TooBig", E2BIG},
    {"NotSupported", EOPNOTSUPP},
    {"NoSuchOffset", ENXIO},
    {"ConsistentBaseUnavailable", EIO},
    {"BaseDrift", EIO},
    {"Conflict", EBUSY},
    {"CapacityExhausted", ENOSPC},
    {"SnapshotBarrierFailed", EIO},
    {"MissingContent", EIO},
    {"VerificationFailed", EIO},
    {"NotOwner", EAGAIN},
    {"EpochFenced", EAGAIN},
    {"AccessDenied", EACCES},
    {"GrantInvalid", EACCES},
    {"LandingConflict", EBUSY},
    {"RequestExpired", ESTALE},
};

static int errno_for(const char *code, size_t len)
{
    for (size_t i = 0; i < sizeof ERRNO_TABLE / sizeof ERRNO_TABLE[0]; i++) {
        if (strlen(ERRNO_TABLE[i].code) == len && memcmp(ERRNO_TABLE[i].code, code, len) == 0)
            return ERRNO_TABLE[i].err;
    }
    return EIO;
}

int bridge_errno_for(const char *code)
{
    return code == NULL ? EIO : errno_for(code, strlen(code));
}

/* -- counters --------------------------------------------------------------- */

uint64_t bridge_request_count(int opcode)
{
    if (opcode < 0 || opcode >= BRIDGE_OPCODES)
        return 0;
    return __atomic_load_n(&g_counts[opcode], __ATOMIC_RELAXED);
}

uint64_t bridge_stat(int slot)
{
    if (slot < 0 || slot >= BRIDGE_COUNTERS)
        return 0;
    return __atomic_load_n(&g_counts[slot], __ATOMIC_RELAXED);
}

int bridge_set_counter_memory(void *mem, uint64_t len)
{
    if (mem == NULL || len < BRIDGE_COUNTER_BYTES || ((uintptr_t)mem & 7u))
        return -EINVAL;
    uint64_t *counts = mem;
    for (int i = 0; i < BRIDGE_COUNTERS; i++)
        counts[i] = g_counts[i];
    g_counts = counts;
    return 0;
}

void bridge_reset_counters(void)
{
    for (int i = 0; i < BRIDGE_COUNTERS; i++)
        __atomic_store_n(&g_counts[i], 0, __ATOMIC_RELAXED);
}

/* -- encoding --------------------------------------------------------------- */

static void codec_init(void)
{
    if (g.codec_ready)
        return;
    msgpack_sbuffer_init(&g.sbuf);
    msgpack_packer_init(&g.pk, &g.sbuf, msgpack_sbuffer_write);
    msgpack_unpacked_init(&g.unp);
    g.unp_live = 1;
    g.codec_ready = 1;
}

/* Strict UTF-8 (no overlongs, surrogates or values past U+10FFFF). */
static int valid_utf8(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp;
        if (c >= 0xc2 && c <= 0xdf) {
            len = 2;
            cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            len = 3;
            cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            len = 4;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i < len)
            return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += len;
    }
    return 1;
}

static void pack_cstr(const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(&g.pk, n);
    msgpack_pack_str_body(&g.pk, s, n);
}

/* A name or target: str when it is UTF-8, bin otherwise (PROTOCOL.md). */
static void pack_name(const char *s, size_t n)
{
    if (valid_utf8((const uint8_t *)s, n)) {
        msgpack_pack_str(&g.pk, n);
        msgpack_pack_str_body(&g.pk, s, n);
    } else {
        msgpack_pack_bin(&g.pk, n);
        msgpack_pack_bin_body(&g.pk, s, n);
    }
}

static void kv_u64(const char *key, uint64_t v)
{
    pack_cstr(key);
    msgpack_pack_uint64(&g.pk, v);
}

static void kv_i64(const char *key, int64_t v)
{
    pack_cstr(key);
    msgpack_pack_int64(&g.pk, v);
}

static void kv_bool(const char *key, int v)
{
    pack_cstr(key);
    if (v)
        msgpack_pack_true(&g.pk);
    else
        msgpack_pack_false(&g.pk);
}

static void kv_name(const char *key, const char *s)
{
    pack_cstr(key);
    pack_name(s, strlen(s));
}

static void kv_bin(const char *key, const void *p, size_t n)
{
    pack_cstr(key);
    msgpack_pack_bin(&g.pk, n);
    msgpack_pack_bin_body(&g.pk, p, n);
}

/* Start {"seq", "ack", "op", "args": ...}, up to the args' value. */
static void envelope_begin(const char *op)
{
    codec_init();
    msgpack_sbuffer_clear(&g.sbuf);
    g.cur_seq = g.next_seq++;
    g.cur_op = op;
    msgpack_pack_map(&g.pk, 4);
    kv_u64("seq", g.cur_seq);
    /* One request at a time: every reply below this one was received (or
     * given up on, which must not hold the shard's saved results either). */
    kv_u64("ack", g.cur_seq - 1);
    pack_cstr("op");
    pack_cstr(op);
    pack_cstr("args");
}

/* Start {"seq", "ack", "op", "args": {"volume", ...nargs more}}. */
static void req_begin(const char *op, uint32_t nargs)
{
    envelope_begin(op);
    msgpack_pack_map(&g.pk, nargs + 1);
    pack_cstr("volume");
    pack_cstr(g.volume);
}

/* -- per-op request encoders (shared by the callbacks and the tests) ---------- */

static void enc_lookup(uint64_t parent, const char *name)
{
    req_begin("fs.lookup", 2);
    kv_u64("parent", parent);
    kv_name("name", name);
}

static void enc_forget(const struct fuse_forget_data *items, size_t n)
{
    req_begin("fs.forget", 1);
    pack_cstr("items");
    msgpack_pack_array(&g.pk, n);
    for (size_t i = 0; i < n; i++) {
        msgpack_pack_array(&g.pk, 2);
        msgpack_pack_uint64(&g.pk, items[i].ino);
        msgpack_pack_uint64(&g.pk, items[i].nlookup);
    }
}

static void enc_ino(const char *op, uint64_t ino)
{
    req_begin(op, 1);
    kv_u64("ino", ino);
}

static int64_t ts_ns(const struct timespec *ts)
{
    return (int64_t)ts->tv_sec * (int64_t)NS_PER_SEC + ts->tv_nsec;
}

static void enc_setattr(uint64_t ino, const struct stat *attr, int to_set)
{
    int64_t now = (int64_t)now_ns(CLOCK_REALTIME);
    uint32_t n = 1;
    n += !!(to_set & FUSE_SET_ATTR_MODE);
    n += !!(to_set & FUSE_SET_ATTR_UID);
    n += !!(to_set & FUSE_SET_ATTR_GID);
    n += !!(to_set & FUSE_SET_ATTR_SIZE);
    n += !!(to_set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_ATIME_NOW));
    n += !!(to_set & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW));
    req_begin("fs.setattr", n);
    kv_u64("ino", ino);
    if (to_set & FUSE_SET_ATTR_MODE)
        kv_u64("mode", attr->st_mode & 07777);
    if (to_set & FUSE_SET_ATTR_UID)
        kv_u64("uid", attr->st_uid);
    if (to_set & FUSE_SET_ATTR_GID)
        kv_u64("gid", attr->st_gid);
    if (to_set & FUSE_SET_ATTR_SIZE)
        kv_u64("size", (uint64_t)attr->st_size);
    if (to_set & FUSE_SET_ATTR_ATIME_NOW)
        kv_i64("atime_ns", now);
    else if (to_set & FUSE_SET_ATTR_ATIME)
        kv_i64("atime_ns", attr->st_atim.tv_nsec == UTIME_NOW ? now : ts_ns(&attr->st_atim));
    if (to_set & FUSE_SET_ATTR_MTIME_NOW)
        kv_i64("mtime_ns", now);
    else if (to_set & FUSE_SET_ATTR_MTIME)
        kv_i64("mtime_ns", attr->st_mtim.tv_nsec == UTIME_NOW ? now : ts_ns(&attr->st_mtim));
}

static void enc_mknod(uint64_t parent, const char *name, uint32_t mode, uint64_t rdev,
                      uint32_t uid, uint32_t gid)
{
    req_begin("fs.mknod", 6);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode);
    kv_u64("rdev", rdev);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

static void enc_mkdir(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                      uint32_t gid)
{
    req_begin("fs.mkdir", 5);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode & 07777);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

static void enc_entry_name(const char *op, uint64_t parent, const char *name)
{
    req_begin(op, 2);
    kv_u64("parent", parent);
    kv_name("name", name);
}

static void enc_symlink(uint64_t parent, const char *name, const char *target, uint32_t uid,
                        uint32_t gid)
{
    req_begin("fs.symlink", 5);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_name("target", target);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

static void enc_rename(uint64_t parent, const char *name, uint64_t new_parent,
                       const char *new_name, unsigned flags)
{
    req_begin("fs.rename", 5);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("new_parent", new_parent);
    kv_name("new_name", new_name);
    kv_u64("flags", flags);
}

static void enc_link(uint64_t ino, uint64_t new_parent, const char *new_name)
{
    req_begin("fs.link", 3);
    kv_u64("ino", ino);
    kv_u64("new_parent", new_parent);
    kv_name("new_name", new_name);
}

static void enc_create(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                       uint32_t gid, int exclusive)
{
    req_begin("fs.create", 6);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode & 07777);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
    kv_bool("exclusive", exclusive);
}

static void enc_read(uint64_t ino, uint64_t offset, uint64_t size)
{
    req_begin("fs.read", 3);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_u64("size", size);
}

static void enc_write(uint64_t ino, uint64_t offset, const void *data, size_t len)
{
    req_begin("fs.write", 3);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_bin("data", data, len);
}

static void enc_statfs(void) { req_begin("fs.statfs", 0); }

static void enc_readdir(uint64_t ino, uint64_t offset, int plus, uint64_t limit)
{
    req_begin("fs.readdir", 4);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_bool("plus", plus);
    kv_u64("limit_bytes", limit);
}

static void enc_setxattr(uint64_t ino, const char *name, const void *value, size_t size,
                         int flags)
{
    req_begin("fs.setxattr", 4);
    kv_u64("ino", ino);
    kv_name("name", name);
    kv_bin("value", value, size);
    kv_u64("flags", (uint64_t)(unsigned)flags);
}

static void enc_ino_name(const char *op, uint64_t ino, const char *name)
{
    req_begin(op, 2);
    kv_u64("ino", ino);
    kv_name("name", name);
}

static void enc_fallocate(uint64_t ino, int mode, uint64_t offset, uint64_t length)
{
    req_begin("fs.fallocate", 4);
    kv_u64("ino", ino);
    kv_u64("mode", (uint64_t)(unsigned)mode);
    kv_u64("offset", offset);
    kv_u64("length", length);
}

static void enc_lseek(uint64_t ino, uint64_t offset, int whence)
{
    req_begin("fs.lseek", 3);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_u64("whence", (uint64_t)(unsigned)whence);
}

static void enc_copy_file_range(uint64_t ino_in, uint64_t off_in, uint64_t ino_out,
                                uint64_t off_out, uint64_t length)
{
    req_begin("fs.copy_file_range", 5);
    kv_u64("ino_in", ino_in);
    kv_u64("off_in", off_in);
    kv_u64("ino_out", ino_out);
    kv_u64("off_out", off_out);
    kv_u64("length", length);
}

static void enc_access(uint64_t ino, int mask)
{
    req_begin("fs.access", 2);
    kv_u64("ino", ino);
    kv_u64("mask", (uint64_t)(unsigned)mask);
}

/* -- decoding --------------------------------------------------------------- */

static const msgpack_object *mp_get(const msgpack_object *map, const char *key)
{
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static int mp_int(const msgpack_object *o, int64_t *out)
{
    if (o == NULL)
        return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX)
            return 0;
        *out = (int64_t)o->via.u64;
        return 1;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.i64;
        return 1;
    }
    return 0;
}

static int mp_uint(const msgpack_object *o, uint64_t *out)
{
    if (o != NULL && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *out = o->via.u64;
        return 1;
    }
    return 0;
}

/* str or bin */
static int mp_bytes(const msgpack_object *o, const char **p, uint32_t *n)
{
    if (o == NULL)
        return 0;
    if (o->type == MSGPACK_OBJECT_STR) {
        *p = o->via.str.ptr;
        *n = o->via.str.size;
        return 1;
    }
    if (o->type == MSGPACK_OBJECT_BIN) {
        *p = o->via.bin.ptr;
        *n = o->via.bin.size;
        return 1;
    }
    return 0;
}

static void ns_to_ts(int64_t ns, struct timespec *ts)
{
    int64_t sec = ns / (int64_t)NS_PER_SEC, rem = ns % (int64_t)NS_PER_SEC;
    if (rem < 0) {
        sec -= 1;
        rem += (int64_t)NS_PER_SEC;
    }
    ts->tv_sec = (time_t)sec;
    ts->tv_nsec = (long)rem;
}

/* Attributes from a shard's map.  `ino` is the kernel's node id; stat shows
 * `st_ino` (the base file's inode number for base files) when present. */
static int attr_from_node(const msgpack_object *o, struct stat *st, fuse_ino_t *node)
{
    int64_t ino, mode, v;
    memset(st, 0, sizeof *st);
    if (!mp_int(mp_get(o, "ino"), &ino) || !mp_int(mp_get(o, "mode"), &mode))
        return EIO;
    *node = (fuse_ino_t)ino;
    st->st_ino = mp_int(mp_get(o, "st_ino"), &v) && v > 0 ? (ino_t)v : (ino_t)ino;
    st->st_mode = (mode_t)mode;
    st->st_nlink = mp_int(mp_get(o, "nlink"), &v) ? (nlink_t)v : 1;
    st->st_uid = mp_int(mp_get(o, "uid"), &v) ? (uid_t)v : 0;
    st->st_gid = mp_int(mp_get(o, "gid"), &v) ? (gid_t)v : 0;
    st->st_size = mp_int(mp_get(o, "size"), &v) ? (off_t)v : 0;
    st->st_blocks = mp_int(mp_get(o, "blocks"), &v) ? (blkcnt_t)v : (st->st_size + 511) / 512;
    st->st_rdev = mp_int(mp_get(o, "rdev"), &v) ? (dev_t)v : 0;
    st->st_blksize = 4096;
    if (mp_int(mp_get(o, "atime_ns"), &v))
        ns_to_ts(v, &st->st_atim);
    if (mp_int(mp_get(o, "mtime_ns"), &v))
        ns_to_ts(v, &st->st_mtim);
    if (mp_int(mp_get(o, "ctime_ns"), &v))
        ns_to_ts(v, &st->st_ctim);
    return 0;
}

static int attr_from(const msgpack_object *o, struct stat *st)
{
    fuse_ino_t node;
    return attr_from_node(o, st, &node);
}

/* A count result: an int, or a map holding it under `key`. */
static int result_count(const msgpack_object *res, const char *key, int64_t *out)
{
    if (mp_int(res, out))
        return 1;
    return mp_int(mp_get(res, key), out);
}

static void log_error(const char *op, const msgpack_object *error)
{
    fprintf(stderr, "slates-bridge[%d]: %s on %s: ", (int)getpid(), op, g.volume);
    msgpack_object_print(stderr, *error);
    fputc('\n', stderr);
    fflush(stderr);
}

/* Decode the message in buf into g.unp.  Returns 0 with *result for an ok
 * reply, a positive errno for an error reply, -EBADMSG when malformed.
 * *seq receives the reply's sequence number. */
static int decode_reply(const uint8_t *buf, size_t len, uint64_t *seq,
                        const msgpack_object **result, int log)
{
    codec_init();
    msgpack_unpacked_destroy(&g.unp);
    msgpack_unpacked_init(&g.unp);
    size_t off = 0;
    if (msgpack_unpack_next(&g.unp, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS ||
        off != len)
        return -EBADMSG;
    const msgpack_object *top = &g.unp.data;
    if (top->type != MSGPACK_OBJECT_MAP || !mp_uint(mp_get(top, "seq"), seq))
        return -EBADMSG;
    const msgpack_object *ok = mp_get(top, "ok");
    if (ok != NULL && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean) {
        *result = mp_get(top, "result");
        return 0;
    }
    const msgpack_object *error = mp_get(top, "error");
    const char *code = NULL;
    uint32_t n = 0;
    if (!mp_bytes(mp_get(error, "code"), &code, &n))
        return -EBADMSG;
    int err = errno_for(code, n);
    if (log && err == EIO)
        log_error(g.cur_op ? g.cur_op : "?", error);
    return err;
}

/* -- the shard connection --------------------------------------------------- */

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

void bridge_detach(void)
{
    g.attached = 0;
    if (g.req_map != NULL) {
        munmap(g.req_map, g.req_len);
        g.req_map = NULL;
    }
    if (g.rep_map != NULL) {
        munmap(g.rep_map, g.rep_len);
        g.rep_map = NULL;
    }
    close_fd(&g.req_memfd);
    close_fd(&g.req_evfd);
    close_fd(&g.rep_memfd);
    close_fd(&g.rep_evfd);
    close_fd(&g.sock);
}

static int map_ring(int memfd, ring_t *ring, void **map, size_t *len)
{
    int seals = fcntl(memfd, F_GET_SEALS);
    int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    if (seals < 0 || (seals & need) != need)
        return -EPERM; /* an unsealed peer could shrink it under our mapping */
    struct stat st;
    if (fstat(memfd, &st) < 0)
        return -errno;
    if (st.st_size < RING_HEADER_SIZE)
        return -EBADMSG;
    void *mem = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (mem == MAP_FAILED)
        return -errno;
    int rc = ring_attach(ring, mem, (uint64_t)st.st_size);
    if (rc < 0) {
        munmap(mem, (size_t)st.st_size);
        return rc;
    }
    *map = mem;
    *len = (size_t)st.st_size;
    return 0;
}

int bridge_attach(int req_memfd, int req_eventfd, int rep_memfd, int rep_eventfd, int sock_fd)
{
    bridge_detach();
    g.req_memfd = req_memfd;
    g.req_evfd = req_eventfd;
    g.rep_memfd = rep_memfd;
    g.rep_evfd = rep_eventfd;
    g.sock = sock_fd;
    int fds[] = {req_memfd, req_eventfd, rep_memfd, rep_eventfd, sock_fd};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) {
        if (fds[i] < 0) {
            bridge_detach();
            return -EBADF;
        }
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    int rc = map_ring(req_memfd, &g.req, &g.req_map, &g.req_len);
    if (rc == 0)
        rc = map_ring(rep_memfd, &g.rep, &g.rep_map, &g.rep_len);
    if (rc == 0) {
        int fl = fcntl(rep_eventfd, F_GETFL);
        if (fl < 0 || fcntl(rep_eventfd, F_SETFL, fl | O_NONBLOCK) < 0)
            rc = -errno;
    }
    if (rc == 0) {
        uint32_t cap = ring_max_message(&g.rep);
        if (cap > g.reply_cap) {
            uint8_t *buf = realloc(g.reply, cap);
            if (buf == NULL) {
                rc = -ENOMEM;
            } else {
                g.reply = buf;
                g.reply_cap = cap;
            }
        }
    }
    if (rc < 0) {
        bridge_detach();
        return rc;
    }
    uint32_t most = ring_max_message(&g.req);
    if (ring_max_message(&g.rep) < most)
        most = ring_max_message(&g.rep);
    uint32_t chunk = most > 2 * IO_HEADROOM ? (most - IO_HEADROOM) & ~(IO_HEADROOM - 1) : 0;
    if (chunk < IO_HEADROOM) {
        bridge_detach();
        return -EMSGSIZE;
    }
    g.io_chunk = chunk > BRIDGE_MAX_IO ? BRIDGE_MAX_IO : chunk;
    g.attached = 1;
    return 0;
}

int bridge_set_cache_timeout(double seconds)
{
    if (g.se != NULL || !(seconds >= 0.0 && seconds <= BRIDGE_TIMEOUT_SECONDS))
        return -EINVAL;
    g.cache_timeout = seconds;
    return 0;
}

int bridge_configure(const char *volume, uint64_t spin_ns)
{
    if (volume == NULL || strlen(volume) == 0 || strlen(volume) >= sizeof g.volume)
        return -EINVAL;
    strcpy(g.volume, volume);
    g.spin_ns = spin_ns;
    codec_init();
    return 0;
}

/* Any event on the socket (data, EOF, error) means the shard is gone: it
 * sends nothing there once the rings are in use. */
static int socket_gone(short revents) { return revents != 0; }

static int shard_alive(void)
{
    struct pollfd p = {.fd = g.sock, .events = POLLIN | POLLRDHUP};
    int n = poll(&p, 1, 0);
    return !(n > 0 && socket_gone(p.revents));
}

static int stopping_too_long(void)
{
    if (!g.stop && !(g.se != NULL && fuse_session_exited(g.se)))
        return 0;
    uint64_t now = now_ns(CLOCK_MONOTONIC);
    if (g.stop_ns == 0)
        g.stop_ns = now;
    return now - g.stop_ns > SHUTDOWN_GRACE_NS;
}

/* 0: pushed; -EPIPE: connection lost; -EMSGSIZE: too large for the ring. */
static int push_request(const uint8_t *msg, uint32_t len)
{
    for (;;) {
        int rc = ring_push(&g.req, msg, len);
        if (rc == 0)
            return ring_notify(&g.req, g.req_evfd) < 0 ? -EPIPE : 0;
        if (rc == -EMSGSIZE)
            return rc;
        if (rc != -EAGAIN || !shard_alive())
            return -EPIPE;
        /* Bounded ring and the shard is behind: wait for it to drain. */
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 50000};
        nanosleep(&ts, NULL);
    }
}

/* Wait for the reply to g.cur_seq.  0: decoded (*status holds 0 with
 * *result, or a positive errno); -EPIPE: connection lost; -ETIMEDOUT: told
 * to stop and the shard did not answer within the grace period. */
static int wait_reply(int *status, const msgpack_object **result)
{
    for (;;) {
        int n = ring_pop(&g.rep, g.reply, g.reply_cap);
        if (n >= 0) {
            uint64_t seq = 0;
            g.reply_len = (uint32_t)n;
            int rc = decode_reply(g.reply, (size_t)n, &seq, result, 1);
            if (rc == -EBADMSG) {
                fprintf(stderr, "slates-bridge: undecodable reply from the shard\n");
                return -EPIPE;
            }
            if (seq != 0 && seq < g.cur_seq)
                continue; /* an answer to a request we gave up on */
            if (seq != 0 && seq != g.cur_seq) {
                fprintf(stderr, "slates-bridge: a reply answered another request\n");
                return -EPIPE;
            }
            *status = rc;
            return 0;
        }
        if (n != -EAGAIN)
            return -EPIPE; /* a corrupt ring: start over on a fresh pair */
        if (g.spin_ns > 0 && ring_spin_wait(&g.rep, g.spin_ns))
            continue;
        if (ring_prepare_park(&g.rep))
            continue;
        struct pollfd p[2] = {
            {.fd = g.rep_evfd, .events = POLLIN},
            {.fd = g.sock, .events = POLLIN | POLLRDHUP},
        };
        int pr = poll(p, 2, 1000);
        ring_unpark(&g.rep);
        if (ring_drain_eventfd(g.rep_evfd) < 0)
            return -EPIPE;
        if (pr < 0 && errno != EINTR)
            return -EPIPE;
        if (pr > 0 && socket_gone(p[1].revents)) {
            /* The shard may have replied just before it went: take that. */
            if (ring_peek_length(&g.rep) >= 0)
                continue;
            return -EPIPE;
        }
        if (stopping_too_long())
            return -ETIMEDOUT;
    }
}

/* One attempt at a fresh hello, through Python. */
static int reconnect_once(void)
{
    bridge_detach();
    int rc = bridge_reconnect_cb();
    if (rc == 0 && !g.attached)
        rc = -ENOTCONN;
    if (rc == 0)
        count(BRIDGE_STAT_RECONNECTS);
    return rc;
}

/* Send the request in g.sbuf and wait for its reply, reconnecting and
 * resending the same bytes (same seq) when the shard goes away.  Returns 0
 * with *result, or a positive errno. */
static int call(const msgpack_object **result)
{
    const uint8_t *msg = (const uint8_t *)g.sbuf.data;
    uint32_t len = (uint32_t)g.sbuf.size;
    unsigned delay_ms = 10;
    *result = NULL;
    g.reply_len = 0;
    for (;;) {
        if (!g.attached) {
            int rc = reconnect_once();
            if (rc < 0) {
                uint64_t now = now_ns(CLOCK_MONOTONIC);
                if (g.down_since_ns == 0)
                    g.down_since_ns = now;
                if (now - g.down_since_ns > (uint64_t)BRIDGE_RECONNECT_SECONDS * NS_PER_SEC ||
                    stopping_too_long() || g.stop) {
                    count(BRIDGE_STAT_FAILED);
                    return EIO;
                }
                sleep_ms(delay_ms);
                delay_ms = delay_ms * 2 > 500 ? 500 : delay_ms * 2;
                continue;
            }
        }
        int rc = push_request(msg, len);
        int status = 0;
        if (rc == -EMSGSIZE) {
            fprintf(stderr, "slates-bridge: %s request of %u bytes exceeds the ring\n",
                    g.cur_op, len);
            return EIO;
        }
        if (rc == 0)
            rc = wait_reply(&status, result);
        if (rc == 0) {
            g.down_since_ns = 0;
            count(BRIDGE_STAT_ROUND_TRIPS);
            return status;
        }
        if (rc == -ETIMEDOUT) {
            count(BRIDGE_STAT_FAILED);
            return EIO;
        }
        if (g.down_since_ns == 0) {
            g.down_since_ns = now_ns(CLOCK_MONOTONIC);
            fprintf(stderr, "slates-bridge: lost the shard during %s; reconnecting\n", g.cur_op);
        }
        bridge_detach();
    }
}

int bridge_request(const char *op, const uint8_t *args, uint32_t args_len, uint8_t *out,
                   uint32_t cap)
{
    envelope_begin(op);
    msgpack_sbuffer_write(&g.sbuf, (const char *)args, args_len);
    const msgpack_object *result;
    (void)call(&result);
    if (g.reply_len == 0)
        return -EIO; /* the shard never answered */
    if (g.reply_len > cap)
        return -EMSGSIZE;
    memcpy(out, g.reply, g.reply_len);
    return (int)g.reply_len;
}

/* -- xattrs known to be absent ----------------------------------------------------
 *
 * The kernel and common tools probe a few xattr names constantly: every
 * write(2) makes the kernel ask for "security.capability" (FUSE inodes never
 * get S_NOSEC), and `ls -l` asks for ACLs and SELinux labels.  The shard's
 * "no such attribute" for one of these names is remembered per inode, so
 * only the first probe costs a round trip; a setxattr/removexattr of that
 * name through this mount, or a forget of the inode, drops the memory.
 * Keys are (ino << 3 | name index) in a linear-probing set (0 is empty). */

static const char *const PROBED_XATTRS[] = {
    "security.capability",
    "system.posix_acl_access",
    "system.posix_acl_default",
    "security.selinux",
};
#define PROBED_COUNT (sizeof PROBED_XATTRS / sizeof PROBED_XATTRS[0])

static uint64_t absent_key(uint64_t ino, const char *name)
{
    if (ino == 0 || ino >> 60)
        return 0;
    for (size_t i = 0; i < PROBED_COUNT; i++) {
        if (strcmp(name, PROBED_XATTRS[i]) == 0)
            return ino << 3 | (i + 1);
    }
    return 0;
}

static struct {
    uint64_t *slots;
    size_t cap; /* power of two, or 0 */
    size_t len;
} g_absent;
/* The loop thread reads and fills the set; the watcher thread empties an
 * inode's entries when another client changes it (notify_inval_inode). */
static pthread_mutex_t g_absent_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t absent_home(uint64_t ino, size_t cap)
{
    return (size_t)((ino * 0x9e3779b97f4a7c15ull) >> 17) & (cap - 1);
}

static int absent_has_locked(uint64_t ino)
{
    if (g_absent.cap == 0 || ino == 0)
        return 0;
    for (size_t i = absent_home(ino, g_absent.cap);; i = (i + 1) & (g_absent.cap - 1)) {
        if (g_absent.slots[i] == ino)
            return 1;
        if (g_absent.slots[i] == 0)
            return 0;
    }
}

static void absent_put(uint64_t *slots, size_t cap, uint64_t ino)
{
    size_t i = absent_home(ino, cap);
    while (slots[i] != 0 && slots[i] != ino)
        i = (i + 1) & (cap - 1);
    slots[i] = ino;
}

static void absent_add_locked(uint64_t ino)
{
    if (ino == 0 || absent_has_locked(ino))
        return;
    if (2 * (g_absent.len + 1) > g_absent.cap) {
        size_t cap = g_absent.cap ? 2 * g_absent.cap : 1024;
        uint64_t *slots = calloc(cap, sizeof *slots);
        if (slots == NULL)
            return; /* only a cache */
        for (size_t i = 0; i < g_absent.cap; i++) {
            if (g_absent.slots[i] != 0)
                absent_put(slots, cap, g_absent.slots[i]);
        }
        free(g_absent.slots);
        g_absent.slots = slots;
        g_absent.cap = cap;
    }
    absent_put(g_absent.slots, g_absent.cap, ino);
    g_absent.len++;
}

static void absent_remove_locked(uint64_t ino)
{
    if (g_absent.cap == 0 || ino == 0)
        return;
    size_t mask = g_absent.cap - 1, i = absent_home(ino, g_absent.cap);
    while (g_absent.slots[i] != ino) {
        if (g_absent.slots[i] == 0)
            return;
        i = (i + 1) & mask;
    }
    /* Backward-shift deletion keeps every probe chain unbroken. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; g_absent.slots[j] != 0; j = (j + 1) & mask) {
        size_t home = absent_home(g_absent.slots[j], g_absent.cap);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            g_absent.slots[hole] = g_absent.slots[j];
            hole = j;
        }
    }
    g_absent.slots[hole] = 0;
    g_absent.len--;
}

static int absent_has(uint64_t key)
{
    pthread_mutex_lock(&g_absent_lock);
    int found = absent_has_locked(key);
    pthread_mutex_unlock(&g_absent_lock);
    return found;
}

static void absent_add(uint64_t key)
{
    pthread_mutex_lock(&g_absent_lock);
    absent_add_locked(key);
    pthread_mutex_unlock(&g_absent_lock);
}

static void absent_remove(uint64_t key)
{
    pthread_mutex_lock(&g_absent_lock);
    absent_remove_locked(key);
    pthread_mutex_unlock(&g_absent_lock);
}

/* Forget every probed name's absence for one inode. */
static void absent_forget_inode(uint64_t ino)
{
    for (size_t i = 0; i < PROBED_COUNT; i++) {
        if (ino != 0 && !(ino >> 60))
            absent_remove(ino << 3 | (i + 1));
    }
}

int bridge_test_absent_set(const uint64_t *ops, uint32_t n, uint64_t probe)
{
    /* ops: keys to add, or ~key (high bit set) to remove */
    for (uint32_t k = 0; k < n; k++) {
        if (ops[k] >> 63)
            absent_remove(~ops[k]);
        else
            absent_add(ops[k]);
    }
    return absent_has(probe);
}

/* -- FUSE callbacks ------------------------------------------------------------ */

static void reply_entry_from(fuse_req_t req, const msgpack_object *res, int create,
                             struct fuse_file_info *fi)
{
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    if (attr_from_node(res, &e.attr, &e.ino) != 0) {
        fuse_reply_err(req, EIO);
        return;
    }
    e.attr_timeout = g.cache_timeout;
    e.entry_timeout = g.cache_timeout;
    if (create) {
        fi->fh = 0;
        fi->keep_cache = 1;
        fuse_reply_create(req, &e, fi);
    } else {
        fuse_reply_entry(req, &e);
    }
}

static void answer_entry(fuse_req_t req)
{
    const msgpack_object *res;
    int rc = call(&res);
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        reply_entry_from(req, res, 0, NULL);
}

static void answer_empty(fuse_req_t req)
{
    const msgpack_object *res;
    fuse_reply_err(req, call(&res));
}

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    unsigned want = FUSE_CAP_WRITEBACK_CACHE | FUSE_CAP_NO_OPEN_SUPPORT |
                    FUSE_CAP_NO_OPENDIR_SUPPORT | FUSE_CAP_READDIRPLUS |
                    FUSE_CAP_AUTO_INVAL_DATA | FUSE_CAP_ASYNC_READ;
    if (!g.writeback)
        want &= ~(unsigned)FUSE_CAP_WRITEBACK_CACHE;
    conn->want |= want & conn->capable;
    if (!g.writeback)
        conn->want &= ~(unsigned)FUSE_CAP_WRITEBACK_CACHE;
    /* Always readdirplus: entries come with their attributes and inode
     * numbers, which plain readdir cannot promise for unbound base names. */
    conn->want &= ~(unsigned)FUSE_CAP_READDIRPLUS_AUTO;
    conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
    /* OPEN is never sent (no_open), so it cannot truncate: without this the
     * kernel would trust OPEN with O_TRUNC and the truncation would be lost.
     * Off, the kernel sends O_TRUNC as a SETATTR of size 0. */
    conn->want &= ~(unsigned)FUSE_CAP_ATOMIC_O_TRUNC;
    conn->max_write = BRIDGE_MAX_IO;
    conn->max_read = BRIDGE_MAX_IO;
    conn->max_readahead = BRIDGE_MAX_IO;
    conn->time_gran = 1;
}

/* The kernel dropped every reference (unmount): tell the shard at once. */
static void op_destroy(void *userdata)
{
    (void)userdata;
    const msgpack_object *res;
    if (!g.attached)
        return; /* a fresh shard holds no references of this session's */
    req_begin("fs.destroy", 0);
    (void)call(&res);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    const msgpack_object *res;
    enc_lookup(parent, name);
    int rc = call(&res);
    if (rc == ENOENT) {
        /* A negative entry the kernel keeps as long as a positive one. */
        struct fuse_entry_param e;
        memset(&e, 0, sizeof e);
        e.ino = 0;
        e.entry_timeout = g.cache_timeout;
        fuse_reply_entry(req, &e);
        return;
    }
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    reply_entry_from(req, res, 0, NULL);
}

static void send_forgets(const struct fuse_forget_data *items, size_t n)
{
    const msgpack_object *res;
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < PROBED_COUNT; k++) {
            if (items[i].ino >> 60 == 0)
                absent_remove(items[i].ino << 3 | (k + 1));
        }
    }
    /* Keep each message well inside the ring: ~20 bytes an item. */
    while (n > 0) {
        size_t batch = n > 4096 ? 4096 : n;
        enc_forget(items, batch);
        (void)call(&res);
        items += batch;
        n -= batch;
    }
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    struct fuse_forget_data item = {.ino = ino, .nlookup = nlookup};
    send_forgets(&item, 1);
    fuse_reply_none(req);
}

static void op_forget_multi(fuse_req_t req, size_t count_, struct fuse_forget_data *forgets)
{
    send_forgets(forgets, count_);
    fuse_reply_none(req);
}

/* Send the encoded request and answer the kernel with the ATTR it returns. */
static void reply_attr(fuse_req_t req)
{
    const msgpack_object *res;
    struct stat st;
    int rc = call(&res);
    if (rc == 0)
        rc = attr_from(res, &st);
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        fuse_reply_attr(req, &st, g.cache_timeout);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    enc_ino("fs.getattr", ino);
    reply_attr(req);
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi)
{
    (void)fi;
    enc_setattr(ino, attr, to_set);
    reply_attr(req);
}

static void op_readlink(fuse_req_t req, fuse_ino_t ino)
{
    const msgpack_object *res;
    const char *p = NULL;
    uint32_t n = 0;
    enc_ino("fs.readlink", ino);
    int rc = call(&res);
    if (rc == 0 && !mp_bytes(res, &p, &n))
        rc = EIO;
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    char *target = malloc((size_t)n + 1);
    if (target == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    memcpy(target, p, n);
    target[n] = '\0';
    fuse_reply_readlink(req, target);
    free(target);
}

static void op_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                     dev_t rdev)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    enc_mknod(parent, name, mode, rdev, ctx->uid, ctx->gid);
    answer_entry(req);
}

static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    enc_mkdir(parent, name, mode, ctx->uid, ctx->gid);
    answer_entry(req);
}

static void op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    enc_entry_name("fs.unlink", parent, name);
    answer_empty(req);
}

static void op_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    enc_entry_name("fs.rmdir", parent, name);
    answer_empty(req);
}

static void op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    enc_symlink(parent, name, link, ctx->uid, ctx->gid);
    answer_entry(req);
}

static void op_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags)
{
    enc_rename(parent, name, newparent, newname, flags);
    answer_empty(req);
}

static void op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{
    enc_link(ino, newparent, newname);
    answer_entry(req);
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    const msgpack_object *res;
    enc_create(parent, name, mode, ctx->uid, ctx->gid, (fi->flags & O_EXCL) != 0);
    int rc = call(&res);
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        reply_entry_from(req, res, 1, fi);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS); /* no_open: the kernel stops asking, keeps its caches */
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, 0);
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS); /* dirty pages are written back before FLUSH anyway */
}

/* One fs.read of at most io_chunk bytes.  Returns bytes copied into dst (or,
 * when dst is NULL, points *direct at them in the reply buffer), or -errno. */
static long read_chunk(fuse_ino_t ino, uint64_t off, size_t size, char *dst, const char **direct)
{
    const msgpack_object *res;
    const char *p = NULL;
    uint32_t n = 0;
    enc_read(ino, off, size);
    int rc = call(&res);
    if (rc != 0)
        return -rc;
    if (!mp_bytes(res, &p, &n))
        return -EIO;
    if (n > size)
        n = (uint32_t)size;
    if (dst != NULL)
        memcpy(dst, p, n);
    else
        *direct = p;
    return (long)n;
}

static uint32_t io_chunk(void) { return g.io_chunk ? g.io_chunk : 256u << 10; }

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void)fi;
    uint32_t chunk = io_chunk();
    if (size <= chunk) {
        const char *p = NULL;
        long n = read_chunk(ino, (uint64_t)off, size, NULL, &p);
        if (n < 0)
            fuse_reply_err(req, (int)-n);
        else
            fuse_reply_buf(req, p, (size_t)n);
        return;
    }
    char *buf = malloc(size);
    if (buf == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t done = 0;
    while (done < size) {
        size_t want = size - done > chunk ? chunk : size - done;
        long n = read_chunk(ino, (uint64_t)off + done, want, buf + done, NULL);
        if (n < 0) {
            if (done == 0) {
                free(buf);
                fuse_reply_err(req, (int)-n);
                return;
            }
            break;
        }
        done += (size_t)n;
        if ((size_t)n < want)
            break; /* end of file */
    }
    fuse_reply_buf(req, buf, done);
    free(buf);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi)
{
    (void)fi;
    uint32_t chunk = io_chunk();
    size_t done = 0;
    int err = 0;
    do {
        const msgpack_object *res;
        int64_t written;
        size_t n = size - done > chunk ? chunk : size - done;
        enc_write(ino, (uint64_t)off + done, buf + done, n);
        err = call(&res);
        if (err == 0 && (!result_count(res, "written", &written) || written < 0 ||
                         (uint64_t)written > n))
            err = EIO;
        if (err != 0)
            break;
        done += (size_t)written;
        if ((size_t)written < n)
            break;
    } while (done < size);
    if (err != 0 && done == 0)
        fuse_reply_err(req, err);
    else
        fuse_reply_write(req, done);
}

static void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    (void)datasync;
    (void)fi;
    enc_ino("fs.fsync", ino);
    answer_empty(req);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS); /* no_opendir: the kernel caches directory contents */
}

static void do_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, int plus)
{
    const msgpack_object *res;
    enc_readdir(ino, (uint64_t)off, plus, size);
    int rc = call(&res);
    if (rc == 0 && (res == NULL || res->type != MSGPACK_OBJECT_ARRAY))
        rc = EIO;
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    uint32_t count_ = res->via.array.size;
    char *buf = malloc(size ? size : 1);
    struct fuse_forget_data *unsent = calloc(count_ ? count_ : 1, sizeof *unsent);
    char *name = malloc(NAME_MAX * 4 + 1);
    if (buf == NULL || unsent == NULL || name == NULL) {
        free(buf);
        free(unsent);
        free(name);
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t used = 0, nunsent = 0;
    int full = 0;
    for (uint32_t i = 0; i < count_; i++) {
        const msgpack_object *item = &res->via.array.ptr[i];
        const char *p = NULL;
        uint32_t n = 0;
        int64_t kind, ino_, next;
        if (item->type != MSGPACK_OBJECT_ARRAY || item->via.array.size < 4 ||
            !mp_bytes(&item->via.array.ptr[0], &p, &n) || n > NAME_MAX * 4 ||
            !mp_int(&item->via.array.ptr[1], &kind) || !mp_int(&item->via.array.ptr[2], &ino_) ||
            !mp_int(&item->via.array.ptr[3], &next)) {
            rc = EIO;
            break;
        }
        memcpy(name, p, n);
        name[n] = '\0';
        const msgpack_object *attr = item->via.array.size > 4 ? &item->via.array.ptr[4] : NULL;
        int has_attr = attr != NULL && attr->type == MSGPACK_OBJECT_MAP;
        size_t need;
        if (plus) {
            struct fuse_entry_param e;
            memset(&e, 0, sizeof e);
            if (has_attr && attr_from_node(attr, &e.attr, &e.ino) == 0) {
                e.attr_timeout = g.cache_timeout;
                e.entry_timeout = g.cache_timeout;
            } else {
                e.attr.st_ino = (ino_t)ino_;
                e.attr.st_mode = (mode_t)kind;
            }
            need = full ? size + 1 : fuse_add_direntry_plus(req, buf + used, size - used, name, &e, next);
            if (need > size - used) {
                /* The shard counted a lookup the kernel will never see. */
                full = 1;
                if (has_attr && e.ino != 0) {
                    unsent[nunsent].ino = e.ino;
                    unsent[nunsent].nlookup = 1;
                    nunsent++;
                }
                continue;
            }
        } else {
            struct stat st;
            memset(&st, 0, sizeof st);
            st.st_ino = (ino_t)ino_;
            st.st_mode = (mode_t)kind;
            need = fuse_add_direntry(req, buf + used, size - used, name, &st, next);
            if (need > size - used)
                break;
        }
        used += need;
    }
    if (rc != 0 && used == 0)
        fuse_reply_err(req, rc);
    else
        fuse_reply_buf(req, buf, used);
    if (nunsent > 0)
        send_forgets(unsent, nunsent);
    free(buf);
    free(unsent);
    free(name);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 0);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                           struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 1);
}

static void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, 0);
}

static void op_fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    op_fsync(req, ino, datasync, fi);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    (void)ino;
    const msgpack_object *res;
    enc_statfs();
    int rc = call(&res);
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    struct statvfs sv;
    memset(&sv, 0, sizeof sv);
    uint64_t v;
    sv.f_bsize = mp_uint(mp_get(res, "bsize"), &v) ? v : 4096;
    sv.f_frsize = mp_uint(mp_get(res, "frsize"), &v) ? v : sv.f_bsize;
    sv.f_blocks = mp_uint(mp_get(res, "blocks"), &v) ? v : 0;
    sv.f_bfree = mp_uint(mp_get(res, "bfree"), &v) ? v : 0;
    sv.f_bavail = mp_uint(mp_get(res, "bavail"), &v) ? v : sv.f_bfree;
    sv.f_files = mp_uint(mp_get(res, "files"), &v) ? v : 0;
    sv.f_ffree = mp_uint(mp_get(res, "ffree"), &v) ? v : 0;
    sv.f_favail = sv.f_ffree;
    sv.f_namemax = mp_uint(mp_get(res, "namemax"), &v) ? v : 255;
    fuse_reply_statfs(req, &sv);
}

static void op_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value,
                        size_t size, int flags)
{
    absent_remove(absent_key(ino, name));
    enc_setxattr(ino, name, value, size, flags);
    answer_empty(req);
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    const msgpack_object *res;
    const char *p = NULL;
    uint32_t n = 0;
    uint64_t key = absent_key(ino, name);
    if (key != 0 && absent_has(key)) {
        fuse_reply_err(req, ENODATA);
        return;
    }
    enc_ino_name("fs.getxattr", ino, name);
    int rc = call(&res);
    if (rc == 0 && !mp_bytes(res, &p, &n))
        rc = EIO;
    if (key != 0 && rc == ENODATA)
        absent_add(key);
    if (rc != 0)
        fuse_reply_err(req, rc);
    else if (size == 0)
        fuse_reply_xattr(req, n);
    else if (n > size)
        fuse_reply_err(req, ERANGE);
    else
        fuse_reply_buf(req, p, n);
}

static void op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size)
{
    const msgpack_object *res;
    enc_ino("fs.listxattr", ino);
    int rc = call(&res);
    if (rc == 0 && (res == NULL || res->type != MSGPACK_OBJECT_ARRAY))
        rc = EIO;
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    size_t total = 0;
    for (uint32_t i = 0; i < res->via.array.size; i++) {
        const char *p = NULL;
        uint32_t n = 0;
        if (!mp_bytes(&res->via.array.ptr[i], &p, &n)) {
            fuse_reply_err(req, EIO);
            return;
        }
        total += (size_t)n + 1;
    }
    if (size == 0) {
        fuse_reply_xattr(req, total);
        return;
    }
    if (total > size) {
        fuse_reply_err(req, ERANGE);
        return;
    }
    char *buf = malloc(total ? total : 1);
    if (buf == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t at = 0;
    for (uint32_t i = 0; i < res->via.array.size; i++) {
        const char *p = NULL;
        uint32_t n = 0;
        mp_bytes(&res->via.array.ptr[i], &p, &n);
        memcpy(buf + at, p, n);
        buf[at + n] = '\0';
        at += (size_t)n + 1;
    }
    fuse_reply_buf(req, buf, total);
    free(buf);
}

static void op_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name)
{
    absent_remove(absent_key(ino, name));
    enc_ino_name("fs.removexattr", ino, name);
    answer_empty(req);
}

static void op_access(fuse_req_t req, fuse_ino_t ino, int mask)
{
    enc_access(ino, mask);
    answer_empty(req);
}

static void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                         struct fuse_file_info *fi)
{
    (void)fi;
    enc_fallocate(ino, mode, (uint64_t)offset, (uint64_t)length);
    answer_empty(req);
}

static void op_lseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence,
                     struct fuse_file_info *fi)
{
    (void)fi;
    if (g.writeback) {
        /* With the writeback cache the kernel may hold data the shard has
         * not seen yet: a hole the shard reports could hide it (cp would
         * skip it).  ENOSYS makes the kernel answer from its own size,
         * treating the whole file as data, which is always safe. */
        fuse_reply_err(req, ENOSYS);
        return;
    }
    const msgpack_object *res;
    int64_t at;
    enc_lseek(ino, (uint64_t)off, whence);
    int rc = call(&res);
    if (rc == 0 && (!result_count(res, "offset", &at) || at < 0))
        rc = EIO;
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        fuse_reply_lseek(req, (off_t)at);
}

static void op_copy_file_range(fuse_req_t req, fuse_ino_t ino_in, off_t off_in,
                               struct fuse_file_info *fi_in, fuse_ino_t ino_out, off_t off_out,
                               struct fuse_file_info *fi_out, size_t len, int flags)
{
    (void)fi_in;
    (void)fi_out;
    if (flags != 0) {
        fuse_reply_err(req, EINVAL);
        return;
    }
    const msgpack_object *res;
    int64_t copied;
    enc_copy_file_range(ino_in, (uint64_t)off_in, ino_out, (uint64_t)off_out, len);
    int rc = call(&res);
    if (rc == 0 && (!result_count(res, "copied", &copied) || copied < 0))
        rc = EIO;
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        fuse_reply_write(req, (size_t)copied);
}

static const struct fuse_lowlevel_ops OPS = {
    .init = op_init,
    .destroy = op_destroy,
    .lookup = op_lookup,
    .forget = op_forget,
    .forget_multi = op_forget_multi,
    .getattr = op_getattr,
    .setattr = op_setattr,
    .readlink = op_readlink,
    .mknod = op_mknod,
    .mkdir = op_mkdir,
    .unlink = op_unlink,
    .rmdir = op_rmdir,
    .symlink = op_symlink,
    .rename = op_rename,
    .link = op_link,
    .open = op_open,
    .read = op_read,
    .write = op_write,
    .flush = op_flush,
    .release = op_release,
    .fsync = op_fsync,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .readdirplus = op_readdirplus,
    .releasedir = op_releasedir,
    .fsyncdir = op_fsyncdir,
    .statfs = op_statfs,
    .setxattr = op_setxattr,
    .getxattr = op_getxattr,
    .listxattr = op_listxattr,
    .removexattr = op_removexattr,
    .access = op_access,
    .create = op_create,
    .fallocate = op_fallocate,
    .lseek = op_lseek,
    .copy_file_range = op_copy_file_range,
};

/* -- the session ---------------------------------------------------------------- */

int bridge_mount(const char *mountpoint, int allow_other, int auto_unmount, int writeback)
{
    if (g.se != NULL)
        return -EBUSY;
    g.writeback = writeback != 0;
    char opts[256];
    snprintf(opts, sizeof opts,
             "default_permissions,fsname=slates,subtype=slates,max_read=%u%s%s", BRIDGE_MAX_IO,
             allow_other ? ",allow_other" : "", auto_unmount ? ",auto_unmount" : "");
    struct fuse_args args = FUSE_ARGS_INIT(0, NULL);
    if (fuse_opt_add_arg(&args, "slates-bridge") != 0 || fuse_opt_add_arg(&args, "-o") != 0 ||
        fuse_opt_add_arg(&args, opts) != 0) {
        fuse_opt_free_args(&args);
        return -ENOMEM;
    }
    struct fuse_session *se = fuse_session_new(&args, &OPS, sizeof OPS, NULL);
    fuse_opt_free_args(&args);
    if (se == NULL)
        return -EINVAL;
    if (fuse_session_mount(se, mountpoint) != 0) {
        fuse_session_destroy(se);
        return -EIO;
    }
    g.se = se;
    return 0;
}

static void on_signal(int sig)
{
    (void)sig;
    g.stop = 1;
    if (g.se != NULL)
        fuse_session_exit(g.se);
}

void bridge_exit(void) { on_signal(0); }

int bridge_run(int ready_fd)
{
    if (g.se == NULL)
        return -EINVAL;
    static const int SIGNALS[] = {SIGTERM, SIGINT, SIGHUP};
    struct sigaction old[3], sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: a blocked read must return EINTR */
    for (int i = 0; i < 3; i++)
        sigaction(SIGNALS[i], &sa, &old[i]);
    int rc = 0;
    struct fuse_buf fbuf;
    memset(&fbuf, 0, sizeof fbuf);
    while (!g.stop && !fuse_session_exited(g.se)) {
        int res = fuse_session_receive_buf(g.se, &fbuf);
        if (res == -EINTR || res == -EAGAIN)
            continue;
        if (res <= 0) {
            rc = res;
            break;
        }
        uint32_t opcode = 0;
        if (!(fbuf.flags & FUSE_BUF_IS_FD) && (size_t)res >= 8) {
            memcpy(&opcode, (const char *)fbuf.mem + 4, sizeof opcode);
            count(opcode < BRIDGE_OPCODES ? (int)opcode : 0);
        }
        fuse_session_process_buf(g.se, &fbuf);
        if (opcode == BRIDGE_OP_INIT && ready_fd >= 0) {
            ssize_t w;
            do
                w = write(ready_fd, "1", 1);
            while (w < 0 && errno == EINTR);
            close(ready_fd);
            ready_fd = -1;
        }
    }
    free(fbuf.mem);
    if (ready_fd >= 0)
        close(ready_fd);
    for (int i = 0; i < 3; i++)
        sigaction(SIGNALS[i], &old[i], NULL);
    return rc == -ENODEV ? 0 : rc;
}

/* Called from the watcher thread while the session loop runs (libfuse's
 * notify calls are safe from another thread).  -ENOENT (the kernel does not
 * know the inode or name) is not an error: there is nothing to forget. */
int bridge_notify_inval_inode(uint64_t ino)
{
    if (g.se == NULL)
        return -ENOTCONN;
    absent_forget_inode(ino); /* another client may have set one of them */
    int rc = fuse_lowlevel_notify_inval_inode(g.se, (fuse_ino_t)ino, 0, 0);
    return rc == -ENOENT ? 0 : rc;
}

int bridge_notify_inval_entry(uint64_t parent, const char *name, size_t namelen)
{
    if (g.se == NULL)
        return -ENOTCONN;
    int rc = fuse_lowlevel_notify_inval_entry(g.se, (fuse_ino_t)parent, name, namelen);
    return rc == -ENOENT ? 0 : rc;
}

void bridge_unmount(void)
{
    if (g.se != NULL) {
        fuse_session_unmount(g.se);
        fuse_session_destroy(g.se);
        g.se = NULL;
    }
    bridge_detach();
}

/* -- tests ----------------------------------------------------------------------- */

int bridge_test_encode(int which, uint8_t *out, uint32_t cap, char *op_out, uint32_t op_cap)
{
    static const char DATA[] = "hello\0world";
    struct fuse_forget_data items[2] = {{.ino = 5, .nlookup = 2}, {.ino = 7, .nlookup = 1}};
    struct stat st;
    memset(&st, 0, sizeof st);
    st.st_mode = S_IFREG | 0640;
    st.st_uid = 1000;
    st.st_gid = 1001;
    st.st_size = 4096;
    st.st_atim.tv_sec = 1;
    st.st_atim.tv_nsec = 1;
    if (g.volume[0] == '\0')
        return -EINVAL;
    switch (which) {
    case 0: enc_lookup(1, "h\xc3\xa9llo"); break;
    case 1: enc_lookup(1, "\xff\xfe"); break;
    case 2: enc_forget(items, 2); break;
    case 3: enc_ino("fs.getattr", 5); break;
    case 4:
        enc_setattr(5, &st,
                    FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID |
                        FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME |
                        FUSE_SET_ATTR_MTIME_NOW);
        break;
    case 5: enc_ino("fs.readlink", 9); break;
    case 6: enc_mknod(1, "fifo", S_IFIFO | 0644, 0, 1, 2); break;
    case 7: enc_mkdir(1, "d", S_IFDIR | 0755, 1, 2); break;
    case 8: enc_entry_name("fs.unlink", 1, "f"); break;
    case 9: enc_entry_name("fs.rmdir", 1, "d"); break;
    case 10: enc_symlink(1, "l", "../target", 1, 2); break;
    case 11: enc_rename(1, "a", 2, "b", 1); break;
    case 12: enc_link(5, 2, "h"); break;
    case 13: enc_create(1, "c", S_IFREG | 0600, 1, 2, 1); break;
    case 14: enc_read(5, 4096, 65536); break;
    case 15: enc_write(5, 10, DATA, sizeof DATA - 1); break;
    case 16: enc_ino("fs.fsync", 5); break;
    case 17: enc_statfs(); break;
    case 18: enc_readdir(1, 0, 1, 4096); break;
    case 19: enc_setxattr(5, "user.k", "v\0", 2, 1); break;
    case 20: enc_ino_name("fs.getxattr", 5, "user.k"); break;
    case 21: enc_ino("fs.listxattr", 5); break;
    case 22: enc_ino_name("fs.removexattr", 5, "user.k"); break;
    case 23: enc_fallocate(5, 1, 0, 8192); break;
    case 24: enc_lseek(5, 100, 3); break;
    case 25: enc_copy_file_range(5, 0, 6, 4096, 1ull << 30); break;
    case 26: enc_access(5, 4); break;
    case 27: enc_create(1, "c", S_IFREG | 0644, 1, 2, 0); break;
    default: return -ENOENT;
    }
    if (g.sbuf.size > cap || strlen(g.cur_op) >= op_cap)
        return -EMSGSIZE;
    memcpy(out, g.sbuf.data, g.sbuf.size);
    strcpy(op_out, g.cur_op);
    return (int)g.sbuf.size;
}

int bridge_test_decode_attr(const uint8_t *msg, uint32_t len, int64_t *out)
{
    uint64_t seq;
    const msgpack_object *res = NULL;
    int rc = decode_reply(msg, len, &seq, &res, 0);
    if (rc != 0)
        return rc;
    struct stat st;
    if (attr_from(res, &st) != 0)
        return -EBADMSG;
    out[0] = (int64_t)st.st_ino;
    out[1] = st.st_mode;
    out[2] = (int64_t)st.st_nlink;
    out[3] = st.st_uid;
    out[4] = st.st_gid;
    out[5] = st.st_size;
    out[6] = st.st_blocks;
    out[7] = ts_ns(&st.st_atim);
    out[8] = ts_ns(&st.st_mtim);
    out[9] = ts_ns(&st.st_ctim);
    out[10] = (int64_t)st.st_rdev;
    return 0;
}
