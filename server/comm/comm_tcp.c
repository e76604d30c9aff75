/* The TCP backend of the collectives: a full mesh of connected stream sockets, one per peer.
 *
 * Every collective is one *exchange*: each rank sends one frame to every peer and receives one
 * frame from every peer, on non-blocking sockets driven by poll(). A rank never blocks in send()
 * while its peer blocks in send() too, whatever the message sizes, because the same loop that
 * writes also drains every readable socket. Payloads stream straight from the caller's send
 * buffer into the caller's receive buffer: no copy and no allocation per call, except
 * all_reduce, which gathers every rank's buffer into one scratch buffer that is kept and reused
 * (grown to the largest call seen).
 *
 * The frames move in the pairwise schedule: in step s (1..size-1) rank r sends to r+s and
 * receives from r-s (mod size). Small frames (PACE_BYTES over all peers) go all at once; so do
 * large ones, unless packets to the peers are being lost (pace_now): then they are paced, a
 * window of steps at a time (exchange() says how), so that a rank's peers take turns on its
 * inbound link instead of overflowing a short queue together (issue 34: at 4 ranks on 20 Mbit/s
 * links with tbf's 189 KB queue, the peers' frames converging on each rank made the shaper drop
 * packets).
 *
 * A frame is a 24-byte header (magic, op kind, call sequence number, payload bytes; little
 * endian) followed by the payload. The receiver reads exactly the header, checks it against
 * the call it is making, then reads exactly the payload into place, so it never reads into the
 * next call's frame. A header that disagrees (another op, size or call number) fails the call
 * with EMBPS_INTERNAL naming both sides, instead of pairing mismatched data silently.
 *
 * all_reduce is an all-gather of the buffers followed by the same reduction on every rank in
 * rank order 0..size-1 (f32 accumulated in f32, f64 in f64), so every rank gets bitwise the same
 * result and so does the NCCL backend's reference. It moves (size-1)·bytes each way, against the
 * 2·(size-1)/size·bytes of a ring; shard groups are small and determinism is the point.
 *
 * The dispatcher (comm.c) has checked every call's arguments before it gets here and counts
 * the calls and their payload; this file only moves the bytes.
 *
 * Any failure (peer closed or reset, timeout, mismatch, poll error) breaks the communicator:
 * later calls fail at once with the same status. A dead or silent peer does not make this rank
 * shut its own connections: in a full mesh every rank exchanges with every peer on every call,
 * so each rank sees that peer directly and names it, instead of blaming the first rank to give
 * up. A mismatch does shut them all down (peers then see this rank close), because a rank that
 * did not get the odd frame itself would otherwise wait for payload that never comes. The
 * sockets are closed when the communicator is freed. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
/* The kernel's tcp_info (tcpi_segs_out is newer than glibc's copy), with TCP_NODELAY and
 * TCP_INFO. */
#include <linux/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/comm/comm.h"

#define FRAME_MAGIC 0x43535045u /* "EPSC" */
#define HEADER_BYTES 24

/* Socket buffer size asked for on every connection (the kernel caps it at net.core.*mem_max). */
#define SOCKET_BUFFER_BYTES (4 << 20)

/* Payload bytes of a paced exchange that may be on their way to the peers at once
 * (embps__comm_tcp_window): while (size-1) frames fit in it they all go at once; else
 * PACE_BYTES / frame steps at a time, at least one. Chosen by measurement (docs/capacity.md,
 * "Slow links"): one step at a time on 20 Mbit/s links kept every peer's frame from being
 * dropped on its way in; 128 and 256 KB left the 64 KB frames of that test two or three at a
 * time and gained nothing; pacing every frame whatever its size cost 30-40% more CPU per lookup
 * at 8 and 16 ranks on loopback and halved the rounds per second. */
/* How often AUTO pacing looks at the peers' retransmissions, and how long it paces after
 * seeing new ones (pace_now). */
#define PACE_LOOK_MS 100
#define PACE_HOLD_MS 2000

#ifndef PACE_BYTES
#define PACE_BYTES (64u << 10)
#endif

/* Op kinds on the wire; all_reduce adds its element type and reduction in the upper bits so a
 * rank reducing f32 with one reducing u64 is caught as a mismatch. */
enum { KIND_ALL_GATHER = 1, KIND_ALL_TO_ALL = 2, KIND_ALL_REDUCE = 3, KIND_BARRIER = 4 };

