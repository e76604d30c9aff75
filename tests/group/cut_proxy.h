/* A TCP proxy on loopback for C tests of retries, which cuts a connection mid-reply: the C twin of
 * tests/lib/cut_proxy.py's HTTP/2 rule, in a thread of the test process.
 *
 *   cut_proxy_start(&p, target_port);   listens on 127.0.0.1:p.port, forwards to the target
 *   cut_proxy_arm(&p);                  cut the next reply (the rule below), once
 *   ... a call through p.port loses its connection ...
 *   cut_proxy_cuts(&p), cut_proxy_accepted(&p); cut_proxy_stop(&p);
 *
 * The rule: both directions are walked as HTTP/2 frames (9-byte headers; payloads skipped by
 * length; the client's 24-byte preface skipped). Once armed, the first connection on which the
 * server sends a HEADERS frame on a stream the client opened after arming is cut just before
 * that frame: both sockets are closed with SO_LINGER 0 (a reset each side sees at once) and the
 * proxy disarms. An embps server sends a response's HEADERS only with its answer, so the call's
 * work is done (a push applied, or refused) and its client cannot know which: the ambiguous
 * failure a retry must survive. Everything else is forwarded untouched, new connections too.
 *
 * cut_proxy_arm_request(&p) cuts instead just before the client's next HEADERS frame that opens a
 * stream (the request's start, which the server never sees): a request lost on its way, so the
 * other shards of its batch wait on their ranks for a shard that never comes.
 *
 * cut_proxy_hold(&p, 1) holds every server's bytes instead (they wait in the socket's buffer)
 * until cut_proxy_hold(&p, 0): replies stall while requests still reach the server, as behind a
 * congested link. */
#ifndef EMBPS_TEST_CUT_PROXY_H
#define EMBPS_TEST_CUT_PROXY_H

#include <pthread.h>

#define CUT_PROXY_MAX_CONNS 16
#define CUT_PROXY_MAX_STREAMS 64

/** One direction's walk over HTTP/2 frames. */
typedef struct cut_proxy_walk {
  unsigned skip; /* bytes to pass before the first frame (the client's preface) */
  unsigned char head[9];
  unsigned have;      /* bytes of head assembled */
  unsigned long left; /* payload bytes of the current frame still to pass */
} cut_proxy_walk_t;

typedef struct cut_proxy_conn {
  int c, s; /* client and server sockets; -1: closed */
  cut_proxy_walk_t up, down;
  unsigned streams[CUT_PROXY_MAX_STREAMS]; /* streams the client opened since the last arming */
  int nstreams;
  int generation; /* the arming the streams belong to */
} cut_proxy_conn_t;

typedef struct cut_proxy {
  int port;        /* where it listens (127.0.0.1) */
  int target_port; /* where it forwards */
  int lfd;
  pthread_t thread;
  pthread_mutex_t mu;
  int stop, armed, generation, cuts, accepted, hold; /* under mu; armed: 1 reply, 2 request */
  cut_proxy_conn_t conns[CUT_PROXY_MAX_CONNS];       /* the thread's */
} cut_proxy_t;

/** Starts a proxy to 127.0.0.1:target_port on a free loopback port. Returns 0, or -1 with the
 * reason printed. */
int cut_proxy_start(cut_proxy_t *p, int target_port);

/** Arms the cut of the next reply (see above). */
void cut_proxy_arm(cut_proxy_t *p);

/** Arms the cut of the next request (see above). */
void cut_proxy_arm_request(cut_proxy_t *p);

/** Holds (1) or releases (0) the servers' bytes on every connection. */
void cut_proxy_hold(cut_proxy_t *p, int on);

/** Connections cut so far, and connections accepted so far. */
int cut_proxy_cuts(cut_proxy_t *p);
int cut_proxy_accepted(cut_proxy_t *p);

/** Stops the thread and closes every socket. */
void cut_proxy_stop(cut_proxy_t *p);

#endif
