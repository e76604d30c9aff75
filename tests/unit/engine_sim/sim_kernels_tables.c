/* The simulated launchers of the hash-keyed tables, of the feature batches' bags and of the
 * rows an Assign writes (kernels/cuda/hash.cu, pool.cu and assign.cu), in sim_kernels.c's way (see
 * its header): the real launchers' argument checks and statuses, the device arrays of known size
 * checked against the simulator's registry when enqueued, what depends on device data (slots, a
 * bag's offsets and rows) checked when the closure runs, then the CPU reference. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "sim_cuda.h"
#include "sim_kernels.h"

/* ---- hash-keyed tables ------------------------------------------------------------------- */

typedef struct hash_args {
  void *table;
  embps_dtype_t dtype;
  size_t width, n, state0_width;
  const int64_t *keys, *slots;
  void *out; /* gather */
  float *state0, *state1, state0_value;
  uint64_t col_begin, seed;
  float scale;
} hash_args_t;

static void run_hash_gather(void *p) {
  const hash_args_t *a = p;
  size_t row_bytes = a->width * embps_dtype_size(a->dtype);
  size_t have = sim_cuda_device_extent(a->table, "hash gather") / row_bytes;
  for (size_t i = 0; i < a->n; i++) /* a negative slot: the key's initial row */
    if (a->slots[i] >= 0 && (uint64_t)a->slots[i] >= have)
      sim_cuda_fail("hash gather: slots[%zu] = %lld is outside the table (%zu rows of %zu bytes)",
                    i, (long long)a->slots[i], have, row_bytes);
  embps_hash_gather_cpu(a->table, a->dtype, a->width, a->keys, a->slots, a->n, a->out, a->col_begin,
                        a->seed, a->scale);
}

