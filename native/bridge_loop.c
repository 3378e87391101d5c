/*
 * The request loop: the threads that read /dev/fuse and run the callbacks,
 * and how they stop.
 *
 * Theory of operation.  bridge_run reads requests on the calling thread
 * until the kernel's INIT is answered (nothing else can arrive before it),
 * writes "1" to ready_fd, then starts g_threads - 1 more loop threads on
 * the same /dev/fuse descriptor.  Each thread blocks in read(2) on it (the
 * kernel wakes one reader per request), counts the request by opcode,
 * dispatches it (fuse_session_process_buf, thread-safe in libfuse), and
 * gives back the link lock if the callback took it (link_release).  So
 * requests answered without the shard (clean base metadata and reads,
 * known-absent xattrs) run in parallel - git's parallel lstat threads
 * (preload-index), readahead beside a reader - while requests that go to
 * the shard still go one at a time over the one ring link.
 *
 * Stopping.  SIGTERM, SIGINT and SIGHUP end the loop: their handler sets
 * g_bridge.stop and exits the session; a blocked read returns EINTR (no
 * SA_RESTART) in the thread that took the signal, and a handler running on
 * any other thread (a Python thread, a worker) forwards the signal to the
 * main loop thread.  When the kernel ends the session (an external
 * unmount) every reader gets ENODEV.  The main loop thread, once out of
 * its loop, exits the session and interrupts each worker with SIGTERM
 * (re-sent every JOIN_POLL_NS: a worker may be between its check and its
 * read) until it has joined them all; a worker inside a shard round trip
 * ends it within the link's shutdown grace.  The first loop error other
 * than ENODEV is bridge_run's result.
 *
 * In io_uring mode (bridge_uring.c) the ring threads start once INIT is
 * answered and serve most requests; this loop then sees only FORGET,
 * BATCH_FORGET and INTERRUPT, and its end stops them (uring_stop).
 *
 * Bounded: at most BRIDGE_MAX_LOOP_THREADS threads, each with one request
 * buffer (libfuse's, max_write plus headers) and one clean-read buffer.
 */
#include "bridge_internal.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define JOIN_POLL_NS 20000000L /* 20 ms */

static unsigned g_threads = BRIDGE_LOOP_THREADS;
static pthread_t g_main_thread;
static volatile sig_atomic_t g_running; /* g_main_thread is valid */
static int g_loop_error;                /* first error a loop thread saw (atomic) */

int bridge_set_threads(unsigned n)
{
    if (g_bridge.se != NULL || n < 1 || n > BRIDGE_MAX_LOOP_THREADS)
        return -EINVAL;
    g_threads = n;
    return 0;
}

static void on_signal(int sig)
{
    (void)sig;
    int first = !g_bridge.stop;
    g_bridge.stop = 1;
    if (g_bridge.se != NULL)
        fuse_session_exit(g_bridge.se);
    /* Wake the main loop thread's read if another thread took the signal. */
    if (first && g_running && !pthread_equal(pthread_self(), g_main_thread))
        pthread_kill(g_main_thread, SIGTERM);
}

void bridge_exit(void) { on_signal(0); }

static int loop_over(void) { return g_bridge.stop || fuse_session_exited(g_bridge.se); }

/* Read and answer one request: 1 when one was answered (*opcode set), 0 to
 * try again (EINTR), -1 when this thread's loop is over. */
static int serve_one(struct fuse_buf *fbuf, uint32_t *opcode)
{
    int res = fuse_session_receive_buf(g_bridge.se, fbuf);
    if (res == -EINTR || res == -EAGAIN)
        return 0;
    if (res <= 0) {
        if (res < 0 && res != -ENODEV) {
            int none = 0;
            __atomic_compare_exchange_n(&g_loop_error, &none, res, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED);
        }
        fuse_session_exit(g_bridge.se); /* every other thread ends too */
        return -1;
    }
    *opcode = 0;
    if (!(fbuf->flags & FUSE_BUF_IS_FD) && (size_t)res >= 8) {
        memcpy(opcode, (const char *)fbuf->mem + 4, sizeof *opcode);
        bridge_count(*opcode < BRIDGE_OPCODES ? (int)*opcode : 0);
    }
    fuse_session_process_buf(g_bridge.se, fbuf);
    link_release(); /* the request is answered: the next one may use the link */
    return 1;
}

