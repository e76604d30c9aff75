/* The gRPC/HTTP2 core without sockets: an in-memory nghttp2 client talks to one h2conn, and
 * every byte the core produces goes through its output batches, as the binding writes them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "server/net/h2conn.h"
#include "tests/unit/net/h2client.h"

#define MAX_CALLS 32
#define PATH "/embps.v1.EmbeddingService/Lookup"
#define CT "application/grpc"
#define GRPC_PREFIX 5 /* the gRPC message prefix: flags and length */

typedef struct server {
  embps__h2conn_t *conn;
  embps_net_stats_t stats;
  int answer_inline; /* echo at once from inside the request callback */
  embps_net_call_t *calls[MAX_CALLS];
  char methods[MAX_CALLS][128];
  char auths[MAX_CALLS][1100];   /* each call's authorization header, "(none)" without one */
  uint64_t deadlines[MAX_CALLS]; /* each call's embps_net_call_deadline_ns */
  uint8_t *msgs[MAX_CALLS];
  size_t lens[MAX_CALLS];
  int ncalls;
  int outputs_notified;
  /* zero-copy check: the range of a reply body, and whether a segment pointed into it */
  const uint8_t *watch;
  size_t watch_len;
  int watch_hit;
  embps_status_t last_feed;
} server_t;

static int releases;
static void count_release(void *arg) {
  releases++;
  if (arg)
    free(arg);
}

static void on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                       size_t len) {
  server_t *sv = user;
  assert_true(sv->ncalls < MAX_CALLS);
  int i = sv->ncalls++;
  snprintf(sv->methods[i], sizeof(sv->methods[i]), "%s", method);
  const char *auth = embps_net_call_authorization(call);
  snprintf(sv->auths[i], sizeof(sv->auths[i]), "%s", auth ? auth : "(none)");
  sv->deadlines[i] = embps_net_call_deadline_ns(call);
  sv->lens[i] = len;
  if (sv->answer_inline) {
    sv->msgs[i] = NULL;
    /* echo the request: the body is the message itself, released with embps_free */
    embps_net_call_reply(call, msg, len, embps_free, msg);
    sv->calls[i] = NULL;
  } else {
    sv->msgs[i] = msg;
    sv->calls[i] = call;
  }
}

static void on_output(void *user) { ((server_t *)user)->outputs_notified++; }

/* A server whose connection counts its calls in metrics (NULL: none). */
static void server_init_metrics(server_t *sv, size_t max_message, embps_net_metrics_t *metrics) {
  memset(sv, 0, sizeof(*sv));
  embps__h2conn_hooks_t hooks = {.on_request = on_request,
                                 .request_user = sv,
                                 .on_output = on_output,
                                 .io_user = sv,
                                 .stats = &sv->stats,
                                 .metrics = metrics};
  assert_int_equal(embps__h2conn_new(&sv->conn, max_message, &hooks), EMBPS_OK);
}

static void server_init(server_t *sv, size_t max_message) {
  server_init_metrics(sv, max_message, NULL);
}

/* A server that answers every request at once with its own message, and a client with large
 * windows. */
static void start_echo(server_t *sv, h2c_t *c) {
  server_init(sv, 1 << 20);
  sv->answer_inline = 1;
  h2c_init(c, 1);
}

static void server_fini(server_t *sv) {
  embps__h2conn_free(sv->conn);
  for (int i = 0; i < sv->ncalls; i++)
    embps_free(sv->msgs[i]);
}

/* Moves bytes both ways until neither side has anything to say (bounded). */
static void pump(h2c_t *c, server_t *sv) {
  for (int round = 0; round < 100000; round++) {
    int progress = 0;
    for (;;) {
      const uint8_t *d;
      ssize_t n = nghttp2_session_mem_send(c->session, &d);
      assert_true(n >= 0);
      if (n == 0)
        break;
      progress = 1;
      sv->last_feed = embps__h2conn_feed(sv->conn, d, (size_t)n);
      if (sv->last_feed != EMBPS_OK)
        return;
    }
    embps__h2out_t *out;
    while ((out = embps__h2conn_take_output(sv->conn)) != NULL) {
      size_t nsegs;
      const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
      size_t total = 0;
      for (size_t i = 0; i < nsegs; i++) {
        if (sv->watch && segs[i].base >= sv->watch && segs[i].base < sv->watch + sv->watch_len)
          sv->watch_hit = 1;
        assert_int_equal(nghttp2_session_mem_recv(c->session, segs[i].base, segs[i].len),
                         (ssize_t)segs[i].len);
        total += segs[i].len;
      }
      assert_int_equal(total, embps__h2out_bytes(out));
      embps__h2out_free(out);
      progress = 1;
    }
    if (!progress)
      return;
  }
  fail_msg("pump did not settle");
}

static void assert_ok_reply(const h2c_stream_t *st, const void *body, size_t len) {
  size_t n;
  assert_true(st->closed);
  assert_int_equal(st->close_error, NGHTTP2_NO_ERROR);
  assert_int_equal(st->http_status, 200);
  assert_string_equal(st->content_type, "application/grpc");
  assert_int_equal(st->grpc_status, 0);
  assert_int_equal(st->header_blocks, 2); /* headers, then trailers */
  const uint8_t *m = h2c_message(st, &n);
  assert_non_null(m);
  assert_int_equal(n, len);
  assert_memory_equal(m, body, len);
}

static void assert_error(const h2c_stream_t *st, int http, int grpc, const char *message) {
  assert_true(st->closed);
  assert_int_equal(st->http_status, http);
  assert_true(st->trailers_only);
  assert_int_equal(st->data_len, 0);
  assert_int_equal(st->grpc_status, grpc);
  if (message)
    assert_string_equal(st->grpc_message, message);
}

#define AUTH_NV(v, len)                                                                            \
  { (uint8_t *)"authorization", (uint8_t *)(v), 13, (len), NGHTTP2_NV_FLAG_NO_INDEX }

/* The authorization header reaches the handler as sent, up to its bound; a longer one or a
 * second one is refused before the handler sees the call, and the connection carries on. */
