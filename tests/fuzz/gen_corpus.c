/* Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from the project's own
 * encoders: requests packed by protobuf-c and sent by the in-memory HTTP/2 client of the net
 * tests, the server core's real replies to them, the group's frames from control.c's encoders,
 * checkpoint files from the store's slice writer. Seeds are real traffic, so the fuzzers start past
 * the preface, the framing and the checksums.
 *
 *   fuzz_gen_corpus DIR   (DIR: tests/fuzz/corpus; the output is deterministic) */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/alloc.h"
#include "embps/v1/embps.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "server/group/control.h"
#include "server/group/dedup.h"
#include "server/net/h2conn.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.h"
#include "tests/fuzz/fuzz_ckpt_tables.h"
#include "tests/fuzz/fuzz_side_files.h"
#include "tests/unit/net/h2client.h"

static const char *root;

/* Writes selector bytes sel[0..nsel) then p[0..n) as DIR/target/name. */
static void seed(const char *target, const char *name, const uint8_t *sel, size_t nsel,
                 const void *p, size_t n) {
  char path[4096];
  FILE *f;
  snprintf(path, sizeof(path), "%s/%s", root, target);
  if (mkdir(path, 0755) != 0 && errno != EEXIST)
    abort();
  snprintf(path, sizeof(path), "%s/%s/%s", root, target, name);
  if (!(f = fopen(path, "wb")) || fwrite(sel, 1, nsel, f) != nsel ||
      (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
}

typedef struct packed {
  uint8_t *p;
  size_t n;
} packed_t;

static packed_t pack(const ProtobufCMessage *m) {
  packed_t out = {NULL, protobuf_c_message_get_packed_size(m)};
  out.p = malloc(out.n ? out.n : 1);
  protobuf_c_message_pack(m, out.p);
  return out;
}

/* A gRPC frame: prefix + message. */
static packed_t frame(const packed_t *m, uint8_t flags) {
  packed_t out = {malloc(m->n + 5), m->n + 5};
  out.p[0] = flags;
  out.p[1] = (uint8_t)(m->n >> 24);
  out.p[2] = (uint8_t)(m->n >> 16);
  out.p[3] = (uint8_t)(m->n >> 8);
  out.p[4] = (uint8_t)m->n;
  memcpy(out.p + 5, m->p, m->n);
  return out;
}

/* ---- the requests ---- */

enum { M_LOOKUP, M_PUSH, M_CREATE, M_LIST, M_STATS, M_CKPT, M_LIST_CKPT, M_HEALTH, NUM_M };
static const char *const method_paths[NUM_M] = {
    "/embps.v1.EmbeddingService/Lookup",          "/embps.v1.EmbeddingService/PushGradients",
    "/embps.v1.EmbeddingService/CreateTable",     "/embps.v1.EmbeddingService/ListTables",
    "/embps.v1.EmbeddingService/GetStats",        "/embps.v1.EmbeddingService/Checkpoint",
    "/embps.v1.EmbeddingService/ListCheckpoints", "/grpc.health.v1.Health/Check",
};

static packed_t request(int m) {
  static int64_t tokens[] = {1, 2, 3, 2};
  static float grads[4 * 8];
  switch (m) {
  case M_LOOKUP: {
    Embps__V1__LookupRequest r = EMBPS__V1__LOOKUP_REQUEST__INIT;
    r.table = "t";
    r.batch_id = 300;
    r.tokens.data = (uint8_t *)tokens;
    r.tokens.len = sizeof(tokens);
    return pack(&r.base);
  }
  case M_PUSH: {
    Embps__V1__PushGradientsRequest r = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
    for (size_t i = 0; i < sizeof(grads) / sizeof(grads[0]); i++)
      grads[i] = 0.25f * (float)i;
    r.table = "t";
    r.batch_id = 301;
    r.tokens.data = (uint8_t *)tokens;
    r.tokens.len = sizeof(tokens);
    r.gradients.data = (uint8_t *)grads;
    r.gradients.len = sizeof(grads);
    r.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
    return pack(&r.base);
  }
  case M_CREATE: {
    Embps__V1__CreateTableRequest r = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
    static Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
    static Embps__V1__OptimizerConfig opt = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
    spec.name = "emb";
    spec.rows = 100;
    spec.emb_width = 8;
    spec.seed = 1;
    opt.kind = EMBPS__V1__OPTIMIZER_KIND__OPTIMIZER_ADAM;
    opt.lr = 0.5f;
    spec.optimizer = &opt;
    r.spec = &spec;
    return pack(&r.base);
  }
  case M_LIST: {
    Embps__V1__ListTablesRequest r = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
    return pack(&r.base);
  }
  case M_STATS: {
    Embps__V1__GetStatsRequest r = EMBPS__V1__GET_STATS_REQUEST__INIT;
    r.prometheus = 1;
    return pack(&r.base);
  }
  case M_CKPT: {
    Embps__V1__CheckpointRequest r = EMBPS__V1__CHECKPOINT_REQUEST__INIT;
    r.table = "t";
    return pack(&r.base);
  }
  case M_LIST_CKPT: {
    Embps__V1__ListCheckpointsRequest r = EMBPS__V1__LIST_CHECKPOINTS_REQUEST__INIT;
    return pack(&r.base);
  }
  default: {
    Grpc__Health__V1__HealthCheckRequest r = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    r.service = "embps.v1.EmbeddingService";
    return pack(&r.base);
  }
  }
}

/* A reply of the method's type, as a server would answer it. */
static packed_t reply(int m) {
  static float rows[4 * 4];
  switch (m) {
  case M_LOOKUP: {
    Embps__V1__LookupResponse r = EMBPS__V1__LOOKUP_RESPONSE__INIT;
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
      rows[i] = (float)i;
    r.batch_id = 300;
    r.emb_width = 4;
    r.dtype = EMBPS__V1__DTYPE__DTYPE_F32;
    r.rows.data = (uint8_t *)rows;
    r.rows.len = 3 * 4 * sizeof(float); /* 3 tokens of 4 f32 columns */
    return pack(&r.base);
  }
  case M_PUSH: {
    Embps__V1__PushGradientsResponse r = EMBPS__V1__PUSH_GRADIENTS_RESPONSE__INIT;
    r.batch_id = 301;
    r.applied = 1;
    r.grad_norm = 1.5;
    r.num_unique = 3;
    return pack(&r.base);
  }
  case M_CREATE: {
    Embps__V1__CreateTableResponse r = EMBPS__V1__CREATE_TABLE_RESPONSE__INIT;
    static Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
    spec.name = "emb";
    spec.rows = 100;
    spec.emb_width = 8;
    r.spec = &spec;
    r.group_size = 2;
    return pack(&r.base);
  }
  case M_LIST: {
    Embps__V1__ListTablesResponse r = EMBPS__V1__LIST_TABLES_RESPONSE__INIT;
    static Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
    static Embps__V1__TableSpec *specs[] = {&spec, &spec};
    spec.name = "emb";
    spec.rows = 100;
    spec.emb_width = 8;
    r.tables = specs;
    r.n_tables = 2;
    r.group_size = 2;
    return pack(&r.base);
  }
  case M_STATS: {
    Embps__V1__GetStatsResponse r = EMBPS__V1__GET_STATS_RESPONSE__INIT;
    static Embps__V1__TableStats ts = EMBPS__V1__TABLE_STATS__INIT;
    static Embps__V1__TableStats *tables[] = {&ts};
    ts.name = "emb";
    ts.rows = 100;
    ts.lookups = 7;
    r.backend = "cpu";
    r.version = "0.1.0";
    r.mesh = "shard=2";
    r.tables = tables;
    r.n_tables = 1;
    r.prometheus_text = "embps_up 1\n";
    return pack(&r.base);
  }
  case M_CKPT: {
    Embps__V1__CheckpointResponse r = EMBPS__V1__CHECKPOINT_RESPONSE__INIT;
    r.bytes = 4096;
    r.round = 12;
    r.path = "/ckpt/ckpt-00000000000000000012";
    return pack(&r.base);
  }
  case M_LIST_CKPT: {
    Embps__V1__ListCheckpointsResponse r = EMBPS__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
    return pack(&r.base);
  }
  default: {
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    return pack(&r.base);
  }
  }
}

/* ---- HTTP/2 traffic: the in-memory client against the server's core ---- */

typedef struct traffic {
  uint8_t *to_server, *to_client;
  size_t to_server_len, to_client_len;
  int method; /* the reply the handler sends */
  int fail;   /* answer with an error instead */
} traffic_t;

static void append(uint8_t **buf, size_t *len, const uint8_t *p, size_t n) {
  *buf = realloc(*buf, *len + n);
  memcpy(*buf + *len, p, n);
  *len += n;
}

static void on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                       size_t len) {
  traffic_t *t = user;
  (void)method, (void)len;
  embps_free(msg);
  if (t->fail) {
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, "table 'x' not found: 100% sure");
    return;
  }
  packed_t r = reply(t->method);
  embps_net_call_reply(call, r.p, r.n, free, r.p);
}

