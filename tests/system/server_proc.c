/* Spawning embps-server for system tests.
 *
 * The server is started with posix_spawnp on "--listen 127.0.0.1:0", so the kernel picks a
 * free port and parallel test runs never collide; its stdout and stderr go to a mkstemp log
 * file, and the port is read back from the "listening on 127.0.0.1:PORT" line it logs once the
 * socket is bound. Every wait is bounded: the start waits at most 30 s for that line (or the
 * process's death), the stop sends SIGTERM and waits at most the caller's timeout before
 * SIGKILL. The stop returns how the process ended, because a clean exit is part of what the
 * tests check: the server must shut down on SIGTERM with status 0, and under AddressSanitizer
 * a leak makes that status non-zero. */
#define _DEFAULT_SOURCE /* mkstemps */
#include "server_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define START_TIMEOUT_MS 30000
#define MAX_FLAGS 32

double server_proc_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void server_proc_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

const char *server_proc_binary(void) {
  const char *b = getenv("EMBPS_SERVER_BIN");
  return b && *b ? b : "embps-server";
}

void server_proc_dump_log(const server_proc_t *s) {
  FILE *f = fopen(s->log_path, "r");
  char line[1024];
  if (!f)
    return;
  fprintf(stderr, "---- embps-server log (%s) ----\n", s->log_path);
  while (fgets(line, sizeof(line), f))
    fputs(line, stderr);
  fprintf(stderr, "---- end of log ----\n");
  fclose(f);
}

/* Reads the port from the log; 0 while the line is not there yet. */
static int read_port(const char *path) {
  static const char key[] = "listening on 127.0.0.1:";
  FILE *f = fopen(path, "r");
  char line[1024];
  int port = 0;
  if (!f)
    return 0;
  while (!port && fgets(line, sizeof(line), f)) {
    const char *p = strstr(line, key);
    if (p)
      port = atoi(p + sizeof(key) - 1);
  }
  fclose(f);
  return port;
}

int server_proc_log_has(const char *path, const char *needle) {
  FILE *f = fopen(path, "r");
  char line[1024];
  int found = 0;
  if (!f)
    return 0;
  while (!found && fgets(line, sizeof(line), f))
    found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

/* Whether the server's group has formed: it listens before, and answers NOT_SERVING and
 * UNAVAILABLE until then (a race a loaded machine shows). */
static int group_ready(const char *path) { return server_proc_log_has(path, "the group is ready"); }

int server_proc_exit_code(int st) {
  if (WIFEXITED(st))
    return WEXITSTATUS(st);
  if (WIFSIGNALED(st))
    return 128 + WTERMSIG(st);
  return -1;
}

int server_proc_alive(server_proc_t *s) {
  int st;
  if (s->pid <= 0 || s->reaped)
    return 0;
  pid_t r = waitpid(s->pid, &st, WNOHANG);
  if (r == 0)
    return 1;
  s->reaped = 1;
  s->exit_code = r == s->pid ? server_proc_exit_code(st) : -1;
  return 0;
}

int server_proc_start(server_proc_t *s, const char *const *flags) {
  const char *argv[MAX_FLAGS + 4];
  posix_spawn_file_actions_t fa;
  int n = 0, fd, rc;
  double deadline;

  memset(s, 0, sizeof(*s));
  snprintf(s->log_path, sizeof(s->log_path), "%s/embps-server-XXXXXX.log",
           getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  fd = mkstemps(s->log_path, 4);
  if (fd < 0) {
    fprintf(stderr, "server_proc_start: mkstemps: %s\n", strerror(errno));
    return -1;
  }
  close(fd);
  argv[n++] = server_proc_binary();
  argv[n++] = "--listen";
  argv[n++] = "127.0.0.1:0";
  for (int i = 0; flags && flags[i] && n < MAX_FLAGS + 3; i++)
    argv[n++] = flags[i];
  argv[n] = NULL;

  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, s->log_path, O_WRONLY | O_APPEND, 0);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  rc = posix_spawnp(&s->pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    fprintf(stderr, "server_proc_start: cannot spawn %s: %s\n", argv[0], strerror(rc));
    s->pid = 0;
    unlink(s->log_path);
    return -1;
  }

  deadline = server_proc_now_ms() + START_TIMEOUT_MS;
  while (server_proc_now_ms() < deadline) {
    if ((s->port = read_port(s->log_path)) > 0 && group_ready(s->log_path))
      break;
    if (!server_proc_alive(s))
      break;
    server_proc_sleep_ms(10);
  }
  if (s->port <= 0 || !group_ready(s->log_path)) {
    fprintf(stderr, "server_proc_start: %s did not start listening with its group ready\n",
            argv[0]);
    server_proc_dump_log(s);
    if (server_proc_alive(s)) {
      kill(s->pid, SIGKILL);
      waitpid(s->pid, NULL, 0);
    }
    unlink(s->log_path);
    s->pid = 0;
    return -1;
  }
  snprintf(s->address, sizeof(s->address), "127.0.0.1:%d", s->port);
  return 0;
}

int server_proc_stop(server_proc_t *s, int timeout_ms) {
  int code;
  double deadline = server_proc_now_ms() + timeout_ms;

  if (s->pid <= 0)
    return -1;
  if (server_proc_alive(s)) {
    kill(s->pid, SIGTERM);
    while (server_proc_alive(s) && server_proc_now_ms() < deadline)
      server_proc_sleep_ms(10);
    if (server_proc_alive(s)) {
      fprintf(stderr, "server_proc_stop: no exit %d ms after SIGTERM; killing it\n", timeout_ms);
      kill(s->pid, SIGKILL);
      waitpid(s->pid, NULL, 0);
      s->reaped = 1;
      s->exit_code = -1;
    }
  }
  code = s->exit_code;
  if (code != 0) {
    fprintf(stderr, "server_proc_stop: embps-server ended with %d\n", code);
    server_proc_dump_log(s);
  }
  unlink(s->log_path);
  s->pid = 0;
  return code;
}
