/* The group's thread (see group.h).
 *
 * Control plane. Besides the communicator's data connections, every non-leader rank keeps one
 * control connection to the leader (rank 0). Frames on it are [u32 length][u8 type][payload]:
 * NOTICE (rank -> leader: "I hold my shard of batch B: kind, tokens_per_batch, table") and
 * ROUND (leader -> every rank: an ordered list of "run B" / "fail B with status S"; a run of a
 * CreateTable carries the table's config). A rank sends its notices in the order its shards
 * arrived, and the leader's sequencer orders a batch once every rank holds its shard, so every
 * rank runs the same batches in the same order and their collectives always match: no
 * deadlock, whatever order concurrent clients' shards reach the ranks in.
 *
 * Threads. The loop thread submits ops into `incoming` (mutex + eventfd); this thread polls the
 * eventfd and the control connections, and posts finished ops to `completed` (mutex +
 * uv_async_t). Collectives block this thread only.
 *
 * Failure. If a peer's connection breaks or a collective fails, the group is broken: every
 * parked op and every later one fails with UNAVAILABLE and the message says which rank and
 * what happened, so clients see an error within the peer timeout instead of hanging. A broken
 * group does not heal; the ranks must be restarted (the health check reports NOT_SERVING). */
#include "group.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/group/bootstrap.h"
#include "server/group/sequencer.h"

_Static_assert((int)EMBPS_OP_LOOKUP == (int)EMBPS_BATCH_LOOKUP &&
                   (int)EMBPS_OP_PUSH == (int)EMBPS_BATCH_PUSH &&
                   (int)EMBPS_OP_CREATE_TABLE == (int)EMBPS_BATCH_CREATE_TABLE,
               "op kinds travel as batch kinds");

enum { FRAME_NOTICE = 1, FRAME_ROUND = 2, FRAME_BROKEN = 3, FRAME_DEVICE = 4, FRAME_NCCL_ID = 5 };
#define ROUND_MAX 256
#define MAX_CLAIMS 64                     /* ranks whose device claims the leader compares */
#define CREATE_ID_BIT (UINT64_C(1) << 63) /* the leader's own ids for creates */

typedef struct rbuf {
  uint8_t *data;
  size_t len, cap;
} rbuf_t;

struct embps_group {
  embps_group_config_t cfg;
  char **peer_addrs;
  char *identity;
  uv_loop_t *loop;
  uv_async_t async;
  embps_store_t *store;
  pthread_t thread;
  int thread_started;
  int wake_fd;

  pthread_mutex_t mu;
  embps_op_t *in_head, *in_tail;     /* guarded by mu */
  embps_op_t *done_head, *done_tail; /* guarded by mu */
  int stopping;                      /* guarded by mu */
  char state_msg[400];               /* guarded by mu */
  atomic_int state;
  atomic_int fatal_pending;
  embps_status_t fatal_status;
  atomic_uint_fast64_t pending;
  atomic_int host_device; /* the device whose pinned memory requests use, -1 for plain */

  /* Group thread only. */
  void *stream; /* cuda: the engine's stream */
  embps_comm_t *comm;
  embps_engine_t *engine;
  embps_sequencer_t *seq;
  int *control_fds; /* size entries, -1 for self (and for everyone on non-leaders but 0) */
  rbuf_t *rbufs;
  embps_op_t *parked; /* ops waiting for their round, arrival order */
  uint64_t next_create_id;
  embps_comm_stats_t comm_stats; /* copy for other threads, guarded by mu */
};

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int is_leader(const embps_group_t *g) { return g->cfg.rank == 0; }

/* ---- completion ------------------------------------------------------------------------------ */

static void complete(embps_group_t *g, embps_op_t *op) {
  op->next = NULL;
  pthread_mutex_lock(&g->mu);
  if (g->done_tail)
    g->done_tail->next = op;
  else
    g->done_head = op;
  g->done_tail = op;
  pthread_mutex_unlock(&g->mu);
  uv_async_send(&g->async);
}

static void fail_op(embps_group_t *g, embps_op_t *op, embps_status_t status, const char *msg) {
  embps_error_set(&op->error, status, "%s", msg);
  complete(g, op);
}

static void on_async(uv_async_t *handle) {
  embps_group_t *g = handle->data;
  embps_op_t *op;
  if (atomic_exchange(&g->fatal_pending, 0) && g->cfg.on_fatal) {
    char msg[400];
    embps_group_state(g, msg, sizeof(msg));
    g->cfg.on_fatal(g->cfg.on_fatal_arg, g->fatal_status, msg);
  }
  pthread_mutex_lock(&g->mu);
  op = g->done_head;
  g->done_head = g->done_tail = NULL;
  pthread_mutex_unlock(&g->mu);
  while (op) {
    embps_op_t *next = op->next;
    op->next = NULL;
    atomic_fetch_sub_explicit(&g->pending, 1, memory_order_relaxed);
    op->done(op);
    op = next;
  }
}

