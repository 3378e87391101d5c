/*
 * uring_probe: a measurement spike, not product code.  A minimal read-only
 * FUSE server (metadata only) that speaks the kernel protocol directly, with
 * no libfuse, over either transport:
 *
 *   classic  (default)  N reader threads read(2) /dev/fuse and write(2) the
 *                        replies (what libfuse 3.14 and the Slates bridge do);
 *   --uring              FUSE-over-io_uring (kernel 6.14+, enable_uring=Y):
 *                        INIT still comes over /dev/fuse; after answering it
 *                        with FUSE_OVER_IO_URING, one thread per possible CPU,
 *                        pinned to that CPU, owns one io_uring (SQE128) and
 *                        registers QDEPTH ring entries for queue qid == cpu
 *                        (FUSE_IO_URING_CMD_REGISTER), then answers each
 *                        request and fetches the next in one SQE
 *                        (FUSE_IO_URING_CMD_COMMIT_AND_FETCH).  The kernel
 *                        queues a request on the ring of the CPU its caller
 *                        runs on, so caller and server stay on one CPU.  A
 *                        /dev/fuse reader stays for what still comes that way
 *                        (FORGET, BATCH_FORGET, INTERRUPT).
 *
 * Served: INIT, LOOKUP, GETATTR, FORGET, BATCH_FORGET, STATFS, OPENDIR,
 * READDIR, RELEASEDIR, INTERRUPT (ignored), DESTROY; anything else ENOSYS.
 * Node ids are node addresses (root is 1); nodes are kept in a hash table
 * keyed by the base (st_dev, st_ino) with kernel lookup counts, and freed when
 * the kernel forgets them and no child names them.  Directories keep an
 * O_PATH descriptor; a non-directory is re-stat'ed through its parent's.
 *
 * It mounts itself (mount(2), type "fuse", fd=N,rootmode=40000,...) and
 * prints "mounted <pid>" on stdout; it exits when the kernel ends the
 * connection (umount) and prints per-transport request counts on stderr.
 *
 * Build: make -C native/uring_probe   (needs liburing-dev)
 * Usage: uring_probe [--uring [--defer-taskrun]] [--readers N] [--depth N]
 *                    [--no-default-permissions] SRC_DIR MOUNTPOINT
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

/*
 * FUSE-over-io_uring ABI.  This machine's /usr/include/linux/fuse.h is
 * protocol 7.38, which predates it, so the pieces are defined here with
 * names of our own.  Layouts and values follow include/uapi/linux/fuse.h of
 * kernels 6.14+ (protocol 7.42), as mirrored in libfuse's
 * include/fuse_kernel.h (libfuse commit e8d407ce93bf, protocol 7.45):
 * struct fuse_uring_ent_in_out, struct fuse_uring_req_header,
 * enum fuse_uring_cmd, struct fuse_uring_cmd_req, FUSE_OVER_IO_URING.
 */
#define PROBE_OVER_IO_URING (1ULL << 41) /* INIT flag, in flags2 (bit 9) */
#define PROBE_URING_IN_OUT_HEADER_SZ 128 /* fuse_in_header / fuse_out_header */
#define PROBE_URING_OP_IN_OUT_SZ 128     /* the per-opcode header (arg 0) */

struct probe_uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id; /* kernel -> us: echo it in the COMMIT_AND_FETCH SQE */
    uint32_t payload_sz; /* both ways: bytes used in the payload buffer */
    uint32_t padding;
    uint64_t reserved;
};

struct probe_uring_req_header {
    char in_out[PROBE_URING_IN_OUT_HEADER_SZ];
    char op_in[PROBE_URING_OP_IN_OUT_SZ];
    struct probe_uring_ent_in_out ring_ent_in_out;
};

enum probe_uring_cmd {
    PROBE_URING_CMD_REGISTER = 1,         /* give the kernel an entry, fetch */
    PROBE_URING_CMD_COMMIT_AND_FETCH = 2, /* answer commit_id, fetch next */
};

/* Lives in the SQE's 80-byte command area (needs IORING_SETUP_SQE128). */
struct probe_uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

_Static_assert(sizeof(struct probe_uring_req_header) == 288, "uring header ABI");
_Static_assert(sizeof(struct probe_uring_cmd_req) == 24, "uring cmd ABI");

