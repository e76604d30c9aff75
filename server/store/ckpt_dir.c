/* The checkpoint directory (--checkpoint-dir): the names inside it, which checkpoints it holds,
 * what retention removes, and the check and lock a starting group takes on it. A checkpoint is
 * a directory named ckpt-<round, 20 digits>, so names sort by round; it exists only when its
 * manifest verifies and names the same round (one moved or copied by hand is not listed).
 * Pruning never removes what a kept incremental checkpoint chains back to, nor an incomplete
 * checkpoint newer than the newest complete one (it may be the one being written). */
#include "server/store/ckpt_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/alloc.h"

void embps_ckpt_slice_name(char *out, size_t cap, uint32_t rank, const char *table) {
  snprintf(out, cap, "r%" PRIu32 "-%s.embps", rank, table);
}

void embps_ckpt_index_name(char *out, size_t cap, const char *table) {
  snprintf(out, cap, "%s%s", EMBPS_CKPT_INDEX_PREFIX, table);
}

void embps_ckpt_path(char *out, size_t cap, const char *dir, uint64_t round) {
  snprintf(out, cap, "%s/ckpt-%020" PRIu64, dir, round);
}

/* ---- listing -------------------------------------------------------------------------------- */

/* Whether name is a checkpoint's directory name ("ckpt-" and 20 digits); *round gets its round. */
static int ckpt_name(const char *name, uint64_t *round) {
  uint64_t v = 0;
  if (strncmp(name, "ckpt-", 5) != 0 || strlen(name) != 25)
    return 0;
  for (const char *c = name + 5; *c; c++) {
    if (*c < '0' || *c > '9' || v > (UINT64_MAX - 9) / 10)
      return 0;
    v = v * 10 + (uint64_t)(*c - '0');
  }
  *round = v;
  return 1;
}

static int by_round(const void *a, const void *b) {
  const embps_ckpt_manifest_t *x = a, *y = b;
  return x->round < y->round ? -1 : x->round > y->round;
}

/* Every checkpoint directory's round in dir (complete or not), unsorted. */
static embps_status_t scan_rounds(const char *dir, uint64_t **out, size_t *n, embps_error_t *err) {
  DIR *d = opendir(dir);
  struct dirent *e;
  uint64_t *v = NULL, round;
  size_t cap = 0;
  *out = NULL;
  *n = 0;
  if (!d) {
    if (errno == ENOENT)
      return embps_error_set(err, EMBPS_NOT_FOUND, "checkpoint directory %s does not exist", dir);
    return embps_error_set(err, EMBPS_INTERNAL, "cannot list %s: %s", dir, strerror(errno));
  }
  while ((e = readdir(d))) {
    if (!ckpt_name(e->d_name, &round))
      continue;
    if (*n == cap) {
      uint64_t *p = embps_realloc(v, (cap = cap ? cap * 2 : 16) * sizeof(*v));
      if (!p) {
        closedir(d);
        embps_free(v);
        *n = 0;
        return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory listing %s", dir);
      }
      v = p;
    }
    v[(*n)++] = round;
  }
  closedir(d);
  *out = v;
  return EMBPS_OK;
}

embps_status_t embps_ckpt_list(const char *dir, embps_ckpt_manifest_t **out, size_t *n,
                               embps_error_t *err) {
  uint64_t *rounds;
  size_t count, k = 0;
  embps_ckpt_manifest_t *list;
  embps_status_t ret;
  char path[EMBPS_CKPT_PATH_MAX];

  *out = NULL;
  *n = 0;
  if ((ret = scan_rounds(dir, &rounds, &count, err)) != EMBPS_OK)
    return ret;
  if (!(list = embps_calloc(count ? count : 1, sizeof(*list)))) {
    embps_free(rounds);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory listing %s", dir);
  }
  for (size_t i = 0; i < count; i++) {
    embps_error_t skip;
    embps_ckpt_path(path, sizeof(path), dir, rounds[i]);
    if (embps_ckpt_read_manifest(path, &list[k], &skip) != EMBPS_OK)
      continue;
    if (list[k].round != rounds[i]) { /* moved or copied by hand: not the one its name says */
      embps_ckpt_manifest_free(&list[k]);
      continue;
    }
    k++;
  }
  embps_free(rounds);
  qsort(list, k, sizeof(*list), by_round);
  *out = list;
  *n = k;
  return EMBPS_OK;
}

void embps_ckpt_list_free(embps_ckpt_manifest_t *list, size_t n) {
  for (size_t i = 0; list && i < n; i++)
    embps_ckpt_manifest_free(&list[i]);
  embps_free(list);
}

embps_status_t embps_ckpt_list_newest(const char *dir, size_t max, embps_ckpt_manifest_t **out,
                                      size_t *n, embps_error_t *err) {
  embps_status_t ret = embps_ckpt_list(dir, out, n, err);
  if (ret != EMBPS_OK || *n <= max)
    return ret;
  for (size_t i = 0; i < *n - max; i++)
    embps_ckpt_manifest_free(&(*out)[i]);
  memmove(*out, *out + (*n - max), max * sizeof(**out));
  *n = max;
  return EMBPS_OK;
}

/* ---- removing and pruning ------------------------------------------------------------------- */

