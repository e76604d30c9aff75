/* Fuzz target: every request message through the service's decoding and validation
 * (server/service/service.c, compiled in whole): protobuf-c's unpack through the service's
 * buffer pool, the one validation function per call, and the answer.
 *
 * The input's first byte picks the method, the second the group the service sits in (size 1,
 * 2 or 4 and this rank, ready or not, draining or not, cpu or cuda backend, checkpoints on or
 * off, whether the engine succeeds); the rest is the request message. The network layer and
 * the group are fakes that record the answer and run queued ops at once (lookups gather real
 * rows of the store's tables, so a token that passed validation out of range trips
 * AddressSanitizer). Checked: every call is answered exactly once, an op reaches the engine
 * only for a request that validation accepted, and nothing leaks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/embps_kernels.h"
#include "server/service/service.c"

/* ---- fakes of the net layer and the group ---------------------------------------------- */

struct embps_net_call {
  int answers;
  embps_status_t status;
};

void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg) {
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < len; i++) /* the socket reads every byte */
    sink ^= body[i];
  (void)sink;
  call->answers++;
  call->status = EMBPS_OK;
  if (release)
    release(release_arg);
}

/* The fake engine never publishes progress, so no reply streams here. */
int embps_net_call_conn_shared(const embps_net_call_t *call) {
  (void)call;
  return 0;
}

embps_status_t embps_net_call_reply_begin(embps_net_call_t *call, const uint8_t *body, size_t len,
                                          size_t ready, void (*release)(void *),
                                          void *release_arg) {
  (void)call, (void)body, (void)len, (void)ready, (void)release, (void)release_arg;
  return EMBPS_CANCELLED;
}

void embps_net_call_reply_ready(embps_net_call_t *call, size_t ready) { (void)call, (void)ready; }

void embps_net_call_reply_end(embps_net_call_t *call) {
  (void)call;
  abort();
}

void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message) {
  if (status == EMBPS_OK || !message)
    abort();
  call->answers++;
  call->status = status;
}

/* No client auth here (the service runs with auth off), and every connection takes any reply. */
const char *embps_net_call_authorization(const embps_net_call_t *call) { return (void)call, NULL; }

embps_status_t embps_net_call_hold_reply(embps_net_call_t *call, size_t bytes, embps_error_t *err) {
  (void)call, (void)bytes, (void)err;
  return EMBPS_OK;
}

void embps_net_get_stats(const embps_net_t *net, embps_net_stats_t *out) {
  (void)net;
  memset(out, 0, sizeof(*out));
}

/* The group as the input's second byte describes it. */
static struct {
  uint32_t size, rank;
  int ready;
  embps_backend_t backend;
  const char *checkpoint_dir;
  int engine_fails;
} group;

static embps_op_t *queued[8];
static int num_queued;

void embps_group_submit(embps_group_t *g, embps_op_t *op) {
  (void)g;
  if (num_queued == (int)(sizeof(queued) / sizeof(queued[0])))
    abort(); /* one request queues at most one op */
  queued[num_queued++] = op;
}

embps_group_state_t embps_group_state(embps_group_t *g, char *message, size_t cap) {
  (void)g;
  if (message)
    snprintf(message, cap, group.ready ? "ready" : "the group is forming");
  return group.ready ? EMBPS_GROUP_READY : EMBPS_GROUP_STARTING;
}

uint32_t embps_group_rank(const embps_group_t *g) { return (void)g, group.rank; }
uint32_t embps_group_size(const embps_group_t *g) { return (void)g, group.size; }
embps_backend_t embps_group_backend(const embps_group_t *g) { return (void)g, group.backend; }
const char *embps_group_checkpoint_dir(const embps_group_t *g) {
  return (void)g, group.checkpoint_dir;
}
int embps_group_host_device(embps_group_t *g) { return (void)g, -1; }

void *embps_host_alloc(int device, size_t bytes, int *pinned) {
  (void)device;
  *pinned = 0;
  return embps_aligned_alloc(bytes);
}

void embps_host_free(void *p, int pinned, size_t bytes) {
  (void)pinned, (void)bytes;
  embps_free(p);
}

void embps_group_comm_stats(embps_group_t *g, embps_comm_stats_t *out) {
  (void)g;
  memset(out, 0, sizeof(*out));
}

