/* Random tokens for the load generator: a fast 64-bit generator and a Zipf sampler. */
#ifndef EMBPS_CLI_ZIPF_H
#define EMBPS_CLI_ZIPF_H

#include <stdint.h>

/** xoshiro256** state; seed it with embps_rng_seed(). */
typedef struct embps_rng {
  uint64_t s[4];
} embps_rng_t;

/** Seeds the generator from one 64-bit value (expanded with splitmix64). */
void embps_rng_seed(embps_rng_t *r, uint64_t seed);
/** The next 64 random bits. */
uint64_t embps_rng_next(embps_rng_t *r);
/** A uniform double in [0, 1). */
double embps_rng_uniform(embps_rng_t *r);

/** Zipf(exponent) over the ranks 1..n: P(k) proportional to k^-exponent; exponent 0 is
 * uniform. Sampling is O(1) without tables (rejection-inversion, Hörmann and Derflinger
 * 1996), so it works for billions of rows. */
typedef struct embps_zipf {
  uint64_t n;
  double exponent;
  double h_integral_x1;
  double h_integral_n;
  double s;
} embps_zipf_t;

/** Sets up z for ranks 1..n; returns -1 if n is 0 or exponent is negative or not finite. */
int embps_zipf_init(embps_zipf_t *z, uint64_t n, double exponent);
/** One rank in [1, n]. */
uint64_t embps_zipf_sample(const embps_zipf_t *z, embps_rng_t *r);

/** A fixed bijection of the 64-bit integers (MurmurHash3's 64-bit finalizer, fmix64): the bench
 * maps the ranks 1..N it draws through it to the keys of a hash-keyed table, so that they are
 * spread over the whole 64-bit range (negative as int64 included) while N of them stay N
 * distinct keys. Only 0 maps to 0, so a rank >= 1 never becomes padding token 0. */
uint64_t embps_key_mix(uint64_t rank);

/** The most --key-space takes: the Zipf sampler works in doubles, exact up to here. */
#define EMBPS_KEY_SPACE_MAX (UINT64_C(1) << 62)

/** The key space a bench draws a table's ids from: key_space (--key-space; 0 when not given) or
 * its default, rows - 1 for a dense table (ids [1, rows)) and 10 x capacity for a hash-keyed one
 * (capacity > 0; a key range larger than the table, so a full table evicts), at most
 * EMBPS_KEY_SPACE_MAX. */
uint64_t embps_bench_key_space(uint64_t rows, uint64_t capacity, uint64_t key_space);

/** The exponent of --tokens zipf without --zipf: the skew of recommender token ids. */
#define EMBPS_ZIPF_DEFAULT_EXPONENT 1.05

/** The Zipf exponent of the bench's --tokens DIST and --zipf A (zipf NULL when not given):
 * uniform (the default) is 0, so every row is alike and a batch reaches memory; zipf takes A,
 * 1.05 when not given; A alone (the older spelling) is Zipf(A). Returns -1 for another DIST or
 * for uniform with an A other than 0. */
int embps_token_exponent(const char *dist, const char *zipf, double a, double *exponent);

#endif
