/* The group's thread (see group.h): its queues, and the rounds it runs.
 *
 * Control plane. Besides the communicator's data connections, every non-leader rank keeps one
 * control connection to the leader (rank 0), which formation (formation.h) hands over. Frames
 * on it (control.h) are NOTICE (rank -> leader: "I hold my shard of batch B: kind,
 * tokens_per_batch, table"), ROUND (leader -> every rank: an ordered list of "run B" / "fail B
 * with status S"; a run of a CreateTable carries the table's config) and BROKEN. A rank sends
 * its notices in the order its shards arrived, and the leader's sequencer orders a batch once
 * every rank holds its shard, so every rank runs the same batches in the same order and their
 * collectives always match: no deadlock, whatever order concurrent clients' shards reach the
 * ranks in.
 *
 * Threads. The loop thread submits ops into `incoming` (mutex + eventfd); this thread polls the
 * eventfd and the control connections, and posts finished ops to `completed` (mutex +
 * uv_async_t). Collectives block this thread only.
 *
 * Failure. If a peer's connection breaks or a collective fails, the group is broken: every
 * parked op and every later one fails with UNAVAILABLE and the message says which rank and
 * what happened, so clients see an error within the peer timeout instead of hanging. A broken
 * group does not heal; the ranks must be restarted (the health check reports NOT_SERVING). */
#include "group.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/group/checkpointer.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/formation.h"
#include "server/group/sequencer.h"

_Static_assert((int)EMBPS_OP_LOOKUP == (int)EMBPS_BATCH_LOOKUP &&
                   (int)EMBPS_OP_PUSH == (int)EMBPS_BATCH_PUSH &&
                   (int)EMBPS_OP_CREATE_TABLE == (int)EMBPS_BATCH_CREATE_TABLE &&
                   (int)EMBPS_OP_DROP_TABLE == (int)EMBPS_BATCH_DROP_TABLE,
               "op kinds travel as batch kinds");

#define CREATE_ID_BIT (UINT64_C(1) << 63) /* the leader's own ids for creates and drops */
#define CKPT_ID_BIT (UINT64_C(3) << 62)   /* and for checkpoints (with the round) */

/* Leader: a checkpoint asked for and not yet ordered. */
typedef struct ckpt_request {
  uint32_t rank;
  int final;
  uint64_t seq; /* the rank's request number; 0 for the leader's periodic ones */
  char scope[EMBPS_TABLE_NAME_MAX];
  struct ckpt_request *next;
} ckpt_request_t;

/* A queue of ops for the loop thread, linked through one of the op's link fields (`link`, its
 * offset): an op can sit in the done, ordered and progress queues at once. */
typedef struct op_queue {
  embps_op_t *head, *tail;
  size_t link;
} op_queue_t;

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
  embps_op_t *in_head, *in_tail; /* guarded by mu */
  op_queue_t done;               /* ops whose `done` is due; guarded by mu */
  op_queue_t ordered;            /* ops whose `ordered` is due; guarded by mu */
  op_queue_t progress;           /* ops whose `progress` is due; guarded by mu */
  int stopping;                  /* guarded by mu */
  char state_msg[400];           /* guarded by mu */
  atomic_int state;
  atomic_int fatal_pending;
  embps_status_t fatal_status;
  atomic_uint_fast64_t pending;
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
  /* The round being sent or applied, and the configs of the creates it runs. */
  embps_round_entry_t round[EMBPS__ROUND_MAX];
  embps_table_config_t round_configs[EMBPS__ROUND_MAX];
  embps_op_t *parked; /* ops waiting for their round, arrival order */
  uint64_t next_create_id;

  /* Checkpoints (group thread only). */
  char *ckpt_dir;                                    /* NULL: off */
  embps__ckpt_t *ckpt;                               /* capture, writer, restore */
  int ckpt_fd;                                       /* the writer's eventfd */
  embps__ckpt_order_t round_ckpts[EMBPS__ROUND_MAX]; /* the orders of the round being applied */
  embps_op_t *ckpt_ops, *ckpt_ops_tail;              /* this rank's, waiting, by seq */
  uint64_t ckpt_seq;                                 /* the last this rank asked for */
  /* Leader only, but for final_done and final_msg, which every rank keeps. */
  uint64_t round_no;                   /* entries run so far (with the restored checkpoint's) */
  ckpt_request_t *req_head, *req_tail; /* asked for, not yet ordered */
  int ckpt_inflight;                   /* cur is ordered and not yet complete */
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

static int is_leader(const embps_group_t *g) { return g->cfg.rank == 0; }

/* ---- completion ------------------------------------------------------------------------------ */

