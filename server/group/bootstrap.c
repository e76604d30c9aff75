/* Group bootstrap: N ranks meet over TCP and check that they agree before serving.
 *
 * Every rank listens on its peer address first, then connects to every lower rank and accepts
 * every higher one, so each pair of ranks is joined exactly once per connection kind (control
 * and data) and nobody needs to know who starts first. Connections only ever go downward, so
 * there is no cycle of waits: rank 0 only accepts, and a higher rank's connection simply waits
 * in the lower rank's listen backlog until that rank has finished its own connects. A connector
 * retries every RETRY_MS while the peer is not listening yet (connection refused, a name not
 * resolving yet, a connection dropped before its verdict), until the deadline.
 *
 * The protocol on each new connection (integers big-endian):
 *   connector -> acceptor  hello:   "EMBPS1" | kind u8 (0 control, 1 data) | sender rank u32 |
 *                                   group size u32 | identity length u32 | identity bytes
 *   acceptor -> connector  verdict: u8 (0 accept, 1 refuse) | message length u16 | message
 * The acceptor checks, in this order, the group size, that the sender is a higher rank not
 * yet connected for that kind, and the identity key by key ("key=value" lines, any order);
 * a refusal names what differs from the acceptor's point of view and the connector fails with
 * it (FAILED_PRECONDITION). The acceptor itself keeps waiting for a matching peer (the refused
 * one may be restarted with the right configuration) and, if the deadline passes, fails with
 * the last refusal rather than a bare timeout. Connections that do not open with the magic
 * (a port scanner, a gRPC client pointed at the peer port) are closed and ignored; accepted
 * connections are read concurrently through one poll() so an idle one cannot stall the rest.
 * When every connection is up, each rank sends READY_BYTE on every control connection and
 * waits for one from every peer: a rank receives all of them only once every rank holds all of
 * its connections, so bootstrap returns on every rank only when the whole group is up.
 *
 * Everything runs on non-blocking sockets with one deadline; the sockets handed back are made
 * blocking again. The module runs before any event loop exists, so it uses plain poll()
 * rather than libuv. */
#include "server/group/bootstrap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/log.h"

#define HELLO_MAGIC "EMBPS1"
#define MAGIC_LEN 6
#define HELLO_HEADER_LEN (MAGIC_LEN + 1 + 4 + 4 + 4)
#define MAX_IDENTITY_LEN (64u * 1024u)
#define VERDICT_HEADER_LEN 3
#define VERDICT_ACCEPT 0
#define VERDICT_REFUSE 1
#define READY_BYTE 'R'
/* How often a connector retries a peer that is not listening yet. */
#define RETRY_MS 50
/* Accepted connections still reading their hello; beyond this the oldest is dropped, so a
 * flood of idle connections cannot lock the real peers out. */
#define MAX_PENDING 64
/* Values quoted in a mismatch message are clipped so the message fits embps_error_t. */
#define MAX_QUOTED 120
#define HOST_CAP 256

typedef struct peer_addr {
  char host[HOST_CAP];
  unsigned port;
  int v6; /* written as "[host]" */
} peer_addr_t;

/* A hello as received. identity is owned (NUL-terminated). */
typedef struct hello {
  uint8_t kind;
  uint32_t rank;
  uint32_t size;
  uint32_t identity_len;
  char *identity;
} hello_t;

/* An accepted connection still reading its hello. */
typedef struct pending {
  int fd;
  uint8_t header[HELLO_HEADER_LEN];
  size_t have;   /* bytes of header + identity read so far */
  hello_t hello; /* filled once the header is complete */
} pending_t;

typedef enum { IO_OK = 0, IO_ERROR, IO_EOF, IO_TIMEOUT } io_result_t;

static const char *kind_name(unsigned kind) { return kind == 0 ? "control" : "data"; }

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Milliseconds left until deadline, clipped to what poll() takes. */
static int remaining_ms(uint64_t deadline) {
  uint64_t now = now_ms();
  if (now >= deadline)
    return 0;
  uint64_t left = deadline - now;
  return left > 1000000000u ? 1000000000 : (int)left;
}

static void put_u32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* ---- addresses ---- */

