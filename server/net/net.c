/* The libuv binding of the network layer: a TCP listener and, per connection, a uv_tcp_t, one
 * timer and one h2conn core (h2conn.c) that does all of the protocol.
 *
 * Reads land in one 256 KiB buffer shared by the whole loop: the core consumes every read
 * synchronously (it copies what it keeps), so no connection needs a buffer of its own, and a
 * large buffer lets a multi-megabyte request arrive in few reads. Writes go out as batches of
 * segments from the core, handed to uv_write as one iovec array: reply bodies are written
 * straight from the handler's buffer and released when the write completes. One write is in
 * flight per connection; when it completes the next batch is taken, so output produced while
 * writing (pipelined replies) coalesces into the next writev. Measured on loopback (2 vCPUs,
 * single stream, 2 MiB replies, client advertising 16 MiB frames): strace shows one writev per
 * reply, and throughput was within the (large) run-to-run noise of a raw send() loop
 * (2.4-7.2 GB/s against 1.7-4.2 GB/s).
 *
 * The one timer per connection follows the core's phase: while a reply waits to be written (the
 * peer's flow-control windows or its socket hold it back) it is the send stall timer, restarted
 * only by bytes written, so a client that reads nothing cannot pin replies by sending PINGs;
 * while the preface or a request is half-received it is the stall timer (restarted by every
 * read); while the connection has no open streams it is the idle timer (restarted by every read:
 * a gRPC keepalive PING keeps a connection open), which ends it with a GOAWAY(NO_ERROR); and
 * otherwise it is stopped. A connection closes on a protocol error (after its GOAWAY is
 * written), on a timeout, on EOF or a socket error, and on embps_net_close; closing detaches its
 * outstanding calls inside the core, so the handler may still answer them, and frees the replies
 * it had not sent.
 *
 * Connections beyond max_connections, or beyond max_connections_per_source from one IP address,
 * are accepted and closed at once. The per-source count scans the open connections: one pass
 * over at most max_connections entries per accept, cheap next to the accept itself, and no
 * second structure to keep in step. Everything runs on the loop thread. */
#include "server/net/net.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/hostport.h"
#include "common/log.h"
#include "server/net/h2conn.h"
#include "server/net/tls.h"

#define READ_BUF_BYTES (256u << 10)
#define LISTEN_BACKLOG 511
/* After an idle connection's GOAWAY, how long its write may take before the socket is closed
 * anyway. */
#define GOAWAY_LINGER_MS 1000
/* Refused connections are logged at most this often (a flood must not flood the log). */
#define REFUSAL_LOG_MS 1000

typedef enum timer_mode {
  TIMER_OFF = 0,
  TIMER_STALL,  /* a request half-received: reads restart it */
  TIMER_SEND,   /* replies wait to be written: writes restart it */
  TIMER_IDLE,   /* no open streams: reads restart it; ends with a GOAWAY */
  TIMER_GOAWAY, /* the GOAWAY is queued: close when it is written or this runs out */
} timer_mode_t;

typedef struct conn {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_write_t wreq;
  embps_net_t *net;
  embps__h2conn_t *h2;
  embps__tls_t *tls;  /* NULL: cleartext */
  char peer_name[64]; /* "host:port" of the client, for TLS failures (the socket may be gone) */
  struct conn *prev, *next;
  embps__h2out_t *writing; /* the batch of the write in flight */
  uv_buf_t *bufs;
  size_t bufs_cap;
  int handles; /* handles not yet closed */
  int closing;
  int broken; /* close as soon as the output is written */
  timer_mode_t timer_mode;
  struct sockaddr_storage peer; /* the client's address (family 0 when unknown) */
} conn_t;

struct embps_net {
  uv_loop_t *loop;
  embps_net_config_t cfg;
  embps_net_request_cb on_request;
  void *user;
  uv_tcp_t *listener; /* NULL when not listening; freed by its close callback */
  int port;
  int closing;
  int handles; /* handles of ours not yet closed (listener, rejected sockets) */
  conn_t *conns;
  embps__tls_ctx_t *tls_ctx; /* NULL: cleartext (h2c) */
  embps_net_stats_t stats;
  embps_net_metrics_t metrics; /* the same and more, for other threads (net.h) */
  uint8_t *read_buf;
  int read_buf_busy;
  uint64_t refusal_logged_ms; /* uv_now of the last refusal logged */
  uint64_t refusals_unlogged; /* refusals since then */
};

