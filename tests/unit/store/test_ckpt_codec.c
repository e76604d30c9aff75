/* The checkpoint codec (server/store/ckpt_codec.c): the byte layouts it documents, field by
 * field at their offsets, the crc32 it names (zlib's), round trips of headers, blocks, trailers
 * and manifests, and the refusals of what does not decode. The other checkpoint tests go through
 * the public face; these pin the format itself, so a field moved by accident fails here by
 * name. */
#include "tests/unit/store/ckpt_fixture.h"

#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "server/store/ckpt_internal.h"
#include "tests/unit/common/table_fields_fixture.h"

TABLE_FIELDS_FIXTURE(config, embps_table_config_t)

static embps_table_config_t spec(const char *name, embps_optimizer_t opt, embps_dtype_t dtype) {
  embps_table_config_t c;
  embps_error_t err;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, name);
  c.rows = UINT64_C(5000000001);
  c.emb_width = 96;
  c.dtype = dtype;
  c.optimizer = opt;
  c.seed = UINT64_C(0x123456789abcdef0);
  c.lr = 0.25f;
  c.weight_decay = 1e-4f;
  assert_int_equal(embps_table_config_resolve(&c, 3, UINT64_C(1) << 62, &err), EMBPS_OK);
  return c;
}

static void test_crc(void **state) {
  uint8_t x[4];
  (void)state;
  /* the check value of the gzip/zlib crc32 */
  assert_int_equal(embps__ckpt_crc(0, "123456789", 9), 0xcbf43926u);
  /* continued over two parts as over one */
  assert_int_equal(embps__ckpt_crc(embps__ckpt_crc(0, "1234", 4), "56789", 5), 0xcbf43926u);
  /* the trailer sums each block's crc32 as a little-endian u32 */
  embps_put_le32(x, 0xdeadbeefu);
  assert_int_equal(embps__ckpt_blocks_crc_add(7, 0xdeadbeefu), embps__ckpt_crc(7, x, 4));
}

static void test_row_and_block_sizes(void **state) {
  size_t rb[3];
  embps_table_config_t c;
  (void)state;
  c = spec("a", EMBPS_OPTIMIZER_ADAM, EMBPS_DTYPE_F32);
  embps__ckpt_row_bytes(&c, 12, rb);
  assert_int_equal(rb[0], 48);
  assert_int_equal(rb[1], 48);
  assert_int_equal(rb[2], 48);
  c = spec("r", EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_DTYPE_BF16);
  embps__ckpt_row_bytes(&c, 12, rb);
  assert_int_equal(rb[0], 24);
  assert_int_equal(rb[1], 4); /* one accumulator per row */
  assert_int_equal(rb[2], 0);
  c = spec("g", EMBPS_OPTIMIZER_ADAGRAD, EMBPS_DTYPE_F32);
  embps__ckpt_row_bytes(&c, 12, rb);
  assert_int_equal(rb[1], 48);
  assert_int_equal(rb[2], 0);
  c = spec("s", EMBPS_OPTIMIZER_SGD, EMBPS_DTYPE_F32);
  embps__ckpt_row_bytes(&c, 12, rb);
  assert_int_equal(rb[0], 48);
  assert_int_equal(rb[1] + rb[2], 0);
  /* floor(1 MiB / a row's payload), at least 1 */
  assert_int_equal(embps__ckpt_rows_per_block(1), BLOCK_BYTES);
  assert_int_equal(embps__ckpt_rows_per_block(96 * 4 * 3), 910);
  assert_int_equal(embps__ckpt_rows_per_block(BLOCK_BYTES - 1), 1);
  assert_int_equal(embps__ckpt_rows_per_block(BLOCK_BYTES), 1);
  assert_int_equal(embps__ckpt_rows_per_block(3 * BLOCK_BYTES), 1);
}