embps_status_t embps_ckpt_remove(const char *ckpt_dir, embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX + 300];
  DIR *d;
  struct dirent *e;
  embps_status_t ret = EMBPS_OK;

  /* The manifest goes first: a removal cut short leaves an incomplete checkpoint, never a
   * complete one with files missing. */
  snprintf(path, sizeof(path), "%s/%s", ckpt_dir, EMBPS_CKPT_MANIFEST);
  if (unlink(path) != 0 && errno != ENOENT)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", path, strerror(errno));
  if (!(d = opendir(ckpt_dir))) {
    if (errno == ENOENT)
      return EMBPS_OK;
    return embps_error_set(err, EMBPS_INTERNAL, "cannot list %s: %s", ckpt_dir, strerror(errno));
  }
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    snprintf(path, sizeof(path), "%s/%s", ckpt_dir, e->d_name);
    if (unlink(path) != 0 && errno != ENOENT && ret == EMBPS_OK)
      ret = embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", path, strerror(errno));
  }
  closedir(d);
  if (ret == EMBPS_OK && rmdir(ckpt_dir) != 0 && errno != ENOENT)
    ret = embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", ckpt_dir, strerror(errno));
  return ret;
}

static const embps_ckpt_manifest_t *find_round(const embps_ckpt_manifest_t *list, size_t n,
                                               uint64_t round) {
  for (size_t i = 0; i < n; i++)
    if (list[i].round == round)
      return &list[i];
  return NULL;
}

embps_status_t embps_ckpt_prune(const char *dir, uint32_t keep, embps_error_t *err) {
  embps_ckpt_manifest_t *list;
  uint64_t *rounds = NULL;
  size_t n, count = 0;
  char *kept = NULL, path[EMBPS_CKPT_PATH_MAX];
  embps_status_t ret;
  int removed = 0;

  if ((ret = embps_ckpt_list(dir, &list, &n, err)) != EMBPS_OK)
    return ret;
  if (!n)
    goto exit;
  if (!(kept = embps_calloc(n, 1)) || (ret = scan_rounds(dir, &rounds, &count, err)) != EMBPS_OK) {
    if (!kept)
      ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory pruning %s", dir);
    goto exit;
  }
  /* The newest `keep` of each scope, newest first, and every checkpoint their chains need. */
  for (size_t i = n; i-- > 0;) {
    uint32_t newer = 0;
    if (!keep) {
      kept[i] = 1;
      continue;
    }
    for (size_t j = i + 1; j < n; j++)
      newer += strcmp(list[j].scope, list[i].scope) == 0;
    if (newer < keep)
      kept[i] = 1;
  }
  for (size_t i = n; i-- > 0;) {
    const embps_ckpt_manifest_t *m = &list[i];
    if (!kept[i])
      continue;
    while (m && m->base_round && (m = find_round(list, n, m->base_round)))
      kept[m - list] = 1;
  }
  for (size_t i = 0; i < n; i++) {
    embps_error_t e;
    if (kept[i])
      continue;
    embps_ckpt_path(path, sizeof(path), dir, list[i].round);
    if (embps_ckpt_remove(path, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
    removed = 1;
  }
  /* What a crash left half written, older than the newest complete checkpoint. */
  for (size_t i = 0; i < count; i++) {
    embps_error_t e;
    if (rounds[i] >= list[n - 1].round || find_round(list, n, rounds[i]))
      continue;
    embps_ckpt_path(path, sizeof(path), dir, rounds[i]);
    if (embps_ckpt_remove(path, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
    removed = 1;
  }
  if (removed) {
    embps_error_t e;
    if (embps_ckpt_sync_dir(dir, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
  }
exit:
  embps_free(kept);
  embps_free(rounds);
  embps_ckpt_list_free(list, n);
  return ret;
}

/* ---- the directory's check and lock -------------------------------------------------------- */

embps_status_t embps_ckpt_dir_check(const char *dir, embps_error_t *err) {
  struct stat st;
  char probe[EMBPS_CKPT_PATH_MAX + 64];
  int fd;
  if (stat(dir, &st) != 0) {
    if (errno == ENOENT)
      return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                             "checkpoint directory %s does not exist: create it, on storage that "
                             "every rank of the group shares",
                             dir);
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "checkpoint directory %s: %s", dir,
                           strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is not a directory", dir);
  /* Root passes every permission check, a read-only mount does not: try. */
  snprintf(probe, sizeof(probe), "%s/.embps-probe-%ld", dir, (long)getpid());
  if ((fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is not writable: %s", dir, strerror(errno));
  close(fd);
  unlink(probe);
  return EMBPS_OK;
}

embps_status_t embps_ckpt_dir_lock(const char *dir, const char *holder, int *fd,
                                   embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX + 8], text[256];
  int f;
  snprintf(path, sizeof(path), "%s/LOCK", dir);
  if ((f = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open %s: %s", path, strerror(errno));
  if (flock(f, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    ssize_t r;
    if (e != EWOULDBLOCK) {
      close(f);
      return embps_error_set(err, EMBPS_INTERNAL, "cannot lock %s: %s", path, strerror(e));
    }
    r = pread(f, text, sizeof(text) - 1, 0);
    text[r > 0 ? r : 0] = '\0';
    text[strcspn(text, "\n")] = '\0';
    close(f);
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is in use by another group (%s holds %s): "
                           "give each group its own directory, or stop the other group first",
                           dir, text[0] ? text : "another process", path);
  }
  snprintf(text, sizeof(text), "%s\n", holder);
  if (ftruncate(f, 0) != 0 || pwrite(f, text, strlen(text), 0) < 0) {
    int e = errno;
    close(f);
    return embps__ckpt_io_error(err, e, "write", path);
  }
  *fd = f;
  return EMBPS_OK;
}
