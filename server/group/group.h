/* The shard group as this rank sees it: the thread that owns everything shared between
 * ranks. It bootstraps the group (server/group/bootstrap), parks the shards the loop thread
 * submits, tells the leader which shards it holds, and runs the rounds the leader's sequencer
 * orders, through the engine, in the same order on every rank. It answers each call (its
 * envelope, embps_group_call_t) on the loop thread through a uv_async_t. A group of one runs the
 * same path with no peers. */
#ifndef EMBPS_GROUP_H
#define EMBPS_GROUP_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "common/status.h"
#include "server/comm/comm.h"
#include "server/engine/engine.h"
#include "server/group/mesh.h"
#include "common/hist.h"
#include "server/store/store.h"

typedef struct embps_group embps_group_t;

/** The phases a round's time splits into, as embps_group_metrics_t keeps them. */
typedef enum embps_round_phase {
  EMBPS_ROUND_PHASE_QUEUE_WAIT = 0,  /* the round's oldest batch: submitted to the round's start */
  EMBPS_ROUND_PHASE_COLLECTIVES = 1, /* time inside collective calls during the round */
  EMBPS_ROUND_PHASE_COMPUTE = 2,     /* the rest of the round: dedup, kernels, copies */
  EMBPS_ROUND_PHASES = 3
} embps_round_phase_t;

/**
 * The group's metrics: written by the group's thread (relaxed atomics), read by any thread
 * without a lock. Rounds count those that ran at least one lookup or push on this rank.
 * Checkpoint figures: the leader records every checkpoint; another rank only those it asked
 * for (and the final one). ckpt_seconds runs from ordering to the manifest (leader only).
 */
typedef struct embps_group_metrics {
  atomic_uint_fast64_t rounds, batches;
  embps_hist_t batches_per_round;
  embps_hist_t round_seconds;                     /* a round's run on this rank */
  embps_hist_t phase_seconds[EMBPS_ROUND_PHASES]; /* embps_round_phase_t */
  embps_hist_t collective_seconds;                /* each collective call */
  atomic_uint_fast64_t peer_bytes_sent, peer_bytes_received, collective_calls;
  atomic_uint_fast64_t ckpt_completed, ckpt_failed;
  atomic_uint_fast64_t ckpt_last_round, ckpt_last_unix_ms, ckpt_last_bytes;
  atomic_uint_fast64_t ckpt_bytes_written; /* this rank's checkpoint files */
  embps_hist_t ckpt_seconds;
  /* Batches failed before they were ordered (leader only: its sequencer decides): with
   * DEADLINE_EXCEEDED (a deadline passed), and with CANCELLED (a caller withdrew its shard). */
  atomic_uint_fast64_t batches_expired, batches_cancelled;
  atomic_uint_fast64_t shards_withdrawn;     /* this rank's shards whose callers went away while
                                                parked, withdrawn from their batch */
  atomic_uint_fast64_t retries_deduplicated; /* this rank's push shards answered from the retry
                                                 window (replayed), not run again */
} embps_group_metrics_t;

/** The group's metrics (owned by the group, valid until embps_group_free); any thread. */
const embps_group_metrics_t *embps_group_metrics(const embps_group_t *group);

/** Writes a rank's configuration identity to out (cap bytes, NUL-terminated): "key=value\n"
 * lines for the version, the mesh, the table and data axes and the peer list, in that order.
 * Arguments are borrowed. Returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT when it does not fit. */
embps_status_t embps_group_identity_format(char *out, size_t cap, const char *version,
                                           const char *mesh, const char *table_axis,
                                           const char *data_axis, const char *peers);

/** Derives a rank's peer address from its client address: the same host, port + port_offset.
 * client_addr is "host:port" as common/hostport.h parses it ("[v6]" kept in brackets).
 * Writes the NUL-terminated result to out (cap bytes, caller-owned). Returns EMBPS_OK, or
 * EMBPS_INVALID_ARGUMENT when the address does not parse, the port is not 1..65535, the
 * derived port falls outside 1..65535, or out is too small; out is then left untouched. */
embps_status_t embps_group_peer_addr(const char *client_addr, int port_offset, char *out,
                                     size_t cap, embps_error_t *err);

/** Resolves --control-fanout (flag: "auto", "" as auto, or a count) for a group of size ranks
 * into *out (embps_group_config_t.control_fanout): auto relays from 16 ranks, in groups of
 * ceil(sqrt(size)); a count of 0 or 1 means none. Returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT
 * (err names the flag) when flag is neither. */
embps_status_t embps_group_control_fanout(const char *flag, uint32_t size, uint32_t *out,
                                          embps_error_t *err);

