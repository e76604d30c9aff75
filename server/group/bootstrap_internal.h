/* The bootstrap's state as its three files see it, internal to the group layer: bootstrap.c
 * (the whole run: validation, the listener, the connects, the accepts, the READY exchange),
 * bootstrap_dial.c (this rank's connections to the lower ranks) and bootstrap_accept.c (the
 * higher ranks' connections to this one). */
#ifndef EMBPS_GROUP_BOOTSTRAP_INTERNAL_H
#define EMBPS_GROUP_BOOTSTRAP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/hostport.h"
#include "common/status.h"
#include "server/group/group.h"

/* Room for "HOST:PORT" ("[v6]:PORT"). */
#define EMBPS__BOOT_ADDR_MAX (EMBPS_HOSTPORT_HOST_MAX + 16)

/* One bootstrap in progress: its arguments, its deadline and what it has joined so far. */
typedef struct embps__boot {
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
} embps__boot_t;

/* ---- bootstrap.c ----------------------------------------------------------------------------- */

/** Whether the server asked the bootstrap to stop (b->cancel_fd is readable); sets err
 * (EMBPS_CANCELLED) when it did. */
int embps__boot_cancelled(const embps__boot_t *b, embps_error_t *err);

/** Sets TCP_NODELAY on fd; 0, or -1 with errno set. */
int embps__boot_set_nodelay(int fd);

/** Closes *fd when it is open and sets it to -1. */
void embps__boot_close_fd(int *fd);

/* ---- bootstrap_dial.c ------------------------------------------------------------------------ */

/** Connects to lower rank `peer` for connection kind `kind` (EMBPS_GROUP_CONN_*), retrying
 * while it is not listening yet, until the deadline. On EMBPS_OK *fd_out is the connection the
 * peer accepted (non-blocking; with peer TLS the plaintext end of its relay). Otherwise err says
 * why: FAILED_PRECONDITION (refused, the group secret check, TLS), DEADLINE_EXCEEDED,
 * CANCELLED, RESOURCE_EXHAUSTED or INTERNAL. */
embps_status_t embps__boot_connect_peer(embps__boot_t *b, uint32_t peer, uint8_t kind, int *fd_out,
                                        embps_error_t *err);

/* ---- bootstrap_accept.c ---------------------------------------------------------------------- */

/** Opens this rank's non-blocking peer listener on its peer address (or, with bind_any, the
 * wildcard address of that address's family) into *fd_out. Returns EMBPS_OK, UNAVAILABLE (the
 * address cannot be resolved or bound) or INTERNAL; err says why. */
embps_status_t embps__boot_open_listener(const embps__boot_t *b, int bind_any, int *fd_out,
                                         embps_error_t *err);

/** Accepts both connections of every higher rank on listen_fd, judging each hello (and, with a
 * group secret, its answer to a challenge) and refusing what does not match, until all are in
 * b->control_fds and b->data_fds or the deadline passes. Returns EMBPS_OK; FAILED_PRECONDITION
 * with the last refusal, or DEADLINE_EXCEEDED, naming the missing ranks; CANCELLED;
 * RESOURCE_EXHAUSTED; INTERNAL. */
embps_status_t embps__boot_accept_peers(embps__boot_t *b, int listen_fd, embps_error_t *err);

#endif
