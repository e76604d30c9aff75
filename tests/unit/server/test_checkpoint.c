/* Checkpoint files: slices written by any group size read back bit for bit onto any column
 * range, incremental chains, manifests, every corruption detected and named, refused arguments
 * that leave nothing behind, a full disk, listing and pruning, and the directory's check and
 * lock. Each test works in its own directory under /tmp, removed afterwards. The byte offsets
 * the corruption tests use are the layouts documented at the top of checkpoint.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/store.h"

/* A block's payload is at most about this (BLOCK_TARGET, as docs/checkpoint-format.md states):
 * a slice file larger than twice it holds at least three blocks. */
#define BLOCK_BYTES (1u << 20)

/* ---- the fixture: a temporary directory, and a tmpfs mount to undo ---------------------------
 */

typedef struct fixture {
  char dir[64];  /* this test's directory */
  char mnt[160]; /* a tmpfs the test mounted ("" when none): teardown unmounts it */
} fixture_t;

static int setup(void **state) {
  fixture_t *fx = calloc(1, sizeof(*fx));
  if (!fx)
    return -1;
  strcpy(fx->dir, "/tmp/embps-test-ckpt-XXXXXX");
  if (!mkdtemp(fx->dir)) {
    free(fx);
    return -1;
  }
  *state = fx;
  return 0;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int teardown(void **state) {
  fixture_t *fx = *state;
  if (fx->mnt[0])
    umount2(fx->mnt, MNT_DETACH);
  nftw(fx->dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  free(fx);
  return 0;
}

/* ---- files ---------------------------------------------------------------------------------- */

static int exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

static uint64_t file_size(const char *path) {
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  return (uint64_t)st.st_size;
}

/* The whole file (caller frees); *n its size. */
static uint8_t *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  uint8_t *p;
  assert_non_null(f);
  *n = (size_t)file_size(path);
  p = malloc(*n ? *n : 1);
  assert_non_null(p);
  assert_int_equal(fread(p, 1, *n, f), *n);
  fclose(f);
  return p;
}

static uint8_t byte_at(const char *path, uint64_t off) {
  uint8_t b = 0;
  int fd = open(path, O_RDONLY);
  assert_true(fd >= 0);
  assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
  close(fd);
  return b;
}

static void set_byte(const char *path, uint64_t off, uint8_t b) {
  int fd = open(path, O_WRONLY);
  assert_true(fd >= 0);
  assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
  close(fd);
}

static void flip_byte(const char *path, uint64_t off) {
  set_byte(path, off, (uint8_t)(byte_at(path, off) ^ 0x5a));
}

/* The names in a directory, "." and ".." left out, sorted and joined by spaces. */
static void dir_names(const char *dir, char *out, size_t cap) {
  struct dirent **list;
  int n = scandir(dir, &list, NULL, alphasort);
  size_t len = 0;
  assert_true(n >= 0);
  out[0] = '\0';
  for (int i = 0; i < n; i++) {
    if (strcmp(list[i]->d_name, ".") != 0 && strcmp(list[i]->d_name, "..") != 0)
      len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? " " : "", list[i]->d_name);
    free(list[i]);
  }
  free(list);
  assert_true(len < cap);
}

static void expect_dir(const char *dir, const char *names) {
  char got[2048];
  dir_names(dir, got, sizeof(got));
  if (strcmp(got, names) != 0)
    fail_msg("%s holds [%s], expected [%s]", dir, got, names);
}

static void ckpt_dir(char *out, size_t cap, const char *dir, uint64_t round) {
  embps_ckpt_path(out, cap, dir, round);
}

static void slice_path(char *out, size_t cap, const char *dir, uint64_t round, uint32_t rank,
                       const char *table) {
  char ck[EMBPS_CKPT_PATH_MAX], name[EMBPS_TABLE_NAME_MAX + 32];
  ckpt_dir(ck, sizeof(ck), dir, round);
  embps_ckpt_slice_name(name, sizeof(name), rank, table);
  snprintf(out, cap, "%s/%s", ck, name);
}

static void subdir(char *out, size_t cap, const char *dir, const char *name) {
  snprintf(out, cap, "%s/%s", dir, name);
  assert_int_equal(mkdir(out, 0755), 0);
}

static int has(const char *haystack, const char *needle) {
  if (strstr(haystack, needle))
    return 1;
  print_error("message [%s] lacks [%s]\n", haystack, needle);
  return 0;
}

/* ---- a table with deterministic, distinct values ---------------------------------------------
 */

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A value for array a (0 data, 1 state0, 2 state1), row and column, under salt. */
static uint64_t cell(uint64_t salt, int a, uint64_t row, uint64_t col) {
  return mix(mix(mix(salt * 4 + (uint64_t)a) ^ row) ^ col);
}

/* A finite float (an integer over 64, exact) from 24 bits of h. */
static float fvalue(uint64_t h) { return (float)((int64_t)(h >> 40) - (INT64_C(1) << 23)) / 64.0f; }

/* The unsplit table, as every writer's slices together hold it. */
typedef struct source {
  embps_table_config_t cfg;
  size_t esz;       /* bytes of one data element */
  uint32_t s0_cols; /* state0 floats per row: 0, 1 (one per row) or emb_width */
  uint32_t s1_cols; /* state1 floats per row: 0 or emb_width */
  uint8_t *data;    /* rows x emb_width of dtype */
  float *state0, *state1;
  uint64_t step;
} source_t;

static const embps_optimizer_t optimizers[] = {EMBPS_OPTIMIZER_SGD, EMBPS_OPTIMIZER_ADAGRAD,
                                               EMBPS_OPTIMIZER_ROWWISE_ADAGRAD,
                                               EMBPS_OPTIMIZER_ADAM};
static const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};

