/* libembps: the C client of an embps shard group. Installed as <embps/embps.h>, the library's
 * whole public face: it and the headers it includes (<embps/status.h>, <embps/dtype.h>,
 * <embps/optimizer.h>, <embps/eviction.h>) compile without the source tree; `pkg-config
 * --cflags --libs embps` or CMake's find_package(embps) with the target embps::embps give the
 * flags.
 *
 * A client holds one HTTP/2 (gRPC, cleartext) connection to every server of a shard group and
 * splits each batch of tokens into one contiguous token shard per rank (a feature batch, many
 * features of a batch of samples, into one contiguous sample shard per rank). Calls are unary gRPC
 * calls; the *_start variants return a call handle so that many calls can be in flight on the
 * same connections (pipelining), and embps_call_wait() finishes one.
 *
 * Threads: the library starts no threads. All I/O happens inside the calling thread, in
 * embps_call_wait() and the blocking calls, with poll(). One client must be used by one thread
 * at a time; use one client per thread for parallelism (clients share nothing).
 *
 * Ordering: calls on one client are sent in the order they were started, with increasing
 * batch ids, and each request's body is sent whole before the next one's starts, so a server
 * sees them in that order on every connection. A retried lookup or push (see max_attempts) is
 * sent again, whole, when its backoff ends, after the calls started since (an assign too).
 *
 * Errors: every function that can fail returns an embps_status_t (values are gRPC status
 * codes). The message of the last failure, including the server's grpc-message, is kept by
 * the client and read with embps_client_last_error().
 */
#ifndef EMBPS_H
#define EMBPS_H

#include <stddef.h>
#include <stdint.h>

#include "embps/dtype.h"     /* embps_dtype_t: EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16 */
#include "embps/eviction.h"  /* embps_eviction_t: EMBPS_EVICTION_DEFAULT, _LRU, _LFU, _TTL */
#include "embps/optimizer.h" /* embps_optimizer_t: EMBPS_OPTIMIZER_DEFAULT, _SGD, ... */
#include "embps/pooling.h"   /* embps_pooling_t: EMBPS_POOLING_NONE, _SUM, _MEAN, _WEIGHTED_SUM */
#include "embps/status.h"    /* embps_status_t, embps_error_t: EMBPS_OK, ... */

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the library's API: the library is built with hidden visibility, so that libembps.so
 * exports these functions and nothing else. */
#if defined(__GNUC__) || defined(__clang__)
#define EMBPS_EXPORT __attribute__((visibility("default")))
#else
#define EMBPS_EXPORT
#endif

/** A connection to a shard group. Opaque; one thread at a time. */
typedef struct embps_client embps_client_t;
/** A call in flight, returned by the *_start functions and finished by embps_call_wait(). */
typedef struct embps_call embps_call_t;

/** Push modes; values equal embps.v1.UpdateMode. */
typedef enum embps_push_mode {
  EMBPS_PUSH_SYNC = 0,  /* the reply comes after the update is applied */
  EMBPS_PUSH_ASYNC = 1, /* the reply comes once the update is ordered */
} embps_push_mode_t;

/** Client options. Initialize with embps_client_options_init() and change what you need. A
 * field left zero means its default, so a zero-filled struct is the defaults too. */
