/*
 * The libfuse3 low-level callbacks: the kernel's requests, on several loop
 * threads (bridge_loop.c).  Each callback first tries what needs no shard
 * (answers from the base, known-absent xattrs, ENOSYS/0 answers), on its
 * own thread; the rest of it, from its first bind, taint or drop on, runs
 * under the link lock (link_lock; the loop releases it once the request is
 * answered), so what goes to the shard still goes one request at a time.
 *
 * Theory of operation: each callback either answers at once (OPEN, OPENDIR
 * and FLUSH with ENOSYS, so the kernel stops sending them and keeps its
 * caches; RELEASE/RELEASEDIR with 0; a probed xattr known to be absent,
 * bridge_cache.c) or encodes one fs.* request (bridge_wire.c), makes one
 * round trip (link_call, bridge_link.c; reads and writes larger than the
 * ring's message limit make several), and turns the reply into exactly one
 * fuse_reply_*; a WRITE under the shard's grant (which a WRITE or a CREATE
 * that asked may bring) is answered once it is in the ring, and its reply
 * taken later (bridge_behind.c), so WRITE and FSYNC also report a failure
 * latched for their inode.  Semantics live in the
 * shard: the bridge adds only what the kernel interface needs (negative
 * entries for NotFound, entry and attribute timeouts, readdirplus buffer
 * packing, xattr size probes).
 * READs of files the shard says are wholly their base file's are served
 * from the base directory (bridge_clean.c): every ATTR teaches the clean
 * table, and every request that may change an inode's content drops the
 * inode from it before it is forwarded.
 *
 * Mutations ask the shard for the attributes they produce (the parent
 * directory's, or the file's) and keep them (bridge_attr.c), so the GETATTR
 * the kernel sends next, having invalidated them, needs no round trip; every
 * request that may change an inode's attributes drops it from there first.
 *
 * LOOKUP, GETATTR, READLINK, ACCESS, LSEEK and READDIRPLUS of untouched
 * base entries in directories the shard marked clean are answered from the
 * base (bridge_meta.c) before anything is sent; every other request first
 * has the nodes it names bound in the shard (PREPARE: only the bridge knew
 * them), and a mutation taints what it changes before it is forwarded.
 *
 * Lookup references: every ENTRY the kernel receives from the shard is one
 * reference the shard counted, and every one the bridge answered itself is
 * counted in bridge_meta.c (handed to the shard when the node is bound);
 * a FORGET goes to the shard only for the shard's part.  A readdirplus
 * entry that does not fit the kernel's buffer is given back at once with a
 * forget, so the counts always agree.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

/* The epochs of the bridge's memories (bridge_cache.c, bridge_clean.c,
 * bridge_meta.c), read before a request is sent. */
struct epochs {
    uint64_t absent, clean, meta, attr;
};

static struct epochs epochs_now(void)
{
    struct epochs ep = {absent_epoch(), clean_epoch(), meta_epoch(), attr_epoch()};
    return ep;
}

/* Before a request naming `node` is encoded: the shard must know the node
 * (bridge_meta.c binds one only the bridge answered). */
#define PREPARE(req, node)                                                                 \
    do {                                                                                   \
        int prepare_rc_ = meta_prepare(node);                                              \
        if (prepare_rc_ != 0) {                                                            \
            fuse_reply_err(req, prepare_rc_);                                              \
            return;                                                                        \
        }                                                                                  \
    } while (0)
#define PREPARE_CHILD(req, parent, name)                                                   \
    do {                                                                                   \
        int prepare_rc_ = meta_prepare_child(parent, name);                                \
        if (prepare_rc_ != 0) {                                                            \
            fuse_reply_err(req, prepare_rc_);                                              \
            return;                                                                        \
        }                                                                                  \
    } while (0)

/* Answer an ENTRY reply; the node answered, or 0 (EIO: no usable ATTR).
 * `fresh`: the request made this inode (it has no xattrs yet); `ep`:
 * epochs_now() from before the request was sent; `answered` (when not NULL):
 * the attributes given. */
