/* The group object (group.h's embps_group_t) as its three modules see it, internal to the group
 * layer:
 * - rounds.c: the group's thread and its queues: calls in from the loop thread, parked until the
 *   leader's sequencer orders them, run through the engine in rounds, answered on the loop;
 *   the control connections' frames; breaking the group.
 * - ckpt_leader.c: the checkpoint protocol between the ranks: a rank asks the leader, the
 *   leader orders a checkpoint as a round, every rank reports its files, the leader has the
 *   manifest written and answers. What a rank writes, and how, is checkpointer.h's.
 * - withdraw.c: withdrawing a parked shard whose caller went away (embps_group_withdraw): the
 *   loop thread queues it, this thread tells the leader's sequencer.
 * - start.c: making the group (config copied, thread started), forming it on the thread
 *   (formation.h, the engine, the sequencer, the checkpointer, a restore), the accessors, and
 *   closing and freeing it.
 * Everything below is the group thread's unless a comment says otherwise. */
#ifndef EMBPS_GROUP_INTERNAL_H
#define EMBPS_GROUP_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/status.h"
#include "server/group/checkpointer.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/dedup.h"
#include "server/group/group.h"
#include "server/group/sequencer.h"

/* A queue of calls for the loop thread, linked through one of the call's link fields (`link`,
 * its offset): a call can sit in the done, ordered and progress queues at once. */
typedef struct embps__call_queue {
  embps_group_call_t *head, *tail;
  size_t link;
} embps__call_queue_t;

/* A withdrawal the loop thread queued (embps_group_withdraw), for the group's thread. call is
 * only compared with the calls still parked, never dereferenced before it is found there: it may
 * be done and freed by the time the group's thread looks. */
typedef struct embps__withdrawal {
  struct embps__withdrawal *next;
  embps_group_call_t *call;
  uint64_t client_id, batch_id;
  uint32_t attempt;
  uint64_t after; /* the calls submitted before it (in_count then): it is acted on after them */
} embps__withdrawal_t;

/* Leader: a checkpoint asked for and not yet ordered (ckpt_leader.c). */
typedef struct embps__ckpt_request embps__ckpt_request_t;

struct embps_group {
  embps_group_config_t cfg;
  char **peer_addrs;
  char *identity;
  uint8_t *secret; /* owned copy of cfg.secret (cfg.secret_len bytes), wiped when freed */
  uv_loop_t *loop;
  uv_async_t async;
  embps_store_t *store;
  pthread_t thread;
  int thread_started;
  int wake_fd;
  int cancel_fd; /* eventfd made readable by embps_group_close: stops a bootstrap in progress */

  pthread_mutex_t mu;
  embps_group_call_t *in_head, *in_tail;  /* guarded by mu */
  uint64_t in_count;                      /* calls ever submitted; guarded by mu */
  embps__withdrawal_t *wd_head, *wd_tail; /* withdrawals not yet taken; guarded by mu */
  embps__call_queue_t done;               /* calls whose `done` is due; guarded by mu */
  embps__call_queue_t ordered;            /* calls whose `ordered` is due; guarded by mu */
  embps__call_queue_t progress;           /* calls whose `progress` is due; guarded by mu */
  int stopping;                           /* guarded by mu */
  char state_msg[400];                    /* guarded by mu */
  atomic_int state;
  atomic_int fatal_pending;
  embps_status_t fatal_status;
  embps_group_metrics_t metrics;
  uint64_t ckpt_started_ns; /* leader: when the checkpoint in flight was ordered */
  atomic_int host_device;   /* the device whose pinned memory requests use, -1 for plain */

  /* Group thread only. */
  void *stream; /* cuda: the engine's stream */
  embps_comm_t *comm;
  embps_engine_t *engine;
  embps_sequencer_t *seq;
  int *control_fds; /* size entries, -1 for self (and for everyone on non-leaders but 0) */
  embps__frame_reader_t *readers; /* size entries: frames arriving on control_fds */
  embps__buf_t out;               /* the frame being sent */
  /* A follower's notices admitted in this wake-up, sent to the leader in one write once the
   * wake-up's calls are admitted, or before any other frame to it (issue 34: one send per
   * notice cost a syscall per batch on every follower and a receive per batch per peer on the
   * leader). */
  embps__buf_t notices;
  /* Upward, notices holds every frame for the rank this one sends to (up): a relay's members'
   * frames too, wrapped (relay.h), in the order they came. */
  uint32_t up;       /* non-leader: the rank its control frames go to: 0, or its relay */
  embps__buf_t down; /* relay: the leader's frames for every member, gathered per wake-up */
  embps__buf_t wrap; /* leader: a frame wrapped for one rank behind (or at) a relay */
  /* The round being sent or applied, and the configs of the creates it runs. */
  embps_round_entry_t round[EMBPS__ROUND_MAX];
  embps_table_config_t round_configs[EMBPS__ROUND_MAX];
  embps_group_call_t *parked; /* calls waiting for their round, most recent first */
  uint64_t admitted;          /* calls taken from the incoming queue so far */
  embps_dedup_t *dedup;       /* the retry window: pushes applied, changed only in rounds */
  uint64_t next_create_id;

