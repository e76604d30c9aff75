/* `embps export`: one table of a complete checkpoint written as numpy .npy files, offline (no
 * server), for any group size that wrote it, full or incremental (through its chain).
 *
 * Which checkpoint: CHECKPOINT is either one checkpoint's directory (ckpt-<round>, whose parent
 * holds its chain) or a --checkpoint-dir, of which the newest complete checkpoint that holds the
 * table is read, or the one of --round R. A checkpoint without a complete manifest is never read.
 *
 * What is written in DIR: rows.npy (N x emb_width: float32, or a bf16 table's uint16 bit
 * patterns unless --f32 widens them), keys.npy for a hash-keyed table (int64, the stored keys in
 * ascending slot order, row i of rows.npy being key i's), with --state the optimizer's arrays
 * (accumulators.npy; m.npy and v.npy), and table.json (the spec, round, step, files). Each file
 * is written as NAME.tmp and renamed once whole, so a failed export leaves no partial .npy under
 * its name. The rows stream through in chunks of about 8 MiB (ckpt_stream.h): memory does not
 * grow with the table, beyond a hash-keyed table's key index. A progress line goes to stderr when
 * it is a terminal. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <dirent.h>

#include "client/cli/args.h"
#include "client/cli/npy_out.h"
#include "client/cli/offline.h"
#include "common/alloc.h"
#include "common/dtype.h"
#include "common/eviction.h"
#include "common/optimizer.h"
#include "server/store/checkpoint.h"
#include "server/store/ckpt_stream.h"
#include "server/store/hindex.h"
#include "server/store/store.h"

embps_cli_flag_t embps_cli_export_flags[] = {
    {"--table", "NAME", "the table to export (required)", NULL},
    {"--out", "DIR", "the directory to write the .npy files in, created if missing (required)",
     NULL},
    {"--round", "R",
     "the checkpoint of round R of a checkpoint directory (default: the newest complete one that "
     "holds the table)",
     NULL},
    {"--state", NULL, "also write the optimizer's state arrays (accumulators.npy, m.npy, v.npy)",
     NULL},
    {"--f32", NULL, "write a bf16 table's rows widened to float32 (exact), not as uint16 bits",
     NULL},
    {NULL, NULL, NULL, NULL}};

#define CHUNK_BYTES (8u << 20)
#define PATH_CAP 4096

static int failed(const char *cmd, embps_status_t st, const char *msg) {
  fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_str(st), msg);
  return 1;
}

/* ---- which checkpoint ---------------------------------------------------------------------- */

/* Whether name is a checkpoint directory's name (ckpt- and 20 digits). */
static int ckpt_name(const char *name) {
  if (strncmp(name, "ckpt-", 5) != 0 || strlen(name) != 25)
    return 0;
  for (const char *c = name + 5; *c; c++)
    if (*c < '0' || *c > '9')
      return 0;
  return 1;
}

/* The checkpoint directories in dir, complete or not. */
static size_t count_ckpt_dirs(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  size_t n = 0;
  if (!d)
    return 0;
  while ((e = readdir(d)))
    n += ckpt_name(e->d_name);
  closedir(d);
  return n;
}

static int holds(const embps_ckpt_manifest_t *m, const char *table) {
  for (size_t i = 0; i < m->num_tables; i++)
    if (strcmp(m->tables[i].name, table) == 0)
      return 1;
  return 0;
}

/* Picks the checkpoint CHECKPOINT (path) and --round (round_text, may be NULL) name for table:
 * its manifest into *m, the directory that holds it and its chain into dir. Returns 0, 1 or
 * EMBPS_CLI_EXIT_USAGE after printing why. */
