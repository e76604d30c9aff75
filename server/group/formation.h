/* Group formation: everything between "a rank starts" and "its communicator is ready". The
 * ranks meet (bootstrap.h), the CUDA backend's ranks claim their devices and the leader checks
 * the claims, the leader hands out NCCL's id, and every rank creates its communicator (TCP or
 * NCCL). Runs on the group's thread before it serves. Internal to the group layer. */
#ifndef EMBPS_GROUP_FORMATION_H
#define EMBPS_GROUP_FORMATION_H

#include "common/status.h"
#include "server/comm/comm.h"
#include "server/group/group.h"

/** What formation hands to the group thread; it owns all of it. */
typedef struct embps__formed {
  /** cfg->size entries: the control connections of the relay tree (relay.h, with
   * cfg->control_fanout): the leader's to every rank that sends to it directly, a relay's to the
   * leader and its members, a member's to its relay; -1 elsewhere. Free with embps_free after
   * closing the descriptors. */
  int *control_fds;
  embps_comm_t *comm; /* free with embps_comm_free */
  void *stream;       /* cuda: the engine's stream (embps_cuda_close); NULL for cpu */
} embps__formed_t;

/**
 * Forms the group as rank cfg->rank of cfg->size (cfg->peer_addrs and cfg->identity must be
 * set; everything is borrowed). The bootstrap stops with EMBPS_CANCELLED once cancel_fd (-1:
 * none) is readable. With the cuda backend the leader refuses a group in which two
 * ranks on one host claim the same device, and tells the other ranks why. On EMBPS_OK *out is
 * filled; on failure *out is untouched and nothing stays open. Returns what
 * embps_group_bootstrap returns, or EMBPS_FAILED_PRECONDITION (devices claimed twice, a build
 * without NCCL for a cuda group, or the leader's refusal as it told it), EMBPS_UNAVAILABLE (a
 * rank stopped answering during formation), EMBPS_RESOURCE_EXHAUSTED, or the device's and
 * communicator's own errors; err says why.
 */
embps_status_t embps__group_form(const embps_group_config_t *cfg, int cancel_fd,
                                 embps__formed_t *out, embps_error_t *err);

#endif