embps_status_t embps_hash_gather_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *keys, const int64_t *slots, size_t n,
                                      void *out, uint64_t col_begin, uint64_t seed, float scale,
                                      cudaStream_t stream) {
  hash_args_t a;
  size_t es = embps_dtype_size(dtype);
  if (bad_dtype("hash gather", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (n == 0 || width == 0)
    return EMBPS_OK;
  if (!table || !keys || !slots || !out) {
    EMBPS_ERROR("hash gather: NULL %s", !table   ? "table"
                                        : !keys  ? "keys"
                                        : !slots ? "slots"
                                                 : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if ((uintptr_t)out % es) {
    EMBPS_ERROR("hash gather: out is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  sim_cuda_check_device(stream, table, width * es, "hash gather: table");
  sim_cuda_check_device(stream, keys, n * sizeof(int64_t), "hash gather: keys");
  sim_cuda_check_device(stream, slots, n * sizeof(int64_t), "hash gather: slots");
  sim_cuda_check_device(stream, out, bytes3(n, width, es, "hash gather"), "hash gather: out");
  memset(&a, 0, sizeof(a));
  a.table = (void *)table;
  a.dtype = dtype;
  a.width = width;
  a.n = n;
  a.keys = keys;
  a.slots = slots;
  a.out = out;
  a.col_begin = col_begin;
  a.seed = seed;
  a.scale = scale;
  sim_cuda_enqueue(stream, run_hash_gather, &a, sizeof(a), "hash gather");
  return EMBPS_OK;
}

static void run_hash_reset(void *p) {
  const hash_args_t *a = p;
  check_distinct_rows("hash reset", a->slots, a->n);
  if (a->width)
    check_rows("hash reset", a->slots, a->n, a->table, a->width * embps_dtype_size(a->dtype),
               "the table");
  if (a->state0_width)
    check_rows("hash reset", a->slots, a->n, a->state0, a->state0_width * sizeof(float), "state0");
  if (a->state1 && a->width)
    check_rows("hash reset", a->slots, a->n, a->state1, a->width * sizeof(float), "state1");
  embps_hash_reset_cpu(a->table, a->dtype, a->width, a->state0, a->state0_width, a->state1,
                       a->state0_value, a->slots, a->keys, a->n, a->col_begin, a->seed, a->scale);
}

embps_status_t embps_hash_reset_cuda(void *table, embps_dtype_t dtype, size_t width, float *state0,
                                     size_t state0_width, float *state1, float state0_value,
                                     const int64_t *slots, const int64_t *keys, size_t n,
                                     uint64_t col_begin, uint64_t seed, float scale,
                                     cudaStream_t stream) {
  hash_args_t a;
  if (bad_dtype("hash reset", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (state0_width != 0 && state0_width != 1 && state0_width != width) {
    EMBPS_ERROR("hash reset: state0 of %zu floats per row (0, 1 or the width %zu)", state0_width,
                width);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || (width == 0 && state0_width == 0))
    return EMBPS_OK;
  if ((width && !table) || !slots || !keys || (state0_width && !state0)) {
    EMBPS_ERROR("hash reset: NULL %s", !slots    ? "slots"
                                       : !keys   ? "keys"
                                       : !state0 ? "state0"
                                                 : "table");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (width)
    sim_cuda_check_device(stream, table, width * embps_dtype_size(dtype), "hash reset: table");
  if (state0_width)
    sim_cuda_check_device(stream, state0, state0_width * sizeof(float), "hash reset: state0");
  if (state1 && width)
    sim_cuda_check_device(stream, state1, width * sizeof(float), "hash reset: state1");
  sim_cuda_check_device(stream, slots, n * sizeof(int64_t), "hash reset: slots");
  sim_cuda_check_device(stream, keys, n * sizeof(int64_t), "hash reset: keys");
  memset(&a, 0, sizeof(a));
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.n = n;
  a.state0_width = state0_width;
  a.keys = keys;
  a.slots = slots;
  a.state0 = state0;
  a.state1 = state1;
  a.state0_value = state0_value;
  a.col_begin = col_begin;
  a.seed = seed;
  a.scale = scale;
  sim_cuda_enqueue(stream, run_hash_reset, &a, sizeof(a), "hash reset");
  return EMBPS_OK;
}

typedef struct hash_order_args {
  const int64_t *in;
  size_t n;
  int64_t *out;
} hash_order_args_t;

static void run_hash_order(void *p) {
  const hash_order_args_t *a = p;
  for (size_t i = 0; i < a->n; i++)
    a->out[i] = (int64_t)((uint64_t)a->in[i] ^ (UINT64_C(1) << 63));
}

embps_status_t embps_hash_order_cuda(const int64_t *in, size_t n, int64_t *out,
                                     cudaStream_t stream) {
  hash_order_args_t a;
  if (n == 0)
    return EMBPS_OK;
  if (!in || !out) {
    EMBPS_ERROR("hash order: NULL %s", !in ? "in" : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  sim_cuda_check_device(stream, in, bytes3(n, sizeof(int64_t), 1, "hash order"), "hash order");
  sim_cuda_check_device(stream, out, bytes3(n, sizeof(int64_t), 1, "hash order"), "hash order");
  a.in = in;
  a.n = n;
  a.out = out;
  sim_cuda_enqueue(stream, run_hash_order, &a, sizeof(a), "hash order");
  return EMBPS_OK;
}

/* ---- feature batches' bags ------------------------------------------------------------- */

typedef struct bags_args {
  const void *table; /* pool */
  const float *g;    /* expand */
  embps_dtype_t dtype;
  size_t width, num_bags;
  const int64_t *ids, *rows, *offsets;
  const float *weights;
  int mean;
  void *out;
  uint64_t col_begin, seed;
  float scale;
} bags_args_t;

/* The bags' positions run from offsets[0] to offsets[num_bags], ascending: returns the end,
 * after checking that ids (and rows, weights where given) hold a value at every position. */
static size_t check_offsets(const char *what, const bags_args_t *a) {
  const int64_t *off = a->offsets;
  size_t end;
  if (off[0] < 0)
    sim_cuda_fail("%s: offsets[0] = %lld is negative", what, (long long)off[0]);
  for (size_t k = 0; k < a->num_bags; k++)
    if (off[k + 1] < off[k])
      sim_cuda_fail("%s: offsets[%zu] = %lld is below offsets[%zu] = %lld (offsets ascend)", what,
                    k + 1, (long long)off[k + 1], k, (long long)off[k]);
  end = (size_t)off[a->num_bags];
  if (end == (size_t)off[0])
    return end; /* no position: no array is read */
  if (end > sim_cuda_device_extent(a->ids, what) / sizeof(int64_t))
    sim_cuda_fail("%s: offsets[%zu] = %zu is beyond ids (%zu ids)", what, a->num_bags, end,
                  sim_cuda_device_extent(a->ids, what) / sizeof(int64_t));
  if (a->rows && end > sim_cuda_device_extent(a->rows, what) / sizeof(int64_t))
    sim_cuda_fail("%s: offsets[%zu] = %zu is beyond rows (%zu rows)", what, a->num_bags, end,
                  sim_cuda_device_extent(a->rows, what) / sizeof(int64_t));
  if (a->weights && end > sim_cuda_device_extent(a->weights, what) / sizeof(float))
    sim_cuda_fail("%s: offsets[%zu] = %zu is beyond weights (%zu weights)", what, a->num_bags, end,
                  sim_cuda_device_extent(a->weights, what) / sizeof(float));
  return end;
}

static void run_pool_bags(void *p) {
  const bags_args_t *a = p;
  const size_t row_bytes = a->width * embps_dtype_size(a->dtype);
  const size_t begin = (size_t)a->offsets[0], end = check_offsets("pool bags", a);
  const size_t have = sim_cuda_device_extent(a->table, "pool bags") / row_bytes;
  float *tmp;
  for (size_t i = begin; i < end; i++) /* the rows of nonzero ids only are read */
    if (a->ids[i] != 0 && a->rows[i] != -1 && (a->rows[i] < 0 || (uint64_t)a->rows[i] >= have))
      sim_cuda_fail("pool bags: rows[%zu] = %lld is neither -1 nor a row of the table (%zu rows of "
                    "%zu bytes)",
                    i, (long long)a->rows[i], have, row_bytes);
  tmp = malloc(2 * a->width * sizeof(float));
  if (!tmp)
    sim_cuda_fail("out of host memory");
  embps_pool_bags_cpu(a->table, a->dtype, a->width, a->ids, a->rows, a->weights, a->offsets,
                      a->num_bags, a->mean, a->out, tmp, a->col_begin, a->seed, a->scale);
  free(tmp);
}

embps_status_t embps_pool_bags_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                    const int64_t *ids, const int64_t *rows, const float *weights,
                                    const int64_t *offsets, size_t num_bags, int mean, float *out,
                                    uint64_t col_begin, uint64_t seed, float scale,
                                    cudaStream_t stream) {
  bags_args_t a;
  const size_t es = embps_dtype_size(dtype);
  if (bad_dtype("pool bags", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (num_bags == 0 || width == 0)
    return EMBPS_OK;
  if (!table || !ids || !rows || !offsets || !out) {
    EMBPS_ERROR("pool bags: NULL %s", !table     ? "table"
                                      : !ids     ? "ids"
                                      : !rows    ? "rows"
                                      : !offsets ? "offsets"
                                                 : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if ((uintptr_t)table % es) {
    EMBPS_ERROR("pool bags: the table is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (num_bags >= SIZE_MAX / sizeof(int64_t))
    sim_cuda_fail("pool bags: %zu bags overflows", num_bags);
  sim_cuda_check_device(stream, table, width * es, "pool bags: table");
  sim_cuda_check_device(stream, offsets, (num_bags + 1) * sizeof(int64_t), "pool bags: offsets");
  sim_cuda_check_device(stream, out, bytes3(num_bags, width, sizeof(float), "pool bags"),
                        "pool bags: out");
  /* ids, rows and weights: their length is offsets[num_bags], checked when the closure runs. */
  memset(&a, 0, sizeof(a));
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.num_bags = num_bags;
  a.ids = ids;
  a.rows = rows;
  a.offsets = offsets;
  a.weights = weights;
  a.mean = mean;
  a.out = out;
  a.col_begin = col_begin;
  a.seed = seed;
  a.scale = scale;
  sim_cuda_enqueue(stream, run_pool_bags, &a, sizeof(a), "pool bags");
  return EMBPS_OK;
}

static void run_expand_bags(void *p) {
  const bags_args_t *a = p;
  const size_t row_bytes = a->width * embps_dtype_size(a->dtype);
  const size_t begin = (size_t)a->offsets[0], end = check_offsets("expand bags", a);
  if (end > begin && end > sim_cuda_device_extent(a->out, "expand bags") / row_bytes)
    sim_cuda_fail("expand bags: offsets[%zu] = %zu is beyond out (%zu rows of %zu bytes)",
                  a->num_bags, end, sim_cuda_device_extent(a->out, "expand bags") / row_bytes,
                  row_bytes);
  embps_expand_bags_cpu(a->g, a->width, a->ids, a->weights, a->offsets, a->num_bags, a->mean,
                        a->dtype, a->out);
}

embps_status_t embps_expand_bags_cuda(const float *g, size_t width, const int64_t *ids,
                                      const float *weights, const int64_t *offsets, size_t num_bags,
                                      int mean, embps_dtype_t dtype, void *out,
                                      cudaStream_t stream) {
  bags_args_t a;
  const size_t es = embps_dtype_size(dtype);
  if (bad_dtype("expand bags", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (num_bags == 0 || width == 0)
    return EMBPS_OK;
  if (!g || !ids || !offsets || !out) {
    EMBPS_ERROR("expand bags: NULL %s", !g ? "g" : !ids ? "ids" : !offsets ? "offsets" : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if ((uintptr_t)out % es) {
    EMBPS_ERROR("expand bags: out is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (num_bags >= SIZE_MAX / sizeof(int64_t))
    sim_cuda_fail("expand bags: %zu bags overflows", num_bags);
  sim_cuda_check_device(stream, g, bytes3(num_bags, width, sizeof(float), "expand bags"),
                        "expand bags: g");
  sim_cuda_check_device(stream, offsets, (num_bags + 1) * sizeof(int64_t), "expand bags: offsets");
  /* ids, weights and out: their length is offsets[num_bags], checked when the closure runs. */
  memset(&a, 0, sizeof(a));
  a.g = g;
  a.dtype = dtype;
  a.width = width;
  a.num_bags = num_bags;
  a.ids = ids;
  a.offsets = offsets;
  a.weights = weights;
  a.mean = mean;
  a.out = out;
  sim_cuda_enqueue(stream, run_expand_bags, &a, sizeof(a), "expand bags");
  return EMBPS_OK;
}

/* ---- rows written as given --------------------------------------------------------------- */

typedef struct assign_args {
  void *table;
  embps_dtype_t dtype;
  size_t width, n, state0_width;
  const int64_t *rows, *src_rows;
  const void *src;
  float *state0, *state1, state0_value;
} assign_args_t;

static void run_assign_rows(void *p) {
  const assign_args_t *a = p;
  const size_t row_bytes = a->width * embps_dtype_size(a->dtype);
  check_distinct_rows("assign rows", a->rows, a->n);
  if (row_bytes) {
    check_rows("assign rows", a->rows, a->n, a->table, row_bytes, "the table");
    check_rows("assign rows", a->src_rows, a->n, a->src, row_bytes, "src");
  }
  if (a->state0_width)
    check_rows("assign rows", a->rows, a->n, a->state0, a->state0_width * sizeof(float), "state0");
  if (a->state1 && a->width)
    check_rows("assign rows", a->rows, a->n, a->state1, a->width * sizeof(float), "state1");
  embps_assign_rows_cpu(a->table, a->dtype, a->width, a->rows, a->src_rows, a->n, a->src, a->state0,
                        a->state0_width, a->state1, a->state0_value);
}

embps_status_t embps_assign_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, const int64_t *src_rows, size_t n,
                                      const void *src, float *state0, size_t state0_width,
                                      float *state1, float state0_value, cudaStream_t stream) {
  assign_args_t a;
  const size_t es = embps_dtype_size(dtype);
  if (bad_dtype("assign rows", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (state0_width != 0 && state0_width != 1 && state0_width != width) {
    EMBPS_ERROR("assign rows: state0 of %zu floats per row (0, 1 or the width %zu)", state0_width,
                width);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || (width == 0 && state0_width == 0))
    return EMBPS_OK;
  if (!rows || !src_rows || (width && (!table || !src)) || (state0_width && !state0)) {
    EMBPS_ERROR("assign rows: NULL %s", !rows       ? "rows"
                                        : !src_rows ? "src_rows"
                                        : !table    ? "table"
                                        : !src      ? "src"
                                                    : "state0");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (width) {
    sim_cuda_check_device(stream, table, width * es, "assign rows: table");
    sim_cuda_check_device(stream, src, width * es, "assign rows: src");
  }
  if (state0_width)
    sim_cuda_check_device(stream, state0, state0_width * sizeof(float), "assign rows: state0");
  if (state1 && width)
    sim_cuda_check_device(stream, state1, width * sizeof(float), "assign rows: state1");
  sim_cuda_check_device(stream, rows, n * sizeof(int64_t), "assign rows: rows");
  sim_cuda_check_device(stream, src_rows, n * sizeof(int64_t), "assign rows: src_rows");
  memset(&a, 0, sizeof(a));
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.n = n;
  a.state0_width = state0_width;
  a.rows = rows;
  a.src_rows = src_rows;
  a.src = src;
  a.state0 = state0;
  a.state1 = state1;
  a.state0_value = state0_value;
  sim_cuda_enqueue(stream, run_assign_rows, &a, sizeof(a), "assign rows");
  return EMBPS_OK;
}
