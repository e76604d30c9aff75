/* What the files of libembps share beyond the public face (include/embps/embps.h): the client and
 * call objects, and the functions one file offers the others. Internal (embps__ prefix).
 *
 *   client.c  the client object: connect, free, options, the last error
 *   call.c    calls in flight: one stream per shard, pipelining, waiting, decoding replies
 *   batch.c   lookups and pushes: a batch split into one token shard per rank
 *   admin.c   the unary admin calls (tables, stats, health, checkpoint) */
#ifndef EMBPS_CLIENT_INTERNAL_H
#define EMBPS_CLIENT_INTERNAL_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "client/conn.h"
#include "client/group.h"
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

struct embps_call {
  embps_client_t *client;
  uint64_t batch_id;
  int64_t deadline; /* CLOCK_MONOTONIC ms; 0: none */
  uint32_t nshards;
  uint32_t pending;
  uint8_t *req; /* a unary request, shared by the shards */
  embps_push_result_t *push_result;
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
 * client's list of calls in flight, with the client's deadline from now. NULL when out of
 * memory. Freed with embps__call_free(). */
embps_call_t *embps__call_new(embps_client_t *c, uint32_t nshards);

/** Resets the call's open streams, takes it off the client's list and frees it. */
void embps__call_free(embps_call_t *call);

/** Creates shard sh's stream for path with the request segs, submits it on the shard's rank,
 * and counts it as pending. Failures are recorded as the client's last error. */
embps_status_t embps__shard_submit(embps_call_t *call, embps__shard_t *sh, const char *path,
                                   const embps__seg_t *segs, int nsegs);

/** Sends what the call's connections can take now. */
void embps__call_kick(embps_call_t *call);

/** Moves I/O until every stream of call has finished or the deadline passes. Does not free. */
void embps__call_run(embps_call_t *call);

/** The call's status: the first failing shard's, in rank order, recorded as the last error. */
embps_status_t embps__call_status(embps_call_t *call);

/** Unpacks rank's reply, gathered in s's buffer, as a message of type desc, to be freed with
 * embps__reply_free(). NULL on failure, recorded as the client's last error: RESOURCE_EXHAUSTED
 * when an allocation failed, INTERNAL for a malformed reply. */
ProtobufCMessage *embps__reply_unpack(embps_client_t *c, const ProtobufCMessageDescriptor *desc,
                                      const embps__stream_t *s, uint32_t rank);

/** Frees a message from embps__reply_unpack(). */
void embps__reply_free(ProtobufCMessage *m);

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
