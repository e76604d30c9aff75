/* GPU kernels against their CPU references (kernels/cuda/<op>.cu against kernels/<op>.c).
 *
 * Every launcher runs on random inputs drawn from a fresh seed (printed; EMBPS_TEST_SEED=<n>
 * replays a run) for f32 and bf16 storage, widths 1, 7, 128 and 1024 and batches of 0, 1
 * and 4099 tokens with Zipf-like duplication and padding tokens (the hash-keyed tables' kernels
 * with 64-bit keys of every kind and about half the slots -1; the bags' pooling and expansion
 * with bags of those tokens, every mode, empty and padding-only bags and a third of the ids
 * absent hash keys), and its output must equal the CPU's bit for bit (row stats' total, summed
 * in a different order, within 1e-12 relative, and bit for bit between two GPU runs). Every
 * device output is filled with 0xFF before the kernel runs and every host output likewise, so
 * an element the kernel forgot to write, or wrote where it must not, shows up as a mismatch.
 *
 * Without a visible CUDA device the program prints one "SKIP: ..." line and exits with 77,
 * which ctest reports as skipped (SKIP_RETURN_CODE). */
#include <cuda_runtime_api.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/gpu/gpu_test_util.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "kernels/embps_kernels.h"

#define NUM_ROWS 8192 /* table rows: tokens are drawn from [0, NUM_ROWS) */

static int failures;
static cudaStream_t stream;

#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                         \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fputc('\n', stderr);                                                                         \
      failures++;                                                                                  \
    }                                                                                              \
  } while (0)

/* ---- random inputs -------------------------------------------------------------------------- */

typedef struct rng {
  uint64_t s;
} rng_t;

static uint64_t next_u64(rng_t *r) {
  uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double next_unit(rng_t *r) { return (double)(next_u64(r) >> 11) * 0x1p-53; }

static float next_float(rng_t *r, float lo, float hi) {
  return lo + (hi - lo) * (float)next_unit(r);
}

/* Zipf(1.1) over NUM_ROWS ranks, ranks mapped to token ids by a random permutation so that the
 * hot tokens are spread over the id range; 5% of the tokens are padding (0). */
typedef struct zipf {
  double cdf[NUM_ROWS];
  int64_t token_of_rank[NUM_ROWS];
} zipf_t;

static void zipf_init(zipf_t *z, rng_t *r) {
  double sum = 0.0;
  for (int k = 0; k < NUM_ROWS; k++) {
    sum += 1.0 / pow((double)(k + 1), 1.1);
    z->cdf[k] = sum;
    z->token_of_rank[k] = k;
  }
  for (int k = 0; k < NUM_ROWS; k++)
    z->cdf[k] /= sum;
  for (int k = NUM_ROWS - 1; k > 0; k--) {
    int j = (int)(next_u64(r) % (uint64_t)(k + 1));
    int64_t t = z->token_of_rank[k];
    z->token_of_rank[k] = z->token_of_rank[j];
    z->token_of_rank[j] = t;
  }
}

static int64_t zipf_token(const zipf_t *z, rng_t *r) {
  if (next_unit(r) < 0.05)
    return 0;
  double u = next_unit(r);
  int lo = 0, hi = NUM_ROWS - 1;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (z->cdf[mid] < u)
      lo = mid + 1;
    else
      hi = mid;
  }
  return z->token_of_rank[lo];
}

/* n elements of dtype with values in [lo, hi) (bf16: the f32 value rounded). */
static void fill_values(void *p, embps_dtype_t dtype, size_t n, rng_t *r, float lo, float hi) {
  for (size_t i = 0; i < n; i++) {
    float x = next_float(r, lo, hi);
    if (dtype == EMBPS_DTYPE_BF16)
      ((uint16_t *)p)[i] = embps_f32_to_bf16(x);
    else
      ((float *)p)[i] = x;
  }
}

/* ---- host and device buffers -------------------------------------------------------------- */

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "FATAL: out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

static void *host_poisoned(size_t bytes) {
  void *p = xmalloc(bytes);
  memset(p, 0xff, bytes);
  return p;
}

static void *host_copy(const void *src, size_t bytes) {
  void *p = xmalloc(bytes);
  if (bytes)
    memcpy(p, src, bytes);
  return p;
}

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}

static void dev_poison(void *d, size_t bytes) {
  if (bytes)
    CUDA_OK(cudaMemsetAsync(d, 0xff, bytes, stream));
}

static void *dev_poisoned(size_t bytes) {
  void *d = dev_alloc(bytes);
  dev_poison(d, bytes);
  return d;
}

/* A device copy of h, complete on return: CUDA does not promise when an async copy from
 * pageable memory reads it, and callers free h right after. */
