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
 * This is the socket side only: addresses are common/hostport's, bytes control.c's and
 * decisions agreement.c's. This file runs the whole (validation, the listener, the connects,
 * the accepts, the READY exchange); bootstrap_dial.c makes this rank's connections to the lower
 * ranks and bootstrap_accept.c takes the higher ranks' ones. Everything runs on non-blocking
 * sockets with one deadline; the sockets handed back are made blocking again. The module runs
 * before any event loop exists, so it uses plain poll() rather than libuv. */
#include "server/group/bootstrap.h"

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
#include "server/group/bootstrap_internal.h"
#include "server/group/control.h"
#include "server/group/control_io.h"

/* Whether the server asked the bootstrap to stop (its cancel descriptor is readable); sets err
 * when it did. Every wait of the bootstrap also polls the descriptor, so a SIGTERM during bootstrap
 * is seen at once rather than when the bootstrap timeout passes. */
int embps__boot_cancelled(const embps__boot_t *b, embps_error_t *err) {
  struct pollfd pfd = {.fd = b->cancel_fd, .events = POLLIN};
  if (b->cancel_fd < 0 || poll(&pfd, 1, 0) <= 0)
    return 0;
  embps_error_set(err, EMBPS_CANCELLED,
                  "rank %u stopped waiting for the group: the server is shutting down", b->rank);
  return 1;
}

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

int embps__boot_set_nodelay(int fd) {
  int one = 1;
  return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static int set_blocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0)
    return -1;
  return fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

void embps__boot_close_fd(int *fd) {
  if (*fd >= 0) {
    close(*fd);
    *fd = -1;
  }
}

/* Sends the READY byte to every peer and waits for one from each. */
static embps_status_t ready_exchange(embps__boot_t *b, embps_error_t *err) {
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
    if (embps__boot_cancelled(b, err)) {
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
  embps__boot_t b;
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

  ret = embps__boot_open_listener(&b, bind_any, &listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  EMBPS_INFO("rank %u of %u: listening for peers on %s, timeout %llu ms", rank, size,
             peer_addrs[rank], (unsigned long long)timeout_ms);
  for (uint32_t r = 0; r < rank; r++) {
    ret = embps__boot_connect_peer(&b, r, EMBPS_GROUP_CONN_CONTROL, &control_fds[r], err);
    if (ret == EMBPS_OK)
      ret = embps__boot_connect_peer(&b, r, EMBPS_GROUP_CONN_DATA, &data_fds[r], err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  ret = embps__boot_accept_peers(&b, listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  /* Nobody joins any more: closing the listener now makes late strays fail fast. */
  embps__boot_close_fd(&listen_fd);
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
  embps__boot_close_fd(&listen_fd);
  embps_free(b.addrs);
  return ret;
fail:
  EMBPS_ERROR("rank %u of %u: bootstrap failed: %s", rank, size, err->message);
  for (uint32_t r = 0; r < size; r++) {
    embps__boot_close_fd(&control_fds[r]);
    embps__boot_close_fd(&data_fds[r]);
  }
  goto exit;
}
