/* A simulation of the NCCL library itself (the subset of <nccl.h> in fake/nccl.h) on the CUDA
 * simulator, so that server/comm/comm_nccl.c runs unchanged, with several ranks, where there is
 * no GPU and no NCCL. (sim_nccl.c is another level: it replaces comm_nccl.c itself.)
 *
 * Rendezvous. ncclGetUniqueId opens a listener on 127.0.0.1 and starts a detached root thread
 * in the calling process, as NCCL's bootstrap root; the id holds its port and a random nonce.
 * Each rank's communicator has a worker thread (NCCL's proxy and kernels in one) which opens its
 * own listener, sends the root a hello (nonce, rank, size, port, pid, device) and gets back the
 * table of every rank's port, or why the rendezvous failed: inconsistent sizes or ranks, two
 * ranks on one device of one process (NCCL's "Duplicate GPU detected"), or a rank that closed
 * its connection before all joined. Rank i then connects to ranks 0..i-1 and accepts from
 * i+1..size-1, which completes the mesh without any rank waiting on another's accept.
 *
 * State. Communicators are non-blocking (config.blocking = 0) as comm_nccl.c makes them, or
 * blocking (the default): a blocking call waits for what it started and returns its result.
 * ncclCommInitRankConfig returns ncclInProgress at once and ncclCommGetAsyncError reports
 * ncclInProgress until the worker has built the mesh, so a rank that never joins leaves the
 * others in progress until the caller's own timeout aborts them. Every collective, every
 * ncclGroupEnd and ncclCommFinalize returns ncclInProgress (NCCL may, for a non-blocking
 * communicator) and the state stays ncclInProgress until the worker has moved the data: the
 * caller must poll ncclCommGetAsyncError before it enqueues anything else behind it, as NCCL
 * requires, and a collective issued while the state is still ncclInProgress aborts with a
 * message (a bug of the program under test). An error is sticky: a peer that closed its
 * connection during an operation gives ncclRemoteError, a socket failure ncclSystemError, and
 * every later call returns it.
 *
 * Data. An operation takes effect as if NCCL's kernel ran at enqueue time after the stream's
 * earlier work: the call checks its buffers (device memory of the communicator's device, on the
 * stream's device, whole), synchronizes the stream on the calling thread (never under the
 * simulator's mutex while waiting on a peer), and hands the transfer to the worker, which opens
 * the device's memory (sim_cuda_device_access_begin) and moves the bytes with poll over
 * non-blocking sockets, every peer's send and receive at once, so a group of ncclSend/ncclRecv
 * never deadlocks. Between each pair of ranks every operation starts with a header (kind,
 * per-pair sequence, bytes): a rank that issues a different collective or size than its peer
 * aborts the process with both sides named, where NCCL would hang or corrupt (unless the peer
 * then turns out to have closed the connection: what a peer that aborted in the middle of an
 * operation left behind gives ncclRemoteError). ncclAllReduce
 * gathers every rank's buffer and reduces in rank order 0..size-1, so every rank gets bitwise
 * the same result.
 *
 * Abort. ncclCommAbort (and ncclCommDestroy) wake the worker through a pipe that every wait of
 * it polls, join it, close the sockets and free the communicator; a stale handle passed later is
 * recognized (a registry of live communicators) and aborts with a message. Every wait is
 * bounded: the worker gives up with ncclSystemError after SIM_BOUND_MS without completion, the
 * root thread after the same time. */
#include <errno.h>
#include <fcntl.h>
#include <nccl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "sim_cuda.h"
#include "sim_nccl_lib.h"

#define ID_MAGIC "SIMNCCLL"
#define ID_MAGIC_BYTES 8
#define NONCE_BYTES 16
#define COMM_MAGIC 0x4e43434cu /* "NCCL" */
#define HDR_MAGIC 0x53494d48u
#define SIM_BOUND_MS (10u * 60u * 1000u) /* no simulated wait outlives this */
#define HELLO_MS 5000u                   /* a connecting rank sends its hello at once */
#define PEER_GONE_MS 2000u /* how long a mismatched header waits to see the peer gone */
#define POLL_SLICE_MS 1000
#define MAX_RANKS 1024
#define SIM_ABORTED ((ncclResult_t)100) /* internal: the communicator is being aborted */

/* Operation kinds, a bitmask in the pair header so that mismatched calls show up. */
enum { KIND_ALLGATHER = 1, KIND_ALLREDUCE = 2, KIND_P2P = 4, KIND_FINALIZE = 8 };

typedef struct hello {
  char magic[ID_MAGIC_BYTES];
  uint8_t nonce[NONCE_BYTES];
  int32_t rank, nranks, device;
  uint32_t pid;
  uint16_t port, pad;
} hello_t;

typedef struct verdict {
  int32_t result; /* ncclSuccess, then nranks uint16 ports follow */
  char message[236];
} verdict_t;

typedef struct peer_hello {
  uint8_t nonce[NONCE_BYTES];
  int32_t rank;
} peer_hello_t;

typedef struct pair_header {
  uint32_t magic, kind;
  uint64_t seq, bytes;
} pair_header_t;

typedef struct seg {
  int peer, send;
  uint8_t *buf;
  size_t bytes;
} seg_t;

typedef struct copy {
  uint8_t *dst;
  const uint8_t *src;
  size_t bytes;
} copy_t;

typedef struct job {
  struct job *next;
  unsigned kind;
  seg_t *segs;
  size_t nsegs, segs_cap;
  copy_t *copies;
  size_t ncopies, copies_cap;
  cudaStream_t *streams;
  size_t nstreams, streams_cap;
  /* ncclAllReduce: gathered blocks in tmp, reduced into out in rank order afterwards */
  struct reduce {
    void *out;
    uint8_t *tmp;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
  } * reduces;
  size_t nreduces, reduces_cap;
} job_t;

struct ncclComm {
  uint32_t magic;
  int rank, nranks, device, blocking;
  uint8_t nonce[NONCE_BYTES];
  uint16_t root_port;
  int listener;
  int *fds;      /* per rank; -1 for this rank */
  uint64_t *seq; /* per rank: operations exchanged with it */
  int wake[2];   /* abort pipe: the worker polls wake[0] */
  pthread_t worker;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ncclResult_t state; /* under mu */
  bool stop, finalized;
  job_t *head, *tail;   /* under mu: submitted, not yet completed (head may be running) */
  char last_error[256]; /* under mu */
  struct ncclComm *next_live;
};

