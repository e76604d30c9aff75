/* client/conn.c: the read path that puts a lookup reply's rows straight into the caller's
 * buffer. A fake server (an nghttp2 server session in this thread, on an accepted loopback
 * socket) answers one or two Lookup streams; its bytes are written to the socket split at every
 * boundary (every cut into two writes, and byte by byte), and the client is pumped until it
 * has read each piece. The rows must arrive byte-identical, nothing may be written past the
 * buffer or after the stream is cancelled, and the rows must have come by the in-place read
 * (direct_bytes), not by a copy. Padded DATA frames and two streams with interleaved frames
 * take the same checks, and a read must stop when a reply is complete. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client/conn_internal.h"
#include "client/wire.h"
#include "common/varint.h"

#define W 8
#define TOKENS 16
#define ROWS_BYTES (TOKENS * W * 4)

/* ---- the fake server ---- */

typedef struct reply {
  uint8_t b[ROWS_BYTES + 64]; /* gRPC prefix and LookupResponse */
  size_t n, off;
  size_t chunk; /* DATA payload per frame before padding; 0: as long as the frame allows */
} reply_t;

typedef struct fake {
  int lfd, sfd;
  nghttp2_session *session;
  reply_t replies[2];
  int32_t ids[2];
  int nids;
  size_t frame_size; /* DATA frames at most this long */
  size_t padding;    /* DATA frames padded to a multiple of this; 0: none */
  uint8_t out[4 * ROWS_BYTES + 65536];
  size_t out_n;
  uint32_t window; /* the server's stream and connection windows; 0: nghttp2's default */
  uint8_t *got;    /* DATA payload received on the first stream, when got_cap is set */
  size_t got_n, got_cap;
  int32_t got_id;
} fake_t;

static uint8_t rows[2][ROWS_BYTES];

static void put(reply_t *r, uint64_t v) { r->n += embps_varint_put(r->b + r->n, v); }

static void make_reply(reply_t *r, const uint8_t *rws, uint64_t batch_id) {
  r->n = 5;
  r->off = 0;
  put(r, 1 << 3);
  put(r, batch_id);
  put(r, 3 << 3);
  put(r, W);
  put(r, 4 << 3);
  put(r, 1); /* f32 */
  put(r, 5 << 3 | 2);
  put(r, ROWS_BYTES);
  memcpy(r->b + r->n, rws, ROWS_BYTES);
  r->n += ROWS_BYTES;
  size_t len = r->n - 5;
  r->b[0] = 0;
  r->b[1] = (uint8_t)(len >> 24);
  r->b[2] = (uint8_t)(len >> 16);
  r->b[3] = (uint8_t)(len >> 8);
  r->b[4] = (uint8_t)len;
}

static ssize_t fake_read(nghttp2_session *session, int32_t id, uint8_t *buf, size_t length,
                         uint32_t *flags, nghttp2_data_source *source, void *user) {
  reply_t *r = source->ptr;
  size_t n = r->n - r->off < length ? r->n - r->off : length;
  if (r->chunk && n > r->chunk)
    n = r->chunk;
  memcpy(buf, r->b + r->off, n);
  r->off += n;
  if (r->off == r->n) {
    nghttp2_nv tr[] = {{(uint8_t *)"grpc-status", (uint8_t *)"0", 11, 1, 0}};
    *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    assert_int_equal(nghttp2_submit_trailer(session, id, tr, 1), 0);
  }
  return (ssize_t)n;
}

static ssize_t fake_length(nghttp2_session *session, uint8_t type, int32_t id, int32_t sw,
                           int32_t stw, uint32_t max, void *user) {
  fake_t *f = user;
  return (ssize_t)f->frame_size;
}

static ssize_t fake_padding(nghttp2_session *session, const nghttp2_frame *frame, size_t max,
                            void *user) {
  fake_t *f = user;
  if (!f->padding || frame->hd.type != NGHTTP2_DATA)
    return (ssize_t)frame->hd.length;
  size_t n = frame->hd.length + f->padding;
  return (ssize_t)(n < max ? n : max);
}

