/* Group bootstrap: N ranks meet over TCP and check that they agree before serving.
 *
 * Every rank listens on its peer address first, then connects to every lower rank and accepts
 * every higher one, so each pair of ranks is joined exactly once per connection kind (control
 * and data) and nobody needs to know who starts first. Connections only ever go downward, so
 * there is no cycle of waits: rank 0 only accepts, and a higher rank's connection simply waits
 * in the lower rank's listen backlog until that rank has finished its own connects. A connector
 * retries every RETRY_MS while the peer is not listening yet (connection refused, a name not
 * resolving yet, a connection dropped before its verdict), until the deadline.
 *
 * On each new connection the connector sends a hello and the acceptor answers with a verdict
 * (control.h has the bytes). The acceptor judges the hello (agreement.h: group size, rank,
 * then the identity key by key); a refusal names what differs from the acceptor's point of
 * view and the connector fails with it (FAILED_PRECONDITION). The acceptor itself keeps waiting
 * for a matching peer (the refused one may be restarted with the right configuration) and, if
 * the deadline passes, fails with the last refusal rather than a bare timeout. With a group
 * secret, a hello that passes is answered with a challenge instead of the verdict, and the
 * connection joins only once its answer proves the secret; the acceptor then proves it in turn
 * (secret.c has the cryptography). A connection waiting to answer is just another pending one,
 * read through the same poll(), so a peer that never answers stalls nobody. Connections that
 * do not open with the hello's magic (a port scanner, a gRPC client pointed at the peer port)
 * are closed and ignored; accepted connections are read concurrently through one poll() so an
 * idle one cannot stall the rest. When every connection is up, each rank sends the READY byte
 * on every control connection and waits for one from every peer: a rank receives all of them
 * only once every rank holds all of its connections, so bootstrap returns on every rank only
 * when the whole group is up.
 *
 * This file is the socket side only: addresses are common/hostport's, bytes control.c's and
 * decisions agreement.c's. Everything runs on non-blocking sockets with one deadline; the
 * sockets handed back are made blocking again. The module runs before any event loop exists,
 * so it uses plain poll() rather than libuv. */
#include "server/group/bootstrap.h"
#include "server/group/group.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/hostport.h"
#include "common/log.h"
#include "server/group/agreement.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/peer_tls.h"
#include "server/group/secret.h"

/* The first byte of a TLS handshake record: what a rank with peer TLS sends first. */
#define TLS_HANDSHAKE_BYTE 0x16
/* How often a connector retries a peer that is not listening yet. */
#define RETRY_MS 50
/* Accepted connections still reading their hello; beyond this the oldest is dropped, so a
 * flood of idle connections cannot lock the real peers out. */
#define MAX_PENDING 64
/* Room for "HOST:PORT" ("[v6]:PORT"). */
#define ADDR_MAX (EMBPS_HOSTPORT_HOST_MAX + 16)

/* An accepted connection still reading its hello, or with a group secret, its answer to our
 * challenge. */
typedef struct pending {
  int fd;
  char addr[ADDR_MAX]; /* where it comes from, "HOST:PORT", for the log */
  uint8_t header[EMBPS__HELLO_HEADER_LEN];
  size_t have;          /* bytes of header + identity read so far */
  embps__hello_t hello; /* filled once the header is complete */
  char *identity;       /* owned, NUL-terminated; allocated once the header is complete */
  int challenged;       /* its hello was judged good and our challenge sent */
  uint8_t nonce[EMBPS__NONCE_LEN]; /* the challenge's */
  uint8_t auth[EMBPS__AUTH_LEN];   /* its answer */
  size_t auth_have;
  embps__peer_link_t *link; /* with peer TLS: its relay (fd is the relay's plaintext end) */
} pending_t;

typedef struct boot {
  uint32_t rank;
  uint32_t size;
  const char *identity;
  size_t identity_len;
  const uint8_t *secret; /* secret_len bytes; none when 0 */
  size_t secret_len;
  embps_group_peer_tls_t *tls; /* NULL: cleartext */
  uint64_t timeout_ms;
  uint64_t deadline;
  embps_hostport_t *addrs; /* size entries, owned */
  int *control_fds;        /* the caller's arrays */
  int *data_fds;
  int cancel_fd; /* readable once the server shuts down: stop waiting (-1: never) */
  char last_refusal[sizeof(((embps_error_t *)0)->message)];
} boot_t;

/* Whether the server asked the bootstrap to stop (its cancel descriptor is readable); sets err
 * when it did. Every wait below also polls the descriptor, so a SIGTERM during bootstrap is
 * seen at once rather than when the bootstrap timeout passes. */
static int cancelled(const boot_t *b, embps_error_t *err) {
  struct pollfd pfd = {.fd = b->cancel_fd, .events = POLLIN};
  if (b->cancel_fd < 0 || poll(&pfd, 1, 0) <= 0)
    return 0;
  embps_error_set(err, EMBPS_CANCELLED,
                  "rank %u stopped waiting for the group: the server is shutting down", b->rank);
  return 1;
}

