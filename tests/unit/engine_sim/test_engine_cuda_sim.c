/* The CUDA engine (server/engine/engine_cuda.c) on the simulated CUDA runtime (sim_cuda.c and
 * sim_kernels.c), against the CPU engine: the same workload through both must give bitwise the
 * same lookups and tables and the same push results. The simulator runs asynchronous work as
 * late as CUDA allows and poisons memory that nothing wrote, so a missing dependency or
 * synchronization in the engine shows up here as a wrong number, and a pointer of the wrong
 * kind or size as an abort with a message.
 *
 * Groups of 1 to 4 ranks run as threads over socketpairs, each rank on its own simulated
 * device. The CUDA engine's communicator takes device buffers like the NCCL backend: it waits
 * for the engine's stream to be idle and then runs the TCP collective on the buffers. Every
 * scenario runs with the request and reply buffers in pageable and in pinned memory, and with
 * the table tracking its dirty rows (incremental checkpoints): two captures (table exports) take
 * exactly the rows that the pushes since the previous one wrote, on both engines. The first
 * tests check the simulator itself: that it does catch a missing wait, a read before a sync and
 * a bad pointer, so that a passing engine test means something. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/cuda/embps_kernels_cuda.h"
#include "server/engine/engine.h"
#include "sim_cuda.h"
#include "sim_nccl.h"

#define WIDTH 12 /* splits over 1, 2, 3 and 4 ranks */
#define ROWS 40
#define STEPS 6
#define MAX_RANKS 4
#define MAX_BATCH 36 /* batches of 12, 24 and 36 tokens: every size divides them */
#define WIDE_WIDTH 384
#define DIRTY_WORDS ((ROWS + 63) / 64)
#define CAPTURE_STEP 2 /* the first capture follows this step (skipped), the second the last */

/* ---- the simulator catches what it is for ---------------------------------------------------- */

static float bf16_value(uint16_t h) { return embps_bf16_to_f32(h); }

static void fill_bf16(uint16_t *h, size_t n, float base) {
  for (size_t i = 0; i < n; i++)
    h[i] = embps_f32_to_bf16(base + (float)i);
}

/* A kernel on stream b reads what a copy on stream a writes. Without a wait it sees the poison
 * of the unwritten memory; with cudaStreamWaitEvent it sees the copy's values. */
