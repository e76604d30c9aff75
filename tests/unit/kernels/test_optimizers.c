/* The fused optimizer updates, run as the engine runs them, against a double-precision
 * reference, for 200 steps.
 *
 * Each step draws a skewed batch of tokens (hot rows repeat, padding token 0 appears) with
 * full-width f32 gradients. The kernel side is a shard group in miniature: the table is split
 * by columns over `ranks` slices; every rank dedups the batch, segment-sums its gradient
 * columns, drops the padding row, adds weight decay, takes row statistics (summed over ranks,
 * the all-reduce, for rowwise Adagrad) and applies the update to its slice. The reference
 * works on the full-width table in double: it sums each row's gradients itself, straight from
 * the batch, and applies the textbook formulas. Hyper-parameters enter both as the same f32
 * values.
 *
 * What is compared, at every one of the 200 steps:
 * - the gradient each kernel is handed (dedup, segment sum, weight decay) against the
 *   reference's own double sum, to 1e-6 of the sum of magnitudes; the reference then uses the
 *   handed values, so that what follows checks the update alone.
 * - f32 weights: |kernel - reference| <= 1e-6 (|w_old| + |delta| + lr).
 * - bf16 weights: the reference rounds its exact result to bf16, so a correct kernel matches
 *   it bit for bit, except where the exact value lies so near a bf16 rounding boundary that
 *   f32 arithmetic may land on either side; there either neighbour is accepted. Such ties
 *   must stay rare (under 0.5% of elements; about 0.05% in practice).
 * - optimizer state (f32 in the kernel, double in the reference): 1e-6 relative; Adam's first
 *   moment, which crosses zero, relative to |m| + sqrt(v).
 * - rows not in the batch are unchanged, row 0 (padding) never changes, and the per-rank
 *   copies of rowwise Adagrad's accumulator are identical.
 * After each comparison the reference takes the kernel's weights and state, so each step is
 * checked tightly instead of letting legitimate f32 drift over 200 steps (about 1e-6 for the
 * long-memory Adam v) eat the tolerance. */
#include <math.h>
#include <stdio.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define ROWS 40
#define FULL 18
#define STEPS 200
#define T 64
#define MAX_RANKS 3
#define INIT_SCALE 0.1f

typedef struct cfg {
  embps_optimizer_t opt;
  embps_dtype_t dtype;
  float half_life;
  float wd;
  size_t ranks;
} cfg_t;

/* Kernel-side state of one rank. */
typedef struct rank_state {
  void *table;  /* ROWS x sw of dtype */
  float *accum; /* ROWS x sw (adagrad) or ROWS (rowwise) */
  float *m, *v; /* ROWS x sw (adam) */
} rank_state_t;

/* Reference state, full width, double. */
typedef struct ref_state {
  double w[ROWS][FULL];
  double acc[ROWS][FULL];
  double racc[ROWS];
  double m[ROWS][FULL], v[ROWS][FULL];
} ref_state_t;

static double max_w_err, max_state_err;
static size_t ties, bf16_checked;

static float kernel_w(const rank_state_t *rs, embps_dtype_t dtype, size_t sw, size_t row,
                      size_t col) {
  size_t k = row * sw + col;
  return dtype == EMBPS_DTYPE_BF16 ? embps_bf16_to_f32(((const uint16_t *)rs->table)[k])
                                   : ((const float *)rs->table)[k];
}

static uint16_t bf16_of_double(double x) { return embps_f32_to_bf16((float)x); }

/* Checks one state element and resynchronizes the reference to the kernel's value. */
static void check_state(float got, double *want, double scale, const char *what, size_t step) {
  double err = fabs(got - *want) / scale;
  if (err > max_state_err)
    max_state_err = err;
  if (!(err <= 1e-6))
    fail_msg("%s: step %zu got %.9g want %.9g (err %.3g)", what, step, got, *want, err);
  *want = got;
}