static const char *kind_name(unsigned kind) { return kind == 0 ? "control" : "data"; }

embps_status_t embps_group_peer_addr(const char *client_addr, int port_offset, char *out,
                                     size_t cap, embps_error_t *err) {
  embps_hostport_t a;
  embps_status_t ret;
  if (!out || !client_addr)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "no client address to derive from");
  ret = embps_hostport_parse(&a, client_addr, strlen(client_addr), "client address", 0, err);
  if (ret != EMBPS_OK)
    return ret;
  long port = (long)a.port + port_offset;
  if (port < 1 || port > 65535)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "peer port of '%s' with offset %d is %ld, outside 1..65535", client_addr,
                           port_offset, port);
  a.port = (uint16_t)port;
  if (embps_hostport_format(&a, out, cap) != EMBPS_OK)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "peer address of '%s' does not fit in %zu bytes", client_addr, cap);
  return EMBPS_OK;
}

/* ---- socket helpers ---- */

static int set_nodelay(int fd) {
  int one = 1;
  return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static int set_blocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0)
    return -1;
  return fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

static void close_fd(int *fd) {
  if (*fd >= 0) {
    close(*fd);
    *fd = -1;
  }
}

/* Sends a verdict; best effort (a refused peer that already left changes nothing). */
static embps__io_t send_verdict(int fd, int accept, const char *msg, uint64_t deadline) {
  uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + EMBPS__VERDICT_MESSAGE_MAX];
  embps__buf_t b = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
  embps__verdict_encode(&b, accept, msg);
  return embps__send_all(fd, b.data, b.len, deadline);
}

/* Appends " r" for every rank in [lo, hi) missing a connection in either array. */
static void list_missing(const boot_t *b, uint32_t lo, uint32_t hi, char *out, size_t cap) {
  size_t n = 0;
  out[0] = '\0';
  for (uint32_t r = lo; r < hi && n + 16 < cap; r++) {
    if (r == b->rank || (b->control_fds[r] >= 0 && b->data_fds[r] >= 0))
      continue;
    n += (size_t)snprintf(out + n, cap - n, "%s%u", n ? ", " : "", r);
  }
}

/* The address this rank listens on: its peer address, or with bind_any the wildcard address
 * of that address's family (IPv6 for a bracketed host). */
static embps_status_t listen_address(const embps_hostport_t *a, int bind_any,
                                     struct sockaddr_storage *ss, socklen_t *len,
                                     embps_error_t *err) {
  embps_hostport_t any = *a;
  embps_error_t why;
  if (bind_any)
    snprintf(any.host, sizeof(any.host), "%s", a->ipv6 ? "::" : "0.0.0.0");
  if (embps_hostport_resolve(&any, ss, len, &why) != EMBPS_OK)
    return embps_error_set(err, EMBPS_UNAVAILABLE, "%s (the peer listen address)", why.message);
  return EMBPS_OK;
}

static embps_status_t open_listener(const boot_t *b, int bind_any, int *fd_out,
                                    embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const embps_hostport_t *a = &b->addrs[b->rank];
  struct sockaddr_storage ss;
  socklen_t len;
  int fd = -1, one = 1;
  if ((ret = listen_address(a, bind_any, &ss, &len, err)) != EMBPS_OK)
    goto fail;
  fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "socket: %s", strerror(errno));
    goto fail;
  }
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "SO_REUSEADDR: %s", strerror(errno));
    goto fail;
  }
  if (bind(fd, (struct sockaddr *)&ss, len) != 0 || listen(fd, 2 * (int)b->size + 64) != 0) {
    ret = embps_error_set(
        err, EMBPS_UNAVAILABLE, "rank %u cannot listen for peers on %s%s%s:%u (%s): %s", b->rank,
        a->ipv6 ? "[" : "", bind_any ? (a->ipv6 ? "::" : "0.0.0.0") : a->host, a->ipv6 ? "]" : "",
        a->port, bind_any ? "all interfaces" : "its peer address", strerror(errno));
    goto fail;
  }
  *fd_out = fd;
exit:
  return ret;
fail:
  close_fd(&fd);
  goto exit;
}

/* Opens a TCP connection to a before the deadline. Returns the socket, or -1 with why (cap
 * bytes) saying what went wrong this time (worth retrying), or -2 with err set (not worth it). */
