/* `embps assign` and `embps import`: rows written into a table as given (the Assign RPC).
 *
 * assign writes one batch: tokens from --tokens, rows from --rows (decimal) or --rows-file (a
 * .npy), and prints the reply. import streams a .npy array of (rows, emb_width) into a table in
 * batches, creating the table with the array's shape when the group lacks it:
 *
 *   - dtype: float32 rows, or uint16 rows holding bf16 bits. A bf16 table takes uint16 bits as
 *     they are and float32 rounded to nearest even; an f32 table takes float32 as it is and bf16
 *     bits widened exactly (npy.h reads the file; anything else is refused naming the file).
 *   - Without --ids, array row i is table row (or hash key) i, and a dense table's row 0, the
 *     padding row, is not written (a warning says so when the array's row 0 is not zeros). With
 *     --ids (a 1-D int64/uint64/int32/uint32 .npy of one id per row), row i goes to ids[i].
 *   - Created tables: dense of rows = the array's rows without --ids, hash-keyed of capacity =
 *     the array's rows with them, in the array's dtype, with the optimizer's defaults.
 *   - Everything is checked before the first batch leaves: the files (npy.h), the width, the
 *     dtype, the ids' length and, for a dense table, their range (or the array's rows against
 *     the table's). A batch that fails later says which --start resumes.
 *
 * The files are mapped, not read: a batch of an f32 array into an f32 table (or bf16 bits into a
 * bf16 table) is sent straight from the mapping, and only a conversion copies. Two batches are
 * kept in flight, so one's round on the servers overlaps the next one's sending. A progress line
 * goes to stderr when stderr is a terminal. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "client/cli/npy.h"
#include "common/dtype.h"
#include "embps/embps.h"

#define IMPORT_BATCH_BYTES ((uint64_t)8 << 20)
#define IN_FLIGHT 2

/* Rows of file (f32 or bf16 bits) as a table of dtype takes them: the mapping itself, or
 * converted into buf (n x width elements of dtype). */
static const void *table_rows(const embps_npy_t *f, uint64_t first, size_t n, size_t width,
                              embps_dtype_t dtype, void *buf) {
  const uint8_t *src = f->data + first * width * f->itemsize;
  const size_t k = n * width;
  if (f->dtype == EMBPS_NPY_F32 && dtype == EMBPS_DTYPE_BF16) {
    for (size_t i = 0; i < k; i++) {
      float v;
      memcpy(&v, src + 4 * i, 4);
      ((uint16_t *)buf)[i] = embps_f32_to_bf16(v);
    }
    return buf;
  }
  if (f->dtype == EMBPS_NPY_U16 && dtype == EMBPS_DTYPE_F32) {
    for (size_t i = 0; i < k; i++) {
      uint16_t b;
      memcpy(&b, src + 2 * i, 2);
      ((float *)buf)[i] = embps_bf16_to_f32(b);
    }
    return buf;
  }
  return src;
}

/* Id i of an ids file, as an int64 token (uint64 keys keep their bits). */
static int64_t id_at(const embps_npy_t *ids, uint64_t i) {
  const uint8_t *p = ids->data + i * ids->itemsize;
  switch (ids->dtype) {
  case EMBPS_NPY_I32: {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
  }
  case EMBPS_NPY_U32: {
    uint32_t v;
    memcpy(&v, p, 4);
    return (int64_t)v;
  }
  default: {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
  }
  }
}

static int check_rows_file(const char *cmd, const char *path, const embps_npy_t *f) {
  if ((f->dtype != EMBPS_NPY_F32 && f->dtype != EMBPS_NPY_U16) || f->ndim != 2) {
    fprintf(stderr,
            "embps: %s: %s holds %s%s of %u dimensions: rows must be a 2-D (rows, emb_width) "
            "array of float32, or of uint16 holding bf16 bits\n",
            cmd, path, f->ndim == 2 ? "" : "an array of ", embps_npy_dtype_name(f->dtype), f->ndim);
    return EMBPS_CLI_EXIT_USAGE;
  }
  return 0;
}

/* ---- assign ---- */