static uint32_t reduce_kind(embps_comm_type_t type, embps_comm_op_t op) {
  return KIND_ALL_REDUCE | ((uint32_t)type << 8) | ((uint32_t)op << 16);
}

/* One peer's side of the current exchange. */
typedef struct peer_xfer {
  uint8_t header_out[HEADER_BYTES];
  uint8_t header_in[HEADER_BYTES];
  const uint8_t *send; /* payload to send */
  uint8_t *recv;       /* where the peer's payload goes */
  size_t sent;         /* bytes of header + payload sent */
  size_t received;     /* bytes of header + payload received */
  short may;           /* POLLIN / POLLOUT: worth trying (the first pass, or poll said so) */
} peer_xfer_t;

typedef struct tcp_comm {
  embps_comm_t base;
  int *fds; /* fds[r] for r != rank; fds[rank] == -1. Owned. */
  uint64_t timeout_ms;
  uint64_t seq;        /* number of the call in progress (first call is 1) */
  peer_xfer_t *xfers;  /* one per rank, preallocated */
  struct pollfd *pfds; /* size - 1 entries, preallocated */
  uint32_t *pfd_rank;  /* the rank of each pollfd entry */
  uint8_t *scratch;    /* all_reduce gather buffer, grown to the largest call */
  size_t scratch_cap;
  /* Pacing (pace_now): the mode, and for EMBPS__COMM_TCP_PACE_AUTO the peers' retransmissions
   * at the last look, when to look again, and until when to pace. */
  embps__comm_tcp_pace_t pacing;
  bool retrans_known;
  uint64_t retrans_seen; /* the peer sockets' tcpi_total_retrans and tcpi_segs_out, summed */
  uint64_t segs_seen;
  uint64_t next_look_ms;
  uint64_t paced_until_ms;
} tcp_comm_t;

static const char *kind_name(uint32_t kind) {
  switch (kind & 0xffu) {
  case KIND_ALL_GATHER:
    return "all_gather";
  case KIND_ALL_TO_ALL:
    return "all_to_all";
  case KIND_ALL_REDUCE:
    break;
  case KIND_BARRIER:
    return "barrier";
  default:
    return "unknown op";
  }
  switch (kind) {
  case KIND_ALL_REDUCE | (EMBPS_COMM_F32 << 8) | (EMBPS_COMM_SUM << 16):
    return "all_reduce(f32 sum)";
  case KIND_ALL_REDUCE | (EMBPS_COMM_F32 << 8) | (EMBPS_COMM_MAX << 16):
    return "all_reduce(f32 max)";
  case KIND_ALL_REDUCE | (EMBPS_COMM_F64 << 8) | (EMBPS_COMM_SUM << 16):
    return "all_reduce(f64 sum)";
  case KIND_ALL_REDUCE | (EMBPS_COMM_F64 << 8) | (EMBPS_COMM_MAX << 16):
    return "all_reduce(f64 max)";
  case KIND_ALL_REDUCE | (EMBPS_COMM_U64 << 8) | (EMBPS_COMM_SUM << 16):
    return "all_reduce(u64 sum)";
  case KIND_ALL_REDUCE | (EMBPS_COMM_U64 << 8) | (EMBPS_COMM_MAX << 16):
    return "all_reduce(u64 max)";
  default:
    return "all_reduce(unknown type)";
  }
}

/* Marks the communicator broken (see embps__comm_break). */
#define break_comm(t, err, status, ...)                                                            \
  embps__comm_break(&(t)->base, err, status, __FILE__, __LINE__, __VA_ARGS__)

/* Sends what remains of peer r's frame up to limit (HEADER_BYTES: the header alone; HEADER_BYTES
 * + bytes: all of it); 1 when done, 0 when the socket is full, -1 on error (errno set; EPIPE or
 * ECONNRESET when the peer went away). */
static int pump_send(tcp_comm_t *t, uint32_t r, size_t bytes, size_t limit) {
  peer_xfer_t *x = &t->xfers[r];
  size_t total = limit;
  while (x->sent < total) {
    struct iovec iov[2];
    int n = 0;
    if (x->sent < HEADER_BYTES) {
      iov[n].iov_base = x->header_out + x->sent;
      iov[n].iov_len = HEADER_BYTES - x->sent;
      n++;
      if (total > HEADER_BYTES) {
        iov[n].iov_base = (void *)x->send;
        iov[n].iov_len = total - HEADER_BYTES;
        n++;
      }
    } else {
      iov[n].iov_base = (void *)(x->send + (x->sent - HEADER_BYTES));
      iov[n].iov_len = total - x->sent;
      n++;
    }
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)n;
    ssize_t k = sendmsg(t->fds[r], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 0;
      return -1;
    }
    x->sent += (size_t)k;
  }
  return 1;
}