static int choose(const char *cmd, const char *path, const char *table, const char *round_text,
                  char *dir, size_t cap, embps_ckpt_manifest_t *m) {
  char p[PATH_CAP], manifest[PATH_CAP + 16], msg[PATH_CAP + 512];
  const char *base;
  uint64_t round = 0, chosen;
  struct stat st;
  embps_error_t err;
  embps_status_t ret;

  snprintf(p, sizeof(p), "%s", path);
  for (size_t len = strlen(p); len > 1 && p[len - 1] == '/'; len--)
    p[len - 1] = '\0';
  if (round_text &&
      embps_cli_parse_u64("--round", round_text, 1, UINT64_MAX, &round, msg, sizeof(msg)) != 0)
    return embps_cli_usage_error(cmd, msg);
  if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
    snprintf(msg, sizeof(msg),
             "%s is not a directory: name a checkpoint directory or one "
             "checkpoint's directory (ckpt-<round>) in it",
             p);
    return failed(cmd, EMBPS_NOT_FOUND, msg);
  }
  base = strrchr(p, '/') ? strrchr(p, '/') + 1 : p;
  snprintf(manifest, sizeof(manifest), "%s/%s", p, EMBPS_CKPT_MANIFEST);
  if (ckpt_name(base) || access(manifest, F_OK) == 0) { /* one checkpoint */
    if ((ret = embps_ckpt_restore_choose(p, "", dir, cap, &chosen, &err)) != EMBPS_OK ||
        (ret = embps_ckpt_read_manifest(p, m, &err)) != EMBPS_OK)
      return failed(cmd, ret, err.message);
    if (round_text && m->round != round) {
      embps_ckpt_manifest_free(m);
      snprintf(msg, sizeof(msg), "%s is the checkpoint of round %" PRIu64 ", not --round %" PRIu64,
               p, chosen, round);
      return embps_cli_usage_error(cmd, msg);
    }
    return 0;
  }
  /* A checkpoint directory: --round's checkpoint, or the newest complete one holding table. */
  snprintf(dir, cap, "%s", p);
  if (round_text) {
    char one[PATH_CAP];
    embps_ckpt_path(one, sizeof(one), p, round);
    if ((ret = embps_ckpt_read_manifest(one, m, &err)) != EMBPS_OK)
      return failed(cmd, ret, err.message);
    return 0;
  }
  {
    embps_ckpt_manifest_t *list = NULL;
    size_t n = 0, pick = SIZE_MAX;
    if ((ret = embps_ckpt_list(p, &list, &n, &err)) != EMBPS_OK)
      return failed(cmd, ret, err.message);
    for (size_t i = n; i-- > 0 && pick == SIZE_MAX;)
      if (holds(&list[i], table))
        pick = i;
    if (pick == SIZE_MAX) {
      size_t all = count_ckpt_dirs(p);
      if (!n && !all)
        snprintf(msg, sizeof(msg),
                 "%s holds no checkpoint: name the servers' --checkpoint-dir or one checkpoint's "
                 "directory (ckpt-<round>) in it",
                 p);
      else if (!n)
        snprintf(msg, sizeof(msg),
                 "%s holds no complete checkpoint (%zu checkpoint director%s without a complete "
                 "manifest: cut short, or being written)",
                 p, all, all == 1 ? "y" : "ies");
      else
        snprintf(msg, sizeof(msg),
                 "no complete checkpoint in %s holds table '%s' (%zu complete, the newest of "
                 "round %" PRIu64 ")",
                 p, table, n, list[n - 1].round);
      embps_ckpt_list_free(list, n);
      return failed(cmd, EMBPS_NOT_FOUND, msg);
    }
    *m = list[pick];
    memset(&list[pick], 0, sizeof(list[pick]));
    embps_ckpt_list_free(list, n);
  }
  return 0;
}

/* ---- progress ------------------------------------------------------------------------------ */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct progress {
  int on; /* stderr is a terminal */
  double t0, shown;
} progress_t;

