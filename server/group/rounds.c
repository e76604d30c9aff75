/* The group's rounds (group_internal.h): the group's thread, its queues, and the rounds it runs.
 *
 * Control plane. Besides the communicator's data connections, every non-leader rank keeps one
 * control connection to the leader (rank 0), which formation (formation.h) hands over. Frames
 * on it (control.h) are NOTICE (rank -> leader: "I hold my shard of batch B: kind,
 * tokens_per_batch, table, and the time its caller's deadline leaves"), ROUND (leader -> every
 * rank: an ordered list of "run B" / "fail B with status S"; a run of a CreateTable carries the
 * table's config), WITHDRAW (rank -> leader: "my shard of B's caller went away", withdraw.c),
 * CHECKPOINT (ckpt_leader.c), BROKEN and LEAVING. In a large group the followers' control
 * connections form a tree instead of a star (relay.h): a member's frames pass through its
 * relay both ways, in order, and the leader handles each as its origin's. A rank sends its notices
 * in the order its shards arrived, and the leader's sequencer orders a batch once every rank holds
 * its shard, so every rank runs the same batches in the same order and their collectives always
 * match: no deadlock, whatever order concurrent clients' shards reach the ranks in.
 *
 * Threads. The loop thread submits calls into `incoming` (mutex + eventfd); this thread polls the
 * eventfd and the control connections, and posts finished calls to `completed` (mutex +
 * uv_async_t). Collectives block this thread only.
 *
 * Failure. If a peer's connection breaks or a collective fails, the group is broken: every
 * parked call and every later one fails with UNAVAILABLE and the message says which rank and
 * what happened, so clients see an error within the peer timeout instead of hanging. A broken
 * group does not heal; the ranks must be restarted (the health check reports NOT_SERVING). A
 * rank that stops cleanly says so first (LEAVING): the group ends the same way, but the others
 * log it as news, not as an error. */
#include "server/group/group_internal.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/group/relay.h"

#define CREATE_ID_BIT (UINT64_C(1) << 63) /* the leader's own ids for creates and drops */

/* ---- completion ------------------------------------------------------------------------------ */

static embps_group_call_t **call_link(embps_group_call_t *call, size_t link) {
  return (embps_group_call_t **)((char *)call + link);
}

/* Appends call to q and wakes the loop (any thread). */
static void post(embps_group_t *g, embps__call_queue_t *q, embps_group_call_t *call) {
  *call_link(call, q->link) = NULL;
  pthread_mutex_lock(&g->mu);
  if (q->tail)
    *call_link(q->tail, q->link) = call;
  else
    q->head = call;
  q->tail = call;
  pthread_mutex_unlock(&g->mu);
  uv_async_send(&g->async);
}

/* Empties q (under mu), returning its calls in order. */
static embps_group_call_t *take_all(embps__call_queue_t *q) {
  embps_group_call_t *head = q->head;
  q->head = q->tail = NULL;
  return head;
}

/* The first call of a list take_all returned, unlinked; *list moves past it. */
static embps_group_call_t *pop(embps_group_call_t **list, size_t link) {
  embps_group_call_t *call = *list;
  *list = *call_link(call, link);
  *call_link(call, link) = NULL;
  return call;
}

void embps__group_complete(embps_group_t *g, embps_group_call_t *call) { post(g, &g->done, call); }

/* Tells the loop that call's batch is ordered (call->ordered runs there, before call->done). */
void embps__group_announce_ordered(embps_group_t *g, embps_group_call_t *call) {
  if (call->ordered)
    post(g, &g->ordered, call);
}

/* The engine made more of a lookup's rows final (engine thread): the loop runs the call's
 * progress. A call is queued once until the loop has taken it, so a fast engine costs one wake
 * per loop turn, not one per chunk. op is the call's own (the engine knows only the op). */
