/* What the ranks of a group must agree on before serving, and the comparisons that decide it:
 * the configuration identity every rank presents at bootstrap (version, mesh, axes, peer
 * list), the hello an acceptor judges, and the CUDA devices ranks claim. Pure functions over
 * values, no I/O; the messages are the ones users see when a group refuses to form. Internal
 * to the group layer (embps__ prefix). */
#ifndef EMBPS_GROUP_AGREEMENT_H
#define EMBPS_GROUP_AGREEMENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/control.h"

/**
 * Compares the identity of rank there_rank with this rank's (here, here_rank): the same keys
 * with the same values, in any order, blank lines ignored; for a key given twice the first
 * line counts. Returns 0 when they agree, else 1 with the first difference in why (cap bytes),
 * e.g. "rank 1's configuration differs from rank 0's: mesh is 'shard=2' there and 'shard=4'
 * here" (values clipped so the sentence fits an embps_error_t).
 */
int embps__identity_differs(const char *here, uint32_t here_rank, const char *there,
                            uint32_t there_rank, char *why, size_t cap);

/**
 * The acceptor's decision on a complete hello h whose identity is `identity` (NUL-terminated),
 * from the connection that comes from addr ("HOST:PORT", for the message): rank `rank` of
 * `size`, holding control_fds/data_fds (size entries, -1 where not connected). Checks, in this
 * order, the group size, the connection kind, that the sender is a higher rank not yet
 * connected for that kind, and the identity. Returns 0 to accept, or 1 with why (cap bytes)
 * saying, from the acceptor's point of view, what differs. When one rank has a group secret
 * and the other none (the identity's group_secret key), why is the README's sentence for it:
 * "rank 1 at HOST:PORT failed the group secret check: it has no group secret and rank 0 has
 * one (group_secret is 'none' there and 'hmac-sha256' here); ...".
 */
int embps__judge_hello(uint32_t rank, uint32_t size, const char *here_identity,
                       const embps__hello_t *h, const char *identity, const char *addr,
                       const int *control_fds, const int *data_fds, char *why, size_t cap);

/**
 * Looks for two ranks among claims[0..n) (claims[r] is rank r's) that claim one device: the
 * same host and PCI bus id. Returns 0 when every claim is distinct, else 1 with why (cap bytes)
 * naming the first such pair, the device and the host, and the remedy.
 */
int embps__claims_conflict(const embps__device_claim_t *claims, uint32_t n, char *why, size_t cap);

#endif
