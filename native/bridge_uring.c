/*
 * FUSE-over-io_uring for the mount bridge (kernel 6.14+, enable_uring=Y):
 * the kernel queues each request on the ring of the CPU its caller runs on,
 * and the bridge thread pinned to that CPU answers it, so a round trip costs
 * no cross-CPU wake-up (issue 14; the spike: native/uring_probe/).
 *
 * Theory of operation.  libfuse 3.14 knows nothing of io_uring, so the
 * bridge keeps libfuse for decoding requests and encoding replies and
 * replaces its transport (fuse_session_custom_io):
 *
 *   - uring_mount opens /dev/fuse and mounts it with mount(2) itself (root
 *     only; the options fuse_session_mount would give the kernel), instead
 *     of fuse_session_mount;
 *   - the custom read is read(2): the /dev/fuse loop (bridge_loop.c) stays,
 *     for INIT and for what the kernel still sends that way after the rings
 *     serve (FORGET, BATCH_FORGET, INTERRUPT); it notes INIT's unique and
 *     whether the kernel offers FUSE_OVER_IO_URING;
 *   - the custom writev adds FUSE_INIT_EXT and FUSE_OVER_IO_URING to the
 *     INIT reply (when offered); a reply whose unique is the ring entry the
 *     calling thread serves (thread-local t_cur) is copied into that entry
 *     (out header, payload, payload_sz) and committed by that thread after
 *     the callback returns; everything else (notifications: unique 0, replies
 *     to /dev/fuse requests) is written to /dev/fuse.
 *
 * Every bridge_ops callback replies before it returns, on its own thread
 * (bridge_ops.c starts no thread and keeps no fuse_req_t), so "the entry this
 * thread serves" identifies every ring reply; a request answered without a
 * reply (none is expected over the ring) is committed as EIO and counted.
 *
 * After INIT is answered, uring_start starts one thread per possible CPU
 * (the kernel makes that many queues and serves none until each has an
 * entry), pinned to its CPU, each with its own io_uring (SQE128) and
 * URING_DEPTH registered entries.  Each completion is one request: the
 * thread rebuilds the /dev/fuse form (fuse_in_header, the opcode's header
 * from op_in, the payload) in its buffer, counts it, runs
 * fuse_session_process_buf, gives the link lock back (link_release: shard
 * requests stay one at a time, under the lock, as on the /dev/fuse threads)
 * and sends COMMIT_AND_FETCH.  When ring setup fails the /dev/fuse loop keeps
 * serving (the kernel uses the rings only once every queue registered).
 *
 * Stopping: an unmount ends the rings (-ENOTCONN); otherwise uring_stop
 * (bridge_run, after its loop) sets the flag and interrupts each thread with
 * SIGTERM until it has joined.  uring_unmount detaches the mount
 * (MNT_DETACH, as libfuse does for root); fuse_session_destroy closes the fd.
 *
 * Bounded: URING_MAX_QUEUES threads, each URING_DEPTH entries of one header
 * page and a BRIDGE_MAX_IO payload, and one rebuild buffer.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

/* The FUSE-over-io_uring ABI (include/uapi/linux/fuse.h of 6.14+; this
 * machine's header is protocol 7.38, which predates it): see
 * native/uring_probe/uring_probe.c. */
#define URING_INIT_FLAG (1ULL << 41) /* FUSE_OVER_IO_URING: flags2 bit 9 */
#define URING_HEADER_SZ 128
#define URING_OP_IN_SZ 128
#define URING_CMD_REGISTER 1
#define URING_CMD_COMMIT_AND_FETCH 2
#define URING_DEPTH 4
#define URING_MAX_QUEUES 64
#define URING_PAYLOAD_SZ BRIDGE_MAX_IO /* >= max_write, max_pages * PAGE_SIZE */
#define URING_INBUF_SZ (URING_PAYLOAD_SZ + sizeof(struct fuse_in_header) + URING_OP_IN_SZ)

struct uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id;
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};

struct uring_req_header {
    char in_out[URING_HEADER_SZ];
    char op_in[URING_OP_IN_SZ];
    struct uring_ent_in_out ent;
};

struct uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

_Static_assert(sizeof(struct uring_req_header) == 288, "uring header ABI");
_Static_assert(sizeof(struct uring_cmd_req) == 24, "uring cmd ABI");

struct uring_ent {
    struct uring_req_header *hdr;
    char *payload;
    struct iovec iov[2];
    uint32_t cmd;
    uint64_t commit_id;
};

struct uring_queue {
    int qid;
    pthread_t tid;
    int started;
    struct io_uring ring;
    struct uring_ent ents[URING_DEPTH];
    char *inbuf;
};

