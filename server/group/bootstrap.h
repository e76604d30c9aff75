/* The shard group's bootstrap: how the N server processes of a group find each other over TCP
 * and agree on their configuration before serving (DESIGN.md, "The shard group"). */
#ifndef EMBPS_GROUP_BOOTSTRAP_H
#define EMBPS_GROUP_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/group.h"

/** Connection kinds: every pair of ranks shares one connection of each kind. */
#define EMBPS_GROUP_CONN_CONTROL 0
#define EMBPS_GROUP_CONN_DATA 1

/** Connects rank `rank` of a group of `size` ranks to every other rank, and returns only once
 * every rank of the group has done the same.
 *
 * peer_addrs[r] (size entries, borrowed) is "host:port" of rank r's *peer* listener, the host an
 * IPv4 dotted address, "localhost" (taken as 127.0.0.1), "[v6]" or a DNS name (resolved again on
 * every connection attempt, so names that appear late, as in Kubernetes, still work). This
 * rank listens on peer_addrs[rank], binding that host, or the wildcard address of its family
 * when `bind_any` is non-zero. identity (borrowed, NUL-terminated, under 64 KiB) is this
 * rank's configuration as "key=value\n" lines (e.g. "mesh=shard=4\ntable_axis=shard\n..."):
 * every rank must present the same keys with the same values, in any order.
 *
 * secret (secret_len bytes, borrowed; NULL and 0 for none) is the group secret. With one, every
 * connection this rank accepts or makes is authenticated both ways by challenge-response
 * (control.h, secret.h) before it counts, and a peer that cannot prove the secret is refused;
 * without one, any process that reaches the peer port and presents the same identity joins.
 *
 * tls (borrowed; NULL for none) puts every connection under TLS from its first byte, hello
 * included (peer_tls.h): certificates are checked both ways, and each side checks that the
 * other's certificate names the host of that rank's peer address. The descriptors handed back
 * are then the plaintext ends of the TLS relays (AF_UNIX stream sockets, not TCP ones). A rank
 * with TLS facing one without (either way round) fails FAILED_PRECONDITION at once on the
 * connecting side, naming the peer; the accepting side logs it and fails with it when the
 * deadline passes, as for any refusal. So does a certificate that is refused.
 *
 * For every other rank two connections are made, a control one and a data one. On EMBPS_OK,
 * control_fds[r] and data_fds[r] (arrays of `size`, caller-allocated) are connected, blocking,
 * close-on-exec TCP sockets with TCP_NODELAY for r != rank, and -1 for r == rank; the caller
 * owns them and closes them. Nothing has been sent on them beyond the bootstrap. On any
 * failure every entry is -1 and nothing stays open. A group of one returns at once, without
 * sockets. The listener is closed before returning. All waits end by timeout_ms, counted
 * from the call.
 *
 * Returns
 * - EMBPS_OK: the whole group is connected.
 * - EMBPS_INVALID_ARGUMENT: rank >= size, a NULL argument, an address that does not parse or an
 *   identity that is too long.
 * - EMBPS_UNAVAILABLE: the listen address cannot be bound (err says why), or a peer dropped
 *   its connections before the group was ready (it failed its own bootstrap).
 * - EMBPS_FAILED_PRECONDITION: a peer failed the group secret check, "rank 1 at HOST:PORT failed
 *   the group secret check: ..." (the acceptor names where the connection came from, the
 *   connector the peer address it dialled; either side may be the one without the secret, or
 *   with another), or a peer's group size or configuration differs, or two processes
 *   claim one rank; err names the key and both values, e.g. "rank 1's configuration differs
 *   from rank 0's: mesh is 'shard=2' there and 'shard=4' here" (from the accepting rank's
 *   point of view: "there" is the connecting rank). A refused rank fails at once; the rank
 *   that refused it keeps waiting for a matching peer and fails with this message only when
 *   the deadline passes.
 * - EMBPS_DEADLINE_EXCEEDED: not every rank joined within timeout_ms; err names the missing
 *   ranks.
 * - EMBPS_CANCELLED: cancel_fd (a descriptor the caller makes readable to stop the wait, as on
 *   SIGTERM; -1 for none) became readable; every connection made so far is closed.
 * - EMBPS_RESOURCE_EXHAUSTED: out of memory.
 * - EMBPS_INTERNAL: a socket call failed unexpectedly (out of descriptors, say). */
embps_status_t embps_group_bootstrap(uint32_t rank, uint32_t size, const char *const *peer_addrs,
                                     int bind_any, const char *identity, const uint8_t *secret,
                                     size_t secret_len, embps_group_peer_tls_t *tls,
                                     uint64_t timeout_ms, int cancel_fd, int *control_fds,
                                     int *data_fds, embps_error_t *err);

#endif