static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ncclComm *live; /* every communicator not yet aborted or destroyed */

static _Thread_local char thread_error[256];
static _Thread_local char last_error_copy[256];

/* ncclGroupStart/End: per thread, as NCCL's. */
typedef struct group_entry {
  ncclComm_t comm;
  job_t *job;
} group_entry_t;
static _Thread_local int group_depth;
static _Thread_local ncclResult_t group_error;
static _Thread_local group_entry_t *group_entries;
static _Thread_local size_t group_n, group_cap;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p)
    sim_cuda_fail("simulated NCCL: out of host memory");
  return p;
}

/* Grows *arr (of *cap elements of `size` bytes) to hold at least need. */
static void grow(void **arr, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return;
  size_t n = *cap ? *cap * 2 : 8;
  while (n < need)
    n *= 2;
  void *p = realloc(*arr, n * size);
  if (!p)
    sim_cuda_fail("simulated NCCL: out of host memory");
  *arr = p;
  *cap = n;
}

static void set_error(ncclComm_t c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(ncclComm_t c, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (c) {
    pthread_mutex_lock(&c->mu);
    memcpy(c->last_error, buf, sizeof buf);
    pthread_mutex_unlock(&c->mu);
  } else {
    memcpy(thread_error, buf, sizeof buf);
  }
}

/* ---- sockets: every wait also watches the abort pipe and a deadline ------------------------- */

typedef enum { IO_OK, IO_ABORTED, IO_TIMEOUT, IO_CLOSED, IO_ERROR } io_t;

static io_t wait_fd(int fd, short events, int wake_fd, uint64_t deadline) {
  for (;;) {
    struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = wake_fd, .events = POLLIN}};
    uint64_t now = now_ms();
    if (now >= deadline)
      return IO_TIMEOUT;
    int slice = deadline - now < POLL_SLICE_MS ? (int)(deadline - now) : POLL_SLICE_MS;
    int rc = poll(p, wake_fd >= 0 ? 2 : 1, slice);
    if (rc < 0 && errno != EINTR)
      return IO_ERROR;
    if (rc > 0 && wake_fd >= 0 && p[1].revents)
      return IO_ABORTED;
    if (rc > 0 && p[0].revents)
      return IO_OK;
  }
}

static io_t send_all(int fd, const void *buf, size_t n, int wake_fd, uint64_t deadline) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      io_t w = wait_fd(fd, POLLOUT, wake_fd, deadline);
      if (w != IO_OK)
        return w;
    } else {
      return k < 0 && (errno == EPIPE || errno == ECONNRESET) ? IO_CLOSED : IO_ERROR;
    }
  }
  return IO_OK;
}

static io_t recv_all(int fd, void *buf, size_t n, int wake_fd, uint64_t deadline) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      io_t w = wait_fd(fd, POLLIN, wake_fd, deadline);
      if (w != IO_OK)
        return w;
    } else {
      return k == 0 || errno == ECONNRESET ? IO_CLOSED : IO_ERROR;
    }
  }
  return IO_OK;
}

static const char *io_str(io_t r) {
  switch (r) {
  case IO_OK:
    return "ok";
  case IO_ABORTED:
    return "aborted";
  case IO_TIMEOUT:
    return "timed out";
  case IO_CLOSED:
    return "connection closed by the peer";
  case IO_ERROR:
    break;
  }
  return strerror(errno);
}

static int open_listener(uint16_t *port) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

static int connect_loopback(uint16_t port, int wake_fd, uint64_t deadline, io_t *why) {
  struct sockaddr_in a = {
      .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
  int so_error = 0;
  socklen_t len = sizeof so_error;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  *why = IO_ERROR;
  if (fd < 0)
    return -1;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
    return fd;
  if (errno == EINPROGRESS || errno == EINTR) {
    *why = wait_fd(fd, POLLOUT, wake_fd, deadline);
    if (*why == IO_OK && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 &&
        so_error == 0)
      return fd;
    if (*why == IO_OK) {
      *why = IO_ERROR;
      errno = so_error;
    }
  }
  close(fd);
  return -1;
}

static int accept_one(int listener, int wake_fd, uint64_t deadline, io_t *why) {
  for (;;) {
    *why = wait_fd(listener, POLLIN, wake_fd, deadline);
    if (*why != IO_OK)
      return -1;
    int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0)
      return fd;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      *why = IO_ERROR;
      return -1;
    }
  }
}

/* ---- the root ------------------------------------------------------------------------------- */

typedef struct root {
  int listener;
  uint8_t nonce[NONCE_BYTES];
} root_t;

/* Tells every joined rank the verdict (and on success the ports). */
static void root_answer(const int *fds, const hello_t *hellos, int nranks, int32_t result,
                        const char *message) {
  verdict_t v;
  uint16_t ports[MAX_RANKS];
  uint64_t deadline = now_ms() + HELLO_MS;
  memset(&v, 0, sizeof v);
  v.result = result;
  snprintf(v.message, sizeof v.message, "%s", message);
  for (int r = 0; r < nranks; r++)
    ports[r] = hellos[r].port;
  for (int r = 0; r < nranks; r++) {
    if (fds[r] < 0)
      continue;
    if (send_all(fds[r], &v, sizeof v, -1, deadline) == IO_OK && result == ncclSuccess)
      (void)send_all(fds[r], ports, sizeof(uint16_t) * (size_t)nranks, -1, deadline);
  }
}

