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
};

/**
 * The TCP backend over already connected stream sockets: fds[r] is a connected socket to rank
 * r for every r != rank (fds[rank] is ignored; pass -1). The communicator takes ownership of
 * the sockets (closes them on free). timeout_ms bounds each call (0: no bound).
 * On failure *out is untouched and the sockets are closed. Returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_comm_tcp_new(embps_comm_t **out, uint32_t rank, uint32_t size, const int *fds,
                                  uint64_t timeout_ms);

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
