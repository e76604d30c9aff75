/* Token dedup: sorts the batch and run-length encodes it.
 *
 * The sort is an LSD radix sort of (token, position) pairs, because batches are large (4k to
 * 1M tokens), heavy-tailed, and their ids use far fewer than 64 bits: keys are taken relative
 * to the batch minimum, so only the bytes that actually differ between tokens cost a pass, and
 * a pass whose byte is the same for every key is skipped outright. When the key bits plus the
 * position bits fit in 64, a pair is packed into one uint64 (key above, position below) so each
 * pass moves 8 bytes per token instead of 12 and scatters into one array instead of two. When
 * they do not (a hash-keyed table's hashed 64-bit ids), the pair holds the key's top bits, and
 * each run of equal top bits is then put in order by its full keys (dedup_wide).
 * LSD radix is stable and the pairs start in position order, so the result (and every pass)
 * depends on the tokens alone: deterministic, no hashing, no allocation (the caller supplies
 * the workspace). A final linear scan over the sorted pairs writes the unique tokens and
 * scatters each position's segment id; the sorted form also keeps the positions in their sorted
 * order (by token, ascending within one: the sort is stable) and where each token's begin, which
 * a feature push's sum walks (segment_sum_bags.c). */
#include <string.h>

#include "kernels/embps_kernels.h"

#define RADIX_BITS 8
#define RADIX_SIZE (1u << RADIX_BITS)
#define MAX_PASSES (64 / RADIX_BITS)

/* Workspace layout: two uint64 arrays (ping-pong). Its size still counts two uint32 position
 * arrays after them, which the path that sorted keys and positions in separate arrays used
 * (until dedup_wide replaced it): the engine's memory figures are built on it. */
size_t embps_dedup_workspace_bytes(size_t n) {
  return n * (2 * sizeof(uint64_t) + 2 * sizeof(uint32_t));
}

/* Number of significant bits of x (0 for 0). */
static unsigned bit_width(uint64_t x) {
  unsigned b = 0;
  while (x) {
    b++;
    x >>= 1;
  }
  return b;
}

/* Signed tokens map to order-preserving unsigned values by flipping the sign bit; ids are
 * validated non-negative upstream, but the kernel should not silently misorder if not. */
static inline uint64_t key_of(int64_t t) { return (uint64_t)t ^ (UINT64_C(1) << 63); }

static inline int64_t token_of(uint64_t k) { return (int64_t)(k ^ (UINT64_C(1) << 63)); }

/* Histograms of every digit that can vary, in one read pass over the keys. A digit d is
 * (v >> (shift + d*8)) & 0xff. */
static void histogram(const uint64_t *restrict v, size_t n, unsigned shift, unsigned passes,
                      size_t hist[MAX_PASSES][RADIX_SIZE]) {
  memset(hist, 0, sizeof(size_t) * MAX_PASSES * RADIX_SIZE);
  for (size_t i = 0; i < n; i++) {
    uint64_t x = v[i] >> shift;
    for (unsigned d = 0; d < passes; d++)
      hist[d][(x >> (d * RADIX_BITS)) & (RADIX_SIZE - 1)]++;
  }
}

/* Turns a histogram into exclusive offsets; returns 0 when one bucket holds every key (the
 * pass would be the identity permutation and is skipped). */
static int offsets(size_t *restrict h, size_t n) {
  size_t sum = 0;
  for (unsigned b = 0; b < RADIX_SIZE; b++) {
    if (h[b] == n)
      return 0;
    size_t c = h[b];
    h[b] = sum;
    sum += c;
  }
  return 1;
}

/* LSD radix passes over the digits of bits [shift, shift + 8 * passes) of v[0..n), ping-ponging
 * with w; returns the array that holds the result (v or w). */
static uint64_t *radix_passes(uint64_t *v, uint64_t *w, size_t n, unsigned shift, unsigned passes) {
  size_t hist[MAX_PASSES][RADIX_SIZE];
  histogram(v, n, shift, passes, hist);
  for (unsigned d = 0; d < passes; d++) {
    if (!offsets(hist[d], n))
      continue;
    const unsigned sh = shift + d * RADIX_BITS;
    size_t *restrict h = hist[d];
    for (size_t i = 0; i < n; i++) {
      const uint64_t x = v[i];
      w[h[(x >> sh) & (RADIX_SIZE - 1)]++] = x;
    }
    uint64_t *t = v;
    v = w;
    w = t;
  }
  return v;
}

/* Keys too wide to pack whole with their positions (key_bits + pos_bits > 64, such as a
 * hash-keyed table's hashed ids): a pair is packed as the key's top 64 - pos_bits significant
 * bits above its position and sorted on those (6 passes of 8 bytes for 65536 random 64-bit keys,
 * against 8 passes of 12 bytes for keys and positions in two arrays: 1.2 against 1.9-2.1 ms,
 * and 70-89 against 95-114 us for 4096, uniform or Zipf, on this project's 2-core Xeon VM, best
 * of 200, the two builds alternated twice), then each run of pairs
 * whose top bits are equal (duplicates of one key, or, rarely for spread keys, keys that differ
 * only below) is put in (key, position) order by its full keys, read back from tokens. The
 * result is the one order of (key, position) pairs, as on the other paths. */
