/* The NCCL backend of the collectives: device buffers, one NCCL communicator per rank.
 *
 * Every call enqueues its NCCL operations (and for all_to_all a device copy, for all_reduce a
 * reduction kernel) on the caller's stream and then waits for that stream, so a call returns
 * with its results in place, as the TCP backend's do. The wait is not cudaStreamSynchronize,
 * which would block forever behind a collective whose peer died: it polls cudaStreamQuery and
 * ncclCommGetAsyncError, backing off from yields to short sleeps, until the stream is idle, NCCL
 * reports an error, or the call's timeout passes. On an error or a timeout the NCCL communicator
 * is aborted (ncclCommAbort makes the device kernels give up, so the stream drains), the
 * communicator is marked broken, and every later call fails at once with the same status and
 * message, like the TCP backend.
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0): initialization and every NCCL
 * call may return ncclInProgress, after which nothing else may be enqueued on the stream until
 * ncclCommGetAsyncError leaves ncclInProgress. Initialization is bounded by the same timeout, so
 * a rank that never joins fails the others instead of hanging them.
 *
 * all_gather is ncclAllGather of bytes; all_to_all copies the rank's own block on the device and
 * exchanges the others with one ncclSend and one ncclRecv per peer in a group; barrier is a
 * one-byte ncclAllReduce. all_reduce is not ncclAllReduce, whose summation order depends on the
 * algorithm NCCL picks, so ranks could differ in the last bit: it is an ncclAllGather of the
 * buffers into a device scratch buffer (kept and grown, as the TCP backend's) followed by a
 * reduction in rank order 0..size-1 on the device (comm_nccl_reduce.cu), the TCP backend's
 * order: every rank gets bitwise the same result, and the same as over TCP. It moves
 * (size-1)·bytes each way instead of a ring's 2·(size-1)/size·bytes; shard groups are small and
 * determinism is the point.
 *
 * The dispatcher (comm.c) checks every call's arguments (alignment of the reduction buffer
 * included) before it gets here, and counts the calls and their payload. */
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/cuda_check.h"
#include "common/log.h"
#include "server/comm/comm.h"
#include "server/comm/comm_nccl_reduce.h"

_Static_assert(sizeof(ncclUniqueId) == EMBPS_NCCL_UNIQUE_ID_BYTES,
               "EMBPS_NCCL_UNIQUE_ID_BYTES must match NCCL's ncclUniqueId");

/* Waiting: this many polls with sched_yield between them (a small collective finishes within
 * them, tens of microseconds), then sleeps doubling from MIN to MAX, which bounds how late a
 * long collective is noticed. Not measured yet; chosen to keep a waiting engine thread off a
 * core without adding more than a fraction of a millisecond to a long call. */
#define SPIN_POLLS 256
#define SLEEP_MIN_NS 2000L
#define SLEEP_MAX_NS 200000L

typedef struct nccl_comm {
  embps_comm_t base;
  ncclComm_t comm;     /* NULL once aborted or when creation failed before NCCL made one */
  cudaStream_t stream; /* the caller's; borrowed */
  int device;          /* the CUDA device current at creation */
  uint64_t timeout_ms; /* per call and for creation; 0: no bound */
  uint8_t *scratch;    /* device: all_reduce gather buffer, grown to the largest call */
  size_t scratch_cap;
  uint8_t *token; /* device: the barrier's one byte (always 0) */
} nccl_comm_t;

/* 0: no bound, also for a timeout so large that the deadline would wrap. */
static uint64_t deadline_of(const nccl_comm_t *t) {
  uint64_t now = embps_now_ms();
  return t->timeout_ms && t->timeout_ms <= UINT64_MAX - now ? now + t->timeout_ms : 0;
}