static int dial(const boot_t *b, const embps_hostport_t *a, char *why, size_t cap,
                embps_error_t *err) {
  struct sockaddr_storage ss;
  socklen_t len;
  embps_error_t rerr;
  int fd;
  if (embps_hostport_resolve(a, &ss, &len, &rerr) != EMBPS_OK) {
    snprintf(why, cap, "%.150s", rerr.message);
    return -1;
  }
  fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || set_nodelay(fd) != 0) {
    embps_error_set(err, EMBPS_INTERNAL, "%s: %s", fd < 0 ? "socket" : "TCP_NODELAY",
                    strerror(errno));
    if (fd >= 0)
      close(fd);
    return -2;
  }
  if (connect(fd, (struct sockaddr *)&ss, len) != 0) {
    int so_err = errno, prc = 0;
    socklen_t so_len = sizeof(so_err);
    if (so_err == EINPROGRESS) {
      struct pollfd pfd[2] = {{.fd = fd, .events = POLLOUT},
                              {.fd = b->cancel_fd, .events = POLLIN}};
      prc = poll(pfd, 2, embps__remaining_ms(b->deadline));
      so_err = prc < 0 ? errno : 0;
      if (cancelled(b, err)) {
        close(fd);
        return -2;
      }
      if (prc > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_err, &so_len) != 0)
        so_err = errno;
    }
    if (prc == 0 && so_err == 0)
      snprintf(why, cap, "connection attempt timed out");
    else if (so_err)
      snprintf(why, cap, "%s", strerror(so_err));
    if (prc == 0 || so_err) {
      close(fd);
      return -1;
    }
  }
  return fd;
}

/* Reads a verdict and its message from fd. Returns 1 with *verdict, *msg (owned by the caller,
 * NUL-terminated after its *msg_len bytes), -1 when the exchange failed (why says how: worth
 * retrying) or -2 when out of memory (err set). */
static int read_verdict(const boot_t *b, uint32_t peer, int fd, int *verdict, char **msg,
                        size_t *msg_len, char *why, size_t cap, embps_error_t *err) {
  uint8_t vh[EMBPS__VERDICT_HEADER_LEN];
  embps__io_t io = embps__recv_all(fd, vh, sizeof(vh), b->deadline);
  if (io != EMBPS__IO_OK) {
    /* The peer's listener may belong to a process on its way out, or be still stuck in its
     * own connects: try again while time is left. */
    snprintf(why, cap, "%s before rank %u answered",
             io == EMBPS__IO_TIMEOUT ? "timed out"
             : io == EMBPS__IO_EOF   ? "connection closed"
                                     : strerror(errno),
             peer);
    return -1;
  }
  if (embps__verdict_decode(vh, verdict, msg_len, NULL) != EMBPS_OK) {
    snprintf(why, cap, "rank %u's answer is not a verdict", peer);
    return -1;
  }
  if (!(*msg = embps_malloc(*msg_len + 1))) {
    embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a verdict");
    return -2;
  }
  if (*msg_len && embps__recv_all(fd, *msg, *msg_len, b->deadline) != EMBPS__IO_OK) {
    snprintf(why, cap, "rank %u's answer was cut short", peer);
    return -1;
  }
  (*msg)[*msg_len] = '\0';
  return 1;
}

/* Answers the challenge (nonce_a, from lower rank peer) to our hello on fd, then checks the
 * acceptor's own proof in its verdict. Returns as exchange_hello does. */
static int answer_challenge(const boot_t *b, uint32_t peer, int fd, const embps__buf_t *hello,
                            const uint8_t *nonce_a, char **msg, char *why, size_t cap,
                            embps_error_t *err) {
  uint8_t nonce_c[EMBPS__NONCE_LEN], proof[EMBPS__PROOF_LEN], bytes[EMBPS__AUTH_LEN];
  embps__buf_t out = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
  embps__transcript_t t = {hello->data,
                           (const char *)hello->data + EMBPS__HELLO_HEADER_LEN,
                           hello->len - EMBPS__HELLO_HEADER_LEN,
                           peer,
                           nonce_a,
                           nonce_c};
  char addr[ADDR_MAX];
  size_t msg_len;
  int verdict, rc;

  embps_hostport_format(&b->addrs[peer], addr, sizeof(addr));
  if (!b->secret_len) {
    embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                    "rank %u at %s asks for the group secret and rank %u has none: start every "
                    "rank with the same --group-secret-file",
                    peer, addr, b->rank);
    return -2;
  }
  if (embps__secret_nonce(nonce_c, err) != EMBPS_OK ||
      embps__secret_proof(b->secret, b->secret_len, EMBPS__PROOF_CONNECTOR, &t, proof, err) !=
          EMBPS_OK)
    return -2;
  embps__auth_encode(&out, nonce_c, proof);
  if (embps__send_all(fd, out.data, out.len, b->deadline) != EMBPS__IO_OK) {
    snprintf(why, cap, "connection closed before rank %u took the answer to its challenge", peer);
    return -1;
  }
  if ((rc = read_verdict(b, peer, fd, &verdict, msg, &msg_len, why, cap, err)) != 1)
    return rc;
  if (verdict == EMBPS__VERDICT_REFUSED)
    return 0;
  if (verdict != EMBPS__VERDICT_ACCEPTED || msg_len != EMBPS__PROOF_LEN ||
      !embps__secret_verify(b->secret, b->secret_len, EMBPS__PROOF_ACCEPTOR, &t,
                            (const uint8_t *)*msg)) {
    embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                    "rank %u at %s failed the group secret check: its answer does not prove it "
                    "holds this group's secret (a different --group-secret-file, or not a rank "
                    "of this group)",
                    peer, addr);
    return -2;
  }
  return 1;
}

