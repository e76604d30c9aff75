/* embps-server: reads the settings, validates the group's shape (before listening, so a bad
 * mesh exits at once with DESIGN.md's message), builds the layers bottom-up (store, group with
 * its engine, service, net), and runs the loop until SIGINT or SIGTERM or until the group
 * cannot form, then closes them top-down so that calls in flight are answered or dropped
 * before the tables go away. */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common/alloc.h"
#include "common/backend.h"
#include "common/clock.h"
#include "common/cpus.h"
#include "common/hostport.h"
#include "common/log.h"
#include "common/tls.h"
#include "server/engine/engine.h"
#include "server/group/group.h"
#include "server/metrics/metrics.h"
#include "server/net/net.h"
#include "server/service/service.h"
#include "server/settings.h"
#include "server/store/checkpoint.h"
#include "server/store/store.h"

#ifdef EMBPS_HAVE_CUDA
#define EMBPS_HAVE_CUDA_BUILD 1
#else
#define EMBPS_HAVE_CUDA_BUILD 0
#endif

typedef struct server {
  uv_loop_t loop;
  uv_signal_t sigint, sigterm, sighup;
  uv_timer_t drain_timer; /* watches a drain until the calls taken are answered */
  int draining;
  uint64_t drain_deadline_ms;
  uint64_t drain_timeout_ms;
  embps_store_t *store;
  embps_group_t *group;
  embps_service_t *service;
  embps_net_t *net;
  embps_metrics_server_t *metrics;  /* NULL without --metrics-listen */
  embps_group_peer_tls_t *peer_tls; /* NULL without --peer-tls-cert */
  embps_metrics_sources_t metrics_src;
  const char *auth_path; /* --auth-tokens-file; NULL: client auth is off */
  embps_auth_t *auth;    /* its tokens, which the service checks calls against */
  int closing;
  int exit_code;
  int has_checkpoints;
  int final_state; /* the drain's final checkpoint: 0 not asked, 1 in flight, 2 done */
  embps_group_call_t final_call;
  embps_group_ckpt_t final_ckpt;
} server_t;

static void shut_down(server_t *s) {
  if (s->closing)
    return;
  s->closing = 1;
  embps_net_close(s->net);
  uv_signal_stop(&s->sigint);
  uv_signal_stop(&s->sigterm);
  uv_signal_stop(&s->sighup);
  uv_close((uv_handle_t *)&s->sigint, NULL);
  uv_close((uv_handle_t *)&s->sigterm, NULL);
  uv_close((uv_handle_t *)&s->sighup, NULL);
  uv_timer_stop(&s->drain_timer);
  uv_close((uv_handle_t *)&s->drain_timer, NULL);
  embps_group_close(s->group);
}

static void on_final_checkpoint(embps_group_call_t *call) {
  server_t *s = call->user;
  if (call->error.status == EMBPS_OK)
    EMBPS_INFO("final checkpoint complete: %s (round %llu, %llu bytes)", s->final_ckpt.path,
               (unsigned long long)s->final_ckpt.round, (unsigned long long)s->final_ckpt.bytes);
  else
    EMBPS_ERROR("the final checkpoint failed: %s", call->error.message);
  s->final_state = 2;
}

/* Once the calls taken are answered, the rank asks the group for a final checkpoint (when it
 * has a checkpoint directory and tables) and leaves once it is complete. */
