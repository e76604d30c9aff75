/* A real shard group for C tests: N embps-server ranks on loopback, started with posix_spawn
 * as `embps-server --rank R --peers HOST:PORT,... --peer-port-offset OFF`, each with its output
 * in a temporary log file, and stopped by PID with SIGTERM. */
#ifndef EMBPS_TEST_GROUP_PROC_H
#define EMBPS_TEST_GROUP_PROC_H

#include <sys/types.h>

#define GROUP_PROC_MAX_RANKS 8

typedef struct group_proc {
  int n;                                     /* ranks */
  int offset;                                /* --peer-port-offset */
  int ports[GROUP_PROC_MAX_RANKS];           /* client ports, rank order */
  pid_t pids[GROUP_PROC_MAX_RANKS];          /* 0: not started or already reaped and stopped */
  int reaped[GROUP_PROC_MAX_RANKS];          /* exit_codes[r] holds how rank r ended */
  int exit_codes[GROUP_PROC_MAX_RANKS];      /* as group_proc_stop returns them */
  char log_paths[GROUP_PROC_MAX_RANKS][256]; /* stdout and stderr of each rank */
  char servers[GROUP_PROC_MAX_RANKS * 24];   /* "127.0.0.1:P0,127.0.0.1:P1,..." */
} group_proc_t;

/** Starts an n-rank group (flags: NULL-terminated extra flags for every rank, may be NULL) on
 * free loopback ports and waits until every rank logged "listening on" and every rank answers
 * health SERVING through libembps. Every wait is bounded (ready_timeout_ms per attempt); a
 * failed attempt (e.g. a port lost to another process) kills the ranks and retries with new
 * ports, at most `attempts` times. Returns 0, or -1 with the logs printed to stderr. */
int group_proc_start(group_proc_t *g, int n, const char *const *flags, int attempts,
                     int ready_timeout_ms);

/** Whether rank r is still running (reaps it when it is not). */
int group_proc_alive(group_proc_t *g, int r);

/** SIGTERM to every running rank (by PID), then waits at most timeout_ms in all; ranks still
 * running after that are SIGKILLed. codes[r] (if codes is not NULL) receives each rank's exit
 * status (0..255), 128+signal when a signal ended it, or -1 when it had to be killed. Prints a
 * rank's log when its code is not 0 and removes the logs. Returns the number of ranks whose
 * code is not 0. Safe to call twice (the second call does nothing and returns 0). */
int group_proc_stop(group_proc_t *g, int timeout_ms, int *codes);

/** Prints every rank's log to stderr. */
void group_proc_dump_logs(const group_proc_t *g);

#endif
