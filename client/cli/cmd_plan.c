/* `embps plan`: what a group needs for a set of tables and a batch shape, offline (no server):
 * memory per rank broken down, bytes per step per rank on each link, lower bounds on step time,
 * checkpoint and restore time, and which resource binds first (docs/capacity.md).
 *
 * No constant here is copied by hand from the server: a row's bytes are the store's
 * (embps_table_config_row_bytes, what the memory budget counts), a hash-keyed table's index and
 * admission sketch are embps_hindex_bytes, a checkpoint's file is embps_ckpt_slice_bytes (the
 * codec's headers, blocks and trailer), and a round's scratch, peer payload and collectives are
 * the engine's round_cost.h, which the engine's cpu backend sizes its scratch by, and so are the
 * ordering's hops (embps_round_order_delays: through a control relay from 16 ranks). A table is
 * resolved by the server's own embps_table_config_resolve, so a spec the group would refuse
 * (emb_width that does not shard over N, say) is refused here with the same message.
 *
 * The step: one lookup and one push of tokens_per_batch tokens per table; per rank T/N tokens. Its
 * lower bound takes the lookup, then the push (a synchronous trainer's step), each over the busier
 * direction of the link plus its path's one-way delays; "overlapped" is the bound when enough
 * steps are in flight that both directions stay busy.
 * Each rank has one full-duplex link (--link-gbit-s, --link-delay-ms one way) that carries its
 * clients' traffic and its peers'; its disk (--disk-mbyte-s) writes its checkpoint files. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/offline.h"
#include "common/dtype.h"
#include "common/op_kind.h"
#include "common/optimizer.h"
#include "server/engine/round_cost.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.h"
#include "server/store/store.h"

embps_cli_flag_t embps_cli_plan_flags[] = {
    {"--group-size", "N", "ranks in the group (required)", NULL},
    {"--tables", "FILE",
     "the tables as JSON: an array of {name, rows | capacity, emb_width, dtype, optimizer, "
     "admit_after, sketch_width, weight_decay, tokens_per_batch} (instead of the flags below)",
     NULL},
    {"--rows", "R", "one dense table of R rows", NULL},
    {"--capacity", "C", "one hash-keyed table of C slots", NULL},
    {"--emb-width", "D", "its values per row", NULL},
    {"--dtype", "f32|bf16", "its storage dtype (default f32)", NULL},
    {"--optimizer", "NAME", "its optimizer (default the server's: rowwise_adagrad)", NULL},
    {"--admit-after", "K", "hash-keyed: admission after K pushes (default 1: no sketch)", NULL},
    {"--weight-decay", "X", "its weight decay (a rowwise optimizer then gathers row figures twice)",
     NULL},
    {"--tokens-per-batch", "T", "tokens of each table's lookup and push in a step (required)",
     NULL},
    {"--unique-fraction", "F",
     "distinct tokens of a batch over its tokens, for a push's row figures (default 1: worst case)",
     NULL},
    {"--batches-in-flight", "K", "batches a rank holds at once, for its buffers (default 1)", NULL},
    {"--backend", "cpu|cuda",
     "where tables live: cpu (checkpoint snapshots in the same memory) or cuda (snapshots in host "
     "memory) (default cpu)",
     NULL},
    {"--no-checkpoints", NULL, "no checkpoint snapshot is held", NULL},
    {"--control-fanout", "K|auto",
     "the servers' --control-fanout, for the delays of a batch's ordering (default auto)", NULL},
    {"--link-gbit-s", "G", "each rank's link, each way, in Gbit/s (default 100)", NULL},
    {"--link-mtu", "BYTES",
     "the link's MTU: each packet of MTU - 52 payload bytes (IPv4, TCP with timestamps) costs MTU "
     "+ 14 (Ethernet) on the wire (default 1500)",
     NULL},
    {"--link-delay-ms", "MS", "the link's one-way delay in ms (default 0.05)", NULL},
    {"--disk-mbyte-s", "MB", "each rank's disk bandwidth in MB/s (default 2000)", NULL},
    {"--memory-gib", "GIB", "memory per rank in GiB (device memory with cuda; default 80)", NULL},
    {"--json", NULL, "print the plan as JSON", NULL},
    {NULL, NULL, NULL, NULL}};

#define MAX_TABLES 256

/* One table of the plan, resolved, with its batch. */
typedef struct plan_table {
  embps_table_config_t cfg;
  uint64_t tokens; /* tokens_per_batch */
} plan_table_t;

