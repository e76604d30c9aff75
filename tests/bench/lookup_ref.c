/* The references for a lookup's speed on this machine, over raw TCP.
 *
 * The iperf3 ceiling that tests/bench/run.sh quotes streams from one cache-warm buffer into
 * another. A lookup cannot: its reply is T rows that the server reads at random from a table far
 * larger than the caches, and that the client receives into a T-row buffer of its own, one call
 * at a time. This program measures what those facts cost by themselves, with no gRPC, HTTP/2 or
 * engine queue, so that embps's lookups can be set against what this machine allows:
 *
 *   - lookup: a plain program that does only what a lookup must: a client sends T int64 tokens
 *     on a loopback TCP connection; on the server side one thread gathers their rows
 *     (embps_gather_cpu) in chunks of the CPU engine's size, and another writes each chunk
 *     with blocking writes as soon as it is gathered, as the engine and the network loop share
 *     the work; the client reads the rows into one buffer and checks every row against the
 *     table. One call in flight, closed loop, as `embps bench --pipeline 1`. (Not a ceiling:
 *     embps's non-blocking loop overlaps the two halves better and measured faster.)
 *   - transfer: the same call without the gather: the server writes its T-row reply buffer as it
 *     stands. The request-reply ceiling of the loopback for this reply size.
 *   - gather: embps_gather_cpu of T rows into a buffer, alone on one thread (the memory's
 *     ceiling for one gathering thread).
 *
 * Lookup and transfer calls alternate, so both are measured in the same seconds.
 *
 *   lookup_ref [--rows R] [--width W] [--batch T] [--seconds S] [--zipf A] [--seed N]
 *
 * --zipf A draws the tokens from Zipf(A) as `embps bench --zipf A` does (0, the default, is
 * uniform over the table: the case that reaches memory).
 *
 * Prints one JSON object: for the lookups, rows_per_s, gbytes_per_s (rows over the calls' summed
 * time: the client's check between calls is left out) and p50_ms; the same for the transfers
 * (transfer_gbytes_per_s, transfer_p50_ms); gather_gbytes_per_s (the median gather); rounds
 * (calls of each kind). Exits 1 if any row arrives wrong. Tables are f32, each row distinct. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "client/cli/zipf.h"
#include "common/alloc.h"
#include "common/cpus.h"
#include "kernels/embps_kernels.h"
#include "server/engine/engine_ops.h"

enum { CALL_LOOKUP, CALL_TRANSFER };

typedef struct {
  const float *table;
  size_t width, batch, row_bytes, chunk_rows;
  int fd;           /* the server's end */
  int64_t *request; /* [0]: CALL_LOOKUP or CALL_TRANSFER; then the batch's tokens */
  int64_t *tokens;  /* request + 1 */
  uint8_t *reply;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  size_t round, gathered; /* round: the round the gatherer is asked for; gathered: its rows done */
  int stop;
} server_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
  fprintf(stderr, "lookup_ref: %s: %s\n", what, strerror(errno));
  exit(2);
}

static void write_all(int fd, const void *p, size_t len) {
  const uint8_t *b = p;
  while (len) {
    ssize_t k = write(fd, b, len);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      die("write");
    b += k;
    len -= (size_t)k;
  }
}

/* Reads exactly len bytes: 1 when they all arrived, 0 when the peer closed before the first.
 * With lowat, the wait before each read is for min(what is left, 1 MiB) bytes (SO_RCVLOWAT),
 * as embps's client waits inside a frame (client/conn.c), so that the transfer stays a ceiling
 * for it rather than a client that is woken by every segment. */
static int read_all_lowat(int fd, void *p, size_t len, int lowat) {
  uint8_t *b = p;
  size_t left = len;
  int mark = 1;
  while (left) {
    int want = !lowat ? 1 : left < ((size_t)1 << 20) ? (int)left : 1 << 20;
    if (want != mark && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0)
      mark = want;
    if (lowat) { /* the wait, then what is there: a blocking read would copy part of the mark
                    and then sleep for a whole mark more, which never comes at the end */
      struct pollfd pfd = {.fd = fd, .events = POLLIN};
      if (poll(&pfd, 1, -1) < 0 && errno != EINTR)
        die("poll");
    }
    ssize_t k = recv(fd, b, left, lowat ? MSG_DONTWAIT : 0);
    if (k < 0 && (errno == EINTR || (lowat && (errno == EAGAIN || errno == EWOULDBLOCK))))
      continue;
    if (k == 0 && left == len)
      return 0;
    if (k <= 0) {
      if (k == 0)
        errno = ECONNRESET;
      die("read");
    }
    b += k;
    left -= (size_t)k;
  }
  if (mark != 1) {
    mark = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof(mark));
  }
  return 1;
}