/** Fewest bytes a group secret may have, and the most read from its file. */
#define EMBPS_GROUP_SECRET_MIN 16
#define EMBPS_GROUP_SECRET_MAX 4096

/**
 * Reads the group secret from the file at path into out (cap bytes, caller-owned; at least
 * EMBPS_GROUP_SECRET_MAX) and sets *len. One trailing newline ("\n" or "\r\n") is dropped,
 * so files written by echo and by printf hold the same secret; every other byte counts.
 * *loose_mode is set to the file's permission bits when any user may read it (the caller
 * warns: Kubernetes mounts secrets 0644 unless defaultMode says otherwise), else 0; a file its
 * group may read passes, as Kubernetes grants a non-root server its secret through fsGroup. On
 * failure out and *len are left untouched.
 *
 * Returns
 * - EMBPS_OK.
 * - EMBPS_INVALID_ARGUMENT: the file cannot be opened or read, is not a regular file, is
 *   empty, holds fewer than EMBPS_GROUP_SECRET_MIN bytes or more than EMBPS_GROUP_SECRET_MAX;
 *   err names the file and what is wrong.
 */
embps_status_t embps_group_secret_load(const char *path, uint8_t *out, size_t cap, size_t *len,
                                       unsigned *loose_mode, embps_error_t *err);

/** TLS between the ranks (peer_tls.c): every rank's certificate and key, and the CA that
 * signed every rank's certificate. Shared by every peer connection; read-only once made. */
typedef struct embps_group_peer_tls embps_group_peer_tls_t;

/**
 * Reads the peer TLS files now: cert_file (PEM chain), key_file (its PEM key) and ca_file (the
 * PEM CAs a peer's certificate must chain to). Every rank-to-rank connection made with it runs
 * TLS 1.2 or later with certificates checked both ways. The caller owns *out
 * (embps_group_peer_tls_free); on failure *out is untouched. Returns EMBPS_OK;
 * EMBPS_INVALID_ARGUMENT with err naming the flag and the file (unreadable, not PEM, a key that
 * does not match); EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_group_peer_tls_new(embps_group_peer_tls_t **out, const char *cert_file,
                                        const char *key_file, const char *ca_file,
                                        embps_error_t *err);

/** Frees what embps_group_peer_tls_new made; connections still open keep working. NULL: no-op. */
void embps_group_peer_tls_free(embps_group_peer_tls_t *tls);

/** The most pushes per client a retry window may hold (embps_group_config_t.retry_window). */
#define EMBPS_GROUP_RETRY_WINDOW_MAX 1048576u
/** What retry_window 0 means. */
#define EMBPS_GROUP_RETRY_WINDOW_DEFAULT 1024u

typedef struct embps_group_config {
  uint32_t rank;
  uint32_t size;
  /** Each rank's peer listener ("host:port"), size entries; unused for a group of one. */
  const char *const *peer_addrs;
  int bind_any;         /* listen for peers on every interface */
  const char *identity; /* "key=value\n" lines every rank must agree on */
  /** The group secret (secret_len bytes; NULL or 0 bytes: none). With one, every peer
   * connection at bootstrap is authenticated both ways (embps_group_bootstrap). */
  const uint8_t *secret;
  size_t secret_len;
  /** TLS on every peer connection (borrowed, outlives the group); NULL: cleartext. The cuda
   * backend's NCCL links are NCCL's own and stay unencrypted. */
  embps_group_peer_tls_t *peer_tls;
  uint64_t bootstrap_timeout_ms; /* how long to wait for every rank at startup */
  uint64_t peer_timeout_ms;      /* bound on one collective */
  uint64_t batch_deadline_ms;    /* a batch whose shards do not all arrive in time fails */
  embps_backend_t backend;       /* cpu, or cuda (tables on `device`, NCCL between ranks) */
  int device;                    /* cuda: the CUDA device this rank uses */
  unsigned engine_threads;       /* cpu: threads for a push's per-row kernels; 0 or 1: one */
  /* Checkpoints (DESIGN.md, Durability); all off without checkpoint_dir. */
  const char *checkpoint_dir;      /* NULL or "": no checkpoints; else a directory every rank
                                      shares (checked and, on the leader, locked by the caller) */
  uint32_t checkpoint_keep;        /* complete checkpoints kept per scope; 0: all */
  uint64_t checkpoint_interval_ms; /* the leader takes one this often; 0: on demand only */
  uint32_t checkpoint_full_every;  /* every this many checkpoints a full one, the others write
                                      only the rows changed since the previous one; 0 or 1: all
                                      full (no row is tracked) */
  const char *restore_dir;         /* with restore_round: the directory that holds it */
  uint64_t restore_round;          /* 0: start empty; else restore restore_dir's checkpoint of
                                      this round before serving */
  uint64_t max_memory_bytes;       /* what all tables may take on this rank (embps_store_set_budget,
                                      which the group calls once its engine runs); 0: 80% of the
                                      memory tables live in */
  uint32_t retry_window;           /* pushes remembered per client, so that a retried push is
                                      applied at most once (the group's retry window); 0: the
                                      default,
                                      at most EMBPS_GROUP_RETRY_WINDOW_MAX */
  /** Control relays (docs/design.md, "The leader's limit"): the followers go in groups of this
   * many, each group's lowest rank relaying the others' control frames to and from the leader;
   * 0: every follower talks to the leader directly. Every rank must have the same (the identity
   * carries it); embps_group_control_fanout resolves the flag. */
  uint32_t control_fanout;
  /** Called on the loop thread if the group cannot form (bootstrap or restore failed). */
  void (*on_fatal)(void *arg, embps_status_t status, const char *message);
  void *on_fatal_arg;
} embps_group_config_t;

