/* Bandwidth benchmark of the CUDA kernels on one GPU (not a ctest test: a program to run).
 *
 *   bench_kernels_gpu [--quick] [--rows-scale X] [--device N] [--probe]
 *
 * Measures, with CUDA events on one stream, the median of several timed runs after warm-up:
 * 1. the device copy ceiling: cudaMemcpyAsync device to device of 1 GiB, counted as bytes
 *    read + bytes written (2 GiB per copy);
 * 2. for emb_width 128 (a table of 100M rows) and 1024 (10M rows), f32 and bf16 storage, with
 *    a batch of 2^20 tokens drawn from Zipf(1.05) over the table's rows (sampled on the host by
 *    rejection-inversion, ranks scattered over the ids by a fixed permutation, then copied):
 *    - dedup of the batch (embps_dedup_cuda): time and tokens/s;
 *    - gather of the batch (embps_gather_cuda), counted as n x width x dtype bytes read from
 *      the table + the same written to the output (the token ids are not counted);
 *    - the hash-keyed gather (embps_hash_gather_cuda) of the batch with every token stored at
 *      the slot of its row ("hgather", counted as gather), and with no token stored
 *      ("hginit": every row the key's initial row, computed; rows/s);
 *    - the fused rowwise Adagrad update of the deduped rows (embps_update_rowwise_adagrad_cuda),
 *      counted as u x width x dtype read + written (weights) + u x width x 4 read (f32 grads)
 *      + u x 4 read + written (accumulators) + u x (8 + 4) read (row ids, row sums of squares);
 *    - segment sum of f32 batch gradients into the deduped rows (embps_segment_sum_cuda, the
 *      push path's reduction; no target), counted as n x width x 4 read + u x width x 4
 *      written (the grouping arrays are not counted);
 *    - the feature batches' sum pooling of the batch as bags of BAG tokens
 *      (embps_pool_bags_cuda, "pool"), counted as n x width x dtype read from the table +
 *      n / BAG x width x 4 written, and the expansion of the pooled rows back to the tokens
 *      (embps_expand_bags_cuda, "xbags"), counted as n / BAG x width x 4 read + n x width x
 *      dtype written (ids and offsets not counted; no target).
 * and prints a short table last: op, width, dtype, GB/s, % of the copy bandwidth, against the
 * target of >= 70% of copy bandwidth at width 128.
 *
 * The table's rows are scaled by --rows-scale (default 1), and scaled down further, with a
 * printed note, when the table does not fit the free device memory (cudaMemGetInfo). Tables
 * are filled by embps_init_rows_cuda (never zeros) and the first gathered rows (into a
 * poisoned output) are checked against embps_init_value, dedup's count against the host's, and
 * one update of the first and the last deduped rows (the highest row ids: element offsets past
 * 2^32 in the 100M-row table) against embps_update_rowwise_adagrad_cpu bit for bit, so a
 * broken kernel cannot pass as a fast one. --probe only reports the device. Without a visible CUDA
 * device the program prints "SKIP: ..." and exits with 77. Exit 1 on any CUDA or launcher error or
 * failed check. */
#include <cuda_runtime_api.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/gpu/gpu_test_util.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "kernels/embps_kernels.h"

#define BATCH ((size_t)1 << 20)      /* tokens per batch */
#define COPY_BYTES ((size_t)1 << 30) /* 1 GiB */
#define ZIPF_S 1.05
#define SEED UINT64_C(20261202)
#define TARGET_PCT 70.0
#define INIT_SCALE 0.05f
#define BAG 16 /* tokens per bag in the pooling and expansion */

static cudaStream_t stream;
static int warmups = 3, reps = 15;

/* ---- results --------------------------------------------------------------------------------- */

typedef struct result {
  char op[16], dtype[8];
  size_t width, rows, items; /* items: tokens (gather, dedup) or unique rows (update) */
  double ms, bytes;          /* bytes moved per run (0: not a bandwidth op) */
} result_t;

static result_t results[48];
static int num_results;
static double copy_gbs;

