/* What the service's modules share: the service itself, the request that carries a call to the
 * group and back, the method table, and the helpers every method uses. The modules are
 * service.c (construction, the method table and dispatch, completion), svc_tables.c
 * (CreateTable, DropTable, ListTables), svc_batch.c (Lookup, PushGradients, Assign),
 * svc_checkpoint.c (Checkpoint, ListCheckpoints), svc_stats.c (GetStats, Health) and svc_wire.c
 * (the walkers of a request's own bytes and the LookupResponse header). Internal to the service
 * layer. */
#ifndef EMBPS_SERVICE_INTERNAL_H
#define EMBPS_SERVICE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/service/auth.h"
#include "server/service/bufpool.h"
#include "server/service/service.h"
#include "embps/v1/embps.pb-c.h"

/** Tables being created at once (their names are reserved until the create is done). */
#define EMBPS__SVC_MAX_PENDING_CREATES 64

struct embps_service {
  embps_group_t *group;
  embps_store_t *store;
  embps_net_t *net;
  embps_service_config_t cfg;
  /* Request and reply buffers, reused; pinned with the CUDA backend. Requests are unpacked
   * through `pb`, so their tokens and gradients land in the pool's memory. */
  embps_bufpool_t *buffers;
  ProtobufCAllocator pb;
  int unpack_out_of_memory; /* an allocation of the last failed unpack failed */
  uint64_t inflight;
  int draining;        /* embps_service_drain: new calls are refused */
  uint64_t started_ns; /* embps_now_ns() at creation */
  /* Names of tables being created (leader only), so a second create of a name fails at once. */
  char pending_creates[EMBPS__SVC_MAX_PENDING_CREATES][EMBPS_TABLE_NAME_MAX];
  size_t num_pending_creates;
  char *(*render_metrics)(void *arg, size_t *len); /* GetStats' prometheus_text; may be NULL */
  void *render_metrics_arg;
  const embps_auth_t *auth; /* the tokens every call is checked against; NULL: auth off */
};

typedef struct embps__svc_request embps__svc_request_t;

/** Called on the loop thread when the group is done with a request whose call is still
 * unanswered: group_call.error says how it went. It answers the call (embps__svc_answer_failure
 * when the op failed); the request is freed after it returns. */
typedef void (*embps__svc_done_cb)(embps__svc_request_t *r);

/** One call handed to the group (group_call, whose op the engine runs). Owns the unpacked
 * request (tokens and gradients point into it) and, for a lookup, the reply buffer the engine
 * fills. */
struct embps__svc_request {
  embps_service_t *svc;
  embps_net_call_t *call; /* NULL once answered (an async push is answered before it runs) */
  embps__svc_done_cb done;
  ProtobufCMessage *msg;
  uint8_t *wire; /* a push read in place: the request's bytes, which op.grads points into */
  embps_group_call_t group_call;
  embps_group_ckpt_t ckpt; /* Checkpoint: the request group_call carries */
  uint32_t shard_index;
  uint8_t *reply; /* lookup: from svc->buffers; NULL once the net streams it */
  size_t reply_len;
  size_t reply_head; /* lookup: the reply's bytes before the rows */
  size_t row_bytes;  /* lookup: bytes of one row */
  int streaming;     /* lookup: the reply began leaving as the engine fills it */
  int caller_gone;   /* lookup, push: its caller left before it was answered (the net's cancel
                        hook): what the group says of it later is nobody's news */
  void *extra;       /* a handler's own, freed with the request by extra_free */
  void (*extra_free)(void *extra);
};

/* ---- the method table ---- */

/** A method's handler, on the loop thread: msg[0..len) is the request message (never NULL).
 * *owned is the allocation that holds it, which the handler takes (setting *owned = NULL) when
 * the op it submits keeps reading the message; otherwise the dispatch frees it. */
typedef void (*embps__svc_handler_t)(embps_service_t *svc, embps_net_call_t *call,
                                     const uint8_t *msg, size_t len, uint8_t **owned);

/** A gRPC method this server knows: its path, the least role that may call it, and its handler
 * (NULL: known, so its role holds, but not served; answered UNIMPLEMENTED). */
typedef struct embps__svc_method {
  const char *path;
  embps_auth_role_t role;
  embps__svc_handler_t handler;
} embps__svc_method_t;

/** Every method, the one table that dispatch and the auth check read. */
extern const embps__svc_method_t embps__svc_methods[];
extern const size_t embps__svc_num_methods;

/** The table's row for path, or NULL for a method this server does not know. */
const embps__svc_method_t *embps__svc_method(const char *path);

/** The least role that may call a path not in the table: any known token, so that unknown
 * methods are not probed without one (they are then answered UNIMPLEMENTED). */
#define EMBPS__SVC_UNKNOWN_METHOD_ROLE EMBPS_AUTH_READER

/** The least role that may call the method of row m (embps__svc_method's answer): its row's, or
 * EMBPS__SVC_UNKNOWN_METHOD_ROLE for NULL. The dispatch's rule. */
static inline embps_auth_role_t embps__svc_role(const embps__svc_method_t *m) {
  return m ? m->role : EMBPS__SVC_UNKNOWN_METHOD_ROLE;
}

/** The least role that may call path: embps__svc_role of its row. */
embps_auth_role_t embps__svc_method_role(const char *path);

/* ---- the table settings <-> TableSpec (svc_tables.c, driven by common/table_fields.h) ---- */

/** c from spec (zeros stay zeros: embps_table_config_resolve fills defaults); a name too long
 * is kept too long so that resolve refuses it. */
void embps__svc_config_from_spec(const Embps__V1__TableSpec *spec, embps_table_config_t *c);
/** spec and o (initialized by the caller) from c; they point into c. */
void embps__svc_spec_from_config(const embps_table_config_t *c, Embps__V1__TableSpec *spec,
                                 Embps__V1__OptimizerConfig *o);

