/* server/group/bootstrap.c (with bootstrap_dial.c and bootstrap_accept.c): whole groups
 * bootstrapping as threads of one process, on loopback.
 *
 * Ports are picked by binding port 0 and closing; if another process steals one before a rank
 * binds it (the rank reports UNAVAILABLE), the group is run again on fresh ports. Threads start
 * in a random order with staggered delays (the seed is printed), and every wait is bounded by
 * the bootstrap's own timeout. */
/* cmocka.h needs these first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "server/group/bootstrap.h"
#include "server/group/control.h"
#include "server/group/group.h"

#define MAX_RANKS 4
#define TIMEOUT_MS 1500
/* Slack over the timeout for a failing rank to return (sanitizers and busy CI included). */
#define SLACK_MS 1500
#define PORT_TRIES 5

typedef struct rank_run {
  uint32_t rank, size;
  const char *addrs[MAX_RANKS];
  char addr_buf[MAX_RANKS][64];
  char identity[512];
  const uint8_t *secret; /* the group secret (secret_len bytes); none by default */
  size_t secret_len;
  int bind_any;
  uint64_t timeout_ms;
  unsigned delay_ms;
  int present;   /* 0: this rank is never started */
  int cancel_fd; /* passed to the bootstrap; -1 by default */
  int control_fds[MAX_RANKS], data_fds[MAX_RANKS];
  embps_status_t status;
  embps_error_t err;
  uint64_t elapsed_ms;
} rank_run_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* n distinct free loopback ports: all bound at once, then closed. */
static void free_ports(unsigned n, unsigned *ports) {
  int fds[MAX_RANKS + 2];
  for (unsigned i = 0; i < n; i++) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    fds[i] = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fds[i] >= 0);
    assert_int_equal(bind(fds[i], (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(getsockname(fds[i], (struct sockaddr *)&a, &len), 0);
    ports[i] = ntohs(a.sin_port);
  }
  for (unsigned i = 0; i < n; i++)
    close(fds[i]);
}

static void *rank_main(void *arg) {
  rank_run_t *r = arg;
  sleep_ms(r->delay_ms);
  uint64_t t0 = now_ms();
  r->status = embps_group_bootstrap(r->rank, r->size, r->addrs, r->bind_any, r->identity, r->secret,
                                    r->secret_len, NULL, r->timeout_ms, r->cancel_fd,
                                    r->control_fds, r->data_fds, &r->err);
  r->elapsed_ms = now_ms() - t0;
  return NULL;
}

static void make_identity(char *out, size_t cap, const char *mesh, uint32_t size) {
  snprintf(out, cap, "mesh=%s\ntable_axis=shard\ndata_axis=shard\npeers=n%u\nversion=0.1.0\n", mesh,
           size);
}

/* Fills runs[0..n) for a group of n on fresh loopback ports: same identity, every rank present,
 * random delays up to max_delay_ms. Tests then adjust what they need. */
static void setup_group(rank_run_t *runs, uint32_t n, unsigned max_delay_ms) {
  unsigned ports[MAX_RANKS];
  free_ports(n, ports);
  for (uint32_t i = 0; i < n; i++) {
    rank_run_t *r = &runs[i];
    memset(r, 0, sizeof(*r));
    r->rank = i;
    r->size = n;
    for (uint32_t j = 0; j < n; j++) {
      snprintf(r->addr_buf[j], sizeof(r->addr_buf[j]), "127.0.0.1:%u", ports[j]);
      r->addrs[j] = r->addr_buf[j];
    }
    make_identity(r->identity, sizeof(r->identity), "shard=4", n);
    r->timeout_ms = TIMEOUT_MS;
    r->delay_ms = max_delay_ms ? (unsigned)rand() % max_delay_ms : 0;
    r->present = 1;
    r->cancel_fd = -1;
    for (uint32_t j = 0; j < MAX_RANKS; j++)
      r->control_fds[j] = r->data_fds[j] = -2;
  }
}

/* Starts the present ranks in random order and joins them. Returns 1 when some rank could not
 * bind its port (stolen by another process): the caller retries on fresh ports. */
static int run_group(rank_run_t *runs, uint32_t n) {
  pthread_t threads[MAX_RANKS];
  uint32_t order[MAX_RANKS];
  for (uint32_t i = 0; i < n; i++)
    order[i] = i;
  for (uint32_t i = n; i > 1; i--) {
    uint32_t j = (uint32_t)rand() % i, t = order[i - 1];
    order[i - 1] = order[j];
    order[j] = t;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (runs[order[i]].present)
      assert_int_equal(pthread_create(&threads[order[i]], NULL, rank_main, &runs[order[i]]), 0);
    sleep_ms((unsigned)rand() % 20);
  }
  int stolen = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (!runs[i].present)
      continue;
    assert_int_equal(pthread_join(threads[i], NULL), 0);
    if (runs[i].status == EMBPS_UNAVAILABLE && strstr(runs[i].err.message, "cannot listen"))
      stolen = 1;
  }
  return stolen;
}

