/* The peer TLS relay (server/group/peer_tls.c) on its own: a connector and an acceptor link whose
 * "TCP" sockets are socketpairs joined by a recording pump, so the test sees every byte on the
 * wire. Plaintext crosses both ways intact, and none of it appears on the wire; the acceptor
 * checks the connector's certificate names; a certificate from another CA and a cleartext hello
 * are refused with their reasons. Certificates are made with the openssl CLI (skips with 77
 * without it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/peer_tls.h"

#define WIRE_MAX (4u << 20)
#define PLAIN_BYTES (256u << 10)

static char dir[64];

/* Copies bytes between a[1] and b[1] until both sides close, recording what goes a -> b. */
typedef struct pump {
  int a, b;
  uint8_t *wire;
  size_t wire_len; /* guarded by mu: the pump may still record while the test reads */
  pthread_mutex_t mu;
} pump_t;

/* What the pump has recorded so far; the bytes below it no longer change. */
static size_t pump_recorded(pump_t *p) {
  pthread_mutex_lock(&p->mu);
  size_t n = p->wire_len;
  pthread_mutex_unlock(&p->mu);
  return n;
}

static void *pump_main(void *arg) {
  pump_t *p = arg;
  uint8_t buf[65536];
  int open_a = 1, open_b = 1;
  while (open_a || open_b) {
    struct pollfd pfd[2] = {{.fd = open_a ? p->a : -1, .events = POLLIN},
                            {.fd = open_b ? p->b : -1, .events = POLLIN}};
    if (poll(pfd, 2, 10000) <= 0)
      break;
    if (pfd[0].revents) {
      ssize_t k = recv(p->a, buf, sizeof(buf), 0);
      if (k <= 0) {
        open_a = 0;
        shutdown(p->b, SHUT_WR);
      } else {
        pthread_mutex_lock(&p->mu);
        size_t room = WIRE_MAX - p->wire_len, n = (size_t)k < room ? (size_t)k : room;
        memcpy(p->wire + p->wire_len, buf, n);
        p->wire_len += n;
        pthread_mutex_unlock(&p->mu);
        send(p->b, buf, (size_t)k, MSG_NOSIGNAL);
      }
    }
    if (pfd[1].revents) {
      ssize_t k = recv(p->b, buf, sizeof(buf), 0);
      if (k <= 0) {
        open_b = 0;
        shutdown(p->a, SHUT_WR);
      } else {
        send(p->a, buf, (size_t)k, MSG_NOSIGNAL);
      }
    }
  }
  return NULL;
}

static int sh(const char *cmd) {
  char line[2048];
  snprintf(line, sizeof(line), "cd %s && %s >/dev/null 2>&1", dir, cmd);
  return system(line);
}

static int make_pki(void) {
  const char *ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  char cmd[1024];
  const char *cas[] = {"ca", "other"};
  for (int i = 0; i < 2; i++) {
    snprintf(cmd, sizeof(cmd),
             "openssl req -x509 %s -keyout %s.key -out %s.crt -days 2 -subj /CN=%s", ec, cas[i],
             cas[i], cas[i]);
    if (sh(cmd))
      return -1;
  }
  char path[128];
  snprintf(path, sizeof(path), "%s/r.ext", dir);
  FILE *ext = fopen(path, "w");
  if (!ext)
    return -1;
  fputs("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n", ext);
  fclose(ext);
  const char *certs[][2] = {{"rank", "ca"}, {"rogue", "other"}};
  for (int i = 0; i < 2; i++) {
    snprintf(cmd, sizeof(cmd),
             "openssl req %s -keyout %s.key -out %s.csr -subj /CN=%s && openssl x509 -req -in "
             "%s.csr -CA %s.crt -CAkey %s.key -CAcreateserial -out %s.crt -days 2 -extfile r.ext",
             ec, certs[i][0], certs[i][0], certs[i][0], certs[i][0], certs[i][1], certs[i][1],
             certs[i][0]);
    if (sh(cmd))
      return -1;
  }
  return 0;
}

static embps_group_peer_tls_t *ctx_of(const char *cert) {
  char c[128], k[128], ca[128];
  embps_group_peer_tls_t *t = NULL;
  embps_error_t err;
  snprintf(c, sizeof(c), "%s/%s.crt", dir, cert);
  snprintf(k, sizeof(k), "%s/%s.key", dir, cert);
  snprintf(ca, sizeof(ca), "%s/ca.crt", dir);
  assert_int_equal(embps_group_peer_tls_new(&t, c, k, ca, &err), EMBPS_OK);
  return t;
}

/* A connector (with cert conn_cert) and an acceptor joined through a recording pump. */
typedef struct pair {
  embps_group_peer_tls_t *tc, *ta;
  embps__peer_link_t *conn, *acc;
  int conn_fd, acc_fd;
  pump_t pump;
  pthread_t thread;
} pair_t;