static void on_drain_tick(uv_timer_t *timer) {
  server_t *s = timer->data;
  uint64_t left = embps_service_inflight(s->service);
  if (left == 0 && s->final_state == 0 && s->has_checkpoints && embps_store_count(s->store) > 0 &&
      embps_group_state(s->group, NULL, 0) == EMBPS_GROUP_READY) {
    EMBPS_INFO("drained: every call taken is answered; taking the final checkpoint");
    memset(&s->final_call, 0, sizeof(s->final_call));
    memset(&s->final_ckpt, 0, sizeof(s->final_ckpt));
    s->final_ckpt.final = 1;
    s->final_call.done = on_final_checkpoint;
    s->final_call.user = s;
    s->final_state = 1;
    embps_group_checkpoint(s->group, &s->final_call, &s->final_ckpt);
  } else if (left == 0 && s->final_state != 1) {
    EMBPS_INFO("drained: every call taken is answered; shutting down");
    shut_down(s);
  } else if (embps_now_ms() >= s->drain_deadline_ms) {
    EMBPS_WARN("the drain timeout (%llu ms) passed with %llu call(s) unanswered; shutting down",
               (unsigned long long)s->drain_timeout_ms, (unsigned long long)left);
    shut_down(s);
  }
}

/* The first SIGTERM or SIGINT drains: no new connections or calls (health says NOT_SERVING, so
 * Kubernetes stops routing here), the calls already taken run to their answers, then the server
 * shuts down; within --drain-timeout-ms. A group that is not serving has nothing to drain, and
 * a second signal stops at once. */
static void on_signal(uv_signal_t *handle, int signum) {
  server_t *s = handle->data;
  if (s->draining || s->drain_timeout_ms == 0 ||
      embps_group_state(s->group, NULL, 0) != EMBPS_GROUP_READY) {
    EMBPS_INFO("signal %d: shutting down", signum);
    shut_down(s);
    return;
  }
  s->draining = 1;
  s->drain_deadline_ms = embps_now_ms() + s->drain_timeout_ms;
  EMBPS_INFO("signal %d: draining %llu call(s) in flight (at most %llu ms)", signum,
             (unsigned long long)embps_service_inflight(s->service),
             (unsigned long long)s->drain_timeout_ms);
  embps_service_drain(s->service);
  embps_net_stop_listening(s->net);
  uv_timer_start(&s->drain_timer, on_drain_tick, 0, 10);
}

/* Says which tokens are in force, by role (never the tokens). */
static void log_auth(const char *verb, const server_t *s) {
  EMBPS_INFO("client auth: %s %zu admin, %zu worker and %zu reader token(s) from %s", verb,
             embps_auth_count(s->auth, EMBPS_AUTH_ADMIN),
             embps_auth_count(s->auth, EMBPS_AUTH_WORKER),
             embps_auth_count(s->auth, EMBPS_AUTH_READER), s->auth_path);
}

/* SIGHUP rereads --auth-tokens-file: a file that now fails to parse keeps the tokens in force
 * (the calls being served were checked against them and later ones still are). Everything
 * runs on the loop thread, so the swap needs no lock. */
static void on_sighup(uv_signal_t *handle, int signum) {
  server_t *s = handle->data;
  embps_auth_t *fresh;
  embps_error_t err;
  (void)signum;
  if (!s->auth_path) {
    EMBPS_INFO("SIGHUP: nothing to reload (no --auth-tokens-file)");
    return;
  }
  if (embps_auth_load(&fresh, s->auth_path, &err) != EMBPS_OK) {
    EMBPS_ERROR("SIGHUP: --auth-tokens-file: %s; the tokens loaded before stay in force",
                err.message);
    return;
  }
  embps_service_set_auth(s->service, fresh);
  embps_auth_free(s->auth);
  s->auth = fresh;
  log_auth("reloaded", s);
}

static void on_group_fatal(void *arg, embps_status_t status, const char *message) {
  server_t *s = arg;
  if (status == EMBPS_CANCELLED && s->closing) { /* a signal stopped the bootstrap: clean exit */
    EMBPS_INFO("%s", message);
    return;
  }
  fprintf(stderr, "embps-server: %s: %s\n", embps_status_name(status), message);
  s->exit_code = 1;
  shut_down(s);
}

