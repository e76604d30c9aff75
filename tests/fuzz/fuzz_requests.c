/* Fuzz target: every request message through the service's decoding and validation
 * (server/service, over the shared fake of tests/unit/service/fake_group.h): protobuf-c's unpack
 * through the service's buffer pool, the one validation function per call, and the answer.
 *
 * The input's first byte picks the method, the second the group the service sits in (size 1,
 * 2 or 4 and this rank, ready or not, draining or not, cpu or cuda backend, checkpoints on or
 * off, whether the engine succeeds); the rest is the request message. The network layer and
 * the group are the fakes, which record the answer; the queued ops are run at once (lookups
 * gather real rows of the store's tables and pushes read every gradient byte, so a token or a
 * length that passed validation wrongly trips AddressSanitizer). Checked: every call is answered
 * exactly once, an op reaches the engine only for a request that validation accepted, and
 * nothing leaks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "server/service/service_internal.h"
#include "tests/unit/service/fake_group.h"

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
    "/embps.v1.EmbeddingService/Assign",
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
  if (embps_store_new(&store) != EMBPS_OK || embps_service_new(&svc, NULL, store, &cfg) != EMBPS_OK)
    abort();
  embps_store_set_budget(store, 1 << 20, 0); /* what CreateTable accepts (--max-memory-bytes) */
  fake_reset(store);
  fake.keep_created = 0; /* every input meets the same store */
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
  fake.size = sizes[data[1] & 3];
  fake.rank = ((data[1] >> 2) & 3) % fake.size;
  fake.ready = !(data[1] & 0x10);
  fake.backend = (data[1] & 0x20) ? EMBPS_BACKEND_CUDA : EMBPS_BACKEND_CPU;
  fake.checkpoint_dir = (data[1] & 0x40) ? "/nonexistent/embps-fuzz" : NULL;
  fake.engine_fails = data[1] >> 7;
  svc->draining = data[0] >= 0xf0;
  if (size > 2) { /* the handler owns the message: a copy of exactly its bytes */
    msg = embps_malloc(size - 2);
    memcpy(msg, data + 2, size - 2);
  }
  embps_service_on_request(svc, &call, methods[data[0] % (sizeof(methods) / sizeof(methods[0]))],
                           msg, size - 2);
  if (fake.num_queued > 1 || (fake.num_queued && call.answers != 0))
    abort(); /* one request queues at most one op, and none for a call already refused */
  fake_run_engine();
  if (call.answers != 1 || embps_service_inflight(svc) != 0)
    abort(); /* every call is answered exactly once, and nothing is left in flight */
  fake_call_release(&call);
  return 0;
}
