/*
 * Directory prefetch: clean directories are listed through the mount ahead
 * of their callers, so the kernel learns their entries from one READDIRPLUS
 * instead of one LOOKUP round trip per name.
 *
 * Theory of operation.  git status (its preload threads lstat every indexed
 * path), make and compilers stat names without listing their directories,
 * so a fresh workspace's first touch is one LOOKUP per name, and on a VM
 * whose idle vCPUs halt each round trip pays two cross-CPU wake-ups
 * (bench/RESULTS.md, "Why a fresh workspace's first touch swings 3x").  The
 * kernel cannot be handed entries it did not ask for, but it keeps every
 * entry a READDIRPLUS reply carries (dentry, inode and attributes, for the
 * entry timeout) and the listing itself.  So this file's one thread has
 * clean directories opened through the mount and read to their end
 * (getdents64): the kernel sends READDIRPLUS, which the loop threads answer
 * from the base like any other (bridge_meta_dir.c, each entry's kernel
 * reference counted in the bridge, never the shard's), and a caller's next
 * lstat finds the name cached.  Each listing is read to its end, so the
 * kernel holds it as complete and answers a caller's listing from it; it is
 * kept while bridge_watch.c watches the base directory (the watch drops it
 * when the base's names change), and dropped at once otherwise
 * (forget_listing), so a caller's first listing then reads the live base.
 * Nothing here answers the kernel or changes what any request returns: the
 * listings are an ordinary reader's.
 *
 * Read-ahead.  A first grep -r or build then reads file after file, each a
 * READ round trip (and its two wake-ups) in the caller's path.  So once no
 * directory waits, the readers read the listed regular files of a clean
 * directory through the mount too (not the root's .git: the repository's
 * objects are git's to read when it needs them), each to its end if it is
 * at most PREFETCH_FILE_MAX bytes, as much as "How much is read ahead" says:
 * the loop threads answer those READs from the base (bridge_clean.c), and
 * the kernel keeps the pages.  The reader does that at SCHED_IDLE (once its
 * first file comes), so it takes only CPU time nobody else wants: without
 * it, a git status started the instant the mount returned took 0.096 s
 * against 0.063 s.  They are an ordinary reader's reads too, under the
 * kernel's page locks, so a caller's write is never overwritten by them,
 * and a base file changed since it was listed fails its fingerprint and
 * is not read (the shard's EIO ends that file's read).  After its last
 * read the reader stats the open file: the kernel marks a file's atime
 * stale after every READ it sends, and the caller's first stat would
 * otherwise cost a GETATTR round trip.  The pages cost the host a second
 * copy of what the base's page cache holds, reclaimable like any cache
 * (kernel overlayfs shares one copy; fuse-overlayfs does not);
 * $SLATES_BRIDGE_READAHEAD=0 (bridge_set_readahead) turns it off.
 *
 * How much is read ahead.  Unasked, PREFETCH_FILES_FREE files and
 * PREFETCH_CONTENT_FREE bytes: all of a repository the size of git/git, and
 * what a mount nobody reads costs (about 1 s of bridge CPU and 64 MiB of
 * cache on the 100,000-file tree).  Past that, files wait for demand: once
 * callers (any process but the readers, by the READ's pid:
 * prefetch_note_read) have sent PREFETCH_DEMAND_READS READs, someone is
 * reading through the tree (grep -r, git hashing the work tree, a large
 * build), and every listed file is read ahead, up to PREFETCH_CONTENT_BYTES.
 * On the 100,000-file tree that made a first grep -r 12-20% faster (2.5-3.3x
 * kernel overlayfs, from 3.0-3.6x; bench/RESULTS.md); reading all of it
 * unasked would cost every mount 3-4 s of bridge CPU.  While files wait for
 * demand the thread polls an eventfd that the READ reaching
 * PREFETCH_DEMAND_READS writes (the one event that lets it read again), and
 * no reader lives: a mount nobody reads may wait for ever, and should not
 * keep processes for it (nor, in the fallback below, a namespace's copies of
 * other mounts).  So the thread reaps its readers when it starts waiting and
 * starts new ones when it may read again.
 *
 * Which directories: once the mount serves, the root, then every
 * subdirectory a listing shows, depth first (a stack; the root's .git last),
 * by several readers at once, until the walk's budget of entries was
 * listed (BRIDGE_WALK_ENTRIES, 131,072; $SLATES_BRIDGE_WALK_ENTRIES,
 * bridge_set_walk_entries); an agent's first command in a fresh workspace is
 * nearly always one that walks it (git status, grep -r, find, a build), and
 * that command would make the kernel hold the same entries.  The budget
 * bounds what one mount makes the kernel hold: a whole 100,000-file tree
 * grew the host's reclaimable slab by about 140 MiB and its unreclaimable
 * by 9 MiB; at 8,192 entries, a git status started the instant the mount
 * returned took 1.7-1.8 s on that tree, and 1.1-1.3 s with its whole walk
 * racing it (bench/RESULTS.md).  Nothing is listed on demand past the
 * budget: on the 100,000-file tree, listing each directory git's preload
 * threads entered raced their lookups of the same names and made git status
 * slower (1.7x once; with pipelined readers and the whole walk, 1.4 s
 * against 1.2-1.3 s), so a larger tree's other directories cost their
 * LOOKUPs as before.
 * A directory is listed only if bridge_meta.c knows it as clean (its every
 * name is its base entry, so the bridge answers its READDIRPLUS without the
 * shard) and it was not listed before (meta_claim_listing, by its base inode).
 *
 * Lifecycle (a table, as everywhere): IDLE --set_mountpoint--> ARMED
 * --start--> RUNNING --stop--> STOPPED, and any state --stop--> STOPPED.  A
 * directory or file offered in another state than RUNNING is dropped: there
 * is no one to list or read it.  The listings themselves are read by one child
 * process per CPU (readers_wanted; see "the reader process" below), which
 * the prefetch thread drives over two pipes each (poll); the thread keeps
 * the stack and the budget and asks bridge_meta.c which directories to
 * list, and the walk ends when no reader lists and nothing waits (or waits
 * only for demand that can no longer come: see "How much is read ahead").
 *
 * Pipelined jobs.  A reader holds up to PREFETCH_QUEUE jobs (a directory to
 * list, a file to read ahead) and answers them in the order given, so it
 * starts its next listing the moment it has sent the last one's buffers,
 * without waiting for the thread to take them and choose its next: that
 * exchange (two wake-ups a directory) had been in the walk's critical path:
 * one reader listed git/git's 226 directories in 0.069-0.083 s with it gone,
 * 0.084-0.098 s before.
 * Directories are claimed when given, so a listing in flight is never given
 * twice, and a file is given only when no directory waits or is being
 * listed (g_listing), so every directory is still listed before any file is
 * read; the budget is checked when a directory is given, so the walk may
 * pass it by what PREFETCH_QUEUE directories of each reader hold.  It is
 * detached and never joined; at stop the readers are killed, and the
 * thread, reading their EOF, closes the pipes, reaps them and ends.  An
 * entry that changed in the last two seconds (a file being written into the
 * live base) comes in a listing without attributes, so the kernel looks it
 * up when it needs it (bridge_meta.c, changing()).
 *
 * An external umount.  The readers hold directories and files of the mount
 * open a moment at a time, and umount(8) refuses a mount something holds
 * open ("target is busy"), so a user's umount in the first seconds of a
 * mount would fail now and then because of the walk.  So the readers walk
 * beneath a detached clone of the mount (open_tree OPEN_TREE_CLONE, taken by
 * prefetch_hold_mount after INIT and before the mount is announced, so no
 * user's umount can race its path walk), each opening relative to it with
 * openat2 RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS: what they
 * hold pins the clone, never the user's mount, so the user's umount
 * succeeds, and the kernel keeps the connection while the clone lives (the
 * bridge's fd and the readers' copies).  The clone is this mount alone: no
 * other mount's connection is held by the walk (an earlier design gave each
 * reader a mount namespace of its own, whose copy of every mount on the host
 * kept another volume's bridge alive after its umount until this walk
 * ended).  The prefetch thread watches the mount table meanwhile (its text,
 * never a stat of the mountpoint: that path walk holds the mount too, and
 * refused one umount in four right after a mount), and once the mountpoint
 * no longer names the mount it ends the walk, killing the readers and
 * closing the clone (release_tree_locked; so does the walk's end and any
 * stop), and the bridge ends as after any unmount.  Without CAP_SYS_ADMIN
 * there is no clone: a reader then unshares its mount namespace if it may,
 * else walks the mountpoint's path in the caller's namespace.
 *
 * Bounded: PREFETCH_STACK directories wait (more are refused), and files
 * only as many as the walk's budget (each is a listed entry, offered once),
 * at most PREFETCH_READERS_MAX readers list, each holding at
 * most PREFETCH_QUEUE jobs, and at most
 * PREFETCH_CONTENT_BYTES (plus one file) are read ahead;
 * the entry budgets above bound what the kernel and the bridge's node table
 * hold because of prefetch.  Counted: BRIDGE_STAT_PREFETCHES (directories
 * listed) and BRIDGE_STAT_READAHEADS (files read ahead).
 */