typedef struct embps_client_options {
  /** Deadline of every call in milliseconds, counted from its start: it bounds the whole call,
   * retries and their backoff included, and each attempt sends what is left of it as
   * grpc-timeout. 0: none. */
  int64_t deadline_ms;
  /** Deadline of connecting to each server (and learning the group size); 0: 10000 ms. */
  int64_t connect_timeout_ms;
  /** Non-zero: pad a batch whose size is not a multiple of the group size with token 0 up to
   * the next multiple; padded rows are dropped from lookups and padded gradients are zero.
   * Zero (the default): such a batch fails with EMBPS_INVALID_ARGUMENT. */
  int pad_batches;
  /** The group size, if known. 0 (the default): learn it from the servers' ListTables at
   * connect time and check that one address was given per rank. */
  uint32_t group_size;
  /** A bearer token sent on every call as the metadata 'authorization: Bearer TOKEN', for
   * servers started with --auth-tokens-file. The string is copied at connect time (the caller
   * keeps its own). NULL or "" (the default): no authorization metadata. A token with a
   * character outside visible ASCII, or longer than 1000 bytes, fails the connect with
   * EMBPS_INVALID_ARGUMENT. */
  const char *token;
  /** TLS: a PEM file of the CA certificates that sign the servers' certificates. NULL or ""
   * (the default): cleartext HTTP/2 (h2c). Set: every connection is TLS 1.2 or 1.3 with ALPN
   * h2, and a server's certificate must chain to these CAs and name the host dialed (or
   * tls_server_name). The files are read by embps_client_connect(). */
  const char *tls_ca;
  /** Mutual TLS: this client's PEM certificate chain and its private key, presented when a
   * server asks (embps-server --tls-client-ca). Both or neither; they need tls_ca. */
  const char *tls_cert;
  const char *tls_key;
  /** The name every server's certificate must carry (a DNS name or an IP address), for
   * addresses that differ from it (a load balancer, an IP); NULL: each address's host. */
  const char *tls_server_name;
  /** Each attempt's own deadline in milliseconds, within deadline_ms: an attempt that passes it
   * is cancelled and, when attempts are left, retried. 0 (the default): an attempt may use all
   * that deadline_ms leaves. Negative values count as 0. */
  int64_t attempt_timeout_ms;
  /** Most attempts of a lookup or push, the first one included: a batch that fails with
   * UNAVAILABLE or DEADLINE_EXCEEDED (a lost connection, a group shutting down or broken, an
   * attempt's timeout), while time is left, is sent again whole, every shard, with the same
   * batch id and digest and the next attempt number, after a backoff (20 ms doubling to 1 s,
   * jittered). A push is therefore applied at most once: a retry of one the group applied
   * already is answered with the first result (embps_push_result_t.replayed). 1: no retry.
   * 0: the default, 4. Over EMBPS_MAX_ATTEMPTS fails the connect with EMBPS_INVALID_ARGUMENT.
   * Other calls (tables, stats, checkpoints) are not retried. */
  uint32_t max_attempts;
} embps_client_options_t;

/** Most attempts embps_client_options_t.max_attempts may ask for. */
#define EMBPS_MAX_ATTEMPTS 100u

/** A table's specification: what embps_create_table() takes and embps_list_tables() and
 * embps_create_table_answered() return. Zero fields mean the server's defaults (see
 * proto/embps/v1/embps.proto). */
typedef struct embps_table_spec {
  /** The table's name. For create: the caller's string, read during the call. In a list:
   * owned by the list, freed by embps_tables_free(). */
  const char *name;
  uint64_t rows;
  uint32_t emb_width;
  embps_dtype_t dtype; /* 0: f32 */
  embps_optimizer_t optimizer;
  float lr;
  float eps;
  float half_life; /* accumulator half-life in steps; 0: no decay */
  float initial_accumulator;
  float weight_decay;
  float beta1;
  float beta2;
  uint64_t seed;
  float init_scale; /* 0: 1/sqrt(emb_width) */
  /* A hash-keyed table (any 64-bit id is a key; 0 stays padding): capacity slots instead of
   * rows (rows must then be 0). 0: a dense table of rows. The fields below it are hash-keyed
   * only. Both backends (cpu and cuda) serve hash-keyed tables. */
  uint64_t capacity;
  uint32_t admit_after;      /* store a key at its admit_after-th push step; 0 or 1: at once */
  embps_eviction_t eviction; /* 0: LRU */
  uint64_t half_life_steps;  /* LFU only: push steps over which a push's weight halves */
  uint64_t ttl_steps;        /* TTL only: push steps without a push before a key expires */
  uint32_t sketch_width;     /* admission's counters per sketch row; 0: the server's default */
} embps_table_spec_t;

