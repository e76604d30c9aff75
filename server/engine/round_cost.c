/* A round's cost, computed from its shape: the scratch the engine's cpu backend reserves
 * (engine_cpu.c's cpu_reserve grows its arrays to exactly these sizes) and the payload of the
 * collectives engine.c calls, in the order it calls them:
 *
 *   lookup: all-gather of the n tokens (8 bytes each); all-to-all of n x w elements per peer.
 *   push:   all-gather of the n tokens; all-to-all of n x w gradient elements per peer;
 *           all-gather of the unique rows' nb row-statistics partials (f32), and a second one
 *           when weight decay changes the gradient a rowwise optimizer sees.
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
    bytes[EMBPS_ROUND_SUMMED] = T * sh->w * sizeof(float);
    bytes[EMBPS_ROUND_ROW_SUMSQ] = T * sizeof(float);
    bytes[EMBPS_ROUND_PARTIALS] = T * nb * sizeof(float);
    bytes[EMBPS_ROUND_SEGMENT_COUNTS] = embps_segment_sum_stats_workspace_bytes(T);
    bytes[EMBPS_ROUND_GATHERED] = exchange ? sh->group_size * T * nb * sizeof(float) : 0;
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
  uint64_t payload = n * sizeof(int64_t) + n * sh->w * sh->ds;
  if (sh->kind == EMBPS_OP_PUSH)
    payload +=
        (second_stats ? 2u : 1u) * unique * embps_round_partials_per_row(sh->w) * sizeof(float);
  return peers * payload;
}

unsigned embps_round_collectives(const embps_round_shape_t *sh, int second_stats) {
  if (sh->group_size < 2)
    return 0;
  return sh->kind == EMBPS_OP_PUSH ? 3u + (second_stats ? 1u : 0u) : 2u;
}
