/*
 * Base directory watches: a listing the kernel keeps of a clean directory is
 * dropped when the base directory's names change, so a kept listing is
 * never older than the base.
 *
 * Theory of operation.  The kernel keeps every directory listing it read
 * (no OPENDIR: FOPEN_CACHE_DIR) until an invalidation, and keeps the entries
 * of a READDIRPLUS reply for the entry timeout.  For a clean directory
 * (bridge_meta.c: every name is its base entry, answered from the base) the
 * only one who can change those names is whoever writes the base directory:
 * the developer, a tool, Slates' own write-back.  So the bridge watches each
 * clean directory it lists from the base (inotify, added on the open
 * directory before its first name is read: bridge_meta_dir.c), and on a
 * name created, removed or moved in it, or the directory itself removed or
 * moved, this file's thread drops the kernel's listing and attributes of
 * the directory (notify_inval_inode), so the next listing reads the base
 * again, as the first one did.  Names the kernel already holds are left
 * alone, and so are files' content and attributes: a base file changed,
 * removed or replaced under an entry the kernel holds is BaseDrift's to
 * report (DESIGN.md, "Base"), as before (a later listing, as ever, carries
 * the base's entries as they are then).  bridge_prefetch.c's walk keeps the
 * listings it reads only of directories watched here.
 *
 * Race with a listing in flight: a READDIRPLUS answered from a listing read
 * before a change, but written after its invalidation, would leave the old
 * listing in the kernel.  Every invalidation of a directory starts a new
 * generation of it; the answer reads the generation before it lists the
 * base and, when it changed by the time its reply is written, asks for the
 * invalidation again (watch_recheck), which this thread makes
 * WATCH_RECHECK_MS later, once the kernel has filled its cache from that
 * reply.
 *
 * Lifecycle (a table, as everywhere): IDLE --start--> RUNNING --stop-->
 * STOPPED, and any state --stop--> STOPPED.  The thread is detached; it
 * ends when stopped (an eventfd wakes it) and closes the inotify fd.
 * Notifications are made under g_watch_session_lock, which watch_stop takes
 * too, so none is made once the bridge stops (the session is destroyed
 * after).
 *
 * Every event taken (and the thread's end) advances watch_events(), which
 * tells bridge_dirfd.c when a directory fd it keeps may name another
 * directory than its path does now.
 *
 * Bounded: at most WATCH_MAX directories are watched (past that, or when
 * inotify refuses a watch, a directory is not watched and the walk drops
 * its listing as before); a queue overflow (IN_Q_OVERFLOW) invalidates every
 * watched directory.  Counted: BRIDGE_STAT_WATCH_INVALS (directories whose
 * listing a base change dropped).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#define WATCH_MAX 16384
#define WATCH_RECHECK_MS 20
#define WATCH_MASK                                                                         \
    (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF |  \
     IN_ONLYDIR)

enum watch_state { W_IDLE, W_RUNNING, W_STOPPED };
enum watch_event { W_START, W_STOP };

struct watched {
    uint64_t node;
    uint64_t gen;  /* invalidations of it so far, from 1 */
    int recheck;   /* a listing raced an invalidation: invalidate again */
};

static struct {
    enum watch_state state;
    int inotify_fd, wake_fd;
    struct u64map by_node; /* node -> struct watched * */
    struct u64map by_wd;   /* wd + 1 -> struct watched * (a key is never 0) */
    int rechecks; /* watched entries with recheck set */
    struct timespec recheck_due; /* when the first of them is to be made */
} g_watch = {.inotify_fd = -1, .wake_fd = -1};
static pthread_mutex_t g_watch_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_watch_session_lock = PTHREAD_MUTEX_INITIALIZER;

/* Under g_watch_lock: the state `event` leads to from the current one, or -1. */
static int next_state(enum watch_event event)
{
    switch (event) {
    case W_START:
        return g_watch.state == W_IDLE ? W_RUNNING : -1;
    case W_STOP:
        return W_STOPPED;
    }
    return -1;
}

uint64_t watch_dir(uint64_t node, int dir_fd)
{
    char proc[64];
    pthread_mutex_lock(&g_watch_lock);
    struct watched *w = map_get(&g_watch.by_node, node);
    uint64_t gen = w != NULL ? w->gen : 0;
    int fd = g_watch.inotify_fd;
    int full = g_watch.by_node.len >= WATCH_MAX;
    pthread_mutex_unlock(&g_watch_lock);
    if (gen != 0 || fd < 0 || full || node == 0)
        return gen;
    /* The open directory itself, whatever its path now: /proc resolves the fd. */
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", dir_fd);
    int wd = inotify_add_watch(fd, proc, WATCH_MASK);
    if (wd < 0)
        return 0; /* no watch (ENOSPC: the host's limit): the listing is not kept */
    pthread_mutex_lock(&g_watch_lock);
    struct watched *known = map_get(&g_watch.by_wd, (uint64_t)wd + 1);
    if (known != NULL) {
        gen = known->gen; /* the same directory under another node, or a racing add */
    } else if (g_watch.state == W_RUNNING && (w = calloc(1, sizeof *w)) != NULL) {
        w->node = node;
        w->gen = 1;
        if (map_put(&g_watch.by_wd, (uint64_t)wd + 1, w) == 0) {
            if (map_put(&g_watch.by_node, node, w) == 0) {
                gen = 1;
            } else {
                map_del(&g_watch.by_wd, (uint64_t)wd + 1);
                free(w);
            }
        } else {
            free(w);
        }
    }
    pthread_mutex_unlock(&g_watch_lock);
    if (gen == 0)
        inotify_rm_watch(fd, wd);
    return gen;
}