static void pair_start(pair_t *p, const char *conn_cert) {
  int a[2], b[2];
  embps_error_t err;
  uint64_t deadline = embps_now_ms() + 10000;
  memset(p, 0, sizeof(*p));
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, a), 0);
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, b), 0);
  p->pump = (pump_t){a[1], b[1], malloc(WIRE_MAX), 0, PTHREAD_MUTEX_INITIALIZER};
  assert_int_equal(pthread_create(&p->thread, NULL, pump_main, &p->pump), 0);
  p->tc = ctx_of(conn_cert);
  p->ta = ctx_of("rank");
  assert_int_equal(embps__peer_link_start(&p->conn, p->tc, a[0], EMBPS__PEER_CONNECTOR, 1, 0,
                                          "127.0.0.1:1", "127.0.0.1", deadline, &p->conn_fd, &err),
                   EMBPS_OK);
  assert_int_equal(embps__peer_link_start(&p->acc, p->ta, b[0], EMBPS__PEER_ACCEPTOR, 0,
                                          EMBPS__PEER_UNKNOWN, "127.0.0.1:2", NULL, deadline,
                                          &p->acc_fd, &err),
                   EMBPS_OK);
}

static void pair_stop(pair_t *p) {
  close(p->conn_fd);
  close(p->acc_fd);
  pthread_join(p->thread, NULL);
  close(p->pump.a);
  close(p->pump.b);
  free(p->pump.wire);
  embps__peer_link_release(p->conn);
  embps__peer_link_release(p->acc);
  embps_group_peer_tls_free(p->tc);
  embps_group_peer_tls_free(p->ta);
}

static void send_all(int fd, const uint8_t *b, size_t n) {
  assert_int_equal(embps__send_all(fd, b, n, embps_now_ms() + 10000), EMBPS__IO_OK);
}

static void recv_all(int fd, uint8_t *b, size_t n) {
  assert_int_equal(embps__recv_all(fd, b, n, embps_now_ms() + 10000), EMBPS__IO_OK);
}

static void test_bytes_cross_encrypted(void **state) {
  (void)state;
  pair_t p;
  uint8_t *plain = malloc(PLAIN_BYTES), *got = malloc(PLAIN_BYTES);
  float *f = (float *)plain;
  char why[512];
  for (size_t i = 0; i < PLAIN_BYTES / sizeof(float); i++)
    f[i] = 1.0f + (float)i * 0.25f; /* table-like floats, every 16 bytes distinct */
  pair_start(&p, "rank");
  /* A writer thread is not needed: the relays buffer both ways. */
  send_all(p.conn_fd, plain, PLAIN_BYTES);
  recv_all(p.acc_fd, got, PLAIN_BYTES);
  assert_memory_equal(got, plain, PLAIN_BYTES);
  send_all(p.acc_fd, plain, 1000);
  recv_all(p.conn_fd, got, 1000);
  assert_memory_equal(got, plain, 1000);
  /* On the wire: a TLS handshake first, and not one 16-byte run of the plaintext. */
  size_t recorded = pump_recorded(&p.pump);
  assert_true(recorded > PLAIN_BYTES);
  assert_int_equal(p.pump.wire[0], 0x16);
  for (size_t off = 0; off + 16 <= PLAIN_BYTES; off += 4096)
    assert_null(memmem(p.pump.wire, recorded, plain + off, 16));
  /* The acceptor checks the connector's certificate against the host its hello claims. */
  assert_int_equal(embps__peer_link_check_name(p.acc, "127.0.0.1", why, sizeof(why)), 0);
  assert_int_equal(embps__peer_link_check_name(p.acc, "10.0.0.9", why, sizeof(why)), 1);
  assert_non_null(strstr(why, "does not name its peer host '10.0.0.9'"));
  assert_int_equal(embps__peer_link_failure(p.conn, why, sizeof(why)), 0);
  /* Closing one plaintext end reaches the other as end-of-file. */
  close(p.conn_fd);
  p.conn_fd = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_int_equal(embps__recv_all(p.acc_fd, got, 1, embps_now_ms() + 10000), EMBPS__IO_EOF);
  pair_stop(&p);
  free(plain);
  free(got);
}

/* Writes CLOSE_BYTES on the connector's plaintext end, then closes it at once. */
#define CLOSE_BYTES (2u << 20)
typedef struct writer {
  int fd;
  const uint8_t *bytes;
} writer_t;

static void *writer_main(void *arg) {
  writer_t *w = arg;
  embps__io_t io = embps__send_all(w->fd, w->bytes, CLOSE_BYTES, embps_now_ms() + 10000);
  close(w->fd);
  return (void *)(intptr_t)io;
}

/* What the owner writes just before closing its plaintext end still reaches the peer, then
 * end-of-file (bootstrap's READY byte is written right before a non-leader closes a control
 * connection it no longer needs). The reader is slow, so the close comes while the relays are
 * full and the connector's relay waits for the wire with the owner's last bytes still queued on
 * its plaintext end. */