/* What pump_recv found. */
enum { RECV_MORE = 0, RECV_DONE = 1, RECV_ERROR = -1, RECV_EOF = -2, RECV_MISMATCH = -3 };

/* Receives what remains of peer r's frame (only its header when header_only); checks the
 * header as soon as it is complete. */
static int pump_recv(tcp_comm_t *t, uint32_t r, uint32_t kind, size_t bytes, bool header_only) {
  peer_xfer_t *x = &t->xfers[r];
  size_t total = HEADER_BYTES + bytes;
  size_t stop = header_only ? HEADER_BYTES : total;
  while (x->received < stop) {
    /* The header and the payload in one call where both are due: the frame's length is known,
     * so the read never runs into the next call's frame, and a peer's frame costs one syscall
     * instead of two (issue 34: receives were half the syscalls of a round). */
    struct iovec iov[2];
    int niov = 0;
    if (x->received < HEADER_BYTES) {
      iov[niov].iov_base = x->header_in + x->received;
      iov[niov].iov_len = HEADER_BYTES - x->received;
      niov++;
      if (stop > HEADER_BYTES) {
        iov[niov].iov_base = x->recv;
        iov[niov].iov_len = bytes;
        niov++;
      }
    } else {
      iov[niov].iov_base = x->recv + (x->received - HEADER_BYTES);
      iov[niov].iov_len = total - x->received;
      niov++;
    }
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)niov;
    ssize_t k = recvmsg(t->fds[r], &msg, MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return RECV_MORE;
      return RECV_ERROR;
    }
    if (k == 0)
      return RECV_EOF;
    bool header_before = x->received < HEADER_BYTES;
    x->received += (size_t)k;
    if (header_before && x->received >= HEADER_BYTES) {
      if (embps_get_le32(x->header_in) != FRAME_MAGIC || embps_get_le32(x->header_in + 4) != kind ||
          embps_get_le64(x->header_in + 8) != t->seq ||
          embps_get_le64(x->header_in + 16) != (uint64_t)bytes)
        return RECV_MISMATCH;
    }
  }
  return RECV_DONE;
}

/* Shuts every connection down (they stay open until the communicator is freed). Used after a
 * mismatch: a peer that did not receive the odd frame itself would otherwise wait for this
 * rank's payload until its timeout, or forever without one. Peer failures and timeouts do not
 * cascade: every rank sees a dead or silent peer directly, and names it. */
static void shutdown_all(tcp_comm_t *t) {
  for (uint32_t r = 0; r < t->base.size; r++)
    if (r != t->base.rank)
      (void)shutdown(t->fds[r], SHUT_RDWR);
}

static embps_status_t mismatch(tcp_comm_t *t, uint32_t r, uint32_t kind, size_t bytes,
                               embps_error_t *err) {
  const uint8_t *h = t->xfers[r].header_in;
  shutdown_all(t);
  if (embps_get_le32(h) != FRAME_MAGIC)
    return break_comm(
        t, err, EMBPS_INTERNAL,
        "rank %u sent a frame with bad magic 0x%08x during %s (call %llu): the stream "
        "is out of step or not an embps peer",
        r, embps_get_le32(h), kind_name(kind), (unsigned long long)t->seq);
  uint32_t pkind = embps_get_le32(h + 4);
  uint64_t pseq = embps_get_le64(h + 8);
  uint64_t pbytes = embps_get_le64(h + 16);
  if (pseq != t->seq)
    return break_comm(
        t, err, EMBPS_INTERNAL,
        "rank %u sent call %llu (%s of %llu bytes) where this rank expected call %llu "
        "(%s of %zu bytes): ranks are out of step",
        r, (unsigned long long)pseq, kind_name(pkind), (unsigned long long)pbytes,
        (unsigned long long)t->seq, kind_name(kind), bytes);
  return break_comm(
      t, err, EMBPS_INTERNAL,
      "rank %u sent %s of %llu bytes where this rank expected %s of %zu bytes (call %llu)", r,
      kind_name(pkind), (unsigned long long)pbytes, kind_name(kind), bytes,
      (unsigned long long)t->seq);
}

