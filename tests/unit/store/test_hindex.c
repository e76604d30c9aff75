/* The hash-keyed table's index (server/store/hindex.c) against a reference model written here:
 * plain arrays and O(n) scans under the same policy rules (hindex.h), over long random sequences
 * (Zipf-like keys over a range 10x the capacity, steps of random sizes with repeats, padding and
 * steps bigger than the table), for every policy and admit_after 1 and 3: the same slots, the
 * same fresh list and the same counters step by step; an encode/decode mid-sequence continues
 * identically; corrupt bytes are refused; find changes nothing; the bytes the index takes are
 * what embps_hindex_bytes says. The test includes hindex.c to check the heap and map
 * invariants and to share the sketch's column hash with the model. */
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

#define MCAP 64
#define MAXN 200

/* ---- the reference model --------------------------------------------------------------------- */

typedef struct model {
  embps_hindex_config_t cfg;
  uint64_t base, dmax;
  uint64_t key[MCAP], score[MCAP];
  uint32_t freestk[MCAP];
  uint64_t nfree;
  uint8_t sketch[4 * 64];
  embps_hindex_stats_t st;
} model_t;

static void model_init(model_t *m, const embps_hindex_config_t *c) {
  uint64_t bits = 0;
  memset(m, 0, sizeof(*m));
  m->cfg = *c;
  for (uint64_t h = c->half_life; h; h >>= 1)
    bits++;
  m->dmax = 62 - bits;
  for (uint64_t s = 0; s < c->capacity; s++)
    m->freestk[s] = (uint32_t)(c->capacity - 1 - s);
  m->nfree = c->capacity;
}

static int64_t model_find(const model_t *m, uint64_t key) {
  if (!key)
    return -1;
  for (uint64_t s = 0; s < m->cfg.capacity; s++)
    if (m->key[s] == key)
      return (int64_t)s;
  return -1;
}

