/* A rank's part in checkpoints (checkpointer.h): snapshots and the writer thread (restore is
 * ckpt_restore.c's).
 *
 * Threads. The group's thread owns the snapshot list and calls everything but the writer's
 * loop; it queues jobs (mutex + condition variable) and the writer posts them back finished
 * (same mutex, then a write to the group's eventfd). A job's slices point into snapshot
 * buffers, which the group's thread does not touch again until that checkpoint is complete. */
#include "server/group/checkpointer.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"

/* One table's snapshot buffers, as long as the table lives. */
typedef struct snap {
  embps_table_t *table;
  embps_table_arrays_t host;
  size_t bytes[3];
  int ready;       /* guarded by mu: every page of host is touched (the writer's prefault job) */
  uint64_t *dirty; /* the rows written since the previous capture, taken at this capture */
  struct snap *next;
} snap_t;

typedef enum { JOB_SLICES = 1, JOB_MANIFEST, JOB_DISCARD, JOB_PREFAULT } job_kind_t;

typedef struct job {
  job_kind_t kind;
  embps__ckpt_order_t order;
  size_t n;
  embps_ckpt_slice_t *slices;   /* JOB_SLICES: what this rank writes */
  embps_table_t **cow;          /* JOB_SLICES: slice i's table when its snapshot is still open
                                   (copy-on-write: the writer completes it), else NULL */
  embps_table_config_t *tables; /* JOB_MANIFEST: the checkpoint's tables (n of them) */
  uint8_t *window;              /* JOB_SLICES on the leader: the retry window's file, encoded
                                   at the round (the group's thread goes on changing it) */
  size_t window_len;
  uint8_t **index; /* JOB_SLICES on the leader: slice i's key index (hash-keyed tables), encoded
                      at the round (whole, or for an incremental checkpoint its delta since the
                      base); else NULL */
  size_t *index_len;
  int has_window;    /* JOB_MANIFEST: the leader wrote the retry window's file */
  struct snap *snap; /* JOB_PREFAULT: the buffers to touch */
  embps__ckpt_result_t result;
  struct job *next;
} job_t;

struct embps__ckpt {
  char dir[EMBPS__CKPT_PATH_MAX];
  uint32_t rank, size, keep;
  int track_dirty, host_tables;
  int wake_fd;
  snap_t *snaps; /* group thread only */
  /* Dropped tables' snapshot buffers that a slices job may still read (group thread only):
   * released once no slices job is out (slices_out, the jobs captured and not yet taken). */
  snap_t *retired;
  unsigned slices_out;
  /* The leader's last capture: the tables its manifest lists (group thread only). */
  embps_table_config_t *last_tables;
  size_t last_n;
  uint64_t last_round;
  int last_window; /* ... and it wrote the retry window's file */

  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;            /* a job is queued, or stopping */
  pthread_cond_t ready_cv;      /* a snapshot became ready */
  job_t *todo_head, *todo_tail; /* guarded by mu */
  job_t *done_head, *done_tail; /* guarded by mu */
  int stopping;                 /* guarded by mu */
};

/* Closes the snapshots of a job that will not be written (only while the writer cannot be
 * completing them: before submit, or after the thread is joined). */
static void job_cancel(job_t *j) {
  for (size_t i = 0; j->cow && i < j->n; i++)
    if (j->cow[i])
      embps_table_snapshot_cancel(j->cow[i]);
}

static void job_free(job_t *j) {
  if (!j)
    return;
  embps_free(j->cow);
  embps_free(j->slices);
  embps_free(j->tables);
  embps_free(j->window);
  for (size_t i = 0; j->index && i < j->n; i++)
    embps_free(j->index[i]);
  embps_free(j->index);
  embps_free(j->index_len);
  embps_free(j);
}

/* ---- the writer ------------------------------------------------------------------------------ */