static embps_status_t peer_gone(tcp_comm_t *t, uint32_t r, uint32_t kind, int error,
                                embps_error_t *err) {
  if (error == 0)
    return break_comm(t, err, EMBPS_UNAVAILABLE, "rank %u closed its connection during %s", r,
                      kind_name(kind));
  return break_comm(t, err, EMBPS_UNAVAILABLE, "rank %u closed its connection during %s (%s)", r,
                    kind_name(kind), strerror(error));
}

uint32_t embps__comm_tcp_send_peer(uint32_t rank, uint32_t size, uint32_t step) {
  return (uint32_t)(((uint64_t)rank + step) % size);
}

uint32_t embps__comm_tcp_recv_peer(uint32_t rank, uint32_t size, uint32_t step) {
  return (uint32_t)(((uint64_t)rank + size - step % size) % size);
}

uint32_t embps__comm_tcp_window(uint32_t size, size_t bytes) {
  if (size < 2)
    return 0;
  size_t w = bytes ? PACE_BYTES / bytes : size - 1;
  if (w < 1)
    w = 1;
  return w > size - 1 ? size - 1 : (uint32_t)w;
}

static const embps_comm_ops_t tcp_ops;

/* Whether this exchange's large frames are paced. AUTO paces them while packets to the peers are
 * being lost: when the peers' sockets have retransmitted at least 1% of the segments they sent
 * since the last look (TCP_INFO's tcpi_total_retrans and tcpi_segs_out, looked at most every
 * PACE_LOOK_MS, and only by exchanges that pacing would change), for the next PACE_HOLD_MS. Pacing
 * costs a one-way delay, queueing included, per step (design.md), so it is used only where the
 * frames converging on a link overflow its queue, which is what the retransmissions say; on links
 * with room it would only slow the exchange (at 200 Mbit/s with tbf's 1.25 MB queues, pacing every
 * large frame made 4-rank lookups 1.18 and pushes 1.27 times the bound, against 1.03 and 1.05
 * unpaced, and no packet was dropped either way). A socket without TCP_INFO (a TLS relay's
 * socketpair) adds nothing, so peers reached through the TLS relay are never paced by AUTO. */
static bool pace_now(tcp_comm_t *t) {
  if (t->pacing != EMBPS__COMM_TCP_PACE_AUTO)
    return t->pacing == EMBPS__COMM_TCP_PACE_ALWAYS;
  uint64_t now = embps_now_ms();
  if (now >= t->next_look_ms) {
    t->next_look_ms = now + PACE_LOOK_MS;
    uint64_t retrans = 0, segs = 0;
    for (uint32_t r = 0; r < t->base.size; r++) {
      struct tcp_info ti;
      socklen_t len = sizeof ti;
      if (r != t->base.rank && getsockopt(t->fds[r], IPPROTO_TCP, TCP_INFO, &ti, &len) == 0 &&
          len >= offsetof(struct tcp_info, tcpi_segs_out) + sizeof ti.tcpi_segs_out) {
        retrans += ti.tcpi_total_retrans;
        segs += ti.tcpi_segs_out;
      }
    }
    /* Lost: at least 1% of the segments sent since the last look were sent again, and more
     * than one (tail loss probes retransmit a segment now and then on links that lose
     * nothing: at 200 Mbit/s about 1 in 30,000; at 20 Mbit/s with drops, 4-7%). */
    uint64_t dr = retrans - t->retrans_seen, ds = segs - t->segs_seen;
    if (t->retrans_known && retrans >= t->retrans_seen && segs >= t->segs_seen && dr >= 2 &&
        dr * 100 >= ds)
      t->paced_until_ms = now + PACE_HOLD_MS;
    t->retrans_seen = retrans;
    t->segs_seen = segs;
    t->retrans_known = true;
  }
  return now < t->paced_until_ms;
}

void embps__comm_tcp_set_pacing(embps_comm_t *c, embps__comm_tcp_pace_t mode) {
  if (c && c->ops == &tcp_ops)
    ((tcp_comm_t *)c)->pacing = mode;
}

/* How much of peer r's frame may be sent now: all of it when its step is inside the window
 * (steps below lo are received, lo .. lo+window-1 may move), else the header alone. */
static size_t send_limit(const tcp_comm_t *t, uint32_t r, uint32_t lo, uint32_t window,
                         size_t bytes) {
  uint32_t step = (r + t->base.size - t->base.rank) % t->base.size;
  return step < lo + window ? HEADER_BYTES + bytes : HEADER_BYTES;
}

