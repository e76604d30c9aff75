/* The restore chain: a table's columns as a checkpoint holds them, whatever group size wrote it
 * and however many ranks read it back. A full checkpoint is read directly; an incremental one
 * through its chain, found by following base_round back to the full checkpoint (or to the first
 * that held every row of a table created since), then applied oldest first so later rows
 * overwrite earlier ones. Each file is checked against its manifest (rank, columns, round, table
 * spec) before its rows are taken, so a file moved into the wrong place is refused, not read.
 * An incremental checkpoint may hold a full slice (base round 0): a table that could not track
 * its dirty rows is written whole, and its rows then simply overwrite the chain's below.
 *
 * Also here: which checkpoint a starting rank restores (the --restore setting's policy), since
 * it is a question about what the directory holds. */
#include "server/store/ckpt_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"

const embps_table_config_t *embps__ckpt_find_table(const embps_ckpt_manifest_t *m, const char *t) {
  for (size_t i = 0; i < m->num_tables; i++)
    if (strcmp(m->tables[i].name, t) == 0)
      return &m->tables[i];
  return NULL;
}

static const embps_ckpt_file_t *find_file(const embps_ckpt_manifest_t *m, const char *t,
                                          uint32_t rank) {
  for (size_t i = 0; i < m->num_files; i++)
    if (m->files[i].rank == rank && strcmp(m->files[i].table, t) == 0)
      return &m->files[i];
  return NULL;
}

embps_status_t embps__ckpt_open_slice(const char *dir, const embps_ckpt_manifest_t *m,
                                      const embps_table_config_t *cfg, uint32_t rank,
                                      embps__ckpt_in_t *f, char *path, size_t cap,
                                      embps_error_t *err) {
  const uint32_t g = m->group_size, sw = g ? cfg->emb_width / g : 0;
  const embps_ckpt_file_t *fe = find_file(m, cfg->name, rank);
  char ckpt[EMBPS_CKPT_PATH_MAX], name[EMBPS_TABLE_NAME_MAX + 32];
  embps_status_t ret;

  memset(f, 0, sizeof(*f));
  f->fd = -1;
  embps_ckpt_path(ckpt, sizeof(ckpt), dir, m->round);
  embps_ckpt_slice_name(name, sizeof(name), rank, cfg->name);
  snprintf(path, cap, "%s/%s", ckpt, name);
  if (!fe)
    return embps_error_set(err, EMBPS_DATA_LOSS, "the manifest of %s does not list %s", ckpt, name);
  if ((ret = embps__ckpt_in_open(f, path, fe->bytes, err)) != EMBPS_OK)
    return ret;
  if (f->h.rank != rank || f->h.group_size != g || f->h.col_begin != rank * sw ||
      f->h.shard_width != sw || f->h.round != m->round ||
      (f->h.base_round && f->h.base_round != m->base_round) ||
      !embps__ckpt_same_config(&f->h.config, cfg))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s does not match its manifest (rank, group size, "
                           "columns, round or table spec differ)",
                           path);
  return EMBPS_OK;
}

/* Applies one checkpoint's files of `table` (whose spec it lists as cfg) onto dst. *full is set
 * when the files held every row. */
static embps_status_t apply_checkpoint(const char *dir, const embps_ckpt_manifest_t *m,
                                       const embps_table_config_t *cfg, embps_ckpt_dest_t *dst,
                                       int *full, embps_error_t *err) {
  const uint32_t g = m->group_size, sw = cfg->emb_width / g;
  char path[EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40];
  int per_row_taken = 0;

  if (!sw || cfg->emb_width % g)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint of round %" PRIu64 ": table '%s' of width %" PRIu32
                           " cannot have been written by %" PRIu32 " ranks",
                           m->round, cfg->name, cfg->emb_width, g);
  *full = 1;
  for (uint32_t rank = 0; rank < g; rank++) {
    const uint32_t fb = rank * sw, lo = fb > dst->col_begin ? fb : dst->col_begin;
    const uint32_t hi =
        fb + sw < dst->col_begin + dst->shard_width ? fb + sw : dst->col_begin + dst->shard_width;
    embps__ckpt_scatter_t sc;
    embps__ckpt_in_t f;
    uint64_t covered = 0;
    embps_status_t ret;

    if (lo >= hi)
      continue; /* none of our columns */
    ret = embps__ckpt_open_slice(dir, m, cfg, rank, &f, path, sizeof(path), err);
    if (ret == EMBPS_OK) {
      sc = (embps__ckpt_scatter_t){.dst = dst,
                                   .from = lo - fb,
                                   .width = hi - lo,
                                   .to = lo - dst->col_begin,
                                   .per_row = !per_row_taken};
      ret = embps__ckpt_apply_file(&f, &sc, &covered, err);
    }
    embps__ckpt_in_close(&f);
    if (ret != EMBPS_OK)
      return ret;
    per_row_taken = 1;
    dst->step = f.h.step;
    if (covered != embps_table_config_rows(cfg))
      *full = 0;
  }
  return EMBPS_OK;
}