static void test_sim_catches_missing_wait(void **state) {
  cudaStream_t a, b;
  cudaEvent_t e;
  uint16_t *x, h_in[8];
  float *y, h_out[8];
  (void)state;
  assert_int_equal(cudaSetDevice(0), cudaSuccess);
  assert_int_equal(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  assert_int_equal(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  assert_int_equal(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&x, sizeof(h_in)), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&y, sizeof(h_out)), cudaSuccess);
  fill_bf16(h_in, 8, 1.0f);

  assert_int_equal(cudaMemcpyAsync(x, h_in, sizeof(h_in), cudaMemcpyHostToDevice, a), cudaSuccess);
  assert_int_equal(embps_bf16_to_f32_cuda(x, 8, y, b), EMBPS_OK);
  assert_int_equal(cudaStreamSynchronize(b), cudaSuccess);
  assert_int_equal(sim_cuda_pending_device(0), 1); /* the copy on a has not run */
  assert_int_equal(cudaMemcpy(h_out, y, sizeof(h_out), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 8; i++)
    assert_true(isnan(h_out[i]));

  fill_bf16(h_in, 8, 2.0f);
  assert_int_equal(cudaMemcpyAsync(x, h_in, sizeof(h_in), cudaMemcpyHostToDevice, a), cudaSuccess);
  assert_int_equal(cudaEventRecord(e, a), cudaSuccess);
  assert_int_equal(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
  assert_int_equal(embps_bf16_to_f32_cuda(x, 8, y, b), EMBPS_OK);
  assert_int_equal(cudaStreamSynchronize(b), cudaSuccess);
  assert_int_equal(sim_cuda_pending_device(0), 0);
  assert_int_equal(cudaMemcpy(h_out, y, sizeof(h_out), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 8; i++)
    assert_true(h_out[i] == bf16_value(h_in[i]));

  assert_int_equal(cudaFree(x), cudaSuccess);
  assert_int_equal(cudaFree(y), cudaSuccess);
  assert_int_equal(cudaEventDestroy(e), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(a), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(b), cudaSuccess);
}

/* A wait is for the event's latest record when the wait is enqueued, not a later one; an event
 * sync runs the stream up to the record only. */
static void test_sim_event_semantics(void **state) {
  cudaStream_t a, b;
  cudaEvent_t e;
  uint16_t *x, h1[4], h2[4];
  float *y, h_out[4];
  (void)state;
  assert_int_equal(cudaSetDevice(0), cudaSuccess);
  assert_int_equal(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  assert_int_equal(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  assert_int_equal(cudaEventCreate(&e), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&x, sizeof(h1)), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&y, sizeof(h_out)), cudaSuccess);
  fill_bf16(h1, 4, 10.0f);
  fill_bf16(h2, 4, 20.0f);

  assert_int_equal(cudaMemcpyAsync(x, h1, sizeof(h1), cudaMemcpyHostToDevice, a), cudaSuccess);
  assert_int_equal(cudaEventRecord(e, a), cudaSuccess);
  assert_int_equal(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
  assert_int_equal(cudaMemcpyAsync(x, h2, sizeof(h2), cudaMemcpyHostToDevice, a), cudaSuccess);
  assert_int_equal(cudaEventRecord(e, a), cudaSuccess); /* too late for b's wait */
  assert_int_equal(embps_bf16_to_f32_cuda(x, 4, y, b), EMBPS_OK);
  assert_int_equal(cudaStreamSynchronize(b), cudaSuccess);
  assert_int_equal(sim_cuda_pending_device(0), 2); /* a's second copy and record */
  assert_int_equal(cudaEventSynchronize(e), cudaSuccess);
  assert_int_equal(sim_cuda_pending_device(0), 0);
  assert_int_equal(cudaMemcpy(h_out, y, sizeof(h_out), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 4; i++)
    assert_true(h_out[i] == bf16_value(h1[i]));

  assert_int_equal(cudaFree(x), cudaSuccess);
  assert_int_equal(cudaFree(y), cudaSuccess);
  assert_int_equal(cudaEventDestroy(e), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(a), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(b), cudaSuccess);
}

/* The host reading a pinned buffer before syncing the stream that fills it sees the old bytes;
 * the legacy stream waits for blocking streams but not for non-blocking ones. */
static void test_sim_host_reads_and_legacy_stream(void **state) {
  cudaStream_t blocking, nonblocking;
  float *x, *y, *pinned, h[4] = {1, 2, 3, 4}, out[4];
  struct cudaPointerAttributes attr;
  (void)state;
  assert_int_equal(cudaSetDevice(0), cudaSuccess);
  assert_int_equal(cudaStreamCreate(&blocking), cudaSuccess);
  assert_int_equal(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&x, sizeof(h)), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&y, sizeof(h)), cudaSuccess);
  assert_int_equal(cudaMallocHost((void **)&pinned, sizeof(h)), cudaSuccess);

  assert_int_equal(cudaPointerGetAttributes(&attr, x + 1), cudaSuccess);
  assert_int_equal(attr.type, cudaMemoryTypeDevice);
  assert_int_equal(cudaPointerGetAttributes(&attr, pinned + 3), cudaSuccess);
  assert_int_equal(attr.type, cudaMemoryTypeHost);
  assert_int_equal(cudaPointerGetAttributes(&attr, h), cudaSuccess);
  assert_int_equal(attr.type, cudaMemoryTypeUnregistered);

  assert_int_equal(cudaMemcpy(x, h, sizeof(h), cudaMemcpyHostToDevice), cudaSuccess);
  memset(pinned, 0, sizeof(h));
  assert_int_equal(cudaMemcpyAsync(pinned, x, sizeof(h), cudaMemcpyDeviceToHost, nonblocking),
                   cudaSuccess);
  assert_true(pinned[0] == 0.0f && pinned[3] == 0.0f); /* not synchronized yet */
  assert_int_equal(cudaStreamSynchronize(nonblocking), cudaSuccess);
  assert_memory_equal(pinned, h, sizeof(h));

  /* y <- x on a stream, then y -> pinned on the legacy stream. */
  assert_int_equal(cudaMemcpyAsync(y, x, sizeof(h), cudaMemcpyDeviceToDevice, nonblocking),
                   cudaSuccess);
  assert_int_equal(cudaMemcpyAsync(pinned, y, sizeof(h), cudaMemcpyDeviceToHost, 0), cudaSuccess);
  assert_int_equal(cudaStreamSynchronize(0), cudaSuccess);
  assert_true(isnan(pinned[0])); /* the legacy stream does not wait for non-blocking streams */
  assert_int_equal(cudaStreamSynchronize(nonblocking), cudaSuccess);
  assert_int_equal(cudaMemset(y, 0, sizeof(h)), cudaSuccess);
  assert_int_equal(cudaMemcpyAsync(y, x, sizeof(h), cudaMemcpyDeviceToDevice, blocking),
                   cudaSuccess);
  assert_int_equal(cudaMemcpyAsync(pinned, y, sizeof(h), cudaMemcpyDeviceToHost, 0), cudaSuccess);
  assert_int_equal(cudaStreamSynchronize(0), cudaSuccess);
  assert_memory_equal(pinned, h, sizeof(h)); /* but it does wait for blocking ones */
  assert_int_equal(cudaMemcpy(out, y, sizeof(out), cudaMemcpyDeviceToHost), cudaSuccess);
  assert_memory_equal(out, h, sizeof(h));

  assert_int_equal(cudaFreeHost(pinned), cudaSuccess);
  assert_int_equal(cudaFree(x), cudaSuccess);
  assert_int_equal(cudaFree(y), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(blocking), cudaSuccess);
  assert_int_equal(cudaStreamDestroy(nonblocking), cudaSuccess);
}

/* Runs fn in a child process and requires it to die; its stderr must hold `message` (NULL: any
 * death will do). */
static void expect_death(void (*fn)(void), const char *message) {
  int fds[2], status;
  char buf[4096];
  size_t have = 0;
  ssize_t got;
  pid_t pid;
  assert_int_equal(pipe(fds), 0);
  fflush(NULL);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    signal(SIGSEGV, SIG_DFL); /* not the test framework's handler, which would go on testing */
    fn();
    _exit(0);
  }
  close(fds[1]);
  while (have < sizeof(buf) - 1 && (got = read(fds[0], buf + have, sizeof(buf) - 1 - have)) > 0)
    have += (size_t)got;
  buf[have] = '\0';
  close(fds[0]);
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
    fail_msg("the simulator let this through (expected \"%s\"); child stderr: %s",
             message ? message : "a crash", buf);
  if (message && !strstr(buf, message))
    fail_msg("expected \"%s\" on the child's stderr, got: %s", message, buf);
}

static void kernel_on_pinned(void) {
  uint16_t *in;
  float *out;
  cudaMallocHost((void **)&in, 64);
  cudaMalloc((void **)&out, 128);
  embps_bf16_to_f32_cuda(in, 32, out, NULL);
}

static void copy_to_host_as_device(void) {
  float h[4] = {0}, dst[4];
  cudaMemcpyAsync(dst, h, sizeof(h), cudaMemcpyHostToDevice, NULL);
}

static void copy_2d_overrun(void) {
  char *d;
  char h[64] = {0};
  cudaMalloc((void **)&d, 60);
  /* 4 rows of 6 bytes at a pitch of 16 from byte 8: the last row ends at byte 62. */
  cudaMemcpy2DAsync(d + 8, 16, h, 6, 6, 4, cudaMemcpyHostToDevice, NULL);
}

static void host_dereference(void) {
  volatile float *d;
  cudaMalloc((void **)&d, 16);
  d[1] = 1.0f;
}

static void kernel_row_out_of_table(void) {
  float *table, *out;
  int64_t *rows, h[2] = {1, 9};
  cudaMalloc((void **)&table, 8 * 4 * sizeof(float));
  cudaMalloc((void **)&out, 2 * 4 * sizeof(float));
  cudaMalloc((void **)&rows, sizeof(h));
  cudaMemcpy(rows, h, sizeof(h), cudaMemcpyHostToDevice);
  embps_gather_cuda(table, EMBPS_DTYPE_F32, 4, rows, 2, out, NULL);
  cudaDeviceSynchronize();
}

static void test_sim_aborts_on_bad_pointers(void **state) {
  (void)state;
  expect_death(kernel_on_pinned, "pinned host memory, not device memory");
  expect_death(copy_to_host_as_device, "is pageable host memory, but the copy kind says device");
  expect_death(copy_2d_overrun, "overruns its 60-byte allocation");
  expect_death(kernel_row_out_of_table, "rows[1] = 9 is outside the table");
  expect_death(host_dereference, "host code dereferenced a device pointer");
}

/* ---- the engine: CPU and simulated CUDA give the same results ------------------------------- */

typedef struct scenario {
  uint32_t size;
  embps_optimizer_t opt;
  embps_dtype_t dtype;
  int weight_decay;
  embps_backend_t backend;
  int pinned;        /* request and reply buffers in cudaMallocHost memory */
  uint32_t width;    /* the table's emb_width: WIDTH, or WIDE_WIDTH */
  size_t big_lookup; /* tokens per rank of a last, large lookup (0: none) */
  int untracked;     /* the table does not track its dirty rows (no incremental checkpoints) */
} scenario_t;

typedef struct step_result {
  uint8_t *lookup; /* this rank's shard of the step's lookup */
  int applied, skipped;
  uint64_t num_unique;
  double grad_norm;
  sim_cuda_counts_t cost; /* the push's host waits and copies to the host (cuda) */
} step_result_t;

typedef struct rank_result {
  step_result_t steps[STEPS];
  uint8_t *final; /* this rank's share of a lookup of every row */
  uint8_t *big;   /* this rank's shard of the large lookup */
  /* the dirty rows that the captures after steps CAPTURE_STEP and STEPS - 1 took */
  uint64_t dirty[2][DIRTY_WORDS];
  char failure[512]; /* empty: none */
} rank_result_t;

typedef struct rank_args {
  const scenario_t *sc;
  uint32_t rank;
  int fds[MAX_RANKS];
  rank_result_t *result;
} rank_args_t;

static size_t batch_of(int step) { return 12 * (1 + (size_t)step % 3); }

/* Steps 2 and 4 carry a non-finite gradient on a real token (in the last and the first rank's
 * shard): the step must be skipped everywhere. Step 3 carries a NaN on a padding position,
 * which does not count. */
static void workload(int step, size_t width, int64_t *tokens, float *grads) {
  size_t b = batch_of(step);
  uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(step + 1);
  for (size_t i = 0; i < b; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tokens[i] = (int64_t)(i % 5 == 4 ? x % ROWS : x % 16); /* duplicates, padding 0 */
    for (size_t col = 0; col < width; col++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      grads[i * width + col] = (float)((double)(x % 2001) / 1000.0 - 1.0);
    }
  }
  if (step == 2) {
    tokens[b - 1] = 7;
    grads[(b - 1) * width + 5] = NAN;
  } else if (step == 4) {
    tokens[0] = 3;
    grads[width - 1] = -INFINITY;
  } else if (step == 3) {
    tokens[5] = 0;
    grads[5 * width + 2] = NAN;
  }
}

static int skipped_step(int step) { return step == 2 || step == 4; }

static embps_table_config_t table_config(const scenario_t *sc) {
  embps_table_config_t c;
  embps_error_t err;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "t");
  c.rows = ROWS;
  c.emb_width = sc->width;
  c.dtype = sc->dtype;
  c.optimizer = sc->opt;
  c.lr = sc->opt == EMBPS_OPTIMIZER_ADAM ? 0.05f : 0.5f;
  c.seed = 3;
  c.half_life = 7.0f;
  c.weight_decay = sc->weight_decay ? 0.01f : 0.0f;
  /* Non-zero accumulators take the engine's fill path, zero ones its memset. */
  c.initial_accumulator = sc->weight_decay ? 0.1f : 0.0f;
  assert_int_equal(embps_table_config_resolve(&c, sc->size, 1 << 30, &err), EMBPS_OK);
  return c;
}

#define RANK_CHECK(a, cond, ...)                                                                   \
  do {                                                                                             \
    if (!(cond) && !(a)->result->failure[0])                                                       \
      snprintf((a)->result->failure, sizeof((a)->result->failure), __VA_ARGS__);                   \
  } while (0)

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of host memory\n");
    abort();
  }
  return p;
}

