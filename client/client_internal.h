/* What the files of libembps share beyond the public face (include/embps/embps.h): the client and
 * call objects, and the functions one file offers the others. Internal (embps__ prefix).
 *
 *   client.c  the client object: connect, free, options, the last error
 *   call.c    calls in flight: one stream per shard, pipelining, waiting, decoding replies, and
 *             a batch's attempts (the rules of retry.c)
 *   batch.c   lookups, pushes and assigns: a batch split into one token shard per rank, its
 *             digest, and the requests of each attempt
 *   features.c  feature batches: a batch of samples of many features split into one sample
 *             shard per rank, its digest, each attempt's requests, and the replies joined
 *   admin.c   the unary admin calls (tables, stats, health, checkpoint) */
#ifndef EMBPS_CLIENT_INTERNAL_H
#define EMBPS_CLIENT_INTERNAL_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "client/conn.h"
#include "client/group.h"
#include "client/retry.h"
#include "client/wire.h"
#include "common/dtype.h"
#include "common/status.h"
#include "embps/embps.h"
#include "embps/v1/embps.pb-c.h"

#define EMBPS__PATH_PREFIX "/embps.v1.EmbeddingService/"

struct embps_client {
  embps__addr_t *addrs;
  SSL_CTX *tls_ctx;          /* NULL: cleartext h2c */
  char tls_server_name[256]; /* "": each address's own host */
  embps__conn_t **conns;
  uint32_t group_size; /* == number of addresses */
  int64_t deadline_ms;
  int64_t connect_timeout_ms;
  uint32_t max_attempts;      /* of a lookup or push; 1: no retry */
  int64_t attempt_timeout_ms; /* each attempt's own bound; 0: what the deadline leaves */
  uint64_t jitter;            /* the backoff's random sequence (splitmix64 state) */
  int pad;
  uint64_t next_batch_id;
  uint64_t client_id; /* random, never 0: sent with every batch (the scope of its ids) */
  embps_error_t last;
  embps_call_t *calls; /* in flight, for embps_client_free */
  char *authorization; /* "Bearer TOKEN" sent on every call, owned; NULL: none */
};

/** One shard of a call: the stream to one rank, with what its request and reply need. */
typedef struct embps__shard {
  embps_call_t *call;
  uint32_t rank;
  embps__stream_t *stream;
  embps__batch_frame_t frame;
  embps__lookup_parser_t parser;
} embps__shard_t;

/** What a lookup or push needs to send (and send again) its requests: the caller's arrays,
 * borrowed until the call is waited for, and the batch's plan and identity. */
typedef struct embps__batch_req {
  int is_push;           /* a push, or an assign (sent as a push's fields: see batch.c) */
  int is_assign;         /* an assign: rows in grads, reset_state in mode */
  char *table;           /* a copy, owned by the call: every attempt encodes it */
  const int64_t *tokens; /* the caller's n tokens */
  void *out;             /* lookup: the caller's buffer of rows */
  const void *grads;     /* push: the caller's gradient rows */
  uint64_t row_bytes;    /* bytes of one row of out or grads */
  embps__batch_plan_t plan;
  int dtype; /* push */
  int mode;  /* push */
  uint64_t digest;
} embps__batch_req_t;

/** A feature batch's request (features.c), owned by its call. */
typedef struct embps__feat_req embps__feat_req_t;

