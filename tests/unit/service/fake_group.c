/* The fakes of fake_group.h: the network layer's call API, the group's face and the engine, as
 * the service calls them, all on the caller's thread. See fake_group.h. */
#include "tests/unit/service/fake_group.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "kernels/embps_kernels.h" /* the fake engine gathers rows */

fake_world_t fake;

#define FAKE_CHECK(cond)                                                                           \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "%s:%d: fake: %s does not hold\n", __FILE__, __LINE__, #cond);               \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

void fake_reset(embps_store_t *store) {
  free(fake.pushed_copy);
  memset(&fake, 0, sizeof(fake));
  fake.size = 1;
  fake.ready = 1;
  fake.backend = EMBPS_BACKEND_CPU;
  fake.host_device = -1;
  fake.conn_shared_script = "";
  fake.store = store;
  fake.keep_created = 1;
}

/* ---- the network layer's call ---- */

void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg) {
  FAKE_CHECK(call->answers == 0 && !call->begun);
  call->answers++;
  call->status = EMBPS_OK;
  call->body = malloc(len ? len : 1); /* reads every byte, as the socket would */
  memcpy(call->body, body, len);
  call->len = len;
  if (release)
    release(release_arg);
}

static void announce(embps_net_call_t *call, size_t ready) {
  if (ready > call->stream_len)
    ready = call->stream_len;
  FAKE_CHECK(ready >= call->stream_ready);
  memcpy(call->announced + call->stream_ready, call->stream_body + call->stream_ready,
         ready - call->stream_ready);
  call->stream_ready = ready;
  call->readies++;
}

embps_status_t embps_net_call_reply_begin(embps_net_call_t *call, const uint8_t *body, size_t len,
                                          size_t ready, void (*release)(void *),
                                          void *release_arg) {
  FAKE_CHECK(call->answers == 0 && !call->begun);
  call->begun = 1;
  call->stream_body = body;
  call->stream_len = len;
  call->stream_ready = 0;
  call->announced = malloc(len ? len : 1);
  call->stream_release = release;
  call->stream_release_arg = release_arg;
  announce(call, ready);
  return EMBPS_OK;
}

int embps_net_call_conn_shared(const embps_net_call_t *call) {
  (void)call;
  if (!fake.conn_shared_script || !*fake.conn_shared_script)
    return 0;
  return *fake.conn_shared_script++ == '1';
}

void embps_net_call_reply_ready(embps_net_call_t *call, size_t ready) {
  FAKE_CHECK(call->begun && call->answers == 0);
  announce(call, ready);
}

/* The end of a streamed reply: the net lets go of the body. */
static void end_stream(embps_net_call_t *call) {
  if (call->stream_release)
    call->stream_release(call->stream_release_arg);
  call->stream_release = NULL;
}

/* What the client receives is the bytes as they were announced, then the rest: they must be the
 * body's bytes as it ends. */
void embps_net_call_reply_end(embps_net_call_t *call) {
  FAKE_CHECK(call->begun && call->answers == 0);
  announce(call, call->stream_len);
  call->answers++;
  call->status = EMBPS_OK;
  FAKE_CHECK(memcmp(call->announced, call->stream_body, call->stream_len) == 0);
  call->body = call->announced;
  call->announced = NULL;
  call->len = call->stream_len;
  end_stream(call);
}

void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message) {
  if (call->begun)
    end_stream(call);
  FAKE_CHECK(call->answers == 0);
  FAKE_CHECK(status != EMBPS_OK && message != NULL);
  call->answers++;
  call->status = status;
  snprintf(call->message, sizeof(call->message), "%s", message);
}

embps_status_t embps_net_call_hold_reply(embps_net_call_t *call, size_t bytes, embps_error_t *err) {
  (void)call;
  if (fake.refuse_hold)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "fake: connection full");
  fake.held_reply_bytes += bytes;
  return EMBPS_OK;
}

const char *embps_net_call_authorization(const embps_net_call_t *call) {
  (void)call;
  return fake.authorization;
}