embps_cli_flag_t embps_cli_assign_flags[] = {
    {"--tokens", "1,2", "token ids (required; a hash-keyed table's keys)", NULL},
    {"--rows", "\"v,v,...|v,v,...\"", "one full-width row per token, rows split by |", NULL},
    {"--rows-file", "ROWS.npy",
     "the rows as a .npy (float32, or uint16 bf16 bits), one per token (instead of --rows)", NULL},
    {"--keep-state", NULL, "keep the rows' optimizer state (default: reset it)", NULL},
    {NULL, NULL, NULL, NULL}};

int embps_cli_cmd_assign(const char *cmd, embps_cli_flag_t *f, const char *name) {
  const char *file = embps_cli_flag(f, "--rows-file");
  int64_t *tokens = NULL;
  float *vals = NULL;
  void *buf = NULL;
  const void *rows;
  size_t n, nv = 0, nrows = 0, nt = 0, width, es;
  char err[1024];
  embps_npy_t npy;
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t *t;
  embps_assign_result_t res;
  embps_client_t *c;
  embps_status_t st;
  int rc = 1;

  memset(&npy, 0, sizeof(npy));
  if (!embps_cli_flag(f, "--tokens"))
    return embps_cli_usage_error(cmd, "--tokens is required");
  if (!!embps_cli_flag(f, "--rows") == !!file)
    return embps_cli_usage_error(cmd, "give exactly one of --rows and --rows-file");
  if (embps_cli_parse_i64_list("--tokens", embps_cli_flag(f, "--tokens"), &tokens, &n, err,
                               sizeof(err)) != 0)
    return embps_cli_usage_error(cmd, err);
  if (!file && embps_cli_parse_f32_rows("--rows", embps_cli_flag(f, "--rows"), &vals, &nv, &nrows,
                                        err, sizeof(err)) != 0) {
    free(tokens);
    return embps_cli_usage_error(cmd, err);
  }
  if (file) {
    if (embps_npy_open(file, &npy, err, sizeof(err)) != 0) {
      fprintf(stderr, "embps: %s: %s\n", cmd, err);
      rc = EMBPS_CLI_EXIT_USAGE;
      goto exit;
    }
    if ((rc = check_rows_file(cmd, file, &npy)) != 0)
      goto exit;
    rc = 1;
  }
  if (!(c = embps_cli_connect(cmd, 1)) || embps_cli_find_table(cmd, c, name, &tables, &nt, &t) != 0)
    goto exit;
  width = t->emb_width;
  es = embps_dtype_size(t->dtype);
  if (file ? (npy.shape[0] != n || npy.shape[1] != width) : (nrows != n || nv != n * width)) {
    fprintf(stderr,
            "embps: %s: %s has %llu rows of %llu values; table %s needs %zu rows (one per token) "
            "of %zu values (emb_width)\n",
            cmd, file ? file : "--rows", (unsigned long long)(file ? npy.shape[0] : nrows),
            (unsigned long long)(file    ? npy.shape[1]
                                 : nrows ? nv / nrows
                                         : 0),
            name, n, width);
    rc = EMBPS_CLI_EXIT_USAGE;
    goto exit;
  }
  if (!(buf = malloc(n * width * es + 1))) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    goto exit;
  }
  if (file) {
    rows = table_rows(&npy, 0, n, width, t->dtype, buf);
  } else {
    for (size_t i = 0; i < n * width; i++) {
      if (t->dtype == EMBPS_DTYPE_BF16)
        ((uint16_t *)buf)[i] = embps_f32_to_bf16(vals[i]);
      else
        ((float *)buf)[i] = vals[i];
    }
    rows = buf;
  }
  st = embps_assign(c, name, tokens, n, rows, n * width * es, t->dtype,
                    !embps_cli_flag(f, "--keep-state"), &res);
  if (st != EMBPS_OK) {
    embps_cli_call_failed(cmd, c, st);
    goto exit;
  }
  printf("assigned=%llu refused=%llu%s\n", (unsigned long long)res.num_assigned,
         (unsigned long long)res.num_refused, res.replayed ? " replayed=1" : "");
  rc = 0;
