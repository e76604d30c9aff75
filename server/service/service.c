/* The service: construction, the method table, dispatch, and the completion of the calls it
 * hands to the group.
 *
 * Every method is one row of embps__svc_methods: its path, the least role that may call it and
 * its handler. A call is checked against the tokens with its row's role (auth.c decides whether
 * a token holds that role), then refused if the server is draining, then handed to its handler,
 * all before any method runs. The handlers live in a module per family (svc_tables.c,
 * svc_batch.c, svc_checkpoint.c, svc_stats.c); each decodes its request with protobuf-c and
 * validates it in one place before anything is queued, so a rejected request has changed
 * nothing.
 *
 * A handler that needs the group makes a request (embps__svc_request_new) whose op the group
 * runs and whose done callback answers the call on the loop thread. Order: the loop thread
 * submits ops in arrival order and the group runs the batches of one connection in that order on
 * every rank, so a lookup that arrives after a push (async or sync) sees it.
 *
 * Requests are unpacked through a protobuf-c allocator over the service's buffer pool (pinned
 * host memory with the CUDA backend), so their tokens and gradients land where the device can
 * copy from. */
#include "server/service/service.h"

#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/service/service_internal.h"

#define SERVICE_PREFIX "/embps.v1.EmbeddingService/"

/* ---- the method table ---- */

/* Every method with its least role. DropTable is admin's like CreateTable. Health/Watch is open
 * like Check but not served (UNIMPLEMENTED). grpc.reflection is not served, so it falls under
 * "any other path": a known token, then UNIMPLEMENTED. */
const embps__svc_method_t embps__svc_methods[] = {
    {SERVICE_PREFIX "CreateTable", EMBPS_AUTH_ADMIN, embps__svc_create_table},
    {SERVICE_PREFIX "DropTable", EMBPS_AUTH_ADMIN, embps__svc_drop_table},
    {SERVICE_PREFIX "Checkpoint", EMBPS_AUTH_ADMIN, embps__svc_checkpoint},
    {SERVICE_PREFIX "PushGradients", EMBPS_AUTH_WORKER, embps__svc_push},
    {SERVICE_PREFIX "Assign", EMBPS_AUTH_WORKER, embps__svc_assign},
    {SERVICE_PREFIX "Lookup", EMBPS_AUTH_READER, embps__svc_lookup},
    {SERVICE_PREFIX "PushFeatures", EMBPS_AUTH_WORKER, embps__svc_push_features},
    {SERVICE_PREFIX "LookupFeatures", EMBPS_AUTH_READER, embps__svc_lookup_features},
    {SERVICE_PREFIX "ListTables", EMBPS_AUTH_READER, embps__svc_list_tables},
    {SERVICE_PREFIX "GetStats", EMBPS_AUTH_READER, embps__svc_stats},
    {SERVICE_PREFIX "ListCheckpoints", EMBPS_AUTH_READER, embps__svc_list_checkpoints},
    {"/grpc.health.v1.Health/Check", EMBPS_AUTH_OPEN, embps__svc_health},
    {"/grpc.health.v1.Health/Watch", EMBPS_AUTH_OPEN, NULL},
};

const size_t embps__svc_num_methods = sizeof(embps__svc_methods) / sizeof(embps__svc_methods[0]);

const embps__svc_method_t *embps__svc_method(const char *path) {
  for (size_t i = 0; i < embps__svc_num_methods; i++)
    if (strcmp(path, embps__svc_methods[i].path) == 0)
      return &embps__svc_methods[i];
  return NULL;
}

embps_auth_role_t embps__svc_method_role(const char *path) {
  return embps__svc_role(embps__svc_method(path));
}

/* ---- answers ---- */

static void release_buffer(void *p) { embps_free(p); }

void embps__svc_reply(embps_net_call_t *call, const ProtobufCMessage *m) {
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = embps_malloc(len);
  if (!buf) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory packing the reply");
    return;
  }
  protobuf_c_message_pack(m, buf);
  embps_net_call_reply(call, buf, len, release_buffer, buf);
}

void embps__svc_fail(embps_net_call_t *call, const embps_error_t *err) {
  embps_net_call_fail(call, err->status, err->message);
}

/* protobuf-c answers NULL both for bytes that do not parse and for an allocation that failed;
 * the allocator tells the two apart. */
void embps__svc_fail_unpack(embps_service_t *svc, embps_net_call_t *call, const char *type) {
  char msg[80];
  if (svc->unpack_out_of_memory) {
    svc->unpack_out_of_memory = 0;
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory unpacking the request");
    return;
  }
  snprintf(msg, sizeof(msg), "malformed %s message", type);
  embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, msg);
}

embps_status_t embps__svc_check_group(embps_service_t *svc, embps_error_t *err) {
  char msg[400];
  if (embps_group_state(svc->group, msg, sizeof(msg)) == EMBPS_GROUP_READY)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_UNAVAILABLE, "%s", msg);
}

embps_table_t *embps__svc_find_table(embps_service_t *svc, const char *name, embps_error_t *err) {
  embps_table_t *t = embps_store_find(svc->store, name ? name : "");
  if (!t)
    embps_error_set(err, EMBPS_NOT_FOUND, "table '%s' not found", name ? name : "");
  return t;
}

/* ---- requests ---- */

static void request_free(embps__svc_request_t *r) {
  if (r->msg)
    protobuf_c_message_free_unpacked(r->msg, &r->svc->pb);
  if (r->reply)
    embps__bufpool_put(r->reply);
  if (r->extra_free)
    r->extra_free(r->extra);
  embps_free(r->wire);
  embps_free(r);
}