/** The reply to a push, joined over the group's ranks. */
typedef struct embps_push_result {
  int applied;  /* 1: the update was applied (sync) */
  int skipped;  /* 1: a non-finite gradient gated the whole step; nothing changed */
  int ordered;  /* 1: async push ordered, not yet applied */
  int replayed; /* 1: a retry of a push the group had applied already: nothing was applied again,
                   and the other fields are the first attempt's answer */
  double grad_norm;    /* L2 norm of the summed gradients (sync only) */
  uint64_t num_unique; /* distinct non-padding tokens in the batch (sync only) */
} embps_push_result_t;

/** The reply to an assign, joined over the group's ranks (every rank reports the same). */
typedef struct embps_assign_result {
  uint64_t num_assigned; /* distinct nonzero tokens whose rows were written */
  uint64_t num_refused;  /* hash-keyed: distinct keys given no slot (every slot was held by a key
                            of this batch); their rows were not written */
  int replayed;          /* 1: a retry of an assign the group had applied already: nothing was
                            written again, and the counts are the first attempt's */
} embps_assign_result_t;

/** One table's counters on one rank. */
typedef struct embps_table_stats {
  char *name; /* owned by the stats array */
  uint64_t rows;
  uint32_t emb_width;
  uint64_t lookups;
  uint64_t pushes;
  uint64_t rows_looked_up;
  uint64_t rows_pushed;
  uint64_t steps_applied;
  uint64_t steps_skipped;
  uint64_t bytes;
  /* A hash-keyed table's index on this rank (all 0 for a dense table): its slots, the keys it
   * stores now, and since the table was created the keys admitted (given a slot), evicted (their
   * slot given to another key), expired (ttl eviction), refused (no slot free or evictable in
   * their step), and the (key, push step) gradients dropped (the key not admitted yet, or
   * refused). Every rank keeps the same index, so every rank reports the same numbers. */
  uint64_t capacity;
  uint64_t keys;
  uint64_t keys_admitted;
  uint64_t keys_evicted;
  uint64_t keys_expired;
  uint64_t keys_refused;
  uint64_t gradients_dropped;
} embps_table_stats_t;

/** One rank's statistics. */
typedef struct embps_rank_stats {
  uint32_t rank;
  uint32_t group_size;
  char *backend; /* "cpu" or "cuda"; owned by the stats array */
  char *version; /* owned by the stats array */
  char *address; /* the host:port this client used; owned by the stats array */
  double uptime_s;
  uint64_t requests;
  uint64_t errors;
  uint64_t bytes_in;
  uint64_t bytes_out;
  uint32_t connections;
  int ready;                    /* the whole group is up */
  char *mesh;                   /* e.g. "shard=4"; owned by the stats array */
  uint64_t peer_bytes_sent;     /* collective payload sent to the other ranks */
  uint64_t peer_bytes_received; /* and received from them */
  uint64_t collective_calls;
  size_t num_tables;
  embps_table_stats_t *tables; /* num_tables entries, owned by the stats array */
} embps_rank_stats_t;

/** Fills opts with the defaults (no deadline, 10 s connect timeout, no padding, learn the
 * group size, no token, cleartext, 4 attempts for a lookup or push, no attempt timeout). */
EMBPS_EXPORT void embps_client_options_init(embps_client_options_t *opts);

/** Connects to every server of a shard group.
 *
 * servers is "host:port[,host:port...]", one address per rank in rank order ("[::1]:7070"
 * for IPv6). opts may be NULL for the defaults. On success *out is a new client that the
 * caller frees with embps_client_free(); on failure *out is left untouched and, when err is
 * not NULL, err holds the status and message.
 *
 * Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (bad address list or options);
 * EMBPS_UNAVAILABLE (a server cannot be reached); EMBPS_DEADLINE_EXCEEDED;
 * EMBPS_UNAUTHENTICATED (a server requires a token and none or an unknown one was given);
 * EMBPS_FAILED_PRECONDITION (the number of addresses is not the group's size);
 * EMBPS_RESOURCE_EXHAUSTED (out of memory); or the status of a failed ListTables. */
EMBPS_EXPORT embps_status_t embps_client_connect(embps_client_t **out, const char *servers,
                                                 const embps_client_options_t *opts,
                                                 embps_error_t *err);