/* Sends the hello on fd and reads the verdict, answering the acceptor's challenge when it sends
 * one. Returns 1 when accepted, 0 when refused (msg holds why), -1 when the exchange failed
 * (why says how: worth retrying) or -2 when this rank must give up (err set: out of memory, or
 * the group secret check failed). *msg is owned by the caller. */
static int exchange_hello(const boot_t *b, uint32_t peer, int fd, const embps__buf_t *hello,
                          char **msg, char *why, size_t cap, embps_error_t *err) {
  size_t msg_len;
  int verdict, rc;
  if (embps__send_all(fd, hello->data, hello->len, b->deadline) != EMBPS__IO_OK) {
    snprintf(why, cap, "connection closed before rank %u took the hello", peer);
    return -1;
  }
  if ((rc = read_verdict(b, peer, fd, &verdict, msg, &msg_len, why, cap, err)) != 1)
    return rc;
  if (verdict == EMBPS__VERDICT_CHALLENGE) {
    uint8_t nonce_a[EMBPS__NONCE_LEN];
    memcpy(nonce_a, *msg, sizeof(nonce_a));
    embps_free(*msg);
    *msg = NULL;
    return answer_challenge(b, peer, fd, hello, nonce_a, msg, why, cap, err);
  }
  if (verdict == EMBPS__VERDICT_ACCEPTED && b->secret_len) {
    char addr[ADDR_MAX];
    embps_hostport_format(&b->addrs[peer], addr, sizeof(addr));
    embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                    "rank %u at %s failed the group secret check: it accepted rank %u without a "
                    "challenge (is it started without --group-secret-file?)",
                    peer, addr, b->rank);
    return -2;
  }
  return verdict == EMBPS__VERDICT_ACCEPTED;
}

/* Connects to lower rank `peer` for `kind`, retrying until the deadline. On EMBPS_OK *fd_out
 * is the accepted connection. */
static embps_status_t connect_peer(boot_t *b, uint32_t peer, uint8_t kind, int *fd_out,
                                   embps_error_t *err) {
  const embps_hostport_t *a = &b->addrs[peer];
  char last_why[160] = "no attempt finished";
  embps__buf_t hello = {0};
  char *msg = NULL;
  int fd = -1;
  embps__peer_link_t *link = NULL;
  embps_status_t ret = EMBPS_OK;

  if (embps__hello_encode(&hello, kind, b->rank, b->size, b->identity, b->identity_len) !=
      EMBPS_OK) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte hello",
                          EMBPS__HELLO_HEADER_LEN + b->identity_len);
    goto fail;
  }
  for (int attempt = 0;; attempt++) {
    if (attempt > 0) {
      close_fd(&fd);
      embps_free(msg);
      msg = NULL;
      int left = embps__remaining_ms(b->deadline);
      struct pollfd cancel = {.fd = b->cancel_fd, .events = POLLIN};
      if (left == 0)
        break;
      poll(&cancel, 1, left < RETRY_MS ? left : RETRY_MS);
      if (cancelled(b, err)) {
        ret = err->status;
        goto fail;
      }
    }
    if (embps__remaining_ms(b->deadline) == 0)
      break;
    fd = dial(b, a, last_why, sizeof(last_why), err);
    if (fd == -2) {
      ret = err->status;
      goto fail;
    }
    if (fd < 0)
      continue;
    if (b->tls) {
      char addr[ADDR_MAX];
      embps__peer_link_release(link);
      link = NULL;
      embps_hostport_format(a, addr, sizeof(addr));
      if ((ret = embps__peer_link_start(&link, b->tls, fd, EMBPS__PEER_CONNECTOR, b->rank, peer,
                                        addr, a->host, b->deadline, &fd, err)) != EMBPS_OK) {
        fd = -1; /* closed by the failed start */
        goto fail;
      }
    }
    int verdict = exchange_hello(b, peer, fd, &hello, &msg, last_why, sizeof(last_why), err);
    if (verdict == -2) {
      ret = err->status;
      goto fail;
    }
    if (verdict < 0 && link) {
      /* The relay closed the plaintext end: its reason says more than end-of-file does. */
      char why[sizeof(err->message)];
      int failure = embps__peer_link_failure(link, why, sizeof(why));
      if (failure == 2) {
        ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "rank %u could not join: %s", b->rank,
                              why);
        goto fail;
      }
      if (failure)
        snprintf(last_why, sizeof(last_why), "%.150s", why);
    }
    if (verdict < 0)
      continue;
    if (verdict == 0) {
      ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "rank %u refused rank %u: %s", peer,
                            b->rank, msg);
      goto fail;
    }
    *fd_out = fd;
    fd = -1;
    goto exit;
  }
  ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                        "rank %u could not join rank %u at %s%s%s:%u within %llu ms (%s); missing "
                        "ranks: %u",
                        b->rank, peer, a->ipv6 ? "[" : "", a->host, a->ipv6 ? "]" : "", a->port,
                        (unsigned long long)b->timeout_ms, last_why, peer);
  goto fail;
exit:
  embps__buf_free(&hello);
  embps_free(msg);
  embps__peer_link_release(link);
  return ret;
