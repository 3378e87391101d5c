/*
 * Attributes a mutation just produced: GETATTRs answered without the shard.
 *
 * Theory of operation.  With default_permissions the kernel invalidates a
 * directory's cached attributes after every CREATE, MKDIR, MKNOD, SYMLINK,
 * LINK, UNLINK, RMDIR and RENAME in it, and (write-through) a file's after
 * every WRITE, FALLOCATE and COPY_FILE_RANGE; the next permission check or
 * stat then costs a GETATTR round trip for attributes the shard has just
 * computed.  So the bridge asks for them with the mutation ("attrs": true,
 * slates/node/fsops.py): the reply carries the new ATTR of the parent(s)
 * or of the file, and the bridge keeps it here, keyed by node id, until the
 * kernel's GETATTR takes it (attr_answer, with the usual attribute timeout).
 * An entry is only ever what fs.getattr would answer now, so:
 *
 *   - every request that may change an inode's attributes drops the inode
 *     before it is forwarded (bridge_ops.c: SETATTR, WRITE, FALLOCATE,
 *     COPY_FILE_RANGE's destination, SETXATTR, REMOVEXATTR, LINK's inode and
 *     new parent, the parent of every entry made; LOOKUP and READDIR drop
 *     the directory, whose binds may touch it); UNLINK, RMDIR and RENAME
 *     drop everything (attr_drop_all: they change a child's nlink and ctime,
 *     and the bridge may not know the child's node), in O(1) by a generation;
 *   - the kernel's FORGET of an inode drops it; a reconnect drops all;
 *   - the shard's invalidation of an inode (another client changed it:
 *     bridge_notify_inval_inode; for bridge_notify_inval_entry, the
 *     directory) drops it on the watcher thread before the shard is
 *     acknowledged, and the shard answers that client only after that, so
 *     once another client's change returns no stat here shows the old state.
 *
 * Race with that drop: the loop thread reads the epoch before it sends the
 * mutation and records the reply's ATTRs only if no invalidation ran
 * meanwhile (as bridge_cache.c and bridge_clean.c do).  Race with the
 * kernel: an answer is given while holding the table's lock, so it reaches
 * the kernel before an invalidation that drops the entry calls the
 * kernel's notify (bridge_meta.c's reply gate, for the same reason).  Drops
 * before mutations and the records after them are made under the link lock
 * (bridge_link.c), so a reply never re-teaches an entry a later mutation
 * dropped; answers (any loop thread) take only this table's lock.
 *
 * Bounded: a direct-mapped table of ATTR_SLOTS entries, allocated on first
 * use (zalloc_touched); a colliding inode evicts the one there (its GETATTR
 * then goes to the shard).  Counted: BRIDGE_STAT_ATTR_ANSWERS.
 */
#include "bridge_internal.h"

#include <pthread.h>

#define ATTR_SLOTS (1u << 12)

struct attr_entry {
    uint64_t ino; /* 0: empty */
    uint64_t gen; /* valid while equal to g_attr.gen */
    struct stat st;
};

static struct {
    struct attr_entry *slots; /* ATTR_SLOTS of them, or NULL */
    uint64_t gen;             /* attr_drop_all so far, plus one */
    uint64_t epoch;           /* invalidations so far */
} g_attr = {.gen = 1};
static pthread_mutex_t g_attr_lock = PTHREAD_MUTEX_INITIALIZER;

static struct attr_entry *attr_slot(uint64_t ino)
{
    if (g_attr.slots == NULL)
        return NULL;
    return &g_attr.slots[(size_t)((ino * 0x9e3779b97f4a7c15ull) >> 40) & (ATTR_SLOTS - 1)];
}

static void attr_drop_locked(uint64_t ino)
{
    struct attr_entry *e = attr_slot(ino);
    if (e != NULL && e->ino == ino)
        e->ino = 0;
}

uint64_t attr_epoch(void)
{
    pthread_mutex_lock(&g_attr_lock);
    uint64_t epoch = g_attr.epoch;
    pthread_mutex_unlock(&g_attr_lock);
    return epoch;
}