static void conn_close(conn_t *c);
static void conn_flush(conn_t *c);

/* ---- connections ---- */

static void conn_handle_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  if (--c->handles > 0)
    return;
  c->net->handles--;
  embps__h2conn_free(c->h2); /* detaches calls still owed an answer */
  embps__tls_free(c->tls);
  embps_free(c->bufs);
  embps_free(c);
}

static void conn_close(conn_t *c) {
  if (c->closing)
    return;
  c->closing = 1;
  embps_net_t *net = c->net;
  if (c->prev)
    c->prev->next = c->next;
  else
    net->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  net->stats.connections--;
  atomic_fetch_sub_explicit(&net->metrics.connections, 1, memory_order_relaxed);
  net->handles++; /* until both handles are closed */
  /* A write in flight is cancelled by uv_close; its callback runs first and frees the batch. */
  uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

static void on_timer(uv_timer_t *t) {
  conn_t *c = t->data;
  switch (c->timer_mode) {
  case TIMER_IDLE:
    EMBPS_DEBUG("closing connection: idle for %llu ms",
                (unsigned long long)c->net->cfg.idle_timeout_ms);
    embps__h2conn_goaway(c->h2);
    c->timer_mode = TIMER_GOAWAY;
    uv_timer_start(&c->timer, on_timer, GOAWAY_LINGER_MS, 0);
    conn_flush(c); /* closes once the GOAWAY is written */
    return;
  case TIMER_SEND:
    EMBPS_INFO("closing connection: its client read none of its replies for %llu ms",
               (unsigned long long)c->net->cfg.stall_timeout_ms);
    break;
  case TIMER_STALL:
    EMBPS_INFO("closing connection: stall timeout");
    break;
  default:
    break;
  }
  conn_close(c);
}

/* Arms the timer for the core's phase. bytes_read, bytes_written: progress just made. */
static void conn_update_timer(conn_t *c, int bytes_read, int bytes_written) {
  if (c->closing || c->timer_mode == TIMER_GOAWAY)
    return;
  const embps_net_config_t *cfg = &c->net->cfg;
  embps__h2conn_phase_t phase = embps__h2conn_phase(c->h2);
  timer_mode_t mode = TIMER_OFF;
  uint64_t ms = 0;
  int restart = 0;
  if ((phase == EMBPS__H2_SENDING || c->writing) && cfg->stall_timeout_ms) {
    mode = TIMER_SEND;
    ms = cfg->stall_timeout_ms;
    restart = bytes_written;
  } else if (phase == EMBPS__H2_RECEIVING && cfg->stall_timeout_ms) {
    mode = TIMER_STALL;
    ms = cfg->stall_timeout_ms;
    restart = bytes_read;
  } else if (phase == EMBPS__H2_IDLE && cfg->idle_timeout_ms) {
    mode = TIMER_IDLE;
    ms = cfg->idle_timeout_ms;
    restart = bytes_read;
  }
  if (mode == c->timer_mode && !restart)
    return;
  c->timer_mode = mode;
  if (mode == TIMER_OFF)
    uv_timer_stop(&c->timer);
  else
    uv_timer_start(&c->timer, on_timer, ms, 0);
}

static void on_write(uv_write_t *req, int status) {
  conn_t *c = req->data;
  int replies_written = status == 0 && embps__h2out_body_bytes(c->writing) > 0;
  if (status == 0) {
    c->net->stats.bytes_out += embps__h2out_bytes(c->writing);
    atomic_fetch_add_explicit(&c->net->metrics.bytes_out, embps__h2out_bytes(c->writing),
                              memory_order_relaxed);
  }
  embps__h2out_free(c->writing);
  c->writing = NULL;
  if (status < 0) {
    if (status != UV_ECANCELED)
      EMBPS_INFO("closing connection: write failed: %s", uv_strerror(status));
    conn_close(c);
    return;
  }
  conn_flush(c);
  conn_update_timer(c, 0, replies_written);
}

/* The next batch to write: the core's output, through the TLS layer when there is one. */
static embps__h2out_t *conn_take_output(conn_t *c) {
  return c->tls ? embps__tls_take_output(c->tls, c->h2) : embps__h2conn_take_output(c->h2);
}

/* Writes the core's pending output, one batch at a time; closes when the core is done. */
static void conn_flush(conn_t *c) {
  if (c->closing || c->writing)
    return;
  embps__h2out_t *out = conn_take_output(c);
  if (!out) {
    if (c->broken || embps__h2conn_want_close(c->h2) || (c->tls && embps__tls_failed(c->tls)))
      conn_close(c);
    return;
  }
  size_t nsegs;
  const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
  if (nsegs > c->bufs_cap) {
    size_t cap = c->bufs_cap ? c->bufs_cap : 64;
    while (cap < nsegs)
      cap *= 2;
    uv_buf_t *bufs = embps_realloc(c->bufs, cap * sizeof(*bufs));
    if (!bufs) {
      EMBPS_ERROR("out of memory for %zu write buffers; closing connection", nsegs);
      embps__h2out_free(out);
      conn_close(c);
      return;
    }
    c->bufs = bufs;
    c->bufs_cap = cap;
  }
  for (size_t i = 0; i < nsegs; i++)
    c->bufs[i] = uv_buf_init((char *)segs[i].base, (unsigned int)segs[i].len);
  c->writing = out;
  c->wreq.data = c;
  /* libuv copies the buffer descriptors, so c->bufs may be reused at once. */
  int rc = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, c->bufs, (unsigned int)nsegs, on_write);
  if (rc < 0) {
    EMBPS_INFO("closing connection: uv_write: %s", uv_strerror(rc));
    c->writing = NULL;
    embps__h2out_free(out);
    conn_close(c);
  }
}

