/* The libuv binding on real sockets: the loop runs on the test's main thread, a client thread
 * speaks gRPC over blocking loopback sockets with an nghttp2 client session. The client thread
 * only records what it saw; the main thread asserts once it has joined. Every wait is bounded:
 * sockets have receive timeouts and a guard timer stops the loop after 20 s. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "server/net/net.h"
#include "tests/unit/net/h2client.h"

#define PATH "/embps.v1.EmbeddingService/Lookup"
#define CT "application/grpc"

typedef struct fixture fixture_t;
struct fixture {
  uv_loop_t loop;
  embps_net_t *net;
  uv_async_t done;
  uv_timer_t guard;
  int port;
  int guard_fired;
  void (*script)(fixture_t *);
  /* written by the client thread, read after join */
  int ok[16];
  long ms[16];
  char why[256];
};

static void on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                       size_t len) {
  if (strcmp(method, PATH) != 0) {
    embps_free(msg);
    embps_net_call_fail(call, EMBPS_UNIMPLEMENTED, "unknown method");
    return;
  }
  embps_net_call_reply(call, msg, len, embps_free, msg); /* echo, zero-copy */
}

static long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* ---- the client side (client thread) ---- */

/* A loopback connection from source address `from` (e.g. "127.0.0.2"; NULL: any). */
static int tcp_connect_from(const char *from, int port, int rcv_timeout_ms) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (from) {
    struct sockaddr_in src = {.sin_family = AF_INET};
    inet_pton(AF_INET, from, &src.sin_addr);
    if (bind(fd, (struct sockaddr *)&src, sizeof(src)) < 0) {
      close(fd);
      return -1;
    }
  }
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct timeval tv = {.tv_sec = rcv_timeout_ms / 1000, .tv_usec = (rcv_timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static int tcp_connect(int port, int rcv_timeout_ms) {
  return tcp_connect_from(NULL, port, rcv_timeout_ms);
}

static int send_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0)
      return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static int h2c_flush(h2c_t *c, int fd) {
  for (;;) {
    const uint8_t *d;
    ssize_t n = nghttp2_session_mem_send(c->session, &d);
    if (n < 0)
      return -1;
    if (n == 0)
      return 0;
    if (send_all(fd, d, (size_t)n) < 0)
      return -1;
  }
}

/* Runs the session until st closes; 0 on success, -1 on EOF, error or timeout. */
static int h2c_wait(h2c_t *c, int fd, h2c_stream_t *st) {
  static uint8_t buf[1 << 16];
  long deadline = now_ms() + 10000;
  while (!st->closed && now_ms() < deadline) {
    if (h2c_flush(c, fd) < 0)
      return -1;
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
      continue; /* a short receive timeout; the deadline bounds the wait */
    if (r <= 0)
      return -1;
    if (nghttp2_session_mem_recv(c->session, buf, (size_t)r) != r)
      return -1;
  }
  return st->closed ? h2c_flush(c, fd) : -1;
}

/* One unary call echoing n bytes; 1 when the echo came back intact. */
static int echo_call(h2c_t *c, int fd, size_t n) {
  uint8_t *msg = malloc(n ? n : 1);
  for (size_t i = 0; i < n; i++)
    msg[i] = (uint8_t)(i * 11 + 3);
  size_t plen;
  uint8_t *p = h2c_frame(0, msg, n, &plen);
  h2c_stream_t *st = h2c_request(c, PATH, CT, p, plen, 0, plen);
  int ok = st && h2c_wait(c, fd, st) == 0 && st->grpc_status == 0;
  size_t got = 0;
  const uint8_t *m = ok ? h2c_message(st, &got) : NULL;
  ok = ok && m && got == n && memcmp(m, msg, n) == 0;
  free(msg);
  free(p);
  return ok;
}

/* Reads (and drops) until the server closes. The ms it took, or -1 after timeout_ms. */
static long wait_eof(int fd, long timeout_ms) {
  uint8_t buf[4096];
  long start = now_ms();
  while (now_ms() - start < timeout_ms) {
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET))
      return now_ms() - start;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return now_ms() - start;
  }
  return -1;
}