int embps__svc_answer_failure(embps__svc_request_t *r) {
  if (r->group_call.error.status == EMBPS_OK)
    return 0;
  embps__svc_fail(r->call, &r->group_call.error);
  return 1;
}

static void on_group_done(embps_group_call_t *gc) {
  embps__svc_request_t *r = gc->user;

  r->svc->inflight--;
  if (!r->call) { /* an async push, answered when it was ordered */
    /* Its caller was told "ordered" and hears nothing more: the log is where the failure shows,
     * unless the caller had left before even that (its answers were dropped; no news for
     * anyone). */
    if (gc->error.status != EMBPS_OK && !r->caller_gone)
      EMBPS_WARN("async push to '%s' failed: %s", embps_table_config(gc->op.table)->name,
                 gc->error.message);
  } else {
    r->done(r);
  }
  request_free(r);
}

embps__svc_request_t *embps__svc_request_new(embps_service_t *svc, embps_net_call_t *call,
                                             ProtobufCMessage *msg, embps__svc_done_cb done) {
  embps__svc_request_t *r = embps_calloc(1, sizeof(*r));
  if (!r)
    return NULL;
  r->svc = svc;
  r->call = call;
  r->done = done;
  r->msg = msg;
  r->group_call.done = on_group_done;
  r->group_call.user = r;
  return r;
}

void embps__svc_submit(embps__svc_request_t *r) {
  r->svc->inflight++;
  if (r->group_call.ckpt)
    embps_group_checkpoint(r->svc->group, &r->group_call, r->group_call.ckpt);
  else
    embps_group_submit(r->svc->group, &r->group_call);
}

/* ---- dispatch ---- */

static void unknown_method(embps_net_call_t *call, const char *method) {
  char text[320];
  snprintf(text, sizeof(text), "unknown method %.256s", method);
  embps_net_call_fail(call, EMBPS_UNIMPLEMENTED, text);
}

void embps_service_on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                              size_t len) {
  embps_service_t *svc = user;
  static const uint8_t empty[1];
  const embps__svc_method_t *m = embps__svc_method(method);
  embps_error_t err;

  /* Who may call what is decided here, once, before any method runs (or a drain is
   * revealed): the method table gives each method's least role. */
  if (embps_auth_check(svc->auth, embps__svc_role(m), method, embps_net_call_authorization(call),
                       &err) != EMBPS_OK) {
    EMBPS_DEBUG("refused a call to %.200s: %s", method, err.message);
    embps__svc_fail(call, &err);
  } else if (svc->draining && strncmp(method, SERVICE_PREFIX, strlen(SERVICE_PREFIX)) == 0) {
    embps_net_call_fail(call, EMBPS_UNAVAILABLE,
                        "this server is shutting down (it finishes the calls it has taken): "
                        "retry once it is back");
  } else if (m && m->handler) {
    m->handler(svc, call, msg ? msg : empty, len, &msg);
  } else {
    unknown_method(call, method);
  }
  embps_free(msg);
}

/* ---- construction ---- */

/* The pool's memory: pinned for the CUDA backend's device once the group has formed. */
static void *host_alloc(void *group, size_t bytes, int *pinned) {
  return embps_host_alloc(embps_group_host_device(group), bytes, pinned);
}

static void host_free(void *group, void *p, size_t bytes, int pinned) {
  (void)group;
  embps_host_free(p, pinned, bytes);
}

static void *pb_alloc(void *data, size_t size) {
  embps_service_t *svc = data;
  void *p = embps__bufpool_get(svc->buffers, size);
  if (!p)
    svc->unpack_out_of_memory = 1;
  return p;
}

static void pb_free(void *data, void *p) {
  (void)data;
  if (p)
    embps__bufpool_put(p);
}

embps_status_t embps_service_new(embps_service_t **out, embps_group_t *group, embps_store_t *store,
                                 const embps_service_config_t *cfg) {
  embps_service_t *svc = embps_calloc(1, sizeof(*svc));
  embps_bufpool_backing_t backing;
  if (!svc)
    return EMBPS_RESOURCE_EXHAUSTED;
  backing.alloc = host_alloc;
  backing.free = host_free;
  backing.ctx = group;
  svc->group = group;
  svc->store = store;
  svc->cfg = *cfg;
  /* Enough idle buffers for a deep pipeline of large requests and replies, and no more than
   * 1 GiB idle. */
  svc->buffers = embps__bufpool_new(64, (size_t)1 << 30, &backing);
  if (!svc->buffers) {
    embps_free(svc);
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  svc->pb.alloc = pb_alloc;
  svc->pb.free = pb_free;
  svc->pb.allocator_data = svc;
  svc->started_ns = embps_now_ns();
  *out = svc;
  return EMBPS_OK;
}

void embps_service_set_net(embps_service_t *svc, embps_net_t *net) { svc->net = net; }

void embps_service_set_metrics(embps_service_t *svc, char *(*render)(void *arg, size_t *len),
                               void *arg) {
  svc->render_metrics = render;
  svc->render_metrics_arg = arg;
}

void embps_service_set_auth(embps_service_t *svc, const embps_auth_t *auth) { svc->auth = auth; }

uint64_t embps_service_inflight(const embps_service_t *svc) { return svc->inflight; }

void embps_service_drain(embps_service_t *svc) { svc->draining = 1; }

void embps_service_free(embps_service_t *svc) {
  if (!svc)
    return;
  embps__bufpool_free(svc->buffers);
  embps_free(svc);
}
