/* TLS between ranks: one relay thread per peer connection (peer_tls.h).
 *
 * Why a relay rather than SSL calls at every socket use: the peer sockets are driven by four
 * poll() loops (bootstrap's accept loop, formation, the group thread's control links, the TCP
 * communicator's exchange), all non-blocking and each reading and writing its sockets from one
 * thread. OpenSSL on those descriptors would need every loop to learn that poll() no longer
 * tells the truth (a record already decrypted inside the SSL object leaves the socket quiet;
 * SSL_write may want to read), and every send/recv/sendmsg to become a TLS call. Ending TLS in
 * a thread of its own and handing the loops a socketpair keeps them exactly as they are
 * (cleartext and TLS groups run the same code above this file) and puts all of TLS in one
 * place. Each SSL object is used by its relay thread alone, so reads and writes on one
 * connection never race inside OpenSSL. The price is one more copy each way through the
 * socketpair and two threads per peer; README's TLS section has the measured cost.
 *
 * The relay is one non-blocking loop: decrypted bytes go to the plaintext end and bytes from
 * it are encrypted, each direction through its own buffer, waiting in poll() only when neither
 * direction can move. A full plaintext end stops reading from TLS (back-pressure reaches the
 * TCP peer), never the other direction. The plaintext end's end-of-file becomes a close_notify
 * and a TCP half-close, also when the owner closes its end outright: what it wrote before
 * closing is still sent (for at most RELAY_LINGER_MS), as the kernel would for a TCP socket it
 * closed, while what the peer still sends is dropped; the peer's close_notify (or its reset)
 * becomes a half-close of the plaintext end, so the loops above see a peer go away as before.
 * Partial writes are enabled (SSL_MODE_ENABLE_PARTIAL_WRITE) so a large buffer goes out record by
 * record as the socket takes it. SIGPIPE is ignored by the server (main.c) and the plaintext end is
 * written with MSG_NOSIGNAL.
 *
 * Session tickets are off: they are post-handshake messages nobody uses (every connection
 * lives as long as the group), and with them gone the only records after the handshake carry
 * data or an alert. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "server/group/peer_tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/tls.h"
#include "server/group/control.h"
#include "server/group/control_io.h"

/* Each direction's buffer: a handful of full 16 KiB records per wake-up. */
#define RELAY_BUF_BYTES (256u << 10)
/* The first byte of a TLS handshake record (RFC 8446 section 5.1: ContentType handshake). */
#define TLS_HANDSHAKE_BYTE 0x16

struct embps_group_peer_tls {
  SSL_CTX *ctx;
  pthread_mutex_t mu;
  pthread_cond_t idle;
  int live; /* relay threads running, which the context must outlive */
};

struct embps__peer_link {
  pthread_mutex_t mu;
  int refs; /* the caller's and the thread's */
  char why[sizeof(((embps_error_t *)0)->message)];
  int failure; /* embps__peer_link_failure's answer */
  embps_group_peer_tls_t *tls;
  X509 *peer_cert; /* the acceptor's view of the connector's certificate, once verified */
  /* The thread's alone from here on. */
  SSL *ssl;
  int tcp_fd;
  int app_fd; /* the relay's end of the socketpair */
  embps__peer_role_t role;
  uint32_t self_rank;
  char addr[96];  /* the peer's "HOST:PORT" */
  char peer[160]; /* what messages call it: "rank 0 at HOST:PORT", "a peer at HOST:PORT" */
  uint64_t deadline;
};

/* ---- the context ---- */