/* Parses "host:port" or "[v6]:port" with port 1..65535. Returns 0, or -1 when it does not. */
static int parse_addr(const char *text, peer_addr_t *out) {
  const char *host, *host_end, *port;
  int v6 = 0;
  if (!text)
    return -1;
  if (text[0] == '[') {
    host = text + 1;
    host_end = strchr(host, ']');
    if (!host_end || host_end[1] != ':')
      return -1;
    port = host_end + 2;
    v6 = 1;
  } else {
    host = text;
    host_end = strrchr(text, ':');
    if (!host_end || memchr(host, ':', (size_t)(host_end - host)))
      return -1; /* no port, or an unbracketed IPv6 address */
    port = host_end + 1;
  }
  size_t host_len = (size_t)(host_end - host);
  if (host_len == 0 || host_len >= HOST_CAP)
    return -1;
  for (size_t i = 0; i < host_len; i++) {
    char c = host[i];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '.' || c == '-' || c == '_' || (v6 && (c == ':' || c == '%'));
    if (!ok)
      return -1;
  }
  unsigned long p = 0;
  size_t digits = 0;
  for (; port[digits]; digits++) {
    if (port[digits] < '0' || port[digits] > '9' || digits >= 5)
      return -1;
    p = p * 10 + (unsigned long)(port[digits] - '0');
  }
  if (digits == 0 || p == 0 || p > 65535)
    return -1;
  memcpy(out->host, host, host_len);
  out->host[host_len] = '\0';
  out->port = (unsigned)p;
  out->v6 = v6;
  return 0;
}

/* Resolves an address to one socket address; wildcard gives the family's any-address. Returns
 * 0, or a getaddrinfo error code. */
static int resolve(const peer_addr_t *a, int wildcard, struct sockaddr_storage *ss,
                   socklen_t *len) {
  memset(ss, 0, sizeof(*ss));
  if (!a->v6 && (wildcard || strcmp(a->host, "localhost") == 0)) {
    struct sockaddr_in *in = (struct sockaddr_in *)ss;
    in->sin_family = AF_INET;
    in->sin_port = htons((uint16_t)a->port);
    in->sin_addr.s_addr = htonl(wildcard ? INADDR_ANY : INADDR_LOOPBACK);
    *len = sizeof(*in);
    return 0;
  }
  if (a->v6 && wildcard) {
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons((uint16_t)a->port);
    in6->sin6_addr = in6addr_any;
    *len = sizeof(*in6);
    return 0;
  }
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = a->v6 ? AF_INET6 : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = a->v6 ? AI_NUMERICHOST : 0;
  int rc = getaddrinfo(a->host, NULL, &hints, &res);
  if (rc != 0)
    return rc;
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  if (ss->ss_family == AF_INET6)
    ((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)a->port);
  else
    ((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)a->port);
  freeaddrinfo(res);
  return 0;
}

embps_status_t embps_group_peer_addr(const char *client_addr, int port_offset, char *out,
                                     size_t cap, embps_error_t *err) {
  peer_addr_t a;
  if (!out || parse_addr(client_addr, &a) != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "client address '%s' is not host:port with a port in 1..65535",
                           client_addr ? client_addr : "(null)");
  long port = (long)a.port + port_offset;
  if (port < 1 || port > 65535)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "peer port of '%s' with offset %d is %ld, outside 1..65535", client_addr,
                           port_offset, port);
  char buf[HOST_CAP + 16];
  int n = snprintf(buf, sizeof(buf), a.v6 ? "[%s]:%ld" : "%s:%ld", a.host, port);
  if (n < 0 || (size_t)n >= cap)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "peer address of '%s' does not fit in %zu bytes", client_addr, cap);
  memcpy(out, buf, (size_t)n + 1);
  return EMBPS_OK;
}

/* ---- identity ---- */

/* Finds key in "key=value\n" text; the first occurrence wins. A line without '=' is a key with
 * an empty value. Returns 1 and sets val/vlen when found. */
static int find_value(const char *text, const char *key, size_t klen, const char **val,
                      size_t *vlen) {
  const char *p = text;
  while (*p) {
    const char *eol = strchr(p, '\n');
    size_t line_len = eol ? (size_t)(eol - p) : strlen(p);
    const char *eq = memchr(p, '=', line_len);
    size_t this_klen = eq ? (size_t)(eq - p) : line_len;
    if (line_len > 0 && this_klen == klen && memcmp(p, key, klen) == 0) {
      *val = eq ? eq + 1 : p + line_len;
      *vlen = eq ? line_len - this_klen - 1 : 0;
      return 1;
    }
    p += line_len + (eol ? 1 : 0);
  }
  return 0;
}

