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

/** The exponent of --tokens zipf without --zipf: the skew of recommender token ids. */
#define EMBPS_ZIPF_DEFAULT_EXPONENT 1.05

/** The Zipf exponent of the bench's --tokens DIST and --zipf A (zipf NULL when not given):
 * uniform (the default) is 0, so every row is alike and a batch reaches memory; zipf takes A,
 * 1.05 when not given; A alone (the older spelling) is Zipf(A). Returns -1 for another DIST or
 * for uniform with an A other than 0. */
int embps_token_exponent(const char *dist, const char *zipf, double a, double *exponent);

#endif
