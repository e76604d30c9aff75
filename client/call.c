/* Calls in flight: a call is one request to the group, made of one gRPC stream per shard
 * (a lookup's or push's token shard, or an admin request to one rank), every stream on its
 * rank's connection. A call finishes when all its streams have; its status is the first failing
 * rank's, in rank order, and its message names the rank when the group has more than one.
 *
 * Pipelining: the *_start functions submit a call's streams and return at once, so many calls
 * can be in flight on the same connections; the connections send requests in call order
 * (conn.c), and embps_call_wait() moves I/O for every connection until its call has finished,
 * which also advances the calls started before and after it. All I/O happens in the calling
 * thread.
 *
 * Replies that are not parsed as they arrive (everything but a lookup's rows) are gathered in
 * the stream's buffer and unpacked by protobuf-c through the project's allocator.
 *
 * Attempts: a lookup or push may be tried more than once under its one deadline (retry.h has the
 * rules). An attempt ends when all its streams have; call_advance() then settles the call or
 * schedules the next attempt, which re-sends every shard with the same batch id and digest and
 * the next attempt number (batch.c's send), on connections that conn.c reconnects when they were
 * lost. The old attempt's streams are released first, so a late byte of theirs never reaches
 * the caller's buffers. A call advances only while its own wait or test runs (the library has
 * no thread): a retry is sent from embps_call_wait(), embps_call_test() or
 * embps_call_wait_for() on that call, after calls started later. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "common/clock.h"

/* protobuf-c allocations go through the project's wrapper too. allocator_data, when set, points
 * at a flag that a failed allocation raises (see embps__reply_unpack). */
static void *pb_alloc(void *data, size_t size) {
  void *p = embps_malloc(size);
  if (!p && data)
    *(int *)data = 1;
  return p;
}
static void pb_free(void *data, void *p) {
  (void)data;
  embps_free(p);
}
static ProtobufCAllocator pb_allocator = {pb_alloc, pb_free, NULL};

/* protobuf-c answers NULL both for bytes that do not parse and for an allocation that failed;
 * the allocator's flag tells the two apart. */
ProtobufCMessage *embps__reply_unpack(embps_client_t *c, const ProtobufCMessageDescriptor *desc,
                                      const embps__stream_t *s, uint32_t rank) {
  int out_of_memory = 0;
  ProtobufCAllocator a = {pb_alloc, pb_free, &out_of_memory};
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, &a, s->buf_len, s->buf);
  if (m)
    return m;
  if (out_of_memory)
    embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory decoding the %s of rank %u",
                       desc->short_name, rank);
  else
    embps__client_fail(c, EMBPS_INTERNAL, "malformed %s from rank %u (%s)", desc->short_name, rank,
                       embps__conn_addr(s->conn)->authority);
  return NULL;
}

void embps__reply_free(ProtobufCMessage *m) {
  if (m)
    protobuf_c_message_free_unpacked(m, &pb_allocator);
}

embps_status_t embps__reply_check(embps_call_t *call, const char *what, uint32_t rank,
                                  uint64_t batch_id, uint32_t shard_index) {
  if (batch_id == call->batch_id && shard_index == rank)
    return EMBPS_OK;
  return embps__client_fail(call->client, EMBPS_INTERNAL,
                            "%s reply from rank %u is for batch %llu shard %u, the request was "
                            "batch %llu shard %u",
                            what, rank, (unsigned long long)batch_id, shard_index,
                            (unsigned long long)call->batch_id, rank);
}

static void on_stream_done(embps__stream_t *s) {
  embps__shard_t *sh = s->user;
  sh->call->pending--;
}

embps_call_t *embps__call_new(embps_client_t *c, uint32_t nshards) {
  embps_call_t *call = embps_calloc(1, sizeof(*call) + nshards * sizeof(embps__shard_t));
  if (!call)
    return NULL;
  call->client = c;
  call->nshards = nshards;
  call->deadline = c->deadline_ms ? (int64_t)embps_now_ms() + c->deadline_ms : 0;
  call->attempt_deadline = call->deadline;
  call->attempt_timeout = c->deadline_ms;
  call->max_attempts = 1;
  for (uint32_t i = 0; i < nshards; i++) {
    call->shards[i].call = call;
    call->shards[i].rank = i;
  }
  call->next = c->calls;
  if (c->calls)
    c->calls->prev = call;
  c->calls = call;
  return call;
}

/* Forgets the current attempt's streams (resetting those still open). */
static void release_streams(embps_call_t *call) {
  for (uint32_t i = 0; i < call->nshards; i++) {
    if (call->shards[i].stream) {
      call->shards[i].stream->on_done = NULL;
      embps__stream_release(call->shards[i].stream);
      call->shards[i].stream = NULL;
    }
  }
  call->pending = 0;
}

void embps__call_free(embps_call_t *call) {
  embps_client_t *c = call->client;
  release_streams(call);
  if (call->prev)
    call->prev->next = call->next;
  else
    c->calls = call->next;
  if (call->next)
    call->next->prev = call->prev;
  embps_free(call->req);
  embps_free(call->batch.table);
  embps__feat_req_free(call->feat);
  embps_free(call);
}