/** Closes the connections and frees the client. Calls still in flight are cancelled and their
 * handles become invalid. NULL is a no-op. */
EMBPS_EXPORT void embps_client_free(embps_client_t *client);

/** The message of the client's last failure ("" if none). The string is owned by the client
 * and valid until its next call. Server errors carry the server's grpc-message; in a group of
 * more than one rank the message starts with the rank and its address. */
EMBPS_EXPORT const char *embps_client_last_error(const embps_client_t *client);

/** The status of the client's last failure (EMBPS_OK if none). */
EMBPS_EXPORT embps_status_t embps_client_last_status(const embps_client_t *client);

/** The group size (number of ranks) the client works with. */
EMBPS_EXPORT uint32_t embps_client_group_size(const embps_client_t *client);

/** Sets the deadline of later calls in milliseconds; 0: none. (Retries stay as the options
 * set them, within this deadline.) */
EMBPS_EXPORT void embps_client_set_deadline(embps_client_t *client, int64_t deadline_ms);

/** Sets whether later batches are padded to a multiple of the group size (see
 * embps_client_options_t.pad_batches). */
EMBPS_EXPORT void embps_client_set_padding(embps_client_t *client, int pad_batches);

/** The status's gRPC name, e.g. "INVALID_ARGUMENT". Static string. */
EMBPS_EXPORT const char *embps_status_string(embps_status_t status);

/** Zeroes spec (every field takes the server's default). */
EMBPS_EXPORT void embps_table_spec_init(embps_table_spec_t *spec);

/** Creates a table on the group (the request goes to rank 0, which creates it group-wide).
 * spec is read during the call. Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (e.g. emb_width
 * that does not shard evenly, checked here first); EMBPS_ALREADY_EXISTS; EMBPS_UNAVAILABLE;
 * EMBPS_DEADLINE_EXCEEDED; or another status the server returns. */
EMBPS_EXPORT embps_status_t embps_create_table(embps_client_t *client,
                                               const embps_table_spec_t *spec);

/** Creates a table like embps_create_table() and hands back the specification the server
 * created it with, every default filled in (dtype, optimizer, lr, eps, beta1, beta2,
 * init_scale). On EMBPS_OK, when created is not NULL, *created is a new one-element array owned
 * by the caller, freed with embps_tables_free(*created, 1); on failure it is untouched. Returns
 * the statuses of embps_create_table(), and EMBPS_RESOURCE_EXHAUSTED or EMBPS_INTERNAL when the
 * reply cannot be decoded (the table was created all the same). */
EMBPS_EXPORT embps_status_t embps_create_table_answered(embps_client_t *client,
                                                        const embps_table_spec_t *spec,
                                                        embps_table_spec_t **created);

/** Drops the table named name (NUL-terminated, read during the call) on the whole group: the
 * request goes to rank 0, which has every rank free the table's memory; its bytes go back to
 * each rank's --max-memory-bytes budget, and the name may be created again. Batches of the
 * table still in flight fail with EMBPS_NOT_FOUND. Returns EMBPS_OK; EMBPS_NOT_FOUND (no such
 * table); EMBPS_INVALID_ARGUMENT (an empty or malformed name); EMBPS_UNAVAILABLE;
 * EMBPS_DEADLINE_EXCEEDED; or another status the server returns. */
EMBPS_EXPORT embps_status_t embps_drop_table(embps_client_t *client, const char *name);

/** Lists the group's tables (asked of rank 0). On success *tables is an array of *n specs
 * owned by the caller, freed with embps_tables_free(); on failure they are untouched.
 * Returns EMBPS_OK; EMBPS_UNAVAILABLE; EMBPS_DEADLINE_EXCEEDED; EMBPS_RESOURCE_EXHAUSTED;
 * EMBPS_INTERNAL (malformed reply). */
EMBPS_EXPORT embps_status_t embps_list_tables(embps_client_t *client, embps_table_spec_t **tables,
                                              size_t *n);

