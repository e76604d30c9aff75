/* The checkpoint tests' shared fixture (ckpt_fixture.c): a temporary directory per test, file
 * helpers, tables with deterministic distinct values split into any group's slices, whole
 * checkpoints written as a group writes them, and read back bit for bit (once the top of
 * tests/unit/server/test_checkpoint.c, before checkpoint.c became the ckpt_*.c modules). Every
 * helper asserts through cmocka, so a test that calls one fails where the helper finds a fault. */
#ifndef EMBPS_TESTS_CKPT_FIXTURE_H
#define EMBPS_TESTS_CKPT_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "server/store/checkpoint.h"
#include "server/store/store.h"

/* A block's payload is at most about this (ckpt_codec.c's EMBPS__CKPT_BLOCK_TARGET, as
 * docs/checkpoint-format.md states): a slice file larger than twice it holds at least three blocks.
 */
#define BLOCK_BYTES (1u << 20)

/* ---- the fixture: a temporary directory, and a tmpfs mount to undo --------------------------- */

typedef struct fixture {
  char dir[64];  /* this test's directory */
  char mnt[160]; /* a tmpfs the test mounted ("" when none): teardown unmounts it */
} fixture_t;

int setup(void **state);
int teardown(void **state);
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

/* ---- files ----------------------------------------------------------------------------------- */

int exists(const char *path);
uint64_t file_size(const char *path);
/* The whole file (caller frees); *n its size. */
uint8_t *slurp(const char *path, size_t *n);
uint8_t byte_at(const char *path, uint64_t off);
void set_byte(const char *path, uint64_t off, uint8_t b);
void flip_byte(const char *path, uint64_t off);
/* The names in dir ("." and ".." left out) are exactly `names`, sorted, joined by spaces. */
void expect_dir(const char *dir, const char *names);
void ckpt_dir(char *out, size_t cap, const char *dir, uint64_t round);
void slice_path(char *out, size_t cap, const char *dir, uint64_t round, uint32_t rank,
                const char *table);
void subdir(char *out, size_t cap, const char *dir, const char *name);
/* Whether haystack holds needle; prints both when not. */
int has(const char *haystack, const char *needle);
/* Writes the n bytes at p as the whole file at path. */
void restore_file(const char *path, const uint8_t *p, size_t n);

/* ---- a table with deterministic, distinct values --------------------------------------------- */

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

/* Every optimizer and dtype the round trips cover. */
extern const embps_optimizer_t optimizers[4];
extern const embps_dtype_t dtypes[2];

void source_init(source_t *s, const char *name, uint64_t rows, uint32_t width, embps_dtype_t dtype,
                 embps_optimizer_t opt);
void source_free(source_t *s);
void source_copy(source_t *to, const source_t *from);
/* Gives every row (dirty NULL) or every dirty row new values under salt. */
void source_fill(source_t *s, uint64_t salt, const uint64_t *dirty);
/* A dirty-row map of `rows` rows with the listed rows set (caller frees). */
uint64_t *dirty_map(uint64_t rows, const uint64_t *list, size_t n);
/* A dirty-row map with rows first..last set (caller frees). */
uint64_t *dirty_range(uint64_t rows, uint64_t first, uint64_t last);
/* Rank `rank`'s slice of s for a group of g (its own copies of the columns; free with
 * slice_free). */
embps_ckpt_slice_t slice_of(const source_t *s, uint32_t rank, uint32_t g, uint64_t round,
                            uint64_t base_round, const uint64_t *dirty);
void slice_free(embps_ckpt_slice_t *sl);

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
void write_ckpt(const char *dir, uint64_t round, uint64_t base_round, const char *scope, uint32_t g,
                const source_t *const *tables, const uint64_t *const *dirty, size_t n);
/* A full checkpoint of s alone, of every table (scope ""). */
void write_full(const char *dir, uint64_t round, uint32_t g, const source_t *s);
/* A checkpoint directory with a slice but no manifest: a write that never finished. */
void write_incomplete(const char *dir, uint64_t round, const source_t *s);
/* Sets the size the manifest of `round` records for rank's file of table to its size on disk. */
void manifest_accept_size(const char *dir, uint64_t round, uint32_t rank, const char *table);

/* ---- reading back ---------------------------------------------------------------------------- */

typedef struct dest_buf {
  embps_ckpt_dest_t d;
  size_t bytes[3];
} dest_buf_t;

/* Destination arrays for columns [cb, cb + w) of s, filled with a pattern no slice holds. */
void dest_init(dest_buf_t *b, const source_t *s, uint32_t cb, uint32_t w);
void dest_free(dest_buf_t *b);
/* The destination holds exactly columns [cb, cb + w) of s. */
void expect_dest(const dest_buf_t *b, const source_t *s);
/* Reads columns [cb, cb + w) of table s from checkpoint `round`; returns the status, err set. */
embps_status_t read_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb,
                          uint32_t w, dest_buf_t *b, embps_error_t *err);
/* Columns [cb, cb + w) of checkpoint `round` are those of s, bit for bit. */
void expect_range(const char *dir, uint64_t round, const source_t *s, uint32_t cb, uint32_t w);
/* Reading the whole table fails with `status` and a message holding each of the strings. */
void expect_read_error(const char *dir, uint64_t round, const source_t *s, embps_status_t status,
                       const char *a, const char *b);
/* dir lists exactly the complete checkpoints of these rounds, in this order. */
void expect_list(const char *dir, const uint64_t *rounds, size_t n);

#endif