embps_status_t embps__call_attempt_failed(embps_call_t *call, const embps_error_t *err) {
  call->failed = *err;
  release_streams(call);
  return err->status;
}

/* Creates shard sh's stream for path, submits it on the shard's rank, and counts it. */
embps_status_t embps__shard_submit(embps_call_t *call, embps__shard_t *sh, const char *path,
                                   const embps__seg_t *segs, int nsegs) {
  embps_client_t *c = call->client;
  embps_error_t err;
  embps_status_t st;
  embps__stream_t *s = embps_calloc(1, sizeof(*s));
  int64_t connect_ms = c->connect_timeout_ms;
  if (!s)
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  s->path = path;
  s->timeout_ms = call->attempt_timeout;
  s->authorization = c->authorization;
  if (nsegs > EMBPS__MAX_SEGS && !(s->segs_more = embps_malloc((size_t)nsegs * sizeof(*segs)))) {
    embps_free(s);
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  memcpy(s->segs_more ? s->segs_more : s->segs, segs, (size_t)nsegs * sizeof(*segs));
  s->nsegs = nsegs;
  s->on_done = on_stream_done;
  s->user = sh;
  if (call->attempt_deadline) { /* a lost connection is reconnected within the attempt's time */
    int64_t left = call->attempt_deadline - (int64_t)embps_now_ms();
    if (left < connect_ms)
      connect_ms = left > 1 ? left : 1;
  }
  embps_error_clear(&err);
  st = embps__conn_submit(c->conns[sh->rank], s, connect_ms, &err);
  if (st != EMBPS_OK) {
    embps__stream_release(s);
    if (c->group_size > 1)
      return embps__client_fail(c, st, "rank %u (%s): %s", sh->rank, c->addrs[sh->rank].authority,
                                err.message);
    return embps__client_fail_err(c, &err);
  }
  sh->stream = s;
  call->pending++;
  return EMBPS_OK;
}

void embps__call_kick(embps_call_t *call) {
  for (uint32_t i = 0; i < call->nshards; i++)
    if (call->shards[i].stream)
      embps__conn_kick(call->shards[i].stream->conn);
}

/* Finishes the current attempt's open streams with status and message (their servers see them
 * reset); the attempt then has ended. */
static void cancel_streams(embps_call_t *call, embps_status_t st, const char *msg) {
  for (uint32_t i = 0; i < call->nshards; i++)
    if (call->shards[i].stream)
      embps__stream_cancel(call->shards[i].stream, st, msg);
  call->pending = 0; /* every stream has finished; on_done counted them down already */
}

/* The attempt has ended (no stream pending): settles the call, or schedules the next attempt. */
static void attempt_ended(embps_call_t *call, int64_t now) {
  embps_client_t *c = call->client;
  embps__verdict_t v = {0, 0, 0};
  if (!call->send) {
    call->final = 1;
    return;
  }
  embps__verdict_add(&v, call->failed.status);
  for (uint32_t i = 0; i < call->nshards; i++)
    if (call->shards[i].stream)
      embps__verdict_add(&v, call->shards[i].stream->result.status);
  if (embps__verdict_retryable(&v))
    call->retry_at = embps__retry_at(now, call->deadline, call->attempt + 1, call->max_attempts,
                                     embps__splitmix64(&c->jitter));
  if (call->retry_at == 0)
    call->final = 1;
}

/* While some shards of the attempt still run, one has failed in a way that will be retried:
 * withdraws the others now (the servers would fail them anyway, or hold them until a deadline
 * when a shard's request was lost on the way), so that the retry need not wait for them.
 * Returns 1 when it did. */
static int retry_early(embps_call_t *call, int64_t now) {
  embps__verdict_t v = {0, 0, 0};
  uint32_t failed_rank = 0;
  char msg[160];
  if (!call->send || call->attempt + 1 >= call->max_attempts)
    return 0;
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    if (!s || !s->done)
      continue;
    if (s->result.status == EMBPS_UNAVAILABLE || s->result.status == EMBPS_DEADLINE_EXCEEDED)
      failed_rank = call->shards[i].rank;
    embps__verdict_add(&v, s->result.status);
  }
  /* the shortest backoff must still fit the deadline, or there is no retry to hurry */
  if (!embps__verdict_retryable(&v) ||
      embps__retry_at(now, call->deadline, call->attempt + 1, call->max_attempts, 0) == 0)
    return 0;
  snprintf(msg, sizeof(msg), "withdrawn: rank %u failed and the batch is sent again", failed_rank);
  cancel_streams(call, EMBPS_CANCELLED, msg);
  return 1;
}

/* Starts the next attempt: its bounds, then every shard again. A deadline that passed while it
 * waited settles the call with the last attempt's outcome. */
static void next_attempt(embps_call_t *call, int64_t now) {
  int64_t deadline, timeout;
  call->retry_at = 0;
  if (embps__attempt_bounds(now, call->deadline, call->attempt_timeout_ms, &deadline, &timeout) !=
      0) {
    call->final = 1;
    return;
  }
  release_streams(call);
  embps_error_clear(&call->failed);
  call->attempt++;
  call->attempt_deadline = deadline;
  call->attempt_timeout = timeout;
  call->send(call); /* a failure is the attempt's: call->failed, nothing pending */
}

