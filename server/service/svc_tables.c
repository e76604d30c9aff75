/* CreateTable, DropTable and ListTables: the table calls.
 *
 * CreateTable and DropTable go to the group's leader (rank 0), which orders them as rounds that
 * every rank runs; the leader checks them first so that it answers at once what it can (a
 * config that does not resolve, a name taken, a table not there). A name being created is
 * reserved until its round is done, so a second create of it fails at once instead of in the
 * round. ListTables is answered on the loop thread from the store. The table settings travel
 * between protobuf and embps_table_config_t through the codec common/table_fields.h drives. */
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/optimizer.h"
#include "common/table_fields.h"
#include "common/wire_fields.h"
#include "server/service/service_internal.h"

/* ---- the table settings <-> protobuf ---- */

/* A table's settings to and from its TableSpec, as common/table_fields.h declares them; zeros
 * stay zeros here and take their defaults in embps_table_config_resolve. */
EMBPS_TABLE_FIELDS_FROM_PB(settings_from_pb, embps_table_config_t)
EMBPS_TABLE_FIELDS_TO_PB(settings_to_pb, embps_table_config_t)

void embps__svc_config_from_spec(const Embps__V1__TableSpec *spec, embps_table_config_t *c) {
  memset(c, 0, sizeof(*c));
  if (spec->name && strlen(spec->name) < sizeof(c->name))
    strcpy(c->name, spec->name);
  else if (spec->name) /* too long: keep it unterminated-length so resolve refuses it */
    memset(c->name, 'x', sizeof(c->name));
  settings_from_pb(spec, c);
}

void embps__svc_spec_from_config(const embps_table_config_t *c, Embps__V1__TableSpec *spec,
                                 Embps__V1__OptimizerConfig *o) {
  spec->name = (char *)c->name;
  settings_to_pb(c, spec, o);
}

/* ---- names being created ---- */

static int name_reserved(const embps_service_t *svc, const char *name) {
  for (size_t i = 0; i < svc->num_pending_creates; i++)
    if (strcmp(svc->pending_creates[i], name) == 0)
      return 1;
  return 0;
}

static void unreserve_name(embps_service_t *svc, const char *name) {
  for (size_t i = 0; i < svc->num_pending_creates; i++)
    if (strcmp(svc->pending_creates[i], name) == 0) {
      memmove(svc->pending_creates[i], svc->pending_creates[--svc->num_pending_creates],
              EMBPS_TABLE_NAME_MAX);
      return;
    }
}

/* ---- CreateTable ---- */

static void create_done(embps__svc_request_t *r) {
  Embps__V1__CreateTableResponse resp = EMBPS__V1__CREATE_TABLE_RESPONSE__INIT;
  Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
  Embps__V1__OptimizerConfig opt = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
  const embps_table_config_t *c;

  unreserve_name(r->svc, r->group_call.op.create.name);
  if (embps__svc_answer_failure(r))
    return;
  c = embps_table_config(r->group_call.op.created);
  embps__svc_spec_from_config(c, &spec, &opt);
  resp.spec = &spec;
  resp.group_size = embps_group_size(r->svc->group);
  EMBPS_INFO("created table '%s': rows=%llu emb_width=%u %s %s, %llu bytes on this rank", c->name,
             (unsigned long long)c->rows, c->emb_width, embps_dtype_name(c->dtype),
             embps_optimizer_name(c->optimizer),
             (unsigned long long)embps_table_bytes(r->group_call.op.created));
  embps__svc_reply(r->call, &resp.base);
}

void embps__svc_create_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                             size_t len, uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_CREATE_TABLE_REQUEST_SPEC,
                                       EMBPS_WIRE_TABLE_SPEC_NAME};
  Embps__V1__CreateTableRequest *req = embps__v1__create_table_request__unpack(&svc->pb, len, msg);
  embps_table_config_t cfg;
  embps_error_t err;
  embps__svc_request_t *r;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "CreateTableRequest");
    return;
  }
  if (!req->spec) {
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, "CreateTableRequest has no spec");
    goto exit;
  }
  if (embps__svc_check_names(msg, len, name_path, 2, &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
    goto exit;
  }
  embps__svc_config_from_spec(req->spec, &cfg);
  if (embps_group_rank(svc->group) != 0) {
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "CreateTable goes to the group's leader, rank 0; this is rank %u",
                    embps_group_rank(svc->group));
    embps__svc_fail(call, &err);
    goto exit;
  }
  /* Every refusal here is answered before the create is ordered: no rank creates anything. */
  if (embps__svc_check_group(svc, &err) != EMBPS_OK ||
      embps_table_config_resolve(&cfg, embps_group_size(svc->group),
                                 embps_store_budget_max(svc->store), &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
    goto exit;
  }
  if (embps_store_find(svc->store, cfg.name) || name_reserved(svc, cfg.name)) {
    embps_error_set(&err, EMBPS_ALREADY_EXISTS, "table '%s' already exists", cfg.name);
    embps__svc_fail(call, &err);
    goto exit;
  }
  if (svc->num_pending_creates == EMBPS__SVC_MAX_PENDING_CREATES) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED,
                        "too many tables are being created at once; retry");
    goto exit;
  }
  r = embps__svc_request_new(svc, call, &req->base, create_done);
  if (!r) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  strcpy(svc->pending_creates[svc->num_pending_creates++], cfg.name);
  r->group_call.op.kind = EMBPS_OP_CREATE_TABLE;
  r->group_call.op.create = cfg;
  embps__svc_submit(r);
  return;