static void source_init(source_t *s, const char *name, uint64_t rows, uint32_t width,
                        embps_dtype_t dtype, embps_optimizer_t opt) {
  embps_error_t err;
  memset(s, 0, sizeof(*s));
  strcpy(s->cfg.name, name);
  s->cfg.rows = rows;
  s->cfg.emb_width = width;
  s->cfg.dtype = dtype;
  s->cfg.optimizer = opt;
  s->cfg.seed = 7;
  assert_int_equal(embps_table_config_resolve(&s->cfg, 1, UINT64_C(1) << 40, &err), EMBPS_OK);
  s->esz = dtype == EMBPS_DTYPE_BF16 ? 2 : 4;
  /* What each optimizer keeps (checkpoint.h's embps_ckpt_slice_t), spelled out here rather
   * than taken from the registry under test. */
  switch (opt) {
  case EMBPS_OPTIMIZER_SGD:
    break;
  case EMBPS_OPTIMIZER_ADAGRAD:
    s->s0_cols = width;
    break;
  case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
    s->s0_cols = 1;
    break;
  case EMBPS_OPTIMIZER_ADAM:
    s->s0_cols = s->s1_cols = width;
    break;
  default:
    fail_msg("optimizer %d is not covered by this test", (int)opt);
  }
  s->data = malloc(rows * width * s->esz);
  assert_non_null(s->data);
  if (s->s0_cols)
    assert_non_null(s->state0 = malloc(rows * s->s0_cols * sizeof(float)));
  if (s->s1_cols)
    assert_non_null(s->state1 = malloc(rows * s->s1_cols * sizeof(float)));
}

static void source_free(source_t *s) {
  free(s->data);
  free(s->state0);
  free(s->state1);
  memset(s, 0, sizeof(*s));
}

static void source_copy(source_t *to, const source_t *from) {
  const uint64_t rows = from->cfg.rows;
  *to = *from;
  to->data = malloc(rows * from->cfg.emb_width * from->esz);
  assert_non_null(to->data);
  memcpy(to->data, from->data, rows * from->cfg.emb_width * from->esz);
  to->state0 = to->state1 = NULL;
  if (from->state0) {
    assert_non_null(to->state0 = malloc(rows * from->s0_cols * sizeof(float)));
    memcpy(to->state0, from->state0, rows * from->s0_cols * sizeof(float));
  }
  if (from->state1) {
    assert_non_null(to->state1 = malloc(rows * from->s1_cols * sizeof(float)));
    memcpy(to->state1, from->state1, rows * from->s1_cols * sizeof(float));
  }
}

static int is_dirty(const uint64_t *dirty, uint64_t r) {
  return !dirty || ((dirty[r / 64] >> (r % 64)) & 1u);
}

/* Gives every row (dirty NULL) or every dirty row new values under salt. */
static void source_fill(source_t *s, uint64_t salt, const uint64_t *dirty) {
  const uint32_t w = s->cfg.emb_width;
  for (uint64_t r = 0; r < s->cfg.rows; r++) {
    if (!is_dirty(dirty, r))
      continue;
    for (uint32_t c = 0; c < w; c++) {
      uint64_t h = cell(salt, 0, r, c);
      if (s->esz == 2) {
        uint16_t b = (uint16_t)(h >> 48);
        memcpy(s->data + (r * w + c) * 2, &b, 2);
      } else {
        float v = fvalue(h);
        memcpy(s->data + (r * w + c) * 4, &v, 4);
      }
    }
    for (uint32_t c = 0; c < s->s0_cols; c++)
      s->state0[r * s->s0_cols + c] = fvalue(cell(salt, 1, r, c));
    for (uint32_t c = 0; c < s->s1_cols; c++)
      s->state1[r * s->s1_cols + c] = fvalue(cell(salt, 2, r, c));
  }
  s->step = salt * 3 + 1;
}

/* A dirty-row map of `rows` rows with the listed rows set (caller frees). */
static uint64_t *dirty_map(uint64_t rows, const uint64_t *list, size_t n) {
  uint64_t *d = calloc(embps_dirty_words(rows), sizeof(uint64_t));
  assert_non_null(d);
  for (size_t i = 0; i < n; i++) {
    assert_true(list[i] < rows);
    d[list[i] / 64] |= UINT64_C(1) << (list[i] % 64);
  }
  return d;
}

static uint64_t *dirty_range(uint64_t rows, uint64_t first, uint64_t last) {
  uint64_t *d = calloc(embps_dirty_words(rows), sizeof(uint64_t));
  assert_non_null(d);
  for (uint64_t r = first; r <= last; r++)
    d[r / 64] |= UINT64_C(1) << (r % 64);
  return d;
}

/* Rank `rank`'s slice of s for a group of g (its own copies of the columns; free with
 * slice_free). */
static embps_ckpt_slice_t slice_of(const source_t *s, uint32_t rank, uint32_t g, uint64_t round,
                                   uint64_t base_round, const uint64_t *dirty) {
  const uint32_t w = s->cfg.emb_width, sw = w / g, cb = rank * sw;
  embps_ckpt_slice_t sl;
  uint8_t *data = malloc(s->cfg.rows * sw * s->esz);
  float *s0 = NULL, *s1 = NULL;
  assert_int_equal(w % g, 0);
  assert_non_null(data);
  for (uint64_t r = 0; r < s->cfg.rows; r++)
    memcpy(data + r * sw * s->esz, s->data + (r * w + cb) * s->esz, sw * s->esz);
  if (s->s0_cols > 1) {
    assert_non_null(s0 = malloc(s->cfg.rows * sw * sizeof(float)));
    for (uint64_t r = 0; r < s->cfg.rows; r++)
      memcpy(s0 + r * sw, s->state0 + r * w + cb, sw * sizeof(float));
  } else if (s->s0_cols == 1) {
    assert_non_null(s0 = malloc(s->cfg.rows * sizeof(float)));
    memcpy(s0, s->state0, s->cfg.rows * sizeof(float));
  }
  if (s->s1_cols) {
    assert_non_null(s1 = malloc(s->cfg.rows * sw * sizeof(float)));
    for (uint64_t r = 0; r < s->cfg.rows; r++)
      memcpy(s1 + r * sw, s->state1 + r * w + cb, sw * sizeof(float));
  }
  memset(&sl, 0, sizeof(sl));
  sl.config = s->cfg;
  sl.rank = rank;
  sl.group_size = g;
  sl.col_begin = cb;
  sl.shard_width = sw;
  sl.round = round;
  sl.step = s->step;
  sl.base_round = base_round;
  sl.dirty = dirty;
  sl.data = data;
  sl.state0 = s0;
  sl.state1 = s1;
  return sl;
}