void embps__group_publish_progress(embps_op_t *op, void *arg) {
  embps_group_t *g = arg;
  embps_group_call_t *call = (embps_group_call_t *)((char *)op - offsetof(embps_group_call_t, op));
  if (!atomic_exchange_explicit(&call->progress_queued, 1, memory_order_acq_rel))
    post(g, &g->progress, call);
}

void embps__group_fail_call(embps_group_t *g, embps_group_call_t *call, embps_status_t status,
                            const char *msg) {
  embps_error_set(&call->error, status, "%s", msg);
  embps__group_complete(g, call);
}

void embps__group_on_async(uv_async_t *handle) {
  embps_group_t *g = handle->data;
  embps_group_call_t *call, *ordered, *progress;
  if (atomic_exchange(&g->fatal_pending, 0) && g->cfg.on_fatal) {
    char msg[400];
    embps_group_state(g, msg, sizeof(msg));
    g->cfg.on_fatal(g->cfg.on_fatal_arg, g->fatal_status, msg);
  }
  pthread_mutex_lock(&g->mu);
  ordered = take_all(&g->ordered);
  progress = take_all(&g->progress);
  call = take_all(&g->done);
  pthread_mutex_unlock(&g->mu);
  /* Every call's ordered notice was queued before its completion: taking the queues at once and
   * running the notices first keeps that order. */
  while (ordered) {
    embps_group_call_t *c = pop(&ordered, g->ordered.link);
    c->ordered(c);
  }
  /* Progress is queued before its call's completion too, so it runs before done frees the call.
   * The flag is cleared first: a chunk published meanwhile queues the call again. */
  while (progress) {
    embps_group_call_t *c = pop(&progress, g->progress.link);
    atomic_store_explicit(&c->progress_queued, 0, memory_order_release);
    c->progress(c);
  }
  while (call) {
    embps_group_call_t *c = pop(&call, g->done.link);
    c->done(c);
  }
}

/* ---- state ----------------------------------------------------------------------------------- */

static void set_state(embps_group_t *g, embps_group_state_t state, const char *msg) {
  pthread_mutex_lock(&g->mu);
  snprintf(g->state_msg, sizeof(g->state_msg), "%s", msg ? msg : "");
  pthread_mutex_unlock(&g->mu);
  atomic_store(&g->state, (int)state);
}

/* Breaks the group: every parked call fails, and so will every later one. */
static void fail_all(embps_group_t *g, const char *msg) {
  set_state(g, EMBPS_GROUP_BROKEN, msg);
  while (g->parked) {
    embps_group_call_t *call = g->parked;
    g->parked = call->next;
    embps__group_fail_call(g, call, EMBPS_UNAVAILABLE, msg);
  }
  while (g->ckpt_calls) {
    embps_group_call_t *call = g->ckpt_calls;
    g->ckpt_calls = call->next;
    if (call->ckpt->final && g->final_done) /* the group's final checkpoint is complete */
      embps__group_ckpt_complete_final(g, call);
    else
      embps__group_fail_call(g, call, EMBPS_UNAVAILABLE, msg);
  }
  g->ckpt_calls_tail = NULL;
}

static embps_status_t flush_notices(embps_group_t *g);

/* Breaks the group on this rank and makes sure every other rank hears of it: a non-leader
 * tells the leader, and the leader tells every rank and closes its control connections, so a
 * rank that is idle (in no collective) when another dies still fails its calls at once.
 *
 * left: nothing failed, a rank left the group on purpose (its LEAVING frame; why names it). The
 * group is just as unable to serve, but a clean rolling stop is no error: this is logged as
 * info, and the leader passes the news on as LEAVING, so the other ranks log it so too. */