static void test_authorization_header(void **state) {
  static char longest[EMBPS_NET_MAX_AUTHORIZATION + 1];
  server_t sv;
  h2c_t c;
  size_t plen;
  (void)state;
  start_echo(&sv, &c);
  memset(longest, 'a', sizeof(longest));
  uint8_t *p = h2c_frame(0, "x", 1, &plen);
  nghttp2_nv one[] = {AUTH_NV("Bearer tok-123", 14)};
  nghttp2_nv at_bound[] = {AUTH_NV(longest, EMBPS_NET_MAX_AUTHORIZATION)};
  nghttp2_nv too_long[] = {AUTH_NV(longest, EMBPS_NET_MAX_AUTHORIZATION + 1)};
  nghttp2_nv twice[] = {AUTH_NV("Bearer a", 8), AUTH_NV("Bearer b", 8)};
  h2c_stream_t *s1 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, one, 1);
  h2c_stream_t *s2 = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  h2c_stream_t *s3 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, at_bound, 1);
  h2c_stream_t *s4 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, too_long, 1);
  h2c_stream_t *s5 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, twice, 2);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 3);
  assert_string_equal(sv.auths[0], "Bearer tok-123");
  assert_string_equal(sv.auths[1], "(none)");
  assert_int_equal(strlen(sv.auths[2]), EMBPS_NET_MAX_AUTHORIZATION);
  assert_ok_reply(s1, "x", 1);
  assert_ok_reply(s2, "x", 1);
  assert_ok_reply(s3, "x", 1);
  assert_error(s4, 200, 16, "the authorization metadata is longer than 1024 bytes");
  assert_error(s5, 200, 16, "more than one authorization header: send one 'Bearer TOKEN'");
  assert_int_equal(sv.stats.errors, 2);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

#define TIMEOUT_NV(v)                                                                              \
  { (uint8_t *)"grpc-timeout", (uint8_t *)(v), 12, strlen(v), NGHTTP2_NV_FLAG_NONE }

/* grpc-timeout becomes the call's deadline, counted from the headers' arrival; a malformed or
 * repeated one is refused with INVALID_ARGUMENT naming it, and a call whose deadline has passed
 * before it is delivered is answered DEADLINE_EXCEEDED: neither reaches the handler. */