/* The stored slot with the least (score, key) among those allowed (pin == NULL: all), or -1. */
static int64_t model_min(const model_t *m, const int *pin, int ttl_only) {
  int64_t best = -1;
  for (uint64_t s = 0; s < m->cfg.capacity; s++) {
    if (!m->key[s] || (pin && pin[s]))
      continue;
    if (ttl_only && !(m->st.clock - m->score[s] > m->cfg.ttl_steps))
      continue;
    if (best < 0 || m->score[s] < m->score[best] ||
        (m->score[s] == m->score[best] && m->key[s] < m->key[best]))
      best = (int64_t)s;
  }
  return best;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* sk: the real index, for its sketch column hash alone. */
static void model_step(model_t *m, const embps_hindex_t *sk, const uint64_t *keys, size_t n,
                       int64_t *slots, embps_hindex_fresh_t *fresh, size_t *nfresh) {
  uint64_t u[MAXN], cand[MAXN], weight = 0;
  int pin[MCAP] = {0};
  size_t k = 0, nu = 0, nc = 0;
  *nfresh = 0;
  m->st.clock++;
  if (m->cfg.policy == EMBPS_HINDEX_LFU) {
    uint64_t d = m->st.clock / m->cfg.half_life - m->base;
    if (d > m->dmax) {
      uint64_t s = d - m->dmax / 2;
      for (uint64_t i = 0; i < m->cfg.capacity; i++)
        m->score[i] >>= s;
      m->base += s;
      d -= s;
    }
    weight = UINT64_C(1) << d;
  }
  if (m->cfg.policy == EMBPS_HINDEX_TTL)
    for (int64_t s; (s = model_min(m, NULL, 1)) >= 0;) {
      m->key[s] = 0;
      m->freestk[m->nfree++] = (uint32_t)s;
      m->st.size--;
      m->st.expired++;
    }
  for (size_t i = 0; i < n; i++)
    if (keys[i])
      u[k++] = keys[i];
  qsort(u, k, sizeof(*u), cmp_u64);
  for (size_t i = 0; i < k; i++)
    if (!nu || u[nu - 1] != u[i])
      u[nu++] = u[i];
  for (size_t i = 0; i < nu; i++) {
    int64_t s = model_find(m, u[i]);
    if (s >= 0) {
      m->score[s] = weight ? m->score[s] + weight : m->st.clock;
      pin[s] = 1;
      continue;
    }
    if (m->cfg.admit_after > 1) {
      uint32_t est = 255, next, col[4];
      for (uint32_t r = 0; r < 4; r++) {
        col[r] = r * m->cfg.sketch_width + (uint32_t)embps__hix_sketch_col(sk, r, u[i]);
        est = m->sketch[col[r]] < est ? m->sketch[col[r]] : est;
      }
      next = est == 255 ? 255 : est + 1;
      for (uint32_t r = 0; r < 4; r++)
        if (m->sketch[col[r]] < next)
          m->sketch[col[r]] = (uint8_t)next;
      if (next < m->cfg.admit_after) {
        m->st.not_admitted++;
        continue;
      }
    }
    cand[nc++] = u[i];
  }
  for (size_t i = 0; i < nc; i++) {
    int64_t s;
    uint64_t evicted = 0;
    if (m->nfree) {
      s = m->freestk[--m->nfree];
    } else if ((s = model_min(m, pin, 0)) >= 0) {
      evicted = m->key[s];
      m->st.evicted++;
      m->st.size--;
    } else {
      m->st.refused++;
      continue;
    }
    m->key[s] = cand[i];
    m->score[s] = weight ? weight : m->st.clock;
    pin[s] = 1;
    m->st.size++;
    m->st.admitted++;
    fresh[*nfresh].key = cand[i];
    fresh[*nfresh].evicted = evicted;
    fresh[*nfresh].slot = (uint32_t)s;
    (*nfresh)++;
  }
  for (size_t i = 0; i < n; i++)
    slots[i] = model_find(m, keys[i]);
}

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

/* The LRU and TTL queue's invariants: from head to tail, linked both ways, strictly ascending by
 * (score, key), every key stored once. */
static void check_queue(const embps_hindex_t *ix) {
  uint64_t n = 0;
  uint32_t prev = EMBPS__HIX_NONE;
  for (uint32_t s = ix->head; s != EMBPS__HIX_NONE; prev = s, s = ix->link[2 * (uint64_t)s + 1]) {
    assert_true(n++ < ix->cfg.capacity);
    assert_true(s < ix->cfg.capacity && ix->key[s] != 0);
    assert_int_equal(ix->link[2 * (uint64_t)s], prev);
    if (prev != EMBPS__HIX_NONE)
      assert_true(less(ix, prev, s));
  }
  assert_int_equal(ix->tail, prev);
  assert_int_equal(n, ix->nheap);
}

/* The index's own invariants: map <-> keys, the victim order (heap order and positions, or the
 * queue), the free stack. */
static void check_invariants(const embps_hindex_t *ix) {
  uint64_t stored = 0, used = 0;
  int lfu = ix->cfg.policy == EMBPS_HINDEX_LFU;
  for (uint64_t s = 0; s < ix->cfg.capacity; s++)
    if (ix->key[s]) {
      stored++;
      assert_int_equal(embps__hindex_map_find(ix, ix->key[s]), s);
      if (lfu)
        assert_int_equal(ix->heap[ix->pos[s]], s);
    } else if (lfu) {
      assert_int_equal(ix->pos[s], EMBPS__HIX_NONE);
    }
  if (!lfu)
    check_queue(ix);
  for (uint64_t b = 0; b <= ix->mask; b++)
    used += ix->buckets[b] != 0;
  assert_int_equal(used, stored);
  assert_int_equal(stored, ix->st.size);
  assert_int_equal(ix->nheap, stored);
  assert_int_equal(ix->nfree + stored, ix->cfg.capacity);
  for (uint64_t i = 1; lfu && i < ix->nheap; i++)
    assert_false(less(ix, ix->heap[i], ix->heap[(i - 1) / 2]));
  for (uint64_t i = 0; i < ix->nfree; i++)
    assert_int_equal(ix->key[ix->free[i]], 0);
}

static void assert_stats_equal(const embps_hindex_stats_t *a, const embps_hindex_stats_t *b) {
  assert_int_equal(a->size, b->size);
  assert_int_equal(a->clock, b->clock);
  assert_int_equal(a->admitted, b->admitted);
  assert_int_equal(a->evicted, b->evicted);
  assert_int_equal(a->expired, b->expired);
  assert_int_equal(a->refused, b->refused);
  assert_int_equal(a->not_admitted, b->not_admitted);
}

static uint8_t *encode(const embps_hindex_t *ix, size_t *len) {
  uint8_t *p;
  *len = embps_hindex_encoded_bytes(ix);
  assert_non_null(p = malloc(*len));
  embps_hindex_encode(ix, p);
  return p;
}

static embps_hindex_config_t config(uint64_t capacity, embps_hindex_policy_t policy, uint32_t k) {
  embps_hindex_config_t c;
  memset(&c, 0, sizeof(c));
  c.capacity = capacity;
  c.policy = policy;
  c.admit_after = k;
  c.sketch_width = k > 1 ? 16 : 0; /* narrow: collisions admit keys early, as they may */
  c.half_life = policy == EMBPS_HINDEX_LFU ? 2 : 0;
  c.ttl_steps = policy == EMBPS_HINDEX_TTL ? 6 : 0;
  c.seed = 0x5eed0000 + (uint64_t)policy * 10 + k;
  return c;
}

/* ---- the long random sequences --------------------------------------------------------------- */

static void run_against_model(embps_hindex_policy_t policy, uint32_t k, uint64_t capacity) {
  embps_hindex_config_t c = config(capacity, policy, k);
  embps_hindex_t *ix = NULL, *ix2 = NULL;
  embps_hindex_stats_t st;
  model_t *m = calloc(1, sizeof(*m));
  uint64_t rng = c.seed, range = 10 * capacity, steps = 5000;
  uint64_t keys[MAXN];
  int64_t slots[MAXN], want[MAXN], slots2[MAXN];
  embps_hindex_fresh_t fresh[MAXN], wfresh[MAXN], fresh2[MAXN];
  size_t nfresh, nwant, nfresh2;
  uint64_t saw_evict = 0, saw_refuse = 0, saw_reuse = 0;

  assert_non_null(m);
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  model_init(m, &c);
  for (uint64_t step = 0; step < steps; step++) {
    uint64_t r = rng_next(&rng);
    size_t n = r % 8 == 0 ? (size_t)(rng_next(&rng) % MAXN) : (size_t)(rng_next(&rng) % 24);
    for (size_t i = 0; i < n; i++) {
      uint64_t d = rng_next(&rng);
      if (d % 20 == 0)
        keys[i] = 0; /* padding */
      else if (i > 0 && d % 7 == 0)
        keys[i] = keys[rng_next(&rng) % i]; /* a repeat */
      else
        keys[i] = key_of(zipf_rank(&rng, range));
    }
    model_step(m, ix, keys, n, want, wfresh, &nwant);
    assert_int_equal(embps_hindex_step(ix, keys, n, slots, fresh, &nfresh), EMBPS_OK);
    assert_memory_equal(slots, want, n * sizeof(*slots));
    assert_int_equal(nfresh, nwant);
    for (size_t i = 0; i < nfresh; i++) {
      assert_int_equal(fresh[i].key, wfresh[i].key);
      assert_int_equal(fresh[i].evicted, wfresh[i].evicted);
      assert_int_equal(fresh[i].slot, wfresh[i].slot);
      saw_evict += fresh[i].evicted != 0;
      saw_reuse += fresh[i].evicted == 0 && m->st.clock > 1 && m->st.admitted > capacity;
    }
    embps_hindex_stats(ix, &st);
    assert_stats_equal(&st, &m->st);
    assert_int_equal(ix->base, m->base); /* and the scores themselves, slot by slot */
    for (uint64_t s = 0; s < capacity; s++)
      assert_true(ix->key[s] == m->key[s] && (!m->key[s] || ix->score[s] == m->score[s]));
    saw_refuse = m->st.refused;
    if (ix2) { /* the decoded index goes on as the original */
      assert_int_equal(embps_hindex_step(ix2, keys, n, slots2, fresh2, &nfresh2), EMBPS_OK);
      assert_memory_equal(slots2, want, n * sizeof(*slots2));
      assert_int_equal(nfresh2, nwant);
      for (size_t i = 0; i < nfresh; i++)
        assert_true(fresh2[i].key == fresh[i].key && fresh2[i].evicted == fresh[i].evicted &&
                    fresh2[i].slot == fresh[i].slot);
      embps_hindex_stats(ix2, &st);
      assert_stats_equal(&st, &m->st);
    }
    if (step % 250 == 0 || step == steps - 1) {
      check_invariants(ix);
      for (uint64_t rank = 0; rank < range; rank++) {
        uint64_t key = key_of(rank);
        int64_t s;
        embps_hindex_find(ix, &key, 1, &s);
        assert_int_equal(s, model_find(m, key));
      }
    }
    if (step == steps / 2) {
      size_t len, len2;
      uint8_t *p = encode(ix, &len), *p2;
      embps_error_t err;
      assert_int_equal(embps_hindex_decode(&ix2, &c, p, len, "mid", &err), EMBPS_OK);
      check_invariants(ix2);
      p2 = encode(ix2, &len2);
      assert_int_equal(len, len2);
      assert_memory_equal(p, p2, len); /* canonical */
      free(p);
      free(p2);
    }
  }
  /* The sequence reached what it is meant to test. */
  assert_true(m->st.size == capacity || policy == EMBPS_HINDEX_TTL);
  assert_true(saw_evict > 0);
  assert_true(saw_refuse > 0);
  if (k > 1)
    assert_true(m->st.not_admitted > 0);
  if (policy == EMBPS_HINDEX_TTL)
    assert_true(m->st.expired > 0 && saw_reuse > 0);
  if (policy == EMBPS_HINDEX_LFU)
    assert_true(ix->base > 0); /* renormalised at least once */
  embps_hindex_free(ix);
  embps_hindex_free(ix2);
  free(m);
}

static void test_lru_k1(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_LRU, 1, 61);
}
static void test_lru_k3(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_LRU, 3, 61);
}
static void test_lfu_k1(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_LFU, 1, 61);
}
static void test_lfu_k3(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_LFU, 3, 61);
}
static void test_ttl_k1(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_TTL, 1, 61);
}
static void test_ttl_k3(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_TTL, 3, 61);
}
static void test_tiny_tables(void **state) {
  (void)state;
  run_against_model(EMBPS_HINDEX_LRU, 1, 1);
  run_against_model(EMBPS_HINDEX_LFU, 3, 2);
  run_against_model(EMBPS_HINDEX_LRU, 3, 7);
}

