/* Metrics exposition (metrics.h). A small text builder appends HELP, TYPE and sample lines;
 * every series comes from a counter that its owner keeps in relaxed atomics (net.h's
 * embps_net_metrics_t, group.h's embps_group_metrics_t, store.h's embps_table_counters_t), so a
 * scrape never waits for the loop or the group's thread. Names follow Prometheus' conventions:
 * the go-grpc-prometheus names and labels for gRPC calls, embps_* for the rest, base units
 * (seconds, bytes), _total on counters. The HTTP side is libmicrohttpd with its internal polling
 * thread: it parses HTTP, we only answer GET /metrics. */
#include "server/metrics/metrics.h"

#include <microhttpd.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/backend.h"
#include "common/hostport.h"

/* ---- text builder ---------------------------------------------------------------------------- */

typedef struct text {
  char *buf;
  size_t len, cap;
  int failed; /* out of memory: the rest is dropped, render fails */
} text_t;

__attribute__((format(printf, 2, 3))) static void put(text_t *t, const char *fmt, ...) {
  va_list ap;
  int n;
  if (t->failed)
    return;
  for (;;) {
    va_start(ap, fmt);
    n = vsnprintf(t->buf ? t->buf + t->len : NULL, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->failed = 1;
      return;
    }
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap ? t->cap * 2 : 16384;
    while (cap - t->len <= (size_t)n)
      cap *= 2;
    char *nb = embps_realloc(t->buf, cap);
    if (!nb) {
      t->failed = 1;
      return;
    }
    t->buf = nb;
    t->cap = cap;
  }
}

