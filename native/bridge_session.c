/*
 * The FUSE session: mount, the kernel's cache invalidations, unmount (the
 * request loop and its signals are bridge_loop.c's).
 *
 * Theory of operation: bridge_mount creates the libfuse3 low-level session
 * with bridge_ops (bridge_ops.c) and mounts it (default_permissions: the
 * kernel checks modes, so the shard never sees ACCESS for plain opens);
 * bridge_run (bridge_loop.c) serves it on several threads until a signal
 * or an external unmount ends it.  With bridge_set_uring, uring_mount
 * (bridge_uring.c) mounts instead, with its own transport, when allowed.
 *
 * The INIT reply: libfuse 3.14 never puts FUSE_PARALLEL_DIROPS in it, whatever
 * conn->want says (its reply here lacked it while want had it), so the kernel
 * took each directory's lock around every LOOKUP and READDIRPLUS in it: git's
 * preload threads' lookups in one directory went one at a time, each behind
 * the last one's answer and its caller's wake-up, and every lookup in a
 * directory waited for the prefetch walk's listing of it.  So the session's
 * transport is libfuse's own read and writev over the same fd, but for the
 * INIT reply, which gains FUSE_PARALLEL_DIROPS when the kernel offered it
 * (init_seen, init_patch; bridge_uring.c's transport uses the same two).
 *
 * It gains FUSE_HANDLE_KILLPRIV_V2 too (libfuse 3.14 has no name for it):
 * without it the kernel asks for "security.capability" before every write(2)
 * (FUSE clears SB_NOSEC), a GETXATTR round trip per write: 1,097 in a lua
 * build of 3,500 requests.  With it the kernel asks once per file and leaves
 * dropping capabilities and set-ID bits to the server (slates/node/fsops.py,
 * _drop_privileges), flagging a WRITE or SETATTR whose caller lacks
 * CAP_FSETID (and every chown) in fields libfuse drops: request_seen reads
 * them from the raw request first, for the loop thread that serves it.
 * FALLOCATE and COPY_FILE_RANGE are not flagged, so for those the bridge
 * reads the caller's CapEff (caller_lacks_fsetid).
 * The fd is O_NONBLOCK: a loop thread waiting for a request may spin a
 * little first (spin_read, bridge_spin.c), then polls.
 *
 * bridge_notify_inval_* run on the Python watcher thread while the loop
 * runs (libfuse's notify calls are safe from another thread): the shard
 * tells the bridge what another client changed, and the kernel forgets its
 * cached attributes, pages and names for it (a writeback mount's kernel
 * keeps a file's size through that, so bridge_notify_inval_file also has it
 * drop the file's inode: bridge_prune.c; and bridge_cache.c its
 * absent xattrs, bridge_clean.c its clean-base-file entry, bridge_meta.c
 * its clean metadata: a tainted node is the shard's to answer; bridge_attr.c
 * the attributes a mutation's reply carried).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <stdio.h>
#include <sys/uio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int bridge_set_cache_timeout(double seconds)
{
    if (g_bridge.se != NULL || !(seconds >= 0.0 && seconds <= BRIDGE_TIMEOUT_SECONDS))
        return -EINVAL;
    g_bridge.cache_timeout = seconds;
    return 0;
}

static struct {
    uint64_t unique;  /* the INIT request's, until its reply is written */
    uint64_t offered; /* the flags (and flags2 << 32) it offered */
} g_init;

uint64_t init_seen(const void *buf, ssize_t n)
{
    if (n < (ssize_t)(sizeof(struct fuse_in_header) + sizeof(struct fuse_init_in)))
        return 0;
    const struct fuse_in_header *ih = buf;
    if (ih->opcode != FUSE_INIT)
        return 0;
    const struct fuse_init_in *in = (const void *)(ih + 1);
    uint64_t offered = in->flags;
    if (in->flags & FUSE_INIT_EXT)
        offered |= (uint64_t)in->flags2 << 32;
    g_init.unique = ih->unique;
    g_init.offered = offered;
    return offered;
}

int init_patch(const struct iovec *iov, int count, struct fuse_init_out *out)
{
    const struct fuse_out_header *oh = iov[0].iov_base;
    if (g_init.unique == 0 || oh->unique != g_init.unique || oh->error != 0)
        return 0;
    g_init.unique = 0;
    if (count != 2 || iov[1].iov_len < offsetof(struct fuse_init_out, flags2) + 4 ||
        iov[1].iov_len > sizeof *out) {
        fprintf(stderr, "slates-bridge: unexpected INIT reply layout\n");
        return 0;
    }
    memcpy(out, iov[1].iov_base, iov[1].iov_len);
    out->flags |= (uint32_t)(g_init.offered & (FUSE_PARALLEL_DIROPS | FUSE_HANDLE_KILLPRIV_V2));
    return 1;
}

/* Whether the request this thread serves asked for set-ID bits to be killed. */
static __thread int t_kill_setid;

void request_seen(const void *buf, size_t n)
{
    const struct fuse_in_header *ih = buf;
    t_kill_setid = 0;
    if (n < sizeof *ih)
        return;
    if (ih->opcode == FUSE_WRITE && n >= sizeof *ih + sizeof(struct fuse_write_in)) {
        const struct fuse_write_in *in = (const void *)(ih + 1);
        t_kill_setid = (in->write_flags & FUSE_WRITE_KILL_SUIDGID) != 0;
    } else if (ih->opcode == FUSE_SETATTR && n >= sizeof *ih + sizeof(struct fuse_setattr_in)) {
        const struct fuse_setattr_in *in = (const void *)(ih + 1);
        t_kill_setid = (in->valid & FATTR_KILL_SUIDGID) != 0;
    }
}