static void test_header(void **state) {
  embps__ckpt_header_t h, got;
  embps_error_t err;
  uint8_t *p = NULL;
  size_t len = 0;
  (void)state;
  memset(&h, 0, sizeof(h));
  h.rank = 2;
  h.group_size = 3;
  h.col_begin = 64;
  h.shard_width = 32;
  h.round = UINT64_C(0x1122334455667788);
  h.step = 99;
  h.base_round = 77;
  h.blocks = 5;
  h.rows_written = 4000;
  h.config = spec("emb_user", EMBPS_OPTIMIZER_ADAM, EMBPS_DTYPE_BF16);
  assert_int_equal(embps__ckpt_header_encode(&h, &p, &len), 0);
  assert_non_null(p);
  /* the documented layout */
  assert_memory_equal(p, "EMBPSCKP", 8);
  assert_int_equal(embps_get_le32(p + 8), EMBPS_CKPT_FORMAT_VERSION);
  assert_int_equal(embps_get_le32(p + 12), len);
  assert_int_equal(embps_get_le32(p + 16), 2);
  assert_int_equal(embps_get_le32(p + 20), 3);
  assert_int_equal(embps_get_le32(p + 24), 64);
  assert_int_equal(embps_get_le32(p + 28), 32);
  assert_int_equal(embps_get_le64(p + 32), h.round);
  assert_int_equal(embps_get_le64(p + 40), 99);
  assert_int_equal(embps_get_le64(p + 48), 77);
  assert_int_equal(embps_get_le64(p + 56), 5);
  assert_int_equal(embps_get_le64(p + 64), 4000);
  assert_int_equal(embps_get_le32(p + 72), strlen("emb_user")); /* the spec's name */
  assert_memory_equal(p + 76, "emb_user", 8);
  assert_int_equal(embps_get_le64(p + 84), h.config.rows);
  assert_int_equal(embps_get_le32(p + len - 4), embps__ckpt_crc(0, p, len - 4));
  assert_true(len <= EMBPS__CKPT_HEADER_MAX);
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_SLICE_MAGIC, "f", &err), EMBPS_OK);

  memset(&got, 0xa5, sizeof(got));
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), 0);
  assert_int_equal(got.rank, 2);
  assert_int_equal(got.group_size, 3);
  assert_int_equal(got.col_begin, 64);
  assert_int_equal(got.shard_width, 32);
  assert_int_equal(got.round, h.round);
  assert_int_equal(got.step, 99);
  assert_int_equal(got.base_round, 77);
  assert_int_equal(got.blocks, 5);
  assert_int_equal(got.rows_written, 4000);
  assert_true(embps__ckpt_same_config(&got.config, &h.config));
  got.config.lr = 0.5f;
  assert_false(embps__ckpt_same_config(&got.config, &h.config));

  /* fields that do not fill the header exactly: one byte short, or a name past the end */
  assert_int_equal(embps__ckpt_header_decode(p, len - 1, &got), -1);
  embps_put_le32(p + 72, 60);
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), -1);
  embps_put_le32(p + 72, EMBPS_TABLE_NAME_MAX);
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), -1);

  /* another magic, another version */
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_MANIFEST_MAGIC, "f", &err),
                   EMBPS_DATA_LOSS);
  assert_true(has(err.message, "bad magic"));
  embps_put_le32(p + 8, EMBPS_CKPT_FORMAT_VERSION + 1);
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_SLICE_MAGIC, "f", &err),
                   EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, "version 3"));
  assert_true(has(err.message, "reads versions 1 to 2"));
  embps_put_le32(p + 8, 0);
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_SLICE_MAGIC, "f", &err),
                   EMBPS_FAILED_PRECONDITION);
  embps_put_le32(p + 8, 1); /* the previous release's: still read */
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_SLICE_MAGIC, "f", &err), EMBPS_OK);
  embps_free(p);
}

/* The bytes of a version 1 file from those of this build's (version 2) with one table spec at
 * `spec` (its settings' offset): the version set to 1 and the settings appended in version 2 cut
 * out, as the previous release wrote them. The caller fixes lengths and checksums. */