/* Moves the call on as far as the clock allows without I/O: an attempt past its deadline is
 * cancelled, an ended attempt is settled or its retry scheduled, a retry that is due is sent.
 * Returns how long (ms) the call can wait for I/O before it must advance again (-1: until I/O);
 * call->final once it has settled. */
static int call_advance(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (;;) {
    int64_t now = (int64_t)embps_now_ms();
    if (call->final)
      return 0;
    if (call->pending > 0) {
      int64_t left;
      if (retry_early(call, now))
        continue;
      if (!call->attempt_deadline)
        return -1;
      left = call->attempt_deadline - now;
      if (left > 0)
        return left > 1000000 ? 1000000 : (int)left;
      char msg[160];
      if (call->attempt_deadline == call->deadline)
        snprintf(msg, sizeof(msg), "deadline of %lld ms exceeded", (long long)c->deadline_ms);
      else
        snprintf(msg, sizeof(msg),
                 "attempt %u exceeded its own deadline of %lld ms "
                 "(attempt_timeout_ms)",
                 call->attempt + 1, (long long)call->attempt_timeout_ms);
      cancel_streams(call, EMBPS_DEADLINE_EXCEEDED, msg);
      continue;
    }
    if (call->retry_at == 0) {
      attempt_ended(call, now);
      continue;
    }
    if (now < call->retry_at)
      return (int)(call->retry_at - now);
    next_attempt(call, now);
  }
}

/* Waits up to ms for I/O on the client's connections; when none of them has anything to wait
 * for (a call between attempts, alone), sleeps instead, so the backoff is kept. Returns what
 * embps__conns_pump() does. */
static int pump_for(embps_client_t *c, int ms) {
  int64_t t0 = (int64_t)embps_now_ms();
  int rc = embps__conns_pump(c->conns, c->group_size, ms);
  if (rc == 0 && ms > 0) {
    int64_t left = ms - ((int64_t)embps_now_ms() - t0);
    if (left > 0)
      poll(NULL, 0, (int)left);
  }
  return rc;
}

void embps__call_run(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (;;) {
    int wait = call_advance(call);
    if (call->final)
      break;
    if (pump_for(c, wait) < 0) {
      char msg[160];
      embps_status_t st = errno == ENOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE;
      snprintf(msg, sizeof(msg), "poll: %s", strerror(errno));
      cancel_streams(call, st, msg);
      if (call->retry_at) { /* failed between attempts: the outcome is this, not the last's */
        embps_error_t err;
        embps_error_set(&err, st, "%s", msg);
        call->failed = err;
      }
      call->final = 1;
      break;
    }
  }
}

/* The shard whose failure the call reports: the first in rank order, one not CANCELLED first. */
static const embps__shard_t *failing_shard(const embps_call_t *call) {
  const embps__shard_t *first = NULL;
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    if (!s || s->result.status == EMBPS_OK)
      continue;
    if (s->result.status != EMBPS_CANCELLED)
      return &call->shards[i];
    if (!first)
      first = &call->shards[i];
  }
  return first;
}

embps_status_t embps__call_status(embps_call_t *call) {
  embps_client_t *c = call->client;
  const embps__shard_t *sh = failing_shard(call);
  char tries[64] = "";
  if (call->attempt > 0)
    snprintf(tries, sizeof(tries), " (after %u attempts)", call->attempt + 1);
  if (call->failed.status != EMBPS_OK)
    return embps__client_fail(c, call->failed.status, "%s%s", call->failed.message, tries);
  if (!sh) {
    embps_error_clear(&c->last);
    return EMBPS_OK;
  }
  if (c->group_size > 1)
    return embps__client_fail(c, sh->stream->result.status, "rank %u (%s): %s%s", sh->rank,
                              c->addrs[sh->rank].authority, sh->stream->result.message, tries);
  return embps__client_fail(c, sh->stream->result.status, "%s%s", sh->stream->result.message,
                            tries);
}

embps_status_t embps_call_wait(embps_call_t *call) {
  embps_status_t st;
  embps__call_run(call);
  st = embps__call_status(call);
  if (st == EMBPS_OK && call->join)
    st = call->join(call);
  embps__call_free(call);
  return st;
}

int embps_call_test(embps_call_t *call) {
  call_advance(call);
  if (call->final)
    return 1;
  if (call->pending > 0)
    embps__conns_pump(call->client->conns, call->client->group_size, 0);
  call_advance(call);
  return call->final;
}

int embps_call_wait_for(embps_call_t *call, int timeout_ms) {
  int wait = call_advance(call);
  if (call->final)
    return 1;
  if (timeout_ms < 0)
    timeout_ms = 0;
  if (wait >= 0 && wait < timeout_ms)
    timeout_ms = wait;
  pump_for(call->client, timeout_ms); /* a failing poll is embps_call_wait()'s to report */
  call_advance(call);
  return call->final;
}

void embps_call_cancel(embps_call_t *call) {
  if (call)
    embps__call_free(call);
}