/* Creates the checkpoint's directory (every rank may be first) and makes its entry durable. */
static embps_status_t make_ckpt_dir(embps__ckpt_t *c, const char *path, embps_error_t *err) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST)
    return embps_error_set(
        err, errno == ENOSPC || errno == EDQUOT ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_INTERNAL,
        "cannot create checkpoint directory %s: %s", path, strerror(errno));
  return embps_ckpt_sync_dir(c->dir, err);
}

static void write_slices(embps__ckpt_t *c, job_t *j) {
  embps__ckpt_result_t *r = &j->result;
  char file[EMBPS__CKPT_PATH_MAX + 160], name[160];
  uint64_t bytes;
  /* First every open snapshot, at memory speed, so that batches stop paying for copies soon;
   * then the files, at the disk's speed. */
  for (size_t i = 0; i < j->n; i++)
    if (j->cow[i])
      embps_table_snapshot_complete(j->cow[i]);
  if (make_ckpt_dir(c, r->path, &r->error) != EMBPS_OK)
    return;
  for (size_t i = 0; i < j->n; i++) {
    embps_ckpt_slice_name(name, sizeof(name), c->rank, j->slices[i].config.name);
    snprintf(file, sizeof(file), "%s/%s", r->path, name);
    if (embps_ckpt_write_slice(file, &j->slices[i], &bytes, &r->error) != EMBPS_OK)
      return;
    r->bytes += bytes;
  }
  for (size_t i = 0; j->index && i < j->n; i++) { /* the leader's, before the manifest too */
    if (!j->index[i])
      continue;
    embps_ckpt_index_name(name, sizeof(name), j->slices[i].config.name);
    snprintf(file, sizeof(file), "%s/%s", r->path, name);
    if (embps_ckpt_write_file(file, j->index[i], j->index_len[i], &bytes, &r->error) != EMBPS_OK)
      return;
    r->bytes += bytes;
  }
  if (j->window) { /* the leader's: written with its slices, so before the manifest */
    snprintf(file, sizeof(file), "%s/%s", r->path, EMBPS_CKPT_WINDOW);
    if (embps_ckpt_write_file(file, j->window, j->window_len, &bytes, &r->error) != EMBPS_OK)
      return;
    r->bytes += bytes;
  }
  embps_ckpt_sync_dir(r->path, &r->error);
}

static uint64_t now_unix_ms(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return (uint64_t)tv.tv_sec * 1000u + (uint64_t)tv.tv_usec / 1000u;
}

/* The leader's manifest: every rank's file of every table, as they lie in the (shared)
 * directory, then the manifest itself, then retention. */