static void *root_main(void *arg) {
  root_t *root = arg;
  uint64_t deadline = now_ms() + SIM_BOUND_MS;
  int nranks = 0, joined = 0;
  int fds[MAX_RANKS];
  hello_t hellos[MAX_RANKS];
  char why[236] = "";
  int32_t result = ncclSuccess;
  for (int r = 0; r < MAX_RANKS; r++)
    fds[r] = -1;
  while (result == ncclSuccess && (nranks == 0 || joined < nranks)) {
    struct pollfd p[MAX_RANKS + 1];
    int who[MAX_RANKS + 1], n = 0;
    uint64_t now = now_ms();
    if (now >= deadline) {
      result = ncclSystemError;
      snprintf(why, sizeof why, "simulated NCCL root: %d of %d ranks joined within %u ms", joined,
               nranks, SIM_BOUND_MS);
      break;
    }
    p[n].fd = root->listener;
    p[n].events = POLLIN;
    who[n++] = -1;
    for (int r = 0; r < nranks; r++)
      if (fds[r] >= 0) {
        p[n].fd = fds[r];
        p[n].events = POLLIN;
        who[n++] = r;
      }
    if (poll(p, (nfds_t)n, POLL_SLICE_MS) <= 0)
      continue;
    for (int i = 1; i < n && result == ncclSuccess; i++)
      if (p[i].revents) { /* a joined rank says nothing more: readable means it left */
        result = ncclRemoteError;
        snprintf(why, sizeof why,
                 "simulated NCCL root: rank %d left before all %d ranks joined (%d had)", who[i],
                 nranks, joined);
        close(fds[who[i]]);
        fds[who[i]] = -1;
      }
    if (result != ncclSuccess || !p[0].revents)
      continue;
    int fd = accept4(root->listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0)
      continue;
    hello_t h;
    if (recv_all(fd, &h, sizeof h, -1, now_ms() + HELLO_MS) != IO_OK ||
        memcmp(h.magic, ID_MAGIC, ID_MAGIC_BYTES) != 0 ||
        memcmp(h.nonce, root->nonce, NONCE_BYTES) != 0) {
      close(fd); /* not one of ours */
      continue;
    }
    if (nranks == 0 && h.nranks >= 1 && h.nranks <= MAX_RANKS)
      nranks = h.nranks;
    if (h.nranks != nranks || h.rank < 0 || h.rank >= nranks || fds[h.rank] >= 0) {
      result = ncclInvalidUsage;
      snprintf(why, sizeof why, "simulated NCCL root: rank %d of %d does not fit (group of %d%s)",
               h.rank, h.nranks, nranks,
               h.rank >= 0 && h.rank < nranks && fds[h.rank] >= 0 ? ", rank taken" : "");
      close(fd);
      break;
    }
    for (int r = 0; r < nranks; r++)
      if (fds[r] >= 0 && hellos[r].pid == h.pid && hellos[r].device == h.device) {
        result = ncclInvalidUsage;
        snprintf(why, sizeof why,
                 "simulated NCCL root: Duplicate GPU detected: rank %d and rank %d both on "
                 "device %d of process %u",
                 r, h.rank, h.device, h.pid);
      }
    fds[h.rank] = fd;
    hellos[h.rank] = h;
    joined++;
  }
  root_answer(fds, hellos, nranks, result, why);
  for (int r = 0; r < nranks; r++)
    if (fds[r] >= 0)
      close(fds[r]);
  close(root->listener);
  free(root);
  return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  root_t *root;
  uint16_t port;
  pthread_t thread;
  pthread_attr_t attr;
  if (!uniqueId) {
    set_error(NULL, "ncclGetUniqueId: uniqueId is NULL");
    return ncclInvalidArgument;
  }
  root = xcalloc(1, sizeof *root);
  if (getrandom(root->nonce, NONCE_BYTES, 0) != NONCE_BYTES ||
      (root->listener = open_listener(&port)) < 0) {
    set_error(NULL, "simulated NCCL: cannot open the bootstrap root: %s", strerror(errno));
    free(root);
    return ncclSystemError;
  }
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, ID_MAGIC, ID_MAGIC_BYTES);
  memcpy(uniqueId->internal + 8, &port, sizeof port);
  uint32_t pid = (uint32_t)getpid();
  memcpy(uniqueId->internal + 12, &pid, sizeof pid);
  memcpy(uniqueId->internal + 16, root->nonce, NONCE_BYTES);
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&thread, &attr, root_main, root);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    set_error(NULL, "simulated NCCL: cannot start the bootstrap root: %s", strerror(rc));
    close(root->listener);
    free(root);
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* ---- the registry of live communicators ------------------------------------------------------ */

/* The communicator behind a handle; aborts on a handle that is not a live communicator (freed
 * by ncclCommAbort or ncclCommDestroy, or never made). NULL passes as NULL. */
static ncclComm_t live_comm(ncclComm_t c, const char *what) {
  if (!c)
    return NULL;
  pthread_mutex_lock(&live_mu);
  ncclComm_t t = live;
  while (t && t != c)
    t = t->next_live;
  pthread_mutex_unlock(&live_mu);
  if (!t)
    sim_cuda_fail("%s: %p is not a live NCCL communicator (aborted, destroyed or never made)", what,
                  (void *)c);
  return t;
}

int sim_nccl_lib_stream_busy(cudaStream_t stream) {
  int busy = 0;
  pthread_mutex_lock(&live_mu);
  for (ncclComm_t c = live; c && !busy; c = c->next_live) {
    pthread_mutex_lock(&c->mu);
    for (job_t *j = c->head; j && !busy; j = j->next)
      for (size_t i = 0; i < j->nstreams; i++)
        busy |= j->streams[i] == stream;
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&live_mu);
  return busy;
}

/* ---- jobs ----------------------------------------------------------------------------------- */

static void free_job(job_t *j) {
  if (!j)
    return;
  for (size_t i = 0; i < j->nreduces; i++)
    free(j->reduces[i].tmp);
  free(j->reduces);
  free(j->segs);
  free(j->copies);
  free(j->streams);
  free(j);
}

static void add_seg(job_t *j, int peer, int send, const void *buf, size_t bytes) {
  if (bytes == 0)
    return;
  grow((void **)&j->segs, &j->segs_cap, j->nsegs + 1, sizeof *j->segs);
  j->segs[j->nsegs++] = (seg_t){peer, send, (uint8_t *)buf, bytes};
}

static void add_copy(job_t *j, void *dst, const void *src, size_t bytes) {
  if (bytes == 0 || dst == src)
    return;
  grow((void **)&j->copies, &j->copies_cap, j->ncopies + 1, sizeof *j->copies);
  j->copies[j->ncopies++] = (copy_t){dst, src, bytes};
}

static void add_stream(job_t *j, cudaStream_t s) {
  for (size_t i = 0; i < j->nstreams; i++)
    if (j->streams[i] == s)
      return;
  grow((void **)&j->streams, &j->streams_cap, j->nstreams + 1, sizeof *j->streams);
  j->streams[j->nstreams++] = s;
}

