/*
 * Base directory fds kept for LOOKUPs: a clean directory's children are
 * stat'ed from an O_PATH fd of the base directory instead of by a path
 * walked from the base root.
 *
 * Theory of operation.  bridge_meta.c answers a LOOKUP in a clean directory
 * from the base.  By path, that is openat2 of the whole base-relative path
 * (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV), fstat and
 * close: three system calls and a walk of every component, about a quarter
 * of the bridge's loop thread while git's preload threads look up a
 * 100,000-file tree (bench/RESULTS.md).  From the directory's fd it is one
 * fstatat of one component (meta_stat_at: nothing followed, another device
 * refused), as a READDIRPLUS of the directory already does.
 *
 * A fd names the directory the path named when it was opened; a path names
 * whatever is there now.  The two differ only once a directory on the path
 * is renamed, removed or replaced in the live base, so a fd is used only
 * while that cannot have happened unseen: bridge_meta.c opens one only when
 * every directory above it is watched (bridge_watch.c), and every event any
 * watch reports, and every overflow of their queue, advances
 * watch_events(); a fd opened at another count than the current one is
 * stale, dropped, and the LOOKUP walks the path as before (the next one
 * opens a fresh fd).  The window left, between the base's change and its
 * event reaching the watch thread, is the one a LOOKUP by path in flight
 * has too.  Not covered: a file system mounted over a base directory after
 * its fd was opened (no watch reports a mount); its names are then those
 * of the directory underneath, where a path would have been refused as
 * another device.
 *
 * Sharing.  A holder is counted: its owner (the directory's node in
 * bridge_meta.c) holds one reference, and each LOOKUP using the fd another,
 * taken under g_meta_lock while the owner's is held; the last dirfd_put
 * closes the fd.  So a FORGET or a taint may drop a directory while another
 * loop thread still stats in it, and no fd is closed under a user (or
 * reused by a later open before its user is done).
 *
 * The fd table.  A process's fd table grows by doubling, and growing the
 * table of a process with several threads waits for an RCU grace period
 * (expand_fdtable): a few ms each on the VM measured, on the loop thread, so
 * opening git/git's 226 directories during a git status cost it about 25 ms
 * (0.080-0.085 s against 0.099-0.115 s, bench/RESULTS.md).  So the table is
 * grown once to hold every fd this file may keep, while the process still
 * has one thread (bridge_reserve_fds: a spare, before its job; any bridge in
 * bridge_configure, if not done before).
 *
 * Bounded: at most DIRFD_MAX fds, and at most a quarter of the soft
 * RLIMIT_NOFILE, are held at once; past that dirfd_open refuses and LOOKUPs
 * walk paths.  Counted: BRIDGE_STAT_DIRFD_LOOKUPS.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define DIRFD_MAX 4096
#define DIRFD_SPARE 256 /* room for the bridge's other fds (bridge_reserve_fds) */

struct dirfd {
    int fd;
    unsigned refs;   /* atomic: the owner's and each user's */
    uint64_t events; /* watch_events() when it was opened */
};

static long g_dirfds; /* atomic: holders open now */
static long g_dirfd_cap = -1;
static pthread_once_t g_dirfd_once = PTHREAD_ONCE_INIT;

static void cap_init(void)
{
    struct rlimit limit;
    long cap = DIRFD_MAX;
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
        (long)(limit.rlim_cur / 4) < cap)
        cap = (long)(limit.rlim_cur / 4);
    g_dirfd_cap = cap;
}

static void reserve(void)
{
    int any = open("/", O_PATH | O_CLOEXEC);
    if (any < 0)
        return;
    int high = fcntl(any, F_DUPFD_CLOEXEC, (int)g_dirfd_cap + DIRFD_SPARE);
    if (high >= 0)
        close(high);
    close(any);
}

void bridge_reserve_fds(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&g_dirfd_once, cap_init);
    pthread_once(&once, reserve);
}

struct dirfd *dirfd_open(int base_fd, const char *path, uint64_t events)
{
    pthread_once(&g_dirfd_once, cap_init);
    if (base_fd < 0)
        return NULL;
    if (__atomic_add_fetch(&g_dirfds, 1, __ATOMIC_RELAXED) > g_dirfd_cap) {
        __atomic_sub_fetch(&g_dirfds, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    struct dirfd *d = malloc(sizeof *d);
    int fd = d != NULL ? base_open(base_fd, path, O_PATH | O_DIRECTORY) : -1;
    if (fd < 0) {
        free(d);
        __atomic_sub_fetch(&g_dirfds, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    d->fd = fd;
    d->refs = 1;
    d->events = events;
    return d;
}

int dirfd_fd(const struct dirfd *d) { return d->fd; }

uint64_t dirfd_events(const struct dirfd *d) { return d->events; }

struct dirfd *dirfd_get(struct dirfd *d)
{
    __atomic_add_fetch(&d->refs, 1, __ATOMIC_RELAXED);
    return d;
}

void dirfd_put(struct dirfd *d)
{
    if (d == NULL || __atomic_sub_fetch(&d->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    close(d->fd);
    free(d);
    __atomic_sub_fetch(&g_dirfds, 1, __ATOMIC_RELAXED);
}
