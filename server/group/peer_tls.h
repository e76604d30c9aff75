/* TLS between the ranks of a group (internal to the group layer; group.h has the context's
 * constructor). A peer connection's TLS runs in a relay thread of its own that ends the TLS
 * session on the TCP socket and hands the caller the other end of a socketpair, which carries
 * the plaintext: bootstrap, the control links and the TCP communicator keep driving plain
 * descriptors with poll(), unchanged (peer_tls.c says why). */
#ifndef EMBPS_GROUP_PEER_TLS_H
#define EMBPS_GROUP_PEER_TLS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/group.h"

/** embps__peer_link_start's peer_rank when the rank is not known yet. */
#define EMBPS__PEER_UNKNOWN UINT32_MAX

/** One relayed peer connection. */
typedef struct embps__peer_link embps__peer_link_t;

/** Which end of the TLS session this rank is: the connector is the TLS client. */
typedef enum embps__peer_role {
  EMBPS__PEER_CONNECTOR = 0,
  EMBPS__PEER_ACCEPTOR = 1,
} embps__peer_role_t;

/**
 * Starts the TLS relay of connected TCP socket tcp_fd (owned from now on, whatever happens).
 * The relay thread does the handshake before the deadline (embps_now_ms()'s clock), then
 * moves bytes both ways until either end closes. A connector verifies that the acceptor's
 * certificate chains to the group's CA and names peer_host (the host of that rank's configured
 * peer address: a DNS name or an IP address); an acceptor verifies the chain only, and
 * bootstrap checks the name once the hello says which rank connected
 * (embps__peer_link_check_name). Messages call the peer "rank R at HOST:PORT" (peer_rank, or
 * EMBPS__PEER_UNKNOWN for an acceptor, which learns the rank from the hello: "a peer at
 * HOST:PORT"); peer_addr and peer_host are copied.
 *
 * An acceptor that finds an embps hello in cleartext instead of a TLS handshake refuses it with
 * a cleartext verdict that says why, so a rank started without peer TLS fails at once.
 *
 * On EMBPS_OK *out is the caller's reference (embps__peer_link_release) and *app_fd the
 * plaintext end, non-blocking and close-on-exec, owned by the caller: closing it (or shutdown)
 * ends the TLS session. Returns EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED or EMBPS_INTERNAL (no
 * socketpair or thread); on failure tcp_fd is closed and *out, *app_fd are untouched.
 */
embps_status_t embps__peer_link_start(embps__peer_link_t **out, embps_group_peer_tls_t *tls,
                                      int tcp_fd, embps__peer_role_t role, uint32_t self_rank,
                                      uint32_t peer_rank, const char *peer_addr,
                                      const char *peer_host, uint64_t deadline, int *app_fd,
                                      embps_error_t *err);

/**
 * Why the TLS session failed, into why (cap bytes): 0 while it has not (why is then ""); 1
 * when it failed but a new connection may succeed (the peer closed during the handshake);
 * 2 when retrying cannot help (a certificate refused either way, a peer that answers in
 * cleartext or refused this rank's cleartext hello). The reason is recorded before the relay
 * closes the plaintext end, so a caller that reads end-of-file there finds it.
 */
int embps__peer_link_failure(embps__peer_link_t *l, char *why, size_t cap);

/**
 * Acceptor: whether the certificate the peer presented names host (as
 * embps__peer_link_start's peer_host). Returns 0, or 1 with why set.
 */
int embps__peer_link_check_name(embps__peer_link_t *l, const char *host, char *why, size_t cap);

/** Drops the caller's reference; the relay runs on until its connection ends. NULL: no-op. */
void embps__peer_link_release(embps__peer_link_t *l);

#endif