#include "bridge_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/openat2.h>

#define PREFETCH_STACK 1024
#define PREFETCH_READERS_MAX 4
#define PREFETCH_BUF (64u << 10) /* the kernel asks READDIRPLUS for this much */
#define PREFETCH_FILES_FIRST 1024u         /* the file list's first size (it doubles) */
#define PREFETCH_FILE_MAX (256u << 10)     /* a larger file is left to its readers */
#define PREFETCH_FILES_FREE 8192u          /* read ahead unasked, at most (files) */
#define PREFETCH_CONTENT_FREE (64ull << 20) /* ... and bytes */
#define PREFETCH_DEMAND_READS 1024u        /* callers' READs that lift those two */
#define PREFETCH_CONTENT_BYTES (256ull << 20) /* read ahead per mount, at most */
#define PF_READ_FILE 0x80000000u           /* a reader's job word: read this file */
#define PREFETCH_QUEUE 4 /* jobs a reader holds at once (see "Pipelined jobs") */
#define CHILD_TREE_FD 3  /* the mount's detached clone, in a reader (see "An external umount") */

enum prefetch_state { PF_IDLE, PF_ARMED, PF_RUNNING, PF_STOPPED };

/* A job given to a reader: a directory to list, or a file to read ahead. */
struct job {
    char *path;    /* mount-relative; the job owns it */
    uint64_t node; /* the directory's node id (0: a file) */
};

/* A reader process (see "the reader process" below) and the jobs it holds:
 * given, not yet answered, oldest first (it answers them in order). */
struct reader {
    pid_t pid;
    int to, from; /* the prefetch thread's ends of its pipes */
    struct job jobs[PREFETCH_QUEUE];
    unsigned first, held; /* a ring: jobs[first] is the oldest of `held` */
};
enum prefetch_event { PF_SET_MOUNTPOINT, PF_START, PF_STOP };