static void test_bytes_before_close_arrive(void **state) {
  (void)state;
  pair_t p;
  pthread_t t;
  void *io;
  char why[512];
  uint8_t *plain = malloc(CLOSE_BYTES), *got = malloc(CLOSE_BYTES);
  for (size_t i = 0; i < CLOSE_BYTES; i++)
    plain[i] = (uint8_t)(i * 7 + i / 251);
  pair_start(&p, "rank");
  writer_t w = {p.conn_fd, plain};
  p.conn_fd = socket(AF_UNIX, SOCK_STREAM, 0); /* the writer closes the real one */
  assert_int_equal(pthread_create(&t, NULL, writer_main, &w), 0);
  for (size_t have = 0; have < CLOSE_BYTES; have += 65536) {
    usleep(2000);
    recv_all(p.acc_fd, got + have, 65536);
  }
  pthread_join(t, &io);
  assert_int_equal((intptr_t)io, EMBPS__IO_OK);
  assert_memory_equal(got, plain, CLOSE_BYTES);
  assert_int_equal(embps__recv_all(p.acc_fd, got, 1, embps_now_ms() + 10000), EMBPS__IO_EOF);
  /* The connector sent close_notify: the acceptor saw an orderly end, not a failure. */
  assert_int_equal(embps__peer_link_failure(p.acc, why, sizeof(why)), 0);
  pair_stop(&p);
  free(plain);
  free(got);
}

static void test_other_ca_refused(void **state) {
  (void)state;
  pair_t p;
  uint8_t byte = 'x';
  char why[512];
  pair_start(&p, "rogue");
  /* The handshake may fail, and the relay close this end, before the byte goes: only an error
   * of the socket itself (EPIPE, ECONNRESET) may stop it. */
  embps__io_t sent = embps__send_all(p.conn_fd, &byte, 1, embps_now_ms() + 10000);
  assert_true(sent == EMBPS__IO_OK ||
              (sent == EMBPS__IO_ERROR && (errno == EPIPE || errno == ECONNRESET)));
  /* Both relays end: the connector learns its certificate was refused, the acceptor why. */
  assert_int_not_equal(embps__recv_all(p.conn_fd, &byte, 1, embps_now_ms() + 10000), EMBPS__IO_OK);
  assert_int_not_equal(embps__recv_all(p.acc_fd, &byte, 1, embps_now_ms() + 10000), EMBPS__IO_OK);
  assert_int_equal(embps__peer_link_failure(p.acc, why, sizeof(why)), 2);
  assert_non_null(strstr(why, "a peer at 127.0.0.1:2 presented a TLS certificate this rank does "
                              "not accept"));
  assert_int_equal(embps__peer_link_failure(p.conn, why, sizeof(why)), 2);
  assert_non_null(strstr(why, "rank 0 at 127.0.0.1:1 refused this rank's TLS certificate"));
  pair_stop(&p);
}

static void test_cleartext_hello_refused(void **state) {
  (void)state;
  embps_group_peer_tls_t *t = ctx_of("rank");
  embps__peer_link_t *l;
  embps__buf_t hello = {0};
  embps_error_t err;
  int s[2], app;
  uint8_t head[EMBPS__VERDICT_HEADER_LEN];
  char why[512], msg[600] = "";
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, s), 0);
  assert_int_equal(embps__peer_link_start(&l, t, s[0], EMBPS__PEER_ACCEPTOR, 0, EMBPS__PEER_UNKNOWN,
                                          "127.0.0.1:3", NULL, embps_now_ms() + 10000, &app, &err),
                   EMBPS_OK);
  assert_int_equal(embps__hello_encode(&hello, 0, 1, 2, "x=1\n", 4), EMBPS_OK);
  send_all(s[1], hello.data, hello.len);
  recv_all(s[1], head, sizeof(head)); /* a cleartext verdict: refused, with why */
  int verdict;
  size_t len;
  assert_int_equal(embps__verdict_decode(head, &verdict, &len, NULL), EMBPS_OK);
  assert_int_equal(verdict, EMBPS__VERDICT_REFUSED);
  assert_true(len < sizeof(msg));
  recv_all(s[1], (uint8_t *)msg, len);
  assert_non_null(strstr(msg, "rank 0 requires TLS on peer connections and rank 1 connected in "
                              "cleartext"));
  assert_int_equal(embps__recv_all(app, head, 1, embps_now_ms() + 10000), EMBPS__IO_EOF);
  assert_int_equal(embps__peer_link_failure(l, why, sizeof(why)), 2);
  assert_non_null(strstr(why, "rank 1 at 127.0.0.1:3 connected in cleartext"));
  close(app);
  close(s[1]);
  embps__buf_free(&hello);
  embps__peer_link_release(l);
  embps_group_peer_tls_free(t);
}

int main(void) {
  snprintf(dir, sizeof(dir), "/tmp/embps-peertls-XXXXXX");
  if (system("openssl version >/dev/null 2>&1") != 0) {
    printf("SKIP: the openssl command-line tool is not installed (deploy/packages.sh installs "
           "it)\n");
    return 77;
  }
  if (!mkdtemp(dir) || make_pki() != 0) {
    fprintf(stderr, "cannot make the test certificates in %s\n", dir);
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bytes_cross_encrypted),
      cmocka_unit_test(test_bytes_before_close_arrive),
      cmocka_unit_test(test_other_ca_refused),
      cmocka_unit_test(test_cleartext_hello_refused),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  if (!getenv("EMBPS_TEST_KEEP"))
    (void)system(cmd);
  return rc;
}
