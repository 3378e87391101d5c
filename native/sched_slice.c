/*
 * The servers' scheduler slice: a shard or a bridge asks Linux's fair
 * scheduler (EEVDF) for a short slice, so that when a request wakes it on a
 * CPU a compiler holds, it runs at once instead of after the compiler's
 * slice.
 *
 * Theory of operation.  Since Linux 6.12 a SCHED_OTHER thread's
 * sched_attr.sched_runtime is the slice it asks for (100 us to 100 ms;
 * the default is 0.75 ms times a factor for the CPU count, 1.4 ms on the
 * 2-vCPU host measured).  A waking task whose slice is shorter than the
 * running task's preempts it (the PREEMPT_SHORT scheduler feature); its
 * share of the CPU stays what its nice value gives, so a busy server takes
 * no more CPU than before, only sooner.  Measured in a lua build in a
 * mount (bench/RESULTS.md): make's LOOKUPs that came while both CPUs ran
 * compilers waited 3.3 ms (p50) with the default slice and 0.34 ms with a
 * 100 us one.
 *
 * servers_short_slice sets the calling thread's slice, keeping its policy and
 * nice value (read with sched_getattr first); threads and processes it
 * starts later inherit it, so a process calls it once, on its main thread,
 * before it starts threads.  Older kernels take a SCHED_OTHER runtime and
 * ignore it; a kernel without sched_setattr (ENOSYS) or a refusal is
 * returned as -errno, and the caller only logs it: the slice is a speed
 * lever, never needed for correctness.  Callers: slates.node.shard's main
 * and slates.fuse.bridge's run_bridge.
 */
#define _GNU_SOURCE
#include "bridge.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The kernel's struct sched_attr (uapi/linux/sched/types.h), as of 5.3. */
struct slice_attr {
    uint32_t size;
    uint32_t sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime;
    uint64_t sched_deadline;
    uint64_t sched_period;
    uint32_t sched_util_min;
    uint32_t sched_util_max;
};

int servers_short_slice(uint64_t ns)
{
#if defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
    struct slice_attr attr;
    memset(&attr, 0, sizeof attr);
    if (syscall(SYS_sched_getattr, 0, &attr, (unsigned)sizeof attr, 0u) != 0)
        return -errno;
    if (attr.sched_policy != 0 /* SCHED_OTHER */)
        return -EPERM; /* not ours to change: an idle or real-time thread keeps its policy */
    attr.size = sizeof attr;
    attr.sched_flags = 0;
    attr.sched_runtime = ns;
    attr.sched_deadline = 0;
    attr.sched_period = 0;
    if (syscall(SYS_sched_setattr, 0, &attr, 0u) != 0)
        return -errno;
    return 0;
#else
    (void)ns;
    return -ENOSYS;
#endif
}

uint64_t servers_slice(void)
{
#if defined(SYS_sched_getattr)
    struct slice_attr attr;
    memset(&attr, 0, sizeof attr);
    if (syscall(SYS_sched_getattr, 0, &attr, (unsigned)sizeof attr, 0u) != 0)
        return 0;
    return attr.sched_runtime;
#else
    return 0;
#endif
}