/* Request and reply buffers as the caller would have them; pinned ones on the current device. */
static void *host_buf(const rank_args_t *a, size_t bytes) {
  void *p = NULL;
  if (!a->sc->pinned)
    return xmalloc(bytes);
  if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
    fprintf(stderr, "out of pinned memory\n");
    abort();
  }
  return p;
}

static void host_free(const rank_args_t *a, void *p) {
  if (a->sc->pinned)
    cudaFreeHost(p);
  else
    free(p);
}

static void run_op(rank_args_t *a, embps_engine_t *engine, embps_op_t *op, const char *what,
                   int step) {
  embps_error_t err;
  embps_error_clear(&err);
  RANK_CHECK(a, embps_engine_run(engine, op, &err) == EMBPS_OK, "%s at step %d: %.300s", what, step,
             err.message);
  RANK_CHECK(a, op->error.status == EMBPS_OK, "%s at step %d: op error %.300s", what, step,
             op->error.message);
  if (a->sc->backend == EMBPS_BACKEND_CUDA)
    RANK_CHECK(a, sim_cuda_pending_device((int)a->rank) == 0,
               "%s at step %d returned with %zu operations still queued on its device", what, step,
               sim_cuda_pending_device((int)a->rank));
}

/* Looks up n tokens into a new array (this rank's reply), which the caller frees. */
static uint8_t *lookup(rank_args_t *a, embps_engine_t *engine, embps_table_t *t,
                       const int64_t *tokens, size_t n, int step) {
  size_t row = a->sc->width * embps_dtype_size(a->sc->dtype);
  int64_t *req = host_buf(a, n * sizeof(int64_t));
  uint8_t *reply = host_buf(a, n * row), *out = xmalloc(n * row);
  embps_op_t op;
  memcpy(req, tokens, n * sizeof(int64_t));
  memset(reply, 0xee, n * row); /* a reply the engine does not fully write cannot match */
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_LOOKUP;
  op.table = t;
  op.tokens = req;
  op.num_tokens = n;
  op.rows_out = reply;
  run_op(a, engine, &op, "lookup", step);
  memcpy(out, reply, n * row);
  host_free(a, req);
  host_free(a, reply);
  return out;
}