/* Runs the queued ops as the engine would, or fails them all. */
static void run_engine(void) {
  for (int i = 0; i < num_queued; i++) {
    embps_op_t *op = queued[i];
    embps_table_t *created = NULL;
    embps_error_clear(&op->error);
    if (op->ordered)
      op->ordered(op);
    if (group.engine_fails) {
      embps_error_set(&op->error, EMBPS_INTERNAL, "fuzz: the engine failed");
    } else if (op->kind == EMBPS_OP_CREATE_TABLE) {
      /* Built to prove the resolved config is one a table can have, then dropped, so every
       * input meets the same store. */
      if (embps_table_new(&created, &op->create, group.rank, group.size) != EMBPS_OK)
        embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      op->created = created;
    } else if (op->kind == EMBPS_OP_LOOKUP) {
      embps_gather_cpu(embps_table_arrays(op->table).data, embps_table_config(op->table)->dtype,
                       embps_table_shard_width(op->table), op->tokens, op->num_tokens,
                       op->rows_out);
    } else if (op->kind == EMBPS_OP_PUSH) {
      op->applied = 1;
      op->num_unique = op->num_tokens;
    } else {
      op->ckpt_round = 7;
      op->ckpt_bytes = 1;
      snprintf(op->ckpt_path, sizeof(op->ckpt_path), "/fuzz/ckpt-7");
    }
    op->done(op);
    embps_table_free(created);
  }
  num_queued = 0;
}

/* ---- the target --------------------------------------------------------------------------- */

static const char *const methods[] = {
    "/embps.v1.EmbeddingService/Lookup",
    "/embps.v1.EmbeddingService/PushGradients",
    "/embps.v1.EmbeddingService/CreateTable",
    "/embps.v1.EmbeddingService/ListTables",
    "/embps.v1.EmbeddingService/GetStats",
    "/embps.v1.EmbeddingService/Checkpoint",
    "/embps.v1.EmbeddingService/ListCheckpoints",
    "/grpc.health.v1.Health/Check",
    "/embps.v1.EmbeddingService/Nope",
    "/fuzz.Other/Call",
};

static embps_store_t *store;
static embps_service_t *svc;

static char *render(void *arg, size_t *len) {
  (void)arg;
  *len = 5;
  return embps_strdup("up 1\n");
}

/* Tables every input meets: "t" (f32, width 8, 64 rows) and "h" (bf16, width 4, 1000 rows). */
static void setup(void) {
  embps_service_config_t cfg = {0};
  static const struct {
    const char *name;
    uint64_t rows;
    uint32_t width;
    embps_dtype_t dtype;
  } tables[] = {{"t", 64, 8, EMBPS_DTYPE_F32}, {"h", 1000, 4, EMBPS_DTYPE_BF16}};
  if (embps_store_new(&store, 0, 1) != EMBPS_OK ||
      embps_service_new(&svc, NULL, store, &cfg) != EMBPS_OK)
    abort();
  embps_store_set_budget(store, 1 << 20, 0); /* what CreateTable accepts (--max-memory-bytes) */
  embps_service_set_metrics(svc, render, NULL);
  for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
    embps_table_config_t c;
    embps_table_t *t;
    embps_error_t err;
    memset(&c, 0, sizeof(c));
    snprintf(c.name, sizeof(c.name), "%s", tables[i].name);
    c.rows = tables[i].rows;
    c.emb_width = tables[i].width;
    c.dtype = tables[i].dtype;
    c.seed = 3;
    if (embps_table_config_resolve(&c, 4, embps_store_budget_max(store), &err) != EMBPS_OK ||
        embps_table_new(&t, &c, 0, 1) != EMBPS_OK || embps_store_add(store, t, &err) != EMBPS_OK)
      abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint32_t sizes[] = {1, 2, 4, 1};
  embps_net_call_t call = {0};
  uint8_t *msg = NULL;

  if (size < 2)
    return 0;
  if (!svc)
    setup();
  group.size = sizes[data[1] & 3];
  group.rank = ((data[1] >> 2) & 3) % group.size;
  group.ready = !(data[1] & 0x10);
  group.backend = (data[1] & 0x20) ? EMBPS_BACKEND_CUDA : EMBPS_BACKEND_CPU;
  group.checkpoint_dir = (data[1] & 0x40) ? "/nonexistent/embps-fuzz" : NULL;
  group.engine_fails = data[1] >> 7;
  svc->draining = data[0] >= 0xf0;
  if (size > 2) { /* the handler owns the message: a copy of exactly its bytes */
    msg = embps_malloc(size - 2);
    memcpy(msg, data + 2, size - 2);
  }
  embps_service_on_request(svc, &call, methods[data[0] % (sizeof(methods) / sizeof(methods[0]))],
                           msg, size - 2);
  if (num_queued && call.answers != 0)
    abort(); /* an op reached the engine for a call already refused */
  run_engine();
  if (call.answers != 1 || embps_service_inflight(svc) != 0)
    abort(); /* every call is answered exactly once, and nothing is left in flight */
  return 0;
}
