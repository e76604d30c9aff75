/* `embps`: the command-line tool of a shard group (admin, lookup/push, load test).
 *
 * This file only dispatches: the command table below names each command, its positional
 * argument, its summary, its handler and its flag table, and the same table prints
 * `embps --help`. The rest lives by concern: args.c parses every flag and value (and prints
 * each command's --help from its flag table), connect.c holds the global settings and the
 * connection, cmd_tables.c, cmd_data.c, cmd_features.c, cmd_import.c, cmd_stats.c,
 * cmd_checkpoint.c and cmd_bench.c run the command families, bench.c and bench_features.c are the
 * load generators. The tool uses only the public libembps API, with common/'s helpers over its
 * types, except `export` and `plan` (cmd_export.c, cmd_plan.c, offline.h), which read checkpoint
 * files with the store layer's reader or size a group from the store's and the round's arithmetic,
 * and talk to no server. Failures print "embps: COMMAND: STATUS: message" with the
 * server's message on stderr and exit 1; usage errors exit 2. */
#include <malloc.h>
#include <stdio.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "client/cli/offline.h"
#include "embps/embps.h"

static const embps_cli_command_t commands[] = {
    {"create-table", "NAME",
     "Create a table on the group; prints the table as the server created it, defaults filled "
     "in.",
     embps_cli_cmd_create_table, embps_cli_create_table_flags},
    {"drop-table", "NAME",
     "Drop a table on the group: its memory is freed and the name may be created again.",
     embps_cli_cmd_drop_table, embps_cli_drop_table_flags},
    {"tables", NULL,
     "List the tables: name, kind (dense or hash), rows or capacity, emb_width, dtype, optimizer, "
     "and a hash-keyed table's settings.",
     embps_cli_cmd_tables, embps_cli_tables_flags},
    {"lookup", "NAME", "Look up rows; prints one line per token: the token, then its values.",
     embps_cli_cmd_lookup, embps_cli_lookup_flags},
    {"push", "NAME", "Push gradients; prints applied, skipped, grad_norm, num_unique.",
     embps_cli_cmd_push, embps_cli_push_flags},
    {"lookup-features", "FILE",
     "Look up a feature batch read from a JSON file (- for stdin), pooled on the servers; prints "
     "one line per row: the feature, the sample (and the id), then the values.",
     embps_cli_cmd_lookup_features, embps_cli_lookup_features_flags},
    {"assign", "NAME",
     "Set rows to values given (--rows or a .npy), resetting their optimizer state unless "
     "--keep-state; prints assigned, refused.",
     embps_cli_cmd_assign, embps_cli_assign_flags},
    {"import", "NAME",
     "Stream a .npy array of (rows, emb_width) into a table in batches (creating it with the "
     "array's shape if absent); resumable with --start.",
     embps_cli_cmd_import, embps_cli_import_flags},
    {"stats", NULL, "Print every rank's statistics and per-table counters.", embps_cli_cmd_stats,
     embps_cli_stats_flags},
    {"health", NULL,
     "Ask every rank's grpc.health.v1 service; prints SERVING and exits 0 when all serve.",
     embps_cli_cmd_health, embps_cli_health_flags},
    {"checkpoint", NULL,
     "Take a checkpoint now into the servers' --checkpoint-dir; prints its round, bytes, path.",
     embps_cli_cmd_checkpoint, embps_cli_checkpoint_flags},
    {"checkpoints", NULL, "List the complete checkpoints: round, time, ranks, bytes, tables.",
     embps_cli_cmd_checkpoints, embps_cli_checkpoints_flags},
    {"export", "CHECKPOINT",
     "Write a table of a complete checkpoint as numpy .npy files (rows, a hash-keyed table's "
     "keys, optionally the optimizer state), offline: no server; any group size, full or "
     "incremental.",
     embps_cli_cmd_export, embps_cli_export_flags},
    {"plan", NULL,
     "Size a group offline: memory per rank, bytes per step on each link, step-time lower "
     "bounds, checkpoint and restore time, and what binds first (docs/capacity.md).",
     embps_cli_cmd_plan, embps_cli_plan_flags},
    {"bench", "NAME[,NAME...]",
     "Load test: C threads keep K lookups/pushes of T random tokens (uniform or Zipf) in flight "
     "(closed loop) or send R batches/s on a schedule (--rate), and report batches/s, rows/s, "
     "GB/s, latency percentiles and errors by status.",
     embps_cli_cmd_bench, embps_cli_bench_flags},
};

#define NUM_COMMANDS (sizeof(commands) / sizeof(commands[0]))

static void usage(FILE *f) {
  fprintf(f, "usage: embps [GLOBAL OPTIONS] COMMAND [OPTIONS]\n\nglobal options (flag, "
             "environment variable, default):\n");
  embps_cli_settings_usage(f);
  fprintf(f, "  %-28s %s\n\ncommands:\n", "--help", "show this help");
  for (size_t i = 0; i < NUM_COMMANDS; i++)
    fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\n`embps COMMAND --help` shows a command's options.\n");
}

/* Runs the command argv[0] with its arguments; returns the exit status. */
static int dispatch(int argc, char **argv) {
  for (size_t k = 0; k < NUM_COMMANDS; k++) {
    const char *pos;
    int rc;
    if (strcmp(argv[0], commands[k].name) != 0)
      continue;
    rc = embps_cli_parse_flags(&commands[k], argc - 1, argv + 1, &pos);
    if (rc != 0)
      return rc < 0 ? 0 : rc;
    rc = commands[k].run(commands[k].name, commands[k].flags, pos);
    embps_cli_disconnect();
    return rc;
  }
  fprintf(stderr, "embps: unknown command '%s' (see embps --help)\n", argv[0]);
  return EMBPS_CLI_EXIT_USAGE;
}

int main(int argc, char **argv) {
  int i, rc;

  /* As in the server (server/main.c): keep large blocks in the heap so that buffers of tens of
   * MiB that bench allocates and frees step after step do not fault their pages in anew. */
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);

  if ((rc = embps_cli_settings_parse(argc, argv, &i)) != 0)
    return rc;
  if (i < argc && (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)) {
    usage(stdout);
    return 0;
  }
  if (i < argc && strcmp(argv[i], "--version") == 0) {
    printf("embps %s\n", EMBPS_VERSION);
    return 0;
  }
  if ((rc = embps_cli_settings_apply()) != 0)
    return rc;
  if (i >= argc) {
    usage(stderr);
    return EMBPS_CLI_EXIT_USAGE;
  }
  return dispatch(argc - i, argv + i);
}
