/* One fake of everything the service sits on, for the service's unit tests and the fuzz target
 * that drives it (tests/fuzz/fuzz_requests.c): the network layer's call (which records the
 * answer), the group (its size, rank, readiness, backend, checkpoint directory) and the engine
 * (which runs the queued calls' ops on the caller's thread against the service's store, gathering
 * real rows so that a token that passed validation out of range trips AddressSanitizer). The
 * service's sources are linked with it instead of the layers below them (tests/unit/service's
 * embps_service_faked library).
 *
 * Misuse of a call (answered twice, a stream not begun) aborts: the fuzz target has no test
 * framework, and a test that aborts fails. */
#ifndef EMBPS_TESTS_FAKE_GROUP_H
#define EMBPS_TESTS_FAKE_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "server/service/service_internal.h"

/** A call as the fake network layer keeps it. Zero it before each call. */
struct embps_net_call {
  int answers; /* replies and failures: exactly one is right */
  embps_status_t status;
  char message[512];
  uint8_t *body; /* a copy of the reply's bytes (malloc'd; fake_call_release frees it) */
  size_t len;
  /* a streamed reply (embps_net_call_reply_begin): the body as the net holds it, and a copy of
   * every byte announced ready, taken when announced, to prove later writes never changed it */
  int begun, readies;
  const uint8_t *stream_body;
  size_t stream_len, stream_ready;
  uint8_t *announced;
  void (*stream_release)(void *);
  void *stream_release_arg;
  /* embps_net_call_on_cancel's hook: what the net would run if the client went (fake_cancel) */
  void (*on_cancel)(void *arg);
  void *on_cancel_arg;
};

/** What the fakes answer and what they saw. fake_reset sets the defaults noted. */
typedef struct fake_world {
  /* the group: of `size` (1), this is `rank` (0); `ready` (1); `backend` (cpu); checkpoints
   * in `checkpoint_dir` (NULL: off); `host_device` (-1: host memory; a device: the CUDA
   * backend, whose requests are unpacked into the pool) */
  uint32_t size, rank;
  int ready;
  embps_backend_t backend;
  const char *checkpoint_dir;
  int host_device;
  /* the net: the authorization header of every call (NULL) and its deadline (0: none); whether
   * a call's connection carries others, one character per question ('1': it does) and then "no"
   * (""); refuse to hold replies (0), and the bytes held so far */
  const char *authorization;
  uint64_t deadline_ns;
  const char *conn_shared_script;
  int refuse_hold;
  size_t held_reply_bytes;
  /* the engine: the store it runs ops on (the service's); keep_created (1): a created table
   * joins the store, else it is built to prove its config, then freed; engine_fails (0): every
   * op fails with INTERNAL; chunk_rows (0: whole): a lookup is filled and published this many
   * rows at a time; fail_after_chunk (0): it then fails after its first chunk */
  embps_store_t *store;
  int keep_created;
  int engine_fails;
  size_t chunk_rows;
  int fail_after_chunk;
  /* calls submitted (ops and checkpoints) and not yet run */
  embps_group_call_t *queued[64];
  int num_queued;
  /* calls the service withdrew (embps_group_withdraw), the last one */
  int withdrawn;
  embps_group_call_t *last_withdrawn;
  /* the last push the engine ran: where its gradients were, and a copy of them (malloc'd) */
  const void *pushed_grads; /* the last push's gradients, or assign's rows */
  uint8_t *pushed_copy;
} fake_world_t;

extern fake_world_t fake;

/** Sets every field of `fake` to its default, over the service's store (borrowed); frees what
 * it held. */
void fake_reset(embps_store_t *store);

/** The leader orders every queued call: each gets its ordered notice, as the group gives them. */
void fake_order_queued(void);

/** Fails every queued call before it is ordered (a shard that never arrived). */
void fake_fail_queued(embps_status_t status, const char *msg);

/** Runs the queued calls as the group and the engine would: each is ordered, then run (its op
 * by the engine, a checkpoint by the group), then done. */
void fake_run_engine(void);

/** The call's client goes before it is answered: runs its cancel hook, as the net would. */
void fake_cancel(embps_net_call_t *call);

/** Frees what the fake net kept of a call's reply. */
void fake_call_release(embps_net_call_t *call);

#endif