static struct {
    int wanted;       /* bridge_set_uring */
    int mounted;      /* uring_mount mounted: the custom transport is in use */
    int offered;      /* the kernel's INIT offered FUSE_OVER_IO_URING */
    int init_flagged; /* our INIT reply carried it */
    int fd;
    char mountpoint[4096];
    int nqueues;
    struct uring_queue *queues[URING_MAX_QUEUES];
    volatile sig_atomic_t stop;
    int registered; /* queues whose entries all registered (atomic) */
} g_uring = {.fd = -1};

/* The entry the calling thread serves, and whether its reply was copied. */
static __thread struct uring_ent *t_cur;
static __thread uint64_t t_cur_unique;
static __thread int t_replied;

int bridge_set_uring(int on)
{
    if (g_bridge.se != NULL)
        return -EBUSY;
    g_uring.wanted = on != 0;
    return 0;
}

int bridge_uring_active(void)
{
    return g_uring.nqueues > 0 &&
           __atomic_load_n(&g_uring.registered, __ATOMIC_RELAXED) == g_uring.nqueues;
}

/* Why io_uring cannot be used here, or NULL when it can. */
static const char *uring_refusal(int auto_unmount)
{
    if (!g_uring.wanted)
        return "";
    if (geteuid() != 0)
        return "not root (the bridge mounts with mount(2) itself)";
    if (auto_unmount)
        return "auto_unmount needs fusermount3 (fuse_session_mount)";
    int fd = open("/sys/module/fuse/parameters/enable_uring", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return "the kernel has no fuse enable_uring parameter";
    char c = 'N';
    ssize_t n = read(fd, &c, 1);
    close(fd);
    if (n != 1 || c != 'Y')
        return "/sys/module/fuse/parameters/enable_uring is not Y";
    return NULL;
}

static ssize_t uring_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    ssize_t n = read(fd, buf, len);
    uint64_t offered = init_seen(buf, n);
    if (offered != 0)
        g_uring.offered = (offered & URING_INIT_FLAG) != 0;
    return n;
}

/* The INIT reply `out` (init_patch's), with FUSE_INIT_EXT and
 * FUSE_OVER_IO_URING added when the kernel offered the rings. */
static ssize_t write_init_reply(int fd, struct iovec *iov, struct fuse_init_out *out)
{
    if (g_uring.offered) {
        out->flags |= FUSE_INIT_EXT;
        out->flags2 |= (uint32_t)(URING_INIT_FLAG >> 32);
    }
    struct iovec patched[2] = {iov[0], {out, iov[1].iov_len}};
    ssize_t w = writev(fd, patched, 2);
    if (w >= 0 && g_uring.offered)
        g_uring.init_flagged = 1;
    return w;
}

static ssize_t uring_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    if (count < 1 || iov[0].iov_len < sizeof(struct fuse_out_header))
        return writev(fd, iov, count);
    const struct fuse_out_header *oh = iov[0].iov_base;
    if (t_cur != NULL && oh->unique == t_cur_unique) {
        size_t payload = 0;
        for (int i = 1; i < count; i++)
            payload += iov[i].iov_len;
        if (payload > URING_PAYLOAD_SZ) {
            errno = EMSGSIZE;
            return -1;
        }
        struct fuse_out_header copy = *oh;
        copy.len = (uint32_t)(sizeof copy + payload);
        memcpy(t_cur->hdr->in_out, &copy, sizeof copy);
        size_t at = 0;
        for (int i = 1; i < count; i++) {
            memcpy(t_cur->payload + at, iov[i].iov_base, iov[i].iov_len);
            at += iov[i].iov_len;
        }
        t_cur->hdr->ent.payload_sz = (uint32_t)payload;
        t_replied = 1;
        return (ssize_t)(sizeof copy + payload);
    }
    struct fuse_init_out out;
    if (init_patch(iov, count, &out))
        return write_init_reply(fd, iov, &out);
    return writev(fd, iov, count);
}

static const struct fuse_custom_io URING_IO = {.read = uring_read, .writev = uring_writev};