static struct {
    enum prefetch_state state;
    int enabled;
    int readahead; /* read the listed files too (bridge_set_readahead) */
    long walk_entries; /* the walk's budget (bridge_set_walk_entries) */
    char mountpoint[PATH_MAX];
    char *stack[PREFETCH_STACK]; /* mount-relative paths ("" the root), newest last */
    unsigned len;
    long listed; /* entries listed so far (the budget) */
    char **files; /* listed regular files, in listing order (files_cap slots) */
    unsigned nfiles, next_file, files_cap; /* files[next_file..nfiles) wait to be read */
    uint64_t content_bytes;      /* read ahead so far (the content budget) */
    uint64_t given_files;        /* files given to readers so far */
    uint64_t demand;             /* READs callers (not the readers) sent, counted to the lift */
    int demand_fd; /* an eventfd the thread polls for that wake-up (-1: none) */
    int tree_fd;   /* the mount's detached clone the readers walk beneath (-1: none) */
    struct reader readers[PREFETCH_READERS_MAX];
    unsigned nreaders; /* alive: set at start, then only by the thread (reaped while it waits) */
} g_pf = {.enabled = 1, .readahead = 1, .walk_entries = BRIDGE_WALK_ENTRIES, .demand_fd = -1,
         .tree_fd = -1};
static pthread_mutex_t g_pf_lock = PTHREAD_MUTEX_INITIALIZER;
/* Held by an invalidation from this thread and by prefetch_stop, so the
 * session is never used once the bridge stops (it is destroyed after). */
static pthread_mutex_t g_pf_session_lock = PTHREAD_MUTEX_INITIALIZER;

/* Under g_pf_lock: the state `event` leads to from the current one, or -1. */
static int next_state(enum prefetch_event event)
{
    switch (event) {
    case PF_SET_MOUNTPOINT:
        return g_pf.state == PF_IDLE ? PF_ARMED : -1;
    case PF_START:
        return g_pf.state == PF_ARMED ? PF_RUNNING : -1;
    case PF_STOP:
        return PF_STOPPED;
    }
    return -1;
}

/* A switch of the walk, set before the mount (IDLE): 0, or -EBUSY. */
static int set_while_idle(int *flag, int on)
{
    pthread_mutex_lock(&g_pf_lock);
    int rc = g_pf.state == PF_IDLE ? 0 : -EBUSY;
    if (rc == 0)
        *flag = on != 0;
    pthread_mutex_unlock(&g_pf_lock);
    return rc;
}

int bridge_set_prefetch(int on) { return set_while_idle(&g_pf.enabled, on); }

int bridge_set_readahead(int on) { return set_while_idle(&g_pf.readahead, on); }

int bridge_set_walk_entries(long entries)
{
    if (entries < 0 || entries > BRIDGE_WALK_ENTRIES_MAX)
        return -EINVAL;
    pthread_mutex_lock(&g_pf_lock);
    int rc = g_pf.state == PF_IDLE ? 0 : -EBUSY;
    if (rc == 0)
        g_pf.walk_entries = entries;
    pthread_mutex_unlock(&g_pf_lock);
    return rc;
}

int prefetch_set_mountpoint(const char *mountpoint)
{
    size_t n = strlen(mountpoint);
    if (n >= sizeof g_pf.mountpoint)
        return -ENAMETOOLONG;
    pthread_mutex_lock(&g_pf_lock);
    int next = next_state(PF_SET_MOUNTPOINT);
    if (next >= 0 && g_pf.enabled) {
        memcpy(g_pf.mountpoint, mountpoint, n + 1);
        g_pf.state = (enum prefetch_state)next;
    }
    pthread_mutex_unlock(&g_pf_lock);
    return next < 0 ? -EBUSY : 0;
}

/* Under g_pf_lock: whether a directory may still be listed. */
static int within_budget(void) { return g_pf.listed < g_pf.walk_entries; }

/* Under g_pf_lock: push a copy of `path` (0), or drop it (-1).  The root's
 * .git goes to the bottom, listed last: git status, grep and builds list the
 * work tree, and a repository's objects would spend the budget first. */
static int push_locked(const char *path)
{
    if (g_pf.state != PF_RUNNING || g_pf.len == PREFETCH_STACK || !within_budget())
        return -1;
    char *copy = strdup(path);
    if (copy == NULL)
        return -1;
    if (strcmp(path, ".git") == 0) {
        memmove(&g_pf.stack[1], &g_pf.stack[0], g_pf.len * sizeof g_pf.stack[0]);
        g_pf.stack[0] = copy;
        g_pf.len++;
    } else {
        g_pf.stack[g_pf.len++] = copy;
    }
    return 0;
}

/* Under g_pf_lock: free every directory and file still waiting. */
static void drop_stack_locked(void)
{
    while (g_pf.len > 0)
        free(g_pf.stack[--g_pf.len]);
    while (g_pf.nfiles > g_pf.next_file)
        free(g_pf.files[--g_pf.nfiles]);
    free(g_pf.files);
    g_pf.files = NULL;
    g_pf.nfiles = g_pf.next_file = g_pf.files_cap = 0;
}

/* Under g_pf_lock: let go of the mount's detached clone (the readers' copies go
 * with them); the connection may then end (see "An external umount"). */
static void release_tree_locked(void)
{
    if (g_pf.tree_fd >= 0)
        close(g_pf.tree_fd);
    g_pf.tree_fd = -1;
}

/* Under g_pf_lock: keep a listed regular file to read ahead, unless it is in
 * the root's .git (a repository's objects are git's, read on demand), the
 * list cannot grow or reading ahead is off.  The list doubles as it fills, up
 * to the walk's budget: every file in it is an entry the walk listed once. */