typedef enum embps_group_state {
  EMBPS_GROUP_STARTING = 0, /* waiting for every rank */
  EMBPS_GROUP_READY = 1,
  EMBPS_GROUP_BROKEN = 2, /* a peer left or failed: every call fails with UNAVAILABLE */
} embps_group_state_t;

/**
 * Starts the group's thread (which bootstraps); completions arrive on loop. cfg is copied
 * (strings too). store is borrowed. On failure *out is untouched. Returns EMBPS_OK,
 * EMBPS_RESOURCE_EXHAUSTED or EMBPS_INTERNAL.
 */
embps_status_t embps_group_new(embps_group_t **out, uv_loop_t *loop,
                               const embps_group_config_t *cfg, embps_store_t *store);

/** Longest checkpoint path a checkpoint request reports. */
#define EMBPS_GROUP_CKPT_PATH_MAX 1100

/** A checkpoint request (embps_group_checkpoint): what to take and, once its call is done
 * without error, what was written. */
typedef struct embps_group_ckpt {
  char table[EMBPS_TABLE_NAME_MAX]; /* the scope: one table's name, or "" for every table */
  int final; /* the rank is shutting down: the group serves no batch after this checkpoint */
  /* Results. */
  uint64_t round, bytes;
  char path[EMBPS_GROUP_CKPT_PATH_MAX];
  uint64_t seq; /* set by the group: this rank's number for the request */
} embps_group_ckpt_t;

typedef struct embps_group_call embps_group_call_t;

/**
 * One call to the group, its envelope: the engine's op it runs (a lookup or push shard, a create
 * or a drop) or a checkpoint it takes, the batch's name, the answer and the callbacks. The
 * submitter owns it and everything it points to; between submission and the done callback only
 * the group (and, for the op, the engine) touches it.
 */
struct embps_group_call {
  embps_op_t op;             /* embps_group_submit: what the engine runs; its kind and inputs set
                                by the submitter, its results the engine's once done */
  embps_group_ckpt_t *ckpt;  /* embps_group_checkpoint: the request (op is then unused) */
  uint64_t client_id;        /* lookup, push: the client's id (0: none), which scopes batch_id */
  uint64_t batch_id;         /* lookup, push: the client's batch id (shards of one batch share it);
                                create, drop: the group numbers them itself */
  uint32_t tokens_per_batch; /* lookup, push: over the whole group */
  /** Lookup, push: the client's digest of the whole batch (the same in every shard; 0: none).
   * The leader joins only shards whose digests are equal (else INVALID_ARGUMENT on every rank),
   * and a push with a client id and a digest is applied at most once however often it is
   * retried, while the retry window remembers it (server/group/dedup.h). */
  uint64_t digest;
  /** Lookup, push: which try of the batch this shard belongs to (0: the first). With client_id
   * and batch_id it names the batch: shards of different attempts never join. */
  uint32_t attempt;
  /** Lookup, push: the caller's deadline in ns on embps_now_ns()'s clock (the net call's
   * embps_net_call_deadline_ns), 0: none. The batch is ordered only while every shard's deadline
   * is still ahead; once the earliest passes first, it fails with DEADLINE_EXCEEDED on every rank
   * and runs on none, as a batch past --batch-deadline-ms does. Once ordered it runs. */
  uint64_t deadline_ns;

