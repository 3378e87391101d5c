/*
 * The loop threads' wait for the kernel's next request: spin a little, then
 * poll.
 *
 * Theory of operation.  A loop thread that blocks in read(2) on /dev/fuse
 * costs the bridge a wake-up on every request, and on the VM measured (idle
 * vCPUs halt) that is a cross-CPU interrupt each way of every round trip
 * (the calibrated cost, ~40-50 us: slates.node.ring.calibrate_spin): a
 * program streaming requests - grep reading file after file, git's lstats -
 * paid it on each one (bench/RESULTS.md, "Read-ahead of small files, and
 * spinning while requests stream in").  So the fd is O_NONBLOCK
 * (bridge_session.c) and spin_read first tries a read; when nothing is
 * queued it spins on non-blocking reads for up to the budget (the
 * calibrated wake-up cost) if the thread's spin_policy says so, then polls
 * and reads.  The policy:
 *   - miss_rate, how often the recent spins ended without a request (an
 *     average with weight 1/SPIN_WEIGHT, in 1/256ths);
 *   - it spins while the spins' hit rate is at least SPIN_MIN_RATE: a spin
 *     never makes a wait longer (one that outlasts it parks and is woken as
 *     it would have been), so it is worth its CPU while it often catches the
 *     request, and waits that nearly never end within it (a build's sparse
 *     requests) stop costing a spin each within about 16 waits;
 *   - while it does not spin, every SPIN_PROBE-th wait spins anyway, so the
 *     rate keeps being measured (a parked wait says little: its wake-up
 *     takes from ~40 us to well over 100 us on this VM) and spinning
 *     resumes after one hit;
 *   - a spin that got less than half of its time on the CPU (other tasks
 *     wanted that CPU) makes it park for the next SPIN_BACKOFF waits
 *     (counting involuntary context switches instead was too eager: a
 *     kernel worker's moment on the CPU counts as one).
 * The bridge's wait for a shard reply (bridge_link.c) follows the crowding
 * half of the policy only (spin_ring, a policy with any_rate set): it spins
 * for its budget on every wait, whatever the hit rate, but not for
 * SPIN_BACKOFF waits after a crowded spin.  The hit-rate half made a stream
 * of small-file creates and unlinks on an idle host 30-60% slower (an earlier
 * trial, bench/RESULTS.md): there a spin that misses still keeps the vCPU
 * from halting before the reply comes.  In a build the compilers hold both
 * CPUs, the servers' short slices (native/sched_slice.c) let a compiler take
 * the spinning thread's CPU within 100 us, and the spin is crowded: the
 * waits that follow park at once, and give that CPU to the build.
 * The shards' request waits spin on every wait.
 * At most one loop thread spins
 * at a time (g_spinner), so extra loop threads never burn more than one CPU
 * between them.  Errors are read's: EINTR (a signal: the loop checks
 * whether it is over) and ENODEV (the kernel ended the session) reach the
 * caller as before; a stop signal that comes while the thread spins ends
 * the wait at once (wait_readable).
 *
 * Counted: BRIDGE_STAT_SPIN_HITS (a request that came while spinning) and
 * BRIDGE_STAT_SPIN_PARKS (a wait that parked); for reply waits,
 * BRIDGE_STAT_REPLY_SPIN_HITS, _MISSES (it spun) and _SKIPS (it did not).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#define SPIN_WEIGHT 8u    /* the rate's average: each spin weighs 1/SPIN_WEIGHT */
#define SPIN_MIN_RATE 32u /* of 256: spin while an eighth of the spins hit */
#define SPIN_PROBE 8u     /* while not spinning, every 8th wait spins anyway */
#define SPIN_BACKOFF 64u  /* waits without a spin after a crowded one */

static int g_spinner; /* a loop thread is spinning (atomic) */

/* Whether to spin for this wait (a probe counts as one). */
int spin_wanted(struct spin_policy *p)
{
    if (p->budget_ns == 0 || p->backoff > 0)
        return 0;
    if (p->any_rate || 256u - p->miss_rate >= SPIN_MIN_RATE)
        return 1;
    if (++p->skipped < SPIN_PROBE)
        return 0;
    p->skipped = 0;
    return 1; /* a probe */
}

/* Record a wait: whether it spun, whether the request came while it spun,
 * and whether the spin was crowded off its CPU. */
void spin_noted(struct spin_policy *p, int spun, int hit, int crowded)
{
    if (spun)
        p->miss_rate = (p->miss_rate * (SPIN_WEIGHT - 1) + (hit ? 0u : 256u)) / SPIN_WEIGHT;
    if (crowded)
        p->backoff = SPIN_BACKOFF;
    else if (!spun && p->backoff > 0)
        p->backoff--;
}

/* Whether a spin that began at monotonic `start`, with the thread's CPU
 * clock at `cpu`, got less than half of its time on the CPU. */
static int crowded_since(uint64_t start, uint64_t cpu)
{
    return 2 * (now_ns(CLOCK_THREAD_CPUTIME_ID) - cpu) < now_ns(CLOCK_MONOTONIC) - start;
}

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

ssize_t spin_read(int fd, void *buf, size_t len, struct spin_policy *p)
{
    ssize_t n;
    if (try_read(fd, buf, len, &n))
        return n;
    int spun = 0, hit = 0, crowded = 0, expected = 0;
    if (spin_wanted(p) && __atomic_compare_exchange_n(&g_spinner, &expected, 1, 0,
                                                      __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        uint64_t start = now_ns(CLOCK_MONOTONIC), cpu = now_ns(CLOCK_THREAD_CPUTIME_ID);
        uint64_t deadline = start + p->budget_ns, now;
        do {
            hit = try_read(fd, buf, len, &n);
            now = now_ns(CLOCK_MONOTONIC);
        } while (!hit && !g_bridge.stop && now < deadline);
        __atomic_store_n(&g_spinner, 0, __ATOMIC_RELEASE);
        spun = 1;
        crowded = crowded_since(start, cpu);
    }
    if (!hit) {
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
    spin_noted(p, spun, hit, crowded);
    return n;
}

int spin_ring(ring_t *ring, struct spin_policy *p)
{
    if (!spin_wanted(p)) {
        spin_noted(p, 0, 0, 0);
        bridge_count(BRIDGE_STAT_REPLY_SPIN_SKIPS);
        return 0;
    }
    uint64_t start = now_ns(CLOCK_MONOTONIC), cpu = now_ns(CLOCK_THREAD_CPUTIME_ID);
    int hit = ring_spin_wait(ring, p->budget_ns);
    int crowded = crowded_since(start, cpu);
    spin_noted(p, 1, hit, crowded);
    bridge_count(hit ? BRIDGE_STAT_REPLY_SPIN_HITS : BRIDGE_STAT_REPLY_SPIN_MISSES);
    return hit;
}

int bridge_test_spin(uint64_t budget_ns, int any_rate, const uint64_t *waits, const int *flags,
                     uint32_t n, int *wanted)
{
    struct spin_policy p = {.budget_ns = budget_ns, .any_rate = any_rate};
    for (uint32_t i = 0; i < n; i++) {
        wanted[i] = spin_wanted(&p);
        spin_noted(&p, wanted[i], wanted[i] && waits[i] <= budget_ns, (flags[i] & 2) != 0);
    }
    return spin_wanted(&p);
}
