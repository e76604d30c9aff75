/* Token generators for `embps bench`.
 *
 * The Zipf sampler is rejection-inversion (W. Hörmann, G. Derflinger, "Rejection-inversion to
 * generate variates from monotone discrete distributions", 1996), as in Apache Commons RNG:
 * it inverts the integral of the continuous hat x^-a, accepts with a cheap test most of the
 * time, and needs no table, so a table of 10^9 rows costs nothing to set up. It takes about
 * 30-60 ns a sample; bench draws its tokens into a pool up front anyway, so sampling is never
 * on the measured path. The helper functions keep the formulas accurate when a is near 1,
 * where (1-a) log x is tiny. */
#include "client/cli/zipf.h"
#include "common/mix64.h"

#include <math.h>
#include <string.h>

void embps_rng_seed(embps_rng_t *r, uint64_t seed) {
  for (int i = 0; i < 4; i++)
    r->s[i] = embps_splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t embps_rng_next(embps_rng_t *r) {
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

double embps_rng_uniform(embps_rng_t *r) { return (double)(embps_rng_next(r) >> 11) * 0x1.0p-53; }

/* log1p(x)/x, accurate near 0. */
static double helper1(double x) {
  return fabs(x) > 1e-8 ? log1p(x) / x : 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
}

/* expm1(x)/x, accurate near 0. */
static double helper2(double x) {
  return fabs(x) > 1e-8 ? expm1(x) / x : 1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x));
}

/* H(x) = integral of the hat function h(x) = x^-a, up to a constant. */
static double h_integral(const embps_zipf_t *z, double x) {
  double log_x = log(x);
  return helper2((1.0 - z->exponent) * log_x) * log_x;
}

static double h(const embps_zipf_t *z, double x) { return exp(-z->exponent * log(x)); }

static double h_integral_inverse(const embps_zipf_t *z, double x) {
  double t = x * (1.0 - z->exponent);
  if (t < -1.0)
    t = -1.0; /* limit rounding errors */
  return exp(helper1(t) * x);
}

int embps_zipf_init(embps_zipf_t *z, uint64_t n, double exponent) {
  if (n == 0 || !(exponent >= 0.0) || !isfinite(exponent))
    return -1;
  z->n = n;
  z->exponent = exponent;
  if (exponent == 0.0)
    return 0;
  z->h_integral_x1 = h_integral(z, 1.5) - 1.0;
  z->h_integral_n = h_integral(z, (double)n + 0.5);
  z->s = 2.0 - h_integral_inverse(z, h_integral(z, 2.5) - h(z, 2.0));
  return 0;
}

uint64_t embps_zipf_sample(const embps_zipf_t *z, embps_rng_t *r) {
  if (z->exponent == 0.0)
    return 1 + (uint64_t)(((unsigned __int128)embps_rng_next(r) * z->n) >> 64);
  for (;;) {
    double u = z->h_integral_n + embps_rng_uniform(r) * (z->h_integral_x1 - z->h_integral_n);
    double x = h_integral_inverse(z, u);
    double kd = floor(x + 0.5);
    uint64_t k;
    if (kd < 1.0)
      kd = 1.0;
    else if (kd > (double)z->n)
      kd = (double)z->n;
    k = (uint64_t)kd;
    if (kd - x <= z->s || u >= h_integral(z, kd + 0.5) - h(z, kd))
      return k;
  }
}

int embps_token_exponent(const char *dist, const char *zipf, double a, double *exponent) {
  if (!dist) {
    *exponent = zipf ? a : 0.0;
    return 0;
  }
  if (strcmp(dist, "uniform") == 0) {
    if (zipf && a != 0.0)
      return -1;
    *exponent = 0.0;
    return 0;
  }
  if (strcmp(dist, "zipf") == 0) {
    *exponent = zipf ? a : EMBPS_ZIPF_DEFAULT_EXPONENT;
    return 0;
  }
  return -1;
}

uint64_t embps_key_mix(uint64_t k) {
  k ^= k >> 33;
  k *= UINT64_C(0xff51afd7ed558ccd);
  k ^= k >> 33;
  k *= UINT64_C(0xc4ceb9fe1a85ec53);
  k ^= k >> 33;
  return k;
}

uint64_t embps_bench_key_space(uint64_t rows, uint64_t capacity, uint64_t key_space) {
  if (key_space)
    return key_space;
  if (!capacity)
    return rows ? rows - 1 : 0;
  return capacity >= EMBPS_KEY_SPACE_MAX / 10 ? EMBPS_KEY_SPACE_MAX : capacity * 10;
}