static void offer_file_locked(const char *path)
{
    if (!g_pf.readahead || strncmp(path, ".git/", 5) == 0)
        return;
    if (g_pf.nfiles == g_pf.files_cap) {
        unsigned long cap = g_pf.files_cap ? 2ul * g_pf.files_cap : PREFETCH_FILES_FIRST;
        if (cap > (unsigned long)g_pf.walk_entries)
            cap = (unsigned long)g_pf.walk_entries;
        char **grown = cap > g_pf.files_cap ? realloc(g_pf.files, cap * sizeof *grown) : NULL;
        if (grown == NULL)
            return; /* full, or no memory: only a prefetch */
        g_pf.files = grown;
        g_pf.files_cap = (unsigned)cap;
    }
    char *copy = strdup(path);
    if (copy != NULL)
        g_pf.files[g_pf.nfiles++] = copy;
}

/* Under g_pf_lock: whether one more file may be read ahead now (see
 * "How much is read ahead"). */
static int ahead_allowed_locked(void)
{
    if (g_pf.content_bytes >= PREFETCH_CONTENT_BYTES)
        return 0;
    if (g_pf.given_files < PREFETCH_FILES_FREE && g_pf.content_bytes < PREFETCH_CONTENT_FREE)
        return 1;
    return g_pf.demand >= PREFETCH_DEMAND_READS;
}

/* Under g_pf_lock: listed files wait to be read ahead, and the walk runs. */
static int files_wait_locked(void)
{
    return g_pf.state == PF_RUNNING && g_pf.next_file < g_pf.nfiles;
}

/* Under g_pf_lock: a file may be given to a reader now. */
static int file_ready_locked(void) { return files_wait_locked() && ahead_allowed_locked(); }

/* Under g_pf_lock: files wait that only a caller's READs may let be read. */
static int waits_for_demand_locked(void)
{
    return files_wait_locked() && g_pf.content_bytes < PREFETCH_CONTENT_BYTES &&
           !ahead_allowed_locked();
}

/* The next file to read ahead (the caller frees it), once no directory waits;
 * NULL when none is left, none is allowed now, or the walk stopped. */
static char *next_file_now(void)
{
    char *path = NULL;
    pthread_mutex_lock(&g_pf_lock);
    if (file_ready_locked()) {
        path = g_pf.files[g_pf.next_file];
        g_pf.files[g_pf.next_file++] = NULL;
        g_pf.given_files++;
        if (g_pf.next_file == g_pf.nfiles)
            g_pf.nfiles = g_pf.next_file = 0; /* all taken: the slots are free again */
    }
    pthread_mutex_unlock(&g_pf_lock);
    return path;
}

/* Wake the prefetch thread in case it waits for demand (demand came, or the
 * stop); a wake-up it was not waiting for costs it one loop. */
static void wake_thread_locked(void)
{
    uint64_t one = 1;
    if (g_pf.demand_fd >= 0 && write(g_pf.demand_fd, &one, sizeof one) < 0) {
        /* an eventfd's counter cannot overflow from these: nothing to do */
    }
}

void prefetch_note_read(uint32_t pid)
{
    if (__atomic_load_n(&g_pf.state, __ATOMIC_RELAXED) != PF_RUNNING ||
        __atomic_load_n(&g_pf.demand, __ATOMIC_RELAXED) >= PREFETCH_DEMAND_READS)
        return; /* hints only (checked again under the lock): nothing to count */
    pthread_mutex_lock(&g_pf_lock);
    if (g_pf.state == PF_RUNNING && g_pf.readahead) {
        int reader = 0;
        for (unsigned i = 0; i < g_pf.nreaders; i++)
            reader |= g_pf.readers[i].pid == (pid_t)pid;
        if (!reader && g_pf.demand < PREFETCH_DEMAND_READS &&
            ++g_pf.demand == PREFETCH_DEMAND_READS)
            wake_thread_locked(); /* the bound is lifted */
    }
    pthread_mutex_unlock(&g_pf_lock);
}

/* Pop the newest directory still within its budget (the caller frees it); NULL
 * when none is left or the walk stopped.  Only the prefetch thread pushes, so
 * an empty stack while no reader lists is the end of the walk. */
static char *pop_now(void)
{
    pthread_mutex_lock(&g_pf_lock);
    while (g_pf.state == PF_RUNNING && g_pf.len > 0) {
        char *path = g_pf.stack[--g_pf.len];
        if (within_budget()) {
            pthread_mutex_unlock(&g_pf_lock);
            return path;
        }
        free(path); /* offered before the budget was spent */
    }
    pthread_mutex_unlock(&g_pf_lock);
    return NULL;
}

/* Push the subdirectories a getdents64 buffer names (the walk goes on), and
 * keep its regular files to read ahead. */
static void push_children(const char *path, uint64_t node, const char *buf, long got)
{
    uint64_t epoch;
    int files_ok = meta_listable(node, &epoch); /* the root may be the shard's to list */
    pthread_mutex_lock(&g_pf_lock);
    int full = 0;
    for (long at = 0; at < got;) {
        const struct dirent64 *d = (const struct dirent64 *)(buf + at);
        at += d->d_reclen;
        if ((d->d_type != DT_DIR && d->d_type != DT_REG) || strcmp(d->d_name, ".") == 0 ||
            strcmp(d->d_name, "..") == 0)
            continue;
        char child[PATH_MAX];
        int n = snprintf(child, sizeof child, "%s%s%s", path, *path ? "/" : "", d->d_name);
        if (n <= 0 || (size_t)n >= sizeof child)
            continue;
        if (d->d_type == DT_REG) {
            if (files_ok)
                offer_file_locked(child);
        } else if (!full && push_locked(child) != 0) {
            full = 1; /* full, or the walk's budget is spent */
        }
    }
    pthread_mutex_unlock(&g_pf_lock);
}