/* The same sequence given twice: to one index as drawn (any order, repeats, padding), to another
 * as the engine's push gives it, its distinct nonzero keys ascending (with the padding key 0
 * first at random): the fast path (no sort, no second lookup) gives the same slot to every key,
 * the same fresh list and counters, and the same state (equal encodings, the invariants hold);
 * and both agree with the reference model. */
static void run_sorted_against_unsorted(embps_hindex_policy_t policy, uint32_t k,
                                        uint64_t capacity) {
  embps_hindex_config_t c = config(capacity, policy, k);
  embps_hindex_t *a = NULL, *b = NULL;
  embps_hindex_stats_t sa, sb;
  model_t *md = calloc(1, sizeof(*md));
  uint64_t rng = c.seed ^ 0xabcdef, range = 10 * capacity, keys[MAXN], sorted[MAXN + 1];
  int64_t slots[MAXN], sslots[MAXN + 1], want[MAXN];
  embps_hindex_fresh_t fresh[MAXN], sfresh[MAXN + 1], wfresh[MAXN];
  size_t nfresh, nsfresh, nwant;
  assert_non_null(md);
  model_init(md, &c);
  assert_int_equal(embps_hindex_new(&a, &c, NULL), EMBPS_OK);
  assert_int_equal(embps_hindex_new(&b, &c, NULL), EMBPS_OK);
  for (uint64_t step = 0; step < 4000; step++) {
    uint64_t r = rng_next(&rng);
    size_t n = r % 8 == 0 ? (size_t)(rng_next(&rng) % MAXN) : (size_t)(rng_next(&rng) % 24);
    size_t m = 0, nu, z = rng_next(&rng) % 3 == 0;
    for (size_t i = 0; i < n; i++) {
      uint64_t d = rng_next(&rng);
      if (d % 20 == 0)
        keys[i] = 0;
      else if (i > 0 && d % 7 == 0)
        keys[i] = keys[rng_next(&rng) % i];
      else
        keys[i] = key_of(zipf_rank(&rng, range));
    }
    sorted[0] = 0;
    for (size_t i = 0; i < n; i++)
      if (keys[i])
        sorted[z + m++] = keys[i];
    qsort(sorted + z, m, sizeof(*sorted), cmp_u64);
    nu = 0;
    for (size_t i = 0; i < m; i++)
      if (nu == 0 || sorted[z + nu - 1] != sorted[z + i])
        sorted[z + nu++] = sorted[z + i];
    m = nu;
    assert_true(strictly_ascending(sorted, z + m));
    model_step(md, a, keys, n, want, wfresh, &nwant);
    assert_int_equal(embps_hindex_step(a, keys, n, slots, fresh, &nfresh), EMBPS_OK);
    assert_int_equal(embps_hindex_step(b, sorted, z + m, sslots, sfresh, &nsfresh), EMBPS_OK);
    assert_memory_equal(slots, want, n * sizeof(*slots));
    assert_int_equal(nfresh, nwant);
    if (z)
      assert_int_equal(sslots[0], -1);
    for (size_t i = 0; i < n; i++) { /* keys[i]'s slot, found in the sorted list */
      const uint64_t *at =
          keys[i] ? bsearch(&keys[i], sorted + z, m, sizeof(*sorted), cmp_u64) : NULL;
      assert_true(keys[i] == 0 || at != NULL);
      assert_int_equal(slots[i], at ? sslots[at - sorted] : -1);
    }
    assert_int_equal(nfresh, nsfresh);
    for (size_t i = 0; i < nfresh; i++)
      assert_true(fresh[i].key == sfresh[i].key && fresh[i].evicted == sfresh[i].evicted &&
                  fresh[i].slot == sfresh[i].slot);
    embps_hindex_stats(a, &sa);
    embps_hindex_stats(b, &sb);
    assert_stats_equal(&sa, &sb);
    assert_stats_equal(&sb, &md->st);
    if (step % 200 == 0 || step == 3999) {
      size_t la, lb;
      uint8_t *pa = encode(a, &la), *pb = encode(b, &lb);
      check_invariants(b);
      assert_int_equal(la, lb);
      assert_memory_equal(pa, pb, la);
      free(pa);
      free(pb);
    }
  }
  embps_hindex_stats(b, &sb);
  assert_true(sb.evicted > 0 && sb.refused > 0); /* full tables, and steps bigger than them */
  embps_hindex_free(a);
  embps_hindex_free(b);
  free(md);
}

