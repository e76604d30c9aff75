/* embps CUDA kernels: the GPU twins of kernels/embps_kernels.h, callable from C.
 *
 * Conventions (in addition to those of embps_kernels.h, which hold here unchanged):
 * - Every array pointer is a device pointer owned by the caller; parameter structs
 *   (embps_opt_params_t) are read on the host during the call. Nothing is allocated, nothing
 *   is freed, nothing is kept after a call returns.
 * - Every launcher enqueues its work on the caller's `stream` and returns without
 *   synchronizing; outputs are ready when the stream reaches that point. Results that the CPU
 *   functions return (dedup's count, row stats' non-finite count) are written to device memory
 *   instead. A launcher that enqueues nothing (n == 0 or width == 0) returns EMBPS_OK.
 * - Return values: EMBPS_OK; EMBPS_INVALID_ARGUMENT for a bad dtype, a NULL array that the
 *   call needs, a too small workspace or a size beyond what the kernel indexes (checked before
 *   anything is enqueued); EMBPS_INTERNAL when a CUDA call or a launch fails (logged with
 *   file:line; work enqueued before the failure may have run).
 * - Results equal the CPU references bit for bit: gather, expand, dedup, init and the bf16
 *   conversions trivially; segment sum, weight decay, the updates and each row's sum of
 *   squares because every output is computed with the same f32/f64 operations in the same
 *   order as on the CPU (no FMA contraction on either side, IEEE division and sqrt). The one
 *   exception is the row combine's total, summed by a deterministic tree instead of in row
 *   order: identical run after run on any GPU, within rounding of the CPU's total. A NaN produced
 * by arithmetic may carry a different payload than on the CPU (it is NaN on both).
 * - The stream is a cudaStream_t from <cuda_runtime_api.h> (plain C); 0 is the legacy default
 *   stream. */
#ifndef EMBPS_KERNELS_CUDA_H
#define EMBPS_KERNELS_CUDA_H

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The project's C headers have no C++ guards of their own; seen from the .cu files (C++)
 * their functions must keep C linkage. */
#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"
#include "kernels/embps_kernels.h"

/* ---- dedup -------------------------------------------------------------------------------- */

/**
 * Bytes of workspace that embps_dedup_cuda needs for n tokens on the current device (the CUB
 * sort's scratch depends on the device). Returns 0 for n == 0, and 0 when the query fails
 * (logged), which no n > 0 ever needs, so 0 for n > 0 means "no workspace size known".
 */
size_t embps_dedup_cuda_workspace_bytes(size_t n);

/**
 * Deduplicates a batch of tokens, like embps_dedup_cpu, and also returns the batch grouped by
 * segment for embps_segment_sum_cuda.
 * - unique (n entries): the distinct tokens ascending in [0, num_unique); the rest untouched.
 * - segment_ids (n): the index of tokens[i] in unique, for every position i.
 * - sorted_positions (n): the positions 0..n-1 ordered by (token, position): segment s's
 *   positions, ascending, are sorted_positions[segment_offsets[s] .. segment_offsets[s+1]).
 * - segment_offsets (n + 1 entries): [0, num_unique] written, segment_offsets[num_unique] = n.
 * - num_unique (1 entry, device): the number of distinct tokens.
 * workspace: at least workspace_bytes >= embps_dedup_cuda_workspace_bytes(n) bytes, 256-byte
 * aligned (cudaMalloc's alignment). n must be below 2^32. Signed tokens sort as signed.
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (n too large, workspace too small, NULL arrays),
 * EMBPS_INTERNAL.
 */
embps_status_t embps_dedup_cuda(const int64_t *tokens, size_t n, int64_t *unique,
                                uint32_t *segment_ids, uint32_t *sorted_positions,
                                uint32_t *segment_offsets, uint32_t *num_unique, void *workspace,
                                size_t workspace_bytes, cudaStream_t stream);

/* ---- gather ------------------------------------------------------------------------------- */

/** embps_gather_cpu on the device: out[i] = table[rows[i]] (n rows of width dtype elements).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype), EMBPS_INTERNAL. */
embps_status_t embps_gather_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                 const int64_t *rows, size_t n, void *out, cudaStream_t stream);

/** embps_expand_cpu on the device: out[i] = src[segment_ids[i]].
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype), EMBPS_INTERNAL. */
embps_status_t embps_expand_cuda(const void *src, embps_dtype_t dtype, size_t width,
                                 const uint32_t *segment_ids, size_t n, void *out,
                                 cudaStream_t stream);

/* ---- segment sum ---------------------------------------------------------------------------- */