int uring_mount(struct fuse_session *se, const char *mountpoint, int allow_other,
                int auto_unmount)
{
    const char *why = uring_refusal(auto_unmount);
    if (why != NULL) {
        if (*why)
            fprintf(stderr, "slates-bridge: io_uring not used: %s\n", why);
        return 1;
    }
    struct stat st;
    if (stat(mountpoint, &st) != 0)
        return -errno;
    if (strlen(mountpoint) >= sizeof g_uring.mountpoint)
        return -ENAMETOOLONG;
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fuse_session_custom_io(se, &URING_IO, fd); /* the session owns fd now */
    if (rc != 0) {
        close(fd);
        return rc;
    }
    /* What fuse_session_mount gives the kernel for this session's options. */
    char opts[256];
    snprintf(opts, sizeof opts,
             "fd=%d,rootmode=%o,user_id=%u,group_id=%u,default_permissions,max_read=%u%s", fd,
             (unsigned)(st.st_mode & S_IFMT), (unsigned)getuid(), (unsigned)getgid(),
             BRIDGE_MAX_IO, allow_other ? ",allow_other" : "");
    if (mount("slates", mountpoint, "fuse.slates", MS_NOSUID | MS_NODEV, opts) != 0)
        return -errno;
    g_uring.fd = fd;
    strcpy(g_uring.mountpoint, mountpoint);
    g_uring.mounted = 1;
    return 0;
}

void uring_unmount(void)
{
    if (!g_uring.mounted)
        return;
    if (umount2(g_uring.mountpoint, MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
        fprintf(stderr, "slates-bridge: umount %s: %s\n", g_uring.mountpoint, strerror(errno));
    g_uring.mounted = 0;
    g_uring.fd = -1; /* fuse_session_destroy closes it */
}

static int prep_cmd(struct uring_queue *q, struct uring_ent *e)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    if (sqe == NULL) /* one SQ slot per entry: cannot happen */
        return -EBUSY;
    memset(sqe, 0, 128); /* SQE128: the second half is the command area */
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = g_uring.fd;
    sqe->cmd_op = e->cmd;
    io_uring_sqe_set_data(sqe, e);
    struct uring_cmd_req *req = (struct uring_cmd_req *)sqe->cmd;
    req->qid = (uint16_t)q->qid;
    if (e->cmd == URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov;
        sqe->len = 2;
    } else {
        req->commit_id = e->commit_id;
    }
    return 0;
}

/* Rebuild the /dev/fuse form of the request in e and answer it. */
static void serve_ent(struct uring_queue *q, struct uring_ent *e)
{
    struct uring_req_header *h = e->hdr;
    struct fuse_in_header ih;
    memcpy(&ih, h->in_out, sizeof ih);
    e->commit_id = h->ent.commit_id;
    size_t payload = h->ent.payload_sz;
    /* in.h.len counts every argument: the opcode's header is what the
     * payload does not hold. */
    size_t args = ih.len >= sizeof ih ? ih.len - sizeof ih : 0;
    int bad = payload > URING_PAYLOAD_SZ || args < payload || args - payload > URING_OP_IN_SZ;
    t_cur = e;
    t_cur_unique = ih.unique;
    t_replied = 0;
    bridge_count(BRIDGE_STAT_URING_REQUESTS);
    bridge_count(ih.opcode < BRIDGE_OPCODES ? (int)ih.opcode : 0);
    if (!bad) {
        size_t op_len = args - payload;
        memcpy(q->inbuf, &ih, sizeof ih);
        memcpy(q->inbuf + sizeof ih, h->op_in, op_len);
        memcpy(q->inbuf + sizeof ih + op_len, e->payload, payload);
        struct fuse_buf fbuf = {.size = ih.len, .mem = q->inbuf};
        request_seen(q->inbuf, ih.len);
        fuse_session_process_buf(g_bridge.se, &fbuf);
        link_release(); /* the request is answered: the next one may use the link */
    } else {
        fprintf(stderr, "slates-bridge: io_uring: malformed request (opcode %u, len %u)\n",
                ih.opcode, ih.len);
    }
    if (!t_replied) {
        bridge_count(BRIDGE_STAT_FAILED);
        struct fuse_out_header oh = {.len = sizeof oh, .error = -EIO, .unique = ih.unique};
        memcpy(h->in_out, &oh, sizeof oh);
        h->ent.payload_sz = 0;
    }
    t_cur = NULL;
    e->cmd = URING_CMD_COMMIT_AND_FETCH;
}

static int queue_setup(struct uring_queue *q)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE;
    p.cq_entries = URING_DEPTH * 2;
    int rc = io_uring_queue_init_params(URING_DEPTH, &q->ring, &p);
    if (rc < 0)
        return rc;
    q->inbuf = malloc(URING_INBUF_SZ);
    if (q->inbuf == NULL)
        return -ENOMEM;
    memset(q->inbuf, 0, URING_INBUF_SZ); /* touched here, on this CPU */
    for (int i = 0; i < URING_DEPTH; i++) {
        struct uring_ent *e = &q->ents[i];
        if (posix_memalign((void **)&e->hdr, 4096, 4096) != 0 ||
            posix_memalign((void **)&e->payload, 4096, URING_PAYLOAD_SZ) != 0)
            return -ENOMEM;
        memset(e->hdr, 0, 4096);
        memset(e->payload, 0, URING_PAYLOAD_SZ);
        e->iov[0] = (struct iovec){e->hdr, sizeof *e->hdr};
        e->iov[1] = (struct iovec){e->payload, URING_PAYLOAD_SZ};
        e->cmd = URING_CMD_REGISTER;
        rc = prep_cmd(q, e);
        if (rc < 0)
            return rc;
    }
    return 0;
}