uint64_t watch_gen(uint64_t node)
{
    pthread_mutex_lock(&g_watch_lock);
    const struct watched *w = map_get(&g_watch.by_node, node);
    uint64_t gen = w != NULL ? w->gen : 0;
    pthread_mutex_unlock(&g_watch_lock);
    return gen;
}

void watch_recheck(uint64_t node)
{
    pthread_mutex_lock(&g_watch_lock);
    struct watched *w = map_get(&g_watch.by_node, node);
    if (w != NULL && !w->recheck) {
        w->recheck = 1;
        if (g_watch.rechecks++ == 0) {
            clock_gettime(CLOCK_MONOTONIC, &g_watch.recheck_due);
            g_watch.recheck_due.tv_nsec += WATCH_RECHECK_MS * 1000000L;
            if (g_watch.recheck_due.tv_nsec >= 1000000000L) {
                g_watch.recheck_due.tv_sec++;
                g_watch.recheck_due.tv_nsec -= 1000000000L;
            }
        }
    }
    int wake = g_watch.wake_fd;
    pthread_mutex_unlock(&g_watch_lock);
    if (wake >= 0) {
        uint64_t one = 1;
        (void)!write(wake, &one, sizeof one);
    }
}

/* Drop the kernel's listing and attributes of `node`; the session is alive
 * while this runs. */
static void invalidate(uint64_t node)
{
    pthread_mutex_lock(&g_watch_session_lock);
    if (__atomic_load_n(&g_watch.state, __ATOMIC_ACQUIRE) == W_RUNNING && g_bridge.se != NULL) {
        fuse_lowlevel_notify_inval_inode(g_bridge.se, (fuse_ino_t)node, 0, 0);
        bridge_count(BRIDGE_STAT_WATCH_INVALS);
    }
    pthread_mutex_unlock(&g_watch_session_lock);
}

/* Under g_watch_lock: forget the watch `w` (its directory is gone). */
static void forget_locked(struct watched *w, int wd)
{
    map_del(&g_watch.by_wd, (uint64_t)wd + 1);
    if (map_get(&g_watch.by_node, w->node) == w)
        map_del(&g_watch.by_node, w->node);
    if (w->recheck)
        g_watch.rechecks--;
    free(w);
}

/* Every watched node, malloc'ed (*n of them), or NULL. */
static uint64_t *all_nodes(size_t *n)
{
    pthread_mutex_lock(&g_watch_lock);
    size_t len = g_watch.by_node.len;
    uint64_t *nodes = malloc((len ? len : 1) * sizeof *nodes);
    size_t k = 0;
    for (size_t i = 0; nodes != NULL && i < g_watch.by_node.cap; i++) {
        if (g_watch.by_node.keys[i] != 0 && k < len)
            nodes[k++] = g_watch.by_node.keys[i];
    }
    pthread_mutex_unlock(&g_watch_lock);
    *n = k;
    return nodes;
}

/* Invalidate every watched directory, or (only_rechecks) those a racing
 * listing refilled; each starts a new generation. */
static void invalidate_each(int only_rechecks)
{
    size_t n;
    uint64_t *nodes = all_nodes(&n);
    for (size_t i = 0; nodes != NULL && i < n; i++) {
        pthread_mutex_lock(&g_watch_lock);
        struct watched *w = map_get(&g_watch.by_node, nodes[i]);
        int go = w != NULL && (!only_rechecks || w->recheck);
        if (go) {
            if (w->recheck)
                g_watch.rechecks--;
            w->recheck = 0;
            w->gen++;
        }
        pthread_mutex_unlock(&g_watch_lock);
        if (go)
            invalidate(nodes[i]);
    }
    free(nodes);
}

/* Events taken so far (and the thread's end): bridge_dirfd.c's fds are stale
 * once it moves. */
static uint64_t g_watch_events;

uint64_t watch_events(void) { return __atomic_load_n(&g_watch_events, __ATOMIC_ACQUIRE); }

