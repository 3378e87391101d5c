/*
 * The loop threads' wait for the kernel's next request: spin a little, then
 * poll.
 *
 * Theory of operation.  A loop thread that blocks in read(2) on /dev/fuse
 * costs the bridge a wake-up on every request, and on the VM measured (idle
 * vCPUs halt) that is a cross-CPU interrupt each way of every round trip: a
 * program streaming requests - grep reading file after file, git's lstats,
 * a compiler's writes - paid it on each one (bench/RESULTS.md, "Read-ahead
 * of small files, and spinning while requests stream in").  So the fd is
 * O_NONBLOCK (bridge_session.c) and spin_read first tries a read; when
 * nothing is queued it spins on non-blocking reads for up to the budget (the
 * calibrated wake-up cost) if the thread's ring_spin_t says so (ring.c,
 * "Spinning": while an eighth of its recent spins caught a request, with a
 * probe every eighth wait otherwise, and not after a spin that got less than
 * half of its time on the CPU), then polls and reads.  At most one loop
 * thread spins at a time (g_spinner), so extra loop threads never burn more
 * than one CPU between them.  Errors are read's: EINTR (a signal: the loop
 * checks whether it is over) and ENODEV (the kernel ended the session) reach
 * the caller as before; a stop signal that comes while the thread spins ends
 * the wait at once (wait_readable).
 *
 * Counted: BRIDGE_STAT_SPIN_HITS (a request that came while spinning) and
 * BRIDGE_STAT_SPIN_PARKS (a wait that parked).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

static int g_spinner; /* a loop thread is spinning (atomic) */

/* Wait for the fd to be readable, or for a stopping signal: 0, or -1 with
 * errno EINTR.  A signal that came while the thread spun has already run its
 * handler (g_bridge.stop) and would interrupt nothing, so the stop signals
 * are blocked while stop is checked, and ppoll unblocks them atomically:
 * one that came just before is taken at once, not after the next request. */
static int wait_readable(int fd)
{
    sigset_t stops, old;
    sigemptyset(&stops);
    sigaddset(&stops, SIGTERM);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stops, &old);
    int rc = -1;
    if (g_bridge.stop) {
        errno = EINTR;
    } else {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        rc = ppoll(&pfd, 1, NULL, &old) < 0 ? -1 : 0;
    }
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = saved;
    return rc;
}

/* One read of the O_NONBLOCK fd: 1 when it is over (*n set: a request, or an
 * error the caller handles), 0 when nothing is queued. */
static int try_read(int fd, void *buf, size_t len, ssize_t *n)
{
    *n = read(fd, buf, len);
    return *n >= 0 || errno != EAGAIN;
}

ssize_t spin_read(int fd, void *buf, size_t len, ring_spin_t *s)
{
    ssize_t n;
    if (try_read(fd, buf, len, &n))
        return n;
    s->spun = s->hit = s->crowded = 0;
    int expected = 0;
    if (ring_spin_wanted(s) && __atomic_compare_exchange_n(&g_spinner, &expected, 1, 0,
                                                           __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        uint64_t start = now_ns(CLOCK_MONOTONIC), cpu = ring_thread_cpu_ns();
        uint64_t deadline = start + s->budget_ns;
        do
            s->hit = try_read(fd, buf, len, &n);
        while (!s->hit && !g_bridge.stop && now_ns(CLOCK_MONOTONIC) < deadline);
        __atomic_store_n(&g_spinner, 0, __ATOMIC_RELEASE);
        s->spun = 1;
        s->crowded = ring_spin_crowded(start, cpu);
    }
    if (!s->hit) {
        bridge_count(BRIDGE_STAT_SPIN_PARKS);
        for (;;) {
            if (wait_readable(fd) < 0)
                return -1; /* EINTR: the loop checks whether it is over */
            if (try_read(fd, buf, len, &n))
                break; /* a request, or ENODEV once the kernel ended the session */
        }
    } else {
        bridge_count(BRIDGE_STAT_SPIN_HITS);
    }
    ring_spin_end(s);
    return n;
}

int bridge_test_spin(uint64_t budget_ns, const uint64_t *waits, const int *flags, uint32_t n,
                     int *wanted)
{
    ring_spin_t s = {.budget_ns = budget_ns};
    for (uint32_t i = 0; i < n; i++) {
        wanted[i] = ring_spin_wanted(&s);
        ring_spin_noted(&s, wanted[i], wanted[i] && waits[i] <= budget_ns, (flags[i] & 2) != 0);
    }
    return ring_spin_wanted(&s);
}
