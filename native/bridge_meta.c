/*
 * Clean base metadata: LOOKUP, READDIRPLUS, GETATTR, READLINK, ACCESS and
 * LSEEK of untouched base entries answered from the base directory, without
 * asking the shard.
 *
 * Theory of operation.  The first touch of a fresh workspace is mostly
 * LOOKUPs of base names nobody has changed; through the shard each costs a
 * Python step that binds the entry and counts a kernel reference, both
 * journaled (bench/RESULTS.md, "First touch").  The shard instead tells the
 * bridge which directories hold nothing private: an ATTR of a directory
 * that merges a base directory, hides no name and holds only base entries
 * bound under their own names carries "dir": [base path, [bound inode, ...]]
 * (slates/node/fsops.py).  In such a directory every name the volume has
 * not bound is exactly its base entry, so the bridge answers it itself:
 *   - the entry is opened beneath the base directory fd (openat2 with
 *     RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV, O_PATH |
 *     O_NOFOLLOW) and fstat'ed, or, once the directory keeps a fd of its base
 *     directory (bridge_dirfd.c: while every directory above it is watched,
 *     so a rename of any of them is seen), lstat'ed from that fd, one
 *     component, nothing followed; missing is a negative entry (nothing
 *     private could hide or add the name);
 *   - its node id is the number the volume gives a base entry when it binds
 *     it (BASE_INO_START + st_ino, slates.core.volume.base_ino), so the
 *     shard's later answers, its invalidations and the kernel agree on it
 *     without any table; an entry on another device, or with an inode
 *     number past the span, is left to the shard;
 *   - its attributes are built as the volume builds a bound base entry's
 *     (a merged directory's nlink is 1 and size 0, blocks from the size);
 *   - a child directory answered so is itself clean (nothing of it is bound);
 *     a regular file is taught to the clean-read table (bridge_clean.c).
 * READDIRPLUS of a clean directory (bridge_meta_dir.c) lists the base
 * directory itself, sorted
 * by the same cookie the shard gives a name (64-bit FNV-1a, fsops.py's
 * cookie_of), so a listing the shard continues (the mark revoked between
 * two calls) neither skips nor repeats a name; each entry is answered as a
 * LOOKUP would be.  Every inode the shard listed as bound, and every node
 * it invalidated, is "tainted": the shard answers for it from then on, since
 * only the volume knows whether it changed (a listing gives such an entry
 * without attributes, and the kernel looks it up).  GETATTR, READLINK,
 * ACCESS and LSEEK of a node this file answered, and not tainted since, are
 * answered from what was seen (an untouched base file is one data extent).
 *
 * Kernel references.  A node answered here costs the shard nothing: the
 * bridge counts the kernel's references itself (`local_refs`) and a FORGET
 * of them never leaves the bridge.  Before any request that names such a
 * node goes to the shard, meta_prepare binds it there (parents first):
 * fs.lookup with `node`, `fp` (the fingerprint seen), `mode` and `refs`,
 * which binds the entry with the fingerprint the kernel saw (a base file
 * changed since then reads as drift, BaseDrift rules unchanged) and retains
 * the counted references, so an unlinked file the kernel holds stays alive
 * in the shard.  meta_prepare_child does the same for the child a
 * mutation names by (parent, name) (unlink, rmdir, rename): the entry is
 * bound before it is removed or replaced.
 *
 * When a mark stops being true.  The loop thread taints, before it forwards
 * a mutation, the nodes it changes (the file written or set, the directory
 * an entry is added to or removed from); the watcher thread taints what the
 * shard invalidates (bridge_notify_inval_*: another client changed it)
 * before it acknowledges, and the shard answers that client only after the
 * acknowledgement.  A taint of a directory also drops its clean mark.  A
 * binding by another client changes nothing visible: the bound entry is
 * still its base entry, under the same number, until a change to it taints
 * it.  Race with a taint: every taint starts a new epoch; a local answer
 * reads the epoch before it looks at the base and replies, inside the reply
 * gate (shared; a taint takes it exclusive), only if no taint ran meanwhile
 * (else the shard answers), so an invalidation acknowledged before the reply
 * is never undone by it.
 *
 * Threads.  Answers from here run on any loop thread, in parallel: the
 * tables are under g_meta_lock, held only for table work (never across a
 * syscall on the base or a reply), and the reply gate orders answers
 * against taints.  Reference counts stay exact: an answer counts its
 * reference (take_ref) before its reply reaches the kernel, so no FORGET
 * can precede it; everything that moves references between the bridge's
 * count and the shard's - a bind (meta_prepare: plan, fs.lookup, subtract),
 * a kernel FORGET's split (meta_forget), a READDIRPLUS giving back entries
 * the kernel never got - runs under the link lock (bridge_link.c), so no
 * split ever sees a bind half done; an answer concurrent with a bind only
 * adds references the bind did not plan, which stay the bridge's.
 *
 * Bounded: the node table holds only nodes the kernel holds (entries leave
 * with the kernel's last FORGET), and the taint set holds nodes changed
 * while mounted; both grow by doubling, and an allocation failure makes the
 * shard answer (only a cache; a taint that cannot be recorded stops every
 * answer here).  Counted: BRIDGE_STAT_META_ANSWERS.
 *
 * A directory the base moves.  A node is numbered by its base inode but
 * answered from its path, so when the base renames a directory the bridge
 * answered (and perhaps makes another at the old name), the kernel finds the
 * same number under the new name.  A LOOKUP or listing that finds a node's
 * directory at another path than its own moves the node there (moved_locked,
 * only for a node the shard has not bound: a bound one is the shard's to
 * answer), and every clean directory the bridge holds below it loses its mark
 * (its path is under the old one), as it does when the shard marks a
 * directory at another path (unclean_below_locked); the kernel's listings of
 * all of them are dropped shortly after (watch_recheck), since one may have
 * been read from the old path in between.  Until then, and until the watch
 * drops the kernel's entry of the old name, the old name may still show what
 * is there now.  Counted: BRIDGE_STAT_MOVED_DIRS.
 *
 * Not covered: another client's unlink of a name whose node only the bridge
 * knows leaves the shard nothing to keep alive (the base file is still read
 * through the kernel's open file, but a write to it fails); an inode number
 * the base reuses for a new file while the volume still holds the old one
 * is bound under another number, and requests naming it fail (EIO).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define META_BASE_INO_SPAN (1ull << 40)
#define META_BASE_INO_START ((1ull << 52) - META_BASE_INO_SPAN)
#define META_SETTLED_NS (2 * (int64_t)NS_PER_SEC) /* see changing() */
#define META_DIRFD_DEPTH 64 /* a deeper directory's LOOKUPs walk its path */