static void progress_show(progress_t *p, const char *table, uint64_t rows, uint64_t total_rows,
                          uint64_t bytes, uint64_t total_bytes, int last) {
  double t = now_s(), el = t - p->t0, rate;
  if (!p->on || (!last && t - p->shown < 0.1))
    return;
  p->shown = t;
  rate = el > 0 ? (double)bytes / el : 0;
  fprintf(stderr, "\rexport %s: %3.0f%% %" PRIu64 "/%" PRIu64 " rows, %.0f MB/s", table,
          total_bytes ? 100.0 * (double)bytes / (double)total_bytes : 100.0, rows, total_rows,
          rate / 1e6);
  if (!last && rate > 0)
    fprintf(stderr, ", %.0f s left  ", (double)(total_bytes - bytes) / rate);
  else
    fprintf(stderr, "%s", last ? "          \n" : "");
  fflush(stderr);
}

/* ---- the files ------------------------------------------------------------------------------ */

typedef struct outputs {
  embps_npy_out_t rows, keys, state[2];
  const char *state_name[2];
  int nstate, has_keys;
  char json_tmp[PATH_CAP + 32], json[PATH_CAP + 32];
} outputs_t;

static void outputs_abandon(outputs_t *o) {
  embps_npy_out_abandon(&o->rows);
  embps_npy_out_abandon(&o->keys);
  for (int i = 0; i < 2; i++)
    embps_npy_out_abandon(&o->state[i]);
  if (o->json_tmp[0])
    unlink(o->json_tmp);
}

static void json_field_str(FILE *f, const char *key, const char *v, int comma) {
  fprintf(f, "  \"%s\": ", key);
  embps_cli_json_string(f, v);
  fprintf(f, "%s\n", comma ? "," : "");
}

/* Writes table.json: what the export holds, for the reader of the .npy files. */
static int write_json(outputs_t *o, const char *dir, const char *ckpt_dir,
                      const embps_ckpt_manifest_t *m, const embps_table_config_t *c, uint64_t step,
                      uint64_t n, int f32, char *err, size_t errlen) {
  const int hash = c->capacity > 0, bf16 = c->dtype == EMBPS_DTYPE_BF16;
  FILE *f;
  char ckpt[PATH_CAP];
  snprintf(o->json, sizeof(o->json), "%s/table.json", dir);
  snprintf(o->json_tmp, sizeof(o->json_tmp), "%s/table.json.tmp", dir);
  embps_ckpt_path(ckpt, sizeof(ckpt), ckpt_dir, m->round);
  if (!(f = fopen(o->json_tmp, "w"))) {
    snprintf(err, errlen, "cannot create %s: %s", o->json_tmp, strerror(errno));
    return -1;
  }
  fprintf(f, "{\n");
  json_field_str(f, "table", c->name, 1);
  json_field_str(f, "kind", hash ? "hash" : "dense", 1);
  fprintf(f, "  \"rows\": %" PRIu64 ",\n  \"emb_width\": %" PRIu32 ",\n", n, c->emb_width);
  if (hash)
    fprintf(f, "  \"capacity\": %" PRIu64 ",\n  \"eviction\": \"%s\",\n", c->capacity,
            embps_eviction_name((embps_eviction_t)c->eviction));
  json_field_str(f, "dtype", embps_dtype_name(c->dtype), 1);
  json_field_str(f, "rows_dtype", !bf16 || f32 ? "float32" : "uint16 (bf16 bits)", 1);
  json_field_str(f, "optimizer", embps_optimizer_name(c->optimizer), 1);
  fprintf(f, "  \"seed\": %" PRIu64 ",\n  \"round\": %" PRIu64 ",\n  \"step\": %" PRIu64 ",\n",
          c->seed, m->round, step);
  json_field_str(f, "checkpoint", ckpt, 1);
  fprintf(f, "  \"group_size\": %" PRIu32 ",\n", m->group_size);
  fprintf(f, "  \"files\": {\"rows\": \"rows.npy\"");
  if (o->has_keys)
    fprintf(f, ", \"keys\": \"keys.npy\"");
  for (int i = 0; i < o->nstate; i++)
    fprintf(f, ", \"%s\": \"%s.npy\"", o->state_name[i], o->state_name[i]);
  fprintf(f, "}%s\n", hash ? "," : "");
  if (hash)
    json_field_str(f, "keys_order", "ascending slot", 0);
  fprintf(f, "}\n");
  if (fclose(f) != 0) {
    snprintf(err, errlen, "cannot write %s: %s", o->json_tmp, strerror(errno));
    return -1;
  }
  return 0;
}