embps_status_t embps_group_peer_tls_new(embps_group_peer_tls_t **out, const char *cert_file,
                                        const char *key_file, const char *ca_file,
                                        embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_group_peer_tls_t *t = embps_calloc(1, sizeof(*t));
  if (!t)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for peer TLS");
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->idle, NULL);
  /* TLS_method(): each rank is a client towards lower ranks and a server towards higher ones. */
  if ((ret = embps_tls_ctx_new(&t->ctx, TLS_method(), err)) != EMBPS_OK ||
      (ret = embps_tls_load_identity(t->ctx, cert_file, "--peer-tls-cert", key_file,
                                     "--peer-tls-key", err)) != EMBPS_OK ||
      (ret = embps_tls_load_ca(t->ctx, ca_file, "--peer-tls-ca", err)) != EMBPS_OK)
    goto fail;
  SSL_CTX_set_verify(t->ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
  SSL_CTX_set_mode(t->ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_num_tickets(t->ctx, 0);
  SSL_CTX_set_session_cache_mode(t->ctx, SSL_SESS_CACHE_OFF);
  *out = t;
exit:
  return ret;
fail:
  embps_group_peer_tls_free(t);
  goto exit;
}

void embps_group_peer_tls_free(embps_group_peer_tls_t *tls) {
  struct timespec until;
  int live;
  if (!tls)
    return;
  /* The group closed its ends of every link, so each relay is on its way out: wait for them
   * (a second at most), so none outlives the process's teardown with OpenSSL state. */
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 1;
  pthread_mutex_lock(&tls->mu);
  while (tls->live > 0 && pthread_cond_timedwait(&tls->idle, &tls->mu, &until) == 0) {
  }
  live = tls->live;
  pthread_mutex_unlock(&tls->mu);
  if (live > 0) {
    EMBPS_WARN("%d peer TLS relay(s) still running at shutdown", live);
    return; /* they still use it */
  }
  SSL_CTX_free(tls->ctx); /* every SSL object holds its own reference */
  pthread_cond_destroy(&tls->idle);
  pthread_mutex_destroy(&tls->mu);
  embps_free(tls);
}

/* ---- the link's shared state ---- */

static void link_unref(embps__peer_link_t *l) {
  int left;
  pthread_mutex_lock(&l->mu);
  left = --l->refs;
  pthread_mutex_unlock(&l->mu);
  if (left > 0)
    return;
  X509_free(l->peer_cert);
  pthread_mutex_destroy(&l->mu);
  embps_free(l);
}

void embps__peer_link_release(embps__peer_link_t *l) {
  if (l)
    link_unref(l);
}

/* Records why the session failed (the first reason wins) and logs it. */
static void set_failure(embps__peer_link_t *l, int failure, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_failure(embps__peer_link_t *l, int failure, const char *fmt, ...) {
  va_list ap;
  pthread_mutex_lock(&l->mu);
  if (!l->failure) {
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof(l->why), fmt, ap);
    va_end(ap);
    l->failure = failure;
    EMBPS_WARN("rank %u: peer TLS: %s", l->self_rank, l->why);
  }
  pthread_mutex_unlock(&l->mu);
}

int embps__peer_link_failure(embps__peer_link_t *l, char *why, size_t cap) {
  int failure;
  pthread_mutex_lock(&l->mu);
  failure = l->failure;
  snprintf(why, cap, "%s", l->why);
  pthread_mutex_unlock(&l->mu);
  return failure;
}

static int is_ip_address(const char *host) {
  unsigned char addr[16];
  return inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1;
}

int embps__peer_link_check_name(embps__peer_link_t *l, const char *host, char *why, size_t cap) {
  int ok;
  pthread_mutex_lock(&l->mu);
  ok = l->peer_cert && (is_ip_address(host) ? X509_check_ip_asc(l->peer_cert, host, 0) == 1
                                            : X509_check_host(l->peer_cert, host, 0, 0, NULL) == 1);
  pthread_mutex_unlock(&l->mu);
  if (!ok)
    snprintf(why, cap,
             "its TLS certificate does not name its peer host '%s' (each rank's --peer-tls-cert "
             "must name the host of its --peers address, as a DNS or IP subject alternative "
             "name)",
             host);
  return !ok;
}

/* ---- the relay thread ---- */

/* Waits for the TCP socket (events) until the deadline, or until the plaintext end's owner
 * gives up (closes it). Returns 1 when ready, 0 on timeout or when abandoned. */
static int wait_tcp(embps__peer_link_t *l, short events) {
  struct pollfd pfd[2] = {{.fd = l->tcp_fd, .events = events}, {.fd = l->app_fd, .events = 0}};
  int left = embps__remaining_ms(l->deadline);
  if (left == 0)
    return 0;
  if (poll(pfd, 2, left) < 0 && errno != EINTR)
    return 0;
  if (pfd[1].revents & (POLLHUP | POLLERR))
    return 0;
  return 1;
}

/* Acceptor: peeks at the connection's first bytes. Returns 1 for a TLS handshake, 0 when the
 * connection must end (after refusing a cleartext embps hello, or a stranger). */
static int sniff(embps__peer_link_t *l) {
  uint8_t head[EMBPS__HELLO_HEADER_LEN];
  for (;;) {
    ssize_t k = recv(l->tcp_fd, head, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 1)
      break;
    if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ||
        !wait_tcp(l, POLLIN))
      return 0;
  }
  if (head[0] == TLS_HANDSHAKE_BYTE)
    return 1;
  if (!embps__hello_magic_ok(head, 1))
    return 0; /* not an embps peer: dropped without a word, as bootstrap does */
  /* A rank without peer TLS: its hello names it; refuse it in words it reads. */
  embps__hello_t hello = {0};
  embps_error_t e;
  char msg[300];
  uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + sizeof(msg)];
  embps__buf_t v = {bytes, 0, sizeof(bytes)}; /* fits: nothing is allocated */
  int named = embps__recv_all(l->tcp_fd, head, sizeof(head), l->deadline) == EMBPS__IO_OK &&
              embps__hello_decode(head, &hello, &e) == EMBPS_OK;
  char who[32] = "a peer";
  if (named)
    snprintf(who, sizeof(who), "rank %u", hello.rank);
  snprintf(msg, sizeof(msg),
           "rank %u requires TLS on peer connections and %s connected in cleartext: start every "
           "rank with the same --peer-tls-cert, --peer-tls-key and --peer-tls-ca, or none",
           l->self_rank, who);
  embps__verdict_encode(&v, 0, msg);
  (void)embps__send_all(l->tcp_fd, v.data, v.len, l->deadline);
  set_failure(l, 2,
              "%s at %s connected in cleartext, but this rank requires peer TLS: start every "
              "rank with the same --peer-tls-cert, --peer-tls-key and --peer-tls-ca, or none",
              who, l->addr);
  return 0;
}