static int fake_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  fake_t *f = user;
  if ((frame->hd.type == NGHTTP2_DATA || frame->hd.type == NGHTTP2_HEADERS) &&
      (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
    nghttp2_nv hd[] = {{(uint8_t *)":status", (uint8_t *)"200", 7, 3, 0},
                       {(uint8_t *)"content-type", (uint8_t *)"application/grpc", 12, 16, 0}};
    nghttp2_data_provider prd = {.source.ptr = &f->replies[f->nids], .read_callback = fake_read};
    assert_true(f->nids < 2);
    f->ids[f->nids++] = frame->hd.stream_id;
    assert_int_equal(nghttp2_submit_response(session, frame->hd.stream_id, hd, 2, &prd), 0);
  }
  return 0;
}

static int fake_data(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data,
                     size_t len, void *user) {
  fake_t *f = user;
  if (!f->got_id)
    f->got_id = id;
  if (id == f->got_id) {
    assert_true(f->got_n + len <= f->got_cap);
    memcpy(f->got + f->got_n, data, len);
    f->got_n += len;
  }
  return 0;
}

static void fake_start(fake_t *f, embps__addr_t *addr) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(sa);
  nghttp2_session_callbacks *cbs;
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(f->lfd >= 0);
  assert_int_equal(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  assert_int_equal(listen(f->lfd, 4), 0);
  assert_int_equal(getsockname(f->lfd, (struct sockaddr *)&sa, &len), 0);
  memset(addr, 0, sizeof(*addr));
  snprintf(addr->host, sizeof(addr->host), "127.0.0.1");
  snprintf(addr->port, sizeof(addr->port), "%u", ntohs(sa.sin_port));
  snprintf(addr->authority, sizeof(addr->authority), "127.0.0.1:%u", ntohs(sa.sin_port));
  assert_int_equal(nghttp2_session_callbacks_new(&cbs), 0);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, fake_frame_recv);
  nghttp2_session_callbacks_set_data_source_read_length_callback(cbs, fake_length);
  nghttp2_session_callbacks_set_select_padding_callback(cbs, fake_padding);
  if (f->got_cap)
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, fake_data);
  assert_int_equal(nghttp2_session_server_new(&f->session, cbs, f), 0);
  nghttp2_session_callbacks_del(cbs);
  nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, f->window}};
  assert_int_equal(nghttp2_submit_settings(f->session, NGHTTP2_FLAG_NONE, iv, f->window ? 1 : 0),
                   0);
  if (f->window)
    assert_int_equal(
        nghttp2_session_set_local_window_size(f->session, NGHTTP2_FLAG_NONE, 0, (int32_t)f->window),
        0);
  make_reply(&f->replies[0], rows[0], 7);
  make_reply(&f->replies[1], rows[1], 8);
  if (f->padding) /* room in each frame for the padding */
    f->replies[0].chunk = f->replies[1].chunk = f->frame_size - f->padding - 1;
}

/* Reads what the client sent (bounded wait) into the server session. */
static void fake_take(fake_t *f) {
  uint8_t buf[65536];
  for (int i = 0; i < 100; i++) {
    struct pollfd p = {.fd = f->sfd, .events = POLLIN};
    if (poll(&p, 1, i == 0 ? 1000 : 10) <= 0)
      return;
    ssize_t n = recv(f->sfd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0)
      return;
    assert_int_equal(nghttp2_session_mem_recv(f->session, buf, (size_t)n), n);
  }
}

/* Everything the server session has to send, into f->out. */
static void fake_drain(fake_t *f) {
  for (;;) {
    const uint8_t *p;
    ssize_t n = nghttp2_session_mem_send(f->session, &p);
    assert_true(n >= 0);
    if (n == 0)
      return;
    assert_true(f->out_n + (size_t)n <= sizeof(f->out));
    memcpy(f->out + f->out_n, p, (size_t)n);
    f->out_n += (size_t)n;
  }
}

static void fake_stop(fake_t *f) {
  nghttp2_session_del(f->session);
  close(f->sfd);
  close(f->lfd);
}

/* ---- the client side ---- */

