/* `embps checkpoint` and `embps checkpoints`: take a checkpoint now, list those on disk.
 *
 * Both go to rank 0, which runs the group's checkpoint protocol and reads the servers'
 * --checkpoint-dir; the CLI only prints the answers. */
#include <stdio.h>
#include <time.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "embps/embps.h"

embps_cli_flag_t embps_cli_checkpoint_flags[] = {
    {"--table", "NAME", "table to checkpoint (default: every table)", NULL},
    {NULL, NULL, NULL, NULL}};

int embps_cli_cmd_checkpoint(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  embps_checkpoint_info_t info;
  embps_client_t *c;
  embps_status_t st;
  (void)pos;
  if (!(c = embps_cli_connect(cmd, 1)))
    return 1;
  st = embps_checkpoint(c, embps_cli_flag(f, "--table"), &info);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  printf("checkpoint complete: round %llu, %llu bytes, %s\n", (unsigned long long)info.round,
         (unsigned long long)info.bytes, info.path);
  return 0;
}

embps_cli_flag_t embps_cli_checkpoints_flags[] = {{NULL, NULL, NULL, NULL}};

int embps_cli_cmd_checkpoints(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  embps_checkpoint_info_t *list;
  embps_client_t *c;
  embps_status_t st;
  size_t n;
  (void)f, (void)pos;
  if (!(c = embps_cli_connect(cmd, 1)))
    return 1;
  st = embps_list_checkpoints(c, &list, &n);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  printf("%-12s %-24s %-5s %-14s %-12s %s\n", "round", "time (UTC)", "ranks", "bytes", "kind",
         "tables");
  for (size_t i = 0; i < n; i++) {
    char when[32] = "?", kind[40];
    time_t t = (time_t)(list[i].time_unix_ms / 1000);
    struct tm tm;
    if (gmtime_r(&t, &tm))
      strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    if (list[i].base_round)
      snprintf(kind, sizeof(kind), "incr<-%llu", (unsigned long long)list[i].base_round);
    else
      snprintf(kind, sizeof(kind), "%s", list[i].scope[0] ? "table" : "full");
    printf("%-12llu %-24s %-5u %-14llu %-12s %s\n", (unsigned long long)list[i].round, when,
           list[i].group_size, (unsigned long long)list[i].bytes, kind, list[i].tables);
  }
  embps_checkpoints_free(list);
  return 0;
}