static void push(rank_args_t *a, embps_engine_t *engine, embps_table_t *t, const int64_t *tokens,
                 const float *grads, size_t n, step_result_t *r, int step) {
  size_t ds = embps_dtype_size(a->sc->dtype), elems = n * a->sc->width;
  int64_t *req = host_buf(a, n * sizeof(int64_t));
  void *g = host_buf(a, elems * ds);
  embps_op_t op;
  memcpy(req, tokens, n * sizeof(int64_t));
  for (size_t i = 0; i < elems; i++) {
    if (ds == 2)
      ((uint16_t *)g)[i] = embps_f32_to_bf16(grads[i]);
    else
      ((float *)g)[i] = grads[i];
  }
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_PUSH;
  op.table = t;
  op.tokens = req;
  op.num_tokens = n;
  op.grads = g;
  if (a->sc->backend == EMBPS_BACKEND_CUDA) {
    sim_cuda_counts_t before;
    sim_cuda_counts((int)a->rank, &before);
    run_op(a, engine, &op, "push", step);
    sim_cuda_counts((int)a->rank, &r->cost);
    r->cost.syncs -= before.syncs;
    r->cost.d2h_copies -= before.d2h_copies;
    r->cost.d2h_bytes -= before.d2h_bytes;
  } else {
    run_op(a, engine, &op, "push", step);
  }
  r->applied = op.applied;
  r->skipped = op.skipped;
  r->num_unique = op.num_unique;
  r->grad_norm = op.grad_norm;
  host_free(a, req);
  host_free(a, g);
}

/* A checkpoint's capture as the checkpointer makes it: the table's arrays exported to host
 * memory, then the dirty rows taken from the table's bitmap, which is cleared. */
static void capture(rank_args_t *a, embps_engine_t *engine, embps_table_t *t,
                    uint64_t dirty[DIRTY_WORDS]) {
  size_t bytes[3];
  embps_table_arrays_t host;
  embps_error_t err;
  uint64_t *bits = embps_table_dirty(t);
  embps_table_array_bytes(t, bytes);
  host.data = xmalloc(bytes[0]);
  host.state0 = bytes[1] ? xmalloc(bytes[1]) : NULL;
  host.state1 = bytes[2] ? xmalloc(bytes[2]) : NULL;
  embps_error_clear(&err);
  RANK_CHECK(a, embps_engine_table_export(engine, t, &host, &err) == EMBPS_OK, "export: %.300s",
             err.message);
  if (a->sc->backend == EMBPS_BACKEND_CUDA)
    RANK_CHECK(a, sim_cuda_pending_device((int)a->rank) == 0,
               "the export returned with work still queued on its device");
  memset(dirty, 0, DIRTY_WORDS * sizeof(uint64_t));
  if (bits) {
    memcpy(dirty, bits, DIRTY_WORDS * sizeof(uint64_t));
    memset(bits, 0, DIRTY_WORDS * sizeof(uint64_t));
  }
  free(host.data);
  free(host.state0);
  free(host.state1);
}

