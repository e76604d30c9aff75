/* A real embps-server process for system tests: start it on a free loopback port, stop it and
 * learn how it exited. */
#ifndef EMBPS_TEST_SERVER_PROC_H
#define EMBPS_TEST_SERVER_PROC_H

#include <sys/types.h>

typedef struct server_proc {
  pid_t pid;          /* 0 when never started or already stopped */
  int reaped;         /* the process has exited and exit_code holds how */
  int exit_code;      /* as server_proc_stop returns it */
  int port;           /* the port it listens on, parsed from its log */
  char address[64];   /* "127.0.0.1:PORT" */
  char log_path[256]; /* its stdout and stderr */
} server_proc_t;

/** The server binary: $EMBPS_SERVER_BIN, else "embps-server" on PATH. Static string. */
const char *server_proc_binary(void);

/** Starts `embps-server --listen 127.0.0.1:0 FLAGS...` (flags: NULL-terminated, may be NULL)
 * with its output in a temporary log file, and waits (at most 30 s) for its "listening on"
 * line and its group's "the group is ready" line (before that it answers NOT_SERVING). Returns 0
 * with *s filled, or -1 (the log is printed to stderr and the process killed). */
int server_proc_start(server_proc_t *s, const char *const *flags);

/** Whether the process is still running (it is reaped when it is not). */
int server_proc_alive(server_proc_t *s);

/** Sends SIGTERM and waits at most timeout_ms for the exit; kills it after that. Returns the
 * exit status (0..255), 128+signal when a signal ended it, or -1 when it had to be killed
 * (or was never started). A process that already exited gives its own exit code. Prints the log to
 * stderr when the result is not 0. Removes the log. */
int server_proc_stop(server_proc_t *s, int timeout_ms);

/** Prints the server's log to stderr (for failing tests). */
void server_proc_dump_log(const server_proc_t *s);

/** Milliseconds on a monotonic clock. */
double server_proc_now_ms(void);

/** Sleeps ms milliseconds. */
void server_proc_sleep_ms(int ms);

/** Whether the file at path (a server's log) has a line containing needle. */
int server_proc_log_has(const char *path, const char *needle);

/** A waitpid status as server_proc_stop reports it: the exit code, or 128+signal. */
int server_proc_exit_code(int wait_status);

#endif
