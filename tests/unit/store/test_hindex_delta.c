/* The index's deltas (server/store/hindex_delta.c): over long random sequences of steps (Zipf-like
 * keys over a range 10x the capacity, repeats, padding, steps bigger than the table: evictions,
 * expiries, admissions, refusals, LFU renormalisations), an index fed only the deltas of a writer's
 * captures (decoded from a full encoding, then every delta applied in order, the chain restarted
 * at random full captures) encodes at every capture to exactly the writer's full bytes, keeps its
 * map, victim order and free stack sound, and then steps exactly as the writer; a delta is small
 * when little changed; deltas applied on the wrong index, twice, out of order, corrupt,
 * truncated, of another version or configuration, or mutated behind a valid crc32 are refused
 * (or, for a mutation, give a sound index); an allocation failure changes nothing. The test
 * includes hindex.c to check the index's invariants. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.c"

#define MAXN 300

/* ---- helpers --------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) { return embps__hix_mix(*s += GOLDEN); }

/* A Zipf-like (exponent 1) rank in [0, range): log-uniform. */
static uint64_t zipf_rank(uint64_t *s, uint64_t range) {
  double u = (double)(rng_next(s) >> 11) / 9007199254740992.0;
  uint64_t r = (uint64_t)exp(u * log((double)range + 1.0)) - 1;
  return r < range ? r : range - 1;
}

static uint64_t key_of(uint64_t rank) {
  uint64_t k = embps__hix_mix(rank * 0x1234567ULL + 77);
  return k ? k : 1;
}

/* n random keys: Zipf-like over range, padding and repeats among them. */
static size_t random_keys(uint64_t *rng, uint64_t range, uint64_t *keys) {
  size_t n = rng_next(rng) % 8 == 0 ? (size_t)(rng_next(rng) % MAXN) : (size_t)(rng_next(rng) % 24);
  for (size_t i = 0; i < n; i++) {
    uint64_t d = rng_next(rng);
    if (d % 20 == 0)
      keys[i] = 0;
    else if (i > 0 && d % 7 == 0)
      keys[i] = keys[rng_next(rng) % i];
    else
      keys[i] = key_of(zipf_rank(rng, range));
  }
  return n;
}

static uint8_t *full(const embps_hindex_t *ix, size_t *len) {
  uint8_t *p;
  *len = embps_hindex_encoded_bytes(ix);
  assert_non_null(p = malloc(*len));
  embps_hindex_encode(ix, p);
  return p;
}

static uint8_t *delta(const embps_hindex_t *ix, size_t *len) {
  uint8_t *p;
  *len = embps_hindex_delta_bytes(ix);
  assert_non_null(p = malloc(*len));
  embps_hindex_delta_encode(ix, p);
  return p;
}

static embps_hindex_t *decoded(const embps_hindex_config_t *c, const uint8_t *p, size_t len) {
  embps_hindex_t *ix = NULL;
  embps_error_t err;
  assert_int_equal(embps_hindex_decode(&ix, c, p, len, "base", &err), EMBPS_OK);
  return ix;
}

static void assert_same_full(const embps_hindex_t *a, const embps_hindex_t *b) {
  size_t la, lb;
  uint8_t *pa = full(a, &la), *pb = full(b, &lb);
  assert_int_equal(la, lb);
  assert_memory_equal(pa, pb, la);
  free(pa);
  free(pb);
}

/* The index's own invariants: map <-> keys, the victim order (heap or queue, sorted), the free
 * stack (every free slot once), and a clean change tracking after a capture. */