/* Records why the TLS session failed after an SSL call returned rc. */
static void tls_failed(embps__peer_link_t *l, const char *when, int rc) {
  char detail[256];
  int e = SSL_get_error(l->ssl, rc);
  long verify = SSL_get_verify_result(l->ssl);
  int handshake = !SSL_is_init_finished(l->ssl);
  if (handshake && verify != X509_V_OK) {
    set_failure(l, 2,
                "%s presented a TLS certificate this rank does not accept: %s (every rank's "
                "--peer-tls-cert must be signed by a CA in --peer-tls-ca and name the rank's "
                "peer host)",
                l->peer, X509_verify_cert_error_string(verify));
  } else if (e == SSL_ERROR_SSL) {
    int lib_reason = ERR_GET_REASON(ERR_peek_error());
    embps_tls_error(detail, sizeof(detail));
    if (lib_reason == SSL_R_WRONG_VERSION_NUMBER || lib_reason == SSL_R_PACKET_LENGTH_TOO_LONG)
      set_failure(l, 2,
                  "%s does not speak TLS on its peer port (%s): it is started without "
                  "--peer-tls-cert while this rank has it; start every rank with the same peer "
                  "TLS options, or none",
                  l->peer, detail);
    else if (strstr(detail, "alert"))
      set_failure(l, 2,
                  "%s refused this rank's TLS certificate (%s): every rank's --peer-tls-cert "
                  "must be signed by a CA in the others' --peer-tls-ca",
                  l->peer, detail);
    else
      set_failure(l, 2, "TLS %s with %s failed: %s", when, l->peer, detail);
  } else if (handshake) {
    set_failure(l, 1,
                "%s closed the connection during the TLS handshake (is it started without "
                "--peer-tls-cert?)",
                l->peer);
  }
  /* After the handshake, a peer that closes without close_notify or resets is just a peer that
   * went away: the loops above see the plaintext end close and say so themselves. */
  ERR_clear_error();
}

