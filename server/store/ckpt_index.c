/* A hash-keyed table's key index read back from a checkpoint (checkpoint.h,
 * embps_ckpt_read_index). A full checkpoint holds the index whole; an incremental one holds the
 * delta since the checkpoint it applies on (base_round). The chain is followed back from the
 * restored checkpoint to the first whose manifest lists the index whole, then that one is decoded
 * and each delta applied in order, each onto the index the one before it gave. */
#include "server/store/ckpt_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"

/* The index file of `table` that m lists (either kind), or NULL. */
static const embps_ckpt_file_t *index_file(const embps_ckpt_manifest_t *m, const char *table) {
  for (size_t i = 0; i < m->num_files; i++)
    if ((m->files[i].rank == EMBPS_CKPT_INDEX_RANK ||
         m->files[i].rank == EMBPS_CKPT_INDEX_DELTA_RANK) &&
        strcmp(m->files[i].table, table) == 0)
      return &m->files[i];
  return NULL;
}

/* Reads the index file f of the checkpoint of `round` in dir into *p (*len bytes), its path into
 * file. */
static embps_status_t read_one(const char *dir, uint64_t round, const char *table,
                               const embps_ckpt_file_t *f, char *file, size_t cap, uint8_t **p,
                               size_t *len, embps_error_t *err) {
  char ckpt[EMBPS_CKPT_PATH_MAX], name[EMBPS_TABLE_NAME_MAX + 16];
  embps_ckpt_path(ckpt, sizeof(ckpt), dir, round);
  embps_ckpt_index_name(name, sizeof(name), table);
  snprintf(file, cap, "%s/%s", ckpt, name);
  return embps_ckpt_read_file(file, f->bytes, p, len, err);
}

embps_status_t embps_ckpt_read_index(const char *dir, const embps_ckpt_manifest_t *m,
                                     const char *table, const embps_hindex_config_t *c,
                                     embps_hindex_t **out, embps_error_t *err) {
  char file[EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40];
  embps_ckpt_manifest_t *chain = NULL; /* chain[0] is m's base, chain[1] its base, ... */
  size_t depth = 0, cap = 0;
  const embps_ckpt_manifest_t *cur = m;
  embps_hindex_t *ix = NULL;
  embps_status_t ret = EMBPS_OK;
  uint8_t *p = NULL;
  size_t len = 0;

  /* Back through the chain to the checkpoint that holds the index whole. */
  for (;;) {
    const embps_ckpt_file_t *f = index_file(cur, table);
    char path[EMBPS_CKPT_PATH_MAX];
    embps_error_t why;
    if (!f) {
      embps_ckpt_path(path, sizeof(path), dir, cur->round);
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the manifest of %s lists no key index (%s%s) of hash-keyed table '%s'",
                            path, EMBPS_CKPT_INDEX_PREFIX, table, table);
      goto exit;
    }
    if (f->rank == EMBPS_CKPT_INDEX_RANK)
      break;
    if (!cur->base_round || cur->base_round >= cur->round) {
      ret =
          embps_error_set(err, EMBPS_DATA_LOSS,
                          "the checkpoint chain is broken: round %" PRIu64
                          " holds a delta of table '%s''s key index and applies on round %" PRIu64,
                          cur->round, table, cur->base_round);
      goto exit;
    }
    if (depth == cap) {
      embps_ckpt_manifest_t *q = embps_realloc(chain, (cap = cap ? cap * 2 : 8) * sizeof(*q));
      if (!q) {
        ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading a chain");
        goto exit;
      }
      chain = q;
    }
    embps_ckpt_path(path, sizeof(path), dir, cur->base_round);
    if (embps_ckpt_read_manifest(path, &chain[depth], &why) != EMBPS_OK) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the incremental checkpoint of round %" PRIu64
                            " applies on round %" PRIu64 ", which cannot be read: %s",
                            cur->round, cur->base_round, why.message);
      goto exit;
    }
    cur = &chain[depth++];
  }
  /* The whole index, then every delta, oldest first. */
  if ((ret = read_one(dir, cur->round, table, index_file(cur, table), file, sizeof(file), &p, &len,
                      err)) != EMBPS_OK ||
      (ret = embps_hindex_decode(&ix, c, p, len, file, err)) != EMBPS_OK)
    goto exit;
  for (size_t i = depth; i-- > 0;) {
    const embps_ckpt_manifest_t *d = i == 0 ? m : &chain[i - 1];
    embps_free(p);
    p = NULL;
    if ((ret = read_one(dir, d->round, table, index_file(d, table), file, sizeof(file), &p, &len,
                        err)) != EMBPS_OK ||
        (ret = embps_hindex_delta_apply(ix, p, len, file, err)) != EMBPS_OK)
      goto exit;
  }
  *out = ix;
  ix = NULL;
exit:
  embps_hindex_free(ix);
  embps_free(p);
  for (size_t i = 0; i < depth; i++)
    embps_ckpt_manifest_free(&chain[i]);
  embps_free(chain);
  return ret;
}