exit:
  free(buf);
  free(vals);
  free(tokens);
  embps_npy_close(&npy);
  embps_tables_free(tables, nt);
  return rc;
}

/* ---- import ---- */

embps_cli_flag_t embps_cli_import_flags[] = {
    {"FILE.npy", NULL, "the rows: a 2-D float32 .npy, or uint16 holding bf16 bits", NULL},
    {"--ids", "IDS.npy", "one id per row (int64 or uint64 .npy; default: row i is id i)", NULL},
    {"--start", "N", "the first row of the file to send, to resume an import (default 0)", NULL},
    {"--batch-rows", "B", "rows per assign (default: about 8 MiB of rows)", NULL},
    {"--keep-state", NULL, "keep the rows' optimizer state (default: reset it)", NULL},
    {"--no-progress", NULL, "print no progress line (default: one on a terminal's stderr)", NULL},
    {NULL, NULL, NULL, NULL}};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* One batch in flight: its call, its rows [lo, hi) of the file, and the buffers it reads. */
typedef struct slot {
  embps_call_t *call;
  uint64_t lo, hi;
  int64_t *tokens;
  void *conv;
  embps_assign_result_t res;
} slot_t;

typedef struct import {
  const char *cmd, *name, *path, *ids_path;
  embps_client_t *c;
  embps_npy_t rows, ids;
  int have_ids;
  embps_dtype_t dtype;
  size_t width, row_bytes;
  uint64_t start, batch, total, done, assigned, refused;
  int progress, reset;
  double t0, shown;
} import_t;

static void show(import_t *im, int final) {
  double t = now_s();
  if (!im->progress || (!final && t - im->shown < 0.2))
    return;
  im->shown = t;
  fprintf(stderr, "\rimport %s: %" PRIu64 "/%" PRIu64 " rows (%.1f%%), %.0f rows/s%s", im->name,
          im->done, im->total, im->total ? 100.0 * (double)im->done / (double)im->total : 100.0,
          (double)(im->done - im->start) / (t - im->t0 > 1e-9 ? t - im->t0 : 1e-9),
          final ? "\n" : "");
  fflush(stderr);
}

/* Waits for slot s's batch; on failure says what was written and how to resume. */
static int settle(import_t *im, slot_t *s) {
  embps_status_t st = embps_call_wait(s->call);
  s->call = NULL;
  if (st != EMBPS_OK) {
    if (im->progress)
      fputc('\n', stderr);
    embps_cli_call_failed(im->cmd, im->c, st);
    fprintf(stderr,
            "embps: %s: the import stopped at row %" PRIu64 " of %s: rows [%" PRIu64 ", %" PRIu64
            ") were written; resume with --start %" PRIu64 "\n",
            im->cmd, s->lo, im->path, im->start, s->lo, s->lo);
    return 1;
  }
  im->assigned += s->res.num_assigned;
  im->refused += s->res.num_refused;
  im->done = s->hi;
  show(im, 0);
  return 0;
}

