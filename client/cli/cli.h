/* The parts of the `embps` program that its files share: the connection the global settings
 * describe (connect.c) and the handlers and flag tables of every command family (cmd_*.c),
 * which main.c's command table lists. */
#ifndef EMBPS_CLI_CLI_H
#define EMBPS_CLI_CLI_H

#include <stddef.h>
#include <stdio.h>

#include "client/cli/args.h"
#include "embps/embps.h"

/* ---- the global settings and the connection (connect.c) ---- */

/** Reads the global settings (--servers, deadlines, padding, token file, TLS) from the
 * environment and from argv's options before the command. *next is the index of the first
 * argument left (the command, or --help, -h or --version). Returns 0, or EMBPS_CLI_EXIT_USAGE
 * after printing why. */
int embps_cli_settings_parse(int argc, char **argv, int *next);

/** Turns the settings read into the client options later connections use: numbers checked,
 * the token read from --token-file. Returns 0, or EMBPS_CLI_EXIT_USAGE after printing why. */
int embps_cli_settings_apply(void);

/** Prints the global settings' part of `embps --help`. */
void embps_cli_settings_usage(FILE *f);

/** Connects to the servers of --servers with the settings' options; with learn_group 0 the
 * group size is the number of addresses instead of what rank 0 says (for stats and health,
 * which ask every rank). The client is owned here and freed by embps_cli_disconnect().
 * Returns it, or NULL after printing "embps: CMD: STATUS: message". */
embps_client_t *embps_cli_connect(const char *cmd, int learn_group);

/** Frees the client of embps_cli_connect(), if any. */
void embps_cli_disconnect(void);

/** The --servers text, owned by the settings. */
const char *embps_cli_servers(void);

/** The client options the settings describe (strings owned by the settings). */
embps_client_options_t embps_cli_options(void);

/** Prints "embps: CMD: STATUS: the client's last error" and returns 1. */
int embps_cli_call_failed(const char *cmd, embps_client_t *c, embps_status_t st);

/** Lists the tables into *tables (*n of them, freed by the caller with embps_tables_free()) and
 * points *out at the one called name. Returns 0, or 1 after printing the failed call or
 * NOT_FOUND. */
int embps_cli_find_table(const char *cmd, embps_client_t *c, const char *name,
                         embps_table_spec_t **tables, size_t *n, const embps_table_spec_t **out);

/* ---- the commands: each family's flag tables and handlers (embps_cli_handler_t) ---- */

/* cmd_tables.c: create-table, drop-table, tables */
extern embps_cli_flag_t embps_cli_create_table_flags[];
extern embps_cli_flag_t embps_cli_drop_table_flags[];
extern embps_cli_flag_t embps_cli_tables_flags[];
int embps_cli_cmd_create_table(const char *cmd, embps_cli_flag_t *f, const char *name);
int embps_cli_cmd_drop_table(const char *cmd, embps_cli_flag_t *f, const char *name);
int embps_cli_cmd_tables(const char *cmd, embps_cli_flag_t *f, const char *pos);

/** Reads create-table's flags (f) into spec, its name excluded: exactly one of --rows (dense)
 * and --capacity (hash-keyed), --emb-width, and the options; a hash-keyed option beside --rows
 * is refused here. spec must be initialized (embps_table_spec_init). Returns 0, or
 * EMBPS_CLI_EXIT_USAGE after printing "embps: CMD: why" to stderr. */
int embps_cli_table_spec_from_flags(const char *cmd, const embps_cli_flag_t *f,
                                    embps_table_spec_t *spec);

/** Prints the "created table NAME: ..." line of the spec the server answered (the kind, then
 * every setting; a hash-keyed table's settings after the optimizer's). */
void embps_cli_print_created(FILE *out, const embps_table_spec_t *t);

/** Prints n tables as `embps tables` does: a header and a line per table (name, kind, rows or
 * capacity, emb_width, dtype, optimizer, the hash-keyed settings or "-"), or with json a JSON
 * array of objects, each with "kind" ("dense" or "hash") and "capacity", and for a hash-keyed
 * table its settings. */
void embps_cli_print_tables(FILE *out, const embps_table_spec_t *t, size_t n, int json);

/* cmd_data.c: lookup, push */
extern embps_cli_flag_t embps_cli_lookup_flags[];
extern embps_cli_flag_t embps_cli_push_flags[];
int embps_cli_cmd_lookup(const char *cmd, embps_cli_flag_t *f, const char *name);
int embps_cli_cmd_push(const char *cmd, embps_cli_flag_t *f, const char *name);

/* cmd_features.c: lookup-features (a feature batch read from a JSON file) */
extern embps_cli_flag_t embps_cli_lookup_features_flags[];
int embps_cli_cmd_lookup_features(const char *cmd, embps_cli_flag_t *f, const char *file);
/* cmd_import.c: assign, import (rows written as given; .npy files read by npy.h) */
extern embps_cli_flag_t embps_cli_assign_flags[];
extern embps_cli_flag_t embps_cli_import_flags[];
int embps_cli_cmd_assign(const char *cmd, embps_cli_flag_t *f, const char *name);
int embps_cli_cmd_import(const char *cmd, embps_cli_flag_t *f, const char *name);

/* cmd_stats.c: stats (text, JSON, Prometheus), health */
extern embps_cli_flag_t embps_cli_stats_flags[];
extern embps_cli_flag_t embps_cli_health_flags[];
int embps_cli_cmd_stats(const char *cmd, embps_cli_flag_t *f, const char *pos);
int embps_cli_cmd_health(const char *cmd, embps_cli_flag_t *f, const char *pos);

/** Prints the Prometheus texts of n ranks as one valid exposition: each family once (its HELP
 * and TYPE), then every rank's samples of it, with a rank="R" label when n > 1. */
void embps_cli_print_prometheus(FILE *f, char **texts, size_t n);

/** Prints one table's counters on one rank: text, the "  table NAME: ..." line of `embps stats`
 * (a hash-keyed table's with its capacity, keys, load and the admission and eviction counters),
 * or a JSON object with "kind" and every counter, the hash-keyed ones 0 for a dense table. */
void embps_cli_print_table_stats(FILE *out, const embps_table_stats_t *t, int json);

/* cmd_checkpoint.c: checkpoint, checkpoints */
extern embps_cli_flag_t embps_cli_checkpoint_flags[];
extern embps_cli_flag_t embps_cli_checkpoints_flags[];
int embps_cli_cmd_checkpoint(const char *cmd, embps_cli_flag_t *f, const char *pos);
int embps_cli_cmd_checkpoints(const char *cmd, embps_cli_flag_t *f, const char *pos);

/* cmd_bench.c: bench (its flags; the load generator is bench.c) */
extern embps_cli_flag_t embps_cli_bench_flags[];
int embps_cli_cmd_bench(const char *cmd, embps_cli_flag_t *f, const char *names);

#endif
