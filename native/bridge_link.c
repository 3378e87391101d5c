/*
 * The bridge's link to the shard that owns its volume: a request ring and a
 * reply ring in shared memory (ring.h), their eventfds, and the shard's unix
 * socket, which carries nothing once the rings are in use and so serves as
 * the liveness signal (any event on it means the shard is gone).
 *
 * Theory of operation: link_call sends the request that bridge_wire.c left
 * in g_bridge.sbuf (and, for a split request, the raw tail after it, both
 * copied straight into the ring) and waits for the reply with the same
 * sequence number: it spins up to spin_ns (the shard's usual service time)
 * unless recent spins were crowded off their CPU (spin_ring), then parks on
 * the reply eventfd, polled together with the socket; when
 * replies to writes answered early come first, it does not spin and parks
 * until the shard has pushed them all and the one it waits for
 * (ring_prepare_park_until), so it wakes once, not once a reply.  One
 * request is waited for at a time (the rings are single-producer,
 * single-consumer, and one loop thread at a time holds the link: see
 * "Threads" below); the only others in flight are writes answered early
 * (bridge_behind.c), whose replies come first and are handed to
 * link_take_behind.  Any other reply with a lower seq answers a request
 * given up on and is skipped, and any other seq is a broken link.  When the
 * shard goes away, the link detaches (bridge_detach first copies the
 * early-answered writes out of the ring: behind_save), asks Python for a
 * fresh hello (bridge_reconnect_cb), sends those writes again
 * (behind_resend), then resends the same bytes with the same seq, so a
 * request the old shard had already applied is answered from its saved
 * result; after BRIDGE_RECONNECT_SECONDS without a shard, or
 * SHUTDOWN_GRACE_NS after being told to stop, the request fails with EIO.
 * Everything the shard put in shared memory is validated before use
 * (ring.c); memfds must be sealed against shrinking so a peer cannot pull
 * pages from under us.
 *
 * Threads: several loop threads (bridge_loop.c) answer kernel requests, but
 * the link, the codec buffers (bridge_wire.c) and the decoded reply belong
 * to one thread at a time: the first encode (envelope_begin) or an explicit
 * link_lock() takes the link lock, and the thread keeps it until its kernel
 * request is answered (the loop calls link_release after each request), so
 * a request's prepare-binds, taints, round trips and reply are one critical
 * section and the one-in-flight rule above still holds.  The lock is taken
 * at most once per thread (a thread-local flag), so nested takers (a
 * prepare inside a request) are free.
 *
 * The counters (kernel requests by opcode, round trips, reconnects,
 * failures) live here too: relaxed atomics, optionally in caller memory
 * (a shared file mapping other processes read).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct bridge_state g_bridge = {
    .req_memfd = -1,
    .req_evfd = -1,
    .rep_memfd = -1,
    .rep_evfd = -1,
    .sock = -1,
    .next_seq = 1,
    .cache_timeout = BRIDGE_TIMEOUT_SECONDS,
};

static pthread_mutex_t g_link_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_link_held;

void link_lock(void)
{
    if (!t_link_held) {
        pthread_mutex_lock(&g_link_lock);
        t_link_held = 1;
    }
}

void link_release(void)
{
    if (t_link_held) {
        t_link_held = 0;
        pthread_mutex_unlock(&g_link_lock);
    }
}

static uint64_t g_local_counts[BRIDGE_COUNTERS];
static uint64_t *g_counts = g_local_counts;

void bridge_count(int slot)
{
    if (slot >= 0 && slot < BRIDGE_COUNTERS)
        __atomic_fetch_add(&g_counts[slot], 1, __ATOMIC_RELAXED);
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* -- counters --------------------------------------------------------------- */

uint64_t bridge_request_count(int opcode)
{
    if (opcode < 0 || opcode >= BRIDGE_OPCODES)
        return 0;
    return __atomic_load_n(&g_counts[opcode], __ATOMIC_RELAXED);
}

uint64_t bridge_stat(int slot)
{
    if (slot < 0 || slot >= BRIDGE_COUNTERS)
        return 0;
    return __atomic_load_n(&g_counts[slot], __ATOMIC_RELAXED);
}

int bridge_set_counter_memory(void *mem, uint64_t len)
{
    if (mem == NULL || len < BRIDGE_COUNTER_BYTES || ((uintptr_t)mem & 7u))
        return -EINVAL;
    uint64_t *counts = mem;
    for (int i = 0; i < BRIDGE_COUNTERS; i++)
        counts[i] = g_counts[i];
    g_counts = counts;
    return 0;
}