/* Everything the plan prints, per rank. */
typedef struct plan {
  uint32_t N;
  int cuda, checkpoints;
  double unique_fraction, link_bytes_s, delay_s, disk_bytes_s, memory_bytes;
  double wire_factor; /* wire bytes per payload byte: the packets' headers */
  uint64_t in_flight;
  /* memory */
  uint64_t rows, state, index, sketch, snapshot, scratch, buffers;
  uint64_t device_total, host_total; /* cpu: host_total 0, all in device_total ("memory") */
  double rows_fit_fraction;          /* the tables' rows that would fit the memory, as a fraction
                                        of theirs */
  /* bytes per step */
  uint64_t client_in_lookup, client_in_push, client_out_lookup, client_out_push;
  uint64_t peer_lookup, peer_push;     /* each way */
  unsigned delays_lookup, delays_push; /* one-way delays of each op's path */
  uint32_t fanout; /* the servers' --control-fanout, resolved: 0 for none (the ordering's hops) */
  double t_link_in, t_link_out, t_delay; /* the step's bytes each way, its delays */
  double t_lookup, t_push;               /* each op alone: its busier direction, its delays */
  double t_step, t_overlapped;           /* lookup then push; steps overlapped (throughput) */
  /* durability */
  uint64_t ckpt_bytes;
  double t_ckpt, t_restore;
  const char *binds;
} plan_t;

static int usage(const char *cmd, const char *msg) { return embps_cli_usage_error(cmd, msg); }

/* Resolves t->cfg as the server would for a group of N (no memory budget: the plan reports
 * what fits). Returns 0, or 1 after printing the server's message. */
static int resolve(const char *cmd, plan_table_t *t, uint32_t N) {
  embps_error_t err;
  embps_error_clear(&err);
  if (embps_table_config_resolve(&t->cfg, N, UINT64_MAX, &err) != EMBPS_OK) {
    fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_str(err.status), err.message);
    return 1;
  }
  if (t->tokens % N != 0) {
    fprintf(stderr,
            "embps: %s: INVALID_ARGUMENT: tokens_per_batch=%" PRIu64
            " does not shard evenly over the %u-rank communicator: pad it up to a multiple of "
            "%u\n",
            cmd, t->tokens, N, N);
    return 1;
  }
  return 0;
}