static size_t as_version_1(uint8_t *p, size_t len, size_t spec) {
  const size_t cut = TABLE_FIELDS_LAYOUT_BYTES - TABLE_FIELDS_LAYOUT_V1_BYTES;
  embps_put_le32(p + 8, 1);
  memmove(p + spec + TABLE_FIELDS_LAYOUT_V1_BYTES, p + spec + TABLE_FIELDS_LAYOUT_BYTES,
          len - spec - TABLE_FIELDS_LAYOUT_BYTES);
  return len - cut;
}

/* A version 1 slice header and manifest (a dense table's spec ending at beta2) decode with the
 * hash-keyed settings 0 and every other setting as written; a version 2 reader that read them as
 * version 2 would find them malformed. */
static void test_version_1_specs(void **state) {
  embps__ckpt_header_t h, got;
  embps_ckpt_manifest_t m, got_m;
  embps_table_config_t c, want;
  embps_error_t err;
  uint8_t *p = NULL;
  size_t len = 0;
  (void)state;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "settings");
  config_fill(&c);
  want = c;
#define ZERO_HASH_SETTING(field, type, wire, message, pb_field)                                    \
  memset(&want.field, 0, sizeof(want.field));
  EMBPS_TABLE_FIELDS_HASH(ZERO_HASH_SETTING)
#undef ZERO_HASH_SETTING

  memset(&h, 0, sizeof(h));
  h.config = c;
  h.rank = 1;
  h.group_size = 2;
  assert_int_equal(embps__ckpt_header_encode(&h, &p, &len), 0);
  len = as_version_1(p, len, 84);
  embps_put_le32(p + 12, (uint32_t)len);
  embps_put_le32(p + len - 4, embps__ckpt_crc(0, p, len - 4));
  assert_int_equal(embps__ckpt_check_preamble(p, EMBPS__CKPT_SLICE_MAGIC, "f", &err), EMBPS_OK);
  memset(&got, 0xa5, sizeof(got));
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), 0);
  assert_int_equal(got.rank, 1);
  assert_int_equal(got.group_size, 2);
  assert_string_equal(got.config.name, "settings");
  config_assert_same(&got.config, &want);
  embps_put_le32(p + 8, 2); /* the same bytes read as version 2 are short */
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), -1);
  embps_free(p);

  memset(&m, 0, sizeof(m));
  m.group_size = 1;
  m.num_tables = 1;
  m.tables = &c;
  assert_int_equal(embps__ckpt_manifest_encode(&m, &p, &len), 0);
  len = as_version_1(p, len, 72);
  embps_put_le32(p + 12, (uint32_t)(len - 20));
  embps_put_le32(p + len - 4, embps__ckpt_crc(0, p, len - 4));
  memset(&got_m, 0, sizeof(got_m));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got_m, &err), EMBPS_OK);
  assert_int_equal(got_m.format_version, 1);
  assert_int_equal(got_m.num_tables, 1);
  config_assert_same(&got_m.tables[0], &want);
  embps_ckpt_manifest_free(&got_m);
  embps_free(p);
}

/* Every table setting at its documented offset after the name, in a slice header and in a
 * manifest, and back: each setting holds a value no other has, so one forgotten, moved or read
 * into another's place fails here by name. */