static void end_group(embps_group_t *g, const char *why, int left) {
  char msg[400];
  int leader = embps__group_is_leader(g);
  if (atomic_load(&g->state) == EMBPS_GROUP_BROKEN)
    return;
  snprintf(msg, sizeof(msg), "the shard group is broken: %.300s; restart its ranks", why);
  if (left)
    EMBPS_INFO("rank %u: %.300s; this rank serves no group calls until the group is restarted",
               g->cfg.rank, why);
  else
    EMBPS_ERROR("rank %u: %s", g->cfg.rank, msg);
  fail_all(g, msg);
  if (!g->control_fds)
    return;
  /* A relay passes its members' frames on first (a member's LEAVING among them). */
  if (!leader && g->notices.len && g->control_fds[g->up] >= 0)
    flush_notices(g);
  for (uint32_t r = 0; r < g->cfg.size; r++) {
    if (g->control_fds[r] < 0)
      continue;
    if (!leader && r == g->up) { /* a non-leader only ever hears the leader leave */
      if (!left)
        embps__send_broken(g->control_fds[r], why);
      continue;
    }
    /* The leader's ranks, or a relay's members: they hear it from here. */
    if (left)
      embps__send_leaving(g->control_fds[r], why);
    else
      embps__send_broken(g->control_fds[r], why);
    shutdown(g->control_fds[r], SHUT_RDWR);
  }
}

void embps__group_break(embps_group_t *g, const char *why) { end_group(g, why, 0); }

/* This rank stops while its group serves: it tells the others it leaves on purpose (the leader
 * every rank, a non-leader the leader, who passes it on), so that they log a clean stop as such
 * and not as a broken group. A rank that dies sends nothing, and they log an error. */
static void announce_leave(embps_group_t *g) {
  char why[80];
  if (!g->control_fds)
    return;
  snprintf(why, sizeof(why), "rank %u left the group (shutting down)", g->cfg.rank);
  EMBPS_INFO("rank %u: leaving the group (shutting down)", g->cfg.rank);
  if (!embps__group_is_leader(g) && g->notices.len && g->control_fds[g->up] >= 0)
    flush_notices(g);
  /* Every connection this rank keeps: the leader's ranks, a follower's up, a relay's members. */
  for (uint32_t r = 0; r < g->cfg.size; r++)
    if (g->control_fds[r] >= 0)
      embps__send_leaving(g->control_fds[r], why);
}

embps_group_state_t embps_group_state(embps_group_t *g, char *message, size_t cap) {
  embps_group_state_t s = (embps_group_state_t)atomic_load(&g->state);
  if (message) {
    pthread_mutex_lock(&g->mu);
    snprintf(message, cap, "%s", g->state_msg);
    pthread_mutex_unlock(&g->mu);
  }
  return s;
}

/* ---- control frames -------------------------------------------------------------------------- */

/* Follower: sends the notices queued since the last flush to the leader (through its relay, or
 * for a relay with its members' frames), in one write. */
static embps_status_t flush_notices(embps_group_t *g) {
  embps__io_t io;
  if (g->notices.len == 0)
    return EMBPS_OK;
  io = embps__send_all(g->control_fds[g->up], g->notices.data, g->notices.len, UINT64_MAX);
  g->notices.len = 0;
  return io == EMBPS__IO_OK ? EMBPS_OK : EMBPS_UNAVAILABLE;
}

/* Sends the frame in g->out to peer alone (after the notices still queued for it, which came
 * first): a follower's goes up (peer is the leader, 0), the leader's to a rank at or behind a
 * relay wrapped in RELAY naming it. Frames are small and the peer reads them as they come, so
 * this waits as long as the socket needs (a dead peer fails it). */
embps_status_t embps__group_send_out(embps_group_t *g, uint32_t peer) {
  const uint8_t *p = g->out.data;
  size_t len = g->out.len;
  uint32_t via = peer;
  if (!embps__group_is_leader(g)) {
    if (flush_notices(g) != EMBPS_OK)
      return EMBPS_UNAVAILABLE;
    via = g->up;
  } else if (g->control_fds[peer] < 0 ||
             embps__relay_members(g->cfg.size, g->cfg.control_fanout, peer, NULL)) {
    via = embps__relay_up(g->cfg.size, g->cfg.control_fanout, peer);
    via = via ? via : peer;
    g->wrap.len = 0;
    if (embps__frame_relay(&g->wrap, peer, g->out.data, g->out.len, NULL) != EMBPS_OK)
      return EMBPS_RESOURCE_EXHAUSTED;
    p = g->wrap.data;
    len = g->wrap.len;
  }
  if (g->control_fds[via] < 0)
    return EMBPS_UNAVAILABLE;
  embps__io_t io = embps__send_all(g->control_fds[via], p, len, UINT64_MAX);
  return io == EMBPS__IO_OK ? EMBPS_OK : EMBPS_UNAVAILABLE;
}