#define PROTO_MINOR_MAX 45
#define MAX_PAGES 32
#define MAX_WRITE (MAX_PAGES * 4096)
/* The kernel rejects an entry whose payload buffer is smaller than
 * max(8192, max_write, max_pages * PAGE_SIZE). */
#define PAYLOAD_SZ MAX_WRITE
#define DEV_BUF_SZ (MAX_WRITE + 4096)
#define MAX_QUEUES 64
#define MAX_DEPTH 64
#define MAX_READERS 8
#define HASH_BUCKETS 16384
#define TIMEOUT_S 60

struct node {
    uint64_t dev, ino;
    uint64_t nlookup;  /* kernel references, from LOOKUP replies */
    uint64_t children; /* nodes whose parent is this one */
    struct node *parent;
    char *name;        /* in parent; NULL for the root */
    int fd;            /* O_PATH, directories only; -1 otherwise */
    struct node *next; /* hash chain */
};

struct dir_handle {
    pthread_mutex_t lock;
    DIR *dir;
};

struct ring_ent {
    struct probe_uring_req_header *hdr;
    char *payload;
    struct iovec iov[2];
    enum probe_uring_cmd last_cmd;
    uint64_t commit_id;
};

struct queue {
    int qid;
    pthread_t tid;
    struct io_uring ring;
    struct ring_ent ents[MAX_DEPTH];
    char scratch[PAYLOAD_SZ]; /* reply built here: the payload holds the input */
};

static struct {
    int devfd;
    int use_uring;
    int readers;
    int depth;
    int defer_taskrun; /* IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN */
    int nqueues;
    struct node root;
    pthread_mutex_t table_lock;
    struct node *buckets[HASH_BUCKETS];
    sem_t ring_start; /* posted per queue once INIT is answered */
    struct queue *queues[MAX_QUEUES];
    atomic_ulong dev_requests;
    atomic_ulong ring_requests[MAX_QUEUES];
    atomic_ulong ring_errors;
    atomic_int init_done;
} g;