/** Frees an array from embps_list_tables(), names included. NULL is a no-op. */
EMBPS_EXPORT void embps_tables_free(embps_table_spec_t *tables, size_t n);

/** Looks up the rows of n tokens of table, blocking until they arrive, retrying the batch on
 * UNAVAILABLE and DEADLINE_EXCEEDED as options.max_attempts allows (within deadline_ms).
 *
 * tokens: n token ids, read during the call. out: the caller's buffer of out_bytes =
 * n * emb_width * dtype size bytes, which receives one full row per token, in token order,
 * in the table's dtype (the reply is copied straight into it). Returns EMBPS_OK;
 * EMBPS_INVALID_ARGUMENT (n not a multiple of the group size without padding, out_bytes not
 * matching the table's rows, a token out of range, ...); EMBPS_NOT_FOUND (no such table);
 * EMBPS_UNAVAILABLE (connection lost); EMBPS_DEADLINE_EXCEEDED; EMBPS_INTERNAL (malformed
 * reply); or another status the server returns. */
EMBPS_EXPORT embps_status_t embps_lookup(embps_client_t *client, const char *table,
                                         const int64_t *tokens, size_t n, void *out,
                                         size_t out_bytes);

/** Starts a lookup without waiting (see embps_lookup()). tokens and out must stay valid and
 * untouched until embps_call_wait() returns for *call (a retry sends tokens again and rewrites
 * out). On success *call is a handle that must be finished with embps_call_wait() or dropped
 * with embps_call_cancel(); on failure *call is untouched and the status is one of
 * embps_lookup()'s (validation errors; a rank that cannot be reached when retries are off).
 * Retries (options.max_attempts) happen while embps_call_wait(), embps_call_test() or
 * embps_call_wait_for() runs for this call, and are sent after calls started later. */
EMBPS_EXPORT embps_status_t embps_lookup_start(embps_client_t *client, const char *table,
                                               const int64_t *tokens, size_t n, void *out,
                                               size_t out_bytes, embps_call_t **call);

/** Pushes gradients for n tokens of table, blocking until the reply arrives.
 *
 * grads: n full-width rows of dtype (grad_bytes = n * emb_width * dtype size bytes), read
 * during the call. result, if not NULL, receives the joined reply. A push that fails with
 * UNAVAILABLE or DEADLINE_EXCEEDED is retried as options.max_attempts allows, with the same
 * batch id and digest, so it is applied at most once (result->replayed says a retry found it
 * applied). Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (shape or dtype mismatch); EMBPS_NOT_FOUND;
 * EMBPS_UNAVAILABLE or EMBPS_DEADLINE_EXCEEDED (the last attempt's: the update may or may not
 * have been applied, see docs/c-library.md); EMBPS_INTERNAL; or another status the server
 * returns. */
EMBPS_EXPORT embps_status_t embps_push(embps_client_t *client, const char *table,
                                       const int64_t *tokens, size_t n, const void *grads,
                                       size_t grad_bytes, embps_dtype_t dtype,
                                       embps_push_mode_t mode, embps_push_result_t *result);

/** Starts a push without waiting (see embps_push()). tokens, grads and result must stay
 * valid until embps_call_wait() returns for *call; result is written then. On failure *call
 * is untouched. Retries happen as for embps_lookup_start(). */
EMBPS_EXPORT embps_status_t embps_push_start(embps_client_t *client, const char *table,
                                             const int64_t *tokens, size_t n, const void *grads,
                                             size_t grad_bytes, embps_dtype_t dtype,
                                             embps_push_mode_t mode, embps_push_result_t *result,
                                             embps_call_t **call);

/** One feature of a feature batch (docs/design.md, "Feature batches"): for each of the batch's
 * batch_size samples a bag of ids of one table, as a jagged list, and how its rows are pooled.
 * Every pointer is the caller's, read (or, for out, written) during the call; a *_start variant
 * borrows them until embps_call_wait() returns. Zero-fill it and set what the call needs. */