static fuse_ino_t reply_entry_from(fuse_req_t req, const msgpack_object *res, int create,
                                   struct fuse_file_info *fi, int fresh, struct epochs ep,
                                   struct stat *answered)
{
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    if (attr_from_node(res, &e.attr, &e.ino) != 0) {
        fuse_reply_err(req, EIO);
        return 0;
    }
    if (fresh || attr_has_no_xattrs(res))
        absent_mark_inode(e.ino, ep.absent);
    clean_note_attr(e.ino, res, ep.clean);
    meta_note_attr(e.ino, res, ep.meta, 1);
    /* A mutation's ENTRY carries its directory's new attributes (bridge_attr.c). */
    attr_note(mp_get(res, "parent_attr"), ep.attr);
    e.attr_timeout = g_bridge.cache_timeout;
    e.entry_timeout = g_bridge.cache_timeout;
    if (answered != NULL)
        *answered = e.attr;
    if (create) {
        fi->fh = 0;
        fi->keep_cache = 1;
        fuse_reply_create(req, &e, fi);
    } else {
        fuse_reply_entry(req, &e);
    }
    return e.ino;
}

/* Send the encoded request and answer with the ENTRY it returns; `fresh`
 * as for reply_entry_from; `keep_self`: the ENTRY is the attributes the
 * mutation gave an existing inode (LINK), kept for the next GETATTR. */
static void answer_entry(fuse_req_t req, int fresh, int keep_self)
{
    const msgpack_object *res;
    struct epochs ep = epochs_now();
    int rc = link_call(&res);
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    if (keep_self)
        attr_note(res, ep.attr);
    reply_entry_from(req, res, 0, NULL, fresh, ep, NULL);
}

static void answer_empty(fuse_req_t req)
{
    const msgpack_object *res;
    fuse_reply_err(req, link_call(&res));
}

/* Send the encoded mutation, keep the ATTRs its reply carries under `keys`
 * (bridge_attr.c; NULL-terminated), and answer with its status. */
static void answer_keeping_attrs(fuse_req_t req, const char *const *keys)
{
    const msgpack_object *res;
    struct epochs ep = epochs_now();
    int rc = link_call(&res);
    if (rc == 0 && res != NULL && res->type == MSGPACK_OBJECT_MAP) {
        for (; *keys != NULL; keys++)
            attr_note(mp_get(res, *keys), ep.attr);
    }
    fuse_reply_err(req, rc);
}

static const char *const PARENT_ATTR[] = {"parent_attr", NULL};
static const char *const BOTH_PARENTS_ATTR[] = {"parent_attr", "new_parent_attr", NULL};
static const char *const FILE_ATTR[] = {"attr", NULL};

/* What the bridge asks of the kernel (DESIGN.md section 2, fuse-levers). */
static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    /* no_open/no_opendir keep the kernel's page and directory caches;
     * readdirplus brings every entry's attributes with the listing; async
     * reads let readahead run beside the reader; cached symlinks make a
     * second readlink free (a symlink's target never changes, and the
     * shard's invalidation of an inode drops its cached pages too);
     * parallel dirops let lookups in one directory queue without the
     * directory's lock (the loop threads answer them side by side). */
    unsigned want = FUSE_CAP_WRITEBACK_CACHE | FUSE_CAP_NO_OPEN_SUPPORT |
                    FUSE_CAP_NO_OPENDIR_SUPPORT | FUSE_CAP_READDIRPLUS |
                    FUSE_CAP_ASYNC_READ |
                    FUSE_CAP_CACHE_SYMLINKS | FUSE_CAP_PARALLEL_DIROPS;
    /* A writeback kernel keeps a file's size through every reply; only
     * FUSE_NOTIFY_PRUNE (protocol 7.45) lets another client's size change
     * reach it (bridge_prune.c).  Without it, write through. */
    if (g_bridge.writeback && (conn->proto_major < 7 || (conn->proto_major == 7 &&
                                                         conn->proto_minor < 45))) {
        fprintf(stderr, "slates-bridge: this kernel (FUSE %u.%u) cannot drop a file's cached "
                        "size: writing through instead of the writeback cache\n",
                conn->proto_major, conn->proto_minor);
        g_bridge.writeback = 0;
    }
    if (!g_bridge.writeback)
        want &= ~(unsigned)FUSE_CAP_WRITEBACK_CACHE;
    conn->want |= want & conn->capable;
    if (!g_bridge.writeback)
        conn->want &= ~(unsigned)FUSE_CAP_WRITEBACK_CACHE;
    /* Always readdirplus, never "auto": entries come with their attributes
     * and inode numbers, which plain readdir cannot promise for unbound
     * base names, and a listing followed by stats (find, git status's
     * untracked scan, grep -r) then needs no LOOKUP per entry. */
    conn->want &= ~(unsigned)FUSE_CAP_READDIRPLUS_AUTO;
    /* No auto_inval_data (libfuse asks for it by default): with it the kernel
     * drops a file's cached pages whenever a GETATTR brings a newer mtime,
     * which in a write-through mount is after every write of its own, so a
     * build read back every object file it had just written through the
     * shard.  Changes made elsewhere never rely on it: the shard's
     * invalidations (bridge_session.c) drop the pages of what other clients
     * change, and a size change drops them in the kernel regardless. */
    conn->want &= ~(unsigned)FUSE_CAP_AUTO_INVAL_DATA;
    conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
    /* OPEN is never sent (no_open), so it cannot truncate: without this the
     * kernel would trust OPEN with O_TRUNC and the truncation would be lost.
     * Off, the kernel sends O_TRUNC as a SETATTR of size 0. */
    conn->want &= ~(unsigned)FUSE_CAP_ATOMIC_O_TRUNC;
    /* Not the first version, which would have the server kill set-ID bits on
     * every write, whoever writes (a root writer keeps them): the INIT reply
     * claims FUSE_HANDLE_KILLPRIV_V2 instead, whose requests say when
     * (bridge_session.c's request_seen). */
    conn->want &= ~(unsigned)FUSE_CAP_HANDLE_KILLPRIV;
    conn->max_write = BRIDGE_MAX_IO;
    conn->max_read = BRIDGE_MAX_IO;
    conn->max_readahead = BRIDGE_MAX_IO;
    /* Readahead and writeback requests the kernel may queue before it
     * throttles their writers (libfuse's default is 12). */
    conn->max_background = BRIDGE_MAX_BACKGROUND;
    conn->congestion_threshold = BRIDGE_MAX_BACKGROUND * 3 / 4;
    conn->time_gran = 1;
}

