/*
 * Write-behind: a write the shard promised to accept is answered to the
 * kernel as soon as it is in the request ring, and the shard's reply is
 * taken later, so a writer's next write(2) overlaps the shard's work on the
 * last one.
 *
 * Theory of operation.  The shard answers a synchronous fs.write that asked
 * ("behind") with a grant when it can promise more: "the next writes to
 * this inode, each starting where the last ended, up to N bytes in all,
 * will be applied" (it reserved their capacity: slates/fuse/PROTOCOL.md,
 * "Write grants").  An fs.create that asked gets one for writes anywhere
 * in the empty file it made, and so does a write to a file with no base
 * content ("scatter": C, each write counted C more than its bytes, as
 * slates.node.grants counts it), so a new file's writes are
 * answered early too, even those that go back to fill in a header (an
 * assembler's object file), and a tool writing many small files waits for
 * two round trips each, not three.
 * A grant lives until the next request the shard takes from this ring that
 * is neither a write under it nor a read, on both sides: link_call ends it
 * here before it sends anything else, the shard on receiving it (a read
 * comes after the granted writes in the ring, so it sees them, and holds no
 * room: an assembler reading back what it wrote keeps its grant).  behind_try sends a write under the grant (args "granted") without
 * waiting, and the callback answers the kernel at once.  Its seq, inode and
 * frame position wait in a FIFO (at most BEHIND_MAX; a full FIFO first
 * waits for its oldest reply) until the shard's reply comes, in order,
 * before the reply of whatever is sent next (link_take_behind, called by the
 * link's reply wait).  Nothing else changes: the shard applies a ring's
 * requests in order, so a read, a getattr, an fsync or a snapshot barrier
 * that follows sees every earlier write, and an fsync, whose reply comes
 * after theirs, returns only once they are applied.
 *
 * Failures.  A write under a grant should not fail (its room was
 * reserved); if one does, its error is latched for its inode and is the
 * answer to the next write or fsync of that inode (as the kernel's own
 * writeback reports a failed page), and it is logged.  The shard going away
 * must not lose an answered write: the frames of unanswered writes stay in
 * the request ring's memory (ring_keep stops later pushes from overwriting
 * them); when the link detaches, behind_save copies them out, and after the
 * next hello behind_resend pushes them again, same bytes and seq, before
 * anything else, so the new shard applies each one that the old did not
 * commit and answers the others from their saved results.  The ack that
 * every request carries never passes the oldest unanswered write
 * (link_ack), so those saved results stay.
 *
 * Threads: every function here runs under the link lock (bridge_link.c).
 * Only write-through mounts use grants (with the kernel's writeback cache,
 * its own flushes already overlap the writer).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BEHIND_MAX 8     /* writes answered to the kernel, unanswered by the shard */
#define BEHIND_FILE_MAX (1ull << 43) /* slates.core.volume.MAX_FILE_SIZE */
#define LATCH_MAX 16     /* inodes with a write failure not yet reported */

struct behind {
    uint64_t seq;
    uint64_t ino;
    uint64_t pos;   /* its frame's position in the request ring */
    uint32_t len;   /* its frame's payload bytes (the whole request) */
    uint32_t size;  /* the data bytes it writes */
    uint8_t *saved; /* the payload, copied out when the link detached */
};

static struct {
    int enabled;
    /* the grant: held while `left` > 0; anywhere in the file when `scatter` (what
     * each write counts beyond its bytes, as the shard said) is not 0 */
    uint64_t ino, end, left, scatter;
    struct behind fifo[BEHIND_MAX];
    unsigned first, count;
    struct {
        uint64_t ino;
        int err;
    } latched[LATCH_MAX];
    unsigned nlatched;
    int latch_overflow; /* a failure not kept per inode: the next fsync or write says so */
} g_wb;

int bridge_set_write_behind(int on)
{
    if (g_bridge.se != NULL)
        return -EBUSY;
    g_wb.enabled = on != 0;
    return 0;
}

int behind_wanted(void) { return g_wb.enabled && !g_bridge.writeback; }

void behind_end_grant(void) { g_wb.left = 0; }

void behind_granted(uint64_t ino, uint64_t end, const msgpack_object *result)
{
    int64_t bytes = 0, scatter = 0;
    if (!mp_int(mp_get(result, "grant"), &bytes))
        return;
    if (mp_get(result, "scatter") != NULL && !mp_int(mp_get(result, "scatter"), &scatter))
        return;
    if (bytes <= 0 || scatter < 0 || scatter > bytes || !behind_wanted())
        return;
    g_wb.ino = ino;
    g_wb.end = end;
    g_wb.left = (uint64_t)bytes;
    g_wb.scatter = (uint64_t)scatter;
}

static struct behind *fifo_at(unsigned i) { return &g_wb.fifo[(g_wb.first + i) % BEHIND_MAX]; }

uint64_t link_ack(uint64_t seq) { return (g_wb.count > 0 ? fifo_at(0)->seq : seq) - 1; }

static void latch(uint64_t ino, int err)
{
    content_drop(ino); /* its copy holds bytes the shard refused (bridge_content.c) */
    for (unsigned i = 0; i < g_wb.nlatched; i++)
        if (g_wb.latched[i].ino == ino)
            return; /* the first failure is the one reported */
    if (g_wb.nlatched == LATCH_MAX) {
        g_wb.latch_overflow = err;
        return;
    }
    g_wb.latched[g_wb.nlatched].ino = ino;
    g_wb.latched[g_wb.nlatched].err = err;
    g_wb.nlatched++;
}