static void close_all(rank_run_t *runs, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < n; j++) {
      if (runs[i].control_fds[j] >= 0)
        close(runs[i].control_fds[j]);
      if (runs[i].data_fds[j] >= 0)
        close(runs[i].data_fds[j]);
      runs[i].control_fds[j] = runs[i].data_fds[j] = -1;
    }
}

static void assert_fds_closed_state(const rank_run_t *r) {
  for (uint32_t j = 0; j < r->size; j++) {
    assert_int_equal(r->control_fds[j], -1);
    assert_int_equal(r->data_fds[j], -1);
  }
}

/* One byte each way over the pair (a's fd to b, b's fd to a). */
static void check_pair(int fd_ab, int fd_ba, uint8_t tag) {
  uint8_t got = 0, out = tag;
  assert_true(fd_ab >= 0 && fd_ba >= 0);
  assert_int_equal(send(fd_ab, &out, 1, MSG_NOSIGNAL), 1);
  assert_int_equal(recv(fd_ba, &got, 1, 0), 1);
  assert_int_equal(got, tag);
  out = (uint8_t)(tag ^ 0xff);
  assert_int_equal(send(fd_ba, &out, 1, MSG_NOSIGNAL), 1);
  assert_int_equal(recv(fd_ab, &got, 1, 0), 1);
  assert_int_equal(got, (uint8_t)(tag ^ 0xff));
}

static void check_socket(int fd) {
  int flags = fcntl(fd, F_GETFL), nodelay = 0;
  socklen_t len = sizeof(nodelay);
  assert_true(flags >= 0);
  assert_false(flags & O_NONBLOCK);
  assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
  assert_int_equal(getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, &len), 0);
  assert_true(nodelay);
}

static int connect_loopback(unsigned port) {
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static unsigned port_of(const char *addr) { return (unsigned)atoi(strrchr(addr, ':') + 1); }

/* Checks a successful group: every rank OK, fds wired pairwise, listeners closed. */
static void check_group_ok(rank_run_t *runs, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    if (runs[i].status != EMBPS_OK)
      print_error("rank %u: %s\n", i, runs[i].err.message);
    assert_int_equal(runs[i].status, EMBPS_OK);
    assert_int_equal(runs[i].control_fds[i], -1);
    assert_int_equal(runs[i].data_fds[i], -1);
  }
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < n; j++) {
      if (i == j)
        continue;
      check_socket(runs[i].control_fds[j]);
      check_socket(runs[i].data_fds[j]);
      if (i < j) {
        check_pair(runs[i].control_fds[j], runs[j].control_fds[i], (uint8_t)(16 * i + j));
        check_pair(runs[i].data_fds[j], runs[j].data_fds[i], (uint8_t)(128 + 16 * i + j));
      }
    }
  /* Nothing is left to read (the ready bytes were consumed exactly), and the listeners are
   * gone. */
  for (uint32_t i = 0; i < n; i++) {
    for (uint32_t j = 0; j < n; j++) {
      uint8_t b;
      if (i == j)
        continue;
      assert_int_equal(recv(runs[i].control_fds[j], &b, 1, MSG_DONTWAIT), -1);
      assert_int_equal(recv(runs[i].data_fds[j], &b, 1, MSG_DONTWAIT), -1);
    }
    int fd = connect_loopback(port_of(runs[i].addrs[i]));
    assert_int_equal(fd, -1);
  }
}

static void test_group_of_one(void **state) {
  rank_run_t r;
  (void)state;
  setup_group(&r, 1, 0);
  r.addrs[0] = "not an address"; /* a group of one touches no socket */
  rank_main(&r);
  assert_int_equal(r.status, EMBPS_OK);
  assert_int_equal(r.control_fds[0], -1);
  assert_int_equal(r.data_fds[0], -1);
  assert_true(r.elapsed_ms < 100);
}

static void bootstrap_ok(uint32_t n, unsigned max_delay, int bind_any, int use_localhost) {
  rank_run_t runs[MAX_RANKS];
  for (int attempt = 0;; attempt++) {
    assert_true(attempt < PORT_TRIES);
    setup_group(runs, n, max_delay);
    for (uint32_t i = 0; i < n; i++) {
      runs[i].bind_any = bind_any;
      runs[i].timeout_ms = 10000;
      if (use_localhost)
        for (uint32_t j = 0; j < n; j++) {
          unsigned port = port_of(runs[i].addr_buf[j]);
          snprintf(runs[i].addr_buf[j], sizeof(runs[i].addr_buf[j]), "localhost:%u", port);
        }
    }
    if (n == 3) /* the same keys in another order are the same configuration */
      snprintf(runs[1].identity, sizeof(runs[1].identity),
               "version=0.1.0\npeers=n3\ndata_axis=shard\n\ntable_axis=shard\nmesh=shard=4");
    if (!run_group(runs, n))
      break;
    close_all(runs, n);
  }
  check_group_ok(runs, n);
  close_all(runs, n);
}