/* One exchange: to every peer r, a frame of `bytes` from send_base + r*send_stride; from every
 * peer r, a frame of `bytes` into recv_base + r*recv_stride.
 *
 * The payloads move in the pairwise schedule (embps__comm_tcp_send_peer): in step s this rank
 * sends to rank+s and receives from rank-s, and a step's payload is sent only while fewer than
 * `window` steps are open, counting from the lowest step whose frame has not fully arrived. Every
 * rank's peers then take turns on its inbound link instead of all sending into it at once (a
 * shaped or switched link's queue overflows and drops under such incast; issue 34). The headers
 * of all frames go out at once, so every peer learns this call's kind and size before any
 * payload, and every socket is read whenever data is there, whatever its step: a sender's
 * progress never waits on a receiver's window, so the schedule cannot deadlock (the frame of
 * step s depends only on receives of steps below s). Frames small enough that all of them fit
 * in the window's bytes (embps__comm_tcp_window) move at once, as before. */
static embps_status_t exchange(tcp_comm_t *t, uint32_t kind, const uint8_t *send_base,
                               size_t send_stride, uint8_t *recv_base, size_t recv_stride,
                               size_t bytes, embps_error_t *err) {
  uint32_t me = t->base.rank, size = t->base.size;
  for (uint32_t r = 0; r < size; r++) {
    if (r == me)
      continue;
    peer_xfer_t *x = &t->xfers[r];
    embps_put_le32(x->header_out, FRAME_MAGIC);
    embps_put_le32(x->header_out + 4, kind);
    embps_put_le64(x->header_out + 8, t->seq);
    embps_put_le64(x->header_out + 16, (uint64_t)bytes);
    x->send = send_base ? send_base + (size_t)r * send_stride : NULL;
    x->recv = recv_base ? recv_base + (size_t)r * recv_stride : NULL;
    x->sent = 0;
    x->received = 0;
    x->may = POLLIN | POLLOUT;
  }
  size_t total = HEADER_BYTES + bytes;
  uint32_t window = size - 1;
  if (embps__comm_tcp_window(size, bytes) < size - 1 && pace_now(t))
    window = embps__comm_tcp_window(size, bytes);
  uint32_t lo = 1; /* the lowest step whose frame has not fully arrived */
  bool paced = window < size - 1;
  uint64_t deadline = t->timeout_ms ? embps_now_ms() + t->timeout_ms : 0;
  for (;;) {
    /* Move what the sockets take without waiting, then wait for the ones that are stuck. All
     * sends go first, paced ones in step order, so every peer has this call's header (socket space
     * permitting) before this rank can fail on what it reads. */
    for (uint32_t s = 1; s < size; s++) {
      /* Unpaced, in rank order, so that an exchange nothing paces (loopback, fast links) is the
       * loop it was before the schedule; its CPU per lookup was measured against that one. */
      uint32_t r = paced ? embps__comm_tcp_send_peer(me, size, s) : s - (s <= me);
      peer_xfer_t *x = &t->xfers[r];
      size_t limit = !paced || s < lo + window ? total : HEADER_BYTES;
      if (x->sent >= limit || !(x->may & POLLOUT))
        continue;
      int rc = pump_send(t, r, bytes, limit);
      if (rc < 0) {
        int e = errno;
        if (e == EPIPE || e == ECONNRESET || e == ENOTCONN || e == ETIMEDOUT)
          return peer_gone(t, r, kind, e, err);
        return break_comm(t, err, EMBPS_UNAVAILABLE, "sending to rank %u during %s: %s", r,
                          kind_name(kind), strerror(e));
      }
      if (rc == 0)
        x->may &= (short)~POLLOUT; /* full: only poll says when it has room again */
    }
    nfds_t n = 0, pending = 0; /* pollfd entries; those still moving bytes */
    uint32_t gone_rank = UINT32_MAX;
    int gone_errno = 0;
    for (uint32_t r = 0; r < size; r++) {
      if (r == me)
        continue;
      peer_xfer_t *x = &t->xfers[r];
      if (x->received < total && gone_rank == UINT32_MAX && (x->may & POLLIN)) {
        int rc = pump_recv(t, r, kind, bytes, false);
        if (rc == RECV_MISMATCH)
          return mismatch(t, r, kind, bytes, err);
        if (rc == RECV_EOF || rc == RECV_ERROR) {
          /* Reported after the other peers' headers are read: a peer that shut down because
           * it saw a mismatch is then blamed less often than the rank that caused it. */
          gone_rank = r;
          gone_errno = rc == RECV_EOF ? 0 : errno;
          continue;
        }
        if (rc == RECV_MORE)
          x->may &= (short)~POLLIN; /* drained: only poll says when more has come */
      }
      short events = (short)((x->sent < send_limit(t, r, lo, window, bytes) ? POLLOUT : 0) |
                             (x->received < total ? POLLIN : 0));
      if (events)
        pending++;
      else if (paced)
        events = POLLRDHUP; /* done with this peer: only its death matters (below) */
      if (events) {
        t->pfds[n].fd = t->fds[r];
        t->pfds[n].events = events;
        t->pfds[n].revents = 0;
        t->pfd_rank[n] = r;
        n++;
      }
    }
    if (gone_rank != UINT32_MAX) {
      /* Read what the remaining peers have already sent, for a mismatch to report instead. */
      for (uint32_t r = 0; r < size; r++) {
        if (r == me || r == gone_rank || t->xfers[r].received >= HEADER_BYTES)
          continue;
        if (pump_recv(t, r, kind, bytes, true) == RECV_MISMATCH)
          return mismatch(t, r, kind, bytes, err);
      }
      int e = gone_errno;
      if (e == 0 || e == ECONNRESET || e == ENOTCONN || e == ETIMEDOUT || e == EPIPE)
        return peer_gone(t, gone_rank, kind, e, err);
      return break_comm(t, err, EMBPS_UNAVAILABLE, "receiving from rank %u during %s: %s",
                        gone_rank, kind_name(kind), strerror(e));
    }
    /* The window moves past the steps whose frames have arrived; the sends it opens are tried
     * at once, before waiting. */
    uint32_t old_lo = lo;
    while (lo < size && t->xfers[embps__comm_tcp_recv_peer(me, size, lo)].received >= total)
      lo++;
    if (lo != old_lo && old_lo + window < size) {
      for (uint32_t s = old_lo + window; s < lo + window && s < size; s++)
        t->xfers[embps__comm_tcp_send_peer(me, size, s)].may |= POLLOUT;
      continue;
    }
    if (pending == 0)
      return EMBPS_OK;
    int wait_ms = -1;
    if (deadline) {
      uint64_t now = embps_now_ms();
      if (now >= deadline) {
        /* Name the lowest rank still owing us data, else the lowest not taking ours. */
        uint32_t who = UINT32_MAX;
        for (nfds_t i = 0; i < n && who == UINT32_MAX; i++)
          if (t->pfds[i].events & POLLIN)
            who = t->pfd_rank[i];
        for (nfds_t i = 0; i < n && who == UINT32_MAX; i++)
          if (t->pfds[i].events & POLLOUT)
            who = t->pfd_rank[i];
        return break_comm(t, err, EMBPS_UNAVAILABLE,
                          "%s timed out after %llu ms waiting for rank %u", kind_name(kind),
                          (unsigned long long)t->timeout_ms, who);
      }
      uint64_t left = deadline - now;
      wait_ms = left > 60000 ? 60000 : (int)left;
    }
    int pr = poll(t->pfds, n, wait_ms);
    if (pr < 0 && errno != EINTR)
      return break_comm(t, err, EMBPS_UNAVAILABLE, "poll during %s: %s", kind_name(kind),
                        strerror(errno));
    /* Only the sockets poll named are tried again: at 16 ranks and more, trying every pending
     * peer after each wake-up cost an EAGAIN per peer per wake-up. An error or hang-up counts
     * as both, so that the next read or write reports it. */
    for (nfds_t i = 0; i < n; i++) {
      short ev = pr > 0 ? t->pfds[i].revents : 0;
      if (t->pfds[i].events == POLLRDHUP) {
        /* A peer this rank is done with went away. In a paced exchange the frame still owed
         * by another peer may wait on the one that died (that peer's own step from it), and
         * that peer, failing, sends nothing more: wait no longer. */
        if (ev & (POLLRDHUP | POLLERR | POLLHUP | POLLNVAL)) {
          int e = 0;
          socklen_t len = sizeof e;
          (void)getsockopt(t->pfds[i].fd, SOL_SOCKET, SO_ERROR, &e, &len);
          return peer_gone(t, t->pfd_rank[i], kind, e, err);
        }
        continue;
      }
      if (ev & (POLLERR | POLLHUP | POLLNVAL))
        ev |= POLLIN | POLLOUT;
      peer_xfer_t *x = &t->xfers[t->pfd_rank[i]];
      x->may = (short)((x->may & ~(POLLIN | POLLOUT)) | (ev & (POLLIN | POLLOUT)));
    }
  }
}