typedef struct shard {
  embps__lookup_parser_t parser;
  uint8_t dst[ROWS_BYTES + 16]; /* 16 guard bytes */
  embps__stream_t *s;
} shard_t;

static uint8_t *direct(void *arg, size_t *n) {
  return embps__lookup_parser_direct(&((shard_t *)arg)->parser, n);
}

static void shard_submit(shard_t *sh, embps__conn_t *c) {
  static const uint8_t body[] = {0, 0, 0, 0, 2, 8, 1};
  embps_error_t err;
  memset(sh->dst, 0xab, sizeof(sh->dst));
  embps__lookup_parser_init(&sh->parser, sh->dst, ROWS_BYTES, ROWS_BYTES, W * 4);
  sh->s = calloc(1, sizeof(*sh->s));
  assert_non_null(sh->s);
  sh->s->path = "/embps.v1.EmbeddingService/Lookup";
  sh->s->segs[0] = (embps__seg_t){body, sizeof(body)};
  sh->s->nsegs = 1;
  sh->s->sink = embps__lookup_parser_sink;
  sh->s->sink_direct = direct;
  sh->s->sink_arg = &sh->parser;
  assert_int_equal(embps__conn_submit(c, sh->s, 1000, &err), EMBPS_OK);
}

/* Pumps the client until it has read everything the socket holds (bounded). */
static void client_read_all(embps__conn_t *c) {
  for (int i = 0; i < 1000; i++) {
    int avail = 0;
    embps__conns_pump(&c, 1, 0);
    if (c->fd < 0 || !c->streams || (ioctl(c->fd, FIONREAD, &avail) == 0 && avail == 0))
      return;
  }
  fail_msg("the client did not read what it was sent");
}

static int rcvlowat(int fd) {
  int v = -1;
  socklen_t len = sizeof(v);
  assert_int_equal(getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, &len), 0);
  return v;
}

static void write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0)
      fail_msg("send: %s", strerror(errno));
    p += k;
    n -= (size_t)k;
  }
}

typedef struct run {
  size_t cut;        /* split the reply bytes into [0, cut) and [cut, end); 0: byte by byte */
  size_t frame_size; /* the server's DATA frames */
  size_t padding;
  int nstreams;
  size_t cancel_at;  /* cancel stream 0 after this many reply bytes; 0: never */
  int stop_at_close; /* all bytes at once: one pump must stop reading when one stream is done */
} run_t;

/* One connection, nstreams lookups, the reply bytes written as r says; checks the rows. Returns
 * the bytes read in place. */