fail:
  close_fd(&fd);
  goto exit;
}

/* Writes where accepted connection fd comes from ("HOST:PORT") into out. */
static void peer_name(int fd, char *out, size_t cap) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  embps_hostport_t a;
  if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0 ||
      embps_hostport_numeric(&ss, len, &a) != EMBPS_OK ||
      embps_hostport_format(&a, out, cap) != EMBPS_OK)
    snprintf(out, cap, "an unknown address");
}

static void pending_drop(pending_t *pend, size_t *n, size_t i) {
  close_fd(&pend[i].fd);
  embps__peer_link_release(pend[i].link);
  embps_free(pend[i].identity);
  pend[i] = pend[*n - 1];
  (*n)--;
}

enum { READ_MORE = 0, READ_DONE = 1, READ_REFUSE = 2, READ_DROP = -1, READ_NOMEM = -2 };

/* Reads what is available of pending connection p. Returns READ_DONE when its hello is
 * complete, READ_MORE when more is needed, READ_DROP when it must be dropped (closed, error,
 * not an embps peer), READ_REFUSE with why set for a well-formed peer that must be refused
 * before its identity is read, or READ_NOMEM. */
static int pending_read(pending_t *p, char *why, size_t cap) {
  for (;;) {
    uint8_t *dst;
    size_t want;
    if (p->challenged) {
      if (p->auth_have == EMBPS__AUTH_LEN)
        return READ_DONE;
      ssize_t k = recv(p->fd, p->auth + p->auth_have, EMBPS__AUTH_LEN - p->auth_have, 0);
      if (k <= 0)
        return k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) ? READ_MORE
                                                                                    : READ_DROP;
      p->auth_have += (size_t)k;
      continue;
    }
    if (p->have < EMBPS__HELLO_HEADER_LEN) {
      dst = p->header + p->have;
      want = EMBPS__HELLO_HEADER_LEN - p->have;
    } else {
      size_t got = p->have - EMBPS__HELLO_HEADER_LEN;
      if (got == p->hello.identity_len)
        return READ_DONE;
      dst = (uint8_t *)p->identity + got;
      want = p->hello.identity_len - got;
    }
    ssize_t k = recv(p->fd, dst, want, 0);
    if (k == 0)
      return READ_DROP;
    if (k < 0)
      return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK ? READ_MORE : READ_DROP;
    size_t before = p->have;
    p->have += (size_t)k;
    if (!embps__hello_magic_ok(p->header, p->have))
      return READ_DROP;
    if (before < EMBPS__HELLO_HEADER_LEN && p->have == EMBPS__HELLO_HEADER_LEN) {
      embps_error_t e;
      embps_status_t st = embps__hello_decode(p->header, &p->hello, &e);
      if (st != EMBPS_OK) {
        snprintf(why, cap, "%s", e.message);
        return st == EMBPS_FAILED_PRECONDITION ? READ_REFUSE : READ_DROP;
      }
      if (!(p->identity = embps_malloc(p->hello.identity_len + 1)))
        return READ_NOMEM;
      p->identity[p->hello.identity_len] = '\0';
    }
  }
}

/* Refuses pending connection p with why: logged, remembered as the last refusal, told to it. */
static void refuse(boot_t *b, const pending_t *p, const char *why) {
  EMBPS_WARN("rank %u refused a peer: %s", b->rank, why);
  snprintf(b->last_refusal, sizeof(b->last_refusal), "%s", why);
  send_verdict(p->fd, 0, why, b->deadline);
}

/* Takes pending connection p as rank p->hello.rank's connection of its kind, after telling it
 * so (with our proof when it answered a challenge). */
static void admit(boot_t *b, pending_t *p, uint32_t *joined, const uint8_t *proof) {
  embps__io_t io;
  if (proof) {
    uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + EMBPS__PROOF_LEN];
    embps__buf_t v = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
    embps__verdict_encode_bytes(&v, EMBPS__VERDICT_ACCEPTED, proof, EMBPS__PROOF_LEN);
    io = embps__send_all(p->fd, v.data, v.len, b->deadline);
  } else {
    io = send_verdict(p->fd, 1, "", b->deadline);
  }
  if (io != EMBPS__IO_OK)
    return;
  int *slot = p->hello.kind == EMBPS_GROUP_CONN_CONTROL ? &b->control_fds[p->hello.rank]
                                                        : &b->data_fds[p->hello.rank];
  *slot = p->fd;
  p->fd = -1;
  (*joined)++;
  EMBPS_DEBUG("rank %u: rank %u joined (%s)", b->rank, p->hello.rank, kind_name(p->hello.kind));
}

/* Sends our challenge to pending connection p, whose hello was judged good. Returns 1 when it
 * went out (p waits for the answer), 0 when p must be dropped, -1 with err set on failure. */
