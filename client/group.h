/* The shape of a shard group as the client sees it: the address list, and how a batch of
 * tokens is padded and split into one contiguous token shard per rank. Pure functions, no
 * I/O. Internal to libembps (embps__ prefix). */
#ifndef EMBPS_CLIENT_GROUP_H
#define EMBPS_CLIENT_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/** Most ranks one client connects to. */
#define EMBPS__MAX_GROUP 4096

/** One server address: host (without IPv6 brackets) and port, and "host:port" as written. */
typedef struct embps__addr {
  char host[256];
  char port[6];
  char authority[272]; /* host:port, brackets kept for IPv6, for :authority and messages */
} embps__addr_t;

/** Parses "host:port[,host:port...]" (spaces around entries allowed, "[v6]:port" for IPv6).
 * On success *out is an array of *n addresses freed with embps_free(). INVALID_ARGUMENT with
 * a message naming the bad entry; RESOURCE_EXHAUSTED. */
embps_status_t embps__parse_servers(const char *list, embps__addr_t **out, size_t *n,
                                    embps_error_t *err);

/** How a batch of n tokens goes to a group of group_size ranks. */
typedef struct embps__batch_plan {
  uint64_t n;                /* the caller's tokens */
  uint64_t tokens_per_batch; /* n, or n padded up to a multiple of group_size */
  uint64_t shard_tokens;     /* tokens_per_batch / group_size */
  uint32_t group_size;
} embps__batch_plan_t;

/** Plans a batch: with pad set, n is padded up to the next multiple of group_size; without,
 * n must already be one (INVALID_ARGUMENT with the shared shape message otherwise). Also
 * INVALID_ARGUMENT when the padded batch exceeds 2^32-1 tokens (tokens_per_batch is 32-bit). */
embps_status_t embps__batch_plan(embps__batch_plan_t *plan, uint64_t n, uint32_t group_size,
                                 int pad, embps_error_t *err);

/** Rank r's shard: positions [r*shard_tokens, (r+1)*shard_tokens) of the padded batch, of which
 * the first *real are the caller's tokens starting at *first, and the remaining *pad are
 * padding (token 0; rows dropped, gradients zero). */
void embps__shard_range(const embps__batch_plan_t *plan, uint32_t r, uint64_t *first,
                        uint64_t *real, uint64_t *pad);

#endif
