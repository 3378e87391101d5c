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
 * bridge_notify_inval_* run on the Python watcher thread while the loop
 * runs (libfuse's notify calls are safe from another thread): the shard
 * tells the bridge what another client changed, and the kernel forgets its
 * cached attributes, pages and names for it (and bridge_cache.c its
 * absent xattrs, bridge_clean.c its clean-base-file entry, bridge_meta.c
 * its clean metadata: a tainted node is the shard's to answer; bridge_attr.c
 * the attributes a mutation's reply carried).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <stdio.h>
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
    meta_taint(ino);       /* ... or its attributes, or its names */
    attr_invalidate(ino);  /* the attributes a reply of ours carried are old */
    int rc = fuse_lowlevel_notify_inval_inode(g_bridge.se, (fuse_ino_t)ino, 0, 0);
    return rc == -ENOENT ? 0 : rc;
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
