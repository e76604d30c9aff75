/* GetStats and the gRPC health check, both answered on the loop thread from counters that other
 * threads keep (relaxed atomics: a snapshot need not be consistent across counters). GetStats
 * carries the Prometheus exposition text when asked for it and the server gave the service a
 * renderer (embps_service_set_metrics). Health answers SERVING only while the group is ready
 * and the server is not draining, which is what a load balancer's probe needs. */
#include <string.h>

#include "common/backend.h"
#include "common/alloc.h"
#include "common/clock.h"
#include "server/service/service_internal.h"
#include "grpc/health/v1/health.pb-c.h"

static double uptime_s(const embps_service_t *svc) {
  return (double)(embps_now_ns() - svc->started_ns) * 1e-9;
}

static uint64_t load(atomic_uint_fast64_t *v) {
  return atomic_load_explicit(v, memory_order_relaxed);
}

void embps__svc_stats(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                      uint8_t **owned) {
  Embps__V1__GetStatsRequest *req = embps__v1__get_stats_request__unpack(&svc->pb, len, msg);
  Embps__V1__GetStatsResponse resp = EMBPS__V1__GET_STATS_RESPONSE__INIT;
  size_t n = embps_store_count(svc->store) + 1;
  Embps__V1__TableStats *ts = NULL, **ptrs = NULL;
  embps_table_t **tables = NULL;
  embps_net_stats_t ns;
  embps_comm_stats_t cs;
  char *prom = NULL;
  size_t prom_len = 0;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "GetStatsRequest");
    return;
  }
  if (req->prometheus && svc->render_metrics &&
      !(prom = svc->render_metrics(svc->render_metrics_arg, &prom_len))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory rendering the metrics");
    goto exit;
  }
  if (prom)
    resp.prometheus_text = prom;
  ts = embps_calloc(n, sizeof(*ts));
  ptrs = embps_calloc(n, sizeof(*ptrs));
  tables = embps_calloc(n, sizeof(*tables));
  if (!ts || !ptrs || !tables) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  n = embps_store_list(svc->store, tables, n);
  memset(&ns, 0, sizeof(ns));
  if (svc->net)
    embps_net_get_stats(svc->net, &ns);
  resp.rank = embps_group_rank(svc->group);
  resp.group_size = embps_group_size(svc->group);
  resp.backend = (char *)embps_backend_name(embps_group_backend(svc->group));
  embps_group_comm_stats(svc->group, &cs);
  resp.peer_bytes_sent = cs.bytes_sent;
  resp.peer_bytes_received = cs.bytes_received;
  resp.collective_calls = cs.calls;
  resp.ready = embps_group_state(svc->group, NULL, 0) == EMBPS_GROUP_READY;
  resp.uptime_s = uptime_s(svc);
  resp.requests = ns.requests;
  resp.errors = ns.errors;
  resp.bytes_in = ns.bytes_in;
  resp.bytes_out = ns.bytes_out;
  resp.connections = ns.connections;
  resp.version = (char *)EMBPS_VERSION;
  resp.mesh = svc->cfg.mesh;
  resp.memory_bytes = embps_store_budget_used(svc->store);
  resp.max_memory_bytes = embps_store_budget_max(svc->store);
  for (size_t i = 0; i < n; i++) {
    embps_table_t *t = tables[i];
    embps__v1__table_stats__init(&ts[i]);
    ts[i].name = (char *)embps_table_config(t)->name;
    ts[i].rows = embps_table_config(t)->rows;
    ts[i].emb_width = embps_table_config(t)->emb_width;
    ts[i].lookups = load(&embps_table_counters(t)->lookups);
    ts[i].pushes = load(&embps_table_counters(t)->pushes);
    ts[i].rows_looked_up = load(&embps_table_counters(t)->rows_looked_up);
    ts[i].rows_pushed = load(&embps_table_counters(t)->rows_pushed);
    ts[i].steps_applied = load(&embps_table_counters(t)->steps_applied);
    ts[i].steps_skipped = load(&embps_table_counters(t)->steps_skipped);
    ts[i].bytes = embps_table_bytes(t);
    if (embps_table_config_hashed(embps_table_config(t))) { /* the same on every rank */
      embps_hindex_stats_t hs;
      embps_table_hindex_stats(t, &hs);
      ts[i].capacity = embps_table_config(t)->capacity;
      ts[i].keys = hs.size;
      ts[i].keys_admitted = hs.admitted;
      ts[i].keys_evicted = hs.evicted;
      ts[i].keys_expired = hs.expired;
      ts[i].keys_refused = hs.refused;
      ts[i].gradients_dropped = hs.refused + hs.not_admitted;
    }
    ptrs[i] = &ts[i];
  }
  resp.n_tables = n;
  resp.tables = ptrs;
  embps__svc_reply(call, &resp.base);
exit:
  embps_free(prom);
  embps_free(ts);
  embps_free(ptrs);
  embps_free(tables);
  embps__v1__get_stats_request__free_unpacked(req, &svc->pb);
}

void embps__svc_health(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned) {
  Grpc__Health__V1__HealthCheckRequest *req =
      grpc__health__v1__health_check_request__unpack(&svc->pb, len, msg);
  Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "HealthCheckRequest");
    return;
  }
  if (req->service && req->service[0] && strcmp(req->service, "embps.v1.EmbeddingService") != 0) {
    embps_net_call_fail(call, EMBPS_NOT_FOUND, "unknown service");
  } else {
    resp.status = !svc->draining && embps_group_state(svc->group, NULL, 0) == EMBPS_GROUP_READY
                      ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    embps__svc_reply(call, &resp.base);
  }
  grpc__health__v1__health_check_request__free_unpacked(req, &svc->pb);
}