/* ---- state ----------------------------------------------------------------------------------- */

static void set_state(embps_group_t *g, embps_group_state_t state, const char *msg) {
  pthread_mutex_lock(&g->mu);
  snprintf(g->state_msg, sizeof(g->state_msg), "%s", msg ? msg : "");
  pthread_mutex_unlock(&g->mu);
  atomic_store(&g->state, (int)state);
}

/* Breaks the group: every parked op fails, and so will every later one. */
static void fail_all(embps_group_t *g, const char *msg) {
  set_state(g, EMBPS_GROUP_BROKEN, msg);
  while (g->parked) {
    embps_op_t *op = g->parked;
    g->parked = op->next;
    fail_op(g, op, EMBPS_UNAVAILABLE, msg);
  }
}

/* Tells the other side of a control connection that the group broke, and why; best effort
 * (one non-blocking send: the peer may be the one that died). */
static void send_broken(embps_group_t *g, uint32_t peer, const char *why) {
  uint8_t frame[5 + 300];
  uint32_t len = (uint32_t)strnlen(why, 300);
  uint32_t flen = len + 1;
  memcpy(frame, &flen, 4);
  frame[4] = FRAME_BROKEN;
  memcpy(frame + 5, why, len);
  if (send(g->control_fds[peer], frame, 5 + len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
    EMBPS_DEBUG("could not tell rank %u that the group broke: %s", peer, strerror(errno));
}

/* Breaks the group on this rank and makes sure every other rank hears of it: a non-leader
 * tells the leader, and the leader tells every rank and closes its control connections, so a
 * rank that is idle (in no collective) when another dies still fails its calls at once. */
static void break_group(embps_group_t *g, const char *why) {
  char msg[400];
  if (atomic_load(&g->state) == EMBPS_GROUP_BROKEN)
    return;
  snprintf(msg, sizeof(msg), "the shard group is broken: %.300s; restart its ranks", why);
  EMBPS_ERROR("rank %u: %s", g->cfg.rank, msg);
  fail_all(g, msg);
  if (!g->control_fds)
    return;
  for (uint32_t r = 0; r < g->cfg.size; r++) {
    if (g->control_fds[r] < 0 || (!is_leader(g) && r != 0))
      continue;
    send_broken(g, r, why);
    if (is_leader(g))
      shutdown(g->control_fds[r], SHUT_RDWR);
  }
}

embps_group_state_t embps_group_state(embps_group_t *g, char *message, size_t cap) {
  embps_group_state_t s = (embps_group_state_t)atomic_load(&g->state);
  if (message) {
    pthread_mutex_lock(&g->mu);
    snprintf(message, cap, "%s", g->state_msg);
    pthread_mutex_unlock(&g->mu);
  }
  return s;
}

/* ---- control frames -------------------------------------------------------------------------- */

static embps_status_t send_all(int fd, const uint8_t *p, size_t len) {
  while (len) {
    ssize_t k = send(fd, p, len, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      struct pollfd pfd = {.fd = fd, .events = POLLOUT};
      poll(&pfd, 1, 1000);
      continue;
    }
    if (k <= 0)
      return EMBPS_UNAVAILABLE;
    p += k;
    len -= (size_t)k;
  }
  return EMBPS_OK;
}

typedef struct wbuf {
  uint8_t *data;
  size_t len, cap;
  int failed;
} wbuf_t;

static void put(wbuf_t *w, const void *p, size_t n) {
  if (w->failed)
    return;
  if (w->len + n > w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 256;
    uint8_t *d;
    while (cap < w->len + n)
      cap *= 2;
    if (!(d = embps_realloc(w->data, cap))) {
      w->failed = 1;
      return;
    }
    w->data = d;
    w->cap = cap;
  }
  memcpy(w->data + w->len, p, n);
  w->len += n;
}

static void begin_frame(wbuf_t *w, uint8_t type) {
  uint32_t zero = 0;
  w->len = 0;
  put(w, &zero, 4);
  put(w, &type, 1);
}

static void end_frame(wbuf_t *w) {
  uint32_t len = (uint32_t)(w->len - 4);
  if (!w->failed)
    memcpy(w->data, &len, 4);
}

static embps_status_t send_notice(embps_group_t *g, const embps_batch_desc_t *d) {
  wbuf_t w = {0};
  uint8_t tl = (uint8_t)strnlen(d->table, sizeof(d->table) - 1);
  embps_status_t ret;
  begin_frame(&w, FRAME_NOTICE);
  put(&w, &d->batch_id, 8);
  put(&w, &d->kind, 4);
  put(&w, &d->tokens_per_batch, 4);
  put(&w, &tl, 1);
  put(&w, d->table, tl);
  end_frame(&w);
  ret = w.failed ? EMBPS_RESOURCE_EXHAUSTED : send_all(g->control_fds[0], w.data, w.len);
  embps_free(w.data);
  return ret;
}

static embps_op_t *find_parked(embps_group_t *g, uint64_t batch_id, int unlink) {
  for (embps_op_t **pp = &g->parked; *pp; pp = &(*pp)->next) {
    if ((*pp)->batch_id == batch_id) {
      embps_op_t *op = *pp;
      if (unlink) {
        *pp = op->next;
        op->next = NULL;
      }
      return op;
    }
  }
  return NULL;
}

static embps_status_t send_round(embps_group_t *g, const embps_round_entry_t *e, size_t n) {
  wbuf_t w = {0};
  uint32_t count = (uint32_t)n;
  embps_status_t ret = EMBPS_OK;
  begin_frame(&w, FRAME_ROUND);
  put(&w, &count, 4);
  for (size_t i = 0; i < n; i++) {
    uint16_t ml = (uint16_t)strnlen(e[i].message, sizeof(e[i].message) - 1);
    uint32_t status = (uint32_t)e[i].status;
    put(&w, &e[i].batch_id, 8);
    put(&w, &e[i].action, 4);
    put(&w, &e[i].kind, 4);
    put(&w, &status, 4);
    put(&w, &ml, 2);
    put(&w, e[i].message, ml);
    if (e[i].action == EMBPS_ROUND_RUN && e[i].kind == EMBPS_OP_CREATE_TABLE) {
      embps_op_t *op = find_parked(g, e[i].batch_id, 0);
      embps_table_config_t none;
      memset(&none, 0, sizeof(none));
      put(&w, op ? &op->create : &none, sizeof(none));
    }
  }
  end_frame(&w);
  if (w.failed)
    ret = EMBPS_RESOURCE_EXHAUSTED;
  for (uint32_t r = 1; r < g->cfg.size && ret == EMBPS_OK; r++)
    ret = send_all(g->control_fds[r], w.data, w.len);
  embps_free(w.data);
  return ret;
}

/* Reads what peer's control connection has; calls handle for each whole frame. Returns
 * EMBPS_UNAVAILABLE when the peer closed it. */
typedef void (*frame_fn)(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p,
                         size_t len);

static embps_status_t read_frames(embps_group_t *g, uint32_t peer, frame_fn handle) {
  rbuf_t *b = &g->rbufs[peer];
  size_t off = 0;
  for (;;) {
    ssize_t k;
    if (b->cap - b->len < 65536) {
      size_t cap = b->cap ? b->cap * 2 : 131072;
      uint8_t *d = embps_realloc(b->data, cap);
      if (!d)
        return EMBPS_RESOURCE_EXHAUSTED;
      b->data = d;
      b->cap = cap;
    }
    k = recv(g->control_fds[peer], b->data + b->len, b->cap - b->len, MSG_DONTWAIT);
    if (k > 0) {
      b->len += (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR)
      continue;
    if (k == 0)
      return EMBPS_UNAVAILABLE;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      break;
    return EMBPS_UNAVAILABLE;
  }
  while (b->len - off >= 5) {
    uint32_t flen;
    memcpy(&flen, b->data + off, 4);
    if (b->len - off - 4 < flen)
      break;
    handle(g, peer, b->data[off + 4], b->data + off + 5, flen - 1);
    off += 4 + flen;
  }
  memmove(b->data, b->data + off, b->len - off);
  b->len -= off;
  return EMBPS_OK;
}

/* ---- rounds ---------------------------------------------------------------------------------- */

static void apply_round(embps_group_t *g, const embps_round_entry_t *e, size_t n,
                        const embps_table_config_t *configs) {
  for (size_t i = 0; i < n && atomic_load(&g->state) != EMBPS_GROUP_BROKEN; i++) {
    embps_op_t *op = find_parked(g, e[i].batch_id, 1), tmp;
    embps_error_t err;

    if (e[i].action == EMBPS_ROUND_FAIL) {
      if (op)
        fail_op(g, op, e[i].status, e[i].message);
      continue;
    }
    if (!op && e[i].kind == EMBPS_OP_CREATE_TABLE && !is_leader(g)) {
      memset(&tmp, 0, sizeof(tmp)); /* a create runs on every rank, answered by the leader */
      tmp.kind = EMBPS_OP_CREATE_TABLE;
      tmp.create = configs[i];
      op = &tmp;
    }
    if (!op) {
      char msg[200];
      snprintf(msg, sizeof(msg), "rank %u was told to run batch %llu, which it does not hold",
               g->cfg.rank, (unsigned long long)e[i].batch_id);
      break_group(g, msg);
      return;
    }
    embps_error_clear(&err);
    if (embps_engine_run(g->engine, op, &err) != EMBPS_OK) {
      if (op != &tmp)
        fail_op(g, op, EMBPS_UNAVAILABLE, err.message);
      break_group(g, err.message);
      return;
    }
    if (op != &tmp)
      complete(g, op);
  }
}

static void on_frame(embps_group_t *g, uint32_t peer, uint8_t type, const uint8_t *p, size_t len) {
  if (type == FRAME_BROKEN) {
    char why[400];
    snprintf(why, sizeof(why), "rank %u reported: %.*s", peer, (int)(len < 300 ? len : 300),
             (const char *)p);
    break_group(g, why);
    return;
  }
  if (type == FRAME_NOTICE && is_leader(g) && len >= 17) {
    embps_batch_desc_t d;
    uint8_t tl = p[16];
    memset(&d, 0, sizeof(d));
    memcpy(&d.batch_id, p, 8);
    memcpy(&d.kind, p + 8, 4);
    memcpy(&d.tokens_per_batch, p + 12, 4);
    if (len >= 17u + tl && tl < sizeof(d.table))
      memcpy(d.table, p + 17, tl);
    embps_sequencer_arrive(g->seq, peer, &d, now_ms());
  } else if (type == FRAME_ROUND && !is_leader(g) && len >= 4) {
    static embps_round_entry_t entries[ROUND_MAX];
    static embps_table_config_t configs[ROUND_MAX];
    uint32_t count;
    size_t off = 4, n = 0;
    memcpy(&count, p, 4);
    for (uint32_t i = 0; i < count && n < ROUND_MAX && off + 22 <= len; i++, n++) {
      embps_round_entry_t *e = &entries[n];
      uint32_t status;
      uint16_t ml;
      memset(e, 0, sizeof(*e));
      memcpy(&e->batch_id, p + off, 8);
      memcpy(&e->action, p + off + 8, 4);
      memcpy(&e->kind, p + off + 12, 4);
      memcpy(&status, p + off + 16, 4);
      memcpy(&ml, p + off + 20, 2);
      e->status = (embps_status_t)status;
      off += 22;
      if (off + ml > len || ml >= sizeof(e->message))
        break;
      memcpy(e->message, p + off, ml);
      off += ml;
      if (e->action == EMBPS_ROUND_RUN && e->kind == EMBPS_OP_CREATE_TABLE) {
        if (off + sizeof(configs[n]) > len)
          break;
        memcpy(&configs[n], p + off, sizeof(configs[n]));
        off += sizeof(configs[n]);
      }
    }
    apply_round(g, entries, n, configs);
  }
}

/* Leader: hands out every round the sequencer has ready, and runs it here too. */
static void lead_rounds(embps_group_t *g) {
  static embps_round_entry_t entries[ROUND_MAX];
  size_t n;
  while (atomic_load(&g->state) != EMBPS_GROUP_BROKEN &&
         (n = embps_sequencer_next_round(g->seq, now_ms(), entries, ROUND_MAX)) > 0) {
    if (g->cfg.size > 1 && send_round(g, entries, n) != EMBPS_OK) {
      break_group(g, "the leader could not send a round to every rank");
      return;
    }
    apply_round(g, entries, n, NULL);
  }
}

/* Parks an op that the loop thread submitted and reports it to the leader. */
static void admit(embps_group_t *g, embps_op_t *op) {
  embps_batch_desc_t d;
  char msg[400];

  if (embps_group_state(g, msg, sizeof(msg)) != EMBPS_GROUP_READY) {
    fail_op(g, op, EMBPS_UNAVAILABLE, msg);
    return;
  }
  if (op->kind == EMBPS_OP_CREATE_TABLE)
    op->batch_id = CREATE_ID_BIT | ++g->next_create_id;
  if (find_parked(g, op->batch_id, 0)) {
    snprintf(msg, sizeof(msg),
             "batch_id %llu is already in flight on rank %u: every batch needs its own id",
             (unsigned long long)op->batch_id, g->cfg.rank);
    fail_op(g, op, EMBPS_INVALID_ARGUMENT, msg);
    return;
  }
  op->next = g->parked;
  g->parked = op;
  memset(&d, 0, sizeof(d));
  d.batch_id = op->batch_id;
  d.kind = (uint32_t)op->kind;
  d.tokens_per_batch = op->tokens_per_batch;
  snprintf(d.table, sizeof(d.table), "%s",
           op->kind == EMBPS_OP_CREATE_TABLE ? op->create.name
                                             : embps_table_config(op->table)->name);
  if (is_leader(g))
    embps_sequencer_arrive(g->seq, 0, &d, now_ms());
  else if (send_notice(g, &d) != EMBPS_OK)
    break_group(g, "this rank lost its connection to the leader (rank 0)");
}

/* ---- the thread ------------------------------------------------------------------------------ */

/* Reads one control frame from peer within timeout_ms (startup only, before the main loop
 * owns the connections). Returns its type, or -1 on timeout or a closed connection. */
static int read_frame_blocking(embps_group_t *g, uint32_t peer, uint8_t *buf, size_t cap,
                               size_t *len, uint64_t timeout_ms) {
  uint8_t head[5];
  uint32_t flen;
  size_t got = 0, want = 5;
  uint64_t deadline = now_ms() + timeout_ms;
  uint8_t *dst = head;
  for (int stage = 0; stage < 2; stage++) {
    while (got < want) {
      struct pollfd pfd = {.fd = g->control_fds[peer], .events = POLLIN};
      uint64_t now = now_ms();
      ssize_t k;
      if (now >= deadline || poll(&pfd, 1, (int)(deadline - now)) <= 0)
        return -1;
      k = recv(g->control_fds[peer], dst + got, want - got, 0);
      if (k <= 0)
        return -1;
      got += (size_t)k;
    }
    if (stage == 0) {
      memcpy(&flen, head, 4);
      if (flen < 1 || flen - 1 > cap)
        return -1;
      dst = buf;
      got = 0;
      want = flen - 1;
    }
  }
  *len = want;
  return head[4];
}

static embps_status_t send_frame(embps_group_t *g, uint32_t peer, uint8_t type, const void *p,
                                 size_t len) {
  wbuf_t w = {0};
  embps_status_t ret;
  begin_frame(&w, type);
  put(&w, p, len);
  end_frame(&w);
  ret = w.failed ? EMBPS_RESOURCE_EXHAUSTED : send_all(g->control_fds[peer], w.data, w.len);
  embps_free(w.data);
  return ret;
}

/* The CUDA backend's part of forming the group: this rank opens its device; the leader checks
 * that no two ranks on one host claim the same device (they would share its memory and NCCL
 * refuses such a communicator), creates NCCL's unique id and hands it to every rank over the
 * control connections; then every rank joins the NCCL communicator. */
static embps_status_t form_cuda(embps_group_t *g, int *data_fds, embps_error_t *err) {
  const uint32_t N = g->cfg.size;
  char me[400], bus[64], host[256];
  uint8_t buf[400];
  size_t len = 0;
  embps_status_t ret;

  (void)data_fds; /* NCCL makes its own connections; the TCP data sockets are closed */
  if ((ret = embps_cuda_open(g->cfg.device, &g->stream, bus, sizeof(bus), err)) != EMBPS_OK)
    return ret;
  if (gethostname(host, sizeof(host)) != 0)
    snprintf(host, sizeof(host), "unknown");
  host[sizeof(host) - 1] = '\0';
  snprintf(me, sizeof(me), "%.255s %.63s %d", host, bus, g->cfg.device);
  EMBPS_INFO("rank %u uses CUDA device %d (PCI %s) on %s", g->cfg.rank, g->cfg.device, bus, host);

  if (is_leader(g)) {
    static char claims[MAX_CLAIMS][400];
    uint32_t n = N < MAX_CLAIMS ? N : MAX_CLAIMS;
    char why[400];
    snprintf(claims[0], sizeof(claims[0]), "%s", me);
    for (uint32_t r = 1; r < N; r++) {
      int type = read_frame_blocking(g, r, buf, sizeof(buf) - 1, &len, g->cfg.bootstrap_timeout_ms);
      if (type != FRAME_DEVICE)
        return embps_error_set(err, EMBPS_UNAVAILABLE,
                               "rank %u did not say which CUDA device it uses", r);
      buf[len] = '\0';
      if (r < n) /* beyond MAX_CLAIMS ranks the check is skipped (NCCL refuses duplicates) */
        memcpy(claims[r], buf, len + 1);
    }
    why[0] = '\0';
    for (uint32_t a = 0; a < n && !why[0]; a++)
      for (uint32_t b = a + 1; b < n && !why[0]; b++) {
        char ha[256], ba[64], hb[256], bb[64];
        int da = -1, db = -1;
        if (sscanf(claims[a], "%255s %63s %d", ha, ba, &da) == 3 &&
            sscanf(claims[b], "%255s %63s %d", hb, bb, &db) == 3 && strcmp(ha, hb) == 0 &&
            strcmp(ba, bb) == 0)
          snprintf(why, sizeof(why),
                   "ranks %u and %u both claim CUDA device %d (PCI %.32s) on host %.64s: give "
                   "each rank its own device with --device or EMBPS_DEVICE",
                   a, b, da, ba, ha);
      }
#ifndef EMBPS_HAVE_NCCL
    if (!why[0])
      snprintf(why, sizeof(why),
               "this build of embps has CUDA kernels but no NCCL, which the "
               "cuda backend needs between ranks");
#endif
    if (why[0]) {
      for (uint32_t r = 1; r < N; r++)
        send_broken(g, r, why);
      return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s", why);
    }
  } else if (send_frame(g, 0, FRAME_DEVICE, me, strlen(me)) != EMBPS_OK) {
    return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot reach the leader (rank 0)");
  }

#ifdef EMBPS_HAVE_NCCL
  {
    uint8_t uid[EMBPS_NCCL_UNIQUE_ID_BYTES];
    if (is_leader(g)) {
      if ((ret = embps_comm_nccl_unique_id(uid, err)) != EMBPS_OK)
        return ret;
      for (uint32_t r = 1; r < N; r++)
        if (send_frame(g, r, FRAME_NCCL_ID, uid, sizeof(uid)) != EMBPS_OK)
          return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot send NCCL's id to rank %u", r);
    } else {
      int type = read_frame_blocking(g, 0, buf, sizeof(buf) - 1, &len, g->cfg.bootstrap_timeout_ms);
      if (type == FRAME_BROKEN) {
        buf[len] = '\0';
        return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s", (const char *)buf);
      }
      if (type != FRAME_NCCL_ID || len != sizeof(uid))
        return embps_error_set(err, EMBPS_UNAVAILABLE,
                               "the leader (rank 0) did not send NCCL's id");
      memcpy(uid, buf, sizeof(uid));
    }
    return embps_comm_nccl_new(&g->comm, g->cfg.rank, N, uid, g->stream, g->cfg.peer_timeout_ms,
                               err);
  }
#else
  if (!is_leader(g)) {
    int type = read_frame_blocking(g, 0, buf, sizeof(buf) - 1, &len, g->cfg.bootstrap_timeout_ms);
    buf[type == FRAME_BROKEN ? len : 0] = '\0';
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s",
                           type == FRAME_BROKEN ? (const char *)buf
                                                : "the leader refused the cuda backend");
  }
  if (N == 1)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "this build of embps has CUDA kernels but no NCCL, which the cuda "
                           "backend needs");
  return ret;
#endif
}

static embps_status_t form_group(embps_group_t *g, embps_error_t *err) {
  const uint32_t N = g->cfg.size;
  int *data_fds = NULL;
  embps_status_t ret = EMBPS_OK;

  g->control_fds = embps_malloc(N * sizeof(int));
  data_fds = embps_malloc(N * sizeof(int));
  g->rbufs = embps_calloc(N, sizeof(rbuf_t));
  if (!g->control_fds || !data_fds || !g->rbufs) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory forming the group");
    goto exit;
  }
  for (uint32_t r = 0; r < N; r++)
    g->control_fds[r] = data_fds[r] = -1;
  if (N > 1) {
    EMBPS_INFO("rank %u of %u: waiting for the group (peer address %s)", g->cfg.rank, N,
               g->peer_addrs[g->cfg.rank]);
    ret = embps_group_bootstrap(g->cfg.rank, N, (const char *const *)g->peer_addrs, g->cfg.bind_any,
                                g->identity, g->cfg.bootstrap_timeout_ms, g->control_fds, data_fds,
                                err);
    if (ret != EMBPS_OK)
      goto exit;
    /* Only the leader's control connections carry traffic. */
    for (uint32_t r = 1; r < N; r++)
      if (!is_leader(g) && g->control_fds[r] >= 0) {
        close(g->control_fds[r]);
        g->control_fds[r] = -1;
      }
  }
  if (g->cfg.backend == EMBPS_BACKEND_CUDA) {
    ret = form_cuda(g, data_fds, err);
    if (ret != EMBPS_OK)
      goto exit;
  } else {
    ret = embps_comm_tcp_new(&g->comm, g->cfg.rank, N, data_fds, g->cfg.peer_timeout_ms);
    for (uint32_t r = 0; r < N; r++)
      data_fds[r] = -1; /* the communicator owns them now, or closed them */
    if (ret != EMBPS_OK) {
      embps_error_set(err, ret, "cannot create the communicator");
      goto exit;
    }
  }
  if ((ret = embps_engine_new(&g->engine, g->comm, g->store, g->cfg.backend, g->stream)) !=
          EMBPS_OK ||
      (ret = embps_sequencer_new(&g->seq, N, g->cfg.batch_deadline_ms)) != EMBPS_OK)
    embps_error_set(err, ret, "cannot start the engine (%s backend)",
                    embps_backend_name(g->cfg.backend));
  else if (g->cfg.backend == EMBPS_BACKEND_CUDA)
    atomic_store(&g->host_device, g->cfg.device);
exit:
  if (data_fds)
    for (uint32_t r = 0; r < N; r++)
      if (data_fds[r] >= 0)
        close(data_fds[r]);
  embps_free(data_fds);
  return ret;
}