/* Reads until the server closes, feeding what arrives to c (so c->goaway tells whether a GOAWAY
 * came first) and sending a PING every ping_ms (0: none). The ms it took, or -1 after
 * timeout_ms. */
static long wait_eof_h2(h2c_t *c, int fd, long timeout_ms, long ping_ms) {
  uint8_t buf[4096];
  long start = now_ms(), last_ping = start;
  while (now_ms() - start < timeout_ms) {
    if (ping_ms && now_ms() - last_ping >= ping_ms) {
      nghttp2_submit_ping(c->session, NGHTTP2_FLAG_NONE, NULL);
      last_ping = now_ms();
    }
    if (h2c_flush(c, fd) < 0)
      return now_ms() - start;
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET))
      return now_ms() - start;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return now_ms() - start;
    if (r > 0)
      nghttp2_session_mem_recv(c->session, buf, (size_t)r);
  }
  return -1;
}

/* ---- the loop side (main thread) ---- */

static void on_done(uv_async_t *a) { uv_stop(a->loop); }

static void on_guard(uv_timer_t *t) {
  fixture_t *fx = t->data;
  fx->guard_fired = 1;
  uv_stop(t->loop);
}

static void *client_main(void *arg) {
  fixture_t *fx = arg;
  fx->script(fx);
  uv_async_send(&fx->done);
  return NULL;
}

static void fixture_start_cfg(fixture_t *fx, const embps_net_config_t *cfg) {
  memset(fx, 0, sizeof(*fx));
  assert_int_equal(uv_loop_init(&fx->loop), 0);
  assert_int_equal(embps_net_new(&fx->net, &fx->loop, cfg, on_request, fx), EMBPS_OK);
  embps_error_t err;
  assert_int_equal(embps_net_port(fx->net), 0);
  assert_int_equal(embps_net_listen(fx->net, "127.0.0.1:0", &err), EMBPS_OK);
  fx->port = embps_net_port(fx->net);
  assert_true(fx->port > 0);
}

static void fixture_start(fixture_t *fx, uint64_t stall_ms, uint64_t idle_ms, uint32_t max_conns) {
  embps_net_config_t cfg = {.max_message_bytes = 8u << 20,
                            .stall_timeout_ms = stall_ms,
                            .idle_timeout_ms = idle_ms,
                            .max_connections = max_conns};
  fixture_start_cfg(fx, &cfg);
}

static void fixture_run(fixture_t *fx, void (*script)(fixture_t *)) {
  pthread_t th;
  fx->script = script;
  uv_async_init(&fx->loop, &fx->done, on_done);
  uv_timer_init(&fx->loop, &fx->guard);
  fx->guard.data = fx;
  uv_timer_start(&fx->guard, on_guard, 20000, 0);
  assert_int_equal(pthread_create(&th, NULL, client_main, fx), 0);
  uv_run(&fx->loop, UV_RUN_DEFAULT);
  pthread_join(th, NULL);
  assert_false(fx->guard_fired);
}

static void fixture_stop(fixture_t *fx) {
  embps_net_close(fx->net);
  uv_close((uv_handle_t *)&fx->done, NULL);
  uv_close((uv_handle_t *)&fx->guard, NULL);
  uv_run(&fx->loop, UV_RUN_DEFAULT); /* nothing is left active, so this returns */
  embps_net_free(fx->net);
  assert_int_equal(uv_loop_close(&fx->loop), 0);
}

/* ---- tests ---- */