static void *rank_main(void *p) {
  rank_args_t *a = p;
  const scenario_t *sc = a->sc;
  const int cuda = sc->backend == EMBPS_BACKEND_CUDA;
  embps_table_config_t cfg = table_config(sc);
  embps_comm_t *tcp = NULL, *comm;
  embps_store_t *store = NULL;
  embps_engine_t *engine = NULL;
  embps_table_t *t;
  embps_error_t err;
  embps_op_t op;
  void *stream = NULL;
  char bus[64];
  int64_t tokens[MAX_BATCH], *many;
  float *grads = xmalloc(MAX_BATCH * sc->width * sizeof(float));

  embps_error_clear(&err);
  if (embps_comm_tcp_new(&tcp, a->rank, sc->size, a->fds, 20000) != EMBPS_OK) {
    RANK_CHECK(a, 0, "cannot create the TCP communicator");
    free(grads);
    return NULL;
  }
  comm = tcp;
  if (cuda) {
    if (embps_cuda_open((int)a->rank, &stream, bus, sizeof(bus), &err) != EMBPS_OK) {
      RANK_CHECK(a, 0, "embps_cuda_open(%u): %.300s", a->rank, err.message);
      embps_comm_free(tcp);
      free(grads);
      return NULL;
    }
    comm = sim_nccl_wrap(tcp, stream, (int)a->rank);
  }
  if (embps_store_new(&store) != EMBPS_OK ||
      embps_engine_new(&engine, comm, store, sc->backend, stream) != EMBPS_OK) {
    RANK_CHECK(a, 0, "cannot create the store or the engine");
    goto exit;
  }

  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = cfg;
  run_op(a, engine, &op, "create", -1);
  if (!(t = embps_store_find(store, "t"))) {
    RANK_CHECK(a, 0, "the table was not registered");
    goto exit;
  }
  if (!sc->untracked)
    RANK_CHECK(a, embps_table_track_dirty(t) == EMBPS_OK, "cannot track the dirty rows");

  for (int step = 0; step < STEPS; step++) {
    size_t n = batch_of(step) / sc->size;
    workload(step, sc->width, tokens, grads);
    a->result->steps[step].lookup = lookup(a, engine, t, tokens + a->rank * n, n, step);
    push(a, engine, t, tokens + a->rank * n, grads + a->rank * n * sc->width, n,
         &a->result->steps[step], step);
    if (step == CAPTURE_STEP || step == STEPS - 1)
      capture(a, engine, t, a->result->dirty[step == CAPTURE_STEP ? 0 : 1]);
  }
  {
    /* Every row, split over the group (39 rows for 3 ranks). */
    size_t per = (ROWS - ROWS % sc->size) / sc->size, k = sc->big_lookup;
    many = xmalloc((k > per ? k : per) * sizeof(int64_t));
    for (size_t i = 0; i < per; i++)
      many[i] = (int64_t)(a->rank * per + i);
    a->result->final = lookup(a, engine, t, many, per, STEPS);
    /* Enough rows that the reply goes back in several chunks; padding and repeats included. */
    for (size_t i = 0; i < k; i++)
      many[i] = (int64_t)((i * 7 + a->rank * 13 + (i >> 3)) % ROWS);
    if (k)
      a->result->big = lookup(a, engine, t, many, k, STEPS + 1);
    free(many);
  }

exit:
  embps_engine_free(engine);
  embps_store_free(store);
  embps_comm_free(comm);
  free(grads);
  if (cuda) {
    size_t dev_allocs, pinned, streams, events;
    embps_cuda_close(stream);
    sim_cuda_live((int)a->rank, &dev_allocs, &pinned, &streams, &events);
    RANK_CHECK(a, dev_allocs == 0 && pinned == 0 && streams == 0 && events == 0,
               "after the engine, store and stream are freed, device %u still has %zu device and "
               "%zu pinned allocations, %zu streams and %zu events",
               a->rank, dev_allocs, pinned, streams, events);
  }
  return NULL;
}

static void results_free(rank_result_t *results) {
  for (uint32_t r = 0; r < MAX_RANKS; r++) {
    for (int s = 0; s < STEPS; s++)
      free(results[r].steps[s].lookup);
    free(results[r].final);
    free(results[r].big);
    memset(&results[r], 0, sizeof(results[r]));
  }
}

/* Connected sockets for a full mesh of n ranks: fds[i][j] talks to rank j. */
static void mesh_sockets(uint32_t n, int fds[MAX_RANKS][MAX_RANKS]) {
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < n; j++)
      fds[i][j] = -1;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i + 1; j < n; j++) {
      int sv[2];
      assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
      fds[i][j] = sv[0];
      fds[j][i] = sv[1];
    }
}

static const char *scenario_name(const scenario_t *sc, char *buf, size_t cap) {
  snprintf(buf, cap, "%u ranks, %s, %s, width %u, weight decay %s, %s, %s buffers", sc->size,
           embps_optimizer_name(sc->opt), embps_dtype_name(sc->dtype), sc->width,
           sc->weight_decay ? "on" : "off", embps_backend_name(sc->backend),
           sc->pinned ? "pinned" : "pageable");
  return buf;
}

static void run_group(const scenario_t *sc, rank_result_t *results) {
  rank_args_t args[MAX_RANKS];
  pthread_t threads[MAX_RANKS];
  int fds[MAX_RANKS][MAX_RANKS];
  char name[200];
  results_free(results);
  mesh_sockets(sc->size, fds);
  for (uint32_t r = 0; r < sc->size; r++) {
    args[r].sc = sc;
    args[r].rank = r;
    memcpy(args[r].fds, fds[r], sizeof(args[r].fds));
    args[r].result = &results[r];
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &args[r]), 0);
  }
  for (uint32_t r = 0; r < sc->size; r++)
    assert_int_equal(pthread_join(threads[r], NULL), 0);
  for (uint32_t r = 0; r < sc->size; r++)
    if (results[r].failure[0])
      fail_msg("%s, rank %u: %s", scenario_name(sc, name, sizeof(name)), r, results[r].failure);
}

/* The captures took exactly the rows (all ranks' tokens, padding excepted) of the pushes applied
 * since the previous capture, on every rank (each holds a column slice of every row); none when
 * the table does not track them. */
static void check_dirty(const scenario_t *sc, const rank_result_t *res) {
  uint64_t want[2][DIRTY_WORDS];
  int64_t tokens[MAX_BATCH];
  float *grads = xmalloc(MAX_BATCH * sc->width * sizeof(float));
  char name[200];
  memset(want, 0, sizeof(want));
  for (int step = 0; step < STEPS && !sc->untracked; step++) {
    if (skipped_step(step))
      continue;
    workload(step, sc->width, tokens, grads);
    for (size_t i = 0; i < batch_of(step); i++)
      if (tokens[i] != 0)
        want[step > CAPTURE_STEP][tokens[i] / 64] |= UINT64_C(1) << (tokens[i] % 64);
  }
  free(grads);
  if (!sc->untracked) /* some row of the first capture is not written again: it must be gone */
    assert_true((want[0][0] & ~want[1][0]) != 0 && want[1][0] != 0);
  for (uint32_t r = 0; r < sc->size; r++)
    for (int c = 0; c < 2; c++)
      for (size_t w = 0; w < DIRTY_WORDS; w++)
        if (res[r].dirty[c][w] != want[c][w])
          fail_msg("%s, rank %u: capture %d took dirty rows %#llx in word %zu, not %#llx",
                   scenario_name(sc, name, sizeof(name)), r, c,
                   (unsigned long long)res[r].dirty[c][w], w, (unsigned long long)want[c][w]);
}