struct embps_call {
  embps_client_t *client;
  uint64_t batch_id;
  int64_t deadline;         /* the whole call's, CLOCK_MONOTONIC ms; 0: none */
  int64_t attempt_deadline; /* the current attempt's (never past deadline); 0: none */
  int64_t attempt_timeout;  /* the grpc-timeout its shards send, in ms; 0: none */
  uint32_t attempt;         /* the current attempt: 0 for the first */
  uint32_t max_attempts;    /* 1 for every call but a lookup's or push's */
  int64_t attempt_timeout_ms;
  int64_t retry_at;     /* > 0: the attempt failed, and the next one starts then */
  int final;            /* the outcome is settled (the current attempt's): no attempt follows */
  embps_error_t failed; /* a failure of the attempt that no stream carries (a request not sent) */
  uint32_t nshards;
  uint32_t pending; /* streams of the current attempt still running */
  uint8_t *req;     /* a unary request, shared by the shards */
  embps_push_result_t *push_result;
  embps_assign_result_t *assign_result;
  /* (Re)sends every shard of a batch for call->attempt; NULL for calls that are not retried.
   * On failure the shards it sent are withdrawn and call->failed says why. */
  embps_status_t (*send)(embps_call_t *call);
  embps__batch_req_t batch;
  embps__feat_req_t *feat; /* a feature batch's (features.c); NULL for every other call */
  /* Run by embps_call_wait once every shard succeeded, to join the ranks' replies (a push's
   * result); NULL when there is nothing to join. */
  embps_status_t (*join)(embps_call_t *call);
  embps_call_t *next, *prev;
  embps__shard_t shards[];
};

/* ---- client.c ---- */