typedef struct embps_feature {
  const char *name;        /* unique within the batch; names the feature in errors */
  const char *table;       /* several features may share one */
  embps_pooling_t pooling; /* EMBPS_POOLING_NONE (0, a zero-filled struct) keeps a row per id */
  const int64_t *ids;      /* num_ids ids, every bag's, bag after bag (sample 0's first) */
  size_t num_ids;
  const uint32_t *lengths; /* batch_size entries: the ids of each sample's bag (0: empty) */
  const float *weights;    /* num_ids, with EMBPS_POOLING_WEIGHTED_SUM only; else NULL */
  /* Lookup: the caller's buffer of out_bytes, which receives a pooled feature's batch_size rows
   * of f32 (out_bytes = batch_size x emb_width x 4), or with pooling none one row per id in the
   * table's dtype (num_ids x emb_width x dtype size), as embps_lookup(). */
  void *out;
  size_t out_bytes;
  /* Push: grad_bytes of gradients, read during the call: a pooled feature's one f32 row per
   * sample (batch_size x emb_width x 4), which the servers expand to the bag's ids (times the
   * weight, over the bag's nonzero ids for mean); pooling none one row per id in the table's
   * dtype, as embps_push(). */
  const void *grads;
  size_t grad_bytes;
} embps_feature_t;

/** The step a feature batch's push took on one table: every feature of the table contributed
 * to one dedup, segment sum, non-finite gate and optimizer update. */
typedef struct embps_feature_step {
  const char *table; /* the table's name: the caller's string (features[k].table of the first
                        feature naming it), valid while that is */
  /* applied, skipped, grad_norm and num_unique of the table's step (sync); ordered (async); and
   * replayed, when a retry found the whole push applied already: nothing was applied again, and
   * the servers keep no per-table answer for it, so the other fields are then 0. */
  embps_push_result_t result;
} embps_feature_step_t;

/** Looks up a batch of batch_size samples of n features in one call per rank (LookupFeatures),
 * pooling on the servers, blocking until every rank has answered, retried as embps_lookup() is.
 *
 * The batch is split by samples: rank r of N gets samples [r B/N, (r+1) B/N) of every feature.
 * batch_size must be a multiple of N, or, when the client pads (pad_batches), it is padded up to
 * one with empty bags whose rows are dropped. Each feature's rows land in its out buffer (see
 * embps_feature_t). Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (no features, a name missing or used
 * twice, lengths that do not add up to num_ids, weights with a pooling other than weighted sum or
 * missing with it, a buffer that does not hold whole rows, batch_size 0, over 2^32-1 or not
 * splitting without padding: checked here before anything is sent; or the server's checks: an id
 * outside a dense table, a buffer that does not fit the table's rows), the message naming the
 * feature; EMBPS_NOT_FOUND (a feature's table does not exist); EMBPS_UNAVAILABLE;
 * EMBPS_DEADLINE_EXCEEDED; EMBPS_INTERNAL (malformed reply); EMBPS_RESOURCE_EXHAUSTED; or
 * another status the server returns. On failure no feature's out holds a complete answer. */
EMBPS_EXPORT embps_status_t embps_lookup_features(embps_client_t *client,
                                                  const embps_feature_t *features, size_t n,
                                                  size_t batch_size);

/** Starts a feature lookup without waiting (see embps_lookup_features()). features (the array
 * and everything it points to) must stay valid and untouched until embps_call_wait() returns
 * for *call, which writes the out buffers. On failure *call is untouched. */
EMBPS_EXPORT embps_status_t embps_lookup_features_start(embps_client_t *client,
                                                        const embps_feature_t *features, size_t n,
                                                        size_t batch_size, embps_call_t **call);

/** Pushes one gradient per bag (per id for pooling none) of a batch of batch_size samples of n
 * features in one call per rank (PushFeatures), blocking until the reply; split, padded (padded
 * samples push nothing) and retried as embps_lookup_features(), and like embps_push() applied at
 * most once. steps, when not NULL, has room for n entries and receives one per table the batch
 * names, in the order the features first name them; *num_steps (may be NULL) their count.
 * Returns embps_lookup_features()'s statuses (gradients of the wrong size for the table, in the
 * server's words) and, like embps_push(), EMBPS_UNAVAILABLE or EMBPS_DEADLINE_EXCEEDED from the
 * last attempt, when the update may or may not have been applied. */
