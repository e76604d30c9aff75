/* The unary admin calls: CreateTable, DropTable, ListTables and Checkpoint go to rank 0, GetStats
 * and Health to every rank. Each packs its request once, sends it to the ranks it concerns as one
 * call (call.c), waits, and decodes the replies into the caller's structures, which the caller
 * frees with the matching *_free function. */
#include <stdio.h>
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "common/optimizer.h"
#include "common/shape.h"
#include "common/table_fields.h"
#include "embps/v1/embps.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

/* Runs the request msg on ranks [first, first + count) and waits; on EMBPS_OK *out is the
 * finished call (replies in each shard's stream buffer), to be freed with embps__call_free(). */
static embps_status_t unary(embps_client_t *c, const char *path, const ProtobufCMessage *msg,
                            uint32_t first, uint32_t count, embps_call_t **out) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  embps_status_t st;
  embps_call_t *call = embps__call_new(c, count);
  if (!call)
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  call->req = embps_malloc(len + 5);
  if (!call->req) {
    embps__call_free(call);
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  embps__grpc_prefix(call->req, (uint32_t)len);
  protobuf_c_message_pack(msg, call->req + 5);
  for (uint32_t i = 0; i < count; i++) {
    embps__seg_t seg = {call->req, len + 5};
    call->shards[i].rank = first + i;
    st = embps__shard_submit(call, &call->shards[i], path, &seg, 1);
    if (st != EMBPS_OK) {
      embps__call_free(call);
      return st;
    }
  }
  embps__call_kick(call);
  embps__call_run(call);
  st = embps__call_status(call);
  if (st != EMBPS_OK) {
    embps__call_free(call);
    return st;
  }
  *out = call;
  return EMBPS_OK;
}

/* The public embps_table_spec_t is written by hand (its layout is API): it must carry every
 * setting that common/table_fields.h declares, as declared. */
EMBPS_TABLE_FIELDS_CHECK(embps_table_spec_t)
EMBPS_TABLE_FIELDS_TO_PB(settings_to_pb, embps_table_spec_t)
EMBPS_TABLE_FIELDS_FROM_PB(settings_from_pb, embps_table_spec_t)

void embps__table_spec_to_pb(const embps_table_spec_t *spec, Embps__V1__TableSpec *ts,
                             Embps__V1__OptimizerConfig *oc) {
  ts->name = (char *)spec->name;
  settings_to_pb(spec, ts, oc);
}

int embps__table_spec_from_pb(const Embps__V1__TableSpec *ts, embps_table_spec_t *out) {
  out->name = embps_strdup(ts->name ? ts->name : "");
  if (!out->name)
    return -1;
  settings_from_pb(ts, out);
  if (out->dtype == 0)
    out->dtype = EMBPS_DTYPE_F32;
  return 0;
}

static embps_status_t created_decode(embps_client_t *c, const embps__stream_t *s,
                                     embps_table_spec_t **out);

embps_status_t embps_create_table(embps_client_t *client, const embps_table_spec_t *spec) {
  return embps_create_table_answered(client, spec, NULL);
}