static uint64_t run(const run_t *r) {
  fake_t f = {.frame_size = r->frame_size, .padding = r->padding};
  embps__addr_t addr;
  embps__conn_t *c = NULL;
  embps_error_t err;
  shard_t sh[2];
  uint64_t direct_bytes;
  int one = 1;

  fake_start(&f, &addr);
  assert_int_equal(embps__conn_open(&c, &addr, NULL, NULL, 2000, &err), EMBPS_OK);
  f.sfd = accept(f.lfd, NULL, NULL);
  assert_true(f.sfd >= 0);
  /* Each piece leaves at once (no Nagle), so the client sees the splits the test makes. */
  assert_int_equal(setsockopt(f.sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), 0);
  for (int i = 0; i < r->nstreams; i++)
    shard_submit(&sh[i], c);
  embps__conn_kick(c);
  fake_take(&f);
  assert_int_equal(f.nids, r->nstreams);
  fake_drain(&f);

  if (r->stop_at_close) {
    int avail = 0;
    write_all(f.sfd, f.out, f.out_n);
    embps__conns_pump(&c, 1, 100);
    assert_int_equal(ioctl(c->fd, FIONREAD, &avail), 0);
    assert_true(avail > 0);                             /* the other reply still waits */
    assert_int_equal(sh[0].s->done + sh[1].s->done, 1); /* one is complete */
    client_read_all(c);
  } else if (r->cut > 0) {
    size_t cut = r->cut < f.out_n ? r->cut : f.out_n;
    write_all(f.sfd, f.out, cut);
    client_read_all(c);
    write_all(f.sfd, f.out + cut, f.out_n - cut);
    client_read_all(c);
  } else {
    for (size_t i = 0; i < f.out_n; i++) {
      if (r->cancel_at && i == r->cancel_at)
        embps__stream_cancel(sh[0].s, EMBPS_CANCELLED, "cancelled by the test");
      write_all(f.sfd, f.out + i, 1);
      client_read_all(c);
    }
  }
  for (int i = 0; i < r->nstreams; i++) {
    for (size_t k = ROWS_BYTES; k < sizeof(sh[i].dst); k++)
      assert_int_equal(sh[i].dst[k], 0xab); /* nothing past the rows */
    if (r->cancel_at && i == 0) {
      /* Rows that arrived after the cancel are not written: the buffer is the caller's again. */
      size_t have = (size_t)sh[0].parser.rows_have;
      assert_true(have < ROWS_BYTES);
      for (size_t k = have; k < ROWS_BYTES; k++)
        assert_int_equal(sh[0].dst[k], 0xab);
      continue;
    }
    assert_true(sh[i].s->done);
    assert_int_equal(sh[i].s->result.status, EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&sh[i].parser, &err), EMBPS_OK);
    assert_int_equal(sh[i].parser.batch_id, 7 + (uint64_t)i);
    assert_memory_equal(sh[i].dst, rows[i], ROWS_BYTES);
  }
  direct_bytes = c->direct_bytes;
  for (int i = 0; i < r->nstreams; i++)
    embps__stream_release(sh[i].s);
  embps__conn_free(c);
  fake_stop(&f);
  return direct_bytes;
}

static void fill_rows(void) {
  for (size_t i = 0; i < ROWS_BYTES; i++) {
    rows[0][i] = (uint8_t)(i * 7 + 3);
    rows[1][i] = (uint8_t)(i * 13 + 5);
  }
}

/* Every cut of the reply's bytes into two reads, and byte by byte: the rows are right and all
 * but the few that a read takes with the fields before them are read in place. */
static void test_every_split(void **state) {
  run_t r = {.frame_size = 16384, .nstreams = 1};
  fill_rows();
  assert_true(run(&r) >= ROWS_BYTES - 64);
  for (r.cut = 1; r.cut < 200 + ROWS_BYTES; r.cut++) {
    uint64_t d = run(&r);
    if (d < ROWS_BYTES - 128)
      fail_msg("cut %zu: %llu bytes read in place", r.cut, (unsigned long long)d);
  }
}

/* Small DATA frames: every frame boundary falls inside the rows. */
static void test_small_frames(void **state) {
  run_t r = {.frame_size = 100, .nstreams = 1};
  fill_rows();
  assert_true(run(&r) >= ROWS_BYTES / 2);
  r.frame_size = 1;
  run(&r);
}

/* Padded DATA frames are read through the buffer (the pad length comes first), rightly. */
static void test_padded(void **state) {
  run_t r = {.frame_size = 200, .padding = 37, .nstreams = 1};
  fill_rows();
  assert_int_equal(run(&r), 0);
  r.cut = 150;
  run(&r);
}

/* Two lookups on one connection with interleaved DATA frames: each stream's rows land in its
 * own buffer. */
static void test_two_streams(void **state) {
  run_t r = {.frame_size = 96, .nstreams = 2};
  fill_rows();
  assert_true(run(&r) >= ROWS_BYTES);
  r.frame_size = 16384;
  for (r.cut = 1; r.cut < 2 * ROWS_BYTES + 400; r.cut += 37)
    run(&r);
}

/* A read stops when a reply is complete, so that the caller can send its next request while
 * the reply behind it is still arriving. */
static void test_read_stops_at_a_complete_reply(void **state) {
  run_t r = {.frame_size = 16384, .nstreams = 2, .stop_at_close = 1};
  fill_rows();
  run(&r);
}

/* A stream cancelled halfway through its rows takes no more bytes into the caller's buffer. */
static void test_cancelled(void **state) {
  run_t r = {.frame_size = 16384, .nstreams = 1, .cancel_at = 200 + ROWS_BYTES / 2};
  fill_rows();
  run(&r);
}