static embps_status_t tcp_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  tcp_comm_t *t = (tcp_comm_t *)c;
  uint8_t *own = bytes ? (uint8_t *)recv + (size_t)c->rank * bytes : NULL;
  t->seq++;
  if (bytes && send != own)
    memcpy(own, send, bytes);
  if (c->size == 1)
    return EMBPS_OK;
  return exchange(t, KIND_ALL_GATHER, send, 0, recv, bytes, bytes, err);
}

static embps_status_t tcp_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  tcp_comm_t *t = (tcp_comm_t *)c;
  uint32_t me = c->rank;
  t->seq++;
  if (bytes)
    memcpy((uint8_t *)recv + (size_t)me * bytes, (const uint8_t *)send + (size_t)me * bytes, bytes);
  if (c->size == 1)
    return EMBPS_OK;
  return exchange(t, KIND_ALL_TO_ALL, send, bytes, recv, bytes, bytes, err);
}

/* Elements per block of the reduction: big enough to vectorize, small enough that the
 * accumulator block stays in L1 while every rank's block is added to it. */
#define REDUCE_BLOCK 1024

#define DEFINE_REDUCE(name, T, COMBINE)                                                            \
  static void name(T *out, const uint8_t *blocks, size_t count, uint32_t size) {                   \
    for (size_t i0 = 0; i0 < count; i0 += REDUCE_BLOCK) {                                          \
      size_t n = count - i0 < REDUCE_BLOCK ? count - i0 : REDUCE_BLOCK;                            \
      const T *b0 = (const T *)blocks + i0;                                                        \
      for (size_t i = 0; i < n; i++)                                                               \
        out[i0 + i] = b0[i];                                                                       \
      for (uint32_t r = 1; r < size; r++) {                                                        \
        const T *br = (const T *)(blocks + (size_t)r * count * sizeof(T)) + i0;                    \
        for (size_t i = 0; i < n; i++) {                                                           \
          T a = out[i0 + i], b = br[i];                                                            \
          out[i0 + i] = COMBINE;                                                                   \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
  }
DEFINE_REDUCE(reduce_f32_sum, float, a + b)
DEFINE_REDUCE(reduce_f32_max, float, b > a ? b : a)
DEFINE_REDUCE(reduce_f64_sum, double, a + b)
DEFINE_REDUCE(reduce_f64_max, double, b > a ? b : a)
DEFINE_REDUCE(reduce_u64_sum, uint64_t, a + b)
DEFINE_REDUCE(reduce_u64_max, uint64_t, b > a ? b : a)

static embps_status_t tcp_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                     embps_comm_type_t type, embps_comm_op_t op,
                                     embps_error_t *err) {
  tcp_comm_t *t = (tcp_comm_t *)c;
  uint32_t me = c->rank, size = c->size;
  size_t bytes = count * embps_comm_type_size(type);
  if (size > 1 && bytes * size > t->scratch_cap) {
    /* Grown, never shrunk: the engine's all-reduces are the same few sizes every round. */
    uint8_t *grown = embps_aligned_alloc(bytes * size);
    if (!grown)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                             "all_reduce: cannot allocate %zu bytes of scratch", bytes * size);
    embps_free(t->scratch);
    t->scratch = grown;
    t->scratch_cap = bytes * size;
  }
  t->seq++;
  if (size == 1 || count == 0) {
    if (size == 1)
      return EMBPS_OK;
    return exchange(t, reduce_kind(type, op), NULL, 0, NULL, 0, 0, err);
  }
  embps_status_t ret = exchange(t, reduce_kind(type, op), buf, 0, t->scratch, bytes, bytes, err);
  if (ret != EMBPS_OK)
    return ret;
  memcpy(t->scratch + (size_t)me * bytes, buf, bytes);
  switch (type * 16 + op) {
  case EMBPS_COMM_F32 * 16 + EMBPS_COMM_SUM:
    reduce_f32_sum(buf, t->scratch, count, size);
    break;
  case EMBPS_COMM_F32 * 16 + EMBPS_COMM_MAX:
    reduce_f32_max(buf, t->scratch, count, size);
    break;
  case EMBPS_COMM_F64 * 16 + EMBPS_COMM_SUM:
    reduce_f64_sum(buf, t->scratch, count, size);
    break;
  case EMBPS_COMM_F64 * 16 + EMBPS_COMM_MAX:
    reduce_f64_max(buf, t->scratch, count, size);
    break;
  case EMBPS_COMM_U64 * 16 + EMBPS_COMM_SUM:
    reduce_u64_sum(buf, t->scratch, count, size);
    break;
  default:
    reduce_u64_max(buf, t->scratch, count, size);
    break;
  }
  return EMBPS_OK;
}

static embps_status_t tcp_barrier(embps_comm_t *c, embps_error_t *err) {
  tcp_comm_t *t = (tcp_comm_t *)c;
  t->seq++;
  if (c->size == 1)
    return EMBPS_OK;
  /* A header-only exchange: no rank leaves before every rank has entered. */
  return exchange(t, KIND_BARRIER, NULL, 0, NULL, 0, 0, err);
}

static void tcp_destroy(embps_comm_t *c) {
  tcp_comm_t *t = (tcp_comm_t *)c;
  for (uint32_t r = 0; r < c->size; r++)
    if (r != c->rank && t->fds[r] >= 0)
      close(t->fds[r]);
  embps_free(t->fds);
  embps_free(t->xfers);
  embps_free(t->pfds);
  embps_free(t->pfd_rank);
  embps_free(t->scratch);
  embps_free(t);
}

static const embps_comm_ops_t tcp_ops = {
    .name = "tcp",
    .all_gather = tcp_all_gather,
    .all_to_all = tcp_all_to_all,
    .all_reduce = tcp_all_reduce,
    .barrier = tcp_barrier,
    .destroy = tcp_destroy,
};

/* Non-blocking, no Nagle delay (a collective's last segment must not wait for an ACK), big
 * buffers where the kernel allows. The options are best effort: a socket that refuses them
 * (an AF_UNIX pair in a test) still works. */
static int prepare_socket(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return -1;
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int want = SOCKET_BUFFER_BYTES, have = 0;
  socklen_t len = sizeof have;
  if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &have, &len) == 0 && have < want)
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
  len = sizeof have;
  if (getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &have, &len) == 0 && have < want)
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
  return 0;
}