/* Opens the .npy files of n rows for c in dir. */
static int outputs_open(outputs_t *o, const char *dir, const embps_table_config_t *c, uint64_t n,
                        int state, int f32, char *err, size_t errlen) {
  const embps_optimizer_info_t *info = embps_optimizer_info(c->optimizer);
  const int bf16 = c->dtype == EMBPS_DTYPE_BF16;
  const uint64_t shape[2] = {n, c->emb_width};
  char path[PATH_CAP + 32];

  snprintf(path, sizeof(path), "%s/rows.npy", dir);
  if (embps_npy_out_open(&o->rows, path, bf16 && !f32 ? "<u2" : "<f4", bf16 && !f32 ? 2 : 4, shape,
                         2, err, errlen) != 0)
    return -1;
  if (o->has_keys) {
    snprintf(path, sizeof(path), "%s/keys.npy", dir);
    if (embps_npy_out_open(&o->keys, path, "<i8", 8, shape, 1, err, errlen) != 0)
      return -1;
  }
  if (!state || !info)
    return 0;
  if (info->state_per_row || info->state_per_element == 1)
    o->state_name[o->nstate++] = "accumulators";
  else if (info->state_per_element == 2) {
    o->state_name[o->nstate++] = "m";
    o->state_name[o->nstate++] = "v";
  }
  for (int i = 0; i < o->nstate; i++) {
    snprintf(path, sizeof(path), "%s/%s.npy", dir, o->state_name[i]);
    if (embps_npy_out_open(&o->state[i], path, "<f4", 4, shape, info->state_per_row ? 1 : 2, err,
                           errlen) != 0)
      return -1;
  }
  return 0;
}

static int outputs_commit(outputs_t *o, char *err, size_t errlen) {
  if (embps_npy_out_commit(&o->rows, err, errlen) != 0 ||
      (o->has_keys && embps_npy_out_commit(&o->keys, err, errlen) != 0))
    return -1;
  for (int i = 0; i < o->nstate; i++)
    if (embps_npy_out_commit(&o->state[i], err, errlen) != 0)
      return -1;
  if (rename(o->json_tmp, o->json) != 0) {
    snprintf(err, errlen, "cannot rename %s onto %s: %s", o->json_tmp, o->json, strerror(errno));
    return -1;
  }
  o->json_tmp[0] = '\0';
  return 0;
}

/* ---- the command --------------------------------------------------------------------------- */

/* The buffers of one chunk of rows. */
typedef struct chunk {
  uint64_t rows;
  uint8_t *data;
  float *state[2], *wide; /* wide: bf16 rows widened (--f32) */
  int64_t *keys;
} chunk_t;

static void chunk_free(chunk_t *k) {
  embps_free(k->data);
  embps_free(k->state[0]);
  embps_free(k->state[1]);
  embps_free(k->wide);
  embps_free(k->keys);
}

/* Keeps the rows of chunk k (rows r0.. of the table) whose slot holds a key, in order, with
 * their keys in k->keys; returns how many. */
static uint64_t keep_stored(chunk_t *k, const uint64_t *slot_keys, uint64_t r0, uint64_t n,
                            size_t row_bytes, const size_t state_bytes[2]) {
  uint64_t j = 0;
  for (uint64_t i = 0; i < n; i++) {
    if (!slot_keys[r0 + i])
      continue;
    if (i != j) {
      memcpy(k->data + j * row_bytes, k->data + i * row_bytes, row_bytes);
      for (int a = 0; a < 2; a++)
        if (k->state[a])
          memcpy((uint8_t *)k->state[a] + j * state_bytes[a],
                 (uint8_t *)k->state[a] + i * state_bytes[a], state_bytes[a]);
    }
    k->keys[j++] = (int64_t)slot_keys[r0 + i];
  }
  return j;
}

