/* The bootstrap's incoming side (bootstrap_internal.h): this rank's peer listener and the control
 * and data connections of every higher rank.
 *
 * Accepted connections are read concurrently through one poll(), so an idle one cannot stall the
 * rest, and at most MAX_PENDING wait at once (the oldest makes room). Each must open with the
 * hello's magic; anything else (a port scanner, a gRPC client pointed at the peer port) is
 * closed and ignored, except a TLS ClientHello reaching a rank without peer TLS, which is
 * answered with a refusal that says so. A complete hello is judged (agreement.h: group size,
 * kind, rank, the identity key by key); a refusal names what differs, is told to the peer and
 * logged, and is remembered: this rank keeps waiting for a matching peer (the refused one may
 * be restarted with the right configuration) and fails with the last refusal, rather than a bare
 * timeout, if the deadline passes. With a group secret a good hello is answered with a
 * challenge, and the connection joins only once its answer proves the secret; this rank then
 * proves it in turn. A connection waiting to answer is just another pending one. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/hostport.h"
#include "common/log.h"
#include "server/group/agreement.h"
#include "server/group/bootstrap.h"
#include "server/group/bootstrap_internal.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/peer_tls.h"
#include "server/group/secret.h"

/* The first byte of a TLS handshake record: what a rank with peer TLS sends first. */
#define TLS_HANDSHAKE_BYTE 0x16
/* Accepted connections still reading their hello; beyond this the oldest is dropped, so a
 * flood of idle connections cannot lock the real peers out. */
#define MAX_PENDING 64

/* An accepted connection still reading its hello, or with a group secret, its answer to our
 * challenge. */
typedef struct pending {
  int fd;
  char addr[EMBPS__BOOT_ADDR_MAX]; /* where it comes from, "HOST:PORT", for the log */
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

/* Sends a verdict; best effort (a refused peer that already left changes nothing). */
static embps__io_t send_verdict(int fd, int accept, const char *msg, uint64_t deadline) {
  uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + EMBPS__VERDICT_MESSAGE_MAX];
  embps__buf_t b = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
  embps__verdict_encode(&b, accept, msg);
  return embps__send_all(fd, b.data, b.len, deadline);
}

/* Appends " r" for every rank in [lo, hi) missing a connection in either array. */
static void list_missing(const embps__boot_t *b, uint32_t lo, uint32_t hi, char *out, size_t cap) {
  size_t n = 0;
  out[0] = '\0';
  for (uint32_t r = lo; r < hi && n + 16 < cap; r++) {
    if (r == b->rank || (b->control_fds[r] >= 0 && b->data_fds[r] >= 0))
      continue;
    n += (size_t)snprintf(out + n, cap - n, "%s%u", n ? ", " : "", r);
  }
}
static const char *kind_name(unsigned kind) { return kind == 0 ? "control" : "data"; }

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

embps_status_t embps__boot_open_listener(const embps__boot_t *b, int bind_any, int *fd_out,
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
  embps__boot_close_fd(&fd);
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
  embps__boot_close_fd(&pend[i].fd);
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
static void refuse(embps__boot_t *b, const pending_t *p, const char *why) {
  EMBPS_WARN("rank %u refused a peer: %s", b->rank, why);
  snprintf(b->last_refusal, sizeof(b->last_refusal), "%s", why);
  send_verdict(p->fd, 0, why, b->deadline);
}

/* Takes pending connection p as rank p->hello.rank's connection of its kind, after telling it
 * so (with our proof when it answered a challenge). */
static void admit(embps__boot_t *b, pending_t *p, uint32_t *joined, const uint8_t *proof) {
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
static int challenge(embps__boot_t *b, pending_t *p, embps_error_t *err) {
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
static int check_answer(const embps__boot_t *b, const pending_t *p, uint8_t *out, char *why,
                        size_t cap, embps_error_t *err) {
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
static int wrong_name(const embps__boot_t *b, const pending_t *p, char *why, size_t cap) {
  char detail[sizeof(((embps_error_t *)0)->message)];
  if (!embps__peer_link_check_name(p->link, b->addrs[p->hello.rank].host, detail, sizeof(detail)))
    return 0;
  snprintf(why, cap, "rank %u at %s: %.380s", p->hello.rank, p->addr, detail);
  return 1;
}

/* Handles what poll says about pending connection i; returns EMBPS_OK unless out of memory. */
static embps_status_t serve_pending(embps__boot_t *b, pending_t *pend, size_t *npend, size_t i,
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
  } else if (embps__judge_hello(b->rank, b->size, b->identity, &p->hello, p->identity, p->addr,
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
embps_status_t embps__boot_accept_peers(embps__boot_t *b, int listen_fd, embps_error_t *err) {
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
    if (embps__boot_cancelled(b, err)) {
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
        if (embps__boot_set_nodelay(fd) != 0) {
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