/* Fills a table's settings from a JSON object; returns 0 or -1 with msg set. */
static int table_from_json(json_t *o, plan_table_t *t, uint64_t tokens, char *msg, size_t cap) {
  const char *key;
  json_t *v;
  memset(t, 0, sizeof(*t));
  snprintf(t->cfg.name, sizeof(t->cfg.name), "t");
  t->tokens = tokens;
  if (!json_is_object(o))
    return snprintf(msg, cap, "every table must be a JSON object"), -1;
  json_object_foreach(o, key, v) {
    if (!strcmp(key, "name") && json_is_string(v))
      snprintf(t->cfg.name, sizeof(t->cfg.name), "%s", json_string_value(v));
    else if (!strcmp(key, "dtype") && json_is_string(v)) {
      const char *d = json_string_value(v);
      if (strcmp(d, embps_dtype_name(EMBPS_DTYPE_F32)) == 0)
        t->cfg.dtype = EMBPS_DTYPE_F32;
      else if (strcmp(d, embps_dtype_name(EMBPS_DTYPE_BF16)) == 0)
        t->cfg.dtype = EMBPS_DTYPE_BF16;
      else
        return snprintf(msg, cap, "dtype '%s' is not f32 or bf16", d), -1;
    } else if (!strcmp(key, "optimizer") && json_is_string(v)) {
      if (embps_optimizer_from_name(json_string_value(v), &t->cfg.optimizer) != EMBPS_OK)
        return snprintf(msg, cap, "optimizer '%s' is not one of %s", json_string_value(v),
                        EMBPS_OPTIMIZER_NAMES),
               -1;
    } else if (!strcmp(key, "weight_decay") && json_is_number(v))
      t->cfg.weight_decay = (float)json_number_value(v);
    else if (json_is_integer(v) && json_integer_value(v) >= 0) {
      uint64_t x = (uint64_t)json_integer_value(v);
      if (!strcmp(key, "rows"))
        t->cfg.rows = x;
      else if (!strcmp(key, "capacity"))
        t->cfg.capacity = x;
      else if (!strcmp(key, "emb_width") && x <= UINT32_MAX)
        t->cfg.emb_width = (uint32_t)x;
      else if (!strcmp(key, "admit_after") && x <= UINT32_MAX)
        t->cfg.admit_after = (uint32_t)x;
      else if (!strcmp(key, "sketch_width") && x <= UINT32_MAX)
        t->cfg.sketch_width = (uint32_t)x;
      else if (!strcmp(key, "tokens_per_batch"))
        t->tokens = x;
      else
        return snprintf(msg, cap, "unknown or out-of-range table field '%s'", key), -1;
    } else
      return snprintf(msg, cap, "table field '%s' has the wrong type", key), -1;
  }
  if (!t->tokens)
    return snprintf(msg, cap, "table '%s' needs tokens_per_batch (or --tokens-per-batch)",
                    t->cfg.name),
           -1;
  return 0;
}

/* Reads the tables of --tables FILE. Returns the count (>= 1) or -1 with msg set. */
static int tables_from_file(const char *path, uint64_t tokens, plan_table_t *out, char *msg,
                            size_t cap) {
  json_error_t je;
  json_t *root = json_load_file(path, 0, &je), *x;
  size_t i;
  int n = -1;
  if (!root)
    return snprintf(msg, cap, "--tables %s: %s (line %d, column %d)", path, je.text, je.line,
                    je.column),
           -1;
  if (json_is_object(root) && json_object_get(root, "tables"))
    x = json_object_get(root, "tables");
  else
    x = root;
  if (!json_is_array(x) || json_array_size(x) == 0 || json_array_size(x) > MAX_TABLES) {
    snprintf(msg, cap, "--tables %s: expected an array of 1 to %d table objects", path, MAX_TABLES);
    goto exit;
  }
  for (i = 0; i < json_array_size(x); i++)
    if (table_from_json(json_array_get(x, i), &out[i], tokens, msg, cap) != 0)
      goto exit;
  n = (int)i;
exit:
  json_decref(root);
  return n;
}