#define DEFINE_REDUCE(name, T)                                                                     \
  static void name(void *out, const uint8_t *blocks, size_t count, int n, ncclRedOp_t op) {        \
    for (size_t i = 0; i < count; i++) {                                                           \
      T acc, b;                                                                                    \
      memcpy(&acc, blocks + i * sizeof(T), sizeof(T));                                             \
      for (int r = 1; r < n; r++) {                                                                \
        memcpy(&b, blocks + ((size_t)r * count + i) * sizeof(T), sizeof(T));                       \
        acc = op == ncclSum    ? (T)(acc + b)                                                      \
              : op == ncclProd ? (T)(acc * b)                                                      \
              : op == ncclMax  ? (b > acc ? b : acc)                                               \
                               : (b < acc ? b : acc);                                               \
      }                                                                                            \
      memcpy((uint8_t *)out + i * sizeof(T), &acc, sizeof(T));                                     \
    }                                                                                              \
  }
DEFINE_REDUCE(reduce_i8, int8_t)
DEFINE_REDUCE(reduce_u8, uint8_t)
DEFINE_REDUCE(reduce_i32, int32_t)
DEFINE_REDUCE(reduce_u32, uint32_t)
DEFINE_REDUCE(reduce_i64, int64_t)
DEFINE_REDUCE(reduce_u64, uint64_t)
DEFINE_REDUCE(reduce_f32, float)
DEFINE_REDUCE(reduce_f64, double)

static size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0; /* half, bf16, fp8: not simulated */
  }
}

static void run_reduce(const struct reduce *r, int n) {
  void (*fn)(void *, const uint8_t *, size_t, int, ncclRedOp_t) =
      r->type == ncclInt8      ? reduce_i8
      : r->type == ncclUint8   ? reduce_u8
      : r->type == ncclInt32   ? reduce_i32
      : r->type == ncclUint32  ? reduce_u32
      : r->type == ncclInt64   ? reduce_i64
      : r->type == ncclUint64  ? reduce_u64
      : r->type == ncclFloat32 ? reduce_f32
                               : reduce_f64;
  fn(r->out, r->tmp, r->count, n, r->op);
}

/* Per peer progress of one job: a header each way, then the segments in issue order. */
typedef struct chan {
  bool involved;
  pair_header_t out_hdr, in_hdr;
  size_t out_hdr_done, in_hdr_done;
  uint64_t in_expect;
  size_t out_seg, out_off, in_seg, in_off; /* index into job->segs, offset in it */
} chan_t;

static size_t next_seg(const job_t *j, size_t from, int peer, int send) {
  while (from < j->nsegs && !(j->segs[from].peer == peer && j->segs[from].send == send))
    from++;
  return from;
}

static const char *kind_str(unsigned k) {
  static const char *names[16] = {"nothing", "AllGather", "AllReduce", "AllGather+AllReduce",
                                  "Send/Recv"};
  if (k < 5)
    return names[k];
  return k == KIND_FINALIZE ? "Finalize" : "a group of collectives and Send/Recv";
}

/* After a header that does not match: whether the peer has closed the connection (reading and
 * dropping what it sent before, within PEER_GONE_MS). A peer that aborted in the middle of an
 * operation leaves its part of it behind; a live peer that sent something else is a mismatch. */
static bool peer_gone(ncclComm_t c, int r) {
  uint8_t sink[4096];
  uint64_t deadline = now_ms() + PEER_GONE_MS;
  for (;;) {
    ssize_t k = recv(c->fds[r], sink, sizeof sink, MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno == ECONNRESET))
      return true;
    if (k > 0)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return false;
    if (wait_fd(c->fds[r], POLLIN, c->wake[0], deadline) != IO_OK)
      return false;
  }
}