/* Queues a notice for the leader (flush_notices sends it); EMBPS_RESOURCE_EXHAUSTED leaves
 * nothing queued. */
static embps_status_t send_notice(embps_group_t *g, const embps_batch_desc_t *d) {
  return embps__frame_notice(&g->notices, d, NULL);
}

embps_group_call_t *embps__group_find_parked(embps_group_t *g, uint64_t client_id,
                                             uint64_t batch_id, uint32_t attempt, int unlink) {
  for (embps_group_call_t **pp = &g->parked; *pp; pp = &(*pp)->next) {
    if ((*pp)->client_id == client_id && (*pp)->batch_id == batch_id && (*pp)->attempt == attempt) {
      embps_group_call_t *call = *pp;
      if (unlink) {
        *pp = call->next;
        call->next = NULL;
      }
      return call;
    }
  }
  return NULL;
}

/* Leader: sends round entries e[0..n) to every rank, with the config of each create it runs
 * (and, for a checkpoint, its order in ckpts). */
embps_status_t embps__group_send_round(embps_group_t *g, const embps_round_entry_t *e,
                                       const embps__ckpt_order_t *ckpts, size_t n) {
  embps_status_t ret;
  for (size_t i = 0; i < n; i++) {
    embps_group_call_t *call =
        e[i].action == EMBPS_ROUND_RUN &&
                (e[i].kind == EMBPS_OP_CREATE_TABLE || e[i].kind == EMBPS_OP_DROP_TABLE)
            ? embps__group_find_parked(g, e[i].client_id, e[i].batch_id, e[i].attempt, 0)
            : NULL;
    if (call)
      g->round_configs[i] = call->op.create;
    else
      memset(&g->round_configs[i], 0, sizeof(g->round_configs[i]));
  }
  g->out.len = 0;
  if ((ret = embps__frame_round(&g->out, e, g->round_configs, ckpts, n, NULL)) != EMBPS_OK)
    return ret;
  /* Once to each rank the leader keeps a connection to: a relay passes it to its members. */
  for (uint32_t r = 1; r < g->cfg.size && ret == EMBPS_OK; r++)
    if (g->control_fds[r] >= 0 &&
        embps__send_all(g->control_fds[r], g->out.data, g->out.len, UINT64_MAX) != EMBPS__IO_OK)
      ret = EMBPS_UNAVAILABLE;
  return ret;
}

/* Reads what peer's control connection has and handles each whole frame. Returns
 * EMBPS_UNAVAILABLE when the peer closed it (after handling what it sent before), or
 * EMBPS_RESOURCE_EXHAUSTED, or EMBPS_INVALID_ARGUMENT for a malformed frame (err says why). */
typedef void (*frame_fn)(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p,
                         size_t len);

static embps_status_t read_frames(embps_group_t *g, uint32_t peer, frame_fn handle,
                                  embps_error_t *err) {
  embps__frame_reader_t *r = &g->readers[peer];
  const uint8_t *payload;
  size_t len;
  uint8_t type;
  int closed, have;
  embps_status_t ret = embps__frame_reader_fill(r, g->control_fds[peer], &closed);
  if (ret != EMBPS_OK)
    return embps_error_set(err, ret, "out of memory reading rank %u's control frames", peer);
  /* A relay passes the leader's frames to its members before it acts on any (a round's
   * collectives need them too). */
  if (peer == g->up && !embps__group_is_leader(g) && embps__group_relays(g) &&
      (ret = embps__group_relay_down(g, r, err)) != EMBPS_OK)
    return ret;
  while ((ret = embps__frame_reader_next(r, &have, &type, &payload, &len, err)) == EMBPS_OK && have)
    handle(g, peer, type, payload, len);
  if (ret != EMBPS_OK)
    return ret;
  if (closed)
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "rank %u closed its control connection (it stopped or died)", peer);
  return EMBPS_OK;
}