/* Sends every batch from im->start on, IN_FLIGHT at a time. */
static int send_all(import_t *im) {
  slot_t slots[IN_FLIGHT];
  size_t k = 0;
  int rc = 0;
  memset(slots, 0, sizeof(slots));
  for (size_t i = 0; i < IN_FLIGHT; i++) {
    slots[i].tokens = malloc(im->batch * sizeof(int64_t) + 1);
    slots[i].conv = malloc(im->batch * im->row_bytes + 1);
    if (!slots[i].tokens || !slots[i].conv) {
      fprintf(stderr, "embps: %s: out of memory for batches of %" PRIu64 " rows\n", im->cmd,
              im->batch);
      rc = 1;
      goto exit;
    }
  }
  for (uint64_t lo = im->start; lo < im->total; lo += im->batch, k = (k + 1) % IN_FLIGHT) {
    slot_t *s = &slots[k];
    const uint64_t hi = im->total - lo < im->batch ? im->total : lo + im->batch;
    const size_t n = (size_t)(hi - lo);
    const void *rows;
    embps_status_t st;
    if (s->call && (rc = settle(im, s)) != 0)
      goto exit;
    for (size_t i = 0; i < n; i++)
      s->tokens[i] = im->have_ids ? id_at(&im->ids, lo + i) : (int64_t)(lo + i);
    rows = table_rows(&im->rows, lo, n, im->width, im->dtype, s->conv);
    s->lo = lo;
    s->hi = hi;
    st = embps_assign_start(im->c, im->name, s->tokens, n, rows, n * im->row_bytes, im->dtype,
                            im->reset, &s->res, &s->call);
    if (st != EMBPS_OK) {
      s->call = NULL;
      embps_cli_call_failed(im->cmd, im->c, st);
      fprintf(stderr,
              "embps: %s: rows [%" PRIu64 ", %" PRIu64 ") of %s were sent; resume with "
              "--start %" PRIu64 "\n",
              im->cmd, im->start, lo, im->path, lo);
      rc = 1;
      goto exit;
    }
  }
  for (size_t i = 0; i < IN_FLIGHT; i++, k = (k + 1) % IN_FLIGHT)
    if (slots[k].call && (rc = settle(im, &slots[k])) != 0)
      goto exit;
exit:
  for (size_t i = 0; i < IN_FLIGHT; i++) {
    embps_call_cancel(slots[i].call);
    free(slots[i].tokens);
    free(slots[i].conv);
  }
  return rc;
}

/* The checks against the table that leave nothing written when they fail. */
static int check_table(import_t *im, const embps_table_spec_t *t) {
  if (t->emb_width != im->width) {
    fprintf(stderr,
            "embps: %s: %s holds rows of %zu values, but table %s has emb_width=%u: import an "
            "array of emb_width columns\n",
            im->cmd, im->path, im->width, im->name, t->emb_width);
    return EMBPS_CLI_EXIT_USAGE;
  }
  if (t->capacity) /* hash-keyed: any id is a key */
    return 0;
  if (!im->have_ids && im->total > t->rows) {
    fprintf(stderr,
            "embps: %s: %s has %" PRIu64 " rows, but table %s has rows=%" PRIu64 ": row i of "
            "the file is table row i; import into a table of at least %" PRIu64
            " rows, or give --ids\n",
            im->cmd, im->path, im->total, im->name, t->rows, im->total);
    return EMBPS_CLI_EXIT_USAGE;
  }
  for (uint64_t i = im->start; im->have_ids && i < im->total; i++) {
    int64_t id = id_at(&im->ids, i);
    if (id < 0 || (uint64_t)id >= t->rows) {
      fprintf(stderr,
              "embps: %s: %s: id %" PRId64 " at position %" PRIu64 " is outside [0, %" PRIu64
              ") of table %s: nothing was written\n",
              im->cmd, im->ids_path, id, i, t->rows, im->name);
      return EMBPS_CLI_EXIT_USAGE;
    }
  }
  if (!im->have_ids && im->start == 0 && im->total > 0) {
    for (size_t j = 0; j < im->width * im->rows.itemsize; j++)
      if (im->rows.data[j]) {
        fprintf(stderr,
                "embps: %s: warning: row 0 of %s is not zeros, and row 0 of table %s is the "
                "padding row, which is not written; give --ids to place the rows elsewhere\n",
                im->cmd, im->path, im->name);
        break;
      }
  }
  return 0;
}

