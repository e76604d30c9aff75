/* The service: decodes each gRPC request, validates it in one place before anything changes,
 * and routes it: listings, stats and health are answered on the loop thread; lookups, pushes
 * and table creation go to the shard group, which orders them across ranks and runs them. It
 * implements embps.v1.EmbeddingService and grpc.health.v1.Health. */
#ifndef EMBPS_SERVICE_H
#define EMBPS_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/group.h"
#include "server/net/net.h"
#include "server/service/auth.h"
#include "server/store/store.h"

typedef struct embps_service embps_service_t;

typedef struct embps_service_config {
  uint64_t max_reply_bytes; /* the largest reply one call may make (--max-message-bytes); 0: none */
  char mesh[256];           /* the group's mesh, as GetStats reports it */
  uv_loop_t *loop; /* where disk reads (ListCheckpoints) are queued off the loop thread; NULL:
                      done inline (tests) */
} embps_service_config_t;

/**
 * Creates the service over a group and a store (both borrowed: they must outlive it).
 * On failure *out is untouched. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_service_new(embps_service_t **out, embps_group_t *group, embps_store_t *store,
                                 const embps_service_config_t *cfg);

/** Gives the service the network layer whose counters GetStats reports (borrowed). */
void embps_service_set_net(embps_service_t *svc, embps_net_t *net);

/** Gives the service what renders the Prometheus exposition text for GetStats'
 * prometheus_text: render(arg, &len) returns a NUL-terminated string (freed with embps_free) or
 * NULL. Called on the loop thread. Without it, prometheus_text is empty. */
void embps_service_set_metrics(embps_service_t *svc, char *(*render)(void *arg, size_t *len),
                               void *arg);

/** Checks every later call against auth's tokens (borrowed: it must outlive the service or be
 * replaced first); NULL (the default) lets every call through. A call that fails the check is
 * answered UNAUTHENTICATED or PERMISSION_DENIED before its method runs. Loop thread. */
void embps_service_set_auth(embps_service_t *svc, const embps_auth_t *auth);

/** The embps_net_request_cb: pass the service as `user`. Runs on the loop thread. */
void embps_service_on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                              size_t len);

/** Requests the service has handed to the group and not yet answered. */
uint64_t embps_service_inflight(const embps_service_t *svc);

/** Starts a drain (SIGTERM): from now on every EmbeddingService call is refused with
 * UNAVAILABLE and health answers NOT_SERVING, while the calls already taken run to their
 * answers (embps_service_inflight counts them down). */
void embps_service_drain(embps_service_t *svc);

/** Frees the service; every op must have completed. NULL is a no-op. */
void embps_service_free(embps_service_t *svc);

#endif