void attr_drop(uint64_t ino)
{
    pthread_mutex_lock(&g_attr_lock);
    attr_drop_locked(ino);
    pthread_mutex_unlock(&g_attr_lock);
}

void attr_drop_all(void)
{
    pthread_mutex_lock(&g_attr_lock);
    g_attr.gen++;
    g_attr.epoch++; /* and a reply in flight (a reconnect's resend) records nothing */
    pthread_mutex_unlock(&g_attr_lock);
}

void attr_invalidate(uint64_t ino)
{
    pthread_mutex_lock(&g_attr_lock);
    g_attr.epoch++;
    attr_drop_locked(ino);
    pthread_mutex_unlock(&g_attr_lock);
}

static void attr_put(uint64_t ino, const struct stat *st, uint64_t epoch)
{
    if (ino == 0)
        return;
    pthread_mutex_lock(&g_attr_lock);
    if (g_attr.slots == NULL)
        g_attr.slots = zalloc_touched(ATTR_SLOTS, sizeof *g_attr.slots); /* NULL: no cache */
    struct attr_entry *e = attr_slot(ino);
    if (g_attr.epoch != epoch) {
        attr_drop_locked(ino); /* an invalidation ran since the request was sent */
    } else if (e != NULL) {
        e->ino = ino;
        e->gen = g_attr.gen;
        e->st = *st;
    }
    pthread_mutex_unlock(&g_attr_lock);
}

void attr_note(const msgpack_object *attr, uint64_t epoch)
{
    struct stat st;
    fuse_ino_t node = 0;
    if (attr == NULL || attr->type != MSGPACK_OBJECT_MAP)
        return; /* a shard that does not send it: the GETATTR goes to the shard */
    if (attr_from_node(attr, &st, &node) != 0) {
        attr_drop(node);
        return;
    }
    attr_put(node, &st, epoch);
}

int attr_answer(fuse_req_t req, uint64_t ino)
{
    pthread_mutex_lock(&g_attr_lock);
    struct attr_entry *e = attr_slot(ino);
    int hit = e != NULL && ino != 0 && e->ino == ino && e->gen == g_attr.gen;
    if (hit) {
        /* Under the lock: the answer reaches the kernel before any later
         * invalidation of this inode tells the kernel to forget it. */
        fuse_reply_attr(req, &e->st, g_bridge.cache_timeout);
        bridge_count(BRIDGE_STAT_ATTR_ANSWERS);
    }
    pthread_mutex_unlock(&g_attr_lock);
    return hit;
}

static int attr_known(uint64_t ino)
{
    pthread_mutex_lock(&g_attr_lock);
    struct attr_entry *e = attr_slot(ino);
    int known = e != NULL && ino != 0 && e->ino == ino && e->gen == g_attr.gen;
    pthread_mutex_unlock(&g_attr_lock);
    return known;
}

int bridge_test_attr_cache(uint64_t ino, int event)
{
    /* Record an entry for `ino` after reading the epoch, with `event` in
     * between or after: 0 none, 1 an invalidation of another inode before
     * the record, 2 a drop of it after, 3 a drop-all after, 4 an
     * invalidation of it after, 5 a drop of a colliding-free other inode
     * after.  Returns whether the entry is known afterwards. */
    struct stat st;
    memset(&st, 0, sizeof st);
    st.st_ino = (ino_t)ino;
    st.st_mode = S_IFDIR | 0755;
    uint64_t epoch = attr_epoch();
    if (event == 1)
        attr_invalidate(ino + 1);
    attr_put(ino, &st, epoch);
    if (event == 2)
        attr_drop(ino);
    else if (event == 3)
        attr_drop_all();
    else if (event == 4)
        attr_invalidate(ino);
    else if (event == 5)
        attr_drop(ino + 1);
    int known = attr_known(ino);
    attr_drop(ino);
    return known;
}