/* Looks for a key of `a` that `b` lacks or gives another value. Returns 1 and sets the key and
 * both values (b_val NULL when b lacks it) at the first such key, in a's order. */
static int first_difference(const char *a, const char *b, const char **key, size_t *klen,
                            const char **a_val, size_t *a_vlen, const char **b_val,
                            size_t *b_vlen) {
  const char *p = a;
  while (*p) {
    const char *eol = strchr(p, '\n');
    size_t line_len = eol ? (size_t)(eol - p) : strlen(p);
    const char *eq = memchr(p, '=', line_len);
    size_t this_klen = eq ? (size_t)(eq - p) : line_len;
    if (line_len > 0) {
      const char *v = eq ? eq + 1 : p + line_len;
      size_t vlen = eq ? line_len - this_klen - 1 : 0;
      const char *bv;
      size_t bvlen;
      int found = find_value(b, p, this_klen, &bv, &bvlen);
      if (!found || bvlen != vlen || memcmp(bv, v, vlen) != 0) {
        *key = p;
        *klen = this_klen;
        *a_val = v;
        *a_vlen = vlen;
        *b_val = found ? bv : NULL;
        *b_vlen = found ? bvlen : 0;
        return 1;
      }
    }
    p += line_len + (eol ? 1 : 0);
  }
  return 0;
}

static int clip(size_t n) { return n > MAX_QUOTED ? MAX_QUOTED : (int)n; }

/* Compares the identity of rank there_rank with ours. Returns 0 when they agree, else 1 with
 * the first difference described in why. */
static int identity_differs(const char *here, uint32_t here_rank, const char *there,
                            uint32_t there_rank, char *why, size_t cap) {
  const char *key, *hv, *tv;
  size_t klen, hvlen, tvlen;
  if (strcmp(here, there) == 0)
    return 0;
  if (first_difference(here, there, &key, &klen, &hv, &hvlen, &tv, &tvlen)) {
    if (tv)
      snprintf(why, cap,
               "rank %u's configuration differs from rank %u's: %.*s is '%.*s%s' "
               "there and '%.*s%s' here",
               there_rank, here_rank, clip(klen), key, clip(tvlen), tv,
               tvlen > MAX_QUOTED ? "..." : "", clip(hvlen), hv, hvlen > MAX_QUOTED ? "..." : "");
    else
      snprintf(why, cap,
               "rank %u's configuration differs from rank %u's: %.*s is not set "
               "there and '%.*s%s' here",
               there_rank, here_rank, clip(klen), key, clip(hvlen), hv,
               hvlen > MAX_QUOTED ? "..." : "");
    return 1;
  }
  if (first_difference(there, here, &key, &klen, &tv, &tvlen, &hv, &hvlen)) {
    snprintf(why, cap,
             "rank %u's configuration differs from rank %u's: %.*s is '%.*s%s' "
             "there and not set here",
             there_rank, here_rank, clip(klen), key, clip(tvlen), tv,
             tvlen > MAX_QUOTED ? "..." : "");
    return 1;
  }
  return 0; /* same keys and values, other order or blank lines */
}

/* The acceptor's decision on a complete hello. Returns 0 to accept, 1 to refuse (why says
 * why, from the acceptor's point of view). */
static int judge_hello(uint32_t rank, uint32_t size, const char *identity, const hello_t *h,
                       const int *control_fds, const int *data_fds, char *why, size_t cap) {
  if (h->size != size) {
    snprintf(why, cap,
             "rank %u's group size differs from rank %u's: size is %u there and %u "
             "here",
             h->rank, rank, h->size, size);
    return 1;
  }
  if (h->kind > EMBPS_GROUP_CONN_DATA) {
    snprintf(why, cap, "a peer calling itself rank %u opened a connection of unknown kind %u",
             h->rank, h->kind);
    return 1;
  }
  if (h->rank <= rank || h->rank >= size) {
    snprintf(why, cap,
             "a peer calling itself rank %u connected to rank %u, where only ranks "
             "%u..%u connect; do two processes have the same rank?",
             h->rank, rank, rank + 1, size - 1);
    return 1;
  }
  const int *fds = h->kind == EMBPS_GROUP_CONN_CONTROL ? control_fds : data_fds;
  if (fds[h->rank] >= 0) {
    snprintf(why, cap,
             "rank %u opened a second %s connection to rank %u; is rank %u running "
             "twice?",
             h->rank, kind_name(h->kind), rank, h->rank);
    return 1;
  }
  return identity_differs(identity, rank, h->identity, h->rank, why, cap);
}