static void compute(plan_t *p, const plan_table_t *tables, int count) {
  uint64_t scratch_max = 0, msg_max = 0, rows_all = 0;
  const uint32_t N = p->N;
  double fixed;

  for (int i = 0; i < count; i++) {
    const embps_table_config_t *c = &tables[i].cfg;
    const uint64_t rows = embps_table_config_rows(c), n = tables[i].tokens / N;
    const size_t ds = embps_dtype_size(c->dtype);
    const int second = c->weight_decay != 0.0f && c->optimizer == EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
    const uint64_t unique = (uint64_t)ceil(p->unique_fraction * (double)tables[i].tokens);
    uint64_t data, state, scratch;
    embps_round_shape_t sh = {.group_size = N,
                              .T = tables[i].tokens,
                              .w = c->emb_width / N,
                              .W = c->emb_width,
                              .ds = ds,
                              .hashed = embps_table_config_hashed(c)};

    embps_table_config_row_bytes(c, N, &data, &state);
    p->rows += rows * data;
    p->state += rows * state;
    rows_all += rows;
    if (embps_table_config_hashed(c)) {
      embps_hindex_config_t hc, bare;
      uint64_t whole;
      embps_table_config_hindex(c, &hc);
      bare = hc;
      bare.admit_after = 1;
      bare.sketch_width = 0;
      whole = embps_hindex_bytes(&hc);
      p->index += embps_hindex_bytes(&bare);
      p->sketch += whole - embps_hindex_bytes(&bare);
    }
    if (p->checkpoints)
      p->ckpt_bytes += embps_ckpt_slice_bytes(c, N);
    sh.kind = EMBPS_OP_LOOKUP;
    scratch = embps_round_scratch_total(&sh);
    p->peer_lookup += embps_round_peer_bytes(&sh, unique, second);
    p->delays_lookup +=
        2u + embps_round_order_delays(N, p->fanout) + embps_round_collectives(&sh, second);
    sh.kind = EMBPS_OP_PUSH;
    if (embps_round_scratch_total(&sh) > scratch)
      scratch = embps_round_scratch_total(&sh);
    p->peer_push += embps_round_peer_bytes(&sh, unique, second);
    p->delays_push +=
        2u + embps_round_order_delays(N, p->fanout) + embps_round_collectives(&sh, second);
    if (scratch > scratch_max)
      scratch_max = scratch; /* the engine's arrays grow to the largest op */
    /* The messages' payload: tokens (int64), rows or gradients (the table's dtype). */
    p->client_in_lookup += n * 8;
    p->client_out_lookup += n * c->emb_width * ds;
    p->client_in_push += n * 8 + n * c->emb_width * ds;
    p->client_out_push += 0;
    if (n * 8 + 2 * n * c->emb_width * ds > msg_max)
      msg_max = n * 8 + 2 * n * c->emb_width * ds;
  }
  p->scratch = scratch_max;
  /* A batch in flight holds its request and its reply (at most the push's request and the
   * lookup's reply of the widest table). */
  p->buffers = p->in_flight * msg_max;
  /* The checkpoint snapshot: a copy of rows and state, in the same memory on cpu, in host
   * memory on cuda. The hash index lives in host memory on either backend. */
  p->snapshot = p->checkpoints ? p->rows + p->state : 0;
  if (p->cuda) {
    p->device_total = p->rows + p->state + p->scratch + p->buffers;
    p->host_total = p->snapshot + p->index + p->sketch + p->buffers;
  } else
    p->device_total =
        p->rows + p->state + p->index + p->sketch + p->snapshot + p->scratch + p->buffers;
  /* Everything but the round's scratch and the buffers grows with the rows (the index and the
   * sketch with the capacity), so this fraction of the rows fits the memory. */
  fixed = (double)(p->scratch + p->buffers);
  p->rows_fit_fraction =
      rows_all ? (p->memory_bytes - fixed) / ((double)p->device_total - fixed) : 0;

  {
    const double in_l = (double)(p->client_in_lookup + p->peer_lookup),
                 out_l = (double)(p->client_out_lookup + p->peer_lookup),
                 in_p = (double)(p->client_in_push + p->peer_push),
                 out_p = (double)(p->client_out_push + p->peer_push),
                 bw = p->link_bytes_s / p->wire_factor;
    p->t_link_in = (in_l + in_p) / bw;
    p->t_link_out = (out_l + out_p) / bw;
    p->t_delay = (p->delays_lookup + p->delays_push) * p->delay_s;
    /* A step as a synchronous trainer takes it: the lookup, then the push, each moving its bytes
     * over the busier direction of the link and waiting out its path's delays. */
    p->t_lookup = (in_l > out_l ? in_l : out_l) / bw + p->delays_lookup * p->delay_s;
    p->t_push = (in_p > out_p ? in_p : out_p) / bw + p->delays_push * p->delay_s;
    p->t_step = p->t_lookup + p->t_push;
    /* Steps overlapped (enough batches in flight): only the link's busier direction counts. */
    p->t_overlapped = p->t_link_in > p->t_link_out ? p->t_link_in : p->t_link_out;
  }
  p->t_ckpt = (double)p->ckpt_bytes / p->disk_bytes_s;
  p->t_restore = p->t_ckpt;
  if ((double)p->device_total > p->memory_bytes)
    p->binds = "memory";
  else if (p->t_delay >= p->t_step - p->t_delay)
    p->binds = "link delay";
  else
    p->binds = "link bandwidth";
}

static double gib(uint64_t b) { return (double)b / (double)(1ull << 30); }

