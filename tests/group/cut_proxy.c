/* The cutting proxy of C retry tests (see cut_proxy.h): one thread polls the listening socket and
 * every proxied pair with a 100 ms tick (so a stop is seen), reads what is ready and forwards it
 * with blocking writes; loopback peers that read while they write (libuv, libembps's poll loop)
 * keep that from stalling. */
#define _DEFAULT_SOURCE
#include "cut_proxy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define H2_PREFACE_LEN 24
#define H2_HEADERS 0x1

/* Walks n bytes of one direction; for each frame header completed inside them calls on(arg,
 * off, type, stream) with off where the header began (negative when it began in an earlier
 * read). Returns the first off for which on() returned nonzero, or a value past n when none
 * did. */
static long walk(cut_proxy_walk_t *w, const unsigned char *p, size_t n,
                 int (*on)(void *arg, unsigned type, unsigned stream), void *arg) {
  size_t i = 0;
  while (i < n) {
    if (w->skip) {
      size_t k = n - i < w->skip ? n - i : w->skip;
      w->skip -= (unsigned)k;
      i += k;
    } else if (w->left) {
      size_t k = n - i < w->left ? n - i : w->left;
      w->left -= k;
      i += k;
    } else {
      long start = (long)i - (long)w->have;
      while (w->have < 9 && i < n)
        w->head[w->have++] = p[i++];
      if (w->have < 9)
        break;
      w->have = 0;
      w->left = (unsigned long)w->head[0] << 16 | (unsigned long)w->head[1] << 8 | w->head[2];
      unsigned stream = ((unsigned)w->head[5] << 24 | (unsigned)w->head[6] << 16 |
                         (unsigned)w->head[7] << 8 | w->head[8]) &
                        0x7fffffffu;
      if (on(arg, w->head[3], stream))
        return start;
    }
  }
  return (long)n + 1;
}

static int send_all(int fd, const unsigned char *p, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static void conn_close(cut_proxy_conn_t *pc, int reset) {
  int fds[2] = {pc->c, pc->s};
  for (int i = 0; i < 2; i++) {
    if (fds[i] < 0)
      continue;
    if (reset) {
      struct linger l = {1, 0};
      setsockopt(fds[i], SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    }
    close(fds[i]);
  }
  pc->c = pc->s = -1;
}

typedef struct walk_ctx {
  cut_proxy_t *p;
  cut_proxy_conn_t *pc;
} walk_ctx_t;

/* Client to server: the request to cut, or the streams opened since the arming. Called under
 * p->mu. */
static int on_up(void *arg, unsigned type, unsigned stream) {
  walk_ctx_t *x = arg;
  if (!x->p->armed || type != H2_HEADERS || !stream)
    return 0;
  if (x->p->armed == 2)
    return 1;
  if (x->pc->nstreams < CUT_PROXY_MAX_STREAMS)
    x->pc->streams[x->pc->nstreams++] = stream;
  return 0;
}

/* Server to client: the reply to cut. Called under p->mu. */
static int on_down(void *arg, unsigned type, unsigned stream) {
  walk_ctx_t *x = arg;
  if (x->p->armed != 1 || type != H2_HEADERS)
    return 0;
  for (int i = 0; i < x->pc->nstreams; i++)
    if (x->pc->streams[i] == stream)
      return 1;
  return 0;
}

/* Moves what fd of pc has to read; returns -1 when pc is closed. */
static int pump(cut_proxy_t *p, cut_proxy_conn_t *pc, int from_client) {
  unsigned char buf[65536];
  ssize_t n = recv(from_client ? pc->c : pc->s, buf, sizeof(buf), 0);
  walk_ctx_t x = {p, pc};
  long cut;
  if (n < 0 && (errno == EINTR || errno == EAGAIN))
    return 0;
  if (n <= 0) {
    conn_close(pc, 0);
    return -1;
  }
  pthread_mutex_lock(&p->mu);
  if (pc->generation != p->generation) { /* a new arming: forget the streams of the last one */
    pc->generation = p->generation;
    pc->nstreams = 0;
  }
  cut = walk(from_client ? &pc->up : &pc->down, buf, (size_t)n, from_client ? on_up : on_down, &x);
  if (cut <= n) {
    p->armed = 0;
    p->cuts++;
  }
  pthread_mutex_unlock(&p->mu);
  if (cut <= n) {
    if (cut > 0) /* what came before the cut frame goes on */
      send_all(from_client ? pc->s : pc->c, buf, (size_t)cut);
    conn_close(pc, 1);
    return -1;
  }
  if (send_all(from_client ? pc->s : pc->c, buf, (size_t)n) != 0) {
    conn_close(pc, 0);
    return -1;
  }
  return 0;
}

static void accept_one(cut_proxy_t *p) {
  struct sockaddr_in a;
  int one = 1, c = accept(p->lfd, NULL, NULL), s;
  if (c < 0)
    return;
  s = socket(AF_INET, SOCK_STREAM, 0);
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)p->target_port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof(a)) != 0) {
    if (s >= 0)
      close(s);
    close(c);
    return;
  }
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  for (int i = 0; i < CUT_PROXY_MAX_CONNS; i++)
    if (p->conns[i].c < 0 && p->conns[i].s < 0) {
      cut_proxy_conn_t *pc = &p->conns[i];
      memset(pc, 0, sizeof(*pc));
      pc->c = c;
      pc->s = s;
      pc->up.skip = H2_PREFACE_LEN;
      pthread_mutex_lock(&p->mu);
      pc->generation = p->generation;
      p->accepted++;
      pthread_mutex_unlock(&p->mu);
      return;
    }
  close(s); /* no room: refuse */
  close(c);
}