static void test_grpc_timeout_header(void **state) {
  static const char *const bad[] = {"bogus", "-1m", "123456789m", "1", "m", "1x", "1mm", ""};
  enum { NBAD = sizeof(bad) / sizeof(bad[0]) };
  server_t sv;
  h2c_t c;
  size_t plen;
  h2c_stream_t *refused[NBAD];
  char want[160];
  (void)state;
  start_echo(&sv, &c);
  uint8_t *p = h2c_frame(0, "x", 1, &plen);
  nghttp2_nv minute[] = {TIMEOUT_NV("1M")};
  nghttp2_nv huge[] = {TIMEOUT_NV("99999999H")};
  nghttp2_nv expired[] = {TIMEOUT_NV("0n")};
  nghttp2_nv twice[] = {TIMEOUT_NV("1S"), TIMEOUT_NV("2S")};
  uint64_t before = embps_now_ns();
  h2c_stream_t *s1 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, minute, 1);
  h2c_stream_t *s2 = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  h2c_stream_t *s3 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, huge, 1);
  h2c_stream_t *s4 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, expired, 1);
  h2c_stream_t *s5 = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, twice, 2);
  for (int i = 0; i < NBAD; i++) {
    nghttp2_nv one[] = {TIMEOUT_NV(bad[i])};
    refused[i] = h2c_request_with(&c, PATH, CT, p, plen, 0, plen, one, 1);
  }
  pump(&c, &sv);
  uint64_t after = embps_now_ns();
  assert_int_equal(sv.ncalls, 3);
  assert_true(sv.deadlines[0] >= before + UINT64_C(60000000000));
  assert_true(sv.deadlines[0] <= after + UINT64_C(60000000000));
  assert_true(sv.deadlines[1] == 0);
  assert_true(sv.deadlines[2] == UINT64_MAX);
  assert_ok_reply(s1, "x", 1);
  assert_ok_reply(s2, "x", 1);
  assert_ok_reply(s3, "x", 1);
  assert_error(s4, 200, 4,
               "the call's deadline (grpc-timeout) passed before it reached the server");
  assert_error(s5, 200, 3, "more than one grpc-timeout header: send one");
  for (int i = 0; i < NBAD; i++) {
    snprintf(want, sizeof(want),
             "malformed grpc-timeout header '%s': expected 1 to 8 digits and a unit H, M, S, m, "
             "u or n",
             bad[i]);
    assert_error(refused[i], 200, 3, want);
  }
  assert_int_equal(sv.stats.errors, 2 + NBAD);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_unary_round_trip(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  start_echo(&sv, &c);
  uint8_t *p = h2c_frame(0, "hello", 5, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, "application/grpc+proto", p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  assert_string_equal(sv.methods[0], PATH);
  assert_int_equal(sv.lens[0], 5);
  assert_ok_reply(st, "hello", 5);
  assert_int_equal(sv.stats.requests, 1);
  assert_int_equal(sv.stats.errors, 0);
  assert_int_equal(sv.outputs_notified, 0); /* answered inside feed: no notification needed */
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_IDLE);
  /* Large windows so clients never stall on our flow control. */
  assert_int_equal(
      nghttp2_session_get_remote_settings(c.session, NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE),
      2147483647);
  assert_int_equal(nghttp2_session_get_remote_settings(c.session, NGHTTP2_SETTINGS_MAX_FRAME_SIZE),
                   16777215);
  assert_true(nghttp2_session_get_remote_window_size(c.session) > (1 << 30));
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_large_request_and_reply(void **state) {
  const size_t n = 5u << 20;
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 8u << 20);
  h2c_init(&c, 1);
  uint8_t *msg = malloc(n);
  for (size_t i = 0; i < n; i++)
    msg[i] = (uint8_t)(i * 7 + (i >> 13));
  uint8_t *p = h2c_frame(0, msg, n, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  assert_int_equal(sv.lens[0], n);
  assert_memory_equal(sv.msgs[0], msg, n);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_BUSY);

  uint8_t *reply = malloc(n);
  for (size_t i = 0; i < n; i++)
    reply[i] = (uint8_t)(i * 13 + 1);
  releases = 0;
  sv.watch = reply;
  sv.watch_len = n;
  embps_net_call_reply(sv.calls[0], reply, n, count_release, NULL);
  assert_int_equal(sv.outputs_notified, 1);
  /* The body is referenced, not copied: nothing is released before the batch is written. */
  embps__h2out_t *out = embps__h2conn_take_output(sv.conn);
  assert_non_null(out);
  assert_int_equal(releases, 0);
  size_t nsegs;
  const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
  /* DATA frames as large as the client allows (1 MiB), not nghttp2's default 16 KiB. */
  assert_true(nsegs < 32);
  for (size_t i = 0; i < nsegs; i++) {
    if (segs[i].base >= reply && segs[i].base < reply + n)
      sv.watch_hit = 1;
    assert_int_equal(nghttp2_session_mem_recv(c.session, segs[i].base, segs[i].len),
                     (ssize_t)segs[i].len);
  }
  embps__h2out_free(out);
  pump(&c, &sv);
  assert_true(sv.watch_hit);
  assert_int_equal(releases, 1);
  assert_ok_reply(st, reply, n);
  free(reply);
  free(msg);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* Default client settings: 64 KiB windows and 16 KiB frames, so the reply needs many window
 * updates and the core must resume after flow control blocks it. */
static void test_reply_under_small_windows(void **state) {
  const size_t n = 1u << 20;
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 0);
  uint8_t *p = h2c_frame(0, "x", 1, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  uint8_t *reply = malloc(n);
  for (size_t i = 0; i < n; i++)
    reply[i] = (uint8_t)(i ^ (i >> 9));
  releases = 0;
  embps_net_call_reply(sv.calls[0], reply, n, count_release, reply);
  pump(&c, &sv);
  assert_int_equal(releases, 1);
  size_t got;
  const uint8_t *m = h2c_message(st, &got);
  assert_non_null(m);
  assert_int_equal(got, n);
  for (size_t i = 0; i < n; i++)
    if (m[i] != (uint8_t)(i ^ (i >> 9)))
      fail_msg("byte %zu differs", i);
  assert_int_equal(st->grpc_status, 0);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_split_frames(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen, plen2;
  server_init(&sv, 1 << 20);
  sv.answer_inline = 1;
  h2c_init(&c, 1);
  uint8_t msg[1000];
  for (size_t i = 0; i < sizeof(msg); i++)
    msg[i] = (uint8_t)(i * 31);
  /* 3-byte DATA frames: the prefix is split over two frames, the message over hundreds. */
  uint8_t *p = h2c_frame(0, msg, sizeof(msg), &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 3, plen);
  /* 1-byte frames, and an empty message. */
  uint8_t *p2 = h2c_frame(0, NULL, 0, &plen2);
  h2c_stream_t *st2 = h2c_request(&c, PATH, CT, p2, plen2, 1, plen2);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 2);
  assert_ok_reply(st, msg, sizeof(msg));
  assert_ok_reply(st2, "", 0);
  free(p);
  free(p2);
  h2c_free(&c);
  server_fini(&sv);
}

/* Feeds the server as net.c does: each read goes where embps__h2conn_read_target says (a large
 * message's own buffer, or a bounded read into the connection's buffer), `steps` giving how many
 * bytes the socket has for each read in turn; replies go back to the client as pump's do. */
static void pump_reads(h2c_t *c, server_t *sv, const size_t *steps, size_t nsteps) {
  static uint8_t rbuf[256u << 10];
  uint8_t *q = NULL;
  size_t qlen = 0, qoff = 0, k = 0;
  for (int round = 0; round < 100000; round++) {
    int progress = 0;
    const uint8_t *d;
    ssize_t n;
    while ((n = nghttp2_session_mem_send(c->session, &d)) > 0) {
      q = realloc(q, qlen + (size_t)n);
      assert_non_null(q);
      memcpy(q + qlen, d, (size_t)n);
      qlen += (size_t)n;
    }
    assert_true(n == 0);
    while (qoff < qlen) {
      size_t cap, take = steps[k++ % nsteps];
      uint8_t *p = embps__h2conn_read_target(sv->conn, &cap);
      if (!p) {
        p = rbuf;
        if (cap > sizeof(rbuf))
          cap = sizeof(rbuf);
      }
      assert_true(cap > 0);
      if (take > cap)
        take = cap;
      if (take > qlen - qoff)
        take = qlen - qoff;
      memcpy(p, q + qoff, take); /* the socket's read */
      qoff += take;
      sv->last_feed = embps__h2conn_feed(sv->conn, p, take);
      assert_int_equal(sv->last_feed, EMBPS_OK);
      progress = 1;
    }
    embps__h2out_t *out;
    while ((out = embps__h2conn_take_output(sv->conn)) != NULL) {
      size_t nsegs;
      const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
      for (size_t i = 0; i < nsegs; i++)
        assert_int_equal(nghttp2_session_mem_recv(c->session, segs[i].base, segs[i].len),
                         (ssize_t)segs[i].len);
      embps__h2out_free(out);
      progress = 1;
    }
    if (!progress)
      break;
  }
  free(q);
}

/* Large request messages are read straight into their buffers (embps__h2conn_read_target): two
 * of them interleaved in 16 KiB frames and a third in 1 MiB frames arrive intact whatever the
 * reads' sizes, most of their bytes in place; a small one and one in padded frames go through
 * the connection's buffer, intact too. */
static void test_request_read_in_place(void **state) {
  const size_t big = 700u << 10, small = 1000;
  const size_t steps[][3] = {{1u << 20, 1u << 20, 1u << 20}, {7, 100003, 1}, {4096, 65536, 9}};
  (void)state;
  for (size_t v = 0; v < sizeof(steps) / sizeof(steps[0]); v++)
    for (int pad = 0; pad < 2; pad++) {
      server_t sv;
      h2c_t c;
      uint8_t *msg[4], *p[4];
      size_t len[4] = {big, big, big + 11, small}, plen[4];
      server_init(&sv, 8u << 20);
      sv.answer_inline = 1;
      h2c_init(&c, 1);
      c.pad = pad;
      h2c_stream_t *st[4];
      for (int i = 0; i < 4; i++) {
        msg[i] = malloc(len[i]);
        for (size_t j = 0; j < len[i]; j++)
          msg[i][j] = (uint8_t)(j * (7 + 2 * i) + (j >> 11) + i);
        p[i] = h2c_frame(0, msg[i], len[i], &plen[i]);
        /* padded frames need room for their padding below the frame size (16 KiB until the
         * client has the server's SETTINGS) */
        st[i] = h2c_request(&c, PATH, CT, p[i], plen[i], pad ? 16000 : i < 2 ? 16384 : 0, plen[i]);
      }
      pump_reads(&c, &sv, steps[v], 3);
      assert_int_equal(sv.ncalls, 4);
      for (int i = 0; i < 4; i++)
        assert_ok_reply(st[i], msg[i], len[i]);
      uint64_t direct = embps__h2conn_direct_bytes(sv.conn);
      if (pad)
        assert_int_equal(direct, 0);
      else if (!(v == 1)) /* 7-byte and 1-byte reads leave few bytes for the big ones */
        assert_true(direct >= (3 * big) / 2);
      else
        assert_true(direct > 0);
      for (int i = 0; i < 4; i++) {
        free(p[i]);
        free(msg[i]);
      }
      h2c_free(&c);
      server_fini(&sv);
    }
}

static void test_concurrent_out_of_order(void **state) {
  enum { N = 6 };
  server_t sv;
  h2c_t c;
  uint8_t *p[N];
  h2c_stream_t *st[N];
  char body[N][32];
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  for (int i = 0; i < N; i++) {
    char m[16];
    size_t plen;
    snprintf(m, sizeof(m), "req%d", i);
    p[i] = h2c_frame(0, m, strlen(m), &plen);
    st[i] = h2c_request(&c, PATH, CT, p[i], plen, 0, plen);
  }
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, N);
  for (int i = 0; i < N; i++) {
    char m[16];
    snprintf(m, sizeof(m), "req%d", i);
    assert_int_equal(sv.lens[i], strlen(m));
    assert_memory_equal(sv.msgs[i], m, strlen(m)); /* delivered in stream order */
  }
  releases = 0;
  for (int i = N - 1; i >= 0; i--) {
    if (i == 2) {
      embps_net_call_fail(sv.calls[i], EMBPS_NOT_FOUND, "table 't9' not found");
    } else {
      snprintf(body[i], sizeof(body[i]), "reply to %d", i);
      embps_net_call_reply(sv.calls[i], (uint8_t *)body[i], strlen(body[i]), count_release, NULL);
    }
    if (i % 2 == 0)
      pump(&c, &sv);
  }
  pump(&c, &sv);
  assert_int_equal(releases, N - 1);
  for (int i = 0; i < N; i++) {
    if (i == 2)
      assert_error(st[i], 200, EMBPS_NOT_FOUND, "table 't9' not found");
    else
      assert_ok_reply(st[i], body[i], strlen(body[i]));
    free(p[i]);
  }
  assert_int_equal(sv.stats.requests, N);
  assert_int_equal(sv.stats.errors, 1);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_oversized_message(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen, plen2;
  server_init(&sv, 1 << 20);
  sv.answer_inline = 1;
  h2c_init(&c, 1);
  /* Declares 2 MiB but only 64 KiB is available: the answer must not wait for the rest. */
  const size_t big = 2u << 20;
  uint8_t *msg = calloc(1, big);
  uint8_t *p = h2c_frame(0, msg, big, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, 65536);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 0);
  assert_error(st, 200, EMBPS_RESOURCE_EXHAUSTED,
               "received message larger than max (2097152 vs. 1048576)");
  assert_int_equal(st->close_error, NGHTTP2_NO_ERROR); /* RST_STREAM(NO_ERROR): stop sending */
  assert_int_equal(sv.stats.errors, 1);
  /* The connection still works. */
  uint8_t *p2 = h2c_frame(0, "next", 4, &plen2);
  h2c_stream_t *st2 = h2c_request(&c, PATH, CT, p2, plen2, 0, plen2);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  assert_ok_reply(st2, "next", 4);
  assert_false(c.goaway);
  free(msg);
  free(p);
  free(p2);
  h2c_free(&c);
  server_fini(&sv);
}

