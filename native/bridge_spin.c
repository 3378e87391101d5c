/*
 * Adaptive spinning for the bridge's two short waits: a loop thread waiting
 * for the kernel's next request, and the link waiting for the shard's reply.
 *
 * Theory of operation.  A parked wait costs a wake-up; on the 2-vCPU VM
 * measured, whose idle vCPUs halt, that is a cross-CPU interrupt to a
 * halted vCPU each way of a round trip (the calibrated cost is ~40-50 us,
 * slates.node.ring.calibrate_spin), while a spin costs the CPU it burns.
 * The rule before was fixed: spin for the wake-up cost, then park, which
 * is within 2x of the best choice made with hindsight for one wait.  But
 * the link spun on every request, and the shard's writes take ~230 us, so
 * in a lua build every write burned its whole budget for nothing (21% of
 * the bridge's and the shard's perf samples); and the loop threads never
 * spun at all, so a program streaming requests (grep reading file after
 * file, git's lstats, a compiler's writes) paid the bridge's wake-up on
 * every one.  So each wait site keeps a `spin_policy`:
 *   - `avg_ns`, an average of its recent waits as a spinner would have seen
 *     them: a spun wait as it was, a parked one less the wake-up cost (the
 *     budget), each capped at SPIN_CAP budgets so one long idle spell
 *     weighs like a few misses, not forever;
 *   - it spins (for at most the budget) only while that average is within
 *     the budget: waits that reliably outlast it stop costing CPU within a
 *     few waits, and streams of short ones spin again as soon as they come;
 *   - a spin during which this thread was preempted involuntarily (another
 *     task wanted its CPU: a build on every core) makes it park for the next
 *     SPIN_BACKOFF waits: on a busy host, a spin takes the CPU from work.
 * The policy is pure arithmetic over what its caller measured (spin_wanted,
 * spin_noted); spin_read is the /dev/fuse wait built on it (the fd is
 * O_NONBLOCK: bridge_session.c), and the link's (bridge_link.c) spins with
 * ring_spin_wait.  At most one loop thread spins at a time (g_spinner), so
 * extra loop threads never burn more than one CPU between them.
 *
 * Counted: BRIDGE_STAT_SPIN_HITS (a request or reply that came while
 * spinning) and BRIDGE_STAT_SPIN_PARKS (a wait that parked).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#define SPIN_CAP 4u      /* a wait counts at most this many budgets */
#define SPIN_BACKOFF 64u /* parked waits after a spin that was preempted */

static int g_spinner; /* a loop thread is spinning (atomic) */

int spin_wanted(const struct spin_policy *p)
{
    return p->budget_ns > 0 && p->backoff == 0 && p->avg_ns <= p->budget_ns;
}

void spin_noted(struct spin_policy *p, uint64_t waited_ns, int parked, int preempted)
{
    uint64_t budget = p->budget_ns;
    uint64_t seen = parked ? (waited_ns > budget ? waited_ns - budget : 0) : waited_ns;
    if (seen > SPIN_CAP * budget)
        seen = SPIN_CAP * budget;
    p->avg_ns = (p->avg_ns * 3 + seen) / 4;
    if (preempted)
        p->backoff = SPIN_BACKOFF;
    else if (p->backoff > 0 && parked)
        p->backoff--;
}

long spin_preemptions(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : -1;
}

/* One read of the O_NONBLOCK /dev/fuse fd: 1 when it is over (*n set: a
 * request, or an error the caller handles), 0 when nothing is queued. */
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
    uint64_t start = now_ns(CLOCK_MONOTONIC);
    int expected = 0, preempted = 0;
    if (spin_wanted(p) && __atomic_compare_exchange_n(&g_spinner, &expected, 1, 0,
                                                      __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        long before = spin_preemptions();
        uint64_t deadline = start + p->budget_ns, now;
        int got;
        do {
            got = try_read(fd, buf, len, &n);
            now = now_ns(CLOCK_MONOTONIC);
        } while (!got && now < deadline);
        __atomic_store_n(&g_spinner, 0, __ATOMIC_RELEASE);
        preempted = spin_preemptions() != before;
        if (got) {
            spin_noted(p, now - start, 0, preempted);
            bridge_count(BRIDGE_STAT_SPIN_HITS);
            return n;
        }
    }
    bridge_count(BRIDGE_STAT_SPIN_PARKS);
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, -1) < 0)
            return -1; /* EINTR: the loop checks whether it is over */
        if (try_read(fd, buf, len, &n))
            break; /* a request, or ENODEV once the kernel ended the session */
    }
    spin_noted(p, now_ns(CLOCK_MONOTONIC) - start, 1, preempted);
    return n;
}

int bridge_test_spin(uint64_t budget_ns, const uint64_t *waits, const int *flags, uint32_t n,
                     int *wanted)
{
    struct spin_policy p = {.budget_ns = budget_ns};
    for (uint32_t i = 0; i < n; i++) {
        wanted[i] = spin_wanted(&p);
        spin_noted(&p, waits[i], flags[i] & 1, (flags[i] & 2) != 0);
    }
    return spin_wanted(&p);
}
