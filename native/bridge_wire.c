/*
 * The bridge's wire format (slates/fuse/PROTOCOL.md): msgpack requests of
 * the form {"seq", "ack", "op": "fs.<name>", "args": {"volume", ...}} and
 * the shard's replies {"seq", "ok", "result" | "error": {"code", ...}}.
 *
 * Theory of operation: one encoder per FUSE operation writes one whole
 * request into g_bridge.sbuf (the callbacks in bridge_ops.c and the tests
 * share them, so the tests check the bytes the kernel's requests become);
 * decode_reply parses one reply into g_bridge.unp, which stays valid until
 * the next decode (callers read the result in place, no copies).  Names and
 * symlink targets go as msgpack str when they are strict UTF-8 and as bin
 * otherwise, so no byte of a file name is lost or guessed.  Error codes map
 * to errnos through ERRNO_TABLE (each class in slates/errors.py names its
 * errno); an unknown code is EIO.  Nothing here does I/O: the link
 * (bridge_link.c) moves the bytes.
 *
 * Invariant: every request carries "seq" (strictly increasing per process)
 * and "ack" = seq - 1, because the link waits for each request's reply
 * before the next (every reply below this one was received or given up
 * on), except for writes answered early (bridge_behind.c): while their
 * replies are still to come, "ack" stays below the oldest of them.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    {"Unavailable", EAGAIN},
};

int errno_for(const char *code, size_t len)
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

/* -- encoding --------------------------------------------------------------- */

void codec_init(void)
{
    if (g_bridge.codec_ready)
        return;
    msgpack_sbuffer_init(&g_bridge.sbuf);
    msgpack_packer_init(&g_bridge.pk, &g_bridge.sbuf, msgpack_sbuffer_write);
    msgpack_unpacked_init(&g_bridge.unp);
    g_bridge.unp_live = 1;
    g_bridge.codec_ready = 1;
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
    msgpack_pack_str(&g_bridge.pk, n);
    msgpack_pack_str_body(&g_bridge.pk, s, n);
}

/* A name or target: str when it is UTF-8, bin otherwise (PROTOCOL.md). */
static void pack_name(const char *s, size_t n)
{
    if (valid_utf8((const uint8_t *)s, n)) {
        msgpack_pack_str(&g_bridge.pk, n);
        msgpack_pack_str_body(&g_bridge.pk, s, n);
    } else {
        msgpack_pack_bin(&g_bridge.pk, n);
        msgpack_pack_bin_body(&g_bridge.pk, s, n);
    }
}

static void kv_u64(const char *key, uint64_t v)
{
    pack_cstr(key);
    msgpack_pack_uint64(&g_bridge.pk, v);
}

static void kv_i64(const char *key, int64_t v)
{
    pack_cstr(key);
    msgpack_pack_int64(&g_bridge.pk, v);
}

static void kv_bool(const char *key, int v)
{
    pack_cstr(key);
    if (v)
        msgpack_pack_true(&g_bridge.pk);
    else
        msgpack_pack_false(&g_bridge.pk);
}

static void kv_name(const char *key, const char *s)
{
    pack_cstr(key);
    pack_name(s, strlen(s));
}

static void kv_bin(const char *key, const void *p, size_t n)
{
    pack_cstr(key);
    msgpack_pack_bin(&g_bridge.pk, n);
    msgpack_pack_bin_body(&g_bridge.pk, p, n);
}

/* A split request starts with SPLIT_MARK (a byte msgpack never uses) and the
 * head's length (u32, little-endian), patched in by split_end. */
#define SPLIT_MARK 0xc1
#define SPLIT_PREFIX 5u

