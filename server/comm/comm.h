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

/** Bytes a rank sent and received through collectives since creation. */
typedef struct embps_comm_stats {
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t calls;
} embps_comm_stats_t;

/** A backend's functions. Buffers are host memory for "tcp", device memory for "nccl". */
typedef struct embps_comm_ops {
  const char *name;
  /** recv[r*bytes .. (r+1)*bytes) = rank r's send[0..bytes). recv holds size*bytes. */
  embps_status_t (*all_gather)(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                               embps_error_t *err);
  /** recv[r*bytes ..) = rank r's send[me*bytes ..): equal blocks of `bytes` per rank pair. */
  embps_status_t (*all_to_all)(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                               embps_error_t *err);
  /** buf[i] = op over ranks of buf[i], for count elements; every rank gets bitwise the same
   * result (reductions run in rank order). */
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
  embps_comm_stats_t stats;
  embps_status_t broken; /* EMBPS_OK while usable; see embps__comm_break */
  char broken_msg[400];
};

/**
 * For backends: marks c broken with status and the formatted message, logs it at file:line as
 * "comm <backend> rank R/N: message", and sets err. Every later call then fails at once through
 * embps__comm_check_usable. Returns status.
 */
embps_status_t embps__comm_break(embps_comm_t *c, embps_error_t *err, embps_status_t status,
                                 const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/** For backends, first in every call: EMBPS_OK, or the failure that broke c. */
static inline embps_status_t embps__comm_check_usable(const embps_comm_t *c, embps_error_t *err) {
  if (c->broken == EMBPS_OK)
    return EMBPS_OK;
  return embps_error_set(err, c->broken, "communicator unusable after an earlier failure: %s",
                         c->broken_msg);
}

/**
 * The TCP backend over already connected stream sockets: fds[r] is a connected socket to rank
 * r for every r != rank (fds[rank] is ignored; pass -1). The communicator takes ownership of
 * the sockets (closes them on free). timeout_ms bounds each call (0: no bound).
 * On failure *out is untouched and the sockets are closed. Returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_comm_tcp_new(embps_comm_t **out, uint32_t rank, uint32_t size, const int *fds,
                                  uint64_t timeout_ms);

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

/* Whether [a, a+alen) and [b, b+blen) share a byte. */
static inline int embps_comm_overlaps(const void *a, size_t alen, const void *b, size_t blen) {
  uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
  return alen && blen && pa < pb + blen && pb < pa + alen;
}

/**
 * The argument checks every backend's all_gather makes: a receive size that does not overflow,
 * buffers for bytes > 0, and send either apart from recv or exactly in place at
 * recv + rank*bytes. Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT (err says which).
 */
static inline embps_status_t embps_comm_check_all_gather(const embps_comm_t *c, const void *send,
                                                         size_t bytes, const void *recv,
                                                         embps_error_t *err) {
  const uint8_t *own;
  if (bytes > SIZE_MAX / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather of %zu bytes per rank overflows the receive size", bytes);
  if (bytes > 0 && (!send || !recv))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather of %zu bytes needs send and recv buffers", bytes);
  own = bytes ? (const uint8_t *)recv + (size_t)c->rank * bytes : NULL;
  if ((const uint8_t *)send != own && embps_comm_overlaps(send, bytes, recv, bytes * c->size))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather send buffer overlaps recv other than in place at "
                           "recv + rank*bytes");
  return EMBPS_OK;
}

/**
 * The argument checks every backend's all_to_all makes: a buffer size that does not overflow,
 * buffers for bytes > 0, and send apart from recv. Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT.
 */
static inline embps_status_t embps_comm_check_all_to_all(const embps_comm_t *c, const void *send,
                                                         size_t bytes, const void *recv,
                                                         embps_error_t *err) {
  if (bytes > SIZE_MAX / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all of %zu bytes per rank pair overflows the buffer size",
                           bytes);
  if (bytes > 0 && (!send || !recv))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all of %zu bytes needs send and recv buffers", bytes);
  if (embps_comm_overlaps(send, bytes * c->size, recv, bytes * c->size))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all send and recv buffers overlap (in place is not supported)");
  return EMBPS_OK;
}

/**
 * The argument checks every backend's all_reduce makes, in one place so that they refuse the
 * same calls with the same words: a known type and reduction, a buffer for count > 0, and a
 * size that does not overflow over the group. Sets *elem to the element size. Returns EMBPS_OK
 * or EMBPS_INVALID_ARGUMENT (err says which).
 */
static inline embps_status_t embps_comm_check_reduce(const embps_comm_t *c, const void *buf,
                                                     size_t count, embps_comm_type_t type,
                                                     embps_comm_op_t op, size_t *elem,
                                                     embps_error_t *err) {
  switch (type) {
  case EMBPS_COMM_F32:
    *elem = sizeof(float);
    break;
  case EMBPS_COMM_F64:
  case EMBPS_COMM_U64:
    *elem = 8;
    break;
  default:
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce: unknown element type %d",
                           (int)type);
  }
  if (op != EMBPS_COMM_SUM && op != EMBPS_COMM_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce: unknown reduction %d",
                           (int)op);
  if (count > SIZE_MAX / *elem / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_reduce of %zu elements overflows the buffer size", count);
  if (count > 0 && !buf)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce of %zu elements needs a buffer",
                           count);
  return EMBPS_OK;
}

/* Dispatch helpers: the engine calls these, never a backend directly. */
static inline embps_status_t embps_comm_all_gather(embps_comm_t *c, const void *send, size_t bytes,
                                                   void *recv, embps_error_t *err) {
  return c->ops->all_gather(c, send, bytes, recv, err);
}
static inline embps_status_t embps_comm_all_to_all(embps_comm_t *c, const void *send, size_t bytes,
                                                   void *recv, embps_error_t *err) {
  return c->ops->all_to_all(c, send, bytes, recv, err);
}
static inline embps_status_t embps_comm_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                                   embps_comm_type_t type, embps_comm_op_t op,
                                                   embps_error_t *err) {
  return c->ops->all_reduce(c, buf, count, type, op, err);
}
static inline embps_status_t embps_comm_barrier(embps_comm_t *c, embps_error_t *err) {
  return c->ops->barrier(c, err);
}
/** Frees the communicator. NULL is a no-op. */
static inline void embps_comm_free(embps_comm_t *c) {
  if (c)
    c->ops->destroy(c);
}

#endif