static void test_config_settings(void **state) {
  embps__ckpt_header_t h, got;
  embps_ckpt_manifest_t m, got_m;
  embps_table_config_t c;
  embps_error_t err;
  uint8_t *p = NULL;
  size_t len = 0;
  (void)state;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "settings");
  config_fill(&c);
  memset(&h, 0, sizeof(h));
  h.config = c;
  assert_int_equal(embps__ckpt_header_encode(&h, &p, &len), 0);
  assert_int_equal(embps_get_le32(p + 72), 8);
  assert_memory_equal(p + 76, "settings", 8);
  assert_table_fields_bytes(p + 84, &c);
  assert_int_equal(len, 84 + TABLE_FIELDS_LAYOUT_BYTES + 4);
  memset(&got, 0xa5, sizeof(got));
  assert_int_equal(embps__ckpt_header_decode(p, len, &got), 0);
  assert_string_equal(got.config.name, "settings");
  config_assert_same(&got.config, &c);
  assert_true(embps__ckpt_same_config(&got.config, &c));
  embps_free(p);

  memset(&m, 0, sizeof(m));
  m.group_size = 1;
  m.num_tables = 1;
  m.tables = &c;
  assert_int_equal(embps__ckpt_manifest_encode(&m, &p, &len), 0);
  /* preamble 16, round, base_round, time_ms 24, group_size 4, scope "" 4, bytes 8, tables 4 */
  assert_int_equal(embps_get_le32(p + 60), 8);
  assert_memory_equal(p + 64, "settings", 8);
  assert_table_fields_bytes(p + 72, &c);
  memset(&got_m, 0, sizeof(got_m));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got_m, &err), EMBPS_OK);
  assert_int_equal(got_m.num_tables, 1);
  config_assert_same(&got_m.tables[0], &c);
  embps_ckpt_manifest_free(&got_m);
  embps_free(p);
}

static void test_block_and_trailer(void **state) {
  uint8_t b[EMBPS__CKPT_BLOCK_HEADER], t[EMBPS__CKPT_TRAILER_BYTES];
  embps__ckpt_block_t in = {.first = UINT64_C(0x100000001),
                            .rows = 910,
                            .bytes = 1048320,
                            .crc = 0x01020304u},
                      out;
  embps__ckpt_trailer_t tr;
  uint32_t head_crc;
  (void)state;
  head_crc = embps__ckpt_block_put(b, &in);
  assert_int_equal(head_crc, embps__ckpt_crc(0, b, 16));
  assert_int_equal(embps_get_le64(b), in.first);
  assert_int_equal(embps_get_le32(b + 8), 910);
  assert_int_equal(embps_get_le32(b + 12), 1048320);
  assert_int_equal(embps_get_le32(b + 16), 0x01020304u);
  embps__ckpt_block_get(b, &out);
  assert_int_equal(out.first, in.first);
  assert_int_equal(out.rows, in.rows);
  assert_int_equal(out.bytes, in.bytes);
  assert_int_equal(out.crc, in.crc);

  embps__ckpt_trailer_put(t, 22, 20000, 0xcafef00du);
  assert_memory_equal(t, "EMBPSEND", 8);
  assert_int_equal(embps_get_le64(t + 8), 22);
  assert_int_equal(embps_get_le64(t + 16), 20000);
  assert_int_equal(embps_get_le32(t + 24), 0xcafef00du);
  assert_int_equal(embps_get_le32(t + 28), embps__ckpt_crc(0, t, 28));
  embps__ckpt_trailer_get(t, &tr);
  assert_true(tr.magic_ok);
  assert_int_equal(tr.blocks, 22);
  assert_int_equal(tr.rows, 20000);
  assert_int_equal(tr.blocks_crc, 0xcafef00du);
  assert_int_equal(tr.crc, tr.crc_actual);
  t[17] ^= 1;
  embps__ckpt_trailer_get(t, &tr);
  assert_int_not_equal(tr.crc, tr.crc_actual);
  t[0] = 'X';
  embps__ckpt_trailer_get(t, &tr);
  assert_false(tr.magic_ok);
}