/* A call was answered outside a read: write it, and let the timer follow (a reply now waits). */
static void on_core_output(void *user) {
  conn_flush(user);
  conn_update_timer(user, 0, 0);
}

/* Where libuv's next read goes: on a cleartext connection, the body of a large request message
 * is read straight into its buffer (embps__h2conn_read_target), so the kernel's copy is its only
 * one; everything else goes to the shared read buffer. A push of 65536 x 128 f32 is 32 MiB,
 * and its copy out of the read buffer (memmove) was 17.8% of the server's samples under
 * `embps bench --batch 65536 --push-ratio 1` (perf, 2-core VM). */
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn_t *c = h->data;
  embps_net_t *net = c->net;
  size_t cap = READ_BUF_BYTES;
  (void)suggested;
  if (!c->tls && !c->broken) {
    uint8_t *p = embps__h2conn_read_target(c->h2, &cap);
    if (p) {
      *buf = uv_buf_init((char *)p, (unsigned int)(cap < UINT_MAX ? cap : UINT_MAX));
      return;
    }
    if (cap > READ_BUF_BYTES)
      cap = READ_BUF_BYTES;
  }
  if (net->read_buf_busy) { /* cannot happen: reads are consumed synchronously */
    *buf = uv_buf_init(NULL, 0);
    return;
  }
  net->read_buf_busy = 1;
  *buf = uv_buf_init((char *)net->read_buf, (unsigned int)cap);
}

static embps_status_t feed_core(void *user, const uint8_t *data, size_t len) {
  conn_t *c = user;
  return embps__h2conn_feed(c->h2, data, len);
}

/* Feeds what was read to the core, through the TLS layer when there is one. A TLS failure is
 * logged with the peer's address: a handshake refused (wrong CA, no client certificate, a
 * cleartext client) at warn, the end of an established session at info. */
static embps_status_t conn_feed(conn_t *c, const uint8_t *data, size_t len) {
  embps_error_t err;
  embps_status_t st;
  if (!c->tls)
    return embps__h2conn_feed(c->h2, data, len);
  embps_error_clear(&err);
  int handshaking = !embps__tls_handshake_done(c->tls);
  st = embps__tls_feed(c->tls, data, len, feed_core, c, &err);
  if (st != EMBPS_OK && err.status != EMBPS_OK)
    EMBPS_LOG(handshaking ? EMBPS_LOG_WARN : EMBPS_LOG_INFO, "closing connection from %s: %s",
              c->peer_name, err.message);
  return st;
}

/* Writes the IP of a client address into ip ("?" when unknown). */
static void peer_ip(const struct sockaddr_storage *peer, char *ip, size_t size) {
  snprintf(ip, size, "?");
  if (peer->ss_family == AF_INET6)
    uv_ip6_name((const struct sockaddr_in6 *)peer, ip, size);
  else if (peer->ss_family == AF_INET)
    uv_ip4_name((const struct sockaddr_in *)peer, ip, size);
}

