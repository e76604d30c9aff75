/* The commands of `embps` that read checkpoint files on this machine and talk to no server:
 * `embps export`. They link the store layer's checkpoint reader (server/store/ckpt_stream.h and
 * checkpoint.h, its public face), which libembps and the CLI's other commands never see: this
 * library alone does (tests/layers proves both). */
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

#endif