/* META_LISTED: listed by bridge_prefetch.c's walk. */
enum { META_LOCAL = 1, META_BOUND = 2, META_CLEAN_DIR = 4, META_LISTED = 8 };

struct meta_node {
    uint64_t node;
    uint64_t parent;      /* the directory it was answered in (META_LOCAL) */
    uint64_t kernel_refs; /* lookups the kernel holds */
    uint64_t local_refs;  /* of those, the ones the shard was not told */
    char *path;           /* base-relative, "" for the base root; NULL if unknown */
    const char *name;     /* the last component of path */
    struct stat seen;     /* the base entry as fstat'ed (META_LOCAL) */
    unsigned flags;
    struct dirfd *dirfd;  /* a clean directory's base fd for LOOKUPs, or NULL */
};

static struct {
    struct u64map nodes;   /* node -> struct meta_node * */
    struct u64map tainted; /* node -> (void *)1 */
    uint64_t epoch;
    dev_t base_dev;
    int base_known;  /* -1: no usable base, 1: base_dev set (once, base_once) */
    int root_probed; /* atomic */
    int degraded; /* a taint could not be remembered: nothing is answered here */
} g_meta;
static pthread_mutex_t g_meta_lock = PTHREAD_MUTEX_INITIALIZER;
/* The reply gate: an answer from here holds it shared from its epoch check
 * until its reply is written; a taint holds it exclusive.  So a taint waits
 * for the answers already checked, and every later answer sees its epoch
 * (see "Race with a taint" above), while answers run in parallel.  Writers
 * first, so a stream of answers cannot starve an invalidation. */
static pthread_rwlock_t g_meta_gate;
static pthread_once_t g_meta_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_base_once = PTHREAD_ONCE_INIT;

static void gate_init(void)
{
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&g_meta_gate, &attr);
    pthread_rwlockattr_destroy(&attr);
}

static void gate_enter(void)
{
    pthread_once(&g_meta_once, gate_init);
    pthread_rwlock_rdlock(&g_meta_gate);
}

static void gate_leave(void) { pthread_rwlock_unlock(&g_meta_gate); }

static struct meta_node *node_get(uint64_t node) { return map_get(&g_meta.nodes, node); }

static void node_free(struct meta_node *e)
{
    dirfd_put(e->dirfd);
    free(e->path);
    free(e);
}

/* Under the lock: `e` keeps no base directory fd (the next LOOKUP may open one). */
static void drop_dirfd_locked(struct meta_node *e)
{
    dirfd_put(e->dirfd);
    e->dirfd = NULL;
}

/* Under the lock: `e` is no longer a clean directory (or no longer at the path
 * its kept fd was opened at): the fd goes with the mark. */
