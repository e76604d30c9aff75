/* A round's cost, computed from its shape: the scratch the engine's cpu backend reserves
 * (engine_cpu.c's cpu_reserve grows its arrays to exactly these sizes) and the payload of the
 * collectives engine.c calls, in the order it calls them:
 *
 *   lookup: all-gather of the n tokens (8 bytes each); all-to-all of n x w elements per peer.
 *   push:   all-gather of the n tokens; all-to-all of n x w gradient elements per peer;
 *           the m unique rows' row statistics (nb partials of f32 per row), again when weight
 *           decay changes the gradient a rowwise optimizer sees. Either gathered whole (an
 *           all-gather of m x nb f32: O(group_size x m) bytes and scratch on every rank) or, on
 *           larger groups, combined by owner: an all-to-all of q x nb f32 per peer (q = ceil(m /
 *           group_size), the rows each rank owns) and an all-gather of q f64 sums, about
 *           m x (4 nb + 8) bytes a rank whatever the group size. At 64 ranks, nb = 1 and m =
 *           65536 that is 0.8 MB instead of 16.5 MB a rank each way.
 *
 * `embps plan` reads the same functions (round_cost.h says why), so what is written here is
 * the one statement of a round's bytes. */
#include "server/engine/round_cost.h"

#include <string.h>

#include "kernels/embps_kernels.h"

size_t embps_round_partials_per_row(size_t w) {
  size_t block = w ? embps_row_stats_block(w) : 0;
  return block ? w / block : 0;
}

int embps_round_stats_by_owner(uint32_t group_size, size_t nb) {
  return group_size > 1 && nb > 0 && (uint64_t)group_size * nb * 4u >= 2u * (nb * 4u + 8u);
}

size_t embps_round_stats_owned(uint32_t group_size, size_t m) {
  return group_size ? (m + group_size - 1) / group_size : 0;
}

void embps_round_scratch_bytes(const embps_round_shape_t *sh,
                               size_t bytes[EMBPS_ROUND_SCRATCH_COUNT]) {
  const int push = sh->kind == EMBPS_OP_PUSH, exchange = sh->group_size > 1;
  const size_t T = sh->T, exchange_bytes = T * sh->w * sh->ds;
  const size_t nb = push ? embps_round_partials_per_row(sh->w) : 0;

  memset(bytes, 0, EMBPS_ROUND_SCRATCH_COUNT * sizeof(bytes[0]));
  if (push || exchange) {
    bytes[EMBPS_ROUND_UNIQUE] = T * sizeof(int64_t);
    bytes[EMBPS_ROUND_SEGMENT_IDS] = T * sizeof(uint32_t);
    bytes[EMBPS_ROUND_DEDUP_WS] = embps_dedup_workspace_bytes(T);
    bytes[EMBPS_ROUND_ORDER] = T * sizeof(uint32_t);
    bytes[EMBPS_ROUND_STARTS] = (T + 1) * sizeof(uint32_t);
  }
  if (exchange) {
    bytes[EMBPS_ROUND_ALL_TOKENS] = T * sizeof(int64_t);
    bytes[EMBPS_ROUND_SEND] = exchange_bytes;
    bytes[EMBPS_ROUND_RECV] = exchange_bytes;
    bytes[EMBPS_ROUND_ROWS] = push ? 0 : exchange_bytes;
  }
  if (push && sh->hashed)
    bytes[EMBPS_ROUND_KEYS] = T * sizeof(int64_t);
  if (push) {
    const int owner = embps_round_stats_by_owner(sh->group_size, nb);
    /* By owner, q rows of every rank: the all-to-all reads group_size x q >= m rows of partials,
     * at most group_size - 1 beyond the last (and one more past a padding row). */
    const size_t rows = owner ? sh->group_size * embps_round_stats_owned(sh->group_size, T) : 0;
    bytes[EMBPS_ROUND_SUMMED] = T * sh->w * sizeof(float);
    bytes[EMBPS_ROUND_ROW_SUMSQ] = T * sizeof(float);
    bytes[EMBPS_ROUND_PARTIALS] = (owner ? T + sh->group_size : T) * nb * sizeof(float);
    bytes[EMBPS_ROUND_SEGMENT_COUNTS] = embps_segment_sum_stats_workspace_bytes(T);
    bytes[EMBPS_ROUND_GATHERED] = owner      ? rows * nb * sizeof(float)
                                  : exchange ? sh->group_size * T * nb * sizeof(float)
                                             : 0;
    bytes[EMBPS_ROUND_SUMS] = rows * sizeof(double);
  }
}

size_t embps_round_scratch_total(const embps_round_shape_t *sh) {
  size_t bytes[EMBPS_ROUND_SCRATCH_COUNT], sum = 0;
  embps_round_scratch_bytes(sh, bytes);
  for (int i = 0; i < EMBPS_ROUND_SCRATCH_COUNT; i++)
    sum += bytes[i];
  return sum;
}

uint64_t embps_round_peer_bytes(const embps_round_shape_t *sh, uint64_t unique, int second_stats) {
  const uint64_t peers = sh->group_size > 1 ? sh->group_size - 1u : 0;
  const uint64_t n = sh->group_size ? sh->T / sh->group_size : 0;
  const size_t nb = embps_round_partials_per_row(sh->w);
  uint64_t payload = n * sizeof(int64_t) + n * sh->w * sh->ds, stats;
  if (sh->kind == EMBPS_OP_PUSH) {
    if (embps_round_stats_by_owner(sh->group_size, nb)) {
      const uint64_t q = embps_round_stats_owned(sh->group_size, unique);
      stats = q * nb * sizeof(float) + q * sizeof(double);
    } else
      stats = unique * nb * sizeof(float);
    payload += (second_stats ? 2u : 1u) * stats;
  }
  return peers * payload;
}

unsigned embps_round_collectives(const embps_round_shape_t *sh, int second_stats) {
  if (sh->group_size < 2)
    return 0;
  unsigned stats =
      embps_round_stats_by_owner(sh->group_size, embps_round_partials_per_row(sh->w)) ? 2u : 1u;
  return sh->kind == EMBPS_OP_PUSH ? 2u + stats * (second_stats ? 2u : 1u) : 2u;
}

uint32_t embps_round_control_fanout_auto(uint32_t group_size) {
  uint32_t k = 1;
  if (group_size < EMBPS_ROUND_RELAY_AUTO_MIN)
    return 0;
  while ((uint64_t)k * k < group_size)
    k++;
  return k;
}

unsigned embps_round_order_delays(uint32_t group_size, uint32_t fanout) {
  if (group_size < 2)
    return 0;
  return fanout >= 2 && group_size >= 3 ? 4u : 2u;
}