static void close_fds(uint32_t rank, uint32_t size, const int *fds) {
  if (!fds)
    return;
  for (uint32_t r = 0; r < size; r++)
    if (r != rank && fds[r] >= 0)
      close(fds[r]);
}

embps_status_t embps_comm_tcp_new(embps_comm_t **out, uint32_t rank, uint32_t size, const int *fds,
                                  uint64_t timeout_ms) {
  embps_status_t ret = EMBPS_OK;
  tcp_comm_t *t = NULL;
  EMBPS_CHECK_GOTO(out && size > 0 && rank < size && (size == 1 || fds), EMBPS_INVALID_ARGUMENT,
                   fail, "embps_comm_tcp_new: bad arguments (rank %u, size %u)", rank, size);
  for (uint32_t r = 0; r < size; r++)
    EMBPS_CHECK_GOTO(r == rank || fds[r] >= 0, EMBPS_INVALID_ARGUMENT, fail,
                     "embps_comm_tcp_new: no socket for rank %u", r);
  t = embps_calloc(1, sizeof *t);
  EMBPS_CHECK_GOTO(t, EMBPS_RESOURCE_EXHAUSTED, fail, "embps_comm_tcp_new: out of memory");
  t->fds = embps_malloc(size * sizeof *t->fds);
  t->xfers = embps_calloc(size, sizeof *t->xfers);
  t->pfds = embps_calloc(size, sizeof *t->pfds);
  t->pfd_rank = embps_calloc(size, sizeof *t->pfd_rank);
  EMBPS_CHECK_GOTO(t->fds && t->xfers && t->pfds && t->pfd_rank, EMBPS_RESOURCE_EXHAUSTED,
                   fail_alloc, "embps_comm_tcp_new: out of memory");
  for (uint32_t r = 0; r < size; r++) {
    t->fds[r] = r == rank ? -1 : fds[r];
    if (r != rank)
      EMBPS_CHECK_GOTO(prepare_socket(fds[r]) == 0, EMBPS_INVALID_ARGUMENT, fail_alloc,
                       "embps_comm_tcp_new: socket for rank %u: %s", r, strerror(errno));
  }
  t->base.ops = &tcp_ops;
  t->base.rank = rank;
  t->base.size = size;
  t->timeout_ms = timeout_ms;
  *out = &t->base;
  return EMBPS_OK;

fail_alloc:
  embps_free(t->fds);
  embps_free(t->xfers);
  embps_free(t->pfds);
  embps_free(t->pfd_rank);
  embps_free(t);
fail:
  if (size > 0 && rank < size)
    close_fds(rank, size, fds);
  return ret;
}