/* Streams every row of s into o. */
static int copy_rows(embps_ckpt_stream_t *s, const uint64_t *slot_keys, outputs_t *o, int f32,
                     uint64_t total, progress_t *pg, embps_status_t *st, char *err, size_t errlen) {
  const embps_table_config_t *c = embps_ckpt_stream_config(s);
  const embps_optimizer_info_t *info = embps_optimizer_info(c->optimizer);
  const uint64_t rows = embps_ckpt_stream_rows(s), w = c->emb_width;
  const int widen = f32 && c->dtype == EMBPS_DTYPE_BF16;
  const size_t row_bytes = w * embps_dtype_size(c->dtype);
  size_t state_bytes[2] = {0, 0};
  chunk_t k = {.rows = embps_ckpt_stream_chunk_rows(s, CHUNK_BYTES)};
  uint64_t done = 0;
  int rc = -1;

  for (int a = 0; a < o->nstate; a++)
    state_bytes[a] = info->state_per_row ? sizeof(float) : w * sizeof(float);
  *st = EMBPS_RESOURCE_EXHAUSTED;
  snprintf(err, errlen, "out of memory for a chunk of %" PRIu64 " rows", k.rows);
  if (!(k.data = embps_malloc(k.rows * row_bytes)) ||
      (o->nstate > 0 && !(k.state[0] = embps_malloc(k.rows * state_bytes[0]))) ||
      (o->nstate > 1 && !(k.state[1] = embps_malloc(k.rows * state_bytes[1]))) ||
      (widen && !(k.wide = embps_malloc(k.rows * w * sizeof(float)))) ||
      (slot_keys && !(k.keys = embps_malloc(k.rows * sizeof(int64_t)))))
    goto exit;
  for (uint64_t r0 = 0; r0 < rows;) {
    const uint64_t n = rows - r0 < k.rows ? rows - r0 : k.rows;
    uint64_t keep = n;
    embps_error_t e;
    if ((*st = embps_ckpt_stream_read(s, n, k.data, k.state[0], k.state[1], &e)) != EMBPS_OK) {
      snprintf(err, errlen, "%s", e.message);
      goto exit;
    }
    *st = EMBPS_INTERNAL; /* the writes' failures below */
    if (slot_keys)
      keep = keep_stored(&k, slot_keys, r0, n, row_bytes, state_bytes);
    if (widen)
      for (uint64_t i = 0; i < keep * w; i++)
        k.wide[i] = embps_bf16_to_f32(((const uint16_t *)k.data)[i]);
    if (embps_npy_out_write(&o->rows, widen ? (void *)k.wide : (void *)k.data,
                            keep * (widen ? w * sizeof(float) : row_bytes), err, errlen) != 0 ||
        (slot_keys && embps_npy_out_write(&o->keys, k.keys, keep * 8, err, errlen) != 0))
      goto exit;
    for (int a = 0; a < o->nstate; a++)
      if (embps_npy_out_write(&o->state[a], k.state[a], keep * state_bytes[a], err, errlen) != 0)
        goto exit;
    r0 += n;
    done += keep;
    progress_show(pg, c->name, done, total, embps_ckpt_stream_bytes_read(s),
                  embps_ckpt_stream_bytes(s), 0);
  }
  progress_show(pg, c->name, done, total, embps_ckpt_stream_bytes_read(s),
                embps_ckpt_stream_bytes(s), 1);
  rc = 0;
exit:
  chunk_free(&k);
  return rc;
}