/* The CPU run's own sanity: the gate fired exactly where it should, on every rank alike, and
 * the pushes moved the table (so that equal tables mean something). */
static void check_reference(const scenario_t *sc, const rank_result_t *ref) {
  size_t ds = embps_dtype_size(sc->dtype), per = (ROWS - ROWS % sc->size) / sc->size;
  size_t moved = 0;
  for (uint32_t r = 0; r < sc->size; r++)
    for (int s = 0; s < STEPS; s++) {
      assert_int_equal(ref[r].steps[s].skipped, skipped_step(s));
      assert_int_equal(ref[r].steps[s].applied, !skipped_step(s));
      assert_true(ref[r].steps[s].num_unique == ref[0].steps[s].num_unique);
      assert_true(ref[r].steps[s].grad_norm == ref[0].steps[s].grad_norm);
    }
  for (uint32_t r = 0; r < sc->size; r++)
    for (size_t i = 0; i < per; i++)
      for (size_t col = 0; col < sc->width; col++) {
        uint64_t row = r * per + i;
        float init = embps_init_value(3, row, col, 1.0f / sqrtf((float)sc->width));
        const uint8_t *v = ref[r].final + (i * sc->width + col) * ds;
        float got;
        if (ds == 2) {
          uint16_t h;
          memcpy(&h, v, 2);
          got = embps_bf16_to_f32(h);
          init = embps_bf16_to_f32(embps_f32_to_bf16(init));
        } else {
          memcpy(&got, v, 4);
        }
        if (row == 0)
          assert_true(got == 0.0f); /* padding never moves */
        moved += got != init;
      }
  assert_true(moved > 0);
  check_dirty(sc, ref);
}

static void compare(const scenario_t *sc, const rank_result_t *ref, const rank_result_t *got) {
  size_t ds = embps_dtype_size(sc->dtype), per = (ROWS - ROWS % sc->size) / sc->size;
  size_t row = sc->width * ds;
  char name[200];
  scenario_name(sc, name, sizeof(name));
  for (uint32_t r = 0; r < sc->size; r++) {
    for (int s = 0; s < STEPS; s++) {
      const step_result_t *a = &ref[r].steps[s], *b = &got[r].steps[s];
      size_t n = batch_of(s) / sc->size;
      double tol = 1e-12 * fabs(a->grad_norm);
      if (memcmp(a->lookup, b->lookup, n * row) != 0)
        fail_msg("%s, rank %u, step %d: the lookup differs from the CPU engine's", name, r, s);
      if (a->applied != b->applied || a->skipped != b->skipped || a->num_unique != b->num_unique)
        fail_msg("%s, rank %u, step %d: applied %d skipped %d num_unique %llu, the CPU engine "
                 "says %d %d %llu",
                 name, r, s, b->applied, b->skipped, (unsigned long long)b->num_unique, a->applied,
                 a->skipped, (unsigned long long)a->num_unique);
      if (!(fabs(a->grad_norm - b->grad_norm) <= tol))
        fail_msg("%s, rank %u, step %d: grad_norm %.17g, the CPU engine says %.17g", name, r, s,
                 b->grad_norm, a->grad_norm);
    }
    for (size_t i = 0; i < per * sc->width; i++)
      if (memcmp(ref[r].final + i * ds, got[r].final + i * ds, ds) != 0)
        fail_msg("%s, rank %u: final table element %zu (row %zu, column %zu) differs from the "
                 "CPU engine's",
                 name, r, i, r * per + i / sc->width, i % sc->width);
    for (size_t i = 0; i < sc->big_lookup; i++)
      if (memcmp(ref[r].big + i * row, got[r].big + i * row, row) != 0)
        fail_msg("%s, rank %u: row %zu of the large lookup differs from the CPU engine's", name, r,
                 i);
    if (memcmp(ref[r].dirty, got[r].dirty, sizeof(ref[r].dirty)) != 0)
      fail_msg("%s, rank %u: the captures took other dirty rows than the CPU engine's", name, r);
  }
}

/* The CPU engine once, then the simulated CUDA engine with pageable and with pinned request
 * and reply buffers, on the same workload. */
static void check_scenario(scenario_t sc) {
  rank_result_t *ref = calloc(MAX_RANKS, sizeof(*ref)), *got = calloc(MAX_RANKS, sizeof(*got));
  assert_non_null(ref);
  assert_non_null(got);
  sc.backend = EMBPS_BACKEND_CPU;
  sc.pinned = 0;
  run_group(&sc, ref);
  check_reference(&sc, ref);
  sc.backend = EMBPS_BACKEND_CUDA;
  for (int pinned = 0; pinned < 2; pinned++) {
    sc.pinned = pinned;
    run_group(&sc, got);
    compare(&sc, ref, got);
  }
  results_free(ref);
  results_free(got);
  free(ref);
  free(got);
}

static void run_size(uint32_t size) {
  static const embps_optimizer_t opts[] = {EMBPS_OPTIMIZER_SGD, EMBPS_OPTIMIZER_ADAGRAD,
                                           EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_OPTIMIZER_ADAM};
  static const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  for (size_t o = 0; o < 4; o++)
    for (size_t d = 0; d < 2; d++)
      for (int wd = 0; wd < 2; wd++) {
        scenario_t sc = {size, opts[o], dtypes[d], wd, EMBPS_BACKEND_CPU, 0, WIDTH, 0, 0};
        check_scenario(sc);
      }
}