static embps_op_t **op_link(embps_op_t *op, size_t link) {
  return (embps_op_t **)((char *)op + link);
}

/* Appends op to q and wakes the loop (any thread). */
static void post(embps_group_t *g, op_queue_t *q, embps_op_t *op) {
  *op_link(op, q->link) = NULL;
  pthread_mutex_lock(&g->mu);
  if (q->tail)
    *op_link(q->tail, q->link) = op;
  else
    q->head = op;
  q->tail = op;
  pthread_mutex_unlock(&g->mu);
  uv_async_send(&g->async);
}

/* Empties q (under mu), returning its ops in order. */
static embps_op_t *take_all(op_queue_t *q) {
  embps_op_t *head = q->head;
  q->head = q->tail = NULL;
  return head;
}

/* The first op of a list take_all returned, unlinked; *list moves past it. */
static embps_op_t *pop(embps_op_t **list, size_t link) {
  embps_op_t *op = *list;
  *list = *op_link(op, link);
  *op_link(op, link) = NULL;
  return op;
}

static void complete(embps_group_t *g, embps_op_t *op) { post(g, &g->done, op); }

/* Tells the loop that op's batch is ordered (op->ordered runs there, before op->done). */
static void announce_ordered(embps_group_t *g, embps_op_t *op) {
  if (op->ordered)
    post(g, &g->ordered, op);
}

/* The engine made more of a lookup's rows final (engine thread): the loop runs op->progress. An
 * op is queued once until the loop has taken it, so a fast engine costs one wake per loop turn,
 * not one per chunk. */
static void publish_progress(embps_op_t *op, void *arg) {
  embps_group_t *g = arg;
  if (!atomic_exchange_explicit(&op->progress_queued, 1, memory_order_acq_rel))
    post(g, &g->progress, op);
}

static void fail_op(embps_group_t *g, embps_op_t *op, embps_status_t status, const char *msg) {
  embps_error_set(&op->error, status, "%s", msg);
  complete(g, op);
}

static void on_async(uv_async_t *handle) {
  embps_group_t *g = handle->data;
  embps_op_t *op, *ordered, *progress;
  if (atomic_exchange(&g->fatal_pending, 0) && g->cfg.on_fatal) {
    char msg[400];
    embps_group_state(g, msg, sizeof(msg));
    g->cfg.on_fatal(g->cfg.on_fatal_arg, g->fatal_status, msg);
  }
  pthread_mutex_lock(&g->mu);
  ordered = take_all(&g->ordered);
  progress = take_all(&g->progress);
  op = take_all(&g->done);
  pthread_mutex_unlock(&g->mu);
  /* Every op's ordered notice was queued before its completion: taking the queues at once and
   * running the notices first keeps that order. */
  while (ordered) {
    embps_op_t *o = pop(&ordered, g->ordered.link);
    o->ordered(o);
  }
  /* Progress is queued before its op's completion too, so it runs before done frees the op. The
   * flag is cleared first: a chunk published meanwhile queues the op again. */
  while (progress) {
    embps_op_t *o = pop(&progress, g->progress.link);
    atomic_store_explicit(&o->progress_queued, 0, memory_order_release);
    o->progress(o);
  }
  while (op) {
    embps_op_t *o = pop(&op, g->done.link);
    atomic_fetch_sub_explicit(&g->pending, 1, memory_order_relaxed);
    o->done(o);
  }
}

/* ---- state ----------------------------------------------------------------------------------- */

static void set_state(embps_group_t *g, embps_group_state_t state, const char *msg) {
  pthread_mutex_lock(&g->mu);
  snprintf(g->state_msg, sizeof(g->state_msg), "%s", msg ? msg : "");
  pthread_mutex_unlock(&g->mu);
  atomic_store(&g->state, (int)state);
}

/* Answers a shutting-down rank's checkpoint op with the group's final checkpoint, which is
 * complete: every rank heard of it when it was. */
static void complete_final(embps_group_t *g, embps_op_t *op) {
  op->next = NULL;
  op->ckpt_round = g->final_msg.round;
  op->ckpt_bytes = g->final_msg.bytes;
  snprintf(op->ckpt_path, sizeof(op->ckpt_path), "%s", g->final_msg.path);
  complete(g, op);
}