static int loop_over(void)
{
    return g_uring.stop || g_bridge.stop || fuse_session_exited(g_bridge.se);
}

static void *queue_thread(void *arg)
{
    struct uring_queue *q = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(q->qid, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
        fprintf(stderr, "slates-bridge: io_uring: pin queue %d: %s\n", q->qid, strerror(errno));
    int rc = queue_setup(q);
    if (rc < 0) {
        fprintf(stderr, "slates-bridge: io_uring: queue %d setup: %s (serving /dev/fuse)\n",
                q->qid, strerror(-rc));
        return NULL;
    }
    int registered = 0;
    while (!loop_over()) {
        rc = io_uring_submit_and_wait(&q->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            fprintf(stderr, "slates-bridge: io_uring: queue %d submit: %s\n", q->qid,
                    strerror(-rc));
            break;
        }
        if (!registered && rc >= 0) {
            /* the REGISTERs went in (a failure comes back as a completion) */
            registered = 1;
            __atomic_fetch_add(&g_uring.registered, 1, __ATOMIC_RELAXED);
        }
        int over = 0;
        unsigned head, seen = 0;
        struct io_uring_cqe *cqe;
        io_uring_for_each_cqe(&q->ring, head, cqe)
        {
            seen++;
            struct uring_ent *e = io_uring_cqe_get_data(cqe);
            if (cqe->res == 0) {
                serve_ent(q, e);
            } else if (cqe->res != -EINTR && cqe->res != -EAGAIN) {
                if (cqe->res != -ENOTCONN) /* -ENOTCONN: unmounted */
                    fprintf(stderr,
                            "slates-bridge: io_uring: queue %d command %u: %s%s\n", q->qid,
                            e->cmd, strerror(-cqe->res),
                            e->cmd == URING_CMD_REGISTER ? " (serving /dev/fuse)" : "");
                over = 1;
                continue;
            }
            if (prep_cmd(q, e) < 0)
                over = 1;
        }
        io_uring_cq_advance(&q->ring, seen);
        if (over)
            break;
    }
    if (registered)
        __atomic_fetch_sub(&g_uring.registered, 1, __ATOMIC_RELAXED);
    io_uring_queue_exit(&q->ring); /* cancels what is still registered */
    clean_thread_done();
    return NULL;
}

int uring_start(void)
{
    if (!g_uring.mounted)
        return 0;
    if (!g_uring.init_flagged) {
        fprintf(stderr, "slates-bridge: io_uring not used: the kernel did not offer "
                        "FUSE_OVER_IO_URING\n");
        return 0;
    }
    int n = get_nprocs_conf(); /* the kernel makes num_possible_cpus() queues */
    if (n > URING_MAX_QUEUES) {
        fprintf(stderr, "slates-bridge: io_uring not used: %d CPUs, at most %d queues\n", n,
                URING_MAX_QUEUES);
        return 0;
    }
    g_uring.stop = 0;
    for (int i = 0; i < n; i++) {
        struct uring_queue *q = calloc(1, sizeof *q);
        if (q == NULL)
            break;
        q->qid = i;
        if (pthread_create(&q->tid, NULL, queue_thread, q) != 0) {
            free(q);
            fprintf(stderr, "slates-bridge: io_uring: cannot start queue %d "
                            "(serving /dev/fuse)\n", i);
            break;
        }
        q->started = 1;
        g_uring.queues[g_uring.nqueues++] = q;
    }
    return g_uring.nqueues;
}

void uring_stop(void)
{
    g_uring.stop = 1;
    for (int i = 0; i < g_uring.nqueues; i++) {
        struct uring_queue *q = g_uring.queues[i];
        bridge_join_thread(q->tid);
        for (int j = 0; j < URING_DEPTH; j++) {
            free(q->ents[j].hdr);
            free(q->ents[j].payload);
        }
        free(q->inbuf);
        free(q);
        g_uring.queues[i] = NULL;
    }
    g_uring.nqueues = 0;
    __atomic_store_n(&g_uring.registered, 0, __ATOMIC_RELAXED);
}