/* Streams that each announce a message up to the limit and then send little of it may hold at
 * most twice the limit in buffers on one connection; the next one is refused at once. */
static void test_receiving_budget(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  (void)state;
  server_init(&sv, 1 << 20);
  sv.answer_inline = 1;
  h2c_init(&c, 1);
  const size_t big = 1u << 20;
  uint8_t *msg = calloc(1, big);
  uint8_t *p = h2c_frame(0, msg, big, &plen);
  h2c_stream_t *a = h2c_request(&c, PATH, CT, p, plen, 0, 64);
  h2c_stream_t *b = h2c_request(&c, PATH, CT, p, plen, 0, 64);
  h2c_stream_t *third = h2c_request(&c, PATH, CT, p, plen, 0, 64);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 0);
  assert_error(third, 200, EMBPS_RESOURCE_EXHAUSTED,
               "this connection is already receiving 2097152 bytes of messages; another "
               "1048576 would pass twice the limit of 1048576");
  assert_false(a->closed);
  assert_false(b->closed);
  assert_false(c.goaway);
  free(msg);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_bad_messages(void **state) {
  server_t sv;
  h2c_t c;
  size_t l1, l2, l3, l4;
  server_init(&sv, 1 << 20);
  sv.answer_inline = 1;
  h2c_init(&c, 1);
  uint8_t *compressed = h2c_frame(1, "zzzz", 4, &l1);
  h2c_stream_t *s1 = h2c_request(&c, PATH, CT, compressed, l1, 0, l1);
  uint8_t *wrong_ct = h2c_frame(0, "a", 1, &l2);
  h2c_stream_t *s2 = h2c_request(&c, PATH, "application/json", wrong_ct, l2, 0, l2);
  h2c_stream_t *s3 = h2c_request(&c, PATH, CT, NULL, 0, 0, 0); /* no message at all */
  /* two messages in one DATA frame */
  uint8_t *a = h2c_frame(0, "one", 3, &l3);
  uint8_t two[16];
  memcpy(two, a, l3);
  memcpy(two + l3, a, l3);
  h2c_stream_t *s4 = h2c_request(&c, PATH, CT, two, 2 * l3, 0, 2 * l3);
  /* a message cut short by END_STREAM */
  uint8_t *cut = h2c_frame(0, "truncated", 9, &l4);
  h2c_stream_t *s5 = h2c_request(&c, PATH, CT, cut, l4 - 3, 0, l4 - 3);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 0);
  assert_error(s1, 200, EMBPS_UNIMPLEMENTED, "compressed messages are not supported");
  assert_error(s2, 415, EMBPS_INVALID_ARGUMENT,
               "invalid gRPC request content-type 'application/json'");
  assert_error(s3, 200, EMBPS_INVALID_ARGUMENT, NULL);
  assert_error(s4, 200, EMBPS_UNIMPLEMENTED, NULL);
  assert_error(s5, 200, EMBPS_INVALID_ARGUMENT, NULL);
  assert_int_equal(sv.stats.errors, 5);
  assert_false(c.goaway);
  free(compressed);
  free(wrong_ct);
  free(a);
  free(cut);
  h2c_free(&c);
  server_fini(&sv);
}

#define ENCODING_NV(v)                                                                             \
  { (uint8_t *)"grpc-encoding", (uint8_t *)(v), 13, sizeof(v) - 1, NGHTTP2_NV_FLAG_NONE }

/* A compressed request (the message's compressed flag, or a grpc-encoding other than identity)
 * is refused with UNIMPLEMENTED and grpc-accept-encoding: identity, as the gRPC protocol asks;
 * grpc-encoding: identity and other errors carry no grpc-accept-encoding. */