int embps_cli_cmd_import(const char *cmd, embps_cli_flag_t *f, const char *name) {
  const char *ids_path = embps_cli_flag(f, "--ids");
  import_t im;
  char err[1024];
  embps_table_spec_t *tables = NULL, *made = NULL;
  const embps_table_spec_t *t = NULL;
  size_t nt = 0;
  uint64_t batch = 0;
  int rc = EMBPS_CLI_EXIT_USAGE;

  memset(&im, 0, sizeof(im));
  im.cmd = cmd;
  im.name = name;
  im.path = embps_cli_flag(f, "FILE.npy");
  im.ids_path = ids_path;
  im.reset = !embps_cli_flag(f, "--keep-state");
  im.progress = !embps_cli_flag(f, "--no-progress") && isatty(2);
  if (embps_npy_open(im.path, &im.rows, err, sizeof(err)) != 0 ||
      (ids_path && embps_npy_open(ids_path, &im.ids, err, sizeof(err)) != 0)) {
    fprintf(stderr, "embps: %s: %s\n", cmd, err);
    goto exit;
  }
  if (check_rows_file(cmd, im.path, &im.rows) != 0)
    goto exit;
  im.total = im.rows.shape[0];
  im.width = (size_t)im.rows.shape[1];
  if (ids_path) {
    im.have_ids = 1;
    if (im.ids.dtype == EMBPS_NPY_F32 || im.ids.dtype == EMBPS_NPY_U16 || im.ids.ndim != 1 ||
        im.ids.shape[0] != im.total) {
      fprintf(stderr,
              "embps: %s: %s holds %s of shape (%" PRIu64 ", %" PRIu64 ") in %u dimensions: ids "
              "must be a 1-D integer array (int64, uint64, int32 or uint32) of one id per row of "
              "%s (%" PRIu64 ")\n",
              cmd, ids_path, embps_npy_dtype_name(im.ids.dtype), im.ids.shape[0], im.ids.shape[1],
              im.ids.ndim, im.path, im.total);
      goto exit;
    }
  }
  if (embps_cli_flag_u64(cmd, f, "--start", 0, im.total, 0, &im.start) != 0 ||
      embps_cli_flag_u64(cmd, f, "--batch-rows", 1, UINT32_MAX, 0, &batch) != 0)
    goto exit;
  rc = 1;
  if (!(im.c = embps_cli_connect(cmd, 1)))
    goto exit;
  if (embps_list_tables(im.c, &tables, &nt) != EMBPS_OK) {
    embps_cli_call_failed(cmd, im.c, embps_client_last_status(im.c));
    goto exit;
  }
  for (size_t i = 0; i < nt && !t; i++)
    if (strcmp(tables[i].name, name) == 0)
      t = &tables[i];
  if (!t) { /* a table of the file's shape */
    embps_table_spec_t spec;
    embps_table_spec_init(&spec);
    spec.name = name;
    spec.emb_width = (uint32_t)im.width;
    spec.dtype = im.rows.dtype == EMBPS_NPY_U16 ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
    if (im.have_ids)
      spec.capacity = im.total;
    else
      spec.rows = im.total;
    if (im.total == 0 || im.width != spec.emb_width) {
      fprintf(stderr, "embps: %s: %s has no rows to create table %s from\n", cmd, im.path, name);
      rc = EMBPS_CLI_EXIT_USAGE;
      goto exit;
    }
    if (embps_create_table_answered(im.c, &spec, &made) != EMBPS_OK) {
      embps_cli_call_failed(cmd, im.c, embps_client_last_status(im.c));
      goto exit;
    }
    embps_cli_print_created(stdout, made);
    t = made;
  }
  if ((rc = check_table(&im, t)) != 0)
    goto exit;
  rc = 1;
  im.dtype = t->dtype ? t->dtype : EMBPS_DTYPE_F32;
  im.row_bytes = im.width * embps_dtype_size(im.dtype);
  if (!batch)
    batch = IMPORT_BATCH_BYTES / (im.row_bytes ? im.row_bytes : 1);
  /* whole shards (the last batch is padded with token 0, which writes nothing) */
  batch = batch / embps_client_group_size(im.c) * embps_client_group_size(im.c);
  im.batch = batch ? batch : embps_client_group_size(im.c);
  embps_client_set_padding(im.c, 1);
  im.t0 = now_s();
  im.done = im.start;
  if ((rc = send_all(&im)) != 0)
    goto exit;
  show(&im, 1);
  printf("imported %" PRIu64 " rows of %s into %s: assigned=%" PRIu64 " refused=%" PRIu64 "\n",
         im.total - im.start, im.path, name, im.assigned, im.refused);
exit:
  embps_npy_close(&im.rows);
  embps_npy_close(&im.ids);
  embps_tables_free(tables, nt);
  embps_tables_free(made, 1);
  return rc;
}
