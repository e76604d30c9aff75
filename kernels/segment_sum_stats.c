/* Segment sum fused with the row statistics: what embps_segment_sum_cpu followed by
 * embps_row_partials_cpu on its output computes, bit for bit, in one pass over the gradients.
 *
 * The two-step version writes the num_unique x width sums three times over (the zeroing, the
 * scattered adds, the partials' read): at 65536 x 128 f32 uniform over 1M rows those are 32 MiB
 * each, far beyond the caches. Here a count of each segment's positions (one pass over the
 * segment ids, num_unique uint32s that stay in cache) lets the single forward pass over the
 * positions know a segment's first position, which stores 0.0f + g (exactly what the zeroed
 * accumulator's first add gives, -0.0 included) instead of adding to a zeroed row, and its last,
 * after which the row is complete and still in L1, so its partials are taken right there with
 * embps_row_partials_cpu itself. The order of every sum is unchanged (ascending position within
 * a segment), so the results are the two-step version's bits.
 * Measured on this project's shared 2-core VM, both forms in one program run alternately on
 * the same batches (uniform tokens over 1M rows, width 128 f32, equal bits, medians of 21 and
 * 201): 65536 tokens 6.74 ms against 9.52 ms for segment sum then partials, 4096 tokens
 * 0.160 ms against 0.175 ms. Walking the segments in sorted order instead (a counting sort of
 * the positions, then sequential stores) was slower in a prototype: its gradient reads jump.
 *
 * The gradients are read with memcpy loads, so they may sit at any alignment: the CPU engine
 * reads them in place from the received request, where the bytes field starts wherever the
 * fields before it end. The loads still vectorize (unaligned vector loads; -fopt-info-vec).
 * The next rows' accumulators are prefetched for writing a few positions ahead, as the
 * scattered stores otherwise stall on each miss.
 *
 * The range form sums the segments [seg_lo, seg_hi) alone, so that the CPU engine's threads can
 * share a batch: each walks every position but sums only its own segments, and every segment
 * still has one thread and its order. Measured in the server with timers around the round's
 * steps (a 1M x 128 f32 rowwise Adagrad table, 65536 uniform tokens a push, one and two threads
 * alternating, 4 rounds on the 2-core VM): the update went from 4.4-5.7 ms to 2.6-3.4 ms, this
 * sum only from 5.7-6.3 ms to 5.0-6.2 ms (it reads the gradients just received on the loop's
 * core). */
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/embps_kernels.h"

#define SEEN 0x80000000u /* a segment's count, once its first position has been summed */
#define STREAM_COLS 256  /* a single bf16 row's columns widened on the stack at a time */

size_t embps_segment_sum_stats_workspace_bytes(size_t num_unique) {
  return num_unique * sizeof(uint32_t);
}

static void first_row_f32(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    float v;
    memcpy(&v, g + j * sizeof(float), sizeof(float));
    acc[j] = 0.0f + v;
  }
}

static void add_row_f32(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    float v;
    memcpy(&v, g + j * sizeof(float), sizeof(float));
    acc[j] += v;
  }
}

static void first_row_bf16(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    uint16_t h;
    memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
    acc[j] = 0.0f + embps_bf16_to_f32(h);
  }
}

static void add_row_bf16(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    uint16_t h;
    memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
    acc[j] += embps_bf16_to_f32(h);
  }
}

/* A segment of one position (most of a batch of uniform tokens) is complete as soon as it is
 * summed, and nothing in this pass reads its row again: its partials are taken (single_row,
 * below), and it goes to out with non-temporal stores, which need no read for ownership of the
 * row's lines. With ordinary stores each line is
 * first fetched for writing, and the lines out holds were last read by the engine thread that
 * updated the previous push, on the other core: measured in one program (4096 uniform tokens
 * over 1M rows, width 128 f32, a second thread reading out between passes, medians of 400
 * passes on this project's 2-core VM), the pass took 0.63 ms with the reader on the other core
 * against 0.15 ms on the same one, and its stall was the rows' first loads (perf annotate); with
 * the streamed rows it took 0.27-0.35 ms wherever the reader ran. The server's push showed the
 * same two states: 2.8M rows/s when the threads' lines crossed cores, 5.9M when they did not.
 * In the server, push 4096 x 128 f32 rowwise Adagrad went from 2.87M to 4.07M rows/s and 16384
 * from 4.35M to 4.98M, but 65536 fell from 4.17M to 3.93M (old and new servers alternating, 3-6
 * rounds, medians): 32 MiB of sums no longer sat in the L3 cache when the update read them. So
 * only a call whose segments' sums take at most STREAM_MAX_BYTES streams; the largest measured
 * size that gained (with it: 4096 2.81M -> 4.80M rows/s, 65536 3.62M both, 4 and 3 rounds). Same
 * additions in the same order (0.0f + g), so the same bits. Needs 16-byte aligned rows. */