static void script_round_trip(fixture_t *fx) {
  h2c_t c;
  int fd = tcp_connect(fx->port, 5000);
  if (fd < 0)
    return;
  h2c_init(&c, 1);
  fx->ok[0] = echo_call(&c, fd, 5);
  fx->ok[1] = echo_call(&c, fd, 3u << 20); /* a large reply through uv_write */
  fx->ok[2] = echo_call(&c, fd, 0);
  /* an unknown method comes back as the handler's error */
  size_t plen;
  uint8_t *p = h2c_frame(0, "x", 1, &plen);
  h2c_stream_t *st = h2c_request(&c, "/no.Such/Method", CT, p, plen, 0, plen);
  fx->ok[3] = st && h2c_wait(&c, fd, st) == 0 && st->grpc_status == EMBPS_UNIMPLEMENTED &&
              strcmp(st->grpc_message, "unknown method") == 0;
  free(p);
  h2c_free(&c);
  close(fd);
}

static void test_round_trip(void **state) {
  fixture_t fx;
  fixture_start(&fx, 0, 0, 0);
  fixture_run(&fx, script_round_trip);
  for (int i = 0; i < 4; i++)
    if (!fx.ok[i])
      fail_msg("call %d failed", i);
  embps_net_stats_t st;
  embps_net_get_stats(fx.net, &st);
  assert_int_equal(st.requests, 4);
  assert_int_equal(st.errors, 1);
  assert_true(st.bytes_in > (3u << 20));
  assert_true(st.bytes_out > (3u << 20));
  fixture_stop(&fx);
}

