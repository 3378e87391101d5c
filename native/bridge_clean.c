/*
 * Clean base reads: READs of files whose content is wholly their base
 * file's, answered from the base directory without asking the shard.
 *
 * Theory of operation.  A fresh workspace is mostly base files nobody has
 * changed; reading one through the shard costs a Python step per READ
 * (bench/RESULTS.md, "First touch") for bytes the shard itself only reads
 * from the base.  So the bridge learns, per inode, what the shard knows:
 * an ATTR (lookup, getattr, setattr, create, link, readdirplus entries)
 * for a regular file whose bytes are all the base file's, unchanged,
 * carries "base": [path, dev, ino, size, mtime_ns], its base-relative path
 * and the fingerprint the volume pinned (slates/node/fsops.py); every
 * other ATTR for the inode says nothing, and drops what was known.  A READ
 * of a known inode opens the path beneath the base directory fd
 * (bridge_set_base: opened and identity-checked by slates/fuse/bridge.py)
 * with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)
 * and O_NOFOLLOW | O_NONBLOCK, checks fstat against the fingerprint,
 * preads and closes: exactly the checks the shard's base reader makes
 * (slates/base/live.py), so a base file changed, replaced, removed or
 * swapped for a symlink or fifo is never read here.  Any doubt (no entry,
 * a mismatch, an error, a short read) sends the READ to the shard as
 * before, so BaseDrift stays the shard's to decide and to report.
 *
 * The file is opened for every READ rather than kept open: a base file
 * replaced by rename keeps its old inode (and fingerprint) alive behind a
 * cached fd, and the shard, which opens by path, would call that drift.
 *
 * When an entry stops being true.  The loop thread drops an inode's entry
 * before it forwards anything that may change the content (WRITE,
 * SETATTR, FALLOCATE, COPY_FILE_RANGE's destination) and when the kernel
 * forgets it; the reply's ATTR (if any) then teaches the new state.  The
 * watcher thread drops it when the shard invalidates the inode (another
 * client changed it: bridge_notify_inval_inode), before it acknowledges,
 * and the shard answers that client only after the acknowledgement, so
 * once another client's write returns no READ here serves the old bytes.
 * Race with that drop: the loop thread reads the epoch before it sends a
 * request and records the reply's entry only if no invalidation ran
 * meanwhile (as bridge_cache.c does).  Loop threads: the drops before a
 * mutation and the lessons of the shard's replies are all made under the
 * link lock (bridge_link.c), so a reply never re-teaches an entry a later
 * mutation dropped; a READ served here concurrently with a WRITE of the
 * same inode read the entry before the drop, i.e. it is ordered before the
 * write, as the kernel's page locks order the two.  Each loop thread has
 * its own read buffer.
 *
 * Files bridge_meta.c answered from the base itself (never bound in the
 * shard) and nobody changed since are clean too: a READ that finds no entry
 * here asks bridge_meta.c for the path and the stat it answered with, and
 * makes the same checks.
 *
 * Bounded: a direct-mapped table of CLEAN_SLOTS entries (made by
 * bridge_set_base, before the loop threads start) keyed by inode
 * number; a colliding inode evicts the one there (its READs then go to the
 * shard, unless bridge_meta.c knows it).  Paths are at most PATH_MAX bytes.  Counted: BRIDGE_STAT_CLEAN_READS
 * (READs answered here) and BRIDGE_STAT_CLEAN_MISSES (entries that failed
 * their check, so the shard answered).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CLEAN_SLOTS (1u << 16)

struct clean_entry {
    uint64_t ino; /* 0: empty */
    char *path;   /* relative to the base directory, no leading '/' */
    uint64_t dev, st_ino, size;
    int64_t mtime_ns;
};

static struct {
    struct clean_entry *slots; /* CLEAN_SLOTS of them, allocated on first use */
    uint64_t epoch;            /* invalidations so far (under the lock) */
    int base_fd;               /* -1: no clean reads */
    int disabled;              /* openat2 missing: stop trying (atomic) */
} g_clean = {.base_fd = -1};
static __thread char *t_read_buf; /* BRIDGE_MAX_IO bytes, one per loop thread */
static pthread_mutex_t g_clean_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t clean_slot(uint64_t ino)
{
    return (size_t)((ino * 0x9e3779b97f4a7c15ull) >> 32) & (CLEAN_SLOTS - 1);
}

static void clean_drop_locked(uint64_t ino)
{
    if (g_clean.slots == NULL || ino == 0)
        return;
    struct clean_entry *e = &g_clean.slots[clean_slot(ino)];
    if (e->ino == ino) {
        free(e->path);
        memset(e, 0, sizeof *e);
    }
}