static size_t dedup_wide(const int64_t *tokens, size_t n, uint64_t kmin, unsigned key_bits,
                         unsigned pos_bits, int64_t *unique, uint32_t *segment_ids, uint32_t *order,
                         uint32_t *starts, uint64_t *ws) {
  const unsigned low = key_bits + pos_bits - 64; /* key bits left out of a pair: <= pos_bits */
  const uint64_t pos_mask = (UINT64_C(1) << pos_bits) - 1;
  const uint64_t low_mask = (UINT64_C(1) << low) - 1;
  uint64_t *a, *b;
  size_t u = 0;
  for (size_t i = 0; i < n; i++)
    ws[i] = ((key_of(tokens[i]) - kmin) >> low << pos_bits) | (uint64_t)i;
  a = radix_passes(ws, ws + n, n, pos_bits, (64 - pos_bits + RADIX_BITS - 1) / RADIX_BITS);
  b = a == ws ? ws + n : ws;
  for (size_t i = 0; i < n;) {
    const uint64_t top = a[i] >> pos_bits;
    size_t j = i + 1;
    while (j < n && a[j] >> pos_bits == top)
      j++;
    if (j - i > 1) {
      /* The run's keys differ at most in their low bits: packed as (low bits, position), which
       * fit in 64 bits, and sorted on the low bits when they are not in order already (ties
       * stay in position order). */
      int sorted = 1;
      for (size_t k = i; k < j; k++) {
        const uint64_t l = (key_of(tokens[a[k] & pos_mask]) - kmin) & low_mask;
        b[k] = (l << pos_bits) | (a[k] & pos_mask);
        sorted &= k == i || b[k] >> pos_bits >= b[k - 1] >> pos_bits;
      }
      if (!sorted) {
        const uint64_t *r =
            radix_passes(b + i, a + i, j - i, pos_bits, (low + RADIX_BITS - 1) / RADIX_BITS);
        for (size_t k = i; k < j; k++)
          a[k] = (top << pos_bits) | (r[k - i] & pos_mask);
      }
    }
    for (size_t k = i; k < j; k++) {
      const uint64_t pos = a[k] & pos_mask;
      if (k > 0 && tokens[pos] != unique[u]) {
        u++;
        if (starts)
          starts[u] = (uint32_t)k;
      }
      unique[u] = tokens[pos];
      segment_ids[pos] = (uint32_t)u;
      if (order)
        order[k] = (uint32_t)pos;
    }
    i = j;
  }
  if (starts) {
    starts[0] = 0;
    starts[u + 1] = (uint32_t)n;
  }
  return u + 1;
}

/* Keys over a range of at most twice the tokens (a dense table's rows, a big push): a counting
 * sort, one count and one scatter over the tokens instead of a histogram and two or more radix
 * passes of 8 bytes a token. Its order is the radix sort's, (key, position) ascending: a bucket
 * takes its positions in position order. The workspace holds a uint32 per key of the range for
 * the buckets' next places and another for their segments (8 bytes a key, 16 a token at most,
 * within embps_dedup_workspace_bytes). Against the radix path, with the same output (a
 * throwaway program, this project's shared 2-core VM, medians of 31, uniform tokens): 204800
 * tokens over 20000 rows 1.40 against 2.14 ms, 55296 over 20000 0.33 against 0.55 ms, 1M over
 * 1M 16.6 against 19.9 ms, 20480 over 20000 0.17 against 0.18 ms; 4096 over 20000 keeps the
 * radix path. */
static size_t dedup_counting(const int64_t *tokens, size_t n, uint64_t kmin, size_t range,
                             int64_t *unique, uint32_t *segment_ids, uint32_t *order,
                             uint32_t *starts, void *workspace) {
  uint32_t *next = workspace, *seg = next + range;
  size_t u;
  embps_dedup_count_cpu(tokens, 0, n, kmin, range, next);
  u = embps_dedup_buckets_cpu(next, 1, range, kmin, unique, starts, seg);
  embps_dedup_place_cpu(tokens, 0, n, kmin, next, seg, segment_ids, order);
  return u;
}