void bridge_reset_counters(void)
{
    for (int i = 0; i < BRIDGE_COUNTERS; i++)
        __atomic_store_n(&g_counts[i], 0, __ATOMIC_RELAXED);
}

/* -- the shard connection --------------------------------------------------- */

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

void bridge_detach(void)
{
    if (g_bridge.attached)
        behind_save(); /* answered writes must outlive this ring (bridge_behind.c) */
    g_bridge.attached = 0;
    if (g_bridge.req_map != NULL) {
        munmap(g_bridge.req_map, g_bridge.req_len);
        g_bridge.req_map = NULL;
    }
    if (g_bridge.rep_map != NULL) {
        munmap(g_bridge.rep_map, g_bridge.rep_len);
        g_bridge.rep_map = NULL;
    }
    close_fd(&g_bridge.req_memfd);
    close_fd(&g_bridge.req_evfd);
    close_fd(&g_bridge.rep_memfd);
    close_fd(&g_bridge.rep_evfd);
    close_fd(&g_bridge.sock);
}

static int map_ring(int memfd, ring_t *ring, void **map, size_t *len)
{
    int seals = fcntl(memfd, F_GET_SEALS);
    int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    if (seals < 0 || (seals & need) != need)
        return -EPERM; /* an unsealed peer could shrink it under our mapping */
    struct stat st;
    if (fstat(memfd, &st) < 0)
        return -errno;
    if (st.st_size < RING_HEADER_SIZE)
        return -EBADMSG;
    void *mem = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (mem == MAP_FAILED)
        return -errno;
    int rc = ring_attach(ring, mem, (uint64_t)st.st_size);
    if (rc < 0) {
        munmap(mem, (size_t)st.st_size);
        return rc;
    }
    *map = mem;
    *len = (size_t)st.st_size;
    return 0;
}

int bridge_attach(int req_memfd, int req_eventfd, int rep_memfd, int rep_eventfd, int sock_fd)
{
    bridge_detach();
    g_bridge.req_memfd = req_memfd;
    g_bridge.req_evfd = req_eventfd;
    g_bridge.rep_memfd = rep_memfd;
    g_bridge.rep_evfd = rep_eventfd;
    g_bridge.sock = sock_fd;
    int fds[] = {req_memfd, req_eventfd, rep_memfd, rep_eventfd, sock_fd};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) {
        if (fds[i] < 0) {
            bridge_detach();
            return -EBADF;
        }
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    int rc = map_ring(req_memfd, &g_bridge.req, &g_bridge.req_map, &g_bridge.req_len);
    if (rc == 0)
        rc = map_ring(rep_memfd, &g_bridge.rep, &g_bridge.rep_map, &g_bridge.rep_len);
    if (rc == 0) {
        int fl = fcntl(rep_eventfd, F_GETFL);
        if (fl < 0 || fcntl(rep_eventfd, F_SETFL, fl | O_NONBLOCK) < 0)
            rc = -errno;
    }
    if (rc == 0) {
        uint32_t cap = ring_max_message(&g_bridge.rep);
        if (cap > g_bridge.reply_cap) {
            uint8_t *buf = realloc(g_bridge.reply, cap);
            if (buf == NULL) {
                rc = -ENOMEM;
            } else {
                g_bridge.reply = buf;
                g_bridge.reply_cap = cap;
            }
        }
    }
    if (rc < 0) {
        bridge_detach();
        return rc;
    }
    uint32_t most = ring_max_message(&g_bridge.req);
    if (ring_max_message(&g_bridge.rep) < most)
        most = ring_max_message(&g_bridge.rep);
    uint32_t chunk = most > 2 * IO_HEADROOM ? (most - IO_HEADROOM) & ~(IO_HEADROOM - 1) : 0;
    if (chunk < IO_HEADROOM) {
        bridge_detach();
        return -EMSGSIZE;
    }
    g_bridge.io_chunk = chunk > BRIDGE_MAX_IO ? BRIDGE_MAX_IO : chunk;
    g_bridge.attached = 1;
    return 0;
}

int bridge_configure(const char *volume, uint64_t spin_ns)
{
    if (volume == NULL || strlen(volume) == 0 || strlen(volume) >= sizeof g_bridge.volume)
        return -EINVAL;
    strcpy(g_bridge.volume, volume);
    g_bridge.spin_ns = spin_ns;
    codec_init();
    bridge_reserve_fds(); /* if a spare did not, before its threads */
    return 0;
}

/* Any event on the socket (data, EOF, error) means the shard is gone: it
 * sends nothing there once the rings are in use. */
