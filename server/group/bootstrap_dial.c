/* The bootstrap's outgoing side (bootstrap_internal.h): this rank's control and data connections
 * to every lower rank.
 *
 * A connection is dialled again every RETRY_MS while the peer is not listening yet (connection
 * refused, a name not resolving yet, a connection dropped before its verdict), until the
 * deadline; a name is resolved again on every attempt, so names that appear late (Kubernetes)
 * still work. With peer TLS the connection becomes a TLS relay first (peer_tls.h). Then this
 * rank sends its hello and reads the acceptor's verdict: accepted, refused (the connector fails
 * at once with the acceptor's reason, FAILED_PRECONDITION), or with a group secret a challenge,
 * which it answers with its proof before it checks the acceptor's own proof in the final
 * verdict (secret.c has the cryptography). A rank with a secret that is accepted without a
 * challenge gives up: the acceptor does not hold the secret. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/hostport.h"
#include "server/group/bootstrap.h"
#include "server/group/bootstrap_internal.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/peer_tls.h"
#include "server/group/secret.h"

/* How often a connector retries a peer that is not listening yet. */
#define RETRY_MS 50

/* Opens a TCP connection to a before the deadline. Returns the socket, or -1 with why (cap
 * bytes) saying what went wrong this time (worth retrying), or -2 with err set (not worth it). */
static int dial(const embps__boot_t *b, const embps_hostport_t *a, char *why, size_t cap,
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
  if (fd < 0 || embps__boot_set_nodelay(fd) != 0) {
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
      if (embps__boot_cancelled(b, err)) {
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
static int read_verdict(const embps__boot_t *b, uint32_t peer, int fd, int *verdict, char **msg,
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
static int answer_challenge(const embps__boot_t *b, uint32_t peer, int fd,
                            const embps__buf_t *hello, const uint8_t *nonce_a, char **msg,
                            char *why, size_t cap, embps_error_t *err) {
  uint8_t nonce_c[EMBPS__NONCE_LEN], proof[EMBPS__PROOF_LEN], bytes[EMBPS__AUTH_LEN];
  embps__buf_t out = {bytes, 0, sizeof(bytes)}; /* always fits: nothing is allocated */
  embps__transcript_t t = {hello->data,
                           (const char *)hello->data + EMBPS__HELLO_HEADER_LEN,
                           hello->len - EMBPS__HELLO_HEADER_LEN,
                           peer,
                           nonce_a,
                           nonce_c};
  char addr[EMBPS__BOOT_ADDR_MAX];
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
static int exchange_hello(const embps__boot_t *b, uint32_t peer, int fd, const embps__buf_t *hello,
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
    char addr[EMBPS__BOOT_ADDR_MAX];
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
embps_status_t embps__boot_connect_peer(embps__boot_t *b, uint32_t peer, uint8_t kind, int *fd_out,
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
      embps__boot_close_fd(&fd);
      embps_free(msg);
      msg = NULL;
      int left = embps__remaining_ms(b->deadline);
      struct pollfd cancel = {.fd = b->cancel_fd, .events = POLLIN};
      if (left == 0)
        break;
      poll(&cancel, 1, left < RETRY_MS ? left : RETRY_MS);
      if (embps__boot_cancelled(b, err)) {
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
      char addr[EMBPS__BOOT_ADDR_MAX];
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
  embps__boot_close_fd(&fd);
  goto exit;
}