static void family(text_t *t, const char *name, const char *type, const char *help) {
  put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A family with a single unlabelled sample. */
static void scalar(text_t *t, const char *name, const char *type, const char *help,
                   unsigned long long v) {
  family(t, name, type, help);
  put(t, "%s %llu\n", name, v);
}

/* A label value with \, " and newline escaped, as the format asks. */
static void escape(char *out, size_t cap, const char *in) {
  size_t n = 0;
  for (; *in && n + 3 < cap; in++) {
    if (*in == '\\' || *in == '"') {
      out[n++] = '\\';
      out[n++] = *in;
    } else if (*in == '\n') {
      out[n++] = '\\';
      out[n++] = 'n';
    } else {
      out[n++] = *in;
    }
  }
  out[n] = '\0';
}

static uint64_t ld(const atomic_uint_fast64_t *a) {
  return (uint64_t)atomic_load_explicit(a, memory_order_relaxed);
}

/* One histogram's samples; labels: "" or 'a="b",' pieces, each ending in a comma. */
static void hist(text_t *t, const char *name, const char *labels, const embps_hist_t *h) {
  uint64_t cum = 0;
  size_t ll = strlen(labels);
  for (size_t b = 0; b < h->nbounds; b++) {
    cum += ld(&h->counts[b]);
    put(t, "%s_bucket{%sle=\"%g\"} %llu\n", name, labels, h->bounds[b], (unsigned long long)cum);
  }
  cum += ld(&h->counts[h->nbounds]);
  put(t, "%s_bucket{%sle=\"+Inf\"} %llu\n", name, labels, (unsigned long long)cum);
  /* _sum and _count without the trailing comma */
  put(t, "%s_sum{%.*s} %.9g\n", name, ll ? (int)ll - 1 : 0, labels,
      (double)ld(&h->sum_nanos) * 1e-9);
  put(t, "%s_count{%.*s} %llu\n", name, ll ? (int)ll - 1 : 0, labels, (unsigned long long)cum);
}

/* ---- the series ------------------------------------------------------------------------------ */

static const char *const grpc_code_names[EMBPS_NET_GRPC_CODES] = {
    "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
    "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
    "DataLoss", "Unauthenticated"};

static void render_grpc(text_t *t, const embps_net_metrics_t *m) {
  size_t n = atomic_load_explicit(&m->num_methods, memory_order_acquire);
  const embps_net_method_metrics_t *slots[EMBPS_NET_METRICS_METHODS + 1];
  size_t k = 0;
  char lab[400];
  for (size_t i = 0; i < n; i++)
    slots[k++] = &m->methods[i];
  if (ld(&m->methods[EMBPS_NET_METRICS_METHODS].started))
    slots[k++] = &m->methods[EMBPS_NET_METRICS_METHODS];

  family(t, "grpc_server_started_total", "counter", "Total number of RPCs started on the server.");
  for (size_t i = 0; i < k; i++)
    put(t,
        "grpc_server_started_total{grpc_type=\"unary\",grpc_service=\"%s\",grpc_method=\"%s\"} "
        "%llu\n",
        slots[i]->service, slots[i]->method, (unsigned long long)ld(&slots[i]->started));
  family(t, "grpc_server_handled_total", "counter",
         "Total number of RPCs completed on the server, regardless of success or failure.");
  for (size_t i = 0; i < k; i++)
    for (int c = 0; c < EMBPS_NET_GRPC_CODES; c++) {
      uint64_t v = ld(&slots[i]->handled[c]);
      if (v || c == 0)
        put(t,
            "grpc_server_handled_total{grpc_type=\"unary\",grpc_service=\"%s\",grpc_method=\"%s\","
            "grpc_code=\"%s\"} %llu\n",
            slots[i]->service, slots[i]->method, grpc_code_names[c], (unsigned long long)v);
    }
  family(t, "grpc_server_handling_seconds", "histogram",
         "Histogram of response latency (seconds) of gRPC that had been application-level "
         "handled by the server.");
  for (size_t i = 0; i < k; i++) {
    snprintf(lab, sizeof(lab), "grpc_type=\"unary\",grpc_service=\"%s\",grpc_method=\"%s\",",
             slots[i]->service, slots[i]->method);
    hist(t, "grpc_server_handling_seconds", lab, &slots[i]->seconds);
  }
}

static void render_net(text_t *t, const embps_net_metrics_t *m) {
  scalar(t, "embps_connections", "gauge", "Client connections open now.", ld(&m->connections));
  scalar(t, "embps_connections_accepted_total", "counter", "Client connections accepted.",
         ld(&m->connections_accepted));
  scalar(t, "embps_network_received_bytes_total", "counter",
         "Bytes read from client sockets (HTTP/2 framing included).", ld(&m->bytes_in));
  scalar(t, "embps_network_sent_bytes_total", "counter",
         "Bytes written to client sockets (HTTP/2 framing included).", ld(&m->bytes_out));
  scalar(t, "embps_message_received_bytes_total", "counter",
         "gRPC request message bytes delivered to the service.", ld(&m->message_bytes_in));
  scalar(t, "embps_message_sent_bytes_total", "counter",
         "gRPC reply message bytes of calls answered OK.", ld(&m->message_bytes_out));
}

static const char *const phase_names[EMBPS_ROUND_PHASES] = {"queue_wait", "collectives", "compute"};

static void render_group(text_t *t, embps_group_t *g) {
  const embps_group_metrics_t *m = embps_group_metrics(g);
  char lab[64];
  family(t, "embps_group_rank", "gauge", "This server's rank in the shard group.");
  put(t, "embps_group_rank %u\n", embps_group_rank(g));
  family(t, "embps_group_size", "gauge", "Ranks in the shard group.");
  put(t, "embps_group_size %u\n", embps_group_size(g));
  family(t, "embps_group_ready", "gauge", "1 when the whole group is up and serving, else 0.");
  put(t, "embps_group_ready %d\n", embps_group_state(g, NULL, 0) == EMBPS_GROUP_READY);
  family(t, "embps_group_backend_info", "gauge",
         "The compute backend this rank runs (cpu or cuda), as a label; the value is 1.");
  put(t, "embps_group_backend_info{backend=\"%s\"} 1\n",
      embps_backend_name(embps_group_backend(g)));
  scalar(t, "embps_group_peer_sent_bytes_total", "counter",
         "Collective payload bytes this rank sent to its peers.", ld(&m->peer_bytes_sent));
  scalar(t, "embps_group_peer_received_bytes_total", "counter",
         "Collective payload bytes this rank received from its peers.",
         ld(&m->peer_bytes_received));
  scalar(t, "embps_group_collective_calls_total", "counter", "Collective calls made.",
         ld(&m->collective_calls));
  family(t, "embps_group_collective_seconds", "histogram",
         "Time of each collective call (all-gather, all-to-all, all-reduce, barrier).");
  hist(t, "embps_group_collective_seconds", "", &m->collective_seconds);

  scalar(t, "embps_group_batches_expired_total", "counter",
         "Batches failed with DEADLINE_EXCEEDED before they were ordered: a shard missed "
         "--batch-deadline-ms or a caller's deadline (grpc-timeout) passed (counted by the "
         "leader).",
         ld(&m->batches_expired));
  scalar(t, "embps_group_batches_cancelled_total", "counter",
         "Batches failed with CANCELLED before they were ordered because a shard's caller went "
         "away (counted by the leader).",
         ld(&m->batches_cancelled));
  scalar(t, "embps_group_shards_withdrawn_total", "counter",
         "This rank's shards withdrawn from their batch while parked, their caller having reset "
         "the stream or closed the connection.",
         ld(&m->shards_withdrawn));
  scalar(t, "embps_group_retries_deduplicated_total", "counter",
         "Retried push shards this rank answered from the retry window (replayed) instead of "
         "applying them again.",
         ld(&m->retries_deduplicated));

  scalar(t, "embps_rounds_total", "counter", "Rounds run on this rank that held a batch.",
         ld(&m->rounds));
  scalar(t, "embps_round_batches_total", "counter", "Lookup and push batches run in rounds.",
         ld(&m->batches));
  family(t, "embps_round_batches", "histogram", "Batches fused into one round.");
  hist(t, "embps_round_batches", "", &m->batches_per_round);
  family(t, "embps_round_seconds", "histogram",
         "Time a round takes on this rank's group thread (collectives plus compute).");
  hist(t, "embps_round_seconds", "", &m->round_seconds);
  family(t, "embps_round_phase_seconds", "histogram",
         "A round's time by phase: queue_wait (its oldest batch, from submission to the round's "
         "start), collectives (inside collective calls), compute (the rest: dedup, kernels, "
         "copies).");
  for (int p = 0; p < EMBPS_ROUND_PHASES; p++) {
    snprintf(lab, sizeof(lab), "phase=\"%s\",", phase_names[p]);
    hist(t, "embps_round_phase_seconds", lab, &m->phase_seconds[p]);
  }

  scalar(t, "embps_checkpoints_completed_total", "counter",
         "Checkpoints complete (manifest written) that this rank knows of.",
         ld(&m->ckpt_completed));
  scalar(t, "embps_checkpoints_failed_total", "counter", "Checkpoints that failed.",
         ld(&m->ckpt_failed));
  scalar(t, "embps_checkpoint_written_bytes_total", "counter",
         "Bytes of checkpoint files this rank wrote.", ld(&m->ckpt_bytes_written));
  if (ld(&m->ckpt_last_unix_ms)) {
    scalar(t, "embps_checkpoint_last_round", "gauge", "Round of the last complete checkpoint.",
           ld(&m->ckpt_last_round));
    family(t, "embps_checkpoint_last_timestamp_seconds", "gauge",
           "Unix time the last complete checkpoint became complete.");
    put(t, "embps_checkpoint_last_timestamp_seconds %.3f\n",
        (double)ld(&m->ckpt_last_unix_ms) / 1000.0);
    scalar(t, "embps_checkpoint_last_bytes", "gauge",
           "Bytes of every rank's files of the last complete checkpoint.", ld(&m->ckpt_last_bytes));
  }
  family(t, "embps_checkpoint_duration_seconds", "histogram",
         "Time from ordering a checkpoint to its manifest (recorded by the leader).");
  hist(t, "embps_checkpoint_duration_seconds", "", &m->ckpt_seconds);
}

/* Hash-keyed tables' key index (the same figures on every rank; the families list only those
 * tables): slots, keys stored, and since creation the keys admitted, evicted, expired and refused
 * and the (key, step) gradients dropped. */
static void render_hash_tables(text_t *t, embps_table_t **list, size_t n) {
  static const struct {
    const char *name, *type, *help;
  } fam[] = {
      {"embps_table_capacity", "gauge", "Slots of a hash-keyed table."},
      {"embps_table_keys", "gauge", "Keys a hash-keyed table stores now."},
      {"embps_table_keys_admitted_total", "counter",
       "Keys given a slot (a key stored again after its eviction counts again)."},
      {"embps_table_keys_evicted_total", "counter", "Keys evicted for a new key."},
      {"embps_table_keys_expired_total", "counter", "Keys expired (ttl eviction)."},
      {"embps_table_keys_refused_total", "counter",
       "(key, step) pairs admitted but given no slot: every slot held a key of that step."},
      {"embps_table_gradients_dropped_total", "counter",
       "(key, step) gradients dropped: the key not yet admitted (admit_after), or refused."},
  };
  char name[EMBPS_TABLE_NAME_MAX * 2 + 4];
  size_t hashed = 0;
  for (size_t i = 0; i < n; i++)
    hashed += embps_table_config_hashed(embps_table_config(list[i]));
  if (!hashed)
    return;
  for (size_t f = 0; f < sizeof(fam) / sizeof(fam[0]); f++) {
    family(t, fam[f].name, fam[f].type, fam[f].help);
    for (size_t i = 0; i < n; i++) {
      const embps_table_config_t *c = embps_table_config(list[i]);
      embps_hindex_stats_t st;
      if (!embps_table_config_hashed(c))
        continue;
      embps_table_hindex_stats(list[i], &st);
      const uint64_t v[] = {c->capacity,
                            st.size,
                            st.admitted,
                            st.evicted,
                            st.expired,
                            st.refused,
                            st.refused + st.not_admitted}; /* in fam's order */
      escape(name, sizeof(name), c->name);
      put(t, "%s{table=\"%s\"} %llu\n", fam[f].name, name, (unsigned long long)v[f]);
    }
  }
}

/* Per-table series, over one listing of the tables: a table dropped meanwhile keeps a readable
 * struct (embps_store_drop), and a dropped table is in no later listing. */
static void render_tables(text_t *t, embps_store_t *store, embps_backend_t backend) {
  size_t n = embps_store_count(store) + 1;
  embps_table_t **list = embps_calloc(n, sizeof(*list));
  uint64_t table_bytes = 0;
  static const struct {
    const char *name, *help;
    size_t off;
  } counters[] = {
      {"embps_table_lookups_total", "Lookup batches served (this rank's shards).",
       offsetof(embps_table_counters_t, lookups)},
      {"embps_table_pushes_total", "Gradient push batches served (this rank's shards).",
       offsetof(embps_table_counters_t, pushes)},
      {"embps_table_rows_looked_up_total", "Rows looked up (tokens of this rank's shards).",
       offsetof(embps_table_counters_t, rows_looked_up)},
      {"embps_table_rows_pushed_total", "Gradient rows pushed (tokens of this rank's shards).",
       offsetof(embps_table_counters_t, rows_pushed)},
      {"embps_table_steps_applied_total", "Optimizer steps applied.",
       offsetof(embps_table_counters_t, steps_applied)},
      {"embps_table_steps_skipped_total",
       "Optimizer steps skipped by the finite gate (a non-finite gradient).",
       offsetof(embps_table_counters_t, steps_skipped)},
  };
  char name[EMBPS_TABLE_NAME_MAX * 2 + 4];

  if (!list) {
    t->failed = 1;
    return;
  }
  n = embps_store_list(store, list, n);
  family(t, "embps_tables", "gauge", "Tables this server holds.");
  put(t, "embps_tables %zu\n", n);
  family(t, "embps_table_rows", "gauge", "Rows of the table.");
  for (size_t i = 0; i < n; i++) {
    embps_table_t *tb = list[i];
    escape(name, sizeof(name), embps_table_config(tb)->name);
    put(t, "embps_table_rows{table=\"%s\"} %llu\n", name,
        (unsigned long long)embps_table_config_rows(embps_table_config(tb)));
  }
  family(t, "embps_table_bytes", "gauge",
         "Bytes this rank holds of the table (its column slice and optimizer state).");
  for (size_t i = 0; i < n; i++) {
    embps_table_t *tb = list[i];
    escape(name, sizeof(name), embps_table_config(tb)->name);
    table_bytes += embps_table_bytes(tb);
    put(t, "embps_table_bytes{table=\"%s\"} %llu\n", name,
        (unsigned long long)embps_table_bytes(tb));
  }
  for (size_t c = 0; c < sizeof(counters) / sizeof(counters[0]); c++) {
    family(t, counters[c].name, "counter", counters[c].help);
    for (size_t i = 0; i < n; i++) {
      embps_table_t *tb = list[i];
      const atomic_uint_fast64_t *a =
          (const atomic_uint_fast64_t *)((const char *)embps_table_counters(tb) + counters[c].off);
      escape(name, sizeof(name), embps_table_config(tb)->name);
      put(t, "%s{table=\"%s\"} %llu\n", counters[c].name, name, (unsigned long long)ld(a));
    }
  }
  render_hash_tables(t, list, n);
  family(t, "embps_table_unique_tokens_per_batch", "summary",
         "Distinct tokens per deduplicated batch (every rank's shards together).");
  for (size_t i = 0; i < n; i++) {
    embps_table_t *tb = list[i];
    embps_table_counters_t *tc = embps_table_counters(tb);
    escape(name, sizeof(name), embps_table_config(tb)->name);
    put(t, "embps_table_unique_tokens_per_batch_sum{table=\"%s\"} %llu\n", name,
        (unsigned long long)ld(&tc->unique_tokens));
    put(t, "embps_table_unique_tokens_per_batch_count{table=\"%s\"} %llu\n", name,
        (unsigned long long)ld(&tc->unique_batches));
  }

  /* Memory: tables where the backend keeps them, and the process's resident set. */
  {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
      if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = 0;
      fclose(f);
    }
    uint64_t pinned = 0, pageable = 0;
    embps_host_memory(&pinned, &pageable);
    family(t, "embps_memory_bytes", "gauge",
           "Memory held: tables_host and tables_device (table slices and optimizer state by "
           "where the backend keeps them), buffers_pinned and buffers_host (request and reply "
           "buffers: page-locked for the CUDA backend, else pageable), process_resident (the "
           "whole process's resident set).");
    int device = backend == EMBPS_BACKEND_CUDA;
    put(t, "embps_memory_bytes{kind=\"tables_host\"} %llu\n",
        (unsigned long long)(device ? 0 : table_bytes));
    put(t, "embps_memory_bytes{kind=\"tables_device\"} %llu\n",
        (unsigned long long)(device ? table_bytes : 0));
    put(t, "embps_memory_bytes{kind=\"buffers_pinned\"} %llu\n", (unsigned long long)pinned);
    put(t, "embps_memory_bytes{kind=\"buffers_host\"} %llu\n", (unsigned long long)pageable);
    put(t, "embps_memory_bytes{kind=\"process_resident\"} %llu\n",
        (unsigned long long)resident * (unsigned long long)sysconf(_SC_PAGESIZE));
  }
  embps_free(list);
}

