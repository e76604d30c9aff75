/* The checkpoint tests' shared fixture (ckpt_fixture.h). The byte offsets the corruption tests
 * use are the layouts documented at the top of server/store/ckpt_codec.c. */
#include "tests/unit/store/ckpt_fixture.h"

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
#include <unistd.h>

/* ---- the fixture: a temporary directory, and a tmpfs mount to undo ---------------------------
 */

int setup(void **state) {
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

int teardown(void **state) {
  fixture_t *fx = *state;
  if (fx->mnt[0])
    umount2(fx->mnt, MNT_DETACH);
  nftw(fx->dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  free(fx);
  return 0;
}

/* ---- files ---------------------------------------------------------------------------------- */

int exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

uint64_t file_size(const char *path) {
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  return (uint64_t)st.st_size;
}

/* The whole file (caller frees); *n its size. */
uint8_t *slurp(const char *path, size_t *n) {
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

uint8_t byte_at(const char *path, uint64_t off) {
  uint8_t b = 0;
  int fd = open(path, O_RDONLY);
  assert_true(fd >= 0);
  assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
  close(fd);
  return b;
}

void set_byte(const char *path, uint64_t off, uint8_t b) {
  int fd = open(path, O_WRONLY);
  assert_true(fd >= 0);
  assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
  close(fd);
}

void flip_byte(const char *path, uint64_t off) {
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

void expect_dir(const char *dir, const char *names) {
  char got[2048];
  dir_names(dir, got, sizeof(got));
  if (strcmp(got, names) != 0)
    fail_msg("%s holds [%s], expected [%s]", dir, got, names);
}

void ckpt_dir(char *out, size_t cap, const char *dir, uint64_t round) {
  embps_ckpt_path(out, cap, dir, round);
}

void slice_path(char *out, size_t cap, const char *dir, uint64_t round, uint32_t rank,
                const char *table) {
  char ck[EMBPS_CKPT_PATH_MAX], name[EMBPS_TABLE_NAME_MAX + 32];
  ckpt_dir(ck, sizeof(ck), dir, round);
  embps_ckpt_slice_name(name, sizeof(name), rank, table);
  snprintf(out, cap, "%s/%s", ck, name);
}

void subdir(char *out, size_t cap, const char *dir, const char *name) {
  snprintf(out, cap, "%s/%s", dir, name);
  assert_int_equal(mkdir(out, 0755), 0);
}

int has(const char *haystack, const char *needle) {
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

const embps_optimizer_t optimizers[4] = {EMBPS_OPTIMIZER_SGD, EMBPS_OPTIMIZER_ADAGRAD,
                                         EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_OPTIMIZER_ADAM};
const embps_dtype_t dtypes[2] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};

void source_init(source_t *s, const char *name, uint64_t rows, uint32_t width, embps_dtype_t dtype,
                 embps_optimizer_t opt) {
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

void source_free(source_t *s) {
  free(s->data);
  free(s->state0);
  free(s->state1);
  memset(s, 0, sizeof(*s));
}

void source_copy(source_t *to, const source_t *from) {
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
void source_fill(source_t *s, uint64_t salt, const uint64_t *dirty) {
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
uint64_t *dirty_map(uint64_t rows, const uint64_t *list, size_t n) {
  uint64_t *d = calloc(embps_dirty_words(rows), sizeof(uint64_t));
  assert_non_null(d);
  for (size_t i = 0; i < n; i++) {
    assert_true(list[i] < rows);
    d[list[i] / 64] |= UINT64_C(1) << (list[i] % 64);
  }
  return d;
}

uint64_t *dirty_range(uint64_t rows, uint64_t first, uint64_t last) {
  uint64_t *d = calloc(embps_dirty_words(rows), sizeof(uint64_t));
  assert_non_null(d);
  for (uint64_t r = first; r <= last; r++)
    d[r / 64] |= UINT64_C(1) << (r % 64);
  return d;
}

/* Rank `rank`'s slice of s for a group of g (its own copies of the columns; free with
 * slice_free). */
embps_ckpt_slice_t slice_of(const source_t *s, uint32_t rank, uint32_t g, uint64_t round,
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
  sl.base_round = dirty ? base_round : 0; /* as a rank writes a table it could not track */
  sl.dirty = dirty;
  sl.data = data;
  sl.state0 = s0;
  sl.state1 = s1;
  return sl;
}

void slice_free(embps_ckpt_slice_t *sl) {
  free((void *)sl->data);
  free((void *)sl->state0);
  free((void *)sl->state1);
}

/* Writes checkpoint `round` of the n tables in dir as a group of g writes it: each rank's slice
 * of each table (dirty[i] NULL: every row), then the manifest. */
void write_ckpt(const char *dir, uint64_t round, uint64_t base_round, const char *scope, uint32_t g,
                const source_t *const *tables, const uint64_t *const *dirty, size_t n) {
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

void write_full(const char *dir, uint64_t round, uint32_t g, const source_t *s) {
  const source_t *t[1] = {s};
  write_ckpt(dir, round, 0, "", g, t, NULL, 1);
}

/* ---- reading back ----------------------------------------------------------------------------
 */

/* Destination arrays for columns [cb, cb + w) of s, filled with a pattern no slice holds. */
void dest_init(dest_buf_t *b, const source_t *s, uint32_t cb, uint32_t w) {
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

void dest_free(dest_buf_t *b) {
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
void expect_dest(const dest_buf_t *b, const source_t *s) {
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
embps_status_t read_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb,
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
void expect_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb, uint32_t w) {
  dest_buf_t b;
  embps_error_t err;
  if (read_range(dir, round, s, cb, w, &b, &err) != EMBPS_OK)
    fail_msg("reading columns %" PRIu32 "+%" PRIu32 " of '%s' in round %" PRIu64 ": %s", cb, w,
             s->cfg.name, round, err.message);
  expect_dest(&b, s);
  dest_free(&b);
}

/* Reading the whole table fails with `status` and a message holding each of the strings. */
void expect_read_error(const char *dir, uint64_t round, const source_t *s, embps_status_t status,
                       const char *a, const char *b) {
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

/* Sets the size the manifest of `round` records for rank's file of table to its size on disk. */
void manifest_accept_size(const char *dir, uint64_t round, uint32_t rank, const char *table) {
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

void restore_file(const char *path, const uint8_t *p, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(p, 1, n, f), n);
  fclose(f);
}

void expect_list(const char *dir, const uint64_t *rounds, size_t n) {
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
void write_incomplete(const char *dir, uint64_t round, const source_t *s) {
  char ck[EMBPS_CKPT_PATH_MAX];
  write_full(dir, round, 1, s);
  ckpt_dir(ck, sizeof(ck), dir, round);
  snprintf(ck + strlen(ck), sizeof(ck) - strlen(ck), "/%s", EMBPS_CKPT_MANIFEST);
  assert_int_equal(unlink(ck), 0);
}