/* ---- socket helpers ---- */

static int set_nodelay(int fd) {
  int one = 1;
  return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static int set_blocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0)
    return -1;
  return fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

static void close_fd(int *fd) {
  if (*fd >= 0) {
    close(*fd);
    *fd = -1;
  }
}

/* Waits until fd is ready for `events` or the deadline passes (EINTR counts as ready: the
 * caller retries its call). */
static io_result_t wait_ready(int fd, short events, uint64_t deadline) {
  struct pollfd pfd = {.fd = fd, .events = events};
  int left = remaining_ms(deadline);
  if (left == 0)
    return IO_TIMEOUT;
  if (poll(&pfd, 1, left) < 0 && errno != EINTR)
    return IO_ERROR;
  return IO_OK;
}

/* Sends all n bytes on a non-blocking socket before the deadline. */
static io_result_t send_all(int fd, const void *buf, size_t n, uint64_t deadline) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return IO_ERROR;
    io_result_t w = wait_ready(fd, POLLOUT, deadline);
    if (w != IO_OK)
      return w;
  }
  return IO_OK;
}

/* Receives exactly n bytes from a non-blocking socket before the deadline. */
static io_result_t recv_all(int fd, void *buf, size_t n, uint64_t deadline) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0)
      return IO_EOF;
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return IO_ERROR;
    io_result_t w = wait_ready(fd, POLLIN, deadline);
    if (w != IO_OK)
      return w;
  }
  return IO_OK;
}

/* Sends a verdict; best effort (a refused peer that already left changes nothing). */
static io_result_t send_verdict(int fd, uint8_t verdict, const char *msg, uint64_t deadline) {
  uint8_t buf[VERDICT_HEADER_LEN + sizeof(((embps_error_t *)0)->message)];
  size_t len = strlen(msg);
  if (len > sizeof(buf) - VERDICT_HEADER_LEN)
    len = sizeof(buf) - VERDICT_HEADER_LEN;
  buf[0] = verdict;
  buf[1] = (uint8_t)(len >> 8);
  buf[2] = (uint8_t)len;
  memcpy(buf + VERDICT_HEADER_LEN, msg, len);
  return send_all(fd, buf, VERDICT_HEADER_LEN + len, deadline);
}

/* ---- bootstrap ---- */

typedef struct boot {
  uint32_t rank;
  uint32_t size;
  const char *identity;
  size_t identity_len;
  uint64_t timeout_ms;
  uint64_t deadline;
  peer_addr_t *addrs; /* size entries, owned */
  int *control_fds;   /* the caller's arrays */
  int *data_fds;
  char last_refusal[sizeof(((embps_error_t *)0)->message)];
} boot_t;

/* Appends " r" for every rank in [lo, hi) missing a connection in either array. */
static void list_missing(const boot_t *b, uint32_t lo, uint32_t hi, char *out, size_t cap) {
  size_t n = 0;
  out[0] = '\0';
  for (uint32_t r = lo; r < hi && n + 16 < cap; r++) {
    if (r == b->rank || (b->control_fds[r] >= 0 && b->data_fds[r] >= 0))
      continue;
    n += (size_t)snprintf(out + n, cap - n, "%s%u", n ? ", " : "", r);
  }
}

static embps_status_t open_listener(const boot_t *b, int bind_any, int *fd_out,
                                    embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const peer_addr_t *a = &b->addrs[b->rank];
  struct sockaddr_storage ss;
  socklen_t len;
  int fd = -1, one = 1;
  int rc = resolve(a, bind_any, &ss, &len);
  if (rc != 0) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                          "cannot resolve the peer listen address "
                          "'%s': %s",
                          a->host, gai_strerror(rc));
    goto fail;
  }
  fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "socket: %s", strerror(errno));
    goto fail;
  }
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "SO_REUSEADDR: %s", strerror(errno));
    goto fail;
  }
  if (bind(fd, (struct sockaddr *)&ss, len) != 0 || listen(fd, 2 * (int)b->size + 64) != 0) {
    ret =
        embps_error_set(err, EMBPS_UNAVAILABLE,
                        "rank %u cannot listen for peers on %s%s%s:%u"
                        " (%s): %s",
                        b->rank, a->v6 ? "[" : "", bind_any ? (a->v6 ? "::" : "0.0.0.0") : a->host,
                        a->v6 ? "]" : "", a->port, bind_any ? "all interfaces" : "its peer address",
                        strerror(errno));
    goto fail;
  }
  *fd_out = fd;
