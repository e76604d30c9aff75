/* Withdrawing a parked shard whose caller went away (group_internal.h).
 *
 * The loop thread hears from the network layer that a call's stream was reset, or its connection
 * closed, before the call was answered, and queues a withdrawal: the call's address and its
 * batch's key, never the call itself, which may be done and freed before the group's thread looks.
 * That thread takes the withdrawal after the calls submitted before it (so a call submitted and
 * abandoned before the thread woke is parked by then, and a later call that happens to reuse the
 * address is not yet), and acts only when the same call is still parked under the same key.
 *
 * The leader's sequencer decides (embps_sequencer_withdraw): a batch still pending fails with
 * CANCELLED on every rank and runs on none; one already ordered runs as ordered. Either way the
 * withdrawn call stays parked until its round entry (run or fail) reaches this rank, like any
 * other, and its answer goes to the gone caller, where the network layer drops it.
 *
 * A caller that gives up at its deadline resets its stream too (gRPC clients do), at about the
 * time its deadline passes here: that is no cancellation but the deadline, which the leader
 * enforces on its own (DEADLINE_EXCEEDED for every caller, as without the reset). So a reset that
 * comes when the call's deadline is all but up (within DEADLINE_SLACK_NS, or a quarter of the
 * call's time if that is less) withdraws nothing: the header carrying grpc-timeout reached this
 * rank a little after the client started its clock, so its deadline here is that much later than
 * the client's. */
#include "server/group/group_internal.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"

/* How far ahead of a call's deadline a reset still counts as its client giving up at it. */
#define DEADLINE_SLACK_NS (25 * UINT64_C(1000000))

/* Whether call's caller went at its deadline (loop thread: submitted_ns is the loop's). */
static int at_deadline(const embps_group_call_t *call, uint64_t now_ns) {
  uint64_t slack = DEADLINE_SLACK_NS;
  if (!call->deadline_ns)
    return 0;
  if (call->deadline_ns > call->submitted_ns &&
      (call->deadline_ns - call->submitted_ns) / 4 < slack)
    slack = (call->deadline_ns - call->submitted_ns) / 4;
  return now_ns + slack >= call->deadline_ns;
}

void embps_group_withdraw(embps_group_t *g, embps_group_call_t *call) {
  embps__withdrawal_t *w;
  uint64_t one = 1;
  if (at_deadline(call, embps_now_ns()))
    return; /* the leader expires its batch at the deadline: DEADLINE_EXCEEDED for every caller */
  if (!(w = embps_calloc(1, sizeof(*w))))
    return; /* the batch runs or expires as it would have: nothing worse than before */
  w->call = call;
  w->client_id = call->client_id;
  w->batch_id = call->batch_id;
  w->attempt = call->attempt;
  pthread_mutex_lock(&g->mu);
  w->after = g->in_count;
  if (g->wd_tail)
    g->wd_tail->next = w;
  else
    g->wd_head = w;
  g->wd_tail = w;
  pthread_mutex_unlock(&g->mu);
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
}

void embps__group_withdraw_run(embps_group_t *g, const embps__withdrawal_t *w) {
  embps_group_call_t *call;
  embps__withdraw_t frame;
  embps_status_t ret;

  if (atomic_load(&g->state) != EMBPS_GROUP_READY)
    return; /* nothing is parked in a broken group */
  call = embps__group_find_parked(g, w->client_id, w->batch_id, w->attempt, 0);
  if (!call || call != w->call)
    return; /* answered meanwhile (its round came), or never parked */
  atomic_fetch_add_explicit(&g->metrics.shards_withdrawn, 1, memory_order_relaxed);
  if (embps__group_is_leader(g)) {
    embps_sequencer_withdraw(g->seq, g->cfg.rank, w->client_id, w->batch_id, w->attempt,
                             embps_now_ms());
    embps__group_publish_seq_counts(g);
    return;
  }
  frame.client_id = w->client_id;
  frame.batch_id = w->batch_id;
  frame.attempt = w->attempt;
  g->out.len = 0;
  if ((ret = embps__frame_withdraw(&g->out, &frame, NULL)) == EMBPS_OK)
    ret = embps__group_send_out(g, 0);
  if (ret == EMBPS_UNAVAILABLE)
    embps__group_break(g, "this rank lost its connection to the leader (rank 0)");
  /* Out of memory for the frame: the batch runs or expires as it would have. */
}

embps_status_t embps__group_withdraw_on_frame(embps_group_t *g, uint32_t peer, const uint8_t *p,
                                              size_t len, embps_error_t *err) {
  embps__withdraw_t w;
  embps_status_t ret = embps__parse_withdraw(p, len, &w, err);
  if (ret != EMBPS_OK)
    return ret;
  embps_sequencer_withdraw(g->seq, peer, w.client_id, w.batch_id, w.attempt, embps_now_ms());
  embps__group_publish_seq_counts(g);
  return EMBPS_OK;
}

void embps__group_withdrawals_free(embps_group_t *g) {
  while (g->wd_head) {
    embps__withdrawal_t *w = g->wd_head;
    g->wd_head = w->next;
    embps_free(w);
  }
  g->wd_tail = NULL;
}