static void *worker(void *arg)
{
    (void)arg;
    struct fuse_buf fbuf;
    memset(&fbuf, 0, sizeof fbuf);
    uint32_t opcode;
    while (!loop_over() && serve_one(&fbuf, &opcode) >= 0)
        ;
    free(fbuf.mem);
    clean_thread_done();
    return NULL;
}

static void signal_ready(int *ready_fd)
{
    if (*ready_fd < 0)
        return;
    ssize_t w;
    do
        w = write(*ready_fd, "1", 1);
    while (w < 0 && errno == EINTR);
    close(*ready_fd);
    *ready_fd = -1;
}

/* Interrupt `tid` with SIGTERM until it has ended (re-sent every JOIN_POLL_NS: it
 * may be between its check and its blocking call) and join it. */
void bridge_join_thread(pthread_t tid)
{
    for (;;) {
        pthread_kill(tid, SIGTERM);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += JOIN_POLL_NS;
        if (until.tv_nsec >= (long)NS_PER_SEC) {
            until.tv_sec++;
            until.tv_nsec -= (long)NS_PER_SEC;
        }
        if (pthread_timedjoin_np(tid, NULL, &until) == 0)
            return;
    }
}

/* Interrupt and join every started worker. */
static void join_workers(pthread_t *ids, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        bridge_join_thread(ids[i]);
}

int bridge_run(int ready_fd)
{
    if (g_bridge.se == NULL)
        return -EINVAL;
    static const int SIGNALS[] = {SIGTERM, SIGINT, SIGHUP};
    struct sigaction old[3], sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: a blocked read must return EINTR */
    g_main_thread = pthread_self();
    g_loop_error = 0;
    g_running = 1;
    for (int i = 0; i < 3; i++)
        sigaction(SIGNALS[i], &sa, &old[i]);
    struct fuse_buf fbuf;
    memset(&fbuf, 0, sizeof fbuf);
    uint32_t opcode = 0;
    /* Alone until INIT is answered: nothing else arrives before it. */
    for (int inited = 0; !inited && !loop_over();) {
        int served = serve_one(&fbuf, &opcode);
        if (served < 0)
            break;
        inited = served > 0 && opcode == BRIDGE_OP_INIT;
    }
    if (!loop_over()) {
        watch_start(); /* before any listing: every one of a clean directory is watched */
        uring_start(); /* io_uring mode only: rings serve once every queue registers */
        prefetch_hold_mount(); /* before a user may umount it: see bridge_prefetch.c */
    }
    signal_ready(&ready_fd);
    if (!loop_over())
        prefetch_start();
    pthread_t ids[BRIDGE_MAX_LOOP_THREADS];
    unsigned started = 0;
    while (!loop_over() && started + 1 < g_threads) {
        if (pthread_create(&ids[started], NULL, worker, NULL) != 0)
            break; /* fewer threads serve: slower, not wrong */
        started++;
    }
    while (!loop_over() && serve_one(&fbuf, &opcode) >= 0)
        ;
    fuse_session_exit(g_bridge.se);
    prefetch_stop();
    watch_stop();
    join_workers(ids, started);
    uring_stop();
    g_running = 0;
    free(fbuf.mem);
    clean_thread_done();
    for (int i = 0; i < 3; i++)
        sigaction(SIGNALS[i], &old[i], NULL);
    return __atomic_load_n(&g_loop_error, __ATOMIC_RELAXED);
}