uint64_t embps_net_call_deadline_ns(const embps_net_call_t *call) {
  (void)call;
  return fake.deadline_ns;
}

int embps_net_call_on_cancel(embps_net_call_t *call, void (*fn)(void *arg), void *arg) {
  FAKE_CHECK(call->answers == 0); /* the hook of an answered call is gone */
  call->on_cancel = fn;
  call->on_cancel_arg = arg;
  return 0;
}

void fake_cancel(embps_net_call_t *call) {
  void (*fn)(void *) = call->on_cancel;
  if (call->answers)
    return; /* answered: the net forgot the hook */
  call->on_cancel = NULL;
  if (fn)
    fn(call->on_cancel_arg);
}

void embps_net_get_stats(const embps_net_t *net, embps_net_stats_t *out) {
  (void)net;
  memset(out, 0, sizeof(*out));
  out->requests = 7;
}

void fake_call_release(embps_net_call_t *call) {
  free(call->body);
  free(call->announced);
  call->body = NULL;
  call->announced = NULL;
}

/* ---- the group ---- */

void embps_group_submit(embps_group_t *group, embps_group_call_t *call) {
  (void)group;
  FAKE_CHECK(fake.num_queued < (int)(sizeof(fake.queued) / sizeof(fake.queued[0])));
  call->ckpt = NULL;
  fake.queued[fake.num_queued++] = call;
}

void embps_group_checkpoint(embps_group_t *group, embps_group_call_t *call,
                            embps_group_ckpt_t *req) {
  (void)group;
  FAKE_CHECK(fake.num_queued < (int)(sizeof(fake.queued) / sizeof(fake.queued[0])));
  call->ckpt = req;
  fake.queued[fake.num_queued++] = call;
}

void embps_group_withdraw(embps_group_t *group, embps_group_call_t *call) {
  (void)group;
  fake.withdrawn++;
  fake.last_withdrawn = call;
}

embps_group_state_t embps_group_state(embps_group_t *group, char *message, size_t cap) {
  (void)group;
  if (message)
    snprintf(message, cap, fake.ready ? "ready" : "the group is forming");
  return fake.ready ? EMBPS_GROUP_READY : EMBPS_GROUP_STARTING;
}

uint32_t embps_group_rank(const embps_group_t *group) { return (void)group, fake.rank; }
uint32_t embps_group_size(const embps_group_t *group) { return (void)group, fake.size; }
embps_backend_t embps_group_backend(const embps_group_t *group) {
  return (void)group, fake.backend;
}

const char *embps_group_checkpoint_dir(const embps_group_t *group) {
  return (void)group, fake.checkpoint_dir;
}

int embps_group_host_device(embps_group_t *group) { return (void)group, fake.host_device; }

void embps_group_comm_stats(embps_group_t *group, embps_comm_stats_t *out) {
  (void)group;
  memset(out, 0, sizeof(*out));
}

/* The engine's host memory, plain here (the real one pins for the CUDA backend). */
void *embps_host_alloc(int device, size_t bytes, int *pinned) {
  (void)device;
  *pinned = 0;
  return embps_aligned_alloc(bytes);
}

void embps_host_free(void *p, int pinned, size_t bytes) {
  (void)pinned, (void)bytes;
  embps_free(p);
}

/* ---- the engine ---- */

void fake_order_queued(void) {
  for (int i = 0; i < fake.num_queued; i++)
    if (fake.queued[i]->ordered)
      fake.queued[i]->ordered(fake.queued[i]);
}

void fake_fail_queued(embps_status_t status, const char *msg) {
  for (int i = 0; i < fake.num_queued; i++) {
    embps_error_set(&fake.queued[i]->error, status, "%s", msg);
    fake.queued[i]->done(fake.queued[i]);
  }
  fake.num_queued = 0;
}

/* A lookup filled chunk_rows rows at a time, each chunk published as the engine does (and
 * passed on to the call's progress, as the group does). */