EMBPS_EXPORT embps_status_t embps_push_features(embps_client_t *client,
                                                const embps_feature_t *features, size_t n,
                                                size_t batch_size, embps_push_mode_t mode,
                                                embps_feature_step_t *steps, size_t *num_steps);

/** Starts a feature push without waiting (see embps_push_features()). features, steps and
 * num_steps must stay valid until embps_call_wait() returns for *call; the steps are written
 * then. On failure *call is untouched. */
EMBPS_EXPORT embps_status_t embps_push_features_start(embps_client_t *client,
                                                      const embps_feature_t *features, size_t n,
                                                      size_t batch_size, embps_push_mode_t mode,
                                                      embps_feature_step_t *steps,
                                                      size_t *num_steps, embps_call_t **call);
/** Sets the rows of n tokens of table to the rows given, blocking until every rank has written
 * them (the Assign RPC: warm starts, imports, rows fixed by hand).
 *
 * rows: n full-width rows of dtype, which must be the table's (rows_bytes = n * emb_width *
 * dtype size bytes), read during the call; each is written bit for bit. A token given twice
 * takes its last row; token 0 (padding) is skipped. On a hash-keyed table a key without a slot
 * is inserted (no admission count; the table's eviction rule frees a slot when it is full); keys
 * left without one are counted in result->num_refused. reset_state non-zero: the rows' optimizer
 * state goes back to its initial value too (an accumulator to initial_accumulator, Adam's
 * moments to 0); zero: it stays (a key given a new slot starts from the initial state either
 * way). The assign is ordered like a push: a lookup started after it sees it. It is retried
 * like a push (options.max_attempts) with the same batch id and digest and written at most once
 * (result->replayed). result may be NULL. Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (shape,
 * dtype, a token outside a dense table's rows; nothing written); EMBPS_NOT_FOUND;
 * EMBPS_PERMISSION_DENIED (a reader's token: assign needs the worker or admin role);
 * EMBPS_UNAVAILABLE or EMBPS_DEADLINE_EXCEEDED (the last attempt's: see embps_push());
 * EMBPS_INTERNAL; or another status the server returns. */
EMBPS_EXPORT embps_status_t embps_assign(embps_client_t *client, const char *table,
                                         const int64_t *tokens, size_t n, const void *rows,
                                         size_t rows_bytes, embps_dtype_t dtype, int reset_state,
                                         embps_assign_result_t *result);

/** Starts an assign without waiting (see embps_assign()). tokens, rows and result must stay
 * valid until embps_call_wait() returns for *call; result is written then. On failure *call is
 * untouched. Retries happen as for embps_lookup_start(). */
EMBPS_EXPORT embps_status_t embps_assign_start(embps_client_t *client, const char *table,
                                               const int64_t *tokens, size_t n, const void *rows,
                                               size_t rows_bytes, embps_dtype_t dtype,
                                               int reset_state, embps_assign_result_t *result,
                                               embps_call_t **call);

/** Waits for a call to finish, moving I/O for every connection of its client meanwhile and
 * sending the call's retries, and frees the handle. Returns the call's status (EMBPS_OK or any
 * status the blocking variant lists); the message is then embps_client_last_error(), which
 * says how many attempts were made when there was more than one. */
EMBPS_EXPORT embps_status_t embps_call_wait(embps_call_t *call);

/** Moves I/O without blocking, sends the call's retry when one is due, and tells whether the
 * call has finished (1) or not (0: still running, or waiting for its next attempt); a finished
 * call still needs embps_call_wait(), which then returns at once. */
EMBPS_EXPORT int embps_call_test(embps_call_t *call);

/** Like embps_call_test(), but waits up to timeout_ms milliseconds for I/O on the client's
 * connections first: returns 1 as soon as the call has finished, 0 when the time passed or when
 * I/O for other calls of the client arrived (call it again to keep waiting). Lets one thread keep
 * several calls in flight and start new ones on a schedule (embps bench --rate). */