static void envelope_start(const char *op, int split)
{
    link_lock(); /* the codec buffers are the link's: held until the request is done */
    codec_init();
    msgpack_sbuffer_clear(&g_bridge.sbuf);
    g_bridge.tail = NULL;
    g_bridge.tail_len = 0;
    if (split) {
        static const char prefix[SPLIT_PREFIX] = {(char)SPLIT_MARK, 0, 0, 0, 0};
        msgpack_sbuffer_write(&g_bridge.sbuf, prefix, SPLIT_PREFIX);
    }
    g_bridge.cur_seq = g_bridge.next_seq++;
    g_bridge.cur_op = op;
    msgpack_pack_map(&g_bridge.pk, 4);
    kv_u64("seq", g_bridge.cur_seq);
    /* Every reply below this one was received (or given up on, which must
     * not hold the shard's saved results either), but for writes answered
     * early whose replies are still to come (bridge_behind.c). */
    kv_u64("ack", link_ack(g_bridge.cur_seq));
    pack_cstr("op");
    pack_cstr(op);
    pack_cstr("args");
}

/* Start {"seq", "ack", "op", "args": ...}, up to the args' value. */
void envelope_begin(const char *op) { envelope_start(op, 0); }

/* Start {"seq", "ack", "op", "args": {"volume", ...nargs more}}. */
static void req_start(const char *op, uint32_t nargs, int split)
{
    envelope_start(op, split);
    msgpack_pack_map(&g_bridge.pk, nargs + 1);
    pack_cstr("volume");
    pack_cstr(g_bridge.volume);
}

static void req_begin(const char *op, uint32_t nargs) { req_start(op, nargs, 0); }

/* End a split request's head: `data` goes after it as args.data, uncopied
 * until the push copies it into the ring. */
static void split_end(const void *data, size_t len)
{
    uint32_t head = (uint32_t)(g_bridge.sbuf.size - SPLIT_PREFIX);
    uint8_t *at = (uint8_t *)g_bridge.sbuf.data + 1;
    for (int i = 0; i < 4; i++)
        at[i] = (uint8_t)(head >> (8 * i));
    g_bridge.tail = data;
    g_bridge.tail_len = (uint32_t)len;
}

/* -- per-op request encoders (shared by the callbacks and the tests) ---------- */

void enc_lookup(uint64_t parent, const char *name)
{
    req_begin("fs.lookup", 2);
    kv_u64("parent", parent);
    kv_name("name", name);
}

void enc_forget(const struct fuse_forget_data *items, size_t n)
{
    req_begin("fs.forget", 1);
    pack_cstr("items");
    msgpack_pack_array(&g_bridge.pk, n);
    for (size_t i = 0; i < n; i++) {
        msgpack_pack_array(&g_bridge.pk, 2);
        msgpack_pack_uint64(&g_bridge.pk, items[i].ino);
        msgpack_pack_uint64(&g_bridge.pk, items[i].nlookup);
    }
}

void enc_ino(const char *op, uint64_t ino)
{
    req_begin(op, 1);
    kv_u64("ino", ino);
}

void enc_setattr(uint64_t ino, const struct stat *attr, int to_set, int64_t kill_gid)
{
    int64_t now = (int64_t)now_ns(CLOCK_REALTIME);
    uint32_t n = 1 + (kill_gid >= 0);
    n += !!(to_set & FUSE_SET_ATTR_MODE);
    n += !!(to_set & FUSE_SET_ATTR_UID);
    n += !!(to_set & FUSE_SET_ATTR_GID);
    n += !!(to_set & FUSE_SET_ATTR_SIZE);
    n += !!(to_set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_ATIME_NOW));
    n += !!(to_set & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW));
    req_begin("fs.setattr", n);
    kv_u64("ino", ino);
    if (kill_gid >= 0)
        kv_u64("kill", (uint64_t)kill_gid);
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

void enc_mknod(uint64_t parent, const char *name, uint32_t mode, uint64_t rdev,
                      uint32_t uid, uint32_t gid)
{
    req_begin("fs.mknod", 7);
    kv_bool("attrs", 1);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode);
    kv_u64("rdev", rdev);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

void enc_mkdir(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                      uint32_t gid)
{
    req_begin("fs.mkdir", 6);
    kv_bool("attrs", 1);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode & 07777);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

void enc_entry_name(const char *op, uint64_t parent, const char *name)
{
    req_begin(op, 3);
    kv_bool("attrs", 1); /* fs.unlink, fs.rmdir */
    kv_u64("parent", parent);
    kv_name("name", name);
}