/* Runs one call of `method` with body (already framed) and records both directions. */
static void converse(traffic_t *t, const char *path, const char *ct, const packed_t *body) {
  embps__h2conn_hooks_t hooks = {.on_request = on_request, .request_user = t};
  embps__h2conn_t *conn;
  h2c_t c;
  if (embps__h2conn_new(&conn, 1 << 20, &hooks) != EMBPS_OK)
    abort();
  h2c_init(&c, 1);
  h2c_request(&c, path, ct, body ? body->p : NULL, body ? body->n : 0, 0, body ? body->n : 0);
  for (int round = 0; round < 100; round++) {
    const uint8_t *p;
    ssize_t n;
    int moved = 0;
    while ((n = nghttp2_session_mem_send(c.session, &p)) > 0) {
      moved = 1;
      append(&t->to_server, &t->to_server_len, p, (size_t)n);
      embps__h2conn_feed(conn, p, (size_t)n);
    }
    embps__h2out_t *out;
    while ((out = embps__h2conn_take_output(conn)) != NULL) {
      size_t nsegs;
      const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
      for (size_t i = 0; i < nsegs; i++) {
        moved = 1;
        append(&t->to_client, &t->to_client_len, segs[i].base, segs[i].len);
        nghttp2_session_mem_recv(c.session, segs[i].base, segs[i].len);
      }
      embps__h2out_free(out);
    }
    if (!moved)
      break;
  }
  h2c_free(&c);
  embps__h2conn_free(conn);
}