static void test_compressed_request(void **state) {
  server_t sv;
  h2c_t c;
  size_t lz, lp;
  (void)state;
  start_echo(&sv, &c);
  uint8_t *zipped = h2c_frame(1, "zzzz", 4, &lz);
  uint8_t *plain = h2c_frame(0, "x", 1, &lp);
  nghttp2_nv gzip[] = {ENCODING_NV("gzip")};
  nghttp2_nv identity[] = {ENCODING_NV("identity")};
  h2c_stream_t *s1 = h2c_request_with(&c, PATH, CT, zipped, lz, 0, lz, gzip, 1);
  h2c_stream_t *s2 = h2c_request_with(&c, PATH, CT, plain, lp, 0, lp, gzip, 1);
  h2c_stream_t *s3 = h2c_request(&c, PATH, CT, zipped, lz, 0, lz);
  h2c_stream_t *s4 = h2c_request_with(&c, PATH, CT, plain, lp, 0, lp, identity, 1);
  h2c_stream_t *s5 = h2c_request(&c, PATH, "text/plain", plain, lp, 0, lp);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1); /* s4 only */
  const char *refused = "grpc-encoding 'gzip' is not supported: this server takes identity "
                        "(uncompressed) messages only";
  assert_error(s1, 200, EMBPS_UNIMPLEMENTED, refused);
  assert_string_equal(s1->grpc_accept_encoding, "identity");
  assert_error(s2, 200, EMBPS_UNIMPLEMENTED, refused);
  assert_string_equal(s2->grpc_accept_encoding, "identity");
  assert_error(s3, 200, EMBPS_UNIMPLEMENTED, "compressed messages are not supported");
  assert_string_equal(s3->grpc_accept_encoding, "identity");
  assert_ok_reply(s4, "x", 1);
  assert_string_equal(s4->grpc_accept_encoding, "");
  assert_error(s5, 415, EMBPS_INVALID_ARGUMENT, NULL);
  assert_string_equal(s5->grpc_accept_encoding, "");
  assert_int_equal(sv.stats.errors, 4);
  assert_false(c.goaway);
  free(zipped);
  free(plain);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_garbage_preface(void **state) {
  server_t sv;
  server_init(&sv, 1 << 20);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_RECEIVING);
  const char *g = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
  assert_int_equal(embps__h2conn_feed(sv.conn, (const uint8_t *)g, strlen(g)), EMBPS_UNAVAILABLE);
  assert_true(embps__h2conn_want_close(sv.conn));
  /* What is left to write is our SETTINGS and a GOAWAY(PROTOCOL_ERROR). */
  uint8_t bytes[4096];
  size_t total = 0;
  embps__h2out_t *out;
  while ((out = embps__h2conn_take_output(sv.conn)) != NULL) {
    size_t nsegs;
    const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
    for (size_t i = 0; i < nsegs; i++) {
      assert_true(total + segs[i].len <= sizeof(bytes));
      memcpy(bytes + total, segs[i].base, segs[i].len);
      total += segs[i].len;
    }
    embps__h2out_free(out);
  }
  int goaway = 0;
  for (size_t off = 0; off + 9 <= total;) {
    size_t len = ((size_t)bytes[off] << 16) | ((size_t)bytes[off + 1] << 8) | bytes[off + 2];
    if (bytes[off + 3] == NGHTTP2_GOAWAY) {
      goaway = 1;
      assert_int_equal(bytes[off + 9 + 7], NGHTTP2_PROTOCOL_ERROR); /* low byte of the code */
    }
    off += 9 + len;
  }
  assert_true(goaway);
  assert_int_equal(embps__h2conn_feed(sv.conn, (const uint8_t *)"x", 1), EMBPS_UNAVAILABLE);
  assert_int_equal(sv.ncalls, 0);
  server_fini(&sv);
}