/* The kernel keeps a directory's listing (no OPENDIR: FOPEN_CACHE_DIR) until
 * an invalidation.  A watched directory's is kept (bridge_watch.c drops it
 * when the base's names change); any other's is dropped, so a caller's first
 * listing reads the base then, as it would have without prefetch. */
static void forget_listing(uint64_t node)
{
    if (watch_gen(node) != 0)
        return;
    pthread_mutex_lock(&g_pf_session_lock);
    if (g_pf.state == PF_RUNNING && g_bridge.se != NULL)
        fuse_lowlevel_notify_inval_inode(g_bridge.se, (fuse_ino_t)node, 0, 0);
    pthread_mutex_unlock(&g_pf_session_lock);
}

/* -- the reader process ----------------------------------------------------
 *
 * The listings are read by a child process, never by a thread of the bridge:
 * a FUSE request the bridge's loop thread has already taken cannot be
 * abandoned by its caller, even on SIGKILL, so a bridge killed while one of
 * its own threads waited on its mount could never finish exiting (its
 * /dev/fuse fd would stay open and the mount would hang).  The child holds
 * no fd but its two pipes, so a dead bridge's connection ends at once, and
 * the child's pending getdents64 with it.  The child uses only
 * async-signal-safe calls (it is forked from a threaded process): per
 * directory it reads a path and sends the getdents64 buffers of it, then a
 * zero length (at once when it cannot open it).  It ends on EOF, on a
 * broken pipe, or with its parent (PR_SET_PDEATHSIG). */

static int full_read(int fd, void *buf, size_t n)
{
    for (size_t done = 0; done < n;) {
        ssize_t got = read(fd, (char *)buf + done, n - done);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        done += (size_t)got;
    }
    return 0;
}

static int full_write(int fd, const void *buf, size_t n)
{
    for (size_t done = 0; done < n;) {
        ssize_t put = write(fd, (const char *)buf + done, n - done);
        if (put < 0 && errno == EINTR)
            continue;
        if (put <= 0)
            return -1;
        done += (size_t)put;
    }
    return 0;
}

static long entries_in(const char *buf, long got)
{
    long n = 0;
    for (long at = 0; at < got; n++)
        at += ((const struct dirent64 *)(buf + at))->d_reclen;
    return n;
}

/* Whether this reader walks beneath the mount's detached clone (CHILD_TREE_FD). */
static int g_child_tree;

/* Open a job's path, `full` (the mountpoint, '/', then the mount-relative path):
 * beneath the detached clone when the reader has one, never leaving it (no
 * symlink followed, no other mount crossed), else by its path. */
static int child_open(const char *full, size_t mlen, int flags)
{
    if (!g_child_tree)
        return open(full, flags);
    const char *rel = full[mlen + 1] != '\0' ? full + mlen + 1 : ".";
    struct open_how how = {
        .flags = (uint64_t)flags,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV,
    };
    return (int)syscall(SYS_openat2, CHILD_TREE_FD, rel, &how, sizeof how);
}

/* One file read ahead, in the child: the bytes read (0: not read).  Its READs
 * mark its atime stale in the kernel, so a caller's next stat of it would
 * cost a GETATTR: the fstat after the last read asks it now instead. */
static uint32_t child_read_file(const char *full, size_t mlen, char *buf)
{
    int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
    int fd = child_open(full, mlen, flags | O_NOATIME);
    if (fd < 0 && errno == EPERM) /* O_NOATIME needs the owner or CAP_FOWNER */
        fd = child_open(full, mlen, flags);
    if (fd < 0)
        return 0;
    struct stat st;
    uint32_t total = 0;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= PREFETCH_FILE_MAX) {
        for (;;) {
            ssize_t got = read(fd, buf, PREFETCH_BUF);
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0 || (total += (uint32_t)got) > PREFETCH_FILE_MAX)
                break; /* the end, an error (drift: the shard said EIO), or it grew */
        }
        (void)fstat(fd, &st);
    }
    close(fd);
    return total;
}

/* One job, in the child: a directory listed or a file read ahead.  0 to go
 * on, -1 when the parent is gone. */
static int child_list_one(const char *mountpoint, size_t mlen, char *buf)
{
    uint32_t word, len;
    char full[PATH_MAX];
    if (full_read(0, &word, sizeof word) != 0)
        return -1;
    len = word & ~PF_READ_FILE;
    if (len >= sizeof full - mlen - 1)
        return -1;
    memcpy(full, mountpoint, mlen);
    full[mlen] = '/';
    if (full_read(0, full + mlen + 1, len) != 0)
        return -1;
    full[mlen + 1 + len] = '\0';
    if (word & PF_READ_FILE) {
        /* Reading ahead is for idle CPUs: a caller's first command (git status
         * the instant the mount returns) must not wait behind it. */
        static int idle;
        if (!idle) {
            struct sched_param none = {.sched_priority = 0};
            idle = sched_setscheduler(0, SCHED_IDLE, &none) == 0 ? 1 : -1;
        }
        uint32_t got = child_read_file(full, mlen, buf);
        return full_write(1, &got, sizeof got);
    }
    int fd = child_open(full, mlen, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) { /* gone, renamed, or the mount is ending: nothing to list */
        uint32_t end = 0;
        return full_write(1, &end, sizeof end);
    }
    for (long got = 0;;) {
        got = syscall(SYS_getdents64, fd, buf, PREFETCH_BUF);
        if (got < 0 && errno == EINTR)
            continue;
        uint32_t n = got > 0 ? (uint32_t)got : 0;
        if (full_write(1, &n, sizeof n) != 0 || full_write(1, buf, n) != 0)
            return -1;
        /* The kernel holds a listing as complete, and answers later ones from
         * it, only once a READDIRPLUS came back empty: read to the end. */
        if (n == 0)
            break;
    }
    close(fd);
    return 0;
}