static void slice_free(embps_ckpt_slice_t *sl) {
  free((void *)sl->data);
  free((void *)sl->state0);
  free((void *)sl->state1);
}

#define MAX_TABLES 4
#define MAX_FILES 32

/* A manifest with room for its tables and files. */
typedef struct manifest_buf {
  embps_ckpt_manifest_t m;
  embps_table_config_t tables[MAX_TABLES];
  embps_ckpt_file_t files[MAX_FILES];
} manifest_buf_t;

/* Writes checkpoint `round` of the n tables in dir as a group of g writes it: each rank's slice
 * of each table (dirty[i] NULL: every row), then the manifest. */
static void write_ckpt(const char *dir, uint64_t round, uint64_t base_round, const char *scope,
                       uint32_t g, const source_t *const *tables, const uint64_t *const *dirty,
                       size_t n) {
  char ck[EMBPS_CKPT_PATH_MAX], path[EMBPS_CKPT_PATH_MAX + 200];
  manifest_buf_t mb;
  embps_error_t err;
  assert_true(n <= MAX_TABLES && n * g <= MAX_FILES);
  memset(&mb, 0, sizeof(mb));
  ckpt_dir(ck, sizeof(ck), dir, round);
  assert_true(mkdir(ck, 0755) == 0 || errno == EEXIST);
  for (size_t t = 0; t < n; t++) {
    mb.tables[t] = tables[t]->cfg;
    for (uint32_t rank = 0; rank < g; rank++) {
      embps_ckpt_slice_t sl =
          slice_of(tables[t], rank, g, round, base_round, dirty ? dirty[t] : NULL);
      embps_ckpt_file_t *fe = &mb.files[mb.m.num_files++];
      uint64_t bytes = 0;
      slice_path(path, sizeof(path), dir, round, rank, tables[t]->cfg.name);
      if (embps_ckpt_write_slice(path, &sl, &bytes, &err) != EMBPS_OK)
        fail_msg("writing %s: %s", path, err.message);
      slice_free(&sl);
      assert_int_equal(bytes, file_size(path));
      fe->rank = rank;
      strcpy(fe->table, tables[t]->cfg.name);
      fe->bytes = bytes;
      mb.m.bytes += bytes;
    }
  }
  assert_int_equal(embps_ckpt_sync_dir(ck, &err), EMBPS_OK);
  mb.m.round = round;
  mb.m.base_round = base_round;
  mb.m.time_ms = UINT64_C(1700000000000) + round;
  mb.m.group_size = g;
  strcpy(mb.m.scope, scope);
  mb.m.num_tables = n;
  mb.m.tables = mb.tables;
  mb.m.files = mb.files;
  if (embps_ckpt_write_manifest(ck, &mb.m, &err) != EMBPS_OK)
    fail_msg("writing the manifest of %s: %s", ck, err.message);
}

static void write_full(const char *dir, uint64_t round, uint32_t g, const source_t *s) {
  const source_t *t[1] = {s};
  write_ckpt(dir, round, 0, "", g, t, NULL, 1);
}

/* ---- reading back ----------------------------------------------------------------------------
 */

typedef struct dest_buf {
  embps_ckpt_dest_t d;
  size_t bytes[3];
} dest_buf_t;

/* Destination arrays for columns [cb, cb + w) of s, filled with a pattern no slice holds. */
static void dest_init(dest_buf_t *b, const source_t *s, uint32_t cb, uint32_t w) {
  const uint64_t rows = s->cfg.rows;
  memset(b, 0, sizeof(*b));
  b->d.col_begin = cb;
  b->d.shard_width = w;
  b->bytes[0] = rows * w * s->esz;
  b->bytes[1] = s->s0_cols == 1 ? rows * sizeof(float) : s->s0_cols ? rows * w * sizeof(float) : 0;
  b->bytes[2] = s->s1_cols ? rows * w * sizeof(float) : 0;
  assert_non_null(b->d.data = malloc(b->bytes[0]));
  memset(b->d.data, 0xa5, b->bytes[0]);
  if (b->bytes[1]) {
    assert_non_null(b->d.state0 = malloc(b->bytes[1]));
    memset(b->d.state0, 0xa5, b->bytes[1]);
  }
  if (b->bytes[2]) {
    assert_non_null(b->d.state1 = malloc(b->bytes[2]));
    memset(b->d.state1, 0xa5, b->bytes[2]);
  }
}

static void dest_free(dest_buf_t *b) {
  free(b->d.data);
  free(b->d.state0);
  free(b->d.state1);
}

/* Columns [cb, cb + w) of each row of an array of `cols` columns against the destination's. */
static void expect_rows(const char *what, const source_t *s, const uint8_t *want, uint32_t cols,
                        const uint8_t *got, uint32_t cb, uint32_t w, size_t esz) {
  for (uint64_t r = 0; r < s->cfg.rows; r++)
    if (memcmp(got + r * w * esz, want + (r * cols + cb) * esz, w * esz) != 0)
      fail_msg("table '%s' columns %" PRIu32 "+%" PRIu32 ": %s of row %" PRIu64 " differs",
               s->cfg.name, cb, w, what, r);
}

/* The destination holds exactly columns [cb, cb + w) of s. */
static void expect_dest(const dest_buf_t *b, const source_t *s) {
  const uint32_t cb = b->d.col_begin, w = b->d.shard_width;
  expect_rows("data", s, s->data, s->cfg.emb_width, b->d.data, cb, w, s->esz);
  if (s->s0_cols == 1)
    expect_rows("per-row state", s, (const uint8_t *)s->state0, 1, (const uint8_t *)b->d.state0, 0,
                1, sizeof(float));
  else if (s->s0_cols)
    expect_rows("state0", s, (const uint8_t *)s->state0, s->s0_cols, (const uint8_t *)b->d.state0,
                cb, w, sizeof(float));
  if (s->s1_cols)
    expect_rows("state1", s, (const uint8_t *)s->state1, s->s1_cols, (const uint8_t *)b->d.state1,
                cb, w, sizeof(float));
  assert_int_equal(b->d.step, s->step);
}

