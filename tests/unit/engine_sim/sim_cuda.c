/* A CPU simulation of the CUDA runtime (the API of fake/cuda_runtime_api.h), made to expose the
 * orchestration bugs of host code that drives a GPU: a missing dependency between streams, a
 * host read of a buffer before the stream that writes it was synchronized, a pointer of the
 * wrong kind or size handed to a copy or a kernel, a host dereference of device memory.
 *
 * Memory. Device memory (cudaMalloc) is mapped with no access while no simulated work runs, so
 * host code that dereferences a device pointer faults at once; a SIGSEGV handler names the
 * allocation before the fault goes on to the previous handler (ASan's, or the default). Work
 * runs with the device's memory opened. Device and pinned memory (cudaMallocHost,
 * cudaHostAlloc) are filled at allocation with a poison pattern that is a quiet NaN as f32,
 * f64 and bf16 and a huge number as an integer, so reading memory that nothing wrote gives
 * results that differ from the CPU engine's, or an out-of-range row that a kernel's check
 * catches. Every allocation is in a registry (cudaPointerGetAttributes answers from it), and
 * every copy, memset and kernel checks its pointers against it: a device-side range must lie
 * wholly inside one live device allocation of the stream's device, and the memcpy kind must
 * match where the pointers point. A wrong call aborts with a message and a backtrace.
 *
 * Streams are lazy. Asynchronous work (copies, memsets, kernels, event records, waits) is only
 * appended to the stream's FIFO; it runs when something forces it: cudaStreamSynchronize runs
 * the stream, cudaEventSynchronize runs the recording stream up to the record, a wait entry
 * (cudaStreamWaitEvent) first runs the recorded stream up to the record that was the event's
 * latest when the wait was enqueued, and cudaDeviceSynchronize, the synchronous cudaMemcpy and
 * cudaMemset, cudaFree and cudaFreeHost run every stream of the device first, as CUDA
 * synchronizes there. That is the latest schedule CUDA allows, so an unsynchronized read sees
 * the value from before the write (often the poison) instead of racing and mostly winning as on
 * a GPU. Copies between device and pageable host memory are lazy too: CUDA only says they
 * "might be synchronous", so a correct program cannot rely on either behaviour. The legacy
 * default stream (0) keeps its implicit order with blocking streams (cudaStreamCreate);
 * cudaStreamNonBlocking streams have none. cudaStreamQuery and cudaEventQuery run the work and
 * answer cudaSuccess: a poller then never spins.
 *
 * One recursive mutex covers everything, and simulated work runs on the thread that forces it,
 * under it: several ranks run as threads of one process, each on its own device. No blocking
 * call (a communicator) ever runs under the mutex. Destroyed streams and events stay in the
 * lists, marked dead, so that a stale handle is recognized instead of read after free. */
#include "sim_cuda.h"

#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A fixed table so that the SIGSEGV handler can scan it without following freed memory. */
#define MAX_ALLOCS 8192
/* Address space reserved per device for its memory (nothing is committed until written). */
#define ARENA_BYTES ((size_t)16 << 30)

typedef struct alloc {
  char *base; /* NULL: free slot */
  size_t size;
  int pinned; /* 1: pinned host memory, 0: device memory */
  int device; /* the device current at allocation */
} alloc_t;

typedef struct op {
  struct op *next;
  uint64_t seq;
  void (*fn)(void *args); /* NULL for event records and waits */
  void *args;
  struct CUstream_st *wait_stream; /* a wait: run wait_stream up to wait_seq first */
  uint64_t wait_seq;
  const char *what;
} op_t;

struct CUstream_st {
  int device;
  unsigned flags;
  int legacy;
  int dead;
  uint64_t enqueued, executed; /* op seqs are 1, 2, ... per stream */
  op_t *head, *tail;
  struct CUstream_st *next;
};