static int challenge(boot_t *b, pending_t *p, embps_error_t *err) {
  uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + EMBPS__NONCE_LEN];
  embps__buf_t v = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
  if (embps__secret_nonce(p->nonce, err) != EMBPS_OK)
    return -1;
  embps__verdict_encode_bytes(&v, EMBPS__VERDICT_CHALLENGE, p->nonce, EMBPS__NONCE_LEN);
  if (embps__send_all(p->fd, v.data, v.len, b->deadline) != EMBPS__IO_OK)
    return 0;
  p->challenged = 1;
  return 1;
}

/* Checks pending connection p's answer to our challenge: 0 and our own proof (out) when it
 * holds the secret, else 1 with why set. */
static int check_answer(const boot_t *b, const pending_t *p, uint8_t *out, char *why, size_t cap,
                        embps_error_t *err) {
  uint8_t nonce_c[EMBPS__NONCE_LEN], proof[EMBPS__PROOF_LEN];
  embps__transcript_t t = {p->header, p->identity, p->hello.identity_len,
                           b->rank,   p->nonce,    nonce_c};
  embps__auth_decode(p->auth, nonce_c, proof);
  if (!embps__secret_verify(b->secret, b->secret_len, EMBPS__PROOF_CONNECTOR, &t, proof)) {
    snprintf(why, cap,
             "rank %u at %s failed the group secret check: its answer does not prove it holds "
             "this group's secret (a different --group-secret-file, or not a rank of this group)",
             p->hello.rank, p->addr);
    return 1;
  }
  if (embps__secret_proof(b->secret, b->secret_len, EMBPS__PROOF_ACCEPTOR, &t, out, err) !=
      EMBPS_OK) {
    snprintf(why, cap, "%s", err->message);
    return 1;
  }
  return 0;
}

/* With peer TLS: whether pending connection p's certificate fails to name the host of the rank
 * its hello claims (then why says so). The connector checked ours before sending the hello. */
static int wrong_name(const boot_t *b, const pending_t *p, char *why, size_t cap) {
  char detail[sizeof(((embps_error_t *)0)->message)];
  if (!embps__peer_link_check_name(p->link, b->addrs[p->hello.rank].host, detail, sizeof(detail)))
    return 0;
  snprintf(why, cap, "rank %u at %s: %.380s", p->hello.rank, p->addr, detail);
  return 1;
}

/* Handles what poll says about pending connection i; returns EMBPS_OK unless out of memory. */
static embps_status_t serve_pending(boot_t *b, pending_t *pend, size_t *npend, size_t i,
                                    uint32_t *joined, embps_error_t *err) {
  pending_t *p = &pend[i];
  char why[sizeof(((embps_error_t *)0)->message)];
  uint8_t proof[EMBPS__PROOF_LEN];
  int rc = pending_read(p, why, sizeof(why));
  if (rc == READ_MORE)
    return EMBPS_OK;
  if (rc == READ_NOMEM)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for a %u-byte configuration", p->hello.identity_len);
  if (rc == READ_DROP && p->challenged) {
    /* Whoever cannot answer the challenge (a rank without the secret, or something that only
     * speaks the hello) gives up here. */
    snprintf(why, sizeof(why),
             "rank %u at %s failed the group secret check: it closed the connection instead of "
             "answering the challenge (is it started without --group-secret-file?)",
             p->hello.rank, p->addr);
    EMBPS_WARN("rank %u refused a peer: %s", b->rank, why);
    snprintf(b->last_refusal, sizeof(b->last_refusal), "%s", why);
  } else if (rc == READ_DROP && p->link && embps__peer_link_failure(p->link, why, sizeof(why))) {
    /* Its relay said why (and logged it): a refused certificate, a cleartext rank. */
    snprintf(b->last_refusal, sizeof(b->last_refusal), "%s", why);
  } else if (rc == READ_DROP && !b->tls && p->have > 0 && p->header[0] == TLS_HANDSHAKE_BYTE) {
    snprintf(why, sizeof(why),
             "a peer at %s opened a TLS connection, but rank %u is started without peer TLS: "
             "start every rank with the same --peer-tls-cert, --peer-tls-key and --peer-tls-ca, "
             "or none",
             p->addr, b->rank);
    /* Its ClientHello is read out first: closing on unread bytes would send a reset that may
     * overtake the answer. In cleartext, the answer makes its TLS client fail at once. */
    while (recv(p->fd, p->auth, sizeof(p->auth), MSG_DONTWAIT) > 0) {
    }
    refuse(b, p, why);
  } else if (rc == READ_DROP) {
    if (!embps__hello_magic_ok(p->header, p->have) || p->have < EMBPS__HELLO_MAGIC_LEN)
      EMBPS_DEBUG("rank %u: ignored a connection that is not an embps peer", b->rank);
  } else if (rc == READ_REFUSE) {
    refuse(b, p, why);
  } else if (embps__judge_hello(b->rank, b->size, b->identity, &p->hello, p->identity,
                                b->control_fds, b->data_fds, why, sizeof(why))) {
    /* Judged again after the answer: another connection may have taken the rank meanwhile. */
    refuse(b, p, why);
  } else if (p->link && !p->challenged && wrong_name(b, p, why, sizeof(why))) {
    refuse(b, p, why);
  } else if (!b->secret_len) {
    admit(b, p, joined, NULL);
  } else if (!p->challenged) {
    int sent = challenge(b, p, err);
    if (sent < 0)
      return err->status;
    if (sent)
      return EMBPS_OK; /* keep it: its answer comes next */
  } else if (check_answer(b, p, proof, why, sizeof(why), err)) {
    refuse(b, p, why);
  } else {
    admit(b, p, joined, proof);
  }
  pending_drop(pend, npend, i);
  return EMBPS_OK;
}

