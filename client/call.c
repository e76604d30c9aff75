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
 * the stream's buffer and unpacked by protobuf-c through the project's allocator. */
#include <errno.h>
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

void embps__call_free(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (uint32_t i = 0; i < call->nshards; i++) {
    if (call->shards[i].stream) {
      call->shards[i].stream->on_done = NULL;
      embps__stream_release(call->shards[i].stream);
    }
  }
  if (call->prev)
    call->prev->next = call->next;
  else
    c->calls = call->next;
  if (call->next)
    call->next->prev = call->prev;
  embps_free(call->req);
  embps_free(call);
}

/* Creates shard sh's stream for path, submits it on the shard's rank, and counts it. */
embps_status_t embps__shard_submit(embps_call_t *call, embps__shard_t *sh, const char *path,
                                   const embps__seg_t *segs, int nsegs) {
  embps_client_t *c = call->client;
  embps_error_t err;
  embps_status_t st;
  embps__stream_t *s = embps_calloc(1, sizeof(*s));
  if (!s)
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  s->path = path;
  s->timeout_ms = c->deadline_ms;
  s->authorization = c->authorization;
  memcpy(s->segs, segs, (size_t)nsegs * sizeof(*segs));
  s->nsegs = nsegs;
  s->on_done = on_stream_done;
  s->user = sh;
  embps_error_clear(&err);
  st = embps__conn_submit(c->conns[sh->rank], s, c->connect_timeout_ms, &err);
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

/* Moves I/O until every stream of call has finished or the deadline passes. Does not free. */
void embps__call_run(embps_call_t *call) {
  embps_client_t *c = call->client;
  while (call->pending > 0) {
    int timeout = -1;
    if (call->deadline) {
      int64_t left = call->deadline - (int64_t)embps_now_ms();
      if (left <= 0) {
        char msg[128];
        snprintf(msg, sizeof(msg), "deadline of %lld ms exceeded", (long long)c->deadline_ms);
        for (uint32_t i = 0; i < call->nshards; i++)
          if (call->shards[i].stream)
            embps__stream_cancel(call->shards[i].stream, EMBPS_DEADLINE_EXCEEDED, msg);
        break;
      }
      timeout = left > 1000000 ? 1000000 : (int)left;
    }
    if (embps__conns_pump(c->conns, c->group_size, timeout) < 0) {
      char msg[160];
      embps_status_t st = errno == ENOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE;
      snprintf(msg, sizeof(msg), "poll: %s", strerror(errno));
      for (uint32_t i = 0; i < call->nshards; i++)
        if (call->shards[i].stream)
          embps__stream_cancel(call->shards[i].stream, st, msg);
      break;
    }
  }
}

/* The call's status: the first failing shard's, in rank order, recorded as the last error. */
embps_status_t embps__call_status(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (uint32_t i = 0; i < call->nshards; i++) {
    embps__stream_t *s = call->shards[i].stream;
    if (!s || s->result.status == EMBPS_OK)
      continue;
    if (c->group_size > 1)
      return embps__client_fail(c, s->result.status, "rank %u (%s): %s", call->shards[i].rank,
                                c->addrs[call->shards[i].rank].authority, s->result.message);
    return embps__client_fail_err(c, &s->result);
  }
  embps_error_clear(&c->last);
  return EMBPS_OK;
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
  if (call->pending > 0)
    embps__conns_pump(call->client->conns, call->client->group_size, 0);
  return call->pending == 0;
}

int embps_call_wait_for(embps_call_t *call, int timeout_ms) {
  if (call->pending > 0)
    embps__conns_pump(call->client->conns, call->client->group_size,
                      timeout_ms < 0 ? 0 : timeout_ms);
  return call->pending == 0;
}

void embps_call_cancel(embps_call_t *call) {
  if (call)
    embps__call_free(call);
}