struct CUevent_st {
  int device;
  int dead;
  struct CUstream_st *stream; /* of the latest record; NULL: never recorded */
  uint64_t seq;
  struct CUevent_st *next;
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t mu;
static int device_count = 1;
static _Thread_local int current_device;
static _Thread_local cudaError_t last_error;

static alloc_t allocs[MAX_ALLOCS];
static size_t allocs_used; /* slots [0, allocs_used) may be live */
static size_t device_bytes[SIM_CUDA_MAX_DEVICES], device_limit[SIM_CUDA_MAX_DEVICES];
static int device_open[SIM_CUDA_MAX_DEVICES];
/* Device memory: one reserved region per device, handed out upwards with a guard page after
 * each allocation and reset when the device holds no allocation, so that opening or closing a
 * device's memory is one mprotect of [base, top). (One mprotect per allocation made 1.4 million
 * calls in one run of the test, most of its time, in lock contention.) */
static struct arena {
  char *base, *top;
  size_t live;
} arenas[SIM_CUDA_MAX_DEVICES];
static struct CUstream_st legacy_streams[SIM_CUDA_MAX_DEVICES];
static struct CUstream_st *streams; /* every stream ever created, legacy ones included */
static struct CUevent_st *events;
static size_t page_size;
static struct sigaction previous_segv;
/* For SIM_CUDA_REPORT: allocations made per device, and what cudaPointerGetAttributes found. */
static size_t device_allocs_made[SIM_CUDA_MAX_DEVICES], pinned_allocs_made[SIM_CUDA_MAX_DEVICES];
static size_t queries_pinned, queries_device, queries_pageable;
/* sim_cuda_counts: the host's waits for each device and the copies from its memory to the host. */
static sim_cuda_counts_t counts[SIM_CUDA_MAX_DEVICES];

static void count_sync(int device) {
  if (device >= 0 && device < SIM_CUDA_MAX_DEVICES)
    counts[device].syncs++;
}

/* ---- failing loudly ------------------------------------------------------------------------- */

void sim_cuda_fail(const char *fmt, ...) {
  void *frames[64];
  int n;
  va_list ap;
  fputs("sim_cuda: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\n", stderr);
  fflush(stderr);
  n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  abort();
}

static void on_segv(int sig, siginfo_t *si, void *context) {
  const char *addr = si->si_addr;
  char msg[320];
  int len = 0;
  (void)sig;
  (void)context;
  for (int d = 0; d < SIM_CUDA_MAX_DEVICES && len == 0; d++)
    if (arenas[d].base && addr >= arenas[d].base && addr < arenas[d].base + ARENA_BYTES)
      len = snprintf(msg, sizeof(msg),
                     "sim_cuda: segmentation fault at %p, in device %d's memory: host code "
                     "dereferenced a device pointer\n",
                     (const void *)addr, d);
  for (size_t i = 0; i < allocs_used && len > 0; i++) {
    const alloc_t *a = &allocs[i];
    if (a->base && !a->pinned && addr >= a->base && addr < a->base + a->size + page_size) {
      len += snprintf(msg + len, sizeof(msg) - (size_t)len,
                      "sim_cuda: at offset %zu of the %zu-byte allocation at %p\n",
                      (size_t)(addr - a->base), a->size, (const void *)a->base);
      break;
    }
  }
  if (len > 0 && write(2, msg, (size_t)len < sizeof(msg) ? (size_t)len : sizeof(msg) - 1) < 0)
    len = 0;
  /* Return into the faulting access under the previous handler, which reports it. */
  sigaction(SIGSEGV, &previous_segv, NULL);
}

/* Puts on_segv in front of whatever handler is there now (a test framework may have swapped
 * handlers since the last allocation). */
static void install_segv_handler(void) {
  struct sigaction now, sa;
  if (sigaction(SIGSEGV, NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO) &&
      now.sa_sigaction == on_segv)
    return;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous_segv);
}

/* ---- state ---------------------------------------------------------------------------------- */

static void init(void) {
  pthread_mutexattr_t attr;
  const char *env = getenv("SIM_CUDA_DEVICES");
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&mu, &attr);
  pthread_mutexattr_destroy(&attr);
  page_size = (size_t)sysconf(_SC_PAGESIZE);
  if (env && *env) {
    int n = atoi(env);
    device_count = n < 0 ? 0 : n > SIM_CUDA_MAX_DEVICES ? SIM_CUDA_MAX_DEVICES : n;
  }
  for (int d = 0; d < SIM_CUDA_MAX_DEVICES; d++) {
    legacy_streams[d].device = d;
    legacy_streams[d].legacy = 1;
    legacy_streams[d].next = streams;
    streams = &legacy_streams[d];
  }
}

static void lock(void) {
  pthread_once(&once, init);
  pthread_mutex_lock(&mu);
}

static void unlock(void) { pthread_mutex_unlock(&mu); }

static cudaError_t done(cudaError_t e) {
  if (e != cudaSuccess)
    last_error = e;
  unlock();
  return e;
}

static alloc_t *find_alloc(const void *p) {
  const char *c = p;
  if (!p)
    return NULL;
  for (size_t i = 0; i < allocs_used; i++)
    if (allocs[i].base && c >= allocs[i].base && c < allocs[i].base + allocs[i].size)
      return &allocs[i];
  return NULL;
}