static void unclean_locked(struct meta_node *e)
{
    e->flags &= ~(unsigned)META_CLEAN_DIR;
    drop_dirfd_locked(e);
}

static int tainted(uint64_t node)
{
    return g_meta.degraded || map_get(&g_meta.tainted, node) != NULL;
}

/* Under the lock: the node is the shard's to answer from now on. */
static void taint_locked(uint64_t node)
{
    g_meta.epoch++;
    struct meta_node *e = node_get(node);
    if (e != NULL)
        unclean_locked(e);
    if (map_put(&g_meta.tainted, node, (void *)1) != 0)
        g_meta.degraded = 1; /* no room to remember it: the shard answers everything */
}

void meta_taint(uint64_t node)
{
    pthread_once(&g_meta_once, gate_init);
    pthread_rwlock_wrlock(&g_meta_gate); /* after every answer already checked */
    pthread_mutex_lock(&g_meta_lock);
    taint_locked(node);
    pthread_mutex_unlock(&g_meta_lock);
    pthread_rwlock_unlock(&g_meta_gate);
}

uint64_t meta_epoch(void)
{
    pthread_mutex_lock(&g_meta_lock);
    uint64_t epoch = g_meta.epoch;
    pthread_mutex_unlock(&g_meta_lock);
    return epoch;
}

static void base_init(void)
{
    struct stat st;
    int fd = clean_base_fd();
    g_meta.base_known = fd >= 0 && fstat(fd, &st) == 0 ? 1 : -1;
    if (g_meta.base_known == 1)
        g_meta.base_dev = st.st_dev;
}

/* The base directory's device, once; 0 when there is no usable base. */
static int base_ready(void)
{
    pthread_once(&g_base_once, base_init);
    return g_meta.base_known == 1;
}

static char *join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    if (a + b + 2 > PATH_MAX)
        return NULL;
    char *out = malloc(a + b + 2);
    if (out == NULL)
        return NULL;
    if (a == 0) {
        memcpy(out, name, b + 1);
    } else {
        memcpy(out, dir, a);
        out[a] = '/';
        memcpy(out + a + 1, name, b + 1);
    }
    return out;
}

static const char *last_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