exit:
  return ret;
fail:
  close_fd(&fd);
  goto exit;
}

/* Connects to lower rank `peer` for `kind`, retrying until the deadline. On EMBPS_OK *fd_out
 * is the accepted connection. */
static embps_status_t connect_peer(boot_t *b, uint32_t peer, uint8_t kind, int *fd_out,
                                   embps_error_t *err) {
  const peer_addr_t *a = &b->addrs[peer];
  char last_why[160] = "no attempt finished";
  uint8_t *hello = NULL;
  char *msg = NULL;
  int fd = -1;
  embps_status_t ret = EMBPS_OK;
  size_t hello_len = HELLO_HEADER_LEN + b->identity_len;

  hello = embps_malloc(hello_len);
  if (!hello) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "out of memory for a %zu-byte hello", hello_len);
    goto fail;
  }
  memcpy(hello, HELLO_MAGIC, MAGIC_LEN);
  hello[MAGIC_LEN] = kind;
  put_u32(hello + MAGIC_LEN + 1, b->rank);
  put_u32(hello + MAGIC_LEN + 5, b->size);
  put_u32(hello + MAGIC_LEN + 9, (uint32_t)b->identity_len);
  memcpy(hello + HELLO_HEADER_LEN, b->identity, b->identity_len);

  for (int attempt = 0;; attempt++) {
    if (attempt > 0) {
      close_fd(&fd);
      int left = remaining_ms(b->deadline);
      if (left == 0)
        break;
      poll(NULL, 0, left < RETRY_MS ? left : RETRY_MS);
    }
    if (remaining_ms(b->deadline) == 0)
      break;
    struct sockaddr_storage ss;
    socklen_t len;
    int rc = resolve(a, 0, &ss, &len);
    if (rc != 0) {
      snprintf(last_why, sizeof(last_why), "cannot resolve the host: %s", gai_strerror(rc));
      continue;
    }
    fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "socket: %s", strerror(errno));
      goto fail;
    }
    if (set_nodelay(fd) != 0) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "TCP_NODELAY: %s", strerror(errno));
      goto fail;
    }
    if (connect(fd, (struct sockaddr *)&ss, len) != 0) {
      if (errno != EINPROGRESS) {
        snprintf(last_why, sizeof(last_why), "%s", strerror(errno));
        continue;
      }
      struct pollfd pfd = {.fd = fd, .events = POLLOUT};
      int prc = poll(&pfd, 1, remaining_ms(b->deadline));
      if (prc == 0) {
        snprintf(last_why, sizeof(last_why), "connection attempt timed out");
        continue;
      }
      int so_err = 0;
      socklen_t so_len = sizeof(so_err);
      if (prc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_err, &so_len) != 0 || so_err) {
        snprintf(last_why, sizeof(last_why), "%s", strerror(so_err ? so_err : errno));
        continue;
      }
    }
    io_result_t io = send_all(fd, hello, hello_len, b->deadline);
    uint8_t vh[VERDICT_HEADER_LEN];
    if (io == IO_OK)
      io = recv_all(fd, vh, sizeof(vh), b->deadline);
    if (io != IO_OK) {
      /* The peer's listener may belong to a process on its way out, or be still stuck in its
       * own connects: try again while time is left. */
      snprintf(last_why, sizeof(last_why), "%s before rank %u answered",
               io == IO_TIMEOUT ? "timed out"
               : io == IO_EOF   ? "connection closed"
                                : strerror(errno),
               peer);
      continue;
    }
    size_t msg_len = (size_t)vh[1] << 8 | vh[2];
    msg = embps_malloc(msg_len + 1);
    if (!msg) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "out of memory for a verdict");
      goto fail;
    }
    io = recv_all(fd, msg, msg_len, b->deadline);
    if (io != IO_OK) {
      snprintf(last_why, sizeof(last_why), "rank %u's answer was cut short", peer);
      embps_free(msg);
      msg = NULL;
      continue;
    }
    msg[msg_len] = '\0';
    if (vh[0] != VERDICT_ACCEPT) {
      ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "rank %u refused rank %u: %s", peer,
                            b->rank, msg);
      goto fail;
    }
    *fd_out = fd;
    fd = -1;
    goto exit;
  }
  ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                        "rank %u could not join rank %u at %s%s%s:%u"
                        " within %llu ms (%s); missing ranks: %u",
                        b->rank, peer, a->v6 ? "[" : "", a->host, a->v6 ? "]" : "", a->port,
                        (unsigned long long)b->timeout_ms, last_why, peer);
  goto fail;
