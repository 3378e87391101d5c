/*
 * Single-producer/single-consumer message ring in caller-provided shared
 * memory (a memfd that two processes map).
 *
 * Region layout: a RING_HEADER_SIZE header (magic, version, capacity, and
 * the producer's tail and count of messages pushed, the consumer's head and
 * count of messages taken, and the consumer's parked flag with the count to
 * wake it at, each group on its own cache-line pair), then `capacity` data
 * bytes.  Positions
 * are monotonic 64-bit byte counters; a position's offset in the data area
 * is `pos & (capacity - 1)`.
 *
 * Framing: [u32 length][payload], padded to 8 bytes.  A frame never straddles
 * the end of the data area: when it would, the producer writes RING_WRAP in
 * the length slot and the frame starts again at offset 0.  A frame is at
 * most capacity / 2 bytes, so any message that fits the limit fits an empty
 * ring wherever its head happens to be.
 *
 * The region is shared with a peer process we do not trust to be correct:
 * every value read from it is validated before use, and a bad one yields
 * -EBADMSG instead of an out-of-bounds access.  The ring handle (ring_t)
 * lives in private memory and holds the validated capacity, so a peer that
 * rewrites the header after attach cannot widen the bounds.
 *
 * Functions return 0 or a non-negative count on success and -errno on
 * failure.
 */
#ifndef SLATES_RING_H
#define SLATES_RING_H

#include <stdint.h>

#define RING_MAGIC 0x31474e4952534c53ULL /* "SLSRING1" little-endian */
#define RING_VERSION 2 /* 2: message counts and wake_at (ring_prepare_park_until) */
#define RING_HEADER_SIZE 512
#define RING_MIN_CAPACITY 64
#define RING_MAX_CAPACITY 1073741824 /* 1 GiB: lengths stay well inside int */

typedef struct ring_shared ring_shared_t;

/* Private, per-process view of one ring.  Owned by the caller (Python). */
typedef struct {
    ring_shared_t *shared;
    uint8_t *data;
    uint64_t capacity;
    uint64_t mask;
    uint64_t cached_head; /* producer's lower bound on the consumer's head */
    uint64_t cached_tail; /* consumer's lower bound on the producer's tail */
    uint64_t peeked_end;  /* consumer: where the frame ring_peek returned ends, or 0 */
    uint64_t kept_from;   /* producer: frames from here on are not overwritten (ring_keep) */
    int keeping;          /* producer: kept_from is set */
} ring_t;

/* Bytes of shared memory needed for a ring of `capacity` data bytes, or 0
 * when `capacity` is not a power of two in [RING_MIN_CAPACITY,
 * RING_MAX_CAPACITY]. */
uint64_t ring_region_size(uint64_t capacity);

/* Largest payload a ring of this handle accepts. */
uint32_t ring_max_message(const ring_t *r);

/* Format `mem` (mem_len bytes) as an empty ring of `capacity` data bytes.
 * -EINVAL: bad capacity or mem_len < ring_region_size(capacity). */
int ring_init(void *mem, uint64_t mem_len, uint64_t capacity);

/* Validate the header of `mem` and fill `r`.  -EINVAL: mem_len too small
 * for a header.  -EPROTO: foreign magic or version.  -EBADMSG: header
 * values inconsistent with each other or with mem_len. */
int ring_attach(ring_t *r, void *mem, uint64_t mem_len);

/* Producer.  0, -EAGAIN (full: the ring never grows), -EMSGSIZE (len >
 * ring_max_message), -EBADMSG (the shared indices are corrupt). */
int ring_push(ring_t *r, const uint8_t *msg, uint32_t len);

/* Producer.  ring_push of one message made of two parts (`first` then
 * `body`), each copied once into the frame: a large payload need not be
 * joined to its envelope first.  Same errors, for alen + blen. */
int ring_push2(ring_t *r, const uint8_t *first, uint32_t alen, const uint8_t *body,
               uint32_t blen);