static void test_groups_bootstrap(void **state) {
  (void)state;
  for (int round = 0; round < 3; round++) {
    bootstrap_ok(2, 200, 0, 0);
    bootstrap_ok(3, 300, 0, 0);
    bootstrap_ok(4, 400, 0, 0);
  }
  bootstrap_ok(4, 0, 0, 0); /* all at once */
  bootstrap_ok(3, 200, 1, 0);
  bootstrap_ok(2, 100, 0, 1);
}

static void test_ipv6(void **state) {
  (void)state;
  int fd = socket(AF_INET6, SOCK_STREAM, 0);
  struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    if (fd >= 0)
      close(fd);
    skip();
  }
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  unsigned port0 = ntohs(a.sin6_port);
  int fd1 = socket(AF_INET6, SOCK_STREAM, 0);
  a.sin6_port = 0;
  assert_int_equal(bind(fd1, (struct sockaddr *)&a, sizeof(a)), 0);
  assert_int_equal(getsockname(fd1, (struct sockaddr *)&a, &len), 0);
  unsigned port1 = ntohs(a.sin6_port);
  close(fd);
  close(fd1);
  rank_run_t runs[2];
  setup_group(runs, 2, 100);
  for (uint32_t i = 0; i < 2; i++) {
    snprintf(runs[i].addr_buf[0], sizeof(runs[i].addr_buf[0]), "[::1]:%u", port0);
    snprintf(runs[i].addr_buf[1], sizeof(runs[i].addr_buf[1]), "[::1]:%u", port1);
  }
  if (run_group(runs, 2)) {
    close_all(runs, 2);
    skip(); /* a port was stolen; the IPv4 tests cover the retry */
  }
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(runs[i].status, EMBPS_OK);
  check_pair(runs[0].control_fds[1], runs[1].control_fds[0], 7);
  check_pair(runs[0].data_fds[1], runs[1].data_fds[0], 9);
  close_all(runs, 2);
}

/* Runs a prepared failing scenario, retrying on stolen ports via the setup callback. */
typedef void (*scenario_fn)(rank_run_t *runs, uint32_t n);

static void run_failing(rank_run_t *runs, uint32_t n, scenario_fn adjust) {
  for (int attempt = 0;; attempt++) {
    assert_true(attempt < PORT_TRIES);
    setup_group(runs, n, 100);
    adjust(runs, n);
    if (!run_group(runs, n))
      break;
    close_all(runs, n);
  }
  for (uint32_t i = 0; i < n; i++) {
    if (!runs[i].present)
      continue;
    print_message("rank %u: %s (%llu ms): %s\n", i, embps_status_name(runs[i].status),
                  (unsigned long long)runs[i].elapsed_ms, runs[i].err.message);
    assert_int_not_equal(runs[i].status, EMBPS_OK);
    assert_true(runs[i].elapsed_ms < runs[i].timeout_ms + SLACK_MS);
    assert_fds_closed_state(&runs[i]);
  }
}

static void assert_contains(const char *msg, const char *part) {
  if (!strstr(msg, part))
    fail_msg("'%s' does not contain '%s'", msg, part);
}

static void mesh_differs_on_rank1(rank_run_t *runs, uint32_t n) {
  make_identity(runs[1].identity, sizeof(runs[1].identity), "shard=2", n);
}

static void test_identity_mismatch(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 2, mesh_differs_on_rank1);
  /* The refused rank fails at once; the refusing rank when its deadline passes. */
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_true(runs[1].elapsed_ms < TIMEOUT_MS);
  assert_int_equal(runs[0].status, EMBPS_FAILED_PRECONDITION);
  assert_true(runs[0].elapsed_ms + 50 >= TIMEOUT_MS);
  for (int i = 0; i < 2; i++) {
    assert_contains(runs[i].err.message, "rank 1's configuration differs from rank 0's");
    assert_contains(runs[i].err.message, "mesh is 'shard=2' there and 'shard=4' here");
  }
}

static void key_missing_on_rank2(rank_run_t *runs, uint32_t n) {
  (void)n;
  snprintf(runs[2].identity, sizeof(runs[2].identity),
           "mesh=shard=4\ntable_axis=shard\npeers=n3\nversion=0.1.0\n");
}