/* Breaks the group: every parked op fails, and so will every later one. */
static void fail_all(embps_group_t *g, const char *msg) {
  set_state(g, EMBPS_GROUP_BROKEN, msg);
  while (g->parked) {
    embps_op_t *op = g->parked;
    g->parked = op->next;
    fail_op(g, op, EMBPS_UNAVAILABLE, msg);
  }
  while (g->ckpt_ops) {
    embps_op_t *op = g->ckpt_ops;
    g->ckpt_ops = op->next;
    if (op->ckpt_final && g->final_done) /* the group's final checkpoint is complete */
      complete_final(g, op);
    else
      fail_op(g, op, EMBPS_UNAVAILABLE, msg);
  }
  g->ckpt_ops_tail = NULL;
}

/* Breaks the group on this rank and makes sure every other rank hears of it: a non-leader
 * tells the leader, and the leader tells every rank and closes its control connections, so a
 * rank that is idle (in no collective) when another dies still fails its calls at once. */
static void break_group(embps_group_t *g, const char *why) {
  char msg[400];
  if (atomic_load(&g->state) == EMBPS_GROUP_BROKEN)
    return;
  snprintf(msg, sizeof(msg), "the shard group is broken: %.300s; restart its ranks", why);
  EMBPS_ERROR("rank %u: %s", g->cfg.rank, msg);
  fail_all(g, msg);
  if (!g->control_fds)
    return;
  for (uint32_t r = 0; r < g->cfg.size; r++) {
    if (g->control_fds[r] < 0 || (!is_leader(g) && r != 0))
      continue;
    embps__send_broken(g->control_fds[r], why);
    if (is_leader(g))
      shutdown(g->control_fds[r], SHUT_RDWR);
  }
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

/* Sends the frame in g->out to peer. Frames are small and the peer reads them as they come,
 * so this waits as long as the socket needs (a dead peer fails it). */
static embps_status_t send_out(embps_group_t *g, uint32_t peer) {
  embps__io_t io = embps__send_all(g->control_fds[peer], g->out.data, g->out.len, UINT64_MAX);
  return io == EMBPS__IO_OK ? EMBPS_OK : EMBPS_UNAVAILABLE;
}

static embps_status_t send_notice(embps_group_t *g, const embps_batch_desc_t *d) {
  embps_status_t ret;
  g->out.len = 0;
  if ((ret = embps__frame_notice(&g->out, d, NULL)) != EMBPS_OK)
    return ret;
  return send_out(g, 0);
}

/* The parked op of batch (client_id, batch_id); unlinked from the list when unlink is set. */
static embps_op_t *find_parked(embps_group_t *g, uint64_t client_id, uint64_t batch_id,
                               int unlink) {
  for (embps_op_t **pp = &g->parked; *pp; pp = &(*pp)->next) {
    if ((*pp)->client_id == client_id && (*pp)->batch_id == batch_id) {
      embps_op_t *op = *pp;
      if (unlink) {
        *pp = op->next;
        op->next = NULL;
      }
      return op;
    }
  }
  return NULL;
}

/* Leader: sends round entries e[0..n) to every rank, with the config of each create it runs
 * (and, for a checkpoint, its order in ckpts). */
static embps_status_t send_round(embps_group_t *g, const embps_round_entry_t *e,
                                 const embps__ckpt_order_t *ckpts, size_t n) {
  embps_status_t ret;
  for (size_t i = 0; i < n; i++) {
    embps_op_t *op = e[i].action == EMBPS_ROUND_RUN && (e[i].kind == EMBPS_OP_CREATE_TABLE ||
                                                        e[i].kind == EMBPS_OP_DROP_TABLE)
                         ? find_parked(g, e[i].client_id, e[i].batch_id, 0)
                         : NULL;
    if (op)
      g->round_configs[i] = op->create;
    else
      memset(&g->round_configs[i], 0, sizeof(g->round_configs[i]));
  }
  g->out.len = 0;
  if ((ret = embps__frame_round(&g->out, e, g->round_configs, ckpts, n, NULL)) != EMBPS_OK)
    return ret;
  for (uint32_t r = 1; r < g->cfg.size && ret == EMBPS_OK; r++)
    ret = send_out(g, r);
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
  while ((ret = embps__frame_reader_next(r, &have, &type, &payload, &len, err)) == EMBPS_OK && have)
    handle(g, peer, type, payload, len);
  if (ret != EMBPS_OK)
    return ret;
  if (closed)
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "rank %u closed its control connection (it stopped or died)", peer);
  return EMBPS_OK;
}

/* ---- checkpoints ----------------------------------------------------------------------------- */

static embps_status_t send_ckpt(embps_group_t *g, uint32_t peer, const embps__ckpt_msg_t *m) {
  embps_status_t ret;
  g->out.len = 0;
  if ((ret = embps__frame_checkpoint(&g->out, m, NULL)) != EMBPS_OK)
    return ret;
  return send_out(g, peer);
}

