/* The checkpoint protocol between the ranks (DESIGN.md, Durability), in the group's thread: when
 * a checkpoint is taken and who hears of it. What a rank writes, and how, is checkpointer.h's.
 *
 * A checkpoint call on any rank asks the leader (a CHECKPOINT request frame; the leader asks
 * itself directly), and the leader also asks itself every --checkpoint-interval-s. Requests
 * wait in the leader's queue; once no checkpoint is in flight, the leader orders the next as a
 * round of one entry, numbered like the batches' rounds, answering every waiting request of the
 * same scope at once. Every rank captures its tables when it applies that entry, so the
 * checkpoint holds exactly the batches ordered before it, and reports (a DONE frame) once its
 * writer has made its files durable. When every rank has reported, the leader has the manifest
 * written (or what was written removed, if a rank failed) and answers each rank whose requests
 * it covered (a COMPLETE frame); only then may the next checkpoint be ordered, so one is in
 * flight at a time. The leader keeps the incremental chain: which complete checkpoint of every
 * table the next one may apply on, and when a full one is due.
 *
 * A rank shutting down asks for a final checkpoint: once it is ordered the leader fails every
 * later batch, and every rank hears when it is complete, so that the requests of the ranks
 * shutting down after it are answered with it. */
#include "server/group/group_internal.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"

/* The leader's own batch ids for checkpoints (with the round); creates and drops have theirs
 * (rounds.c). */
#define CKPT_ID_BIT (UINT64_C(3) << 62)

struct embps__ckpt_request {
  uint32_t rank;
  int final;
  uint64_t seq; /* the rank's request number; 0 for the leader's periodic ones */
  char scope[EMBPS_TABLE_NAME_MAX];
  struct embps__ckpt_request *next;
};

/* Sets req's results to checkpoint m's. */
static void set_result(embps_group_ckpt_t *req, const embps__ckpt_msg_t *m) {
  req->round = m->round;
  req->bytes = m->bytes;
  snprintf(req->path, sizeof(req->path), "%s", m->path);
}

/* Answers a shutting-down rank's checkpoint call with the group's final checkpoint, which is
 * complete: every rank heard of it when it was. */
void embps__group_ckpt_complete_final(embps_group_t *g, embps_group_call_t *call) {
  call->next = NULL;
  set_result(call->ckpt, &g->final_msg);
  embps__group_complete(g, call);
}

static embps_status_t send_ckpt(embps_group_t *g, uint32_t peer, const embps__ckpt_msg_t *m) {
  embps_status_t ret;
  g->out.len = 0;
  if ((ret = embps__frame_checkpoint(&g->out, m, NULL)) != EMBPS_OK)
    return ret;
  return embps__group_send_out(g, peer);
}

/* Answers this rank's checkpoint calls up to m->seq with checkpoint m's outcome. */
static void complete_ckpt_calls(embps_group_t *g, const embps__ckpt_msg_t *m) {
  while (g->ckpt_calls && m->seq && g->ckpt_calls->ckpt->seq <= m->seq) {
    embps_group_call_t *call = g->ckpt_calls;
    g->ckpt_calls = call->next;
    if (!g->ckpt_calls)
      g->ckpt_calls_tail = NULL;
    call->next = NULL;
    if (m->status != EMBPS_OK) {
      embps__group_fail_call(g, call, (embps_status_t)m->status, m->message);
      continue;
    }
    set_result(call->ckpt, m);
    embps__group_complete(g, call);
  }
}

/* Leader: rank `rank` asks for a checkpoint of scope (its request seq; 0: the leader's own
 * periodic one, which answers nobody). */
static void leader_request(embps_group_t *g, uint32_t rank, uint64_t seq, const char *scope,
                           int final) {
  embps__ckpt_request_t *q = embps_calloc(1, sizeof(*q));
  if (!q) {
    embps__ckpt_msg_t m = {
        .what = EMBPS__CKPT_COMPLETE, .seq = seq, .status = EMBPS_RESOURCE_EXHAUSTED};
    snprintf(m.message, sizeof(m.message), "the leader is out of memory for a checkpoint request");
    if (rank == 0)
      complete_ckpt_calls(g, &m);
    else if (send_ckpt(g, rank, &m) != EMBPS_OK)
      embps__group_break(g, "the leader could not answer a checkpoint request");
    return;
  }
  q->rank = rank;
  q->final = final;
  q->seq = seq;
  snprintf(q->scope, sizeof(q->scope), "%s", scope);
  if (g->req_tail)
    g->req_tail->next = q;
  else
    g->req_head = q;
  g->req_tail = q;
}