/* The reader's argv, as /proc shows it: a bridge's copy would make it look like
 * another bridge to whoever scans /proc for bridges (the anchor's gc, its
 * tests).  The argument area is this process's own copy after fork, so it is
 * overwritten in place (setproctitle's way), between the bounds /proc/self/stat
 * gives (its fields 48 and 49). */
static void rename_self(void)
{
    static const char name[] = "slates-prefetch-reader";
    char st[2048];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, st, sizeof st - 1) : -1;
    if (fd >= 0)
        close(fd);
    prctl(PR_SET_NAME, "slates-prefetch");
    if (n <= 0)
        return;
    st[n] = '\0';
    char *at = strrchr(st, ')');
    unsigned long long field[2] = {0, 0};
    for (int i = 2; at != NULL && *at && i <= 49; at++) {
        if (*at != ' ')
            continue;
        i++; /* at + 1 starts field i */
        if (i == 48 || i == 49) {
            unsigned long long v = 0;
            for (const char *d = at + 1; *d >= '0' && *d <= '9'; d++)
                v = v * 10 + (unsigned long long)(*d - '0');
            field[i - 48] = v;
        }
    }
    unsigned long long start = field[0], end = field[1];
    if (start == 0 || end <= start + sizeof name)
        return;
    memset((void *)(uintptr_t)start, 0, (size_t)(end - start));
    memcpy((void *)(uintptr_t)start, name, sizeof name);
}

static void child_main(int cmd, int res, int tree, const char *mountpoint, char *buf)
{
    rename_self();
    int high = tree >= 0 ? fcntl(tree, F_DUPFD, CHILD_TREE_FD + 1) : -1; /* not 0-2 */
    if (dup2(cmd, 0) < 0 || dup2(res, 1) < 0 || (tree >= 0 && dup2(high, CHILD_TREE_FD) < 0))
        _exit(1);
    g_child_tree = tree >= 0;
    close(2);
    /* /dev/fuse, rings, sockets, logs: none */
    syscall(SYS_close_range, g_child_tree ? CHILD_TREE_FD + 1u : 2u, ~0u, 0u);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* Without the clone (no CAP_SYS_ADMIN for open_tree), a mount namespace of
     * its own if it may, so what it holds pins its copy of the mount, not the
     * user's; else it walks in the caller's namespace (see "An external umount"). */
    if (!g_child_tree && unshare(CLONE_NEWNS) == 0)
        (void)mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    size_t mlen = strlen(mountpoint);
    while (child_list_one(mountpoint, mlen, buf) == 0)
        ;
    _exit(0);
}

/* Start reader `r`: 0, or -1. */
static int start_reader(struct reader *r)
{
    int cmd[2], res[2];
    if (pipe2(cmd, O_CLOEXEC) != 0)
        return -1;
    if (pipe2(res, O_CLOEXEC) != 0) {
        close(cmd[0]);
        close(cmd[1]);
        return -1;
    }
    static char child_buf[PREFETCH_BUF]; /* each child's own copy of this page range */
    pid_t pid = fork();
    if (pid == 0)
        child_main(cmd[0], res[1], g_pf.tree_fd, g_pf.mountpoint, child_buf);
    close(cmd[0]);
    close(res[1]);
    if (pid < 0) {
        close(cmd[1]);
        close(res[0]);
        return -1;
    }
    memset(r, 0, sizeof *r);
    r->pid = pid;
    r->to = cmd[1];
    r->from = res[0];
    return 0;
}

static unsigned readers_wanted(void);

/* Under g_pf_lock: start readers_wanted() readers (fewer if a fork fails). */
static void start_readers_locked(void)
{
    unsigned want = readers_wanted();
    while (g_pf.nreaders < want && start_reader(&g_pf.readers[g_pf.nreaders]) == 0)
        g_pf.nreaders++;
}

/* Under g_pf_lock: end every reader (its thread then reads EOF). */
static void kill_readers_locked(void)
{
    for (unsigned i = 0; i < g_pf.nreaders; i++)
        kill(g_pf.readers[i].pid, SIGKILL);
}

/* Close, end and reap every reader (the prefetch thread, or a failed start);
 * they leave the table first, so no stop signals a reaped (reusable) pid. */
static void reap_readers(void)
{
    struct reader gone[PREFETCH_READERS_MAX];
    pthread_mutex_lock(&g_pf_lock);
    unsigned n = g_pf.nreaders;
    memcpy(gone, g_pf.readers, n * sizeof *gone);
    g_pf.nreaders = 0; /* nobody signals them now: a reaped pid may be reused */
    pthread_mutex_unlock(&g_pf_lock);
    for (unsigned i = 0; i < n; i++) {
        struct reader *r = &gone[i];
        close(r->to); /* a reader ends at EOF, if it has not already */
        close(r->from);
        kill(r->pid, SIGKILL);
        waitpid(r->pid, NULL, 0);
        for (; r->held > 0; r->held--, r->first = (r->first + 1) % PREFETCH_QUEUE)
            free(r->jobs[r->first].path);
    }
}

/* Directory jobs given and not yet answered to their end, over every reader
 * (the prefetch thread's alone): files are read ahead only once it is 0 and
 * no directory waits, so every directory is listed before any file is read. */
static unsigned g_listing;

/* Give reader `r` one more job (`path`, which it now owns; `node` the
 * directory to list, 0 to read the file): 1, or -1 when it is gone. */