/**
 * embps_segment_sum_cpu on the device, taking the grouping from embps_dedup_cuda instead of
 * segment_ids: out[s] = sum of grads[sorted_positions[k]] for k in [segment_offsets[s],
 * segment_offsets[s+1]), in that (ascending position) order, accumulated in f32 from 0. Equal
 * bit for bit to the CPU's sum with the matching segment_ids. grads: batch x width of dtype;
 * out: num_unique x width f32, overwritten. Each segment must hold at least one position
 * (dedup's do). num_unique is a host value (the caller reads dedup's count to size the
 * exchange anyway).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype), EMBPS_INTERNAL.
 */
embps_status_t embps_segment_sum_cuda(const void *grads, embps_dtype_t dtype, size_t width,
                                      const uint32_t *sorted_positions,
                                      const uint32_t *segment_offsets, size_t num_unique,
                                      float *out, cudaStream_t stream);

/* ---- row statistics ------------------------------------------------------------------------ */

/** embps_row_partials_cpu on the device: bit for bit the CPU's partials.
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (block not dividing width, grid too large),
 * EMBPS_INTERNAL. */
embps_status_t embps_row_partials_cuda(const float *g, size_t n, size_t width, size_t block,
                                       float *partials, cudaStream_t stream);

/** Bytes of workspace that embps_row_combine_cuda needs for n rows (device independent). */
size_t embps_row_combine_cuda_workspace_bytes(size_t n);

/**
 * embps_row_combine_cpu on the device, for `slices` x n x nb partials:
 * - row_sumsq (n entries, may be NULL): each row's sum, bit for bit the CPU's.
 * - total_sumsq (1 double, may be NULL): the total is ADDED to it, like the CPU (by a fixed
 *   tree: the same on every run and GPU, equal to the CPU's to rounding).
 * - num_bad (1 uint64, may be NULL): OVERWRITTEN with the number of rows whose sum is not
 *   finite (the CPU's return value).
 * workspace: embps_row_combine_cuda_workspace_bytes(n) bytes, 8-byte aligned; only used when
 * total_sumsq or num_bad is requested (may be NULL otherwise).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (NULL workspace when needed), EMBPS_INTERNAL.
 */
embps_status_t embps_row_combine_cuda(const float *partials, size_t slices, size_t n, size_t nb,
                                      float *row_sumsq, double *total_sumsq, uint64_t *num_bad,
                                      void *workspace, cudaStream_t stream);

/** embps_row_sums_cpu on the device (n <= stride rows; sums n doubles): the combine's own
 * additions, bit for bit the CPU's. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (n > stride, grid
 * too large), EMBPS_INTERNAL. */
embps_status_t embps_row_sums_cuda(const float *partials, size_t slices, size_t stride, size_t n,
                                   size_t nb, double *sums, cudaStream_t stream);

/**
 * embps_row_finish_cpu on the device, with embps_row_combine_cuda's outputs and workspace
 * (embps_row_combine_cuda_workspace_bytes(n)): on the sums of embps_row_sums_cuda, row_sumsq,
 * num_bad and the total are embps_row_combine_cuda's bit for bit (the same fixed-shape tree).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (NULL workspace when needed), EMBPS_INTERNAL.
 */
embps_status_t embps_row_finish_cuda(const double *sums, size_t n, float *row_sumsq,
                                     double *total_sumsq, uint64_t *num_bad, void *workspace,
                                     cudaStream_t stream);

/* ---- fused optimizer updates ---------------------------------------------------------------- */
/* Same contracts as the _cpu updates: rows distinct, grad n x width f32, state indexed by the
 * table row. p is a host pointer, read before returning. Each returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT (dtype, NULL p), EMBPS_INTERNAL. */

/** embps_update_sgd_cpu on the device. */
embps_status_t embps_update_sgd_cuda(void *table, embps_dtype_t dtype, size_t width,
                                     const int64_t *rows, size_t n, const float *grad,
                                     const embps_opt_params_t *p, cudaStream_t stream);

/** embps_update_adagrad_cpu on the device. */
embps_status_t embps_update_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                         const int64_t *rows, size_t n, const float *grad,
                                         float *accum, const embps_opt_params_t *p,
                                         cudaStream_t stream);

/** embps_update_rowwise_adagrad_cpu on the device (row_sumsq: n entries, device). */
embps_status_t embps_update_rowwise_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                 const int64_t *rows, size_t n, const float *grad,
                                                 const float *row_sumsq, size_t full_width,
                                                 float *accum, const embps_opt_params_t *p,
                                                 cudaStream_t stream);

/** embps_update_adam_cpu on the device (bias corrections computed on the host, as the CPU). */
embps_status_t embps_update_adam_cuda(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, size_t n, const float *grad, float *m,
                                      float *v, const embps_opt_params_t *p, cudaStream_t stream);