static void test_group_of_1(void **state) {
  (void)state;
  run_size(1);
}

static void test_group_of_2(void **state) {
  (void)state;
  run_size(2);
}

static void test_group_of_3(void **state) {
  (void)state;
  run_size(3);
}

static void test_group_of_4(void **state) {
  (void)state;
  run_size(4);
}

/* Wide rows and a large lookup, so that the reply goes back in several chunks (the engine
 * copies it in chunks of at least 4 MiB): 6000 rows of 384 f32 is 9 MB per rank. */
static void test_large_lookup(void **state) {
  (void)state;
  for (uint32_t size = 1; size <= MAX_RANKS; size++)
    for (size_t d = 0; d < 2; d++) {
      scenario_t sc = {size,
                       EMBPS_OPTIMIZER_ROWWISE_ADAGRAD,
                       d ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32,
                       1,
                       EMBPS_BACKEND_CPU,
                       0,
                       WIDE_WIDTH,
                       6000,
                       0};
      check_scenario(sc);
    }
}

/* ---- dirty rows on the device --------------------------------------------------------------- */

/* A push that marks its rows for an incremental checkpoint costs the host no more waits and no
 * more copies from the device than one that does not: the marks stay on the device until a
 * capture takes them (whose rows check_dirty checks). */
static void test_dirty_rows_cost_no_round_trip(void **state) {
  rank_result_t *on = calloc(MAX_RANKS, sizeof(*on)), *off = calloc(MAX_RANKS, sizeof(*off));
  (void)state;
  assert_non_null(on);
  assert_non_null(off);
  for (uint32_t size = 1; size <= 2; size++) {
    scenario_t sc = {
        size, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_DTYPE_F32, 1, EMBPS_BACKEND_CUDA, 0, WIDTH, 0,
        0};
    run_group(&sc, on);
    check_dirty(&sc, on);
    sc.untracked = 1;
    run_group(&sc, off);
    check_dirty(&sc, off);
    for (uint32_t r = 0; r < size; r++)
      for (int s = 0; s < STEPS; s++) {
        const sim_cuda_counts_t *a = &on[r].steps[s].cost, *b = &off[r].steps[s].cost;
        assert_true(b->syncs > 0 && b->d2h_copies > 0); /* the counts count */
        if (a->syncs != b->syncs || a->d2h_copies != b->d2h_copies || a->d2h_bytes != b->d2h_bytes)
          fail_msg("%u ranks, rank %u, step %d: a push that tracks its rows made %zu host waits "
                   "and %zu copies (%zu bytes) to the host, one that does not %zu and %zu (%zu)",
                   size, r, s, a->syncs, a->d2h_copies, a->d2h_bytes, b->syncs, b->d2h_copies,
                   b->d2h_bytes);
      }
  }
  results_free(on);
  results_free(off);
  free(on);
  free(off);
}

/* Where the device has no room for the bitmap, a push marks every row in the host bitmap (the
 * next checkpoint is whole, not short of a row) and still succeeds; once there is room, the
 * marks are on the device again and a capture takes exactly the rows pushed. */
