/* The slice reader (server/store/ckpt_reader.c): every corruption of a slice file detected and
 * named (every byte flipped, a corrupt, truncated or missing block, header or trailer, a file
 * that is not the one its manifest lists), the parallel read of a full slice, and descriptor 0
 * closed like any other. */
#include "tests/unit/store/ckpt_fixture.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/byteorder.h"

/* A process started with stdin closed gets descriptor 0 from open(): reading a checkpoint must
 * close it like any other (a leaked one keeps a pruned file's space in use). */
static void test_descriptor_zero(void **state) {
  const fixture_t *fx = *state;
  source_t s;
  int saved = dup(0);
  assert_true(saved > 0);
  source_init(&s, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&s, 1, NULL);
  write_full(fx->dir, 1, 1, &s);
  assert_int_equal(close(0), 0);
  expect_range(fx->dir, 1, &s, 0, 8);
  errno = 0;
  if (fcntl(0, F_GETFD) != -1 || errno != EBADF) {
    assert_int_equal(dup2(saved, 0), 0);
    close(saved);
    fail_msg("reading a checkpoint left descriptor 0 open");
  }
  assert_int_equal(dup2(saved, 0), 0);
  close(saved);
  source_free(&s);
}

static void test_slice_every_byte(void **state) {
  const fixture_t *fx = *state;
  char path[EMBPS_CKPT_PATH_MAX + 200];
  source_t s;
  uint8_t *orig;
  size_t len;
  embps_error_t err;
  source_init(&s, "t", 40, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAM);
  source_fill(&s, 1, NULL);
  write_full(fx->dir, 1, 2, &s);
  slice_path(path, sizeof(path), fx->dir, 1, 1, "t");
  orig = slurp(path, &len);
  for (size_t i = 0; i < len; i++) {
    dest_buf_t b;
    embps_status_t st;
    flip_byte(path, i);
    st = read_range(fx->dir, 1, &s, 0, 4, &b, &err);
    flip_byte(path, i);
    dest_free(&b);
    if (st != (i >= 8 && i < 12 ? EMBPS_FAILED_PRECONDITION : EMBPS_DATA_LOSS))
      fail_msg("slice byte %zu of %zu flipped: %s (%s)", i, len, embps_status_name(st),
               err.message);
    if (!strstr(err.message, path))
      fail_msg("slice byte %zu flipped: the message does not name the file: %s", i, err.message);
  }
  /* columns of rank 0 alone never touch the corrupt file */
  flip_byte(path, len / 2);
  expect_range(fx->dir, 1, &s, 0, 2);
  flip_byte(path, len / 2);
  expect_range(fx->dir, 1, &s, 0, 4);
  free(orig);
  source_free(&s);
}

static void test_slice_corruption(void **state) {
  const fixture_t *fx = *state;
  char path[EMBPS_CKPT_PATH_MAX + 200], other[EMBPS_CKPT_PATH_MAX + 200];
  char want[160];
  source_t s;
  uint8_t *orig;
  size_t len;
  uint64_t off, blocks[8][3];
  uint32_t hlen, nblocks = 0;

  /* one rank writes 3000 rows of 96 f32 columns with adam: about 3.3 MiB, four blocks */
  source_init(&s, "t", 3000, 96, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAM);
  source_fill(&s, 1, NULL);
  write_full(fx->dir, 1, 1, &s);
  slice_path(path, sizeof(path), fx->dir, 1, 0, "t");
  orig = slurp(path, &len);

  /* walk the documented layout: header bytes at 12, then blocks of first row u64, rows u32,
   * payload bytes u32, crc32 u32, payload */
  hlen = embps_get_le32(orig + 12);
  for (off = hlen; off + 32 < len; nblocks++) {
    assert_true(nblocks < 8);
    blocks[nblocks][0] = off;
    blocks[nblocks][1] = embps_get_le64(orig + off);
    blocks[nblocks][2] = embps_get_le32(orig + off + 8);
    off += 20 + embps_get_le32(orig + off + 12);
  }
  assert_int_equal(off + 32, len);
  assert_true(nblocks >= 3);
  assert_memory_equal(orig + off, "EMBPSEND", 8);

  /* a payload byte of the third block: its index, rows and checksums are named */
  flip_byte(path, blocks[2][0] + 20 + 1001);
  snprintf(want, sizeof(want), "block 2 (rows %" PRIu64 "..%" PRIu64 ")", blocks[2][1],
           blocks[2][1] + blocks[2][2] - 1);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, want, "crc32");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, path, "expected");
  flip_byte(path, blocks[2][0] + 20 + 1001);
  expect_range(fx->dir, 1, &s, 0, 96);

  /* a block header's row count */
  flip_byte(path, blocks[1][0] + 8);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 1", path);
  flip_byte(path, blocks[1][0] + 8);

  /* the header (its step), the trailer (its row count) */
  flip_byte(path, 40);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "header", "crc32");
  flip_byte(path, 40);
  flip_byte(path, len - 12);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "trailer", "crc32");
  flip_byte(path, len - 12);

  /* another format version, named */
  set_byte(path, 8, 9);
  expect_read_error(fx->dir, 1, &s, EMBPS_FAILED_PRECONDITION, "version 9",
                    "reads versions 1 to 2");
  set_byte(path, 8, orig[8]);
  /* not a checkpoint file at all */
  set_byte(path, 0, 'X');
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "magic", path);
  set_byte(path, 0, orig[0]);
  expect_range(fx->dir, 1, &s, 0, 96);

  /* truncated: the manifest's size catches it; with the manifest agreeing, the reading does */
  assert_int_equal(truncate(path, (off_t)len - 1), 0);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "truncated", path);
  manifest_accept_size(fx->dir, 1, 0, "t");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "truncated", "trailer");
  assert_int_equal(truncate(path, (off_t)blocks[2][0] + 100), 0);
  manifest_accept_size(fx->dir, 1, 0, "t");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 2", path);
  assert_int_equal(truncate(path, 30), 0);
  manifest_accept_size(fx->dir, 1, 0, "t");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "header", path);
  /* longer than written: trailing bytes after the trailer */
  restore_file(path, orig, len);
  {
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    fputc(0, f);
    fclose(f);
  }
  manifest_accept_size(fx->dir, 1, 0, "t");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "trailer", path);
  restore_file(path, orig, len);
  manifest_accept_size(fx->dir, 1, 0, "t");
  expect_range(fx->dir, 1, &s, 0, 96);

  /* missing */
  assert_int_equal(unlink(path), 0);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "missing", path);
  free(orig);

  /* a file that verifies but is not the one its manifest lists: rank 1's file in rank 0's
   * place */
  {
    source_t two;
    source_init(&two, "u", 50, 8, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
    source_fill(&two, 2, NULL);
    write_full(fx->dir, 2, 2, &two);
    slice_path(path, sizeof(path), fx->dir, 2, 0, "u");
    slice_path(other, sizeof(other), fx->dir, 2, 1, "u");
    expect_range(fx->dir, 2, &two, 0, 8);
    assert_int_equal(rename(other, path), 0);
    manifest_accept_size(fx->dir, 2, 0, "u");
    expect_read_error(fx->dir, 2, &two, EMBPS_DATA_LOSS, "does not match its manifest", path);
    source_free(&two);
  }
  source_free(&s);
}