/** Records st and the formatted message as the client's last error; returns st. */
embps_status_t embps__client_fail(embps_client_t *c, embps_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** Records err as the client's last error; returns its status. */
embps_status_t embps__client_fail_err(embps_client_t *c, const embps_error_t *err);

/* ---- call.c ---- */

/** A call of nshards shards (shard i for rank i until the caller says otherwise) on the
 * client's list of calls in flight, with the client's deadline from now and one attempt bounded
 * by it. NULL when out of memory. Freed with embps__call_free(). */
embps_call_t *embps__call_new(embps_client_t *c, uint32_t nshards);

/** Resets the call's open streams, takes it off the client's list and frees it. */
void embps__call_free(embps_call_t *call);

/** Creates shard sh's stream for path with the request segs, submits it on the shard's rank
 * (reconnecting it first if it was lost, within the connect timeout and what the attempt has
 * left), with the attempt's grpc-timeout, and counts it as pending. Failures are recorded as
 * the client's last error, naming the rank in a group of more than one. */
embps_status_t embps__shard_submit(embps_call_t *call, embps__shard_t *sh, const char *path,
                                   const embps__seg_t *segs, int nsegs);

/** Withdraws the current attempt after a failure that no stream carries: records err (the
 * client's last error) as call->failed, resets the streams already submitted (their servers
 * withdraw those shards) and forgets them. Returns err's status. */
embps_status_t embps__call_attempt_failed(embps_call_t *call, const embps_error_t *err);

/** Sends what the call's connections can take now. */
void embps__call_kick(embps_call_t *call);

/** Moves I/O, and starts the call's later attempts when the rules of retry.h say so, until the
 * call's outcome is settled (every stream of its last attempt has finished, or its deadline
 * passed). Does not free. */
void embps__call_run(embps_call_t *call);

/** The call's status, recorded as the last error: its last attempt's failure that no stream
 * carries, else its first failing shard's in rank order, one that is not CANCELLED first (a
 * shard the servers cancelled because a sibling was lost says less than the loss). After more
 * than one attempt the message says how many were made. */
embps_status_t embps__call_status(embps_call_t *call);

/** Unpacks rank's reply, gathered in s's buffer, as a message of type desc, to be freed with
 * embps__reply_free(). NULL on failure, recorded as the client's last error: RESOURCE_EXHAUSTED
 * when an allocation failed, INTERNAL for a malformed reply. */
ProtobufCMessage *embps__reply_unpack(embps_client_t *c, const ProtobufCMessageDescriptor *desc,
                                      const embps__stream_t *s, uint32_t rank);

/** Frees a message from embps__reply_unpack(). */
void embps__reply_free(ProtobufCMessage *m);

/** EMBPS_OK when rank's reply (of the RPC `what`) answers this call: its batch id and its shard
 * index (rank). Otherwise INTERNAL naming both, recorded as the client's last error. */
embps_status_t embps__reply_check(embps_call_t *call, const char *what, uint32_t rank,
                                  uint64_t batch_id, uint32_t shard_index);

/* ---- features.c ---- */

/** Frees a feature batch's request (the caller's arrays it borrows stay). NULL is a no-op. */
void embps__feat_req_free(embps__feat_req_t *r);

/* ---- feat_wire.c ---- */

/** A feature request's bytes as segments: segs[0..nsegs) joined are the request, gRPC prefix
 * first; a segment either lies in small (the bytes written here) or is a bulk field's bytes where
 * the message's FeatureShard points. Zeroed to start; reused from one encoding to the next; freed
 * with embps__feat_wire_free. */
typedef struct embps__feat_wire {
  uint8_t *small;
  size_t small_len, small_cap;
  embps__seg_t *segs;
  uint64_t *small_at; /* per segment: its offset in small, or UINT64_MAX for a bulk one */
  int nsegs, seg_cap;
} embps__feat_wire_t;

/**
 * Lays out m (a LookupFeaturesRequest or PushFeaturesRequest whose repeated features are the
 * *n_features shards at features) in w: the bytes protobuf_c_message_pack(m) writes, behind a gRPC
 * prefix, without copying the shards' ids, lengths, weights and gradients (the segments point at
 * them: they must stay until the request is sent). *total receives the bytes, prefix included.
 * *n_features is changed while it runs and restored. INVALID_ARGUMENT when m packs to more than
 * 4 GiB - 1 (*total says how much), RESOURCE_EXHAUSTED when out of memory; nothing is recorded
 * as the client's error.
 */
embps_status_t embps__feat_encode(ProtobufCMessage *m, size_t *n_features,
                                  Embps__V1__FeatureShard **features, embps__feat_wire_t *w,
                                  uint64_t *total);

/** Frees w's buffers and zeroes it. NULL is a no-op. */
void embps__feat_wire_free(embps__feat_wire_t *w);

/** One FeatureRows of a LookupFeaturesResponse, read in place: name (name_len bytes, not
 * NUL-terminated; "" when absent) and rows point into the reply. */
typedef struct embps__feat_rows {
  const char *name;
  size_t name_len;
  uint32_t emb_width;
  int dtype;
  const uint8_t *rows;
  uint64_t rows_len;
} embps__feat_rows_t;

/**
 * Reads the LookupFeaturesResponse p[0..n) where it lies, as protobuf-c would decode it but
 * without copying the rows: its batch id and shard index (0 when absent), and its features in
 * order, the first cap of them into rows; *count receives how many it holds. Fields it does not
 * know are skipped. Returns 1, or 0 when the bytes do not parse.
 */
int embps__feat_lookup_reply(const uint8_t *p, size_t n, uint64_t *batch_id, uint32_t *shard_index,
                             embps__feat_rows_t *rows, size_t cap, size_t *count);

/* ---- admin.c ---- */

/** Learns the group size from every rank's ListTables and checks it against the addresses. */
embps_status_t embps__learn_group_size(embps_client_t *c);

/** Fills the TableSpec ts and its OptimizerConfig oc (both initialized by the caller) from spec:
 * its name (ts points at spec's string) and every setting of common/table_fields.h. */
void embps__table_spec_to_pb(const embps_table_spec_t *spec, Embps__V1__TableSpec *ts,
                             Embps__V1__OptimizerConfig *oc);

/** Fills *out from the TableSpec ts: the name copied (owned by out, freed with embps_free), the
 * settings (those of the OptimizerConfig only when ts has one), and an unset dtype as f32.
 * Returns 0, or -1 when out of memory (nothing allocated). */
int embps__table_spec_from_pb(const Embps__V1__TableSpec *ts, embps_table_spec_t *out);

#endif