static int give(struct reader *r, char *path, uint64_t node)
{
    uint32_t len = (uint32_t)strlen(path), word = len | (node != 0 ? 0 : PF_READ_FILE);
    r->jobs[(r->first + r->held) % PREFETCH_QUEUE] = (struct job){path, node};
    r->held++;
    g_listing += node != 0;
    if (full_write(r->to, &word, sizeof word) != 0 || full_write(r->to, path, len) != 0)
        return -1;
    return 1;
}

/* Give reader `r` the next directory to list, or once no directory waits or
 * is being listed the next file to read ahead: 1 when it has one more job,
 * 0 when none is left, -1 when the reader is gone.  The root is listed once,
 * whoever answers it (its READDIRPLUS teaches bridge_meta.c which of its
 * directories are clean); any other directory only if the bridge answers it
 * and nobody listed it yet (claimed by its base inode before the reader is
 * asked, so each listing is one exchange). */
static int assign(struct reader *r)
{
    static int root_listed; /* one thread */
    for (char *path; (path = pop_now()) != NULL;) {
        uint64_t node = *path ? meta_claim_listing(path) : root_listed ? 0 : 1;
        if (node == 0) {
            free(path);
            continue;
        }
        root_listed = 1;
        return give(r, path, node);
    }
    if (g_listing > 0)
        return 0; /* a listing still to come may name more directories */
    char *file = next_file_now();
    return file != NULL ? give(r, file, 0) : 0;
}

/* The oldest job of reader `r` is answered: drop it. */
static void job_done(struct reader *r)
{
    struct job *job = &r->jobs[r->first];
    g_listing -= job->node != 0;
    free(job->path);
    r->first = (r->first + 1) % PREFETCH_QUEUE;
    r->held--;
}

/* One answer of reader `r`, to its oldest job: a getdents64 buffer (its
 * subdirectories pushed, its entries counted), the end of its directory, or
 * the bytes a file read ahead gave.  0, or -1 when the reader is gone. */
static int take_answer(struct reader *r)
{
    static char buf[PREFETCH_BUF];
    struct job *job = &r->jobs[r->first];
    uint32_t n;
    if (job->node == 0) {
        if (full_read(r->from, &n, sizeof n) != 0)
            return -1;
        pthread_mutex_lock(&g_pf_lock);
        g_pf.content_bytes += n;
        pthread_mutex_unlock(&g_pf_lock);
        if (n > 0)
            bridge_count(BRIDGE_STAT_READAHEADS);
        job_done(r);
        return 0;
    }
    if (full_read(r->from, &n, sizeof n) != 0 || n > sizeof buf || full_read(r->from, buf, n) != 0)
        return -1;
    if (n > 0) {
        long entries = entries_in(buf, n);
        pthread_mutex_lock(&g_pf_lock);
        g_pf.listed += entries;
        pthread_mutex_unlock(&g_pf_lock);
        push_children(job->path, job->node, buf, n);
        return 0;
    }
    forget_listing(job->node);
    bridge_count(BRIDGE_STAT_PREFETCHES);
    job_done(r);
    return 0;
}

/* The device ("major:minor" as the mount table writes it) of the topmost mount
 * at `mountpoint`, from /proc/self/mountinfo: 0, or -1 when none is there.  Not
 * a stat of the mountpoint: its path walk would hold the mount, and a user's
 * umount at that moment would be refused busy. */
static int device_mounted_at(const char *mountpoint, char *device, size_t size)
{
    FILE *table = fopen("/proc/self/mountinfo", "re");
    if (table == NULL)
        return -1;
    char *line = NULL, *field[5];
    size_t cap = 0;
    int found = -1;
    while (getline(&line, &cap, table) > 0) {
        /* id parent major:minor root mountpoint ...; the mountpoint's spaces,
         * tabs, newlines and backslashes are written as \ooo octal escapes */
        char *save = NULL, *at = line;
        int n = 0;
        while (n < 5 && (field[n] = strtok_r(at, " ", &save)) != NULL)
            at = NULL, n++;
        if (n < 5)
            continue;
        char *out = field[4];
        for (const char *in = field[4]; *in; out++) {
            if (in[0] == '\\' && in[1] >= '0' && in[1] <= '3' && in[2] >= '0' && in[2] <= '7' &&
                in[3] >= '0' && in[3] <= '7') {
                *out = (char)((in[1] - '0') * 64 + (in[2] - '0') * 8 + (in[3] - '0'));
                in += 4;
            } else {
                *out = *in++;
            }
        }
        *out = '\0';
        if (strcmp(field[4], mountpoint) == 0 && strlen(field[2]) < size) {
            strcpy(device, field[2]); /* later lines are mounted over earlier ones */
            found = 0;
        }
    }
    free(line);
    fclose(table);
    return found;
}