static void test_sorted_input_fast_path(void **state) {
  (void)state;
  for (int p = EMBPS_HINDEX_LRU; p <= EMBPS_HINDEX_TTL; p++) {
    run_sorted_against_unsorted((embps_hindex_policy_t)p, 1, 61);
    run_sorted_against_unsorted((embps_hindex_policy_t)p, 3, 61);
  }
  run_sorted_against_unsorted(EMBPS_HINDEX_LRU, 1, 1);
}

/* ---- targeted cases -------------------------------------------------------------------------- */

static void test_find_changes_nothing_and_key0(void **state) {
  embps_hindex_config_t c = config(8, EMBPS_HINDEX_LRU, 3);
  embps_hindex_t *ix = NULL;
  uint64_t keys[6] = {0, 5, 5, 9, 0, 0};
  int64_t slots[6];
  embps_hindex_fresh_t fresh[6];
  size_t nfresh, len, len2;
  uint8_t *before, *after;
  (void)state;
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  for (int i = 0; i < 2; i++)
    assert_int_equal(embps_hindex_step(ix, keys, 6, slots, fresh, &nfresh), EMBPS_OK);
  before = encode(ix, &len);
  for (int i = 0; i < 10; i++) { /* lookups of 5 do not count towards its admission */
    embps_hindex_find(ix, keys, 6, slots);
    for (int j = 0; j < 6; j++)
      assert_int_equal(slots[j], -1);
  }
  after = encode(ix, &len2);
  assert_int_equal(len, len2);
  assert_memory_equal(before, after, len);
  /* the third push admits 5 and 9 (at slots 0 and 1, ascending key order); 0 never */
  assert_int_equal(embps_hindex_step(ix, keys, 6, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 2);
  assert_int_equal(slots[0], -1);
  assert_int_equal(slots[1], 0);
  assert_int_equal(slots[2], 0);
  assert_int_equal(slots[3], 1);
  assert_int_equal(slots[4], -1);
  /* a step of padding alone advances the clock and nothing else */
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){0, 0}, 2, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 0);
  assert_int_equal(ix->st.clock, 4);
  assert_int_equal(ix->st.size, 2);
  assert_int_equal(ix->st.not_admitted, 4); /* 5 and 9 at steps 1 and 2 */
  free(before);
  free(after);
  embps_hindex_free(ix);
}