/* GetStats' prometheus_text: the same exposition /metrics serves. */
static char *render_metrics(void *arg, size_t *len) {
  char *text = NULL;
  if (embps_metrics_render(arg, &text, len) != EMBPS_OK)
    return NULL;
  return text;
}

/* The host of a --metrics-listen value, for the log line (brackets dropped). */
static const char *metrics_host(const char *listen) {
  static char host[300];
  embps_hostport_t hp;
  embps_error_t err;
  if (embps_hostport_parse(&hp, listen, strlen(listen), "--metrics-listen", EMBPS_HOSTPORT_LISTEN,
                           &err) != EMBPS_OK)
    return "?";
  snprintf(host, sizeof(host), "%s", hp.host);
  return host;
}

/* --engine-threads: 0 is the CPUs this process may use (embps_usable_cpus), at most 8: split
 * finer, a 4096-row batch's shares would come down to the engine's smallest (512 rows) anyway. */
static unsigned engine_threads(uint64_t asked) {
  unsigned cpus = embps_usable_cpus();
  if (asked > 0)
    return asked > 256 ? 256u : (unsigned)asked;
  return cpus > 8 ? 8u : cpus;
}

/* --max-message-bytes' help says how many maximal replies a connection may hold. */
_Static_assert(EMBPS_NET_CONNECTION_REPLY_MESSAGES == 4,
               "--max-message-bytes' help in settings.h says 4 times: keep the two together");

/* The address to serve clients on: --listen, else this rank's --peers entry, else
 * 127.0.0.1:7070. A host given by name is resolved here, since the network layer takes IP
 * literals; *shown is the address as the user wrote it, for the "listening on" line. Returns 0,
 * or -1 with the reason printed. */