static void http2_seeds(void) {
  static const char *const names[NUM_M] = {"lookup",           "push",  "create_table",
                                           "list_tables",      "stats", "checkpoint",
                                           "list_checkpoints", "health"};
  for (int m = 0; m < NUM_M; m++) {
    packed_t req = request(m), body = frame(&req, 0);
    uint8_t sel[3];
    char name[64];

    /* fuzz_requests: method, group byte (size 1, rank 0, ready, cpu; then checkpoints on) */
    sel[0] = (uint8_t)m;
    sel[1] = 0;
    seed("fuzz_requests", names[m], sel, 2, req.p, req.n);
    sel[1] = 0x40 | 0x02; /* group of 4, checkpoints on */
    snprintf(name, sizeof(name), "%s_group4", names[m]);
    seed("fuzz_requests", name, sel, 2, req.p, req.n);

    /* fuzz_grpc_frame: whole frames, then cut into 7-byte DATA frames */
    sel[0] = 0;
    sel[1] = 1;
    seed("fuzz_grpc_frame", names[m], sel, 2, body.p, body.n);
    sel[0] = 7;
    snprintf(name, sizeof(name), "%s_chunked", names[m]);
    seed("fuzz_grpc_frame", name, sel, 2, body.p, body.n);

    /* fuzz_h2conn and fuzz_client_reply: both directions of a real call */
    for (int fail = 0; fail < 2; fail++) {
      traffic_t t = {.method = m, .fail = fail};
      converse(&t, method_paths[m], "application/grpc", &body);
      snprintf(name, sizeof(name), "%s%s", names[m], fail ? "_error" : "");
      if (!fail)
        seed("fuzz_h2conn", name, NULL, 0, t.to_server, t.to_server_len);
      sel[0] = (uint8_t)(1 + m);
      seed("fuzz_client_reply", name, sel, 1, t.to_client, t.to_client_len);
      free(t.to_server);
      free(t.to_client);
    }
    if (m == M_LOOKUP) {
      packed_t r = reply(M_LOOKUP), rf = frame(&r, 0);
      /* fuzz_client_reply mode 0: 3 tokens of 4 columns, all kept (selector 3 << 3 | 3) */
      sel[0] = 0;
      sel[1] = (3 << 3) | 3;
      sel[2] = 255;
      seed("fuzz_client_reply", "lookup_body", sel, 3, rf.p, rf.n);
      sel[1] |= 0x40; /* the third token is padding */
      sel[2] = 2;
      seed("fuzz_client_reply", "lookup_body_padded", sel, 3, rf.p, rf.n);
      free(r.p);
      free(rf.p);
    }
    free(req.p);
    free(body.p);
  }
  { /* bodies the server must refuse: compressed, over the limit, two messages, cut short */
    packed_t req = request(M_LOOKUP), compressed = frame(&req, 1), two = frame(&req, 0);
    static const uint8_t oversized[] = {0, 0, 0, 0x10, 0, 1, 2, 3};
    uint8_t sel[2] = {0, 1};
    seed("fuzz_grpc_frame", "bad_compressed", sel, 2, compressed.p, compressed.n);
    seed("fuzz_grpc_frame", "bad_oversized", sel, 2, oversized, sizeof(oversized));
    seed("fuzz_grpc_frame", "bad_truncated", sel, 2, two.p, two.n - 1);
    two.p = realloc(two.p, 2 * two.n);
    memcpy(two.p + two.n, two.p, two.n);
    two.n *= 2;
    seed("fuzz_grpc_frame", "bad_two_messages", sel, 2, two.p, two.n);
    free(req.p);
    free(compressed.p);
    free(two.p);
  }
  { /* a connection that misbehaves: wrong content type, compressed and oversized messages */
    packed_t req = request(M_LOOKUP), compressed = frame(&req, 1);
    traffic_t t = {0};
    converse(&t, method_paths[M_LOOKUP], "application/json", &compressed);
    seed("fuzz_h2conn", "bad_content_type", NULL, 0, t.to_server, t.to_server_len);
    free(t.to_server);
    free(t.to_client);
    memset(&t, 0, sizeof(t));
    converse(&t, method_paths[M_LOOKUP], "application/grpc", &compressed);
    seed("fuzz_h2conn", "compressed", NULL, 0, t.to_server, t.to_server_len);
    free(t.to_server);
    free(t.to_client);
    memset(&t, 0, sizeof(t));
    converse(&t, "/grpc.health.v1.Health/Check", "application/grpc", NULL);
    seed("fuzz_h2conn", "no_body", NULL, 0, t.to_server, t.to_server_len);
    free(t.to_server);
    free(t.to_client);
    free(req.p);
    free(compressed.p);
  }
}