static void drain_incoming(embps_group_t *g, int *stopping) {
  embps_op_t *batch, *last = NULL;
  uint64_t v;
  while (read(g->wake_fd, &v, sizeof(v)) > 0) {
  }
  pthread_mutex_lock(&g->mu);
  batch = g->in_head;
  g->in_head = g->in_tail = NULL;
  *stopping = g->stopping;
  pthread_mutex_unlock(&g->mu);
  /* The queue is in submission order; admit in that order. */
  while (batch) {
    embps_op_t *op = batch;
    batch = op->next;
    op->next = NULL;
    (void)last;
    admit(g, op);
  }
}

static void *group_main(void *arg) {
  embps_group_t *g = arg;
  const uint32_t N = g->cfg.size;
  struct pollfd *pfds = embps_calloc(N + 1, sizeof(*pfds));
  embps_error_t err;
  int stopping = 0;

  embps_error_clear(&err);
  if (!pfds || form_group(g, &err) != EMBPS_OK) {
    char msg[400];
    snprintf(msg, sizeof(msg), "rank %u could not join the group: %.300s", g->cfg.rank,
             pfds ? err.message : "out of memory");
    g->fatal_status = pfds ? err.status : EMBPS_RESOURCE_EXHAUSTED;
    set_state(g, EMBPS_GROUP_BROKEN, msg);
    atomic_store(&g->fatal_pending, 1);
    uv_async_send(&g->async);
  } else {
    set_state(g, EMBPS_GROUP_READY, NULL);
    EMBPS_INFO("rank %u of %u: the group is ready", g->cfg.rank, N);
  }

  while (!stopping) {
    nfds_t n = 0;
    int timeout = 1000;
    pfds[n++] = (struct pollfd){.fd = g->wake_fd, .events = POLLIN};
    if (g->control_fds && atomic_load(&g->state) == EMBPS_GROUP_READY)
      for (uint32_t r = 0; r < N; r++)
        if (g->control_fds[r] >= 0)
          pfds[n++] = (struct pollfd){.fd = g->control_fds[r], .events = POLLIN};
    if (g->seq && is_leader(g)) {
      uint64_t left = embps_sequencer_next_deadline(g->seq, now_ms());
      if (left < (uint64_t)timeout)
        timeout = (int)left + 1;
    }
    if (poll(pfds, n, timeout) < 0 && errno != EINTR)
      break;
    drain_incoming(g, &stopping);
    if (atomic_load(&g->state) != EMBPS_GROUP_READY)
      continue;
    for (nfds_t i = 1; i < n; i++) {
      uint32_t peer = 0;
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      for (uint32_t r = 0; r < N; r++)
        if (g->control_fds[r] == pfds[i].fd)
          peer = r;
      if (read_frames(g, peer, on_frame) != EMBPS_OK) {
        char msg[200];
        snprintf(msg, sizeof(msg), "rank %u closed its control connection (it stopped or died)",
                 peer);
        break_group(g, msg);
        break;
      }
    }
    if (is_leader(g))
      lead_rounds(g);
  }
  fail_all(g, "this server is shutting down");
  embps_free(pfds);
  return NULL;
}