static void check_invariants(const embps_hindex_t *ix, int captured) {
  uint64_t stored = 0, used = 0, n = 0;
  int lfu = ix->cfg.policy == EMBPS_HINDEX_LFU;
  uint8_t *seen = calloc(ix->cfg.capacity, 1);
  assert_non_null(seen);
  for (uint64_t s = 0; s < ix->cfg.capacity; s++)
    if (ix->key[s]) {
      stored++;
      assert_int_equal(embps__hindex_map_find(ix, ix->key[s]), s);
      if (lfu)
        assert_int_equal(ix->heap[ix->pos[s]], s);
    }
  for (uint64_t b = 0; b <= ix->mask; b++)
    used += ix->buckets[b] != 0;
  assert_int_equal(used, stored);
  assert_int_equal(stored, ix->st.size);
  assert_int_equal(ix->nheap, stored);
  assert_int_equal(ix->nfree + stored, ix->cfg.capacity);
  if (lfu) {
    for (uint64_t i = 1; i < ix->nheap; i++)
      assert_false(less(ix, ix->heap[i], ix->heap[(i - 1) / 2]));
  } else {
    uint32_t prev = EMBPS__HIX_NONE;
    for (uint32_t s = ix->head; s != EMBPS__HIX_NONE; prev = s, s = ix->link[2 * (uint64_t)s + 1]) {
      assert_true(n++ < ix->cfg.capacity && ix->key[s]);
      assert_int_equal(ix->link[2 * (uint64_t)s], prev);
      if (prev != EMBPS__HIX_NONE)
        assert_true(less(ix, prev, s));
    }
    assert_int_equal(ix->tail, prev);
    assert_int_equal(n, ix->nheap);
  }
  for (uint64_t i = 0; i < ix->nfree; i++) {
    assert_int_equal(ix->key[ix->free[i]], 0);
    assert_int_equal(seen[ix->free[i]]++, 0);
  }
  if (captured) {
    for (uint64_t w = 0; w < (ix->cfg.capacity + 63) / 64; w++)
      assert_int_equal(ix->chg[w], 0);
    assert_int_equal(ix->low_free, ix->nfree);
  }
  free(seen);
}

static embps_hindex_config_t config(uint64_t capacity, embps_hindex_policy_t policy, uint32_t k) {
  embps_hindex_config_t c;
  memset(&c, 0, sizeof(c));
  c.capacity = capacity;
  c.policy = policy;
  c.admit_after = k;
  c.sketch_width = k > 1 ? 40 : 0; /* 160 bytes: two whole sketch blocks and a short one */
  c.half_life = policy == EMBPS_HINDEX_LFU ? 2 : 0;
  c.ttl_steps = policy == EMBPS_HINDEX_TTL ? 6 : 0;
  c.seed = 0xde17a000 + (uint64_t)policy * 10 + k;
  return c;
}

/* ---- the long random sequences --------------------------------------------------------------- */

/* A writer steps at random and captures at random points (one in five a full capture, which
 * restarts the reader's chain, else a delta; sometimes twice with no step between); the reader
 * gets only what a restore reads. */