static void *run(void *arg) {
  cut_proxy_t *p = arg;
  for (;;) {
    struct pollfd pfd[1 + 2 * CUT_PROXY_MAX_CONNS];
    int who[1 + 2 * CUT_PROXY_MAX_CONNS], np = 0, stop, hold;
    pthread_mutex_lock(&p->mu);
    stop = p->stop;
    hold = p->hold;
    pthread_mutex_unlock(&p->mu);
    if (stop)
      break;
    pfd[np] = (struct pollfd){p->lfd, POLLIN, 0};
    who[np++] = -1;
    for (int i = 0; i < CUT_PROXY_MAX_CONNS; i++)
      if (p->conns[i].c >= 0) {
        pfd[np] = (struct pollfd){p->conns[i].c, POLLIN, 0};
        who[np++] = 2 * i;
        if (hold)
          continue; /* the server's bytes wait in its socket */
        pfd[np] = (struct pollfd){p->conns[i].s, POLLIN, 0};
        who[np++] = 2 * i + 1;
      }
    if (poll(pfd, (nfds_t)np, 100) <= 0)
      continue;
    for (int k = 0; k < np; k++) {
      if (!pfd[k].revents)
        continue;
      if (who[k] < 0) {
        accept_one(p);
        continue;
      }
      cut_proxy_conn_t *pc = &p->conns[who[k] / 2];
      if (pc->c >= 0)
        pump(p, pc, who[k] % 2 == 0);
    }
  }
  return NULL;
}

int cut_proxy_start(cut_proxy_t *p, int target_port) {
  struct sockaddr_in a;
  socklen_t len = sizeof(a);
  memset(p, 0, sizeof(*p));
  for (int i = 0; i < CUT_PROXY_MAX_CONNS; i++)
    p->conns[i].c = p->conns[i].s = -1;
  p->target_port = target_port;
  p->lfd = socket(AF_INET, SOCK_STREAM, 0);
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (p->lfd < 0 || bind(p->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
      listen(p->lfd, 16) != 0 || getsockname(p->lfd, (struct sockaddr *)&a, &len) != 0) {
    perror("cut_proxy: listen");
    if (p->lfd >= 0)
      close(p->lfd);
    return -1;
  }
  p->port = ntohs(a.sin_port);
  pthread_mutex_init(&p->mu, NULL);
  if (pthread_create(&p->thread, NULL, run, p) != 0) {
    perror("cut_proxy: thread");
    close(p->lfd);
    pthread_mutex_destroy(&p->mu);
    return -1;
  }
  return 0;
}

void cut_proxy_arm(cut_proxy_t *p) {
  pthread_mutex_lock(&p->mu);
  p->armed = 1;
  p->generation++;
  pthread_mutex_unlock(&p->mu);
}

void cut_proxy_hold(cut_proxy_t *p, int on) {
  pthread_mutex_lock(&p->mu);
  p->hold = on;
  pthread_mutex_unlock(&p->mu);
}

void cut_proxy_arm_request(cut_proxy_t *p) {
  pthread_mutex_lock(&p->mu);
  p->armed = 2;
  p->generation++;
  pthread_mutex_unlock(&p->mu);
}

int cut_proxy_cuts(cut_proxy_t *p) {
  int n;
  pthread_mutex_lock(&p->mu);
  n = p->cuts;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int cut_proxy_accepted(cut_proxy_t *p) {
  int n;
  pthread_mutex_lock(&p->mu);
  n = p->accepted;
  pthread_mutex_unlock(&p->mu);
  return n;
}

void cut_proxy_stop(cut_proxy_t *p) {
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->thread, NULL);
  for (int i = 0; i < CUT_PROXY_MAX_CONNS; i++)
    conn_close(&p->conns[i], 0);
  close(p->lfd);
  pthread_mutex_destroy(&p->mu);
}