static void test_percent_encoding(void **state) {
  char *e = embps__h2_percent_encode("caf\xc3\xa9 100%\ndone~");
  assert_string_equal(e, "caf%C3%A9 100%25%0Adone~");
  embps_free(e);

  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "q", 1, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  embps_net_call_fail(sv.calls[0], EMBPS_INVALID_ARGUMENT, "emb_width=\xe2\x82\xac 50% off");
  pump(&c, &sv);
  assert_error(st, 200, EMBPS_INVALID_ARGUMENT, "emb_width=%E2%82%AC 50%25 off");
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_answer_after_teardown(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  for (int i = 0; i < 3; i++)
    h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 3);
  /* The client resets stream 0: its call is cancelled but stays valid. */
  assert_false(embps_net_call_cancelled(sv.calls[0]));
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[0].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_true(embps_net_call_cancelled(sv.calls[0]));
  assert_false(embps_net_call_cancelled(sv.calls[1]));
  releases = 0;
  uint8_t *dropped = malloc(8);
  embps_net_call_reply(sv.calls[0], dropped, 8, count_release, dropped);
  assert_int_equal(releases, 1);
  /* A reply queued but not yet written when the connection goes is released with it. */
  uint8_t *queued = malloc(64);
  embps_net_call_reply(sv.calls[1], queued, 64, count_release, queued);
  assert_int_equal(releases, 1);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(releases, 2);
  /* The connection is gone: the last call is cancelled, its answer dropped and released. */
  assert_true(embps_net_call_cancelled(sv.calls[2]));
  uint8_t *late = malloc(32);
  embps_net_call_reply(sv.calls[2], late, 32, count_release, late);
  assert_int_equal(releases, 3);
  free(p);
  h2c_free(&c);
  server_fini(&sv);

  /* Same for an error answer after teardown. */
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  p = h2c_frame(0, "abc", 3, &plen);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  embps_net_call_fail(sv.calls[0], EMBPS_INTERNAL, "late");
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* embps_net_call_on_cancel: the hook runs once when the client resets an unanswered call's
 * stream or its connection goes, never for a call answered first, never twice, and not for a
 * call already cancelled when it is asked. */
static int cancels[4];
static void on_cancel(void *arg) { cancels[(int)(intptr_t)arg]++; }

static void test_cancel_hook(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  memset(cancels, 0, sizeof(cancels));
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  for (int i = 0; i < 4; i++)
    h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 4);
  for (int i = 0; i < 4; i++)
    assert_int_equal(embps_net_call_on_cancel(sv.calls[i], on_cancel, (void *)(intptr_t)i), 0);
  /* Call 1 is answered: its hook is forgotten. */
  uint8_t *body = malloc(8);
  embps_net_call_reply(sv.calls[1], body, 8, count_release, body);
  pump(&c, &sv);
  /* Stream 0 is reset: its hook runs once, and the call stays owed an answer. */
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[0].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(cancels[0], 1);
  assert_int_equal(cancels[1], 0);
  assert_true(embps_net_call_cancelled(sv.calls[0]));
  assert_int_equal(embps_net_call_on_cancel(sv.calls[0], on_cancel, (void *)0), 1);
  /* Call 3 forgets its hook; the connection goes: call 2's runs, and call 0's not again. */
  assert_int_equal(embps_net_call_on_cancel(sv.calls[3], NULL, NULL), 0);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(cancels[0], 1);
  assert_int_equal(cancels[2], 1);
  assert_int_equal(cancels[3], 0);
  for (int i = 0; i < 4; i++)
    if (i != 1)
      embps_net_call_fail(sv.calls[i], EMBPS_CANCELLED, "gone");
  assert_int_equal(cancels[0] + cancels[1] + cancels[2] + cancels[3], 2);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* A batch written after its stream is gone still owns the body it points at. */
static void test_batch_outlives_connection(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  uint8_t *body = malloc(100000);
  memset(body, 7, 100000);
  releases = 0;
  embps_net_call_reply(sv.calls[0], body, 100000, count_release, body);
  embps__h2out_t *out = embps__h2conn_take_output(sv.conn);
  assert_non_null(out);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(releases, 0);
  size_t nsegs, sum = 0;
  const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
  for (size_t i = 0; i < nsegs; i++)
    for (size_t j = 0; j < segs[i].len; j++)
      sum += segs[i].base[j]; /* readable under ASan */
  assert_true(sum >= 7 * 100000);
  embps__h2out_free(out);
  assert_int_equal(releases, 1);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* A reply streamed in odd-sized steps, as an engine fills it, reaches the client byte-identical
 * to the whole body; while it waits for bytes still being made, the connection is BUSY (the
 * stall timer is not the client's to blame), and the trailers wait for the end. */
static void test_streamed_reply(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  const size_t len = 300001;
  size_t steps[] = {0, 1, 4, 5, 6, 17, 65536, 65537, 200000, 300001};
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  uint8_t *body = malloc(len);
  memset(body, 0xee, len); /* not yet made: must never reach the client */
  releases = 0;
  assert_int_equal(embps_net_call_reply_begin(sv.calls[0], body, len, 0, count_release, body),
                   EMBPS_OK);
  assert_int_equal(embps_net_call_reply_begin(sv.calls[0], body, len, 0, count_release, body),
                   EMBPS_FAILED_PRECONDITION);
  for (size_t k = 0; k < sizeof(steps) / sizeof(steps[0]); k++) {
    for (size_t i = k ? steps[k - 1] : 0; i < steps[k]; i++)
      body[i] = (uint8_t)(i * 31 + 7);
    embps_net_call_reply_ready(sv.calls[0], steps[k]);
    assert_true(embps_net_call_conn_shared(sv.calls[0])); /* new bytes (or the prefix) wait */
    pump(&c, &sv);
    assert_false(embps_net_call_conn_shared(sv.calls[0])); /* all made is out: it defers */
    assert_false(st->closed);
    assert_int_equal(st->data_len, GRPC_PREFIX + steps[k]);
    assert_int_equal(st->grpc_status, -1);
    assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_BUSY);
  }
  assert_int_equal(releases, 0);
  uint8_t *want = malloc(len);
  memcpy(want, body, len);
  embps_net_call_reply_end(sv.calls[0]);
  pump(&c, &sv);
  assert_int_equal(releases, 1); /* body is freed now */
  assert_ok_reply(st, want, len);
  free(want);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 0);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_IDLE);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* A streamed reply that fails after bytes went out ends with the error in trailers: the client
 * sees a non-OK grpc-status and the cut message, never an OK reply. */
static void test_streamed_reply_fails(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen, n;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  uint8_t *body = calloc(1, 1000);
  releases = 0;
  assert_int_equal(embps_net_call_reply_begin(sv.calls[0], body, 1000, 100, count_release, body),
                   EMBPS_OK);
  pump(&c, &sv);
  assert_int_equal(st->data_len, GRPC_PREFIX + 100);
  embps_net_call_fail(sv.calls[0], EMBPS_UNAVAILABLE, "rank 1 is gone");
  pump(&c, &sv);
  assert_true(st->closed);
  assert_int_equal(st->http_status, 200);
  assert_int_equal(st->header_blocks, 2); /* headers, then trailers */
  assert_int_equal(st->grpc_status, 14);  /* UNAVAILABLE */
  assert_string_equal(st->grpc_message, "rank 1 is gone");
  assert_int_equal(st->data_len, GRPC_PREFIX + 100);
  assert_null(h2c_message(st, &n)); /* the cut message is not a message */
  assert_int_equal(releases, 1);
  assert_int_equal(sv.stats.errors, 1);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* The client resets the stream, or the connection goes, while the body is still being made: the
 * body stays allocated (the producer keeps writing into it) until the call ends. Under ASan a
 * write after an early free would fail. */
static void test_streamed_reply_outlives_reset(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  for (int i = 0; i < 2; i++)
    h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  uint8_t *b0 = calloc(1, 4096), *b1 = calloc(1, 4096);
  releases = 0;
  assert_true(embps_net_call_conn_shared(sv.calls[0])); /* two calls on one connection */
  assert_true(embps_net_call_conn_shared(sv.calls[1]));
  assert_int_equal(embps_net_call_reply_begin(sv.calls[0], b0, 4096, 10, count_release, b0),
                   EMBPS_OK);
  assert_int_equal(embps_net_call_reply_begin(sv.calls[1], b1, 4096, 10, count_release, b1),
                   EMBPS_OK);
  pump(&c, &sv);
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[0].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_true(embps_net_call_cancelled(sv.calls[0]));
  assert_int_equal(releases, 0);
  memset(b0, 1, 4096); /* the engine carries on */
  embps_net_call_reply_ready(sv.calls[0], 4096);
  embps_net_call_reply_end(sv.calls[0]);
  assert_int_equal(releases, 1);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(releases, 1);
  memset(b1, 2, 4096);
  embps_net_call_reply_ready(sv.calls[1], 4096);
  embps_net_call_fail(sv.calls[1], EMBPS_CANCELLED, "gone");
  assert_int_equal(releases, 2);
  /* A call whose client is gone does not begin: the caller still owns the body. */
  server_fini(&sv);
  server_init(&sv, 1 << 20);
  h2c_free(&c);
  h2c_init(&c, 1);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[0].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(embps_net_call_reply_begin(sv.calls[0], b0, 4096, 10, count_release, b0),
                   EMBPS_CANCELLED);
  embps_net_call_fail(sv.calls[0], EMBPS_CANCELLED, "gone");
  assert_int_equal(releases, 2);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_phases(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  server_init(&sv, 1 << 20);
  h2c_init(&c, 1);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_RECEIVING); /* no preface yet */
  pump(&c, &sv);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_IDLE);
  uint8_t *p = h2c_frame(0, "abcdef", 6, &plen);
  h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, 7);
  pump(&c, &sv);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_RECEIVING); /* half a request */
  h2c_release_more(&c, st, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 1);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_BUSY);
  embps_net_call_reply(sv.calls[0], (const uint8_t *)"ok", 2, NULL, NULL);
  pump(&c, &sv);
  assert_ok_reply(st, "ok", 2);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_IDLE);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* Replies a connection holds are counted from the hold to the stream's end, whichever way it
 * ends (written, reset by the client); a hold past the limit is refused unless the connection
 * holds nothing else, and a client with a closed window keeps the connection SENDING. */