void enc_symlink(uint64_t parent, const char *name, const char *target, uint32_t uid,
                        uint32_t gid)
{
    req_begin("fs.symlink", 6);
    kv_bool("attrs", 1);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_name("target", target);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
}

void enc_rename(uint64_t parent, const char *name, uint64_t new_parent,
                       const char *new_name, unsigned flags)
{
    req_begin("fs.rename", 6);
    kv_bool("attrs", 1);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("new_parent", new_parent);
    kv_name("new_name", new_name);
    kv_u64("flags", flags);
}

void enc_link(uint64_t ino, uint64_t new_parent, const char *new_name)
{
    req_begin("fs.link", 4);
    kv_bool("attrs", 1);
    kv_u64("ino", ino);
    kv_u64("new_parent", new_parent);
    kv_name("new_name", new_name);
}

void enc_create(uint64_t parent, const char *name, uint32_t mode, uint32_t uid,
                       uint32_t gid, int exclusive, int asking)
{
    req_begin("fs.create", asking ? 8 : 7);
    kv_bool("attrs", 1);
    if (asking)
        kv_bool("behind", 1);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("mode", mode & 07777);
    kv_u64("uid", uid);
    kv_u64("gid", gid);
    kv_bool("exclusive", exclusive);
}

void enc_read(uint64_t ino, uint64_t offset, uint64_t size)
{
    req_begin("fs.read", 3);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_u64("size", size);
}

/* Split: the data is the raw tail (args.data), copied once, into the ring. */
/* fs.write: "attrs" asks for the file's ATTR, "behind" for a grant, "granted"
 * says it goes under one (bridge_behind.c), "kill" (the caller's group) that
 * set-ID bits go. */
static void write_request(uint64_t ino, uint64_t offset, const void *data, size_t len,
                          const char *flag, const char *flag2, int64_t kill_gid)
{
    req_start("fs.write", 2 + (flag != NULL) + (flag2 != NULL) + (kill_gid >= 0), 1);
    if (flag != NULL)
        kv_bool(flag, 1);
    if (flag2 != NULL)
        kv_bool(flag2, 1);
    if (kill_gid >= 0)
        kv_u64("kill", (uint64_t)kill_gid);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    split_end(data, len);
}

void enc_write(uint64_t ino, uint64_t offset, const void *data, size_t len,
               int64_t kill_gid)
{
    write_request(ino, offset, data, len, "attrs", NULL, kill_gid);
}

void enc_write_asking(uint64_t ino, uint64_t offset, const void *data, size_t len,
                      int64_t kill_gid)
{
    write_request(ino, offset, data, len, "attrs", "behind", kill_gid);
}

void enc_write_granted(uint64_t ino, uint64_t offset, const void *data, size_t len,
                       int64_t kill_gid)
{
    write_request(ino, offset, data, len, "granted", NULL, kill_gid);
}

void enc_statfs(void) { req_begin("fs.statfs", 0); }

void enc_destroy(void) { req_begin("fs.destroy", 0); }

void enc_bind(uint64_t parent, const char *name, uint64_t node, const struct stat *seen,
              uint64_t refs)
{
    req_begin("fs.lookup", 6);
    kv_u64("parent", parent);
    kv_name("name", name);
    kv_u64("node", node);
    pack_cstr("fp");
    msgpack_pack_array(&g_bridge.pk, 4);
    msgpack_pack_uint64(&g_bridge.pk, (uint64_t)seen->st_dev);
    msgpack_pack_uint64(&g_bridge.pk, (uint64_t)seen->st_ino);
    msgpack_pack_uint64(&g_bridge.pk, (uint64_t)seen->st_size);
    msgpack_pack_int64(&g_bridge.pk, ts_ns(&seen->st_mtim));
    kv_u64("mode", (uint64_t)(seen->st_mode & S_IFMT));
    kv_u64("refs", refs);
}