/* Producer.  The position just past the last frame pushed (the producer's
 * own tail): a frame of `len` payload bytes that ring_push2 just queued
 * starts at ring_produced - ring_frame_size(len), its payload
 * RING_FRAME_HEADER bytes after that (no wrap marker falls inside). */
uint64_t ring_produced(const ring_t *r);
uint64_t ring_frame_size(uint32_t len);
#define RING_FRAME_HEADER 4u

/* Consumer.  The position up to which frames were taken (the consumer's own
 * head): a frame ring_produced showed is taken once this reaches it. */
uint64_t ring_consumed(const ring_t *r);

/* Producer.  Keep the frames at and after position `from` (a frame start
 * ring_produced gave) from being overwritten by later pushes, even once the
 * consumer has taken them (-EAGAIN instead, as for a full ring), so the
 * producer can read them back to send again elsewhere; ring_unkeep ends it.
 * The consumer never writes the data area, but a broken one could: a
 * reader of kept bytes treats them as its own request's, not as trusted. */
void ring_keep(ring_t *r, uint64_t from);
void ring_unkeep(ring_t *r);

/* Producer.  The payload bytes of the frame at `pos` (a kept frame start)
 * of `len` bytes, or NULL when that span is not inside the data area. */
const uint8_t *ring_frame_payload(const ring_t *r, uint64_t pos, uint32_t len);

/* Consumer.  Payload length copied into `out`, -EAGAIN (empty), -EMSGSIZE
 * (cap too small; the message stays queued, ring_peek_length tells the size
 * needed), -EBADMSG (corrupt header, index or frame), -EBUSY (a ring_peek
 * is held: ring_consume it first). */
int ring_pop(ring_t *r, uint8_t *out, uint32_t cap);

/* Consumer.  Length of the next message without consuming it; same errors
 * as ring_pop. */
int ring_peek_length(ring_t *r);

/* Consumer.  The next message in place: its length, with *payload pointing
 * into the shared data area, until ring_consume.  Same errors as ring_pop
 * (-EMSGSIZE aside).  The peer may still write those bytes: a caller copies
 * what it keeps and validates what it copied (a decoder that reads each
 * byte once into private objects does both), never reading a byte twice. */
int ring_peek(ring_t *r, const uint8_t **payload);

/* Consumer.  Release the message ring_peek returned (0), or -EINVAL when
 * none is held. */
int ring_consume(ring_t *r);

/* Consumer.  Busy-wait up to spin_ns for the ring to become non-empty:
 * 1 if it did, 0 if the time ran out. */
int ring_spin_wait(ring_t *r, uint64_t spin_ns);

/* Consumer, before blocking on the eventfd: set the parked flag, then look
 * at the ring again.  0: still empty, safe to block (the producer will see
 * the flag).  1: data arrived meanwhile; the flag was cleared, do not block. */
int ring_prepare_park(ring_t *r);

/* Consumer: ring_prepare_park, asking to sleep until `messages` more have
 * been pushed (counted from those taken so far; 0 counts as 1), for a
 * consumer that knows the message it waits for comes after others: the
 * producer does not wake it for those.  It must take every message there
 * is before parking again (1 means data arrived, as above). */
int ring_prepare_park_until(ring_t *r, uint32_t messages);

/* Consumer, after waking (or giving up on) the eventfd. */
void ring_unpark(ring_t *r);

int ring_is_parked(const ring_t *r);

/* Producer, after ring_push: write the eventfd if the consumer is parked
 * and the messages pushed reach the count it parked until.  1 if it wrote,
 * 0 if not, -errno if write failed. */
int ring_notify(ring_t *r, int eventfd);

/* Reset the eventfd counter.  Returns the counter (0 if it was already 0)
 * or -errno.  The eventfd must be non-blocking. */
int64_t ring_drain_eventfd(int eventfd);

#endif
