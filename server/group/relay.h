/* Control relays (docs/design.md, "The leader's limit"): which control connections a rank keeps,
 * and what a relay does with the frames it carries. Internal to the group layer.
 *
 * With a fanout K of 2 or more, the followers 1..N-1 are split, in rank order, into groups of K;
 * each group's lowest rank is its relay, and the others are its members. A member's control
 * connection goes to its relay only, a relay's to the leader, and the leader keeps one to each
 * relay (and to a relay with no members: a direct rank). Upward, a relay sends the leader its
 * members' frames wrapped in RELAY frames naming their origin, after and between its own, in one
 * write per wake-up; the leader handles each as if its origin had sent it. Downward, a frame the
 * leader sends a relay unwrapped is for every rank of the group (ROUND, BROKEN, LEAVING): the
 * relay passes it to its members before it acts on it itself; a frame for one rank travels
 * wrapped in RELAY naming it, and the relay passes on only what it carries. Frames between one
 * rank and the leader so keep their order both ways. With K 0 or 1 every follower talks to the
 * leader directly, as the leader's star did before relays. */
#ifndef EMBPS_GROUP_RELAY_H
#define EMBPS_GROUP_RELAY_H

#include <stdint.h>

#include "common/status.h"

/** The automatic fanout for a group of n ranks: embps_round_control_fanout_auto's (round_cost.h,
 * which `embps plan` reads too): 0 (a direct star) below 16 ranks, else ceil(sqrt(n)). */
uint32_t embps__relay_fanout_auto(uint32_t n);

/** The rank that rank r of n sends its control frames to with fanout k: 0 for a follower that
 * talks to the leader (a relay, or every follower when k < 2), its relay for a member; 0 for the
 * leader itself (it has none). */
uint32_t embps__relay_up(uint32_t n, uint32_t k, uint32_t r);

/** How many members rank r of n relays for with fanout k (0: none, and always for the leader and
 * for members); *first (may be NULL) is set to the lowest of them, which run consecutively. */
uint32_t embps__relay_members(uint32_t n, uint32_t k, uint32_t r, uint32_t *first);

/** 1 when rank r keeps its control connection to rank peer (r != peer) after formation with
 * fanout k: peer is the rank r sends to, or one that sends to r; else 0. */
int embps__relay_keeps(uint32_t n, uint32_t k, uint32_t r, uint32_t peer);

#endif