static void on_frame(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p, size_t len);

/* A RELAY frame from peer: the leader handles its load as its origin's (a rank behind peer); a
 * relay, one from the leader for itself (it passed those for its members on already). */
static embps_status_t on_relay(embps_group_t *g, uint32_t peer, const uint8_t *p, size_t len,
                               embps_error_t *err) {
  const uint8_t *payload, *frame;
  size_t payload_len, frame_len;
  uint8_t type;
  uint32_t rank;
  embps_status_t ret =
      embps__parse_relay(p, len, &rank, &type, &payload, &payload_len, &frame, &frame_len, err);
  if (ret != EMBPS_OK)
    return ret;
  if (embps__group_is_leader(g)) {
    if (rank >= g->cfg.size || embps__relay_up(g->cfg.size, g->cfg.control_fanout, rank) != peer)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "a RELAY frame from rank %u, which relays no rank %u", rank, peer);
    on_frame(g, rank, type, payload, payload_len);
  } else if (peer == g->up && rank == g->cfg.rank) {
    on_frame(g, peer, type, payload, payload_len);
  } else if (!(peer == g->up && embps__group_is_member(g, rank))) {
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "a RELAY frame for rank %u, which this rank does not relay for", rank);
  }
  return EMBPS_OK;
}

static void on_frame(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p, size_t len) {
  embps_error_t err;
  embps_status_t ret = EMBPS_OK;
  char why[400];
  if (!embps__group_is_leader(g) && peer != g->up) {
    /* A relay's member: its frames go to the leader as they came. The relay ends the group on
     * its side too when the member says it ends, so that its other members hear at once. */
    if (type == EMBPS__FRAME_RELAY)
      ret = embps_error_set(&err, EMBPS_INVALID_ARGUMENT, "a RELAY frame from a member");
    else
      ret = embps__group_relay_up(g, peer, p - EMBPS__FRAME_HEADER_LEN,
                                  len + EMBPS__FRAME_HEADER_LEN, &err);
    if (ret == EMBPS_OK && type != EMBPS__FRAME_BROKEN && type != EMBPS__FRAME_LEAVING)
      return;
  }
  if (ret != EMBPS_OK) {
  } else if (type == EMBPS__FRAME_RELAY) {
    ret = on_relay(g, peer, p, len, &err);
  } else if (type == EMBPS__FRAME_BROKEN) {
    char reason[EMBPS__BROKEN_MAX + 1];
    if ((ret = embps__parse_broken(p, len, reason, sizeof(reason), &err)) == EMBPS_OK) {
      snprintf(why, sizeof(why), "rank %u reported: %s", peer, reason);
      embps__group_break(g, why);
    }
  } else if (type == EMBPS__FRAME_LEAVING) {
    char reason[EMBPS__BROKEN_MAX + 1];
    if ((ret = embps__parse_broken(p, len, reason, sizeof(reason), &err)) == EMBPS_OK)
      end_group(g, reason, 1);
  } else if (type == EMBPS__FRAME_NOTICE && embps__group_is_leader(g)) {
    embps_batch_desc_t d;
    if ((ret = embps__parse_notice(p, len, &d, &err)) == EMBPS_OK)
      embps_sequencer_arrive(g->seq, peer, &d, embps_now_ms());
  } else if (type == EMBPS__FRAME_WITHDRAW && embps__group_is_leader(g)) {
    ret = embps__group_withdraw_on_frame(g, peer, p, len, &err);
  } else if (type == EMBPS__FRAME_ROUND && !embps__group_is_leader(g) && peer == g->up) {
    size_t n;
    if ((ret = embps__parse_round(p, len, g->round, g->round_configs, g->round_ckpts,
                                  EMBPS__ROUND_MAX, &n, &err)) == EMBPS_OK)
      embps__group_apply_round(g, g->round, n, g->round_configs, g->round_ckpts);
  } else if (type == EMBPS__FRAME_CHECKPOINT && (embps__group_is_leader(g) || peer == g->up)) {
    ret = embps__group_ckpt_on_frame(g, peer, p, len, &err);
  }
  if (ret != EMBPS_OK) {
    snprintf(why, sizeof(why), "rank %u sent a control frame this rank cannot read (%.300s)", peer,
             err.message);
    embps__group_break(g, why);
  }
}