/* fstat of the entry at `path` beneath the base: 0, or -errno. */
int meta_stat_beneath(const char *path, struct stat *st)
{
    int fd = base_open(clean_base_fd(), path, O_PATH);
    if (fd < 0)
        return -errno;
    int rc = fstat(fd, st) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

int meta_stat_at(int dir_fd, const char *name, struct stat *st)
{
    if (!base_ready() || name[0] == '\0' || strchr(name, '/') != NULL ||
        strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return -EINVAL;
    if (fstatat(dir_fd, name, st, AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT) != 0)
        return -errno;
    return st->st_dev == g_meta.base_dev ? 0 : -EXDEV; /* a mount point: as RESOLVE_NO_XDEV */
}

/* Whether a base entry changed so recently that it may be changing still (a
 * file being written into the live base): a listing then gives it without
 * attributes, so the kernel does not keep a half-written size for a day but
 * looks the name up when it needs it (git's "racily clean" rule, for the same
 * reason).  A LOOKUP, which a caller asks for now, is answered as it is. */
static int changing(const struct stat *st)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return ts_ns(&now) - ts_ns(&st->st_ctim) < META_SETTLED_NS;
}

/* The node id the volume binds this base entry at, or 0 (the shard decides). */
static uint64_t derived_node(const struct stat *st)
{
    if (st->st_dev != g_meta.base_dev || st->st_ino == 0 || (uint64_t)st->st_ino >= META_BASE_INO_SPAN)
        return 0;
    return META_BASE_INO_START + (uint64_t)st->st_ino;
}

/* The attributes the volume reports for a base entry bound from `b`. */
static void attr_of_base(const struct stat *b, struct stat *out)
{
    memset(out, 0, sizeof *out);
    out->st_ino = b->st_ino;
    out->st_mode = b->st_mode & (S_IFMT | 07777);
    out->st_nlink = S_ISDIR(b->st_mode) ? 1 : (b->st_nlink > 0 ? b->st_nlink : 1);
    out->st_uid = b->st_uid;
    out->st_gid = b->st_gid;
    if (S_ISREG(b->st_mode) || S_ISLNK(b->st_mode))
        out->st_size = b->st_size;
    if (S_ISREG(b->st_mode))
        out->st_blocks = (b->st_size + 511) / 512;
    if (S_ISCHR(b->st_mode) || S_ISBLK(b->st_mode))
        out->st_rdev = b->st_rdev;
    out->st_blksize = 4096;
    out->st_atim = b->st_atim;
    out->st_mtim = b->st_mtim;
    out->st_ctim = b->st_ctim;
}

static int root_probed(void) { return __atomic_load_n(&g_meta.root_probed, __ATOMIC_ACQUIRE); }

/* Learn the root's mark once (the kernel never looks the root up).  Takes
 * the link lock (kept until this request is answered): before any other. */
static void probe_root(void)
{
    const msgpack_object *res;
    link_lock();
    if (root_probed())
        return; /* another thread did it meanwhile */
    __atomic_store_n(&g_meta.root_probed, 1, __ATOMIC_RELEASE);
    uint64_t epoch = meta_epoch();
    enc_ino("fs.getattr", 1);
    if (link_call(&res) == 0)
        meta_note_attr(1, res, epoch, 0);
}

char *meta_dir_path(uint64_t dir, uint64_t *parent)
{
    char *path = NULL;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(dir);
    if (e != NULL && e->path != NULL) {
        path = strdup(e->path);
        *parent = (e->flags & META_LOCAL) ? e->parent : dir == 1 ? 1 : 0;
    }
    pthread_mutex_unlock(&g_meta_lock);
    return path;
}

char *meta_child_path(uint64_t dir, const char *name)
{
    char *path = NULL;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(dir);
    if (e != NULL && e->path != NULL)
        path = join(e->path, name);
    pthread_mutex_unlock(&g_meta_lock);
    return path;
}

/* Under the lock: whether `n` is below the directory `dir`, by the parents the
 * bridge answered its nodes in. */
static int below_locked(const struct meta_node *n, uint64_t dir)
{
    for (int steps = 0; steps < PATH_MAX / 2 && n != NULL && (n->flags & META_LOCAL); steps++) {
        if (n->parent == dir)
            return 1;
        n = node_get(n->parent);
    }
    return 0;
}

/* Under the lock: the directory `dir` is at another path now (the base moved it).
 * Every directory below it the bridge holds still has a path under the old one,
 * where another directory may stand now, so none of them is answered here from its
 * path any more: the shard binds them by their names, below this one's (and marks
 * them again).  A file below keeps its path: a read from it checks the file's
 * fingerprint first (bridge_clean.c).  A new epoch, so no answer worked out from
 * an old path is sent.  The kernel's listings of them, and of `dir`, are dropped
 * shortly after (watch_recheck): between the base's rename and this, one may have
 * been read from the old path, where another directory stands.  The watch
 * thread's lock is taken under this one, never the other way round. */
static void unclean_below_locked(const struct meta_node *dir)
{
    g_meta.epoch++;
    size_t len = strlen(dir->path);
    for (size_t i = 0; i < g_meta.nodes.cap; i++) {
        struct meta_node *n = g_meta.nodes.keys[i] != 0 ? g_meta.nodes.values[i] : NULL;
        /* A clean directory's path was made under its parent's current one (a path
         * that changed uncleaned everything below it), hence the cheap test first. */
        if (n != NULL && n != dir && (n->flags & META_CLEAN_DIR) && n->path != NULL &&
            strncmp(n->path, dir->path, len) == 0 && n->path[len] == '/' &&
            below_locked(n, dir->node)) {
            unclean_locked(n);
            watch_recheck(n->node);
        }
    }
    watch_recheck(dir->node);
}

/* Under the lock: the directory `dir`, found at `*path` in `parent`, moved there in
 * the base: its node follows it (taking `*path`, set to NULL), as the kernel does,
 * which finds the same number under the new name. */
static void moved_locked(struct meta_node *dir, uint64_t parent, char **path)
{
    unclean_below_locked(dir);
    drop_dirfd_locked(dir); /* opened at the old path */
    free(dir->path);
    dir->path = *path;
    dir->name = last_name(*path);
    dir->parent = parent;
    *path = NULL;
    bridge_count(BRIDGE_STAT_MOVED_DIRS);
}

/* Under g_meta_lock: the entry of base entry `node` (a child of `parent`, `st` as
 * the base shows it at `*path`), holding one more kernel reference; made if the
 * bridge does not know the node yet, in which case it takes `*path` (set to NULL).
 * NULL when the shard must answer: it knows the node otherwise, or the base entry
 * changed since the bridge saw it. */
static struct meta_node *take_ref(uint64_t node, uint64_t parent, char **path,
                                  const struct stat *st)
{
    struct meta_node *e = node_get(node);
    if (e != NULL && (!(e->flags & META_LOCAL) || e->seen.st_mode != st->st_mode ||
                      e->seen.st_size != st->st_size ||
                      ts_ns(&e->seen.st_mtim) != ts_ns(&st->st_mtim)))
        return NULL;
    if (e != NULL && S_ISDIR(st->st_mode) && e->path != NULL && strcmp(e->path, *path) != 0) {
        if (e->flags & META_BOUND)
            return NULL; /* the shard has it bound where it was: it decides */
        moved_locked(e, parent, path);
    }
    if (e == NULL) {
        e = calloc(1, sizeof *e);
        if (e == NULL || map_put(&g_meta.nodes, node, e) != 0) {
            free(e);
            return NULL;
        }
        e->node = node;
        e->parent = parent;
        e->path = *path;
        e->name = last_name(*path);
        e->seen = *st;
        e->flags = META_LOCAL | (S_ISDIR(st->st_mode) ? META_CLEAN_DIR : 0);
        *path = NULL;
    }
    e->kernel_refs++;
    e->local_refs++;
    return e;
}

/* Under g_meta_lock: a reference to the fd `dir`'s children are stat'ed from
 * (dirfd_put it), or NULL; a stale one (`events` moved on) is dropped. */
static struct dirfd *dir_fd_locked(struct meta_node *dir, uint64_t events)
{
    if (dir->dirfd != NULL && dirfd_events(dir->dirfd) != events)
        drop_dirfd_locked(dir);
    return dir->dirfd != NULL ? dirfd_get(dir->dirfd) : NULL;
}

/* Under g_meta_lock: the directories above `dir` up to the base root (its
 * parent first; at most `cap`), or -1 when one is not this file's answer (its
 * parent unknown). */
static int above_locked(const struct meta_node *dir, uint64_t *out, int cap)
{
    int n = 0;
    for (const struct meta_node *e = dir; e->path[0] != '\0'; n++) {
        if (!(e->flags & META_LOCAL) || n == cap || (e = node_get(out[n] = e->parent)) == NULL ||
            e->path == NULL)
            return -1;
    }
    return n;
}

/* Whether every directory in `dirs` is watched, so a rename or removal of any
 * of them advances watch_events() (bridge_dirfd.c). */
static int all_watched(const uint64_t *dirs, int n)
{
    for (int i = 0; i < n; i++) {
        if (watch_gen(dirs[i]) == 0)
            return 0;
    }
    return n >= 0;
}

int meta_lookup(fuse_req_t req, uint64_t parent, const char *name)
{
    if (!base_ready())
        return 0;
    if (parent == 1 && !root_probed())
        probe_root();
    uint64_t absent_ep = absent_epoch(), clean_ep = clean_epoch();
    uint64_t events = watch_events(); /* before the watches are looked at */
    uint64_t above[META_DIRFD_DEPTH];
    int nabove = -1;
    pthread_mutex_lock(&g_meta_lock);
    uint64_t epoch = g_meta.epoch;
    struct meta_node *pe = node_get(parent);
    char *path = NULL, *dir_path = NULL;
    struct dirfd *dfd = NULL, *opened = NULL;
    int in_root = 0;
    if (pe != NULL && (pe->flags & META_CLEAN_DIR) && pe->path != NULL && !tainted(parent)) {
        path = join(pe->path, name);
        in_root = pe->path[0] == '\0';
        if (!in_root && (dfd = dir_fd_locked(pe, events)) == NULL &&
            (nabove = above_locked(pe, above, META_DIRFD_DEPTH)) >= 0)
            dir_path = strdup(pe->path);
    }
    pthread_mutex_unlock(&g_meta_lock);
    if (path == NULL) {
        free(dir_path);
        return 0;
    }
    /* From the directory's fd when it may be kept (bridge_dirfd.c), from the
     * base fd in the base root, else by the path from the root. */
    if (dir_path != NULL && all_watched(above, nabove) &&
        (dfd = opened = dirfd_open(clean_base_fd(), dir_path, events)) != NULL)
        (void)watch_dir(parent, dirfd_fd(opened)); /* so its subdirectories may keep fds */
    struct stat st;
    if (dfd != NULL)
        bridge_count(BRIDGE_STAT_DIRFD_LOOKUPS);
    int rc = dfd != NULL            ? meta_stat_at(dirfd_fd(dfd), name, &st)
             : in_root ? meta_stat_at(clean_base_fd(), name, &st)
                       : meta_stat_beneath(path, &st);
    uint64_t node = rc == 0 ? derived_node(&st) : 0;
    int answered = 0;
    if ((rc != 0 && rc != -ENOENT) || (rc == 0 && node == 0))
        goto done; /* the shard decides */
    struct fuse_entry_param ep;
    memset(&ep, 0, sizeof ep);
    ep.entry_timeout = g_bridge.cache_timeout; /* rc == -ENOENT: a negative entry */
    gate_enter(); /* until the reply is written: no taint can slip in between */
    pthread_mutex_lock(&g_meta_lock);
    pe = node_get(parent);
    if (g_meta.epoch != epoch || pe == NULL || !(pe->flags & META_CLEAN_DIR))
        goto out;
    if (opened != NULL && pe->dirfd == NULL && pe->path != NULL && strcmp(pe->path, dir_path) == 0)
        pe->dirfd = dirfd_get(opened); /* kept for its next LOOKUPs */
    if (rc == 0) {
        if (tainted(node))
            goto out;
        struct meta_node *e = take_ref(node, parent, &path, &st);
        if (e == NULL)
            goto out; /* known otherwise, or changed since: the shard decides */
        ep.ino = node;
        attr_of_base(&st, &ep.attr);
        ep.attr_timeout = g_bridge.cache_timeout;
        absent_mark_inode(node, absent_ep); /* an unbound base entry has no xattrs */
        if (S_ISREG(st.st_mode) && st.st_size > 0)
            clean_learn(node, e->path, &st, clean_ep);
        bridge_count(BRIDGE_STAT_META_ANSWERS);
    }
    answered = 1;
out:
    pthread_mutex_unlock(&g_meta_lock);
    if (answered)
        fuse_reply_entry(req, &ep); /* its reference is counted (take_ref) before it */
    gate_leave();
done:
    dirfd_put(dfd);
    free(dir_path);
    free(path);
    return answered;
}

int meta_listable(uint64_t dir, uint64_t *epoch)
{
    if (!base_ready())
        return 0;
    if (dir == 1 && !root_probed())
        probe_root();
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(dir);
    int ok = e != NULL && (e->flags & META_CLEAN_DIR) && e->path != NULL && !tainted(dir);
    *epoch = g_meta.epoch;
    pthread_mutex_unlock(&g_meta_lock);
    return ok;
}

uint64_t meta_claim_listing(const char *path)
{
    struct stat st;
    if (!base_ready() || meta_stat_beneath(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return 0;
    uint64_t node = derived_node(&st);
    if (node == 0)
        return 0;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(node);
    int ok = e != NULL && (e->flags & META_CLEAN_DIR) && !(e->flags & META_LISTED) &&
             e->path != NULL && !tainted(node);
    if (ok)
        e->flags |= META_LISTED;
    pthread_mutex_unlock(&g_meta_lock);
    return ok ? node : 0;
}

int meta_dirent(uint64_t dir, int dir_fd, const char *name, uint64_t epoch,
                struct fuse_entry_param *out)
{
    uint64_t absent_ep = absent_epoch(), clean_ep = clean_epoch();
    char *path = meta_child_path(dir, name);
    if (path == NULL)
        return 0;
    struct stat st;
    int rc = meta_stat_at(dir_fd, name, &st);
    if (rc == -ENOENT) {
        free(path);
        return -1; /* removed since it was listed: the shard skips it too */
    }
    uint64_t node = rc == 0 && !changing(&st) ? derived_node(&st) : 0;
    int answered = 0;
    pthread_mutex_lock(&g_meta_lock);
    if (node == 0 || g_meta.epoch != epoch || tainted(node))
        goto out;
    struct meta_node *e = take_ref(node, dir, &path, &st);
    if (e == NULL)
        goto out;
    memset(out, 0, sizeof *out);
    out->ino = node;
    attr_of_base(&st, &out->attr);
    out->attr_timeout = g_bridge.cache_timeout;
    out->entry_timeout = g_bridge.cache_timeout;
    absent_mark_inode(node, absent_ep);
    if (S_ISREG(st.st_mode) && st.st_size > 0)
        clean_learn(node, e->path, &st, clean_ep);
    bridge_count(BRIDGE_STAT_META_ANSWERS);
    answered = 1;
out:
    pthread_mutex_unlock(&g_meta_lock);
    free(path);
    return answered;
}

int meta_kernel_holds(uint64_t dir, const char *name, uint64_t base_ino)
{
    if (base_ino == 0 || base_ino >= META_BASE_INO_SPAN)
        return 0;
    pthread_mutex_lock(&g_meta_lock);
    const struct meta_node *e = node_get(META_BASE_INO_START + base_ino);
    int held = e != NULL && (e->flags & META_LOCAL) && e->kernel_refs > 0 && e->parent == dir &&
               e->name != NULL && strcmp(e->name, name) == 0;
    pthread_mutex_unlock(&g_meta_lock);
    return held;
}

int meta_lock_if(uint64_t epoch)
{
    gate_enter();
    pthread_mutex_lock(&g_meta_lock);
    int same = g_meta.epoch == epoch;
    pthread_mutex_unlock(&g_meta_lock);
    if (!same)
        gate_leave();
    return same;
}

void meta_unlock(void) { gate_leave(); }

/* A node this file answered and nobody changed since: its attributes. */
static int local_attr(uint64_t ino, struct stat *attr, struct stat *seen)
{
    struct meta_node *e = node_get(ino);
    if (e == NULL || !(e->flags & META_LOCAL) || tainted(ino))
        return 0;
    attr_of_base(&e->seen, attr);
    if (seen != NULL)
        *seen = e->seen;
    return 1;
}

int meta_getattr(fuse_req_t req, uint64_t ino)
{
    struct stat st;
    gate_enter();
    pthread_mutex_lock(&g_meta_lock);
    int known = local_attr(ino, &st, NULL);
    pthread_mutex_unlock(&g_meta_lock);
    if (known) {
        fuse_reply_attr(req, &st, g_bridge.cache_timeout);
        bridge_count(BRIDGE_STAT_META_ANSWERS);
    }
    gate_leave();
    return known;
}

int meta_base_file(uint64_t ino, char *path, size_t cap, struct stat *seen)
{
    struct stat attr;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(ino);
    int known = local_attr(ino, &attr, seen) && S_ISREG(seen->st_mode) && e->path != NULL &&
                strlen(e->path) < cap;
    if (known)
        strcpy(path, e->path);
    pthread_mutex_unlock(&g_meta_lock);
    return known;
}

int meta_lseek(fuse_req_t req, uint64_t ino, uint64_t off, int whence)
{
    struct stat attr, seen;
    gate_enter();
    pthread_mutex_lock(&g_meta_lock);
    int known = local_attr(ino, &attr, &seen) && S_ISREG(seen.st_mode) &&
                (whence == SEEK_DATA || whence == SEEK_HOLE);
    pthread_mutex_unlock(&g_meta_lock);
    if (known) {
        /* An untouched base file is one data extent over its size, as the volume
         * pins it: data at any offset inside, the only hole at the end. */
        uint64_t size = (uint64_t)seen.st_size;
        if (off >= size)
            fuse_reply_err(req, ENXIO);
        else
            fuse_reply_lseek(req, (off_t)(whence == SEEK_DATA ? off : size));
        bridge_count(BRIDGE_STAT_META_ANSWERS);
    }
    gate_leave();
    return known;
}

int meta_access(fuse_req_t req, uint64_t ino)
{
    struct stat st;
    gate_enter();
    pthread_mutex_lock(&g_meta_lock);
    int known = local_attr(ino, &st, NULL);
    pthread_mutex_unlock(&g_meta_lock);
    if (known) {
        fuse_reply_err(req, 0); /* the shard's fs.access only checks the inode exists */
        bridge_count(BRIDGE_STAT_META_ANSWERS);
    }
    gate_leave();
    return known;
}

int meta_readlink(fuse_req_t req, uint64_t ino)
{
    struct stat attr, seen;
    char *path = NULL;
    pthread_mutex_lock(&g_meta_lock);
    uint64_t epoch = g_meta.epoch;
    struct meta_node *e = node_get(ino);
    if (local_attr(ino, &attr, &seen) && S_ISLNK(seen.st_mode) && e->path != NULL)
        path = strdup(e->path);
    pthread_mutex_unlock(&g_meta_lock);
    if (path == NULL)
        return 0;
    int fd = base_open(clean_base_fd(), path, O_PATH);
    free(path);
    if (fd < 0)
        return 0;
    struct stat now;
    char target[PATH_MAX + 1];
    ssize_t n = -1;
    if (fstat(fd, &now) == 0 && now.st_dev == seen.st_dev && now.st_ino == seen.st_ino &&
        now.st_size == seen.st_size && ts_ns(&now.st_mtim) == ts_ns(&seen.st_mtim))
        n = readlinkat(fd, "", target, PATH_MAX);
    close(fd);
    if (n < 0 || n != seen.st_size)
        return 0; /* changed since the kernel saw it: the shard decides */
    target[n] = '\0';
    int answered = meta_lock_if(epoch);
    if (answered) {
        fuse_reply_readlink(req, target);
        bridge_count(BRIDGE_STAT_META_ANSWERS);
        meta_unlock();
    }
    return answered;
}

uint64_t meta_forget(uint64_t ino, uint64_t nlookup)
{
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(ino);
    if (e == NULL) {
        pthread_mutex_unlock(&g_meta_lock);
        return nlookup;
    }
    uint64_t local = nlookup < e->local_refs ? nlookup : e->local_refs;
    e->local_refs -= local;
    e->kernel_refs -= nlookup < e->kernel_refs ? nlookup : e->kernel_refs;
    if (e->kernel_refs == 0 && ino != 1) {
        map_del(&g_meta.nodes, ino);
        node_free(e);
    }
    pthread_mutex_unlock(&g_meta_lock);
    return nlookup - local;
}

void meta_note_attr(uint64_t node, const msgpack_object *attr, uint64_t epoch, int entry)
{
    const msgpack_object *mark = mp_get(attr, "dir");
    const char *p = NULL;
    uint32_t n = 0;
    const msgpack_object *bound = NULL;
    if (mark != NULL && mark->type == MSGPACK_OBJECT_ARRAY && mark->via.array.size == 2 &&
        mp_bytes(&mark->via.array.ptr[0], &p, &n) && n < PATH_MAX &&
        memchr(p, '\0', n) == NULL && mark->via.array.ptr[1].type == MSGPACK_OBJECT_ARRAY)
        bound = &mark->via.array.ptr[1];
    else
        mark = NULL;
    if (node == 1)
        __atomic_store_n(&g_meta.root_probed, 1, __ATOMIC_RELEASE); /* the kernel asked first */
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(node);
    if (e != NULL) {
        e->flags |= META_BOUND; /* the shard answered for it: it has it */
        if (entry)
            e->kernel_refs++;
    }
    if (mark == NULL || g_meta.epoch != epoch || !base_ready()) {
        if (e != NULL)
            unclean_locked(e);
        pthread_mutex_unlock(&g_meta_lock);
        return;
    }
    if (e == NULL && (entry || node == 1)) {
        e = calloc(1, sizeof *e);
        if (e != NULL && map_put(&g_meta.nodes, node, e) != 0) {
            free(e);
            e = NULL;
        }
        if (e != NULL) {
            e->node = node;
            e->kernel_refs = node == 1 ? 1 : 1; /* the root is never forgotten */
            e->flags = META_BOUND;
        }
    }
    char *path = e != NULL ? malloc((size_t)n + 1) : NULL;
    if (path != NULL) {
        while (n > 0 && p[0] == '/') {
            p++;
            n--;
        }
        memcpy(path, p, n);
        path[n] = '\0';
        if (e->path == NULL || strcmp(e->path, path) != 0) {
            unclean_locked(e); /* marked again below, at its new path */
            if (e->path != NULL)
                unclean_below_locked(e); /* paths below it are under the old one */
        }
        free(e->path);
        e->path = path;
        e->name = last_name(path);
        int ok = 1;
        for (uint32_t i = 0; i < bound->via.array.size && ok; i++) {
            uint64_t child;
            ok = mp_uint(&bound->via.array.ptr[i], &child) &&
                 map_put(&g_meta.tainted, child, (void *)1) == 0;
        }
        ok = ok && !g_meta.degraded;
        if (ok)
            e->flags |= META_CLEAN_DIR;
        else
            unclean_locked(e);
    }
    pthread_mutex_unlock(&g_meta_lock);
}

/* What binding `node` in the shard needs, read under the lock. */
struct bind_plan {
    uint64_t parent, refs;
    struct stat seen;
    char name[NAME_MAX * 4 + 1];
    int needed;
};

static struct bind_plan plan_of(uint64_t node)
{
    struct bind_plan plan;
    memset(&plan, 0, sizeof plan);
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(node);
    if (e != NULL && (e->flags & META_LOCAL) && e->path != NULL &&
        (e->local_refs > 0 || !(e->flags & META_BOUND)) && strlen(e->name) < sizeof plan.name) {
        plan.needed = 1;
        plan.parent = e->parent;
        plan.refs = e->local_refs;
        plan.seen = e->seen;
        strcpy(plan.name, e->name);
    }
    pthread_mutex_unlock(&g_meta_lock);
    return plan;
}

int meta_prepare(uint64_t node)
{
    struct bind_plan plan = plan_of(node);
    if (!plan.needed)
        return 0;
    int rc = meta_prepare(plan.parent); /* bounded by the path's depth */
    if (rc != 0)
        return rc;
    const msgpack_object *res;
    uint64_t epoch = meta_epoch();
    enc_bind(plan.parent, plan.name, node, &plan.seen, plan.refs);
    rc = link_call(&res);
    if (rc != 0)
        return rc;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *e = node_get(node);
    if (e != NULL) {
        e->local_refs -= plan.refs < e->local_refs ? plan.refs : e->local_refs;
        e->flags |= META_BOUND;
    }
    pthread_mutex_unlock(&g_meta_lock);
    meta_note_attr(node, res, epoch, 0);
    return 0;
}

int meta_prepare_child(uint64_t parent, const char *name)
{
    char *path = NULL;
    pthread_mutex_lock(&g_meta_lock);
    struct meta_node *pe = node_get(parent);
    if (pe != NULL && pe->path != NULL && base_ready())
        path = join(pe->path, name);
    pthread_mutex_unlock(&g_meta_lock);
    if (path == NULL)
        return 0;
    struct stat st;
    int rc = meta_stat_beneath(path, &st);
    free(path);
    uint64_t node = rc == 0 ? derived_node(&st) : 0;
    if (node == 0)
        return 0;
    rc = meta_prepare(node);
    meta_taint(node); /* it loses or changes a name: its attributes are the shard's now */
    return rc;
}