static void test_reply_hold_accounting(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  embps_error_t err;
  nghttp2_settings_entry zero = {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0};
  nghttp2_settings_entry open = {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20};
  server_init(&sv, 1 << 20);
  embps__h2conn_set_reply_limit(sv.conn, 1000);
  h2c_init(&c, 0);
  nghttp2_submit_settings(c.session, NGHTTP2_FLAG_NONE, &zero, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  for (int i = 0; i < 4; i++)
    h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 4);

  assert_int_equal(embps_net_call_hold_reply(sv.calls[0], 600, &err), EMBPS_OK);
  assert_int_equal(embps_net_call_hold_reply(sv.calls[1], 600, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(err.message, "already holds 600 bytes"));
  assert_non_null(strstr(err.message, "its limit of 1000 (4 x --max-message-bytes)"));
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 600); /* the refusal counted nothing */
  embps_net_call_fail(sv.calls[1], EMBPS_RESOURCE_EXHAUSTED, err.message);
  assert_int_equal(embps_net_call_hold_reply(sv.calls[2], 400, &err), EMBPS_OK);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 1000);

  releases = 0;
  uint8_t *b0 = malloc(600), *b2 = malloc(400), *b3 = malloc(5000);
  memset(b3, 3, 5000);
  embps_net_call_reply(sv.calls[0], b0, 600, count_release, b0);
  embps_net_call_reply(sv.calls[2], b2, 400, count_release, b2);
  pump(&c, &sv);
  /* the client's windows are closed: nothing of either reply went out */
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_SENDING);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 1000);
  assert_int_equal(releases, 0);

  /* A reset frees that reply and its share at once. */
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[0].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(releases, 1);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 400);
  assert_int_equal(embps_net_call_hold_reply(sv.calls[3], 5000, &err), EMBPS_RESOURCE_EXHAUSTED);
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[2].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(releases, 2);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 0);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_BUSY); /* call 3 is still owed */

  /* Alone, one reply fits whatever its size; once written, it is no longer held. */
  assert_int_equal(embps_net_call_hold_reply(sv.calls[3], 5000, &err), EMBPS_OK);
  embps_net_call_reply(sv.calls[3], b3, 5000, count_release, b3);
  pump(&c, &sv);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 5000);
  nghttp2_submit_settings(c.session, NGHTTP2_FLAG_NONE, &open, 1);
  pump(&c, &sv);
  assert_int_equal(c.streams[3].grpc_status, 0);
  assert_int_equal(c.streams[3].data_len, 5005);
  assert_int_equal(releases, 3);
  assert_int_equal(embps__h2conn_reply_bytes(sv.conn), 0);
  assert_int_equal(embps__h2conn_phase(sv.conn), EMBPS__H2_IDLE);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

/* A reply held back by a closed window is released when the connection goes, and a call of a
 * gone connection holds nothing. */
static void test_unsent_reply_freed_with_connection(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  embps_error_t err;
  nghttp2_settings_entry zero = {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0};
  server_init(&sv, 1 << 20);
  h2c_init(&c, 0);
  nghttp2_submit_settings(c.session, NGHTTP2_FLAG_NONE, &zero, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 2);
  assert_int_equal(embps_net_call_hold_reply(sv.calls[0], 1 << 20, &err), EMBPS_OK);
  releases = 0;
  uint8_t *body = malloc(1 << 20);
  embps_net_call_reply(sv.calls[0], body, 1 << 20, count_release, body);
  pump(&c, &sv);
  assert_int_equal(releases, 0);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(releases, 1);
  assert_int_equal(embps_net_call_hold_reply(sv.calls[1], 10, &err), EMBPS_CANCELLED);
  embps_net_call_fail(sv.calls[1], EMBPS_CANCELLED, err.message);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
}