void enc_readdir(uint64_t ino, uint64_t offset, int plus, uint64_t limit)
{
    req_begin("fs.readdir", 4);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_bool("plus", plus);
    kv_u64("limit_bytes", limit);
}

void enc_setxattr(uint64_t ino, const char *name, const void *value, size_t size,
                         int flags)
{
    req_begin("fs.setxattr", 4);
    kv_u64("ino", ino);
    kv_name("name", name);
    kv_bin("value", value, size);
    kv_u64("flags", (uint64_t)(unsigned)flags);
}

void enc_ino_name(const char *op, uint64_t ino, const char *name)
{
    req_begin(op, 2);
    kv_u64("ino", ino);
    kv_name("name", name);
}

void enc_fallocate(uint64_t ino, int mode, uint64_t offset, uint64_t length,
                   int64_t kill_gid)
{
    req_begin("fs.fallocate", 5 + (kill_gid >= 0));
    kv_bool("attrs", 1);
    if (kill_gid >= 0)
        kv_u64("kill", (uint64_t)kill_gid);
    kv_u64("ino", ino);
    kv_u64("mode", (uint64_t)(unsigned)mode);
    kv_u64("offset", offset);
    kv_u64("length", length);
}

void enc_lseek(uint64_t ino, uint64_t offset, int whence)
{
    req_begin("fs.lseek", 3);
    kv_u64("ino", ino);
    kv_u64("offset", offset);
    kv_u64("whence", (uint64_t)(unsigned)whence);
}

void enc_copy_file_range(uint64_t ino_in, uint64_t off_in, uint64_t ino_out,
                                uint64_t off_out, uint64_t length, int64_t kill_gid)
{
    req_begin("fs.copy_file_range", 6 + (kill_gid >= 0));
    kv_bool("attrs", 1);
    if (kill_gid >= 0)
        kv_u64("kill", (uint64_t)kill_gid);
    kv_u64("ino_in", ino_in);
    kv_u64("off_in", off_in);
    kv_u64("ino_out", ino_out);
    kv_u64("off_out", off_out);
    kv_u64("length", length);
}

void enc_access(uint64_t ino, int mask)
{
    req_begin("fs.access", 2);
    kv_u64("ino", ino);
    kv_u64("mask", (uint64_t)(unsigned)mask);
}

/* -- decoding --------------------------------------------------------------- */

const msgpack_object *mp_get(const msgpack_object *map, const char *key)
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

int mp_int(const msgpack_object *o, int64_t *out)
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

int mp_uint(const msgpack_object *o, uint64_t *out)
{
    if (o != NULL && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *out = o->via.u64;
        return 1;
    }
    return 0;
}

/* str or bin */
int mp_bytes(const msgpack_object *o, const char **p, uint32_t *n)
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
int attr_from_node(const msgpack_object *o, struct stat *st, fuse_ino_t *node)
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

int attr_from(const msgpack_object *o, struct stat *st)
{
    fuse_ino_t node;
    return attr_from_node(o, st, &node);
}

int attr_has_no_xattrs(const msgpack_object *o)
{
    uint64_t n;
    return mp_uint(mp_get(o, "xattrs"), &n) && n == 0;
}

/* A count result: an int, or a map holding it under `key`. */
int result_count(const msgpack_object *res, const char *key, int64_t *out)
{
    if (mp_int(res, out))
        return 1;
    return mp_int(mp_get(res, key), out);
}

static void log_error(const char *op, const msgpack_object *error)
{
    fprintf(stderr, "slates-bridge[%d]: %s on %s: ", (int)getpid(), op, g_bridge.volume);
    msgpack_object_print(stderr, *error);
    fputc('\n', stderr);
    fflush(stderr);
}

/* Decode the message in buf into g_bridge.unp.  Returns 0 with *result for an ok
 * reply, a positive errno for an error reply, -EBADMSG when malformed.
 * *seq receives the reply's sequence number. */
