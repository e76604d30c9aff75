/* Checkpoint and ListCheckpoints.
 *
 * A Checkpoint call may arrive at any rank; the group takes it to the leader, which orders it
 * into the rounds, and the call is answered once the checkpoint is complete (its manifest
 * written). ListCheckpoints reads the manifests in the checkpoint directory on libuv's thread
 * pool (a disk, or a network filesystem, may be slow), then answers on the loop thread. */
#include <stdio.h>

#include "common/alloc.h"
#include "common/wire_fields.h"
#include "server/service/service_internal.h"
#include "server/store/checkpoint.h"

#define CHECKPOINTS_OFF                                                                            \
  "checkpoints are off: start every rank with --checkpoint-dir (EMBPS_CHECKPOINT_DIR)"

/* ---- Checkpoint ---- */

static void checkpoint_done(embps__svc_request_t *r) {
  Embps__V1__CheckpointResponse resp = EMBPS__V1__CHECKPOINT_RESPONSE__INIT;
  if (embps__svc_answer_failure(r))
    return;
  resp.bytes = r->ckpt.bytes;
  resp.round = r->ckpt.round;
  resp.path = r->ckpt.path;
  embps__svc_reply(r->call, &resp.base);
}

void embps__svc_checkpoint(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                           size_t len, uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_CHECKPOINT_REQUEST_TABLE};
  Embps__V1__CheckpointRequest *req = embps__v1__checkpoint_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  embps__svc_request_t *r;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "CheckpointRequest");
    return;
  }
  if (embps__svc_check_group(svc, &err) != EMBPS_OK ||
      embps__svc_check_names(msg, len, name_path, 1, &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
  } else if (!embps_group_checkpoint_dir(svc->group)) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION, CHECKPOINTS_OFF);
  } else if (req->path && req->path[0]) {
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT,
                        "checkpoints go to the servers' --checkpoint-dir; leave path empty");
  } else if (req->table && req->table[0] && !embps__svc_find_table(svc, req->table, &err)) {
    embps__svc_fail(call, &err);
  } else if (embps_store_count(svc->store) == 0) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION,
                        "there are no tables to checkpoint: create one first");
  } else if (!(r = embps__svc_request_new(svc, call, &req->base, checkpoint_done))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    snprintf(r->ckpt.table, sizeof(r->ckpt.table), "%s", req->table ? req->table : "");
    r->group_call.ckpt = &r->ckpt;
    embps__svc_submit(r);
    return;
  }
  embps__v1__checkpoint_request__free_unpacked(req, &svc->pb);
}

/* ---- ListCheckpoints ---- */

typedef struct list_job {
  uv_work_t work;
  embps_net_call_t *call;
  char dir[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t *list;
  size_t n;
  embps_error_t err;
} list_job_t;

static void list_read(uv_work_t *w) {
  list_job_t *j = w->data;
  embps_error_clear(&j->err);
  /* The newest 64 are plenty for an operator; older ones are listed on disk. */
  if (embps_ckpt_list_newest(j->dir, 64, &j->list, &j->n, &j->err) != EMBPS_OK) {
    j->list = NULL;
    j->n = 0;
  }
}

static void list_answer(list_job_t *j) {
  Embps__V1__ListCheckpointsResponse resp = EMBPS__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
  Embps__V1__CheckpointInfo *infos = NULL, **ptrs = NULL;
  char paths[64][EMBPS_CKPT_PATH_MAX];
  char **names = NULL;
  size_t total_tables = 0, k = 0, n = j->n;

  if (j->err.status != EMBPS_OK) {
    embps__svc_fail(j->call, &j->err);
    goto exit;
  }
  for (size_t i = 0; i < n; i++)
    total_tables += j->list[i].num_tables;
  infos = embps_calloc(n ? n : 1, sizeof(*infos));
  ptrs = embps_calloc(n ? n : 1, sizeof(*ptrs));
  names = embps_calloc(total_tables ? total_tables : 1, sizeof(*names));
  if (!infos || !ptrs || !names) {
    embps_net_call_fail(j->call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    embps_ckpt_manifest_t *m = &j->list[i];
    embps__v1__checkpoint_info__init(&infos[i]);
    infos[i].round = m->round;
    infos[i].time_unix_ms = m->time_ms;
    infos[i].group_size = m->group_size;
    infos[i].bytes = m->bytes;
    infos[i].base_round = m->base_round;
    infos[i].scope = m->scope;
    embps_ckpt_path(paths[i], sizeof(paths[i]), j->dir, m->round);
    infos[i].path = paths[i];
    infos[i].tables = names + k;
    infos[i].n_tables = m->num_tables;
    for (size_t t = 0; t < m->num_tables; t++)
      names[k++] = m->tables[t].name;
    ptrs[i] = &infos[i];
  }
  resp.dir = j->dir;
  resp.n_checkpoints = n;
  resp.checkpoints = ptrs;
  embps__svc_reply(j->call, &resp.base);
exit:
  embps_free(infos);
  embps_free(ptrs);
  embps_free(names);
  embps_ckpt_list_free(j->list, j->n);
  embps_free(j);
}

static void list_done(uv_work_t *w, int status) {
  (void)status;
  list_answer(w->data);
}

void embps__svc_list_checkpoints(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                                 size_t len, uint8_t **owned) {
  Embps__V1__ListCheckpointsRequest *req =
      embps__v1__list_checkpoints_request__unpack(&svc->pb, len, msg);
  const char *dir = embps_group_checkpoint_dir(svc->group);
  list_job_t *j;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "ListCheckpointsRequest");
    return;
  }
  embps__v1__list_checkpoints_request__free_unpacked(req, &svc->pb);
  if (!dir) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION, CHECKPOINTS_OFF);
    return;
  }
  if (!(j = embps_calloc(1, sizeof(*j)))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  j->call = call;
  snprintf(j->dir, sizeof(j->dir), "%s", dir);
  j->work.data = j;
  if (!svc->cfg.loop || uv_queue_work(svc->cfg.loop, &j->work, list_read, list_done) != 0) {
    list_read(&j->work);
    list_answer(j);
  }
}
