/* Group formation (formation.h).
 *
 * The steps run in order on every rank, each bounded by the bootstrap timeout: bootstrap (TCP
 * connections between every pair of ranks, configurations compared); then, for the CUDA
 * backend, every rank opens its device and sends its claim (host, PCI bus id, number) to the
 * leader, which checks that no two ranks on one host share a device (they would share its
 * memory, and NCCL refuses such a communicator), creates NCCL's unique id and hands it to
 * every rank; then every rank creates its communicator: NCCL's for CUDA, which makes its own
 * connections (the TCP data sockets are closed), or the TCP one over the data sockets. When
 * the leader refuses the group it sends every rank a BROKEN frame with the reason, so each
 * rank fails with the leader's words rather than a lost connection. Those steps use every
 * follower's direct control connection to the leader; only then does each rank keep the control
 * connections of the relay tree (relay.h) and close the others, so that the bootstrap's secret
 * and TLS cover a member's connection to its relay exactly as the ones to the leader.
 *
 * The claims live in this call's own memory, sized to the group: two groups forming in one
 * process do not share them. */
#include "server/group/formation.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/engine/engine.h"
#include "server/group/agreement.h"
#include "server/group/bootstrap.h"
#include "server/group/control.h"
#include "server/group/control_io.h"
#include "server/group/relay.h"

#ifdef EMBPS_HAVE_NCCL
_Static_assert(EMBPS__NCCL_ID_BYTES == EMBPS_NCCL_UNIQUE_ID_BYTES,
               "the NCCL_ID frame carries NCCL's whole unique id");
#endif

/* One formation in progress. */
typedef struct former {
  const embps_group_config_t *cfg;
  int *control_fds; /* cfg->size entries each */
  int *data_fds;
  embps__buf_t out; /* the frame being sent */
  embps__buf_t in;  /* the payload of the last frame received */
  void *stream;
  embps_comm_t *comm;
} former_t;

static int is_leader(const former_t *f) { return f->cfg->rank == 0; }

static uint64_t step_deadline(const former_t *f) {
  return embps_now_ms() + f->cfg->bootstrap_timeout_ms;
}

/* Sends the frame in f->out to peer. */
static embps_status_t send_out(former_t *f, uint32_t peer) {
  embps__io_t io = embps__send_all(f->control_fds[peer], f->out.data, f->out.len, step_deadline(f));
  return io == EMBPS__IO_OK ? EMBPS_OK : EMBPS_UNAVAILABLE;
}

/* Receives peer's next frame into f->in. Returns its type; -1 when none came in time (the
 * connection closed, the deadline passed, a malformed frame); -2 when out of memory (err set). */
static int recv_in(former_t *f, uint32_t peer, embps_error_t *err) {
  uint8_t type;
  embps_error_t why;
  embps_status_t st =
      embps__frame_recv(f->control_fds[peer], step_deadline(f), &type, &f->in, &why);
  if (st == EMBPS_RESOURCE_EXHAUSTED) {
    embps_error_set(err, st, "%s", why.message);
    return -2;
  }
  return st == EMBPS_OK ? type : -1;
}

/* A non-leader waits for the leader's frame of type want (in f->in). A BROKEN frame instead
 * is the leader's refusal, which this rank fails with (FAILED_PRECONDITION); anything else
 * fails with status and message. */
static embps_status_t await_leader(former_t *f, int want, embps_status_t status,
                                   const char *message, embps_error_t *err) {
  char why[EMBPS__BROKEN_MAX + 1];
  int type = recv_in(f, 0, err);
  if (type == -2)
    return EMBPS_RESOURCE_EXHAUSTED;
  if (type == EMBPS__FRAME_BROKEN &&
      embps__parse_broken(f->in.data, f->in.len, why, sizeof(why), NULL) == EMBPS_OK)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s", why);
  if (type < 0 || type != want)
    return embps_error_set(err, status, "%s", message);
  return EMBPS_OK;
}

/* This rank opens its device and claims it; the leader collects every claim and refuses the
 * group (telling every rank) when two ranks on one host claim one device. */
static embps_status_t claim_devices(former_t *f, embps_error_t *err) {
  const embps_group_config_t *cfg = f->cfg;
  embps__device_claim_t me, *claims = NULL;
  char why[400];
  embps_status_t ret;

  memset(&me, 0, sizeof(me));
  if ((ret = embps_cuda_open(cfg->device, &f->stream, me.bus_id, sizeof(me.bus_id), err)) !=
      EMBPS_OK)
    return ret;
  if (gethostname(me.host, sizeof(me.host)) != 0)
    snprintf(me.host, sizeof(me.host), "unknown");
  me.host[sizeof(me.host) - 1] = '\0';
  me.device = cfg->device;
  EMBPS_INFO("rank %u uses CUDA device %d (PCI %s) on %s", cfg->rank, cfg->device, me.bus_id,
             me.host);
  if (!is_leader(f)) {
    f->out.len = 0;
    if ((ret = embps__frame_device(&f->out, &me, err)) != EMBPS_OK)
      return ret;
    if (send_out(f, 0) != EMBPS_OK)
      return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot reach the leader (rank 0)");
    return EMBPS_OK;
  }
  if (!(claims = embps_calloc(cfg->size, sizeof(*claims))))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for %u device claims",
                           cfg->size);
  claims[0] = me;
  for (uint32_t r = 1; r < cfg->size; r++) {
    int type = recv_in(f, r, err);
    if (type == -2) {
      ret = EMBPS_RESOURCE_EXHAUSTED;
      goto exit;
    }
    if (type != EMBPS__FRAME_DEVICE ||
        embps__parse_device(f->in.data, f->in.len, &claims[r], NULL) != EMBPS_OK) {
      ret = embps_error_set(err, EMBPS_UNAVAILABLE, "rank %u did not say which CUDA device it uses",
                            r);
      goto exit;
    }
  }
  why[0] = '\0';
  embps__claims_conflict(claims, cfg->size, why, sizeof(why));