#define STREAM_MAX_BYTES ((size_t)8 << 20)

static int streamable(const float *out, size_t width, size_t segments) {
#if defined(__SSE2__)
  return width % 4 == 0 && ((uintptr_t)out & 15) == 0 &&
         segments * width * sizeof(float) <= STREAM_MAX_BYTES;
#else
  (void)out;
  (void)width;
  (void)segments;
  return 0;
#endif
}

/* A segment of one position: its partials taken, and its row (0.0f + g) streamed to acc (only
 * when streamable()). An f32 row is read where it is, twice (the second read hits L1). It used to
 * be staged on the stack first, in 16-byte stores that the partials' 32-byte loads then read
 * back: such a load cannot be forwarded from two stores, and it waited for them to retire.
 * Measured with a throwaway program (65536 and 4096 uniform tokens over 1M rows, width 128 f32,
 * rows fed in 256 KiB pieces each copied in just before, medians of 21 and 41, this project's
 * 2-core VM, 5 and 3 alternations, medians), in a mode that left the rows in place rather than
 * streaming them (since removed with the loop thread's push prep): 65536 tokens 5.6 -> 4.0 ms,
 * 4096 0.197 -> 0.117 ms, equal bits. A bf16 row is widened on the stack, in pieces of
 * STREAM_COLS columns. */
static void single_row(float *restrict acc, const unsigned char *restrict g, int bf16, size_t width,
                       size_t block, float *restrict partials) {
  if (!bf16) {
    if (block)
      embps_row_partials_at_cpu(g, width, block, partials);
#if defined(__SSE2__)
    for (size_t j = 0; j < width; j += 4) {
      __m128 v;
      memcpy(&v, g + j * sizeof(float), sizeof(v));
      _mm_stream_ps(acc + j, _mm_add_ps(_mm_setzero_ps(), v));
    }
#endif
    return;
  }
  float tmp[STREAM_COLS] __attribute__((aligned(16)));
  for (size_t off = 0; off < width; off += STREAM_COLS) {
    const size_t len = width - off < STREAM_COLS ? width - off : STREAM_COLS;
    first_row_bf16(tmp, g + off * sizeof(uint16_t), len);
    /* STREAM_COLS and width are multiples of block (a divisor of 32): whole blocks only. */
    if (block)
      embps_row_partials_cpu(tmp, 1, len, block, partials + off / block);
#if defined(__SSE2__)
    for (size_t j = 0; j < len; j += 4)
      _mm_stream_ps(acc + off + j, _mm_load_ps(tmp + j));
#endif
  }
}

/* Prefetches segment s's sum for writing, unless it is a row of one position that is streamed
 * (nothing reads its line of out), with embps_prefetch_row_kept (locality 3): the row is added to
 * again by the segment's later positions and read by the update, unlike the rows
 * embps_prefetch_row fetches once (locality 0).
 * Always inlined: as a function of its own (up to 1038543), GCC 12 at -O1 and above found it free
 * of side effects (ipa-pure-const: a prefetch writes nothing) and deleted its calls, and the
 * object held no prefetch instruction at all. Measured with a throwaway program (this file's
 * three forms linked side by side, fed in 256 KiB pieces with single rows left in place, a mode
 * since removed with the loop thread's push prep; 1M-row token space, width 128 f32, caches
 * evicted before each pass, forms interleaved, medians of 31-41, this project's 2-core VM, two
 * runs each): Zipf(1.05) 65536 tokens 3.04 / 3.20 ms without the prefetch, 2.71 / 2.95 at
 * locality 0, 2.61 / 2.85 at locality 3; uniform 65536 4.39 / 3.91, 3.90 / 3.54, 4.03 / 3.48;
 * Zipf 4096 0.229, 0.209, 0.205 ms; equal bits. In the server (old and new alternating on fresh
 * servers, 1M x 128 f32 rowwise Adagrad, medians): a Zipf push of 65536 went from 3.91M / 3.98M
 * to 4.12M / 4.45M rows/s (4 rounds, two runs), Zipf 4096 from 3.53M to 3.71M (7 rounds); uniform
 * 65536 stayed at 2.42M / 2.40M (3 rounds), its rows being mostly single. */