static void test_dirty_rows_without_device_memory(void **state) {
  scenario_t sc = {1, EMBPS_OPTIMIZER_SGD, EMBPS_DTYPE_F32, 0, EMBPS_BACKEND_CUDA, 0, WIDTH, 0, 0};
  rank_result_t *res = calloc(1, sizeof(*res));
  rank_args_t a = {.sc = &sc, .rank = 0, .fds = {-1, -1, -1, -1}, .result = res};
  embps_comm_t *tcp, *comm;
  embps_store_t *store;
  embps_engine_t *engine;
  embps_table_t *t;
  embps_error_t err;
  embps_op_t op;
  void *stream;
  char bus[64];
  size_t free_b, total_b;
  int64_t tokens[MAX_BATCH];
  float grads[MAX_BATCH * WIDTH];
  uint64_t want = 0, got[DIRTY_WORDS];
  step_result_t r;
  (void)state;
  assert_non_null(res);
  assert_int_equal(embps_comm_tcp_new(&tcp, 0, 1, a.fds, 20000), EMBPS_OK);
  assert_int_equal(embps_cuda_open(0, &stream, bus, sizeof(bus), &err), EMBPS_OK);
  comm = sim_nccl_wrap(tcp, stream, 0);
  assert_int_equal(embps_store_new(&store), EMBPS_OK);
  assert_int_equal(embps_engine_new(&engine, comm, store, EMBPS_BACKEND_CUDA, stream), EMBPS_OK);
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = table_config(&sc);
  run_op(&a, engine, &op, "create", -1);
  assert_non_null(t = embps_store_find(store, "t"));
  workload(0, WIDTH, tokens, grads);
  push(&a, engine, t, tokens, grads, 12, &r, 0); /* the scratch a push needs, before the cap */

  assert_int_equal(cudaSetDevice(0), cudaSuccess);
  assert_int_equal(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  sim_cuda_set_memory_limit(0, total_b - free_b); /* nothing more fits */
  assert_int_equal(embps_table_track_dirty(t), EMBPS_OK);
  push(&a, engine, t, tokens, grads, 12, &r, 1);
  assert_true(r.applied);
  capture(&a, engine, t, got);
  assert_true(got[0] == UINT64_MAX);
  assert_null(embps_table_device_dirty(t));

  sim_cuda_set_memory_limit(0, 0);
  workload(1, WIDTH, tokens, grads);
  push(&a, engine, t, tokens, grads, 24, &r, 2);
  assert_true(r.applied);
  assert_non_null(embps_table_device_dirty(t));
  for (size_t i = 0; i < 24; i++)
    if (tokens[i] != 0)
      want |= UINT64_C(1) << tokens[i];
  capture(&a, engine, t, got);
  assert_true(got[0] == want);
  if (res->failure[0])
    fail_msg("%s", res->failure);

  embps_engine_free(engine);
  embps_store_free(store);
  embps_comm_free(comm);
  embps_cuda_close(stream);
  free(res);
}

/* ---- CreateTable out of device memory on one rank -------------------------------------------- */

typedef struct oom_args {
  uint32_t rank, size;
  int fds[MAX_RANKS];
  embps_status_t first, second; /* op errors of the too-large and of the fitting create */
  uint64_t num_unique;
  char failure[256];
} oom_args_t;

static void *oom_rank(void *p) {
  oom_args_t *a = p;
  embps_comm_t *tcp, *comm;
  embps_store_t *store;
  embps_engine_t *engine;
  embps_error_t err;
  embps_op_t op;
  scenario_t sc = {
      a->size, EMBPS_OPTIMIZER_ADAM, EMBPS_DTYPE_F32, 1, EMBPS_BACKEND_CUDA, 0, WIDTH, 0, 1};
  void *stream;
  char bus[64];
  size_t dev_allocs, pinned, streams, events;

  if (embps_comm_tcp_new(&tcp, a->rank, a->size, a->fds, 20000) != EMBPS_OK ||
      embps_cuda_open((int)a->rank, &stream, bus, sizeof(bus), &err) != EMBPS_OK) {
    snprintf(a->failure, sizeof(a->failure), "setup failed");
    return NULL;
  }
  comm = sim_nccl_wrap(tcp, stream, (int)a->rank);
  if (embps_store_new(&store) != EMBPS_OK ||
      embps_engine_new(&engine, comm, store, EMBPS_BACKEND_CUDA, stream) != EMBPS_OK) {
    snprintf(a->failure, sizeof(a->failure), "setup failed");
    return NULL;
  }
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = table_config(&sc);
  op.create.rows = 1 << 20; /* 16 MiB of data per rank, beyond rank 1's 8 MiB */
  if (embps_engine_run(engine, &op, &err) != EMBPS_OK)
    snprintf(a->failure, sizeof(a->failure), "create: %.200s", err.message);
  a->first = op.error.status;

  op.create = table_config(&sc);
  if (embps_engine_run(engine, &op, &err) != EMBPS_OK)
    snprintf(a->failure, sizeof(a->failure), "create: %.200s", err.message);
  a->second = op.error.status;
  if (op.error.status == EMBPS_OK) {
    int64_t tokens[MAX_BATCH];
    float grads[MAX_BATCH * WIDTH];
    size_t n = 12 / a->size;
    workload(0, WIDTH, tokens, grads);
    memset(&op, 0, sizeof(op));
    op.kind = EMBPS_OP_PUSH;
    op.table = embps_store_find(store, "t");
    op.tokens = tokens + a->rank * n;
    op.num_tokens = n;
    op.grads = grads + a->rank * n * WIDTH;
    if (embps_engine_run(engine, &op, &err) != EMBPS_OK || !op.applied)
      snprintf(a->failure, sizeof(a->failure), "push after the failed create: %.200s", err.message);
    a->num_unique = op.num_unique;
  }
  if (sim_cuda_pending_device((int)a->rank) != 0)
    snprintf(a->failure, sizeof(a->failure), "work left queued");
  embps_engine_free(engine);
  embps_store_free(store);
  embps_comm_free(comm);
  embps_cuda_close(stream);
  sim_cuda_live((int)a->rank, &dev_allocs, &pinned, &streams, &events);
  if (dev_allocs || pinned || streams || events)
    snprintf(a->failure, sizeof(a->failure),
             "leaked %zu device, %zu pinned, %zu streams, %zu events", dev_allocs, pinned, streams,
             events);
  return NULL;
}

/* One rank cannot allocate the table: every rank reports it, nothing leaks, and the group goes
 * on to create and use a table that fits. */
static void test_create_out_of_device_memory(void **state) {
  const uint32_t size = 3;
  oom_args_t args[MAX_RANKS];
  pthread_t threads[MAX_RANKS];
  int fds[MAX_RANKS][MAX_RANKS];
  (void)state;
  sim_cuda_set_memory_limit(1, 8u << 20);
  mesh_sockets(size, fds);
  for (uint32_t r = 0; r < size; r++) {
    memset(&args[r], 0, sizeof(args[r]));
    args[r].rank = r;
    args[r].size = size;
    memcpy(args[r].fds, fds[r], sizeof(args[r].fds));
    assert_int_equal(pthread_create(&threads[r], NULL, oom_rank, &args[r]), 0);
  }
  for (uint32_t r = 0; r < size; r++)
    assert_int_equal(pthread_join(threads[r], NULL), 0);
  sim_cuda_set_memory_limit(1, 0);
  for (uint32_t r = 0; r < size; r++) {
    if (args[r].failure[0])
      fail_msg("rank %u: %s", r, args[r].failure);
    assert_int_equal(args[r].first, EMBPS_RESOURCE_EXHAUSTED);
    assert_int_equal(args[r].second, EMBPS_OK);
    assert_true(args[r].num_unique > 0 && args[r].num_unique == args[0].num_unique);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sim_catches_missing_wait),
      cmocka_unit_test(test_sim_event_semantics),
      cmocka_unit_test(test_sim_host_reads_and_legacy_stream),
      cmocka_unit_test(test_sim_aborts_on_bad_pointers),
      cmocka_unit_test(test_group_of_1),
      cmocka_unit_test(test_group_of_2),
      cmocka_unit_test(test_group_of_3),
      cmocka_unit_test(test_group_of_4),
      cmocka_unit_test(test_large_lookup),
      cmocka_unit_test(test_dirty_rows_cost_no_round_trip),
      cmocka_unit_test(test_dirty_rows_without_device_memory),
      cmocka_unit_test(test_create_out_of_device_memory),
  };
  sim_cuda_set_device_count(MAX_RANKS);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