embps_status_t embps_create_table_answered(embps_client_t *client, const embps_table_spec_t *spec,
                                           embps_table_spec_t **created) {
  Embps__V1__CreateTableRequest req = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
  Embps__V1__TableSpec ts = EMBPS__V1__TABLE_SPEC__INIT;
  Embps__V1__OptimizerConfig oc = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
  embps_call_t *call;
  embps_error_t err;
  embps_status_t st;

  if (!spec || !spec->name || !spec->name[0])
    return embps__client_fail(client, EMBPS_INVALID_ARGUMENT, "create table: no table name");
  if (spec->dtype != 0 && embps_dtype_size(spec->dtype) == 0)
    return embps__client_fail(client, EMBPS_INVALID_ARGUMENT,
                              "create table: dtype %d is neither f32 nor bf16", (int)spec->dtype);
  if (spec->optimizer != EMBPS_OPTIMIZER_DEFAULT && !embps_optimizer_info(spec->optimizer))
    return embps__client_fail(client, EMBPS_INVALID_ARGUMENT, "create table: unknown optimizer %d",
                              (int)spec->optimizer);
  embps_error_clear(&err);
  if (embps_shape_check_emb_width(spec->emb_width, client->group_size, &err) != EMBPS_OK)
    return embps__client_fail_err(client, &err);
  embps__table_spec_to_pb(spec, &ts, &oc);
  req.spec = &ts;
  st = unary(client, EMBPS__PATH_PREFIX "CreateTable", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  if (created)
    st = created_decode(client, call->shards[0].stream, created);
  embps__call_free(call);
  return st;
}

embps_status_t embps_drop_table(embps_client_t *client, const char *name) {
  Embps__V1__DropTableRequest req = EMBPS__V1__DROP_TABLE_REQUEST__INIT;
  embps_call_t *call;
  embps_status_t st;

  if (!name || !name[0])
    return embps__client_fail(client, EMBPS_INVALID_ARGUMENT, "drop table: no table name");
  req.name = (char *)name;
  st = unary(client, EMBPS__PATH_PREFIX "DropTable", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  embps__call_free(call);
  return EMBPS_OK;
}

void embps_tables_free(embps_table_spec_t *tables, size_t n) {
  if (!tables)
    return;
  for (size_t i = 0; i < n; i++)
    embps_free((char *)tables[i].name);
  embps_free(tables);
}

/* Decodes a CreateTableResponse's spec into a new one-element array (*out). */
static embps_status_t created_decode(embps_client_t *c, const embps__stream_t *s,
                                     embps_table_spec_t **out) {
  Embps__V1__CreateTableResponse *m = (Embps__V1__CreateTableResponse *)embps__reply_unpack(
      c, &embps__v1__create_table_response__descriptor, s, 0);
  embps_table_spec_t *t = NULL;
  embps_status_t st = EMBPS_OK;
  if (!m)
    return c->last.status;
  if (!m->spec) {
    st = embps__client_fail(c, EMBPS_INTERNAL, "create table: the reply holds no table spec");
  } else if (!(t = embps_calloc(1, sizeof(*t))) || embps__table_spec_from_pb(m->spec, t) != 0) {
    embps_free(t);
    st = embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    *out = t;
  }
  embps__reply_free(&m->base);
  return st;
}

/* Decodes a ListTablesResponse; sets *group_size if not NULL. */
static embps_status_t tables_decode(embps_client_t *c, const embps__stream_t *s, uint32_t rank,
                                    embps_table_spec_t **out, size_t *n, uint32_t *group_size) {
  Embps__V1__ListTablesResponse *m = (Embps__V1__ListTablesResponse *)embps__reply_unpack(
      c, &embps__v1__list_tables_response__descriptor, s, rank);
  embps_table_spec_t *t = NULL;
  if (!m)
    return c->last.status;
  if (group_size)
    *group_size = m->group_size;
  if (out) {
    t = embps_calloc(m->n_tables ? m->n_tables : 1, sizeof(*t));
    if (!t)
      goto oom;
    for (size_t i = 0; i < m->n_tables; i++)
      if (embps__table_spec_from_pb(m->tables[i], &t[i]) != 0) {
        embps_tables_free(t, i);
        goto oom;
      }
    *out = t;
    *n = m->n_tables;
  }
  embps__reply_free(&m->base);
  return EMBPS_OK;
oom:
  embps__reply_free(&m->base);
  return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
}

embps_status_t embps_list_tables(embps_client_t *client, embps_table_spec_t **tables, size_t *n) {
  Embps__V1__ListTablesRequest req = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
  embps_call_t *call;
  embps_status_t st = unary(client, EMBPS__PATH_PREFIX "ListTables", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  st = tables_decode(client, call->shards[0].stream, 0, tables, n, NULL);
  embps__call_free(call);
  return st;
}

static char *dup_or_empty(const char *s) { return embps_strdup(s ? s : ""); }

void embps_stats_free(embps_rank_stats_t *stats, size_t n) {
  if (!stats)
    return;
  for (size_t i = 0; i < n; i++) {
    embps_free(stats[i].backend);
    embps_free(stats[i].version);
    embps_free(stats[i].address);
    embps_free(stats[i].mesh);
    for (size_t j = 0; j < stats[i].num_tables && stats[i].tables; j++)
      embps_free(stats[i].tables[j].name);
    embps_free(stats[i].tables);
  }
  embps_free(stats);
}

void embps_stats_prometheus_free(char **texts, size_t n) {
  if (!texts)
    return;
  for (size_t i = 0; i < n; i++)
    embps_free(texts[i]);
  embps_free(texts);
}

embps_status_t embps_stats_prometheus(embps_client_t *client, char ***texts, size_t *n) {
  Embps__V1__GetStatsRequest req = EMBPS__V1__GET_STATS_REQUEST__INIT;
  embps_call_t *call;
  char **out;
  embps_status_t st;
  req.prometheus = 1;
  st = unary(client, EMBPS__PATH_PREFIX "GetStats", &req.base, 0, client->group_size, &call);
  if (st != EMBPS_OK)
    return st;
  out = embps_calloc(call->nshards ? call->nshards : 1, sizeof(*out));
  if (!out) {
    embps__call_free(call);
    return embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  for (uint32_t i = 0; i < call->nshards; i++) {
    Embps__V1__GetStatsResponse *m = (Embps__V1__GetStatsResponse *)embps__reply_unpack(
        client, &embps__v1__get_stats_response__descriptor, call->shards[i].stream, i);
    if (!m) {
      st = client->last.status;
      embps_stats_prometheus_free(out, call->nshards);
      embps__call_free(call);
      return st;
    }
    out[i] = dup_or_empty(m->prometheus_text);
    embps__reply_free(&m->base);
    if (!out[i]) {
      embps_stats_prometheus_free(out, call->nshards);
      embps__call_free(call);
      return embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    }
  }
  *texts = out;
  *n = call->nshards;
  embps__call_free(call);
  return EMBPS_OK;
}

embps_status_t embps_stats(embps_client_t *client, embps_rank_stats_t **stats, size_t *n) {
  Embps__V1__GetStatsRequest req = EMBPS__V1__GET_STATS_REQUEST__INIT;
  embps_rank_stats_t *out;
  embps_call_t *call;
  embps_status_t st =
      unary(client, EMBPS__PATH_PREFIX "GetStats", &req.base, 0, client->group_size, &call);
  if (st != EMBPS_OK)
    return st;
  out = embps_calloc(call->nshards, sizeof(*out));
  if (!out) {
    embps__call_free(call);
    return embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    embps_rank_stats_t *r = &out[i];
    Embps__V1__GetStatsResponse *m = (Embps__V1__GetStatsResponse *)embps__reply_unpack(
        client, &embps__v1__get_stats_response__descriptor, s, i);
    if (!m) {
      st = client->last.status;
      goto fail;
    }
    r->rank = m->rank;
    r->group_size = m->group_size;
    r->uptime_s = m->uptime_s;
    r->requests = m->requests;
    r->errors = m->errors;
    r->bytes_in = m->bytes_in;
    r->bytes_out = m->bytes_out;
    r->connections = m->connections;
    r->ready = m->ready;
    r->peer_bytes_sent = m->peer_bytes_sent;
    r->peer_bytes_received = m->peer_bytes_received;
    r->collective_calls = m->collective_calls;
    r->mesh = dup_or_empty(m->mesh);
    r->backend = dup_or_empty(m->backend);
    r->version = dup_or_empty(m->version);
    r->address = dup_or_empty(client->addrs[i].authority);
    r->tables = embps_calloc(m->n_tables ? m->n_tables : 1, sizeof(*r->tables));
    if (r->tables)
      r->num_tables = m->n_tables;
    for (size_t j = 0; r->tables && j < m->n_tables; j++) {
      const Embps__V1__TableStats *t = m->tables[j];
      embps_table_stats_t *o = &r->tables[j];
      o->name = dup_or_empty(t->name);
      o->rows = t->rows;
      o->emb_width = t->emb_width;
      o->lookups = t->lookups;
      o->pushes = t->pushes;
      o->rows_looked_up = t->rows_looked_up;
      o->rows_pushed = t->rows_pushed;
      o->steps_applied = t->steps_applied;
      o->steps_skipped = t->steps_skipped;
      o->bytes = t->bytes;
      o->capacity = t->capacity;
      o->keys = t->keys;
      o->keys_admitted = t->keys_admitted;
      o->keys_evicted = t->keys_evicted;
      o->keys_expired = t->keys_expired;
      o->keys_refused = t->keys_refused;
      o->gradients_dropped = t->gradients_dropped;
    }
    embps__reply_free(&m->base);
    if (!r->backend || !r->version || !r->address || !r->mesh || !r->tables) {
      st = embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      goto fail;
    }
    for (size_t j = 0; j < r->num_tables; j++)
      if (!r->tables[j].name) {
        st = embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
      }
  }
  *stats = out;
  *n = call->nshards;
  embps__call_free(call);
  return EMBPS_OK;
fail:
  embps_stats_free(out, call->nshards);
  embps__call_free(call);
  return st;
}

embps_status_t embps_health(embps_client_t *client, const char *service, int *serving) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  embps_call_t *call;
  embps_status_t st;
  req.service = (char *)(service ? service : "");
  st = unary(client, "/grpc.health.v1.Health/Check", &req.base, 0, client->group_size, &call);
  if (st != EMBPS_OK)
    return st;
  *serving = 1;
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    Grpc__Health__V1__HealthCheckResponse *m =
        (Grpc__Health__V1__HealthCheckResponse *)embps__reply_unpack(
            client, &grpc__health__v1__health_check_response__descriptor, s, i);
    int status;
    if (!m) {
      embps__call_free(call);
      return client->last.status;
    }
    status = m->status;
    embps__reply_free(&m->base);
    if (status != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING && *serving) {
      static const char *names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
      *serving = 0;
      embps__client_fail(client, EMBPS_OK, "rank %u (%s) is %s", i, client->addrs[i].authority,
                         status >= 0 && status <= 3 ? names[status] : "UNKNOWN");
    }
  }
  embps__call_free(call);
  return EMBPS_OK;
}

embps_status_t embps_checkpoint(embps_client_t *client, const char *table,
                                embps_checkpoint_info_t *info) {
  Embps__V1__CheckpointRequest req = EMBPS__V1__CHECKPOINT_REQUEST__INIT;
  Embps__V1__CheckpointResponse *m;
  embps_call_t *call;
  embps_status_t st;
  req.table = (char *)(table ? table : "");
  st = unary(client, EMBPS__PATH_PREFIX "Checkpoint", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  m = (Embps__V1__CheckpointResponse *)embps__reply_unpack(
      client, &embps__v1__checkpoint_response__descriptor, call->shards[0].stream, 0);
  if (!m) {
    embps__call_free(call);
    return client->last.status;
  }
  if (info) {
    memset(info, 0, sizeof(*info));
    info->round = m->round;
    info->bytes = m->bytes;
    snprintf(info->path, sizeof(info->path), "%s", m->path ? m->path : "");
    snprintf(info->scope, sizeof(info->scope), "%s", table ? table : "");
  }
  embps__reply_free(&m->base);
  embps__call_free(call);
  return EMBPS_OK;
}

/* Joins names into out (cap bytes), comma-separated, ending in "..." when they do not fit. */
static void join_names(char *out, size_t cap, char **names, size_t n) {
  size_t used = 0;
  out[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    size_t need = strlen(names[i]) + (i ? 1 : 0);
    if (used + need + 4 >= cap) {
      snprintf(out + used, cap - used, "...");
      return;
    }
    used += (size_t)snprintf(out + used, cap - used, "%s%s", i ? "," : "", names[i]);
  }
}

embps_status_t embps_list_checkpoints(embps_client_t *client, embps_checkpoint_info_t **list,
                                      size_t *n) {
  Embps__V1__ListCheckpointsRequest req = EMBPS__V1__LIST_CHECKPOINTS_REQUEST__INIT;
  Embps__V1__ListCheckpointsResponse *m;
  embps_checkpoint_info_t *out;
  embps_call_t *call;
  embps_status_t st;
  *list = NULL;
  *n = 0;
  st = unary(client, EMBPS__PATH_PREFIX "ListCheckpoints", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  m = (Embps__V1__ListCheckpointsResponse *)embps__reply_unpack(
      client, &embps__v1__list_checkpoints_response__descriptor, call->shards[0].stream, 0);
  if (!m) {
    embps__call_free(call);
    return client->last.status;
  }
  out = embps_calloc(m->n_checkpoints ? m->n_checkpoints : 1, sizeof(*out));
  if (!out) {
    embps__reply_free(&m->base);
    embps__call_free(call);
    return embps__client_fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  for (size_t i = 0; i < m->n_checkpoints; i++) {
    const Embps__V1__CheckpointInfo *c = m->checkpoints[i];
    out[i].round = c->round;
    out[i].bytes = c->bytes;
    out[i].time_unix_ms = c->time_unix_ms;
    out[i].group_size = c->group_size;
    out[i].base_round = c->base_round;
    snprintf(out[i].path, sizeof(out[i].path), "%s", c->path ? c->path : "");
    snprintf(out[i].scope, sizeof(out[i].scope), "%s", c->scope ? c->scope : "");
    join_names(out[i].tables, sizeof(out[i].tables), c->tables, c->n_tables);
  }
  *list = out;
  *n = m->n_checkpoints;
  embps__reply_free(&m->base);
  embps__call_free(call);
  return EMBPS_OK;
}

void embps_checkpoints_free(embps_checkpoint_info_t *list) { embps_free(list); }

/* Learns the group size from every rank's ListTables and checks it against the addresses. */
embps_status_t embps__learn_group_size(embps_client_t *c) {
  Embps__V1__ListTablesRequest req = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
  uint32_t n = c->group_size;
  embps_call_t *call;
  embps_status_t st = unary(c, EMBPS__PATH_PREFIX "ListTables", &req.base, 0, n, &call);
  if (st != EMBPS_OK)
    return st;
  for (uint32_t i = 0; i < n && st == EMBPS_OK; i++) {
    uint32_t g = 0;
    st = tables_decode(c, call->shards[i].stream, i, NULL, NULL, &g);
    if (st == EMBPS_OK && g != 0 && g != n)
      st = embps__client_fail(
          c, EMBPS_FAILED_PRECONDITION,
          "%s belongs to a group of %u ranks but %u address%s given: list every rank's "
          "host:port in rank order",
          c->addrs[i].authority, g, n, n == 1 ? " was" : "es were");
  }
  embps__call_free(call);
  return st;
}