/* Leader: rank `rank` has written its files of checkpoint `round` (or failed to); once every
 * rank has, the manifest is written or what was written removed. */
static void leader_report(embps_group_t *g, uint32_t rank, uint64_t round,
                          const embps_error_t *err) {
  if (!g->ckpt_inflight || round != g->cur.round)
    return;
  g->cur_reported++;
  if (err->status != EMBPS_OK && g->cur_err.status == EMBPS_OK)
    embps_error_set(&g->cur_err, err->status, "rank %u: %.400s", rank, err->message);
  if (g->cur_reported == g->cfg.size)
    embps__ckpt_finish(g->ckpt, &g->cur, g->cur_err.status == EMBPS_OK, &g->cur_err);
}

/* This rank's files of checkpoint `round` are durable, or not: the leader hears of it. */
static void report_ckpt_done(embps_group_t *g, uint64_t round, const embps_error_t *err,
                             uint64_t bytes) {
  embps__ckpt_msg_t m = {.what = EMBPS__CKPT_DONE, .round = round, .bytes = bytes};
  if (embps__group_is_leader(g)) {
    leader_report(g, 0, round, err);
    return;
  }
  m.status = (uint32_t)err->status;
  snprintf(m.message, sizeof(m.message), "%s", err->message);
  if (send_ckpt(g, 0, &m) != EMBPS_OK)
    embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
}

/* Every rank, applying a checkpoint's round entry: the capture; the writer does the rest. */
void embps__group_ckpt_run_entry(embps_group_t *g, const embps__ckpt_order_t *o) {
  embps_error_t err;
  embps_error_clear(&err);
  if (!g->ckpt)
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "rank %u has no --checkpoint-dir, and every rank of a group needs the same one",
                    g->cfg.rank);
  else if (embps__ckpt_capture(g->ckpt, g->engine, g->store, g->dedup, o, &err) == EMBPS_OK)
    return;
  report_ckpt_done(g, o->round, &err, 0);
}

static uint64_t unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A checkpoint's outcome, for the metrics. */
static void record_ckpt(embps_group_t *g, const embps__ckpt_msg_t *m) {
  embps_group_metrics_t *mt = &g->metrics;
  if (m->status != EMBPS_OK) {
    atomic_fetch_add_explicit(&mt->ckpt_failed, 1, memory_order_relaxed);
    return;
  }
  atomic_fetch_add_explicit(&mt->ckpt_completed, 1, memory_order_relaxed);
  if (m->round >= atomic_load_explicit(&mt->ckpt_last_round, memory_order_relaxed)) {
    atomic_store_explicit(&mt->ckpt_last_round, m->round, memory_order_relaxed);
    atomic_store_explicit(&mt->ckpt_last_bytes, m->bytes, memory_order_relaxed);
    atomic_store_explicit(&mt->ckpt_last_unix_ms, unix_ms(), memory_order_relaxed);
  }
}

/* Leader: the checkpoint in flight is complete (or failed). Every rank whose requests it
 * answers hears of it, and the next checkpoint may be ordered. */
static void leader_complete(embps_group_t *g, const embps__ckpt_result_t *r) {
  embps__ckpt_msg_t m = {.what = EMBPS__CKPT_COMPLETE, .round = r->round, .bytes = r->bytes};
  const int whole = g->cur.scope[0] == '\0';
  m.status = (uint32_t)r->error.status;
  snprintf(m.path, sizeof(m.path), "%s", r->path);
  snprintf(m.message, sizeof(m.message), "%s", r->error.message);
  record_ckpt(g, &m);
  if (r->error.status == EMBPS_OK)
    embps_hist_observe_ns(&g->metrics.ckpt_seconds, embps_now_ns() - g->ckpt_started_ns);
  if (r->error.status == EMBPS_OK)
    EMBPS_INFO("checkpoint of round %llu complete: %s (%s, %llu bytes)",
               (unsigned long long)r->round, r->path, g->cur.base_round ? "incremental" : "full",
               (unsigned long long)r->bytes);
  /* Every rank hears of a final checkpoint (those that did not ask for it will, as they shut
   * down too, and may find the leader gone by then). */
  m.final = (uint8_t)(g->cur_final && r->error.status == EMBPS_OK);
  for (uint32_t rank = 1; rank < g->cfg.size; rank++) {
    if (!(m.seq = g->cur_attached[rank]) && !m.final)
      continue;
    if (send_ckpt(g, rank, &m) != EMBPS_OK) {
      embps__group_break(g, "the leader could not tell a rank that its checkpoint is complete");
      return;
    }
  }
  m.seq = g->cur_attached[0];
  complete_ckpt_calls(g, &m);
  if (whole) { /* a checkpoint of every table moves the incremental chain on, or breaks it */
    g->since_full = r->error.status == EMBPS_OK && g->cur.base_round ? g->since_full + 1 : 0;
    g->chain_base = r->error.status == EMBPS_OK ? r->round : 0;
  }
  g->ckpt_inflight = 0;
  g->next_periodic_ms = embps_now_ms() + g->cfg.checkpoint_interval_ms;
  if (g->cur_final && r->error.status == EMBPS_OK) {
    g->final_done = 1;
    g->final_msg = m;
  }
}