embps_status_t embps_metrics_render(const embps_metrics_sources_t *src, char **out, size_t *len) {
  text_t t = {0};
  family(&t, "embps_build_info", "gauge", "The server's version, as a label; the value is 1.");
  put(&t, "embps_build_info{version=\"%s\"} 1\n", EMBPS_VERSION);
  family(&t, "process_start_time_seconds", "gauge",
         "Start time of the process since unix epoch in seconds.");
  put(&t, "process_start_time_seconds %.3f\n", src->start_unix_s);
  if (src->net) {
    render_grpc(&t, embps_net_metrics(src->net));
    render_net(&t, embps_net_metrics(src->net));
  }
  if (src->group)
    render_group(&t, src->group);
  if (src->store)
    render_tables(&t, src->store, src->group ? embps_group_backend(src->group) : EMBPS_BACKEND_CPU);
  if (t.failed || !t.buf) {
    embps_free(t.buf);
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  *out = t.buf;
  *len = t.len;
  return EMBPS_OK;
}

/* ---- HTTP ------------------------------------------------------------------------------------ */

struct embps_metrics_server {
  struct MHD_Daemon *daemon;
  embps_metrics_sources_t src;
  int port;
};

static void free_body(void *p) { embps_free(p); }

static enum MHD_Result on_http(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_len, void **state) {
  embps_metrics_server_t *m = cls;
  struct MHD_Response *resp;
  enum MHD_Result ret;
  unsigned status = MHD_HTTP_OK;
  char *body = NULL;
  size_t len = 0;
  (void)version;
  (void)upload;
  (void)upload_len;
  (void)state;
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
    static const char msg[] = "only GET /metrics is served here\n";
    status = MHD_HTTP_METHOD_NOT_ALLOWED;
    resp = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
  } else if (strcmp(url, "/metrics") != 0) {
    static const char msg[] = "not found: metrics are at /metrics\n";
    status = MHD_HTTP_NOT_FOUND;
    resp = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
  } else {
    if (embps_metrics_render(&m->src, &body, &len) != EMBPS_OK) {
      static const char msg[] = "out of memory rendering the metrics\n";
      status = MHD_HTTP_INTERNAL_SERVER_ERROR;
      resp = MHD_create_response_from_buffer(sizeof(msg) - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
    } else {
      resp = MHD_create_response_from_buffer_with_free_callback(len, body, free_body);
      if (!resp)
        embps_free(body);
    }
  }
  if (!resp)
    return MHD_NO;
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                          status == MHD_HTTP_OK ? "text/plain; version=0.0.4; charset=utf-8"
                                                : "text/plain; charset=utf-8");
  ret = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return ret;
}