int request_kills_setid(void) { return t_kill_setid; }

int caller_lacks_fsetid(uint32_t pid)
{
    char path[48], text[4096];
    snprintf(path, sizeof path, "/proc/%u/status", (unsigned)pid);
    int fd = pid != 0 ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    ssize_t n = fd >= 0 ? read(fd, text, sizeof text - 1) : -1;
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return 1;
    text[n] = '\0';
    const char *at = strstr(text, "\nCapEff:\t");
    if (at == NULL)
        return 1;
    unsigned long long caps = strtoull(at + 9, NULL, 16);
    return !(caps & (1ull << 4)); /* CAP_FSETID */
}

/* Each loop thread's wait for the kernel's next request (bridge_spin.c). */
static __thread struct spin_policy t_request_spin;

static ssize_t plain_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    t_request_spin.budget_ns = g_bridge.spin_ns;
    ssize_t n = spin_read(fd, buf, len, &t_request_spin);
    (void)init_seen(buf, n);
    request_seen(buf, n > 0 ? (size_t)n : 0);
    return n;
}

static ssize_t plain_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    struct fuse_init_out out;
    if (count >= 1 && iov[0].iov_len >= sizeof(struct fuse_out_header) &&
        init_patch(iov, count, &out)) {
        struct iovec patched[2] = {iov[0], {&out, iov[1].iov_len}};
        return writev(fd, patched, 2);
    }
    return writev(fd, iov, count);
}

static const struct fuse_custom_io PLAIN_IO = {.read = plain_read, .writev = plain_writev};

int bridge_mount(const char *mountpoint, int allow_other, int auto_unmount, int writeback)
{
    if (g_bridge.se != NULL)
        return -EBUSY;
    g_bridge.writeback = writeback != 0;
    char opts[256];
    snprintf(opts, sizeof opts,
             "default_permissions,fsname=slates,subtype=slates,max_read=%u%s%s", BRIDGE_MAX_IO,
             allow_other ? ",allow_other" : "", auto_unmount ? ",auto_unmount" : "");
    struct fuse_args args = FUSE_ARGS_INIT(0, NULL);
    if (fuse_opt_add_arg(&args, "slates-bridge") != 0 || fuse_opt_add_arg(&args, "-o") != 0 ||
        fuse_opt_add_arg(&args, opts) != 0) {
        fuse_opt_free_args(&args);
        return -ENOMEM;
    }
    int prc = prefetch_set_mountpoint(mountpoint);
    if (prc < 0) {
        fuse_opt_free_args(&args);
        return prc;
    }
    struct fuse_session *se = fuse_session_new(&args, &bridge_ops, sizeof bridge_ops, NULL);
    fuse_opt_free_args(&args);
    if (se == NULL)
        return -EINVAL;
    int rc = uring_mount(se, mountpoint, allow_other, auto_unmount);
    if (rc < 0) {
        fuse_session_destroy(se);
        return rc;
    }
    if (rc > 0 && fuse_session_mount(se, mountpoint) != 0) {
        fuse_session_destroy(se);
        return -EIO;
    }
    if (rc > 0 && (fuse_session_custom_io(se, &PLAIN_IO, fuse_session_fd(se)) != 0 ||
                   fcntl(fuse_session_fd(se), F_SETFL, O_NONBLOCK) != 0)) {
        fuse_session_unmount(se);
        fuse_session_destroy(se);
        return -EIO;
    }
    g_bridge.se = se;
    return 0;
}

/* Called from the watcher thread while the session loop runs (libfuse's
 * notify calls are safe from another thread).  -ENOENT (the kernel does not
 * know the inode or name) is not an error: there is nothing to forget. */
int bridge_notify_inval_inode(uint64_t ino)
{
    if (g_bridge.se == NULL)
        return -ENOTCONN;
    absent_forget_inode(ino); /* another client may have set one of them */
    clean_invalidate(ino); /* another client may have changed its content */
    content_invalidate(ino); /* ... so a copy of what this mount wrote is old */
    meta_taint(ino);       /* ... or its attributes, or its names */
    attr_invalidate(ino);  /* the attributes a reply of ours carried are old */
    int rc = fuse_lowlevel_notify_inval_inode(g_bridge.se, (fuse_ino_t)ino, 0, 0);
    return rc == -ENOENT ? 0 : rc;
}

int bridge_notify_inval_file(uint64_t ino)
{
    int rc = bridge_notify_inval_inode(ino);
    if (rc == 0 && g_bridge.writeback)
        rc = prune_note(ino); /* the kernel keeps a writeback file's size (bridge_prune.c) */
    return rc;
}

int bridge_notify_inval_entry(uint64_t parent, const char *name, size_t namelen)
{
    if (g_bridge.se == NULL)
        return -ENOTCONN;
    meta_taint(parent); /* its names changed: the shard answers them from now on */
    attr_invalidate(parent); /* ... and its size, times and link count */
    int rc = fuse_lowlevel_notify_inval_entry(g_bridge.se, (fuse_ino_t)parent, name, namelen);
    return rc == -ENOENT ? 0 : rc;
}

void bridge_unmount(void)
{
    prefetch_stop();
    watch_stop();
    if (g_bridge.se != NULL) {
        uring_unmount();                  /* when bridge_uring.c mounted it */
        fuse_session_unmount(g_bridge.se); /* when libfuse did */
        fuse_session_destroy(g_bridge.se); /* DESTROY's callback may take the link */
        g_bridge.se = NULL;
        link_release();
    }
    bridge_detach();
}