/** embps_apply_weight_decay_cpu on the device (enqueues nothing when weight_decay == 0).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype), EMBPS_INTERNAL. */
embps_status_t embps_apply_weight_decay_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                             const int64_t *rows, size_t n, float *grad,
                                             float weight_decay, cudaStream_t stream);

/* ---- row marks ---------------------------------------------------------------------------- */

/** embps_mark_rows_cpu on the device (bits and rows device memory): the same bitmap bit for
 * bit, its bits set by atomic ORs in any order. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (NULL
 * arrays, n beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_mark_rows_cuda(uint64_t *bits, const int64_t *rows, size_t n,
                                    cudaStream_t stream);

/* ---- initializer -------------------------------------------------------------------------- */

/** embps_init_rows_cpu on the device: the same values bit for bit (same hash, same f32 math).
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype), EMBPS_INTERNAL. */
embps_status_t embps_init_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                    uint64_t row_begin, uint64_t row_end, uint64_t col_begin,
                                    uint64_t seed, float scale, cudaStream_t stream);

/* ---- dtype conversion ------------------------------------------------------------------------ */

/** n f32 values to bf16 bits, exactly embps_f32_to_bf16 (nearest even, NaN stays quiet NaN).
 * Returns EMBPS_OK, EMBPS_INTERNAL. */
embps_status_t embps_f32_to_bf16_cuda(const float *in, size_t n, uint16_t *out,
                                      cudaStream_t stream);

/** n bf16 bit patterns to f32, exactly embps_bf16_to_f32. Returns EMBPS_OK, EMBPS_INTERNAL. */
embps_status_t embps_bf16_to_f32_cuda(const uint16_t *in, size_t n, float *out,
                                      cudaStream_t stream);

/* ---- feature batches' bags --------------------------------------------------------------- */

/** embps_pool_bags_cpu on the device (every array device memory, weights NULL for none; no
 * tmp): the same f32 bits, each output column summed in position order with the same
 * operations. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype, NULL arrays, a table not aligned
 * to its elements, num_bags beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_pool_bags_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                    const int64_t *ids, const int64_t *rows, const float *weights,
                                    const int64_t *offsets, size_t num_bags, int mean, float *out,
                                    uint64_t col_begin, uint64_t seed, float scale,
                                    cudaStream_t stream);

/** embps_expand_bags_cpu on the device (every array device memory, weights NULL for none): the
 * same bits. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype, NULL arrays, out not aligned to
 * its elements, num_bags beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_expand_bags_cuda(const float *g, size_t width, const int64_t *ids,
                                      const float *weights, const int64_t *offsets, size_t num_bags,
                                      int mean, embps_dtype_t dtype, void *out,
                                      cudaStream_t stream);

/* ---- hash-keyed tables ------------------------------------------------------------------- */

/** embps_hash_gather_cpu on the device (table, keys, slots and out device memory; out aligned
 * for dtype): the same rows bit for bit. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype, NULL
 * arrays, out not aligned for dtype, n beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_hash_gather_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *keys, const int64_t *slots, size_t n,
                                      void *out, uint64_t col_begin, uint64_t seed, float scale,
                                      cudaStream_t stream);

/** embps_hash_reset_cpu on the device (every array device memory; slots distinct): the same
 * bits. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype, NULL arrays, a state0_width other than
 * 0, 1 or width, n beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_hash_reset_cuda(void *table, embps_dtype_t dtype, size_t width, float *state0,
                                     size_t state0_width, float *state1, float state0_value,
                                     const int64_t *slots, const int64_t *keys, size_t n,
                                     uint64_t col_begin, uint64_t seed, float scale,
                                     cudaStream_t stream);

/** out[i] = in[i] with its top bit flipped (n values; in == out allowed): a hash-keyed push's
 * keys in the order that sorts them as unsigned numbers with the padding key 0 first. Returns
 * EMBPS_OK, EMBPS_INVALID_ARGUMENT (NULL arrays, n beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_hash_order_cuda(const int64_t *in, size_t n, int64_t *out,
                                     cudaStream_t stream);

/* ---- rows written as given ---------------------------------------------------------------- */

/** embps_assign_rows_cpu on the device (every array device memory; rows distinct): the same
 * bits, each row copied as raw bytes. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (dtype, NULL
 * arrays, a state0_width other than 0, 1 or width, n beyond the grid), EMBPS_INTERNAL. */
embps_status_t embps_assign_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, const int64_t *src_rows, size_t n,
                                      const void *src, float *state0, size_t state0_width,
                                      float *state1, float state0_value, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