/* The kernel dropped every reference (unmount): tell the shard at once. */
static void op_destroy(void *userdata)
{
    (void)userdata;
    const msgpack_object *res;
    link_lock();
    if (!g_bridge.attached)
        return; /* a fresh shard holds no references of this session's */
    enc_destroy();
    (void)link_call(&res);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    const msgpack_object *res;
    if (meta_lookup(req, parent, name))
        return;
    link_lock();
    PREPARE(req, parent);
    attr_drop(parent); /* a bind may touch the directory: fs.getattr answers it */
    struct epochs ep = epochs_now();
    enc_lookup(parent, name);
    int rc = link_call(&res);
    if (rc == ENOENT) {
        /* A negative entry the kernel keeps as long as a positive one. */
        struct fuse_entry_param e;
        memset(&e, 0, sizeof e);
        e.ino = 0;
        e.entry_timeout = g_bridge.cache_timeout;
        fuse_reply_entry(req, &e);
        return;
    }
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    reply_entry_from(req, res, 0, NULL, 0, ep, NULL);
}

/* Tell the shard of forgotten references.  `kernel`: the kernel forgot them
 * (references only the bridge counted stay here, bridge_meta.c); else the
 * bridge gives back references the shard counted but the kernel never got. */
static void send_forgets(const struct fuse_forget_data *given, size_t n, int kernel)
{
    const msgpack_object *res;
    struct fuse_forget_data *items = malloc((n ? n : 1) * sizeof *items);
    if (items == NULL)
        return; /* the shard keeps the inodes a little longer */
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        absent_forget_inode(given[i].ino);
        clean_drop(given[i].ino);
        attr_drop(given[i].ino);
        content_drop(given[i].ino);
        if (kernel)
            prune_forgotten(given[i].ino); /* evicted: its next lookup is fresh */
        uint64_t count = kernel ? meta_forget(given[i].ino, given[i].nlookup) : given[i].nlookup;
        if (count > 0) {
            items[kept].ino = given[i].ino;
            items[kept].nlookup = count;
            kept++;
        }
    }
    struct fuse_forget_data *all = items;
    n = kept;
    /* Keep each message well inside the ring: ~20 bytes an item. */
    while (n > 0) {
        size_t batch = n > 4096 ? 4096 : n;
        enc_forget(items, batch);
        (void)link_call(&res);
        items += batch;
        n -= batch;
    }
    free(all);
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    struct fuse_forget_data item = {.ino = ino, .nlookup = nlookup};
    link_lock(); /* the split between the bridge's references and the shard's */
    send_forgets(&item, 1, 1);
    fuse_reply_none(req);
}

static void op_forget_multi(fuse_req_t req, size_t count_, struct fuse_forget_data *forgets)
{
    link_lock();
    send_forgets(forgets, count_, 1);
    fuse_reply_none(req);
}

