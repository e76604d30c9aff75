/* The launchers of kernels/cuda/embps_kernels_cuda.h for the CUDA simulator: each one makes the
 * real launcher's argument checks (same status for the same call), checks every device array
 * whose size is known on the host against the simulator's registry, and enqueues a closure on
 * the caller's stream that runs the CPU reference of kernels/embps_kernels.h when the stream
 * gets there. Scalars and the optimizer's parameter struct are copied into the closure at
 * enqueue time, as a kernel launch captures its arguments.
 *
 * What depends on device data (the rows an update touches, a segment's positions) is checked
 * when the closure runs, against the allocation the pointer lies in: a stale or poisoned index
 * array then aborts with the kernel's name instead of reading far away. Updates also check
 * their documented preconditions (distinct rows), which a GPU would silently
 * turn into races, and the hash reset its distinct slots. Workspaces are scribbled with the poison
 * after use, as a GPU's scratch would be left, so a caller that aliases a workspace with live data
 * finds out.
 *
 * Results are the CPU's bit for bit, as the launchers promise, except that row stats' total is
 * the CPU's row-order sum (the GPU's tree differs in rounding only).
 *
 * The launchers of the hash-keyed tables and of the feature batches' bags are in
 * sim_kernels_tables.c; the checks both files make are sim_kernels.h's. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "sim_cuda.h"
#include "sim_kernels.h"

#define ALIGN 256

static size_t align_up(size_t x) { return (x + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* ---- dedup -------------------------------------------------------------------------------- */

/* Workspace: the CPU dedup's scratch, then n int64 for the unique tokens (the launcher leaves
 * unique[num_unique..n) untouched, which the CPU function does not promise). */
size_t embps_dedup_cuda_workspace_bytes(size_t n) {
  if (n == 0 || n > UINT32_MAX)
    return 0;
  return align_up(embps_dedup_workspace_bytes(n)) + align_up(n * sizeof(int64_t));
}

typedef struct dedup_args {
  const int64_t *tokens;
  size_t n, ws_bytes;
  int64_t *unique;
  uint32_t *segment_ids, *sorted_positions, *segment_offsets, *num_unique;
  char *workspace;
} dedup_args_t;

static void run_dedup(void *p) {
  const dedup_args_t *a = p;
  int64_t *tmp = (int64_t *)(a->workspace + align_up(embps_dedup_workspace_bytes(a->n)));
  size_t u = embps_dedup_cpu(a->tokens, a->n, tmp, a->segment_ids, a->workspace);
  uint32_t *off = a->segment_offsets;
  memcpy(a->unique, tmp, u * sizeof(int64_t));
  /* A counting sort by segment, positions ascending: segment s's positions land in
   * [off[s], off[s+1]). off[s] serves as segment s's cursor, then shifts back. */
  memset(off, 0, (u + 1) * sizeof(uint32_t));
  for (size_t i = 0; i < a->n; i++)
    off[a->segment_ids[i] + 1]++;
  for (size_t s = 0; s < u; s++)
    off[s + 1] += off[s];
  for (size_t i = 0; i < a->n; i++)
    a->sorted_positions[off[a->segment_ids[i]]++] = (uint32_t)i;
  for (size_t s = u; s > 0; s--)
    off[s] = off[s - 1];
  off[0] = 0;
  *a->num_unique = (uint32_t)u;
  sim_cuda_poison(a->workspace, a->ws_bytes);
}