exit:
  embps_free(hello);
  embps_free(msg);
  return ret;
fail:
  close_fd(&fd);
  goto exit;
}

static void pending_drop(pending_t *pend, size_t *n, size_t i) {
  close_fd(&pend[i].fd);
  embps_free(pend[i].hello.identity);
  pend[i] = pend[*n - 1];
  (*n)--;
}

/* Reads what is available of pending connection p. Returns 1 when its hello is complete, 0 when
 * more is needed, -1 when it must be dropped (closed, error, not an embps peer). May set why
 * and return 2 for a well-formed peer that must be refused before its identity is read. */
static int pending_read(pending_t *p, char *why, size_t cap) {
  for (;;) {
    uint8_t *dst;
    size_t want;
    if (p->have < HELLO_HEADER_LEN) {
      dst = p->header + p->have;
      want = HELLO_HEADER_LEN - p->have;
    } else {
      size_t got = p->have - HELLO_HEADER_LEN;
      if (got == p->hello.identity_len)
        return 1;
      dst = (uint8_t *)p->hello.identity + got;
      want = p->hello.identity_len - got;
    }
    ssize_t k = recv(p->fd, dst, want, 0);
    if (k == 0)
      return -1;
    if (k < 0)
      return errno == EINTR ? 0 : errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    size_t before = p->have;
    p->have += (size_t)k;
    if (before < MAGIC_LEN) {
      size_t upto = p->have < MAGIC_LEN ? p->have : MAGIC_LEN;
      if (memcmp(p->header, HELLO_MAGIC, upto) != 0)
        return -1;
    }
    if (before < HELLO_HEADER_LEN && p->have == HELLO_HEADER_LEN) {
      p->hello.kind = p->header[MAGIC_LEN];
      p->hello.rank = get_u32(p->header + MAGIC_LEN + 1);
      p->hello.size = get_u32(p->header + MAGIC_LEN + 5);
      p->hello.identity_len = get_u32(p->header + MAGIC_LEN + 9);
      if (p->hello.identity_len >= MAX_IDENTITY_LEN) {
        snprintf(why, cap, "rank %u sent a %u-byte configuration, more than the %u allowed",
                 p->hello.rank, p->hello.identity_len, MAX_IDENTITY_LEN);
        return 2;
      }
      p->hello.identity = embps_malloc(p->hello.identity_len + 1);
      if (!p->hello.identity)
        return -1;
      p->hello.identity[p->hello.identity_len] = '\0';
    }
  }
}

