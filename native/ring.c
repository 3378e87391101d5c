/* See ring.h for the layout, framing and trust model. */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* 128, not 64: Intel's adjacent-line prefetcher pulls cache lines in pairs,
 * so indices 64 bytes apart still bounce between the two cores. */
#define RING_LINE 128
#define RING_WRAP 0xffffffffu
#define FRAME_HEADER RING_FRAME_HEADER

struct ring_shared {
    /* Written once by ring_init, read-only afterwards. */
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;
    uint64_t capacity;
    uint8_t pad0[RING_LINE - 24];
    /* Written only by the producer: its position, and messages pushed. */
    alignas(RING_LINE) _Atomic uint64_t tail;
    _Atomic uint64_t pushed;
    uint8_t pad1[RING_LINE - 16];
    /* Written only by the consumer: its position, and messages taken. */
    alignas(RING_LINE) _Atomic uint64_t head;
    _Atomic uint64_t taken;
    uint8_t pad2[RING_LINE - 16];
    /* Written by the consumer, read by the producer after every push: whether
     * it sleeps, and the count of messages pushed at which to wake it. */
    alignas(RING_LINE) _Atomic uint32_t parked;
    uint32_t pad3a;
    _Atomic uint64_t wake_at;
    uint8_t pad3[RING_LINE - 16];
};

_Static_assert(sizeof(struct ring_shared) == RING_HEADER_SIZE, "header size");
_Static_assert(offsetof(struct ring_shared, tail) == RING_LINE, "tail line");
_Static_assert(offsetof(struct ring_shared, head) == 2 * RING_LINE, "head line");
_Static_assert(offsetof(struct ring_shared, parked) == 3 * RING_LINE, "parked line");
/* Lock-free atomics are address-free, which is what makes them work across
 * two processes mapping the region at different addresses. */
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "32-bit atomics must be lock-free");

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t align8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

static inline int valid_capacity(uint64_t capacity)
{
    return capacity >= RING_MIN_CAPACITY && capacity <= RING_MAX_CAPACITY &&
           (capacity & (capacity - 1)) == 0;
}

/* The peer may rewrite a length slot at any moment: read it exactly once. */
static inline uint32_t read_slot(const ring_t *r, uint64_t off)
{
    return *(const volatile uint32_t *)(r->data + off);
}

/* A consistent pair of indices: 8-aligned and at most a ring apart. */
static inline int valid_span(const ring_t *r, uint64_t head, uint64_t tail)
{
    return ((head | tail) & 7u) == 0 && tail - head <= r->capacity;
}

uint64_t ring_region_size(uint64_t capacity)
{
    return valid_capacity(capacity) ? RING_HEADER_SIZE + capacity : 0;
}

uint32_t ring_max_message(const ring_t *r)
{
    return (uint32_t)(r->capacity / 2 - FRAME_HEADER);
}

int ring_init(void *mem, uint64_t mem_len, uint64_t capacity)
{
    uint64_t need = ring_region_size(capacity);
    if (mem == NULL || need == 0 || mem_len < need)
        return -EINVAL;
    struct ring_shared *s = mem;
    memset(s, 0, RING_HEADER_SIZE);
    s->version = RING_VERSION;
    s->header_size = RING_HEADER_SIZE;
    s->capacity = capacity;
    atomic_init(&s->tail, 0);
    atomic_init(&s->head, 0);
    atomic_init(&s->pushed, 0);
    atomic_init(&s->taken, 0);
    atomic_init(&s->parked, 0);
    atomic_init(&s->wake_at, 0);
    /* Magic last, so a half-initialised region is never taken for a ring. */
    atomic_thread_fence(memory_order_release);
    s->magic = RING_MAGIC;
    return 0;
}

int ring_attach(ring_t *r, void *mem, uint64_t mem_len)
{
    if (r == NULL || mem == NULL || mem_len < RING_HEADER_SIZE)
        return -EINVAL;
    struct ring_shared *s = mem;
    if (s->magic != RING_MAGIC || s->version != RING_VERSION)
        return -EPROTO;
    uint64_t capacity = s->capacity;
    if (s->header_size != RING_HEADER_SIZE || !valid_capacity(capacity) ||
        mem_len < RING_HEADER_SIZE + capacity)
        return -EBADMSG;
    ring_t view = {
        .shared = s,
        .data = (uint8_t *)mem + RING_HEADER_SIZE,
        .capacity = capacity,
        .mask = capacity - 1,
    };
    /* Only alignment is checked here: a live peer may move the indices
     * between our two loads, so their distance is checked at each use. */
    uint64_t head = atomic_load_explicit(&s->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&s->tail, memory_order_acquire);
    if ((head | tail) & 7u)
        return -EBADMSG;
    view.cached_head = head;
    view.cached_tail = tail;
    *r = view;
    return 0;
}