embps_status_t embps_dedup_cuda(const int64_t *tokens, size_t n, int64_t *unique,
                                uint32_t *segment_ids, uint32_t *sorted_positions,
                                uint32_t *segment_offsets, uint32_t *num_unique, void *workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  dedup_args_t a;
  size_t need;
  if (!num_unique || !segment_offsets) {
    EMBPS_ERROR("dedup: num_unique and segment_offsets are required");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0) {
    if (cudaMemsetAsync(num_unique, 0, sizeof(uint32_t), stream) != cudaSuccess ||
        cudaMemsetAsync(segment_offsets, 0, sizeof(uint32_t), stream) != cudaSuccess)
      return EMBPS_INTERNAL;
    return EMBPS_OK;
  }
  if (n > UINT32_MAX || !tokens || !unique || !segment_ids || !sorted_positions || !workspace ||
      ((uintptr_t)workspace & (ALIGN - 1))) {
    EMBPS_ERROR("dedup: %zu tokens (at most 2^32 - 1), a NULL array or a workspace not aligned "
                "to %d bytes",
                n, ALIGN);
    return EMBPS_INVALID_ARGUMENT;
  }
  need = embps_dedup_cuda_workspace_bytes(n);
  if (need > workspace_bytes) {
    EMBPS_ERROR("dedup: workspace of %zu bytes, %zu needed", workspace_bytes, need);
    return EMBPS_INVALID_ARGUMENT;
  }
  sim_cuda_check_device(stream, tokens, n * sizeof(int64_t), "dedup: tokens");
  sim_cuda_check_device(stream, unique, n * sizeof(int64_t), "dedup: unique");
  sim_cuda_check_device(stream, segment_ids, n * sizeof(uint32_t), "dedup: segment_ids");
  sim_cuda_check_device(stream, sorted_positions, n * sizeof(uint32_t), "dedup: sorted_positions");
  sim_cuda_check_device(stream, segment_offsets, (n + 1) * sizeof(uint32_t),
                        "dedup: segment_offsets");
  sim_cuda_check_device(stream, num_unique, sizeof(uint32_t), "dedup: num_unique");
  sim_cuda_check_device(stream, workspace, need, "dedup: workspace");
  a.tokens = tokens;
  a.n = n;
  a.ws_bytes = need;
  a.unique = unique;
  a.segment_ids = segment_ids;
  a.sorted_positions = sorted_positions;
  a.segment_offsets = segment_offsets;
  a.num_unique = num_unique;
  a.workspace = workspace;
  sim_cuda_enqueue(stream, run_dedup, &a, sizeof(a), "dedup");
  return EMBPS_OK;
}

/* ---- gather and expand -------------------------------------------------------------------- */

typedef struct copy_rows_args {
  const void *src;
  embps_dtype_t dtype;
  size_t width, n;
  const int64_t *rows;     /* gather */
  const uint32_t *seg_ids; /* expand */
  void *out;
} copy_rows_args_t;

static void run_gather(void *p) {
  const copy_rows_args_t *a = p;
  check_rows("gather", a->rows, a->n, a->src, a->width * embps_dtype_size(a->dtype), "the table");
  embps_gather_cpu(a->src, a->dtype, a->width, a->rows, a->n, a->out);
}

static void run_expand(void *p) {
  const copy_rows_args_t *a = p;
  size_t row_bytes = a->width * embps_dtype_size(a->dtype);
  size_t have = sim_cuda_device_extent(a->src, "expand") / row_bytes;
  for (size_t i = 0; i < a->n; i++)
    if (a->seg_ids[i] >= have)
      sim_cuda_fail("expand: segment_ids[%zu] = %u is outside src (%zu rows)", i, a->seg_ids[i],
                    have);
  embps_expand_cpu(a->src, a->dtype, a->width, a->seg_ids, a->n, a->out);
}

