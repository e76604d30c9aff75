/* Spawning an embps-server shard group for C tests (see group_proc.h).
 *
 * Ports are picked as tests/group/grouplib.py picks them: client ports at random in
 * 10000-30000 (below the kernel's ephemeral range) and a peer-port offset of 20000 plus a
 * random value under 12000, every client port and every peer port checked free by binding it
 * (no SO_REUSEADDR, so TIME_WAIT counts). A start that still loses a port race is retried with
 * new ports. Ranks are only ever signalled by their own PIDs. */
#define _DEFAULT_SOURCE /* mkstemps */
#include "group_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/embps.h"
#include "tests/system/server_proc.h"

extern char **environ;

#define MAX_FLAGS 32

static uint64_t g_rng;

static uint32_t rnd(void) {
  if (!g_rng) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    g_rng = (((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40)) | 1;
  }
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33);
}

static int port_free(int port) {
  struct sockaddr_in a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), ok;
  if (fd < 0)
    return 0;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
  close(fd);
  return ok;
}

static int pick_ports(group_proc_t *g) {
  for (int tries = 0; tries < 500; tries++) {
    int ok = 1;
    g->offset = 20000 + (int)(rnd() % 12000);
    for (int r = 0; r < g->n && ok; r++) {
      g->ports[r] = 10000 + (int)(rnd() % 20000);
      for (int q = 0; q < r; q++)
        if (g->ports[q] == g->ports[r] || g->ports[q] == g->ports[r] + g->offset ||
            g->ports[q] + g->offset == g->ports[r])
          ok = 0;
      ok = ok && port_free(g->ports[r]) && port_free(g->ports[r] + g->offset);
    }
    if (ok)
      return 0;
  }
  fprintf(stderr, "group_proc: no free loopback ports found\n");
  return -1;
}

int group_proc_alive(group_proc_t *g, int r) {
  int st;
  if (g->pids[r] <= 0 || g->reaped[r])
    return 0;
  pid_t w = waitpid(g->pids[r], &st, WNOHANG);
  if (w == 0)
    return 1;
  g->reaped[r] = 1;
  g->exit_codes[r] = w == g->pids[r] ? server_proc_exit_code(st) : -1;
  return 0;
}

static void dump_log(const group_proc_t *g, int r) {
  FILE *f = fopen(g->log_paths[r], "r");
  char line[1024];
  if (!f)
    return;
  fprintf(stderr, "---- rank %d (pid %d) log (%s) ----\n", r, (int)g->pids[r], g->log_paths[r]);
  while (fgets(line, sizeof(line), f))
    fputs(line, stderr);
  fprintf(stderr, "---- end of rank %d log ----\n", r);
  fclose(f);
}

void group_proc_dump_logs(const group_proc_t *g) {
  for (int r = 0; r < g->n; r++)
    dump_log(g, r);
}

/* SIGKILLs every rank still running, reaps it and removes the logs. */
static void kill_all(group_proc_t *g) {
  for (int r = 0; r < g->n; r++) {
    if (group_proc_alive(g, r)) {
      kill(g->pids[r], SIGKILL);
      waitpid(g->pids[r], NULL, 0);
      g->reaped[r] = 1;
      g->exit_codes[r] = -1;
    }
    if (g->log_paths[r][0])
      unlink(g->log_paths[r]);
    g->log_paths[r][0] = 0;
    g->pids[r] = 0;
  }
}

static int spawn_rank(group_proc_t *g, int r, const char *const *flags) {
  const char *argv[MAX_FLAGS + 10];
  char rank[16], offset[16];
  posix_spawn_file_actions_t fa;
  int n = 0, fd, rc;

  snprintf(g->log_paths[r], sizeof(g->log_paths[r]), "%s/embps-group-XXXXXX.log",
           getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  fd = mkstemps(g->log_paths[r], 4);
  if (fd < 0) {
    fprintf(stderr, "group_proc: mkstemps: %s\n", strerror(errno));
    g->log_paths[r][0] = 0;
    return -1;
  }
  close(fd);
  snprintf(rank, sizeof(rank), "%d", r);
  snprintf(offset, sizeof(offset), "%d", g->offset);
  argv[n++] = server_proc_binary();
  argv[n++] = "--rank";
  argv[n++] = rank;
  argv[n++] = "--peers";
  argv[n++] = g->servers;
  argv[n++] = "--peer-port-offset";
  argv[n++] = offset;
  for (int i = 0; flags && flags[i] && i < MAX_FLAGS; i++)
    argv[n++] = flags[i];
  argv[n] = NULL;

  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, g->log_paths[r], O_WRONLY | O_APPEND, 0);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  rc = posix_spawnp(&g->pids[r], argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    fprintf(stderr, "group_proc: cannot spawn %s: %s\n", argv[0], strerror(rc));
    g->pids[r] = 0;
    return -1;
  }
  g->reaped[r] = 0;
  g->exit_codes[r] = 0;
  return 0;
}