static void add_result(const char *op, size_t width, const char *dtype, size_t rows, size_t items,
                       double ms, double bytes) {
  result_t *r = &results[num_results++];
  snprintf(r->op, sizeof(r->op), "%s", op);
  snprintf(r->dtype, sizeof(r->dtype), "%s", dtype);
  r->width = width;
  r->rows = rows;
  r->items = items;
  r->ms = ms;
  r->bytes = bytes;
  if (bytes > 0)
    printf("  %-8s width %-5zu %-4s  %9.4f ms  %8.1f GB/s\n", op, width, dtype, ms,
           bytes / (ms * 1e-3) / 1e9);
  else
    printf("  %-8s width %-5zu %-4s  %9.4f ms  %8.1f Mtokens/s\n", op, width, dtype, ms,
           (double)items / (ms * 1e-3) / 1e6);
  fflush(stdout);
}

/* ---- timing ---------------------------------------------------------------------------------- */

typedef void (*op_fn)(void *ctx);

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median milliseconds of `reps` runs of fn after `warmups` untimed ones, each timed by its own
 * pair of events on the stream. */
static double time_op(op_fn fn, void *ctx) {
  for (int i = 0; i < warmups; i++)
    fn(ctx);
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaEvent_t ev[2 * 64];
  int n = reps > 64 ? 64 : reps;
  for (int i = 0; i < 2 * n; i++)
    CUDA_OK(cudaEventCreate(&ev[i]));
  for (int i = 0; i < n; i++) {
    CUDA_OK(cudaEventRecord(ev[2 * i], stream));
    fn(ctx);
    CUDA_OK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  double ms[64];
  for (int i = 0; i < n; i++) {
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[i] = t;
  }
  for (int i = 0; i < 2 * n; i++)
    CUDA_OK(cudaEventDestroy(ev[i]));
  qsort(ms, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

/* ---- Zipf sampler: rejection-inversion (Hoermann & Derflinger 1996), O(1) per sample -------- */

typedef struct rng {
  uint64_t s;
} rng_t;

static uint64_t next_u64(rng_t *r) {
  uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

static double next_unit(rng_t *r) { return (double)(next_u64(r) >> 11) * 0x1p-53; }

typedef struct zipf {
  double s, n, h_x1, h_n, cut;
} zipf_t;

static double zipf_helper1(double x) { /* log1p(x) / x */
  return fabs(x) > 1e-8 ? log1p(x) / x : 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
}
static double zipf_helper2(double x) { /* expm1(x) / x */
  return fabs(x) > 1e-8 ? expm1(x) / x : 1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x));
}
static double zipf_h(const zipf_t *z, double x) { return exp(-z->s * log(x)); }
static double zipf_hint(const zipf_t *z, double x) {
  double lx = log(x);
  return zipf_helper2((1.0 - z->s) * lx) * lx;
}
static double zipf_hint_inv(const zipf_t *z, double x) {
  double t = x * (1.0 - z->s);
  if (t < -1.0)
    t = -1.0;
  return exp(zipf_helper1(t) * x);
}

static void zipf_init(zipf_t *z, double s, size_t n) {
  z->s = s;
  z->n = (double)n;
  z->h_x1 = zipf_hint(z, 1.5) - 1.0;
  z->h_n = zipf_hint(z, z->n + 0.5);
  z->cut = 2.0 - zipf_hint_inv(z, zipf_hint(z, 2.5) - zipf_h(z, 2.0));
}

/* A rank in [1, n], P(k) proportional to k^-s. */
static uint64_t zipf_rank(const zipf_t *z, rng_t *r) {
  for (;;) {
    double u = z->h_n + next_unit(r) * (z->h_x1 - z->h_n);
    double x = zipf_hint_inv(z, u);
    double kd = floor(x + 0.5);
    if (kd < 1.0)
      kd = 1.0;
    else if (kd > z->n)
      kd = z->n;
    if (kd - x <= z->cut || u >= zipf_hint(z, kd + 0.5) - zipf_h(z, kd))
      return (uint64_t)kd;
  }
}

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
  while (b) {
    uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* n tokens over [0, rows): Zipf ranks mapped to ids by id = (a * (rank - 1) + b) mod rows, a
 * coprime to rows (a bijection), so the hot rows are spread over the table. */
static void zipf_tokens(int64_t *out, size_t n, size_t rows, uint64_t seed) {
  zipf_t z;
  zipf_init(&z, ZIPF_S, rows);
  rng_t r = {seed};
  uint64_t a = UINT64_C(2654435761) % rows, b = next_u64(&r) % rows;
  if (a == 0)
    a = 1;
  while (gcd_u64(a, rows) != 1)
    a++;
  for (size_t i = 0; i < n; i++) {
    unsigned __int128 id = (unsigned __int128)a * (zipf_rank(&z, &r) - 1) + b;
    out[i] = (int64_t)(uint64_t)(id % rows);
  }
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static size_t host_unique_count(const int64_t *tokens, size_t n) {
  int64_t *t = malloc(n * sizeof(int64_t));
  if (!t) {
    fprintf(stderr, "FATAL: out of host memory\n");
    exit(1);
  }
  memcpy(t, tokens, n * sizeof(int64_t));
  qsort(t, n, sizeof(int64_t), cmp_i64);
  size_t u = n ? 1 : 0;
  for (size_t i = 1; i < n; i++)
    u += t[i] != t[i - 1];
  free(t);
  return u;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the ops ----------------------------------------------------------------------------------
 */

typedef struct ctx {
  void *src, *dst; /* copy */
  size_t bytes;
  void *table;
  embps_dtype_t dtype;
  size_t width, n, u;
  int64_t *tokens, *unique;
  uint32_t *seg_ids, *sorted_pos, *seg_offsets, *num_unique;
  void *ws;
  size_t ws_bytes;
  void *out;
  int64_t *no_slots; /* n slots of -1: every key reads its initial row */
  float *grad, *row_sumsq, *accum;
  embps_opt_params_t p;
  int64_t *bag_offsets; /* num_bags + 1: bag k is tokens [k * BAG, (k + 1) * BAG) */
  size_t num_bags;
  float *pooled; /* num_bags x width */
} ctx_t;

static void op_copy(void *v) {
  ctx_t *c = v;
  CUDA_OK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, stream));
}

static void op_dedup(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_dedup_cuda(c->tokens, c->n, c->unique, c->seg_ids, c->sorted_pos, c->seg_offsets,
                             c->num_unique, c->ws, c->ws_bytes, stream));
}

static void op_gather(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_gather_cuda(c->table, c->dtype, c->width, c->tokens, c->n, c->out, stream));
}

/* The hash-keyed gather with every key stored (its slot is its row: the same rows as gather) and
 * with none stored (every row the key's initial row, computed). */
static void op_hash_gather(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_hash_gather_cuda(c->table, c->dtype, c->width, c->tokens, c->tokens, c->n, c->out,
                                   0, SEED, INIT_SCALE, stream));
}