static void lookup_in_chunks(embps_group_call_t *call) {
  embps_op_t *op = &call->op;
  const embps_table_config_t *c = embps_table_config(op->table);
  const size_t row_bytes = c->emb_width * embps_dtype_size(c->dtype);
  for (size_t a = 0; a < op->num_tokens; a += fake.chunk_rows) {
    size_t m = op->num_tokens - a < fake.chunk_rows ? op->num_tokens - a : fake.chunk_rows;
    embps_gather_cpu(embps_table_arrays(op->table).data, c->dtype,
                     embps_table_shard_width(op->table), op->tokens + a, m,
                     (uint8_t *)op->rows_out + a * row_bytes);
    atomic_store(&op->rows_ready, a + m);
    if (call->progress)
      call->progress(call);
    if (fake.fail_after_chunk) {
      embps_error_set(&op->error, EMBPS_UNAVAILABLE, "fake: the group broke mid-round");
      return;
    }
  }
}

static void run_create(embps_op_t *op, embps_table_t **dropped) {
  embps_table_t *t;
  if (embps_table_new(&t, &op->create, fake.rank, fake.size) != EMBPS_OK) {
    embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  if (!fake.keep_created) /* built to prove the config is one a table can have */
    *dropped = t;
  else if (embps_store_add(fake.store, t, &op->error) != EMBPS_OK) {
    embps_table_free(t);
    return;
  }
  op->created = t;
}

/* A push's gradients, or an assign's rows: every byte read (a length that passed validation
 * wrongly trips AddressSanitizer) and kept. */
static void run_push(embps_op_t *op) {
  const embps_table_config_t *c = embps_table_config(op->table);
  const size_t bytes = op->num_tokens * c->emb_width * embps_dtype_size(c->dtype);
  const void *in = op->kind == EMBPS_OP_ASSIGN ? op->rows_in : op->grads;
  fake.pushed_grads = in;
  free(fake.pushed_copy);
  fake.pushed_copy = malloc(bytes ? bytes : 1);
  if (bytes)
    memcpy(fake.pushed_copy, in, bytes);
  op->applied = 1;
  op->num_unique = op->num_tokens;
}

void fake_run_engine(void) {
  for (int i = 0; i < fake.num_queued; i++) {
    embps_group_call_t *call = fake.queued[i];
    embps_op_t *op = &call->op;
    embps_table_t *dropped = NULL;
    embps_error_clear(&op->error);
    if (call->ordered)
      call->ordered(call);
    if (fake.engine_fails) {
      embps_error_set(&op->error, EMBPS_INTERNAL, "fake: the engine failed");
    } else if (call->ckpt) {
      call->ckpt->round = 7;
      call->ckpt->bytes = 1;
      snprintf(call->ckpt->path, sizeof(call->ckpt->path), "/fake/ckpt-7");
    } else if (op->kind == EMBPS_OP_CREATE_TABLE) {
      run_create(op, &dropped);
    } else if (op->kind == EMBPS_OP_LOOKUP && fake.chunk_rows) {
      lookup_in_chunks(call);
    } else if (op->kind == EMBPS_OP_LOOKUP) {
      embps_gather_cpu(embps_table_arrays(op->table).data, embps_table_config(op->table)->dtype,
                       embps_table_shard_width(op->table), op->tokens, op->num_tokens,
                       op->rows_out);
    } else if (op->kind == EMBPS_OP_PUSH || op->kind == EMBPS_OP_ASSIGN) {
      run_push(op);
    } else {
      FAKE_CHECK(op->kind == EMBPS_OP_DROP_TABLE);
      /* the table is answered for, and stays in the store (the fake frees nothing) */
      if (!(op->table = embps_store_find(fake.store, op->create.name)))
        embps_error_set(&op->error, EMBPS_NOT_FOUND, "table '%s' not found", op->create.name);
    }
    call->error = op->error; /* the group answers with the engine's answer */
    call->done(call);
    embps_table_free(dropped);
  }
  fake.num_queued = 0;
}