static void test_step_bigger_than_capacity(void **state) {
  embps_hindex_config_t c = config(8, EMBPS_HINDEX_LRU, 1);
  embps_hindex_t *ix = NULL;
  uint64_t keys[20];
  int64_t slots[20];
  embps_hindex_fresh_t fresh[20];
  size_t nfresh;
  (void)state;
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  for (int i = 0; i < 20; i++)
    keys[i] = (uint64_t)(20 - i); /* given descending: processed ascending */
  assert_int_equal(embps_hindex_step(ix, keys, 20, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 8);
  for (int i = 0; i < 20; i++) /* keys 1..8 got slots 0..7, 9..20 were refused */
    assert_int_equal(slots[i], keys[i] <= 8 ? (int64_t)keys[i] - 1 : -1);
  assert_int_equal(ix->st.refused, 12);
  /* 21..40: the eight stored keys are evicted for 21..28, oldest (all step 1: by key) first */
  for (int i = 0; i < 20; i++)
    keys[i] = (uint64_t)(21 + i);
  assert_int_equal(embps_hindex_step(ix, keys, 20, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 8);
  for (int i = 0; i < 8; i++) {
    assert_int_equal(fresh[i].key, 21 + i);
    assert_int_equal(fresh[i].evicted, 1 + i);
    assert_int_equal(fresh[i].slot, i);
  }
  assert_int_equal(ix->st.evicted, 8);
  assert_int_equal(ix->st.refused, 24);
  check_invariants(ix);
  embps_hindex_free(ix);
}

/* Evictions cut the LRU queue after its victims in one piece: the key left at its head is then
 * touched (taken out of the queue from its head) and the next eviction takes the next oldest. */
static void test_evict_then_touch_head(void **state) {
  embps_hindex_config_t c = config(4, EMBPS_HINDEX_LRU, 1);
  embps_hindex_t *ix = NULL;
  int64_t slots[4];
  embps_hindex_fresh_t fresh[4];
  size_t nfresh;
  (void)state;
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){1, 2, 3, 4}, 4, slots, fresh, &nfresh),
                   EMBPS_OK); /* the queue: 1 2 3 4 */
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){5}, 1, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(fresh[0].evicted, 1); /* 2 3 4 5 */
  check_invariants(ix);
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){2}, 1, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 0); /* 3 4 5 2 */
  check_invariants(ix);
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){6, 7}, 2, slots, fresh, &nfresh), EMBPS_OK);
  assert_int_equal(nfresh, 2);
  assert_int_equal(fresh[0].evicted, 3);
  assert_int_equal(fresh[1].evicted, 4); /* 5 2 6 7 */
  check_invariants(ix);
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){8, 9, 10, 11}, 4, slots, fresh, &nfresh),
                   EMBPS_OK); /* every key evicted: the queue emptied, then refilled */
  assert_int_equal(fresh[0].evicted, 5);
  assert_int_equal(fresh[1].evicted, 2);
  assert_int_equal(fresh[3].evicted, 7);
  check_invariants(ix);
  embps_hindex_free(ix);
}