static void test_identity_key_missing(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 3, key_missing_on_rank2);
  assert_int_equal(runs[2].status, EMBPS_FAILED_PRECONDITION);
  assert_int_equal(runs[0].status, EMBPS_FAILED_PRECONDITION);
  for (int i = 0; i < 3; i += 2)
    assert_contains(runs[i].err.message, "data_axis is not set there and 'shard' here");
  /* Rank 1 joined rank 0 but rank 2 gave up before reaching it. */
  assert_int_equal(runs[1].status, EMBPS_DEADLINE_EXCEEDED);
  assert_contains(runs[1].err.message, "missing ranks: 2");
}

static void size_differs_on_rank1(rank_run_t *runs, uint32_t n) {
  (void)n;
  unsigned extra;
  free_ports(1, &extra);
  runs[1].size = 3;
  snprintf(runs[1].addr_buf[2], sizeof(runs[1].addr_buf[2]), "127.0.0.1:%u", extra);
  runs[1].addrs[2] = runs[1].addr_buf[2];
}

static void test_size_mismatch(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 2, size_differs_on_rank1);
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_true(runs[1].elapsed_ms < TIMEOUT_MS);
  assert_int_equal(runs[0].status, EMBPS_FAILED_PRECONDITION);
  for (int i = 0; i < 2; i++)
    assert_contains(runs[i].err.message, "size is 3 there and 2 here");
}

static void rank2_absent(rank_run_t *runs, uint32_t n) {
  (void)n;
  runs[2].present = 0;
}

static void rank0_absent(rank_run_t *runs, uint32_t n) {
  (void)n;
  runs[0].present = 0;
}

static void test_missing_rank(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 3, rank2_absent);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(runs[i].status, EMBPS_DEADLINE_EXCEEDED);
    assert_true(runs[i].elapsed_ms + 50 >= TIMEOUT_MS);
    assert_contains(runs[i].err.message, "missing ranks: 2");
  }
  run_failing(runs, 3, rank0_absent);
  for (int i = 1; i < 3; i++) {
    assert_int_equal(runs[i].status, EMBPS_DEADLINE_EXCEEDED);
    assert_true(runs[i].elapsed_ms + 50 >= TIMEOUT_MS);
    assert_contains(runs[i].err.message, "missing ranks: 0");
  }
}

/* ---- the group secret ---- */

static const uint8_t SECRET[] = "0123456789abcdef-the-group-secret";
static const uint8_t OTHER_SECRET[] = "0123456789abcdef-another-secret!!";

static void give_secret(rank_run_t *r, const uint8_t *secret, size_t len) {
  r->secret = secret;
  r->secret_len = len;
}

/* Ranks that share a secret form the group as without one, whatever the order they start in. */
static void test_secret_group_forms(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  for (uint32_t n = 2; n <= 4; n++) {
    for (int attempt = 0;; attempt++) {
      assert_true(attempt < PORT_TRIES);
      setup_group(runs, n, 200);
      for (uint32_t i = 0; i < n; i++) {
        give_secret(&runs[i], SECRET, sizeof(SECRET) - 1);
        runs[i].timeout_ms = 10000;
      }
      if (!run_group(runs, n))
        break;
      close_all(runs, n);
    }
    check_group_ok(runs, n);
    close_all(runs, n);
  }
}

static void all_secret_rank1_other(rank_run_t *runs, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    give_secret(&runs[i], SECRET, sizeof(SECRET) - 1);
  give_secret(&runs[1], OTHER_SECRET, sizeof(OTHER_SECRET) - 1);
}

/* A rank with another secret is refused: it fails at once, the rank that refused it when its
 * deadline passes, both naming the rank that failed the check and where it came from. */
static void test_secret_differs(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 2, all_secret_rank1_other);
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_true(runs[1].elapsed_ms < TIMEOUT_MS);
  assert_int_equal(runs[0].status, EMBPS_FAILED_PRECONDITION);
  assert_true(runs[0].elapsed_ms + 50 >= TIMEOUT_MS);
  for (int i = 0; i < 2; i++)
    assert_contains(runs[i].err.message, "rank 1 at 127.0.0.1:");
  for (int i = 0; i < 2; i++)
    assert_contains(runs[i].err.message, "failed the group secret check");
}

static void secret_on_rank0_only(rank_run_t *runs, uint32_t n) {
  (void)n;
  give_secret(&runs[0], SECRET, sizeof(SECRET) - 1);
}

static void secret_on_rank1_only(rank_run_t *runs, uint32_t n) {
  (void)n;
  give_secret(&runs[1], SECRET, sizeof(SECRET) - 1);
}

/* A rank without the secret cannot join one with it, and a rank with it does not join one
 * that accepts without asking (it may be anybody). */