/* Answers this rank's checkpoint ops up to m->seq with checkpoint m's outcome. */
static void complete_ckpt_ops(embps_group_t *g, const embps__ckpt_msg_t *m) {
  while (g->ckpt_ops && m->seq && g->ckpt_ops->ckpt_seq <= m->seq) {
    embps_op_t *op = g->ckpt_ops;
    g->ckpt_ops = op->next;
    if (!g->ckpt_ops)
      g->ckpt_ops_tail = NULL;
    op->next = NULL;
    if (m->status != EMBPS_OK) {
      fail_op(g, op, (embps_status_t)m->status, m->message);
      continue;
    }
    op->ckpt_round = m->round;
    op->ckpt_bytes = m->bytes;
    snprintf(op->ckpt_path, sizeof(op->ckpt_path), "%s", m->path);
    complete(g, op);
  }
}

/* Leader: rank `rank` asks for a checkpoint of scope (its request seq; 0: the leader's own
 * periodic one, which answers nobody). */
static void leader_request(embps_group_t *g, uint32_t rank, uint64_t seq, const char *scope,
                           int final) {
  ckpt_request_t *q = embps_calloc(1, sizeof(*q));
  if (!q) {
    embps__ckpt_msg_t m = {
        .what = EMBPS__CKPT_COMPLETE, .seq = seq, .status = EMBPS_RESOURCE_EXHAUSTED};
    snprintf(m.message, sizeof(m.message), "the leader is out of memory for a checkpoint request");
    if (rank == 0)
      complete_ckpt_ops(g, &m);
    else if (send_ckpt(g, rank, &m) != EMBPS_OK)
      break_group(g, "the leader could not answer a checkpoint request");
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
  if (is_leader(g)) {
    leader_report(g, 0, round, err);
    return;
  }
  m.status = (uint32_t)err->status;
  snprintf(m.message, sizeof(m.message), "%s", err->message);
  if (send_ckpt(g, 0, &m) != EMBPS_OK)
    break_group(g, "this rank lost its connection to the leader (rank 0)");
}

/* Every rank, applying a checkpoint's round entry: the capture; the writer does the rest. */
static void run_ckpt_entry(embps_group_t *g, const embps__ckpt_order_t *o) {
  embps_error_t err;
  embps_error_clear(&err);
  if (!g->ckpt)
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "rank %u has no --checkpoint-dir, and every rank of a group needs the same one",
                    g->cfg.rank);
  else if (embps__ckpt_capture(g->ckpt, g->engine, g->store, o, &err) == EMBPS_OK)
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
      break_group(g, "the leader could not tell a rank that its checkpoint is complete");
      return;
    }
  }
  m.seq = g->cur_attached[0];
  complete_ckpt_ops(g, &m);
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
static void on_ckpt_results(embps_group_t *g) {
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

static void apply_round(embps_group_t *g, const embps_round_entry_t *e, size_t n,
                        const embps_table_config_t *configs, const embps__ckpt_order_t *ckpts);

/* Leader: orders the next checkpoint asked for (or due), once none is in flight. Requests of
 * the same scope waiting in a row are answered by one checkpoint. */
static void leader_order_ckpt(embps_group_t *g) {
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
      ckpt_request_t *q = g->req_head;
      g->req_head = q->next;
      g->final_msg.seq = q->seq;
      if (q->rank == 0)
        complete_ckpt_ops(g, &g->final_msg);
      else if (q->seq && send_ckpt(g, q->rank, &g->final_msg) != EMBPS_OK)
        break_group(g, "the leader could not tell a rank that its checkpoint is complete");
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
    ckpt_request_t *q = g->req_head;
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
  if (!g->cur.scope[0] && g->cfg.checkpoint_incremental && g->chain_base &&
      g->since_full + 1 < g->cfg.checkpoint_full_every)
    g->cur.base_round = g->chain_base;
  g->ckpt_inflight = 1;
  g->cur_reported = 0;
  embps_error_clear(&g->cur_err);
  memset(&g->round[0], 0, sizeof(g->round[0]));
  g->round[0].batch_id = CKPT_ID_BIT | g->cur.round;
  g->round[0].action = EMBPS_ROUND_RUN;
  g->round[0].kind = EMBPS_BATCH_CHECKPOINT;
  g->round_ckpts[0] = g->cur;
  if (g->cur_final) {
    g->closing = 1;
    EMBPS_INFO("a rank is shutting down: the final checkpoint is round %llu, and the group "
               "serves no batch after it",
               (unsigned long long)g->cur.round);
  }
  if (g->cfg.size > 1 && send_round(g, g->round, g->round_ckpts, 1) != EMBPS_OK) {
    break_group(g, "the leader could not send a round to every rank");
    return;
  }
  apply_round(g, g->round, 1, NULL, g->round_ckpts);
}

/* A checkpoint op from the loop thread: asks the leader, waits for its answer. */
static void admit_ckpt(embps_group_t *g, embps_op_t *op) {
  embps__ckpt_msg_t m = {.what = EMBPS__CKPT_REQUEST};
  if (!g->ckpt) {
    fail_op(g, op, EMBPS_FAILED_PRECONDITION,
            "checkpoints are off: start every rank with --checkpoint-dir (EMBPS_CHECKPOINT_DIR)");
    return;
  }
  if (op->ckpt_final && g->final_done) {
    complete_final(g, op);
    return;
  }
  op->ckpt_seq = ++g->ckpt_seq;
  op->next = NULL;
  if (g->ckpt_ops_tail)
    g->ckpt_ops_tail->next = op;
  else
    g->ckpt_ops = op;
  g->ckpt_ops_tail = op;
  if (is_leader(g)) {
    leader_request(g, 0, op->ckpt_seq, op->ckpt_table, op->ckpt_final);
    return;
  }
  m.seq = op->ckpt_seq;
  m.final = (uint8_t)op->ckpt_final;
  snprintf(m.scope, sizeof(m.scope), "%s", op->ckpt_table);
  if (send_ckpt(g, 0, &m) != EMBPS_OK)
    break_group(g, "this rank lost its connection to the leader (rank 0)");
}

/* ---- rounds ---------------------------------------------------------------------------------- */

/* Publishes the communicator's totals for other threads (GetStats on the loop, /metrics on its
 * own thread). The dispatcher counts in g->comm->stats, plain fields that only this thread may
 * touch while it makes collectives; everyone else reads these atomic copies, as of the end of
 * the group's last round (or of forming the group). */
static void publish_comm_stats(embps_group_t *g) {
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

static void apply_round(embps_group_t *g, const embps_round_entry_t *e, size_t n,
                        const embps_table_config_t *configs, const embps__ckpt_order_t *ckpts) {
  const uint64_t start_ns = embps_now_ns(), comm_ns = g->comm ? g->comm->stats.ns : 0;
  uint64_t oldest_ns = 0;
  size_t batches = 0;
  if (g->comm && !g->comm->call_seconds)
    embps_comm_set_call_histogram(g->comm, &g->metrics.collective_seconds);
  /* The round is ordered: every async push in it may say so before any of it runs. */
  for (size_t i = 0; i < n; i++) {
    embps_op_t *op =
        e[i].action == EMBPS_ROUND_RUN ? find_parked(g, e[i].client_id, e[i].batch_id, 0) : NULL;
    if (op)
      announce_ordered(g, op);
    if (op && (op->kind == EMBPS_OP_LOOKUP || op->kind == EMBPS_OP_PUSH)) {
      batches++;
      if (!oldest_ns || op->submitted_ns < oldest_ns)
        oldest_ns = op->submitted_ns;
    }
  }
  for (size_t i = 0; i < n && atomic_load(&g->state) != EMBPS_GROUP_BROKEN; i++) {
    embps_op_t *op = find_parked(g, e[i].client_id, e[i].batch_id, 1), tmp;
    embps_error_t err;

    if (e[i].action == EMBPS_ROUND_FAIL) {
      if (op)
        fail_op(g, op, e[i].status, e[i].message);
      continue;
    }
    if (e[i].kind == EMBPS_BATCH_CHECKPOINT) {
      run_ckpt_entry(g, &ckpts[i]);
      continue;
    }
    if (is_leader(g))
      g->round_no++;
    if (!op && (e[i].kind == EMBPS_OP_CREATE_TABLE || e[i].kind == EMBPS_OP_DROP_TABLE) &&
        !is_leader(g)) {
      memset(&tmp, 0,
             sizeof(tmp)); /* creates and drops run on every rank, answered by the leader */
      tmp.kind = (embps_op_kind_t)e[i].kind;
      tmp.batch_id = e[i].batch_id;
      tmp.create = configs[i];
      op = &tmp;
    }
    if (!op) {
      char msg[200];
      snprintf(msg, sizeof(msg), "rank %u was told to run batch %llu, which it does not hold",
               g->cfg.rank, (unsigned long long)e[i].batch_id);
      break_group(g, msg);
      return;
    }
    embps_error_clear(&err);
    if (op->progress) {
      op->publish = publish_progress;
      op->publish_arg = g;
    }
    if (embps_engine_run(g->engine, op, &err) != EMBPS_OK) {
      if (op != &tmp)
        fail_op(g, op, EMBPS_UNAVAILABLE, err.message);
      break_group(g, err.message);
      return;
    }
    if (op->kind == EMBPS_OP_CREATE_TABLE && op->created && g->ckpt) {
      embps__ckpt_prepare(g->ckpt, op->created);
      g->chain_base = 0; /* the chain's full checkpoint lacks the new table */
    }
    if (op->kind == EMBPS_OP_DROP_TABLE && op->error.status == EMBPS_OK && g->ckpt) {
      embps__ckpt_forget(g->ckpt, op->table);
      g->chain_base = 0; /* the chain's full checkpoint holds a table that is gone */
    }
    if (op != &tmp)
      complete(g, op);
  }
  if (batches && atomic_load(&g->state) != EMBPS_GROUP_BROKEN)
    record_round(g, start_ns, oldest_ns, batches, comm_ns);
  publish_comm_stats(g);
}

static void on_frame(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p, size_t len) {
  embps_error_t err;
  embps_status_t ret = EMBPS_OK;
  char why[400];
  if (type == EMBPS__FRAME_BROKEN) {
    char reason[EMBPS__BROKEN_MAX + 1];
    if ((ret = embps__parse_broken(p, len, reason, sizeof(reason), &err)) == EMBPS_OK) {
      snprintf(why, sizeof(why), "rank %u reported: %s", peer, reason);
      break_group(g, why);
    }
  } else if (type == EMBPS__FRAME_NOTICE && is_leader(g)) {
    embps_batch_desc_t d;
    if ((ret = embps__parse_notice(p, len, &d, &err)) == EMBPS_OK)
      embps_sequencer_arrive(g->seq, peer, &d, embps_now_ms());
  } else if (type == EMBPS__FRAME_ROUND && !is_leader(g)) {
    size_t n;
    if ((ret = embps__parse_round(p, len, g->round, g->round_configs, g->round_ckpts,
                                  EMBPS__ROUND_MAX, &n, &err)) == EMBPS_OK)
      apply_round(g, g->round, n, g->round_configs, g->round_ckpts);
  } else if (type == EMBPS__FRAME_CHECKPOINT) {
    embps__ckpt_msg_t m;
    if ((ret = embps__parse_checkpoint(p, len, &m, &err)) != EMBPS_OK) {
    } else if (is_leader(g) && m.what == EMBPS__CKPT_REQUEST) {
      leader_request(g, peer, m.seq, m.scope, m.final);
    } else if (is_leader(g) && m.what == EMBPS__CKPT_DONE) {
      embps_error_t done;
      done.status = (embps_status_t)m.status;
      snprintf(done.message, sizeof(done.message), "%s", m.message);
      leader_report(g, peer, m.round, &done);
    } else if (!is_leader(g) && m.what == EMBPS__CKPT_COMPLETE) {
      record_ckpt(g, &m);
      if (m.final) {
        g->final_done = 1;
        g->final_msg = m;
      }
      complete_ckpt_ops(g, &m);
    } else {
      ret =
          embps_error_set(&err, EMBPS_INVALID_ARGUMENT, "a checkpoint message of kind %u", m.what);
    }
  }
  if (ret != EMBPS_OK) {
    snprintf(why, sizeof(why), "rank %u sent a control frame this rank cannot read (%.300s)", peer,
             err.message);
    break_group(g, why);
  }
}

/* Leader: hands out every round the sequencer has ready, and runs it here too. Once a final
 * checkpoint is ordered, every batch fails instead: what the group acknowledges is in it. */
static void lead_rounds(embps_group_t *g) {
  size_t n;
  while (atomic_load(&g->state) != EMBPS_GROUP_BROKEN &&
         (n = embps_sequencer_next_round(g->seq, embps_now_ms(), g->round, EMBPS__ROUND_MAX)) > 0) {
    for (size_t i = 0; i < n && g->closing; i++) {
      if (g->round[i].action != EMBPS_ROUND_RUN)
        continue;
      g->round[i].action = EMBPS_ROUND_FAIL;
      g->round[i].status = EMBPS_UNAVAILABLE;
      snprintf(g->round[i].message, sizeof(g->round[i].message),
               "the shard group is shutting down (a rank got SIGTERM and its final checkpoint "
               "is taken); retry once the group is back");
    }
    if (g->cfg.size > 1 && send_round(g, g->round, NULL, n) != EMBPS_OK) {
      break_group(g, "the leader could not send a round to every rank");
      return;
    }
    apply_round(g, g->round, n, NULL, NULL);
  }
}

/* Parks an op that the loop thread submitted and reports it to the leader. */
static void admit(embps_group_t *g, embps_op_t *op) {
  embps_batch_desc_t d;
  embps_status_t ret;
  char msg[400];

  if (embps_group_state(g, msg, sizeof(msg)) != EMBPS_GROUP_READY) {
    fail_op(g, op, EMBPS_UNAVAILABLE, msg);
    return;
  }
  if (op->kind == EMBPS_OP_CHECKPOINT) {
    admit_ckpt(g, op);
    return;
  }
  if (op->kind == EMBPS_OP_CREATE_TABLE || op->kind == EMBPS_OP_DROP_TABLE) {
    op->client_id = 0;
    op->batch_id = CREATE_ID_BIT | ++g->next_create_id;
  }
  if (find_parked(g, op->client_id, op->batch_id, 0)) {
    snprintf(msg, sizeof(msg),
             "batch_id %llu is already in flight on rank %u: every batch needs its own id",
             (unsigned long long)op->batch_id, g->cfg.rank);
    fail_op(g, op, EMBPS_INVALID_ARGUMENT, msg);
    return;
  }
  op->next = g->parked;
  g->parked = op;
  memset(&d, 0, sizeof(d));
  d.client_id = op->client_id;
  d.batch_id = op->batch_id;
  d.kind = (uint32_t)op->kind;
  d.tokens_per_batch = op->tokens_per_batch;
  if (op->kind == EMBPS_OP_CREATE_TABLE || op->kind == EMBPS_OP_DROP_TABLE) {
    snprintf(d.table, sizeof(d.table), "%s", op->create.name);
  } else {
    snprintf(d.table, sizeof(d.table), "%s", embps_table_config(op->table)->name);
    d.table_id = embps_table_id(op->table);
  }
  if (is_leader(g)) {
    embps_sequencer_arrive(g->seq, 0, &d, embps_now_ms());
  } else if ((ret = send_notice(g, &d)) == EMBPS_RESOURCE_EXHAUSTED) {
    /* Nothing was sent: the leader never orders this shard, and the others expire. */
    find_parked(g, op->client_id, op->batch_id, 1);
    fail_op(g, op, ret, "out of memory for the notice to the leader (rank 0)");
  } else if (ret != EMBPS_OK) {
    break_group(g, "this rank lost its connection to the leader (rank 0)");
  }
}

/* ---- the thread ------------------------------------------------------------------------------ */

/* Starts this rank's checkpointer: its writer thread and the eventfd it wakes us with. */
static embps_status_t start_checkpoints(embps_group_t *g, embps_error_t *err) {
  embps__ckpt_config_t cc = {.dir = g->ckpt_dir,
                             .rank = g->cfg.rank,
                             .size = g->cfg.size,
                             .keep = g->cfg.checkpoint_keep,
                             .track_dirty = g->cfg.checkpoint_incremental,
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
                                 g->cfg.rank, g->cfg.size, g->cfg.max_table_bytes, &m, err)) !=
      EMBPS_OK)
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

/* Forms the group (formation.h), then starts the engine and the sequencer over its
 * communicator. */
static embps_status_t form_group(embps_group_t *g, embps_error_t *err) {
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
  if (ret == EMBPS_OK)
    set_budget(g);
  if (ret == EMBPS_OK && g->ckpt_dir)
    ret = start_checkpoints(g, err);
  if (ret == EMBPS_OK && g->cfg.restore_round)
    ret = restore(g, err);
  publish_comm_stats(g);
  return ret;
}

static void drain_incoming(embps_group_t *g, int *stopping) {
  embps_op_t *batch, *last = NULL;
  uint64_t v;
  while (read(g->wake_fd, &v, sizeof(v)) > 0) {
  }
  pthread_mutex_lock(&g->mu);
  batch = g->in_head;
  g->in_head = g->in_tail = NULL;
  *stopping = g->stopping;
  pthread_mutex_unlock(&g->mu);
  /* The queue is in submission order; admit in that order. */
  while (batch) {
    embps_op_t *op = batch;
    batch = op->next;
    op->next = NULL;
    (void)last;
    admit(g, op);
  }
}

static void *group_main(void *arg) {
  embps_group_t *g = arg;
  const uint32_t N = g->cfg.size;
  struct pollfd *pfds = embps_calloc(N + 2, sizeof(*pfds));
  embps_error_t err;
  int stopping = 0;

  embps_error_clear(&err);
  if (!pfds || form_group(g, &err) != EMBPS_OK) {
    char msg[400];
    snprintf(msg, sizeof(msg), "rank %u could not join the group: %.300s", g->cfg.rank,
             pfds ? err.message : "out of memory");
    g->fatal_status = pfds ? err.status : EMBPS_RESOURCE_EXHAUSTED;
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
    if (g->control_fds && atomic_load(&g->state) == EMBPS_GROUP_READY)
      for (uint32_t r = 0; r < N; r++)
        if (g->control_fds[r] >= 0)
          pfds[n++] = (struct pollfd){.fd = g->control_fds[r], .events = POLLIN};
    if (g->seq && is_leader(g)) {
      uint64_t left = embps_sequencer_next_deadline(g->seq, embps_now_ms());
      if (left < (uint64_t)timeout)
        timeout = (int)left + 1;
      if (g->ckpt && g->cfg.checkpoint_interval_ms && !g->ckpt_inflight && !g->closing) {
        uint64_t now = embps_now_ms();
        left = g->next_periodic_ms > now ? g->next_periodic_ms - now : 0;
        if (left < (uint64_t)timeout)
          timeout = (int)left + 1;
      }
    }
    if (poll(pfds, n, timeout) < 0 && errno != EINTR)
      break;
    drain_incoming(g, &stopping);
    if (g->ckpt)
      on_ckpt_results(g); /* drops them when the group is not ready */
    if (atomic_load(&g->state) != EMBPS_GROUP_READY)
      continue;
    for (nfds_t i = 1; i < n; i++) {
      uint32_t peer = 0;
      if (pfds[i].fd == g->ckpt_fd || !(pfds[i].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      for (uint32_t r = 0; r < N; r++)
        if (g->control_fds[r] == pfds[i].fd)
          peer = r;
      if (read_frames(g, peer, on_frame, &err) != EMBPS_OK) {
        break_group(g, err.message);
        break;
      }
    }
    if (is_leader(g)) {
      lead_rounds(g);
      leader_order_ckpt(g);
    }
  }
  fail_all(g, "this server is shutting down");
  embps_free(pfds);
  return NULL;
}

/* ---- public ---------------------------------------------------------------------------------- */

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
  g->done.link = offsetof(embps_op_t, next);
  g->ordered.link = offsetof(embps_op_t, ordered_next);
  g->progress.link = offsetof(embps_op_t, progress_next);
  atomic_store(&g->state, EMBPS_GROUP_STARTING);
  snprintf(g->state_msg, sizeof(g->state_msg),
           "the shard group is starting: waiting for all %u ranks to join", cfg->size);
  if (uv_async_init(loop, &g->async, on_async) != 0)
    goto fail_mutex;
  g->async.data = g;
  if (pthread_create(&g->thread, NULL, group_main, g) != 0) {
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

void embps_group_submit(embps_group_t *g, embps_op_t *op) {
  uint64_t one = 1;
  op->next = NULL;
  op->submitted_ns = embps_now_ns();
  atomic_fetch_add_explicit(&g->pending, 1, memory_order_relaxed);
  pthread_mutex_lock(&g->mu);
  if (g->in_tail)
    g->in_tail->next = op;
  else
    g->in_head = op;
  g->in_tail = op;
  pthread_mutex_unlock(&g->mu);
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
}

uint32_t embps_group_rank(const embps_group_t *g) { return g->cfg.rank; }
uint32_t embps_group_size(const embps_group_t *g) { return g->cfg.size; }
const char *embps_group_backend(const embps_group_t *g) {
  return embps_backend_name(g->cfg.backend);
}
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

uint64_t embps_group_pending(const embps_group_t *g) {
  return atomic_load_explicit(&((embps_group_t *)g)->pending, memory_order_relaxed);
}

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
  on_async(&g->async); /* deliver what finished before the join */
  uv_close((uv_handle_t *)&g->async, NULL);
}

void embps_group_free(embps_group_t *g) {
  if (!g)
    return;
  embps__ckpt_free(g->ckpt); /* finishes the file being written */
  if (g->ckpt_fd >= 0)
    close(g->ckpt_fd);
  while (g->req_head) {
    ckpt_request_t *q = g->req_head;
    g->req_head = q->next;
    embps_free(q);
  }
  embps_free(g->cur_attached);
  embps_free(g->ckpt_dir);
  embps_free(g->restore_dir);
  embps_engine_free(g->engine);
  embps_sequencer_free(g->seq);
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
  if (g->peer_addrs)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      embps_free(g->peer_addrs[r]);
  embps_free(g->peer_addrs);
  embps_free(g->identity);
  free_secret(g);
  close(g->wake_fd);
  close(g->cancel_fd);
  pthread_mutex_destroy(&g->mu);
  embps_free(g);
}