static int socket_gone(short revents) { return revents != 0; }

static int shard_alive(void)
{
    struct pollfd p = {.fd = g_bridge.sock, .events = POLLIN | POLLRDHUP};
    int n = poll(&p, 1, 0);
    return !(n > 0 && socket_gone(p.revents));
}

static int stopping_too_long(void)
{
    if (!g_bridge.stop && !(g_bridge.se != NULL && fuse_session_exited(g_bridge.se)))
        return 0;
    uint64_t now = now_ns(CLOCK_MONOTONIC);
    if (g_bridge.stop_ns == 0)
        g_bridge.stop_ns = now;
    return now - g_bridge.stop_ns > SHUTDOWN_GRACE_NS;
}

static int wait_reply(uint64_t want, int *status, const msgpack_object **result);

/* 0: pushed; -EPIPE: connection lost; -EMSGSIZE: too large for the ring. */
static int push_request(const uint8_t *msg, uint32_t len, const uint8_t *tail, uint32_t tail_len)
{
    for (;;) {
        int rc = ring_push2(&g_bridge.req, msg, len, tail, tail_len);
        if (rc == 0)
            return ring_notify(&g_bridge.req, g_bridge.req_evfd) < 0 ? -EPIPE : 0;
        if (rc == -EMSGSIZE)
            return rc;
        if (rc != -EAGAIN || !shard_alive())
            return -EPIPE;
        /* Full of frames kept for writes answered early: take their replies. */
        if (behind_oldest() != 0) {
            if (link_wait_oldest() != 0)
                return -EPIPE;
            continue;
        }
        /* Bounded ring and the shard is behind: wait for it to drain. */
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 50000};
        nanosleep(&ts, NULL);
    }
}

int link_push_current(void)
{
    const uint8_t *msg = (const uint8_t *)g_bridge.sbuf.data;
    return push_request(msg, (uint32_t)g_bridge.sbuf.size, g_bridge.tail, g_bridge.tail_len);
}

int link_push_bytes(const uint8_t *msg, uint32_t len) { return push_request(msg, len, NULL, 0); }

/* Wait for the reply to `want`, taking the replies to writes answered early
 * that come before it (link_take_behind).  0: decoded (*status holds 0 with
 * *result, or a positive errno); -EPIPE: connection lost; -ETIMEDOUT: told
 * to stop and the shard did not answer within the grace period. */
/* The reply wait's spin policy (bridge_spin.c): crowding alone stops it.
 * Only the thread holding the link lock uses it. */
static struct spin_policy g_reply_spin = {.any_rate = 1};

static int wait_reply(uint64_t want, int *status, const msgpack_object **result)
{
    g_reply_spin.budget_ns = g_bridge.spin_ns;
    for (;;) {
        int n = ring_pop(&g_bridge.rep, g_bridge.reply, g_bridge.reply_cap);
        if (n >= 0) {
            uint64_t seq = 0;
            g_bridge.reply_len = (uint32_t)n;
            int rc = decode_reply(g_bridge.reply, (size_t)n, &seq, result, 1);
            if (rc == -EBADMSG) {
                fprintf(stderr, "slates-bridge: undecodable reply from the shard\n");
                return -EPIPE;
            }
            if (seq != 0 && seq != want && link_take_behind(seq, rc, *result))
                continue;
            if (seq != 0 && seq < want)
                continue; /* an answer to a request we gave up on */
            if (seq != 0 && seq != want) {
                fprintf(stderr, "slates-bridge: a reply answered another request\n");
                return -EPIPE;
            }
            *status = rc;
            return 0;
        }
        if (n != -EAGAIN)
            return -EPIPE; /* a corrupt ring: start over on a fresh pair */
        /* Behind replies to writes answered early, each costing the shard tens
         * of microseconds: no spin, and one wake-up, when the wanted reply is
         * pushed after them (the shard pushes in order). */
        unsigned ahead = behind_before(want);
        if (ahead == 0 && spin_ring(&g_bridge.rep, &g_reply_spin))
            continue;
        if (ring_prepare_park_until(&g_bridge.rep, ahead + 1))
            continue;
        struct pollfd p[2] = {
            {.fd = g_bridge.rep_evfd, .events = POLLIN},
            {.fd = g_bridge.sock, .events = POLLIN | POLLRDHUP},
        };
        int pr = poll(p, 2, 1000);
        ring_unpark(&g_bridge.rep);
        if (ring_drain_eventfd(g_bridge.rep_evfd) < 0)
            return -EPIPE;
        if (pr < 0 && errno != EINTR)
            return -EPIPE;
        if (pr > 0 && socket_gone(p[1].revents)) {
            /* The shard may have replied just before it went: take that. */
            if (ring_peek_length(&g_bridge.rep) >= 0)
                continue;
            return -EPIPE;
        }
        if (stopping_too_long())
            return -ETIMEDOUT;
    }
}

