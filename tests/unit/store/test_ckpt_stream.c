/* A table streamed whole and in order from a checkpoint (server/store/ckpt_stream.c, what `embps
 * export` reads): every optimizer and dtype written by 1 to 4 ranks, read in chunks of uneven
 * sizes, equal to the table bit for bit, data and state; single-rank full slices read in place
 * by whole blocks; incremental chains (a table created since, one whose first checkpoint is
 * incremental); a corrupt block, a cut file and reads past the end refused, naming the file and
 * the block. */
#include "tests/unit/store/ckpt_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/store/ckpt_stream.h"

/* Reads table s of checkpoint `round` in dir through a stream, in chunks of the given sizes
 * (cycled; 0: the stream's own chunk), and expects every row, data and state, to be s's. */
static void expect_stream(const char *dir, uint64_t round, const source_t *s,
                          const uint64_t *chunks, size_t nchunks) {
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_ckpt_stream_t *st = NULL;
  embps_error_t err;
  const uint64_t rows = s->cfg.rows, w = s->cfg.emb_width;
  uint8_t *data = malloc(rows * w * s->esz + 1);
  float *s0 = malloc(rows * (s->s0_cols ? s->s0_cols : 1) * sizeof(float));
  float *s1 = malloc(rows * (s->s1_cols ? s->s1_cols : 1) * sizeof(float));
  uint64_t pos = 0;

  ckpt_dir(ck, sizeof(ck), dir, round);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  assert_int_equal(embps_ckpt_stream_open(dir, &m, s->cfg.name, &st, &err), EMBPS_OK);
  assert_int_equal(embps_ckpt_stream_rows(st), rows);
  assert_int_equal(embps_ckpt_stream_step(st), s->step);
  assert_true(embps_ckpt_stream_config(st)->emb_width == w);
  for (size_t k = 0; pos < rows; k++) {
    uint64_t n = chunks[k % nchunks] ? chunks[k % nchunks] : embps_ckpt_stream_chunk_rows(st, 4096);
    if (n > rows - pos)
      n = rows - pos;
    assert_int_equal(embps_ckpt_stream_read(st, n, data + pos * w * s->esz,
                                            s->s0_cols ? s0 + pos * s->s0_cols : NULL,
                                            s->s1_cols ? s1 + pos * s->s1_cols : NULL, &err),
                     EMBPS_OK);
    pos += n;
  }
  assert_int_equal(embps_ckpt_stream_bytes_read(st), embps_ckpt_stream_bytes(st));
  assert_memory_equal(data, s->data, rows * w * s->esz);
  if (s->s0_cols)
    assert_memory_equal(s0, s->state0, rows * s->s0_cols * sizeof(float));
  if (s->s1_cols)
    assert_memory_equal(s1, s->state1, rows * s->s1_cols * sizeof(float));
  /* nothing is left to read */
  assert_int_equal(embps_ckpt_stream_read(st, 1, data, NULL, NULL, &err), EMBPS_INVALID_ARGUMENT);
  embps_ckpt_stream_close(st);
  embps_ckpt_manifest_free(&m);
  free(data);
  free(s0);
  free(s1);
}

static void test_full_any_group_size(void **state) {
  const fixture_t *fx = *state;
  static const uint64_t uneven[] = {1, 7, 4093, 30000}, own[] = {0};
  for (size_t o = 0; o < 4; o++)
    for (size_t d = 0; d < 2; d++)
      for (uint32_t g = 1; g <= 4; g++) {
        char dir[128];
        source_t s;
        /* sgd f32 on one rank: 48 bytes a row, 21845 rows a block: three blocks */
        source_init(&s, "t", 50000, 12, dtypes[d], optimizers[o]);
        source_fill(&s, 100 + o * 10 + d, NULL);
        snprintf(dir, sizeof(dir), "%s/o%zud%zug%u", fx->dir, o, d, g);
        assert_int_equal(mkdir(dir, 0755), 0);
        write_full(dir, 5, g, &s);
        expect_stream(dir, 5, &s, uneven, 4);
        expect_stream(dir, 5, &s, own, 1); /* g == 1: whole blocks, read in place */
        source_free(&s);
      }
}