static void test_secret_on_one_side(void **state) {
  rank_run_t runs[MAX_RANKS];
  (void)state;
  run_failing(runs, 2, secret_on_rank0_only);
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_contains(runs[1].err.message, "asks for the group secret and rank 1 has none");
  assert_int_equal(runs[0].status, EMBPS_FAILED_PRECONDITION);
  assert_contains(runs[0].err.message, "rank 1 at 127.0.0.1:");
  assert_contains(runs[0].err.message, "failed the group secret check");
  run_failing(runs, 2, secret_on_rank1_only);
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_contains(runs[1].err.message, "rank 0 at 127.0.0.1:");
  assert_contains(runs[1].err.message, "failed the group secret check");
  assert_contains(runs[1].err.message, "without a challenge");
}

/* What the impostor saw. */
typedef struct impostor {
  unsigned port;
  const char *identity;
  int challenge_byte; /* the first byte of rank 0's answer to the hello */
  int verdict_byte;   /* and of its answer to the forged proof */
  char message[512];  /* that answer's message */
} impostor_t;

static int recv_exact(int fd, void *p, size_t n) {
  size_t have = 0;
  while (have < n) {
    ssize_t k = recv(fd, (uint8_t *)p + have, n - have, 0);
    if (k <= 0)
      return -1;
    have += (size_t)k;
  }
  return 0;
}

/* Speaks the hello as a rank 1 without the secret would: its configuration copied from the
 * real one (the version and mesh are public), then 64 bytes of made-up answer. */
static void *impostor_main(void *arg) {
  impostor_t *im = arg;
  struct timeval tv = {.tv_sec = 5};
  uint8_t vh[EMBPS__VERDICT_HEADER_LEN], nonce[EMBPS__NONCE_LEN], forged[EMBPS__AUTH_LEN];
  embps__buf_t hello = {0};
  int fd = -1;
  for (int i = 0; i < 200 && fd < 0; i++) { /* until rank 0 listens: 2 s at most */
    fd = connect_loopback(im->port);
    if (fd < 0)
      sleep_ms(10);
  }
  assert_true(fd >= 0);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  assert_int_equal(embps__hello_encode(&hello, EMBPS_GROUP_CONN_CONTROL, 1, 2, im->identity,
                                       strlen(im->identity)),
                   EMBPS_OK);
  assert_int_equal(send(fd, hello.data, hello.len, MSG_NOSIGNAL), (ssize_t)hello.len);
  embps__buf_free(&hello);
  assert_int_equal(recv_exact(fd, vh, sizeof(vh)), 0);
  im->challenge_byte = vh[0];
  if (vh[0] == 2) {
    assert_int_equal(recv_exact(fd, nonce, sizeof(nonce)), 0);
    memset(forged, 0x5a, sizeof(forged));
    assert_int_equal(send(fd, forged, sizeof(forged), MSG_NOSIGNAL), (ssize_t)sizeof(forged));
    assert_int_equal(recv_exact(fd, vh, sizeof(vh)), 0);
    im->verdict_byte = vh[0];
    size_t len = (size_t)(vh[1] | vh[2] << 8);
    assert_true(len < sizeof(im->message));
    assert_int_equal(recv_exact(fd, im->message, len), 0);
    im->message[len] = '\0';
  }
  close(fd);
  return NULL;
}

/* A process that copies rank 1's hello but not the secret is refused before it counts as a
 * rank, and the real rank 1, coming later, still forms the group with rank 0. */
static void test_impostor_refused(void **state) {
  rank_run_t runs[MAX_RANKS];
  impostor_t im;
  pthread_t t;
  (void)state;
  for (int attempt = 0;; attempt++) {
    assert_true(attempt < PORT_TRIES);
    setup_group(runs, 2, 0);
    memset(&im, 0, sizeof(im));
    im.port = port_of(runs[0].addrs[0]);
    im.identity = runs[1].identity;
    im.challenge_byte = im.verdict_byte = -1;
    for (uint32_t i = 0; i < 2; i++) {
      give_secret(&runs[i], SECRET, sizeof(SECRET) - 1);
      runs[i].timeout_ms = 10000;
    }
    runs[1].delay_ms = 600; /* after the impostor */
    assert_int_equal(pthread_create(&t, NULL, impostor_main, &im), 0);
    int stolen = run_group(runs, 2);
    assert_int_equal(pthread_join(t, NULL), 0);
    if (!stolen)
      break;
    close_all(runs, 2);
  }
  assert_int_equal(im.challenge_byte, 2); /* challenged, not accepted */
  assert_int_equal(im.verdict_byte, 1);   /* refused */
  assert_contains(im.message, "rank 1 at 127.0.0.1:");
  assert_contains(im.message, "failed the group secret check");
  check_group_ok(runs, 2);
  close_all(runs, 2);
}