/* Accepts every higher rank's two connections. */
static embps_status_t accept_peers(boot_t *b, int listen_fd, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  pending_t *pend = NULL;
  struct pollfd *pfds = NULL;
  size_t npend = 0;
  uint32_t expected = 2 * (b->size - 1 - b->rank), joined = 0;

  if (expected == 0)
    return EMBPS_OK;
  pend = embps_calloc(MAX_PENDING, sizeof(*pend));
  pfds = embps_calloc(MAX_PENDING + 2, sizeof(*pfds)); /* + the listener, + cancel_fd */
  if (!pend || !pfds) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for pending connections");
    goto fail;
  }
  while (joined < expected) {
    int left = embps__remaining_ms(b->deadline);
    if (left == 0)
      break;
    pfds[0] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
    for (size_t i = 0; i < npend; i++)
      pfds[i + 1] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
    size_t npoll = npend + 1;
    pfds[npoll] = (struct pollfd){.fd = b->cancel_fd, .events = POLLIN};
    int prc = poll(pfds, npoll + 1, left);
    if (cancelled(b, err)) {
      ret = err->status;
      goto fail;
    }
    if (prc < 0 && errno != EINTR) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "poll: %s", strerror(errno));
      goto fail;
    }
    if (prc <= 0)
      continue;
    /* Pending connections first, from the end, so dropping one does not skip another. */
    for (size_t i = npoll - 1; i >= 1; i--)
      if (pfds[i].revents &&
          (ret = serve_pending(b, pend, &npend, i - 1, &joined, err)) != EMBPS_OK)
        goto fail;
    if (pfds[0].revents) {
      for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
          break; /* EAGAIN, or a connection reset before we took it */
        if (set_nodelay(fd) != 0) {
          close(fd);
          continue;
        }
        if (npend == MAX_PENDING)
          pending_drop(pend, &npend, 0); /* the oldest idle one makes room */
        pending_t *p = &pend[npend];
        memset(p, 0, sizeof(*p));
        peer_name(fd, p->addr, sizeof(p->addr));
        if (b->tls) {
          embps_error_t lerr;
          if (embps__peer_link_start(&p->link, b->tls, fd, EMBPS__PEER_ACCEPTOR, b->rank,
                                     EMBPS__PEER_UNKNOWN, p->addr, NULL, b->deadline, &fd,
                                     &lerr) != EMBPS_OK) {
            EMBPS_WARN("rank %u: %s", b->rank, lerr.message); /* fd is closed */
            continue;
          }
        }
        p->fd = fd;
        npend++;
      }
    }
  }
  if (joined < expected) {
    char missing[256];
    list_missing(b, b->rank + 1, b->size, missing, sizeof(missing));
    if (b->last_refusal[0])
      ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s (missing ranks: %s)",
                            b->last_refusal, missing);
    else
      ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                            "not every rank joined rank %u within %llu ms; missing ranks: %s",
                            b->rank, (unsigned long long)b->timeout_ms, missing);
    goto fail;
  }
exit:
  while (npend > 0)
    pending_drop(pend, &npend, npend - 1);
  embps_free(pend);
  embps_free(pfds);
  return ret;
fail:
  goto exit;
}

/* Sends the READY byte to every peer and waits for one from each. */
static embps_status_t ready_exchange(boot_t *b, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  struct pollfd *pfds = NULL;
  uint32_t *ranks = NULL;
  uint32_t n = 0, waiting;
  const uint8_t ready = EMBPS__READY_BYTE;

  pfds = embps_calloc(b->size + 1, sizeof(*pfds)); /* + cancel_fd */
  ranks = embps_calloc(b->size, sizeof(*ranks));
  if (!pfds || !ranks) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for the ready exchange");
    goto fail;
  }
  for (uint32_t r = 0; r < b->size; r++) {
    if (r == b->rank)
      continue;
    if (embps__send_all(b->control_fds[r], &ready, 1, b->deadline) != EMBPS__IO_OK) {
      ret =
          embps_error_set(err, EMBPS_UNAVAILABLE, "rank %u could not tell rank %u it is ready: %s",
                          b->rank, r, strerror(errno));
      goto fail;
    }
    pfds[n] = (struct pollfd){.fd = b->control_fds[r], .events = POLLIN};
    ranks[n++] = r;
  }
  waiting = n;
  while (waiting > 0) {
    int left = embps__remaining_ms(b->deadline);
    if (left == 0) {
      char missing[256];
      size_t len = 0;
      missing[0] = '\0';
      for (uint32_t i = 0; i < n && len + 16 < sizeof(missing); i++)
        if (pfds[i].fd >= 0)
          len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%u", len ? ", " : "",
                                  ranks[i]);
      ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                            "rank %u: the group was not ready within %llu ms; missing ranks: %s",
                            b->rank, (unsigned long long)b->timeout_ms, missing);
      goto fail;
    }
    pfds[n] = (struct pollfd){.fd = b->cancel_fd, .events = POLLIN};
    int prc = poll(pfds, n + 1, left);
    if (prc < 0 && errno != EINTR) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "poll: %s", strerror(errno));
      goto fail;
    }
    if (cancelled(b, err)) {
      ret = err->status;
      goto fail;
    }
    for (uint32_t i = 0; prc > 0 && i < n; i++) {
      if (pfds[i].fd < 0 || !pfds[i].revents)
        continue;
      uint8_t byte;
      ssize_t k = recv(pfds[i].fd, &byte, 1, 0);
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        continue;
      if (k != 1 || byte != EMBPS__READY_BYTE) {
        ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                              "rank %u dropped its connection to rank %u before the group was "
                              "ready (it failed its own bootstrap?)",
                              ranks[i], b->rank);
        goto fail;
      }
      pfds[i].fd = -1; /* poll ignores negative descriptors */
      waiting--;
    }
  }