static void test_new_fails_cleanly(void **state) {
  embps__h2conn_hooks_t hooks = {.on_request = on_request};
  embps__h2conn_t *conn = (embps__h2conn_t *)&hooks; /* must stay untouched */
  embps_alloc_fail_after(1);
  assert_int_equal(embps__h2conn_new(&conn, 1024, &hooks), EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
  assert_ptr_equal(conn, (embps__h2conn_t *)&hooks);
}

/* Every allocation the core makes for one request fails in turn (with every one after it, while
 * the client's bytes are fed): the call is refused as out of resources, by a RESOURCE_EXHAUSTED
 * trailers-only answer or, when there is no stream object to answer on, by
 * RST_STREAM(ENHANCE_YOUR_CALM), which gRPC clients read as RESOURCE_EXHAUSTED; never as an
 * internal error. The connection then serves the next request. */
static void test_out_of_memory_refuses_the_call(void **state) {
  int refused = 0;
  for (long k = 1; k < 64; k++) {
    server_t sv;
    h2c_t c;
    size_t plen;
    start_echo(&sv, &c);
    pump(&c, &sv); /* prefaces and SETTINGS, with memory */
    uint8_t *p = h2c_frame(0, "hello", 5, &plen);
    h2c_stream_t *st = h2c_request(&c, PATH, CT, p, plen, 0, plen);
    embps_alloc_fail_after(k);
    for (;;) {
      const uint8_t *d;
      ssize_t n = nghttp2_session_mem_send(c.session, &d);
      assert_true(n >= 0);
      if (n == 0)
        break;
      assert_int_equal(embps__h2conn_feed(sv.conn, d, (size_t)n), EMBPS_OK);
    }
    embps_alloc_fail_after(0);
    pump(&c, &sv);
    int done = st->grpc_status == 0;
    if (done) {
      assert_ok_reply(st, "hello", 5);
    } else {
      refused++;
      assert_true(st->closed);
      if (st->grpc_status < 0)
        assert_int_equal(st->close_error, NGHTTP2_ENHANCE_YOUR_CALM);
      else
        assert_int_equal(st->grpc_status, EMBPS_RESOURCE_EXHAUSTED);
      h2c_stream_t *again = h2c_request(&c, PATH, CT, p, plen, 0, plen);
      pump(&c, &sv);
      assert_ok_reply(again, "hello", 5);
    }
    free(p);
    h2c_free(&c);
    server_fini(&sv);
    if (done)
      break;
  }
  /* The stream, its :path, its message, its delivery queue entry, its call, the reply. */
  assert_true(refused >= 6);
}

/* The handled count of PATH's method by gRPC code, and the sum over every code. */
static uint64_t handled(const embps_net_metrics_t *m, int code) {
  assert_int_equal(atomic_load(&m->num_methods), 1);
  assert_string_equal(m->methods[0].method, "Lookup");
  return atomic_load(&m->methods[0].handled[code]);
}

static uint64_t handled_all(const embps_net_metrics_t *m) {
  uint64_t n = 0;
  for (int c = 0; c < EMBPS_NET_GRPC_CODES; c++)
    n += handled(m, c);
  return n;
}

enum { OK = 0, CANCELLED = 1, NOT_FOUND = 5, DEADLINE_EXCEEDED = 4 };

/* Every call is counted once, with the code it really ended with: an answer that reached the
 * client with its own code; one the client reset the stream before having (or the connection
 * went before it was sent) as CANCELLED, even when the server then answered OK; one the server
 * answered DEADLINE_EXCEEDED before the reset as such (the client gave up at that deadline). */
static void test_metrics_count_the_final_code(void **state) {
  server_t sv;
  h2c_t c;
  size_t plen;
  embps_net_metrics_t *m = calloc(1, sizeof(*m));
  assert_non_null(m);
  server_init_metrics(&sv, 1 << 20, m);
  h2c_init(&c, 1);
  uint8_t *p = h2c_frame(0, "abc", 3, &plen);
  for (int i = 0; i < 9; i++)
    h2c_request(&c, PATH, CT, p, plen, 0, plen);
  pump(&c, &sv);
  assert_int_equal(sv.ncalls, 9);
  assert_int_equal(atomic_load(&m->methods[0].started), 9);
  assert_int_equal(handled_all(m), 0);

  /* 0: answered OK, and the answer went out. 1: answered NOT_FOUND, went out. */
  uint8_t *b0 = malloc(8);
  memset(b0, 1, 8);
  embps_net_call_reply(sv.calls[0], b0, 8, count_release, b0);
  embps_net_call_fail(sv.calls[1], EMBPS_NOT_FOUND, "no such table");
  pump(&c, &sv);
  assert_int_equal(c.streams[0].grpc_status, 0);
  assert_int_equal(c.streams[1].grpc_status, NOT_FOUND);
  assert_int_equal(handled(m, OK), 1);
  assert_int_equal(handled(m, NOT_FOUND), 1);
  assert_int_equal(atomic_load(&m->message_bytes_out), 8);

  /* 2: reset before the server answers: CANCELLED at once; its later OK answer is dropped. */
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[2].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(handled(m, CANCELLED), 1);
  uint8_t *b2 = malloc(8);
  embps_net_call_reply(sv.calls[2], b2, 8, count_release, b2);
  assert_int_equal(handled(m, OK), 1);
  assert_int_equal(handled(m, CANCELLED), 1);

  /* 3: answered OK, but the client resets the stream before the answer is sent: CANCELLED,
   * and its bytes are not counted as sent. */
  uint8_t *b3 = malloc(8);
  embps_net_call_reply(sv.calls[3], b3, 8, count_release, b3);
  assert_int_equal(handled_all(m), 3); /* counted when the stream closes */
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[3].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(handled(m, OK), 1);
  assert_int_equal(handled(m, CANCELLED), 2);
  assert_int_equal(atomic_load(&m->message_bytes_out), 8);

  /* 4: reset first (counted at once), then the server answers DEADLINE_EXCEEDED: CANCELLED.
   * 5: answered DEADLINE_EXCEEDED, reset before it is sent: DEADLINE_EXCEEDED. */
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[4].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(handled(m, CANCELLED), 3);
  embps_net_call_fail(sv.calls[4], EMBPS_DEADLINE_EXCEEDED, "late");
  embps_net_call_fail(sv.calls[5], EMBPS_DEADLINE_EXCEEDED, "late");
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[5].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  assert_int_equal(handled(m, DEADLINE_EXCEEDED), 1);
  assert_int_equal(handled(m, CANCELLED), 3);

  /* 6: a streamed reply whose stream is reset between its beginning and its end: CANCELLED. */
  uint8_t *b6 = calloc(1, 4096);
  assert_int_equal(embps_net_call_reply_begin(sv.calls[6], b6, 4096, 10, count_release, b6),
                   EMBPS_OK);
  pump(&c, &sv);
  nghttp2_submit_rst_stream(c.session, NGHTTP2_FLAG_NONE, c.streams[6].id, NGHTTP2_CANCEL);
  pump(&c, &sv);
  embps_net_call_reply_ready(sv.calls[6], 4096);
  embps_net_call_reply_end(sv.calls[6]);
  assert_int_equal(handled(m, CANCELLED), 4);
  assert_int_equal(handled(m, OK), 1);

  /* 7: answered OK but not yet sent, 8: not answered, when the connection goes: CANCELLED. */
  uint8_t *b7 = malloc(8);
  embps_net_call_reply(sv.calls[7], b7, 8, count_release, b7);
  embps__h2conn_free(sv.conn);
  sv.conn = NULL;
  assert_int_equal(handled(m, CANCELLED), 6);
  embps_net_call_reply(sv.calls[8], NULL, 0, NULL, NULL); /* dropped, not counted again */

  /* Each call counted exactly once, and the latency histogram saw each. */
  assert_int_equal(handled(m, OK), 1);
  assert_int_equal(handled_all(m), 9);
  assert_int_equal(atomic_load(&m->methods[0].seconds.count), 9);
  assert_int_equal(atomic_load(&m->message_bytes_out), 8);
  free(p);
  h2c_free(&c);
  server_fini(&sv);
  free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_unary_round_trip),
      cmocka_unit_test(test_large_request_and_reply),
      cmocka_unit_test(test_reply_under_small_windows),
      cmocka_unit_test(test_split_frames),
      cmocka_unit_test(test_request_read_in_place),
      cmocka_unit_test(test_concurrent_out_of_order),
      cmocka_unit_test(test_oversized_message),
      cmocka_unit_test(test_receiving_budget),
      cmocka_unit_test(test_bad_messages),
      cmocka_unit_test(test_garbage_preface),
      cmocka_unit_test(test_compressed_request),
      cmocka_unit_test(test_percent_encoding),
      cmocka_unit_test(test_answer_after_teardown),
      cmocka_unit_test(test_cancel_hook),
      cmocka_unit_test(test_batch_outlives_connection),
      cmocka_unit_test(test_phases),
      cmocka_unit_test(test_streamed_reply),
      cmocka_unit_test(test_streamed_reply_fails),
      cmocka_unit_test(test_streamed_reply_outlives_reset),
      cmocka_unit_test(test_reply_hold_accounting),
      cmocka_unit_test(test_unsent_reply_freed_with_connection),
      cmocka_unit_test(test_authorization_header),
      cmocka_unit_test(test_grpc_timeout_header),
      cmocka_unit_test(test_new_fails_cleanly),
      cmocka_unit_test(test_out_of_memory_refuses_the_call),
      cmocka_unit_test(test_metrics_count_the_final_code),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