static int read_all(int fd, void *p, size_t len) { return read_all_lowat(fd, p, len, 0); }

/* Tokens as embps bench draws them: Zipf(exponent) over [1, rows), exponent 0 uniform. */
static void draw(int64_t *tokens, size_t n, const embps_zipf_t *z, embps_rng_t *rng) {
  for (size_t i = 0; i < n; i++)
    tokens[i] = (int64_t)embps_zipf_sample(z, rng);
}

/* Gathers each round's rows chunk by chunk, publishing the count done under the mutex. */
static void *gather_main(void *arg) {
  server_t *s = arg;
  size_t seen = 0;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (s->round == seen && !s->stop)
      pthread_cond_wait(&s->cv, &s->mu);
    if (s->stop)
      break;
    seen = s->round;
    pthread_mutex_unlock(&s->mu);
    for (size_t a = 0; a < s->batch; a += s->chunk_rows) {
      size_t m = s->batch - a < s->chunk_rows ? s->batch - a : s->chunk_rows;
      embps_gather_cpu(s->table, EMBPS_DTYPE_F32, s->width, s->tokens + a, m,
                       s->reply + a * s->row_bytes);
      pthread_mutex_lock(&s->mu);
      s->gathered = a + m;
      pthread_cond_broadcast(&s->cv);
      pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* Reads a request and answers it: a lookup's rows are written chunk by chunk as they are
 * gathered, a transfer's reply at once. Until the client closes. */
static void *server_main(void *arg) {
  server_t *s = arg;
  for (;;) {
    size_t sent = 0;
    if (!read_all(s->fd, s->request, (s->batch + 1) * sizeof(int64_t)))
      return NULL; /* the client is done */
    if (s->request[0] == CALL_TRANSFER) {
      write_all(s->fd, s->reply, s->batch * s->row_bytes);
      continue;
    }
    pthread_mutex_lock(&s->mu);
    s->gathered = 0;
    s->round++;
    pthread_cond_broadcast(&s->cv);
    while (sent < s->batch) {
      while (s->gathered == sent)
        pthread_cond_wait(&s->cv, &s->mu);
      size_t ready = s->gathered;
      pthread_mutex_unlock(&s->mu);
      write_all(s->fd, s->reply + sent * s->row_bytes, (ready - sent) * s->row_bytes);
      sent = ready;
      pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
  }
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, size_t n) {
  qsort(v, n, sizeof(*v), cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static size_t arg_size(int argc, char **argv, const char *name, size_t dflt) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0)
      return (size_t)strtoull(argv[i + 1], NULL, 10);
  return dflt;
}

int main(int argc, char **argv) {
  const size_t rows = arg_size(argc, argv, "--rows", 1000000);
  const size_t width = arg_size(argc, argv, "--width", 128);
  const size_t batch = arg_size(argc, argv, "--batch", 4096);
  const double seconds = (double)arg_size(argc, argv, "--seconds", 5);
  const char *zipf = NULL;
  embps_rng_t rng;
  embps_zipf_t z;
  const size_t row_bytes = width * sizeof(float), reply_bytes = batch * row_bytes;
  size_t rounds[2] = {0, 0}, cap = (size_t)1 << 16, bad = 0;
  server_t s;
  pthread_t gatherer, server;
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof(addr);
  int one = 1, lfd, cfd;

  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--zipf") == 0)
      zipf = argv[i + 1];
  if (rows < 2 || width == 0 || batch == 0 || seconds <= 0 ||
      embps_zipf_init(&z, rows - 1, zipf ? strtod(zipf, NULL) : 0.0) != 0) {
    fprintf(stderr, "usage: lookup_ref [--rows R>1] [--width W] [--batch T] [--seconds S] "
                    "[--zipf A>=0] [--seed N]\n");
    return 2;
  }
  embps_rng_seed(&rng, arg_size(argc, argv, "--seed", 1));
  float *table = embps_map_alloc(rows * row_bytes);
  int64_t *request = embps_malloc((batch + 1) * sizeof(int64_t)), *tokens = request + 1;
  uint8_t *rows_in = embps_aligned_alloc(reply_bytes), *gathered = embps_aligned_alloc(reply_bytes);
  double *lat[2] = {embps_malloc(cap * sizeof(double)), embps_malloc(cap * sizeof(double))};
  double *gat = embps_malloc(cap * sizeof(double));
  memset(&s, 0, sizeof(s));
  s.request = embps_malloc((batch + 1) * sizeof(int64_t));
  s.reply = embps_aligned_alloc(reply_bytes);
  if (!table || !request || !rows_in || !gathered || !lat[0] || !lat[1] || !gat || !s.request ||
      !s.reply)
    die("out of memory");
  s.tokens = s.request + 1;
  for (size_t r = 0; r < rows; r++)
    for (size_t j = 0; j < width; j++)
      table[r * width + j] = (float)r + (float)j / (float)(width + 1);
  memset(rows_in, 0, reply_bytes);
  memset(gathered, 0, reply_bytes);
  memset(s.reply, 0, reply_bytes);

  /* The gather alone, a few times over fresh tokens. */
  size_t ng = 0;
  for (double end = now_s() + seconds / 5; ng < cap && (ng < 3 || now_s() < end); ng++) {
    draw(tokens, batch, &z, &rng);
    double t0 = now_s();
    embps_gather_cpu(table, EMBPS_DTYPE_F32, width, tokens, batch, gathered);
    gat[ng] = now_s() - t0;
  }

  if ((lfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 || bind(lfd, (void *)&addr, sizeof(addr)) ||
      listen(lfd, 1) || getsockname(lfd, (void *)&addr, &alen) ||
      (cfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 || connect(cfd, (void *)&addr, sizeof(addr)) ||
      (s.fd = accept(lfd, NULL, NULL)) < 0)
    die("loopback connection");
  (void)setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  (void)setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  s.table = table;
  s.width = width;
  s.batch = batch;
  s.row_bytes = row_bytes;
  const size_t chunk_bytes = embps__engine_cpu_chunk_bytes(embps_l2_cache_bytes());
  s.chunk_rows = row_bytes < chunk_bytes ? chunk_bytes / row_bytes : 1;
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  if (pthread_create(&gatherer, NULL, gather_main, &s) ||
      pthread_create(&server, NULL, server_main, &s))
    die("pthread_create");

  /* Two warm-up calls, then lookups and transfers in turn, closed loop, for the time asked. */
  double end = 0;
  for (size_t call = 0; rounds[1] < cap && (call < 4 || now_s() < end); call++) {
    const int kind = call % 2 ? CALL_TRANSFER : CALL_LOOKUP;
    request[0] = kind;
    draw(tokens, batch, &z, &rng);
    double t0 = now_s();
    if (call == 2)
      end = t0 + seconds;
    write_all(cfd, request, (batch + 1) * sizeof(int64_t));
    if (!read_all_lowat(cfd, rows_in, reply_bytes, 1)) {
      errno = ECONNRESET;
      die("read");
    }
    double t1 = now_s();
    if (kind == CALL_LOOKUP)
      for (size_t i = 0; i < batch; i++)
        bad += memcmp(rows_in + i * row_bytes, table + (size_t)tokens[i] * width, row_bytes) != 0;
    if (call >= 2)
      lat[kind][rounds[kind]++] = t1 - t0;
  }
  shutdown(cfd, SHUT_WR);
  pthread_join(server, NULL);
  pthread_mutex_lock(&s.mu);
  s.stop = 1;
  pthread_cond_broadcast(&s.cv);
  pthread_mutex_unlock(&s.mu);
  pthread_join(gatherer, NULL);
  close(cfd);
  close(s.fd);
  close(lfd);

  /* Rows per second of calls back to back (the client's check between them left out). */
  double rows_per_s[2], p50_ms[2];
  for (int kind = 0; kind < 2; kind++) {
    double calls_s = 0;
    for (size_t i = 0; i < rounds[kind]; i++)
      calls_s += lat[kind][i];
    rows_per_s[kind] = (double)(rounds[kind] * batch) / calls_s;
    p50_ms[kind] = median(lat[kind], rounds[kind]) * 1e3;
  }
  printf("{\"batch\": %zu, \"rounds\": %zu, \"rows_per_s\": %.1f, \"gbytes_per_s\": %.6f, "
         "\"p50_ms\": %.4f, \"transfer_gbytes_per_s\": %.6f, \"transfer_p50_ms\": %.4f, "
         "\"gather_gbytes_per_s\": %.6f, \"bad_rows\": %zu}\n",
         batch, rounds[CALL_LOOKUP], rows_per_s[CALL_LOOKUP],
         rows_per_s[CALL_LOOKUP] * (double)row_bytes / 1e9, p50_ms[CALL_LOOKUP],
         rows_per_s[CALL_TRANSFER] * (double)row_bytes / 1e9, p50_ms[CALL_TRANSFER],
         (double)reply_bytes / median(gat, ng) / 1e9, bad);
  if (bad)
    fprintf(stderr, "lookup_ref: %zu rows arrived wrong\n", bad);
  embps_map_free(table, rows * row_bytes);
  embps_free(request);
  embps_free(rows_in);
  embps_free(gathered);
  embps_free(lat[0]);
  embps_free(lat[1]);
  embps_free(gat);
  embps_free(s.request);
  embps_free(s.reply);
  return bad ? 1 : 0;
}