/* Reads columns [cb, cb + w) of table s from checkpoint `round`; returns the status, err set. */
static embps_status_t read_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb,
                                 uint32_t w, dest_buf_t *b, embps_error_t *err) {
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_error_t merr;
  embps_status_t st;
  ckpt_dir(ck, sizeof(ck), dir, round);
  if (embps_ckpt_read_manifest(ck, &m, &merr) != EMBPS_OK)
    fail_msg("manifest of %s: %s", ck, merr.message);
  dest_init(b, s, cb, w);
  embps_error_clear(err);
  st = embps_ckpt_read_columns(dir, &m, s->cfg.name, &b->d, err);
  embps_ckpt_manifest_free(&m);
  return st;
}

/* Columns [cb, cb + w) of checkpoint `round` are those of s, bit for bit. */
static void expect_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb,
                         uint32_t w) {
  dest_buf_t b;
  embps_error_t err;
  if (read_range(dir, round, s, cb, w, &b, &err) != EMBPS_OK)
    fail_msg("reading columns %" PRIu32 "+%" PRIu32 " of '%s' in round %" PRIu64 ": %s", cb, w,
             s->cfg.name, round, err.message);
  expect_dest(&b, s);
  dest_free(&b);
}

/* Reading the whole table fails with `status` and a message holding each of the strings. */
static void expect_read_error(const char *dir, uint64_t round, const source_t *s,
                              embps_status_t status, const char *a, const char *b) {
  dest_buf_t d;
  embps_error_t err;
  embps_status_t st = read_range(dir, round, s, 0, s->cfg.emb_width, &d, &err);
  dest_free(&d);
  if (st != status)
    fail_msg("reading '%s' of round %" PRIu64 " gave %s (%s), expected %s", s->cfg.name, round,
             embps_status_name(st), err.message, embps_status_name(status));
  assert_true(has(err.message, a));
  if (b)
    assert_true(has(err.message, b));
}

/* ---- 1. round trips over every optimizer, dtype, writer group and reader split ---------------
 */

static void test_optimizers_covered(void **state) {
  size_t known = 0;
  (void)state;
  /* the round trip covers every optimizer the table spec supports: a new one fails here */
  for (int k = 0; k < 64; k++)
    known += embps_optimizer_info((embps_optimizer_t)k) != NULL;
  assert_int_equal(known, sizeof(optimizers) / sizeof(optimizers[0]));
  for (size_t i = 0; i < known; i++)
    assert_non_null(embps_optimizer_info(optimizers[i]));
}

static void test_round_trip(void **state) {
  const fixture_t *fx = *state;
  static const uint32_t writers[] = {1, 2, 3}, readers[] = {1, 2, 3, 4, 6};
  uint64_t round = 0;
  for (size_t o = 0; o < sizeof(optimizers) / sizeof(optimizers[0]); o++)
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++)
      for (size_t wi = 0; wi < sizeof(writers) / sizeof(writers[0]); wi++) {
        const uint32_t g = writers[wi];
        const int big = optimizers[o] == EMBPS_OPTIMIZER_ADAM;
        source_t small, large;
        const source_t *tables[2] = {&small, &large};
        round++;
        /* 77 rows: not a whole number of 64-row words */
        source_init(&small, "small", 77, 12, dtypes[d], optimizers[o]);
        source_fill(&small, round * 10 + 1, NULL);
        if (big) {
          /* about 3 (f32) or 2.5 MiB (bf16) per slice of a 3-rank group: several blocks */
          source_init(&large, "large", 8000, 96, dtypes[d], optimizers[o]);
          source_fill(&large, round * 10 + 2, NULL);
        }
        write_ckpt(fx->dir, round, 0, "", g, tables, NULL, big ? 2 : 1);
        for (size_t t = 0; t < (big ? 2u : 1u); t++) {
          const source_t *s = tables[t];
          const uint32_t w = s->cfg.emb_width;
          for (size_t ri = 0; ri < sizeof(readers) / sizeof(readers[0]); ri++)
            for (uint32_t j = 0; j < readers[ri]; j++)
              expect_range(fx->dir, round, s, j * (w / readers[ri]), w / readers[ri]);
          /* a range that matches no split: a part of every writer's columns */
          expect_range(fx->dir, round, s, 1, w - 2);
          expect_range(fx->dir, round, s, w - 1, 1);
        }
        if (big)
          for (uint32_t rank = 0; rank < g; rank++) {
            char path[EMBPS_CKPT_PATH_MAX + 200];
            slice_path(path, sizeof(path), fx->dir, round, rank, "large");
            assert_true(file_size(path) > 2 * BLOCK_BYTES);
          }
        source_free(&small);
        if (big)
          source_free(&large);
      }
}

static void test_read_refusals(void **state) {
  const fixture_t *fx = *state;
  source_t s;
  dest_buf_t b;
  embps_error_t err;
  (void)state;
  source_init(&s, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAGRAD);
  source_fill(&s, 1, NULL);
  write_full(fx->dir, 1, 2, &s);
  assert_int_equal(read_range(fx->dir, 1, &s, 4, 5, &b, &err), EMBPS_INVALID_ARGUMENT);
  assert_true(has(err.message, "outside table 't'"));
  dest_free(&b);
  assert_int_equal(read_range(fx->dir, 1, &s, 0, 0, &b, &err), EMBPS_INVALID_ARGUMENT);
  dest_free(&b);
  strcpy(s.cfg.name, "nope");
  assert_int_equal(read_range(fx->dir, 1, &s, 0, 8, &b, &err), EMBPS_NOT_FOUND);
  assert_true(has(err.message, "no table 'nope'"));
  dest_free(&b);
  source_free(&s);
}

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

/* ---- 2. incremental chains ------------------------------------------------------------------ */

