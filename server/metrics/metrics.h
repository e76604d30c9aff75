/* Metrics: the server's figures in the Prometheus text exposition format (version 0.0.4), and
 * an HTTP endpoint (libmicrohttpd, on its own thread) that serves them at GET /metrics. A scrape
 * reads what the serving threads already keep in relaxed atomics (net, group, the tables'
 * counters) and takes no lock the hot path waits on (the table registry's lock is held only
 * to read each table's pointer). */
#ifndef EMBPS_METRICS_H
#define EMBPS_METRICS_H

#include <stddef.h>

#include "common/status.h"
#include "server/engine/engine.h"
#include "server/group/group.h"
#include "server/net/net.h"
#include "server/store/store.h"

/** What a scrape reads; all borrowed, and they must outlive every render and the server. */
typedef struct embps_metrics_sources {
  embps_store_t *store;
  embps_group_t *group;
  embps_net_t *net; /* NULL: no network series */
  double start_unix_s;
} embps_metrics_sources_t;

/**
 * Renders every series into *out (NUL-terminated, *len bytes without the NUL; caller frees with
 * embps_free). Any thread. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED (*out untouched).
 */
embps_status_t embps_metrics_render(const embps_metrics_sources_t *src, char **out, size_t *len);

typedef struct embps_metrics_server embps_metrics_server_t;

/**
 * Serves GET /metrics on host_port ("127.0.0.1:9100", "[::]:9100", port 0 picks one) from a
 * libmicrohttpd thread. src is copied; what it points to is borrowed. On failure *out is
 * untouched. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (an address that does not parse or
 * resolve), EMBPS_UNAVAILABLE (cannot listen; err says why) or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_metrics_server_start(embps_metrics_server_t **out, const char *host_port,
                                          const embps_metrics_sources_t *src, embps_error_t *err);

/** The port it listens on. */
int embps_metrics_server_port(const embps_metrics_server_t *m);

/** Stops the thread and frees the server. NULL is a no-op. */
void embps_metrics_server_stop(embps_metrics_server_t *m);

#endif