#ifndef EMBPS_HAVE_NCCL
  if (!why[0])
    snprintf(why, sizeof(why),
             "this build of embps has CUDA kernels but no NCCL, which the cuda backend needs "
             "between ranks");
#endif
  if (why[0]) {
    for (uint32_t r = 1; r < cfg->size; r++)
      embps__send_broken(f->control_fds[r], why);
    ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s", why);
  }
exit:
  embps_free(claims);
  return ret;
}

#ifdef EMBPS_HAVE_NCCL
/* The leader creates NCCL's id and hands it to every rank; every rank joins the communicator. */
static embps_status_t join_nccl(former_t *f, embps_error_t *err) {
  const embps_group_config_t *cfg = f->cfg;
  uint8_t uid[EMBPS__NCCL_ID_BYTES];
  embps_status_t ret;
  if (is_leader(f)) {
    if ((ret = embps_comm_nccl_unique_id(uid, err)) != EMBPS_OK)
      return ret;
    f->out.len = 0;
    if ((ret = embps__frame_nccl_id(&f->out, uid, err)) != EMBPS_OK)
      return ret;
    for (uint32_t r = 1; r < cfg->size; r++)
      if (send_out(f, r) != EMBPS_OK)
        return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot send NCCL's id to rank %u", r);
  } else {
    static const char missing[] = "the leader (rank 0) did not send NCCL's id";
    ret = await_leader(f, EMBPS__FRAME_NCCL_ID, EMBPS_UNAVAILABLE, missing, err);
    if (ret == EMBPS_OK && embps__parse_nccl_id(f->in.data, f->in.len, uid, NULL) != EMBPS_OK)
      ret = embps_error_set(err, EMBPS_UNAVAILABLE, "%s", missing);
    if (ret != EMBPS_OK)
      return ret;
  }
  return embps_comm_nccl_new(&f->comm, cfg->rank, cfg->size, uid, f->stream, cfg->peer_timeout_ms,
                             err);
}
#else
/* Without NCCL the leader has refused the group already (claim_devices); a non-leader learns
 * why. */
static embps_status_t join_nccl(former_t *f, embps_error_t *err) {
  return await_leader(f, -1, EMBPS_FAILED_PRECONDITION, "the leader refused the cuda backend", err);
}
#endif

embps_status_t embps__group_form(const embps_group_config_t *cfg, int cancel_fd,
                                 embps__formed_t *out, embps_error_t *err) {
  const uint32_t N = cfg->size;
  former_t f;
  embps_status_t ret = EMBPS_OK;

  memset(&f, 0, sizeof(f));
  f.cfg = cfg;
  f.control_fds = embps_malloc(N * sizeof(int));
  f.data_fds = embps_malloc(N * sizeof(int));
  if (!f.control_fds || !f.data_fds) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory forming the group");
    goto fail;
  }
  for (uint32_t r = 0; r < N; r++)
    f.control_fds[r] = f.data_fds[r] = -1;
  if (N > 1) {
    EMBPS_INFO("rank %u of %u: waiting for the group (peer address %s)", cfg->rank, N,
               cfg->peer_addrs[cfg->rank]);
    ret = embps_group_bootstrap(
        cfg->rank, N, cfg->peer_addrs, cfg->bind_any, cfg->identity, cfg->secret, cfg->secret_len,
        cfg->peer_tls, cfg->bootstrap_timeout_ms, cancel_fd, f.control_fds, f.data_fds, err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  if (cfg->backend == EMBPS_BACKEND_CUDA) {
    if ((ret = claim_devices(&f, err)) != EMBPS_OK || (ret = join_nccl(&f, err)) != EMBPS_OK)
      goto fail;
  } else {
    ret = embps_comm_tcp_new(&f.comm, cfg->rank, N, f.data_fds, cfg->peer_timeout_ms);
    for (uint32_t r = 0; r < N; r++)
      f.data_fds[r] = -1; /* the communicator owns them now, or closed them */
    if (ret != EMBPS_OK) {
      embps_error_set(err, ret, "cannot create the communicator");
      goto fail;
    }
  }
  /* Device claims and NCCL's id went over the direct connections to the leader; from here only
   * those of the control tree carry traffic (relay.h): the leader's to its relays and direct
   * ranks, a relay's to the leader and its members, a member's to its relay. The rest close. */
  for (uint32_t r = 0; r < N; r++)
    if (f.control_fds[r] >= 0 && !embps__relay_keeps(N, cfg->control_fanout, cfg->rank, r)) {
      close(f.control_fds[r]);
      f.control_fds[r] = -1;
    }
  out->control_fds = f.control_fds;
  out->comm = f.comm;
  out->stream = f.stream;
  f.control_fds = NULL;
exit:
  for (uint32_t r = 0; f.data_fds && r < N; r++)
    if (f.data_fds[r] >= 0)
      close(f.data_fds[r]); /* the TCP communicator took them; NCCL makes its own */
  embps_free(f.data_fds);
  embps__buf_free(&f.out);
  embps__buf_free(&f.in);
  return ret;
fail:
  for (uint32_t r = 0; f.control_fds && r < N; r++)
    if (f.control_fds[r] >= 0)
      close(f.control_fds[r]);
  embps_free(f.control_fds);
  embps_comm_free(f.comm);
  embps_cuda_close(f.stream);
  goto exit;
}