/* Writes the client's "host:port" (IPv6 in brackets) into c->peer_name. */
static void conn_name_peer(conn_t *c) {
  char ip[INET6_ADDRSTRLEN];
  int port = c->peer.ss_family == AF_INET6
                 ? ntohs(((const struct sockaddr_in6 *)&c->peer)->sin6_port)
                 : ntohs(((const struct sockaddr_in *)&c->peer)->sin_port);
  peer_ip(&c->peer, ip, sizeof(ip));
  snprintf(c->peer_name, sizeof(c->peer_name), c->peer.ss_family == AF_INET6 ? "[%s]:%d" : "%s:%d",
           ip, port);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = stream->data;
  embps_net_t *net = c->net;
  if (buf->base == (char *)net->read_buf)
    net->read_buf_busy = 0;
  if (nread == 0)
    return;
  if (nread < 0) {
    if (nread != UV_EOF)
      EMBPS_INFO("closing connection: read: %s", uv_strerror((int)nread));
    conn_close(c);
    return;
  }
  if (c->broken)
    return;
  net->stats.bytes_in += (uint64_t)nread;
  atomic_fetch_add_explicit(&net->metrics.bytes_in, (uint64_t)nread, memory_order_relaxed);
  if (conn_feed(c, (const uint8_t *)buf->base, (size_t)nread) != EMBPS_OK) {
    c->broken = 1;
    uv_read_stop(stream);
    uv_timer_stop(&c->timer);
    c->timer_mode = TIMER_OFF;
  }
  conn_flush(c);
  conn_update_timer(c, 1, 0);
}

static void reject_closed(uv_handle_t *h) {
  embps_net_t *net = h->data;
  net->handles--;
  embps_free(h);
}

/* Logs a refused connection, at most once per REFUSAL_LOG_MS with a count of the rest. */
static void log_refusal(embps_net_t *net, const char *why) {
  uint64_t now = uv_now(net->loop);
  if (net->refusal_logged_ms && now - net->refusal_logged_ms < REFUSAL_LOG_MS) {
    net->refusals_unlogged++;
    return;
  }
  if (net->refusals_unlogged)
    EMBPS_WARN("refusing connection: %s (%llu more refused since the last report)", why,
               (unsigned long long)net->refusals_unlogged);
  else
    EMBPS_WARN("refusing connection: %s", why);
  net->refusal_logged_ms = now ? now : 1;
  net->refusals_unlogged = 0;
}

static int same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
  if (a->ss_family != b->ss_family)
    return 0;
  if (a->ss_family == AF_INET)
    return memcmp(&((const struct sockaddr_in *)a)->sin_addr,
                  &((const struct sockaddr_in *)b)->sin_addr, sizeof(struct in_addr)) == 0;
  if (a->ss_family == AF_INET6)
    return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                  &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr)) == 0;
  return 0;
}

/* Records the peer of c (accepted, not yet in net->conns) and says whether its address already
 * has max_connections_per_source connections open. */
static int source_full(embps_net_t *net, conn_t *c) {
  int len = sizeof(c->peer);
  uint32_t limit = net->cfg.max_connections_per_source, n = 0;
  char ip[INET6_ADDRSTRLEN], why[160];
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->peer, &len) < 0) {
    c->peer.ss_family = 0; /* unknown: not counted against any source */
    return 0;
  }
  if (!limit)
    return 0;
  for (const conn_t *o = net->conns; o && n < limit; o = o->next)
    n += (uint32_t)same_host(&o->peer, &c->peer);
  if (n < limit)
    return 0;
  peer_ip(&c->peer, ip, sizeof(ip));
  snprintf(why, sizeof(why), "%s already has max_connections_per_source=%u open", ip, limit);
  log_refusal(net, why);
  return 1;
}