static void *dev_upload(const void *h, size_t bytes) {
  void *d = dev_alloc(bytes);
  if (bytes) {
    CUDA_OK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  return d;
}

/* Waits for the stream, then copies back into a new host buffer. */
static void *dev_download(const void *d, size_t bytes) {
  void *h = host_poisoned(bytes);
  CUDA_OK(cudaStreamSynchronize(stream));
  if (bytes)
    CUDA_OK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
  return h;
}

static void dev_free(void *d) { CUDA_OK(cudaFree(d)); }

/* Compares two buffers bit for bit as elements of `es` bytes; reports the first difference. */
static int same_bits(const char *what, const char *cfg, const void *want, const void *got,
                     size_t bytes, size_t es) {
  if (bytes == 0 || memcmp(want, got, bytes) == 0)
    return 1;
  size_t n = bytes / es, bad = 0, first = n;
  for (size_t i = 0; i < n; i++)
    if (memcmp((const char *)want + i * es, (const char *)got + i * es, es) != 0) {
      bad++;
      if (first == n)
        first = i;
    }
  uint64_t w = 0, g = 0;
  memcpy(&w, (const char *)want + first * es, es < 8 ? es : 8);
  memcpy(&g, (const char *)got + first * es, es < 8 ? es : 8);
  CHECK(0, "%s [%s]: %zu of %zu elements differ, first at %zu: cpu 0x%" PRIx64 " gpu 0x%" PRIx64,
        what, cfg, bad, n, first, w, g);
  return 0;
}

/* ---- one configuration: dtype x width x batch --------------------------------------------- */

typedef struct config {
  embps_dtype_t dtype;
  size_t width, n;
  char name[64];
} config_t;

/* Runs one optimizer on CPU and GPU from the same table and state, compares everything. */
typedef enum { RUN_SGD, RUN_ADAGRAD, RUN_ROWWISE, RUN_ADAM } opt_run_t;

static void check_update(const config_t *c, opt_run_t which, const void *table0,
                         const int64_t *rows, size_t u, const float *grad, const float *row_sumsq,
                         rng_t *r) {
  static const char *names[] = {"sgd", "adagrad", "rowwise adagrad", "adam"};
  const size_t es = embps_dtype_size(c->dtype), w = c->width;
  const size_t table_bytes = (size_t)NUM_ROWS * w * es;
  const size_t state_elems = which == RUN_ROWWISE ? NUM_ROWS : (size_t)NUM_ROWS * w;
  const size_t state_bytes = state_elems * sizeof(float);
  float *s1 = xmalloc(state_bytes), *s2 = xmalloc(state_bytes);
  for (size_t i = 0; i < state_elems; i++) {
    s1[i] = which == RUN_ADAM ? next_float(r, -0.1f, 0.1f) : next_float(r, 0.0f, 1.0f);
    s2[i] = next_float(r, 0.0f, 0.01f);
  }
  embps_opt_params_t p = {.lr = 0.05f,
                          .eps = 1e-6f,
                          .decay = (next_u64(r) & 1) ? 1.0f : embps_opt_decay_from_half_life(100),
                          .beta1 = 0.9f,
                          .beta2 = 0.999f,
                          .step = 0};
  void *h_table = host_copy(table0, table_bytes);
  float *h_s1 = host_copy(s1, state_bytes), *h_s2 = host_copy(s2, state_bytes);
  void *d_table = dev_upload(table0, table_bytes);
  float *d_s1 = dev_upload(s1, state_bytes), *d_s2 = dev_upload(s2, state_bytes);
  int64_t *d_rows = dev_upload(rows, u * sizeof(int64_t));
  float *d_grad = dev_upload(grad, u * w * sizeof(float));
  float *d_rs = dev_upload(row_sumsq, u * sizeof(float));
  size_t full_width = w * 3;

  /* Two steps, so that the second starts from state the first wrote (adam: steps 0 and 5). */
  for (int step = 0; step < 2; step++) {
    p.step = step == 0 ? 0 : 5;
    switch (which) {
    case RUN_SGD:
      embps_update_sgd_cpu(h_table, c->dtype, w, rows, u, grad, &p);
      STATUS_OK(embps_update_sgd_cuda(d_table, c->dtype, w, d_rows, u, d_grad, &p, stream));
      break;
    case RUN_ADAGRAD:
      embps_update_adagrad_cpu(h_table, c->dtype, w, rows, u, grad, h_s1, &p);
      STATUS_OK(
          embps_update_adagrad_cuda(d_table, c->dtype, w, d_rows, u, d_grad, d_s1, &p, stream));
      break;
    case RUN_ROWWISE:
      embps_update_rowwise_adagrad_cpu(h_table, c->dtype, w, rows, u, grad, row_sumsq, full_width,
                                       h_s1, &p);
      STATUS_OK(embps_update_rowwise_adagrad_cuda(d_table, c->dtype, w, d_rows, u, d_grad, d_rs,
                                                  full_width, d_s1, &p, stream));
      break;
    case RUN_ADAM:
      embps_update_adam_cpu(h_table, c->dtype, w, rows, u, grad, h_s1, h_s2, &p);
      STATUS_OK(
          embps_update_adam_cuda(d_table, c->dtype, w, d_rows, u, d_grad, d_s1, d_s2, &p, stream));
      break;
    }
  }
  void *g_table = dev_download(d_table, table_bytes);
  void *g_s1 = dev_download(d_s1, state_bytes), *g_s2 = dev_download(d_s2, state_bytes);
  char what[64];
  snprintf(what, sizeof(what), "%s weights", names[which]);
  same_bits(what, c->name, h_table, g_table, table_bytes, es);
  if (which != RUN_SGD) {
    snprintf(what, sizeof(what), "%s state", names[which]);
    same_bits(what, c->name, h_s1, g_s1, state_bytes, sizeof(float));
  }
  if (which == RUN_ADAM)
    same_bits("adam v", c->name, h_s2, g_s2, state_bytes, sizeof(float));
  /* Untouched rows must be untouched (compared above too, since both started equal). */
  free(g_table), free(g_s1), free(g_s2);
  free(h_table), free(h_s1), free(h_s2), free(s1), free(s2);
  dev_free(d_table), dev_free(d_s1), dev_free(d_s2), dev_free(d_rows), dev_free(d_grad);
  dev_free(d_rs);
}

/* The combine split by owner (engine.c's row_figures on 3 owners) over the device partials
 * d_parts (slices x rows x nb): each owner's q rows of every slice copied as the all-to-all
 * would (the rows past the last left poisoned: never added), embps_row_sums_cuda on them,
 * embps_row_finish_cuda on every row's sum: row_sumsq, the count and the total bit for bit
 * those of embps_row_combine_cuda on the same partials (want_rs, want_bad; want_total is its
 * total as added to 1.5). */
static void check_by_owner(const config_t *c, const char *what, const float *d_parts, size_t slices,
                           size_t rows, size_t nb, const float *want_rs, double want_total,
                           uint64_t want_bad) {
  const size_t owners = 3, q = (rows + owners - 1) / owners;
  float *d_recv = dev_poisoned((slices * q * nb + 1) * sizeof(float));
  double *d_sums = dev_poisoned((owners * q + 1) * sizeof(double));
  float *d_rs = dev_poisoned((rows + 1) * sizeof(float));
  double *d_total = dev_alloc(sizeof(double));
  uint64_t *d_bad = dev_poisoned(sizeof(uint64_t));
  void *d_ws = dev_poisoned(embps_row_combine_cuda_workspace_bytes(rows) + 8);
  const double start = 1.5;
  char name[80];
  CUDA_OK(cudaMemcpyAsync(d_total, &start, sizeof(start), cudaMemcpyHostToDevice, stream));
  for (size_t j = 0; j < owners; j++) {
    const size_t first = j * q, owned = rows > first ? (rows - first < q ? rows - first : q) : 0;
    for (size_t r = 0; r < slices && owned > 0; r++)
      CUDA_OK(cudaMemcpyAsync(d_recv + r * q * nb, d_parts + (r * rows + first) * nb,
                              owned * nb * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    STATUS_OK(embps_row_sums_cuda(d_recv, slices, q, owned, nb, d_sums + first, stream));
  }
  STATUS_OK(embps_row_finish_cuda(d_sums, rows, d_rs, d_total, d_bad, d_ws, stream));
  float *g_rs = dev_download(d_rs, rows * sizeof(float));
  double *g_total = dev_download(d_total, sizeof(double));
  uint64_t *g_bad = dev_download(d_bad, sizeof(uint64_t));
  snprintf(name, sizeof(name), "%s by owner: row_sumsq", what);
  same_bits(name, c->name, want_rs, g_rs, rows * sizeof(float), sizeof(float));
  CHECK(*g_bad == want_bad, "%s by owner: non-finite rows [%s]: combine %" PRIu64 " owner %" PRIu64,
        what, c->name, want_bad, *g_bad);
  CHECK(memcmp(g_total, &want_total, sizeof(double)) == 0 || (isnan(*g_total) && isnan(want_total)),
        "%s by owner: total [%s]: combine %.17g owner %.17g", what, c->name, want_total, *g_total);
  free(g_rs), free(g_total), free(g_bad);
  dev_free(d_recv), dev_free(d_sums), dev_free(d_rs), dev_free(d_total), dev_free(d_bad);
  dev_free(d_ws);
}

/* Row statistics of g (u x w) on both sides: the column-block partials bit for bit, then their
 * combine (as two slices when the width splits in two at a block boundary, as a group of two
 * would, else one): per-row sums bit for bit, the count of non-finite rows exact, the total
 * close and identical over two GPU runs. Returns the CPU's row sums (caller frees). */
static float *check_row_stats(const config_t *c, const char *what, const float *g, size_t u) {
  const size_t w = c->width, block = embps_row_stats_block(w), nb = block ? w / block : 0;
  const size_t slices = (nb % 2 == 0 && u % 2 == 0 && u > 0) ? 2 : 1, rows = u / slices;
  float *h_parts = host_poisoned((u * nb + 1) * sizeof(float));
  float *h_rs = host_poisoned((rows + 1) * sizeof(float));
  double h_total = 1.5; /* added to, not overwritten */
  embps_row_partials_cpu(g, u, w, block, h_parts);
  /* The u x nb partials read as `slices` arrays of rows x nb: the same bytes a group of that
   * many ranks would gather (only the layout matters to the combine). */
  size_t h_bad = embps_row_combine_cpu(h_parts, slices, rows, nb, h_rs, &h_total);

  float *d_g = dev_upload(g, (u * w + 1) * sizeof(float));
  float *d_parts = dev_poisoned((u * nb + 1) * sizeof(float));
  float *d_rs = dev_poisoned((rows + 1) * sizeof(float));
  double *d_total = dev_alloc(2 * sizeof(double));
  uint64_t *d_bad = dev_poisoned(sizeof(uint64_t));
  size_t ws_bytes = embps_row_combine_cuda_workspace_bytes(rows);
  void *d_ws = dev_poisoned(ws_bytes + 8);
  double start[2] = {1.5, 1.5};
  CUDA_OK(cudaMemcpyAsync(d_total, start, sizeof(start), cudaMemcpyHostToDevice, stream));
  STATUS_OK(embps_row_partials_cuda(d_g, u, w, block, d_parts, stream));
  float *g_parts = dev_download(d_parts, u * nb * sizeof(float));
  char name[80];
  snprintf(name, sizeof(name), "%s partials", what);
  for (size_t i = 0; i < u * nb; i++) {
    int ok = isnan(h_parts[i]) ? isnan(g_parts[i])
                               : memcmp(&h_parts[i], &g_parts[i], sizeof(float)) == 0;
    CHECK(ok, "%s [%s] %zu: cpu %g gpu %g", name, c->name, i, h_parts[i], g_parts[i]);
  }
  STATUS_OK(
      embps_row_combine_cuda(d_parts, slices, rows, nb, d_rs, &d_total[0], d_bad, d_ws, stream));
  dev_poison(d_ws, ws_bytes);
  STATUS_OK(
      embps_row_combine_cuda(d_parts, slices, rows, nb, NULL, &d_total[1], NULL, d_ws, stream));
  float *g_rs = dev_download(d_rs, rows * sizeof(float));
  double *g_total = dev_download(d_total, 2 * sizeof(double));
  uint64_t *g_bad = dev_download(d_bad, sizeof(uint64_t));

  snprintf(name, sizeof(name), "%s row_sumsq", what);
  if (h_bad == 0) {
    same_bits(name, c->name, h_rs, g_rs, rows * sizeof(float), sizeof(float));
  } else {
    /* Rows with a NaN or inf are "not meaningful": both must be non-finite of the same kind
     * (NaN payloads differ between x86 and the GPU), the other rows bit for bit. */
    for (size_t i = 0; i < rows; i++) {
      int ok = isnan(h_rs[i]) ? isnan(g_rs[i]) : memcmp(&h_rs[i], &g_rs[i], sizeof(float)) == 0;
      CHECK(ok, "%s [%s] row %zu: cpu %g gpu %g", name, c->name, i, h_rs[i], g_rs[i]);
    }
  }
  CHECK(*g_bad == h_bad, "%s non-finite rows [%s]: cpu %zu gpu %" PRIu64, what, c->name, h_bad,
        *g_bad);
  if (isfinite(h_total)) {
    double tol = 1e-12 * fabs(h_total);
    CHECK(fabs(g_total[0] - h_total) <= tol, "%s total [%s]: cpu %.17g gpu %.17g", what, c->name,
          h_total, g_total[0]);
  } else {
    CHECK(!!isnan(h_total) == !!isnan(g_total[0]) && !isfinite(g_total[0]),
          "%s total [%s]: cpu %g gpu %g", what, c->name, h_total, g_total[0]);
  }
  CHECK(memcmp(&g_total[0], &g_total[1], sizeof(double)) == 0,
        "%s total not deterministic [%s]: %.17g then %.17g", what, c->name, g_total[0], g_total[1]);
  check_by_owner(c, what, d_parts, slices, rows, nb, g_rs, g_total[0], *g_bad);
  free(g_parts), free(g_rs), free(g_total), free(g_bad), free(h_parts);
  dev_free(d_g), dev_free(d_parts), dev_free(d_rs), dev_free(d_total), dev_free(d_bad);
  dev_free(d_ws);
  if (slices == 1)
    return h_rs;
  /* The updates take one sum per row of g: the whole width's, as one slice. */
  free(h_rs);
  h_rs = host_poisoned((u + 1) * sizeof(float));
  h_parts = host_poisoned((u * nb + 1) * sizeof(float));
  embps_row_partials_cpu(g, u, w, block, h_parts);
  embps_row_combine_cpu(h_parts, 1, u, nb, h_rs, NULL);
  free(h_parts);
  return h_rs;
}

static void check_init(const config_t *c, rng_t *r) {
  const size_t es = embps_dtype_size(c->dtype), w = c->width;
  /* Covers row 0 (padding) when the batch has a single row. */
  uint64_t row_begin = c->n == 1 ? 0 : next_u64(r) % 100;
  uint64_t row_end = row_begin + c->n, col_begin = next_u64(r) % 1000, seed = next_u64(r);
  size_t bytes = (size_t)(row_end + 2) * w * es; /* two rows past the end must stay poisoned */
  void *h = host_poisoned(bytes);
  void *d = dev_poisoned(bytes);
  embps_init_rows_cpu(h, c->dtype, w, row_begin, row_end, col_begin, seed, 0.05f);
  STATUS_OK(
      embps_init_rows_cuda(d, c->dtype, w, row_begin, row_end, col_begin, seed, 0.05f, stream));
  void *g = dev_download(d, bytes);
  same_bits("init", c->name, h, g, bytes, es);
  free(h), free(g);
  dev_free(d);
}

/* ---- hash-keyed tables ------------------------------------------------------------------- */

/* A 64-bit key as a hash table sees them: the padding key 0, keys with the top bit set (negative
 * as int64), all ones, small ones and random bit patterns. */
static int64_t hash_key(rng_t *r, size_t i) {
  switch (i % 8) {
  case 0:
    return 0;
  case 1:
    return INT64_MIN + (int64_t)(next_u64(r) % 1000);
  case 2:
    return -1 - (int64_t)(next_u64(r) % 1000);
  case 3:
    return (int64_t)(next_u64(r) % NUM_ROWS);
  default:
    return (int64_t)next_u64(r);
  }
}

/* Gather by slot (about half the slots -1, stored slots repeating) into an aligned and an
 * element-offset output, then resets of distinct slots with state0 widths 0, 1 and width and
 * with and without state1, then the key order out of place and in place: all against the CPU
 * bit for bit, guard bytes past every output and every untouched slot included. */
static void check_hash(const config_t *c, rng_t *r) {
  const size_t es = embps_dtype_size(c->dtype), w = c->width, n = c->n, row_bytes = w * es;
  const size_t table_bytes = (size_t)NUM_ROWS * row_bytes;
  const uint64_t col_begin = next_u64(r) % 1000, seed = next_u64(r);
  const float scale = 0.05f;
  void *table = xmalloc(table_bytes);
  fill_values(table, c->dtype, (size_t)NUM_ROWS * w, r, -1.0f, 1.0f);
  int64_t *keys = xmalloc(n * sizeof(int64_t)), *slots = xmalloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++) {
    keys[i] = hash_key(r, i);
    slots[i] = (next_u64(r) & 1) ? -1 : (int64_t)(next_u64(r) % NUM_ROWS);
  }
  void *d_table = dev_upload(table, table_bytes);
  int64_t *d_keys = dev_upload(keys, n * sizeof(int64_t));
  int64_t *d_slots = dev_upload(slots, n * sizeof(int64_t));

  /* Gather, at out and at out + one element (a narrower copy unit), 16 guard bytes after. */
  const size_t out_bytes = n * row_bytes + 16 + es;
  void *h_out = host_poisoned(out_bytes);
  void *d_out = dev_poisoned(out_bytes);
  embps_hash_gather_cpu(table, c->dtype, w, keys, slots, n, h_out, col_begin, seed, scale);
  STATUS_OK(embps_hash_gather_cuda(d_table, c->dtype, w, d_keys, d_slots, n, d_out, col_begin, seed,
                                   scale, stream));
  void *g_out = dev_download(d_out, out_bytes);
  same_bits("hash gather", c->name, h_out, g_out, out_bytes, es);
  free(g_out);
  dev_poison(d_out, out_bytes);
  STATUS_OK(embps_hash_gather_cuda(d_table, c->dtype, w, d_keys, d_slots, n, (char *)d_out + es,
                                   col_begin, seed, scale, stream));
  g_out = dev_download(d_out, out_bytes);
  same_bits("hash gather (offset output)", c->name, h_out, (char *)g_out + es, out_bytes - es, es);
  free(g_out), free(h_out);
  dev_free(d_out);

  /* Reset of m distinct slots (a random partial permutation), new keys as above. */
  const size_t m = n < NUM_ROWS / 2 ? n : NUM_ROWS / 2;
  int64_t *perm = xmalloc(NUM_ROWS * sizeof(int64_t));
  for (size_t i = 0; i < NUM_ROWS; i++)
    perm[i] = (int64_t)i;
  for (size_t i = 0; i < m; i++) {
    size_t j = i + next_u64(r) % (NUM_ROWS - i);
    int64_t t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  int64_t *d_rslots = dev_upload(perm, m * sizeof(int64_t));
  static const struct {
    int state0; /* 0: none, 1: one float per row, 2: width floats per row */
    int state1;
    const char *name;
  } variants[] = {{0, 0, "hash reset (no state)"},
                  {1, 0, "hash reset (state0 per row)"},
                  {2, 0, "hash reset (state0 per element)"},
                  {2, 1, "hash reset (state0 and state1)"}};
  for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++) {
    const size_t s0w = variants[v].state0 == 2 ? w : (size_t)variants[v].state0;
    const size_t s0_bytes = (size_t)NUM_ROWS * s0w * sizeof(float);
    const size_t s1_bytes = variants[v].state1 ? (size_t)NUM_ROWS * w * sizeof(float) : 0;
    float *s0 = xmalloc(s0_bytes), *s1 = xmalloc(s1_bytes);
    fill_values(s0, EMBPS_DTYPE_F32, s0_bytes / sizeof(float), r, 0.0f, 1.0f);
    fill_values(s1, EMBPS_DTYPE_F32, s1_bytes / sizeof(float), r, -1.0f, 1.0f);
    void *h_table = host_copy(table, table_bytes);
    float *h_s0 = host_copy(s0, s0_bytes), *h_s1 = host_copy(s1, s1_bytes);
    void *dt = dev_upload(table, table_bytes);
    float *d_s0 = s0w ? dev_upload(s0, s0_bytes) : NULL;
    float *d_s1 = s1_bytes ? dev_upload(s1, s1_bytes) : NULL;
    embps_hash_reset_cpu(h_table, c->dtype, w, s0w ? h_s0 : NULL, s0w, s1_bytes ? h_s1 : NULL,
                         0.25f, perm, keys, m, col_begin, seed, scale);
    STATUS_OK(embps_hash_reset_cuda(dt, c->dtype, w, d_s0, s0w, d_s1, 0.25f, d_rslots, d_keys, m,
                                    col_begin, seed, scale, stream));
    void *g_table = dev_download(dt, table_bytes);
    same_bits(variants[v].name, c->name, h_table, g_table, table_bytes, es);
    free(g_table);
    if (s0w) {
      float *g = dev_download(d_s0, s0_bytes);
      same_bits(variants[v].name, c->name, h_s0, g, s0_bytes, sizeof(float));
      free(g);
      dev_free(d_s0);
    }
    if (s1_bytes) {
      float *g = dev_download(d_s1, s1_bytes);
      same_bits(variants[v].name, c->name, h_s1, g, s1_bytes, sizeof(float));
      free(g);
      dev_free(d_s1);
    }
    free(h_table), free(h_s0), free(h_s1), free(s0), free(s1);
    dev_free(dt);
  }

  /* Rows written as given (an Assign): the m distinct rows from random source rows (repeated),
   * with and without the optimizer state's reset. */
  if (m > 0) {
    void *src = xmalloc(n * row_bytes);
    int64_t *src_rows = xmalloc(m * sizeof(int64_t));
    fill_values(src, c->dtype, n * w, r, -1.0f, 1.0f);
    for (size_t i = 0; i < m; i++)
      src_rows[i] = (int64_t)(next_u64(r) % n);
    void *d_src = dev_upload(src, n * row_bytes);
    int64_t *d_src_rows = dev_upload(src_rows, m * sizeof(int64_t));
    for (int reset = 0; reset <= 1; reset++) {
      const size_t s_bytes = (size_t)NUM_ROWS * w * sizeof(float);
      const char *what = reset ? "assign rows (state reset)" : "assign rows";
      float *s0 = xmalloc(s_bytes), *s1 = xmalloc(s_bytes);
      fill_values(s0, EMBPS_DTYPE_F32, s_bytes / sizeof(float), r, 0.0f, 1.0f);
      fill_values(s1, EMBPS_DTYPE_F32, s_bytes / sizeof(float), r, -1.0f, 1.0f);
      void *h_table = host_copy(table, table_bytes);
      float *h_s0 = host_copy(s0, s_bytes), *h_s1 = host_copy(s1, s_bytes);
      void *dt = dev_upload(table, table_bytes);
      float *d_s0 = dev_upload(s0, s_bytes), *d_s1 = dev_upload(s1, s_bytes);
      embps_assign_rows_cpu(h_table, c->dtype, w, perm, src_rows, m, src, reset ? h_s0 : NULL,
                            reset ? w : 0, reset ? h_s1 : NULL, 0.5f);
      STATUS_OK(embps_assign_rows_cuda(dt, c->dtype, w, d_rslots, d_src_rows, m, d_src,
                                       reset ? d_s0 : NULL, reset ? w : 0, reset ? d_s1 : NULL,
                                       0.5f, stream));
      void *g_table = dev_download(dt, table_bytes);
      float *g0 = dev_download(d_s0, s_bytes), *g1 = dev_download(d_s1, s_bytes);
      same_bits(what, c->name, h_table, g_table, table_bytes, es);
      same_bits(what, c->name, h_s0, g0, s_bytes, sizeof(float));
      same_bits(what, c->name, h_s1, g1, s_bytes, sizeof(float));
      free(g_table), free(g0), free(g1), free(h_table), free(h_s0), free(h_s1), free(s0), free(s1);
      dev_free(dt), dev_free(d_s0), dev_free(d_s1);
    }
    free(src), free(src_rows);
    dev_free(d_src), dev_free(d_src_rows);
  }

  /* Key order: top bit flipped, out of place (one guard element) and in place. */
  int64_t *want = host_poisoned((n + 1) * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    want[i] = (int64_t)((uint64_t)keys[i] ^ (UINT64_C(1) << 63));
  int64_t *d_ord = dev_poisoned((n + 1) * sizeof(int64_t));
  STATUS_OK(embps_hash_order_cuda(d_keys, n, d_ord, stream));
  int64_t *g_ord = dev_download(d_ord, (n + 1) * sizeof(int64_t));
  same_bits("hash order", c->name, want, g_ord, (n + 1) * sizeof(int64_t), sizeof(int64_t));
  free(g_ord);
  STATUS_OK(embps_hash_order_cuda(d_keys, n, d_keys, stream));
  g_ord = dev_download(d_keys, n * sizeof(int64_t));
  same_bits("hash order (in place)", c->name, want, g_ord, n * sizeof(int64_t), sizeof(int64_t));
  free(g_ord), free(want), free(perm), free(keys), free(slots), free(table);
  dev_free(d_ord), dev_free(d_rslots), dev_free(d_keys), dev_free(d_slots), dev_free(d_table);
}

/* ---- feature batches' bags ----------------------------------------------------------------- */

/* The batch's n positions as bags after `lead` positions in no bag: lengths 0 to 12, one bag of
 * 300 now and then (UNROLL's tail and long chains), a bag of padding only, three empty bags when
 * n is 0. Position p's id is a Zipf token read from its row (rows[p] = id, 0 being padding), or
 * for about a third an absent hash key (a 64-bit key, rows[p] = -1; key 0 is padding too).
 * Returns the bags (at most 2n + 3); offsets holds num_bags + 1 entries. */
static size_t make_bags(const zipf_t *z, rng_t *r, size_t n, size_t lead, int64_t *ids,
                        int64_t *rows, float *weights, int64_t *offsets) {
  size_t p = lead, k = 0, empties = 0;
  for (size_t i = 0; i < n; i++) {
    const int absent = next_u64(r) % 3 == 0;
    ids[i] = absent ? hash_key(r, i) : zipf_token(z, r);
    rows[i] = absent ? -1 : ids[i];
    weights[i] = next_float(r, -2.0f, 2.0f);
  }
  if (n == 0) {
    for (k = 0; k < 3; k++)
      offsets[k] = (int64_t)lead;
    offsets[3] = (int64_t)lead;
    return 3;
  }
  while (p < n) {
    size_t len = k % 40 == 17 ? 300 : next_u64(r) % 13;
    if (len == 0 && empties++ >= n + 2) /* at most 2n + 3 bags in all */
      len = 1;
    if (len > n - p)
      len = n - p;
    if (k == 3) /* padding only */
      for (size_t i = p; i < p + len; i++)
        ids[i] = 0;
    offsets[k++] = (int64_t)p;
    p += len;
  }
  offsets[k] = (int64_t)n;
  return k;
}

/* Pooling (sum, weighted sum, mean, weighted mean) into an aligned output and one offset by a
 * float (the element-wise path), then the expansion of random bag gradients into an aligned
 * output and one offset by an element, against the CPU bit for bit with guard bytes after every
 * output and the positions in no bag left poisoned. */
static void check_bags(const config_t *c, const zipf_t *z, rng_t *r) {
  const size_t es = embps_dtype_size(c->dtype), w = c->width, row_bytes = w * es;
  const size_t lead = c->n > 8 ? 5 : 0, n = c->n, max_bags = 2 * n + 3;
  const uint64_t col_begin = next_u64(r) % 1000, seed = next_u64(r);
  const float scale = 0.05f;
  void *table = xmalloc((size_t)NUM_ROWS * row_bytes);
  fill_values(table, c->dtype, (size_t)NUM_ROWS * w, r, -1.0f, 1.0f);
  int64_t *ids = xmalloc(n * sizeof(int64_t)), *rows = xmalloc(n * sizeof(int64_t));
  int64_t *offsets = xmalloc((max_bags + 1) * sizeof(int64_t));
  float *weights = xmalloc(n * sizeof(float));
  const size_t nb = make_bags(z, r, n, lead, ids, rows, weights, offsets);
  float *g = xmalloc(nb * w * sizeof(float)), *tmp = xmalloc(2 * w * sizeof(float));
  fill_values(g, EMBPS_DTYPE_F32, nb * w, r, -1.0f, 1.0f);
  void *d_table = dev_upload(table, (size_t)NUM_ROWS * row_bytes);
  int64_t *d_ids = dev_upload(ids, n * sizeof(int64_t)), *d_rows = dev_upload(rows, n * 8);
  int64_t *d_offsets = dev_upload(offsets, (nb + 1) * sizeof(int64_t));
  float *d_weights = dev_upload(weights, n * sizeof(float));
  float *d_g = dev_upload(g, nb * w * sizeof(float));
  const size_t pool_bytes = nb * w * sizeof(float) + 16 + sizeof(float);
  const size_t exp_bytes = n * row_bytes + 16 + es;
  float *d_pool = dev_alloc(pool_bytes);
  void *d_exp = dev_alloc(exp_bytes);
  for (int mode = 0; mode < 4; mode++) {
    const int weighted = mode & 1, mean = mode >> 1;
    char what[64];
    const float *hw = weighted ? weights : NULL, *dw = weighted ? d_weights : NULL;
    float *h_pool = host_poisoned(pool_bytes);
    embps_pool_bags_cpu(table, c->dtype, w, ids, rows, hw, offsets, nb, mean, h_pool, tmp,
                        col_begin, seed, scale);
    for (size_t off = 0; off <= 1; off++) {
      snprintf(what, sizeof(what), "pool bags (%s%s%s)", weighted ? "weighted " : "",
               mean ? "mean" : "sum", off ? ", offset output" : "");
      dev_poison(d_pool, pool_bytes);
      STATUS_OK(embps_pool_bags_cuda(d_table, c->dtype, w, d_ids, d_rows, dw, d_offsets, nb, mean,
                                     d_pool + off, col_begin, seed, scale, stream));
      float *got = dev_download(d_pool, pool_bytes);
      same_bits(what, c->name, h_pool, got + off, pool_bytes - off * sizeof(float), sizeof(float));
      free(got);
    }
    for (size_t k = 0; k < nb; k++) /* empty and padding-only bags pool to zeros */
      if (k == 3 || offsets[k] == offsets[k + 1])
        for (size_t j = 0; j < w; j++)
          CHECK(h_pool[k * w + j] == 0.0f, "pool bags [%s]: bag %zu of no ids is not zero", c->name,
                k);
    free(h_pool);

    unsigned char *h_exp = host_poisoned(exp_bytes);
    embps_expand_bags_cpu(g, w, ids, hw, offsets, nb, mean, c->dtype, h_exp);
    for (size_t off = 0; off <= 1; off++) {
      snprintf(what, sizeof(what), "expand bags (%s%s%s)", weighted ? "weighted " : "",
               mean ? "mean" : "sum", off ? ", offset output" : "");
      dev_poison(d_exp, exp_bytes);
      STATUS_OK(embps_expand_bags_cuda(d_g, w, d_ids, dw, d_offsets, nb, mean, c->dtype,
                                       (char *)d_exp + off * es, stream));
      unsigned char *got = dev_download(d_exp, exp_bytes);
      same_bits(what, c->name, h_exp, got + off * es, exp_bytes - off * es, es);
      free(got);
    }
    free(h_exp);
  }
  free(table), free(ids), free(rows), free(offsets), free(weights), free(g), free(tmp);
  dev_free(d_table), dev_free(d_ids), dev_free(d_rows), dev_free(d_offsets);
  dev_free(d_weights), dev_free(d_g), dev_free(d_pool), dev_free(d_exp);
}

/* The grouping the CPU's segment ids imply, as embps_dedup_cuda gives it: offsets[0..u] from the
 * segment sizes, and each segment's positions ascending in sorted[0..n). */
static void cpu_grouping(const uint32_t *seg, size_t n, size_t u, uint32_t *offsets,
                         uint32_t *sorted) {
  uint32_t *fill = xmalloc((u + 1) * sizeof(uint32_t));
  memset(fill, 0, (u + 1) * sizeof(uint32_t));
  for (size_t i = 0; i < n; i++)
    fill[seg[i] + 1]++;
  for (size_t s = 0; s < u; s++)
    fill[s + 1] += fill[s];
  memcpy(offsets, fill, (u + 1) * sizeof(uint32_t));
  for (size_t i = 0; i < n; i++)
    sorted[fill[seg[i]]++] = (uint32_t)i;
  free(fill);
}

static void run_config(const config_t *c, const zipf_t *z, rng_t *r) {
  const embps_dtype_t dt = c->dtype;
  const size_t es = embps_dtype_size(dt), w = c->width, n = c->n;
  const size_t row_bytes = w * es;

  /* ---- dedup ---- */
  int64_t *tokens = xmalloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    tokens[i] = zipf_token(z, r);
  int64_t *h_unique = host_poisoned(n * sizeof(int64_t));
  uint32_t *h_seg = host_poisoned(n * sizeof(uint32_t));
  void *h_ws = xmalloc(embps_dedup_workspace_bytes(n));
  size_t u = embps_dedup_cpu(tokens, n, h_unique, h_seg, h_ws);
  free(h_ws);

  int64_t *d_tokens = dev_upload(tokens, n * sizeof(int64_t));
  int64_t *d_unique = dev_poisoned(n * sizeof(int64_t));
  uint32_t *d_seg = dev_poisoned(n * sizeof(uint32_t));
  uint32_t *d_sorted = dev_poisoned(n * sizeof(uint32_t));
  uint32_t *d_offsets = dev_poisoned((n + 1) * sizeof(uint32_t));
  uint32_t *d_num_unique = dev_poisoned(sizeof(uint32_t));
  size_t ws_bytes = embps_dedup_cuda_workspace_bytes(n);
  CHECK(n == 0 || ws_bytes > 0, "dedup workspace query failed [%s]", c->name);
  void *d_ws = dev_poisoned(ws_bytes);
  STATUS_OK(embps_dedup_cuda(d_tokens, n, d_unique, d_seg, d_sorted, d_offsets, d_num_unique, d_ws,
                             ws_bytes, stream));
  uint32_t *g_num_unique = dev_download(d_num_unique, sizeof(uint32_t));
  int64_t *g_unique = dev_download(d_unique, n * sizeof(int64_t));
  uint32_t *g_seg = dev_download(d_seg, n * sizeof(uint32_t));
  uint32_t *g_sorted = dev_download(d_sorted, n * sizeof(uint32_t));
  uint32_t *g_offsets = dev_download(d_offsets, (n + 1) * sizeof(uint32_t));
  CHECK(*g_num_unique == u, "dedup num_unique [%s]: cpu %zu gpu %u", c->name, u, *g_num_unique);
  same_bits("dedup unique", c->name, h_unique, g_unique, n * sizeof(int64_t), sizeof(int64_t));
  same_bits("dedup segment_ids", c->name, h_seg, g_seg, n * sizeof(uint32_t), sizeof(uint32_t));
  uint32_t *want_offsets = host_poisoned((n + 1) * sizeof(uint32_t));
  uint32_t *want_sorted = host_poisoned(n * sizeof(uint32_t));
  cpu_grouping(h_seg, n, u, want_offsets, want_sorted);
  same_bits("dedup segment_offsets", c->name, want_offsets, g_offsets, (u + 1) * sizeof(uint32_t),
            sizeof(uint32_t));
  same_bits("dedup sorted_positions", c->name, want_sorted, g_sorted, n * sizeof(uint32_t),
            sizeof(uint32_t));
  free(want_offsets), free(want_sorted);
  free(g_num_unique), free(g_unique), free(g_seg), free(g_sorted), free(g_offsets);

  /* ---- gather the batch from a random table, then expand the unique rows ---- */
  void *table = xmalloc((size_t)NUM_ROWS * row_bytes);
  fill_values(table, dt, (size_t)NUM_ROWS * w, r, -1.0f, 1.0f);
  void *d_table = dev_upload(table, (size_t)NUM_ROWS * row_bytes);
  void *h_out = host_poisoned(n * row_bytes + 16);
  void *d_out = dev_poisoned(n * row_bytes + 16);
  embps_gather_cpu(table, dt, w, tokens, n, h_out);
  STATUS_OK(embps_gather_cuda(d_table, dt, w, d_tokens, n, d_out, stream));
  void *g_out = dev_download(d_out, n * row_bytes + 16);
  same_bits("gather", c->name, h_out, g_out, n * row_bytes + 16, es);
  free(g_out);
  /* Output 8 bytes off 16-byte alignment: a narrower copy unit. */
  dev_poison(d_out, n * row_bytes + 16);
  STATUS_OK(embps_gather_cuda(d_table, dt, w, d_tokens, n, (char *)d_out + 8, stream));
  g_out = dev_download(d_out, n * row_bytes + 16);
  same_bits("gather (offset output)", c->name, h_out, (char *)g_out + 8, n * row_bytes, es);
  free(g_out);

  int64_t *d_rows_unique = d_unique; /* the CPU's unique rows, verified equal above */
  void *h_src = host_poisoned(u * row_bytes);
  embps_gather_cpu(table, dt, w, h_unique, u, h_src);
  void *d_src = dev_upload(h_src, u * row_bytes);
  memset(h_out, 0xff, n * row_bytes);
  dev_poison(d_out, n * row_bytes);
  embps_expand_cpu(h_src, dt, w, h_seg, n, h_out);
  STATUS_OK(embps_expand_cuda(d_src, dt, w, d_seg, n, d_out, stream));
  g_out = dev_download(d_out, n * row_bytes);
  same_bits("expand", c->name, h_out, g_out, n * row_bytes, es);
  free(g_out), free(h_src), free(h_out);
  dev_free(d_src), dev_free(d_out);

  /* ---- segment sum of random batch gradients ---- */
  void *grads = xmalloc(n * row_bytes);
  fill_values(grads, dt, n * w, r, -1.0f, 1.0f);
  void *d_grads = dev_upload(grads, n * row_bytes);
  float *h_sum = host_poisoned(u * w * sizeof(float));
  float *d_sum = dev_poisoned(u * w * sizeof(float));
  embps_segment_sum_cpu(grads, dt, w, h_seg, n, u, h_sum);
  STATUS_OK(embps_segment_sum_cuda(d_grads, dt, w, d_sorted, d_offsets, u, d_sum, stream));
  float *g_sum = dev_download(d_sum, u * w * sizeof(float));
  same_bits("segment sum", c->name, h_sum, g_sum, u * w * sizeof(float), sizeof(float));
  free(g_sum), free(grads);
  dev_free(d_grads), dev_free(d_sum);

  /* ---- weight decay on the summed gradient (rows = unique tokens) ---- */
  float *h_grad = host_copy(h_sum, u * w * sizeof(float));
  float *d_grad = dev_upload(h_sum, u * w * sizeof(float));
  free(h_sum);
  STATUS_OK(embps_apply_weight_decay_cuda(d_table, dt, w, d_rows_unique, u, d_grad, 0.0f, stream));
  float *g_grad = dev_download(d_grad, u * w * sizeof(float));
  same_bits("weight decay 0 (no-op)", c->name, h_grad, g_grad, u * w * sizeof(float),
            sizeof(float));
  free(g_grad);
  embps_apply_weight_decay_cpu(table, dt, w, h_unique, u, h_grad, 0.01f);
  STATUS_OK(embps_apply_weight_decay_cuda(d_table, dt, w, d_rows_unique, u, d_grad, 0.01f, stream));
  g_grad = dev_download(d_grad, u * w * sizeof(float));
  same_bits("weight decay", c->name, h_grad, g_grad, u * w * sizeof(float), sizeof(float));
  free(g_grad);
  dev_free(d_grad);

  /* ---- row stats: the decayed gradient, then a copy with NaN and inf planted ---- */
  float *row_sumsq = check_row_stats(c, "row stats", h_grad, u);
  if (u * w > 0) {
    float *bad = host_copy(h_grad, u * w * sizeof(float));
    size_t k = 1 + next_u64(r) % 5;
    for (size_t i = 0; i < k; i++) {
      size_t at = next_u64(r) % (u * w);
      bad[at] = (i % 3 == 0) ? NAN : (i % 3 == 1) ? INFINITY : -INFINITY;
    }
    free(check_row_stats(c, "row stats (non-finite)", bad, u));
    free(bad);
  }

  /* ---- the updates ---- */
  check_update(c, RUN_SGD, table, h_unique, u, h_grad, row_sumsq, r);
  check_update(c, RUN_ADAGRAD, table, h_unique, u, h_grad, row_sumsq, r);
  check_update(c, RUN_ROWWISE, table, h_unique, u, h_grad, row_sumsq, r);
  check_update(c, RUN_ADAM, table, h_unique, u, h_grad, row_sumsq, r);
  free(row_sumsq), free(h_grad);

  check_init(c, r);
  check_hash(c, r);
  check_bags(c, z, r);

  free(tokens), free(h_unique), free(h_seg), free(table);
  dev_free(d_tokens), dev_free(d_unique), dev_free(d_seg), dev_free(d_sorted);
  dev_free(d_offsets), dev_free(d_num_unique), dev_free(d_ws), dev_free(d_table);
}

/* ---- checks outside the grid of configurations --------------------------------------------- */

/* Dedup of wide-range, signed tokens at 1M: the CPU's unpacked radix path against CUB. */
static void check_dedup_wide(rng_t *r) {
  const size_t n = (size_t)1 << 20;
  int64_t *tokens = xmalloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    tokens[i] = (i % 3 == 0 && i) ? tokens[next_u64(r) % i] : (int64_t)next_u64(r);
  int64_t *h_unique = host_poisoned(n * sizeof(int64_t));
  uint32_t *h_seg = host_poisoned(n * sizeof(uint32_t));
  void *h_ws = xmalloc(embps_dedup_workspace_bytes(n));
  size_t u = embps_dedup_cpu(tokens, n, h_unique, h_seg, h_ws);
  free(h_ws);
  int64_t *d_tokens = dev_upload(tokens, n * sizeof(int64_t));
  int64_t *d_unique = dev_poisoned(n * sizeof(int64_t));
  uint32_t *d_seg = dev_poisoned(n * sizeof(uint32_t));
  uint32_t *d_sorted = dev_poisoned(n * sizeof(uint32_t));
  uint32_t *d_offsets = dev_poisoned((n + 1) * sizeof(uint32_t));
  uint32_t *d_nu = dev_poisoned(sizeof(uint32_t));
  size_t ws_bytes = embps_dedup_cuda_workspace_bytes(n);
  void *d_ws = dev_alloc(ws_bytes);
  CHECK(embps_dedup_cuda(d_tokens, n, d_unique, d_seg, d_sorted, d_offsets, d_nu, d_ws,
                         ws_bytes - 1, stream) == EMBPS_INVALID_ARGUMENT,
        "dedup accepted a workspace one byte short");
  STATUS_OK(embps_dedup_cuda(d_tokens, n, d_unique, d_seg, d_sorted, d_offsets, d_nu, d_ws,
                             ws_bytes, stream));
  uint32_t *g_nu = dev_download(d_nu, sizeof(uint32_t));
  int64_t *g_unique = dev_download(d_unique, n * sizeof(int64_t));
  uint32_t *g_seg = dev_download(d_seg, n * sizeof(uint32_t));
  CHECK(*g_nu == u, "wide dedup num_unique: cpu %zu gpu %u", u, *g_nu);
  same_bits("wide dedup unique", "1M signed", h_unique, g_unique, n * sizeof(int64_t), 8);
  same_bits("wide dedup segment_ids", "1M signed", h_seg, g_seg, n * sizeof(uint32_t), 4);
  free(g_nu), free(g_unique), free(g_seg), free(tokens), free(h_unique), free(h_seg);
  dev_free(d_tokens), dev_free(d_unique), dev_free(d_seg), dev_free(d_sorted);
  dev_free(d_offsets), dev_free(d_nu), dev_free(d_ws);
}

/* Segment sums whose segments straddle the hot-segment limit of kernels/cuda/segment_sum.cu
 * (128 rows, walked by a whole block 448 rows a stage): lengths 127, 128, 129, 447, 448, 449,
 * 896 (two whole stages) and 60001 (a Zipf head), among single rows, in shuffled positions; at
 * widths that give 1 to 32 column slices of 32, the last one partial or not, f32 and bf16,
 * against the CPU bit for bit. */
static void check_segment_sum_hot(rng_t *r) {
  static const size_t lengths[] = {127, 128, 129, 447, 448, 449, 896, 60001};
  static const struct {
    embps_dtype_t dt;
    size_t w;
  } cfgs[] = {{EMBPS_DTYPE_F32, 128},
              {EMBPS_DTYPE_BF16, 128},
              {EMBPS_DTYPE_F32, 7},
              {EMBPS_DTYPE_BF16, 1024},
              {EMBPS_DTYPE_F32, 1000}};
  const size_t singles = 20000;
  size_t n = singles;
  for (size_t i = 0; i < sizeof(lengths) / sizeof(lengths[0]); i++)
    n += lengths[i];
  int64_t *tokens = xmalloc(n * sizeof(int64_t));
  size_t k = 0;
  for (size_t i = 0; i < sizeof(lengths) / sizeof(lengths[0]); i++)
    for (size_t j = 0; j < lengths[i]; j++)
      tokens[k++] = (int64_t)(i + 1) * 1000003;
  for (size_t j = 0; j < singles; j++)
    tokens[k++] = (int64_t)(100 + j);
  for (size_t i = n - 1; i > 0; i--) { /* shuffled: each segment's positions spread out */
    size_t o = next_u64(r) % (i + 1);
    int64_t t = tokens[i];
    tokens[i] = tokens[o], tokens[o] = t;
  }
  int64_t *unique = xmalloc(n * sizeof(int64_t));
  uint32_t *seg = xmalloc(n * sizeof(uint32_t));
  void *ws = xmalloc(embps_dedup_workspace_bytes(n));
  size_t u = embps_dedup_cpu(tokens, n, unique, seg, ws);
  free(ws);
  uint32_t *offsets = xmalloc((u + 1) * sizeof(uint32_t));
  uint32_t *sorted = xmalloc(n * sizeof(uint32_t));
  cpu_grouping(seg, n, u, offsets, sorted);
  uint32_t *d_sorted = dev_upload(sorted, n * sizeof(uint32_t));
  uint32_t *d_offsets = dev_upload(offsets, (u + 1) * sizeof(uint32_t));
  for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++) {
    size_t w = cfgs[c].w, row_bytes = w * embps_dtype_size(cfgs[c].dt);
    char name[64];
    snprintf(name, sizeof(name), "hot segments %s width %zu", embps_dtype_name(cfgs[c].dt), w);
    void *grads = xmalloc(n * row_bytes);
    fill_values(grads, cfgs[c].dt, n * w, r, -1.0f, 1.0f);
    void *d_grads = dev_upload(grads, n * row_bytes);
    float *h_sum = host_poisoned(u * w * sizeof(float));
    float *d_sum = dev_poisoned(u * w * sizeof(float));
    embps_segment_sum_cpu(grads, cfgs[c].dt, w, seg, n, u, h_sum);
    STATUS_OK(
        embps_segment_sum_cuda(d_grads, cfgs[c].dt, w, d_sorted, d_offsets, u, d_sum, stream));
    float *g_sum = dev_download(d_sum, u * w * sizeof(float));
    same_bits("segment sum", name, h_sum, g_sum, u * w * sizeof(float), sizeof(float));
    free(g_sum), free(h_sum), free(grads);
    dev_free(d_grads), dev_free(d_sum);
  }
  free(tokens), free(unique), free(seg), free(offsets), free(sorted);
  dev_free(d_sorted), dev_free(d_offsets);
}

/* The device bf16 conversion against common/dtype.h: every high half with a set of low halves
 * around the rounding points (ties, NaN payloads, infinities, denormals), plus random bits;
 * and every bf16 pattern back to f32. */
static void check_convert(rng_t *r) {
  static const uint16_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
  const size_t per = 16, n = (size_t)65536 * per;
  uint32_t *bits = xmalloc(n * sizeof(uint32_t));
  for (size_t h = 0; h < 65536; h++)
    for (size_t k = 0; k < per; k++)
      bits[h * per + k] = (uint32_t)(h << 16) |
                          (k < sizeof(lows) / sizeof(lows[0]) ? lows[k] : (uint16_t)next_u64(r));
  uint16_t *want = xmalloc(n * sizeof(uint16_t));
  for (size_t i = 0; i < n; i++) {
    float f;
    memcpy(&f, &bits[i], sizeof(f));
    want[i] = embps_f32_to_bf16(f);
  }
  float *d_in = dev_upload(bits, n * sizeof(float));
  uint16_t *d_out = dev_poisoned(n * sizeof(uint16_t));
  STATUS_OK(embps_f32_to_bf16_cuda(d_in, n, d_out, stream));
  uint16_t *got = dev_download(d_out, n * sizeof(uint16_t));
  same_bits("f32 -> bf16", "all high halves", want, got, n * sizeof(uint16_t), 2);
  free(got);

  uint16_t *all = xmalloc(65536 * sizeof(uint16_t));
  float *back = xmalloc(65536 * sizeof(float));
  for (size_t h = 0; h < 65536; h++) {
    all[h] = (uint16_t)h;
    back[h] = embps_bf16_to_f32((uint16_t)h);
  }
  uint16_t *d_all = dev_upload(all, 65536 * sizeof(uint16_t));
  float *d_back = dev_poisoned(65536 * sizeof(float));
  STATUS_OK(embps_bf16_to_f32_cuda(d_all, 65536, d_back, stream));
  float *g_back = dev_download(d_back, 65536 * sizeof(float));
  same_bits("bf16 -> f32", "all patterns", back, g_back, 65536 * sizeof(float), 4);
  free(g_back), free(all), free(back), free(bits), free(want);
  dev_free(d_in), dev_free(d_out), dev_free(d_all), dev_free(d_back);
}

/* Row marks: Zipf tokens (hot rows hit by many threads' atomics at once, padding included) over
 * a bitmap that already has bits set, which must stay; 0, 1, 4099 and 1M rows. */
static void check_mark_rows(const zipf_t *z, rng_t *r) {
  static const size_t batches[] = {0, 1, 4099, (size_t)1 << 20};
  const size_t words = (NUM_ROWS + 63) / 64;
  for (size_t b = 0; b < sizeof(batches) / sizeof(batches[0]); b++) {
    const size_t n = batches[b];
    int64_t *rows = xmalloc(n * sizeof(int64_t));
    uint64_t *want = xmalloc(words * sizeof(uint64_t));
    char name[64];
    for (size_t i = 0; i < n; i++)
      rows[i] = zipf_token(z, r);
    for (size_t w = 0; w < words; w++)
      want[w] = next_u64(r) & next_u64(r) & next_u64(r); /* an eighth of the bits set */
    uint64_t *d_bits = dev_upload(want, words * sizeof(uint64_t));
    int64_t *d_rows = dev_upload(rows, n * sizeof(int64_t));
    embps_mark_rows_cpu(want, rows, n);
    STATUS_OK(embps_mark_rows_cuda(d_bits, d_rows, n, stream));
    uint64_t *got = dev_download(d_bits, words * sizeof(uint64_t));
    snprintf(name, sizeof(name), "%zu rows", n);
    same_bits("mark rows", name, want, got, words * sizeof(uint64_t), sizeof(uint64_t));
    free(got), free(want), free(rows);
    dev_free(d_bits), dev_free(d_rows);
  }
}

/* Arguments rejected before anything is enqueued. */
static void check_invalid(void) {
  embps_opt_params_t p = {.lr = 1.0f};
  CHECK(embps_gather_cuda(NULL, (embps_dtype_t)7, 4, NULL, 1, NULL, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "gather accepted dtype 7");
  CHECK(embps_update_sgd_cuda(NULL, (embps_dtype_t)0, 4, NULL, 1, NULL, &p, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "sgd accepted dtype 0");
  CHECK(embps_update_adam_cuda(NULL, EMBPS_DTYPE_F32, 4, NULL, 1, NULL, NULL, NULL, NULL, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "adam accepted NULL params");
  CHECK(embps_row_combine_cuda(NULL, 1, 4, 4, NULL, NULL, NULL, NULL, stream) == EMBPS_OK,
        "row combine with nothing requested should enqueue nothing");
  CHECK(embps_row_partials_cuda(NULL, 4, 6, 4, NULL, stream) == EMBPS_INVALID_ARGUMENT,
        "row partials accepted a block that does not divide the width");
  CHECK(embps_row_sums_cuda(NULL, 2, 3, 4, 1, NULL, stream) == EMBPS_INVALID_ARGUMENT,
        "row sums accepted more rows than its stride");
  CHECK(embps_row_finish_cuda(NULL, 4, NULL, NULL, NULL, NULL, stream) == EMBPS_OK,
        "row finish with nothing requested should enqueue nothing");
  CHECK(embps_row_finish_cuda(NULL, 4, NULL, NULL, (uint64_t *)8, NULL, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "row finish accepted a count without a workspace");
  CHECK(embps_mark_rows_cuda(NULL, NULL, 1, stream) == EMBPS_INVALID_ARGUMENT,
        "mark rows accepted a NULL bitmap");
  CHECK(embps_mark_rows_cuda(NULL, NULL, 0, stream) == EMBPS_OK,
        "mark rows of no rows should enqueue nothing");
  int64_t one[1] = {0};
  void *fake = (void *)(uintptr_t)4096; /* never dereferenced: each call is rejected first */
  CHECK(embps_hash_gather_cuda(fake, (embps_dtype_t)7, 4, one, one, 1, fake, 0, 1, 1.0f, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "hash gather accepted dtype 7");
  CHECK(embps_hash_gather_cuda(fake, EMBPS_DTYPE_F32, 4, NULL, one, 1, fake, 0, 1, 1.0f, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "hash gather accepted NULL keys");
  CHECK(embps_hash_gather_cuda(fake, EMBPS_DTYPE_F32, 4, one, one, 1, (char *)fake + 2, 0, 1, 1.0f,
                               stream) == EMBPS_INVALID_ARGUMENT,
        "hash gather accepted an f32 output off its alignment");
  CHECK(embps_hash_gather_cuda(NULL, EMBPS_DTYPE_F32, 4, NULL, NULL, 0, NULL, 0, 1, 1.0f, stream) ==
            EMBPS_OK,
        "hash gather of no rows should enqueue nothing");
  CHECK(embps_hash_reset_cuda(fake, EMBPS_DTYPE_F32, 8, fake, 3, NULL, 0.0f, one, one, 1, 0, 1,
                              1.0f, stream) == EMBPS_INVALID_ARGUMENT,
        "hash reset accepted a state0 of 3 floats per row at width 8");
  CHECK(embps_hash_reset_cuda(fake, EMBPS_DTYPE_F32, 8, NULL, 1, NULL, 0.0f, one, one, 1, 0, 1,
                              1.0f, stream) == EMBPS_INVALID_ARGUMENT,
        "hash reset accepted a NULL state0 of 1 float per row");
  CHECK(embps_hash_reset_cuda(fake, (embps_dtype_t)0, 8, NULL, 0, NULL, 0.0f, one, one, 1, 0, 1,
                              1.0f, stream) == EMBPS_INVALID_ARGUMENT,
        "hash reset accepted dtype 0");
  float *ff = (float *)fake;
  CHECK(embps_pool_bags_cuda(fake, (embps_dtype_t)7, 4, one, one, NULL, one, 1, 0, ff, 0, 1, 1.0f,
                             stream) == EMBPS_INVALID_ARGUMENT,
        "pool bags accepted dtype 7");
  CHECK(embps_pool_bags_cuda(fake, EMBPS_DTYPE_F32, 4, one, NULL, NULL, one, 1, 0, ff, 0, 1, 1.0f,
                             stream) == EMBPS_INVALID_ARGUMENT,
        "pool bags accepted NULL rows");
  CHECK(embps_pool_bags_cuda((char *)fake + 2, EMBPS_DTYPE_F32, 4, one, one, NULL, one, 1, 0, ff, 0,
                             1, 1.0f, stream) == EMBPS_INVALID_ARGUMENT,
        "pool bags accepted an f32 table off its alignment");
  CHECK(embps_pool_bags_cuda(NULL, EMBPS_DTYPE_F32, 4, NULL, NULL, NULL, NULL, 0, 0, NULL, 0, 1,
                             1.0f, stream) == EMBPS_OK,
        "pool bags of no bags should enqueue nothing");
  CHECK(embps_expand_bags_cuda(ff, 4, one, NULL, one, 1, 0, (embps_dtype_t)0, fake, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "expand bags accepted dtype 0");
  CHECK(embps_expand_bags_cuda(ff, 4, one, NULL, NULL, 1, 1, EMBPS_DTYPE_F32, fake, stream) ==
            EMBPS_INVALID_ARGUMENT,
        "expand bags accepted NULL offsets");
  CHECK(embps_expand_bags_cuda(ff, 4, one, NULL, one, 1, 0, EMBPS_DTYPE_BF16, (char *)fake + 1,
                               stream) == EMBPS_INVALID_ARGUMENT,
        "expand bags accepted a bf16 output off its alignment");
  CHECK(embps_expand_bags_cuda(NULL, 4, NULL, NULL, NULL, 0, 0, EMBPS_DTYPE_F32, NULL, stream) ==
            EMBPS_OK,
        "expand bags of no bags should enqueue nothing");
  CHECK(embps_hash_order_cuda(NULL, 1, fake, stream) == EMBPS_INVALID_ARGUMENT,
        "hash order accepted NULL keys");
  CHECK(embps_hash_order_cuda(NULL, 0, NULL, stream) == EMBPS_OK,
        "hash order of no keys should enqueue nothing");
}

int main(void) {
  int count = gpu_devices_or_skip();
  if (count == 0)
    return GPU_SKIP_CODE;
  uint64_t seed;
  const char *env = getenv("EMBPS_TEST_SEED");
  if (env && *env)
    seed = strtoull(env, NULL, 0);
  else
    seed = (uint64_t)time(NULL) * UINT64_C(0x9e3779b97f4a7c15) ^ (uint64_t)getpid() ^
           (uint64_t)clock();
  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  printf("device 0: %s (sm_%d%d); seed %" PRIu64 " (EMBPS_TEST_SEED=%" PRIu64 " replays)\n",
         prop.name, prop.major, prop.minor, seed, seed);
  fflush(stdout);
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  rng_t r = {seed};
  zipf_t *z = xmalloc(sizeof(*z));
  zipf_init(z, &r);
  static const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  static const size_t widths[] = {1, 7, 128, 1024};
  static const size_t batches[] = {0, 1, 4099}; /* 4099: gather's last group of 4 rows is partial */
  int configs = 0;
  for (size_t d = 0; d < 2; d++)
    for (size_t wi = 0; wi < 4; wi++)
      for (size_t bi = 0; bi < 3; bi++) {
        config_t c = {.dtype = dtypes[d], .width = widths[wi], .n = batches[bi]};
        snprintf(c.name, sizeof(c.name), "%s width %zu batch %zu", embps_dtype_name(c.dtype),
                 c.width, c.n);
        int before = failures;
        run_config(&c, z, &r);
        printf("%-4s %s\n", failures == before ? "ok" : "FAIL", c.name);
        configs++;
      }
  int before = failures;
  check_dedup_wide(&r);
  printf("%-4s dedup of 1M wide-range signed tokens\n", failures == before ? "ok" : "FAIL");
  before = failures;
  check_segment_sum_hot(&r);
  printf("%-4s segment sums over segments of 127 to 60001 rows\n",
         failures == before ? "ok" : "FAIL");
  before = failures;
  check_convert(&r);
  printf("%-4s bf16 conversions\n", failures == before ? "ok" : "FAIL");
  before = failures;
  check_mark_rows(z, &r);
  printf("%-4s row marks of 0 to 1M Zipf rows\n", failures == before ? "ok" : "FAIL");
  check_invalid();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  free(z);
  printf("%s: %d configurations, %d failures (seed %" PRIu64 ")\n", failures ? "FAILED" : "PASSED",
         configs, failures, seed);
  return failures ? 1 : 0;
}