int behind_take_error(uint64_t ino)
{
    for (unsigned i = 0; i < g_wb.nlatched; i++) {
        if (g_wb.latched[i].ino == ino) {
            int err = g_wb.latched[i].err;
            g_wb.latched[i] = g_wb.latched[--g_wb.nlatched];
            return err;
        }
    }
    int err = g_wb.latch_overflow;
    g_wb.latch_overflow = 0;
    return err;
}

static void keep_front(void)
{
    if (!g_bridge.attached)
        return;
    if (g_wb.count == 0)
        ring_unkeep(&g_bridge.req);
    else
        ring_keep(&g_bridge.req, fifo_at(0)->pos);
}

uint64_t behind_oldest(void) { return g_wb.count > 0 ? fifo_at(0)->seq : 0; }

unsigned behind_before(uint64_t seq)
{
    unsigned n = 0;
    while (n < g_wb.count && fifo_at(n)->seq < seq)
        n++;
    return n;
}

int link_take_behind(uint64_t seq, int status, const msgpack_object *result)
{
    if (g_wb.count == 0 || fifo_at(0)->seq != seq)
        return 0;
    struct behind *b = fifo_at(0);
    int64_t written = -1;
    if (status == 0 && (!result_count(result, "written", &written) || written != (int64_t)b->size))
        status = EIO;
    if (status != 0) {
        fprintf(stderr, "slates-bridge: a write answered early failed (errno %d) on inode %llu\n",
                status, (unsigned long long)b->ino);
        latch(b->ino, status);
        behind_end_grant();
    }
    free(b->saved);
    b->saved = NULL;
    g_wb.first = (g_wb.first + 1) % BEHIND_MAX;
    g_wb.count--;
    keep_front();
    bridge_count(BRIDGE_STAT_BEHIND_REPLIES);
    return 1;
}

int behind_try(uint64_t ino, uint64_t off, const char *buf, size_t size, int64_t kill_gid)
{
    uint64_t cost = size + g_wb.scatter; /* slates.node.grants.cost */
    if (g_wb.left == 0 || g_wb.ino != ino || (g_wb.end != off && g_wb.scatter == 0) ||
        cost > g_wb.left || size > g_bridge.io_chunk || size == 0 || !g_bridge.attached ||
        off > BEHIND_FILE_MAX - size)
        return 0;
    if (g_wb.count == BEHIND_MAX && link_wait_oldest() != 0)
        return 0;
    if (g_wb.left == 0) /* the oldest write's reply failed: no more early answers */
        return 0;
    enc_write_granted(ino, off, buf, size, kill_gid);
    uint32_t len = (uint32_t)(g_bridge.sbuf.size + g_bridge.tail_len);
    if (link_push_current() != 0) {
        behind_end_grant();
        return 0; /* the caller sends it the usual way, which reconnects */
    }
    struct behind *b = fifo_at(g_wb.count);
    b->seq = g_bridge.cur_seq;
    b->ino = ino;
    b->pos = ring_produced(&g_bridge.req) - ring_frame_size(len);
    b->len = len;
    b->size = (uint32_t)size;
    b->saved = NULL;
    g_wb.count++;
    keep_front();
    g_wb.end = off + size;
    g_wb.left -= cost;
    bridge_count(BRIDGE_STAT_BEHIND_WRITES);
    return 1;
}

/* The link is detaching: copy the unanswered writes out of the ring first. */
void behind_save(void)
{
    for (unsigned i = 0; i < g_wb.count; i++) {
        struct behind *b = fifo_at(i);
        if (b->saved != NULL || b->len == 0)
            continue; /* still the copy of an earlier detach, or lost */
        const uint8_t *at = ring_frame_payload(&g_bridge.req, b->pos, b->len);
        uint8_t *copy = at != NULL ? malloc(b->len) : NULL;
        if (copy == NULL) {
            /* Cannot happen short of memory: the write is lost, so say so. */
            fprintf(stderr, "slates-bridge: cannot keep an answered write to inode %llu\n",
                    (unsigned long long)b->ino);
            latch(b->ino, EIO);
            b->len = 0;
            continue;
        }
        memcpy(copy, at, b->len);
        b->saved = copy;
    }
    g_wb.left = 0;
}

/* After a fresh hello: send the unanswered writes again, oldest first.
 * 0, or -EPIPE when the new link failed too (what is not sent stays saved). */
int behind_resend(void)
{
    /* Those with no copy (lost: latched in behind_save) will get no reply:
     * drop them first, so the front kept below is always a frame of this ring. */
    unsigned kept = 0;
    for (unsigned i = 0; i < g_wb.count; i++) {
        struct behind *b = fifo_at(i);
        if (b->saved != NULL)
            *fifo_at(kept++) = *b;
    }
    g_wb.count = kept;
    for (unsigned i = 0; i < g_wb.count; i++) {
        struct behind *b = fifo_at(i);
        if (link_push_bytes(b->saved, b->len) != 0)
            return -EPIPE;
        b->pos = ring_produced(&g_bridge.req) - ring_frame_size(b->len);
        free(b->saved);
        b->saved = NULL;
        keep_front();
    }
    return 0;
}