exit:
  embps__v1__create_table_request__free_unpacked(req, &svc->pb);
}

/* ---- DropTable ---- */

static void drop_done(embps__svc_request_t *r) {
  Embps__V1__DropTableResponse resp = EMBPS__V1__DROP_TABLE_RESPONSE__INIT;
  if (embps__svc_answer_failure(r))
    return;
  EMBPS_INFO("dropped table '%s': %llu bytes on this rank freed", r->group_call.op.create.name,
             (unsigned long long)embps_table_bytes(r->group_call.op.table));
  resp.bytes = embps_table_bytes(r->group_call.op.table);
  embps__svc_reply(r->call, &resp.base);
}

/* Like CreateTable, the leader orders it as a round that every rank runs; the table named is
 * checked here (to answer at once) and again when the round runs. */
void embps__svc_drop_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                           size_t len, uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_DROP_TABLE_REQUEST_NAME};
  Embps__V1__DropTableRequest *req = embps__v1__drop_table_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  embps__svc_request_t *r;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "DropTableRequest");
    return;
  }
  if (embps_group_rank(svc->group) != 0) {
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "DropTable goes to the group's leader, rank 0; this is rank %u",
                    embps_group_rank(svc->group));
    embps__svc_fail(call, &err);
  } else if (embps__svc_check_group(svc, &err) != EMBPS_OK ||
             embps__svc_check_names(msg, len, name_path, 1, &err) != EMBPS_OK ||
             embps_table_name_check(req->name, strlen(req->name), &err) != EMBPS_OK ||
             !embps__svc_find_table(svc, req->name, &err)) {
    embps__svc_fail(call, &err);
  } else if (!(r = embps__svc_request_new(svc, call, &req->base, drop_done))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    r->group_call.op.kind = EMBPS_OP_DROP_TABLE;
    snprintf(r->group_call.op.create.name, sizeof(r->group_call.op.create.name), "%s", req->name);
    embps__svc_submit(r);
    return;
  }
  embps__v1__drop_table_request__free_unpacked(req, &svc->pb);
}

/* ---- ListTables ---- */

void embps__svc_list_tables(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                            size_t len, uint8_t **owned) {
  Embps__V1__ListTablesRequest *req = embps__v1__list_tables_request__unpack(&svc->pb, len, msg);
  Embps__V1__ListTablesResponse resp = EMBPS__V1__LIST_TABLES_RESPONSE__INIT;
  size_t n = embps_store_count(svc->store) + 1, k = 0;
  Embps__V1__TableSpec *specs = NULL, **ptrs = NULL;
  Embps__V1__OptimizerConfig *opts = NULL;
  embps_table_t **tables = NULL;
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "ListTablesRequest");
    return;
  }
  specs = embps_calloc(n, sizeof(*specs));
  ptrs = embps_calloc(n, sizeof(*ptrs));
  opts = embps_calloc(n, sizeof(*opts));
  tables = embps_calloc(n, sizeof(*tables));
  if (!specs || !ptrs || !opts || !tables) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  n = embps_store_list(svc->store, tables, n);
  for (size_t i = 0; i < n; i++) {
    const embps_table_t *t = tables[i];
    embps__v1__table_spec__init(&specs[k]);
    embps__v1__optimizer_config__init(&opts[k]);
    embps__svc_spec_from_config(embps_table_config(t), &specs[k], &opts[k]);
    ptrs[k] = &specs[k];
    k++;
  }
  resp.n_tables = k;
  resp.tables = ptrs;
  resp.group_size = embps_group_size(svc->group);
  embps__svc_reply(call, &resp.base);
exit:
  embps_free(specs);
  embps_free(ptrs);
  embps_free(opts);
  embps_free(tables);
  embps__v1__list_tables_request__free_unpacked(req, &svc->pb);
}
