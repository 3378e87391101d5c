/*
 * What the bridge answers without asking the shard: xattr names known to be
 * absent, per inode.
 *
 * The kernel and common tools probe a few xattr names constantly: the first
 * write(2) to a file after its attributes were fetched makes the kernel ask
 * for "security.capability" (once per file, not per write: the INIT reply
 * claims FUSE_HANDLE_KILLPRIV_V2, bridge_session.c, so the kernel marks an
 * inode with nothing to drop S_NOSEC), and `ls -l` asks for ACLs and SELinux
 * labels.  A volume can hold security.*
 * names (a client may set them; only the POSIX ACL names are refused,
 * slates/core/volume.py), so the bridge never assumes absence: it knows it
 * from the shard, per inode, in three ways:
 *   - a getxattr of that name answered "no such attribute";
 *   - an ATTR whose optional "xattrs" count is 0 (an entry or attribute
 *     reply: lookup, create, mkdir, readdirplus, getattr, ...; a shard that
 *     does not send the count teaches nothing this way);
 *   - the inode was just created through this mount (a new inode has no
 *     xattrs, and only setxattr adds one).
 * The memory of one inode is dropped by a setxattr/removexattr of that name
 * through this mount, by the kernel's forget of the inode, and by the
 * shard's invalidation of the inode (another client changed it:
 * bridge_notify_inval_inode, on the watcher thread).
 *
 * Race with that invalidation: the loop thread learns "absent" from a reply
 * and records it a moment later; an invalidation processed in between would
 * be undone.  So every invalidation starts a new epoch, the loop thread
 * reads the epoch before it sends the request, and records nothing when the
 * epoch moved (a skipped record only costs one more round trip later).
 *
 * Keys are (ino << 3 | name index) in a linear-probing set (0 is empty),
 * growing by doubling; allocation failure only loses cache entries.
 */
#include "bridge_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const char *const PROBED_XATTRS[] = {
    "security.capability",
    "system.posix_acl_access",
    "system.posix_acl_default",
    "security.selinux",
};
#define PROBED_COUNT (sizeof PROBED_XATTRS / sizeof PROBED_XATTRS[0])

uint64_t absent_key(uint64_t ino, const char *name)
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
    uint64_t epoch; /* invalidations so far (under the lock) */
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
        uint64_t *slots = zalloc_touched(cap, sizeof *slots);
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

int absent_has(uint64_t key)
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

void absent_remove(uint64_t key)
{
    pthread_mutex_lock(&g_absent_lock);
    absent_remove_locked(key);
    pthread_mutex_unlock(&g_absent_lock);
}

uint64_t absent_epoch(void)
{
    pthread_mutex_lock(&g_absent_lock);
    uint64_t epoch = g_absent.epoch;
    pthread_mutex_unlock(&g_absent_lock);
    return epoch;
}

void absent_add_since(uint64_t key, uint64_t epoch)
{
    pthread_mutex_lock(&g_absent_lock);
    if (g_absent.epoch == epoch)
        absent_add_locked(key);
    pthread_mutex_unlock(&g_absent_lock);
}

void absent_mark_inode(uint64_t ino, uint64_t epoch)
{
    if (ino == 0 || ino >> 60)
        return;
    pthread_mutex_lock(&g_absent_lock);
    if (g_absent.epoch == epoch) {
        for (size_t i = 0; i < PROBED_COUNT; i++)
            absent_add_locked(ino << 3 | (i + 1));
    }
    pthread_mutex_unlock(&g_absent_lock);
}

void absent_forget_inode(uint64_t ino)
{
    pthread_mutex_lock(&g_absent_lock);
    g_absent.epoch++;
    if (ino != 0 && !(ino >> 60)) {
        for (size_t i = 0; i < PROBED_COUNT; i++)
            absent_remove_locked(ino << 3 | (i + 1));
    }
    pthread_mutex_unlock(&g_absent_lock);
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

int bridge_test_absent_since(uint64_t ino, int invalidate_between)
{
    uint64_t epoch = absent_epoch();
    if (invalidate_between)
        absent_forget_inode(ino + 1); /* the watcher invalidates some inode meanwhile */
    absent_mark_inode(ino, epoch);
    return absent_has(absent_key(ino, "security.capability"));
}