static void op_hash_init(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_hash_gather_cuda(c->table, c->dtype, c->width, c->tokens, c->no_slots, c->n,
                                   c->out, 0, SEED, INIT_SCALE, stream));
}

static void op_update(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_update_rowwise_adagrad_cuda(c->table, c->dtype, c->width, c->unique, c->u,
                                              c->grad, c->row_sumsq, c->width, c->accum, &c->p,
                                              stream));
}

static void op_segsum(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_segment_sum_cuda(c->out, EMBPS_DTYPE_F32, c->width, c->sorted_pos, c->seg_offsets,
                                   c->u, c->grad, stream));
}

/* Sum pooling of the batch's tokens (rows = ids: a dense table) as bags of BAG, and the
 * expansion of the pooled rows back to the tokens. */
static void op_pool(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_pool_bags_cuda(c->table, c->dtype, c->width, c->tokens, c->tokens, NULL,
                                 c->bag_offsets, c->num_bags, 0, c->pooled, 0, SEED, INIT_SCALE,
                                 stream));
}

static void op_expand_bags(void *v) {
  ctx_t *c = v;
  STATUS_OK(embps_expand_bags_cuda(c->pooled, c->width, c->tokens, NULL, c->bag_offsets,
                                   c->num_bags, 0, c->dtype, c->out, stream));
}

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}

static void *host_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "FATAL: out of host memory\n");
    exit(1);
  }
  return p;
}

/* One rowwise Adagrad step (op_update) checked against the CPU on the first and the last few
 * deduped rows, bit for bit: weights and accumulators. The deduped rows ascend, so the last
 * ones are the table's highest row ids, whose element offsets pass 2^32 at 100M x 128. Leaves
 * the step applied. Returns 0 when equal. */