uint64_t ring_produced(const ring_t *r)
{
    return atomic_load_explicit(&r->shared->tail, memory_order_relaxed);
}

uint64_t ring_consumed(const ring_t *r)
{
    return atomic_load_explicit(&r->shared->head, memory_order_relaxed);
}

uint64_t ring_frame_size(uint32_t len) { return align8(FRAME_HEADER + (uint64_t)len); }

void ring_keep(ring_t *r, uint64_t from)
{
    r->kept_from = from;
    r->keeping = 1;
}

void ring_unkeep(ring_t *r) { r->keeping = 0; }

const uint8_t *ring_frame_payload(const ring_t *r, uint64_t pos, uint32_t len)
{
    uint64_t off = pos & r->mask;
    if ((pos & 7u) || len > ring_max_message(r) || off + ring_frame_size(len) > r->capacity)
        return NULL;
    return r->data + off + FRAME_HEADER;
}

int ring_push(ring_t *r, const uint8_t *msg, uint32_t len)
{
    return ring_push2(r, msg, len, NULL, 0);
}

int ring_push2(ring_t *r, const uint8_t *first, uint32_t alen, const uint8_t *body,
               uint32_t blen)
{
    if (alen > ring_max_message(r) || blen > ring_max_message(r) - alen)
        return -EMSGSIZE;
    uint32_t len = alen + blen;
    struct ring_shared *s = r->shared;
    uint64_t frame = align8(FRAME_HEADER + (uint64_t)len);
    uint64_t tail = atomic_load_explicit(&s->tail, memory_order_relaxed);
    uint64_t off = tail & r->mask;
    uint64_t room_to_end = r->capacity - off;
    uint64_t need = frame <= room_to_end ? frame : room_to_end + frame;

    /* The cached head only lags the real one, so it can only make the ring
     * look fuller: re-read the consumer's line only when it says "full". */
    uint64_t head = r->cached_head;
    if (!valid_span(r, head, tail) || tail - head + need > r->capacity) {
        head = atomic_load_explicit(&s->head, memory_order_acquire);
        if (!valid_span(r, head, tail))
            return -EBADMSG;
        r->cached_head = head;
        if (tail - head + need > r->capacity)
            return -EAGAIN;
    }
    /* Kept frames count as unread (ring_keep): the room ends at the older. */
    if (r->keeping && r->kept_from <= tail && tail - r->kept_from + need > r->capacity)
        return -EAGAIN;

    if (frame > room_to_end) {
        *(volatile uint32_t *)(r->data + off) = RING_WRAP;
        tail += room_to_end;
        off = 0;
    }
    *(volatile uint32_t *)(r->data + off) = len;
    memcpy(r->data + off + FRAME_HEADER, first, alen);
    if (blen)
        memcpy(r->data + off + FRAME_HEADER + alen, body, blen);
    atomic_store_explicit(&s->tail, tail + frame, memory_order_release);
    atomic_store_explicit(&s->pushed, atomic_load_explicit(&s->pushed, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    return 0;
}

/* Locate the consumer's next frame: its payload length and offset, and the
 * head position just before it (past a wrap marker, if one was skipped). */
static int next_frame(ring_t *r, uint64_t *head_out, uint64_t *off_out)
{
    struct ring_shared *s = r->shared;
    uint64_t head = atomic_load_explicit(&s->head, memory_order_relaxed);
    uint64_t tail = r->cached_tail;
    if (tail == head || !valid_span(r, head, tail)) {
        tail = atomic_load_explicit(&s->tail, memory_order_acquire);
        if (!valid_span(r, head, tail))
            return -EBADMSG;
        r->cached_tail = tail;
        if (tail == head)
            return -EAGAIN;
    }

    uint64_t off = head & r->mask;
    uint64_t room_to_end = r->capacity - off;
    uint32_t len = read_slot(r, off);
    if (len == RING_WRAP) {
        /* A producer only wraps mid-ring, and only once per frame. */
        if (off == 0 || tail - head <= room_to_end)
            return -EBADMSG;
        head += room_to_end;
        off = 0;
        room_to_end = r->capacity;
        len = read_slot(r, 0);
    }
    if (len > ring_max_message(r))
        return -EBADMSG;
    uint64_t frame = align8(FRAME_HEADER + (uint64_t)len);
    if (frame > room_to_end || frame > tail - head)
        return -EBADMSG;
    *head_out = head;
    *off_out = off;
    return (int)len;
}

int ring_peek_length(ring_t *r)
{
    uint64_t head, off;
    return next_frame(r, &head, &off);
}

int ring_peek(ring_t *r, const uint8_t **payload)
{
    uint64_t head, off;
    int len = next_frame(r, &head, &off);
    if (len < 0)
        return len;
    *payload = r->data + off + FRAME_HEADER;
    r->peeked_end = head + align8(FRAME_HEADER + (uint64_t)len);
    return len;
}

int ring_consume(ring_t *r)
{
    if (r->peeked_end == 0)
        return -EINVAL;
    /* Release: the caller's reads of the payload happen before the producer
     * may reuse the space. */
    struct ring_shared *s = r->shared;
    atomic_store_explicit(&s->taken, atomic_load_explicit(&s->taken, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    atomic_store_explicit(&s->head, r->peeked_end, memory_order_release);
    r->peeked_end = 0;
    return 0;
}

int ring_pop(ring_t *r, uint8_t *out, uint32_t cap)
{
    if (r->peeked_end != 0)
        return -EBUSY; /* ring_consume first: the peeked frame would be taken twice */
    const uint8_t *payload;
    int len = ring_peek(r, &payload);
    if (len < 0)
        return len;
    if ((uint32_t)len > cap) {
        r->peeked_end = 0; /* the message stays queued */
        return -EMSGSIZE;
    }
    memcpy(out, payload, (size_t)len);
    (void)ring_consume(r); /* held: it cannot fail */
    return len;
}

static inline int has_data(ring_t *r)
{
    uint64_t head = atomic_load_explicit(&r->shared->head, memory_order_relaxed);
    return atomic_load_explicit(&r->shared->tail, memory_order_acquire) != head;
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int ring_spin_wait(ring_t *r, uint64_t spin_ns)
{
    if (has_data(r))
        return 1;
    uint64_t deadline = now_ns() + spin_ns;
    do {
        for (int i = 0; i < 32; i++) {
            cpu_relax();
            if (has_data(r))
                return 1;
        }
    } while (now_ns() < deadline);
    return 0;
}

/*
 * Lost-wakeup freedom (Dekker): the consumer stores parked=1 then reads tail;
 * the producer stores tail then reads parked.  With a seq_cst fence between
 * each side's store and load, at least one side sees the other's store: the
 * consumer finds the message, or the producer finds the flag and writes the
 * eventfd.  Without the fences both loads may be satisfied before the stores
 * are visible (store buffering), and the consumer would sleep on a message.
 * A consumer parks only on an empty ring, so "pushed >= wake_at" becomes true
 * only through a push after the park, which sees the flag and (stored before
 * it, released with it) wake_at.
 */
int ring_prepare_park(ring_t *r) { return ring_prepare_park_until(r, 1); }

int ring_prepare_park_until(ring_t *r, uint32_t messages)
{
    struct ring_shared *s = r->shared;
    uint64_t taken = atomic_load_explicit(&s->taken, memory_order_relaxed);
    atomic_store_explicit(&s->wake_at, taken + (messages ? messages : 1), memory_order_relaxed);
    /* Release: a producer that sees the flag sees this park's wake_at too. */
    atomic_store_explicit(&s->parked, 1, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (has_data(r)) {
        atomic_store_explicit(&s->parked, 0, memory_order_relaxed);
        return 1;
    }
    return 0;
}

void ring_unpark(ring_t *r)
{
    atomic_store_explicit(&r->shared->parked, 0, memory_order_relaxed);
}

int ring_is_parked(const ring_t *r)
{
    return atomic_load_explicit(&r->shared->parked, memory_order_relaxed) != 0;
}

int ring_notify(ring_t *r, int eventfd)
{
    atomic_thread_fence(memory_order_seq_cst);
    struct ring_shared *s = r->shared;
    if (atomic_load_explicit(&s->parked, memory_order_acquire) == 0)
        return 0;
    /* A consumer that asked to sleep through some messages (it knows the one
     * it waits for comes after them) is not woken for those.  wake_at is the
     * consumer's word: a wrong one only delays the consumer itself, whose
     * waits are bounded by its own timeout. */
    if (atomic_load_explicit(&s->pushed, memory_order_relaxed) <
        atomic_load_explicit(&s->wake_at, memory_order_relaxed))
        return 0;
    uint64_t one = 1;
    for (;;) {
        if (write(eventfd, &one, sizeof one) == (ssize_t)sizeof one)
            return 1;
        /* EAGAIN means the counter is already huge: the consumer is awake. */
        if (errno == EAGAIN)
            return 1;
        if (errno != EINTR)
            return -errno;
    }
}

int64_t ring_drain_eventfd(int eventfd)
{
    uint64_t count;
    for (;;) {
        if (read(eventfd, &count, sizeof count) == (ssize_t)sizeof count)
            return (int64_t)count;
        if (errno == EAGAIN)
            return 0;
        if (errno != EINTR)
            return -errno;
    }
}
