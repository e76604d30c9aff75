/* Fuzz target: the server's HTTP/2 + gRPC connection core (server/net/h2conn.c, h2call.c,
 * h2read.c, grpc_frame.c, h2out.c) fed raw bytes as a client's socket would deliver them.
 *
 * The input is the whole byte stream from the client, connection preface included (the seed
 * corpus starts with it, so mutations get past it). It is fed in pieces whose sizes come from
 * the input's last byte, so requests also arrive cut at odd places. Every call the core
 * delivers is answered, by how long its message is: at once with the message echoed, at once
 * with an error, or only after the feed (outside the core's callbacks), and one in four not at
 * all until the connection is freed (a peer gone before its answer). All output is taken and
 * checked to be as long as the batch says. Each piece goes where embps__h2conn_read_target says,
 * as the network layer's reads do: into a large message's own buffer when it names one. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "server/net/h2conn.h"

/* Above EMBPS__H2_DIRECT_MIN, so that messages which announce a large length are read in place
 * (embps__h2conn_read_target) as net.c reads them. */
#define MAX_MESSAGE (1u << 20)
#define MAX_LATER 64

typedef struct fuzz_server {
  embps_net_call_t *later[MAX_LATER]; /* answered after the feed */
  int nlater;
  embps_net_call_t *never[MAX_LATER]; /* answered after the connection is freed */
  int nnever;
} fuzz_server_t;

static void on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                       size_t len) {
  fuzz_server_t *sv = user;
  (void)method;
  switch (len % 4) {
  case 0:
    embps_net_call_reply(call, msg, len, embps_free, msg);
    return;
  case 1:
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, "fuzz: refused \x01 100%");
    break;
  case 2:
    if (sv->nlater < MAX_LATER) {
      sv->later[sv->nlater++] = call;
      break;
    }
    embps_net_call_fail(call, EMBPS_UNAVAILABLE, "fuzz: too many");
    break;
  default:
    if (sv->nnever < MAX_LATER) {
      sv->never[sv->nnever++] = call;
      break;
    }
    embps_net_call_fail(call, EMBPS_UNAVAILABLE, "fuzz: too many");
    break;
  }
  embps_free(msg);
}

/* Takes every batch of output ready now and reads each byte of it, as the socket write would. */
static void drain(embps__h2conn_t *conn) {
  embps__h2out_t *out;
  while ((out = embps__h2conn_take_output(conn)) != NULL) {
    size_t nsegs, total = 0;
    const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < nsegs; i++) {
      for (size_t k = 0; k < segs[i].len; k++)
        sink ^= segs[i].base[k];
      total += segs[i].len;
    }
    (void)sink;
    if (total != embps__h2out_bytes(out))
      abort();
    embps__h2out_free(out);
  }
}

static void on_output(void *io_user) { (void)io_user; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static embps_net_stats_t stats;
  static embps_net_metrics_t metrics;
  fuzz_server_t sv = {0};
  embps__h2conn_hooks_t hooks = {.on_request = on_request,
                                 .request_user = &sv,
                                 .on_output = on_output,
                                 .stats = &stats,
                                 .metrics = &metrics};
  embps__h2conn_t *conn;
  size_t piece = size ? (size_t)data[size - 1] * 7 + 1 : 1, off = 0;

  memset(&stats, 0, sizeof(stats));
  memset(&metrics, 0, sizeof(metrics));
  if (embps__h2conn_new(&conn, MAX_MESSAGE, &hooks) != EMBPS_OK)
    return 0;
  drain(conn);
  while (off < size) {
    size_t n = size - off < piece ? size - off : piece, cap;
    uint8_t *in_place = embps__h2conn_read_target(conn, &cap);
    embps_status_t st;
    if (n > cap)
      n = cap;
    if (in_place) { /* the socket's bytes land in the message itself */
      memcpy(in_place, data + off, n);
      st = embps__h2conn_feed(conn, in_place, n);
    } else {
      st = embps__h2conn_feed(conn, data + off, n);
    }
    off += n;
    drain(conn);
    (void)embps__h2conn_phase(conn);
    for (int i = 0; i < sv.nlater; i++)
      embps_net_call_reply(sv.later[i], (const uint8_t *)"late", 4, NULL, NULL);
    sv.nlater = 0;
    drain(conn);
    if (st != EMBPS_OK || embps__h2conn_want_close(conn))
      break;
  }
  for (int i = 0; i < sv.nlater; i++)
    embps_net_call_fail(sv.later[i], EMBPS_INTERNAL, "late");
  embps__h2conn_free(conn);
  for (int i = 0; i < sv.nnever; i++) {
    if (!embps_net_call_cancelled(sv.never[i]))
      abort(); /* its connection is gone */
    embps_net_call_fail(sv.never[i], EMBPS_INTERNAL, "after the connection");
  }
  return 0;
}
