/* Address lists and batch splitting for a shard group.
 *
 * DESIGN.md fixes the split: a batch of T tokens becomes group_size contiguous shards of
 * T/group_size tokens, shard r to rank r, and the client pads T up to a multiple of the group
 * size when asked to. Padding is appended at the end of the batch, so it lands in the last
 * shard(s); the caller's tokens keep their positions and the joined lookup reply is simply
 * the first n rows. Nothing here allocates per batch: a shard is described by ranges over the
 * caller's array plus a count of padding tokens that the transport sends as zeros. */
#include "client/group.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/shape.h"

/* Parses one "host:port" entry of length len at s into a. */
static embps_status_t parse_one(const char *s, size_t len, embps__addr_t *a, embps_error_t *err) {
  const char *host, *port, *colon;
  size_t host_len, port_len;
  unsigned long p = 0;

  if (len == 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "empty server address in the list (expected host:port[,host:port...])");
  if (s[0] == '[') {
    const char *close = memchr(s, ']', len);
    if (!close || close + 1 >= s + len || close[1] != ':')
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "server address '%.*s' is not [ipv6]:port", (int)len, s);
    host = s + 1;
    host_len = (size_t)(close - host);
    colon = close + 1;
  } else {
    colon = NULL;
    for (size_t i = 0; i < len; i++)
      if (s[i] == ':')
        colon = s + i;
    if (!colon)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "server address '%.*s' has no port (expected host:port)", (int)len, s);
    host = s;
    host_len = (size_t)(colon - s);
    if (memchr(host, ':', host_len))
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "server address '%.*s': write IPv6 hosts as [addr]:port", (int)len, s);
  }
  port = colon + 1;
  port_len = (size_t)(s + len - port);
  if (host_len == 0 || host_len >= sizeof(a->host))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "server address '%.*s' has %s host",
                           (int)len, s, host_len == 0 ? "an empty" : "a too long");
  for (size_t i = 0; i < host_len; i++)
    if (isspace((unsigned char)host[i]) || host[i] == '/' || host[i] == '[' || host[i] == ']')
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "server address '%.*s' has a bad character in its host", (int)len, s);
  if (port_len == 0 || port_len > 5)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "server address '%.*s' has a bad port (expected 1..65535)", (int)len, s);
  for (size_t i = 0; i < port_len; i++) {
    if (port[i] < '0' || port[i] > '9')
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "server address '%.*s' has a bad port (expected 1..65535)", (int)len,
                             s);
    p = p * 10 + (unsigned long)(port[i] - '0');
  }
  if (p == 0 || p > 65535)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "server address '%.*s' has a bad port (expected 1..65535)", (int)len, s);
  memcpy(a->host, host, host_len);
  a->host[host_len] = '\0';
  memcpy(a->port, port, port_len);
  a->port[port_len] = '\0';
  memcpy(a->authority, s, len);
  a->authority[len] = '\0';
  return EMBPS_OK;
}

embps_status_t embps__parse_servers(const char *list, embps__addr_t **out, size_t *n,
                                    embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps__addr_t *addrs = NULL;
  size_t count = 1, k = 0;
  const char *s;

  if (!list)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "no server addresses given");
  for (s = list; *s; s++)
    count += *s == ',';
  if (count > EMBPS__MAX_GROUP)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%zu server addresses, at most %d", count,
                           EMBPS__MAX_GROUP);
  addrs = embps_calloc(count, sizeof(*addrs));
  if (!addrs)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  s = list;
  for (;;) {
    const char *end = strchr(s, ',');
    const char *e = end ? end : s + strlen(s);
    while (s < e && isspace((unsigned char)*s))
      s++;
    while (e > s && isspace((unsigned char)e[-1]))
      e--;
    if ((size_t)(e - s) >= sizeof(addrs[k].authority)) {
      ret =
          embps_error_set(err, EMBPS_INVALID_ARGUMENT, "server address '%.40s...' is too long", s);
      goto fail;
    }
    ret = parse_one(s, (size_t)(e - s), &addrs[k], err);
    if (ret != EMBPS_OK)
      goto fail;
    k++;
    if (!end)
      break;
    s = end + 1;
  }
  *out = addrs;
  *n = k;
  return EMBPS_OK;
fail:
  embps_free(addrs);
  return ret;
}

embps_status_t embps__batch_plan(embps__batch_plan_t *plan, uint64_t n, uint32_t group_size,
                                 int pad, embps_error_t *err) {
  uint64_t t = n;
  if (group_size == 0)
    group_size = 1;
  if (pad)
    t = embps_shape_padded_tokens(n, group_size);
  else if (embps_shape_check_tokens_per_batch(n, group_size, err) != EMBPS_OK)
    return EMBPS_INVALID_ARGUMENT;
  if (t > UINT32_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "tokens_per_batch=%llu is over 4294967295: split the batch",
                           (unsigned long long)t);
  plan->n = n;
  plan->tokens_per_batch = t;
  plan->shard_tokens = t / group_size;
  plan->group_size = group_size;
  return EMBPS_OK;
}

void embps__shard_range(const embps__batch_plan_t *plan, uint32_t r, uint64_t *first,
                        uint64_t *real, uint64_t *pad) {
  uint64_t begin = (uint64_t)r * plan->shard_tokens;
  uint64_t end = begin + plan->shard_tokens;
  uint64_t real_end = end < plan->n ? end : plan->n;
  *first = begin;
  *real = real_end > begin ? real_end - begin : 0;
  *pad = plan->shard_tokens - *real;
}