static void clean_put(uint64_t ino, const char *path, uint32_t len, const uint64_t fp[3],
                      int64_t mtime_ns, uint64_t epoch);

int clean_base_fd(void)
{
    return __atomic_load_n(&g_clean.disabled, __ATOMIC_RELAXED) ? -1 : g_clean.base_fd;
}

void clean_thread_done(void)
{
    free(t_read_buf);
    t_read_buf = NULL;
}

void clean_learn(uint64_t ino, const char *path, const struct stat *st, uint64_t epoch)
{
    const uint64_t fp[3] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, (uint64_t)st->st_size};
    clean_put(ino, path, (uint32_t)strlen(path), fp, ts_ns(&st->st_mtim), epoch);
}

int bridge_set_base(int dir_fd)
{
    if (g_bridge.se != NULL) {
        /* Loop threads use base_fd without the lock: set it before mounting. */
        if (dir_fd >= 0)
            close(dir_fd);
        return -EBUSY;
    }
    if (dir_fd >= 0) {
        struct stat st;
        if (fstat(dir_fd, &st) != 0 || !S_ISDIR(st.st_mode)) {
            close(dir_fd);
            return -ENOTDIR;
        }
    }
    /* The table, before the loop threads run (zalloc_touched: no copy-on-write
     * faults later); a failure only means no clean reads. */
    struct clean_entry *fresh = dir_fd >= 0 && g_clean.slots == NULL
                                    ? zalloc_touched(CLEAN_SLOTS, sizeof *fresh)
                                    : NULL;
    pthread_mutex_lock(&g_clean_lock);
    if (fresh != NULL)
        g_clean.slots = fresh;
    int old = g_clean.base_fd;
    g_clean.base_fd = dir_fd;
    g_clean.epoch++;
    if (g_clean.slots != NULL) {
        for (size_t i = 0; i < CLEAN_SLOTS; i++)
            free(g_clean.slots[i].path);
        memset(g_clean.slots, 0, CLEAN_SLOTS * sizeof *g_clean.slots);
    }
    pthread_mutex_unlock(&g_clean_lock);
    if (old >= 0)
        close(old);
    return 0;
}

uint64_t clean_epoch(void)
{
    pthread_mutex_lock(&g_clean_lock);
    uint64_t epoch = g_clean.epoch;
    pthread_mutex_unlock(&g_clean_lock);
    return epoch;
}

void clean_drop(uint64_t ino)
{
    pthread_mutex_lock(&g_clean_lock);
    clean_drop_locked(ino);
    pthread_mutex_unlock(&g_clean_lock);
}

void clean_invalidate(uint64_t ino)
{
    pthread_mutex_lock(&g_clean_lock);
    g_clean.epoch++;
    clean_drop_locked(ino);
    pthread_mutex_unlock(&g_clean_lock);
}

/* Record (ino -> path, fingerprint) unless an invalidation ran since `epoch`. */
static void clean_put(uint64_t ino, const char *path, uint32_t len, const uint64_t fp[3],
                      int64_t mtime_ns, uint64_t epoch)
{
    while (len > 0 && path[0] == '/') {
        path++;
        len--;
    }
    if (ino == 0 || len == 0 || len >= PATH_MAX || memchr(path, '\0', len) != NULL) {
        clean_drop(ino);
        return;
    }
    char *copy = malloc((size_t)len + 1);
    if (copy == NULL) {
        clean_drop(ino); /* only a cache */
        return;
    }
    memcpy(copy, path, len);
    copy[len] = '\0';
    pthread_mutex_lock(&g_clean_lock);
    if (g_clean.slots == NULL || g_clean.base_fd < 0 || g_clean.epoch != epoch) {
        clean_drop_locked(ino);
        pthread_mutex_unlock(&g_clean_lock);
        free(copy);
        return;
    }
    struct clean_entry *e = &g_clean.slots[clean_slot(ino)];
    free(e->path); /* whoever was here: evicted, or this inode's old entry */
    e->ino = ino;
    e->path = copy;
    e->dev = fp[0];
    e->st_ino = fp[1];
    e->size = fp[2];
    e->mtime_ns = mtime_ns;
    pthread_mutex_unlock(&g_clean_lock);
}

void clean_note_attr(uint64_t ino, const msgpack_object *attr, uint64_t epoch)
{
    const msgpack_object *base = mp_get(attr, "base");
    int64_t mode;
    if (base == NULL || base->type != MSGPACK_OBJECT_ARRAY || base->via.array.size != 5 ||
        !mp_int(mp_get(attr, "mode"), &mode) || !S_ISREG((mode_t)mode)) {
        clean_drop(ino);
        return;
    }
    const msgpack_object *items = base->via.array.ptr;
    const char *path = NULL;
    uint32_t len = 0;
    uint64_t fp[3];
    int64_t mtime_ns;
    if (!mp_bytes(&items[0], &path, &len) || !mp_uint(&items[1], &fp[0]) ||
        !mp_uint(&items[2], &fp[1]) || !mp_uint(&items[3], &fp[2]) ||
        !mp_int(&items[4], &mtime_ns)) {
        clean_drop(ino);
        return;
    }
    clean_put(ino, path, len, fp, mtime_ns, epoch);
}