int decode_reply(const uint8_t *buf, size_t len, uint64_t *seq,
                        const msgpack_object **result, int log)
{
    codec_init();
    msgpack_unpacked_destroy(&g_bridge.unp);
    msgpack_unpacked_init(&g_bridge.unp);
    size_t off = 0;
    int unpacked = msgpack_unpack_next(&g_bridge.unp, (const char *)buf, len, &off);
    if (unpacked != MSGPACK_UNPACK_SUCCESS || off != len)
        return -EBADMSG;
    const msgpack_object *top = &g_bridge.unp.data;
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
        log_error(g_bridge.cur_op ? g_bridge.cur_op : "?", error);
    return err;
}

/* -- tests ----------------------------------------------------------------------- */

static int test_encode(int which, uint8_t *out, uint32_t cap, char *op_out, uint32_t op_cap);

int bridge_test_encode(int which, uint8_t *out, uint32_t cap, char *op_out, uint32_t op_cap)
{
    int rc = test_encode(which, out, cap, op_out, op_cap);
    link_release();
    return rc;
}

static int test_encode(int which, uint8_t *out, uint32_t cap, char *op_out, uint32_t op_cap)
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
    if (g_bridge.volume[0] == '\0')
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
                        FUSE_SET_ATTR_MTIME_NOW,
                    -1);
        break;
    case 5: enc_ino("fs.readlink", 9); break;
    case 6: enc_mknod(1, "fifo", S_IFIFO | 0644, 0, 1, 2); break;
    case 7: enc_mkdir(1, "d", S_IFDIR | 0755, 1, 2); break;
    case 8: enc_entry_name("fs.unlink", 1, "f"); break;
    case 9: enc_entry_name("fs.rmdir", 1, "d"); break;
    case 10: enc_symlink(1, "l", "../target", 1, 2); break;
    case 11: enc_rename(1, "a", 2, "b", 1); break;
    case 12: enc_link(5, 2, "h"); break;
    case 13: enc_create(1, "c", S_IFREG | 0600, 1, 2, 1, 0); break;
    case 14: enc_read(5, 4096, 65536); break;
    case 15: enc_write(5, 10, DATA, sizeof DATA - 1, -1); break;
    case 16: enc_ino("fs.fsync", 5); break;
    case 17: enc_statfs(); break;
    case 18: enc_readdir(1, 0, 1, 4096); break;
    case 19: enc_setxattr(5, "user.k", "v\0", 2, 1); break;
    case 20: enc_ino_name("fs.getxattr", 5, "user.k"); break;
    case 21: enc_ino("fs.listxattr", 5); break;
    case 22: enc_ino_name("fs.removexattr", 5, "user.k"); break;
    case 23: enc_fallocate(5, 1, 0, 8192, -1); break;
    case 24: enc_lseek(5, 100, 3); break;
    case 25: enc_copy_file_range(5, 0, 6, 4096, 1ull << 30, -1); break;
    case 26: enc_access(5, 4); break;
    case 27: enc_create(1, "c", S_IFREG | 0644, 1, 2, 0, 0); break;
    case 28: enc_create(1, "c", S_IFREG | 0600, 1, 2, 1, 1); break;
    case 29: enc_write_granted(5, 10, DATA, sizeof DATA - 1, 1001); break;
    case 30: enc_setattr(5, &st, FUSE_SET_ATTR_UID | FUSE_SET_ATTR_SIZE, 0); break;
    default: return -ENOENT;
    }
    size_t size = g_bridge.sbuf.size + g_bridge.tail_len;
    if (size > cap || strlen(g_bridge.cur_op) >= op_cap)
        return -EMSGSIZE;
    memcpy(out, g_bridge.sbuf.data, g_bridge.sbuf.size);
    if (g_bridge.tail_len)
        memcpy(out + g_bridge.sbuf.size, g_bridge.tail, g_bridge.tail_len);
    strcpy(op_out, g_bridge.cur_op);
    return (int)size;
}

int bridge_test_decode_attr(const uint8_t *msg, uint32_t len, int64_t *out)
{
    uint64_t seq;
    const msgpack_object *res = NULL;
    link_lock(); /* g_bridge.unp is the link's */
    int rc = decode_reply(msg, len, &seq, &res, 0);
    link_release();
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