/* ---- the group's control protocol ---- */

static void control_seeds(void) {
  const char *identity = "version=0.1.0\nmesh=shard=4\ntable_axis=shard\ndata_axis=shard\n";
  embps__buf_t b = {0};
  embps_error_t err;
  uint8_t sel;

  embps__hello_encode(&b, 0, 2, 4, identity, strlen(identity));
  sel = 0;
  seed("fuzz_control", "hello", &sel, 1, b.data, b.len);
  embps__buf_free(&b);
  embps__hello_encode(&b, 1, 3, 4, "version=0.1.0\nmesh=shard=2\n", 27);
  seed("fuzz_control", "hello_differs", &sel, 1, b.data, b.len);
  embps__buf_free(&b);
  embps__verdict_encode(&b, 0, "rank 1's configuration differs from rank 0's: mesh");
  sel = 1;
  seed("fuzz_control", "verdict", &sel, 1, b.data, b.len);
  embps__buf_free(&b);

  embps_batch_desc_t d;
  memset(&d, 0, sizeof(d));
  d.batch_id = 12;
  d.kind = EMBPS_OP_PUSH;
  d.tokens_per_batch = 64;
  d.digest = UINT64_C(0x9e3779b97f4a7c15);
  d.attempt = 1;
  snprintf(d.table, sizeof(d.table), "emb");
  embps__frame_notice(&b, &d, &err);

  embps_round_entry_t e[3];
  embps_table_config_t cfgs[3];
  embps__ckpt_order_t ck[3];
  memset(e, 0, sizeof(e));
  memset(cfgs, 0, sizeof(cfgs));
  memset(ck, 0, sizeof(ck));
  e[0] = (embps_round_entry_t){
      .batch_id = 12, .attempt = 1, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_PUSH};
  e[1] = (embps_round_entry_t){
      .batch_id = 13, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_CREATE_TABLE};
  fuzz_ckpt_table(0, &cfgs[1]);
  e[2] =
      (embps_round_entry_t){.batch_id = 14, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_CHECKPOINT};
  ck[2].round = 9;
  snprintf(ck[2].scope, sizeof(ck[2].scope), "emb");
  embps__frame_round(&b, e, cfgs, ck, 3, &err);
  e[0].action = EMBPS_ROUND_FAIL;
  e[0].status = EMBPS_DEADLINE_EXCEEDED;
  snprintf(e[0].message, sizeof(e[0].message), "batch 12: shard 1 did not arrive");
  embps__frame_round(&b, e, cfgs, ck, 1, &err);
  embps__frame_broken(&b, "rank 2 left the group", &err);
  embps__frame_leaving(&b, "rank 1 left the group (shutting down)", &err);
  embps__withdraw_t w = {.client_id = 77, .batch_id = 12, .attempt = 1};
  embps__frame_withdraw(&b, &w, &err);
  {
    embps__buf_t inner = {0}; /* a member's withdrawal, as its relay passes it on */
    embps__frame_withdraw(&inner, &w, &err);
    embps__frame_relay(&b, 5, inner.data, inner.len, &err);
    embps__buf_free(&inner);
  }
  embps__device_claim_t claim = {.device = 1};
  snprintf(claim.host, sizeof(claim.host), "node-a");
  snprintf(claim.bus_id, sizeof(claim.bus_id), "0000:3b:00.0");
  embps__frame_device(&b, &claim, &err);
  uint8_t id[EMBPS__NCCL_ID_BYTES];
  for (size_t i = 0; i < sizeof(id); i++)
    id[i] = (uint8_t)i;
  embps__frame_nccl_id(&b, id, &err);
  embps__ckpt_msg_t m;
  memset(&m, 0, sizeof(m));
  m.what = EMBPS__CKPT_COMPLETE;
  m.seq = 2;
  m.round = 9;
  m.bytes = 1 << 20;
  snprintf(m.path, sizeof(m.path), "/ckpt/ckpt-00000000000000000009");
  embps__frame_checkpoint(&b, &m, &err);
  sel = 2;
  seed("fuzz_control", "frames", &sel, 1, b.data, b.len);
  embps__buf_free(&b);
}