void embps__group_publish_seq_counts(embps_group_t *g) {
  embps_sequencer_counts_t c;
  embps_sequencer_counts(g->seq, &c);
  atomic_store_explicit(&g->metrics.batches_expired, c.expired, memory_order_relaxed);
  atomic_store_explicit(&g->metrics.batches_cancelled, c.cancelled, memory_order_relaxed);
}

/* Leader: hands out every round the sequencer has ready, and runs it here too. Once a final
 * checkpoint is ordered, every batch fails instead: what the group acknowledges is in it. */
static void lead_rounds(embps_group_t *g) {
  size_t n;
  while (atomic_load(&g->state) != EMBPS_GROUP_BROKEN &&
         (n = embps_sequencer_next_round(g->seq, embps_now_ms(), g->round, EMBPS__ROUND_MAX)) > 0) {
    embps__group_publish_seq_counts(g);
    for (size_t i = 0; i < n && g->closing; i++) {
      if (g->round[i].action != EMBPS_ROUND_RUN)
        continue;
      g->round[i].action = EMBPS_ROUND_FAIL;
      g->round[i].status = EMBPS_UNAVAILABLE;
      snprintf(g->round[i].message, sizeof(g->round[i].message),
               "the shard group is shutting down (a rank got SIGTERM and its final checkpoint "
               "is taken); retry once the group is back");
    }
    if (g->cfg.size > 1 && embps__group_send_round(g, g->round, NULL, n) != EMBPS_OK) {
      embps__group_break(g, "the leader could not send a round to every rank");
      return;
    }
    embps__group_apply_round(g, g->round, n, NULL, NULL);
  }
}

/* Puts a caller's deadline (deadline_ns on this rank's clock; 0: none) into d as the time it has
 * left, rounded up to whole milliseconds, since the leader reads it on its own clock. One more
 * than 49 days away is as good as none. */
static void set_deadline(embps_batch_desc_t *d, uint64_t deadline_ns, uint64_t now_ns) {
  uint64_t left_ms;
  if (!deadline_ns)
    return;
  if (deadline_ns > now_ns) {
    uint64_t left_ns = deadline_ns - now_ns;
    left_ms = left_ns / 1000000 + (left_ns % 1000000 != 0);
  } else {
    left_ms = 0;
  }
  if (left_ms > UINT32_MAX)
    return;
  d->has_deadline = 1;
  d->deadline_left_ms = (uint32_t)left_ms;
}

