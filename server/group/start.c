/* The group's start (group_internal.h): embps_group_new copies the configuration and starts the
 * group's thread; the thread forms the group first (embps__group_start: the ranks meet and
 * agree, formation.h; then the engine, the sequencer and the checkpointer start over the
 * communicator, the table budget is set and the agreed checkpoint restored) and serves rounds
 * after (rounds.c). Closing stops the thread, which also ends a bootstrap still waiting for
 * peers (cancel_fd); freeing releases what the start made, top-down. The accessors of group.h
 * that read no queue are here too. */
#include "server/group/group_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/group/formation.h"
#include "server/group/relay.h"

_Static_assert(EMBPS_GROUP_RETRY_WINDOW_MAX == EMBPS_DEDUP_WINDOW_MAX,
               "--retry-window's bound is the most a window's checkpoint file may hold");

/* Starts this rank's checkpointer: its writer thread and the eventfd it wakes us with. */
static embps_status_t start_checkpoints(embps_group_t *g, embps_error_t *err) {
  embps__ckpt_config_t cc = {.dir = g->ckpt_dir,
                             .rank = g->cfg.rank,
                             .size = g->cfg.size,
                             .keep = g->cfg.checkpoint_keep,
                             .track_dirty = g->cfg.checkpoint_full_every > 1,
                             .host_tables = embps_engine_backend(g->engine) == EMBPS_BACKEND_CPU,
                             .wake_fd = -1};
  embps_status_t ret;
  if ((g->ckpt_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot make an eventfd: %s", strerror(errno));
  cc.wake_fd = g->ckpt_fd;
  if (!(g->cur_attached = embps_calloc(g->cfg.size, sizeof(*g->cur_attached))) ||
      (ret = embps__ckpt_new(&g->ckpt, &cc)) != EMBPS_OK)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "cannot start the checkpoint writer");
  return EMBPS_OK;
}

/* Restores the checkpoint the group agreed on (every rank in step); the leader's round numbers
 * go on from it. */
static embps_status_t restore(embps_group_t *g, embps_error_t *err) {
  embps_ckpt_manifest_t m;
  embps_status_t ret;
  memset(&m, 0, sizeof(m));
  if ((ret = embps__ckpt_restore(g->ckpt, g->engine, g->store, g->restore_dir, g->cfg.restore_round,
                                 g->cfg.rank, g->cfg.size, &g->dedup, &m, err)) != EMBPS_OK)
    return ret;
  g->round_no = m.round;
  /* A restored checkpoint of every table is the table, row for row: the chain goes on from it
   * (a full one next if it was itself incremental, to keep chains short). */
  g->chain_base =
      !m.scope[0] && g->ckpt_dir && strcmp(g->ckpt_dir, g->restore_dir) == 0 ? m.round : 0;
  g->since_full = m.base_round ? g->cfg.checkpoint_full_every : 0;
  embps_ckpt_manifest_free(&m);
  return EMBPS_OK;
}

/* The budget of table memory (--max-memory-bytes): by default 80% of the memory tables live in,
 * which only the engine knows on the CUDA backend (the device's). With checkpoints on the CPU
 * backend, every table keeps a snapshot buffer of its size in the same memory, so it counts
 * twice; on the CUDA backend the snapshot is host memory and the budget is the device's. */
static void set_budget(embps_group_t *g) {
  uint64_t max = g->cfg.max_memory_bytes, total;
  if (!max) {
    total = embps_engine_memory_total(g->engine);
    max = total ? total / 10 * 8 : UINT64_MAX;
  }
  embps_store_set_budget(g->store, max,
                         g->ckpt_dir && embps_engine_backend(g->engine) == EMBPS_BACKEND_CPU);
  EMBPS_INFO("rank %u: tables may take %llu bytes of %s (--max-memory-bytes%s)", g->cfg.rank,
             (unsigned long long)max,
             embps_engine_backend(g->engine) == EMBPS_BACKEND_CPU ? "memory" : "GPU memory",
             g->cfg.max_memory_bytes ? "" : ": 80% of it");
}

embps_status_t embps__group_start(embps_group_t *g, embps_error_t *err) {
  embps_group_config_t cfg = g->cfg;
  embps__formed_t formed;
  embps_status_t ret;

  g->readers = embps_calloc(cfg.size, sizeof(*g->readers));
  if (!g->readers)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory forming the group");
  cfg.peer_addrs = (const char *const *)g->peer_addrs;
  cfg.identity = g->identity;
  cfg.secret = g->secret;
  if ((ret = embps__group_form(&cfg, g->cancel_fd, &formed, err)) != EMBPS_OK)
    return ret;
  g->control_fds = formed.control_fds;
  g->up = embps__relay_up(cfg.size, cfg.control_fanout, cfg.rank);
  if (cfg.size > 1 && cfg.control_fanout && embps__group_is_leader(g))
    EMBPS_INFO("rank 0: control relays, the followers in groups of %u (--control-fanout)",
               cfg.control_fanout);
  else if (cfg.size > 1 && cfg.control_fanout)
    EMBPS_INFO("rank %u: control frames go to rank %u; %u ranks send theirs through this one",
               cfg.rank, g->up, embps__relay_members(cfg.size, cfg.control_fanout, cfg.rank, NULL));
  g->comm = formed.comm;
  g->stream = formed.stream;
  if ((ret = embps_engine_new(&g->engine, g->comm, g->store, cfg.backend, g->stream)) != EMBPS_OK ||
      (ret = embps_sequencer_new(&g->seq, cfg.size, cfg.batch_deadline_ms)) != EMBPS_OK)
    embps_error_set(err, ret, "cannot start the engine (%s backend)",
                    embps_backend_name(cfg.backend));
  else if (cfg.backend == EMBPS_BACKEND_CUDA)
    atomic_store(&g->host_device, cfg.device);
  else if (cfg.engine_threads > 1)
    EMBPS_INFO("engine: pushes applied on %u threads",
               embps_engine_set_threads(g->engine, cfg.engine_threads));
  if (ret == EMBPS_OK &&
      (ret = embps_dedup_new(&g->dedup,
                             cfg.retry_window ? cfg.retry_window : EMBPS_GROUP_RETRY_WINDOW_DEFAULT,
                             EMBPS_DEDUP_MAX_CLIENTS)) != EMBPS_OK)
    embps_error_set(err, ret, "cannot make the retry window (--retry-window %u)", cfg.retry_window);
  if (ret == EMBPS_OK)
    set_budget(g);
  if (ret == EMBPS_OK && g->ckpt_dir)
    ret = start_checkpoints(g, err);
  if (ret == EMBPS_OK && g->cfg.restore_round)
    ret = restore(g, err);
  embps__group_publish_comm_stats(g);
  return ret;
}

/* Wipes and frees the group secret's copy: it should not outlive its use in freed memory. */
static void free_secret(embps_group_t *g) {
  if (g->secret)
    explicit_bzero(g->secret, g->cfg.secret_len);
  embps_free(g->secret);
  g->secret = NULL;
}

embps_status_t embps_group_new(embps_group_t **out, uv_loop_t *loop,
                               const embps_group_config_t *cfg, embps_store_t *store) {
  embps_group_t *g = embps_calloc(1, sizeof(*g));
  if (!g)
    return EMBPS_RESOURCE_EXHAUSTED;
  g->cfg = *cfg;
  g->loop = loop;
  g->store = store;
  embps_hist_init(&g->metrics.batches_per_round, embps_hist_count_bounds, embps_hist_count_nbounds);
  embps_hist_init(&g->metrics.round_seconds, embps_hist_seconds_bounds, embps_hist_seconds_nbounds);
  for (int p = 0; p < EMBPS_ROUND_PHASES; p++)
    embps_hist_init(&g->metrics.phase_seconds[p], embps_hist_seconds_bounds,
                    embps_hist_seconds_nbounds);
  embps_hist_init(&g->metrics.collective_seconds, embps_hist_seconds_bounds,
                  embps_hist_seconds_nbounds);
  embps_hist_init(&g->metrics.ckpt_seconds, embps_hist_long_seconds_bounds,
                  embps_hist_long_seconds_nbounds);
  g->wake_fd = g->cancel_fd = g->ckpt_fd = -1;
  atomic_init(&g->host_device, -1);
  if (cfg->size > 1) {
    g->peer_addrs = embps_calloc(cfg->size, sizeof(char *));
    if (!g->peer_addrs)
      goto fail;
    for (uint32_t r = 0; r < cfg->size; r++)
      if (!(g->peer_addrs[r] = embps_strdup(cfg->peer_addrs[r])))
        goto fail;
  }
  if (!(g->identity = embps_strdup(cfg->identity ? cfg->identity : "")))
    goto fail;
  if (cfg->secret_len) {
    if (!(g->secret = embps_malloc(cfg->secret_len)))
      goto fail;
    memcpy(g->secret, cfg->secret, cfg->secret_len);
  }
  g->cfg.secret = NULL;
  if (cfg->checkpoint_dir && cfg->checkpoint_dir[0] &&
      !(g->ckpt_dir = embps_strdup(cfg->checkpoint_dir)))
    goto fail;
  g->cfg.peer_addrs = NULL;
  g->cfg.identity = NULL;
  if (cfg->restore_round && !(g->restore_dir = embps_strdup(cfg->restore_dir)))
    goto fail;
  g->cfg.checkpoint_dir = NULL;
  g->cfg.restore_dir = NULL;
  if ((g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
      (g->cancel_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    goto fail;
  pthread_mutex_init(&g->mu, NULL);
  g->done.link = offsetof(embps_group_call_t, next);
  g->ordered.link = offsetof(embps_group_call_t, ordered_next);
  g->progress.link = offsetof(embps_group_call_t, progress_next);
  atomic_store(&g->state, EMBPS_GROUP_STARTING);
  snprintf(g->state_msg, sizeof(g->state_msg),
           "the shard group is starting: waiting for all %u ranks to join", cfg->size);
  if (uv_async_init(loop, &g->async, embps__group_on_async) != 0)
    goto fail_mutex;
  g->async.data = g;
  if (pthread_create(&g->thread, NULL, embps__group_main, g) != 0) {
    uv_close((uv_handle_t *)&g->async, NULL); /* freed by the caller's process exit */
    return EMBPS_INTERNAL;
  }
  g->thread_started = 1;
  *out = g;
  return EMBPS_OK;
fail_mutex:
  pthread_mutex_destroy(&g->mu);
fail:
  if (g->wake_fd >= 0)
    close(g->wake_fd);
  if (g->cancel_fd >= 0)
    close(g->cancel_fd);
  if (g->peer_addrs)
    for (uint32_t r = 0; r < cfg->size; r++)
      embps_free(g->peer_addrs[r]);
  embps_free(g->peer_addrs);
  embps_free(g->identity);
  free_secret(g);
  embps_free(g->ckpt_dir);
  embps_free(g->restore_dir);
  embps_free(g);
  return EMBPS_RESOURCE_EXHAUSTED;
}

uint32_t embps_group_rank(const embps_group_t *g) { return g->cfg.rank; }
uint32_t embps_group_size(const embps_group_t *g) { return g->cfg.size; }
embps_backend_t embps_group_backend(const embps_group_t *g) { return g->cfg.backend; }
int embps_group_host_device(embps_group_t *g) { return atomic_load(&g->host_device); }

const embps_group_metrics_t *embps_group_metrics(const embps_group_t *g) { return &g->metrics; }

void embps_group_comm_stats(embps_group_t *g, embps_comm_stats_t *out) {
  /* Not g->comm->stats: the group thread writes those while this runs (see
   * publish_comm_stats). */
  const embps_group_metrics_t *m = &g->metrics;
  memset(out, 0, sizeof(*out));
  out->bytes_sent = atomic_load_explicit(&m->peer_bytes_sent, memory_order_relaxed);
  out->bytes_received = atomic_load_explicit(&m->peer_bytes_received, memory_order_relaxed);
  out->calls = atomic_load_explicit(&m->collective_calls, memory_order_relaxed);
}

const char *embps_group_checkpoint_dir(const embps_group_t *g) { return g->ckpt_dir; }

void embps_group_close(embps_group_t *g) {
  uint64_t one = 1;
  if (!g || !g->thread_started)
    return;
  pthread_mutex_lock(&g->mu);
  g->stopping = 1;
  pthread_mutex_unlock(&g->mu);
  /* A thread still forming the group stops waiting for its peers; one that formed it never
   * looks at cancel_fd again. */
  if (write(g->cancel_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot cancel the group's bootstrap: %s", strerror(errno));
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
  pthread_join(g->thread, NULL);
  g->thread_started = 0;
  embps__group_on_async(&g->async); /* deliver what finished before the join */
  uv_close((uv_handle_t *)&g->async, NULL);
}

void embps_group_free(embps_group_t *g) {
  if (!g)
    return;
  embps__ckpt_free(g->ckpt); /* finishes the file being written */
  if (g->ckpt_fd >= 0)
    close(g->ckpt_fd);
  embps__group_ckpt_free(g);
  embps_free(g->ckpt_dir);
  embps_free(g->restore_dir);
  embps_engine_free(g->engine);
  embps_sequencer_free(g->seq);
  embps_dedup_free(g->dedup);
  embps_comm_free(g->comm);
  embps_cuda_close(g->stream);
  if (g->control_fds)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      if (g->control_fds[r] >= 0)
        close(g->control_fds[r]);
  embps_free(g->control_fds);
  if (g->readers)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      embps__frame_reader_free(&g->readers[r]);
  embps_free(g->readers);
  embps__buf_free(&g->out);
  embps__buf_free(&g->notices);
  embps__buf_free(&g->down);
  embps__buf_free(&g->wrap);
  if (g->peer_addrs)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      embps_free(g->peer_addrs[r]);
  embps_free(g->peer_addrs);
  embps_free(g->identity);
  free_secret(g);
  embps__group_withdrawals_free(g);
  close(g->wake_fd);
  close(g->cancel_fd);
  pthread_mutex_destroy(&g->mu);
  embps_free(g);
}