static void test_incremental_chain(void **state) {
  const fixture_t *fx = *state;
  static const uint64_t rows20[] = {0, 60, 61, 62, 63, 64, 65, 100, 199}, rows30[] = {5, 63, 199};
  static const uint64_t chunks[] = {3, 64, 1000};
  source_t t, fresh, late;
  uint64_t *d20 = dirty_map(200, rows20, sizeof(rows20) / sizeof(rows20[0]));
  uint64_t *d30 = dirty_map(200, rows30, sizeof(rows30) / sizeof(rows30[0]));
  uint64_t *fresh_all = dirty_range(130, 0, 129), *fresh30 = dirty_range(130, 3, 70);
  uint64_t *late_part = dirty_range(90, 0, 88);
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_ckpt_stream_t *st = NULL;
  embps_error_t err;

  source_init(&t, "t", 200, 12, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAM);
  source_init(&fresh, "fresh", 130, 12, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  source_init(&late, "late", 90, 12, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&t, 10, NULL);
  write_full(fx->dir, 10, 2, &t);
  source_fill(&t, 20, d20);
  source_fill(&fresh, 21, NULL);
  {
    const source_t *tabs[2] = {&t, &fresh};
    const uint64_t *dirty[2] = {d20, fresh_all};
    write_ckpt(fx->dir, 20, 10, "", 2, tabs, dirty, 2);
  }
  expect_stream(fx->dir, 20, &t, chunks, 3);
  source_fill(&t, 30, d30);
  source_fill(&fresh, 31, fresh30);
  source_fill(&late, 32, NULL);
  {
    const source_t *tabs[3] = {&t, &fresh, &late};
    const uint64_t *dirty[3] = {d30, fresh30, late_part};
    write_ckpt(fx->dir, 30, 20, "", 3, tabs, dirty, 3); /* another group size on the chain */
  }
  expect_stream(fx->dir, 30, &t, chunks, 3);
  expect_stream(fx->dir, 30, &fresh, chunks, 3);
  /* a table whose first checkpoint is incremental must have all its rows there */
  ckpt_dir(ck, sizeof(ck), fx->dir, 30);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  assert_int_equal(embps_ckpt_stream_open(fx->dir, &m, "late", &st, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "does not hold all"));
  assert_int_equal(embps_ckpt_stream_open(fx->dir, &m, "nope", &st, &err), EMBPS_NOT_FOUND);
  assert_true(has(err.message, "no table 'nope'"));
  assert_null(st);
  embps_ckpt_manifest_free(&m);
  source_free(&t);
  source_free(&fresh);
  source_free(&late);
  free(d20);
  free(d30);
  free(fresh_all);
  free(fresh30);
  free(late_part);
}

/* Opens table t of checkpoint 5 in dir and reads it whole in chunks of `chunk` rows (0: the
 * stream's own, whole blocks of a single-rank slice read in place); returns the first failure's
 * status (err set). */
static embps_status_t read_chunks(const char *dir, uint64_t rows, size_t row_bytes, uint64_t chunk,
                                  embps_error_t *err) {
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_ckpt_stream_t *st = NULL;
  uint8_t *buf = malloc(rows * row_bytes);
  embps_status_t ret;
  ckpt_dir(ck, sizeof(ck), dir, 5);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, err), EMBPS_OK);
  ret = embps_ckpt_stream_open(dir, &m, "t", &st, err);
  if (ret == EMBPS_OK && !chunk)
    chunk = embps_ckpt_stream_chunk_rows(st, 1u << 20);
  for (uint64_t pos = 0; ret == EMBPS_OK && pos < rows; pos += chunk)
    ret = embps_ckpt_stream_read(st, rows - pos < chunk ? rows - pos : chunk, buf, NULL, NULL, err);
  embps_ckpt_stream_close(st);
  embps_ckpt_manifest_free(&m);
  free(buf);
  return ret;
}

/* Reads as read_chunks, in chunks of 1000 rows and of the stream's own; both must give `want`. */
static embps_status_t read_whole(const char *dir, uint64_t rows, size_t row_bytes,
                                 embps_error_t *err) {
  embps_error_t own;
  embps_status_t a = read_chunks(dir, rows, row_bytes, 1000, err);
  assert_int_equal(read_chunks(dir, rows, row_bytes, 0, &own), a);
  if (a != EMBPS_OK)
    assert_string_equal(own.message, err->message);
  return a;
}

static void test_corrupt_and_cut(void **state) {
  const fixture_t *fx = *state;
  for (uint32_t g = 1; g <= 2; g++) {
    char dir[128], path[EMBPS_CKPT_PATH_MAX + 200], want[64];
    source_t s;
    size_t n;
    uint8_t *orig;
    uint32_t hlen, nbytes0;
    embps_error_t err;
    snprintf(dir, sizeof(dir), "%s/g%u", fx->dir, g);
    assert_int_equal(mkdir(dir, 0755), 0);
    source_init(&s, "t", 70000, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
    source_fill(&s, 3, NULL);
    write_full(dir, 5, g, &s);
    slice_path(path, sizeof(path), dir, 5, g - 1, "t");
    orig = slurp(path, &n);
    hlen = (uint32_t)orig[12] | (uint32_t)orig[13] << 8;
    nbytes0 = (uint32_t)orig[hlen + 12] | (uint32_t)orig[hlen + 13] << 8 |
              (uint32_t)orig[hlen + 14] << 16 | (uint32_t)orig[hlen + 15] << 24;
    /* a byte inside block 1's payload */
    flip_byte(path, hlen + 20 + nbytes0 + 20 + 100);
    assert_int_equal(read_whole(dir, 70000, 8 * 4, &err), EMBPS_DATA_LOSS);
    assert_true(has(err.message, path));
    assert_true(has(err.message, "block 1 (rows"));
    assert_true(has(err.message, "fails its crc32"));
    /* the file cut inside block 1 */
    restore_file(path, orig, hlen + 20 + nbytes0 + 20 + 100);
    assert_int_equal(read_whole(dir, 70000, 8 * 4, &err), EMBPS_DATA_LOSS);
    assert_true(has(err.message, path));
    snprintf(want, sizeof(want), "it ends in block 1, rows");
    assert_true(has(err.message, want));
    /* the trailer corrupt: found once the last row is read */
    restore_file(path, orig, n);
    flip_byte(path, n - 10);
    assert_int_equal(read_whole(dir, 70000, 8 * 4, &err), EMBPS_DATA_LOSS);
    assert_true(has(err.message, "trailer"));
    restore_file(path, orig, n);
    assert_int_equal(read_whole(dir, 70000, 8 * 4, &err), EMBPS_OK);
    free(orig);
    source_free(&s);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_full_any_group_size),
      T(test_incremental_chain),
      T(test_corrupt_and_cut),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