static void run_chain(embps_hindex_policy_t policy, uint32_t k, uint64_t capacity) {
  embps_hindex_config_t c = config(capacity, policy, k);
  embps_hindex_t *w = NULL, *r;
  uint64_t rng = c.seed, range = 10 * capacity, steps = 4000, deltas = 0, empty = 0, fulls = 0;
  uint64_t keys[MAXN], renorms = 0, base0 = 0;
  int64_t slots[MAXN], rslots[MAXN];
  embps_hindex_fresh_t fresh[MAXN], rfresh[MAXN];
  size_t nfresh, rnfresh, len;
  uint8_t *p;

  assert_int_equal(embps_hindex_new(&w, &c, NULL), EMBPS_OK);
  p = full(w, &len);
  r = decoded(&c, p, len); /* the first capture: the empty index, whole */
  free(p);
  for (uint64_t step = 0; step < steps; step++) {
    size_t n = random_keys(&rng, range, keys);
    assert_int_equal(embps_hindex_step(w, keys, n, slots, fresh, &nfresh), EMBPS_OK);
    if (w->base != base0)
      renorms++, base0 = w->base;
    if (rng_next(&rng) % 13 != 0)
      continue;
    for (int twice = 0; twice < (rng_next(&rng) % 6 == 0 ? 2 : 1); twice++) {
      embps_error_t err;
      size_t dlen, flen;
      uint8_t *d = delta(w, &dlen), *f = full(w, &flen);
      if (rng_next(&rng) % 5 == 0) { /* a full capture: the chain starts again */
        embps_hindex_free(r);
        r = decoded(&c, f, flen);
        fulls++;
      } else {
        if (embps_hindex_delta_apply(r, d, dlen, "d", &err) != EMBPS_OK)
          fail_msg("%s", err.message);
        deltas++;
        empty += twice;
      }
      embps_hindex_mark_captured(w);
      assert_same_full(r, w);
      if (deltas % 8 == 0)
        check_invariants(r, 1);
      free(d);
      free(f);
    }
  }
  /* One last delta, then the reader steps exactly as the writer. */
  {
    embps_error_t err;
    uint8_t *d = delta(w, &len);
    assert_int_equal(embps_hindex_delta_apply(r, d, len, "d", &err), EMBPS_OK);
    free(d);
  }
  check_invariants(r, 1);
  for (uint64_t step = 0; step < 500; step++) {
    size_t n = random_keys(&rng, range, keys);
    assert_int_equal(embps_hindex_step(w, keys, n, slots, fresh, &nfresh), EMBPS_OK);
    assert_int_equal(embps_hindex_step(r, keys, n, rslots, rfresh, &rnfresh), EMBPS_OK);
    assert_memory_equal(slots, rslots, n * sizeof(*slots));
    assert_int_equal(nfresh, rnfresh);
    for (size_t i = 0; i < nfresh; i++) /* field by field: the struct has padding */
      assert_true(fresh[i].key == rfresh[i].key && fresh[i].evicted == rfresh[i].evicted &&
                  fresh[i].slot == rfresh[i].slot);
  }
  assert_same_full(r, w);
  /* The sequence reached what it is meant to test. */
  print_message("policy %d k %u capacity %llu: %llu deltas (%llu empty), %llu full; evicted %llu "
                "expired %llu refused %llu not admitted %llu\n",
                (int)policy, k, (unsigned long long)capacity, (unsigned long long)deltas,
                (unsigned long long)empty, (unsigned long long)fulls,
                (unsigned long long)w->st.evicted, (unsigned long long)w->st.expired,
                (unsigned long long)w->st.refused, (unsigned long long)w->st.not_admitted);
  assert_true(deltas > 100 && fulls > 20 && empty > 5);
  if (capacity < 100) /* the larger table empties by expiry faster than it fills */
    assert_true(w->st.evicted > 0 && w->st.refused > 0);
  if (k > 1)
    assert_true(w->st.not_admitted > 0);
  if (policy == EMBPS_HINDEX_TTL && capacity > 2) /* two slots are evicted before they expire */
    assert_true(w->st.expired > 0);
  if (policy == EMBPS_HINDEX_LFU)
    assert_true(renorms > 0);
  embps_hindex_free(w);
  embps_hindex_free(r);
}

static void test_chain_lru_k1(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_LRU, 1, 61);
}
static void test_chain_lru_k3(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_LRU, 3, 61);
}
static void test_chain_lfu_k1(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_LFU, 1, 61);
}
static void test_chain_lfu_k3(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_LFU, 3, 61);
}
static void test_chain_ttl_k1(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_TTL, 1, 61);
}
static void test_chain_ttl_k3(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_TTL, 3, 61);
}
static void test_chain_sizes(void **state) {
  (void)state;
  run_chain(EMBPS_HINDEX_LRU, 1, 1);
  run_chain(EMBPS_HINDEX_TTL, 2, 2);
  run_chain(EMBPS_HINDEX_LFU, 1, 64);
  run_chain(EMBPS_HINDEX_LRU, 2, 65);
  run_chain(EMBPS_HINDEX_TTL, 1, 700);
}

/* ---- targeted cases -------------------------------------------------------------------------- */