EMBPS_EXPORT int embps_call_wait_for(embps_call_t *call, int timeout_ms);

/** Cancels a call and frees the handle; the buffers it was given may be reused on return.
 * NULL is a no-op. */
EMBPS_EXPORT void embps_call_cancel(embps_call_t *call);

/** Gets the statistics of every rank. On success *stats is an array of *n entries (one per
 * rank, in rank order) owned by the caller and freed with embps_stats_free(). Returns
 * EMBPS_OK; EMBPS_UNAVAILABLE; EMBPS_DEADLINE_EXCEEDED; EMBPS_RESOURCE_EXHAUSTED;
 * EMBPS_INTERNAL. */
EMBPS_EXPORT embps_status_t embps_stats(embps_client_t *client, embps_rank_stats_t **stats,
                                        size_t *n);

/** Frees an array from embps_stats(). NULL is a no-op. */
EMBPS_EXPORT void embps_stats_free(embps_rank_stats_t *stats, size_t n);

/** Gets every rank's metrics in the Prometheus text exposition format (what the rank's
 * --metrics-listen endpoint serves at /metrics). On success *texts is an array of *n
 * NUL-terminated strings (rank order) owned by the caller and freed with
 * embps_stats_prometheus_free(). Returns as embps_stats(). */
EMBPS_EXPORT embps_status_t embps_stats_prometheus(embps_client_t *client, char ***texts,
                                                   size_t *n);

/** Frees an array from embps_stats_prometheus(). NULL is a no-op. */
EMBPS_EXPORT void embps_stats_prometheus_free(char **texts, size_t n);

/** Asks every rank's grpc.health.v1.Health/Check for service ("" : the whole server).
 * *serving is 1 when every rank answers SERVING, else 0, and the last error then names the
 * first rank that is not. Returns EMBPS_OK when every rank answered; EMBPS_UNAVAILABLE;
 * EMBPS_DEADLINE_EXCEEDED; EMBPS_NOT_FOUND (unknown service); EMBPS_INTERNAL. */
EMBPS_EXPORT embps_status_t embps_health(embps_client_t *client, const char *service, int *serving);

/** A complete checkpoint, as the servers describe it. */
typedef struct embps_checkpoint_info {
  uint64_t round;  /* the tables as they stood at this round */
  uint64_t bytes;  /* every rank's files */
  char path[1100]; /* its directory, on the servers */
  /* embps_list_checkpoints only: */
  uint64_t time_unix_ms; /* when it became complete */
  uint32_t group_size;   /* ranks that wrote it; any group size restores it */
  uint64_t base_round;   /* incremental: the checkpoint it applies on; 0 when full */
  char scope[128];       /* "": every table; else the one table it holds */
  char tables[1024];     /* its tables, comma-separated (clipped with "..." if longer) */
} embps_checkpoint_info_t;

/** Asks the group to take a checkpoint of table (NULL or "": every table) into the servers'
 * --checkpoint-dir now, and waits until it is complete (every rank's files durable, the
 * manifest written). *info (may be NULL) receives its round, path and bytes. Returns EMBPS_OK
 * or the server's status (FAILED_PRECONDITION without --checkpoint-dir; RESOURCE_EXHAUSTED when
 * a disk filled up, naming the file). */
EMBPS_EXPORT embps_status_t embps_checkpoint(embps_client_t *client, const char *table,
                                             embps_checkpoint_info_t *info);

/** The complete checkpoints in the group's --checkpoint-dir, oldest first (as rank 0 sees the
 * directory): *list (free with embps_checkpoints_free) holds *n entries. */
EMBPS_EXPORT embps_status_t embps_list_checkpoints(embps_client_t *client,
                                                   embps_checkpoint_info_t **list, size_t *n);

/** Frees a list from embps_list_checkpoints(). NULL is a no-op. */
EMBPS_EXPORT void embps_checkpoints_free(embps_checkpoint_info_t *list);

#ifdef __cplusplus
}
#endif

#endif