/* A full slice of many blocks is read by several threads (ckpt_reader.c, read_parallel): the
 * rows land where they belong, and a corrupt or missing block is named as a serial read names
 * it, the first one when there are several. */
static void test_parallel_read(void **state) {
  const fixture_t *fx = *state;
  char path[EMBPS_CKPT_PATH_MAX + 200], want[160];
  source_t s;
  uint8_t *orig;
  size_t len;
  uint64_t per_row = 96 * 4 * 3, per_block = BLOCK_BYTES / per_row, stride, nblocks;
  uint32_t hlen;

  /* 20000 rows of 96 f32 columns with adam: 22 blocks of 910 rows in one file */
  source_init(&s, "p", 20000, 96, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAM);
  source_fill(&s, 5, NULL);
  write_full(fx->dir, 1, 1, &s);
  slice_path(path, sizeof(path), fx->dir, 1, 0, "p");
  orig = slurp(path, &len);
  hlen = embps_get_le32(orig + 12);
  stride = 20 + per_block * per_row;
  nblocks = (20000 + per_block - 1) / per_block;
  assert_int_equal(nblocks, 22);
  for (uint64_t b = 0; b < nblocks; b++) /* the layout the threads rely on */
    assert_int_equal(embps_get_le64(orig + hlen + b * stride), b * per_block);
  expect_range(fx->dir, 1, &s, 0, 96);
  expect_range(fx->dir, 1, &s, 10, 40);

  flip_byte(path, hlen + 17 * stride + 20 + 5);
  snprintf(want, sizeof(want), "block 17 (rows %" PRIu64 "..%" PRIu64 ")", 17 * per_block,
           18 * per_block - 1);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, want, "crc32");
  flip_byte(path, hlen + 3 * stride + 20 + 5);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 3 ", "crc32");
  restore_file(path, orig, len);
  expect_range(fx->dir, 1, &s, 0, 96);

  /* a block header that names other rows than its place holds */
  flip_byte(path, hlen + 20 * stride + 1);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 20", path);
  restore_file(path, orig, len);

  /* cut in the middle of block 15 */
  assert_int_equal(truncate(path, (off_t)(hlen + 15 * stride + 100)), 0);
  manifest_accept_size(fx->dir, 1, 0, "p");
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 15", path);
  restore_file(path, orig, len);
  manifest_accept_size(fx->dir, 1, 0, "p");
  expect_range(fx->dir, 1, &s, 0, 96);
  free(orig);
  source_free(&s);

  /* bf16 rows with one accumulator per row, read straight into the destination (the whole
   * width) and through the bounce buffer (some columns): both land, and a flipped accumulator
   * (the payload's last bytes) is caught in place */
  per_row = 96 * 2 + 4;
  per_block = BLOCK_BYTES / per_row;
  source_init(&s, "q", 120000, 96, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  source_fill(&s, 7, NULL);
  write_full(fx->dir, 1, 1, &s);
  slice_path(path, sizeof(path), fx->dir, 1, 0, "q");
  orig = slurp(path, &len);
  hlen = embps_get_le32(orig + 12);
  stride = 20 + per_block * per_row;
  nblocks = (120000 + per_block - 1) / per_block;
  assert_true(nblocks >= 16);
  expect_range(fx->dir, 1, &s, 0, 96);
  expect_range(fx->dir, 1, &s, 8, 48);
  flip_byte(path, hlen + 9 * stride - 2);
  expect_read_error(fx->dir, 1, &s, EMBPS_DATA_LOSS, "block 8 ", "crc32");
  restore_file(path, orig, len);
  expect_range(fx->dir, 1, &s, 0, 96);
  free(orig);
  source_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_descriptor_zero),
      T(test_slice_every_byte),
      T(test_slice_corruption),
      T(test_parallel_read),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