/* Accepts every higher rank's two connections. */
static embps_status_t accept_peers(boot_t *b, int listen_fd, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  pending_t *pend = NULL;
  struct pollfd *pfds = NULL;
  size_t npend = 0;
  uint32_t expected = 2 * (b->size - 1 - b->rank), joined = 0;
  char why[sizeof(((embps_error_t *)0)->message)];

  if (expected == 0)
    return EMBPS_OK;
  pend = embps_calloc(MAX_PENDING, sizeof(*pend));
  pfds = embps_calloc(MAX_PENDING + 1, sizeof(*pfds));
  if (!pend || !pfds) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "out of memory for pending connections");
    goto fail;
  }
  while (joined < expected) {
    int left = remaining_ms(b->deadline);
    if (left == 0)
      break;
    pfds[0] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
    for (size_t i = 0; i < npend; i++)
      pfds[i + 1] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
    size_t npoll = npend + 1;
    int prc = poll(pfds, npoll, left);
    if (prc < 0 && errno != EINTR) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "poll: %s", strerror(errno));
      goto fail;
    }
    if (prc <= 0)
      continue;
    /* Pending connections first, from the end, so dropping one does not skip another. */
    for (size_t i = npoll - 1; i >= 1; i--) {
      if (!pfds[i].revents)
        continue;
      pending_t *p = &pend[i - 1];
      int rc = pending_read(p, why, sizeof(why));
      if (rc == 0)
        continue;
      if (rc < 0) {
        if (p->have < MAGIC_LEN || memcmp(p->header, HELLO_MAGIC, MAGIC_LEN) != 0)
          EMBPS_DEBUG("rank %u: ignored a connection that is not an embps peer", b->rank);
        pending_drop(pend, &npend, i - 1);
        continue;
      }
      if (rc == 1 && !judge_hello(b->rank, b->size, b->identity, &p->hello, b->control_fds,
                                  b->data_fds, why, sizeof(why))) {
        if (send_verdict(p->fd, VERDICT_ACCEPT, "", b->deadline) != IO_OK) {
          pending_drop(pend, &npend, i - 1);
          continue;
        }
        int *slot = p->hello.kind == EMBPS_GROUP_CONN_CONTROL ? &b->control_fds[p->hello.rank]
                                                              : &b->data_fds[p->hello.rank];
        *slot = p->fd;
        p->fd = -1;
        joined++;
        EMBPS_DEBUG("rank %u: rank %u joined (%s)", b->rank, p->hello.rank,
                    kind_name(p->hello.kind));
      } else {
        EMBPS_WARN("rank %u refused a peer: %s", b->rank, why);
        snprintf(b->last_refusal, sizeof(b->last_refusal), "%s", why);
        send_verdict(p->fd, VERDICT_REFUSE, why, b->deadline);
      }
      pending_drop(pend, &npend, i - 1);
    }
    if (pfds[0].revents) {
      for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
          break; /* EAGAIN, or a connection reset before we took it */
        if (set_nodelay(fd) != 0) {
          close(fd);
          continue;
        }
        if (npend == MAX_PENDING)
          pending_drop(pend, &npend, 0); /* the oldest idle one makes room */
        memset(&pend[npend], 0, sizeof(pend[npend]));
        pend[npend++].fd = fd;
      }
    }
  }
  if (joined < expected) {
    char missing[256];
    list_missing(b, b->rank + 1, b->size, missing, sizeof(missing));
    if (b->last_refusal[0])
      ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION, "%s (missing ranks: %s)",
                            b->last_refusal, missing);
    else
      ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                            "not every rank joined rank %u "
                            "within %llu ms; missing ranks: %s",
                            b->rank, (unsigned long long)b->timeout_ms, missing);
    goto fail;
  }
exit:
  while (npend > 0)
    pending_drop(pend, &npend, npend - 1);
  embps_free(pend);
  embps_free(pfds);
  return ret;
fail:
  goto exit;
}

/* Sends READY_BYTE to every peer and waits for one from each. */
static embps_status_t ready_exchange(boot_t *b, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  struct pollfd *pfds = NULL;
  uint32_t *ranks = NULL;
  uint32_t n = 0, waiting;
  const uint8_t ready = READY_BYTE;

  pfds = embps_calloc(b->size, sizeof(*pfds));
  ranks = embps_calloc(b->size, sizeof(*ranks));
  if (!pfds || !ranks) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "out of memory for the ready exchange");
    goto fail;
  }
  for (uint32_t r = 0; r < b->size; r++) {
    if (r == b->rank)
      continue;
    if (send_all(b->control_fds[r], &ready, 1, b->deadline) != IO_OK) {
      ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                            "rank %u could not tell rank %u it is ready"
                            ": %s",
                            b->rank, r, strerror(errno));
      goto fail;
    }
    pfds[n] = (struct pollfd){.fd = b->control_fds[r], .events = POLLIN};
    ranks[n++] = r;
  }
  waiting = n;
  while (waiting > 0) {
    int left = remaining_ms(b->deadline);
    if (left == 0) {
      char missing[256];
      size_t len = 0;
      missing[0] = '\0';
      for (uint32_t i = 0; i < n && len + 16 < sizeof(missing); i++)
        if (pfds[i].fd >= 0)
          len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%u", len ? ", " : "",
                                  ranks[i]);
      ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                            "rank %u: the group was not ready "
                            "within %llu ms; missing ranks: %s",
                            b->rank, (unsigned long long)b->timeout_ms, missing);
      goto fail;
    }
    int prc = poll(pfds, n, left);
    if (prc < 0 && errno != EINTR) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "poll: %s", strerror(errno));
      goto fail;
    }
    for (uint32_t i = 0; prc > 0 && i < n; i++) {
      if (pfds[i].fd < 0 || !pfds[i].revents)
        continue;
      uint8_t byte;
      ssize_t k = recv(pfds[i].fd, &byte, 1, 0);
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        continue;
      if (k != 1 || byte != READY_BYTE) {
        ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                              "rank %u dropped its connection to rank "
                              "%u before the group was ready (it failed its own bootstrap?)",
                              ranks[i], b->rank);
        goto fail;
      }
      pfds[i].fd = -1; /* poll ignores negative descriptors */
      waiting--;
    }
  }