static void run(cfg_t c) {
  kt_rng_t rng = {1000 + (uint64_t)c.opt * 10 + (uint64_t)c.dtype + (uint64_t)c.ranks * 100};
  const size_t sw = FULL / c.ranks;
  const size_t es = embps_dtype_size(c.dtype);
  const int bf16 = c.dtype == EMBPS_DTYPE_BF16;
  const uint64_t seed = 77;

  embps_opt_params_t p = {
      .lr = c.opt == EMBPS_OPTIMIZER_SGD    ? 0.01f
            : c.opt == EMBPS_OPTIMIZER_ADAM ? 0.005f
                                            : 0.02f,
      .eps = 0.05f, /* large enough that where eps enters the formula shows */
      .decay = embps_opt_decay_from_half_life(c.half_life),
      .beta1 = 0.9f,
      .beta2 = 0.999f,
  };
  const double lr = p.lr, eps = p.eps, decay = p.decay, b1 = p.beta1, b2 = p.beta2;

  rank_state_t rs[MAX_RANKS];
  for (size_t r = 0; r < c.ranks; r++) {
    rs[r].table = kt_alloc(ROWS * sw * es);
    embps_init_rows_cpu(rs[r].table, c.dtype, sw, 0, ROWS, r * sw, seed, INIT_SCALE);
    rs[r].accum = calloc(ROWS * sw, sizeof(float));
    rs[r].m = calloc(ROWS * sw, sizeof(float));
    rs[r].v = calloc(ROWS * sw, sizeof(float));
    assert_non_null(rs[r].accum);
    assert_non_null(rs[r].m);
    assert_non_null(rs[r].v);
  }
  ref_state_t *ref = calloc(1, sizeof(*ref));
  assert_non_null(ref);
  for (size_t i = 0; i < ROWS; i++)
    for (size_t j = 0; j < FULL; j++) {
      float v = embps_init_value(seed, i, j, INIT_SCALE);
      ref->w[i][j] = bf16 ? kt_bf16_round(v) : v;
      assert_true(kernel_w(&rs[j / sw], c.dtype, sw, i, j % sw) == (float)ref->w[i][j]);
    }

  int64_t tokens[T], unique[T];
  uint32_t seg[T];
  static float grads_full[T][FULL];
  float gslice[T * FULL], summed[T * FULL], row_sumsq[T];
  void *ws = kt_alloc(embps_dedup_workspace_bytes(T));

  for (uint64_t step = 1; step <= STEPS; step++) {
    p.step = step;
    for (size_t i = 0; i < T; i++) {
      double u = kt_unit(&rng);
      tokens[i] = (int64_t)(ROWS * u * u); /* skewed; token 0 about 16% of the time */
      for (size_t j = 0; j < FULL; j++)
        grads_full[i][j] = kt_uniform(&rng, -1.0f, 1.0f);
    }

    /* ---- kernel side ---- */
    static float prev[ROWS][FULL];
    for (size_t row = 0; row < ROWS; row++)
      for (size_t j = 0; j < FULL; j++)
        prev[row][j] = kernel_w(&rs[j / sw], c.dtype, sw, row, j % sw);
    size_t nu = embps_dedup_cpu(tokens, T, unique, seg, ws);
    size_t skip = unique[0] == 0; /* the padding row is not updated */
    const int64_t *rows = unique + skip;
    size_t n = nu - skip;
    const size_t block = embps_row_stats_block(sw), nb = sw / block;
    float *parts = kt_alloc((c.ranks * n * nb + 1) * sizeof(float));
    float *gr[MAX_RANKS];
    for (size_t r = 0; r < c.ranks; r++) {
      for (size_t i = 0; i < T; i++)
        memcpy(gslice + i * sw, &grads_full[i][r * sw], sw * sizeof(float));
      embps_segment_sum_cpu(gslice, EMBPS_DTYPE_F32, sw, seg, T, nu, summed);
      gr[r] = kt_alloc((n ? n : 1) * sw * sizeof(float));
      memcpy(gr[r], summed + skip * sw, n * sw * sizeof(float));
      embps_apply_weight_decay_cpu(rs[r].table, c.dtype, sw, rows, n, gr[r], c.wd);
      /* Each rank's column-block partials, then every rank's combined in column order (what
       * the engine all-gathers). */
      embps_row_partials_cpu(gr[r], n, sw, block, parts + r * n * nb);
    }
    assert_int_equal(embps_row_combine_cpu(parts, c.ranks, n, nb, row_sumsq, NULL), 0);
    free(parts);
    for (size_t r = 0; r < c.ranks; r++) {
      switch (c.opt) {
      case EMBPS_OPTIMIZER_SGD:
        embps_update_sgd_cpu(rs[r].table, c.dtype, sw, rows, n, gr[r], &p);
        break;
      case EMBPS_OPTIMIZER_ADAGRAD:
        embps_update_adagrad_cpu(rs[r].table, c.dtype, sw, rows, n, gr[r], rs[r].accum, &p);
        break;
      case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
        embps_update_rowwise_adagrad_cpu(rs[r].table, c.dtype, sw, rows, n, gr[r], row_sumsq, FULL,
                                         rs[r].accum, &p);
        break;
      case EMBPS_OPTIMIZER_ADAM:
        embps_update_adam_cpu(rs[r].table, c.dtype, sw, rows, n, gr[r], rs[r].m, rs[r].v, &p);
        break;
      }
    }

    /* ---- reference ---- */
    static double g[ROWS][FULL], gabs[ROWS][FULL];
    int touched[ROWS] = {0};
    size_t idx_of[ROWS];
    for (size_t i = 0; i < n; i++)
      idx_of[rows[i]] = i;
    memset(g, 0, sizeof(g));
    memset(gabs, 0, sizeof(gabs));
    for (size_t i = 0; i < T; i++) {
      if (tokens[i] == 0)
        continue;
      touched[tokens[i]] = 1;
      for (size_t j = 0; j < FULL; j++) {
        g[tokens[i]][j] += grads_full[i][j];
        gabs[tokens[i]][j] += fabs(grads_full[i][j]);
      }
    }
    size_t n_ref = 0;
    for (size_t row = 0; row < ROWS; row++) {
      if (!touched[row])
        continue;
      n_ref++;
      /* The gradient the kernels were handed (dedup, segment sum, weight decay) must match
       * the reference's own to f32 summation accuracy; from here on the reference uses the
       * handed values, so that what is compared below is the optimizer alone. */
      double sumsq = 0.0;
      for (size_t j = 0; j < FULL; j++) {
        g[row][j] += (double)c.wd * ref->w[row][j];
        double handed = gr[j / sw][idx_of[row] * sw + j % sw];
        double tol = 1e-6 * (gabs[row][j] + fabs(c.wd * ref->w[row][j])) + 1e-30;
        if (!(fabs(handed - g[row][j]) <= tol))
          fail_msg("gradient [%zu][%zu] step %zu: handed %.9g, reference %.9g", row, j,
                   (size_t)step, handed, g[row][j]);
        g[row][j] = handed;
        sumsq += handed * handed;
      }
      if (c.opt == EMBPS_OPTIMIZER_ROWWISE_ADAGRAD)
        ref->racc[row] = ref->racc[row] * decay + sumsq / FULL;
      for (size_t j = 0; j < FULL; j++) {
        double gj = g[row][j], delta = 0.0;
        switch (c.opt) {
        case EMBPS_OPTIMIZER_SGD:
          delta = lr * gj;
          break;
        case EMBPS_OPTIMIZER_ADAGRAD:
          ref->acc[row][j] = ref->acc[row][j] * decay + gj * gj;
          delta = lr * gj / (sqrt(ref->acc[row][j]) + eps);
          break;
        case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
          delta = lr * gj / (sqrt(ref->racc[row]) + eps);
          break;
        case EMBPS_OPTIMIZER_ADAM: {
          ref->m[row][j] = b1 * ref->m[row][j] + (1.0 - b1) * gj;
          ref->v[row][j] = b2 * ref->v[row][j] + (1.0 - b2) * gj * gj;
          double mhat = ref->m[row][j] / (1.0 - pow(b1, (double)step));
          double vhat = ref->v[row][j] / (1.0 - pow(b2, (double)step));
          delta = lr * mhat / (sqrt(vhat) + eps);
          break;
        }
        }
        double w_old = ref->w[row][j];
        double x = w_old - delta;
        float got = kernel_w(&rs[j / sw], c.dtype, sw, row, j % sw);
        if (bf16) {
          /* Every value within `amb` of x rounds to a bf16 in [lo, hi]; amb covers the f32
           * rounding of the kernel's result and a few f32 roundings in its delta. */
          double amb = 2e-7 * (fabs(w_old) + fabs(delta)) + 2e-6 * fabs(delta) + 1e-7 * lr;
          float lo = embps_bf16_to_f32(bf16_of_double(x - amb));
          float hi = embps_bf16_to_f32(bf16_of_double(x + amb));
          bf16_checked++;
          if (lo != hi)
            ties++;
          if (!(got >= lo && got <= hi))
            fail_msg("bf16 w[%zu][%zu] step %zu: got %.9g, want %.9g (exact %.12g)", row, j,
                     (size_t)step, got, lo, x);
          ref->w[row][j] = got; /* equal to the reference's rounding, or a tie */
        } else {
          double err = fabs(got - x) / (fabs(w_old) + fabs(delta) + lr);
          if (err > max_w_err)
            max_w_err = err;
          if (!(err <= 1e-6))
            fail_msg("f32 w[%zu][%zu] step %zu: got %.9g, want %.12g (err %.3g)", row, j,
                     (size_t)step, got, x, err);
          ref->w[row][j] = got;
        }
      }
    }
    assert_int_equal(n_ref, n);
    for (size_t r = 0; r < c.ranks; r++)
      free(gr[r]);

    /* Untouched rows (row 0 included) hold exactly the reference's (unchanged) values; the
     * state is compared everywhere. */
    for (size_t row = 0; row < ROWS; row++) {
      for (size_t j = 0; j < FULL; j++) {
        const rank_state_t *k = &rs[j / sw];
        size_t kj = row * sw + j % sw;
        if (!touched[row] && kernel_w(k, c.dtype, sw, row, j % sw) != prev[row][j])
          fail_msg("untouched w[%zu][%zu] step %zu changed", row, j, (size_t)step);
        if (c.opt == EMBPS_OPTIMIZER_ADAGRAD)
          check_state(k->accum[kj], &ref->acc[row][j], ref->acc[row][j] + 1e-30, "accum",
                      (size_t)step);
        if (c.opt == EMBPS_OPTIMIZER_ADAM) {
          double vs = sqrt(ref->v[row][j]);
          check_state(k->m[kj], &ref->m[row][j], fabs(ref->m[row][j]) + vs + 1e-30, "m",
                      (size_t)step);
          check_state(k->v[kj], &ref->v[row][j], ref->v[row][j] + 1e-30, "v", (size_t)step);
        }
      }
      if (c.opt == EMBPS_OPTIMIZER_ROWWISE_ADAGRAD) {
        check_state(rs[0].accum[row], &ref->racc[row], ref->racc[row] + 1e-30, "row accum",
                    (size_t)step);
        for (size_t r = 1; r < c.ranks; r++)
          assert_true(rs[r].accum[row] == rs[0].accum[row]);
      }
    }
  }
  for (size_t j = 0; j < FULL; j++)
    assert_true(ref->w[0][j] == 0.0);

  free(ws);
  free(ref);
  for (size_t r = 0; r < c.ranks; r++) {
    free(rs[r].table);
    free(rs[r].accum);
    free(rs[r].m);
    free(rs[r].v);
  }
}