static embps_status_t copy_rows(const char *what, const void *src, embps_dtype_t dtype,
                                size_t width, const int64_t *rows, const uint32_t *seg_ids,
                                size_t n, void *out, cudaStream_t stream) {
  copy_rows_args_t a;
  if (bad_dtype(what, dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (n == 0 || width == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, src, 1, what);
  if (rows)
    sim_cuda_check_device(stream, rows, n * sizeof(int64_t), "gather: rows");
  else
    sim_cuda_check_device(stream, seg_ids, n * sizeof(uint32_t), "expand: segment_ids");
  sim_cuda_check_device(stream, out, bytes3(n, width, embps_dtype_size(dtype), what), what);
  a.src = src;
  a.dtype = dtype;
  a.width = width;
  a.n = n;
  a.rows = rows;
  a.seg_ids = seg_ids;
  a.out = out;
  sim_cuda_enqueue(stream, rows ? run_gather : run_expand, &a, sizeof(a), what);
  return EMBPS_OK;
}

embps_status_t embps_gather_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                 const int64_t *rows, size_t n, void *out, cudaStream_t stream) {
  if (!rows && n > 0 && width > 0 && embps_dtype_size(dtype))
    sim_cuda_fail("gather: rows is NULL");
  return copy_rows("gather", table, dtype, width, rows, NULL, n, out, stream);
}

embps_status_t embps_expand_cuda(const void *src, embps_dtype_t dtype, size_t width,
                                 const uint32_t *segment_ids, size_t n, void *out,
                                 cudaStream_t stream) {
  if (!segment_ids && n > 0 && width > 0 && embps_dtype_size(dtype))
    sim_cuda_fail("expand: segment_ids is NULL");
  return copy_rows("expand", src, dtype, width, NULL, segment_ids, n, out, stream);
}

/* ---- segment sum ---------------------------------------------------------------------------- */

typedef struct segment_sum_args {
  const void *grads;
  embps_dtype_t dtype;
  size_t width, num_unique;
  const uint32_t *sorted_positions, *segment_offsets;
  float *out;
} segment_sum_args_t;

/* Gathers the segments' rows in (segment, k) order and lets the CPU reference sum them: its
 * ascending-position order is then exactly the launcher's k order. */
static void run_segment_sum(void *p) {
  const segment_sum_args_t *a = p;
  const uint32_t *off = a->segment_offsets;
  size_t es = embps_dtype_size(a->dtype), row = a->width * es, k0 = off[0], k1, rows_have;
  uint8_t *tmp;
  uint32_t *seg;
  for (size_t s = 0; s < a->num_unique; s++)
    if (off[s + 1] <= off[s])
      sim_cuda_fail("segment sum: segment %zu of %zu is empty or reversed (offsets %u, %u)", s,
                    a->num_unique, off[s], off[s + 1]);
  k1 = off[a->num_unique];
  if ((size_t)k1 * sizeof(uint32_t) >
      sim_cuda_device_extent(a->sorted_positions, "segment sum: sorted_positions"))
    sim_cuda_fail("segment sum: segment_offsets[%zu] = %zu is beyond sorted_positions",
                  a->num_unique, k1);
  rows_have = sim_cuda_device_extent(a->grads, "segment sum: grads") / row;
  tmp = malloc((k1 - k0) * row + 1);
  seg = malloc((k1 - k0) * sizeof(uint32_t) + 1);
  if (!tmp || !seg)
    sim_cuda_fail("out of host memory");
  for (size_t s = 0; s < a->num_unique; s++)
    for (size_t k = off[s]; k < off[s + 1]; k++) {
      uint32_t pos = a->sorted_positions[k];
      if (pos >= rows_have)
        sim_cuda_fail("segment sum: sorted_positions[%zu] = %u is outside grads (%zu rows)", k, pos,
                      rows_have);
      memcpy(tmp + (k - k0) * row, (const uint8_t *)a->grads + (size_t)pos * row, row);
      seg[k - k0] = (uint32_t)s;
    }
  embps_segment_sum_cpu(tmp, a->dtype, a->width, seg, k1 - k0, a->num_unique, a->out);
  free(tmp);
  free(seg);
}

embps_status_t embps_segment_sum_cuda(const void *grads, embps_dtype_t dtype, size_t width,
                                      const uint32_t *sorted_positions,
                                      const uint32_t *segment_offsets, size_t num_unique,
                                      float *out, cudaStream_t stream) {
  segment_sum_args_t a;
  if (bad_dtype("segment sum", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (num_unique == 0 || width == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, grads, width * embps_dtype_size(dtype), "segment sum: grads");
  sim_cuda_check_device(stream, sorted_positions, sizeof(uint32_t),
                        "segment sum: sorted_positions");
  sim_cuda_check_device(stream, segment_offsets, (num_unique + 1) * sizeof(uint32_t),
                        "segment sum: segment_offsets");
  sim_cuda_check_device(stream, out, bytes3(num_unique, width, sizeof(float), "segment sum"),
                        "segment sum: out");
  a.grads = grads;
  a.dtype = dtype;
  a.width = width;
  a.num_unique = num_unique;
  a.sorted_positions = sorted_positions;
  a.segment_offsets = segment_offsets;
  a.out = out;
  sim_cuda_enqueue(stream, run_segment_sum, &a, sizeof(a), "segment sum");
  return EMBPS_OK;
}

/* ---- row statistics ------------------------------------------------------------------------ */

typedef struct row_partials_args {
  const float *g;
  size_t n, width, block;
  float *partials;
} row_partials_args_t;

static void run_row_partials(void *p) {
  const row_partials_args_t *a = p;
  embps_row_partials_cpu(a->g, a->n, a->width, a->block, a->partials);
}

embps_status_t embps_row_partials_cuda(const float *g, size_t n, size_t width, size_t block,
                                       float *partials, cudaStream_t stream) {
  row_partials_args_t a;
  if (block == 0 || width % block != 0) {
    EMBPS_ERROR("row partials: block %zu does not divide width %zu", block, width);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || width == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, g, bytes3(n, width, sizeof(float), "row partials"),
                        "row partials: g");
  sim_cuda_check_device(stream, partials, bytes3(n, width / block, sizeof(float), "row partials"),
                        "row partials: partials");
  a.g = g;
  a.n = n;
  a.width = width;
  a.block = block;
  a.partials = partials;
  sim_cuda_enqueue(stream, run_row_partials, &a, sizeof(a), "row partials");
  return EMBPS_OK;
}

/* The real launcher's: one double and one count per block of 256 rows. */
size_t embps_row_combine_cuda_workspace_bytes(size_t n) {
  return (n + 255) / 256 * (sizeof(double) + sizeof(uint64_t));
}

typedef struct row_combine_args {
  const float *partials;
  size_t slices, n, nb;
  float *row_sumsq;
  double *total_sumsq;
  uint64_t *num_bad;
  void *workspace;
} row_combine_args_t;

static void run_row_combine(void *p) {
  const row_combine_args_t *a = p;
  size_t bad =
      embps_row_combine_cpu(a->partials, a->slices, a->n, a->nb, a->row_sumsq, a->total_sumsq);
  if (a->num_bad)
    *a->num_bad = bad;
  if (a->workspace)
    sim_cuda_poison(a->workspace, embps_row_combine_cuda_workspace_bytes(a->n));
}

embps_status_t embps_row_combine_cuda(const float *partials, size_t slices, size_t n, size_t nb,
                                      float *row_sumsq, double *total_sumsq, uint64_t *num_bad,
                                      void *workspace, cudaStream_t stream) {
  row_combine_args_t a;
  int reduce = total_sumsq || num_bad;
  if (reduce && n > 0 && (!workspace || ((uintptr_t)workspace & (sizeof(double) - 1)))) {
    EMBPS_ERROR("row combine: the total or the count needs an 8-byte aligned workspace");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (!(n > 0 && row_sumsq) && !reduce)
    return EMBPS_OK;
  if (n > 0 && nb > 0)
    sim_cuda_check_device(stream, partials, bytes3(slices * n, nb, sizeof(float), "row combine"),
                          "row combine: partials");
  if (n > 0) {
    if (row_sumsq)
      sim_cuda_check_device(stream, row_sumsq, n * sizeof(float), "row combine: row_sumsq");
    if (reduce)
      sim_cuda_check_device(stream, workspace, embps_row_combine_cuda_workspace_bytes(n),
                            "row combine: workspace");
  }
  if (total_sumsq)
    sim_cuda_check_device(stream, total_sumsq, sizeof(double), "row combine: total_sumsq");
  if (num_bad)
    sim_cuda_check_device(stream, num_bad, sizeof(uint64_t), "row combine: num_bad");
  a.partials = partials;
  a.slices = slices;
  a.n = n;
  a.nb = nb;
  a.row_sumsq = row_sumsq;
  a.total_sumsq = total_sumsq;
  a.num_bad = num_bad;
  a.workspace = reduce && n > 0 ? workspace : NULL;
  sim_cuda_enqueue(stream, run_row_combine, &a, sizeof(a), "row combine");
  return EMBPS_OK;
}

typedef struct row_sums_args {
  const float *partials;
  size_t slices, stride, n, nb;
  double *sums;
} row_sums_args_t;

static void run_row_sums(void *p) {
  const row_sums_args_t *a = p;
  embps_row_sums_cpu(a->partials, a->slices, a->stride, a->n, a->nb, a->sums);
}

embps_status_t embps_row_sums_cuda(const float *partials, size_t slices, size_t stride, size_t n,
                                   size_t nb, double *sums, cudaStream_t stream) {
  row_sums_args_t a;
  if (n > stride) {
    EMBPS_ERROR("row sums: %zu rows do not fit a stride of %zu", n, stride);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0)
    return EMBPS_OK;
  /* Slice r's rows end at (r * stride + n) * nb: the last slice's, the extent the kernel reads. */
  if (slices > 0 && nb > 0)
    sim_cuda_check_device(stream, partials,
                          bytes3((slices - 1) * stride + n, nb, sizeof(float), "row sums"),
                          "row sums: partials");
  sim_cuda_check_device(stream, sums, n * sizeof(double), "row sums: sums");
  a.partials = partials;
  a.slices = slices;
  a.stride = stride;
  a.n = n;
  a.nb = nb;
  a.sums = sums;
  sim_cuda_enqueue(stream, run_row_sums, &a, sizeof(a), "row sums");
  return EMBPS_OK;
}

typedef struct row_finish_args {
  const double *sums;
  size_t n;
  float *row_sumsq;
  double *total_sumsq;
  uint64_t *num_bad;
  void *workspace;
} row_finish_args_t;

static void run_row_finish(void *p) {
  const row_finish_args_t *a = p;
  size_t bad = embps_row_finish_cpu(a->sums, a->n, a->row_sumsq, a->total_sumsq);
  if (a->num_bad)
    *a->num_bad = bad;
  if (a->workspace)
    sim_cuda_poison(a->workspace, embps_row_combine_cuda_workspace_bytes(a->n));
}

embps_status_t embps_row_finish_cuda(const double *sums, size_t n, float *row_sumsq,
                                     double *total_sumsq, uint64_t *num_bad, void *workspace,
                                     cudaStream_t stream) {
  row_finish_args_t a;
  int reduce = total_sumsq || num_bad;
  if (reduce && n > 0 && (!workspace || ((uintptr_t)workspace & (sizeof(double) - 1)))) {
    EMBPS_ERROR("row finish: the total or the count needs an 8-byte aligned workspace");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (!(n > 0 && row_sumsq) && !reduce)
    return EMBPS_OK;
  if (n > 0) {
    sim_cuda_check_device(stream, sums, n * sizeof(double), "row finish: sums");
    if (row_sumsq)
      sim_cuda_check_device(stream, row_sumsq, n * sizeof(float), "row finish: row_sumsq");
    if (reduce)
      sim_cuda_check_device(stream, workspace, embps_row_combine_cuda_workspace_bytes(n),
                            "row finish: workspace");
  }
  if (total_sumsq)
    sim_cuda_check_device(stream, total_sumsq, sizeof(double), "row finish: total_sumsq");
  if (num_bad)
    sim_cuda_check_device(stream, num_bad, sizeof(uint64_t), "row finish: num_bad");
  a.sums = sums;
  a.n = n;
  a.row_sumsq = row_sumsq;
  a.total_sumsq = total_sumsq;
  a.num_bad = num_bad;
  a.workspace = reduce && n > 0 ? workspace : NULL;
  sim_cuda_enqueue(stream, run_row_finish, &a, sizeof(a), "row finish");
  return EMBPS_OK;
}

/* ---- fused optimizer updates ---------------------------------------------------------------- */

typedef enum update_kind { SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM } update_kind_t;

typedef struct update_args {
  update_kind_t kind;
  void *table;
  embps_dtype_t dtype;
  size_t width, n, full_width;
  const int64_t *rows;
  const float *grad, *row_sumsq;
  float *s0, *s1; /* accum, or adam's m and v */
  embps_opt_params_t p;
} update_args_t;

static const char *update_name(update_kind_t k) {
  return k == SGD ? "sgd" : k == ADAGRAD ? "adagrad" : k == ADAM ? "adam" : "rowwise adagrad";
}

static void run_update(void *p) {
  const update_args_t *a = p;
  const char *what = update_name(a->kind);
  size_t row = a->width * embps_dtype_size(a->dtype), frow = a->width * sizeof(float);
  check_distinct_rows(what, a->rows, a->n);
  check_rows(what, a->rows, a->n, a->table, row, "the table");
  switch (a->kind) {
  case SGD:
    embps_update_sgd_cpu(a->table, a->dtype, a->width, a->rows, a->n, a->grad, &a->p);
    break;
  case ADAGRAD:
    check_rows(what, a->rows, a->n, a->s0, frow, "accum");
    embps_update_adagrad_cpu(a->table, a->dtype, a->width, a->rows, a->n, a->grad, a->s0, &a->p);
    break;
  case ROWWISE_ADAGRAD:
    check_rows(what, a->rows, a->n, a->s0, sizeof(float), "accum");
    embps_update_rowwise_adagrad_cpu(a->table, a->dtype, a->width, a->rows, a->n, a->grad,
                                     a->row_sumsq, a->full_width, a->s0, &a->p);
    break;
  case ADAM:
    check_rows(what, a->rows, a->n, a->s0, frow, "m");
    check_rows(what, a->rows, a->n, a->s1, frow, "v");
    embps_update_adam_cpu(a->table, a->dtype, a->width, a->rows, a->n, a->grad, a->s0, a->s1,
                          &a->p);
    break;
  }
}

static embps_status_t update(update_args_t *a, const embps_opt_params_t *p, cudaStream_t stream) {
  const char *what = update_name(a->kind);
  if (!p) {
    EMBPS_ERROR("%s: NULL params", what);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (bad_dtype(what, a->dtype))
    return EMBPS_INVALID_ARGUMENT;
  /* Rowwise Adagrad with width 0 still updates the accumulators, as the CPU does. */
  if (a->n == 0 || (a->width == 0 && a->kind != ROWWISE_ADAGRAD))
    return EMBPS_OK;
  a->p = *p;
  sim_cuda_check_device(stream, a->rows, a->n * sizeof(int64_t), "update: rows");
  sim_cuda_check_device(stream, a->grad, bytes3(a->n, a->width, sizeof(float), what),
                        "update: grad");
  if (a->width)
    sim_cuda_check_device(stream, a->table, 1, "update: table");
  if (a->s0)
    sim_cuda_check_device(stream, a->s0, 1, "update: state");
  if (a->s1)
    sim_cuda_check_device(stream, a->s1, 1, "update: state");
  if (a->kind == ROWWISE_ADAGRAD)
    sim_cuda_check_device(stream, a->row_sumsq, a->n * sizeof(float), "update: row_sumsq");
  sim_cuda_enqueue(stream, run_update, a, sizeof(*a), what);
  return EMBPS_OK;
}

static update_args_t update_args(update_kind_t kind, void *table, embps_dtype_t dtype, size_t width,
                                 const int64_t *rows, size_t n, const float *grad) {
  update_args_t a;
  memset(&a, 0, sizeof(a));
  a.kind = kind;
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.rows = rows;
  a.n = n;
  a.grad = grad;
  return a;
}

embps_status_t embps_update_sgd_cuda(void *table, embps_dtype_t dtype, size_t width,
                                     const int64_t *rows, size_t n, const float *grad,
                                     const embps_opt_params_t *p, cudaStream_t stream) {
  update_args_t a = update_args(SGD, table, dtype, width, rows, n, grad);
  return update(&a, p, stream);
}

embps_status_t embps_update_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                         const int64_t *rows, size_t n, const float *grad,
                                         float *accum, const embps_opt_params_t *p,
                                         cudaStream_t stream) {
  update_args_t a = update_args(ADAGRAD, table, dtype, width, rows, n, grad);
  a.s0 = accum;
  return update(&a, p, stream);
}

embps_status_t embps_update_rowwise_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                 const int64_t *rows, size_t n, const float *grad,
                                                 const float *row_sumsq, size_t full_width,
                                                 float *accum, const embps_opt_params_t *p,
                                                 cudaStream_t stream) {
  update_args_t a = update_args(ROWWISE_ADAGRAD, table, dtype, width, rows, n, grad);
  a.row_sumsq = row_sumsq;
  a.full_width = full_width;
  a.s0 = accum;
  return update(&a, p, stream);
}

embps_status_t embps_update_adam_cuda(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, size_t n, const float *grad, float *m,
                                      float *v, const embps_opt_params_t *p, cudaStream_t stream) {
  update_args_t a = update_args(ADAM, table, dtype, width, rows, n, grad);
  a.s0 = m;
  a.s1 = v;
  return update(&a, p, stream);
}

typedef struct weight_decay_args {
  const void *table;
  embps_dtype_t dtype;
  size_t width, n;
  const int64_t *rows;
  float *grad;
  float weight_decay;
} weight_decay_args_t;

static void run_weight_decay(void *p) {
  const weight_decay_args_t *a = p;
  check_rows("weight decay", a->rows, a->n, a->table, a->width * embps_dtype_size(a->dtype),
             "the table");
  embps_apply_weight_decay_cpu(a->table, a->dtype, a->width, a->rows, a->n, a->grad,
                               a->weight_decay);
}

embps_status_t embps_apply_weight_decay_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                             const int64_t *rows, size_t n, float *grad,
                                             float weight_decay, cudaStream_t stream) {
  weight_decay_args_t a;
  if (weight_decay == 0.0f && embps_dtype_size(dtype) != 0)
    return EMBPS_OK;
  if (bad_dtype("weight decay", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (n == 0 || width == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, table, 1, "weight decay: table");
  sim_cuda_check_device(stream, rows, n * sizeof(int64_t), "weight decay: rows");
  sim_cuda_check_device(stream, grad, bytes3(n, width, sizeof(float), "weight decay"),
                        "weight decay: grad");
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.n = n;
  a.rows = rows;
  a.grad = grad;
  a.weight_decay = weight_decay;
  sim_cuda_enqueue(stream, run_weight_decay, &a, sizeof(a), "weight decay");
  return EMBPS_OK;
}

/* ---- row marks ---------------------------------------------------------------------------- */

typedef struct mark_args {
  uint64_t *bits;
  const int64_t *rows;
  size_t n;
} mark_args_t;

static void run_mark_rows(void *p) {
  const mark_args_t *a = p;
  size_t words = sim_cuda_device_extent(a->bits, "mark rows") / sizeof(uint64_t);
  for (size_t i = 0; i < a->n; i++)
    if (a->rows[i] < 0 || (uint64_t)a->rows[i] / 64 >= words)
      sim_cuda_fail("mark rows: rows[%zu] = %lld is outside the bitmap (%zu words)", i,
                    (long long)a->rows[i], words);
  embps_mark_rows_cpu(a->bits, a->rows, a->n);
}

embps_status_t embps_mark_rows_cuda(uint64_t *bits, const int64_t *rows, size_t n,
                                    cudaStream_t stream) {
  mark_args_t a;
  if (n == 0)
    return EMBPS_OK;
  if (!bits || !rows) {
    EMBPS_ERROR("mark rows: NULL %s", !bits ? "bitmap" : "rows");
    return EMBPS_INVALID_ARGUMENT;
  }
  sim_cuda_check_device(stream, bits, sizeof(uint64_t), "mark rows: bits");
  sim_cuda_check_device(stream, rows, n * sizeof(int64_t), "mark rows: rows");
  a.bits = bits;
  a.rows = rows;
  a.n = n;
  sim_cuda_enqueue(stream, run_mark_rows, &a, sizeof(a), "mark rows");
  return EMBPS_OK;
}

/* ---- initializer -------------------------------------------------------------------------- */

typedef struct init_args {
  void *table;
  embps_dtype_t dtype;
  size_t width;
  uint64_t row_begin, row_end, col_begin, seed;
  float scale;
} init_args_t;

static void run_init(void *p) {
  const init_args_t *a = p;
  embps_init_rows_cpu(a->table, a->dtype, a->width, a->row_begin, a->row_end, a->col_begin, a->seed,
                      a->scale);
}

embps_status_t embps_init_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                    uint64_t row_begin, uint64_t row_end, uint64_t col_begin,
                                    uint64_t seed, float scale, cudaStream_t stream) {
  init_args_t a;
  if (bad_dtype("init", dtype))
    return EMBPS_INVALID_ARGUMENT;
  if (row_end <= row_begin || width == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, table, bytes3(row_end, width, embps_dtype_size(dtype), "init"),
                        "init: table");
  a.table = table;
  a.dtype = dtype;
  a.width = width;
  a.row_begin = row_begin;
  a.row_end = row_end;
  a.col_begin = col_begin;
  a.seed = seed;
  a.scale = scale;
  sim_cuda_enqueue(stream, run_init, &a, sizeof(a), "init");
  return EMBPS_OK;
}

/* ---- dtype conversion ------------------------------------------------------------------------ */

typedef struct convert_args {
  const void *in;
  size_t n;
  void *out;
} convert_args_t;

static void run_to_bf16(void *p) {
  const convert_args_t *a = p;
  for (size_t i = 0; i < a->n; i++)
    ((uint16_t *)a->out)[i] = embps_f32_to_bf16(((const float *)a->in)[i]);
}

static void run_to_f32(void *p) {
  const convert_args_t *a = p;
  for (size_t i = 0; i < a->n; i++)
    ((float *)a->out)[i] = embps_bf16_to_f32(((const uint16_t *)a->in)[i]);
}

static embps_status_t convert(const void *in, size_t in_es, size_t n, void *out, size_t out_es,
                              void (*fn)(void *), cudaStream_t stream, const char *what) {
  convert_args_t a;
  if (n == 0)
    return EMBPS_OK;
  sim_cuda_check_device(stream, in, bytes3(n, in_es, 1, what), what);
  sim_cuda_check_device(stream, out, bytes3(n, out_es, 1, what), what);
  a.in = in;
  a.n = n;
  a.out = out;
  sim_cuda_enqueue(stream, fn, &a, sizeof(a), what);
  return EMBPS_OK;
}

embps_status_t embps_f32_to_bf16_cuda(const float *in, size_t n, uint16_t *out,
                                      cudaStream_t stream) {
  return convert(in, sizeof(float), n, out, sizeof(uint16_t), run_to_bf16, stream, "f32 to bf16");
}

embps_status_t embps_bf16_to_f32_cuda(const uint16_t *in, size_t n, float *out,
                                      cudaStream_t stream) {
  return convert(in, sizeof(uint16_t), n, out, sizeof(float), run_to_f32, stream, "bf16 to f32");
}