static void *prefetch_thread(void *unused)
{
    (void)unused;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the loop threads take the signals */
    unsigned n = g_pf.nreaders; /* changes only here once the thread runs */
    /* The mount table, polled for changes (POLLPRI), and the mount's device:
     * when the topmost mount at the mountpoint is no longer it, the user
     * unmounted it, and the walk ends with its readers. */
    int table = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    char mounted[32], now[32];
    int watching = table >= 0 && device_mounted_at(g_pf.mountpoint, mounted, sizeof mounted) == 0;
    /* Not in the table although it could be read: unmounted before this thread
     * ran (a loaded host).  Walking on unwatched, the readers' copies would keep
     * the connection until the walk ended. */
    for (int gone = table >= 0 && !watching; !gone;) {
        struct pollfd fds[PREFETCH_READERS_MAX + 2];
        unsigned busy = 0;
        for (unsigned i = 0; i < n && !gone; i++) {
            struct reader *r = &g_pf.readers[i];
            for (int given = 1; given > 0 && r->held < PREFETCH_QUEUE;)
                gone = (given = assign(r)) < 0;
            fds[i].fd = r->held > 0 ? r->from : -1; /* poll skips an idle one */
            fds[i].events = POLLIN;
            fds[i].revents = 0;
            busy += r->held > 0;
        }
        if (gone)
            break; /* a reader is gone */
        if (busy == 0) {
            pthread_mutex_lock(&g_pf_lock);
            int waiting = g_pf.demand_fd >= 0 && waits_for_demand_locked();
            pthread_mutex_unlock(&g_pf_lock);
            if (!waiting)
                break; /* the walk is done: nothing listing, nothing left to read */
            if (n > 0) { /* no reader waits with it (see "How much is read ahead") */
                reap_readers();
                n = 0;
            }
        }
        fds[n].fd = watching ? table : -1;
        fds[n].events = POLLPRI;
        fds[n].revents = 0;
        fds[n + 1].fd = g_pf.demand_fd;
        fds[n + 1].events = POLLIN;
        fds[n + 1].revents = 0;
        if (poll(fds, n + 2, -1) < 0 && errno != EINTR)
            break;
        uint64_t woken;
        if ((fds[n + 1].revents & POLLIN) && read(g_pf.demand_fd, &woken, sizeof woken) < 0) {
            /* EAGAIN: another wake-up was read already */
        }
        if ((fds[n].revents & (POLLPRI | POLLERR)) &&
            (device_mounted_at(g_pf.mountpoint, now, sizeof now) != 0 || strcmp(now, mounted) != 0))
            break; /* unmounted from outside */
        for (unsigned i = 0; i < n && !gone; i++) {
            if (fds[i].fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
                gone = take_answer(&g_pf.readers[i]) != 0;
        }
        if (n == 0) { /* woken while waiting: readers again, if reading ahead may go on */
            pthread_mutex_lock(&g_pf_lock);
            if (file_ready_locked())
                start_readers_locked();
            n = g_pf.nreaders;
            pthread_mutex_unlock(&g_pf_lock);
        }
    }
    if (table >= 0)
        close(table);
    reap_readers();
    pthread_mutex_lock(&g_pf_lock);
    if (g_pf.demand_fd >= 0)
        close(g_pf.demand_fd);
    g_pf.demand_fd = -1;
    release_tree_locked();
    pthread_mutex_unlock(&g_pf_lock);
    return NULL;
}

/* One reader a CPU, at most PREFETCH_READERS_MAX.  A reader waits on each of
 * its listings' READDIRPLUS round trips, so one alone leaves the loop thread
 * idle between them: on the 2-vCPU host measured, two readers listed the
 * 100,000-file tree in 0.69-0.83 s against one's 1.08-1.33 s, and made a git
 * status started the instant the mount returned about 10% faster on git/git
 * (find and create + mount no slower; bench/RESULTS.md).  (One reader a CPU
 * pair had been kept before the jobs were pipelined, when three readers cost
 * find and the mount more than they bought.) */
static unsigned readers_wanted(void)
{
    long want = sysconf(_SC_NPROCESSORS_ONLN);
    return want < 1 ? 1u : want > PREFETCH_READERS_MAX ? PREFETCH_READERS_MAX : (unsigned)want;
}

void prefetch_hold_mount(void)
{
    pthread_mutex_lock(&g_pf_lock);
    int armed = g_pf.state == PF_ARMED && g_pf.tree_fd < 0;
    pthread_mutex_unlock(&g_pf_lock);
    if (!armed)
        return;
    /* Its path walk ends at the mount's root, which the kernel has from INIT:
     * no request of this mount, so the loop need not serve yet. */
    int tree = open_tree(AT_FDCWD, g_pf.mountpoint, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (tree < 0)
        return; /* no CAP_SYS_ADMIN: the readers go by path (child_main) */
    pthread_mutex_lock(&g_pf_lock);
    if (g_pf.state == PF_ARMED && g_pf.tree_fd < 0) {
        g_pf.tree_fd = tree;
        tree = -1;
    }
    pthread_mutex_unlock(&g_pf_lock);
    if (tree >= 0)
        close(tree);
}

void prefetch_start(void)
{
    pthread_mutex_lock(&g_pf_lock);
    int next = next_state(PF_START);
    if (next >= 0) {
        g_pf.state = (enum prefetch_state)next;
        push_locked(""); /* the walk begins at the root */
        start_readers_locked();
        g_pf.demand_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); /* -1: no waiting for demand */
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256u << 10);
        if (g_pf.nreaders == 0) {
            next = next_state(PF_STOP); /* no prefetch: slower, not wrong */
        } else if (pthread_create(&tid, &attr, prefetch_thread, NULL) != 0) {
            pthread_mutex_unlock(&g_pf_lock);
            reap_readers();
            pthread_mutex_lock(&g_pf_lock);
            next = next_state(PF_STOP);
        }
        pthread_attr_destroy(&attr);
        if (next == PF_STOPPED) {
            g_pf.state = PF_STOPPED;
            drop_stack_locked();
            release_tree_locked();
        }
    }
    pthread_mutex_unlock(&g_pf_lock);
}

void prefetch_stop(void)
{
    pthread_mutex_lock(&g_pf_session_lock);
    pthread_mutex_lock(&g_pf_lock);
    if (g_pf.state == PF_RUNNING)
        kill_readers_locked(); /* the thread then reads EOF, closes and reaps */
    g_pf.state = (enum prefetch_state)next_state(PF_STOP);
    drop_stack_locked();
    release_tree_locked(); /* no reader starts now; those alive are killed */
    wake_thread_locked(); /* one waiting for demand sees the stop */
    pthread_mutex_unlock(&g_pf_lock);
    pthread_mutex_unlock(&g_pf_session_lock);
}