/* ---- checkpoint files ---- */

static packed_t read_file(const char *path) {
  packed_t out = {NULL, 0};
  FILE *f = fopen(path, "rb");
  if (!f)
    abort();
  fseek(f, 0, SEEK_END);
  out.n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  out.p = malloc(out.n);
  if (fread(out.p, 1, out.n, f) != out.n)
    abort();
  fclose(f);
  return out;
}

static void checkpoint_seeds(void) {
  char dir[] = "/tmp/embps-gen-ckpt-XXXXXX", ckpt[4096], path[8192], name[512];
  embps_table_config_t cfg[FUZZ_CKPT_TABLES];
  embps_ckpt_file_t files[FUZZ_CKPT_TABLES];
  embps_ckpt_manifest_t m;
  embps_error_t err;
  uint8_t sel;

  if (!mkdtemp(dir))
    abort();
  embps_ckpt_path(ckpt, sizeof(ckpt), dir, FUZZ_CKPT_ROUND);
  if (mkdir(ckpt, 0700) != 0)
    abort();
  for (int t = 0; t < FUZZ_CKPT_TABLES; t++) {
    embps_ckpt_slice_t s;
    size_t n;
    uint64_t bytes;
    fuzz_ckpt_table(t, &cfg[t]);
    n = (size_t)cfg[t].rows * cfg[t].emb_width;
    memset(&s, 0, sizeof(s));
    s.config = cfg[t];
    s.group_size = 1;
    s.shard_width = cfg[t].emb_width;
    s.round = FUZZ_CKPT_ROUND;
    s.step = 4;
    s.data = calloc(n, 4);
    s.state0 = calloc(n, 4);
    s.state1 = t == 0 ? calloc(n, 4) : NULL;
    embps_ckpt_slice_name(name, sizeof(name), 0, cfg[t].name);
    snprintf(path, sizeof(path), "%s/%s", ckpt, name);
    if (embps_ckpt_write_slice(path, &s, &bytes, &err) != EMBPS_OK) {
      fprintf(stderr, "%s\n", err.message);
      exit(1);
    }
    packed_t f = read_file(path);
    sel = (uint8_t)(1 | t << 1);
    snprintf(name, sizeof(name), "slice_t%d", t);
    seed("fuzz_checkpoint", name, &sel, 1, f.p, f.n);
    sel |= 4;
    snprintf(name, sizeof(name), "slice_t%d_fixed", t);
    seed("fuzz_checkpoint", name, &sel, 1, f.p, f.n);
    free(f.p);
    unlink(path);
    free((void *)s.data);
    free((void *)s.state0);
    free((void *)s.state1);
    files[t] = (embps_ckpt_file_t){.rank = 0, .bytes = bytes};
    memcpy(files[t].table, cfg[t].name, sizeof(files[t].table)); /* both EMBPS_TABLE_NAME_MAX */
  }
  memset(&m, 0, sizeof(m));
  m.round = FUZZ_CKPT_ROUND;
  m.group_size = 1;
  m.num_tables = FUZZ_CKPT_TABLES;
  m.tables = cfg;
  m.num_files = FUZZ_CKPT_TABLES;
  m.files = files;
  if (embps_ckpt_write_manifest(ckpt, &m, &err) != EMBPS_OK)
    abort();
  snprintf(path, sizeof(path), "%s/%s", ckpt, EMBPS_CKPT_MANIFEST);
  packed_t f = read_file(path);
  /* time_ms is the wall clock: zero it (and fix the checksum through the selector) so the seed
   * is the same on every run */
  memset(f.p + 16 + 16, 0, 8);
  sel = 4;
  seed("fuzz_checkpoint", "manifest_fixed", &sel, 1, f.p, f.n);
  free(f.p);
  unlink(path);
  rmdir(ckpt);
  rmdir(dir);
}