static int client_listen_address(const embps_settings_t *set, const embps_hostport_t *peer,
                                 char *numeric, size_t cap, embps_hostport_t *shown,
                                 int *wildcard) {
  struct sockaddr_storage ss;
  socklen_t len;
  embps_hostport_t resolved;
  embps_error_t err;
  const char *text = set->listen[0] ? set->listen : "127.0.0.1:7070";
  if (!set->listen[0] && peer)
    *shown = *peer;
  else if (embps_hostport_parse(shown, text, strlen(text), "--listen", EMBPS_HOSTPORT_LISTEN,
                                &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return -1;
  }
  if (embps_hostport_resolve(shown, &ss, &len, &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: the address to serve clients on: %s\n", err.message);
    return -1;
  }
  if (embps_hostport_numeric(&ss, len, &resolved) != EMBPS_OK ||
      embps_hostport_format(&resolved, numeric, cap) != EMBPS_OK) {
    fprintf(stderr, "embps-server: '%s' resolves to an address that cannot be served on\n",
            shown->host);
    return -1;
  }
  *wildcard = embps_hostport_is_wildcard(&ss);
  return 0;
}

/* Parses --peers: *n ranks, each rank's peer address (its client address with the port
 * offset) in peer_addrs (strings in bufs), and this rank's client address in *mine when
 * --rank is within the list. Returns 0, or -1 with the reason printed. */
static int peer_addresses(const embps_settings_t *set, char (*bufs)[300], const char **peer_addrs,
                          size_t *n, embps_hostport_t *mine) {
  embps_hostport_t *peers;
  embps_error_t err;
  int ret = 0;
  if (embps_hostport_parse_list(set->peers, "--peers entry", EMBPS_SETTINGS_MAX_PEERS, 0, &peers, n,
                                &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return -1;
  }
  for (size_t r = 0; r < *n && ret == 0; r++) {
    char entry[300];
    if (embps_hostport_format(&peers[r], entry, sizeof(entry)) != EMBPS_OK ||
        embps_group_peer_addr(entry, (int)set->peer_port_offset, bufs[r], sizeof(bufs[r]), &err) !=
            EMBPS_OK) {
      fprintf(stderr, "embps-server: --peers entry %zu: %s\n", r, err.message);
      ret = -1;
    }
    peer_addrs[r] = bufs[r];
  }
  if (set->rank < *n)
    *mine = peers[set->rank];
  embps_free(peers);
  return ret;
}

/* TLS between ranks: --peer-tls-cert, --peer-tls-key and --peer-tls-ca all or none, their files
 * read now so that a bad one stops the server at once rather than at bootstrap. */
static int peer_tls(const embps_settings_t *set, embps_group_peer_tls_t **out) {
  embps_error_t err;
  int given = !!set->peer_tls_cert[0] + !!set->peer_tls_key[0] + !!set->peer_tls_ca[0];
  if (given == 0)
    return 0;
  if (given != 3) {
    fprintf(stderr, "embps-server: --peer-tls-cert, --peer-tls-key and --peer-tls-ca go "
                    "together: give all three (TLS between ranks) or none (cleartext)\n");
    return 1;
  }
  if (embps_group_peer_tls_new(out, set->peer_tls_cert, set->peer_tls_key, set->peer_tls_ca,
                               &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return 1;
  }
  return 0;
}

/* The client port's TLS files (--tls-cert, --tls-key, --tls-client-ca), read and checked now,
 * before the group starts forming: a bad one stops this rank before its peers see it join. The
 * network layer reads them again when it sets up TLS (open_listeners). Returns 0, or -1 with
 * the reason (the flag and the file) printed. */
static int check_client_tls(const embps_settings_t *set) {
  SSL_CTX *ctx = NULL;
  embps_error_t err;
  int ret = 0;
  if (!set->tls_cert[0])
    return 0;
  if (embps_tls_ctx_new(&ctx, TLS_server_method(), &err) != EMBPS_OK ||
      embps_tls_load_identity(ctx, set->tls_cert, "--tls-cert", set->tls_key, "--tls-key", &err) !=
          EMBPS_OK ||
      (set->tls_client_ca[0] &&
       embps_tls_load_ca(ctx, set->tls_client_ca, "--tls-client-ca", &err) != EMBPS_OK)) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    ret = -1;
  }
  SSL_CTX_free(ctx);
  return ret;
}

/* The group secret: read from --group-secret-file, refused when unusable, warned about when
 * others may read it (only warned: Kubernetes mounts secrets 0644 unless defaultMode says
 * otherwise) or when a group runs without one. Whether a secret is set joins the identity, so
 * that a rank with one and a rank without refuse each other with a sentence that says so rather
 * than by a failed check. Returns 0, or -1 with the reason printed. */
static int group_secret(const embps_settings_t *set, uint32_t size, uint8_t *secret, size_t cap,
                        size_t *secret_len, char *identity, size_t id_cap) {
  size_t used = strlen(identity);
  embps_error_t err;
  unsigned loose;
  *secret_len = 0;
  if (set->group_secret_file[0]) {
    if (embps_group_secret_load(set->group_secret_file, secret, cap, secret_len, &loose, &err) !=
        EMBPS_OK) {
      fprintf(stderr, "embps-server: --group-secret-file: %s\n", err.message);
      return -1;
    }
    if (loose)
      EMBPS_WARN("the group secret file %s has mode %04o: every user of this host may read it "
                 "(chmod 0600, or defaultMode: 0440 for a Kubernetes secret)",
                 set->group_secret_file, loose);
  } else if (size > 1) {
    EMBPS_WARN("no --group-secret-file: any process that reaches this rank's peer port can join "
               "the group as a rank and receive its shards and gradients");
  }
  if ((size_t)snprintf(identity + used, id_cap - used, "group_secret=%s\n",
                       *secret_len ? "hmac-sha256" : "none") >= id_cap - used) {
    fprintf(stderr, "embps-server: the group's configuration does not fit in %zu bytes\n", id_cap);
    return -1;
  }
  return 0;
}

/* Checkpoints: the directory must exist and be writable (every rank checks), the leader locks
 * it against a second group, and --restore names the checkpoint to start from (the store's
 * embps_ckpt_restore_choose decides; *restore_round 0: none), which joins the identity, so that
 * ranks that would restore different ones refuse each other. Returns 0, or -1 with the reason
 * printed. */
static int checkpoint_setup(const embps_settings_t *set, uint32_t rank, uint32_t size,
                            char *identity, size_t cap, char *restore_dir, size_t rd_cap,
                            uint64_t *restore_round) {
  const char *dir = set->checkpoint_dir;
  embps_error_t err;
  size_t used = strlen(identity);
  int lock_fd;
  *restore_round = 0;
  if (dir[0]) {
    char holder[400], host[256] = "?";
    if (strlen(dir) > 1000) {
      fprintf(stderr, "embps-server: --checkpoint-dir: a path of at most 1000 bytes, please\n");
      return -1;
    }
    if (embps_ckpt_dir_check(dir, &err) != EMBPS_OK) {
      fprintf(stderr, "embps-server: --checkpoint-dir: %s\n", err.message);
      return -1;
    }
    gethostname(host, sizeof(host) - 1);
    snprintf(holder, sizeof(holder), "pid %d on host %s, the leader of a %u-rank group",
             (int)getpid(), host, size);
    /* The lock lives as long as the process: its descriptor is never closed. */
    if (rank == 0 && embps_ckpt_dir_lock(dir, holder, &lock_fd, &err) != EMBPS_OK) {
      fprintf(stderr, "embps-server: %s\n", err.message);
      return -1;
    }
  }
  if (embps_ckpt_restore_choose(set->restore, dir, restore_dir, rd_cap, restore_round, &err) !=
      EMBPS_OK) {
    fprintf(stderr, "embps-server: --restore %s: %s\n", set->restore, err.message);
    return -1;
  }
  if (*restore_round)
    EMBPS_INFO("restoring the checkpoint of round %llu from %s", (unsigned long long)*restore_round,
               restore_dir);
  if ((size_t)snprintf(identity + used, cap - used,
                       "checkpoints=%s\nincremental=%d\nrestore=%llu\n", dir[0] ? "on" : "off",
                       set->checkpoint_full_every > 1,
                       (unsigned long long)*restore_round) >= cap - used) {
    fprintf(stderr, "embps-server: the group's configuration does not fit in %zu bytes\n", cap);
    return -1;
  }
  return 0;
}

/* Loads the client port's TLS files and opens the metrics and client listeners. Returns 0, or
 * the exit code with err set: 2 for unusable TLS files (a configuration error), 1 for a listener
 * that cannot open. */
static int open_listeners(server_t *s, const embps_settings_t *set, const char *listen_addr,
                          embps_error_t *err) {
  if (set->tls_cert[0] &&
      embps_net_use_tls(s->net, set->tls_cert, set->tls_key, set->tls_client_ca, err) != EMBPS_OK)
    return 2;
  if (set->metrics_listen[0] && embps_metrics_server_start(&s->metrics, set->metrics_listen,
                                                           &s->metrics_src, err) != EMBPS_OK)
    return 1;
  return embps_net_listen(s->net, listen_addr, err) == EMBPS_OK ? 0 : 1;
}

int main(int argc, char **argv) {
  static char peer_addrs_buf[EMBPS_SETTINGS_MAX_PEERS][300];
  const char *peer_addrs[EMBPS_SETTINGS_MAX_PEERS];
  char identity[4096], mesh_text[256], ta[256], da[256], listen_addr[300];
  uint32_t control_fanout = 0;
  size_t used;
  static uint8_t secret[EMBPS_GROUP_SECRET_MAX];
  size_t secret_len = 0;
  char restore_dir[EMBPS_CKPT_PATH_MAX] = "";
  uint64_t restore_round;
  embps_hostport_t mine, shown;
  size_t num_peers = 0;
  embps_settings_t set;
  embps_service_config_t scfg;
  embps_group_config_t gcfg;
  embps_net_config_t ncfg;
  embps_mesh_t mesh;
  embps_error_t err;
  server_t s;
  int want_help, level, device, bind_any;
  embps_backend_t backend;
  uint32_t group_size = 1, rank;

  signal(SIGPIPE, SIG_IGN);
  /* Requests and replies of tens of MiB come and go every step. glibc serves blocks above
   * 32 MiB with a fresh mmap each time, and on this project's VM faulting those pages in cost
   * more than the copies themselves (perf at 65536 x 128 pushes: 30% of the server's samples
   * in the page-fault path, 0.09 GB/s). Keeping every block in the heap and the heap's top
   * mapped up to 1 GiB lets the same pages serve step after step. */
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
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
  if (embps_settings_device(set.device, set.rank, embps_cuda_device_count(), &backend, &device,
                            &err) != EMBPS_OK) {
    fprintf(stderr, "embps-server: %s%s\n", err.message,
            err.status == EMBPS_FAILED_PRECONDITION && !EMBPS_HAVE_CUDA_BUILD
                ? " (this build has no CUDA backend)"
                : "");
    return 2;
  }
  if (set.retry_window == 0 || set.retry_window > EMBPS_GROUP_RETRY_WINDOW_MAX) {
    fprintf(stderr,
            "embps-server: --retry-window %llu: give the pushes remembered per client, from 1 to "
            "%u\n",
            (unsigned long long)set.retry_window, EMBPS_GROUP_RETRY_WINDOW_MAX);
    return 2;
  }
  if (set.checkpoint_full_every == 0) {
    fprintf(stderr, "embps-server: --checkpoint-full-every: 0 is not a count of checkpoints; 1 "
                    "makes every checkpoint full, N > 1 a full one every N\n");
    return 2;
  }

  /* The group's shape, checked before anything listens. */
  rank = (uint32_t)set.rank;
  if (set.peers[0]) {
    if (peer_addresses(&set, peer_addrs_buf, peer_addrs, &num_peers, &mine) != 0)
      return 2;
    group_size = (uint32_t)num_peers;
  }
  if (set.rank >= group_size) {
    fprintf(stderr, "embps-server: --rank %llu is outside the %u-rank group that --peers lists\n",
            (unsigned long long)set.rank, group_size);
    return 2;
  }
  if (embps_mesh_parse(&mesh, set.mesh, set.table_axis, set.data_axis, group_size, &err) !=
      EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return 2;
  }
  if (!set.tls_cert[0] != !set.tls_key[0]) {
    fprintf(stderr, "embps-server: --tls-cert and --tls-key go together: give both (TLS) or "
                    "neither (cleartext)\n");
    return 2;
  }
  if (set.tls_client_ca[0] && !set.tls_cert[0]) {
    fprintf(stderr, "embps-server: --tls-client-ca needs --tls-cert and --tls-key (mutual TLS "
                    "is TLS)\n");
    return 2;
  }
  if (client_listen_address(&set, num_peers ? &mine : NULL, listen_addr, sizeof(listen_addr),
                            &shown, &bind_any) != 0)
    return 2;
  embps_mesh_format(&mesh, mesh_text, sizeof(mesh_text));
  embps_mesh_format_axes(&mesh, 0, ta, sizeof(ta));
  embps_mesh_format_axes(&mesh, 1, da, sizeof(da));
  if (embps_group_identity_format(identity, sizeof(identity), EMBPS_VERSION, mesh_text, ta, da,
                                  set.peers) != EMBPS_OK) {
    fprintf(stderr, "embps-server: the group's configuration does not fit in %zu bytes\n",
            sizeof(identity));
    return 2;
  }
  if (embps_group_control_fanout(set.control_fanout, group_size, &control_fanout, &err) !=
      EMBPS_OK) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    return 2;
  }
  /* Every rank must draw the same relay tree: the fanout joins the identity. */
  used = strlen(identity);
  if ((size_t)snprintf(identity + used, sizeof(identity) - used, "control_fanout=%u\n",
                       control_fanout) >= sizeof(identity) - used) {
    fprintf(stderr, "embps-server: the group's configuration does not fit in %zu bytes\n",
            sizeof(identity));
    return 2;
  }
  if (group_secret(&set, group_size, secret, sizeof(secret), &secret_len, identity,
                   sizeof(identity)) != 0)
    return 2;
  if (checkpoint_setup(&set, rank, group_size, identity, sizeof(identity), restore_dir,
                       sizeof(restore_dir), &restore_round) != 0)
    return 2;
  if (set.auth_tokens_file[0]) {
    s.auth_path = set.auth_tokens_file;
    if (embps_auth_load(&s.auth, s.auth_path, &err) != EMBPS_OK) {
      fprintf(stderr, "embps-server: --auth-tokens-file: %s\n", err.message);
      return 2;
    }
  }
  if (peer_tls(&set, &s.peer_tls) != 0)
    return 2;
  /* Every file the flags name is read by now: the group forms only after this. */
  if (check_client_tls(&set) != 0)
    return 2;

  memset(&scfg, 0, sizeof(scfg));
  /* A lookup's reply is as large as the push of the same tokens, which --max-message-bytes
   * already bounds: the same figure bounds replies. */
  scfg.max_reply_bytes = set.max_message_bytes;
  snprintf(scfg.mesh, sizeof(scfg.mesh), "%s", mesh_text);
  scfg.loop = &s.loop;
  memset(&ncfg, 0, sizeof(ncfg));
  ncfg.max_message_bytes = set.max_message_bytes;
  ncfg.stall_timeout_ms = set.stall_timeout_ms;
  ncfg.idle_timeout_ms = set.idle_timeout_ms;
  ncfg.max_connections = (uint32_t)set.max_connections;
  ncfg.max_connections_per_source = (uint32_t)set.max_connections_per_source;
  memset(&gcfg, 0, sizeof(gcfg));
  gcfg.rank = rank;
  gcfg.size = group_size;
  gcfg.peer_addrs = peer_addrs;
  gcfg.bind_any = bind_any;
  gcfg.identity = identity;
  gcfg.secret = secret;
  gcfg.secret_len = secret_len;
  gcfg.peer_tls = s.peer_tls;
  gcfg.bootstrap_timeout_ms = set.bootstrap_timeout_ms;
  gcfg.peer_timeout_ms = set.peer_timeout_ms;
  gcfg.batch_deadline_ms = set.batch_deadline_ms;
  gcfg.backend = backend;
  gcfg.device = device;
  gcfg.engine_threads = engine_threads(set.engine_threads);
  gcfg.checkpoint_dir = set.checkpoint_dir;
  gcfg.checkpoint_keep = (uint32_t)set.checkpoint_keep;
  gcfg.checkpoint_interval_ms = set.checkpoint_interval_s * 1000u;
  gcfg.checkpoint_full_every =
      set.checkpoint_full_every > UINT32_MAX ? UINT32_MAX : (uint32_t)set.checkpoint_full_every;
  gcfg.retry_window = (uint32_t)set.retry_window;
  gcfg.control_fanout = control_fanout;
  gcfg.restore_dir = restore_dir;
  gcfg.restore_round = restore_round;
  gcfg.max_memory_bytes = set.max_memory_bytes;
  s.has_checkpoints = set.checkpoint_dir[0] != '\0';
  gcfg.on_fatal = on_group_fatal;
  gcfg.on_fatal_arg = &s;

  if (uv_loop_init(&s.loop) != 0) {
    fprintf(stderr, "embps-server: cannot create the event loop\n");
    return 1;
  }
  /* Say which step failed and how: not every failure here is running out of memory. */
  const char *step = NULL;
  embps_status_t st;
  if ((st = embps_store_new(&s.store)) != EMBPS_OK)
    step = "the table store";
  else if ((st = embps_group_new(&s.group, &s.loop, &gcfg, s.store)) != EMBPS_OK)
    step = "the group";
  else if ((st = embps_service_new(&s.service, s.group, s.store, &scfg)) != EMBPS_OK)
    step = "the service";
  else if ((st = embps_net_new(&s.net, &s.loop, &ncfg, embps_service_on_request, s.service)) !=
           EMBPS_OK)
    step = "the network layer";
  if (step) {
    fprintf(stderr, "embps-server: cannot create %s: %s\n", step, embps_status_str(st));
    return 1;
  }
  embps_service_set_net(s.service, s.net);
  embps_service_set_auth(s.service, s.auth);
  s.metrics_src.store = s.store;
  s.metrics_src.group = s.group;
  s.metrics_src.net = s.net;
  s.metrics_src.start_unix_s = (double)time(NULL);
  embps_service_set_metrics(s.service, render_metrics, &s.metrics_src);
  /* Clients may connect while the group forms: health answers NOT_SERVING until it is ready. */
  if ((s.exit_code = open_listeners(&s, &set, listen_addr, &err)) != 0) {
    fprintf(stderr, "embps-server: %s\n", err.message);
    s.closing = 1;
    embps_net_close(s.net);
    embps_group_close(s.group);
    uv_run(&s.loop, UV_RUN_DEFAULT);
    goto exit;
  }
  uv_signal_init(&s.loop, &s.sigint);
  uv_signal_init(&s.loop, &s.sigterm);
  uv_signal_init(&s.loop, &s.sighup);
  uv_timer_init(&s.loop, &s.drain_timer);
  s.drain_timeout_ms = set.drain_timeout_ms;
  s.sigint.data = s.sigterm.data = s.sighup.data = s.drain_timer.data = &s;
  uv_signal_start(&s.sigint, on_signal, SIGINT);
  uv_signal_start(&s.sigterm, on_signal, SIGTERM);
  uv_signal_start(&s.sighup, on_sighup, SIGHUP);
  EMBPS_INFO("embps-server %s: rank %u of a %u-rank group, mesh %s, backend %s, --device %s",
             EMBPS_VERSION, rank, group_size, mesh_text,
             embps_backend_name(embps_group_backend(s.group)), set.device);
  if (s.auth)
    log_auth("accepting", &s);
  else
    EMBPS_INFO("client auth is off: every client may call every method (see "
               "--auth-tokens-file)");
  /* The listening line is what scripts and tests wait for; its port is the real one when
   * --listen asked for port 0, and its host is as the user wrote it. */
  EMBPS_INFO("listening on %s%s%s:%d%s", shown.ipv6 ? "[" : "", shown.host, shown.ipv6 ? "]" : "",
             embps_net_port(s.net),
             !set.tls_cert[0]       ? " (cleartext h2c)"
             : set.tls_client_ca[0] ? " (TLS, client certificates required)"
                                    : " (TLS)");
  if (s.metrics)
    EMBPS_INFO("metrics on http://%s%s%s:%d/metrics", strchr(set.metrics_listen, '[') ? "[" : "",
               metrics_host(set.metrics_listen), strchr(set.metrics_listen, '[') ? "]" : "",
               embps_metrics_server_port(s.metrics));
  uv_run(&s.loop, UV_RUN_DEFAULT);
exit:
  embps_metrics_server_stop(s.metrics); /* before what it reads goes away */
  embps_net_free(s.net);
  embps_service_free(s.service);
  embps_auth_free(s.auth);
  embps_group_free(s.group);
  embps_group_peer_tls_free(s.peer_tls);
  embps_store_free(s.store);
  uv_loop_close(&s.loop);
  return s.exit_code;
}