static void test_listen_addresses(void **state) {
  uv_loop_t loop;
  embps_net_t *net;
  embps_error_t err;
  embps_net_config_t cfg = {.max_message_bytes = 1024};
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(embps_net_new(&net, &loop, &cfg, on_request, NULL), EMBPS_OK);
  assert_int_equal(embps_net_listen(net, "nonsense", &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_net_listen(net, "127.0.0.1:99999", &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_net_listen(net, "::1:80", &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_net_listen(net, "1.2.3:80", &err), EMBPS_INVALID_ARGUMENT);
  embps_status_t s = embps_net_listen(net, "[::1]:0", &err);
  if (s == EMBPS_OK) {
    assert_true(embps_net_port(net) > 0);
  } else {
    /* a host without IPv6 loopback: a clean UNAVAILABLE, and IPv4 still works */
    assert_int_equal(s, EMBPS_UNAVAILABLE);
    assert_int_equal(embps_net_listen(net, "127.0.0.1:0", &err), EMBPS_OK);
    assert_true(embps_net_port(net) > 0);
  }
  embps_net_close(net);
  uv_run(&loop, UV_RUN_DEFAULT);
  embps_net_free(net);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void script_garbage(fixture_t *fx) {
  h2c_t c;
  int good = tcp_connect(fx->port, 5000);
  int bad = tcp_connect(fx->port, 5000);
  if (good < 0 || bad < 0)
    return;
  h2c_init(&c, 1);
  fx->ok[0] = echo_call(&c, good, 100);
  const char *g = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
  send_all(bad, (const uint8_t *)g, strlen(g));
  fx->ms[1] = wait_eof(bad, 3000);
  fx->ok[2] = echo_call(&c, good, 100);
  h2c_free(&c);
  close(good);
  close(bad);
}

static void test_garbage_closes_only_that_connection(void **state) {
  fixture_t fx;
  fixture_start(&fx, 0, 0, 0);
  fixture_run(&fx, script_garbage);
  assert_true(fx.ok[0]);
  assert_true(fx.ms[1] >= 0); /* closed */
  assert_true(fx.ok[2]);      /* the other connection still works */
  fixture_stop(&fx);
}

static void script_stall(fixture_t *fx) {
  h2c_t c;
  /* 1: a request half-sent, then silence */
  int fd = tcp_connect(fx->port, 5000);
  if (fd < 0)
    return;
  h2c_init(&c, 1);
  size_t plen;
  uint8_t *p = h2c_frame(0, "0123456789", 10, &plen);
  h2c_request(&c, PATH, CT, p, plen, 0, 8);
  h2c_flush(&c, fd);
  fx->ms[0] = wait_eof(fd, 5000);
  free(p);
  h2c_free(&c);
  close(fd);
  /* 2: a preface never sent */
  fd = tcp_connect(fx->port, 5000);
  fx->ms[1] = wait_eof(fd, 5000);
  close(fd);
  /* 3: a connection with a completed call is not stalled (and idle is off): it stays open */
  fd = tcp_connect(fx->port, 100);
  h2c_init(&c, 1);
  fx->ok[2] = echo_call(&c, fd, 10);
  fx->ms[2] = wait_eof(fd, 1000);
  fx->ok[3] = echo_call(&c, fd, 10);
  h2c_free(&c);
  close(fd);
}

static void test_stalled_connection_closed(void **state) {
  fixture_t fx;
  fixture_start(&fx, 300, 0, 0);
  fixture_run(&fx, script_stall);
  assert_true(fx.ms[0] >= 250 && fx.ms[0] < 3000);
  assert_true(fx.ms[1] >= 250 && fx.ms[1] < 3000);
  assert_true(fx.ok[2]);
  assert_int_equal(fx.ms[2], -1);
  assert_true(fx.ok[3]);
  fixture_stop(&fx);
}

static void script_idle(fixture_t *fx) {
  h2c_t c;
  int fd = tcp_connect(fx->port, 50);
  if (fd < 0)
    return;
  h2c_init(&c, 1);
  fx->ok[0] = echo_call(&c, fd, 10);
  fx->ms[1] = wait_eof_h2(&c, fd, 5000, 0);
  fx->ok[1] = c.goaway && c.goaway_error == NGHTTP2_NO_ERROR;
  h2c_free(&c);
  close(fd);
  /* PINGs every 100 ms (gRPC keepalive) keep an idle connection open well past the timeout */
  fd = tcp_connect(fx->port, 50);
  h2c_init(&c, 1);
  fx->ok[2] = echo_call(&c, fd, 10);
  fx->ms[2] = wait_eof_h2(&c, fd, 1200, 100);
  fx->ok[3] = echo_call(&c, fd, 10);
  h2c_free(&c);
  close(fd);
}

static void test_idle_connection_closed(void **state) {
  fixture_t fx;
  fixture_start(&fx, 0, 300, 0);
  fixture_run(&fx, script_idle);
  assert_true(fx.ok[0]);
  assert_true(fx.ms[1] >= 250 && fx.ms[1] < 3000);
  assert_true(fx.ok[1]); /* a GOAWAY(NO_ERROR) came before the close */
  assert_true(fx.ok[2]);
  assert_int_equal(fx.ms[2], -1); /* still open after 1.2 s */
  assert_true(fx.ok[3]);
  fixture_stop(&fx);
}

/* A client that opens no window for its reply is closed after the stall timeout, though it
 * keeps sending PINGs. */
static void script_unread_reply(fixture_t *fx) {
  h2c_t c;
  size_t plen;
  nghttp2_settings_entry zero = {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0};
  int fd = tcp_connect(fx->port, 50);
  if (fd < 0)
    return;
  h2c_init(&c, 0);
  nghttp2_submit_settings(c.session, NGHTTP2_FLAG_NONE, &zero, 1);
  uint8_t *p = h2c_frame(0, "0123456789", 10, &plen);
  h2c_request(&c, PATH, CT, p, plen, 0, plen);
  fx->ms[0] = wait_eof_h2(&c, fd, 5000, 100);
  free(p);
  h2c_free(&c);
  close(fd);
}

static void test_unread_reply_closes_connection(void **state) {
  fixture_t fx;
  fixture_start(&fx, 300, 0, 0);
  fixture_run(&fx, script_unread_reply);
  assert_true(fx.ms[0] >= 250 && fx.ms[0] < 3000);
  fixture_stop(&fx);
}

/* Connections beyond the per-source limit are closed at once; another address still gets in,
 * and the source gets in again once one of its connections is gone. */
static void script_per_source(fixture_t *fx) {
  h2c_t a, b, d;
  int fa = tcp_connect(fx->port, 5000), fb = tcp_connect(fx->port, 5000);
  if (fa < 0 || fb < 0)
    return;
  h2c_init(&a, 1);
  h2c_init(&b, 1);
  fx->ok[0] = echo_call(&a, fa, 10) && echo_call(&b, fb, 10);
  int third = tcp_connect(fx->port, 5000);
  fx->ms[1] = third < 0 ? 0 : wait_eof(third, 3000);
  if (third >= 0)
    close(third);
  int other = tcp_connect_from("127.0.0.2", fx->port, 5000);
  h2c_init(&d, 1);
  fx->ok[2] = other >= 0 && echo_call(&d, other, 10);
  h2c_free(&d);
  fx->ok[3] = echo_call(&a, fa, 10);
  h2c_free(&b);
  close(fb);
  for (int i = 0; i < 50 && !fx->ok[4]; i++) {
    int again = tcp_connect(fx->port, 2000);
    h2c_init(&d, 1);
    fx->ok[4] = again >= 0 && echo_call(&d, again, 10);
    h2c_free(&d);
    if (again >= 0)
      close(again);
    if (!fx->ok[4])
      usleep(20000);
  }
  h2c_free(&a);
  close(fa);
  if (other >= 0)
    close(other);
}

static void test_max_connections_per_source(void **state) {
  fixture_t fx;
  embps_net_config_t cfg = {.max_message_bytes = 1 << 20, .max_connections_per_source = 2};
  fixture_start_cfg(&fx, &cfg);
  fixture_run(&fx, script_per_source);
  assert_true(fx.ok[0]);
  assert_true(fx.ms[1] >= 0); /* the third from 127.0.0.1 was closed at once */
  assert_true(fx.ok[2]);      /* 127.0.0.2 is another source */
  assert_true(fx.ok[3]);
  assert_true(fx.ok[4]);
  fixture_stop(&fx);
}

static void script_max_conns(fixture_t *fx) {
  h2c_t c;
  int first = tcp_connect(fx->port, 5000);
  if (first < 0)
    return;
  h2c_init(&c, 1);
  fx->ok[0] = echo_call(&c, first, 10); /* the first is surely accepted and counted */
  int second = tcp_connect(fx->port, 5000);
  fx->ms[1] = second < 0 ? 0 : wait_eof(second, 3000);
  if (second >= 0)
    close(second);
  fx->ok[2] = echo_call(&c, first, 10);
  h2c_free(&c);
  close(first);
  /* once the first is gone, a new connection is served again (bounded retries: the server
   * notices the close asynchronously) */
  for (int i = 0; i < 50 && !fx->ok[3]; i++) {
    int again = tcp_connect(fx->port, 2000);
    h2c_init(&c, 1);
    fx->ok[3] = again >= 0 && echo_call(&c, again, 10);
    h2c_free(&c);
    if (again >= 0)
      close(again);
    if (!fx->ok[3])
      usleep(20000);
  }
}

static void test_max_connections(void **state) {
  fixture_t fx;
  fixture_start(&fx, 0, 0, 1);
  fixture_run(&fx, script_max_conns);
  assert_true(fx.ok[0]);
  assert_true(fx.ms[1] >= 0); /* the second was closed at once */
  assert_true(fx.ok[2]);
  assert_true(fx.ok[3]);
  fixture_stop(&fx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_listen_addresses),
      cmocka_unit_test(test_garbage_closes_only_that_connection),
      cmocka_unit_test(test_stalled_connection_closed),
      cmocka_unit_test(test_idle_connection_closed),
      cmocka_unit_test(test_max_connections),
      cmocka_unit_test(test_max_connections_per_source),
      cmocka_unit_test(test_unread_reply_closes_connection),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