int link_wait_oldest(void)
{
    uint64_t oldest = behind_oldest();
    if (oldest == 0)
        return 0;
    int status = 0;
    const msgpack_object *result = NULL;
    int rc = wait_reply(oldest, &status, &result);
    if (rc == 0) {
        link_take_behind(oldest, status, result);
        return 0;
    }
    bridge_detach(); /* the next link_call reconnects and sends it again */
    return -EPIPE;
}

/* One attempt at a fresh hello, through Python. */
static int reconnect_once(void)
{
    bridge_detach();
    attr_drop_all(); /* what the old shard's replies taught (bridge_attr.c) */
    int rc = bridge_reconnect_cb();
    if (rc == 0 && !g_bridge.attached)
        rc = -ENOTCONN;
    if (rc == 0 && behind_resend() != 0) {
        bridge_detach();
        rc = -EPIPE;
    }
    if (rc == 0)
        bridge_count(BRIDGE_STAT_RECONNECTS);
    return rc;
}

/* Send the request in g_bridge.sbuf and wait for its reply, reconnecting and
 * resending the same bytes (same seq) when the shard goes away.  Returns 0
 * with *result, or a positive errno. */
int link_call(const msgpack_object **result)
{
    const uint8_t *msg = (const uint8_t *)g_bridge.sbuf.data;
    uint32_t len = (uint32_t)g_bridge.sbuf.size;
    unsigned delay_ms = 10;
    *result = NULL;
    g_bridge.reply_len = 0;
    /* Any request but a read ends the grant; the shard ends it there too
     * (slates.node.grants: a read only sees what came before it in the ring). */
    if (g_bridge.cur_op == NULL || strcmp(g_bridge.cur_op, "fs.read") != 0)
        behind_end_grant();
    for (;;) {
        if (!g_bridge.attached) {
            int rc = reconnect_once();
            if (rc < 0) {
                uint64_t now = now_ns(CLOCK_MONOTONIC);
                if (g_bridge.down_since_ns == 0)
                    g_bridge.down_since_ns = now;
                uint64_t budget = (uint64_t)BRIDGE_RECONNECT_SECONDS * NS_PER_SEC;
                if (now - g_bridge.down_since_ns > budget || stopping_too_long() ||
                    g_bridge.stop) {
                    bridge_count(BRIDGE_STAT_FAILED);
                    return EIO;
                }
                sleep_ms(delay_ms);
                delay_ms = delay_ms * 2 > 500 ? 500 : delay_ms * 2;
                continue;
            }
        }
        int rc = push_request(msg, len, g_bridge.tail, g_bridge.tail_len);
        int status = 0;
        if (rc == -EMSGSIZE) {
            fprintf(stderr, "slates-bridge: %s request of %u bytes exceeds the ring\n",
                    g_bridge.cur_op, len + g_bridge.tail_len);
            return EIO;
        }
        if (rc == 0)
            rc = wait_reply(g_bridge.cur_seq, &status, result);
        if (rc == 0) {
            g_bridge.down_since_ns = 0;
            bridge_count(BRIDGE_STAT_ROUND_TRIPS);
            return status;
        }
        if (rc == -ETIMEDOUT) {
            bridge_count(BRIDGE_STAT_FAILED);
            return EIO;
        }
        if (g_bridge.down_since_ns == 0) {
            g_bridge.down_since_ns = now_ns(CLOCK_MONOTONIC);
            fprintf(stderr, "slates-bridge: lost the shard during %s; reconnecting\n",
                    g_bridge.cur_op);
        }
        bridge_detach();
    }
}

int bridge_request(const char *op, const uint8_t *args, uint32_t args_len, uint8_t *out,
                   uint32_t cap)
{
    envelope_begin(op); /* takes the link lock */
    msgpack_sbuffer_write(&g_bridge.sbuf, (const char *)args, args_len);
    const msgpack_object *result;
    (void)link_call(&result);
    int rc = (int)g_bridge.reply_len;
    if (g_bridge.reply_len == 0)
        rc = -EIO; /* the shard never answered */
    else if (g_bridge.reply_len > cap)
        rc = -EMSGSIZE;
    else
        memcpy(out, g_bridge.reply, g_bridge.reply_len);
    link_release();
    return rc;
}