/* Send the encoded request and answer the kernel with the ATTR it returns;
 * `keep`: a mutation's ATTR, kept for the kernel's next GETATTR.  0 with the
 * ATTR in *out (when not NULL), or the errno answered. */
static int reply_attr(fuse_req_t req, int keep, struct stat *out)
{
    const msgpack_object *res;
    struct stat st;
    fuse_ino_t node = 0;
    struct epochs ep = epochs_now();
    int rc = link_call(&res);
    if (rc == 0)
        rc = attr_from_node(res, &st, &node);
    if (rc == 0 && attr_has_no_xattrs(res))
        absent_mark_inode(node, ep.absent);
    if (rc == 0) {
        clean_note_attr(node, res, ep.clean);
        meta_note_attr(node, res, ep.meta, 0);
        if (keep)
            attr_note(res, ep.attr);
    }
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return rc;
    }
    if (out != NULL)
        *out = st;
    fuse_reply_attr(req, &st, g_bridge.cache_timeout);
    return 0;
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    if (meta_getattr(req, ino))
        return;
    if (attr_answer(req, ino))
        return;
    link_lock();
    PREPARE(req, ino);
    enc_ino("fs.getattr", ino);
    (void)reply_attr(req, 0, NULL);
}

/* What a request that may kill set-ID bits says of it (enc_setattr's kill_gid). */
static int64_t kill_gid(fuse_req_t req, int kill)
{
    return kill ? (int64_t)fuse_req_ctx(req)->gid : -1;
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi)
{
    (void)fi;
    link_lock();
    PREPARE(req, ino);
    meta_taint(ino);
    clean_drop(ino); /* a truncation changes the content; the reply teaches again */
    attr_drop(ino);
    int sizing = (to_set & FUSE_SET_ATTR_SIZE) != 0;
    uint64_t content_ep = content_epoch();
    enc_setattr(ino, attr, to_set, kill_gid(req, request_kills_setid()));
    struct stat now;
    if (reply_attr(req, 1, &now) != 0) {
        if (sizing)
            content_drop(ino); /* the size it has now is the shard's to say */
        return;
    }
    if (sizing && now.st_size == 0 && S_ISREG(now.st_mode))
        content_start(ino, content_ep); /* emptied: its content passes through here */
    else if (sizing)
        content_resize(ino, (uint64_t)now.st_size);
}

static void op_readlink(fuse_req_t req, fuse_ino_t ino)
{
    const msgpack_object *res;
    const char *p = NULL;
    uint32_t n = 0;
    if (meta_readlink(req, ino))
        return;
    link_lock();
    PREPARE(req, ino);
    enc_ino("fs.readlink", ino);
    int rc = link_call(&res);
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
    link_lock();
    PREPARE(req, parent);
    meta_taint(parent);
    attr_drop(parent);
    enc_mknod(parent, name, mode, rdev, ctx->uid, ctx->gid);
    answer_entry(req, 1, 0);
}

static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    link_lock();
    PREPARE(req, parent);
    meta_taint(parent);
    attr_drop(parent);
    enc_mkdir(parent, name, mode, ctx->uid, ctx->gid);
    answer_entry(req, 1, 0);
}

static void op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    link_lock();
    PREPARE(req, parent);
    PREPARE_CHILD(req, parent, name);
    meta_taint(parent);
    attr_drop_all(); /* the child's nlink and ctime change too */
    enc_entry_name("fs.unlink", parent, name);
    answer_keeping_attrs(req, PARENT_ATTR);
}

static void op_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    link_lock();
    PREPARE(req, parent);
    PREPARE_CHILD(req, parent, name);
    meta_taint(parent);
    attr_drop_all();
    enc_entry_name("fs.rmdir", parent, name);
    answer_keeping_attrs(req, PARENT_ATTR);
}

static void op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    link_lock();
    PREPARE(req, parent);
    meta_taint(parent);
    attr_drop(parent);
    enc_symlink(parent, name, link, ctx->uid, ctx->gid);
    answer_entry(req, 1, 0);
}

static void op_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags)
{
    link_lock();
    PREPARE(req, parent);
    PREPARE(req, newparent);
    PREPARE_CHILD(req, parent, name);
    PREPARE_CHILD(req, newparent, newname);
    meta_taint(parent);
    meta_taint(newparent);
    attr_drop_all(); /* the moved and any replaced inode change too */
    enc_rename(parent, name, newparent, newname, flags);
    answer_keeping_attrs(req, BOTH_PARENTS_ATTR);
}

