/* Applying a round on one rank (group_internal.h): its entries run in order through the engine,
 * with the retry window's rulings on pushes and assigns, and runs of lookups fused (lookups.c in
 * the engine); the round's figures for the metrics. The group's thread (rounds.c) calls it, on the
 * leader as it orders a round and on the others as each ROUND frame arrives, so every rank runs
 * the same entries in the same order and makes the same collective calls. */
#include "server/group/group_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"

/* ---- rounds ---------------------------------------------------------------------------------- */

/* Publishes the communicator's totals for other threads (GetStats on the loop, /metrics on its
 * own thread). The dispatcher counts in g->comm->stats, plain fields that only this thread may
 * touch while it makes collectives; everyone else reads these atomic copies, as of the end of
 * the group's last round (or of forming the group). */
void embps__group_publish_comm_stats(embps_group_t *g) {
  embps_group_metrics_t *m = &g->metrics;
  if (!g->comm)
    return;
  atomic_store_explicit(&m->peer_bytes_sent, g->comm->stats.bytes_sent, memory_order_relaxed);
  atomic_store_explicit(&m->peer_bytes_received, g->comm->stats.bytes_received,
                        memory_order_relaxed);
  atomic_store_explicit(&m->collective_calls, g->comm->stats.calls, memory_order_relaxed);
}

/* A round's figures, once it ran: its time split into phases (see embps_round_phase_t). */
static void record_round(embps_group_t *g, uint64_t start_ns, uint64_t oldest_ns, size_t batches,
                         uint64_t comm_ns_before) {
  embps_group_metrics_t *m = &g->metrics;
  uint64_t now = embps_now_ns(), total = now - start_ns, coll = 0;
  if (g->comm)
    coll = g->comm->stats.ns - comm_ns_before;
  if (coll > total)
    coll = total;
  atomic_fetch_add_explicit(&m->rounds, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&m->batches, batches, memory_order_relaxed);
  embps_hist_observe(&m->batches_per_round, (double)batches);
  embps_hist_observe_ns(&m->round_seconds, total);
  embps_hist_observe_ns(&m->phase_seconds[EMBPS_ROUND_PHASE_QUEUE_WAIT],
                        oldest_ns && oldest_ns < start_ns ? start_ns - oldest_ns : 0);
  embps_hist_observe_ns(&m->phase_seconds[EMBPS_ROUND_PHASE_COLLECTIVES], coll);
  embps_hist_observe_ns(&m->phase_seconds[EMBPS_ROUND_PHASE_COMPUTE], total - coll);
}

/* ---- the retry window ------------------------------------------------------------------------ */

/* Whether the retry window rules on call: a push or an assign (which writes rows, and so must
 * not be applied twice either) with a client id and a digest. Every rank holds its shard of the
 * same batch, with the same client id and digest (the leader joined only equal digests), so
 * every rank answers the same. */
static int windowed(const embps_group_t *g, const embps_group_call_t *call) {
  return g->dedup && call && (call->op.kind == EMBPS_OP_PUSH || call->op.kind == EMBPS_OP_ASSIGN) &&
         call->client_id && call->digest;
}

/* Before running windowed push call: what the window says. Returns 1 when that answers it (the
 * first attempt's result, replayed; or a refusal) and it must not run, else 0. The window holds
 * the same keys on every rank at every round, so every rank decides alike and none enters a
 * collective another skips. */
static int answered_by_window(embps_group_t *g, embps_group_call_t *call) {
  embps_dedup_result_t res;
  uint64_t first = 0;
  char msg[400];
  switch (
      embps_dedup_check(g->dedup, call->client_id, call->batch_id, call->digest, &res, &first)) {
  case EMBPS_DEDUP_REPLAY:
    call->op.applied = res.applied;
    call->op.skipped = res.skipped;
    call->op.grad_norm = res.grad_norm;
    call->op.num_unique = res.num_unique;
    /* an assign's refused keys are kept where a push keeps its norm (remember_push) */
    call->op.num_refused = call->op.kind == EMBPS_OP_ASSIGN ? (uint64_t)res.grad_norm : 0;
    call->replayed = 1;
    embps_error_clear(&call->error);
    atomic_fetch_add_explicit(&g->metrics.retries_deduplicated, 1, memory_order_relaxed);
    embps__group_complete(g, call);
    return 1;
  case EMBPS_DEDUP_CONFLICT:
    snprintf(msg, sizeof(msg),
             "batch %llu of client 0x%llx was already applied with other content (digest "
             "0x%016llx then, 0x%016llx now): a retry must send the same batch",
             (unsigned long long)call->batch_id, (unsigned long long)call->client_id,
             (unsigned long long)first, (unsigned long long)call->digest);
    embps__group_fail_call(g, call, EMBPS_INVALID_ARGUMENT, msg);
    return 1;
  case EMBPS_DEDUP_FORGOTTEN:
    snprintf(msg, sizeof(msg),
             "%s batch %llu of client 0x%llx is older than the retry window remembers (the last "
             "%u pushes of each client, --retry-window): whether its first attempt was applied is "
             "unknown, and it was not applied again",
             embps_op_kind_name(call->op.kind), (unsigned long long)call->batch_id,
             (unsigned long long)call->client_id, embps_dedup_window(g->dedup));
    embps__group_fail_call(g, call, EMBPS_FAILED_PRECONDITION, msg);
    return 1;
  default:
    return 0;
  }
}