/* One event: the directory's listing goes. */
static void on_event(const struct inotify_event *ev)
{
    __atomic_add_fetch(&g_watch_events, 1, __ATOMIC_ACQ_REL);
    if (ev->mask & IN_Q_OVERFLOW) {
        invalidate_each(0);
        return;
    }
    pthread_mutex_lock(&g_watch_lock);
    struct watched *w = map_get(&g_watch.by_wd, (uint64_t)ev->wd + 1);
    uint64_t node = w != NULL ? w->node : 0;
    if (w != NULL)
        w->gen++;
    if (w != NULL && (ev->mask & IN_IGNORED))
        forget_locked(w, ev->wd); /* removed, moved away, or its filesystem unmounted */
    pthread_mutex_unlock(&g_watch_lock);
    if (node != 0)
        invalidate(node);
}

/* Under g_watch_lock: milliseconds until the rechecks are due (0: now), or -1
 * when none waits. */
static int recheck_wait_ms_locked(void)
{
    if (g_watch.rechecks == 0)
        return -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t left = (int64_t)(g_watch.recheck_due.tv_sec - now.tv_sec) * 1000 +
                   (g_watch.recheck_due.tv_nsec - now.tv_nsec) / 1000000;
    return left <= 0 ? 0 : (int)left;
}

static void clear_map(struct u64map *m)
{
    free(m->keys);
    free(m->values);
    memset(m, 0, sizeof *m);
}

static void *watch_thread(void *unused)
{
    (void)unused;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the loop threads take the signals */
    /* Events are read whole (the kernel never splits one across reads). */
    static char buf[64 * (sizeof(struct inotify_event) + NAME_MAX + 1)]
        __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        pthread_mutex_lock(&g_watch_lock);
        int running = g_watch.state == W_RUNNING, wait_ms = recheck_wait_ms_locked();
        struct pollfd fds[2] = {{g_watch.inotify_fd, POLLIN, 0}, {g_watch.wake_fd, POLLIN, 0}};
        pthread_mutex_unlock(&g_watch_lock);
        if (!running)
            break;
        if (wait_ms == 0) { /* due, however busy the inotify queue keeps this thread */
            invalidate_each(1);
            continue;
        }
        int ready = poll(fds, 2, wait_ms);
        if (ready < 0 && errno != EINTR)
            break;
        if (ready <= 0)
            continue;
        if (fds[1].revents & POLLIN) {
            uint64_t ignored;
            (void)!read(g_watch.wake_fd, &ignored, sizeof ignored);
        }
        if (!(fds[0].revents & POLLIN))
            continue;
        ssize_t got = read(g_watch.inotify_fd, buf, sizeof buf);
        for (ssize_t at = 0; got > 0 && at < got;) {
            const struct inotify_event *ev = (const struct inotify_event *)(buf + at);
            on_event(ev);
            at += (ssize_t)(sizeof *ev + ev->len);
        }
    }
    __atomic_add_fetch(&g_watch_events, 1, __ATOMIC_ACQ_REL); /* no more events */
    pthread_mutex_lock(&g_watch_lock);
    for (size_t i = 0; i < g_watch.by_wd.cap; i++) {
        if (g_watch.by_wd.keys[i] != 0)
            free(g_watch.by_wd.values[i]);
    }
    clear_map(&g_watch.by_wd);
    clear_map(&g_watch.by_node);
    g_watch.rechecks = 0;
    close(g_watch.inotify_fd);
    close(g_watch.wake_fd);
    g_watch.inotify_fd = g_watch.wake_fd = -1;
    pthread_mutex_unlock(&g_watch_lock);
    return NULL;
}

void watch_start(void)
{
    pthread_mutex_lock(&g_watch_lock);
    int next = next_state(W_START);
    if (next >= 0) {
        g_watch.state = (enum watch_state)next;
        g_watch.inotify_fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
        g_watch.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256u << 10);
        if (g_watch.inotify_fd < 0 || g_watch.wake_fd < 0 ||
            pthread_create(&tid, &attr, watch_thread, NULL) != 0) {
            /* No watches: listings are dropped as before (slower, not wrong). */
            if (g_watch.inotify_fd >= 0)
                close(g_watch.inotify_fd);
            if (g_watch.wake_fd >= 0)
                close(g_watch.wake_fd);
            g_watch.inotify_fd = g_watch.wake_fd = -1;
            g_watch.state = (enum watch_state)next_state(W_STOP);
        }
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&g_watch_lock);
}

void watch_stop(void)
{
    pthread_mutex_lock(&g_watch_session_lock);
    pthread_mutex_lock(&g_watch_lock);
    int was_running = g_watch.state == W_RUNNING;
    __atomic_store_n(&g_watch.state, (enum watch_state)next_state(W_STOP), __ATOMIC_RELEASE);
    int wake = g_watch.wake_fd;
    if (was_running && wake >= 0) {
        uint64_t one = 1;
        (void)!write(wake, &one, sizeof one); /* the thread ends, and closes its fds */
    }
    pthread_mutex_unlock(&g_watch_lock);
    pthread_mutex_unlock(&g_watch_session_lock);
}
