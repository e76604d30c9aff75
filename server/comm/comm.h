/* Collectives between the ranks of a shard group: all-gather, all-to-all, all-reduce and
 * barrier, behind one small interface with one backend per transport (TCP for CPU servers,
 * NCCL for GPU servers). Every call is collective: all ranks make the same calls in the same
 * order with the same sizes. Calls block the calling thread (the engine thread, which owns the
 * communicator) and return EMBPS_UNAVAILABLE with a message naming the peer when a peer goes
 * away or the per-call timeout passes, so ranks fail their pending work instead of hanging. */
#ifndef EMBPS_COMM_H
#define EMBPS_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct embps_hist embps_hist_t; /* common/hist.h */

typedef struct embps_comm embps_comm_t;

typedef enum embps_comm_type {
  EMBPS_COMM_F32 = 1,
  EMBPS_COMM_F64 = 2,
  EMBPS_COMM_U64 = 3,
} embps_comm_type_t;

typedef enum embps_comm_op {
  EMBPS_COMM_SUM = 1,
  EMBPS_COMM_MAX = 2,
} embps_comm_op_t;

/**
 * What a rank moved through collectives since creation, counted by the dispatcher (comm.c), not
 * by the backends, so every backend counts alike. calls: the collectives that passed the argument
 * checks and reached the backend, failed ones included. bytes_sent and bytes_received: the
 * payload that crosses to and from the other ranks in calls that succeeded, (size-1)*bytes each
 * way for all_gather, all_to_all and all_reduce (not the rank's own block), none for barrier.
 */
typedef struct embps_comm_stats {
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t calls;
  uint64_t ns; /* time spent in the calls (for nccl: enqueueing them, unless the backend waits) */
} embps_comm_stats_t;

/**
 * A backend's functions. Buffers are host memory for "tcp", device memory for "nccl".
 *
 * The dispatcher (embps_comm_all_gather and the others below) has already refused what every
 * backend would refuse: a communicator broken by an earlier failure, missing buffers, sizes that
 * overflow, overlapping buffers, an unknown element type or reduction, an all_reduce buffer not
 * aligned to its elements. It also counts the call and its payload in stats. A backend only
 * moves the bytes, and breaks the communicator (embps__comm_break) when it cannot.
 */
typedef struct embps_comm_ops {
  const char *name;
  /** recv[r*bytes .. (r+1)*bytes) = rank r's send[0..bytes). recv holds size*bytes. send may be
   * recv + rank*bytes (in place). */
  embps_status_t (*all_gather)(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                               embps_error_t *err);
  /** recv[r*bytes ..) = rank r's send[me*bytes ..): equal blocks of `bytes` per rank pair. */
  embps_status_t (*all_to_all)(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                               embps_error_t *err);
  /** buf[i] = op over ranks of buf[i], for count elements of embps_comm_type_size(type) bytes;
   * every rank gets bitwise the same result (reductions run in rank order). */
  embps_status_t (*all_reduce)(embps_comm_t *c, void *buf, size_t count, embps_comm_type_t type,
                               embps_comm_op_t op, embps_error_t *err);
  embps_status_t (*barrier)(embps_comm_t *c, embps_error_t *err);
  void (*destroy)(embps_comm_t *c);
} embps_comm_ops_t;

/** The state every backend starts with; backends embed it first in their own struct. */
struct embps_comm {
  const embps_comm_ops_t *ops;
  uint32_t rank;
  uint32_t size;
  embps_comm_stats_t stats;   /* kept by the dispatcher */
  embps_hist_t *call_seconds; /* NULL, or where the dispatcher observes each call's time */
  embps_status_t broken;      /* EMBPS_OK while usable; see embps__comm_break */
  char broken_msg[400];
};

/** Bytes per element of type: 4 for f32, 8 for f64 and u64, 0 for anything else. */
static inline size_t embps_comm_type_size(embps_comm_type_t type) {
  switch (type) {
  case EMBPS_COMM_F32:
    return 4;
  case EMBPS_COMM_F64:
  case EMBPS_COMM_U64:
    return 8;
  default:
    return 0;
  }
}

/**
 * For backends: marks c broken with status and the formatted message, logs it at file:line as
 * "comm <backend> rank R/N: message", and sets err. Every later call then fails at once in the
 * dispatcher, with the same status. Returns status.
 */