static alloc_t *new_alloc_slot(void) {
  for (size_t i = 0; i < allocs_used; i++)
    if (!allocs[i].base)
      return &allocs[i];
  if (allocs_used == MAX_ALLOCS)
    sim_cuda_fail("more than %d live allocations", MAX_ALLOCS);
  return &allocs[allocs_used++];
}

static void protect(char *p, size_t bytes, int open) {
  if (bytes && mprotect(p, bytes, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
    sim_cuda_fail("mprotect of %zu bytes of device memory at %p failed", bytes, (void *)p);
}

static void open_device(int d) {
  if (device_open[d]++ == 0)
    protect(arenas[d].base, (size_t)(arenas[d].top - arenas[d].base), 1);
}

static void close_device(int d) {
  if (--device_open[d] == 0)
    protect(arenas[d].base, (size_t)(arenas[d].top - arenas[d].base), 0);
}

void sim_cuda_poison(void *p, size_t n) {
  /* Bytes c0 7f repeated from an even address: 0x7fc0 (bf16), 0x7fc07fc0 (f32) and
   * 0x7fc07fc07fc07fc0 (f64) are quiet NaNs. */
  static const unsigned char pair[2] = {0xc0, 0x7f};
  unsigned char chunk[4096];
  unsigned char *b = p;
  if (n > 0 && ((uintptr_t)b & 1)) {
    *b++ = pair[1];
    n--;
  }
  for (size_t i = 0; i < sizeof(chunk); i++)
    chunk[i] = pair[i & 1];
  for (size_t k; n > 0; b += k, n -= k) {
    k = n < sizeof(chunk) ? n : sizeof(chunk);
    memcpy(b, chunk, k);
  }
}

static const char *where(const alloc_t *a) {
  return !a ? "pageable host memory" : a->pinned ? "pinned host memory" : "device memory";
}

/* ---- streams -------------------------------------------------------------------------------- */

static struct CUstream_st *resolve_stream(cudaStream_t s, const char *what) {
  if (s == NULL || s == cudaStreamLegacy)
    return &legacy_streams[current_device];
  if (s == cudaStreamPerThread)
    sim_cuda_fail("%s: cudaStreamPerThread is not simulated", what);
  for (struct CUstream_st *t = streams; t; t = t->next)
    if (t == s) {
      if (t->dead)
        sim_cuda_fail("%s: stream %p was destroyed", what, (void *)s);
      return t;
    }
  sim_cuda_fail("%s: %p is not a stream", what, (void *)s);
}

static struct CUevent_st *resolve_event(cudaEvent_t e, const char *what) {
  for (struct CUevent_st *t = events; t; t = t->next)
    if (t == e) {
      if (t->dead)
        sim_cuda_fail("%s: event %p was destroyed", what, (void *)e);
      return t;
    }
  sim_cuda_fail("%s: %p is not an event", what, (void *)e);
}

static uint64_t append(struct CUstream_st *s, void (*fn)(void *), void *args,
                       struct CUstream_st *wait_stream, uint64_t wait_seq, const char *what) {
  op_t *op = calloc(1, sizeof(*op));
  if (!op)
    sim_cuda_fail("out of host memory");
  op->seq = ++s->enqueued;
  op->fn = fn;
  op->args = args;
  op->wait_stream = wait_stream;
  op->wait_seq = wait_seq;
  op->what = what;
  if (s->tail)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  return op->seq;
}

/* Appends work to s after the implicit waits of the legacy default stream: work on it waits for
 * the blocking streams of its device, and work on a blocking stream waits for it. */
static uint64_t enqueue(struct CUstream_st *s, void (*fn)(void *), void *args,
                        struct CUstream_st *wait_stream, uint64_t wait_seq, const char *what) {
  if (s->legacy) {
    for (struct CUstream_st *t = streams; t; t = t->next)
      if (!t->legacy && !t->dead && t->device == s->device && !(t->flags & cudaStreamNonBlocking) &&
          t->enqueued > t->executed)
        append(s, NULL, NULL, t, t->enqueued, "implicit wait for a blocking stream");
  } else if (!(s->flags & cudaStreamNonBlocking)) {
    struct CUstream_st *l = &legacy_streams[s->device];
    if (l->enqueued > l->executed)
      append(s, NULL, NULL, l, l->enqueued, "implicit wait for the legacy stream");
  }
  return append(s, fn, args, wait_stream, wait_seq, what);
}

static void run_until(struct CUstream_st *s, uint64_t seq) {
  if (s->executed >= seq)
    return;
  open_device(s->device);
  while (s->executed < seq) {
    op_t *op = s->head;
    s->head = op->next;
    if (!s->head)
      s->tail = NULL;
    /* Waits only name records enqueued before them, so this never comes back to s's future. */
    if (op->wait_stream)
      run_until(op->wait_stream, op->wait_seq);
    if (op->fn)
      op->fn(op->args);
    s->executed = op->seq;
    free(op->args);
    free(op);
  }
  close_device(s->device);
}

static void drain_device(int d) {
  for (struct CUstream_st *t = streams; t; t = t->next)
    if (t->device == d && !t->dead)
      run_until(t, t->enqueued);
}

/* ---- copies --------------------------------------------------------------------------------- */

typedef struct copy_args {
  char *dst;
  const char *src;
  size_t dpitch, spitch, width, height;
  const char *what;
} copy_args_t;

static void run_copy(void *p) {
  const copy_args_t *a = p;
  for (size_t r = 0; r < a->height; r++) {
    char *d = a->dst + r * a->dpitch;
    const char *s = a->src + r * a->spitch;
    if (d < s + a->width && s < d + a->width)
      sim_cuda_fail("%s: row %zu of %zu bytes overlaps its source (dst %p, src %p)", a->what, r,
                    a->width, (void *)d, (const void *)s);
    memcpy(d, s, a->width);
  }
}

typedef struct set_args {
  char *dst;
  int value;
  size_t count;
} set_args_t;

static void run_set(void *p) {
  const set_args_t *a = p;
  memset(a->dst, a->value, a->count);
}

/* Checks one side of a copy: `bytes` from p in one allocation when p is in one, the kind of
 * memory the copy kind names, the stream's device for device memory. Returns 1 for device. */
static int check_side(const void *p, size_t bytes, int want_device, int any, int device,
                      const char *what, const char *side) {
  alloc_t *a = find_alloc(p);
  if (!p)
    sim_cuda_fail("%s: %s is NULL", what, side);
  if (a && bytes > (size_t)(a->base + a->size - (const char *)p))
    sim_cuda_fail("%s: %s %p + %zu bytes overruns its %zu-byte allocation of %s at %p (offset "
                  "%zu)",
                  what, side, p, bytes, a->size, where(a), (void *)a->base,
                  (size_t)((const char *)p - a->base));
  if (!any && want_device != (a && !a->pinned))
    sim_cuda_fail("%s: %s %p is %s, but the copy kind says %s memory", what, side, p, where(a),
                  want_device ? "device" : "host");
  if (a && !a->pinned && a->device != device)
    sim_cuda_fail("%s: %s %p is memory of device %d, used on device %d", what, side, p, a->device,
                  device);
  return a && !a->pinned;
}

/* Checks a copy's pointers and kind; returns 1 when it goes from device to host memory. */
static int check_copy(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                      size_t height, enum cudaMemcpyKind kind, int device, const char *what) {
  int dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  int src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  int any = kind == cudaMemcpyDefault;
  if ((int)kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault)
    sim_cuda_fail("%s: unknown copy kind %d", what, (int)kind);
  if (dpitch < width || spitch < width)
    sim_cuda_fail("%s: pitches %zu (dst) and %zu (src) below the row width %zu", what, dpitch,
                  spitch, width);
  int to_dev = check_side(dst, (height - 1) * dpitch + width, dst_dev, any, device, what, "dst");
  int from_dev = check_side(src, (height - 1) * spitch + width, src_dev, any, device, what, "src");
  if (height == 1 && (const char *)dst < (const char *)src + width &&
      (const char *)src < (const char *)dst + width)
    sim_cuda_fail("%s: %zu bytes from %p overlap their destination %p", what, width, src, dst);
  return from_dev && !to_dev;
}

static copy_args_t *copy_args(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, const char *what) {
  copy_args_t *a = malloc(sizeof(*a));
  if (!a)
    sim_cuda_fail("out of host memory");
  a->dst = dst;
  a->src = src;
  a->dpitch = dpitch;
  a->spitch = spitch;
  a->width = width;
  a->height = height;
  a->what = what;
  return a;
}

static cudaError_t copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                          size_t height, enum cudaMemcpyKind kind, int async, cudaStream_t stream,
                          const char *what) {
  struct CUstream_st *s;
  copy_args_t *a;
  lock();
  s = resolve_stream(async ? stream : NULL, what);
  if (width == 0 || height == 0)
    return done(cudaSuccess);
  if (check_copy(dst, dpitch, src, spitch, width, height, kind, s->device, what) &&
      s->device < SIM_CUDA_MAX_DEVICES) {
    counts[s->device].d2h_copies++;
    counts[s->device].d2h_bytes += width * height;
  }
  a = copy_args(dst, dpitch, src, spitch, width, height, what);
  if (async) {
    enqueue(s, run_copy, a, NULL, 0, what);
  } else {
    count_sync(s->device);
    drain_device(s->device);
    open_device(s->device);
    run_copy(a);
    close_device(s->device);
    free(a);
  }
  return done(cudaSuccess);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  return copy2d(dst, count, src, count, count, 1, kind, 0, NULL, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy2d(dst, count, src, count, count, 1, kind, 1, stream, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height, enum cudaMemcpyKind kind) {
  return copy2d(dst, dpitch, src, spitch, width, height, kind, 0, NULL, "cudaMemcpy2D");
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, enum cudaMemcpyKind kind,
                              cudaStream_t stream) {
  return copy2d(dst, dpitch, src, spitch, width, height, kind, 1, stream, "cudaMemcpy2DAsync");
}

static cudaError_t set(void *p, int value, size_t count, int async, cudaStream_t stream,
                       const char *what) {
  struct CUstream_st *s;
  set_args_t *a;
  lock();
  s = resolve_stream(async ? stream : NULL, what);
  if (count == 0)
    return done(cudaSuccess);
  check_side(p, count, 1, 0, s->device, what, "devPtr");
  if (!(a = malloc(sizeof(*a))))
    sim_cuda_fail("out of host memory");
  a->dst = p;
  a->value = value;
  a->count = count;
  if (async) {
    enqueue(s, run_set, a, NULL, 0, what);
  } else {
    count_sync(s->device);
    drain_device(s->device);
    open_device(s->device);
    run_set(a);
    close_device(s->device);
    free(a);
  }
  return done(cudaSuccess);
}

cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  return set(devPtr, value, count, 0, NULL, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
  return set(devPtr, value, count, 1, stream, "cudaMemsetAsync");
}

/* ---- devices and errors ---------------------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count) {
  lock();
  if (!count)
    return done(cudaErrorInvalidValue);
  *count = device_count;
  return done(device_count > 0 ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  lock();
  if (device < 0 || device >= device_count)
    return done(cudaErrorInvalidDevice);
  current_device = device;
  return done(cudaSuccess);
}

cudaError_t cudaGetDevice(int *device) {
  lock();
  if (!device)
    return done(cudaErrorInvalidValue);
  *device = current_device;
  return done(cudaSuccess);
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
  char id[32];
  int n;
  lock();
  if (device < 0 || device >= device_count)
    return done(cudaErrorInvalidDevice);
  n = snprintf(id, sizeof(id), "0000:%02X:00.0", 0x18 + 0x10 * device);
  if (!pciBusId || len <= n)
    return done(cudaErrorInvalidValue);
  memcpy(pciBusId, id, (size_t)n + 1);
  return done(cudaSuccess);
}

cudaError_t cudaDeviceSynchronize(void) {
  lock();
  count_sync(current_device);
  drain_device(current_device);
  return done(cudaSuccess);
}

const char *cudaGetErrorName(cudaError_t error) {
  switch (error) {
  case cudaSuccess:
    return "cudaSuccess";
  case cudaErrorInvalidValue:
    return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation:
    return "cudaErrorMemoryAllocation";
  case cudaErrorInitializationError:
    return "cudaErrorInitializationError";
  case cudaErrorNoDevice:
    return "cudaErrorNoDevice";
  case cudaErrorInvalidDevice:
    return "cudaErrorInvalidDevice";
  case cudaErrorInvalidResourceHandle:
    return "cudaErrorInvalidResourceHandle";
  case cudaErrorNotReady:
    return "cudaErrorNotReady";
  case cudaErrorIllegalAddress:
    return "cudaErrorIllegalAddress";
  case cudaErrorUnknown:
    break;
  }
  return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t error) {
  switch (error) {
  case cudaSuccess:
    return "no error";
  case cudaErrorInvalidValue:
    return "invalid argument";
  case cudaErrorMemoryAllocation:
    return "out of memory";
  case cudaErrorInitializationError:
    return "initialization error";
  case cudaErrorNoDevice:
    return "no CUDA-capable device is detected";
  case cudaErrorInvalidDevice:
    return "invalid device ordinal";
  case cudaErrorInvalidResourceHandle:
    return "invalid resource handle";
  case cudaErrorNotReady:
    return "device not ready";
  case cudaErrorIllegalAddress:
    return "an illegal memory access was encountered";
  case cudaErrorUnknown:
    break;
  }
  return "unknown error";
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

/* ---- memory --------------------------------------------------------------------------------- */

cudaError_t cudaMalloc(void **devPtr, size_t size) {
  alloc_t *a;
  struct arena *ar;
  size_t span;
  char *p;
  int d;
  lock();
  d = current_device;
  if (!devPtr)
    return done(cudaErrorInvalidValue);
  if (size == 0) {
    *devPtr = NULL;
    return done(cudaSuccess);
  }
  if (device_limit[d] && (size > device_limit[d] || device_bytes[d] > device_limit[d] - size))
    return done(cudaErrorMemoryAllocation);
  ar = &arenas[d];
  if (!ar->base) {
    p = mmap(NULL, ARENA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      return done(cudaErrorMemoryAllocation);
    ar->base = ar->top = p;
  }
  /* Whole pages and a page between allocations, so that the poison and the reset stay per
   * allocation and an overrun while the device is closed faults. */
  span = (size + page_size - 1) / page_size * page_size + page_size;
  if (span > ARENA_BYTES - (size_t)(ar->top - ar->base))
    return done(cudaErrorMemoryAllocation);
  p = ar->top;
  ar->top += span;
  install_segv_handler();
  a = new_alloc_slot();
  a->base = p;
  a->size = size;
  a->pinned = 0;
  a->device = d;
  protect(p, span - page_size, 1);
  sim_cuda_poison(p, size);
  if (device_open[d])
    protect(p + span - page_size, page_size, 1); /* [base, top) is open: keep it one range */
  else
    protect(p, span - page_size, 0);
  ar->live++;
  device_bytes[d] += size;
  device_allocs_made[d]++;
  *devPtr = p;
  return done(cudaSuccess);
}

/* The current device's limit (sim_cuda_set_memory_limit) as its total, what it holds taken off
 * for the free figure; a device with no limit reports 16 GiB. */
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  size_t total;
  lock();
  if (!free_bytes || !total_bytes)
    return done(cudaErrorInvalidValue);
  total = device_limit[current_device] ? device_limit[current_device] : (size_t)16 << 30;
  *total_bytes = total;
  *free_bytes = device_bytes[current_device] < total ? total - device_bytes[current_device] : 0;
  return done(cudaSuccess);
}

cudaError_t cudaFree(void *devPtr) {
  struct arena *ar;
  alloc_t *a;
  lock();
  if (!devPtr)
    return done(cudaSuccess);
  a = find_alloc(devPtr);
  if (!a || a->pinned || a->base != (char *)devPtr)
    sim_cuda_fail("cudaFree(%p): not the start of a live cudaMalloc allocation (%s%s)", devPtr,
                  where(a), a && a->base != (char *)devPtr ? ", inside one" : "");
  drain_device(a->device);
  drain_device(current_device);
  ar = &arenas[a->device];
  /* The range is not reused until the device is empty; its pages stay, since faulting fresh
   * pages in was most of the test's time. */
  device_bytes[a->device] -= a->size;
  if (--ar->live == 0) {
    protect(ar->base, (size_t)(ar->top - ar->base), 0);
    ar->top = ar->base;
  }
  memset(a, 0, sizeof(*a));
  return done(cudaSuccess);
}

cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags) {
  alloc_t *a;
  void *p = NULL;
  lock();
  if (!pHost || (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped |
                                     cudaHostAllocWriteCombined)))
    return done(cudaErrorInvalidValue);
  if (size == 0) {
    *pHost = NULL;
    return done(cudaSuccess);
  }
  if (posix_memalign(&p, page_size, size) != 0)
    return done(cudaErrorMemoryAllocation);
  a = new_alloc_slot();
  a->base = p;
  a->size = size;
  a->pinned = 1;
  a->device = current_device;
  pinned_allocs_made[current_device]++;
  sim_cuda_poison(p, size);
  *pHost = p;
  return done(cudaSuccess);
}

cudaError_t cudaMallocHost(void **ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void *ptr) {
  alloc_t *a;
  lock();
  if (!ptr)
    return done(cudaSuccess);
  a = find_alloc(ptr);
  if (!a || !a->pinned || a->base != (char *)ptr)
    sim_cuda_fail("cudaFreeHost(%p): not the start of a live pinned allocation (%s%s)", ptr,
                  where(a), a && a->base != (char *)ptr ? ", inside one" : "");
  drain_device(a->device);
  drain_device(current_device);
  free(a->base);
  memset(a, 0, sizeof(*a));
  return done(cudaSuccess);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
  alloc_t *a;
  lock();
  if (!attributes)
    return done(cudaErrorInvalidValue);
  memset(attributes, 0, sizeof(*attributes));
  a = find_alloc(ptr);
  if (!a) {
    queries_pageable++;
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;
    attributes->hostPointer = (void *)ptr;
  } else if (a->pinned) {
    queries_pinned++;
    attributes->type = cudaMemoryTypeHost;
    attributes->device = a->device;
    attributes->devicePointer = (void *)ptr; /* mapped, as every pinned allocation under UVA */
    attributes->hostPointer = (void *)ptr;
  } else {
    queries_device++;
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = a->device;
    attributes->devicePointer = (void *)ptr;
  }
  return done(cudaSuccess);
}

/* ---- streams and events --------------------------------------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  struct CUstream_st *s;
  lock();
  if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking))
    return done(cudaErrorInvalidValue);
  if (!(s = calloc(1, sizeof(*s))))
    return done(cudaErrorMemoryAllocation);
  s->device = current_device;
  s->flags = flags;
  s->next = streams;
  streams = s;
  *pStream = s;
  return done(cudaSuccess);
}

cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
  return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  struct CUstream_st *s;
  lock();
  s = resolve_stream(stream, "cudaStreamDestroy");
  if (s->legacy)
    sim_cuda_fail("cudaStreamDestroy of the legacy default stream");
  /* CUDA lets queued work finish after the call; running it now is that, early. */
  run_until(s, s->enqueued);
  s->dead = 1;
  return done(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  struct CUstream_st *s;
  lock();
  s = resolve_stream(stream, "cudaStreamSynchronize");
  count_sync(s->device);
  run_until(s, s->enqueued);
  return done(cudaSuccess);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  struct CUstream_st *s;
  struct CUevent_st *e;
  lock();
  s = resolve_stream(stream, "cudaStreamWaitEvent");
  e = resolve_event(event, "cudaStreamWaitEvent");
  if (flags != cudaEventWaitDefault)
    return done(cudaErrorInvalidValue);
  if (e->stream) /* an event never recorded is complete: no wait */
    enqueue(s, NULL, NULL, e->stream, e->seq, "cudaStreamWaitEvent");
  return done(cudaSuccess);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  struct CUevent_st *e;
  lock();
  if (!event || (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming | 0x04)))
    return done(cudaErrorInvalidValue);
  if (!(e = calloc(1, sizeof(*e))))
    return done(cudaErrorMemoryAllocation);
  e->device = current_device;
  e->next = events;
  events = e;
  *event = e;
  return done(cudaSuccess);
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  struct CUevent_st *e;
  struct CUstream_st *s;
  lock();
  e = resolve_event(event, "cudaEventRecord");
  s = resolve_stream(stream, "cudaEventRecord");
  if (e->device != s->device)
    sim_cuda_fail("cudaEventRecord: event of device %d recorded on a stream of device %d",
                  e->device, s->device);
  e->seq = enqueue(s, NULL, NULL, NULL, 0, "cudaEventRecord");
  e->stream = s;
  return done(cudaSuccess);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  struct CUevent_st *e;
  lock();
  e = resolve_event(event, "cudaEventSynchronize");
  count_sync(e->device);
  if (e->stream)
    run_until(e->stream, e->seq);
  return done(cudaSuccess);
}

cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  lock();
  resolve_event(event, "cudaEventDestroy")->dead = 1;
  return done(cudaSuccess);
}

/* ---- the simulator's own face --------------------------------------------------------------- */

void sim_cuda_enqueue(cudaStream_t stream, void (*fn)(void *args), const void *args,
                      size_t args_size, const char *what) {
  struct CUstream_st *s;
  void *copy = malloc(args_size ? args_size : 1);
  if (!copy)
    sim_cuda_fail("out of host memory");
  memcpy(copy, args, args_size);
  lock();
  s = resolve_stream(stream, what);
  if (s->device != current_device)
    sim_cuda_fail("%s: launched on a stream of device %d while device %d is current", what,
                  s->device, current_device);
  enqueue(s, fn, copy, NULL, 0, what);
  unlock();
}

void sim_cuda_check_device(cudaStream_t stream, const void *p, size_t bytes, const char *what) {
  struct CUstream_st *s;
  alloc_t *a;
  if (bytes == 0)
    return;
  lock();
  s = resolve_stream(stream, what);
  a = find_alloc(p);
  if (!a || a->pinned)
    sim_cuda_fail("%s: %p (%zu bytes) is %s, not device memory", what, p, bytes, where(a));
  if (bytes > (size_t)(a->base + a->size - (const char *)p))
    sim_cuda_fail("%s: %p + %zu bytes overruns its %zu-byte device allocation at %p (offset %zu)",
                  what, p, bytes, a->size, (void *)a->base, (size_t)((const char *)p - a->base));
  if (a->device != s->device)
    sim_cuda_fail("%s: %p is memory of device %d, used on a stream of device %d", what, p,
                  a->device, s->device);
  unlock();
}