/* Whether windowed push call, entry i of round e, is sure to run: the window has not seen it and
 * no earlier entry of the round is from the same client, whose record could make the window see
 * it (an earlier attempt of the same batch) or forget it (a full window moving its floor). */
static int runs_fresh(const embps_group_t *g, const embps_group_call_t *call,
                      const embps_round_entry_t *e, size_t i) {
  for (size_t j = 0; j < i; j++)
    if (e[j].client_id == call->client_id)
      return 0;
  return embps_dedup_check(g->dedup, call->client_id, call->batch_id, call->digest, NULL, NULL) ==
         EMBPS_DEDUP_NEW;
}

/* After windowed push or assign call ran without error (applied, or skipped by the gate): the
 * window remembers its answer. An assign has no norm: its num_refused goes in grad_norm's place
 * (a count below 2^53, exact as a double), so the window's entries and their checkpoint bytes
 * stay one format. Returns EMBPS_OK, or EMBPS_RESOURCE_EXHAUSTED when it could not, which breaks
 * the group (the caller): the ranks' windows must never differ. */
static embps_status_t remember_push(embps_group_t *g, const embps_group_call_t *call) {
  const embps_op_t *op = &call->op;
  embps_dedup_result_t res = {.applied = (uint8_t)(op->applied != 0),
                              .skipped = (uint8_t)(op->skipped != 0),
                              .grad_norm = op->kind == EMBPS_OP_ASSIGN ? (double)op->num_refused
                                                                       : op->grad_norm,
                              .num_unique = op->num_unique};
  return embps_dedup_record(g->dedup, call->client_id, call->batch_id, call->digest,
                            embps_table_config(op->table)->name, g->round_no, &res);
}

/* Runs round entry i, lookup `first` (unlinked from parked), together with the lookups of the
 * entries right after it that the engine fuses with it (lookups.c): every rank holds the same
 * entries and tables, so every rank fuses the same run. Answers them all; returns how many
 * entries it ran, or 0 when the group broke. */
static size_t run_lookups(embps_group_t *g, const embps_round_entry_t *e, size_t n, size_t i,
                          embps_group_call_t *first) {
  embps_group_call_t *calls[EMBPS__ROUND_MAX];
  embps_op_t *ops[EMBPS__ROUND_MAX];
  size_t k = 0, tokens = 0;
  embps_error_t err;
  calls[k] = first;
  ops[k++] = &first->op;
  tokens = first->op.num_tokens;
  while (i + k < n && e[i + k].action == EMBPS_ROUND_RUN && e[i + k].kind == EMBPS_OP_LOOKUP) {
    const embps_round_entry_t *x = &e[i + k];
    embps_group_call_t *c = embps__group_find_parked(g, x->client_id, x->batch_id, x->attempt, 0);
    if (!c || !embps_engine_lookups_fuse(g->engine, &first->op, &c->op, tokens))
      break;
    embps__group_find_parked(g, x->client_id, x->batch_id, x->attempt, 1);
    if (c->progress) {
      c->op.publish = embps__group_publish_progress;
      c->op.publish_arg = g;
    }
    g->round_no++; /* each entry is a round of its own, fused or not */
    calls[k] = c;
    ops[k++] = &c->op;
    tokens += c->op.num_tokens;
  }
  embps_error_clear(&err);
  if (embps_engine_run_lookups(g->engine, ops, k, &err) != EMBPS_OK) {
    for (size_t j = 0; j < k; j++)
      embps__group_fail_call(g, calls[j], EMBPS_UNAVAILABLE, err.message);
    embps__group_break(g, err.message);
    return 0;
  }
  for (size_t j = 0; j < k; j++) {
    calls[j]->error = calls[j]->op.error;
    embps__group_complete(g, calls[j]);
  }
  return k;
}