static void test_bytes_and_alloc_failures(void **state) {
  embps_hindex_config_t c = config(1000, EMBPS_HINDEX_LFU, 3);
  embps_hindex_t *ix = NULL;
  size_t want;
  embps_error_t err;
  int64_t slot;
  embps_hindex_fresh_t fresh[1];
  size_t len, len2, nfresh;
  uint8_t *before, *after;
  (void)state;
  c.sketch_width = 100;
  /* buckets 2048 x 8, key and score 1000 x 8, pos, heap, free 1000 x 4, sketch 4 x 100, the
   * changed slots' bits (16 x 8) and the changed sketch blocks' (7 bits: 8): each rounded up to
   * 64 bytes */
  want = sizeof(struct embps_hindex) + 2048 * 8 + 2 * 8000 + 3 * 4032 + 448 + 128 + 64;
  assert_int_equal(embps_hindex_bytes(&c), want);
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  assert_int_equal(sizeof(*ix) + ix->arena_bytes, want);
  assert_true(ix->sketch + 4 * 100 <= (uint8_t *)ix->arena + ix->arena_bytes);
  assert_true((uint8_t *)(ix->free + 1000) <= ix->sketch);
  assert_int_equal(ix->mask + 1, 2048);
  /* a step whose scratch cannot be had changes nothing */
  before = encode(ix, &len);
  embps_alloc_fail_after(1);
  assert_int_equal(embps_hindex_step(ix, (uint64_t[]){7}, 1, &slot, fresh, &nfresh),
                   EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
  after = encode(ix, &len2);
  assert_memory_equal(before, after, len);
  embps_hindex_free(ix);
  free(before);
  free(after);
  for (long n = 1; n <= 2; n++) {
    embps_hindex_t *none = NULL;
    embps_alloc_fail_after(n);
    assert_int_equal(embps_hindex_new(&none, &c, &err), EMBPS_RESOURCE_EXHAUSTED);
    embps_alloc_fail_after(0);
    assert_null(none);
  }
  /* a billion keys: the figure docs/design.md quotes */
  c.capacity = 1000000000;
  c.sketch_width = 0;
  c.admit_after = 1;
  print_message("embps_hindex_bytes(1e9 keys) = %zu\n", embps_hindex_bytes(&c));
}

static void test_config_refusals(void **state) {
  embps_hindex_config_t ok = config(10, EMBPS_HINDEX_LRU, 1), c;
  embps_error_t err;
  embps_hindex_t *ix = NULL;
  (void)state;
  assert_int_equal(embps_hindex_config_check(&ok, &err), EMBPS_OK);
  c = ok, c.capacity = 0;
  assert_int_equal(embps_hindex_new(&ix, &c, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "capacity"));
  c = ok, c.capacity = EMBPS_HINDEX_MAX_CAPACITY + 1;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  c = ok, c.policy = 9;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "policy"));
  c = ok, c.admit_after = 0;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  c = ok, c.admit_after = 256;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  c = ok, c.admit_after = 2;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "sketch_width"));
  c = ok, c.sketch_width = 5;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  c = ok, c.half_life = 3;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "half_life"));
  c = ok, c.policy = EMBPS_HINDEX_LFU;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  c = ok, c.policy = EMBPS_HINDEX_TTL;
  assert_int_equal(embps_hindex_config_check(&c, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "ttl_steps"));
  assert_int_equal(embps_hindex_bytes(&c), 0);
  assert_null(ix);
}