/* One step of the wait's back-off; *polls counts the polls made so far. */
static void back_off(unsigned *polls) {
  if (*polls < SPIN_POLLS) {
    (*polls)++;
    sched_yield();
    return;
  }
  long ns = SLEEP_MIN_NS << (*polls - SPIN_POLLS < 7 ? *polls - SPIN_POLLS : 7);
  if (ns > SLEEP_MAX_NS)
    ns = SLEEP_MAX_NS;
  (*polls)++;
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

/* Who the wait is for: NCCL reports that something failed, not which peer. */
static void describe_peers(const nccl_comm_t *t, char *buf, size_t cap) {
  uint32_t me = t->base.rank, size = t->base.size;
  if (size == 1)
    snprintf(buf, cap, "this rank's own device (a 1-rank group has no peer)");
  else if (size == 2)
    snprintf(buf, cap, "rank %u", 1u - me);
  else
    snprintf(buf, cap, "one of ranks 0..%u other than %u (NCCL does not say which)", size - 1, me);
}

/* Aborts the NCCL communicator (no-op when there is none). ncclCommAbort frees it whatever it
 * returns, so the handle is dropped either way. */
static void abort_nccl(nccl_comm_t *t) {
  if (!t->comm)
    return;
  ncclResult_t rc = ncclCommAbort(t->comm);
  if (rc != ncclSuccess && rc != ncclInProgress)
    EMBPS_WARN("comm nccl rank %u/%u: ncclCommAbort: %s", t->base.rank, t->base.size,
               ncclGetErrorString(rc));
  t->comm = NULL;
}

/* Marks the communicator broken (see embps__comm_break) and aborts NCCL. */
static embps_status_t break_at(nccl_comm_t *t, embps_error_t *err, embps_status_t status,
                               const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static embps_status_t break_at(nccl_comm_t *t, embps_error_t *err, embps_status_t status,
                               const char *file, int line, const char *fmt, ...) {
  char msg[sizeof t->base.broken_msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  embps__comm_break(&t->base, err, status, file, line, "%s", msg);
  abort_nccl(t);
  return status;
}
#define BREAK(t, err, status, ...) break_at(t, err, status, __FILE__, __LINE__, __VA_ARGS__)

/* NCCL's result as a status: errors that come from peers, the network or the system mean the
 * group is unavailable; the rest (invalid usage, CUDA errors, NCCL bugs) are internal, since
 * every argument was checked before it reached NCCL. */
static embps_status_t status_of_nccl(ncclResult_t rc) {
  switch (rc) {
  case ncclSystemError:
  case ncclRemoteError:
    return EMBPS_UNAVAILABLE;
  default:
    return EMBPS_INTERNAL;
  }
}

/* The check macro for NCCL calls (NCCL's NCCLCHECKGOTO): a failed call logs file:line with the
 * call and the error, breaks the communicator, reports through `err`, sets `ret` and jumps to
 * `label`. ncclInProgress is not a failure: the call was taken and finishes in the background
 * (see wait_for). CUDA calls go through common/cuda_check.h's EMBPS_CUDA_CHECK_GOTO into a
 * local embps_error_t and jump to a fail_cuda label, where cuda_broke() breaks the
 * communicator with what it says. */
#define NCCL_CHECK_GOTO(t, call, label)                                                            \
  do {                                                                                             \
    ncclResult_t nccl_rc_ = (call);                                                                \
    if (nccl_rc_ != ncclSuccess && nccl_rc_ != ncclInProgress) {                                   \
      ret = BREAK(t, err, status_of_nccl(nccl_rc_), "%s: %s (%s)", #call,                          \
                  ncclGetErrorString(nccl_rc_), ncclGetLastError((t)->comm));                      \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

/* A CUDA call failed (EMBPS_CUDA_CHECK_GOTO logged it and said so in *why): a device error
 * leaves the stream and the NCCL communicator in an unknown state, so it breaks the
 * communicator. Returns why's status. */
static embps_status_t cuda_broke(nccl_comm_t *t, embps_error_t *err, const embps_error_t *why) {
  return BREAK(t, err, why->status, "%s", why->message);
}

/* Waits until NCCL has taken every operation enqueued so far (its state leaves ncclInProgress)
 * and, when `drain`, until the stream is idle; breaks the communicator on an NCCL error, a CUDA
 * error or the deadline (0: none) passing. `what` names the call in messages. */
static embps_status_t wait_for(nccl_comm_t *t, const char *what, uint64_t deadline, bool drain,
                               embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  unsigned polls = 0;
  char peers[128];
  for (;;) {
    ncclResult_t state = ncclSuccess;
    NCCL_CHECK_GOTO(t, ncclCommGetAsyncError(t->comm, &state), fail);
    if (state != ncclSuccess && state != ncclInProgress) {
      describe_peers(t, peers, sizeof peers);
      ret = BREAK(t, err, EMBPS_UNAVAILABLE, "%s failed: NCCL reports %s (%s); suspect %s", what,
                  ncclGetErrorString(state), ncclGetLastError(t->comm), peers);
      goto fail;
    }
    if (state == ncclSuccess) {
      if (!drain)
        goto exit;
      cudaError_t q = cudaStreamQuery(t->stream);
      if (q == cudaSuccess)
        goto exit;
      if (q != cudaErrorNotReady) {
        ret = BREAK(t, err, EMBPS_INTERNAL, "%s: cudaStreamQuery: %s (%s)", what,
                    cudaGetErrorName(q), cudaGetErrorString(q));
        goto fail;
      }
    }
    if (deadline && embps_now_ms() >= deadline) {
      describe_peers(t, peers, sizeof peers);
      ret = BREAK(t, err, EMBPS_UNAVAILABLE, "%s timed out after %llu ms waiting for %s", what,
                  (unsigned long long)t->timeout_ms, peers);
      goto fail;
    }
    back_off(&polls);
  }
exit:
  return ret;
fail:
  goto exit;
}

/* Makes the communicator's device current on the calling thread (a no-op when it is). */
static embps_status_t enter(nccl_comm_t *t, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_error_t cuda_err;
  int current = -1;
  EMBPS_CUDA_CHECK_GOTO(cudaGetDevice(&current), &cuda_err, fail_cuda);
  if (current != t->device)
    EMBPS_CUDA_CHECK_GOTO(cudaSetDevice(t->device), &cuda_err, fail_cuda);
exit:
  return ret;
fail_cuda:
  ret = cuda_broke(t, err, &cuda_err);
  goto exit;
}

static embps_status_t nccl_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                      embps_error_t *err) {
  nccl_comm_t *t = (nccl_comm_t *)c;
  if (bytes == 0)
    return EMBPS_OK; /* NCCL moves nothing for a count of 0 either */
  uint64_t deadline = deadline_of(t);
  embps_status_t ret = enter(t, err);
  if (ret != EMBPS_OK)
    return ret;
  /* In place (send == own) is NCCL's in-place all-gather. */
  NCCL_CHECK_GOTO(t, ncclAllGather(send, recv, bytes, ncclUint8, t->comm, t->stream), fail);
  ret = wait_for(t, "all_gather", deadline, true, err);
exit:
  return ret;
fail:
  goto exit;
}

static embps_status_t nccl_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                      embps_error_t *err) {
  nccl_comm_t *t = (nccl_comm_t *)c;
  uint32_t me = c->rank, size = c->size;
  if (bytes == 0)
    return EMBPS_OK;
  uint64_t deadline = deadline_of(t);
  embps_status_t ret = enter(t, err);
  if (ret != EMBPS_OK)
    return ret;
  const uint8_t *s = send;
  uint8_t *r = recv;
  embps_error_t cuda_err;
  EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(r + (size_t)me * bytes, s + (size_t)me * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, t->stream),
                        &cuda_err, fail_cuda);
  /* One group, so every pair's send and receive progress together: no rank waits on a peer
   * that is itself waiting to send elsewhere. With one rank the group is empty. A failed send
   * or receive still closes the group before the communicator is aborted: the open group holds
   * operations on it, and a group left open would swallow this thread's every later NCCL call. */
  NCCL_CHECK_GOTO(t, ncclGroupStart(), fail);
  ncclResult_t rc = ncclSuccess;
  const char *what = "ncclGroupEnd";
  for (uint32_t p = 0; p < size && (rc == ncclSuccess || rc == ncclInProgress); p++) {
    if (p == me)
      continue;
    what = "ncclSend";
    rc = ncclSend(s + (size_t)p * bytes, bytes, ncclUint8, (int)p, t->comm, t->stream);
    if (rc == ncclSuccess || rc == ncclInProgress) {
      what = "ncclRecv";
      rc = ncclRecv(r + (size_t)p * bytes, bytes, ncclUint8, (int)p, t->comm, t->stream);
    }
  }
  ncclResult_t end = ncclGroupEnd();
  if (rc == ncclSuccess || rc == ncclInProgress) {
    rc = end;
    what = "ncclGroupEnd";
  }
  if (rc != ncclSuccess && rc != ncclInProgress) {
    ret = BREAK(t, err, status_of_nccl(rc), "%s: %s (%s)", what, ncclGetErrorString(rc),
                ncclGetLastError(t->comm));
    goto fail;
  }
  ret = wait_for(t, "all_to_all", deadline, true, err);
exit:
  return ret;
fail_cuda:
  ret = cuda_broke(t, err, &cuda_err);
fail:
  goto exit;
}

static embps_status_t nccl_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                      embps_comm_type_t type, embps_comm_op_t op,
                                      embps_error_t *err) {
  nccl_comm_t *t = (nccl_comm_t *)c;
  uint32_t size = c->size;
  size_t bytes = count * embps_comm_type_size(type);
  if (bytes == 0)
    return EMBPS_OK;
  uint64_t deadline = deadline_of(t);
  embps_status_t ret = enter(t, err);
  if (ret != EMBPS_OK)
    return ret;
  embps_error_t cuda_err;
  if (bytes * size > t->scratch_cap) {
    /* Grown, never shrunk: the engine's all-reduces are the same few sizes every round. The
     * previous call waited for its stream, so the old buffer is idle. Running out of device
     * memory fails this call only (as the TCP backend's scratch allocation does); peers then
     * time out waiting for this rank. */
    EMBPS_CUDA_CHECK_GOTO(cudaFree(t->scratch), &cuda_err, fail_cuda);
    t->scratch = NULL;
    t->scratch_cap = 0;
    void *grown = NULL;
    cudaError_t rc = cudaMalloc(&grown, bytes * size);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError(); /* not sticky: clear it so later calls do not see it */
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                             "all_reduce: cannot allocate %zu bytes of device scratch",
                             bytes * size);
    }
    EMBPS_CUDA_CHECK_GOTO(rc, &cuda_err, fail_cuda);
    t->scratch = grown;
    t->scratch_cap = bytes * size;
  }
  NCCL_CHECK_GOTO(t, ncclAllGather(buf, t->scratch, bytes, ncclUint8, t->comm, t->stream), fail);
  /* Nothing else may go on the stream while NCCL still holds the call (ncclInProgress). */
  ret = wait_for(t, "all_reduce", deadline, false, err);
  if (ret != EMBPS_OK)
    goto fail;
  EMBPS_CUDA_CHECK_GOTO(embps__comm_nccl_reduce(buf, t->scratch, count, size, type, op, t->stream),
                        &cuda_err, fail_cuda);
  ret = wait_for(t, "all_reduce", deadline, true, err);
