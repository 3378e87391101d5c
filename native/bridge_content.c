/*
 * Files made through this mount, read back without the shard.
 *
 * Theory of operation.  A write-through kernel marks a page of the page
 * cache up to date only when one write(2) covered all of it, so a file
 * written in small pieces (an assembler's object file, an archive `ar`
 * builds member by member, a linker's output) is read back from the server
 * page by page: a lua build's link steps sent 326 READs, each queued in the
 * ring behind the writes answered early (bridge_behind.c), about 120 us
 * each, one after another.  Yet every byte of such a file passed through this
 * bridge.  So for a file that begins empty here (a CREATE answered with an
 * empty regular file, or a SETATTR truncating one to size 0) the bridge keeps
 * a copy of its content, and from then on:
 *
 *   - every WRITE the shard applied or promised (an early answer) is copied
 *     in, and a SETATTR of its size cuts or zero-extends it, in the order the
 *     bridge sends them to the shard (under the link lock);
 *   - anything else that changes its content drops the copy: FALLOCATE,
 *     COPY_FILE_RANGE into it, a write that failed (or whose early answer the
 *     shard later refused: bridge_behind.c's latch), the kernel's FORGET, and
 *     the shard's invalidation of the inode (another client changed it:
 *     bridge_notify_inval_inode, on the watcher thread, before the shard
 *     answers that client);
 *   - a READ of it is answered from the copy (content_read), bytes past its
 *     size read as the end of the file, as the shard would answer.
 * A copy is only ever begun when no invalidation ran since the request that
 * made the file empty was sent (content_epoch, as bridge_attr.c does), so it
 * never starts from a state another client already changed.  Updates to a
 * copy need no such check: a write the shard applied before another client's
 * change is copied before that change's invalidation drops the copy, or
 * after it, when there is no copy left to update.  An answer is written to
 * the kernel while holding this table's lock, so it reaches the kernel
 * before an invalidation that drops the copy calls the kernel's notify.
 *
 * Bounded: a file is kept up to CONTENT_FILE_MAX bytes (a write past that
 * drops its copy), and all copies up to CONTENT_TOTAL_MAX bytes of buffers:
 * a copy that would pass it first drops every other copy.  Counted:
 * BRIDGE_STAT_CONTENT_READS.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <pthread.h>

#define CONTENT_FILE_MAX (8ull << 20)
#define CONTENT_TOTAL_MAX (64ull << 20)

struct content {
    uint64_t size;
    uint64_t cap;
    uint8_t *buf;
};

static struct {
    struct u64map by_ino; /* ino -> struct content * */
    uint64_t total;       /* bytes of buffers held */
    uint64_t epoch;       /* invalidations so far */
} g_content;
static pthread_mutex_t g_content_lock = PTHREAD_MUTEX_INITIALIZER;

uint64_t content_epoch(void) { return __atomic_load_n(&g_content.epoch, __ATOMIC_ACQUIRE); }

/* Under the lock. */
static void drop_locked(uint64_t ino)
{
    struct content *c = map_get(&g_content.by_ino, ino);
    if (c == NULL)
        return;
    map_del(&g_content.by_ino, ino);
    g_content.total -= c->cap;
    free(c->buf);
    free(c);
}

/* Under the lock: every copy but `keep`'s (map_del may move entries, so the
 * inodes are listed first). */
static void drop_others_locked(uint64_t keep)
{
    size_t n = 0;
    uint64_t *inos = malloc(g_content.by_ino.len * sizeof *inos);
    if (inos == NULL)
        return; /* the copy grows past the bound this once */
    for (size_t i = 0; i < g_content.by_ino.cap; i++) {
        uint64_t ino = g_content.by_ino.keys[i];
        if (ino != 0 && ino != keep)
            inos[n++] = ino;
    }
    for (size_t i = 0; i < n; i++)
        drop_locked(inos[i]);
    free(inos);
}

/* Under the lock: room for `size` bytes in `ino`'s copy, or the copy dropped (0). */
static int reserve_locked(uint64_t ino, struct content *c, uint64_t size)
{
    if (size <= c->cap)
        return 1;
    if (size > CONTENT_FILE_MAX) {
        drop_locked(ino);
        return 0;
    }
    uint64_t cap = c->cap ? c->cap : 4096;
    while (cap < size)
        cap *= 2;
    if (cap > CONTENT_FILE_MAX)
        cap = CONTENT_FILE_MAX;
    if (g_content.total - c->cap + cap > CONTENT_TOTAL_MAX)
        drop_others_locked(ino);
    uint8_t *grown = realloc(c->buf, cap);
    if (grown == NULL) {
        drop_locked(ino);
        return 0;
    }
    g_content.total += cap - c->cap;
    c->buf = grown;
    c->cap = cap;
    return 1;
}

void content_start(uint64_t ino, uint64_t epoch)
{
    pthread_mutex_lock(&g_content_lock);
    drop_locked(ino);
    struct content *c = calloc(1, sizeof *c);
    if (c != NULL && epoch == g_content.epoch && map_put(&g_content.by_ino, ino, c) == 0)
        c = NULL; /* kept */
    free(c);
    pthread_mutex_unlock(&g_content_lock);
}

void content_write(uint64_t ino, uint64_t off, const void *data, size_t n)
{
    pthread_mutex_lock(&g_content_lock);
    struct content *c = map_get(&g_content.by_ino, ino);
    if (c != NULL && n > 0) {
        uint64_t end = off + n;
        if (end < off) {
            drop_locked(ino);
        } else if (reserve_locked(ino, c, end)) {
            if (off > c->size)
                memset(c->buf + c->size, 0, off - c->size); /* a hole reads as zeros */
            memcpy(c->buf + off, data, n);
            if (end > c->size)
                c->size = end;
        }
    }
    pthread_mutex_unlock(&g_content_lock);
}

void content_resize(uint64_t ino, uint64_t size)
{
    pthread_mutex_lock(&g_content_lock);
    struct content *c = map_get(&g_content.by_ino, ino);
    if (c != NULL && reserve_locked(ino, c, size)) {
        if (size > c->size)
            memset(c->buf + c->size, 0, size - c->size);
        c->size = size;
    }
    pthread_mutex_unlock(&g_content_lock);
}

void content_drop(uint64_t ino)
{
    pthread_mutex_lock(&g_content_lock);
    if (g_content.by_ino.len > 0)
        drop_locked(ino);
    pthread_mutex_unlock(&g_content_lock);
}

void content_invalidate(uint64_t ino)
{
    pthread_mutex_lock(&g_content_lock);
    __atomic_add_fetch(&g_content.epoch, 1, __ATOMIC_ACQ_REL);
    if (g_content.by_ino.len > 0)
        drop_locked(ino);
    pthread_mutex_unlock(&g_content_lock);
}

int content_read(fuse_req_t req, uint64_t ino, uint64_t off, size_t size)
{
    pthread_mutex_lock(&g_content_lock);
    const struct content *c = g_content.by_ino.len > 0 ? map_get(&g_content.by_ino, ino) : NULL;
    if (c == NULL) {
        pthread_mutex_unlock(&g_content_lock);
        return 0;
    }
    size_t n = off >= c->size ? 0 : (size_t)(c->size - off < size ? c->size - off : size);
    fuse_reply_buf(req, n ? (const char *)c->buf + off : NULL, n);
    pthread_mutex_unlock(&g_content_lock);
    bridge_count(BRIDGE_STAT_CONTENT_READS);
    return 1;
}