static void test_manifest_codec(void **state) {
  embps_table_config_t tables[2] = {spec("a", EMBPS_OPTIMIZER_SGD, EMBPS_DTYPE_F32),
                                    spec("b", EMBPS_OPTIMIZER_ADAGRAD, EMBPS_DTYPE_BF16)};
  embps_ckpt_file_t files[3] = {{.rank = 0, .table = "a", .bytes = 10},
                                {.rank = 1, .table = "a", .bytes = 11},
                                {.rank = 0, .table = "b", .bytes = 12}};
  embps_ckpt_manifest_t m, got;
  embps_error_t err;
  uint8_t *p = NULL;
  size_t len = 0;
  (void)state;
  memset(&m, 0, sizeof(m));
  m.format_version = 99; /* written as this build's version whatever it says */
  m.round = 30;
  m.base_round = 20;
  m.time_ms = UINT64_C(1712345678901);
  m.group_size = 2;
  strcpy(m.scope, "b");
  m.bytes = 33;
  m.num_tables = 2;
  m.tables = tables;
  m.num_files = 3;
  m.files = files;
  assert_int_equal(embps__ckpt_manifest_encode(&m, &p, &len), 0);
  assert_memory_equal(p, "EMBPSMAN", 8);
  assert_int_equal(embps_get_le32(p + 8), EMBPS_CKPT_FORMAT_VERSION);
  assert_int_equal(embps_get_le32(p + 12) + 20, len);
  assert_int_equal(embps_get_le64(p + 16), 30);
  assert_int_equal(embps_get_le64(p + 24), 20);
  assert_int_equal(embps_get_le64(p + 32), m.time_ms);
  assert_int_equal(embps_get_le32(p + 40), 2);
  assert_int_equal(embps_get_le32(p + 44), 1); /* the scope's name */
  assert_int_equal(p[48], 'b');
  assert_int_equal(embps_get_le64(p + 49), 33);
  assert_int_equal(embps_get_le32(p + 57), 2);
  assert_int_equal(embps_get_le32(p + len - 4), embps__ckpt_crc(0, p, len - 4));

  memset(&got, 0, sizeof(got));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got, &err), EMBPS_OK);
  assert_int_equal(got.format_version, EMBPS_CKPT_FORMAT_VERSION);
  assert_int_equal(got.round, 30);
  assert_int_equal(got.base_round, 20);
  assert_int_equal(got.time_ms, m.time_ms);
  assert_int_equal(got.group_size, 2);
  assert_string_equal(got.scope, "b");
  assert_int_equal(got.bytes, 33);
  assert_int_equal(got.num_tables, 2);
  assert_true(embps__ckpt_same_config(&got.tables[1], &tables[1]));
  assert_int_equal(got.num_files, 3);
  assert_int_equal(got.files[1].rank, 1);
  assert_string_equal(got.files[2].table, "b");
  assert_int_equal(got.files[2].bytes, 12);
  embps_ckpt_manifest_free(&got);

  /* refusals, each leaving nothing allocated (the sanitizer build's leak check) */
  assert_int_equal(embps__ckpt_manifest_decode("M", p, 19, &got, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "truncated"));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len - 1, &got, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "truncated or overlong"));
  p[50] ^= 1;
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "crc32"));
  p[50] ^= 1;
  /* a count of tables beyond what is left, its checksum made right: malformed */
  embps_put_le32(p + 57, 1000000);
  embps_put_le32(p + len - 4, embps__ckpt_crc(0, p, len - 4));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "malformed"));
  assert_null(got.tables);
  assert_null(got.files);
  /* a group of no ranks: malformed */
  embps_put_le32(p + 57, 2);
  embps_put_le32(p + 40, 0);
  embps_put_le32(p + len - 4, embps__ckpt_crc(0, p, len - 4));
  assert_int_equal(embps__ckpt_manifest_decode("M", p, len, &got, &err), EMBPS_DATA_LOSS);
  assert_true(has(err.message, "malformed"));
  embps_free(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_crc),
      cmocka_unit_test(test_row_and_block_sizes),
      cmocka_unit_test(test_header),
      cmocka_unit_test(test_config_settings),
      cmocka_unit_test(test_version_1_specs),
      cmocka_unit_test(test_block_and_trailer),
      cmocka_unit_test(test_manifest_codec),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