/* ---- the retry window ---- */

static void retry_window_seeds(void) {
  embps_dedup_t *d;
  uint8_t *p, sel;
  size_t n;
  if (embps_dedup_new(&d, 4, 8) != EMBPS_OK)
    abort();
  if (embps_dedup_encode(d, NULL, 1, &p, &n) != EMBPS_OK)
    abort();
  sel = 0;
  seed("fuzz_retry_window", "empty", &sel, 1, p, n);
  free(p);
  /* Three clients over two tables; client 10 forgets two pushes (a floor). */
  for (uint64_t b = 1; b <= 6; b++) {
    embps_dedup_result_t r = {.applied = (uint8_t)(b % 2),
                              .skipped = (uint8_t) !(b % 2),
                              .grad_norm = 0.5 * (double)b,
                              .num_unique = b * 3};
    if (embps_dedup_record(d, 10, b, 100 + b, b % 3 ? "a" : "b", b, &r) != EMBPS_OK)
      abort();
  }
  embps_dedup_result_t r = {.applied = 1, .grad_norm = 2.0, .num_unique = 9};
  if (embps_dedup_record(d, 20, 9, 0x9999, "b", 3, &r) != EMBPS_OK ||
      embps_dedup_record(d, 20, 4, 0x4444, "a", 7, &r) != EMBPS_OK ||
      embps_dedup_record(d, 30, 1, 0x1111, "a", 7, &r) != EMBPS_OK)
    abort();
  if (embps_dedup_encode(d, NULL, 9, &p, &n) != EMBPS_OK)
    abort();
  sel = 4 | 8; /* a window of 4, every client: reads back whole */
  seed("fuzz_retry_window", "window", &sel, 1, p, n);
  sel = 1 | 2; /* crc rewritten; a window of 2 and 2 clients: forgets on the way */
  seed("fuzz_retry_window", "window_fixed_smaller", &sel, 1, p, n);
  free(p);
  if (embps_dedup_encode(d, "b", 9, &p, &n) != EMBPS_OK)
    abort();
  sel = 1 | 6;
  seed("fuzz_retry_window", "window_scoped_fixed", &sel, 1, p, n);
  free(p);
  embps_dedup_free(d);
}