static void test_incremental_chain(void **state) {
  const fixture_t *fx = *state;
  static const struct {
    embps_optimizer_t opt;
    embps_dtype_t dtype;
  } kinds[] = {{EMBPS_OPTIMIZER_ADAM, EMBPS_DTYPE_F32},
               {EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_DTYPE_BF16},
               {EMBPS_OPTIMIZER_SGD, EMBPS_DTYPE_BF16}};
  /* round 20: row 0, a run across the word boundary 63/64, the last row; rows 128..191 (a whole
   * word) stay clean. round 30: both sides of two word boundaries and the last row again. */
  static const uint64_t rows20[] = {0, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 100, 199},
                        rows30[] = {5, 63, 64, 127, 128, 199};
  for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
    char dir[128], full0[EMBPS_CKPT_PATH_MAX + 200], inc0[EMBPS_CKPT_PATH_MAX + 200];
    source_t t, at20, fresh, late;
    uint64_t *d20 = dirty_map(200, rows20, sizeof(rows20) / sizeof(rows20[0]));
    uint64_t *d30 = dirty_map(200, rows30, sizeof(rows30) / sizeof(rows30[0]));
    uint64_t *fresh_all = dirty_range(130, 0, 129), *fresh30 = dirty_range(130, 3, 70);
    uint64_t *late_part = dirty_range(90, 0, 88);
    snprintf(dir, sizeof(dir), "%s/k%zu", fx->dir, k);
    assert_int_equal(mkdir(dir, 0755), 0);
    source_init(&t, "t", 200, 12, kinds[k].dtype, kinds[k].opt);
    source_init(&fresh, "fresh", 130, 12, kinds[k].dtype, kinds[k].opt);
    source_init(&late, "late", 90, 12, kinds[k].dtype, kinds[k].opt);

    source_fill(&t, 10, NULL);
    write_full(dir, 10, 2, &t);

    /* round 20: t's dirty rows, and "fresh", created since round 10, with every row */
    source_fill(&t, 20, d20);
    source_fill(&fresh, 21, NULL);
    {
      const source_t *tabs[2] = {&t, &fresh};
      const uint64_t *dirty[2] = {d20, fresh_all};
      write_ckpt(dir, 20, 10, "", 2, tabs, dirty, 2);
    }
    source_copy(&at20, &t);

    /* round 30: t's and fresh's dirty rows, and "late" with only some of its rows */
    source_fill(&t, 30, d30);
    source_fill(&fresh, 31, fresh30);
    source_fill(&late, 32, NULL);
    {
      const source_t *tabs[3] = {&t, &fresh, &late};
      const uint64_t *dirty[3] = {d30, fresh30, late_part};
      write_ckpt(dir, 30, 20, "", 2, tabs, dirty, 3);
    }

    /* an incremental file holds only its dirty rows */
    slice_path(full0, sizeof(full0), dir, 10, 0, "t");
    slice_path(inc0, sizeof(inc0), dir, 20, 0, "t");
    assert_true(file_size(inc0) < file_size(full0) / 4);

    for (uint32_t n = 1; n <= 4; n++)
      for (uint32_t j = 0; j < n; j++) {
        expect_range(dir, 30, &t, j * (12 / n), 12 / n);
        expect_range(dir, 20, &at20, j * (12 / n), 12 / n);
      }
    expect_range(dir, 30, &t, 5, 4);
    expect_range(dir, 30, &fresh, 0, 12);
    expect_range(dir, 30, &fresh, 6, 6);
    /* a table whose first checkpoint is incremental must have all its rows there */
    expect_read_error(dir, 30, &late, EMBPS_DATA_LOSS, "chain is broken", "does not hold all");

    /* the base gone: the chain cannot be read */
    {
      char ck[EMBPS_CKPT_PATH_MAX];
      embps_error_t err;
      ckpt_dir(ck, sizeof(ck), dir, 10);
      assert_int_equal(embps_ckpt_remove(ck, &err), EMBPS_OK);
      assert_false(exists(ck));
    }
    expect_read_error(dir, 30, &t, EMBPS_DATA_LOSS, "incremental checkpoint of round 20",
                      "applies on round 10");
    expect_read_error(dir, 20, &at20, EMBPS_DATA_LOSS, "incremental checkpoint of round 20",
                      "applies on round 10");

    source_free(&t);
    source_free(&at20);
    source_free(&fresh);
    source_free(&late);
    free(d20);
    free(d30);
    free(fresh_all);
    free(fresh30);
    free(late_part);
  }
}

/* A manifest whose base round is not older than its own round is a broken chain, not a loop. */
static void test_chain_loop(void **state) {
  const fixture_t *fx = *state;
  source_t t;
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_error_t err;
  source_init(&t, "t", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&t, 1, NULL);
  write_full(fx->dir, 5, 1, &t);
  ckpt_dir(ck, sizeof(ck), fx->dir, 5);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  m.base_round = 5;
  assert_int_equal(embps_ckpt_write_manifest(ck, &m, &err), EMBPS_OK);
  embps_ckpt_manifest_free(&m);
  expect_read_error(fx->dir, 5, &t, EMBPS_DATA_LOSS, "chain is broken", "round 5");
  source_free(&t);
}

/* ---- 3. manifests --------------------------------------------------------------------------- */

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

