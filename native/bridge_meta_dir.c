/*
 * READDIRPLUS of a clean directory answered wholly from the base directory
 * (bridge_meta.c says which directories are clean and answers each entry).
 *
 * Theory of operation.  The base directory is listed beneath the base fd
 * (openat2, no symlinks, no other mount), every name given the cookie the
 * shard gives it (64-bit FNV-1a, slates/node/fsops.py's cookie_of) and the
 * names sorted by it, so a listing the shard continues (the directory's mark
 * revoked between two calls) neither skips nor repeats a name, and a name
 * removed between two calls never makes the listing skip another.  Each name
 * is stat'ed in the directory as listed (fstatat of that one component,
 * nothing followed, another device refused: meta_stat_at) rather than walked
 * again from the base root: the same checks, one syscall instead of three.
 * "." and ".." come first (cookies 1 and 2).  Each other name is answered as a
 * LOOKUP would be (meta_dirent: one kernel reference counted in the
 * bridge).  A name the kernel holds already as the bridge answered it
 * (meta_kernel_holds, by the inode number the base lists: a caller looked it
 * up before the walk listed its directory) goes without attributes and
 * without a stat: the kernel keeps the entry it has.  A name bound in the
 * volume, or not the bridge's to number, or changed in the last two seconds
 * (it may be being written), goes without attributes too, and the kernel
 * looks it up when it needs it.  The reply is sent inside the metadata reply gate after
 * checking that no taint ran since the listing began, so an invalidation the watcher
 * acknowledged is never undone by it; otherwise every reference counted is
 * given back (give_back, under the link lock) and the shard answers.
 *
 * Bounded: at most BRIDGE_LIST_MAX names (a larger directory is the
 * shard's); the listing is read again for every READDIRPLUS of it.
 */
#include "bridge_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The readdir cookie of a name, as slates/node/fsops.py's cookie_of: 64-bit
 * FNV-1a of the name's bytes, shifted into 63 bits, above "." (1) and ".." (2). */
uint64_t meta_cookie(const char *name, size_t len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)name[i];
        h *= 0x100000001b3ull;
    }
    return (h >> 1) | 4;
}

struct listed {
    uint64_t cookie;
    char *name;
    uint64_t base_ino; /* as the base directory lists it (d_ino) */
    unsigned char type; /* d_type */
};

static int by_cookie(const void *a, const void *b)
{
    uint64_t x = ((const struct listed *)a)->cookie, y = ((const struct listed *)b)->cookie;
    return x < y ? -1 : x > y;
}

/* Every name of the base directory at `path`, sorted by cookie: the count, or
 * -errno.  *out is malloc'ed (names too); bounded by BRIDGE_LIST_MAX names.
 * *dir_out is the directory as listed (the caller's to closedir). */
#define BRIDGE_LIST_MAX (1u << 20)
static long list_beneath(const char *path, uint64_t node, uint64_t off, uint64_t *gen,
                         struct listed **out, DIR **dir_out)
{
    int fd = base_open(clean_base_fd(), path, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return -errno;
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        int err = errno;
        close(fd);
        return -err;
    }
    /* Watched before its first name is read, so no change after goes unseen
     * (bridge_watch.c); a later call only reads the generation. */
    *gen = off == 0 ? watch_dir(node, fd) : watch_gen(node);
    size_t n = 0, cap = 64;
    struct listed *items = malloc(cap * sizeof *items);
    long rc = items != NULL ? 0 : -ENOMEM;
    struct dirent *d;
    while (rc == 0 && (errno = 0, d = readdir(dir)) != NULL) {
        if (strcmp(d->d_name, ".") == 0 || strcmp(d->d_name, "..") == 0)
            continue;
        if (n == BRIDGE_LIST_MAX) {
            rc = -E2BIG;
            break;
        }
        if (n == cap) {
            struct listed *more = realloc(items, 2 * cap * sizeof *items);
            if (more == NULL) {
                rc = -ENOMEM;
                break;
            }
            items = more;
            cap *= 2;
        }
        size_t len = strlen(d->d_name);
        items[n].name = strdup(d->d_name);
        if (items[n].name == NULL) {
            rc = -ENOMEM;
            break;
        }
        items[n].cookie = meta_cookie(d->d_name, len);
        items[n].base_ino = (uint64_t)d->d_ino;
        items[n].type = d->d_type;
        n++;
    }
    if (rc == 0 && errno != 0)
        rc = -errno;
    if (rc != 0) {
        closedir(dir);
        for (size_t i = 0; i < n; i++)
            free(items[i].name);
        free(items);
        return rc;
    }
    qsort(items, n, sizeof *items, by_cookie);
    *out = items;
    *dir_out = dir;
    return (long)n;
}