static void write_manifest(embps__ckpt_t *c, job_t *j) {
  embps__ckpt_result_t *r = &j->result;
  embps_ckpt_manifest_t m;
  char file[EMBPS__CKPT_PATH_MAX + 160], name[160];
  struct stat st;
  size_t nindex = 0, k;

  memset(&m, 0, sizeof(m));
  m.round = j->order.round;
  m.base_round = j->order.base_round;
  m.time_ms = now_unix_ms();
  m.group_size = c->size;
  snprintf(m.scope, sizeof(m.scope), "%s", j->order.scope);
  m.num_tables = j->n;
  m.tables = j->tables;
  for (size_t t = 0; t < j->n; t++)
    nindex += embps_table_config_hashed(&j->tables[t]);
  m.num_files = j->n * c->size + nindex + (j->has_window ? 1 : 0);
  m.files = embps_calloc(m.num_files ? m.num_files : 1, sizeof(*m.files));
  if (!m.files) {
    embps_error_set(&r->error, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a manifest");
    return;
  }
  for (size_t t = 0; t < j->n; t++) {
    for (uint32_t rank = 0; rank < c->size; rank++) {
      embps_ckpt_file_t *f = &m.files[t * c->size + rank];
      embps_ckpt_slice_name(name, sizeof(name), rank, j->tables[t].name);
      snprintf(file, sizeof(file), "%s/%s", r->path, name);
      if (stat(file, &st) != 0) {
        embps_error_set(&r->error, EMBPS_INTERNAL,
                        "rank %u reported its files durable, but %s is not there (%s): is "
                        "--checkpoint-dir one filesystem that every rank shares?",
                        rank, file, strerror(errno));
        goto exit;
      }
      f->rank = rank;
      snprintf(f->table, sizeof(f->table), "%s", j->tables[t].name);
      f->bytes = (uint64_t)st.st_size;
      m.bytes += f->bytes;
    }
  }
  k = j->n * c->size;
  for (size_t t = 0; t < j->n; t++) { /* the key indexes: a restore needs them */
    embps_ckpt_file_t *f = &m.files[k];
    if (!embps_table_config_hashed(&j->tables[t]))
      continue;
    embps_ckpt_index_name(name, sizeof(name), j->tables[t].name);
    snprintf(file, sizeof(file), "%s/%s", r->path, name);
    if (stat(file, &st) != 0) {
      embps_error_set(&r->error, EMBPS_INTERNAL, "the key index's file %s is not there (%s)", file,
                      strerror(errno));
      goto exit;
    }
    f->rank = j->order.base_round ? EMBPS_CKPT_INDEX_DELTA_RANK : EMBPS_CKPT_INDEX_RANK;
    snprintf(f->table, sizeof(f->table), "%s", j->tables[t].name);
    f->bytes = (uint64_t)st.st_size;
    m.bytes += f->bytes;
    k++;
  }
  if (j->has_window) { /* listed, so that a restore needs it and checks its size */
    embps_ckpt_file_t *f = &m.files[k];
    snprintf(file, sizeof(file), "%s/%s", r->path, EMBPS_CKPT_WINDOW);
    if (stat(file, &st) != 0) {
      embps_error_set(&r->error, EMBPS_INTERNAL, "the retry window's file %s is not there (%s)",
                      file, strerror(errno));
      goto exit;
    }
    f->rank = 0;
    snprintf(f->table, sizeof(f->table), "%s", EMBPS_CKPT_WINDOW_TABLE);
    f->bytes = (uint64_t)st.st_size;
    m.bytes += f->bytes;
  }
  if (embps_ckpt_write_manifest(r->path, &m, &r->error) != EMBPS_OK ||
      embps_ckpt_sync_dir(c->dir, &r->error) != EMBPS_OK)
    goto exit;
  r->bytes = m.bytes;
  {
    embps_error_t perr;
    if (embps_ckpt_prune(c->dir, c->keep, &perr) != EMBPS_OK)
      EMBPS_WARN("checkpoint retention: %s", perr.message);
  }
exit:
  embps_free(m.files);
}

/* Touches every page of a new table's snapshot buffers, off the group's thread: on a 0.5 GiB
 * table that is most of a second of page faults that neither CreateTable nor a restore waits
 * for. A capture that comes first waits for it (wait_ready). */
static void prefault(embps__ckpt_t *c, snap_t *s) {
  void *arrays[3] = {s->host.data, s->host.state0, s->host.state1};
  for (int i = 0; i < 3; i++)
    if (arrays[i])
      memset(arrays[i], 0, s->bytes[i]);
  pthread_mutex_lock(&c->mu);
  s->ready = 1;
  pthread_cond_broadcast(&c->ready_cv);
  pthread_mutex_unlock(&c->mu);
}

static void *writer_main(void *arg) {
  embps__ckpt_t *c = arg;
  uint64_t one = 1;
  for (;;) {
    job_t *j;
    pthread_mutex_lock(&c->mu);
    while (!c->todo_head && !c->stopping)
      pthread_cond_wait(&c->cv, &c->mu);
    if (c->stopping) {
      pthread_mutex_unlock(&c->mu);
      return NULL;
    }
    j = c->todo_head;
    c->todo_head = j->next;
    if (!c->todo_head)
      c->todo_tail = NULL;
    pthread_mutex_unlock(&c->mu);

    if (j->kind == JOB_PREFAULT) { /* nothing to report */
      prefault(c, j->snap);
      job_free(j);
      continue;
    }
    if (j->kind == JOB_SLICES) {
      write_slices(c, j);
    } else if (j->kind == JOB_MANIFEST) {
      write_manifest(c, j);
    } else {
      embps_error_t rerr;
      if (embps_ckpt_remove(j->result.path, &rerr) != EMBPS_OK)
        EMBPS_WARN("cannot remove the failed checkpoint: %s", rerr.message);
    }
    if (j->result.error.status != EMBPS_OK && j->kind != JOB_DISCARD)
      EMBPS_ERROR("rank %u: checkpoint of round %llu: %s", c->rank,
                  (unsigned long long)j->order.round, j->result.error.message);

    j->next = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->done_tail)
      c->done_tail->next = j;
    else
      c->done_head = j;
    c->done_tail = j;
    pthread_mutex_unlock(&c->mu);
    if (write(c->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
      EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
  }
}

static void submit(embps__ckpt_t *c, job_t *j) {
  j->next = NULL;
  pthread_mutex_lock(&c->mu);
  if (c->todo_tail)
    c->todo_tail->next = j;
  else
    c->todo_head = j;
  c->todo_tail = j;
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* ---- the group's side ------------------------------------------------------------------------ */

embps_status_t embps__ckpt_new(embps__ckpt_t **out, const embps__ckpt_config_t *cfg) {
  embps__ckpt_t *c = embps_calloc(1, sizeof(*c));
  if (!c)
    return EMBPS_RESOURCE_EXHAUSTED;
  snprintf(c->dir, sizeof(c->dir), "%s", cfg->dir);
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->keep = cfg->keep;
  c->track_dirty = cfg->track_dirty;
  c->host_tables = cfg->host_tables;
  c->wake_fd = cfg->wake_fd;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  pthread_cond_init(&c->ready_cv, NULL);
  if (pthread_create(&c->thread, NULL, writer_main, c) != 0) {
    pthread_cond_destroy(&c->ready_cv);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    embps_free(c);
    return EMBPS_INTERNAL;
  }
  *out = c;
  return EMBPS_OK;
}

static void snap_release(snap_t *s) {
  embps_free(s->host.data);
  embps_free(s->host.state0);
  embps_free(s->host.state1);
  embps_free(s->dirty);
  memset(&s->host, 0, sizeof(s->host));
  s->dirty = NULL;
}

static void release_retired(embps__ckpt_t *c) {
  while (c->retired) {
    snap_t *s = c->retired;
    c->retired = s->next;
    snap_release(s);
    embps_free(s);
  }
}

void embps__ckpt_free(embps__ckpt_t *c) {
  if (!c)
    return;
  pthread_mutex_lock(&c->mu);
  c->stopping = 1;
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->mu);
  pthread_join(c->thread, NULL);
  for (job_t *j = c->todo_head, *next; j; j = next) {
    next = j->next;
    job_cancel(j);
    job_free(j);
  }
  for (job_t *j = c->done_head, *next; j; j = next) {
    next = j->next;
    job_free(j);
  }
  while (c->snaps) {
    snap_t *s = c->snaps;
    c->snaps = s->next;
    snap_release(s);
    embps_free(s);
  }
  release_retired(c);
  embps_free(c->last_tables);
  pthread_cond_destroy(&c->ready_cv);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  embps_free(c);
}

static snap_t *find_snap(embps__ckpt_t *c, const embps_table_t *t) {
  for (snap_t *s = c->snaps; s; s = s->next)
    if (s->table == t)
      return s;
  return NULL;
}

/* Allocates s's buffers (untouched: see prefault). Sets *fresh when it did. */
static embps_status_t snap_alloc(snap_t *s, int *fresh) {
  void **arrays[3] = {&s->host.data, (void **)&s->host.state0, (void **)&s->host.state1};
  *fresh = 0;
  if (s->host.data)
    return EMBPS_OK;
  embps_table_array_bytes(s->table, s->bytes);
  for (int i = 0; i < 3; i++) {
    if (!s->bytes[i])
      continue;
    if (!(*arrays[i] = embps_aligned_alloc(s->bytes[i]))) {
      snap_release(s);
      return EMBPS_RESOURCE_EXHAUSTED;
    }
  }
  if (embps_table_dirty(s->table) &&
      !(s->dirty =
            embps_calloc(embps_dirty_words(embps_table_config_rows(embps_table_config(s->table))),
                         sizeof(uint64_t)))) {
    snap_release(s);
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  *fresh = 1;
  return EMBPS_OK;
}

/* Group thread: waits until the writer has touched s's pages (a capture must not copy into
 * buffers the writer is still zeroing). */
static void wait_ready(embps__ckpt_t *c, snap_t *s) {
  pthread_mutex_lock(&c->mu);
  while (!s->ready)
    pthread_cond_wait(&c->ready_cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

static snap_t *snap_for(embps__ckpt_t *c, embps_table_t *t) {
  snap_t *s = find_snap(c, t);
  if (s)
    return s;
  if (!(s = embps_calloc(1, sizeof(*s))))
    return NULL;
  s->table = t;
  s->next = c->snaps;
  c->snaps = s;
  return s;
}

void embps__ckpt_prepare(embps__ckpt_t *c, embps_table_t *t) {
  job_t *j;
  snap_t *s;
  int fresh;
  if (c->track_dirty) {
    if (embps_table_track_dirty(t) != EMBPS_OK) {
      EMBPS_WARN("out of memory tracking the dirty rows of table '%s': its checkpoints are full",
                 embps_table_config(t)->name);
    } else {
      /* A new table is not in the chain's full checkpoint: every row of it is news. */
      memset(embps_table_dirty(t), 0xff,
             embps_dirty_words(embps_table_config_rows(embps_table_config(t))) * sizeof(uint64_t));
    }
  }
  if (!(s = snap_for(c, t)) || snap_alloc(s, &fresh) != EMBPS_OK) {
    EMBPS_WARN("out of memory for the checkpoint buffers of table '%s' (%llu bytes); trying "
               "again at the next checkpoint",
               embps_table_config(t)->name, (unsigned long long)embps_table_bytes(t));
    return;
  }
  if (!fresh)
    return;
  /* Copy-on-write captures touch the pages as they copy, mostly on the writer's thread (and a
   * prefault would race with the engine's block copies). */
  if (c->host_tables || !(j = embps_calloc(1, sizeof(*j)))) {
    pthread_mutex_lock(&c->mu);
    s->ready = 1;
    pthread_mutex_unlock(&c->mu);
    return;
  }
  j->kind = JOB_PREFAULT;
  j->snap = s;
  submit(c, j);
}

embps_status_t embps__ckpt_capture(embps__ckpt_t *c, embps_engine_t *engine, embps_store_t *store,
                                   const embps_dedup_t *window, const embps__ckpt_order_t *order,
                                   embps_error_t *err) {
  const size_t count = embps_store_count(store);
  const uint64_t t0 = embps_now_ns();
  job_t *j = embps_calloc(1, sizeof(*j));
  embps_status_t ret = EMBPS_OK;
  uint64_t bytes = 0;

  const int cow = c->host_tables;

  if (!j || !(j->slices = embps_calloc(count ? count : 1, sizeof(*j->slices))) ||
      !(j->cow = embps_calloc(count ? count : 1, sizeof(*j->cow))) ||
      !(j->tables = embps_calloc(count ? count : 1, sizeof(*j->tables))) ||
      (c->rank == 0 &&
       (!(j->index = embps_calloc(count ? count : 1, sizeof(*j->index))) ||
        !(j->index_len = embps_calloc(count ? count : 1, sizeof(*j->index_len)))))) {
    job_free(j);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory capturing a checkpoint");
  }
  j->kind = JOB_SLICES;
  j->order = *order;
  embps_ckpt_path(j->result.path, sizeof(j->result.path), c->dir, order->round);
  for (size_t i = 0; i < count; i++) {
    embps_table_t *t = embps_store_at(store, i);
    const embps_table_config_t *cfg = embps_table_config(t);
    embps_ckpt_slice_t *sl = &j->slices[j->n];
    snap_t *s;
    int fresh;
    if (order->scope[0] && strcmp(order->scope, cfg->name) != 0)
      continue;
    if (!(s = snap_for(c, t)) || snap_alloc(s, &fresh) != EMBPS_OK) {
      ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                            "out of host memory for a copy of table '%s' (%llu bytes) to "
                            "checkpoint",
                            cfg->name, (unsigned long long)embps_table_bytes(t));
      break;
    }
    if (fresh) { /* prepare could not allocate them: the copy faults the pages in */
      pthread_mutex_lock(&c->mu);
      s->ready = 1;
      pthread_mutex_unlock(&c->mu);
    }
    wait_ready(c, s);
    if (!cow && (ret = embps_engine_table_export(engine, t, &s->host, err)) != EMBPS_OK)
      break;
    sl->config = *cfg;
    sl->rank = c->rank;
    sl->group_size = c->size;
    sl->col_begin = embps_table_col_begin(t);
    sl->shard_width = embps_table_shard_width(t);
    sl->round = order->round;
    sl->step = embps_table_step(t);
    sl->data = s->host.data;
    sl->state0 = s->host.state0;
    sl->state1 = s->host.state1;
    /* Only a checkpoint of every table moves the chain on, so only it takes the marks. */
    if (!order->scope[0] && embps_table_dirty(t) && s->dirty) {
      size_t words = embps_dirty_words(embps_table_config_rows(cfg));
      memcpy(s->dirty, embps_table_dirty(t), words * sizeof(uint64_t));
      memset(embps_table_dirty(t), 0, words * sizeof(uint64_t));
      if (order->base_round) {
        sl->dirty = s->dirty;
        sl->base_round = order->base_round;
      }
    }
    /* On host memory the copy is lazy: the writer and the engine's writes share it. */
    if (cow && (ret = embps_table_snapshot_begin(t, &s->host, sl->dirty)) != EMBPS_OK) {
      embps_error_set(err, ret, "cannot open a snapshot of table '%s' to checkpoint: %s", cfg->name,
                      ret == EMBPS_RESOURCE_EXHAUSTED ? "out of memory" : "one is open already");
      break;
    }
    /* A hash-keyed table's index as it stands at this round (the group's thread steps it on while
     * the writer runs): the leader's alone is written, every rank holding the same. Whole, or in
     * an incremental checkpoint the delta since the base: the checkpoint of every table before,
     * whose capture (below) was the delta's start. */
    if (j->index && embps_table_hindex(t)) {
      const embps_hindex_t *ix = embps_table_hindex(t);
      j->index_len[j->n] =
          order->base_round ? embps_hindex_delta_bytes(ix) : embps_hindex_encoded_bytes(ix);
      if (!(j->index[j->n] = embps_malloc(j->index_len[j->n]))) {
        ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                              "out of memory capturing the key index of table '%s' (%zu bytes) to "
                              "checkpoint",
                              cfg->name, j->index_len[j->n]);
        if (cow)
          embps_table_snapshot_cancel(t);
        break;
      }
      if (order->base_round)
        embps_hindex_delta_encode(ix, j->index[j->n]);
      else
        embps_hindex_encode(ix, j->index[j->n]);
    }
    /* Every rank starts the next delta here, as the dirty rows above: only a checkpoint of every
     * table moves the chain on. One that fails breaks the chain (the leader's next is full), so
     * the changes it took are never needed again. */
    if (!order->scope[0] && embps_table_hindex(t))
      embps_hindex_mark_captured(embps_table_hindex(t));
    j->cow[j->n] = cow ? t : NULL;
    j->tables[j->n] = *cfg;
    j->n++;
    bytes += embps_table_bytes(t);
  }
  /* Every rank's window is the same at this round: the leader's alone is written, of the
   * tables the checkpoint covers. */
  if (ret == EMBPS_OK && c->rank == 0 && window &&
      embps_dedup_encode(window, order->scope, order->round, &j->window, &j->window_len) !=
          EMBPS_OK)
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                          "out of memory capturing the retry window (%zu entries) to checkpoint",
                          embps_dedup_size(window));
  if (ret != EMBPS_OK) {
    job_cancel(j);
    job_free(j);
    return ret;
  }
  /* The leader's manifest lists what it captured: every rank holds the same tables. */
  if (c->rank == 0) {
    embps_free(c->last_tables);
    c->last_tables = j->tables;
    c->last_n = j->n;
    c->last_round = order->round;
    c->last_window = j->window != NULL;
    j->tables = NULL;
  }
  EMBPS_INFO("rank %u: captured the checkpoint of round %llu (%zu table(s), %llu bytes) in %.1f "
             "ms; writing it in the background",
             c->rank, (unsigned long long)order->round, j->n, (unsigned long long)bytes,
             (double)(embps_now_ns() - t0) / 1e6);
  c->slices_out++;
  submit(c, j);
  return EMBPS_OK;
}

void embps__ckpt_finish(embps__ckpt_t *c, const embps__ckpt_order_t *order, int ok,
                        const embps_error_t *why) {
  job_t *j = embps_calloc(1, sizeof(*j));
  if (!j) {
    EMBPS_ERROR("out of memory finishing the checkpoint of round %llu",
                (unsigned long long)order->round);
    return;
  }
  j->order = *order;
  j->result.manifest = 1;
  j->result.round = order->round;
  embps_ckpt_path(j->result.path, sizeof(j->result.path), c->dir, order->round);
  if (ok && c->last_round == order->round) {
    j->kind = JOB_MANIFEST;
    j->tables = c->last_tables;
    j->n = c->last_n;
    j->has_window = c->last_window;
    c->last_tables = NULL;
    c->last_n = 0;
  } else {
    j->kind = JOB_DISCARD;
    if (why && why->status != EMBPS_OK)
      j->result.error = *why;
    else
      embps_error_set(&j->result.error, EMBPS_INTERNAL,
                      "the leader lost its capture of the checkpoint of round %llu",
                      (unsigned long long)order->round);
  }
  submit(c, j);
}

int embps__ckpt_take(embps__ckpt_t *c, embps__ckpt_result_t *out) {
  job_t *j;
  pthread_mutex_lock(&c->mu);
  j = c->done_head;
  if (j) {
    c->done_head = j->next;
    if (!c->done_head)
      c->done_tail = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  if (!j)
    return 0;
  *out = j->result;
  out->round = j->order.round;
  if (j->kind == JOB_SLICES && --c->slices_out == 0)
    release_retired(c); /* the writer is done reading them */
  job_free(j);
  return 1;
}

void embps__ckpt_forget(embps__ckpt_t *c, embps_table_t *t) {
  snap_t **pp = &c->snaps, *s;
  while (*pp && (*pp)->table != t)
    pp = &(*pp)->next;
  if (!(s = *pp))
    return;
  *pp = s->next;
  if (s->host.data)
    wait_ready(c, s); /* a prefault job may still be touching its pages */
  if (c->slices_out) {
    s->next = c->retired;
    c->retired = s;
    return;
  }
  snap_release(s);
  embps_free(s);
}
