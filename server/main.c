/* embps-server: reads the settings, builds the layers bottom-up (store, engine, service, net),
 * and runs the loop until SIGINT or SIGTERM, then closes them top-down so that calls in flight
 * are answered or dropped before the tables go away. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "common/log.h"
#include "server/engine/engine.h"
#include "server/net/net.h"
#include "server/service/service.h"
#include "server/settings.h"
#include "server/store/store.h"

typedef struct server {
  uv_loop_t loop;
  uv_signal_t sigint, sigterm;
  embps_store_t *store;
  embps_engine_t *engine;
  embps_service_t *service;
  embps_net_t *net;
} server_t;

static void on_signal(uv_signal_t *handle, int signum) {
  server_t *s = handle->data;
  EMBPS_INFO("signal %d: shutting down", signum);
  embps_net_close(s->net);
  uv_signal_stop(&s->sigint);
  uv_signal_stop(&s->sigterm);
  uv_close((uv_handle_t *)&s->sigint, NULL);
  uv_close((uv_handle_t *)&s->sigterm, NULL);
  embps_engine_close(s->engine);
}

static uint64_t default_max_table_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0)
    return UINT64_C(1) << 32;
  return (uint64_t)pages * (uint64_t)page / 4 * 3;
}

int main(int argc, char **argv) {
  embps_settings_t set;
  embps_service_config_t scfg;
  embps_net_config_t ncfg;
  embps_error_t err;
  server_t s;
  int want_help, level, rc = 1;

  signal(SIGPIPE, SIG_IGN);
  memset(&s, 0, sizeof(s));
  embps_error_clear(&err);
  if (embps_settings_load(&set, argc, argv, &want_help, &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return 2;
  }
  if (want_help) {
    embps_settings_usage(stdout, "embps-server");
    return 0;
  }
  if ((level = embps_log_parse_level(set.log_level)) < 0) {
    fprintf(stderr, "embps-server: --log-level: '%s' is not debug, info, warn or error\n",
            set.log_level);
    return 2;
  }
  embps_log_set_level((embps_log_level_t)level);
  if (strcmp(set.backend, "auto") != 0 && strcmp(set.backend, "cpu") != 0) {
    fprintf(stderr, "embps-server: --backend: '%s' is not auto or cpu (this build has no CUDA)\n",
            set.backend);
    return 2;
  }

  scfg.max_table_bytes = set.max_table_bytes ? set.max_table_bytes : default_max_table_bytes();
  memset(&ncfg, 0, sizeof(ncfg));
  ncfg.max_message_bytes = set.max_message_bytes;
  ncfg.stall_timeout_ms = set.stall_timeout_ms;
  ncfg.idle_timeout_ms = set.idle_timeout_ms;
  ncfg.max_connections = (uint32_t)set.max_connections;

  if (uv_loop_init(&s.loop) != 0) {
    fprintf(stderr, "embps-server: cannot create the event loop\n");
    return 1;
  }
  if (embps_store_new(&s.store, 0, 1, set.max_tables) != EMBPS_OK ||
      embps_engine_new(&s.engine, &s.loop) != EMBPS_OK ||
      embps_service_new(&s.service, s.engine, s.store, &scfg) != EMBPS_OK ||
      embps_net_new(&s.net, &s.loop, &ncfg, embps_service_on_request, s.service) != EMBPS_OK) {
    fprintf(stderr, "embps-server: out of memory at startup\n");
    return 1;
  }
  embps_service_set_net(s.service, s.net);
  if (embps_net_listen(s.net, set.listen, &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    goto exit;
  }
  uv_signal_init(&s.loop, &s.sigint);
  uv_signal_init(&s.loop, &s.sigterm);
  s.sigint.data = s.sigterm.data = &s;
  uv_signal_start(&s.sigint, on_signal, SIGINT);
  uv_signal_start(&s.sigterm, on_signal, SIGTERM);
  EMBPS_INFO("embps-server %s: rank 0 of a 1-rank group, backend %s, max table bytes %llu",
             EMBPS_VERSION, embps_engine_backend(s.engine),
             (unsigned long long)scfg.max_table_bytes);
  {
    /* The listening line is what scripts and tests wait for; its port is the real one when
     * --listen asked for port 0. */
    char host[256];
    const char *colon = strrchr(set.listen, ':');
    size_t hl = colon ? (size_t)(colon - set.listen) : strlen(set.listen);
    snprintf(host, sizeof(host), "%.*s", (int)hl, set.listen);
    EMBPS_INFO("listening on %s:%d", host, embps_net_port(s.net));
  }
  uv_run(&s.loop, UV_RUN_DEFAULT);
  rc = 0;
exit:
  if (rc != 0) {
    embps_net_close(s.net);
    embps_engine_close(s.engine);
    uv_run(&s.loop, UV_RUN_DEFAULT);
  }
  embps_net_free(s.net);
  embps_service_free(s.service);
  embps_engine_free(s.engine);
  embps_store_free(s.store);
  uv_loop_close(&s.loop);
  return rc;
}
