/* hindex_bench: the hash-keyed table's index (server/store/hindex.h) on one core. For each
 * capacity, key distribution (uniform, or Zipf with exponent 1 over ranks: log-uniform) over a
 * key range 10x the capacity, and load (the share of slots held: 0.5 and 1.0, filled with the
 * most popular ranks first), it prints:
 *   find  keys/s of embps_hindex_find over batches of --batch keys of the distribution, and the
 *         share of them found;
 *   step  keys/s of embps_hindex_step (LRU, admit_after 1) over batches of --batch keys of the
 *         distribution: sort and deduplication, touches, and an insertion for every absent key,
 *         into a free slot at load 0.5 (the run stops before the table passes 0.6) or evicting
 *         at 1.0; and the share of keys that were new. With --sorted, each step gets its batch's
 *         distinct keys in ascending order, as the server's push passes them (its dedup sorts
 *         them), and keys/s counts those distinct keys (the sort and dedup are not timed).
 * Keys are 64-bit values scattered from the ranks by a bijective mix. Not a test: it asserts
 * nothing about speed; with --check it checks every found slot holds its key (the ctest smoke run).
 *
 *   hindex_bench [--capacity C[,C...]] [--batch B] [--queries Q] [--sorted] [--check] */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/store/hindex.h"

static uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= UINT64_C(0xbf58476d1ce4e5b9);
  x ^= x >> 27;
  x *= UINT64_C(0x94d049bb133111eb);
  x ^= x >> 31;
  return x;
}

static uint64_t rng_state = 1;

static uint64_t rng_next(void) { return mix(rng_state += UINT64_C(0x9e3779b97f4a7c15)); }

static uint64_t key_of(uint64_t rank) { return mix(rank + 12345) | 1; }

static uint64_t draw(int zipf, uint64_t range) {
  if (!zipf)
    return rng_next() % range;
  double u = (double)(rng_next() >> 11) / 9007199254740992.0;
  uint64_t r = (uint64_t)exp(u * log((double)range + 1.0)) - 1;
  return r < range ? r : range - 1;
}

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Sorts keys[0..n) ascending and drops repeats; returns how many are left. */
static size_t sort_distinct(uint64_t *keys, size_t n) {
  size_t m = 0;
  qsort(keys, n, sizeof(*keys), cmp_u64);
  for (size_t i = 0; i < n; i++)
    if (m == 0 || keys[i] != keys[m - 1])
      keys[m++] = keys[i];
  return m;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int run(uint64_t capacity, int zipf, double load, size_t batch, size_t queries, int sorted,
               int check) {
  embps_hindex_config_t c = {
      .capacity = capacity, .policy = EMBPS_HINDEX_LRU, .admit_after = 1, .seed = 7};
  embps_hindex_t *ix = NULL;
  embps_hindex_stats_t st;
  embps_error_t err;
  uint64_t range = 10 * capacity, fill = (uint64_t)(load * (double)capacity);
  uint64_t *keys = malloc(batch * sizeof(*keys)), found = 0, fresh_keys = 0, stepped = 0;
  int64_t *slots = malloc(batch * sizeof(*slots));
  embps_hindex_fresh_t *fresh = malloc(batch * sizeof(*fresh));
  size_t nfresh;
  double t, t_find = 0, t_step = 0;

  if (!keys || !slots || !fresh || embps_hindex_new(&ix, &c, &err) != EMBPS_OK) {
    fprintf(stderr, "hindex_bench: cannot make an index of %" PRIu64 " slots\n", capacity);
    return 1;
  }
  for (uint64_t r = 0; r < fill;) { /* the most popular ranks first */
    size_t n = 0;
    for (; n < batch && r < fill; n++, r++)
      keys[n] = key_of(r);
    if (sorted)
      n = sort_distinct(keys, n);
    embps_hindex_step(ix, keys, n, slots, fresh, &nfresh);
  }
  for (size_t done = 0; done < queries; done += batch) {
    for (size_t i = 0; i < batch; i++)
      keys[i] = key_of(draw(zipf, range));
    t = now();
    embps_hindex_find(ix, keys, batch, slots);
    t_find += now() - t;
    for (size_t i = 0; i < batch; i++) {
      found += slots[i] >= 0;
      if (check && slots[i] >= 0) {
        int64_t again;
        embps_hindex_find(ix, &keys[i], 1, &again);
        if (again != slots[i] || (uint64_t)slots[i] >= capacity) {
          fprintf(stderr, "hindex_bench: find is not stable\n");
          return 1;
        }
      }
    }
  }
  for (size_t done = 0; done < queries; done += batch) {
    embps_hindex_stats(ix, &st);
    if (load < 1.0 && st.size + batch > (uint64_t)(0.6 * (double)capacity) && done)
      break;
    size_t n = batch;
    for (size_t i = 0; i < batch; i++)
      keys[i] = key_of(draw(zipf, range));
    if (sorted)
      n = sort_distinct(keys, batch);
    t = now();
    if (embps_hindex_step(ix, keys, n, slots, fresh, &nfresh) != EMBPS_OK) {
      fprintf(stderr, "hindex_bench: a step failed\n");
      return 1;
    }
    t_step += now() - t;
    stepped += n;
    fresh_keys += nfresh;
    if (check)
      for (size_t i = 0; i < n; i++)
        if (slots[i] < 0) {
          fprintf(stderr, "hindex_bench: a key was not given a slot\n");
          return 1;
        }
  }
  printf("%10" PRIu64 "  %-7s  %4.2f  find %7.1f Mkeys/s (%4.1f%% found)  step %6.2f Mkeys/s "
         "(%4.1f%% new)  index %.1f MiB\n",
         capacity, zipf ? "zipf" : "uniform", load, (double)queries / t_find / 1e6,
         100.0 * (double)found / (double)queries, (double)stepped / t_step / 1e6,
         100.0 * (double)fresh_keys / (double)stepped,
         (double)embps_hindex_bytes(&c) / (1024.0 * 1024.0));
  fflush(stdout);
  embps_hindex_free(ix);
  free(keys);
  free(slots);
  free(fresh);
  return 0;
}

int main(int argc, char **argv) {
  const char *caps = "1048576,16777216";
  size_t batch = 65536, queries = 1u << 24;
  int check = 0, sorted = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--capacity") && i + 1 < argc)
      caps = argv[++i];
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
      batch = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--queries") && i + 1 < argc)
      queries = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--check"))
      check = 1;
    else if (!strcmp(argv[i], "--sorted"))
      sorted = 1;
    else {
      fprintf(stderr, "usage: hindex_bench [--capacity C[,C...]] [--batch B] [--queries Q] "
                      "[--sorted] [--check]\n");
      return 2;
    }
  }
  if (!batch || queries < batch) {
    fprintf(stderr, "hindex_bench: --batch must be at least 1 and at most --queries\n");
    return 2;
  }
  queries = queries / batch * batch;
  printf("  capacity  keys     load  (one core, batches of %zu keys, %zu keys per figure%s)\n",
         batch, queries, sorted ? "; steps on each batch's distinct keys, ascending" : "");
  for (const char *p = caps; *p;) {
    char *end;
    uint64_t cap = strtoull(p, &end, 10);
    if (end == p || !cap) {
      fprintf(stderr, "hindex_bench: --capacity takes numbers separated by commas\n");
      return 2;
    }
    for (int zipf = 0; zipf < 2; zipf++)
      for (int l = 0; l < 2; l++)
        if (run(cap, zipf, l ? 1.0 : 0.5, batch, queries, sorted, check))
          return 1;
    p = *end == ',' ? end + 1 : end;
  }
  return 0;
}
