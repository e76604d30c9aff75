/* A rank's part in checkpoints (checkpointer.h), at startup: restore. Every rank reads the same
 * manifest and the same retry window file, creates the checkpoint's tables through the engine
 * (collectives: in step on every rank) and fills its columns of each; the ranks agree on any
 * failure twice (after reading the manifest and the window, and after the tables), so a rank
 * that failed never serves while the others do. */
#include "server/group/checkpointer.h"

#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"

/* Every rank learns whether any rank failed (a status code; 0 when none did). */
static embps_status_t agree_failure(embps_engine_t *engine, embps_status_t mine,
                                    embps_status_t *worst, embps_error_t *err) {
  uint64_t v = (uint64_t)mine;
  embps_status_t ret = embps_engine_agree_max(engine, &v, err);
  *worst = (embps_status_t)v;
  return ret;
}

/* Reads this rank's columns of table `cfg` from the checkpoint into the new (blank) table t:
 * straight into its arrays where they are host memory, else through host buffers. */
static embps_status_t fill_table(embps_engine_t *engine, embps_table_t *t, const char *dir,
                                 const embps_ckpt_manifest_t *m, embps_error_t *err) {
  const int direct = embps_engine_backend(engine) == EMBPS_BACKEND_CPU;
  embps_ckpt_dest_t dst;
  embps_table_arrays_t host;
  size_t bytes[3];
  embps_status_t ret = EMBPS_RESOURCE_EXHAUSTED;

  memset(&dst, 0, sizeof(dst));
  memset(&host, 0, sizeof(host));
  embps_table_array_bytes(t, bytes);
  if (direct) {
    embps_table_arrays_t a = embps_table_arrays(t);
    dst.col_begin = embps_table_col_begin(t);
    dst.shard_width = embps_table_shard_width(t);
    dst.data = a.data;
    dst.state0 = a.state0;
    dst.state1 = a.state1;
    if ((ret = embps_ckpt_read_columns(dir, m, embps_table_config(t)->name, &dst, err)) == EMBPS_OK)
      embps_table_set_step(t, dst.step);
    return ret;
  }
  if (!(host.data = embps_aligned_alloc(bytes[0] ? bytes[0] : 64)) ||
      (bytes[1] && !(host.state0 = embps_aligned_alloc(bytes[1]))) ||
      (bytes[2] && !(host.state1 = embps_aligned_alloc(bytes[2])))) {
    embps_error_set(err, ret, "out of host memory restoring table '%s'",
                    embps_table_config(t)->name);
    goto exit;
  }
  dst.col_begin = embps_table_col_begin(t);
  dst.shard_width = embps_table_shard_width(t);
  dst.data = host.data;
  dst.state0 = host.state0;
  dst.state1 = host.state1;
  if ((ret = embps_ckpt_read_columns(dir, m, embps_table_config(t)->name, &dst, err)) != EMBPS_OK ||
      (ret = embps_engine_table_import(engine, t, &host, err)) != EMBPS_OK)
    goto exit;
  embps_table_set_step(t, dst.step);
exit:
  embps_free(host.data);
  embps_free(host.state0);
  embps_free(host.state1);
  return ret;
}

/* Reads the retry window's file of the checkpoint at path, if its manifest lists one, into a new
 * window of *window's size that replaces it; a checkpoint without one leaves *window as it is. */
static void read_window(const char *path, const embps_ckpt_manifest_t *m, embps_dedup_t **window,
                        embps_error_t *err) {
  char file[EMBPS__CKPT_PATH_MAX + 32];
  const embps_ckpt_file_t *f = NULL;
  embps_dedup_t *d;
  uint8_t *p = NULL;
  size_t len = 0;
  uint64_t at = 0;
  for (size_t i = 0; i < m->num_files && !f; i++)
    if (m->files[i].rank == 0 && strcmp(m->files[i].table, EMBPS_CKPT_WINDOW_TABLE) == 0)
      f = &m->files[i];
  if (!f || !window || !*window)
    return;
  snprintf(file, sizeof(file), "%s/%s", path, EMBPS_CKPT_WINDOW);
  if (embps_ckpt_read_file(file, f->bytes, &p, &len, err) != EMBPS_OK)
    return;
  if (embps_dedup_decode(&d, embps_dedup_window(*window), EMBPS_DEDUP_MAX_CLIENTS, p, len, file,
                         &at, err) == EMBPS_OK) {
    if (at != m->round) {
      embps_error_set(err, EMBPS_DATA_LOSS,
                      "retry window file %s is of round %llu; its manifest's round is %llu", file,
                      (unsigned long long)at, (unsigned long long)m->round);
      embps_dedup_free(d);
    } else {
      embps_dedup_free(*window);
      *window = d;
    }
  }
  embps_free(p);
}