/* A listener on rank 0's port that challenges like rank 0 but cannot prove the secret. */
typedef struct rogue {
  int listen_fd;
  int answered; /* it got a whole answer to its challenge */
} rogue_t;

static void *rogue_main(void *arg) {
  rogue_t *rg = arg;
  struct timeval tv = {.tv_sec = 5};
  uint8_t header[EMBPS__HELLO_HEADER_LEN], identity[512], answer[EMBPS__AUTH_LEN];
  uint8_t bytes[EMBPS__VERDICT_HEADER_LEN + EMBPS__NONCE_LEN], fake[EMBPS__PROOF_LEN];
  embps__buf_t v = {bytes, 0, sizeof(bytes)};
  embps__hello_t h;
  int fd = accept(rg->listen_fd, NULL, NULL);
  assert_true(fd >= 0);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  assert_int_equal(recv_exact(fd, header, sizeof(header)), 0);
  assert_int_equal(embps__hello_decode(header, &h, NULL), EMBPS_OK);
  assert_true(h.identity_len <= sizeof(identity));
  assert_int_equal(recv_exact(fd, identity, h.identity_len), 0);
  memset(fake, 0x33, sizeof(fake));
  assert_int_equal(
      embps__verdict_encode_bytes(&v, EMBPS__VERDICT_CHALLENGE, fake, EMBPS__NONCE_LEN), EMBPS_OK);
  assert_int_equal(send(fd, v.data, v.len, MSG_NOSIGNAL), (ssize_t)v.len);
  rg->answered = recv_exact(fd, answer, sizeof(answer)) == 0;
  v.len = 0;
  assert_int_equal(embps__verdict_encode_bytes(&v, EMBPS__VERDICT_ACCEPTED, fake, sizeof(fake)),
                   EMBPS_OK);
  send(fd, v.data, v.len, MSG_NOSIGNAL);
  close(fd);
  return NULL;
}

/* A rank does not join a rank 0 that cannot prove the secret, whatever it answers. */
static void test_rogue_acceptor(void **state) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(a);
  rank_run_t runs[MAX_RANKS];
  rogue_t rg = {.listen_fd = socket(AF_INET, SOCK_STREAM, 0)};
  pthread_t t;
  (void)state;
  assert_true(rg.listen_fd >= 0);
  assert_int_equal(bind(rg.listen_fd, (struct sockaddr *)&a, sizeof(a)), 0);
  assert_int_equal(listen(rg.listen_fd, 4), 0);
  assert_int_equal(getsockname(rg.listen_fd, (struct sockaddr *)&a, &len), 0);
  setup_group(runs, 2, 0);
  snprintf(runs[1].addr_buf[0], sizeof(runs[1].addr_buf[0]), "127.0.0.1:%u", ntohs(a.sin_port));
  give_secret(&runs[1], SECRET, sizeof(SECRET) - 1);
  assert_int_equal(pthread_create(&t, NULL, rogue_main, &rg), 0);
  rank_main(&runs[1]);
  assert_int_equal(pthread_join(t, NULL), 0);
  close(rg.listen_fd);
  assert_true(rg.answered);
  assert_int_equal(runs[1].status, EMBPS_FAILED_PRECONDITION);
  assert_contains(runs[1].err.message, "rank 0 at 127.0.0.1:");
  assert_contains(runs[1].err.message, "failed the group secret check");
  assert_fds_closed_state(&runs[1]);
}

/* ---- cancellation (SIGTERM while the group forms) ---- */

static int cancel_efd = -1;

static void rank2_absent_cancellable(rank_run_t *runs, uint32_t n) {
  runs[2].present = 0;
  for (uint32_t i = 0; i < n; i++)
    runs[i].cancel_fd = cancel_efd;
}

static void *cancel_later(void *arg) {
  uint64_t one = 1;
  (void)arg;
  sleep_ms(300);
  assert_int_equal(write(cancel_efd, &one, sizeof(one)), (ssize_t)sizeof(one));
  return NULL;
}

/* Ranks waiting for a rank that never comes stop at once when their cancel descriptor becomes
 * readable, with EMBPS_CANCELLED and nothing left open, instead of waiting out the timeout. */
static void test_cancelled(void **state) {
  rank_run_t runs[MAX_RANKS];
  pthread_t canceller;
  (void)state;
  cancel_efd = eventfd(0, EFD_CLOEXEC);
  assert_true(cancel_efd >= 0);
  assert_int_equal(pthread_create(&canceller, NULL, cancel_later, NULL), 0);
  run_failing(runs, 3, rank2_absent_cancellable);
  assert_int_equal(pthread_join(canceller, NULL), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(runs[i].status, EMBPS_CANCELLED);
    assert_contains(runs[i].err.message, "shutting down");
    assert_true(runs[i].elapsed_ms < TIMEOUT_MS - 500);
  }
  close(cancel_efd);
  cancel_efd = -1;
}