/* ---- public ---------------------------------------------------------------------------------- */

embps_status_t embps_group_new(embps_group_t **out, uv_loop_t *loop,
                               const embps_group_config_t *cfg, embps_store_t *store) {
  embps_group_t *g = embps_calloc(1, sizeof(*g));
  if (!g)
    return EMBPS_RESOURCE_EXHAUSTED;
  g->cfg = *cfg;
  g->loop = loop;
  g->store = store;
  g->wake_fd = -1;
  atomic_init(&g->host_device, -1);
  if (cfg->size > 1) {
    g->peer_addrs = embps_calloc(cfg->size, sizeof(char *));
    if (!g->peer_addrs)
      goto fail;
    for (uint32_t r = 0; r < cfg->size; r++)
      if (!(g->peer_addrs[r] = embps_strdup(cfg->peer_addrs[r])))
        goto fail;
  }
  if (!(g->identity = embps_strdup(cfg->identity ? cfg->identity : "")))
    goto fail;
  g->cfg.peer_addrs = NULL;
  g->cfg.identity = NULL;
  if ((g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    goto fail;
  pthread_mutex_init(&g->mu, NULL);
  atomic_store(&g->state, EMBPS_GROUP_STARTING);
  snprintf(g->state_msg, sizeof(g->state_msg),
           "the shard group is starting: waiting for all %u ranks to join", cfg->size);
  if (uv_async_init(loop, &g->async, on_async) != 0)
    goto fail_mutex;
  g->async.data = g;
  if (pthread_create(&g->thread, NULL, group_main, g) != 0) {
    uv_close((uv_handle_t *)&g->async, NULL); /* freed by the caller's process exit */
    return EMBPS_INTERNAL;
  }
  g->thread_started = 1;
  *out = g;
  return EMBPS_OK;
fail_mutex:
  pthread_mutex_destroy(&g->mu);
fail:
  if (g->wake_fd >= 0)
    close(g->wake_fd);
  if (g->peer_addrs)
    for (uint32_t r = 0; r < cfg->size; r++)
      embps_free(g->peer_addrs[r]);
  embps_free(g->peer_addrs);
  embps_free(g->identity);
  embps_free(g);
  return EMBPS_RESOURCE_EXHAUSTED;
}

void embps_group_submit(embps_group_t *g, embps_op_t *op) {
  uint64_t one = 1;
  op->next = NULL;
  atomic_fetch_add_explicit(&g->pending, 1, memory_order_relaxed);
  pthread_mutex_lock(&g->mu);
  if (g->in_tail)
    g->in_tail->next = op;
  else
    g->in_head = op;
  g->in_tail = op;
  pthread_mutex_unlock(&g->mu);
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
}

uint32_t embps_group_rank(const embps_group_t *g) { return g->cfg.rank; }
uint32_t embps_group_size(const embps_group_t *g) { return g->cfg.size; }
const char *embps_group_backend(const embps_group_t *g) {
  return embps_backend_name(g->cfg.backend);
}
int embps_group_host_device(embps_group_t *g) { return atomic_load(&g->host_device); }

void embps_group_comm_stats(embps_group_t *g, embps_comm_stats_t *out) {
  /* The counters are written by the group thread; a torn read of a 64-bit counter cannot
   * happen on the 64-bit hosts embps runs on, and stats tolerate a stale value. */
  embps_comm_t *c = g->comm;
  if (c && atomic_load(&g->state) != EMBPS_GROUP_STARTING)
    *out = c->stats;
  else
    memset(out, 0, sizeof(*out));
}

uint64_t embps_group_pending(const embps_group_t *g) {
  return atomic_load_explicit(&((embps_group_t *)g)->pending, memory_order_relaxed);
}

void embps_group_close(embps_group_t *g) {
  uint64_t one = 1;
  if (!g || !g->thread_started)
    return;
  pthread_mutex_lock(&g->mu);
  g->stopping = 1;
  pthread_mutex_unlock(&g->mu);
  if (write(g->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
    EMBPS_ERROR("cannot wake the group thread: %s", strerror(errno));
  pthread_join(g->thread, NULL);
  g->thread_started = 0;
  on_async(&g->async); /* deliver what finished before the join */
  uv_close((uv_handle_t *)&g->async, NULL);
}

void embps_group_free(embps_group_t *g) {
  if (!g)
    return;
  embps_engine_free(g->engine);
  embps_sequencer_free(g->seq);
  embps_comm_free(g->comm);
  embps_cuda_close(g->stream);
  if (g->control_fds)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      if (g->control_fds[r] >= 0)
        close(g->control_fds[r]);
  embps_free(g->control_fds);
  if (g->rbufs)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      embps_free(g->rbufs[r].data);
  embps_free(g->rbufs);
  if (g->peer_addrs)
    for (uint32_t r = 0; r < g->cfg.size; r++)
      embps_free(g->peer_addrs[r]);
  embps_free(g->peer_addrs);
  embps_free(g->identity);
  close(g->wake_fd);
  pthread_mutex_destroy(&g->mu);
  embps_free(g);
}