/* Reads hash-keyed table t's key index as the checkpoint m in dir holds it (whole, or through its
 * chain's deltas: embps_ckpt_read_index) and makes it t's: every rank reads the same files, so
 * every rank holds the same index. A dense table has none to read. */
static void read_index(const char *dir, const embps_ckpt_manifest_t *m, embps_table_t *t,
                       embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  embps_hindex_config_t hc;
  embps_hindex_t *ix;
  if (!embps_table_hindex(t))
    return;
  embps_table_config_hindex(cfg, &hc);
  if (embps_ckpt_read_index(dir, m, cfg->name, &hc, &ix, err) == EMBPS_OK)
    embps_table_set_hindex(t, ix);
}

embps_status_t embps__ckpt_restore(embps__ckpt_t *c, embps_engine_t *engine, embps_store_t *store,
                                   const char *dir, uint64_t round, uint32_t rank, uint32_t size,
                                   embps_dedup_t **window, embps_ckpt_manifest_t *manifest_out,
                                   embps_error_t *err) {
  const uint64_t max_bytes = embps_store_budget_max(store);
  char path[EMBPS__CKPT_PATH_MAX];
  const uint64_t t0 = embps_now_ns();
  embps_ckpt_manifest_t m;
  embps_error_t mine;
  embps_status_t ret, worst;

  memset(&m, 0, sizeof(m));
  embps_error_clear(&mine);
  embps_ckpt_path(path, sizeof(path), dir, round);
  embps_ckpt_read_manifest(path, &m, &mine);
  for (size_t i = 0; mine.status == EMBPS_OK && i < m.num_tables; i++) {
    embps_table_config_t cfg = m.tables[i];
    embps_error_t why;
    if (embps_table_config_resolve(&cfg, size, max_bytes, &why) != EMBPS_OK)
      embps_error_set(&mine, why.status, "cannot restore table '%s' of %s onto %u ranks: %s",
                      m.tables[i].name, path, size, why.message);
  }
  if (mine.status == EMBPS_OK)
    read_window(path, &m, window, &mine);
  /* Every rank has read the same manifest, or none goes on. */
  if ((ret = agree_failure(engine, mine.status, &worst, err)) != EMBPS_OK)
    goto exit;
  if (worst != EMBPS_OK) {
    if (mine.status != EMBPS_OK)
      *err = mine;
    else
      embps_error_set(err, worst, "another rank could not read checkpoint %s (see its log)", path);
    ret = err->status;
    goto exit;
  }
  for (size_t i = 0; i < m.num_tables; i++) {
    embps_op_t op;
    memset(&op, 0, sizeof(op));
    op.kind = EMBPS_OP_CREATE_TABLE;
    op.create = m.tables[i];
    op.create_blank = 1; /* fill_table writes every byte, or the restore fails as a whole */
    embps_table_config_resolve(&op.create, size, max_bytes, NULL);
    if ((ret = embps_engine_run(engine, &op, err)) != EMBPS_OK)
      goto exit;
    if (op.error.status != EMBPS_OK) {
      *err = op.error; /* every rank agreed on it */
      ret = err->status;
      goto exit;
    }
    if (mine.status == EMBPS_OK) {
      fill_table(engine, op.created, dir, &m, &mine);
      if (mine.status == EMBPS_OK)
        read_index(dir, &m, op.created, &mine);
      if (c && mine.status == EMBPS_OK) {
        embps__ckpt_prepare(c, op.created);
        if (embps_table_dirty(op.created)) /* the restored table is the checkpoint: all clean */
          memset(embps_table_dirty(op.created), 0,
                 embps_dirty_words(embps_table_config_rows(embps_table_config(op.created))) *
                     sizeof(uint64_t));
      }
    }
  }
  if ((ret = agree_failure(engine, mine.status, &worst, err)) != EMBPS_OK)
    goto exit;
  if (worst != EMBPS_OK) {
    if (mine.status != EMBPS_OK)
      *err = mine;
    else
      embps_error_set(err, worst, "another rank could not restore checkpoint %s (see its log)",
                      path);
    ret = err->status;
    goto exit;
  }
  EMBPS_INFO("rank %u: restored %zu table(s) and %zu retried push(es) to recognise from %s "
             "(round %llu, written by %u rank(s)) in %.1f ms",
             rank, m.num_tables, window && *window ? embps_dedup_size(*window) : (size_t)0, path,
             (unsigned long long)m.round, m.group_size, (double)(embps_now_ns() - t0) / 1e6);
  if (manifest_out) {
    *manifest_out = m;
    memset(&m, 0, sizeof(m));
  }
exit:
  embps_ckpt_manifest_free(&m);
  return ret;
}