  /* Checkpoints (group thread only). */
  char *ckpt_dir;                                    /* NULL: off */
  embps__ckpt_t *ckpt;                               /* capture, writer, restore */
  int ckpt_fd;                                       /* the writer's eventfd */
  embps__ckpt_order_t round_ckpts[EMBPS__ROUND_MAX]; /* the orders of the round being applied */
  embps_group_call_t *ckpt_calls, *ckpt_calls_tail;  /* this rank's, waiting, by seq */
  uint64_t ckpt_seq;                                 /* the last this rank asked for */
  /* Leader only, but for round_no, final_done and final_msg, which every rank keeps. */
  uint64_t round_no; /* entries run so far, checkpoints included (with the restored
                        checkpoint's): the same on every rank once a round is applied */
  embps__ckpt_request_t *req_head, *req_tail; /* asked for, not yet ordered */
  int ckpt_inflight;                          /* cur is ordered and not yet complete */
  embps__ckpt_order_t cur;
  uint32_t cur_reported;  /* ranks that reported on cur */
  embps_error_t cur_err;  /* the first failure reported */
  uint64_t *cur_attached; /* size entries: the highest request seq of each rank cur answers */
  uint64_t chain_base;    /* the last complete checkpoint of every table an incremental one may
                             apply on; 0: the next is full */
  uint32_t since_full;    /* incremental checkpoints since the chain's full one */
  uint64_t next_periodic_ms;
  int cur_final;  /* cur answers a rank that is shutting down */
  int closing;    /* a final checkpoint was ordered: every later batch fails */
  int final_done; /* ... and is complete (every rank hears of it): final_msg
                     answers the requests of ranks shutting down */
  embps__ckpt_msg_t final_msg;
  char *restore_dir;
};

static inline int embps__group_is_leader(const embps_group_t *g) { return g->cfg.rank == 0; }

/* ---- rounds.c -------------------------------------------------------------------------------- */

/** The group's thread: forms the group (embps__group_start), then serves until
 * embps_group_close. arg is the group. */
void *embps__group_main(void *arg);

/** The loop thread's side of the queues (the group's uv_async_t callback): runs the ordered,
 * progress and done callbacks of what the group's thread posted, in that order. */
void embps__group_on_async(uv_async_t *handle);

/** Answers call on the loop thread (call->done), as it is (any thread). */
void embps__group_complete(embps_group_t *g, embps_group_call_t *call);

/** Tells the loop that call's batch is ordered (call->ordered runs there, before call->done);
 * nothing when the call has no ordered callback. */
void embps__group_announce_ordered(embps_group_t *g, embps_group_call_t *call);

/** An engine op's publish callback (embps_op_t.publish, arg: the group): the engine made more of
 * a lookup's rows final, and the loop runs the call's progress (engine thread). */
void embps__group_publish_progress(embps_op_t *op, void *arg);

/** Answers call with status and msg (any thread). */
void embps__group_fail_call(embps_group_t *g, embps_group_call_t *call, embps_status_t status,
                            const char *msg);

/** Breaks the group on this rank, with why, and tells the other ranks. */
void embps__group_break(embps_group_t *g, const char *why);

/** Sends the frame in g->out to peer; EMBPS_OK or EMBPS_UNAVAILABLE (a dead peer). */
embps_status_t embps__group_send_out(embps_group_t *g, uint32_t peer);

/** Leader: sends round entries e[0..n) to every rank (ckpts: each entry's checkpoint order, or
 * NULL when the round has none). */
embps_status_t embps__group_send_round(embps_group_t *g, const embps_round_entry_t *e,
                                       const embps__ckpt_order_t *ckpts, size_t n);

/** Runs round entries e[0..n) on this rank, in order (configs: the creates' configs on a
 * non-leader, else NULL; ckpts as for embps__group_send_round). */
void embps__group_apply_round(embps_group_t *g, const embps_round_entry_t *e, size_t n,
                              const embps_table_config_t *configs,
                              const embps__ckpt_order_t *ckpts);

/** Publishes the communicator's totals for other threads (embps_group_comm_stats). */
void embps__group_publish_comm_stats(embps_group_t *g);

/** The parked call of batch (client_id, batch_id, attempt), or NULL; unlinked from the list when
 * unlink is set. */
