/* Control relays (relay.h): the topology, and a relay's forwarding on the group's thread
 * (group_internal.h). */
#include "server/group/relay.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "server/engine/round_cost.h"
#include "server/group/group_internal.h"

uint32_t embps__relay_fanout_auto(uint32_t n) { return embps_round_control_fanout_auto(n); }

/* The lowest rank of follower r's group (r >= 1, k >= 2). */
static uint32_t group_first(uint32_t k, uint32_t r) { return 1 + (r - 1) / k * k; }

uint32_t embps__relay_up(uint32_t n, uint32_t k, uint32_t r) {
  if (r == 0 || r >= n || k < 2)
    return 0;
  uint32_t first = group_first(k, r);
  return first == r ? 0 : first;
}

uint32_t embps__relay_members(uint32_t n, uint32_t k, uint32_t r, uint32_t *first) {
  if (first)
    *first = 0;
  if (r == 0 || r >= n || k < 2 || group_first(k, r) != r)
    return 0;
  uint32_t end = (uint64_t)r + k < n ? r + k : n; /* one past the group's last rank */
  if (first && end > r + 1)
    *first = r + 1;
  return end - r - 1;
}

int embps__relay_keeps(uint32_t n, uint32_t k, uint32_t r, uint32_t peer) {
  if (r == peer || r >= n || peer >= n)
    return 0;
  if (r != 0 && embps__relay_up(n, k, r) == peer)
    return 1;
  return peer != 0 && embps__relay_up(n, k, peer) == r;
}

embps_status_t embps_group_control_fanout(const char *flag, uint32_t size, uint32_t *out,
                                          embps_error_t *err) {
  char *end;
  unsigned long v;
  if (!flag || !flag[0] || strcmp(flag, "auto") == 0) {
    *out = embps__relay_fanout_auto(size);
    return EMBPS_OK;
  }
  errno = 0;
  v = strtoul(flag, &end, 10);
  if (errno || *end || flag[0] == '-' || flag[0] == '+' || v > 65536)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "--control-fanout '%s' is neither auto nor a count of 0 to 65536 "
                           "(0 or 1: every rank sends its control frames to the leader directly)",
                           flag);
  *out = v < 2 ? 0 : (uint32_t)v;
  return EMBPS_OK;
}

/* ---- forwarding (group's thread) ------------------------------------------------------------- */

int embps__group_relays(const embps_group_t *g) {
  return !embps__group_is_leader(g) &&
         embps__relay_members(g->cfg.size, g->cfg.control_fanout, g->cfg.rank, NULL) > 0;
}

int embps__group_is_member(const embps_group_t *g, uint32_t rank) {
  return rank != g->cfg.rank &&
         embps__relay_up(g->cfg.size, g->cfg.control_fanout, rank) == g->cfg.rank;
}

/* Relay: sends the leader's frames gathered in g->down to every member, in one write each. */
static embps_status_t flush_down(embps_group_t *g, embps_error_t *err) {
  uint32_t first, n = embps__relay_members(g->cfg.size, g->cfg.control_fanout, g->cfg.rank, &first);
  embps_status_t ret = EMBPS_OK;
  for (uint32_t m = first; m < first + n && g->down.len; m++) {
    if (g->control_fds[m] < 0)
      continue;
    if (embps__send_all(g->control_fds[m], g->down.data, g->down.len, UINT64_MAX) != EMBPS__IO_OK) {
      ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                            "rank %u's control connection to its relay (rank %u) failed (it "
                            "stopped or died)",
                            m, g->cfg.rank);
      break;
    }
  }
  g->down.len = 0;
  return ret;
}

embps_status_t embps__group_relay_down(embps_group_t *g, const embps__frame_reader_t *r,
                                       embps_error_t *err) {
  const uint8_t *p = r->in.data + r->off, *payload, *inner, *inner_payload;
  size_t avail = r->in.len - r->off, len, frame_len, inner_len, inner_payload_len;
  uint8_t type, inner_type;
  uint32_t to;
  embps_status_t ret;
  g->down.len = 0;
  while (avail) {
    if (embps__frame_next(p, avail, &type, &payload, &len, &frame_len, NULL) != EMBPS_OK ||
        !frame_len)
      break; /* malformed (the handling pass says so) or not whole yet */
    if (type != EMBPS__FRAME_RELAY) {
      uint8_t *d;
      if (g->down.cap - g->down.len < frame_len) {
        size_t cap = g->down.cap ? g->down.cap : 4096;
        while (cap - g->down.len < frame_len)
          cap *= 2;
        if (!(d = embps_realloc(g->down.data, cap)))
          return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                                 "out of memory for the frames this relay passes on");
        g->down.data = d;
        g->down.cap = cap;
      }
      memcpy(g->down.data + g->down.len, p, frame_len);
      g->down.len += frame_len;
    } else if (embps__parse_relay(payload, len, &to, &inner_type, &inner_payload,
                                  &inner_payload_len, &inner, &inner_len, NULL) == EMBPS_OK &&
               embps__group_is_member(g, to) && g->control_fds[to] >= 0) {
      /* One member's frame: after what came before it, to that member alone. */
      if ((ret = flush_down(g, err)) != EMBPS_OK)
        return ret;
      if (embps__send_all(g->control_fds[to], inner, inner_len, UINT64_MAX) != EMBPS__IO_OK)
        return embps_error_set(err, EMBPS_UNAVAILABLE,
                               "rank %u's control connection to its relay (rank %u) failed (it "
                               "stopped or died)",
                               to, g->cfg.rank);
    }
    p += frame_len;
    avail -= frame_len;
  }
  return flush_down(g, err);
}

embps_status_t embps__group_relay_up(embps_group_t *g, uint32_t member, const uint8_t *frame,
                                     size_t frame_len, embps_error_t *err) {
  return embps__frame_relay(&g->notices, member, frame, frame_len, err);
}