  /** The answer, once done: status EMBPS_OK on success; else the op's failure (op.error) or the
   * group's (UNAVAILABLE when the group is not ready or broken, DEADLINE_EXCEEDED, ...). */
  embps_error_t error;
  /** Push, set by the group once done without error: 1 when the push was a retry of one the
   * group had applied already, answered from the retry window with the first attempt's results
   * (op.applied, op.skipped, op.grad_norm, op.num_unique) and not run again; else 0. */
  int replayed;
  /** Called on the loop thread once the call is complete. */
  void (*done)(embps_group_call_t *call);
  /** When not NULL: called on the loop thread once the leader has ordered the call's batch into a
   * round (before done, which always follows). An async push answers its client here, so that
   * "ordered" is true when it is said; a batch that fails before it is ordered only gets done,
   * with the error. */
  void (*ordered)(embps_group_call_t *call);
  /** Lookup, when not NULL: called on the loop thread when more of op.rows_out is final
   * (op.rows_ready grew), so the reply can leave while the engine fills the rest; always before
   * done. A backend that copies its rows out asynchronously (CUDA) reports none. */
  void (*progress)(embps_group_call_t *call);
  void *user; /* the submitter's, for its callbacks */

  /* The group's own, from submission to done: its queue links and bookkeeping. */
  uint64_t submitted_ns;             /* embps_now_ns() at submission, for queue-wait metrics */
  atomic_int progress_queued;        /* progress is queued and the loop has not yet run it */
  embps_group_call_t *next;          /* the incoming, parked, checkpoint and done queues */
  embps_group_call_t *ordered_next;  /* the queue of ordered notices */
  embps_group_call_t *progress_next; /* the queue of progress notices */
};

/**
 * Queues call (loop thread), whose op.kind is a lookup, a push, a create or a drop. Lookups and
 * pushes wait for their batch's other shards; a create or a drop (leader only) is ordered like a
 * batch. call->done runs on the loop thread when it is complete, with call->error set on
 * failure (UNAVAILABLE when the group is not ready or broken).
 */
void embps_group_submit(embps_group_t *group, embps_group_call_t *call);

/**
 * Withdraws call, a lookup or push shard submitted with embps_group_submit, whose caller went
 * away (loop thread; the network layer said its stream was reset or its connection closed before
 * it was answered). The group's thread acts on it later, and only if call is then still parked
 * waiting for its batch with the same (client_id, batch_id, attempt): it does not read *call
 * otherwise, so a call done (or freed) meanwhile is safe. A parked shard's batch that is not yet
 * ordered then fails with CANCELLED on every rank and runs on none (the leader's sequencer
 * decides, embps_sequencer_withdraw); one already ordered runs as ordered. Either way call stays
 * the group's until its done callback runs as always (its answer goes to the gone caller). A
 * caller that goes at its deadline (deadline_ns all but up: gRPC clients reset the stream then)
 * withdraws nothing: its batch expires at that deadline with DEADLINE_EXCEEDED for every caller,
 * as without the reset. Out of memory, the withdrawal is dropped (the batch then runs or expires
 * as it would have).
 */
void embps_group_withdraw(embps_group_t *group, embps_group_call_t *call);

/**
 * Asks for a checkpoint (loop thread, any rank): the group takes req to the leader, which orders
 * it as a round once the checkpoint before it is complete, and call->done runs on the loop thread
 * once its manifest is durable (req->round, path and bytes say what was written) or it failed
 * (call->error: FAILED_PRECONDITION when checkpoints are off, UNAVAILABLE when the group is not
 * ready or broken). call and req are the caller's until then; call->op is unused.
 */
void embps_group_checkpoint(embps_group_t *group, embps_group_call_t *call,
                            embps_group_ckpt_t *req);

/** The state; when message is not NULL, a sentence on why it is not READY. */
embps_group_state_t embps_group_state(embps_group_t *group, char *message, size_t cap);

uint32_t embps_group_rank(const embps_group_t *group);
uint32_t embps_group_size(const embps_group_t *group);
/** The backend this rank computes on (its configuration's). Any thread. */
embps_backend_t embps_group_backend(const embps_group_t *group);

/** The CUDA device whose pinned host memory request and reply buffers should use (see
 * embps_host_alloc), once the group has formed with the CUDA backend; -1 before, and for the
 * CPU backend. Any thread. */
int embps_group_host_device(embps_group_t *group);

/** Collective traffic so far (payload bytes and calls; ns is 0), for stats and benchmarks, as of
 * the end of the group's last round. Any thread. */
void embps_group_comm_stats(embps_group_t *group, embps_comm_stats_t *out);

/** The checkpoint directory; NULL when checkpoints are off. */
const char *embps_group_checkpoint_dir(const embps_group_t *group);

/**
 * Fails what is still parked (UNAVAILABLE: shutting down), stops the thread and closes the
 * async handle; the done callbacks still run on the loop. Call embps_group_free after the loop
 * has run once more.
 */
void embps_group_close(embps_group_t *group);
void embps_group_free(embps_group_t *group);

#endif