exit:
  return ret;
fail_cuda:
  ret = cuda_broke(t, err, &cuda_err);
fail:
  goto exit;
}

static embps_status_t nccl_barrier(embps_comm_t *c, embps_error_t *err) {
  nccl_comm_t *t = (nccl_comm_t *)c;
  uint64_t deadline = deadline_of(t);
  embps_status_t ret = enter(t, err);
  if (ret != EMBPS_OK)
    return ret;
  /* A one-byte all-reduce: no rank's stream passes it before every rank has enqueued it. The
   * byte is 0 and stays 0. Not counted as payload, like the TCP backend's header-only barrier. */
  NCCL_CHECK_GOTO(t, ncclAllReduce(t->token, t->token, 1, ncclUint8, ncclSum, t->comm, t->stream),
                  fail);
  ret = wait_for(t, "barrier", deadline, true, err);
exit:
  return ret;
fail:
  goto exit;
}

/* Frees everything; the NCCL communicator is finalized (flushing, bounded by the timeout) and
 * destroyed, or aborted when that fails or the communicator is broken. */
static void release(nccl_comm_t *t) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != t->device)
    (void)cudaSetDevice(t->device);
  if (t->comm && t->base.broken == EMBPS_OK) {
    ncclResult_t rc = ncclCommFinalize(t->comm);
    uint64_t deadline = deadline_of(t);
    unsigned polls = 0;
    ncclResult_t state = rc;
    while (state == ncclInProgress) {
      if (ncclCommGetAsyncError(t->comm, &state) != ncclSuccess)
        break;
      if (state != ncclInProgress)
        break;
      if (deadline && embps_now_ms() >= deadline)
        break;
      back_off(&polls);
    }
    if (state == ncclSuccess) {
      rc = ncclCommDestroy(t->comm); /* frees in the background: ncclInProgress is fine */
      if (rc != ncclSuccess && rc != ncclInProgress)
        EMBPS_WARN("comm nccl rank %u/%u: ncclCommDestroy: %s", t->base.rank, t->base.size,
                   ncclGetErrorString(rc));
      t->comm = NULL;
    } else {
      EMBPS_WARN("comm nccl rank %u/%u: finalize did not complete (%s); aborting", t->base.rank,
                 t->base.size, ncclGetErrorString(state));
    }
  }
  abort_nccl(t); /* no-op once destroyed */
  cudaError_t rc = t->scratch ? cudaFree(t->scratch) : cudaSuccess;
  if (rc == cudaSuccess && t->token)
    rc = cudaFree(t->token);
  if (rc != cudaSuccess)
    EMBPS_WARN("comm nccl rank %u/%u: cudaFree: %s", t->base.rank, t->base.size,
               cudaGetErrorString(rc));
  if (current >= 0 && current != t->device)
    (void)cudaSetDevice(current);
  embps_free(t);
}