exit:
  embps_free(pfds);
  embps_free(ranks);
  return ret;
fail:
  goto exit;
}

embps_status_t embps_group_bootstrap(uint32_t rank, uint32_t size, const char *const *peer_addrs,
                                     int bind_any, const char *identity, uint64_t timeout_ms,
                                     int *control_fds, int *data_fds, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_error_t local_err;
  boot_t b;
  int listen_fd = -1;

  if (!err)
    err = &local_err; /* the failure is still logged */
  /* Validation, before anything is opened. */
  if (size == 0 || rank >= size || !peer_addrs || !identity || !control_fds || !data_fds)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "bootstrap needs rank < size and "
                           "non-NULL addresses, identity and descriptor arrays (rank %u, size "
                           "%u)",
                           rank, size);
  for (uint32_t r = 0; r < size; r++)
    control_fds[r] = data_fds[r] = -1;
  memset(&b, 0, sizeof(b));
  b.identity_len = strlen(identity);
  if (b.identity_len >= MAX_IDENTITY_LEN)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "the configuration identity is %zu "
                           "bytes, more than the %u allowed",
                           b.identity_len, MAX_IDENTITY_LEN);
  if (size == 1)
    return EMBPS_OK;
  b.addrs = embps_calloc(size, sizeof(*b.addrs));
  if (!b.addrs)
    return embps_error_set(err, EMBPS_INTERNAL, "out of memory for %u peer addresses", size);
  for (uint32_t r = 0; r < size; r++) {
    if (parse_addr(peer_addrs[r], &b.addrs[r]) != 0) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                            "peer address of rank %u, '%s', is not "
                            "host:port, [v6]:port with a port in 1..65535",
                            r, peer_addrs[r] ? peer_addrs[r] : "(null)");
      goto fail;
    }
  }
  b.rank = rank;
  b.size = size;
  b.identity = identity;
  b.timeout_ms = timeout_ms;
  b.deadline = now_ms() + timeout_ms;
  b.control_fds = control_fds;
  b.data_fds = data_fds;

  ret = open_listener(&b, bind_any, &listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  EMBPS_INFO("rank %u of %u: listening for peers on %s, timeout %llu ms", rank, size,
             peer_addrs[rank], (unsigned long long)timeout_ms);
  for (uint32_t r = 0; r < rank; r++) {
    ret = connect_peer(&b, r, EMBPS_GROUP_CONN_CONTROL, &control_fds[r], err);
    if (ret == EMBPS_OK)
      ret = connect_peer(&b, r, EMBPS_GROUP_CONN_DATA, &data_fds[r], err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  ret = accept_peers(&b, listen_fd, err);
  if (ret != EMBPS_OK)
    goto fail;
  /* Nobody joins any more: closing the listener now makes late strays fail fast. */
  close_fd(&listen_fd);
  ret = ready_exchange(&b, err);
  if (ret != EMBPS_OK)
    goto fail;
  for (uint32_t r = 0; r < size; r++) {
    if (r == rank)
      continue;
    if (set_blocking(control_fds[r]) != 0 || set_blocking(data_fds[r]) != 0) {
      ret = embps_error_set(err, EMBPS_INTERNAL, "fcntl: %s", strerror(errno));
      goto fail;
    }
  }
  EMBPS_INFO("rank %u of %u: the group is up", rank, size);
exit:
  close_fd(&listen_fd);
  embps_free(b.addrs);
  return ret;
fail:
  EMBPS_ERROR("rank %u of %u: bootstrap failed: %s", rank, size, err->message);
  for (uint32_t r = 0; r < size; r++) {
    close_fd(&control_fds[r]);
    close_fd(&data_fds[r]);
  }
  goto exit;
}