/* Runs the handshake before the deadline. Returns 1 when done, 0 on failure (recorded). */
static int handshake(embps__peer_link_t *l) {
  for (;;) {
    ERR_clear_error();
    int rc = SSL_do_handshake(l->ssl);
    if (rc == 1)
      break;
    int e = SSL_get_error(l->ssl, rc);
    if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
      tls_failed(l, "handshake", rc);
      return 0;
    }
    if (!wait_tcp(l, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT)) {
      set_failure(l, 1, "no TLS handshake with %s before the bootstrap deadline", l->peer);
      return 0;
    }
  }
  X509 *cert = SSL_get1_peer_certificate(l->ssl);
  pthread_mutex_lock(&l->mu);
  l->peer_cert = cert;
  pthread_mutex_unlock(&l->mu);
  EMBPS_DEBUG("rank %u: peer TLS with %s: %s, %s", l->self_rank, l->peer, SSL_get_version(l->ssl),
              SSL_get_cipher_name(l->ssl));
  return 1;
}

/* One direction's bytes in flight. */
typedef struct dir {
  uint8_t *buf;
  size_t off, len;
  int done; /* its source ended */
} dir_t;

/* How long a relay whose owner closed its end may take to hand the peer what the owner wrote
 * before closing: well inside the second embps_group_peer_tls_free waits for relays. */
#define RELAY_LINGER_MS 500

/* The plaintext end's owner closed it: nothing more is delivered to it (what the peer sends is
 * dropped), and the relay ends once the owner's last bytes are out, or at *linger. */
static void owner_gone(dir_t *in, uint64_t *linger) {
  in->done = 1;
  in->off = in->len;
  if (!*linger)
    *linger = embps_now_ms() + RELAY_LINGER_MS;
}