static void die(const char *what)
{
    fprintf(stderr, "uring_probe: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* ---- node table ------------------------------------------------------ */

static size_t bucket_of(uint64_t dev, uint64_t ino)
{
    uint64_t h = (ino * 0x9E3779B97F4A7C15ull) ^ (dev * 0xC2B2AE3D27D4EB4Full);
    return (size_t)(h >> 32) % HASH_BUCKETS;
}

static struct node *node_of(uint64_t nodeid)
{
    return nodeid == FUSE_ROOT_ID ? &g.root : (struct node *)(uintptr_t)nodeid;
}

static uint64_t nodeid_of(struct node *n)
{
    return n == &g.root ? FUSE_ROOT_ID : (uint64_t)(uintptr_t)n;
}

/* Caller holds table_lock.  Frees n and then any parent it was the last
 * reason to keep. */
static void maybe_free(struct node *n)
{
    while (n != NULL && n != &g.root && n->nlookup == 0 && n->children == 0) {
        struct node **pp = &g.buckets[bucket_of(n->dev, n->ino)];
        while (*pp != NULL && *pp != n)
            pp = &(*pp)->next;
        if (*pp == n)
            *pp = n->next;
        struct node *parent = n->parent;
        if (n->fd >= 0)
            close(n->fd);
        free(n->name);
        free(n);
        parent->children--;
        n = parent;
    }
}

static void forget_node(uint64_t nodeid, uint64_t nlookup)
{
    struct node *n = node_of(nodeid);
    pthread_mutex_lock(&g.table_lock);
    n->nlookup = n->nlookup > nlookup ? n->nlookup - nlookup : 0;
    maybe_free(n);
    pthread_mutex_unlock(&g.table_lock);
}

static void fill_attr(struct fuse_attr *a, const struct stat *st)
{
    memset(a, 0, sizeof *a);
    a->ino = st->st_ino;
    a->size = (uint64_t)st->st_size;
    a->blocks = (uint64_t)st->st_blocks;
    a->atime = (uint64_t)st->st_atim.tv_sec;
    a->mtime = (uint64_t)st->st_mtim.tv_sec;
    a->ctime = (uint64_t)st->st_ctim.tv_sec;
    a->atimensec = (uint32_t)st->st_atim.tv_nsec;
    a->mtimensec = (uint32_t)st->st_mtim.tv_nsec;
    a->ctimensec = (uint32_t)st->st_ctim.tv_nsec;
    a->mode = st->st_mode;
    a->nlink = (uint32_t)st->st_nlink;
    a->uid = st->st_uid;
    a->gid = st->st_gid;
    a->rdev = (uint32_t)st->st_rdev;
    a->blksize = (uint32_t)st->st_blksize;
}

/* ---- operations: each returns the reply bytes it wrote to out, or -errno */

static int op_lookup(uint64_t parent_id, const char *name, size_t name_max, void *out)
{
    struct node *parent = node_of(parent_id);
    if (parent->fd < 0)
        return -ENOTDIR;
    if (strnlen(name, name_max) >= name_max)
        return -EINVAL;
    struct stat st;
    if (fstatat(parent->fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return -errno;
    size_t b = bucket_of(st.st_dev, st.st_ino);
    pthread_mutex_lock(&g.table_lock);
    struct node *n = g.buckets[b];
    while (n != NULL && !(n->dev == st.st_dev && n->ino == st.st_ino))
        n = n->next;
    if (n == NULL) {
        n = calloc(1, sizeof *n);
        char *copy = strdup(name);
        int fd = -1;
        if (S_ISDIR(st.st_mode))
            fd = openat(parent->fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (n == NULL || copy == NULL || (S_ISDIR(st.st_mode) && fd < 0)) {
            int err = n == NULL || copy == NULL ? ENOMEM : errno;
            pthread_mutex_unlock(&g.table_lock);
            free(n);
            free(copy);
            return -err;
        }
        n->dev = st.st_dev;
        n->ino = st.st_ino;
        n->parent = parent;
        n->name = copy;
        n->fd = fd;
        n->next = g.buckets[b];
        g.buckets[b] = n;
        parent->children++;
    }
    n->nlookup++;
    pthread_mutex_unlock(&g.table_lock);
    struct fuse_entry_out *e = out;
    memset(e, 0, sizeof *e);
    e->nodeid = nodeid_of(n);
    e->entry_valid = TIMEOUT_S;
    e->attr_valid = TIMEOUT_S;
    fill_attr(&e->attr, &st);
    return (int)sizeof *e;
}

static int op_getattr(uint64_t nodeid, void *out)
{
    struct node *n = node_of(nodeid);
    struct stat st;
    int rc;
    if (n->fd >= 0) {
        rc = fstat(n->fd, &st);
    } else {
        /* the parent outlives n (children count), so its fd is valid */
        rc = fstatat(n->parent->fd, n->name, &st, AT_SYMLINK_NOFOLLOW);
    }
    if (rc < 0)
        return -errno;
    struct fuse_attr_out *a = out;
    memset(a, 0, sizeof *a);
    a->attr_valid = TIMEOUT_S;
    fill_attr(&a->attr, &st);
    return (int)sizeof *a;
}

static int op_statfs(void *out)
{
    struct statvfs sv;
    if (fstatvfs(g.root.fd, &sv) < 0)
        return -errno;
    struct fuse_statfs_out *s = out;
    memset(s, 0, sizeof *s);
    s->st.blocks = sv.f_blocks;
    s->st.bfree = sv.f_bfree;
    s->st.bavail = sv.f_bavail;
    s->st.files = sv.f_files;
    s->st.ffree = sv.f_ffree;
    s->st.bsize = (uint32_t)sv.f_bsize;
    s->st.frsize = (uint32_t)sv.f_frsize;
    s->st.namelen = (uint32_t)sv.f_namemax;
    return (int)sizeof *s;
}

static int op_opendir(uint64_t nodeid, void *out)
{
    struct node *n = node_of(nodeid);
    if (n->fd < 0)
        return -ENOTDIR;
    int fd = openat(n->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct dir_handle *h = calloc(1, sizeof *h);
    DIR *dir = h != NULL ? fdopendir(fd) : NULL;
    if (dir == NULL) {
        close(fd);
        free(h);
        return -ENOMEM;
    }
    pthread_mutex_init(&h->lock, NULL);
    h->dir = dir;
    struct fuse_open_out *o = out;
    memset(o, 0, sizeof *o);
    o->fh = (uint64_t)(uintptr_t)h;
    return (int)sizeof *o;
}

static int op_readdir(const struct fuse_read_in *in, void *out, size_t cap)
{
    struct dir_handle *h = (struct dir_handle *)(uintptr_t)in->fh;
    size_t limit = in->size < cap ? in->size : cap;
    size_t used = 0;
    pthread_mutex_lock(&h->lock);
    seekdir(h->dir, (long)in->offset);
    for (;;) {
        long here = telldir(h->dir);
        errno = 0;
        struct dirent *de = readdir(h->dir);
        if (de == NULL)
            break;
        size_t namelen = strlen(de->d_name);
        size_t reclen = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET + namelen);
        if (used + reclen > limit) {
            seekdir(h->dir, here);
            break;
        }
        struct fuse_dirent *fd = (struct fuse_dirent *)((char *)out + used);
        memset(fd, 0, reclen);
        fd->ino = de->d_ino;
        fd->off = (uint64_t)telldir(h->dir);
        fd->namelen = (uint32_t)namelen;
        fd->type = de->d_type;
        memcpy(fd->name, de->d_name, namelen);
        used += reclen;
    }
    pthread_mutex_unlock(&h->lock);
    return (int)used;
}

static int op_releasedir(const struct fuse_release_in *in)
{
    struct dir_handle *h = (struct dir_handle *)(uintptr_t)in->fh;
    closedir(h->dir);
    pthread_mutex_destroy(&h->lock);
    free(h);
    return 0;
}

/* Bytes of the per-opcode header (argument 0) that precede the rest of the
 * input in a /dev/fuse message; over io_uring that header arrives in op_in
 * and the rest in the payload buffer. */
static size_t op_header_size(uint32_t opcode)
{
    switch (opcode) {
    case FUSE_GETATTR: return sizeof(struct fuse_getattr_in);
    case FUSE_FORGET: return sizeof(struct fuse_forget_in);
    case FUSE_BATCH_FORGET: return sizeof(struct fuse_batch_forget_in);
    case FUSE_OPENDIR: return sizeof(struct fuse_open_in);
    case FUSE_READDIR: return sizeof(struct fuse_read_in);
    case FUSE_RELEASEDIR: return sizeof(struct fuse_release_in);
    case FUSE_INTERRUPT: return sizeof(struct fuse_interrupt_in);
    case FUSE_INIT: return sizeof(struct fuse_init_in);
    default: return 0; /* LOOKUP (name in the rest), STATFS, DESTROY */
    }
}

/* One request, either transport.  hdr: the opcode's header; rest/rest_len:
 * what follows it.  Returns the reply payload bytes written to out or
 * -errno; sets *no_reply for requests that get no reply (FORGET, ...). */
static int dispatch(const struct fuse_in_header *ih, const void *hdr, const char *rest,
                    size_t rest_len, void *out, size_t cap, int *no_reply)
{
    *no_reply = 0;
    switch (ih->opcode) {
    case FUSE_LOOKUP:
        return op_lookup(ih->nodeid, rest, rest_len, out);
    case FUSE_GETATTR:
        return op_getattr(ih->nodeid, out);
    case FUSE_STATFS:
        return op_statfs(out);
    case FUSE_OPENDIR:
        return op_opendir(ih->nodeid, out);
    case FUSE_READDIR:
        return op_readdir(hdr, out, cap);
    case FUSE_RELEASEDIR:
        return op_releasedir(hdr);
    case FUSE_FORGET:
        *no_reply = 1;
        forget_node(ih->nodeid, ((const struct fuse_forget_in *)hdr)->nlookup);
        return 0;
    case FUSE_BATCH_FORGET: {
        *no_reply = 1;
        const struct fuse_batch_forget_in *b = hdr;
        const struct fuse_forget_one *one = (const void *)rest;
        size_t count = rest_len / sizeof *one;
        if (b->count < count)
            count = b->count;
        for (size_t i = 0; i < count; i++)
            forget_node(one[i].nodeid, one[i].nlookup);
        return 0;
    }
    case FUSE_INTERRUPT:
        *no_reply = 1; /* every operation here is short: let it finish */
        return 0;
    case FUSE_DESTROY:
        return 0;
    default:
        return -ENOSYS;
    }
}

/* ---- classic /dev/fuse transport -------------------------------------- */

static int write_reply(uint64_t unique, int result, const void *payload)
{
    struct fuse_out_header oh = {.unique = unique};
    struct iovec iov[2] = {{&oh, sizeof oh}, {(void *)payload, 0}};
    int n = 1;
    if (result < 0) {
        oh.error = result;
    } else if (result > 0) {
        iov[1].iov_len = (size_t)result;
        n = 2;
    }
    oh.len = (uint32_t)(sizeof oh + iov[1].iov_len);
    ssize_t w = writev(g.devfd, iov, n);
    return w < 0 ? -errno : 0;
}

static int handle_init(const struct fuse_in_header *ih, const struct fuse_init_in *in)
{
    struct fuse_init_out out;
    memset(&out, 0, sizeof out);
    out.major = FUSE_KERNEL_VERSION;
    out.minor = in->minor < PROTO_MINOR_MAX ? in->minor : PROTO_MINOR_MAX;
    if (in->major != FUSE_KERNEL_VERSION) {
        fprintf(stderr, "uring_probe: kernel protocol %u.%u\n", in->major, in->minor);
        return write_reply(ih->unique, (int)sizeof out, &out);
    }
    uint64_t offered = in->flags;
    if (in->flags & FUSE_INIT_EXT)
        offered |= (uint64_t)in->flags2 << 32;
    uint64_t want = FUSE_INIT_EXT | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES | FUSE_BIG_WRITES;
    if (g.use_uring) {
        if (!(offered & PROBE_OVER_IO_URING)) {
            fprintf(stderr, "uring_probe: kernel did not offer FUSE_OVER_IO_URING "
                            "(is /sys/module/fuse/parameters/enable_uring Y?)\n");
            exit(2);
        }
        want |= PROBE_OVER_IO_URING;
    }
    want &= offered;
    out.max_readahead = in->max_readahead;
    out.flags = (uint32_t)want;
    out.flags2 = (uint32_t)(want >> 32);
    out.max_background = 16;
    out.congestion_threshold = 12;
    out.max_write = MAX_WRITE;
    out.time_gran = 1;
    out.max_pages = MAX_PAGES;
    int rc = write_reply(ih->unique, (int)sizeof out, &out);
    if (rc == 0) {
        atomic_store(&g.init_done, 1);
        if (g.use_uring) /* the kernel refuses REGISTER before this reply */
            for (int q = 0; q < g.nqueues; q++)
                sem_post(&g.ring_start);
    }
    return rc;
}

static void *dev_reader(void *arg)
{
    (void)arg;
    char *buf = malloc(DEV_BUF_SZ);
    char *out = malloc(PAYLOAD_SZ);
    if (buf == NULL || out == NULL)
        die("malloc");
    for (;;) {
        ssize_t n = read(g.devfd, buf, DEV_BUF_SZ);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue; /* ENOENT: the request was interrupted away */
            if (errno != ENODEV)
                fprintf(stderr, "uring_probe: read /dev/fuse: %s\n", strerror(errno));
            break; /* ENODEV: unmounted */
        }
        if ((size_t)n < sizeof(struct fuse_in_header))
            continue;
        const struct fuse_in_header *ih = (const void *)buf;
        atomic_fetch_add(&g.dev_requests, 1);
        size_t hsz = op_header_size(ih->opcode);
        size_t body = (size_t)n - sizeof *ih;
        if (hsz > body) {
            write_reply(ih->unique, -EIO, NULL);
            continue;
        }
        const char *args = buf + sizeof *ih;
        if (ih->opcode == FUSE_INIT) {
            if (handle_init(ih, (const void *)args) != 0)
                break;
            continue;
        }
        int no_reply;
        int r = dispatch(ih, args, args + hsz, body - hsz, out, PAYLOAD_SZ, &no_reply);
        if (!no_reply)
            write_reply(ih->unique, r, out);
        if (ih->opcode == FUSE_DESTROY)
            break;
    }
    free(buf);
    free(out);
    return NULL;
}

/* ---- FUSE-over-io_uring transport ------------------------------------- */

static void prep_cmd(struct queue *q, struct ring_ent *e)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    if (sqe == NULL) { /* cannot happen: one SQE slot per entry */
        fprintf(stderr, "uring_probe: qid %d: SQ full\n", q->qid);
        exit(1);
    }
    memset(sqe, 0, 128); /* SQE128: the second half is the command area */
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = g.devfd;
    sqe->cmd_op = e->last_cmd;
    io_uring_sqe_set_data(sqe, e);
    struct probe_uring_cmd_req *req = (struct probe_uring_cmd_req *)sqe->cmd;
    req->qid = (uint16_t)q->qid;
    if (e->last_cmd == PROBE_URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov; /* iov[0] headers, iov[1] payload */
        sqe->len = 2;
    } else {
        req->commit_id = e->commit_id;
    }
}

/* The kernel filled e: answer it in place and queue COMMIT_AND_FETCH. */
static void serve_ring_ent(struct queue *q, struct ring_ent *e)
{
    struct probe_uring_req_header *h = e->hdr;
    struct fuse_in_header ih;
    memcpy(&ih, h->in_out, sizeof ih); /* the out header overwrites it */
    size_t in_len = h->ring_ent_in_out.payload_sz;
    e->commit_id = h->ring_ent_in_out.commit_id;
    atomic_fetch_add(&g.ring_requests[q->qid], 1);
    int no_reply;
    int r = dispatch(&ih, h->op_in, e->payload, in_len < PAYLOAD_SZ ? in_len : PAYLOAD_SZ,
                     q->scratch, PAYLOAD_SZ, &no_reply);
    struct fuse_out_header oh = {.unique = ih.unique};
    uint32_t out_len = 0;
    if (r < 0) {
        oh.error = r;
    } else if (r > 0) {
        memcpy(e->payload, q->scratch, (size_t)r);
        out_len = (uint32_t)r;
    }
    oh.len = (uint32_t)sizeof oh + out_len;
    memcpy(h->in_out, &oh, sizeof oh);
    h->ring_ent_in_out.payload_sz = out_len;
    e->last_cmd = PROBE_URING_CMD_COMMIT_AND_FETCH;
    prep_cmd(q, e);
}

static void *ring_thread(void *arg)
{
    struct queue *q = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(q->qid, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
        fprintf(stderr, "uring_probe: pin qid %d: %s\n", q->qid, strerror(errno));
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE;
    p.cq_entries = (unsigned)g.depth * 2;
    if (g.defer_taskrun) /* task work (request copy-in) runs only inside our wait */
        p.flags |= IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int rc = io_uring_queue_init_params((unsigned)g.depth, &q->ring, &p);
    if (rc < 0) {
        fprintf(stderr, "uring_probe: io_uring_queue_init qid %d: %s\n", q->qid, strerror(-rc));
        exit(1);
    }
    for (int i = 0; i < g.depth; i++) {
        struct ring_ent *e = &q->ents[i];
        /* page-aligned, touched here: the entry's memory is local to the CPU */
        if (posix_memalign((void **)&e->hdr, 4096, 4096) != 0 ||
            posix_memalign((void **)&e->payload, 4096, PAYLOAD_SZ) != 0)
            die("posix_memalign");
        memset(e->hdr, 0, 4096);
        memset(e->payload, 0, PAYLOAD_SZ);
        e->iov[0] = (struct iovec){e->hdr, sizeof *e->hdr};
        e->iov[1] = (struct iovec){e->payload, PAYLOAD_SZ};
    }
    sem_wait(&g.ring_start);
    for (int i = 0; i < g.depth; i++) {
        q->ents[i].last_cmd = PROBE_URING_CMD_REGISTER;
        prep_cmd(q, &q->ents[i]);
    }
    for (;;) {
        rc = io_uring_submit_and_wait(&q->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            fprintf(stderr, "uring_probe: qid %d submit: %s\n", q->qid, strerror(-rc));
            break;
        }
        int stop = 0;
        unsigned head, seen = 0;
        struct io_uring_cqe *cqe;
        io_uring_for_each_cqe(&q->ring, head, cqe)
        {
            seen++;
            struct ring_ent *e = io_uring_cqe_get_data(cqe);
            if (cqe->res == 0) {
                serve_ring_ent(q, e);
            } else if (cqe->res == -EINTR || cqe->res == -EAGAIN) {
                prep_cmd(q, e); /* resend the same command */
            } else {
                /* -ENOTCONN on unmount; anything else is a protocol error */
                if (cqe->res != -ENOTCONN) {
                    atomic_fetch_add(&g.ring_errors, 1);
                    fprintf(stderr, "uring_probe: qid %d cmd %d: %s\n", q->qid, e->last_cmd,
                            strerror(-cqe->res));
                }
                stop = 1;
            }
        }
        io_uring_cq_advance(&q->ring, seen);
        if (stop)
            break;
    }
    return NULL;
}

/* ---- main --------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: uring_probe [--uring [--defer-taskrun]] [--readers N] [--depth N] "
                    "[--no-default-permissions] SRC_DIR MOUNTPOINT\n");
    exit(2);
}

int main(int argc, char **argv)
{
    int default_permissions = 1;
    g.readers = 1;
    g.depth = 8;
    int argi = 1;
    for (; argi < argc && strncmp(argv[argi], "--", 2) == 0; argi++) {
        if (strcmp(argv[argi], "--uring") == 0)
            g.use_uring = 1;
        else if (strcmp(argv[argi], "--defer-taskrun") == 0)
            g.defer_taskrun = 1;
        else if (strcmp(argv[argi], "--no-default-permissions") == 0)
            default_permissions = 0;
        else if (strcmp(argv[argi], "--readers") == 0 && argi + 1 < argc)
            g.readers = atoi(argv[++argi]);
        else if (strcmp(argv[argi], "--depth") == 0 && argi + 1 < argc)
            g.depth = atoi(argv[++argi]);
        else
            usage();
    }
    if (argc - argi != 2 || g.readers < 1 || g.readers > MAX_READERS || g.depth < 1 ||
        g.depth > MAX_DEPTH)
        usage();
    const char *src = argv[argi], *mnt = argv[argi + 1];

    struct rlimit rl = {65536, 65536}; /* one O_PATH fd per directory node */
    setrlimit(RLIMIT_NOFILE, &rl);
    pthread_mutex_init(&g.table_lock, NULL);
    sem_init(&g.ring_start, 0, 0);
    g.root.fd = open(src, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (g.root.fd < 0)
        die(src);
    struct stat st;
    if (fstat(g.root.fd, &st) < 0)
        die("fstat root");
    g.root.dev = st.st_dev;
    g.root.ino = st.st_ino;
    g.root.nlookup = 1;

    g.devfd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (g.devfd < 0)
        die("/dev/fuse");
    char opts[256];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0%s", g.devfd,
             default_permissions ? ",default_permissions" : "");
    if (mount("uring_probe", mnt, "fuse", MS_NOSUID | MS_NODEV | MS_RDONLY, opts) != 0)
        die("mount");

    if (g.use_uring) {
        g.nqueues = get_nprocs_conf(); /* the kernel makes num_possible_cpus() queues */
        if (g.nqueues > MAX_QUEUES)
            g.nqueues = MAX_QUEUES;
        for (int i = 0; i < g.nqueues; i++) {
            g.queues[i] = calloc(1, sizeof(struct queue));
            if (g.queues[i] == NULL)
                die("calloc");
            g.queues[i]->qid = i;
            if (pthread_create(&g.queues[i]->tid, NULL, ring_thread, g.queues[i]) != 0)
                die("pthread_create");
        }
    }
    printf("mounted %d\n", (int)getpid());
    fflush(stdout);

    pthread_t readers[MAX_READERS];
    for (int i = 1; i < g.readers; i++)
        if (pthread_create(&readers[i], NULL, dev_reader, NULL) != 0)
            die("pthread_create");
    dev_reader(NULL); /* returns on ENODEV: the connection is gone */
    for (int i = 1; i < g.readers; i++)
        pthread_join(readers[i], NULL);
    for (int i = 0; i < g.nqueues; i++)
        pthread_join(g.queues[i]->tid, NULL);

    unsigned long ring_total = 0;
    fprintf(stderr, "stats transport=%s dev_requests=%lu", g.use_uring ? "uring" : "dev",
            atomic_load(&g.dev_requests));
    for (int i = 0; i < g.nqueues; i++) {
        unsigned long r = atomic_load(&g.ring_requests[i]);
        ring_total += r;
        fprintf(stderr, " ring%d=%lu", i, r);
    }
    fprintf(stderr, " ring_requests=%lu ring_errors=%lu\n", ring_total,
            atomic_load(&g.ring_errors));
    return 0;
}