embps_status_t embps_metrics_server_start(embps_metrics_server_t **out, const char *host_port,
                                          const embps_metrics_sources_t *src, embps_error_t *err) {
  embps_hostport_t hp;
  struct sockaddr_storage ss;
  socklen_t sslen;
  embps_metrics_server_t *m;
  embps_status_t ret;
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD;
  const union MHD_DaemonInfo *info;

  if ((ret = embps_hostport_parse(&hp, host_port, strlen(host_port), "--metrics-listen",
                                  EMBPS_HOSTPORT_LISTEN, err)) != EMBPS_OK ||
      (ret = embps_hostport_resolve(&hp, &ss, &sslen, err)) != EMBPS_OK)
    return ret == EMBPS_OK ? EMBPS_INVALID_ARGUMENT : ret;
  if (!(m = embps_calloc(1, sizeof(*m))))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for the metrics server");
  m->src = *src;
  if (ss.ss_family == AF_INET6)
    flags |= MHD_USE_IPv6;
  m->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_http, m, MHD_OPTION_SOCK_ADDR,
                               (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, 64u,
                               MHD_OPTION_CONNECTION_TIMEOUT, 30u, MHD_OPTION_END);
  if (!m->daemon) {
    embps_free(m);
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "--metrics-listen %s: cannot serve HTTP there (address in use?)",
                           host_port);
  }
  info = MHD_get_daemon_info(m->daemon, MHD_DAEMON_INFO_BIND_PORT);
  m->port = info ? (int)info->port : (int)hp.port;
  *out = m;
  return EMBPS_OK;
}

int embps_metrics_server_port(const embps_metrics_server_t *m) { return m->port; }

void embps_metrics_server_stop(embps_metrics_server_t *m) {
  if (!m)
    return;
  MHD_stop_daemon(m->daemon);
  embps_free(m);
}