/* Moves bytes both ways until the connection ends. */
static void relay(embps__peer_link_t *l, dir_t *in, dir_t *out) {
  uint64_t linger = 0; /* set once the owner closed its end */
  for (;;) {
    short tcp_ev = 0, app_ev = 0;
    int moved = 0;
    size_t n;
    /* peer -> plaintext end */
    if (!in->done && in->off == in->len) {
      ERR_clear_error();
      int rc = SSL_read_ex(l->ssl, in->buf, RELAY_BUF_BYTES, &n);
      if (rc == 1) {
        in->off = 0;
        in->len = n;
        moved = 1;
      } else {
        int e = SSL_get_error(l->ssl, rc);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
          tcp_ev |= e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
        } else {
          if (e != SSL_ERROR_ZERO_RETURN)
            tls_failed(l, "read", rc);
          if (e != SSL_ERROR_ZERO_RETURN && e != SSL_ERROR_SYSCALL)
            return; /* a protocol error or an alert: nothing more can be trusted */
          in->done = 1;
          shutdown(l->app_fd, SHUT_WR);
        }
      }
    }
    if (in->off < in->len) {
      ssize_t k = send(l->app_fd, in->buf + in->off, in->len - in->off, MSG_NOSIGNAL);
      if (k > 0) {
        in->off += (size_t)k;
        moved = 1;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        app_ev |= POLLOUT;
      } else if (k < 0 && errno != EINTR) {
        owner_gone(in, &linger); /* what it wrote before closing still goes out below */
      }
    }
    /* plaintext end -> peer */
    if (!out->done && out->off == out->len) {
      ssize_t k = recv(l->app_fd, out->buf, RELAY_BUF_BYTES, 0);
      if (k > 0) {
        out->off = 0;
        out->len = (size_t)k;
        moved = 1;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        app_ev |= POLLIN;
      } else if (k == 0 || errno != EINTR) {
        out->done = 1;
        (void)SSL_shutdown(l->ssl); /* close_notify, best effort */
        shutdown(l->tcp_fd, SHUT_WR);
      }
    }
    if (out->off < out->len) {
      ERR_clear_error();
      int rc = SSL_write_ex(l->ssl, out->buf + out->off, out->len - out->off, &n);
      if (rc == 1) {
        out->off += n;
        moved = 1;
      } else {
        int e = SSL_get_error(l->ssl, rc);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
          tls_failed(l, "write", rc);
          return;
        }
        tcp_ev |= e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
      }
    }
    if (in->done && out->done)
      return;
    if (moved)
      continue;
    struct pollfd pfd[2] = {{.fd = l->tcp_fd, .events = tcp_ev},
                            {.fd = l->app_fd, .events = app_ev}};
    int left = linger ? embps__remaining_ms(linger) : -1;
    if (left == 0)
      return; /* a peer that takes nothing more does not hold the relay past the linger */
    if ((poll(pfd, 2, left) < 0 && errno != EINTR) || (pfd[1].revents & POLLNVAL) ||
        (pfd[0].revents & POLLNVAL))
      return;
    /* POLLHUP or POLLERR on the plaintext end: its owner closed it (or shut it both ways), so
     * nothing more can be delivered to it. But the bytes it wrote before closing are still
     * queued on our end, and they must reach the peer (bootstrap's READY byte, written just
     * before a non-leader closes the control connection it no longer needs): the reads above
     * take them until end-of-file, which sends the close_notify. */
    if (pfd[1].revents & (POLLERR | POLLHUP))
      owner_gone(in, &linger);
  }
}

/* Before closing a connection whose handshake failed: half-closes it and reads what the peer
 * still sends until it closes too (at most a second). Closing with unread bytes would send a
 * reset, which can overtake the alert or verdict just written and leave the peer with a bare
 * "connection reset" instead of the reason. */
static void drain(embps__peer_link_t *l) {
  uint8_t junk[4096];
  uint64_t until = embps_now_ms() + 1000;
  if (until > l->deadline)
    until = l->deadline;
  shutdown(l->tcp_fd, SHUT_WR);
  for (;;) {
    ssize_t k = recv(l->tcp_fd, junk, sizeof(junk), MSG_DONTWAIT);
    if (k > 0 || (k < 0 && errno == EINTR))
      continue;
    struct pollfd pfd = {.fd = l->tcp_fd, .events = POLLIN};
    int left = embps__remaining_ms(until);
    if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK) || left == 0 ||
        poll(&pfd, 1, left) <= 0)
      return;
  }
}

static void *link_main(void *arg) {
  embps__peer_link_t *l = arg;
  dir_t in = {0}, out = {0};
  if ((l->role == EMBPS__PEER_ACCEPTOR && !sniff(l)) || !handshake(l)) {
    /* The reason is recorded: the owner may read it once its end closes. */
    close(l->app_fd);
    l->app_fd = -1;
    drain(l);
    goto exit;
  }
  in.buf = embps_malloc(RELAY_BUF_BYTES);
  out.buf = embps_malloc(RELAY_BUF_BYTES);
  if (!in.buf || !out.buf) {
    set_failure(l, 1, "out of memory for the TLS relay with %s", l->peer);
    goto exit;
  }
  relay(l, &in, &out);
exit:
  embps_free(in.buf);
  embps_free(out.buf);
  SSL_free(l->ssl);
  /* The failure (if any) is recorded: closing the plaintext end now lets the owner read it. */
  close(l->tcp_fd);
  if (l->app_fd >= 0)
    close(l->app_fd);
  ERR_clear_error();
  OPENSSL_thread_stop();
  embps_group_peer_tls_t *tls = l->tls;
  link_unref(l);
  pthread_mutex_lock(&tls->mu);
  if (--tls->live == 0)
    pthread_cond_broadcast(&tls->idle);
  pthread_mutex_unlock(&tls->mu);
  return NULL;
}