/* Closes a connection that was never counted as open (both handles initialized). */
static void conn_discard(conn_t *c) {
  c->closing = 1;
  c->net->handles++;
  uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

/* The replies a connection may hold: EMBPS_NET_CONNECTION_REPLY_MESSAGES maximal messages
 * (0, no message limit: none either). */
static size_t connection_reply_limit(size_t max_message_bytes) {
  if (max_message_bytes > SIZE_MAX / EMBPS_NET_CONNECTION_REPLY_MESSAGES)
    return SIZE_MAX;
  return max_message_bytes * EMBPS_NET_CONNECTION_REPLY_MESSAGES;
}

static void on_connection(uv_stream_t *server, int status) {
  embps_net_t *net = server->data;
  embps_status_t ret = EMBPS_OK;
  conn_t *c = NULL;
  if (status < 0) {
    EMBPS_WARN("accept: %s", uv_strerror(status));
    return;
  }
  if (net->closing)
    return;
  if (net->cfg.max_connections && net->stats.connections >= net->cfg.max_connections) {
    uv_tcp_t *t = embps_malloc(sizeof(*t));
    if (!t || uv_tcp_init(net->loop, t) < 0) {
      embps_free(t);
      return;
    }
    t->data = net;
    net->handles++;
    if (uv_accept(server, (uv_stream_t *)t) == 0) {
      char why[80];
      snprintf(why, sizeof(why), "max_connections=%u reached", net->cfg.max_connections);
      log_refusal(net, why);
    }
    uv_close((uv_handle_t *)t, reject_closed);
    return;
  }
  c = embps_calloc(1, sizeof(*c));
  EMBPS_CHECK_GOTO(c, EMBPS_RESOURCE_EXHAUSTED, fail, "out of memory for a connection");
  c->net = net;
  embps__h2conn_hooks_t hooks = {.on_request = net->on_request,
                                 .request_user = net->user,
                                 .on_output = on_core_output,
                                 .io_user = c,
                                 .stats = &net->stats,
                                 .metrics = &net->metrics};
  ret = embps__h2conn_new(&c->h2, net->cfg.max_message_bytes, &hooks);
  if (ret != EMBPS_OK)
    goto fail;
  embps__h2conn_set_reply_limit(c->h2, connection_reply_limit(net->cfg.max_message_bytes));
  if (net->tls_ctx && (ret = embps__tls_new(&c->tls, net->tls_ctx)) != EMBPS_OK)
    goto fail;
  EMBPS_UV_CHECK_GOTO(uv_tcp_init(net->loop, &c->tcp), fail);
  c->tcp.data = c;
  c->handles = 1;
  c->timer.data = c;
  if (uv_timer_init(net->loop, &c->timer) < 0) {
    /* Close what is open; the close callback frees the rest. */
    c->handles = 1;
    c->closing = 1;
    net->handles++;
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
    return;
  }
  c->handles = 2;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 || source_full(net, c)) {
    conn_discard(c);
    return;
  }
  c->next = net->conns;
  if (net->conns)
    net->conns->prev = c;
  net->conns = c;
  net->stats.connections++;
  atomic_fetch_add_explicit(&net->metrics.connections, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&net->metrics.connections_accepted, 1, memory_order_relaxed);
  /* Small frames (HEADERS, trailers) must not wait for Nagle. */
  uv_tcp_nodelay(&c->tcp, 1);
  if (c->tls)
    conn_name_peer(c);
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
    conn_close(c);
    return;
  }
  conn_flush(c); /* our SETTINGS */
  conn_update_timer(c, 1, 0);
  return;
fail:
  if (c) {
    embps__h2conn_free(c->h2);
    embps__tls_free(c->tls);
  }
  embps_free(c);
  (void)ret;
}

/* ---- the network layer ---- */

embps_status_t embps_net_new(embps_net_t **out, uv_loop_t *loop, const embps_net_config_t *cfg,
                             embps_net_request_cb on_request, void *user) {
  embps_status_t ret = EMBPS_OK;
  embps_net_t *net = embps_calloc(1, sizeof(*net));
  EMBPS_CHECK_GOTO(net, EMBPS_RESOURCE_EXHAUSTED, fail, "out of memory for the network layer");
  net->read_buf = embps_malloc(READ_BUF_BYTES);
  EMBPS_CHECK_GOTO(net->read_buf, EMBPS_RESOURCE_EXHAUSTED, fail, "out of memory for reads");
  net->loop = loop;
  net->cfg = *cfg;
  net->on_request = on_request;
  net->user = user;
  {
    embps_net_method_metrics_t *other = &net->metrics.methods[EMBPS_NET_METRICS_METHODS];
    snprintf(other->service, sizeof(other->service), "unknown");
    snprintf(other->method, sizeof(other->method), "unknown");
    embps_hist_init(&other->seconds, embps_hist_seconds_bounds, embps_hist_seconds_nbounds);
  }
  *out = net;
exit:
  return ret;
fail:
  if (net)
    embps_free(net->read_buf);
  embps_free(net);
  goto exit;
}

/* Parses "host:port", "[v6]:port" (and "localhost:port") into addr. */
/* A listen address through the project's one host:port parser. The network layer never blocks
 * its loop on a DNS lookup, so the host must be an IP literal, "localhost" or empty (every IPv4
 * interface): main() resolves names before it gets here. */