/* Moves one job's bytes with every involved peer at once. */
static ncclResult_t transfer(ncclComm_t c, job_t *j) {
  chan_t *ch = xcalloc((size_t)c->nranks, sizeof *ch);
  ncclResult_t ret = ncclSuccess;
  struct pollfd *p = xcalloc((size_t)c->nranks + 1, sizeof *p);
  int *who = xcalloc((size_t)c->nranks + 1, sizeof *who);
  uint64_t deadline = now_ms() + SIM_BOUND_MS;
  for (size_t i = 0; i < j->nsegs; i++) {
    chan_t *h = &ch[j->segs[i].peer];
    if (!h->involved) {
      h->involved = true;
      h->out_hdr.magic = HDR_MAGIC;
      h->out_hdr.kind = j->kind;
      h->out_hdr.seq = ++c->seq[j->segs[i].peer];
    }
    if (j->segs[i].send)
      h->out_hdr.bytes += j->segs[i].bytes;
    else
      h->in_expect += j->segs[i].bytes;
  }
  for (int r = 0; r < c->nranks; r++) {
    ch[r].out_seg = next_seg(j, 0, r, 1);
    ch[r].in_seg = next_seg(j, 0, r, 0);
  }
  for (;;) {
    int n = 0;
    for (int r = 0; r < c->nranks; r++) {
      chan_t *h = &ch[r];
      if (!h->involved)
        continue;
      short ev = 0;
      if (h->out_hdr_done < sizeof h->out_hdr || h->out_seg < j->nsegs)
        ev |= POLLOUT;
      if (h->in_hdr_done < sizeof h->in_hdr || h->in_seg < j->nsegs)
        ev |= POLLIN;
      if (ev) {
        p[n] = (struct pollfd){.fd = c->fds[r], .events = ev};
        who[n++] = r;
      }
    }
    if (n == 0)
      break;
    uint64_t now = now_ms();
    if (now >= deadline) {
      set_error(c, "simulated NCCL rank %d: %s not complete after %u ms", c->rank,
                kind_str(j->kind), SIM_BOUND_MS);
      ret = ncclSystemError;
      goto exit;
    }
    p[n] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
    int rc = poll(p, (nfds_t)n + 1, POLL_SLICE_MS);
    if (rc < 0 && errno != EINTR) {
      set_error(c, "simulated NCCL rank %d: poll: %s", c->rank, strerror(errno));
      ret = ncclSystemError;
      goto exit;
    }
    if (rc <= 0)
      continue;
    if (p[n].revents) {
      ret = SIM_ABORTED;
      goto exit;
    }
    for (int i = 0; i < n; i++) {
      int r = who[i];
      chan_t *h = &ch[r];
      if (!p[i].revents)
        continue;
      /* Send what the socket takes. */
      while ((p[i].events & POLLOUT) &&
             (h->out_hdr_done < sizeof h->out_hdr || h->out_seg < j->nsegs)) {
        const uint8_t *src;
        size_t len;
        if (h->out_hdr_done < sizeof h->out_hdr) {
          src = (const uint8_t *)&h->out_hdr + h->out_hdr_done;
          len = sizeof h->out_hdr - h->out_hdr_done;
        } else {
          src = j->segs[h->out_seg].buf + h->out_off;
          len = j->segs[h->out_seg].bytes - h->out_off;
        }
        ssize_t k = send(c->fds[r], src, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
          break;
        if (k <= 0) {
          set_error(c, "simulated NCCL rank %d: connection to rank %d lost while sending (%s): %s",
                    c->rank, r, kind_str(j->kind), k < 0 ? strerror(errno) : "nothing sent");
          ret = ncclRemoteError;
          goto exit;
        }
        if (h->out_hdr_done < sizeof h->out_hdr) {
          h->out_hdr_done += (size_t)k;
        } else if ((h->out_off += (size_t)k) == j->segs[h->out_seg].bytes) {
          h->out_off = 0;
          h->out_seg = next_seg(j, h->out_seg + 1, r, 1);
        }
      }
      /* Receive what has arrived. */
      while ((p[i].events & POLLIN) &&
             (h->in_hdr_done < sizeof h->in_hdr || h->in_seg < j->nsegs)) {
        uint8_t *dst;
        size_t len;
        if (h->in_hdr_done < sizeof h->in_hdr) {
          dst = (uint8_t *)&h->in_hdr + h->in_hdr_done;
          len = sizeof h->in_hdr - h->in_hdr_done;
        } else {
          dst = j->segs[h->in_seg].buf + h->in_off;
          len = j->segs[h->in_seg].bytes - h->in_off;
        }
        ssize_t k = recv(c->fds[r], dst, len, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
          break;
        if (k <= 0) {
          set_error(c,
                    "simulated NCCL rank %d: rank %d closed the connection during %s (it exited "
                    "or aborted its communicator)%s%s",
                    c->rank, r, kind_str(j->kind), k < 0 ? ": " : "", k < 0 ? strerror(errno) : "");
          ret = ncclRemoteError;
          goto exit;
        }
        if (h->in_hdr_done < sizeof h->in_hdr) {
          h->in_hdr_done += (size_t)k;
          if (h->in_hdr_done < sizeof h->in_hdr ||
              (h->in_hdr.magic == HDR_MAGIC && h->in_hdr.kind == j->kind &&
               h->in_hdr.seq == h->out_hdr.seq && h->in_hdr.bytes == h->in_expect))
            continue;
          if (peer_gone(c, r)) {
            set_error(c,
                      "simulated NCCL rank %d: rank %d closed the connection during %s (it "
                      "aborted its communicator in the middle of its operation #%llu, %s)",
                      c->rank, r, kind_str(j->kind), (unsigned long long)h->in_hdr.seq,
                      kind_str(h->in_hdr.kind));
            ret = ncclRemoteError;
            goto exit;
          }
          sim_cuda_fail("simulated NCCL: mismatched operations between rank %d and rank %d: "
                        "rank %d's operation #%llu with it is %s receiving %llu bytes from it, "
                        "rank %d's #%llu is %s sending %llu bytes (every rank must issue the "
                        "same collectives with the same counts in the same order)",
                        c->rank, r, c->rank, (unsigned long long)h->out_hdr.seq, kind_str(j->kind),
                        (unsigned long long)h->in_expect, r, (unsigned long long)h->in_hdr.seq,
                        kind_str(h->in_hdr.kind), (unsigned long long)h->in_hdr.bytes);
        } else if ((h->in_off += (size_t)k) == j->segs[h->in_seg].bytes) {
          h->in_off = 0;
          h->in_seg = next_seg(j, h->in_seg + 1, r, 0);
        }
      }
    }
  }
exit:
  free(ch);
  free(p);
  free(who);
  return ret;
}

static ncclResult_t run_job(ncclComm_t c, job_t *j) {
  ncclResult_t ret;
  if (j->kind == KIND_FINALIZE)
    return ncclSuccess;
  sim_cuda_device_access_begin(c->device);
  for (size_t i = 0; i < j->ncopies; i++)
    memcpy(j->copies[i].dst, j->copies[i].src, j->copies[i].bytes);
  ret = transfer(c, j);
  if (ret == ncclSuccess)
    for (size_t i = 0; i < j->nreduces; i++)
      run_reduce(&j->reduces[i], c->nranks);
  sim_cuda_device_access_end(c->device);
  return ret;
}

/* ---- the worker ------------------------------------------------------------------------------ */

static ncclResult_t rendezvous(ncclComm_t c) {
  uint64_t deadline = now_ms() + SIM_BOUND_MS;
  uint16_t port = 0, *ports = NULL;
  int root = -1;
  io_t io;
  ncclResult_t ret = ncclSuccess;
  hello_t h;
  verdict_t v;
  if ((c->listener = open_listener(&port)) < 0) {
    set_error(c, "simulated NCCL rank %d: cannot listen: %s", c->rank, strerror(errno));
    return ncclSystemError;
  }
  root = connect_loopback(c->root_port, c->wake[0], deadline, &io);
  if (root < 0) {
    set_error(c, "simulated NCCL rank %d: cannot reach the bootstrap root at 127.0.0.1:%u: %s",
              c->rank, c->root_port, io_str(io));
    return io == IO_ABORTED ? SIM_ABORTED : ncclSystemError;
  }
  memset(&h, 0, sizeof h);
  memcpy(h.magic, ID_MAGIC, ID_MAGIC_BYTES);
  memcpy(h.nonce, c->nonce, NONCE_BYTES);
  h.rank = c->rank;
  h.nranks = c->nranks;
  h.device = c->device;
  h.pid = (uint32_t)getpid();
  h.port = port;
  ports = xcalloc((size_t)c->nranks, sizeof *ports);
  if ((io = send_all(root, &h, sizeof h, c->wake[0], deadline)) != IO_OK ||
      (io = recv_all(root, &v, sizeof v, c->wake[0], deadline)) != IO_OK ||
      (v.result == ncclSuccess && (io = recv_all(root, ports, sizeof *ports * (size_t)c->nranks,
                                                 c->wake[0], deadline)) != IO_OK)) {
    set_error(c, "simulated NCCL rank %d: bootstrap with the root failed: %s", c->rank, io_str(io));
    ret = io == IO_ABORTED ? SIM_ABORTED : io == IO_CLOSED ? ncclRemoteError : ncclSystemError;
    goto exit;
  }
  if (v.result != ncclSuccess) {
    v.message[sizeof v.message - 1] = 0;
    set_error(c, "%s", v.message);
    ret = (ncclResult_t)v.result;
    goto exit;
  }
  for (int r = 0; r < c->rank; r++) {
    peer_hello_t ph;
    memcpy(ph.nonce, c->nonce, NONCE_BYTES);
    ph.rank = c->rank;
    c->fds[r] = connect_loopback(ports[r], c->wake[0], deadline, &io);
    if (c->fds[r] < 0 ||
        (io = send_all(c->fds[r], &ph, sizeof ph, c->wake[0], deadline)) != IO_OK) {
      set_error(c, "simulated NCCL rank %d: cannot connect to rank %d: %s", c->rank, r, io_str(io));
      ret = io == IO_ABORTED ? SIM_ABORTED : ncclRemoteError;
      goto exit;
    }
  }
  for (int k = c->rank + 1; k < c->nranks; k++) {
    peer_hello_t ph;
    int fd = accept_one(c->listener, c->wake[0], deadline, &io);
    if (fd >= 0 && (io = recv_all(fd, &ph, sizeof ph, c->wake[0], now_ms() + HELLO_MS)) != IO_OK) {
      close(fd);
      fd = -1;
    }
    if (fd < 0) {
      set_error(c, "simulated NCCL rank %d: waiting for ranks above it to connect: %s", c->rank,
                io_str(io));
      ret = io == IO_ABORTED ? SIM_ABORTED : ncclRemoteError;
      goto exit;
    }
    if (memcmp(ph.nonce, c->nonce, NONCE_BYTES) != 0 || ph.rank <= c->rank ||
        ph.rank >= c->nranks || c->fds[ph.rank] >= 0) {
      close(fd);
      k--; /* a stray connection */
      continue;
    }
    c->fds[ph.rank] = fd;
  }
exit:
  free(ports);
  if (root >= 0)
    close(root);
  return ret;
}

static void *worker_main(void *arg) {
  ncclComm_t c = arg;
  ncclResult_t rc = rendezvous(c);
  pthread_mutex_lock(&c->mu);
  if (rc == SIM_ABORTED) {
    pthread_mutex_unlock(&c->mu);
    return NULL;
  }
  c->state = rc;
  pthread_cond_broadcast(&c->cv);
  for (;;) {
    while (!c->stop && !c->head)
      pthread_cond_wait(&c->cv, &c->mu);
    if (c->stop)
      break;
    job_t *j = c->head;
    pthread_mutex_unlock(&c->mu);
    rc = run_job(c, j);
    pthread_mutex_lock(&c->mu);
    if (rc == SIM_ABORTED)
      break;
    c->head = j->next;
    if (!c->head)
      c->tail = NULL;
    free_job(j);
    if (rc != ncclSuccess) {
      c->state = rc;
      while (c->head) { /* nothing runs after an error */
        j = c->head;
        c->head = j->next;
        free_job(j);
      }
      c->tail = NULL;
    } else if (!c->head && c->state == ncclInProgress) {
      c->state = ncclSuccess;
    }
    pthread_cond_broadcast(&c->cv);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* ---- communicators --------------------------------------------------------------------------- */

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  ncclComm_t c;
  uint16_t port;
  int device = 0;
  if (!comm || nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
    set_error(NULL, "ncclCommInitRankConfig: bad arguments (comm %p, rank %d of %d)", (void *)comm,
              rank, nranks);
    return ncclInvalidArgument;
  }
  if (config && (config->magic != 0xcafebeef || config->size != sizeof(ncclConfig_t))) {
    set_error(NULL, "ncclCommInitRankConfig: config not initialized with NCCL_CONFIG_INITIALIZER");
    return ncclInvalidArgument;
  }
  memcpy(&port, commId.internal + 8, sizeof port);
  if (memcmp(commId.internal, ID_MAGIC, ID_MAGIC_BYTES) != 0 || port == 0) {
    set_error(NULL, "ncclCommInitRankConfig: not a unique id from ncclGetUniqueId");
    return ncclInvalidArgument;
  }
  if (cudaGetDevice(&device) != cudaSuccess) {
    set_error(NULL, "ncclCommInitRankConfig: cudaGetDevice failed");
    return ncclUnhandledCudaError;
  }
  c = xcalloc(1, sizeof *c);
  c->magic = COMM_MAGIC;
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  c->blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  memcpy(c->nonce, commId.internal + 16, NONCE_BYTES);
  c->root_port = port;
  c->listener = -1;
  c->fds = xcalloc((size_t)nranks, sizeof *c->fds);
  c->seq = xcalloc((size_t)nranks, sizeof *c->seq);
  for (int r = 0; r < nranks; r++)
    c->fds[r] = -1;
  c->state = ncclInProgress;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) != 0)
    sim_cuda_fail("simulated NCCL: pipe2: %s", strerror(errno));
  int rc = pthread_create(&c->worker, NULL, worker_main, c);
  if (rc != 0)
    sim_cuda_fail("simulated NCCL: pthread_create: %s", strerror(rc));
  pthread_mutex_lock(&live_mu);
  c->next_live = live;
  live = c;
  pthread_mutex_unlock(&live_mu);
  *comm = c;
  if (!c->blocking)
    return ncclInProgress;
  pthread_mutex_lock(&c->mu);
  while (c->state == ncclInProgress)
    pthread_cond_wait(&c->cv, &c->mu);
  ncclResult_t st = c->state;
  pthread_mutex_unlock(&c->mu);
  return st;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  ncclComm_t c = live_comm(comm, "ncclCommGetAsyncError");
  if (!c || !asyncError)
    return ncclInvalidArgument;
  pthread_mutex_lock(&c->mu);
  *asyncError = c->state;
  pthread_mutex_unlock(&c->mu);
  return ncclSuccess;
}

/* Drops this thread's open-group operations on c (it is going away). */
static void drop_group_ops(ncclComm_t c) {
  size_t k = 0;
  for (size_t i = 0; i < group_n; i++) {
    if (group_entries[i].comm == c)
      free_job(group_entries[i].job);
    else
      group_entries[k++] = group_entries[i];
  }
  group_n = k;
}

/* Stops the worker, closes everything and frees the communicator. */
static void free_comm(ncclComm_t c) {
  pthread_mutex_lock(&live_mu);
  for (ncclComm_t *pp = &live; *pp; pp = &(*pp)->next_live)
    if (*pp == c) {
      *pp = c->next_live;
      break;
    }
  pthread_mutex_unlock(&live_mu);
  drop_group_ops(c);
  pthread_mutex_lock(&c->mu);
  c->stop = true;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (write(c->wake[1], "x", 1) < 0 && errno != EAGAIN)
    sim_cuda_fail("simulated NCCL: write to the abort pipe: %s", strerror(errno));
  pthread_join(c->worker, NULL);
  for (int r = 0; r < c->nranks; r++)
    if (c->fds[r] >= 0)
      close(c->fds[r]);
  if (c->listener >= 0)
    close(c->listener);
  close(c->wake[0]);
  close(c->wake[1]);
  while (c->head) {
    job_t *j = c->head;
    c->head = j->next;
    free_job(j);
  }
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c->fds);
  free(c->seq);
  c->magic = 0;
  free(c);
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  ncclComm_t c = live_comm(comm, "ncclCommAbort");
  if (c)
    free_comm(c);
  return ncclSuccess;
}