/* Parks a call that the loop thread submitted and reports it to the leader. */
static void admit(embps_group_t *g, embps_group_call_t *call) {
  const embps_op_t *op = &call->op;
  embps_batch_desc_t d;
  embps_status_t ret;
  char msg[400];

  if (embps_group_state(g, msg, sizeof(msg)) != EMBPS_GROUP_READY) {
    embps__group_fail_call(g, call, EMBPS_UNAVAILABLE, msg);
    return;
  }
  if (call->ckpt) {
    embps__group_ckpt_admit(g, call);
    return;
  }
  if (op->kind == EMBPS_OP_CREATE_TABLE || op->kind == EMBPS_OP_DROP_TABLE) {
    call->client_id = 0;
    call->batch_id = CREATE_ID_BIT | ++g->next_create_id;
    call->attempt = 0;
    call->digest = 0;
  }
  if (embps__group_find_parked(g, call->client_id, call->batch_id, call->attempt, 0)) {
    snprintf(msg, sizeof(msg),
             "batch_id %llu is already in flight on rank %u: every batch needs its own id",
             (unsigned long long)call->batch_id, g->cfg.rank);
    embps__group_fail_call(g, call, EMBPS_INVALID_ARGUMENT, msg);
    return;
  }
  call->next = g->parked;
  g->parked = call;
  memset(&d, 0, sizeof(d));
  d.client_id = call->client_id;
  d.batch_id = call->batch_id;
  d.attempt = call->attempt;
  d.digest = call->digest;
  d.kind = op->kind;
  d.tokens_per_batch = call->tokens_per_batch;
  if (op->kind == EMBPS_OP_CREATE_TABLE || op->kind == EMBPS_OP_DROP_TABLE) {
    snprintf(d.table, sizeof(d.table), "%s", op->create.name);
  } else {
    snprintf(d.table, sizeof(d.table), "%s", embps_table_config(op->table)->name);
    d.table_id = embps_table_id(op->table);
    set_deadline(&d, call->deadline_ns, embps_now_ns());
  }
  if (embps__group_is_leader(g)) {
    embps_sequencer_arrive(g->seq, 0, &d, embps_now_ms());
  } else if ((ret = send_notice(g, &d)) == EMBPS_RESOURCE_EXHAUSTED) {
    /* Nothing was sent: the leader never orders this shard, and the others expire. */
    embps__group_find_parked(g, call->client_id, call->batch_id, call->attempt, 1);
    embps__group_fail_call(g, call, ret, "out of memory for the notice to the leader (rank 0)");
  } else if (ret != EMBPS_OK) {
    embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
  }
}

/* ---- the thread ------------------------------------------------------------------------------ */

/* Queues call for the group's thread, in submission order whatever it asks for. */
static void enqueue(embps_group_t *g, embps_group_call_t *call) {
  uint64_t one = 1;
  call->next = NULL;
  call->submitted_ns = embps_now_ns();
  call->replayed = 0;
  pthread_mutex_lock(&g->mu);
  g->in_count++;
  if (g->in_tail)
    g->in_tail->next = call;
  else
    g->in_head = call;
  g->in_tail = call;
  pthread_mutex_unlock(&g->mu);
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
}

void embps_group_submit(embps_group_t *g, embps_group_call_t *call) {
  call->ckpt = NULL;
  enqueue(g, call);
}

void embps_group_checkpoint(embps_group_t *g, embps_group_call_t *call, embps_group_ckpt_t *req) {
  call->ckpt = req;
  enqueue(g, call);
}

/* Takes what the loop thread queued: calls, admitted in submission order, and withdrawals, each
 * acted on once the calls submitted before it are admitted (withdraw.c says why). */
static void drain_incoming(embps_group_t *g, int *stopping) {
  embps_group_call_t *batch;
  embps__withdrawal_t *wd;
  uint64_t v;
  while (read(g->wake_fd, &v, sizeof(v)) > 0) {
  }
  pthread_mutex_lock(&g->mu);
  batch = g->in_head;
  g->in_head = g->in_tail = NULL;
  wd = g->wd_head;
  g->wd_head = g->wd_tail = NULL;
  *stopping = g->stopping;
  pthread_mutex_unlock(&g->mu);
  while (batch || wd) {
    if (wd && (!batch || wd->after <= g->admitted)) {
      embps__withdrawal_t *w = wd;
      wd = w->next;
      embps__group_withdraw_run(g, w);
      embps_free(w);
      continue;
    }
    embps_group_call_t *call = batch;
    batch = call->next;
    call->next = NULL;
    g->admitted++;
    admit(g, call);
  }
  if (g->notices.len && flush_notices(g) != EMBPS_OK)
    embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
}

