/* The commands of `embps` that read checkpoint files on this machine and talk to no server:
 * `embps export`, and `embps plan`, which sizes a group from the store's and the engine's round
 * arithmetic (round_cost.h). They link the store layer's checkpoint reader
 * (server/store/ckpt_stream.h and checkpoint.h, its public face), which libembps and the CLI's
 * other commands never see: this library alone does (tests/layers proves both). */
#ifndef EMBPS_CLI_OFFLINE_H
#define EMBPS_CLI_OFFLINE_H

#include "client/cli/args.h"

/* cmd_export.c: export */
extern embps_cli_flag_t embps_cli_export_flags[];

/** `embps export CHECKPOINT --table T --out DIR [--state] [--round R] [--f32]`: writes table T
 * of a complete checkpoint as numpy .npy files in DIR (docs/cli-and-benchmarks.md). Returns 0,
 * 1 after printing "embps: export: STATUS: message" (the checkpoint cannot be read, or DIR
 * cannot be written), or EMBPS_CLI_EXIT_USAGE. */
int embps_cli_cmd_export(const char *cmd, embps_cli_flag_t *f, const char *path);

/* cmd_plan.c: plan */
extern embps_cli_flag_t embps_cli_plan_flags[];

/** `embps plan --group-size N (--tables FILE | --rows R | --capacity C ...) --tokens-per-batch
 * T [hardware flags] [--json]`: prints what the group needs per rank for the tables and batch
 * (docs/capacity.md): memory broken down, bytes per step on each link, step-time lower bounds,
 * checkpoint and restore time, what binds first. Reads no checkpoint and talks to no server.
 * Returns 0; 1 after printing "embps: plan: STATUS: message" for a table the group would refuse
 * (the server's own message); EMBPS_CLI_EXIT_USAGE for a bad flag or tables file. */
int embps_cli_cmd_plan(const char *cmd, embps_cli_flag_t *f, const char *pos);

#endif