static void run_all(embps_optimizer_t opt) {
  embps_dtype_t dtypes[2] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  for (int d = 0; d < 2; d++) {
    max_w_err = max_state_err = 0.0;
    ties = bf16_checked = 0;
    /* Half-life decay and weight decay over a 3-way column split; then neither, unsplit. */
    run((cfg_t){opt, dtypes[d], 20.0f, 0.01f, 3});
    run((cfg_t){opt, dtypes[d], 0.0f, 0.0f, 1});
    if (getenv("EMBPS_TEST_VERBOSE"))
      printf("opt %d %s: max w err %.3g, max state err %.3g, bf16 ties %zu of %zu\n", (int)opt,
             embps_dtype_name(dtypes[d]), max_w_err, max_state_err, ties, bf16_checked);
    if (dtypes[d] == EMBPS_DTYPE_BF16) {
      assert_true(bf16_checked > 100000);
      assert_true(ties * 200 < bf16_checked); /* under 0.5% */
    }
  }
}

static void test_sgd(void **state) {
  (void)state;
  run_all(EMBPS_OPTIMIZER_SGD);
}

static void test_adagrad(void **state) {
  (void)state;
  run_all(EMBPS_OPTIMIZER_ADAGRAD);
}

static void test_rowwise_adagrad(void **state) {
  (void)state;
  run_all(EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
}

static void test_adam(void **state) {
  (void)state;
  run_all(EMBPS_OPTIMIZER_ADAM);
}

static void test_decay_from_half_life(void **state) {
  (void)state;
  assert_true(embps_opt_decay_from_half_life(0.0f) == 1.0f);
  assert_true(embps_opt_decay_from_half_life(-5.0f) == 1.0f);
  assert_true(embps_opt_decay_from_half_life(NAN) == 1.0f);
  assert_true(embps_opt_decay_from_half_life(1.0f) == 0.5f);
  float hls[] = {0.5f, 2.0f, 10.0f, 1000.0f, 1e6f};
  for (int i = 0; i < 5; i++) {
    double want = exp(-log(2.0) / hls[i]);
    float got = embps_opt_decay_from_half_life(hls[i]);
    assert_true(fabs(got - want) <= 6e-8 * want);
    /* After half_life steps the accumulator has halved (as far as an f32 decay can say:
     * its rounding, 3e-8, is multiplied by the half-life). */
    if (hls[i] <= 1000.0f)
      assert_true(fabs(pow(got, hls[i]) - 0.5) < 1e-4);
  }
}

/* Small hand-computed cases, independent of the long runs. */
static void test_single_steps(void **state) {
  (void)state;
  embps_opt_params_t p = {
      .lr = 0.5f, .eps = 0.0f, .decay = 1.0f, .beta1 = 0.5f, .beta2 = 0.75f, .step = 1};
  float table[3 * 2] = {0, 0, 1, 2, 3, 4};
  int64_t rows[1] = {2};
  float g[2] = {2.0f, -4.0f};

  embps_update_sgd_cpu(table, EMBPS_DTYPE_F32, 2, rows, 1, g, &p);
  assert_true(table[4] == 2.0f && table[5] == 6.0f && table[2] == 1.0f && table[0] == 0.0f);

  float acc[3 * 2] = {0, 0, 0, 0, 0, 0};
  embps_update_adagrad_cpu(table, EMBPS_DTYPE_F32, 2, rows, 1, g, acc, &p);
  /* a = g^2; w -= 0.5 * g / |g| */
  assert_true(acc[4] == 4.0f && acc[5] == 16.0f);
  assert_true(table[4] == 1.5f && table[5] == 6.5f);

  /* rowwise: full width 4, row_sumsq 20 => a = 5 */
  float racc[3] = {0, 0, 3.0f};
  float rsum[1] = {20.0f};
  p.decay = 0.5f; /* a = 3*0.5 + 5 = 6.5 */
  embps_update_rowwise_adagrad_cpu(table, EMBPS_DTYPE_F32, 2, rows, 1, g, rsum, 4, racc, &p);
  assert_true(racc[2] == 6.5f && racc[0] == 0.0f);
  assert_true(fabs(table[4] - (1.5 - 0.5 * 2.0 / sqrt(6.5))) < 1e-6);

  /* adam, step 1: mhat = g, vhat = g^2, so w -= lr * sign(g) */
  float m[6] = {0}, v[6] = {0};
  float w4 = table[4], w5 = table[5];
  embps_update_adam_cpu(table, EMBPS_DTYPE_F32, 2, rows, 1, g, m, v, &p);
  assert_true(m[4] == 1.0f && m[5] == -2.0f && v[4] == 1.0f && v[5] == 4.0f);
  assert_true(fabs(table[4] - (w4 - 0.5f)) < 1e-6 && fabs(table[5] - (w5 + 0.5f)) < 1e-6);

  /* bf16 storage rounds to nearest even: 1 - 2^-9 is halfway between 1 - 2^-8 and 1. */
  uint16_t tb[2] = {embps_f32_to_bf16(1.0f), embps_f32_to_bf16(1.0f)};
  int64_t r0[1] = {0};
  float gb[2] = {0x1p-9f, 0x1p-9f * 3.0f}; /* lr 1: 1 - 2^-9 (tie -> even = 1), 1 - 3*2^-9 */
  p.lr = 1.0f;
  embps_update_sgd_cpu(tb, EMBPS_DTYPE_BF16, 2, r0, 1, gb, &p);
  assert_true(embps_bf16_to_f32(tb[0]) == 1.0f);
  assert_true(embps_bf16_to_f32(tb[1]) == 1.0f - 0x1p-7f); /* tie between 1-2^-8, 1-2^-7 */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decay_from_half_life),
      cmocka_unit_test(test_single_steps),
      cmocka_unit_test(test_sgd),
      cmocka_unit_test(test_adagrad),
      cmocka_unit_test(test_rowwise_adagrad),
      cmocka_unit_test(test_adam),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