/* A full table of 4096 keys, then a few steps: the delta holds the slots they changed. */
static void test_small_change_small_delta(void **state) {
  embps_hindex_config_t c = config(4096, EMBPS_HINDEX_LRU, 2);
  embps_hindex_t *w = NULL, *r;
  uint64_t keys[64];
  int64_t slots[64];
  embps_hindex_fresh_t fresh[64];
  size_t nfresh, flen, dlen;
  uint8_t *f, *d;
  embps_error_t err;
  (void)state;
  c.sketch_width = 4096;
  assert_int_equal(embps_hindex_new(&w, &c, NULL), EMBPS_OK);
  for (uint64_t b = 0; b < 3 * 4096 / 64; b++) /* 64 keys twice each: admitted; then evicting */
    for (int twice = 0; twice < 2; twice++) {
      for (uint64_t j = 0; j < 64; j++)
        keys[j] = 1 + b * 64 + j;
      assert_int_equal(embps_hindex_step(w, keys, 64, slots, fresh, &nfresh), EMBPS_OK);
    }
  f = full(w, &flen);
  embps_hindex_mark_captured(w);
  r = decoded(&c, f, flen);
  for (uint64_t b = 0; b < 2; b++) /* 2 x 16 new keys twice each: 32 evictions */
    for (int twice = 0; twice < 2; twice++) {
      for (uint64_t j = 0; j < 16; j++)
        keys[j] = UINT64_C(1) << 40 | (b * 16 + j);
      assert_int_equal(embps_hindex_step(w, keys, 16, slots, fresh, &nfresh), EMBPS_OK);
    }
  d = delta(w, &dlen);
  assert_true(w->st.evicted > 0);
  /* 224 header bytes, 20 per changed slot (32), 68 per changed sketch block (at most 256), where
   * the whole index is 20 bytes per key (4096) and the sketch (16 KiB) */
  assert_true(dlen < flen / 5);
  print_message("full %zu bytes, delta %zu bytes\n", flen, dlen);
  assert_int_equal(embps_hindex_delta_apply(r, d, dlen, "d", &err), EMBPS_OK);
  assert_same_full(r, w);
  check_invariants(r, 1);
  free(f);
  free(d);
  embps_hindex_free(w);
  embps_hindex_free(r);
}

/* A writer at a capture (base), a few steps, a second capture (d1), more steps (d2). */
typedef struct fixture {
  embps_hindex_config_t c;
  uint8_t *base, *d1, *d2;
  size_t lbase, l1, l2;
  embps_hindex_t *w; /* at d2 */
} fixture_t;

static void fixture(fixture_t *fx, embps_hindex_policy_t policy, uint32_t k) {
  uint64_t rng = 99, keys[MAXN];
  int64_t slots[MAXN];
  embps_hindex_fresh_t fresh[MAXN];
  size_t nfresh;
  memset(fx, 0, sizeof(*fx));
  fx->c = config(20, policy, k);
  assert_int_equal(embps_hindex_new(&fx->w, &fx->c, NULL), EMBPS_OK);
  for (int s = 0; s < 60; s++) {
    size_t n = random_keys(&rng, 200, keys);
    assert_int_equal(embps_hindex_step(fx->w, keys, n, slots, fresh, &nfresh), EMBPS_OK);
    if (s == 20) {
      fx->base = full(fx->w, &fx->lbase);
      embps_hindex_mark_captured(fx->w);
    } else if (s == 40) {
      fx->d1 = delta(fx->w, &fx->l1);
      embps_hindex_mark_captured(fx->w);
    }
  }
  fx->d2 = delta(fx->w, &fx->l2);
}

static void fixture_free(fixture_t *fx) {
  free(fx->base);
  free(fx->d1);
  free(fx->d2);
  embps_hindex_free(fx->w);
}