embps_status_t embps__ckpt_chain_read(const char *dir, const embps_ckpt_manifest_t *m,
                                      embps_ckpt_manifest_t **chain, size_t *depth,
                                      embps_error_t *err) {
  embps_ckpt_manifest_t *list = NULL;
  size_t n = 0, cap = 0;
  embps_status_t ret = EMBPS_OK;

  for (uint64_t base = m->base_round, above = m->round; base;
       above = base, base = list[n - 1].base_round) {
    char path[EMBPS_CKPT_PATH_MAX];
    embps_error_t why;
    if (base >= above) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the checkpoint chain is broken: round %" PRIu64
                            " claims to apply on round %" PRIu64,
                            above, base);
      break;
    }
    if (n == cap) {
      embps_ckpt_manifest_t *p = embps_realloc(list, (cap = cap ? cap * 2 : 8) * sizeof(*p));
      if (!p) {
        ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading a chain");
        break;
      }
      list = p;
    }
    embps_ckpt_path(path, sizeof(path), dir, base);
    if (embps_ckpt_read_manifest(path, &list[n], &why) != EMBPS_OK) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the incremental checkpoint of round %" PRIu64
                            " applies on round %" PRIu64 ", which cannot be read: %s",
                            above, base, why.message);
      break;
    }
    n++;
  }
  if (ret != EMBPS_OK) {
    embps__ckpt_chain_free(list, n);
    return ret;
  }
  *chain = list;
  *depth = n;
  return EMBPS_OK;
}

void embps__ckpt_chain_free(embps_ckpt_manifest_t *chain, size_t depth) {
  for (size_t i = 0; i < depth; i++)
    embps_ckpt_manifest_free(&chain[i]);
  embps_free(chain);
}

embps_status_t embps__ckpt_chain_same_table(const embps_table_config_t *tc,
                                            const embps_table_config_t *cfg, uint64_t round,
                                            uint64_t top, embps_error_t *err) {
  if (tc->rows != cfg->rows || tc->capacity != cfg->capacity || tc->emb_width != cfg->emb_width ||
      tc->dtype != cfg->dtype || tc->optimizer != cfg->optimizer)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "the checkpoint chain is broken: table '%s' differs between rounds "
                           "%" PRIu64 " and %" PRIu64,
                           cfg->name, round, top);
  return EMBPS_OK;
}

embps_status_t embps_ckpt_read_columns(const char *dir, const embps_ckpt_manifest_t *m,
                                       const char *table, embps_ckpt_dest_t *dst,
                                       embps_error_t *err) {
  const embps_table_config_t *cfg = embps__ckpt_find_table(m, table);
  embps_ckpt_manifest_t *chain = NULL; /* chain[0] is m's base, chain[1] its base, ... */
  size_t depth = 0;
  embps_status_t ret;
  int started = 0;

  if (!cfg)
    return embps_error_set(err, EMBPS_NOT_FOUND,
                           "the checkpoint of round %" PRIu64 " holds no table '%s'", m->round,
                           table);
  if (!dst->shard_width || (uint64_t)dst->col_begin + dst->shard_width > cfg->emb_width)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "columns %" PRIu32 "+%" PRIu32 " are outside table '%s' (width %" PRIu32
                           ")",
                           dst->col_begin, dst->shard_width, table, cfg->emb_width);
  if ((ret = embps__ckpt_chain_read(dir, m, &chain, &depth, err)) != EMBPS_OK)
    return ret;
  /* Oldest first: the full checkpoint (or the first that held every row of a table created
   * since), then each increment. */
  for (size_t i = depth + 1; i-- > 0;) {
    const embps_ckpt_manifest_t *c = i == 0 ? m : &chain[i - 1];
    const embps_table_config_t *tc = embps__ckpt_find_table(c, table);
    int full = 0;
    if (!tc)
      continue;
    if ((ret = embps__ckpt_chain_same_table(tc, cfg, c->round, m->round, err)) != EMBPS_OK ||
        (ret = apply_checkpoint(dir, c, tc, dst, &full, err)) != EMBPS_OK)
      goto exit;
    if (!started && !full && c->base_round) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the checkpoint chain is broken: the oldest checkpoint of round "
                            "%" PRIu64 " that holds table '%s' does not hold all of it",
                            c->round, table);
      goto exit;
    }
    started = 1;
  }
exit:
  embps__ckpt_chain_free(chain, depth);
  return ret;
}

/* ---- which checkpoint a starting rank restores ---------------------------------------------- */

embps_status_t embps_ckpt_restore_choose(const char *restore, const char *ckpt_dir,
                                         char *restore_dir, size_t cap, uint64_t *round,
                                         embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX], *slash;
  embps_ckpt_manifest_t m;
  size_t len;
  embps_status_t ret;

  *round = 0;
  restore_dir[0] = '\0';
  if (strcmp(restore, "none") == 0)
    return EMBPS_OK;
  if (strcmp(restore, "auto") == 0) {
    embps_ckpt_manifest_t *list = NULL;
    size_t n = 0;
    if (!ckpt_dir[0]) /* checkpoints off: nothing to look for */
      return EMBPS_OK;
    if ((ret = embps_ckpt_list(ckpt_dir, &list, &n, err)) != EMBPS_OK)
      return ret;
    /* The newest of every table; a checkpoint of one table (its scope) alone would lose the
     * others. None: the group starts empty. */
    for (size_t i = n; i-- > 0 && !*round;)
      if (!list[i].scope[0])
        *round = list[i].round;
    embps_ckpt_list_free(list, n);
    snprintf(restore_dir, cap, "%s", ckpt_dir);
    return EMBPS_OK;
  }
  /* A checkpoint's own directory: it must be complete; its parent holds its chain. */
  snprintf(path, sizeof(path), "%s", restore);
  while ((len = strlen(path)) > 1 && path[len - 1] == '/')
    path[len - 1] = '\0';
  if ((ret = embps_ckpt_read_manifest(path, &m, err)) != EMBPS_OK)
    return ret;
  *round = m.round;
  embps_ckpt_manifest_free(&m);
  slash = strrchr(path, '/');
  if (slash == path)
    snprintf(restore_dir, cap, "/");
  else if (slash)
    snprintf(restore_dir, cap, "%.*s", (int)(slash - path), path);
  else
    snprintf(restore_dir, cap, ".");
  return EMBPS_OK;
}