/* An index after some steps, its encoding in *p, *len. */
static embps_hindex_t *some_index(const embps_hindex_config_t *c, uint8_t **p, size_t *len) {
  embps_hindex_t *ix = NULL;
  uint64_t rng = 3, keys[30];
  int64_t slots[30];
  embps_hindex_fresh_t fresh[30];
  size_t nfresh;
  assert_int_equal(embps_hindex_new(&ix, c, NULL), EMBPS_OK);
  for (int step = 0; step < 40; step++) {
    for (int i = 0; i < 30; i++)
      keys[i] = key_of(zipf_rank(&rng, 10 * c->capacity));
    assert_int_equal(embps_hindex_step(ix, keys, 30, slots, fresh, &nfresh), EMBPS_OK);
  }
  for (int step = 0; step < 8; step++) /* quiet steps: TTL frees slots */
    assert_int_equal(embps_hindex_step(ix, keys, 1, slots, fresh, &nfresh), EMBPS_OK);
  *p = encode(ix, len);
  return ix;
}

static void test_decode_refusals(void **state) {
  embps_hindex_config_t c = config(20, EMBPS_HINDEX_TTL, 3), other;
  embps_hindex_t *ix, *got = NULL;
  embps_error_t err;
  uint8_t *p, *q;
  size_t len;
  (void)state;
  ix = some_index(&c, &p, &len);
  assert_true(ix->st.size > 0 && ix->nfree > 0); /* both sections present */
  assert_non_null(q = malloc(len));
  /* every single flipped byte is refused (crc32, or the magic or version before it) */
  for (size_t i = 0; i < len; i++) {
    memcpy(q, p, len);
    q[i] ^= 0x40;
    assert_int_not_equal(embps_hindex_decode(&got, &c, q, len, "x", &err), EMBPS_OK);
    assert_null(got);
    assert_non_null(strstr(err.message, "x"));
  }
  /* every truncation */
  for (size_t n = 0; n < len; n++)
    assert_int_equal(embps_hindex_decode(&got, &c, p, n, "x", &err), EMBPS_DATA_LOSS);
  /* mutations behind a valid crc32: refused as malformed, or decode into a valid index */
  for (size_t i = 12; i < len - 4; i++) {
    memcpy(q, p, len);
    q[i] ^= (uint8_t)(1u << (i % 8));
    embps_put_le32(q + len - 4, embps_ckpt_crc32(0, q, len - 4));
    if (embps_hindex_decode(&got, &c, q, len, "x", &err) == EMBPS_OK) {
      check_invariants(got);
      embps_hindex_free(got);
      got = NULL;
    }
  }
  /* another capacity or settings */
  other = c, other.capacity = 21;
  assert_int_equal(embps_hindex_decode(&got, &other, p, len, "ckpt/t.hix", &err),
                   EMBPS_FAILED_PRECONDITION);
  assert_non_null(strstr(err.message, "capacity of 20 slots"));
  assert_non_null(strstr(err.message, "ckpt/t.hix"));
  other = c, other.seed++;
  assert_int_equal(embps_hindex_decode(&got, &other, p, len, "x", &err), EMBPS_FAILED_PRECONDITION);
  other = c, other.policy = EMBPS_HINDEX_LRU, other.ttl_steps = 0;
  assert_int_equal(embps_hindex_decode(&got, &other, p, len, "x", &err), EMBPS_FAILED_PRECONDITION);
  assert_non_null(strstr(err.message, "ttl"));
  /* another version */
  memcpy(q, p, len);
  embps_put_le32(q + 8, 99);
  assert_int_equal(embps_hindex_decode(&got, &c, q, len, "x", &err), EMBPS_FAILED_PRECONDITION);
  assert_null(got);
  assert_int_equal(embps_hindex_decode(&got, &c, p, len, "x", &err), EMBPS_OK);
  embps_hindex_free(got);
  free(p);
  free(q);
  embps_hindex_free(ix);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lru_k1),
      cmocka_unit_test(test_lru_k3),
      cmocka_unit_test(test_lfu_k1),
      cmocka_unit_test(test_lfu_k3),
      cmocka_unit_test(test_ttl_k1),
      cmocka_unit_test(test_ttl_k3),
      cmocka_unit_test(test_tiny_tables),
      cmocka_unit_test(test_sorted_input_fast_path),
      cmocka_unit_test(test_find_changes_nothing_and_key0),
      cmocka_unit_test(test_step_bigger_than_capacity),
      cmocka_unit_test(test_evict_then_touch_head),
      cmocka_unit_test(test_bytes_and_alloc_failures),
      cmocka_unit_test(test_config_refusals),
      cmocka_unit_test(test_decode_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