static void print_text(const plan_t *p, const plan_table_t *t, int count) {
  printf("plan: %d table(s) on %u rank(s), %s backend, per rank\n", count, p->N,
         p->cuda ? "cuda" : "cpu");
  for (int i = 0; i < count; i++)
    printf("  table %s: %s %" PRIu64 " x %u %s, %s, tokens_per_batch %" PRIu64 "\n", t[i].cfg.name,
           embps_table_config_hashed(&t[i].cfg) ? "capacity" : "rows",
           embps_table_config_rows(&t[i].cfg), t[i].cfg.emb_width, embps_dtype_name(t[i].cfg.dtype),
           embps_optimizer_name(t[i].cfg.optimizer), t[i].tokens);
  printf("memory per rank%30s %12s\n", "bytes", "GiB");
#define LINE(label, v) printf("  %-36s %14" PRIu64 " %10.3f\n", label, (uint64_t)(v), gib(v))
  LINE("rows", p->rows);
  LINE("optimizer state", p->state);
  LINE("hash index (host)", p->index);
  LINE("admission sketch (host)", p->sketch);
  LINE(p->cuda ? "checkpoint snapshot (host)" : "checkpoint snapshot", p->snapshot);
  LINE("round scratch", p->scratch);
  LINE("request buffers", p->buffers);
  LINE(p->cuda ? "total device memory" : "total", p->device_total);
  if (p->cuda)
    LINE("total host memory", p->host_total);
  printf("  memory per rank %.1f GiB: %s (%.0f%% of the rows would fit)\n",
         p->memory_bytes / (double)(1ull << 30),
         (double)p->device_total <= p->memory_bytes ? "fits" : "DOES NOT FIT",
         100.0 * p->rows_fit_fraction);
  printf("bytes per step per rank (one lookup and one push per table)\n");
  LINE("client -> server, lookup", p->client_in_lookup);
  LINE("client -> server, push", p->client_in_push);
  LINE("server -> client, lookup", p->client_out_lookup);
  LINE("peer <-> peer, lookup (each way)", p->peer_lookup);
  LINE("peer <-> peer, push (each way)", p->peer_push);
#undef LINE
  printf("step time lower bounds\n");
  printf("  %-36s %14.6f s\n", "link in (bandwidth)", p->t_link_in);
  printf("  %-36s %14.6f s\n", "link out (bandwidth)", p->t_link_out);
  printf("  %-36s %14.6f s (%u one-way delays%s)\n", "link delay", p->t_delay,
         p->delays_lookup + p->delays_push,
         embps_round_order_delays(p->N, p->fanout) > 2 ? ", ordering through control relays" : "");
  printf("  %-36s %14.6f s\n", "lookup", p->t_lookup);
  printf("  %-36s %14.6f s\n", "push", p->t_push);
  printf("  %-36s %14.6f s\n", "step (lookup, then push)", p->t_step);
  printf("  %-36s %14.6f s\n", "step, steps overlapped", p->t_overlapped);
  printf("durability\n");
  printf("  %-36s %14" PRIu64 " %10.3f\n", "checkpoint bytes per rank", p->ckpt_bytes,
         gib(p->ckpt_bytes));
  printf("  %-36s %14.3f s\n", "checkpoint write", p->t_ckpt);
  printf("  %-36s %14.3f s\n", "restore (same group size)", p->t_restore);
  printf("binds first: %s\n", p->binds);
}