static void test_names(void **state) {
  char out[EMBPS_CKPT_PATH_MAX];
  (void)state;
  embps_ckpt_path(out, sizeof(out), "/x/y", 42);
  assert_string_equal(out, "/x/y/ckpt-00000000000000000042");
  embps_ckpt_path(out, sizeof(out), "d", UINT64_MAX);
  assert_string_equal(out, "d/ckpt-18446744073709551615");
  embps_ckpt_slice_name(out, sizeof(out), 3, "emb");
  assert_string_equal(out, "r3-emb.embps");
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
  set_byte(path, 8, 2);
  assert_int_equal(read_manifest_status(ck, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, "version 2"));
  assert_true(has(err.message, "version 1"));
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

/* ---- 4. corrupt, truncated and missing slice files ------------------------------------------ */

/* Sets the size the manifest of `round` records for rank's file of table to its size on disk. */
static void manifest_accept_size(const char *dir, uint64_t round, uint32_t rank,
                                 const char *table) {
  char ck[EMBPS_CKPT_PATH_MAX], path[EMBPS_CKPT_PATH_MAX + 200];
  embps_ckpt_manifest_t m;
  embps_error_t err;
  ckpt_dir(ck, sizeof(ck), dir, round);
  slice_path(path, sizeof(path), dir, round, rank, table);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  for (size_t i = 0; i < m.num_files; i++)
    if (m.files[i].rank == rank && strcmp(m.files[i].table, table) == 0)
      m.files[i].bytes = file_size(path);
  assert_int_equal(embps_ckpt_write_manifest(ck, &m, &err), EMBPS_OK);
  embps_ckpt_manifest_free(&m);
}

static void restore_file(const char *path, const uint8_t *p, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(p, 1, n, f), n);
  fclose(f);
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
  expect_read_error(fx->dir, 1, &s, EMBPS_FAILED_PRECONDITION, "version 9", "version 1");
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

/* A full slice of many blocks is read by several threads (checkpoint.c, read_parallel): the
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

/* ---- 5. refused slices leave nothing behind ------------------------------------------------- */

static void test_slice_refusals(void **state) {
  const fixture_t *fx = *state;
  char path[256], cmp[256];
  source_t s;
  embps_ckpt_slice_t good, bad;
  embps_error_t err;
  uint64_t dirty[1] = {1}, bytes = 0;
  float extra[80];
  uint8_t *before;
  size_t before_len;

  source_init(&s, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAGRAD);
  source_fill(&s, 1, NULL);
  good = slice_of(&s, 0, 2, 5, 0, NULL);
  snprintf(path, sizeof(path), "%s/r0-t.embps", fx->dir);
  assert_int_equal(embps_ckpt_write_slice(path, &good, &bytes, &err), EMBPS_OK);
  before = slurp(path, &before_len);
  assert_int_equal(before_len, bytes);

  for (int k = 0; k < 15; k++) {
    bad = good;
    switch (k) {
    case 0:
      bad.rank = 2;
      break;
    case 1:
      bad.group_size = 0;
      break;
    case 2:
      bad.shard_width = 0;
      break;
    case 3:
      bad.col_begin = 6; /* 6 + 4 > 8 */
      break;
    case 4:
      bad.data = NULL;
      break;
    case 5:
      bad.state0 = NULL; /* adagrad keeps accumulators */
      break;
    case 6:
      bad.state1 = extra; /* but no second moment */
      break;
    case 7:
      bad.dirty = dirty; /* a dirty map with no base */
      break;
    case 8:
      bad.base_round = 1; /* a base with no dirty map */
      break;
    case 9:
      bad.dirty = dirty;
      bad.base_round = 5; /* not older than its round */
      break;
    case 10:
      bad.config.rows = 0;
      break;
    case 11:
      bad.config.dtype = (embps_dtype_t)7;
      break;
    case 12:
      bad.config.optimizer = (embps_optimizer_t)9;
      break;
    case 13:
      bad.config.emb_width = 0;
      break;
    default:
      bad.config.emb_width = EMBPS_MAX_EMB_WIDTH + 8;
      break;
    }
    embps_error_clear(&err);
    if (embps_ckpt_write_slice(path, &bad, &bytes, &err) != EMBPS_INVALID_ARGUMENT)
      fail_msg("refusal %d: %s (%s)", k, embps_status_name(err.status), err.message);
    assert_true(has(err.message, "table 't'"));
    expect_dir(fx->dir, "r0-t.embps");
    /* the file already there is untouched */
    {
      size_t n;
      uint8_t *now = slurp(path, &n);
      assert_int_equal(n, before_len);
      assert_memory_equal(now, before, n);
      free(now);
    }
  }
  free(before);

  /* a directory that does not exist: an error naming the file, nothing created */
  snprintf(path, sizeof(path), "%s/nope/r0-t.embps", fx->dir);
  assert_int_equal(embps_ckpt_write_slice(path, &good, NULL, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "r0-t.embps");

  /* the rename fails (a non-empty directory holds the name): the temporary file is removed */
  snprintf(path, sizeof(path), "%s/r1-t.embps", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(cmp, sizeof(cmp), "%s/r1-t.embps/x", fx->dir);
  assert_int_equal(mkdir(cmp, 0755), 0);
  assert_int_equal(embps_ckpt_write_slice(path, &good, NULL, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "r0-t.embps r1-t.embps");
  expect_dir(path, "x");
  slice_free(&good);
  source_free(&s);
}

/* ---- 6. a full disk ------------------------------------------------------------------------- */

static void test_no_space(void **state) {
  fixture_t *fx = *state;
  char mnt[160], path[256];
  source_t small, big;
  embps_ckpt_slice_t sl;
  embps_error_t err;
  uint8_t *before;
  size_t before_len;

  if (geteuid() != 0) {
    print_message("SKIP test_no_space: not root, cannot mount a small tmpfs\n");
    skip();
  }
  snprintf(mnt, sizeof(mnt), "%s/full", fx->dir);
  assert_int_equal(mkdir(mnt, 0755), 0);
  if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k") != 0) {
    print_message("SKIP test_no_space: cannot mount a tmpfs on %s: %s\n", mnt, strerror(errno));
    skip();
  }
  strcpy(fx->mnt, mnt);

  source_init(&small, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&small, 1, NULL);
  /* 512 KiB of rows: eight times what the file system holds */
  source_init(&big, "t", 16384, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&big, 2, NULL);
  snprintf(path, sizeof(path), "%s/r0-t.embps", mnt);
  sl = slice_of(&small, 0, 1, 1, 0, NULL);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_OK);
  slice_free(&sl);
  before = slurp(path, &before_len);

  sl = slice_of(&big, 0, 1, 2, 0, NULL);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_true(has(err.message, "no space left on device"));
  assert_true(has(err.message, path));
  expect_dir(mnt, "r0-t.embps");
  {
    size_t n;
    uint8_t *now = slurp(path, &n);
    assert_int_equal(n, before_len);
    assert_memory_equal(now, before, n);
    free(now);
  }
  /* a new name: nothing of it stays */
  snprintf(path, sizeof(path), "%s/r1-t.embps", mnt);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_RESOURCE_EXHAUSTED);
  expect_dir(mnt, "r0-t.embps");
  slice_free(&sl);
  free(before);
  source_free(&small);
  source_free(&big);

  assert_int_equal(umount2(mnt, 0), 0);
  fx->mnt[0] = '\0';
}

/* ---- 7. listing and pruning ----------------------------------------------------------------- */

static void expect_list(const char *dir, const uint64_t *rounds, size_t n) {
  embps_ckpt_manifest_t *list;
  size_t got;
  embps_error_t err;
  assert_int_equal(embps_ckpt_list(dir, &list, &got, &err), EMBPS_OK);
  if (got != n) {
    char s[512];
    size_t len = 0;
    for (size_t i = 0; i < got; i++)
      len += (size_t)snprintf(s + len, sizeof(s) - len, " %" PRIu64, list[i].round);
    s[len] = '\0';
    fail_msg("%s lists %zu checkpoints (%s), expected %zu", dir, got, s, n);
  }
  for (size_t i = 0; i < n; i++)
    assert_int_equal(list[i].round, rounds[i]);
  embps_ckpt_list_free(list, got);
}

/* A checkpoint directory with a slice but no manifest: a write that never finished. */
static void write_incomplete(const char *dir, uint64_t round, const source_t *s) {
  char ck[EMBPS_CKPT_PATH_MAX];
  write_full(dir, round, 1, s);
  ckpt_dir(ck, sizeof(ck), dir, round);
  snprintf(ck + strlen(ck), sizeof(ck) - strlen(ck), "/%s", EMBPS_CKPT_MANIFEST);
  assert_int_equal(unlink(ck), 0);
}

static void test_list_and_prune(void **state) {
  const fixture_t *fx = *state;
  char ck[EMBPS_CKPT_PATH_MAX], path[EMBPS_CKPT_PATH_MAX + 32];
  source_t a, t, a20;
  embps_ckpt_manifest_t *list, m;
  size_t n;
  embps_error_t err;
  uint64_t *d20 = dirty_range(70, 10, 20), *d30 = dirty_range(70, 60, 69);
  const source_t *tabs[1];
  const uint64_t *dirty[1];

  source_init(&a, "a", 70, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  source_init(&t, "t", 70, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  tabs[0] = &a;

  source_fill(&a, 1, NULL);
  write_ckpt(fx->dir, 1, 0, "", 1, tabs, NULL, 1);
  write_incomplete(fx->dir, 3, &a);
  /* ...and one with a corrupt manifest: incomplete too */
  write_full(fx->dir, 4, 1, &a);
  ckpt_dir(ck, sizeof(ck), fx->dir, 4);
  snprintf(path, sizeof(path), "%s/MANIFEST", ck);
  flip_byte(path, 30);
  tabs[0] = &t;
  source_fill(&t, 5, NULL);
  write_ckpt(fx->dir, 5, 0, "t", 1, tabs, NULL, 1);
  /* a complete checkpoint copied under another round's name is not that round */
  write_full(fx->dir, 7, 1, &t);
  ckpt_dir(ck, sizeof(ck), fx->dir, 7);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  m.round = 8;
  assert_int_equal(embps_ckpt_write_manifest(ck, &m, &err), EMBPS_OK);
  embps_ckpt_manifest_free(&m);
  tabs[0] = &a;
  source_fill(&a, 10, NULL);
  write_ckpt(fx->dir, 10, 0, "", 1, tabs, NULL, 1);
  write_incomplete(fx->dir, 12, &a);
  tabs[0] = &t;
  source_fill(&t, 15, NULL);
  write_ckpt(fx->dir, 15, 0, "t", 1, tabs, NULL, 1);
  tabs[0] = &a;
  dirty[0] = d20;
  source_fill(&a, 20, d20);
  write_ckpt(fx->dir, 20, 10, "", 1, tabs, dirty, 1);
  source_copy(&a20, &a);
  tabs[0] = &t;
  source_fill(&t, 25, NULL);
  write_ckpt(fx->dir, 25, 0, "t", 1, tabs, NULL, 1);
  tabs[0] = &a;
  dirty[0] = d30;
  source_fill(&a, 30, d30);
  write_ckpt(fx->dir, 30, 20, "", 1, tabs, dirty, 1);
  write_incomplete(fx->dir, 40, &a); /* newer than every complete one: maybe being written */
  snprintf(path, sizeof(path), "%s/other", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof(path), "%s/ckpt-0000000000000000000x", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);

  {
    static const uint64_t all[] = {1, 5, 10, 15, 20, 25, 30};
    expect_list(fx->dir, all, 7);
  }
  assert_int_equal(embps_ckpt_list(fx->dir, &list, &n, &err), EMBPS_OK);
  assert_int_equal(n, 7);
  assert_string_equal(list[1].scope, "t");
  assert_string_equal(list[4].scope, "");
  assert_int_equal(list[4].base_round, 10);
  assert_int_equal(list[6].base_round, 20);
  assert_int_equal(list[2].base_round, 0);
  assert_int_equal(list[6].group_size, 1);
  assert_int_equal(list[6].time_ms, UINT64_C(1700000000000) + 30);
  embps_ckpt_list_free(list, n);

  /* keep 2: rounds 30 and 20 of scope "", and 10 that they chain back to; 25 and 15 of "t";
   * the incomplete 3, 4, 7 and 12 go; 40 may still be being written and stays */
  assert_int_equal(embps_ckpt_prune(fx->dir, 2, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 15, 20, 25, 30};
    expect_list(fx->dir, kept, 5);
  }
  expect_dir(fx->dir, "ckpt-0000000000000000000x ckpt-00000000000000000010 "
                      "ckpt-00000000000000000015 ckpt-00000000000000000020 "
                      "ckpt-00000000000000000025 ckpt-00000000000000000030 "
                      "ckpt-00000000000000000040 other");
  expect_range(fx->dir, 30, &a, 0, 4);
  expect_range(fx->dir, 20, &a20, 1, 3);
  /* again: nothing more to do */
  assert_int_equal(embps_ckpt_prune(fx->dir, 2, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 15, 20, 25, 30};
    expect_list(fx->dir, kept, 5);
  }
  /* keep 1: 30 (and its chain 20, 10), 25 */
  assert_int_equal(embps_ckpt_prune(fx->dir, 1, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 20, 25, 30};
    expect_list(fx->dir, kept, 4);
  }
  expect_range(fx->dir, 30, &a, 0, 4);

  /* a directory that does not exist */
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_list(path, &list, &n, &err), EMBPS_NOT_FOUND);
  assert_int_equal(n, 0);
  assert_true(has(err.message, path));

  source_free(&a);
  source_free(&a20);
  source_free(&t);
  free(d20);
  free(d30);
}

static void test_prune_keep_zero(void **state) {
  const fixture_t *fx = *state;
  char dir[128], empty[128];
  source_t a;
  embps_error_t err;
  source_init(&a, "a", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&a, 1, NULL);
  subdir(dir, sizeof(dir), fx->dir, "d");
  subdir(empty, sizeof(empty), fx->dir, "e");

  /* no complete checkpoint: nothing is removed, an incomplete one may be the first being
   * written */
  write_incomplete(dir, 2, &a);
  assert_int_equal(embps_ckpt_prune(dir, 2, &err), EMBPS_OK);
  expect_dir(dir, "ckpt-00000000000000000002");
  assert_int_equal(embps_ckpt_prune(empty, 2, &err), EMBPS_OK);
  expect_dir(empty, "");

  /* keep 0 keeps every complete checkpoint; what a crash left older than the newest complete
   * one is still removed (checkpoint.h: retention counts complete checkpoints) */
  write_full(dir, 1, 1, &a);
  write_full(dir, 3, 1, &a);
  write_full(dir, 5, 1, &a);
  write_full(dir, 6, 1, &a);
  assert_int_equal(embps_ckpt_prune(dir, 0, &err), EMBPS_OK);
  {
    static const uint64_t all[] = {1, 3, 5, 6};
    expect_list(dir, all, 4);
  }
  expect_dir(dir, "ckpt-00000000000000000001 ckpt-00000000000000000003 "
                  "ckpt-00000000000000000005 ckpt-00000000000000000006");
  source_free(&a);
}

/* ---- 8. the directory's check and lock ------------------------------------------------------ */

static void test_dir_check(void **state) {
  fixture_t *fx = *state;
  char path[256];
  embps_error_t err;

  assert_int_equal(embps_ckpt_dir_check(fx->dir, &err), EMBPS_OK);
  expect_dir(fx->dir, ""); /* the probe is gone */

  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, path));
  assert_true(has(err.message, "does not exist"));

  snprintf(path, sizeof(path), "%s/file", fx->dir);
  restore_file(path, (const uint8_t *)"x", 1);
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, "not a directory"));
  assert_int_equal(unlink(path), 0);

  /* not writable: a read-only mount for root (whom permissions do not stop), else a mode */
  snprintf(path, sizeof(path), "%s/ro", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  if (geteuid() == 0) {
    if (mount("tmpfs", path, "tmpfs", MS_RDONLY, "size=16k") != 0) {
      print_message("SKIP test_dir_check (not writable): cannot mount a read-only tmpfs: %s\n",
                    strerror(errno));
      return;
    }
    strcpy(fx->mnt, path);
  } else {
    assert_int_equal(chmod(path, 0555), 0);
  }
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, path));
  assert_true(has(err.message, "not writable"));
  if (fx->mnt[0]) {
    assert_int_equal(umount2(path, 0), 0);
    fx->mnt[0] = '\0';
  } else {
    assert_int_equal(chmod(path, 0755), 0);
  }
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_OK);
}