static void nccl_destroy(embps_comm_t *c) { release((nccl_comm_t *)c); }

static const embps_comm_ops_t nccl_ops = {
    .name = "nccl",
    .all_gather = nccl_all_gather,
    .all_to_all = nccl_all_to_all,
    .all_reduce = nccl_all_reduce,
    .barrier = nccl_barrier,
    .destroy = nccl_destroy,
};

embps_status_t embps_comm_nccl_unique_id(uint8_t out[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                         embps_error_t *err) {
  if (!out)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "embps_comm_nccl_unique_id: no output");
  ncclUniqueId id;
  ncclResult_t rc = ncclGetUniqueId(&id);
  if (rc != ncclSuccess) {
    EMBPS_ERROR("ncclGetUniqueId: %s (%s)", ncclGetErrorString(rc), ncclGetLastError(NULL));
    return embps_error_set(err, EMBPS_UNAVAILABLE, "ncclGetUniqueId: %s (%s)",
                           ncclGetErrorString(rc), ncclGetLastError(NULL));
  }
  memcpy(out, id.internal, EMBPS_NCCL_UNIQUE_ID_BYTES);
  return EMBPS_OK;
}

embps_status_t embps_comm_nccl_new(embps_comm_t **out, uint32_t rank, uint32_t size,
                                   const uint8_t unique_id[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                   void *stream, uint64_t timeout_ms, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_error_t cuda_err;
  nccl_comm_t *t = NULL;
  if (!out || !unique_id || size == 0 || rank >= size || size > (uint32_t)INT32_MAX) {
    EMBPS_ERROR("embps_comm_nccl_new: bad arguments (rank %u, size %u)", rank, size);
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "embps_comm_nccl_new: bad arguments (rank %u, size %u%s%s)", rank, size,
                           out ? "" : ", no output", unique_id ? "" : ", no unique id");
  }
  t = embps_calloc(1, sizeof *t);
  if (!t) {
    EMBPS_ERROR("embps_comm_nccl_new: out of memory");
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "embps_comm_nccl_new: out of memory");
  }
  t->base.ops = &nccl_ops;
  t->base.rank = rank;
  t->base.size = size;
  t->stream = (cudaStream_t)stream;
  t->timeout_ms = timeout_ms;
  uint64_t deadline = deadline_of(t);
  EMBPS_CUDA_CHECK_GOTO(cudaGetDevice(&t->device), &cuda_err, fail_cuda);
  void *token = NULL;
  cudaError_t crc = cudaMalloc(&token, 1);
  if (crc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    ret = BREAK(t, err, EMBPS_RESOURCE_EXHAUSTED,
                "embps_comm_nccl_new: cannot allocate device memory");
    goto fail;
  }
  EMBPS_CUDA_CHECK_GOTO(crc, &cuda_err, fail_cuda);
  t->token = token;
  EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(t->token, 0, 1, t->stream), &cuda_err, fail_cuda);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(t->stream), &cuda_err, fail_cuda);

  ncclUniqueId id;
  memcpy(id.internal, unique_id, EMBPS_NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  /* Non-blocking: returns at once (ncclInProgress) and joins the other ranks in the
   * background; wait_for polls until it is done, fails, or the timeout passes. */
  NCCL_CHECK_GOTO(t, ncclCommInitRankConfig(&t->comm, (int)size, id, (int)rank, &config), fail);
  ret = wait_for(t, "NCCL communicator initialization", deadline, false, err);
  if (ret != EMBPS_OK) {
    EMBPS_ERROR("embps_comm_nccl_new: rank %u of %u: the communicator did not form: %s", rank, size,
                err ? err->message : embps_status_str(ret));
    goto fail;
  }
  EMBPS_INFO("comm nccl rank %u/%u on device %d: ready", rank, size, t->device);
  *out = &t->base;
exit:
  return ret;
fail_cuda:
  ret = cuda_broke(t, err, &cuda_err);
fail:
  abort_nccl(t); /* a communicator NCCL handed out before failing */
  release(t);
  goto exit;
}
