/*
 * A writeback mount's stale file sizes: the kernel's inode of a file another
 * client changed is dropped (FUSE_NOTIFY_PRUNE), so its next lookup brings
 * the shard's size and times.
 *
 * Theory of operation.  With FUSE's writeback cache the kernel owns a
 * regular file's size, mtime and ctime: it ignores those fields of every
 * later GETATTR or LOOKUP reply for an inode it holds (fuse_get_cache_mask),
 * and FUSE_NOTIFY_INVAL_INODE drops pages and attributes but not the size.
 * So when another client (the SDK, a rebase onto other agents' work) changes
 * a file, the shard's ["file", ino] note (slates.node.shard.invalidations)
 * reaches bridge_notify_inval_file (bridge_session.c), which, in a writeback
 * mount, asks the kernel to prune the inode: the kernel drops its unused
 * names for it and, if nothing else holds it (no open file, no mapping),
 * evicts it, and the FORGET that follows (prune_forgotten, from
 * bridge_ops.c's send_forgets) says it is gone.  The next lookup makes a
 * fresh inode from the shard's attributes: the same node id and inode number,
 * the new size.
 *
 * A file held open when the note comes cannot be evicted; it keeps its old
 * size until the last holder lets go.  So every pruned inode stays pending
 * until its FORGET, and bridge_prune_retry (called by the Python watcher
 * thread every PRUNE_RETRY_SECONDS while any is pending: slates.fuse.bridge)
 * asks again for all of them.  Asking for an inode the kernel already dropped,
 * or has looked up fresh since, costs nothing worse than a later lookup.
 *
 * FUSE_NOTIFY_PRUNE is protocol 7.45 (Linux 6.18); op_init turns the
 * writeback cache off on an older kernel, where a writeback mount could not
 * follow another client's size change.  The write-through mount never prunes:
 * its kernel takes the shard's size from every reply.
 *
 * Bounded: at most PRUNE_PENDING_MAX inodes wait (past that an inode is asked
 * for once, and counted in BRIDGE_STAT_PRUNES like every prune sent);
 * a retry sends them in batches of PRUNE_BATCH node ids.  Any thread may note
 * or forget; the pending set has its own lock.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <linux/fuse.h>
#include <unistd.h>

#define FUSE_NOTIFY_PRUNE_CODE 9 /* linux/fuse.h 7.45: FUSE_NOTIFY_PRUNE */
#define PRUNE_PENDING_MAX 4096u
#define PRUNE_BATCH 64u

static struct u64map g_pending; /* ino -> (void *)1 */
static pthread_mutex_t g_prune_lock = PTHREAD_MUTEX_INITIALIZER;

/* One FUSE_NOTIFY_PRUNE for `n` node ids: 0 or -errno. */
static int send_prune(const uint64_t *ids, uint32_t n)
{
    struct {
        struct fuse_out_header head;
        uint32_t count, padding;
        uint64_t spare;
        uint64_t ids[PRUNE_BATCH];
    } msg;
    if (g_bridge.se == NULL || n == 0 || n > PRUNE_BATCH)
        return -EINVAL;
    size_t len = offsetof(__typeof__(msg), ids) + n * sizeof msg.ids[0];
    memset(&msg, 0, offsetof(__typeof__(msg), ids));
    msg.head.len = (uint32_t)len;
    msg.head.error = FUSE_NOTIFY_PRUNE_CODE; /* a notification names its code here */
    msg.count = n;
    memcpy(msg.ids, ids, n * sizeof ids[0]);
    ssize_t wrote = write(fuse_session_fd(g_bridge.se), &msg, len);
    if (wrote < 0)
        return -errno;
    for (uint32_t i = 0; i < n; i++)
        bridge_count(BRIDGE_STAT_PRUNES);
    return wrote == (ssize_t)len ? 0 : -EIO;
}

int prune_note(uint64_t ino)
{
    pthread_mutex_lock(&g_prune_lock);
    if (g_pending.len < PRUNE_PENDING_MAX)
        (void)map_put(&g_pending, ino, (void *)1); /* -ENOMEM: asked for once only */
    pthread_mutex_unlock(&g_prune_lock);
    int rc = send_prune(&ino, 1); /* after the note: its FORGET may come at once */
    return rc == -ENOENT ? 0 : rc;
}

void prune_forgotten(uint64_t ino)
{
    pthread_mutex_lock(&g_prune_lock);
    if (g_pending.len > 0)
        map_del(&g_pending, ino);
    pthread_mutex_unlock(&g_prune_lock);
}

long bridge_prune_pending(void)
{
    pthread_mutex_lock(&g_prune_lock);
    long n = (long)g_pending.len;
    pthread_mutex_unlock(&g_prune_lock);
    return n;
}

long bridge_prune_retry(void)
{
    uint64_t ids[PRUNE_BATCH];
    uint32_t n = 0;
    long pending = 0;
    int rc = 0;
    pthread_mutex_lock(&g_prune_lock);
    for (size_t i = 0; i < g_pending.cap && rc == 0; i++) {
        if (g_pending.keys[i] == 0)
            continue;
        pending++;
        ids[n++] = g_pending.keys[i];
        if (n == PRUNE_BATCH) {
            rc = send_prune(ids, n);
            n = 0;
        }
    }
    if (n > 0 && rc == 0)
        rc = send_prune(ids, n);
    pthread_mutex_unlock(&g_prune_lock);
    return rc < 0 && rc != -ENOENT ? rc : pending;
}
