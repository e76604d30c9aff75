/* The rows an Assign writes (kernels/assign.c and its CUDA twin's simulated launcher, which the
 * CUDA engine runs on in every build): through the simulated runtime, each row of the table
 * becomes its source row bit for bit (f32 and bf16, a NaN's payload included, source rows
 * repeated), the optimizer state of the rows becomes the initial state when asked (state0 per
 * row or per element, state1 zeroed) and stays otherwise, other rows stay; both against a loop
 * written here. The launcher returns the real one's statuses for bad arguments. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "kernels/cuda/embps_kernels_cuda.h"
#include "sim_cuda.h"

#define ROWS 16
#define SRC 8
#define N 5
#define MAXW 40

static void *dev_upload(const void *h, size_t bytes) {
  void *d = NULL;
  assert_int_equal(cudaMalloc(&d, bytes), cudaSuccess);
  assert_int_equal(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

static void download(void *h, const void *d, size_t bytes) {
  assert_int_equal(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

static void check(embps_dtype_t dtype, size_t width, size_t s0w, int with_s1, int reset) {
  const size_t es = embps_dtype_size(dtype), rb = width * es;
  static const int64_t rows[N] = {3, 0, 15, 7, 8}, src_rows[N] = {1, 1, 7, 0, 5};
  unsigned char table[ROWS * MAXW * 4], src[SRC * MAXW * 4], want[ROWS * MAXW * 4],
      got[ROWS * MAXW * 4];
  float s0[ROWS * MAXW], s1[ROWS * MAXW], w0[ROWS * MAXW], w1[ROWS * MAXW], g0[ROWS * MAXW],
      g1[ROWS * MAXW];
  const float v0 = 0.25f;
  for (size_t k = 0; k < ROWS * rb; k++)
    table[k] = (unsigned char)(k * 7 + 3);
  for (size_t k = 0; k < SRC * rb; k++)
    src[k] = (unsigned char)(k * 11 + 5); /* any bits: NaNs with payloads among them */
  for (size_t k = 0; k < ROWS * width; k++)
    s0[k] = 1.0f + (float)k, s1[k] = -2.0f - (float)k;
  memcpy(want, table, ROWS * rb);
  memcpy(w0, s0, sizeof(s0));
  memcpy(w1, s1, sizeof(s1));
  for (size_t i = 0; i < N; i++) {
    memcpy(want + rows[i] * rb, src + src_rows[i] * rb, rb);
    for (size_t j = 0; reset && j < s0w; j++)
      w0[rows[i] * s0w + j] = v0;
    for (size_t j = 0; reset && with_s1 && j < width; j++)
      w1[rows[i] * width + j] = 0.0f;
  }
  void *d_table = dev_upload(table, ROWS * rb), *d_src = dev_upload(src, SRC * rb);
  int64_t *d_rows = dev_upload(rows, sizeof(rows)),
          *d_src_rows = dev_upload(src_rows, sizeof(rows));
  float *d_s0 = dev_upload(s0, sizeof(s0)), *d_s1 = dev_upload(s1, sizeof(s1));
  assert_int_equal(embps_assign_rows_cuda(d_table, dtype, width, d_rows, d_src_rows, N, d_src,
                                          reset && s0w ? d_s0 : NULL, reset ? s0w : 0,
                                          reset && with_s1 ? d_s1 : NULL, v0, 0),
                   EMBPS_OK);
  download(got, d_table, ROWS * rb);
  download(g0, d_s0, sizeof(s0));
  download(g1, d_s1, sizeof(s1));
  assert_memory_equal(got, want, ROWS * rb);
  assert_memory_equal(g0, w0, sizeof(s0));
  assert_memory_equal(g1, w1, sizeof(s1));
  cudaFree(d_table), cudaFree(d_src), cudaFree(d_rows), cudaFree(d_src_rows);
  cudaFree(d_s0), cudaFree(d_s1);
}

static void test_rows_and_state(void **state) {
  (void)state;
  for (int reset = 0; reset <= 1; reset++) {
    check(EMBPS_DTYPE_F32, 8, 1, 0, reset);    /* rowwise Adagrad's one per row */
    check(EMBPS_DTYPE_F32, 5, 5, 0, reset);    /* Adagrad's one per element */
    check(EMBPS_DTYPE_BF16, 12, 12, 1, reset); /* Adam's two */
    check(EMBPS_DTYPE_BF16, 3, 0, 0, reset);   /* SGD's none, an odd width */
    check(EMBPS_DTYPE_F32, MAXW, MAXW, 1, reset);
  }
}

static void test_statuses(void **state) {
  int64_t *d = NULL;
  float *f = NULL;
  (void)state;
  assert_int_equal(cudaMalloc((void **)&d, 64), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&f, 64), cudaSuccess);
  assert_int_equal(embps_assign_rows_cuda(f, (embps_dtype_t)9, 2, d, d, 1, f, NULL, 0, NULL, 0, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_assign_rows_cuda(f, EMBPS_DTYPE_F32, 4, d, d, 1, f, f, 3, NULL, 0, 0),
                   EMBPS_INVALID_ARGUMENT); /* state0 of neither 1 nor the width */
  assert_int_equal(
      embps_assign_rows_cuda(f, EMBPS_DTYPE_F32, 2, NULL, d, 1, f, NULL, 0, NULL, 0, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_assign_rows_cuda(f, EMBPS_DTYPE_F32, 2, d, d, 0, f, NULL, 0, NULL, 0, 0),
                   EMBPS_OK); /* nothing to do */
  cudaFree(d), cudaFree(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rows_and_state),
      cmocka_unit_test(test_statuses),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