static void op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{
    link_lock();
    PREPARE(req, ino);
    PREPARE(req, newparent);
    meta_taint(ino);
    meta_taint(newparent);
    attr_drop(ino);
    attr_drop(newparent);
    enc_link(ino, newparent, newname); /* an existing inode: not fresh */
    answer_entry(req, 0, 1);
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    const msgpack_object *res;
    int exclusive = (fi->flags & O_EXCL) != 0;
    link_lock();
    PREPARE(req, parent);
    PREPARE_CHILD(req, parent, name); /* without O_EXCL it may answer with that file */
    meta_taint(parent);
    attr_drop(parent);
    struct epochs ep = epochs_now();
    uint64_t content_ep = content_epoch();
    int asking = behind_wanted();
    enc_create(parent, name, mode, ctx->uid, ctx->gid, exclusive, asking);
    int rc = link_call(&res);
    /* Without O_EXCL the shard may answer with a file that already exists. */
    if (rc != 0) {
        fuse_reply_err(req, rc);
        return;
    }
    struct stat made;
    fuse_ino_t ino = reply_entry_from(req, res, 1, fi, exclusive, ep, &made);
    /* An empty file: its content passes through here from now on (bridge_content.c);
     * and its writes, anywhere in it, may be answered early (a file that already
     * existed gets a grant only when it is empty).  The kernel's WRITE cannot
     * overtake either: it waits for the link lock, held until we return. */
    if (ino != 0 && made.st_size == 0 && S_ISREG(made.st_mode))
        content_start(ino, content_ep);
    if (asking && ino != 0)
        behind_granted(ino, 0, res);
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
    int rc = link_call(&res);
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

static uint32_t io_chunk(void) { return g_bridge.io_chunk ? g_bridge.io_chunk : 256u << 10; }

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void)fi;
    prefetch_note_read((uint32_t)fuse_req_ctx(req)->pid);
    const char *clean = NULL;
    long served = clean_read(ino, (uint64_t)off, size, &clean);
    if (served >= 0) {
        fuse_reply_buf(req, clean, (size_t)served);
        return;
    }
    if (content_read(req, ino, (uint64_t)off, size))
        return; /* a file made here (bridge_content.c) */
    link_lock();
    PREPARE(req, ino);
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
    link_lock();
    PREPARE(req, ino);
    meta_taint(ino);
    clean_drop(ino); /* before the shard sees the write */
    attr_drop(ino);
    int failed = behind_take_error(ino); /* an earlier write answered early */
    if (failed != 0) {
        fuse_reply_err(req, failed);
        return;
    }
    int64_t kill = kill_gid(req, request_kills_setid());
    if (behind_try(ino, (uint64_t)off, buf, size, kill)) {
        content_write(ino, (uint64_t)off, buf, size);
        fuse_reply_write(req, size); /* the shard promised it (bridge_behind.c) */
        return;
    }
    uint32_t chunk = io_chunk();
    int asking = behind_wanted() && size <= chunk;
    size_t done = 0;
    int err = 0;
    do {
        const msgpack_object *res;
        int64_t written;
        size_t n = size - done > chunk ? chunk : size - done;
        uint64_t attr_ep = attr_epoch();
        if (asking)
            enc_write_asking(ino, (uint64_t)off + done, buf + done, n, kill);
        else
            enc_write(ino, (uint64_t)off + done, buf + done, n, kill);
        err = link_call(&res);
        if (err == 0 && (!result_count(res, "written", &written) || written < 0 ||
                         (uint64_t)written > n))
            err = EIO;
        if (err != 0) {
            attr_drop(ino); /* what an earlier chunk's reply taught may be stale */
            break;
        }
        attr_note(mp_get(res, "attr"), attr_ep); /* the file after this chunk */
        done += (size_t)written;
        if ((size_t)written < n)
            break;
        if (asking && (size_t)written == size)
            behind_granted(ino, (uint64_t)off + size, res);
    } while (done < size);
    if (err != 0)
        content_drop(ino); /* how much of it the shard applied is its to say */
    else
        content_write(ino, (uint64_t)off, buf, done);
    if (err != 0 && done == 0)
        fuse_reply_err(req, err);
    else
        fuse_reply_write(req, done);
}