/* Waits (bounded) until c has nothing in flight; returns its state. */
static ncclResult_t wait_idle(ncclComm_t c) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += SIM_BOUND_MS / 1000;
  pthread_mutex_lock(&c->mu);
  while (c->state == ncclInProgress)
    if (pthread_cond_timedwait(&c->cv, &c->mu, &until) == ETIMEDOUT)
      sim_cuda_fail("simulated NCCL rank %d: an operation did not complete within %u ms", c->rank,
                    SIM_BOUND_MS);
  ncclResult_t st = c->state;
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Queues j on c (taking it) after the streams' earlier work has run; the communicator's state is
 * ncclInProgress until the worker is done with it. */
static ncclResult_t submit(ncclComm_t c, job_t *j) {
  for (size_t i = 0; i < j->nstreams; i++)
    if (cudaStreamSynchronize(j->streams[i]) != cudaSuccess)
      sim_cuda_fail("simulated NCCL: cudaStreamSynchronize failed");
  pthread_mutex_lock(&c->mu);
  if (c->state != ncclSuccess && c->state != ncclInProgress) {
    ncclResult_t st = c->state;
    pthread_mutex_unlock(&c->mu);
    free_job(j);
    return st;
  }
  if (c->tail)
    c->tail->next = j;
  else
    c->head = j;
  c->tail = j;
  c->state = ncclInProgress;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return c->blocking ? wait_idle(c) : ncclInProgress;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ncclComm_t c = live_comm(comm, "ncclCommFinalize");
  if (!c)
    return ncclInvalidArgument;
  if (c->finalized) {
    set_error(c, "ncclCommFinalize: communicator finalized already");
    return ncclInvalidUsage;
  }
  c->finalized = true;
  job_t *j = xcalloc(1, sizeof *j);
  j->kind = KIND_FINALIZE;
  return submit(c, j);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  ncclComm_t c = live_comm(comm, "ncclCommDestroy");
  if (!c)
    return ncclInvalidArgument;
  (void)wait_idle(c); /* NCCL flushes what was issued (finalizing) before it frees */
  free_comm(c);
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
  switch (result) {
  case ncclSuccess:
    return "no error";
  case ncclUnhandledCudaError:
    return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
  case ncclSystemError:
    return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  case ncclInternalError:
    return "internal error - please report this issue to the NCCL developers";
  case ncclInvalidArgument:
    return "invalid argument (run with NCCL_DEBUG=WARN for details)";
  case ncclInvalidUsage:
    return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  case ncclRemoteError:
    return "remote process exited or there was a network error";
  case ncclInProgress:
    return "NCCL operation in progress";
  default:
    return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  ncclComm_t c = live_comm(comm, "ncclGetLastError");
  if (!c) {
    memcpy(last_error_copy, thread_error, sizeof last_error_copy);
  } else {
    pthread_mutex_lock(&c->mu);
    memcpy(last_error_copy, c->last_error, sizeof last_error_copy);
    pthread_mutex_unlock(&c->mu);
  }
  return last_error_copy;
}

/* ---- collectives ----------------------------------------------------------------------------- */

/* The checks every operation makes when it is issued; returns the error to report, or
 * ncclSuccess. An operation issued while the communicator is still ncclInProgress aborts. */
static ncclResult_t issue_check(ncclComm_t c, const char *what) {
  if (!c) {
    set_error(NULL, "%s: communicator is NULL", what);
    return ncclInvalidArgument;
  }
  pthread_mutex_lock(&c->mu);
  ncclResult_t st = c->state;
  pthread_mutex_unlock(&c->mu);
  if (st == ncclInProgress)
    sim_cuda_fail("%s on rank %d: issued while the non-blocking communicator is still "
                  "ncclInProgress (poll ncclCommGetAsyncError until it leaves ncclInProgress "
                  "first)",
                  what, c->rank);
  if (st != ncclSuccess)
    return st;
  if (c->finalized) {
    set_error(c, "%s: communicator finalized", what);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* Aborts unless [p, p+bytes) is device memory of the stream's device and the communicator's. */
static void check_buffer(ncclComm_t c, cudaStream_t stream, const void *p, size_t bytes,
                         const char *what) {
  struct cudaPointerAttributes a;
  if (bytes == 0)
    return;
  sim_cuda_check_device(stream, p, bytes, what);
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.device != c->device)
    sim_cuda_fail("%s: %p is memory of device %d, the communicator's device is %d", what, p,
                  a.device, c->device);
}

/* The job that an operation on c adds to: this thread's open group's, or a new one. */
static job_t *job_for(ncclComm_t c) {
  if (group_depth == 0)
    return xcalloc(1, sizeof(job_t));
  for (size_t i = 0; i < group_n; i++)
    if (group_entries[i].comm == c)
      return group_entries[i].job;
  grow((void **)&group_entries, &group_cap, group_n + 1, sizeof *group_entries);
  group_entries[group_n] = (group_entry_t){c, xcalloc(1, sizeof(job_t))};
  return group_entries[group_n++].job;
}

/* Submits j at once outside a group; inside one, ncclGroupEnd does. */
static ncclResult_t issued(ncclComm_t c, job_t *j) {
  return group_depth == 0 ? submit(c, j) : ncclSuccess;
}

static ncclResult_t failed(ncclResult_t rc) {
  if (group_depth > 0 && group_error == ncclSuccess)
    group_error = rc;
  return rc;
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  ncclComm_t c = live_comm(comm, "ncclAllGather");
  ncclResult_t rc = issue_check(c, "ncclAllGather");
  size_t esz = type_size(datatype);
  if (rc != ncclSuccess)
    return failed(rc);
  if (esz == 0 || (sendcount && (!sendbuff || !recvbuff))) {
    set_error(c, "ncclAllGather: bad datatype %d or NULL buffer", (int)datatype);
    return failed(ncclInvalidArgument);
  }
  size_t bytes = sendcount * esz;
  uint8_t *own = (uint8_t *)recvbuff + (size_t)c->rank * bytes;
  check_buffer(c, stream, sendbuff, bytes, "ncclAllGather (sendbuff)");
  check_buffer(c, stream, recvbuff, bytes * (size_t)c->nranks, "ncclAllGather (recvbuff)");
  if (bytes && (const uint8_t *)sendbuff != own && (const uint8_t *)sendbuff < own + bytes &&
      own < (const uint8_t *)sendbuff + bytes)
    sim_cuda_fail("ncclAllGather: sendbuff %p overlaps recvbuff's block %p without being it",
                  sendbuff, (void *)own);
  job_t *j = job_for(c);
  j->kind |= KIND_ALLGATHER;
  add_stream(j, stream);
  add_copy(j, own, sendbuff, bytes);
  for (int r = 0; r < c->nranks; r++)
    if (r != c->rank) {
      add_seg(j, r, 1, sendbuff, bytes);
      add_seg(j, r, 0, (uint8_t *)recvbuff + (size_t)r * bytes, bytes);
    }
  return issued(c, j);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  ncclComm_t c = live_comm(comm, "ncclAllReduce");
  ncclResult_t rc = issue_check(c, "ncclAllReduce");
  size_t esz = type_size(datatype);
  if (rc != ncclSuccess)
    return failed(rc);
  if (esz == 0 || (op != ncclSum && op != ncclProd && op != ncclMax && op != ncclMin) ||
      (count && (!sendbuff || !recvbuff))) {
    set_error(c, "ncclAllReduce: unsimulated datatype %d or op %d, or NULL buffer", (int)datatype,
              (int)op);
    return failed(ncclInvalidArgument);
  }
  size_t bytes = count * esz;
  check_buffer(c, stream, sendbuff, bytes, "ncclAllReduce (sendbuff)");
  check_buffer(c, stream, recvbuff, bytes, "ncclAllReduce (recvbuff)");
  if (sendbuff != recvbuff && (const uint8_t *)sendbuff < (const uint8_t *)recvbuff + bytes &&
      (const uint8_t *)recvbuff < (const uint8_t *)sendbuff + bytes)
    sim_cuda_fail("ncclAllReduce: sendbuff %p and recvbuff %p overlap without being equal",
                  sendbuff, recvbuff);
  job_t *j = job_for(c);
  j->kind |= KIND_ALLREDUCE;
  add_stream(j, stream);
  if (bytes == 0)
    return issued(c, j);
  uint8_t *tmp = xcalloc((size_t)c->nranks, bytes);
  grow((void **)&j->reduces, &j->reduces_cap, j->nreduces + 1, sizeof *j->reduces);
  j->reduces[j->nreduces++] = (struct reduce){recvbuff, tmp, count, datatype, op};
  add_copy(j, tmp + (size_t)c->rank * bytes, sendbuff, bytes);
  for (int r = 0; r < c->nranks; r++)
    if (r != c->rank) {
      add_seg(j, r, 1, sendbuff, bytes);
      add_seg(j, r, 0, tmp + (size_t)r * bytes, bytes);
    }
  return issued(c, j);
}

static ncclResult_t p2p(const void *buf, size_t count, ncclDataType_t datatype, int peer,
                        ncclComm_t comm, cudaStream_t stream, int send) {
  const char *what = send ? "ncclSend" : "ncclRecv";
  ncclComm_t c = live_comm(comm, what);
  ncclResult_t rc = issue_check(c, what);
  size_t esz = type_size(datatype);
  if (rc != ncclSuccess)
    return failed(rc);
  if (esz == 0 || peer < 0 || peer >= c->nranks || (count && !buf)) {
    set_error(c, "%s: bad datatype %d, peer %d of %d or NULL buffer", what, (int)datatype, peer,
              c->nranks);
    return failed(ncclInvalidArgument);
  }
  if (peer == c->rank)
    sim_cuda_fail("%s to itself (rank %d): not simulated", what, peer);
  check_buffer(c, stream, buf, count * esz, what);
  job_t *j = job_for(c);
  j->kind |= KIND_P2P;
  add_stream(j, stream);
  add_seg(j, peer, send, buf, count * esz);
  return issued(c, j);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(sendbuff, count, datatype, peer, comm, stream, 1);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(recvbuff, count, datatype, peer, comm, stream, 0);
}

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  ncclResult_t ret = group_error;
  bool in_progress = false;
  if (group_depth == 0) {
    set_error(NULL, "ncclGroupEnd: no group open");
    return ncclInvalidUsage;
  }
  if (--group_depth > 0)
    return ncclSuccess;
  for (size_t i = 0; i < group_n; i++) {
    if (ret != ncclSuccess) { /* an operation failed: NCCL drops the whole group */
      free_job(group_entries[i].job);
      continue;
    }
    ncclResult_t rc = submit(group_entries[i].comm, group_entries[i].job);
    if (rc == ncclInProgress)
      in_progress = true;
    else if (rc != ncclSuccess)
      ret = rc;
  }
  free(group_entries);
  group_entries = NULL;
  group_n = group_cap = 0;
  group_error = ncclSuccess;
  return ret != ncclSuccess ? ret : in_progress ? ncclInProgress : ncclSuccess;
}