static inline __attribute__((always_inline)) void
prefetch_sum(float *out, size_t width, const uint32_t *count, uint32_t s, int single) {
  if (!single || count[s] != 1)
    embps_prefetch_row_kept(out + (size_t)s * width, width * sizeof(float));
}

/* Counts each segment of [seg_lo, seg_hi)'s positions into count. */
static void count_positions(const uint32_t *segment_ids, size_t n, uint32_t *count, uint32_t lo,
                            uint32_t span) {
  memset(count + lo, 0, span * sizeof(uint32_t));
  /* segment_ids[i] - lo < span (unsigned) is the range test: one compare per position. */
  for (size_t i = 0; i < n; i++)
    if (segment_ids[i] - lo < span)
      count[segment_ids[i]]++;
}

void embps_segment_sum_stats_range_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                       const uint32_t *segment_ids, size_t n, size_t num_unique,
                                       size_t block, float *out, float *partials, void *workspace,
                                       size_t seg_lo, size_t seg_hi) {
  const int bf16 = dtype == EMBPS_DTYPE_BF16;
  const size_t in_row = width * embps_dtype_size(dtype);
  const size_t nb = block ? width / block : 0;
  const unsigned char *g = grads;
  uint32_t *count = workspace;
  const uint32_t lo = (uint32_t)seg_lo, span = (uint32_t)(seg_hi - seg_lo);
  size_t ahead = 0; /* positions before it are prefetched, or not this range's */
  const int stream = streamable(out, width, span); /* rows of one position bypass out's lines */

  (void)num_unique;
  if (span == 0)
    return;
  count_positions(segment_ids, n, count, lo, span);
  /* The accumulators are prefetched EMBPS_PREFETCH_ROWS of this range's positions ahead (another
   * range's rows are another thread's to touch): the first ones here, then one more with each
   * position summed. A streamed row is not prefetched. */
  for (size_t k = 0; ahead < n && k < EMBPS_PREFETCH_ROWS; ahead++)
    if (segment_ids[ahead] - lo < span) {
      prefetch_sum(out, width, count, segment_ids[ahead], stream);
      k++;
    }
  for (size_t i = 0; i < n; i++) {
    const uint32_t s = segment_ids[i];
    if (s - lo >= span)
      continue;
    float *acc = out + (size_t)s * width;
    uint32_t c = count[s];
    while (ahead < n && segment_ids[ahead] - lo >= span)
      ahead++;
    if (ahead < n)
      prefetch_sum(out, width, count, segment_ids[ahead++], stream);
    if (stream && c == 1) {
      single_row(acc, g + i * in_row, bf16, width, block, partials + (size_t)s * nb);
      count[s] = SEEN;
      continue;
    }
    if (bf16 && !(c & SEEN))
      first_row_bf16(acc, g + i * in_row, width);
    else if (bf16)
      add_row_bf16(acc, g + i * in_row, width);
    else if (!(c & SEEN))
      first_row_f32(acc, g + i * in_row, width);
    else
      add_row_f32(acc, g + i * in_row, width);
    c = (c | SEEN) - 1;
    count[s] = c;
    if (c == SEEN && nb) /* the segment's last position: its row is complete */
      embps_row_partials_cpu(acc, 1, width, block, partials + (size_t)s * nb);
  }
#if defined(__SSE2__)
  if (stream)
    _mm_sfence(); /* the streamed rows are in memory before whoever reads out is told */
#endif
}

void embps_segment_sum_stats_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                 const uint32_t *segment_ids, size_t n, size_t num_unique,
                                 size_t block, float *out, float *partials, void *workspace) {
  embps_segment_sum_stats_range_cpu(grads, dtype, width, segment_ids, n, num_unique, block, out,
                                    partials, workspace, 0, num_unique);
}