/* The wait's low-water mark follows the frame being read: the rest of a large frame, at most
 * 1 MiB, and the default (1) for a small one or between frames; set only when it changes. */
static void test_waits_for_the_rest_of_a_frame(void **state) {
  fake_t f = {.frame_size = 16384};
  embps__addr_t addr;
  embps__conn_t *c = NULL;
  embps_error_t err;
  static const struct {
    size_t have, left;
    int want;
  } cases[] = {
      {9, 200000, 200000},    /* the rest of a 200 KB frame */
      {9, 5u << 20, 1 << 20}, /* a 5 MiB frame: 1 MiB at a time */
      {9, 65536, 65536},      /* just large enough */
      {9, 65535, 1},          /* a small frame: any byte */
      {4, 0, 1},              /* inside a frame header */
      {9, 1u << 20, 1 << 20}, /* from 1 again to a large one */
  };
  fake_start(&f, &addr);
  assert_int_equal(embps__conn_open(&c, &addr, NULL, NULL, 2000, &err), EMBPS_OK);
  f.sfd = accept(f.lfd, NULL, NULL);
  assert_true(f.sfd >= 0);
  assert_int_equal(rcvlowat(c->fd), 1);
  embps_h2_frames_t saved = c->frames;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    c->frames.have = cases[i].have;
    c->frames.left = cases[i].left;
    embps__conn_wait_for_frame(c);
    assert_int_equal(rcvlowat(c->fd), cases[i].want);
  }
  c->frames = saved;
  embps__conn_free(c);
  fake_stop(&f);
}

/* ---- request bodies sent by reference ---- */

#define BIG_BODY ((size_t)3 << 19) /* 1.5 MiB: more than one DATA frame of 1 MiB */

typedef struct body_run {
  fake_t f;
  embps__conn_t *c;
  embps__stream_t *s;
  uint8_t *big;  /* the caller's array: the body's second segment */
  uint8_t *want; /* the whole body as it must arrive */
  size_t body_n;
} body_run_t;

static const uint8_t body_head[] = {0, 0, 0x40, 0, 0x13, 0x0a, 0x05, 't', 'a', 'b', 'l', 'e'};
static const uint8_t body_tail[] = {0x18, 0x2a};
#define ZEROS_SEG 1000

/* A connection whose socket buffers are small, so that the body's frames wait in the client's
 * output queue, and a stream submitted with that body: a header, the caller's array, a run of
 * zeros and a tail. The server's windows take the whole body after the first frame. */