/* ---- the handlers (one module each family) ---- */

void embps__svc_lookup(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned);
void embps__svc_push(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                     uint8_t **owned);
void embps__svc_assign(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned);
void embps__svc_lookup_features(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                                size_t len, uint8_t **owned);
void embps__svc_push_features(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                              size_t len, uint8_t **owned);
void embps__svc_create_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                             size_t len, uint8_t **owned);
void embps__svc_drop_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                           size_t len, uint8_t **owned);
void embps__svc_list_tables(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                            size_t len, uint8_t **owned);
void embps__svc_checkpoint(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                           size_t len, uint8_t **owned);
void embps__svc_list_checkpoints(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                                 size_t len, uint8_t **owned);
void embps__svc_stats(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                      uint8_t **owned);
void embps__svc_health(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned);

/* ---- requests and answers (service.c) ---- */

/** A request for call that owns msg (the unpacked message; NULL: none), finished by done.
 * NULL when out of memory (msg then stays the caller's). */
embps__svc_request_t *embps__svc_request_new(embps_service_t *svc, embps_net_call_t *call,
                                             ProtobufCMessage *msg, embps__svc_done_cb done);

/** Hands the request to the group (as a checkpoint when group_call.ckpt is set, else its op);
 * it comes back through its done callback. */
void embps__svc_submit(embps__svc_request_t *r);

/** Answers r's call with r->group_call.error and returns 1 when it failed; 0 otherwise. */
int embps__svc_answer_failure(embps__svc_request_t *r);

/** Packs a protobuf-c message and answers the call with it (RESOURCE_EXHAUSTED when the reply
 * cannot be allocated). */
void embps__svc_reply(embps_net_call_t *call, const ProtobufCMessage *m);

/** Answers the call with err's status and message. */
void embps__svc_fail(embps_net_call_t *call, const embps_error_t *err);

/** Answers a call whose request did not unpack: INVALID_ARGUMENT ("malformed <type> message"), or
 * RESOURCE_EXHAUSTED when an allocation of the unpack failed. */
void embps__svc_fail_unpack(embps_service_t *svc, embps_net_call_t *call, const char *type);

/** EMBPS_OK when the group is ready; UNAVAILABLE (err says why) otherwise. */
embps_status_t embps__svc_check_group(embps_service_t *svc, embps_error_t *err);

/** The table called name (NULL: ""), or NULL with NOT_FOUND in err. */
embps_table_t *embps__svc_find_table(embps_service_t *svc, const char *name, embps_error_t *err);

/* ---- the wire (svc_wire.c) ---- */

/**
 * Finds the one occurrence of the length-delimited field `field` at the top of the message
 * msg[0..len): *at is where its key starts, *data where its bytes start, *n their count. Returns
 * 0 when the message does not parse, lacks the field or repeats it (the caller then unpacks the
 * whole message, which rules on all of that).
 */
int embps__svc_find_bytes_field(const uint8_t *msg, size_t len, uint32_t field, size_t *at,
                                size_t *data, size_t *n);

/**
 * Checks every table name in the protobuf message msg[0..len) (which protobuf-c has unpacked
 * already) on its full length with embps_table_name_check: path[0..depth) are the field numbers
 * down to the name (CreateTableRequest.spec.name is {1, 1}), and every occurrence of each is
 * checked, since protobuf merges repeated ones. An empty name is left to the call's own checks.
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT.
 */
embps_status_t embps__svc_check_names(const uint8_t *msg, size_t len, const uint32_t *path,
                                      size_t depth, embps_error_t *err);

/** The most bytes embps__svc_put_lookup_header writes. */
#define EMBPS__SVC_LOOKUP_HEADER_MAX 48

/** Writes LookupResponse's fields batch_id, shard_index, emb_width and dtype and the key and
 * length of rows at p; returns the bytes written. The rows themselves follow. */
size_t embps__svc_put_lookup_header(uint8_t *p, uint64_t batch_id, uint32_t shard_index,
                                    uint32_t emb_width, int dtype, size_t rows_bytes);

/**
 * The message msg[0..len) without the bytes field `inner` of each occurrence of its message field
 * `outer` (PushFeaturesRequest.features' gradients), in a new allocation of *rest_len bytes that
 * the caller frees; *bulk (a new array of *count, one per occurrence in order, that the caller
 * frees) points at each occurrence's field bytes inside msg (data NULL where it has none).
 * Returns NULL, having allocated nothing, when a field does not parse, an occurrence holds the
 * field twice (the caller then unpacks the whole message, which rules on it), or out of memory.
 */
uint8_t *embps__svc_strip_nested_bytes(const uint8_t *msg, size_t len, uint32_t outer,
                                       uint32_t inner, ProtobufCBinaryData **bulk, size_t *count,
                                       size_t *rest_len);

/** Writes LookupFeaturesResponse's fields batch_id and shard_index at p (p NULL: only counts
 * them); returns the bytes. The features follow, each laid out by
 * embps__svc_put_feature_rows_header and then its rows. */
size_t embps__svc_put_features_head(uint8_t *p, uint64_t batch_id, uint32_t shard_index);

/** Writes the key and length of one LookupFeaturesResponse.features and its FeatureRows' fields
 * name (NUL-terminated; NULL or empty: left out), emb_width and dtype, and the key and length of
 * its rows, at p (p NULL: only counts them); returns the bytes. rows_bytes of rows follow. */
size_t embps__svc_put_feature_rows_header(uint8_t *p, const char *name, uint32_t emb_width,
                                          int dtype, size_t rows_bytes);

#endif