static embps_status_t listen_addr(const char *host_port, struct sockaddr_storage *addr,
                                  embps_error_t *err) {
  embps_hostport_t hp;
  embps_status_t ret = embps_hostport_parse(&hp, host_port, strlen(host_port), "listen address",
                                            EMBPS_HOSTPORT_LISTEN, err);
  const char *host = hp.host;
  if (ret != EMBPS_OK)
    return ret;
  if (hp.ipv6 && uv_ip6_addr(host, hp.port, (struct sockaddr_in6 *)addr) == 0)
    return EMBPS_OK;
  if (host[0] == '\0')
    host = "0.0.0.0";
  else if (strcmp(host, "localhost") == 0)
    host = "127.0.0.1";
  if (!hp.ipv6 && uv_ip4_addr(host, hp.port, (struct sockaddr_in *)addr) == 0)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                         "listen address '%s': the host must be an IP address (names are "
                         "resolved before the network layer listens)",
                         host_port);
}

static void listener_closed(uv_handle_t *h) {
  embps_net_t *net = h->data;
  net->handles--;
  embps_free(h);
}

embps_status_t embps_net_listen(embps_net_t *net, const char *host_port, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  struct sockaddr_storage addr;
  memset(&addr, 0, sizeof(addr));
  if (!host_port)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "no listen address");
  if ((ret = listen_addr(host_port, &addr, err)) != EMBPS_OK)
    return ret;
  if (net->listener || net->closing)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "the network layer is already %s",
                           net->closing ? "closed" : "listening");
  uv_tcp_t *l = embps_malloc(sizeof(*l));
  if (!l)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for the listener");
  int rc = uv_tcp_init(net->loop, l);
  if (rc < 0) {
    embps_free(l);
    return embps_error_set(err, EMBPS_UNAVAILABLE, "uv_tcp_init: %s", uv_strerror(rc));
  }
  l->data = net;
  net->listener = l;
  net->handles++;
  const char *step = "bind";
  rc = uv_tcp_bind(l, (const struct sockaddr *)&addr, 0);
  if (rc == 0) {
    step = "listen";
    rc = uv_listen((uv_stream_t *)l, LISTEN_BACKLOG, on_connection);
  }
  if (rc == 0) {
    struct sockaddr_storage bound;
    int blen = sizeof(bound);
    step = "getsockname";
    rc = uv_tcp_getsockname(l, (struct sockaddr *)&bound, &blen);
    if (rc == 0)
      net->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
  }
  if (rc < 0) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE, "cannot listen on %s: %s: %s", host_port, step,
                          uv_strerror(rc));
    goto fail;
  }
  EMBPS_DEBUG("bound %s (port %d)", host_port, net->port);
exit:
  return ret;
fail:
  net->listener = NULL;
  net->port = 0;
  uv_close((uv_handle_t *)l, listener_closed);
  goto exit;
}

embps_status_t embps_net_use_tls(embps_net_t *net, const char *cert_file, const char *key_file,
                                 const char *client_ca_file, embps_error_t *err) {
  embps__tls_ctx_t *ctx;
  embps_status_t ret;
  if (net->listener || net->tls_ctx)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "TLS is set up once, before the network layer listens");
  if ((ret = embps__tls_ctx_new(&ctx, cert_file, key_file, client_ca_file, err)) != EMBPS_OK)
    return ret;
  net->tls_ctx = ctx;
  return EMBPS_OK;
}

int embps_net_port(const embps_net_t *net) { return net->port; }

void embps_net_get_stats(const embps_net_t *net, embps_net_stats_t *out) { *out = net->stats; }

const embps_net_metrics_t *embps_net_metrics(const embps_net_t *net) { return &net->metrics; }

void embps_net_stop_listening(embps_net_t *net) {
  if (net->listener) {
    uv_close((uv_handle_t *)net->listener, listener_closed);
    net->listener = NULL;
  }
}

void embps_net_close(embps_net_t *net) {
  if (net->closing)
    return;
  net->closing = 1;
  embps_net_stop_listening(net);
  while (net->conns)
    conn_close(net->conns);
}

void embps_net_free(embps_net_t *net) {
  if (!net)
    return;
  if (net->handles > 0 || net->conns)
    EMBPS_ERROR("embps_net_free before embps_net_close and a turn of the loop: leaking it");
  else {
    embps__tls_ctx_free(net->tls_ctx);
    embps_free(net->read_buf);
    embps_free(net);
  }
}