int embps_cli_cmd_export(const char *cmd, embps_cli_flag_t *f, const char *path) {
  const char *table = embps_cli_flag(f, "--table"), *out = embps_cli_flag(f, "--out");
  const int state = embps_cli_flag(f, "--state") != NULL, f32 = embps_cli_flag(f, "--f32") != NULL;
  char dir[PATH_CAP], msg[PATH_CAP + 600];
  embps_ckpt_manifest_t m = {0};
  embps_ckpt_stream_t *s = NULL;
  embps_hindex_t *ix = NULL;
  const uint64_t *slot_keys = NULL;
  outputs_t o;
  progress_t pg = {.on = isatty(STDERR_FILENO), .t0 = now_s()};
  embps_error_t err;
  embps_status_t st;
  struct stat sb;
  uint64_t total;
  int rc;

  memset(&o, 0, sizeof(o));
  o.rows.fd = o.keys.fd = o.state[0].fd = o.state[1].fd = -1;
  if (!path)
    return embps_cli_usage_error(cmd, "name the checkpoint: embps export CHECKPOINT --table T "
                                      "--out DIR");
  if (!table || !out)
    return embps_cli_usage_error(cmd, !table ? "--table is required" : "--out is required");
  if ((rc = choose(cmd, path, table, embps_cli_flag(f, "--round"), dir, sizeof(dir), &m)) != 0)
    return rc;
  if ((st = embps_ckpt_stream_open(dir, &m, table, &s, &err)) != EMBPS_OK) {
    rc = failed(cmd, st, err.message);
    goto exit;
  }
  {
    const embps_table_config_t *c = embps_ckpt_stream_config(s);
    total = embps_ckpt_stream_rows(s);
    if (c->capacity) { /* hash-keyed: its key index, through the chain */
      embps_hindex_config_t hc;
      embps_hindex_stats_t hs;
      embps_table_config_hindex(c, &hc);
      if ((st = embps_ckpt_read_index(dir, &m, table, &hc, &ix, &err)) != EMBPS_OK) {
        rc = failed(cmd, st, err.message);
        goto exit;
      }
      slot_keys = embps_hindex_slot_keys(ix);
      embps_hindex_stats(ix, &hs);
      total = hs.size;
      o.has_keys = 1;
    }
    if (mkdir(out, 0755) != 0 && (errno != EEXIST || stat(out, &sb) != 0 || !S_ISDIR(sb.st_mode))) {
      snprintf(msg, sizeof(msg), "cannot create the output directory %s: %s", out,
               errno == EEXIST ? "a file has its name" : strerror(errno));
      rc = failed(cmd, EMBPS_FAILED_PRECONDITION, msg);
      goto exit;
    }
    if (outputs_open(&o, out, c, total, state, f32, msg, sizeof(msg)) != 0 ||
        write_json(&o, out, dir, &m, c, embps_ckpt_stream_step(s), total, f32, msg, sizeof(msg)) !=
            0) {
      rc = failed(cmd, EMBPS_INTERNAL, msg);
      goto exit;
    }
    if (copy_rows(s, slot_keys, &o, f32, total, &pg, &st, msg, sizeof(msg)) != 0) {
      if (pg.on)
        fputc('\n', stderr);
      rc = failed(cmd, st, msg);
      goto exit;
    }
    if (outputs_commit(&o, msg, sizeof(msg)) != 0) {
      rc = failed(cmd, EMBPS_INTERNAL, msg);
      goto exit;
    }
    printf("exported table '%s' of the checkpoint of round %" PRIu64 " (%" PRIu32
           " ranks): %" PRIu64 " rows x %" PRIu32 " %s to %s: rows.npy%s",
           table, m.round, m.group_size, total, c->emb_width,
           c->dtype == EMBPS_DTYPE_BF16 && !f32 ? "bf16 (uint16 bits)" : "float32", out,
           o.has_keys ? " keys.npy" : "");
    for (int i = 0; i < o.nstate; i++)
      printf(" %s.npy", o.state_name[i]);
    printf(" table.json\n");
    rc = 0;
  }
exit:
  outputs_abandon(&o);
  embps_hindex_free(ix);
  embps_ckpt_stream_close(s);
  embps_ckpt_manifest_free(&m);
  return rc;
}