/* Whatever the writer finished. */
void embps__group_ckpt_on_results(embps_group_t *g) {
  embps__ckpt_result_t r;
  uint64_t v;
  while (read(g->ckpt_fd, &v, sizeof(v)) > 0) {
  }
  while (embps__ckpt_take(g->ckpt, &r)) {
    if (atomic_load(&g->state) != EMBPS_GROUP_READY)
      continue;
    if (r.manifest)
      leader_complete(g, &r);
    else {
      if (r.error.status == EMBPS_OK)
        atomic_fetch_add_explicit(&g->metrics.ckpt_bytes_written, r.bytes, memory_order_relaxed);
      report_ckpt_done(g, r.round, &r.error, r.bytes);
    }
  }
}

/* Leader: orders the next checkpoint asked for (or due), once none is in flight. Requests of
 * the same scope waiting in a row are answered by one checkpoint. */
void embps__group_ckpt_order(embps_group_t *g) {
  const char *scope;
  if (!g->ckpt || g->ckpt_inflight || atomic_load(&g->state) != EMBPS_GROUP_READY)
    return;
  if (!g->req_head && !g->closing && g->cfg.checkpoint_interval_ms &&
      embps_now_ms() >= g->next_periodic_ms) {
    if (embps_store_count(g->store) > 0)
      leader_request(g, 0, 0, "", 0);
    else
      g->next_periodic_ms = embps_now_ms() + g->cfg.checkpoint_interval_ms;
  }
  if (!g->req_head)
    return;
  if (g->final_done) { /* the group is going down and its final checkpoint is on disk */
    while (g->req_head) {
      embps__ckpt_request_t *q = g->req_head;
      g->req_head = q->next;
      g->final_msg.seq = q->seq;
      if (q->rank == 0)
        complete_ckpt_calls(g, &g->final_msg);
      else if (q->seq && send_ckpt(g, q->rank, &g->final_msg) != EMBPS_OK)
        embps__group_break(g, "the leader could not tell a rank that its checkpoint is complete");
      embps_free(q);
    }
    g->req_tail = NULL;
    return;
  }
  memset(&g->cur, 0, sizeof(g->cur));
  g->cur_final = 0;
  memset(g->cur_attached, 0, g->cfg.size * sizeof(*g->cur_attached));
  scope = g->req_head->scope;
  snprintf(g->cur.scope, sizeof(g->cur.scope), "%s", scope);
  while (g->req_head && strcmp(g->req_head->scope, g->cur.scope) == 0) {
    embps__ckpt_request_t *q = g->req_head;
    g->req_head = q->next;
    if (q->seq > g->cur_attached[q->rank])
      g->cur_attached[q->rank] = q->seq;
    g->cur_final |= q->final;
    embps_free(q);
  }
  if (!g->req_head)
    g->req_tail = NULL;
  g->cur.round = ++g->round_no;
  g->ckpt_started_ns = embps_now_ns();
  /* Incremental (checkpoint_full_every > 1) between full ones: never when every one is full. */
  if (!g->cur.scope[0] && g->chain_base && g->since_full + 1 < g->cfg.checkpoint_full_every)
    g->cur.base_round = g->chain_base;
  g->ckpt_inflight = 1;
  g->cur_reported = 0;
  embps_error_clear(&g->cur_err);
  memset(&g->round[0], 0, sizeof(g->round[0]));
  g->round[0].batch_id = CKPT_ID_BIT | g->cur.round;
  g->round[0].action = EMBPS_ROUND_RUN;
  g->round[0].kind = EMBPS_OP_CHECKPOINT;
  g->round_ckpts[0] = g->cur;
  if (g->cur_final) {
    g->closing = 1;
    EMBPS_INFO("a rank is shutting down: the final checkpoint is round %llu, and the group "
               "serves no batch after it",
               (unsigned long long)g->cur.round);
  }
  if (g->cfg.size > 1 && embps__group_send_round(g, g->round, g->round_ckpts, 1) != EMBPS_OK) {
    embps__group_break(g, "the leader could not send a round to every rank");
    return;
  }
  embps__group_apply_round(g, g->round, 1, NULL, g->round_ckpts);
}