exit:
  embps_free(pfds);
  embps_free(ranks);
  return ret;
fail:
  goto exit;
}

embps_status_t embps_group_bootstrap(uint32_t rank, uint32_t size, const char *const *peer_addrs,
                                     int bind_any, const char *identity, const uint8_t *secret,
                                     size_t secret_len, embps_group_peer_tls_t *tls,
                                     uint64_t timeout_ms, int cancel_fd, int *control_fds,
                                     int *data_fds, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_error_t local_err;
  boot_t b;
  int listen_fd = -1;

  if (!err)
    err = &local_err; /* the failure is still logged */
  /* Validation, before anything is opened. */
  if (size == 0 || rank >= size || !peer_addrs || !identity || !control_fds || !data_fds ||
      (secret_len && !secret))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "bootstrap needs rank < size and non-NULL addresses, identity, secret "
                           "and descriptor arrays (rank %u, size %u)",
                           rank, size);
  for (uint32_t r = 0; r < size; r++)
    control_fds[r] = data_fds[r] = -1;
  memset(&b, 0, sizeof(b));
  b.identity_len = strlen(identity);
  if (b.identity_len >= EMBPS__MAX_IDENTITY_LEN)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "the configuration identity is %zu bytes, more than the %u allowed",
                           b.identity_len, EMBPS__MAX_IDENTITY_LEN);
  if (size == 1)
    return EMBPS_OK;
  b.addrs = embps_calloc(size, sizeof(*b.addrs));
  if (!b.addrs)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for %u peer addresses",
                           size);
  for (uint32_t r = 0; r < size; r++) {
    char what[64];
    snprintf(what, sizeof(what), "peer address of rank %u", r);
    ret = embps_hostport_parse(&b.addrs[r], peer_addrs[r],
                               peer_addrs[r] ? strlen(peer_addrs[r]) : 0, what, 0, err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  b.rank = rank;
  b.size = size;
  b.identity = identity;
  b.secret = secret;
  b.secret_len = secret_len;
  b.tls = tls;
  b.timeout_ms = timeout_ms;
  b.deadline = embps_now_ms() + timeout_ms;
  b.control_fds = control_fds;
  b.data_fds = data_fds;
  b.cancel_fd = cancel_fd;

  ret = open_listener(&b, bind_any, &listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  EMBPS_INFO("rank %u of %u: listening for peers on %s, timeout %llu ms", rank, size,
             peer_addrs[rank], (unsigned long long)timeout_ms);
  for (uint32_t r = 0; r < rank; r++) {
    ret = connect_peer(&b, r, EMBPS_GROUP_CONN_CONTROL, &control_fds[r], err);
    if (ret == EMBPS_OK)
      ret = connect_peer(&b, r, EMBPS_GROUP_CONN_DATA, &data_fds[r], err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  ret = accept_peers(&b, listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  /* Nobody joins any more: closing the listener now makes late strays fail fast. */
  close_fd(&listen_fd);
  ret = ready_exchange(&b, err);
  if (ret != EMBPS_OK)
    goto fail;
  for (uint32_t r = 0; r < size; r++) {
    if (r == rank)
      continue;
    if (set_blocking(control_fds[r]) != 0 || set_blocking(data_fds[r]) != 0) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "fcntl: %s", strerror(errno));
      goto fail;
    }
  }
  EMBPS_INFO("rank %u of %u: the group is up", rank, size);
exit:
  close_fd(&listen_fd);
  embps_free(b.addrs);
  return ret;
fail:
  EMBPS_ERROR("rank %u of %u: bootstrap failed: %s", rank, size, err->message);
  for (uint32_t r = 0; r < size; r++) {
    close_fd(&control_fds[r]);
    close_fd(&data_fds[r]);
  }
  goto exit;
}