static void body_start(body_run_t *b) {
  embps__addr_t addr;
  embps_error_t err;
  int small = 4096;
  memset(b, 0, sizeof(*b));
  b->f.frame_size = 16384;
  b->f.window = 64u << 20;
  b->body_n = sizeof(body_head) + BIG_BODY + ZEROS_SEG + sizeof(body_tail);
  b->f.got_cap = b->body_n;
  b->f.got = malloc(b->f.got_cap);
  b->big = malloc(BIG_BODY);
  b->want = malloc(b->body_n);
  assert_non_null(b->f.got);
  assert_non_null(b->big);
  assert_non_null(b->want);
  for (size_t i = 0; i < BIG_BODY; i++)
    b->big[i] = (uint8_t)(i * 31 + (i >> 13));
  uint8_t *w = b->want;
  memcpy(w, body_head, sizeof(body_head)), w += sizeof(body_head);
  memcpy(w, b->big, BIG_BODY), w += BIG_BODY;
  memset(w, 0, ZEROS_SEG), w += ZEROS_SEG;
  memcpy(w, body_tail, sizeof(body_tail));
  fake_start(&b->f, &addr);
  assert_int_equal(setsockopt(b->f.lfd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  assert_int_equal(embps__conn_open(&b->c, &addr, NULL, NULL, 2000, &err), EMBPS_OK);
  assert_int_equal(setsockopt(b->c->fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  b->f.sfd = accept(b->f.lfd, NULL, NULL);
  assert_true(b->f.sfd >= 0);
  b->s = calloc(1, sizeof(*b->s));
  assert_non_null(b->s);
  b->s->path = "/embps.v1.EmbeddingService/PushGradients";
  b->s->segs[0] = (embps__seg_t){body_head, sizeof(body_head)};
  b->s->segs[1] = (embps__seg_t){b->big, BIG_BODY};
  b->s->segs[2] = (embps__seg_t){NULL, ZEROS_SEG};
  b->s->segs[3] = (embps__seg_t){body_tail, sizeof(body_tail)};
  b->s->nsegs = 4;
  assert_int_equal(embps__conn_submit(b->c, b->s, 5000, &err), EMBPS_OK);
  embps__conn_kick(b->c);
  /* The server's SETTINGS and WINDOW_UPDATE (its windows, for the frames after the first). */
  fake_drain(&b->f);
  write_all(b->f.sfd, b->f.out, b->f.out_n);
  b->f.out_n = 0;
}

/* Alternates server reads and client writes until the server has taken everything (bounded). */
static void body_pump(body_run_t *b) {
  uint8_t buf[65536];
  for (int i = 0; i < 20000; i++) {
    int progress = 0;
    for (;;) {
      ssize_t n = recv(b->f.sfd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0)
        break;
      assert_int_equal(nghttp2_session_mem_recv(b->f.session, buf, (size_t)n), n);
      progress = 1;
    }
    fake_drain(&b->f); /* WINDOW_UPDATEs, and SETTINGS acks */
    if (b->f.out_n) {
      write_all(b->f.sfd, b->f.out, b->f.out_n);
      b->f.out_n = 0;
    }
    if (b->c->fd >= 0)
      embps__conns_pump(&b->c, 1, 0);
    if (!progress && b->c->out_bytes == 0 && i > 10) {
      struct pollfd p = {.fd = b->f.sfd, .events = POLLIN};
      if (poll(&p, 1, 20) <= 0)
        return;
    }
  }
  fail_msg("the body did not get through");
}

static void body_stop(body_run_t *b) {
  embps__stream_release(b->s);
  embps__conn_free(b->c);
  fake_stop(&b->f);
  free(b->f.got), free(b->big), free(b->want);
}

/* The body's array goes to the socket from the caller's memory, not through a copy, and
 * arrives byte for byte, through a socket too small to take it at once. */
static void test_body_by_reference(void **state) {
  body_run_t b;
  body_start(&b);
  body_pump(&b);
  assert_int_equal(b.f.got_n, b.body_n);
  assert_memory_equal(b.f.got, b.want, b.body_n);
  assert_true(b.c->ref_bytes >= BIG_BODY);
  body_stop(&b);
}

/* A stream that finishes while its body still waits in the queue by reference: the queue
 * copies what it holds of the caller's memory, so the caller may overwrite it at once, and the
 * frames already made still carry the body's own bytes. */
static void test_body_owned_when_the_stream_finishes(void **state) {
  body_run_t b;
  body_start(&b);
  /* The first DATA frame (the 64 KiB the default window allowed) waits, most of it, in the
   * queue by reference: the socket is full and the server has read nothing. */
  size_t queued = b.c->out_bytes;
  assert_true(queued > 32768);
  assert_true(b.c->ref_bytes > 32768);
  embps__stream_cancel(b.s, EMBPS_CANCELLED, "cancelled by the test");
  memset(b.big, 0xee, BIG_BODY);
  body_pump(&b);
  assert_true(b.f.got_n >= 65535 && b.f.got_n < b.body_n); /* that frame, and no more */
  assert_memory_equal(b.f.got, b.want, b.f.got_n);
  body_stop(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_split),
      cmocka_unit_test(test_small_frames),
      cmocka_unit_test(test_padded),
      cmocka_unit_test(test_two_streams),
      cmocka_unit_test(test_cancelled),
      cmocka_unit_test(test_read_stops_at_a_complete_reply),
      cmocka_unit_test(test_waits_for_the_rest_of_a_frame),
      cmocka_unit_test(test_body_by_reference),
      cmocka_unit_test(test_body_owned_when_the_stream_finishes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