void embps__group_apply_round(embps_group_t *g, const embps_round_entry_t *e, size_t n,
                              const embps_table_config_t *configs,
                              const embps__ckpt_order_t *ckpts) {
  const uint64_t start_ns = embps_now_ns(), comm_ns = g->comm ? g->comm->stats.ns : 0;
  uint64_t oldest_ns = 0;
  size_t batches = 0;
  if (g->comm && !g->comm->call_seconds)
    embps_comm_set_call_histogram(g->comm, &g->metrics.collective_seconds);
  uint8_t told[EMBPS__ROUND_MAX] = {0}; /* entry i's async push already said "ordered" */
  /* The round is ordered: every async push in it may say so before any of it runs. One the retry
   * window rules on says so now only when the window would run it (a replay or a refusal is no
   * order), which is known now unless an earlier entry of this round is the same batch; the
   * others say so once the window has ruled, just before they run. */
  for (size_t i = 0; i < n; i++) {
    embps_group_call_t *call =
        e[i].action == EMBPS_ROUND_RUN
            ? embps__group_find_parked(g, e[i].client_id, e[i].batch_id, e[i].attempt, 0)
            : NULL;
    if (call && (!windowed(g, call) || runs_fresh(g, call, e, i))) {
      embps__group_announce_ordered(g, call);
      told[i] = 1;
    }
    if (call && (call->op.kind == EMBPS_OP_LOOKUP || call->op.kind == EMBPS_OP_PUSH ||
                 call->op.kind == EMBPS_OP_ASSIGN)) {
      batches++;
      if (!oldest_ns || call->submitted_ns < oldest_ns)
        oldest_ns = call->submitted_ns;
    }
  }
  for (size_t i = 0; i < n && atomic_load(&g->state) != EMBPS_GROUP_BROKEN; i++) {
    embps_group_call_t *call =
        embps__group_find_parked(g, e[i].client_id, e[i].batch_id, e[i].attempt, 1);
    embps_op_t *op = call ? &call->op : NULL, tmp;
    embps_error_t err;

    if (e[i].action == EMBPS_ROUND_FAIL) {
      if (call)
        embps__group_fail_call(g, call, e[i].status, e[i].message);
      continue;
    }
    if (e[i].kind == EMBPS_OP_CHECKPOINT) {
      if (!embps__group_is_leader(g)) /* the leader numbered it when it ordered it */
        g->round_no = ckpts[i].round;
      embps__group_ckpt_run_entry(g, &ckpts[i]);
      continue;
    }
    g->round_no++;
    if (!op && (e[i].kind == EMBPS_OP_CREATE_TABLE || e[i].kind == EMBPS_OP_DROP_TABLE) &&
        !embps__group_is_leader(g)) {
      memset(&tmp, 0,
             sizeof(tmp)); /* creates and drops run on every rank, answered by the leader */
      tmp.kind = e[i].kind;
      tmp.create = configs[i];
      op = &tmp;
    }
    if (!op) {
      char msg[200];
      snprintf(msg, sizeof(msg), "rank %u was told to run batch %llu, which it does not hold",
               g->cfg.rank, (unsigned long long)e[i].batch_id);
      embps__group_break(g, msg);
      return;
    }
    if (windowed(g, call)) {
      if (answered_by_window(g, call))
        continue;
      if (!told[i])
        embps__group_announce_ordered(g, call);
    }
    embps_error_clear(&err);
    if (call && call->progress) {
      op->publish = embps__group_publish_progress;
      op->publish_arg = g;
    }
    if (call && embps_engine_lookups_fuse(g->engine, op, NULL, 0)) {
      size_t k = run_lookups(g, e, n, i, call);
      if (k == 0)
        return; /* the group broke */
      i += k - 1;
      continue;
    }
    if (embps_engine_run(g->engine, op, &err) != EMBPS_OK) {
      if (call)
        embps__group_fail_call(g, call, EMBPS_UNAVAILABLE, err.message);
      embps__group_break(g, err.message);
      return;
    }
    if (op->kind == EMBPS_OP_CREATE_TABLE || op->kind == EMBPS_OP_DROP_TABLE)
      embps__group_ckpt_tables_changed(g, op);
    if (windowed(g, call) && op->error.status == EMBPS_OK && remember_push(g, call) != EMBPS_OK) {
      char msg[300];
      snprintf(msg, sizeof(msg),
               "rank %u could not remember push batch %llu of client 0x%llx in its retry window "
               "(out of memory), so the ranks' windows would differ",
               g->cfg.rank, (unsigned long long)call->batch_id,
               (unsigned long long)call->client_id);
      call->error = op->error; /* it was applied: its caller hears so before the group breaks */
      embps__group_complete(g, call);
      embps__group_break(g, msg);
      return;
    }
    if (call) {
      call->error = op->error; /* the engine's answer is the call's */
      embps__group_complete(g, call);
    }
  }
  if (batches && atomic_load(&g->state) != EMBPS_GROUP_BROKEN)
    record_round(g, start_ns, oldest_ns, batches, comm_ns);
  embps__group_publish_comm_stats(g);
}