static int check_update(ctx_t *c) {
  enum { K = 8 };
  const size_t es = embps_dtype_size(c->dtype), w = c->width, rb = w * es;
  size_t pick[K], k = 0;
  for (size_t i = 0; i < K / 2 && i < c->u; i++)
    pick[k++] = i;
  for (size_t i = c->u > K / 2 ? c->u - K / 2 : 0; i < c->u; i++)
    if (i >= K / 2)
      pick[k++] = i;
  int64_t ids[K], local[K];
  float acc[K], acc_got[K], rs[K];
  unsigned char *tab = host_alloc(K * rb), *tab_got = host_alloc(K * rb);
  float *grad = host_alloc(K * w * sizeof(float));
  CUDA_OK(cudaStreamSynchronize(stream)); /* cudaMemcpy does not wait for a non-blocking stream */
  for (size_t j = 0; j < k; j++) {
    CUDA_OK(cudaMemcpy(&ids[j], c->unique + pick[j], sizeof(int64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(tab + j * rb, (const char *)c->table + (size_t)ids[j] * rb, rb,
                       cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&acc[j], c->accum + ids[j], sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(
        cudaMemcpy(grad + j * w, c->grad + pick[j] * w, w * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&rs[j], c->row_sumsq + pick[j], sizeof(float), cudaMemcpyDeviceToHost));
    local[j] = (int64_t)j;
  }
  embps_update_rowwise_adagrad_cpu(tab, c->dtype, w, local, k, grad, rs, w, acc, &c->p);
  op_update(c);
  CUDA_OK(cudaStreamSynchronize(stream));
  size_t bad = 0;
  for (size_t j = 0; j < k; j++) {
    CUDA_OK(cudaMemcpy(tab_got + j * rb, (const char *)c->table + (size_t)ids[j] * rb, rb,
                       cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&acc_got[j], c->accum + ids[j], sizeof(float), cudaMemcpyDeviceToHost));
    bad += memcmp(tab + j * rb, tab_got + j * rb, rb) != 0;
    bad += memcmp(&acc[j], &acc_got[j], sizeof(float)) != 0;
  }
  if (bad)
    fprintf(stderr,
            "FAIL: update width %zu %s: %zu of %zu checked rows or accumulators differ from the "
            "CPU (row ids %" PRId64 " .. %" PRId64 ")\n",
            w, embps_dtype_name(c->dtype), bad, 2 * k, ids[0], ids[k ? k - 1 : 0]);
  free(tab), free(tab_got), free(grad);
  return bad != 0;
}

/* ---- one width: a table, a batch, dedup, then gather and update for f32 and bf16 ------------- */

/* The first rows of the batch's output, c->out, checked against the initializer: the rows of a
 * freshly initialized table, or the initial rows of its tokens as keys, are the same values. A
 * nonzero return when any differ, after printing which op it was. */
static int check_gathered(const ctx_t *c, const int64_t *h_tokens, const char *op) {
  const size_t check_rows = 64, width = c->width, es = embps_dtype_size(c->dtype);
  unsigned char *h = host_alloc(check_rows * width * es);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(h, c->out, check_rows * width * es, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < check_rows; i++)
    for (size_t j = 0; j < width; j++) {
      float want = embps_init_value(SEED, (uint64_t)h_tokens[i], j, INIT_SCALE);
      float got;
      if (c->dtype == EMBPS_DTYPE_BF16) {
        uint16_t b;
        memcpy(&b, h + (i * width + j) * 2, 2);
        got = embps_bf16_to_f32(b);
        want = embps_bf16_to_f32(embps_f32_to_bf16(want));
      } else {
        memcpy(&got, h + (i * width + j) * 4, 4);
      }
      bad += memcmp(&want, &got, sizeof(float)) != 0;
    }
  free(h);
  if (bad)
    fprintf(stderr,
            "FAIL: %s width %zu %s: %zu of %zu checked values differ from the initializer\n", op,
            width, embps_dtype_name(c->dtype), bad, check_rows * width);
  return bad != 0;
}

/* One pooling (op_pool) of the fresh table and one expansion (op_expand_bags) of its result,
 * checked on the first bags against the CPU references bit for bit (the rows of a fresh table
 * are the initializer's). Returns 0 when equal. */
static int check_bags(ctx_t *c, const int64_t *h_tokens) {
  enum { K = 4 };
  const size_t es = embps_dtype_size(c->dtype), w = c->width, rb = w * es;
  unsigned char *tab = host_alloc(K * BAG * rb), *xw = host_alloc(K * BAG * rb);
  unsigned char *xg = host_alloc(K * BAG * rb);
  float *pw = host_alloc(K * w * sizeof(float)), *pg = host_alloc(K * w * sizeof(float));
  float *tmp = host_alloc(2 * w * sizeof(float));
  int64_t rows[K * BAG], offsets[K + 1];
  for (size_t i = 0; i < K * BAG; i++) {
    embps_init_key_row_cpu(tab + i * rb, c->dtype, w, (uint64_t)h_tokens[i], 0, SEED, INIT_SCALE);
    rows[i] = (int64_t)i;
  }
  for (size_t k = 0; k <= K; k++)
    offsets[k] = (int64_t)(k * BAG);
  embps_pool_bags_cpu(tab, c->dtype, w, h_tokens, rows, NULL, offsets, K, 0, pw, tmp, 0, SEED,
                      INIT_SCALE);
  embps_expand_bags_cpu(pw, w, h_tokens, NULL, offsets, K, 0, c->dtype, xw);
  op_pool(c);
  op_expand_bags(c);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(pg, c->pooled, K * w * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(xg, c->out, K * BAG * rb, cudaMemcpyDeviceToHost));
  const int bad_pool = memcmp(pw, pg, K * w * sizeof(float)) != 0;
  const int bad_expand = memcmp(xw, xg, K * BAG * rb) != 0;
  if (bad_pool || bad_expand)
    fprintf(stderr, "FAIL: %s width %zu %s: the first %d bags differ from the CPU\n",
            bad_pool ? "pool" : "xbags", w, embps_dtype_name(c->dtype), K);
  free(tab), free(xw), free(xg), free(pw), free(pg), free(tmp);
  return bad_pool || bad_expand;
}

static int run_width(size_t width, size_t base_rows, double rows_scale) {
  const size_t n = BATCH;
  size_t rows = (size_t)((double)base_rows * rows_scale);
  if (rows < 1024)
    rows = 1024;

  size_t ws_bytes = embps_dedup_cuda_workspace_bytes(n);
  if (ws_bytes == 0) {
    fprintf(stderr, "FATAL: embps_dedup_cuda_workspace_bytes(%zu) failed\n", n);
    return 1;
  }
  /* Everything but the table and its accumulators: gather output and grads sized for f32 and
   * for u = n (the worst case), the dedup arrays, its workspace, row sums; plus 1 GiB spare. */
  const size_t fixed = 2 * n * width * sizeof(float) + 2 * n * sizeof(int64_t) +
                       (n / BAG) * (width * sizeof(float) + sizeof(int64_t)) +
                       4 * n * sizeof(uint32_t) + 64 + ws_bytes + n * sizeof(float) +
                       ((size_t)1 << 30);
  const size_t per_row = width * sizeof(float) + sizeof(float); /* f32 row + accumulator */
  size_t free_b = 0, total_b = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (fixed + rows * per_row > free_b) {
    size_t fit = free_b > fixed ? (free_b - fixed) / per_row : 0;
    printf("NOTE: width %zu: %zu rows (%.1f GB with accumulators) do not fit the %.1f GB free; "
           "using %zu rows\n",
           width, rows, (double)(rows * per_row) / 1e9, (double)free_b / 1e9, fit);
    rows = fit;
    if (rows < 1024) {
      fprintf(stderr, "FATAL: not even 1024 rows of width %zu fit\n", width);
      return 1;
    }
  }
  printf("\n== width %zu: table %zu rows (%.1f GB as f32, %.1f GB as bf16), batch %zu tokens "
         "Zipf(%.2f)\n",
         width, rows, (double)rows * width * 4 / 1e9, (double)rows * width * 2 / 1e9, n, ZIPF_S);

  /* The batch, on the host. */
  int64_t *h_tokens = malloc(n * sizeof(int64_t));
  if (!h_tokens) {
    fprintf(stderr, "FATAL: out of host memory\n");
    return 1;
  }
  double t0 = now_s();
  zipf_tokens(h_tokens, n, rows, SEED ^ width);
  double t1 = now_s();
  size_t host_u = host_unique_count(h_tokens, n);
  printf("  sampled %zu tokens in %.0f ms on the host; %zu distinct (%.1f%%)\n", n, (t1 - t0) * 1e3,
         host_u, 100.0 * (double)host_u / (double)n);

  ctx_t c = {0};
  c.width = width;
  c.n = n;
  c.ws_bytes = ws_bytes;
  c.table = dev_alloc(rows * width * sizeof(float)); /* bf16 runs use its first half */
  c.accum = dev_alloc(rows * sizeof(float));
  c.tokens = dev_alloc(n * sizeof(int64_t));
  c.unique = dev_alloc(n * sizeof(int64_t));
  c.seg_ids = dev_alloc(n * sizeof(uint32_t));
  c.sorted_pos = dev_alloc(n * sizeof(uint32_t));
  c.seg_offsets = dev_alloc((n + 1) * sizeof(uint32_t));
  c.num_unique = dev_alloc(sizeof(uint32_t));
  c.ws = dev_alloc(ws_bytes);
  c.out = dev_alloc(n * width * sizeof(float));
  c.no_slots = dev_alloc(n * sizeof(int64_t));
  CUDA_OK(cudaMemsetAsync(c.no_slots, 0xff, n * sizeof(int64_t), stream)); /* every slot -1 */
  CUDA_OK(cudaMemcpyAsync(c.tokens, h_tokens, n * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  c.num_bags = n / BAG;
  c.pooled = dev_alloc(c.num_bags * width * sizeof(float));
  c.bag_offsets = dev_alloc((c.num_bags + 1) * sizeof(int64_t));
  {
    int64_t *h_off = host_alloc((c.num_bags + 1) * sizeof(int64_t));
    for (size_t k = 0; k <= c.num_bags; k++)
      h_off[k] = (int64_t)(k * BAG);
    CUDA_OK(cudaMemcpy(c.bag_offsets, h_off, (c.num_bags + 1) * sizeof(int64_t),
                       cudaMemcpyHostToDevice));
    free(h_off);
  }

  /* Dedup (independent of width and dtype, timed once per batch). */
  double ms = time_op(op_dedup, &c);
  uint32_t u32 = 0;
  CUDA_OK(cudaMemcpy(&u32, c.num_unique, sizeof(u32), cudaMemcpyDeviceToHost));
  if ((size_t)u32 != host_u) {
    fprintf(stderr, "FAIL: dedup found %u distinct tokens, the host %zu\n", u32, host_u);
    return 1;
  }
  c.u = u32;
  add_result("dedup", width, "-", rows, n, ms, 0);

  /* Gradients of the deduped rows (nonzero, from the initializer) and their row sums. */
  c.grad = dev_alloc(c.u * width * sizeof(float));
  c.row_sumsq = dev_alloc(c.u * sizeof(float));
  /* (init_rows leaves row 0, the padding row, at zero: one zero gradient row among u.) */
  STATUS_OK(
      embps_init_rows_cuda(c.grad, EMBPS_DTYPE_F32, width, 0, c.u, 0, SEED + 1, 0.01f, stream));
  {
    const size_t block = embps_row_stats_block(width);
    float *parts = dev_alloc(c.u * (width / block) * sizeof(float) + 4);
    STATUS_OK(embps_row_partials_cuda(c.grad, c.u, width, block, parts, stream));
    STATUS_OK(embps_row_combine_cuda(parts, 1, c.u, width / block, c.row_sumsq, NULL, NULL, NULL,
                                     stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaFree(parts));
  }
  c.p = (embps_opt_params_t){.lr = 0.01f, .eps = 1e-8f, .decay = 1.0f};

  const embps_dtype_t dtypes[2] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  for (int d = 0; d < 2; d++) {
    c.dtype = dtypes[d];
    const size_t es = embps_dtype_size(c.dtype);
    const char *dn = embps_dtype_name(c.dtype);
    STATUS_OK(embps_init_rows_cuda(c.table, c.dtype, width, 0, rows, 0, SEED, INIT_SCALE, stream));
    CUDA_OK(cudaMemsetAsync(c.accum, 0, rows * sizeof(float), stream));

    /* One gather of the fresh table into a poisoned output, checked against the initializer
     * on the first rows; the same for the hash-keyed gather with and without slots. */
    CUDA_OK(cudaMemsetAsync(c.out, 0xff, n * width * es, stream));
    op_gather(&c);
    if (check_gathered(&c, h_tokens, "gather"))
      return 1;
    ms = time_op(op_gather, &c);
    add_result("gather", width, dn, rows, n, ms, 2.0 * (double)n * (double)width * (double)es);

    /* The hash-keyed gather: every slot stored, counted as gather; no slot stored, in rows/s. */
    static const struct {
      void (*fn)(void *);
      const char *op;
    } hash_ops[] = {{op_hash_gather, "hgather"}, {op_hash_init, "hginit"}};
    for (size_t h = 0; h < 2; h++) {
      CUDA_OK(cudaMemsetAsync(c.out, 0xff, n * width * es, stream));
      hash_ops[h].fn(&c);
      if (check_gathered(&c, h_tokens, hash_ops[h].op))
        return 1;
      ms = time_op(hash_ops[h].fn, &c);
      add_result(hash_ops[h].op, width, dn, rows, n, ms,
                 h == 0 ? 2.0 * (double)n * (double)width * (double)es : 0.0);
    }

    /* The bags, before the update changes the table. */
    if (check_bags(&c, h_tokens))
      return 1;
    ms = time_op(op_pool, &c);
    add_result("pool", width, dn, rows, n, ms,
               (double)n * (double)width * (double)es + (double)c.num_bags * (double)width * 4.0);
    ms = time_op(op_expand_bags, &c);
    add_result("xbags", width, dn, rows, n, ms,
               (double)c.num_bags * (double)width * 4.0 + (double)n * (double)width * (double)es);

    if (check_update(&c))
      return 1;
    ms = time_op(op_update, &c);
    double ub = (double)c.u * ((double)width * (2.0 * (double)es + 4.0) + 2.0 * 4.0 + 8.0 + 4.0);
    add_result("update", width, dn, rows, c.u, ms, ub);
  }

  /* Segment sum of f32 batch gradients (the gather output, refilled) into c.grad: done with the
   * update, so its gradients may be overwritten. */
  STATUS_OK(embps_init_rows_cuda(c.out, EMBPS_DTYPE_F32, width, 0, n, 0, SEED + 2, 0.01f, stream));
  ms = time_op(op_segsum, &c);
  add_result("segsum", width, "f32", rows, n, ms, ((double)n + (double)c.u) * (double)width * 4.0);

  void *bufs[] = {c.table,      c.accum,       c.tokens,     c.unique, c.seg_ids,
                  c.sorted_pos, c.seg_offsets, c.num_unique, c.ws,     c.out,
                  c.grad,       c.row_sumsq,   c.no_slots,   c.pooled, c.bag_offsets};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    CUDA_OK(cudaFree(bufs[i]));
  free(h_tokens);
  return 0;
}

static void usage(FILE *f) {
  fprintf(f, "usage: bench_kernels_gpu [--quick] [--rows-scale X] [--device N] [--probe]\n"
             "  --quick         1 warm-up and 5 timed runs per op (default 3 and 15)\n"
             "  --rows-scale X  multiply the table rows (100M at width 128, 10M at 1024) by X\n"
             "  --device N      CUDA device (default: $EMBPS_GPU_DEVICE, else 0)\n"
             "  --probe         print the device and exit (77 when none is visible)\n");
}

int main(int argc, char **argv) {
  double rows_scale = 1.0;
  int probe = 0, device = 0;
  const char *env_dev = getenv("EMBPS_GPU_DEVICE"); /* a number; the server's is EMBPS_DEVICE */
  if (env_dev && *env_dev)
    device = atoi(env_dev);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) {
      warmups = 1;
      reps = 5;
    } else if (!strcmp(argv[i], "--probe")) {
      probe = 1;
    } else if (!strcmp(argv[i], "--rows-scale") && i + 1 < argc) {
      char *end;
      rows_scale = strtod(argv[++i], &end);
      if (*end || !(rows_scale > 0)) {
        fprintf(stderr, "bad --rows-scale '%s'\n", argv[i]);
        return 2;
      }
    } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
      device = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }

  int count = gpu_devices_or_skip();
  if (count == 0)
    return GPU_SKIP_CODE;
  if (device < 0 || device >= count) {
    fprintf(stderr, "FATAL: --device %d, but %d device(s) visible\n", device, count);
    return 1;
  }
  CUDA_OK(cudaSetDevice(device));
  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  size_t free_b = 0, total_b = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  int drv = 0, rt = 0;
  CUDA_OK(cudaDriverGetVersion(&drv));
  CUDA_OK(cudaRuntimeGetVersion(&rt));
  printf("GPU %d of %d: %s, sm_%d%d, %d SMs, L2 %.0f MB, memory %.1f GB (%.1f GB free), "
         "driver %d.%d, runtime %d.%d\n",
         device, count, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
         prop.l2CacheSize / 1e6, (double)total_b / 1e9, (double)free_b / 1e9, drv / 1000,
         drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
  if (probe)
    return 0;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  printf("timing: CUDA events, median of %d runs after %d warm-up%s\n", reps, warmups,
         warmups == 1 ? "" : "s");

  /* 1. Copy ceiling. */
  {
    ctx_t c = {0};
    c.bytes = COPY_BYTES;
    c.src = dev_alloc(c.bytes);
    c.dst = dev_alloc(c.bytes);
    CUDA_OK(cudaMemsetAsync(c.src, 0x5a, c.bytes, stream));
    double ms = time_op(op_copy, &c);
    copy_gbs = 2.0 * (double)c.bytes / (ms * 1e-3) / 1e9;
    printf("\n== copy: cudaMemcpyAsync device to device, 1 GiB: %.3f ms, %.1f GB/s counting bytes "
           "read + written (2 GiB per copy)\n",
           ms, copy_gbs);
    add_result("copy", 0, "-", 0, 0, ms, 2.0 * (double)c.bytes);
    CUDA_OK(cudaFree(c.src));
    CUDA_OK(cudaFree(c.dst));
  }

  /* 2. Kernels. */
  if (run_width(128, 100000000, rows_scale) || run_width(1024, 10000000, rows_scale))
    return 1;

  printf("\nbytes counted per run (n = batch tokens, u = distinct tokens, w = width, e = 4 for "
         "f32, 2 for bf16):\n"
         "  copy:   2 x 1 GiB (read + write)\n"
         "  gather: n*w*e read from the table + n*w*e written (token ids not counted)\n"
         "  hgather: as gather (keys and slots not counted); hginit: no byte count, rows/s\n"
         "  update: u*w*e*2 (weights read+write) + u*w*4 (f32 grads read) + u*4*2 (accumulators "
         "read+write) + u*(8+4) (row ids, row sums of squares read)\n"
         "  segsum: n*w*4 (f32 batch grads read) + u*w*4 (sums written); no target\n"
         "  pool:   n*w*e read from the table + (n/B)*w*4 written (bags of B = %d; ids, offsets "
         "not counted); no target\n"
         "  xbags:  (n/B)*w*4 read + n*w*e written (the pooled rows expanded); no target\n"
         "  dedup:  no byte count; tokens/s\n",
         BAG);

  printf("\n== summary (%s; target: gather and update >= %.0f%% of copy bandwidth at width "
         "128)\n",
         prop.name, TARGET_PCT);
  printf("%-7s %5s %5s %10s %9s %9s %7s %s\n", "op", "width", "dtype", "rows", "items", "ms",
         "GB/s", "%copy  target");
  for (int i = 0; i < num_results; i++) {
    const result_t *r = &results[i];
    char w[24] = "-", rows[24] = "-", items[24] = "-";
    if (r->width)
      snprintf(w, sizeof(w), "%zu", r->width);
    if (r->rows)
      snprintf(rows, sizeof(rows), "%zu", r->rows);
    if (r->items)
      snprintf(items, sizeof(items), "%zu", r->items);
    if (r->bytes > 0) {
      double gbs = r->bytes / (r->ms * 1e-3) / 1e9, pct = 100.0 * gbs / copy_gbs;
      const char *tgt = "";
      if (r->width == 128 && (!strcmp(r->op, "gather") || !strcmp(r->op, "update")))
        tgt = pct >= TARGET_PCT ? "  ok" : "  BELOW";
      printf("%-7s %5s %5s %10s %9s %9.4f %7.1f %5.1f%s\n", r->op, w, r->dtype, rows, items, r->ms,
             gbs, pct, tgt);
    } else {
      printf("%-7s %5s %5s %10s %9s %9.4f %7s %5s  (%.0f Mtokens/s)\n", r->op, w, r->dtype, rows,
             items, r->ms, "-", "-", (double)r->items / (r->ms * 1e-3) / 1e6);
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
  return 0;
}