size_t sim_cuda_device_extent(const void *p, const char *what) {
  alloc_t *a;
  size_t n;
  lock();
  a = find_alloc(p);
  if (!a || a->pinned)
    sim_cuda_fail("%s: %p is %s, not device memory", what, p, where(a));
  n = (size_t)(a->base + a->size - (const char *)p);
  unlock();
  return n;
}

size_t sim_cuda_pending(void) {
  size_t n = 0;
  lock();
  for (struct CUstream_st *t = streams; t; t = t->next)
    n += t->enqueued - t->executed;
  unlock();
  return n;
}

size_t sim_cuda_pending_device(int device) {
  size_t n = 0;
  lock();
  for (struct CUstream_st *t = streams; t; t = t->next)
    if (t->device == device)
      n += t->enqueued - t->executed;
  unlock();
  return n;
}

void sim_cuda_live(int device, size_t *device_allocs, size_t *pinned_allocs, size_t *nstreams,
                   size_t *nevents) {
  size_t da = 0, pa = 0, ns = 0, ne = 0;
  lock();
  for (size_t i = 0; i < allocs_used; i++)
    if (allocs[i].base && allocs[i].device == device)
      *(allocs[i].pinned ? &pa : &da) += 1;
  for (struct CUstream_st *t = streams; t; t = t->next)
    ns += !t->legacy && !t->dead && t->device == device;
  for (struct CUevent_st *e = events; e; e = e->next)
    ne += !e->dead && e->device == device;
  unlock();
  if (device_allocs)
    *device_allocs = da;
  if (pinned_allocs)
    *pinned_allocs = pa;
  if (nstreams)
    *nstreams = ns;
  if (nevents)
    *nevents = ne;
}