/* ---- a hash-keyed table's index ---- */

/* For each of fuzz_hindex.c's settings (fuzz_side_files.h), an index after some steps; for
 * fuzz_hindex_delta.c, deltas from the capture after FUZZ_HINDEX_DELTA_BASE of those steps: to
 * the end, after one step, after none. */
static void hindex_seeds(void) {
  for (uint8_t i = 0; i < 4; i++) {
    embps_hindex_t *ix;
    size_t n;
    uint8_t *p, sel = (uint8_t)(i << 1);
    char name[32];
    if (embps_hindex_new(&ix, &fuzz_hindex_configs[i], NULL) != EMBPS_OK)
      abort();
    fuzz_hindex_steps(ix, 0, 90);
    n = embps_hindex_encoded_bytes(ix);
    if (!(p = malloc(n)))
      abort();
    embps_hindex_encode(ix, p);
    snprintf(name, sizeof(name), "index%u", (unsigned)i);
    seed("fuzz_hindex", name, &sel, 1, p, n);
    free(p);
    embps_hindex_free(ix);
    for (uint64_t to = FUZZ_HINDEX_DELTA_BASE; to <= 90;
         to += to == FUZZ_HINDEX_DELTA_BASE ? 1 : 29) {
      ix = fuzz_hindex_delta_base(i);
      fuzz_hindex_steps(ix, FUZZ_HINDEX_DELTA_BASE, to);
      n = embps_hindex_delta_bytes(ix);
      if (!(p = malloc(n)))
        abort();
      embps_hindex_delta_encode(ix, p);
      snprintf(name, sizeof(name), "delta%u_%u", (unsigned)i,
               (unsigned)(to - FUZZ_HINDEX_DELTA_BASE));
      seed("fuzz_hindex_delta", name, &sel, 1, p, n);
      free(p);
      embps_hindex_free(ix);
    }
  }
}

/* ---- text ---- */

static void text_seeds(void) {
  static const struct {
    uint8_t sel;
    const char *name, *text;
  } texts[] = {
      {0, "addr_v4", "10.0.0.1:7070"},
      {0, "addr_v6", "[fe80::1]:7070"},
      {1, "listen_any", ":0"},
      {1, "addr_name", "embps-0.embps.default.svc.cluster.local:7071"},
      {2, "peers", " 10.0.0.1:7071, [::1]:7071 ,localhost:7071"},
      {3, "servers", "127.0.0.1:7070,[::1]:7070, host-b:7070"},
      {4, "size", "256M"},
  };
  for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
    seed("fuzz_hostport", texts[i].name, &texts[i].sel, 1, texts[i].text, strlen(texts[i].text));
  static const char argv[] = "--listen\0 127.0.0.1:7070\0--peers=10.0.0.1:7071,10.0.0.2:7071\0"
                             "--rank\0001\0--max-message-bytes=64M\0--help";
  uint8_t sel = 5;
  seed("fuzz_hostport", "settings", &sel, 1, argv, sizeof(argv) - 1);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  root = argv[1];
  if (mkdir(root, 0755) != 0 && errno != EEXIST)
    abort();
  http2_seeds();
  control_seeds();
  checkpoint_seeds();
  retry_window_seeds();
  hindex_seeds();
  text_seeds();
  return 0;
}