/* A checkpoint call from the loop thread: asks the leader, waits for its answer. */
void embps__group_ckpt_admit(embps_group_t *g, embps_group_call_t *call) {
  embps_group_ckpt_t *req = call->ckpt;
  embps__ckpt_msg_t m = {.what = EMBPS__CKPT_REQUEST};
  if (!g->ckpt) {
    embps__group_fail_call(
        g, call, EMBPS_FAILED_PRECONDITION,
        "checkpoints are off: start every rank with --checkpoint-dir (EMBPS_CHECKPOINT_DIR)");
    return;
  }
  if (req->final && g->final_done) {
    embps__group_ckpt_complete_final(g, call);
    return;
  }
  req->seq = ++g->ckpt_seq;
  call->next = NULL;
  if (g->ckpt_calls_tail)
    g->ckpt_calls_tail->next = call;
  else
    g->ckpt_calls = call;
  g->ckpt_calls_tail = call;
  if (embps__group_is_leader(g)) {
    leader_request(g, 0, req->seq, req->table, req->final);
    return;
  }
  m.seq = req->seq;
  m.final = (uint8_t)req->final;
  snprintf(m.scope, sizeof(m.scope), "%s", req->table);
  if (send_ckpt(g, 0, &m) != EMBPS_OK)
    embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
}

embps_status_t embps__group_ckpt_on_frame(embps_group_t *g, uint32_t peer, const uint8_t *p,
                                          size_t len, embps_error_t *err) {
  embps__ckpt_msg_t m;
  embps_status_t ret;
  if ((ret = embps__parse_checkpoint(p, len, &m, err)) != EMBPS_OK)
    return ret;
  if (embps__group_is_leader(g) && m.what == EMBPS__CKPT_REQUEST) {
    leader_request(g, peer, m.seq, m.scope, m.final);
  } else if (embps__group_is_leader(g) && m.what == EMBPS__CKPT_DONE) {
    embps_error_t done;
    done.status = (embps_status_t)m.status;
    snprintf(done.message, sizeof(done.message), "%s", m.message);
    leader_report(g, peer, m.round, &done);
  } else if (!embps__group_is_leader(g) && m.what == EMBPS__CKPT_COMPLETE) {
    record_ckpt(g, &m);
    if (m.final) {
      g->final_done = 1;
      g->final_msg = m;
    }
    complete_ckpt_calls(g, &m);
  } else {
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a checkpoint message of kind %u", m.what);
  }
  return EMBPS_OK;
}

uint64_t embps__group_ckpt_due_ms(const embps_group_t *g) {
  uint64_t now;
  if (!g->ckpt || !g->cfg.checkpoint_interval_ms || g->ckpt_inflight || g->closing)
    return UINT64_MAX;
  now = embps_now_ms();
  return g->next_periodic_ms > now ? g->next_periodic_ms - now : 0;
}

void embps__group_ckpt_tables_changed(embps_group_t *g, const embps_op_t *op) {
  if (!g->ckpt)
    return;
  if (op->kind == EMBPS_OP_CREATE_TABLE && op->created) {
    embps__ckpt_prepare(g->ckpt, op->created);
    g->chain_base = 0; /* the chain's full checkpoint lacks the new table */
  }
  if (op->kind == EMBPS_OP_DROP_TABLE && op->error.status == EMBPS_OK) {
    embps__ckpt_forget(g->ckpt, op->table);
    g->chain_base = 0; /* the chain's full checkpoint holds a table that is gone */
  }
}

void embps__group_ckpt_free(embps_group_t *g) {
  while (g->req_head) {
    embps__ckpt_request_t *q = g->req_head;
    g->req_head = q->next;
    embps_free(q);
  }
  g->req_tail = NULL;
  embps_free(g->cur_attached);
  g->cur_attached = NULL;
}