static void print_json(const plan_t *p, const plan_table_t *t, int count) {
  printf("{\"group_size\": %u, \"backend\": \"%s\", \"control_fanout\": %u, \"tables\": [", p->N,
         p->cuda ? "cuda" : "cpu", p->fanout);
  for (int i = 0; i < count; i++) {
    printf("%s{\"name\": ", i ? ", " : "");
    embps_cli_json_string(stdout, t[i].cfg.name);
    printf(", \"rows\": %" PRIu64 ", \"emb_width\": %u, \"tokens_per_batch\": %" PRIu64 "}",
           embps_table_config_rows(&t[i].cfg), t[i].cfg.emb_width, t[i].tokens);
  }
  printf("],\n \"memory\": {\"rows\": %" PRIu64 ", \"optimizer_state\": %" PRIu64
         ", \"hash_index\": %" PRIu64 ", \"admission_sketch\": %" PRIu64
         ", \"checkpoint_snapshot\": %" PRIu64 ", \"round_scratch\": %" PRIu64
         ", \"request_buffers\": %" PRIu64 ", \"device_total\": %" PRIu64
         ", \"host_total\": %" PRIu64 ", \"memory_per_rank\": %.0f, \"fits\": %s, "
         "\"rows_fit_fraction\": %.6f},\n",
         p->rows, p->state, p->index, p->sketch, p->snapshot, p->scratch, p->buffers,
         p->device_total, p->host_total, p->memory_bytes,
         (double)p->device_total <= p->memory_bytes ? "true" : "false", p->rows_fit_fraction);
  printf(" \"bytes_per_step\": {\"client_to_server_lookup\": %" PRIu64
         ", \"client_to_server_push\": %" PRIu64 ", \"server_to_client_lookup\": %" PRIu64
         ", \"server_to_client_push\": %" PRIu64 ", \"peer_lookup\": %" PRIu64
         ", \"peer_push\": %" PRIu64 "},\n",
         p->client_in_lookup, p->client_in_push, p->client_out_lookup, p->client_out_push,
         p->peer_lookup, p->peer_push);
  printf(" \"step_time_s\": {\"link_in\": %.9g, \"link_out\": %.9g, \"link_delay\": %.9g, "
         "\"one_way_delays\": %u, \"lookup\": %.9g, \"push\": %.9g, \"lower_bound\": %.9g, "
         "\"overlapped\": %.9g},\n",
         p->t_link_in, p->t_link_out, p->t_delay, p->delays_lookup + p->delays_push, p->t_lookup,
         p->t_push, p->t_step, p->t_overlapped);
  printf(" \"checkpoint\": {\"bytes_per_rank\": %" PRIu64 ", \"write_s\": %.9g, "
         "\"restore_s\": %.9g},\n",
         p->ckpt_bytes, p->t_ckpt, p->t_restore);
  printf(" \"hardware\": {\"link_bytes_per_s\": %.0f, \"link_wire_bytes_per_payload_byte\": "
         "%.6f, \"link_delay_s\": %.9g, \"disk_bytes_per_s\": %.0f},\n",
         p->link_bytes_s, p->wire_factor, p->delay_s, p->disk_bytes_s);
  printf(" \"binds_first\": \"%s\"}\n", p->binds);
}

/* A number flag with a default; returns 0 or the usage error's exit status. */
static int num(const char *cmd, embps_cli_flag_t *f, const char *name, double min, double max,
               double dflt, double *out) {
  char msg[256];
  const char *s = embps_cli_flag(f, name);
  *out = dflt;
  if (s && embps_cli_parse_double(name, s, min, max, out, msg, sizeof(msg)) != 0)
    return usage(cmd, msg);
  return 0;
}