/* Returns 1 when the server closed fd (EOF or reset) within ms. */
static int closed_within(int fd, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  uint8_t buf[64];
  uint64_t end = now_ms() + (uint64_t)ms;
  while (now_ms() < end) {
    if (poll(&p, 1, (int)(end - now_ms())) <= 0)
      continue;
    ssize_t k = recv(fd, buf, sizeof(buf), 0);
    if (k == 0 || (k < 0 && errno == ECONNRESET))
      return 1;
    if (k > 0)
      return 0; /* the server must not answer garbage */
  }
  return 0;
}

static void test_garbage_ignored(void **state) {
  static const char h2_preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  rank_run_t runs[2];
  pthread_t t0, t1;
  (void)state;
  for (int attempt = 0;; attempt++) {
    assert_true(attempt < PORT_TRIES);
    setup_group(runs, 2, 0);
    runs[0].timeout_ms = runs[1].timeout_ms = 10000;
    assert_int_equal(pthread_create(&t0, NULL, rank_main, &runs[0]), 0);
    unsigned port0 = port_of(runs[0].addrs[0]);
    int garbage = -1;
    for (int i = 0; i < 200 && garbage < 0; i++) {
      garbage = connect_loopback(port0);
      if (garbage < 0)
        sleep_ms(10);
    }
    if (garbage < 0) { /* rank 0 never listened: its port was stolen */
      assert_int_equal(pthread_join(t0, NULL), 0);
      assert_int_equal(runs[0].status, EMBPS_UNAVAILABLE);
      continue;
    }
    int idle = connect_loopback(port0);    /* connects and says nothing */
    int partial = connect_loopback(port0); /* starts like a peer, then stalls */
    int bad_magic = connect_loopback(port0);
    assert_true(idle >= 0 && partial >= 0 && bad_magic >= 0);
    assert_int_equal(send(garbage, h2_preface, sizeof(h2_preface) - 1, MSG_NOSIGNAL),
                     (ssize_t)sizeof(h2_preface) - 1);
    assert_int_equal(send(partial, "EMB", 3, MSG_NOSIGNAL), 3);
    assert_int_equal(send(bad_magic, "EMBPS2xxxxxxxxxxxxxxxxxxx", 25, MSG_NOSIGNAL), 25);
    /* Rank 0 drops the garbage without waiting for the group. */
    assert_true(closed_within(garbage, 3000));
    assert_true(closed_within(bad_magic, 3000));
    assert_int_equal(pthread_create(&t1, NULL, rank_main, &runs[1]), 0);
    assert_int_equal(pthread_join(t0, NULL), 0);
    assert_int_equal(pthread_join(t1, NULL), 0);
    /* Connections still pending when the group is up are closed too. */
    assert_true(closed_within(idle, 3000));
    assert_true(closed_within(partial, 3000));
    close(garbage);
    close(idle);
    close(partial);
    close(bad_magic);
    if (runs[1].status == EMBPS_UNAVAILABLE && strstr(runs[1].err.message, "cannot listen")) {
      close_all(runs, 2);
      continue;
    }
    break;
  }
  check_group_ok(runs, 2);
  close_all(runs, 2);
}

static void test_bind_failure(void **state) {
  rank_run_t runs[2];
  (void)state;
  setup_group(runs, 2, 0);
  /* Someone else listens on rank 0's port. */
  int other = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(a);
  assert_int_equal(bind(other, (struct sockaddr *)&a, sizeof(a)), 0);
  assert_int_equal(listen(other, 1), 0);
  assert_int_equal(getsockname(other, (struct sockaddr *)&a, &len), 0);
  snprintf(runs[0].addr_buf[0], sizeof(runs[0].addr_buf[0]), "127.0.0.1:%u", ntohs(a.sin_port));
  rank_main(&runs[0]);
  close(other);
  assert_int_equal(runs[0].status, EMBPS_UNAVAILABLE);
  assert_true(runs[0].elapsed_ms < 500);
  assert_contains(runs[0].err.message, "cannot listen");
  assert_contains(runs[0].err.message, "in use");
  assert_fds_closed_state(&runs[0]);
}