embps_status_t embps__comm_break(embps_comm_t *c, embps_error_t *err, embps_status_t status,
                                 const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/**
 * The TCP backend over already connected stream sockets: fds[r] is a connected socket to rank
 * r for every r != rank (fds[rank] is ignored; pass -1). The communicator takes ownership of
 * the sockets (closes them on free). timeout_ms bounds each call (0: no bound).
 * On failure *out is untouched and the sockets are closed. Returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_comm_tcp_new(embps_comm_t **out, uint32_t rank, uint32_t size, const int *fds,
                                  uint64_t timeout_ms);

/* The TCP backend's schedule (comm_tcp.c; declared here for its unit test). An exchange has
 * steps 1..size-1: in step s, rank sends its frame to embps__comm_tcp_send_peer(rank, size, s) =
 * (rank+s) mod size and receives from embps__comm_tcp_recv_peer(rank, size, s) = (rank-s) mod
 * size, so in every step each rank receives from exactly one peer and every ordered pair meets
 * once. embps__comm_tcp_window(size, bytes) is how many steps' payloads may be in flight at once
 * for frames of `bytes`: at least 1, at most size-1 (all at once), 0 for a group of one. */
uint32_t embps__comm_tcp_send_peer(uint32_t rank, uint32_t size, uint32_t step);
uint32_t embps__comm_tcp_recv_peer(uint32_t rank, uint32_t size, uint32_t step);
uint32_t embps__comm_tcp_window(uint32_t size, size_t bytes);

/** When the TCP backend paces large frames (windows of fewer than size-1 steps). */
typedef enum embps__comm_tcp_pace {
  EMBPS__COMM_TCP_PACE_AUTO = 0, /* the default: while the peer sockets have retransmitted lately */
  EMBPS__COMM_TCP_PACE_ALWAYS = 1,
  EMBPS__COMM_TCP_PACE_NEVER = 2,
} embps__comm_tcp_pace_t;

/** Sets c's pacing (for tests and benchmarks; a communicator that is not TCP is left alone). */
void embps__comm_tcp_set_pacing(embps_comm_t *c, embps__comm_tcp_pace_t mode);

#ifdef EMBPS_HAVE_NCCL
/* The NCCL backend (server/comm/comm_nccl.c), built only with CUDA and NCCL (target
 * embps_comm_nccl, which defines EMBPS_HAVE_NCCL for its users). Its buffers are device memory. */

/** Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES), as the group's control plane carries it. */
#define EMBPS_NCCL_UNIQUE_ID_BYTES 128

/**
 * Creates the id that names one NCCL communicator. The leader calls this once and hands the
 * bytes to every rank (over the group's control plane); the leader's process must live until
 * every rank has created its communicator. Returns EMBPS_OK, or EMBPS_UNAVAILABLE when NCCL
 * cannot set up its bootstrap socket (err says why).
 */
embps_status_t embps_comm_nccl_unique_id(uint8_t out[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                         embps_error_t *err);

/**
 * The NCCL backend: this process's rank of `size` ranks, on the calling thread's current CUDA
 * device, every rank passing the same unique_id. Every collective is enqueued on `stream` (a
 * cudaStream_t passed as void *, so this header stays free of CUDA headers; borrowed, it must
 * outlive the communicator), and the call then waits until the stream is idle, so buffers passed
 * to the ops are DEVICE pointers, free to reuse when the call returns. The communicator's device
 * is made current on the calling thread at each call.
 *
 * timeout_ms bounds the creation (every rank must join within it) and each call (0: no bound).
 * While waiting, the call polls the stream and NCCL's asynchronous error state; an NCCL error,
 * or the timeout passing, aborts the NCCL communicator (ncclCommAbort) and fails the call with
 * EMBPS_UNAVAILABLE, and every later call fails at once with the same status: a dead peer
 * cannot hang the engine thread forever. NCCL does not say which peer failed; messages name
 * the peer when there is only one.
 *
 * all_reduce is an all-gather followed by a reduction in rank order 0..size-1 on the device,
 * so every rank gets bitwise the same result, equal to the TCP backend's.
 *
 * On failure *out is untouched. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (bad rank/size/id),
 * EMBPS_RESOURCE_EXHAUSTED (device or host memory), EMBPS_UNAVAILABLE (NCCL initialization
 * failed or timed out: a rank did not join) or EMBPS_INTERNAL (a CUDA error).
 */
embps_status_t embps_comm_nccl_new(embps_comm_t **out, uint32_t rank, uint32_t size,
                                   const uint8_t unique_id[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                   void *stream, uint64_t timeout_ms, embps_error_t *err);
#endif

/* The collectives. The engine calls these, never a backend directly. Each checks its arguments
 * and whether c is still usable before the backend sees the call, then counts it in c->stats.
 * Every one returns EMBPS_OK; EMBPS_INVALID_ARGUMENT for the arguments described in
 * embps_comm_ops_t (nothing moved, c stays usable); the status that broke c, at once, when an
 * earlier call broke it; EMBPS_UNAVAILABLE when a peer goes away or the call times out (c is then
 * broken); EMBPS_RESOURCE_EXHAUSTED when scratch memory runs out; EMBPS_INTERNAL for a mismatch
 * between ranks or a device error (c is then broken). err says why. */

/** recv[r*bytes .. (r+1)*bytes) = rank r's send[0..bytes). recv holds size*bytes; send is either
 * apart from recv or exactly in place at recv + rank*bytes. */
embps_status_t embps_comm_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err);

/** recv[r*bytes ..) = rank r's send[rank*bytes ..). send and recv hold size*bytes each and do
 * not overlap. */
embps_status_t embps_comm_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err);

/** buf[i] = op over the ranks' buf[i] for count elements, bitwise the same on every rank. buf is
 * aligned to its elements. */
embps_status_t embps_comm_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                     embps_comm_type_t type, embps_comm_op_t op,
                                     embps_error_t *err);

/** Returns once every rank has entered the barrier. */
embps_status_t embps_comm_barrier(embps_comm_t *c, embps_error_t *err);

/** Frees the communicator. NULL is a no-op. */
void embps_comm_free(embps_comm_t *c);

/** Has the dispatcher observe every later call's time in h (borrowed; NULL stops it). Call on
 * the thread that runs the collectives. */
void embps_comm_set_call_histogram(embps_comm_t *c, embps_hist_t *h);

#endif
