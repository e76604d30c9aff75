/* The manifest (server/store/ckpt_manifest.c): written and read back field for field, every
 * flipped byte caught (the version as another version, the rest as loss), truncated and
 * overlong files refused, and a write into a missing directory leaving nothing. */
#include "tests/unit/store/ckpt_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/byteorder.h"

static void expect_same_config(const embps_table_config_t *a, const embps_table_config_t *b) {
  assert_string_equal(a->name, b->name);
  assert_int_equal(a->rows, b->rows);
  assert_int_equal(a->emb_width, b->emb_width);
  assert_int_equal(a->dtype, b->dtype);
  assert_int_equal(a->seed, b->seed);
  assert_int_equal(a->optimizer, b->optimizer);
  assert_memory_equal(&a->init_scale, &b->init_scale, sizeof(float));
  assert_memory_equal(&a->lr, &b->lr, sizeof(float));
  assert_memory_equal(&a->eps, &b->eps, sizeof(float));
  assert_memory_equal(&a->half_life, &b->half_life, sizeof(float));
  assert_memory_equal(&a->initial_accumulator, &b->initial_accumulator, sizeof(float));
  assert_memory_equal(&a->weight_decay, &b->weight_decay, sizeof(float));
  assert_memory_equal(&a->beta1, &b->beta1, sizeof(float));
  assert_memory_equal(&a->beta2, &b->beta2, sizeof(float));
}

static void make_manifest(manifest_buf_t *mb) {
  static const char *names[] = {"emb_user", "emb_item"};
  embps_error_t err;
  memset(mb, 0, sizeof(*mb));
  for (size_t t = 0; t < 2; t++) {
    embps_table_config_t *c = &mb->tables[t];
    strcpy(c->name, names[t]);
    c->rows = UINT64_C(5000000000) + t;
    c->emb_width = 96;
    c->dtype = t ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
    c->optimizer = t ? EMBPS_OPTIMIZER_ADAM : EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
    c->seed = UINT64_C(0x123456789abcdef0) + t;
    c->lr = 0.05f + (float)t;
    c->weight_decay = 1e-4f;
    c->half_life = 3.5f;
    assert_int_equal(embps_table_config_resolve(c, 3, UINT64_C(1) << 62, &err), EMBPS_OK);
  }
  for (size_t i = 0; i < 6; i++) {
    mb->files[i].rank = (uint32_t)(i % 3);
    strcpy(mb->files[i].table, names[i / 3]);
    mb->files[i].bytes = UINT64_C(1) << (20 + i);
    mb->m.bytes += mb->files[i].bytes;
  }
  mb->m.round = UINT64_C(0x1234567890);
  mb->m.base_round = 77;
  mb->m.time_ms = UINT64_C(1712345678901);
  mb->m.group_size = 3;
  strcpy(mb->m.scope, "emb_item");
  mb->m.num_tables = 2;
  mb->m.tables = mb->tables;
  mb->m.num_files = 6;
  mb->m.files = mb->files;
}

static embps_status_t read_manifest_status(const char *ck, embps_error_t *err) {
  embps_ckpt_manifest_t m;
  embps_status_t st = embps_ckpt_read_manifest(ck, &m, err);
  embps_ckpt_manifest_free(&m);
  return st;
}

static void test_manifest(void **state) {
  const fixture_t *fx = *state;
  char ck[EMBPS_CKPT_PATH_MAX], path[EMBPS_CKPT_PATH_MAX + 16];
  manifest_buf_t mb;
  embps_ckpt_manifest_t got;
  embps_error_t err;
  uint8_t *orig;
  size_t len;

  make_manifest(&mb);
  snprintf(ck, sizeof(ck), "%s/ck", fx->dir);
  snprintf(path, sizeof(path), "%s/MANIFEST", ck);
  /* none yet, and none in a directory that does not exist */
  assert_int_equal(mkdir(ck, 0755), 0);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_NOT_FOUND);
  assert_true(has(err.message, ck));
  snprintf(path, sizeof(path), "%s/missing", fx->dir);
  assert_int_equal(read_manifest_status(path, &err), EMBPS_NOT_FOUND);
  snprintf(path, sizeof(path), "%s/MANIFEST", ck);

  mb.m.format_version = 99; /* written as this build's version whatever it says */
  assert_int_equal(embps_ckpt_write_manifest(ck, &mb.m, &err), EMBPS_OK);
  expect_dir(ck, "MANIFEST");
  assert_int_equal(embps_ckpt_read_manifest(ck, &got, &err), EMBPS_OK);
  assert_int_equal(got.format_version, EMBPS_CKPT_FORMAT_VERSION);
  assert_int_equal(got.round, mb.m.round);
  assert_int_equal(got.base_round, mb.m.base_round);
  assert_int_equal(got.time_ms, mb.m.time_ms);
  assert_int_equal(got.group_size, mb.m.group_size);
  assert_string_equal(got.scope, mb.m.scope);
  assert_int_equal(got.bytes, mb.m.bytes);
  assert_int_equal(got.num_tables, 2);
  for (size_t t = 0; t < 2; t++)
    expect_same_config(&got.tables[t], &mb.tables[t]);
  assert_int_equal(got.num_files, 6);
  for (size_t i = 0; i < 6; i++) {
    assert_int_equal(got.files[i].rank, mb.files[i].rank);
    assert_string_equal(got.files[i].table, mb.files[i].table);
    assert_int_equal(got.files[i].bytes, mb.files[i].bytes);
  }
  embps_ckpt_manifest_free(&got);
  assert_null(got.tables);
  assert_int_equal(got.num_files, 0);

  /* every single flipped byte is caught: the version as another version, the rest as loss */
  orig = slurp(path, &len);
  assert_true(len > 16 + 4);
  assert_int_equal(embps_get_le32(orig + 12) + 20, len); /* "body bytes" as documented */
  for (size_t i = 0; i < len; i++) {
    embps_status_t st;
    flip_byte(path, i);
    st = read_manifest_status(ck, &err);
    flip_byte(path, i);
    if (st != (i >= 8 && i < 12 ? EMBPS_FAILED_PRECONDITION : EMBPS_DATA_LOSS))
      fail_msg("manifest byte %zu flipped: %s (%s)", i, embps_status_name(st), err.message);
  }
  flip_byte(path, len / 2);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, path));
  assert_true(has(err.message, "crc32"));
  flip_byte(path, len / 2);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_OK);

  /* another version, named */
  set_byte(path, 8, 3);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, "version 3"));
  assert_true(has(err.message, "reads versions 1 to 2"));
  set_byte(path, 8, orig[8]);

  /* truncated anywhere, or longer than it says */
  for (size_t keep = 0; keep < len; keep += (keep < 24 ? 1 : 37)) {
    assert_int_equal(truncate(path, (off_t)keep), 0);
    assert_int_equal(read_manifest_status(ck, &err), EMBPS_DATA_LOSS);
    assert_true(has(err.message, path));
    assert_true(has(err.message, "truncated"));
    {
      FILE *f = fopen(path, "wb");
      assert_non_null(f);
      assert_int_equal(fwrite(orig, 1, len, f), len);
      fclose(f);
    }
  }
  assert_int_equal(truncate(path, (off_t)len - 1), 0);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_DATA_LOSS);
  assert_int_equal(truncate(path, (off_t)len + 1), 0);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "overlong"));
  free(orig);

  /* into a directory that does not exist: an error, nothing left anywhere */
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_not_equal(embps_ckpt_write_manifest(path, &mb.m, &err), EMBPS_OK);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "ck");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_manifest),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