/* Points the connector's verification at host: the acceptor's certificate must name it. */
static int expect_host(SSL *ssl, const char *host) {
  if (is_ip_address(host))
    return X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), host);
  SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  return SSL_set1_host(ssl, host) && SSL_set_tlsext_host_name(ssl, host);
}

embps_status_t embps__peer_link_start(embps__peer_link_t **out, embps_group_peer_tls_t *tls,
                                      int tcp_fd, embps__peer_role_t role, uint32_t self_rank,
                                      uint32_t peer_rank, const char *peer_addr,
                                      const char *peer_host, uint64_t deadline, int *app_fd,
                                      embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps__peer_link_t *l = embps_calloc(1, sizeof(*l));
  int pair[2] = {-1, -1};
  pthread_attr_t attr;
  pthread_t thread;
  if (!l) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a peer TLS link");
    goto fail_link;
  }
  pthread_mutex_init(&l->mu, NULL);
  l->refs = 2;
  l->tcp_fd = tcp_fd;
  l->role = role;
  l->self_rank = self_rank;
  l->deadline = deadline;
  snprintf(l->addr, sizeof(l->addr), "%s", peer_addr);
  if (peer_rank == EMBPS__PEER_UNKNOWN)
    snprintf(l->peer, sizeof(l->peer), "a peer at %s", l->addr);
  else
    snprintf(l->peer, sizeof(l->peer), "rank %u at %s", peer_rank, l->addr);
  if (!(l->ssl = SSL_new(tls->ctx)) || !SSL_set_fd(l->ssl, tcp_fd) ||
      (role == EMBPS__PEER_CONNECTOR && !expect_host(l->ssl, peer_host))) {
    char why[256];
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "cannot set up TLS with %s: %s", l->peer,
                          embps_tls_error(why, sizeof(why)));
    goto fail_ssl;
  }
  if (role == EMBPS__PEER_CONNECTOR)
    SSL_set_connect_state(l->ssl);
  else
    SSL_set_accept_state(l->ssl);
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) != 0 ||
      fcntl(tcp_fd, F_SETFL, fcntl(tcp_fd, F_GETFL) | O_NONBLOCK) != 0) {
    ret =
        embps_error_set(err, EMBPS_INTERNAL, "socketpair for a peer TLS link: %s", strerror(errno));
    goto fail_ssl;
  }
  l->app_fd = pair[1];
  l->tls = tls;
  pthread_mutex_lock(&tls->mu);
  tls->live++;
  pthread_mutex_unlock(&tls->mu);
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&thread, &attr, link_main, l);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    pthread_mutex_lock(&tls->mu);
    tls->live--;
    pthread_mutex_unlock(&tls->mu);
    ret = embps_error_set(err, EMBPS_INTERNAL, "cannot start a peer TLS relay thread: %s",
                          strerror(rc));
    goto fail_ssl;
  }
  *out = l;
  *app_fd = pair[0];
  return EMBPS_OK;

fail_ssl:
  if (pair[0] >= 0) {
    close(pair[0]);
    close(pair[1]);
  }
  SSL_free(l->ssl);
  pthread_mutex_destroy(&l->mu);
  embps_free(l);
fail_link:
  close(tcp_fd);
  ERR_clear_error();
  return ret;
}