int base_open(int dir_fd, const char *path, int flags)
{
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (uint64_t)(flags | O_NOFOLLOW | O_CLOEXEC);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV;
    long fd;
    do
        fd = syscall(SYS_openat2, dir_fd, path[0] ? path : ".", &how, sizeof how);
    while (fd < 0 && (errno == EINTR || errno == EAGAIN));
    if (fd < 0 && errno == ENOSYS)
        __atomic_store_n(&g_clean.disabled, 1, __ATOMIC_RELAXED); /* never re-enabled */
    return (int)fd;
}

long clean_read(uint64_t ino, uint64_t off, size_t size, const char **out)
{
    char path[PATH_MAX];
    struct clean_entry want;
    if (__atomic_load_n(&g_clean.disabled, __ATOMIC_RELAXED) || size > BRIDGE_MAX_IO)
        return -1;
    pthread_mutex_lock(&g_clean_lock);
    const struct clean_entry *e =
        g_clean.slots != NULL ? &g_clean.slots[clean_slot(ino)] : NULL;
    int dir_fd = g_clean.base_fd; /* changes only before the mount (bridge_set_base) */
    if (e == NULL || e->ino != ino || ino == 0 || dir_fd < 0) {
        pthread_mutex_unlock(&g_clean_lock);
        struct stat seen;
        /* Not in the table (never taught, or evicted by a colliding inode): a
         * file bridge_meta.c answered and nobody changed is as clean. */
        if (dir_fd < 0 || ino == 0 || !meta_base_file(ino, path, sizeof path, &seen))
            return -1;
        memset(&want, 0, sizeof want);
        want.ino = ino;
        want.dev = (uint64_t)seen.st_dev;
        want.st_ino = (uint64_t)seen.st_ino;
        want.size = (uint64_t)seen.st_size;
        want.mtime_ns = ts_ns(&seen.st_mtim);
    } else {
        want = *e;
        strcpy(path, e->path); /* shorter than PATH_MAX (clean_put) */
        pthread_mutex_unlock(&g_clean_lock);
    }
    if (t_read_buf == NULL)
        t_read_buf = malloc(BRIDGE_MAX_IO);
    int fd = t_read_buf != NULL ? base_open(dir_fd, path, O_RDONLY | O_NONBLOCK | O_NOCTTY) : -1;
    long served = -1;
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_dev == want.dev &&
        (uint64_t)st.st_ino == want.st_ino && (uint64_t)st.st_size == want.size &&
        ts_ns(&st.st_mtim) == want.mtime_ns) {
        size_t n = off >= want.size ? 0 : (size_t)(want.size - off < size ? want.size - off : size);
        size_t done = 0;
        while (done < n) {
            ssize_t got = pread(fd, t_read_buf + done, n - done, (off_t)(off + done));
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0)
                break; /* an error or a file shorter than its fingerprint: the shard decides */
            done += (size_t)got;
        }
        if (done == n) {
            served = (long)n;
            *out = t_read_buf;
        }
    }
    if (fd >= 0)
        close(fd);
    if (served < 0) {
        clean_drop(ino); /* the shard answers, and its next ATTR teaches again */
        bridge_count(BRIDGE_STAT_CLEAN_MISSES);
    } else {
        bridge_count(BRIDGE_STAT_CLEAN_READS);
    }
    return served;
}

int bridge_test_clean_since(uint64_t ino, int invalidate_between)
{
    /* A fake base directory ("/"), one entry taught after an epoch read. */
    int had = g_clean.base_fd >= 0;
    if (!had && bridge_set_base(open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC)) != 0)
        return -EIO;
    uint64_t epoch = clean_epoch();
    if (invalidate_between)
        clean_invalidate(ino + 1); /* the watcher invalidates some inode meanwhile */
    const uint64_t fp[3] = {1, 2, 3};
    clean_put(ino, "/x", 2, fp, 4, epoch);
    pthread_mutex_lock(&g_clean_lock);
    int known = g_clean.slots != NULL && g_clean.slots[clean_slot(ino)].ino == ino;
    pthread_mutex_unlock(&g_clean_lock);
    clean_drop(ino);
    if (!had)
        bridge_set_base(-1);
    return known;
}