int embps_dedup_counting_cpu(const int64_t *tokens, size_t n, size_t parts, uint64_t *kmin,
                             size_t *range) {
  uint64_t lo, hi;
  if (n == 0 || parts == 0)
    return 0;
  lo = hi = key_of(tokens[0]);
  for (size_t i = 1; i < n; i++) {
    const uint64_t k = key_of(tokens[i]);
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  if (hi - lo >= 2 * (uint64_t)n ||
      (parts + 1) * ((hi - lo) + 1) * sizeof(uint32_t) > embps_dedup_workspace_bytes(n))
    return 0;
  *kmin = lo;
  *range = (size_t)(hi - lo) + 1;
  return 1;
}

void embps_dedup_count_cpu(const int64_t *tokens, size_t lo, size_t hi, uint64_t kmin, size_t range,
                           uint32_t *counts) {
  memset(counts, 0, range * sizeof(uint32_t));
  for (size_t i = lo; i < hi; i++)
    counts[key_of(tokens[i]) - kmin]++;
}

size_t embps_dedup_buckets_cpu(uint32_t *counts, size_t parts, size_t range, uint64_t kmin,
                               int64_t *unique, uint32_t *starts, uint32_t *seg) {
  uint32_t sum = 0;
  size_t u = 0;
  for (size_t b = 0; b < range; b++) {
    uint32_t c = 0;
    for (size_t p = 0; p < parts; p++)
      c += counts[p * range + b];
    if (c == 0)
      continue;
    unique[u] = token_of(b + kmin);
    if (starts)
      starts[u] = sum;
    seg[b] = (uint32_t)u++;
    for (size_t p = 0; p < parts; p++) { /* part p's positions after those of parts before it */
      const uint32_t cp = counts[p * range + b];
      counts[p * range + b] = sum;
      sum += cp;
    }
  }
  if (starts)
    starts[u] = sum;
  return u;
}

void embps_dedup_place_cpu(const int64_t *tokens, size_t lo, size_t hi, uint64_t kmin,
                           uint32_t *next, const uint32_t *seg, uint32_t *segment_ids,
                           uint32_t *order) {
  for (size_t i = lo; i < hi; i++) {
    const size_t b = (size_t)(key_of(tokens[i]) - kmin);
    segment_ids[i] = seg[b];
    if (order)
      order[next[b]++] = (uint32_t)i;
  }
}

size_t embps_dedup_cpu(const int64_t *tokens, size_t n, int64_t *unique, uint32_t *segment_ids,
                       void *workspace) {
  return embps_dedup_sorted_cpu(tokens, n, unique, segment_ids, NULL, NULL, workspace);
}

size_t embps_dedup_sorted_cpu(const int64_t *tokens, size_t n, int64_t *unique,
                              uint32_t *segment_ids, uint32_t *order, uint32_t *starts,
                              void *workspace) {
  if (n == 0) {
    if (starts)
      starts[0] = 0;
    return 0;
  }

  uint64_t kmin = key_of(tokens[0]), kmax = kmin;
  for (size_t i = 1; i < n; i++) {
    uint64_t k = key_of(tokens[i]);
    kmin = k < kmin ? k : kmin;
    kmax = k > kmax ? k : kmax;
  }
  if (kmin == kmax) {
    /* All tokens equal (includes n == 1): no sort needed. */
    unique[0] = tokens[0];
    memset(segment_ids, 0, n * sizeof(uint32_t));
    for (size_t i = 0; order && i < n; i++)
      order[i] = (uint32_t)i;
    if (starts) {
      starts[0] = 0;
      starts[1] = (uint32_t)n;
    }
    return 1;
  }

  if (kmax - kmin < 2 * (uint64_t)n)
    return dedup_counting(tokens, n, kmin, (size_t)(kmax - kmin) + 1, unique, segment_ids, order,
                          starts, workspace);

  unsigned key_bits = bit_width(kmax - kmin);
  unsigned pos_bits = bit_width((uint64_t)(n - 1));
  uint64_t *a = workspace;

  if (key_bits + pos_bits <= 64) {
    /* Packed path: (key - kmin) << pos_bits | position, sorted on the key bits only. */
    for (size_t i = 0; i < n; i++)
      a[i] = ((key_of(tokens[i]) - kmin) << pos_bits) | (uint64_t)i;
    a = radix_passes(a, a + n, n, pos_bits, (key_bits + RADIX_BITS - 1) / RADIX_BITS);
    uint64_t pos_mask = (UINT64_C(1) << pos_bits) - 1;
    size_t u = 0;
    uint64_t prev = a[0] >> pos_bits;
    unique[0] = token_of(prev + kmin);
    if (order) {
      starts[0] = 0;
      for (size_t i = 0; i < n; i++) {
        uint64_t k = a[i] >> pos_bits;
        if (k != prev) {
          prev = k;
          unique[++u] = token_of(k + kmin);
          starts[u] = (uint32_t)i;
        }
        segment_ids[a[i] & pos_mask] = (uint32_t)u;
        order[i] = (uint32_t)(a[i] & pos_mask);
      }
      starts[u + 1] = (uint32_t)n;
      return u + 1;
    }
    for (size_t i = 0; i < n; i++) {
      uint64_t k = a[i] >> pos_bits;
      if (k != prev) {
        prev = k;
        unique[++u] = token_of(k + kmin);
      }
      segment_ids[a[i] & pos_mask] = (uint32_t)u;
    }
    return u + 1;
  }

  return dedup_wide(tokens, n, kmin, key_bits, pos_bits, unique, segment_ids, order, starts, a);
}