/* Every rank answers health SERVING through libembps, before the deadline. */
static int wait_serving(group_proc_t *g, double deadline) {
  while (server_proc_now_ms() < deadline) {
    embps_client_t *c = NULL;
    embps_client_options_t o;
    embps_error_t err;
    int serving = 0;

    for (int r = 0; r < g->n; r++)
      if (!group_proc_alive(g, r)) {
        fprintf(stderr, "group_proc: rank %d exited with %d before serving\n", r, g->exit_codes[r]);
        return -1;
      }
    embps_client_options_init(&o);
    o.deadline_ms = 2000;
    o.connect_timeout_ms = 2000;
    o.group_size = (uint32_t)g->n;
    embps_error_clear(&err);
    if (embps_client_connect(&c, g->servers, &o, &err) == EMBPS_OK) {
      embps_status_t st = embps_health(c, "", &serving);
      embps_client_free(c);
      if (st == EMBPS_OK && serving)
        return 0;
    }
    server_proc_sleep_ms(50);
  }
  fprintf(stderr, "group_proc: the group did not serve in time\n");
  return -1;
}

static int start_once(group_proc_t *g, const char *const *flags, int ready_timeout_ms) {
  double deadline = server_proc_now_ms() + ready_timeout_ms;
  size_t len = 0;

  if (pick_ports(g) != 0)
    return -1;
  g->servers[0] = 0;
  for (int r = 0; r < g->n; r++)
    len += (size_t)snprintf(g->servers + len, sizeof(g->servers) - len, "%s127.0.0.1:%d",
                            r ? "," : "", g->ports[r]);
  for (int r = 0; r < g->n; r++)
    if (spawn_rank(g, r, flags) != 0)
      return -1;
  for (int r = 0; r < g->n; r++) {
    char pat[64];
    snprintf(pat, sizeof(pat), "listening on 127.0.0.1:%d", g->ports[r]);
    while (!server_proc_log_has(g->log_paths[r], pat)) {
      if (!group_proc_alive(g, r) || server_proc_now_ms() >= deadline) {
        fprintf(stderr, "group_proc: rank %d did not listen on port %d\n", r, g->ports[r]);
        return -1;
      }
      server_proc_sleep_ms(10);
    }
  }
  return wait_serving(g, deadline);
}

int group_proc_start(group_proc_t *g, int n, const char *const *flags, int attempts,
                     int ready_timeout_ms) {
  memset(g, 0, sizeof(*g));
  if (n < 1 || n > GROUP_PROC_MAX_RANKS)
    return -1;
  g->n = n;
  for (int a = 0; a < attempts; a++) {
    if (start_once(g, flags, ready_timeout_ms) == 0)
      return 0;
    fprintf(stderr, "group_proc: attempt %d of %d to start a %d-rank group failed\n", a + 1,
            attempts, n);
    group_proc_dump_logs(g);
    kill_all(g);
  }
  return -1;
}

int group_proc_stop(group_proc_t *g, int timeout_ms, int *codes) {
  double deadline = server_proc_now_ms() + timeout_ms;
  int bad = 0, any = 0;

  for (int r = 0; r < g->n; r++)
    if (g->pids[r] > 0) {
      any = 1;
      if (group_proc_alive(g, r))
        kill(g->pids[r], SIGTERM);
    }
  if (!any)
    return 0;
  for (int r = 0; r < g->n; r++) {
    if (g->pids[r] <= 0)
      continue;
    while (group_proc_alive(g, r) && server_proc_now_ms() < deadline)
      server_proc_sleep_ms(10);
    if (group_proc_alive(g, r)) {
      fprintf(stderr, "group_proc: rank %d (pid %d) did not exit %d ms after SIGTERM; killing it\n",
              r, (int)g->pids[r], timeout_ms);
      kill(g->pids[r], SIGKILL);
      waitpid(g->pids[r], NULL, 0);
      g->reaped[r] = 1;
      g->exit_codes[r] = -1;
    }
  }
  for (int r = 0; r < g->n; r++) {
    if (g->pids[r] <= 0)
      continue;
    if (codes)
      codes[r] = g->exit_codes[r];
    if (g->exit_codes[r] != 0) {
      bad++;
      fprintf(stderr, "group_proc: rank %d ended with %d\n", r, g->exit_codes[r]);
      dump_log(g, r);
    }
    unlink(g->log_paths[r]);
    g->log_paths[r][0] = 0;
    g->pids[r] = 0;
  }
  return bad;
}