static void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    (void)datasync;
    (void)fi;
    link_lock();
    PREPARE(req, ino);
    enc_ino("fs.fsync", ino);
    const msgpack_object *res;
    int err = link_call(&res); /* its reply comes after every earlier write's */
    int failed = behind_take_error(ino);
    fuse_reply_err(req, err != 0 ? err : failed);
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
    if (plus && meta_readdirplus(req, ino, size, (uint64_t)off))
        return;
    link_lock();
    PREPARE(req, ino);
    attr_drop(ino); /* binds may touch the directory: fs.getattr answers it */
    struct epochs ep = epochs_now();
    enc_readdir(ino, (uint64_t)off, plus, size);
    int rc = link_call(&res);
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
                e.attr_timeout = g_bridge.cache_timeout;
                e.entry_timeout = g_bridge.cache_timeout;
                if (attr_has_no_xattrs(attr))
                    absent_mark_inode(e.ino, ep.absent);
                clean_note_attr(e.ino, attr, ep.clean);
            } else {
                has_attr = 0;
                e.attr.st_ino = (ino_t)ino_;
                e.attr.st_mode = (mode_t)kind;
            }
            need = full ? size + 1
                        : fuse_add_direntry_plus(req, buf + used, size - used, name, &e, next);
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
            if (has_attr && e.ino != 0)
                meta_note_attr(e.ino, attr, ep.meta, 1); /* the kernel gets this entry */
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
        send_forgets(unsent, nunsent, 0);
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
    link_lock();
    enc_statfs();
    int rc = link_call(&res);
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
    link_lock();
    PREPARE(req, ino);
    meta_taint(ino);
    absent_remove(absent_key(ino, name));
    attr_drop(ino); /* its ctime changes */
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
    link_lock();
    PREPARE(req, ino);
    uint64_t epoch = absent_epoch();
    enc_ino_name("fs.getxattr", ino, name);
    int rc = link_call(&res);
    if (rc == 0 && !mp_bytes(res, &p, &n))
        rc = EIO;
    if (key != 0 && rc == ENODATA)
        absent_add_since(key, epoch);
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
    link_lock();
    PREPARE(req, ino);
    enc_ino("fs.listxattr", ino);
    int rc = link_call(&res);
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
    link_lock();
    PREPARE(req, ino);
    meta_taint(ino);
    absent_remove(absent_key(ino, name));
    attr_drop(ino);
    enc_ino_name("fs.removexattr", ino, name);
    answer_empty(req);
}

static void op_access(fuse_req_t req, fuse_ino_t ino, int mask)
{
    if (meta_access(req, ino))
        return;
    link_lock();
    PREPARE(req, ino);
    enc_access(ino, mask);
    answer_empty(req);
}

static void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                         struct fuse_file_info *fi)
{
    (void)fi;
    link_lock();
    PREPARE(req, ino);
    meta_taint(ino);
    clean_drop(ino);
    attr_drop(ino);
    content_drop(ino);
    enc_fallocate(ino, mode, (uint64_t)offset, (uint64_t)length,
                  kill_gid(req, caller_lacks_fsetid(fuse_req_ctx(req)->pid)));
    answer_keeping_attrs(req, FILE_ATTR);
}

static void op_lseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence,
                     struct fuse_file_info *fi)
{
    (void)fi;
    if (g_bridge.writeback) {
        /* With the writeback cache the kernel may hold data the shard has
         * not seen yet: a hole the shard reports could hide it (cp would
         * skip it).  ENOSYS makes the kernel answer from its own size,
         * treating the whole file as data, which is always safe. */
        fuse_reply_err(req, ENOSYS);
        return;
    }
    const msgpack_object *res;
    int64_t at;
    if (off >= 0 && meta_lseek(req, ino, (uint64_t)off, whence))
        return;
    link_lock();
    PREPARE(req, ino);
    enc_lseek(ino, (uint64_t)off, whence);
    int rc = link_call(&res);
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
    link_lock();
    PREPARE(req, ino_in);
    PREPARE(req, ino_out);
    meta_taint(ino_out);
    clean_drop(ino_out);
    attr_drop(ino_out);
    content_drop(ino_out);
    uint64_t attr_ep = attr_epoch();
    enc_copy_file_range(ino_in, (uint64_t)off_in, ino_out, (uint64_t)off_out, len,
                        kill_gid(req, caller_lacks_fsetid(fuse_req_ctx(req)->pid)));
    int rc = link_call(&res);
    if (rc == 0 && (!result_count(res, "copied", &copied) || copied < 0))
        rc = EIO;
    if (rc == 0)
        attr_note(mp_get(res, "attr"), attr_ep);
    if (rc != 0)
        fuse_reply_err(req, rc);
    else
        fuse_reply_write(req, (size_t)copied);
}

const struct fuse_lowlevel_ops bridge_ops = {
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