static void test_invalid_arguments(void **state) {
  static const char *const bad_addrs[] = {"noport", "host:",   "host:0", "host:65536", ":80",
                                          "::1:80", "[::1]80", "[::1]",  "a b:80",     "h:8x"};
  rank_run_t runs[2];
  embps_error_t err;
  int cfd[2], dfd[2];
  (void)state;
  setup_group(runs, 2, 0);
  const char *const *addrs = runs[0].addrs;
  assert_int_equal(
      embps_group_bootstrap(2, 2, addrs, 0, "x=1\n", NULL, 0, NULL, 100, -1, cfd, dfd, &err),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_group_bootstrap(0, 0, addrs, 0, "x=1\n", NULL, 0, NULL, 100, -1, cfd, dfd, &err),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_group_bootstrap(0, 2, addrs, 0, NULL, NULL, 0, NULL, 100, -1, cfd, dfd, &err),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_group_bootstrap(0, 2, NULL, 0, "x=1\n", NULL, 0, NULL, 100, -1, cfd, dfd, &err),
      EMBPS_INVALID_ARGUMENT);
  for (size_t i = 0; i < sizeof(bad_addrs) / sizeof(bad_addrs[0]); i++) {
    const char *list[2] = {runs[0].addrs[0], bad_addrs[i]};
    cfd[0] = cfd[1] = dfd[0] = dfd[1] = 5;
    assert_int_equal(
        embps_group_bootstrap(0, 2, list, 0, "x=1\n", NULL, 0, NULL, 100, -1, cfd, dfd, &err),
        EMBPS_INVALID_ARGUMENT);
    assert_contains(err.message, "rank 1");
    assert_int_equal(cfd[0], -1);
    assert_int_equal(dfd[1], -1);
  }
}

static void test_peer_addr(void **state) {
  static const struct {
    const char *in;
    int offset;
    const char *out;
  } ok[] = {
      {"10.0.0.5:7000", 1000, "10.0.0.5:8000"},
      {"localhost:50051", 1, "localhost:50052"},
      {"[::1]:7000", 5, "[::1]:7005"},
      {"embps-1.embps.svc:65000", 535, "embps-1.embps.svc:65535"},
      {"h:100", -99, "h:1"},
  };
  static const struct {
    const char *in;
    int offset;
  } bad[] = {{"10.0.0.5:65000", 536}, {"h:100", -100}, {"abc", 1},     {"abc:", 1},
             {"abc:12x", 1},          {":80", 1},      {"", 1},        {"::1:80", 1},
             {"[::1]80", 1},          {"h:0", 1},      {"h:70000", 1}, {NULL, 1}};
  char out[64];
  embps_error_t err;
  (void)state;
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    assert_int_equal(embps_group_peer_addr(ok[i].in, ok[i].offset, out, sizeof(out), &err),
                     EMBPS_OK);
    assert_string_equal(out, ok[i].out);
  }
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    strcpy(out, "untouched");
    assert_int_equal(embps_group_peer_addr(bad[i].in, bad[i].offset, out, sizeof(out), &err),
                     EMBPS_INVALID_ARGUMENT);
    assert_string_equal(out, "untouched");
    assert_true(err.message[0] != '\0');
  }
  assert_int_equal(embps_group_peer_addr("10.0.0.5:65000", 536, out, sizeof(out), &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "65536");
  /* 14 bytes ("10.0.0.5:8000" and its NUL) do not fit in 13. */
  assert_int_equal(embps_group_peer_addr("10.0.0.5:7000", 1000, out, 13, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_group_peer_addr("10.0.0.5:7000", 1000, out, 14, &err), EMBPS_OK);
}

int main(void) {
  unsigned seed = (unsigned)time(NULL);
  const char *s = getenv("EMBPS_TEST_SEED");
  if (s)
    seed = (unsigned)strtoul(s, NULL, 10);
  fprintf(stderr, "test_bootstrap: seed %u (EMBPS_TEST_SEED to repeat)\n", seed);
  srand(seed);
  /* Failures are expected here: keep the log quiet unless asked. */
  embps_log_set_level(getenv("EMBPS_TEST_VERBOSE") ? EMBPS_LOG_DEBUG : EMBPS_LOG_ERROR + 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_group_of_one),
      cmocka_unit_test(test_groups_bootstrap),
      cmocka_unit_test(test_ipv6),
      cmocka_unit_test(test_identity_mismatch),
      cmocka_unit_test(test_identity_key_missing),
      cmocka_unit_test(test_size_mismatch),
      cmocka_unit_test(test_missing_rank),
      cmocka_unit_test(test_secret_group_forms),
      cmocka_unit_test(test_secret_differs),
      cmocka_unit_test(test_secret_on_one_side),
      cmocka_unit_test(test_impostor_refused),
      cmocka_unit_test(test_rogue_acceptor),
      cmocka_unit_test(test_cancelled),
      cmocka_unit_test(test_garbage_ignored),
      cmocka_unit_test(test_bind_failure),
      cmocka_unit_test(test_invalid_arguments),
      cmocka_unit_test(test_peer_addr),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