int embps_cli_cmd_plan(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  static plan_table_t tables[MAX_TABLES];
  char msg[512];
  const char *file = embps_cli_flag(f, "--tables"), *backend = embps_cli_flag(f, "--backend");
  const char *fanout_flag = embps_cli_flag(f, "--control-fanout");
  double x, gbit, delay_ms, disk, mem, mtu;
  uint64_t N = 0, tokens = 0, k = 1;
  int count = 1, rc;
  plan_t p;
  (void)pos;

  memset(&p, 0, sizeof(p));
  if (!embps_cli_flag(f, "--group-size"))
    return usage(cmd, "--group-size is required");
  if (embps_cli_parse_u64("--group-size", embps_cli_flag(f, "--group-size"), 1, 65536, &N, msg,
                          sizeof(msg)) != 0 ||
      (embps_cli_flag(f, "--tokens-per-batch") &&
       embps_cli_parse_u64("--tokens-per-batch", embps_cli_flag(f, "--tokens-per-batch"), 1,
                           UINT64_C(1) << 40, &tokens, msg, sizeof(msg)) != 0) ||
      (embps_cli_flag(f, "--batches-in-flight") &&
       embps_cli_parse_u64("--batches-in-flight", embps_cli_flag(f, "--batches-in-flight"), 1,
                           65536, &k, msg, sizeof(msg)) != 0))
    return usage(cmd, msg);
  if ((rc = num(cmd, f, "--unique-fraction", 0, 1, 1, &p.unique_fraction)) ||
      (rc = num(cmd, f, "--link-gbit-s", 1e-6, 1e6, 100, &gbit)) ||
      (rc = num(cmd, f, "--link-delay-ms", 0, 1e6, 0.05, &delay_ms)) ||
      (rc = num(cmd, f, "--link-mtu", 576, 65536, 1500, &mtu)) ||
      (rc = num(cmd, f, "--disk-mbyte-s", 1e-3, 1e9, 2000, &disk)) ||
      (rc = num(cmd, f, "--memory-gib", 1e-6, 1e9, 80, &mem)))
    return rc;
  if (backend && strcmp(backend, "cpu") != 0 && strcmp(backend, "cuda") != 0)
    return usage(cmd, "--backend must be cpu or cuda");
  p.N = (uint32_t)N;
  if (fanout_flag && strcmp(fanout_flag, "auto") != 0) {
    uint64_t v;
    if (embps_cli_parse_u64("--control-fanout", fanout_flag, 0, 65536, &v, msg, sizeof(msg)) != 0)
      return usage(cmd, msg);
    p.fanout = v < 2 ? 0 : (uint32_t)v;
  } else {
    p.fanout = embps_round_control_fanout_auto(p.N);
  }
  p.cuda = backend && !strcmp(backend, "cuda");
  p.checkpoints = !embps_cli_flag(f, "--no-checkpoints");
  p.in_flight = k;
  p.link_bytes_s = gbit * 1e9 / 8;
  p.delay_s = delay_ms / 1e3;
  p.wire_factor = (mtu + 14) / (mtu - 52);
  p.disk_bytes_s = disk * 1e6;
  p.memory_bytes = mem * (double)(1ull << 30);

  if (file) {
    if ((count = tables_from_file(file, tokens, tables, msg, sizeof(msg))) < 0)
      return usage(cmd, msg);
  } else {
    json_t *o = json_object();
    const char *s;
    uint64_t v;
    if (!o)
      return usage(cmd, "out of memory");
#define U64FLAG(flag, key)                                                                         \
  if ((s = embps_cli_flag(f, flag))) {                                                             \
    if (embps_cli_parse_u64(flag, s, 0, UINT64_C(1) << 62, &v, msg, sizeof(msg)) != 0) {           \
      json_decref(o);                                                                              \
      return usage(cmd, msg);                                                                      \
    }                                                                                              \
    json_object_set_new(o, key, json_integer((json_int_t)v));                                      \
  }
    U64FLAG("--rows", "rows");
    U64FLAG("--capacity", "capacity");
    U64FLAG("--emb-width", "emb_width");
    U64FLAG("--admit-after", "admit_after");
#undef U64FLAG
    if ((s = embps_cli_flag(f, "--dtype")))
      json_object_set_new(o, "dtype", json_string(s));
    if ((s = embps_cli_flag(f, "--optimizer")))
      json_object_set_new(o, "optimizer", json_string(s));
    if (num(cmd, f, "--weight-decay", 0, 1e9, 0, &x) != 0) {
      json_decref(o);
      return EMBPS_CLI_EXIT_USAGE;
    }
    if (x != 0)
      json_object_set_new(o, "weight_decay", json_real(x));
    rc = table_from_json(o, &tables[0], tokens, msg, sizeof(msg));
    json_decref(o);
    if (rc != 0)
      return usage(cmd, msg);
  }
  for (int i = 0; i < count; i++)
    if (resolve(cmd, &tables[i], p.N) != 0)
      return 1;
  compute(&p, tables, count);
  if (embps_cli_flag(f, "--json"))
    print_json(&p, tables, count);
  else
    print_text(&p, tables, count);
  return 0;
}