/* In a child process: tries to take dir's lock, reports status and message through the pipe. */
static void try_lock_in_child(const char *dir, embps_status_t *status, char *msg, size_t cap) {
  int p[2];
  pid_t pid;
  int wstatus;
  embps_error_t err;
  ssize_t r;
  assert_int_equal(pipe(p), 0);
  fflush(NULL);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int fd = -1;
    close(p[0]);
    memset(&err, 0, sizeof(err));
    err.status = embps_ckpt_dir_lock(dir, "the child", &fd, &err);
    if (write(p[1], &err, sizeof(err)) != (ssize_t)sizeof(err))
      _exit(2);
    _exit(0);
  }
  close(p[1]);
  r = read(p[0], &err, sizeof(err));
  close(p[0]);
  assert_int_equal(waitpid(pid, &wstatus, 0), pid);
  assert_true(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  assert_int_equal(r, sizeof(err));
  *status = err.status;
  snprintf(msg, cap, "%s", err.message);
}

static void test_dir_lock(void **state) {
  const fixture_t *fx = *state;
  char holder[64], path[256], msg[512];
  embps_status_t st;
  embps_error_t err;
  int fd = -1;
  uint8_t *text;
  size_t n;

  snprintf(holder, sizeof(holder), "pid %ld on host test, group of 4", (long)getpid());
  assert_int_equal(embps_ckpt_dir_lock(fx->dir, holder, &fd, &err), EMBPS_OK);
  assert_true(fd >= 0);
  snprintf(path, sizeof(path), "%s/LOCK", fx->dir);
  text = slurp(path, &n);
  assert_int_equal(n, strlen(holder) + 1);
  assert_memory_equal(text, holder, strlen(holder));
  assert_int_equal(text[n - 1], '\n');
  free(text);

  try_lock_in_child(fx->dir, &st, msg, sizeof(msg));
  assert_int_equal(st, EMBPS_FAILED_PRECONDITION);
  assert_true(has(msg, holder));
  assert_true(has(msg, fx->dir));
  /* the refused child did not overwrite the holder */
  text = slurp(path, &n);
  assert_memory_equal(text, holder, strlen(holder));
  free(text);

  /* released when closed: the next one takes it */
  close(fd);
  try_lock_in_child(fx->dir, &st, msg, sizeof(msg));
  assert_int_equal(st, EMBPS_OK);
  text = slurp(path, &n);
  assert_int_equal(n, strlen("the child\n"));
  assert_memory_equal(text, "the child\n", n);
  free(text);

  /* a directory that does not exist */
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_not_equal(embps_ckpt_dir_lock(path, holder, &fd, &err), EMBPS_OK);
  assert_true(has(err.message, path));
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optimizers_covered),
      cmocka_unit_test(test_names),
      T(test_round_trip),
      T(test_read_refusals),
      T(test_descriptor_zero),
      T(test_incremental_chain),
      T(test_chain_loop),
      T(test_manifest),
      T(test_slice_every_byte),
      T(test_slice_corruption),
      T(test_parallel_read),
      T(test_slice_refusals),
      T(test_no_space),
      T(test_list_and_prune),
      T(test_prune_keep_zero),
      T(test_dir_check),
      T(test_dir_lock),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