static void test_refusals(void **state) {
  fixture_t fx;
  embps_hindex_t *r;
  embps_hindex_config_t other;
  embps_error_t err;
  uint8_t *q;
  uint64_t key = 12345;
  int64_t slot;
  embps_hindex_fresh_t fresh[1];
  size_t nfresh;
  (void)state;
  fixture(&fx, EMBPS_HINDEX_TTL, 2);
  assert_non_null(q = malloc(fx.l1));
  r = decoded(&fx.c, fx.base, fx.lbase);
  /* out of order: d2 on the base */
  assert_int_equal(embps_hindex_delta_apply(r, fx.d2, fx.l2, "ckpt/INDEX-t", &err),
                   EMBPS_DATA_LOSS);
  assert_non_null(strstr(err.message, "ckpt/INDEX-t"));
  assert_non_null(strstr(err.message, "chain is broken"));
  /* every bit flip (the crc32 catches it), every truncation: refused, r unchanged */
  for (size_t i = 0; i < fx.l1; i++) {
    memcpy(q, fx.d1, fx.l1);
    q[i] ^= 0x10;
    assert_int_not_equal(embps_hindex_delta_apply(r, q, fx.l1, "x", &err), EMBPS_OK);
    assert_non_null(strstr(err.message, "x"));
  }
  for (size_t n = 0; n < fx.l1; n++)
    assert_int_equal(embps_hindex_delta_apply(r, fx.d1, n, "x", &err), EMBPS_DATA_LOSS);
  /* another version */
  memcpy(q, fx.d1, fx.l1);
  embps_put_le32(q + 8, 2);
  embps_put_le32(q + fx.l1 - 4, embps_ckpt_crc32(0, q, fx.l1 - 4));
  assert_int_equal(embps_hindex_delta_apply(r, q, fx.l1, "x", &err), EMBPS_FAILED_PRECONDITION);
  /* a full encoding is no delta */
  assert_int_equal(embps_hindex_delta_apply(r, fx.base, fx.lbase, "x", &err), EMBPS_DATA_LOSS);
  /* an allocation failure changes nothing */
  embps_alloc_fail_after(1);
  assert_int_equal(embps_hindex_delta_apply(r, fx.d1, fx.l1, "x", &err), EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
  /* in order: applies, twice does not */
  assert_int_equal(embps_hindex_delta_apply(r, fx.d1, fx.l1, "x", &err), EMBPS_OK);
  assert_int_equal(embps_hindex_delta_apply(r, fx.d1, fx.l1, "x", &err), EMBPS_DATA_LOSS);
  assert_int_equal(embps_hindex_delta_apply(r, fx.d2, fx.l2, "x", &err), EMBPS_OK);
  assert_same_full(r, fx.w);
  /* an index stepped since its capture takes no delta */
  embps_hindex_free(r);
  r = decoded(&fx.c, fx.base, fx.lbase);
  assert_int_equal(embps_hindex_step(r, &key, 1, &slot, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(embps_hindex_delta_apply(r, fx.d1, fx.l1, "x", &err), EMBPS_DATA_LOSS);
  embps_hindex_free(r);
  /* another configuration */
  other = fx.c, other.seed++;
  assert_int_equal(embps_hindex_new(&r, &other, NULL), EMBPS_OK);
  assert_int_equal(embps_hindex_delta_apply(r, fx.d1, fx.l1, "x", &err), EMBPS_FAILED_PRECONDITION);
  embps_hindex_free(r);
  free(q);
  fixture_free(&fx);
}

/* Every single-bit mutation behind a valid crc32, onto a fresh base: refused, or a sound index. */
static void mutate_all(embps_hindex_policy_t policy, uint32_t k) {
  fixture_t fx;
  embps_error_t err;
  uint8_t *q;
  uint64_t accepted = 0;
  fixture(&fx, policy, k);
  assert_non_null(q = malloc(fx.l1));
  for (size_t i = 12; i < fx.l1 - 4; i++) {
    embps_hindex_t *r = decoded(&fx.c, fx.base, fx.lbase);
    embps_status_t st;
    memcpy(q, fx.d1, fx.l1);
    q[i] ^= (uint8_t)(1u << (i % 8));
    embps_put_le32(q + fx.l1 - 4, embps_ckpt_crc32(0, q, fx.l1 - 4));
    st = embps_hindex_delta_apply(r, q, fx.l1, "x", &err);
    if (st == EMBPS_OK) {
      size_t len;
      uint8_t *p = full(r, &len);
      embps_hindex_t *again = decoded(&fx.c, p, len); /* decode's own checks agree */
      check_invariants(r, 1);
      embps_hindex_free(again);
      free(p);
      accepted++;
    } else {
      assert_true(st == EMBPS_DATA_LOSS || st == EMBPS_FAILED_PRECONDITION);
      assert_non_null(strstr(err.message, "x"));
    }
    embps_hindex_free(r);
  }
  assert_true(accepted < fx.l1); /* most are caught */
  free(q);
  fixture_free(&fx);
}

static void test_mutations(void **state) {
  (void)state;
  mutate_all(EMBPS_HINDEX_LRU, 2);
  mutate_all(EMBPS_HINDEX_LFU, 1);
  mutate_all(EMBPS_HINDEX_TTL, 3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_chain_lru_k1), cmocka_unit_test(test_chain_lru_k3),
      cmocka_unit_test(test_chain_lfu_k1), cmocka_unit_test(test_chain_lfu_k3),
      cmocka_unit_test(test_chain_ttl_k1), cmocka_unit_test(test_chain_ttl_k3),
      cmocka_unit_test(test_chain_sizes),  cmocka_unit_test(test_small_change_small_delta),
      cmocka_unit_test(test_refusals),     cmocka_unit_test(test_mutations),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