void *embps__group_main(void *arg) {
  embps_group_t *g = arg;
  const uint32_t N = g->cfg.size;
  struct pollfd *pfds = embps_calloc(N + 2, sizeof(*pfds));
  uint32_t *pfd_peer = embps_calloc(N + 2, sizeof(*pfd_peer)); /* the peer of each pfds entry */
  embps_error_t err;
  int stopping = 0;

  embps_error_clear(&err);
  if (!pfds || !pfd_peer || embps__group_start(g, &err) != EMBPS_OK) {
    char msg[400];
    snprintf(msg, sizeof(msg), "rank %u could not join the group: %.300s", g->cfg.rank,
             pfds && pfd_peer ? err.message : "out of memory");
    g->fatal_status = pfds && pfd_peer ? err.status : EMBPS_RESOURCE_EXHAUSTED;
    set_state(g, EMBPS_GROUP_BROKEN, msg);
    atomic_store(&g->fatal_pending, 1);
    uv_async_send(&g->async);
  } else {
    set_state(g, EMBPS_GROUP_READY, NULL);
    g->next_periodic_ms = embps_now_ms() + g->cfg.checkpoint_interval_ms;
    EMBPS_INFO("rank %u of %u: the group is ready", g->cfg.rank, N);
  }

  while (!stopping) {
    nfds_t n = 0;
    int timeout = 1000;
    pfds[n++] = (struct pollfd){.fd = g->wake_fd, .events = POLLIN};
    if (g->ckpt_fd >= 0)
      pfds[n++] = (struct pollfd){.fd = g->ckpt_fd, .events = POLLIN};
    /* The connection up comes last: a relay passes its members' frames on before a round from
     * the leader holds it in collectives. */
    if (g->control_fds && atomic_load(&g->state) == EMBPS_GROUP_READY)
      for (uint32_t i = 1; i <= N; i++) {
        uint32_t r = embps__group_is_leader(g) ? i - 1 : (g->up + i) % N;
        if (g->control_fds[r] >= 0) {
          pfd_peer[n] = r;
          pfds[n++] = (struct pollfd){.fd = g->control_fds[r], .events = POLLIN};
        }
      }
    if (g->seq && embps__group_is_leader(g)) {
      uint64_t left = embps_sequencer_next_deadline(g->seq, embps_now_ms());
      if (left < (uint64_t)timeout)
        timeout = (int)left + 1;
      left = embps__group_ckpt_due_ms(g);
      if (left < (uint64_t)timeout)
        timeout = (int)left + 1;
    }
    if (poll(pfds, n, timeout) < 0 && errno != EINTR)
      break;
    drain_incoming(g, &stopping);
    if (g->ckpt)
      embps__group_ckpt_on_results(g); /* drops them when the group is not ready */
    if (atomic_load(&g->state) != EMBPS_GROUP_READY)
      continue;
    for (nfds_t i = 1; i < n; i++) {
      if (pfds[i].fd == g->ckpt_fd || !(pfds[i].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      if (!embps__group_is_leader(g) && pfd_peer[i] == g->up && g->notices.len &&
          flush_notices(g) != EMBPS_OK) {
        embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
        break;
      }
      if (read_frames(g, pfd_peer[i], on_frame, &err) != EMBPS_OK) {
        embps__group_break(g, err.message);
        break;
      }
    }
    /* A relay sends the leader what its members sent in this wake-up, in one write. */
    if (!embps__group_is_leader(g) && g->notices.len &&
        atomic_load(&g->state) == EMBPS_GROUP_READY && flush_notices(g) != EMBPS_OK)
      embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
    if (embps__group_is_leader(g)) {
      lead_rounds(g);
      embps__group_ckpt_order(g);
    }
  }
  if (stopping && atomic_load(&g->state) == EMBPS_GROUP_READY)
    announce_leave(g);
  fail_all(g, "this server is shutting down");
  embps_free(pfds);
  embps_free(pfd_peer);
  return NULL;
}