void sim_cuda_counts(int device, sim_cuda_counts_t *out) {
  lock();
  if (device < 0 || device >= SIM_CUDA_MAX_DEVICES)
    sim_cuda_fail("sim_cuda_counts: no device %d", device);
  *out = counts[device];
  unlock();
}

void sim_cuda_set_device_count(int n) {
  lock();
  device_count = n < 0 ? 0 : n > SIM_CUDA_MAX_DEVICES ? SIM_CUDA_MAX_DEVICES : n;
  unlock();
}

void sim_cuda_set_memory_limit(int device, size_t bytes) {
  lock();
  if (device < 0 || device >= SIM_CUDA_MAX_DEVICES)
    sim_cuda_fail("sim_cuda_set_memory_limit: no device %d", device);
  device_limit[device] = bytes;
  unlock();
}

void sim_cuda_device_access_begin(int device) {
  lock();
  open_device(device);
  unlock();
}

void sim_cuda_device_access_end(int device) {
  lock();
  close_device(device);
  unlock();
}

/* SIM_CUDA_REPORT=1: at exit, what the process did with each device it used and what it left
 * behind, for tests that run the simulator inside a server process and can only read its log.
 * The lock is only tried: a thread still inside the simulator at exit must not hang it. */
__attribute__((destructor)) static void report_at_exit(void) {
  const char *env = getenv("SIM_CUDA_REPORT");
  if (!env || !*env || strcmp(env, "0") == 0)
    return;
  pthread_once(&once, init);
  if (pthread_mutex_trylock(&mu) != 0) {
    fprintf(stderr, "sim_cuda report: the simulator is busy at exit; no report\n");
    return;
  }
  for (int d = 0; d < SIM_CUDA_MAX_DEVICES; d++) {
    size_t da, pa, ns, ne;
    if (!device_allocs_made[d] && !pinned_allocs_made[d])
      continue;
    sim_cuda_live(d, &da, &pa, &ns, &ne);
    fprintf(stderr,
            "sim_cuda report: device %d: %zu device and %zu pinned allocations made; live at "
            "exit: %zu device allocations, %zu pinned allocations, %zu streams, %zu events, %zu "
            "queued operations\n",
            d, device_allocs_made[d], pinned_allocs_made[d], da, pa, ns, ne,
            sim_cuda_pending_device(d));
  }
  fprintf(stderr,
          "sim_cuda report: pointer queries: %zu pinned host, %zu device, %zu pageable host\n",
          queries_pinned, queries_device, queries_pageable);
  unlock();
}