/* A listing entry with no attributes (nodeid 0): the kernel makes no entry of
 * it, and keeps any it has. */
static void without_attrs(struct fuse_entry_param *e, uint64_t ino, mode_t type)
{
    memset(e, 0, sizeof *e);
    e->attr.st_ino = (ino_t)ino;
    e->attr.st_mode = type;
}

/* References counted for entries the kernel never got: the bridge's count
 * drops, and any a bind on another thread handed to the shard meanwhile is
 * forgotten there (under the link lock, so no bind is half done). */
static void give_back(const uint64_t *nodes, size_t n)
{
    link_lock();
    struct fuse_forget_data *items = malloc((n ? n : 1) * sizeof *items);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t shard = meta_forget(nodes[i], 1);
        if (shard > 0 && items != NULL) {
            items[kept].ino = nodes[i];
            items[kept].nlookup = shard;
            kept++;
        }
    }
    if (kept > 0) {
        const msgpack_object *res;
        enc_forget(items, kept);
        (void)link_call(&res);
    }
    free(items);
}

int meta_readdirplus(fuse_req_t req, uint64_t dir, size_t size, uint64_t off)
{
    uint64_t epoch, parent = 1;
    char *path = NULL;
    if (!meta_listable(dir, &epoch))
        return 0;
    path = meta_dir_path(dir, &parent);
    if (path == NULL)
        return 0;
    struct listed *items = NULL;
    DIR *listed = NULL;
    uint64_t gen = 0;
    long n = list_beneath(path, dir, off, &gen, &items, &listed);
    free(path);
    if (n < 0)
        return 0; /* the shard decides (a directory swapped, gone, unreadable) */
    int dir_fd = dirfd(listed);
    char *buf = malloc(size ? size : 1);
    uint64_t *counted = calloc(n ? (size_t)n : 1, sizeof *counted);
    size_t used = 0, ncounted = 0;
    int ok = buf != NULL && counted != NULL;
    const char *dots[2] = {".", ".."};
    for (int i = 0; ok && i < 2; i++) {
        if ((uint64_t)(i + 1) <= off)
            continue;
        struct fuse_entry_param e;
        memset(&e, 0, sizeof e);
        e.attr.st_ino = (ino_t)(i == 0 ? dir : parent);
        e.attr.st_mode = S_IFDIR;
        size_t need = fuse_add_direntry_plus(req, buf + used, size - used, dots[i], &e,
                                             (off_t)(i + 1));
        if (need > size - used)
            goto full;
        used += need;
    }
    for (long i = 0; ok && i < n; i++) {
        if (items[i].cookie <= off)
            continue;
        struct fuse_entry_param e;
        if (fuse_add_direntry_plus(req, NULL, 0, items[i].name, NULL, 0) > size - used)
            break;
        if (items[i].type != DT_UNKNOWN &&
            meta_kernel_holds(dir, items[i].name, items[i].base_ino)) {
            /* Looked up already (git's lstat, make's, a compiler's, racing the
             * walk): no stat, no reference, and the kernel keeps its entry. */
            without_attrs(&e, items[i].base_ino, DTTOIF(items[i].type));
            bridge_count(BRIDGE_STAT_HELD_ENTRIES);
        } else {
            int got = meta_dirent(dir, dir_fd, items[i].name, epoch, &e);
            if (got < 0)
                continue; /* removed since it was listed */
            if (got == 0) {
                /* Bound in the volume (or not ours to number): the entry goes without
                 * attributes, and the kernel looks it up when it needs them. */
                struct stat st;
                int rc = meta_stat_at(dir_fd, items[i].name, &st);
                if (rc == -ENOENT)
                    continue;
                if (rc != 0) {
                    ok = 0;
                    break;
                }
                without_attrs(&e, st.st_ino, st.st_mode & S_IFMT);
            } else {
                counted[ncounted++] = e.ino;
            }
        }
        used += fuse_add_direntry_plus(req, buf + used, size - used, items[i].name, &e,
                                       (off_t)items[i].cookie);
    }
full:
    if (ok && meta_lock_if(epoch)) {
        fuse_reply_buf(req, buf, used); /* before any later invalidation reaches the kernel */
        meta_unlock();
        if (gen != 0 && watch_gen(dir) != gen)
            watch_recheck(dir); /* the base changed while this was listed */
    } else {
        ok = 0;
        give_back(counted, ncounted); /* never sent: the kernel holds none of them */
    }
    closedir(listed);
    for (long i = 0; i < n; i++)
        free(items[i].name);
    free(items);
    free(buf);
    free(counted);
    return ok;
}


uint64_t bridge_test_cookie(const char *name, size_t len) { return meta_cookie(name, len); }
