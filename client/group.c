/* Address lists and batch splitting for a shard group.
 *
 * DESIGN.md fixes the split: a batch of T tokens becomes group_size contiguous shards of
 * T/group_size tokens, shard r to rank r, and the client pads T up to a multiple of the group
 * size when asked to. Padding is appended at the end of the batch, so it lands in the last
 * shard(s); the caller's tokens keep their positions and the joined lookup reply is simply
 * the first n rows. Nothing here allocates per batch: a shard is described by ranges over the
 * caller's array plus a count of padding tokens that the transport sends as zeros. */
#include "client/group.h"

#include <stdio.h>

#include "common/alloc.h"
#include "common/hostport.h"
#include "common/shape.h"

embps_status_t embps__parse_servers(const char *list, embps__addr_t **out, size_t *n,
                                    embps_error_t *err) {
  embps_hostport_t *hps;
  embps__addr_t *addrs;
  size_t count;
  embps_status_t ret =
      embps_hostport_parse_list(list, "server address", EMBPS__MAX_GROUP, 0, &hps, &count, err);
  if (ret != EMBPS_OK)
    return ret;
  if (!(addrs = embps_calloc(count, sizeof(*addrs)))) {
    embps_free(hps);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  for (size_t k = 0; k < count; k++) {
    snprintf(addrs[k].host, sizeof(addrs[k].host), "%s", hps[k].host);
    snprintf(addrs[k].port, sizeof(addrs[k].port), "%u", hps[k].port);
    embps_hostport_format(&hps[k], addrs[k].authority, sizeof(addrs[k].authority));
  }
  embps_free(hps);
  *out = addrs;
  *n = count;
  return EMBPS_OK;
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