embps_group_call_t *embps__group_find_parked(embps_group_t *g, uint64_t client_id,
                                             uint64_t batch_id, uint32_t attempt, int unlink);

/** Leader: copies its sequencer's counts into the metrics. */
void embps__group_publish_seq_counts(embps_group_t *g);

/* ---- withdraw.c ------------------------------------------------------------------------------ */

/** Acts on a withdrawal taken from the queue: when w->call is still parked under its key, counts
 * it and withdraws its shard (the leader from its sequencer, another rank by a WITHDRAW frame to
 * the leader; a lost connection breaks the group). */
void embps__group_withdraw_run(embps_group_t *g, const embps__withdrawal_t *w);

/** Leader: handles a WITHDRAW frame from peer. Returns EMBPS_OK, or the failure of a frame it
 * cannot read (err says why; the caller breaks the group). */
embps_status_t embps__group_withdraw_on_frame(embps_group_t *g, uint32_t peer, const uint8_t *p,
                                              size_t len, embps_error_t *err);

/** Frees the withdrawals still queued (embps_group_free: the loop may queue some after the
 * group's thread stopped). */
void embps__group_withdrawals_free(embps_group_t *g);

/* ---- ckpt_leader.c --------------------------------------------------------------------------- */

/** A checkpoint call from the loop thread (the group is ready): asks the leader, or fails it at
 * once when checkpoints are off. */
void embps__group_ckpt_admit(embps_group_t *g, embps_group_call_t *call);

/** Every rank, applying a checkpoint's round entry: captures this rank's tables (the writer
 * does the rest), or reports why it cannot. */
void embps__group_ckpt_run_entry(embps_group_t *g, const embps__ckpt_order_t *o);

/** Handles a CHECKPOINT frame from peer. Returns EMBPS_OK, or the failure of a frame this rank
 * cannot read (err says why; the caller breaks the group). */
embps_status_t embps__group_ckpt_on_frame(embps_group_t *g, uint32_t peer, const uint8_t *p,
                                          size_t len, embps_error_t *err);

/** Takes what the checkpoint writer finished (its eventfd is readable) and reports it. */
void embps__group_ckpt_on_results(embps_group_t *g);

/** Leader: orders the next checkpoint asked for (or due), once none is in flight. */
void embps__group_ckpt_order(embps_group_t *g);

/** Leader: milliseconds from now until the next periodic checkpoint is due; UINT64_MAX when
 * none is (off, one in flight, or the group closing). */
uint64_t embps__group_ckpt_due_ms(const embps_group_t *g);

/** An op that ran created or dropped a table: the checkpointer readies or forgets it, and the
 * incremental chain starts over. */
void embps__group_ckpt_tables_changed(embps_group_t *g, const embps_op_t *op);

/** Answers a shutting-down rank's checkpoint call with the group's final checkpoint (final_done
 * is set). */
void embps__group_ckpt_complete_final(embps_group_t *g, embps_group_call_t *call);

/** Frees the leader's requests not yet ordered and its per-rank bookkeeping. */
void embps__group_ckpt_free(embps_group_t *g);

/* ---- relay.c (relay.h) ---------------------------------------------------------------------- */

/** 1 when this rank is a relay: a follower with members. */
int embps__group_relays(const embps_group_t *g);

/** 1 when rank is one of this rank's members (it sends its control frames through this rank). */
int embps__group_is_member(const embps_group_t *g, uint32_t rank);

/** Relay: passes on the whole frames reader r (the leader's connection) holds and has not yet
 * handed out: every unwrapped frame to every member, in one write each, a RELAY frame's load to
 * the member it names; the caller then handles the same frames itself (a RELAY frame for a member
 * it skips). Returns EMBPS_OK, EMBPS_UNAVAILABLE (a member's connection failed: err names it) or
 * EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps__group_relay_down(embps_group_t *g, const embps__frame_reader_t *r,
                                       embps_error_t *err);

/** Relay: queues member's frame (frame_len bytes at frame, header included) for the leader,
 * wrapped in RELAY, after everything queued before it (g->notices). Returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT (not one whole frame) or EMBPS_RESOURCE_EXHAUSTED; err says why. */
embps_status_t embps__group_relay_up(embps_group_t *g, uint32_t member, const uint8_t *frame,
                                     size_t frame_len, embps_error_t *err);

/* ---- start.c --------------------------------------------------------------------------------- */

/** Group thread, first: forms the group (formation.h), then starts the engine, the sequencer
 * and the checkpointer over its communicator and restores the agreed checkpoint. Returns
 * EMBPS_OK or the failure (err says why); the group is then broken. */
embps_status_t embps__group_start(embps_group_t *g, embps_error_t *err);

#endif
