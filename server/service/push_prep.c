/* A push's dedup and segment sum while its request arrives (push_prep.h says what and why).
 *
 * The prep walks the message's top-level fields as their bytes arrive. It needs, before the
 * gradients' field header: the table name (field 1, whose last occurrence protobuf keeps) and
 * exactly one tokens field (6). At the gradients' header (field 8) it resolves the table's shape,
 * checks that the gradients hold one row per token, takes one buffer for everything (sized for
 * every token unique, so nothing is allocated later) and deduplicates; from then on each feed
 * sums the gradient rows complete so far. What comes after the gradients is never read: the
 * result's check against the validated request covers it.
 *
 * The rows of one position are left in place (grad_at) for f32 tables without weight decay: a
 * 65536-token push then writes and reads back none of its 32 MiB of sums. Measured on the 2-core
 * VM (uniform tokens over a 1M x 128 f32 rowwise Adagrad table, one push in flight, old and new
 * servers alternating, fresh each 3 s run of embps bench, medians of 4): 65536 tokens 1.76M ->
 * 2.38M rows/s, 4096 tokens 2.02M -> 2.07M (even). A prototype that streamed every such row
 * (kernels/segment_sum_stats.c's non-temporal stores, with no size limit) reached 2.36M against
 * 3.01M for not storing them at all, in one 3-round run. */
#include "server/service/push_prep.h"

#include <string.h>

#include "common/alloc.h"
#include "common/varint.h"
#include "kernels/embps_kernels.h"

#define FIELD_TABLE 1
#define FIELD_TOKENS 6
#define FIELD_GRADIENTS 8

typedef enum { PREP_HEAD = 0, PREP_SUM, PREP_DONE, PREP_DECLINED } prep_phase_t;

struct embps_push_prep {
  embps_push_prep_env_t env;
  prep_phase_t phase;
  size_t at; /* HEAD: where the next field starts */
  size_t name_at, name_len;
  size_t tokens_at, tokens_len;
  int have_name, have_tokens;
  /* SUM, DONE */
  const uint8_t *grads; /* in the message buffer: position 0's row */
  size_t grads_at, n, rows_done, in_row, block;
  embps_push_prep_shape_t shape;
  const void **grad_at; /* result.grad_at, writable; NULL: every sum in result.summed */
  void *buf;            /* the one allocation, buf_bytes long: the arrays below point into it */
  size_t buf_bytes;
  int64_t *tokens; /* an aligned copy of the request's tokens */
  uint32_t *segment_ids;
  void *count;
  float *partials; /* result.partials, writable */
  embps_push_prepared_t result;
};

embps_push_prep_t *embps_push_prep_new(const embps_push_prep_env_t *env) {
  embps_push_prep_t *p = embps_malloc(sizeof(*p));
  if (!p)
    return NULL;
  memset(p, 0, sizeof(*p));
  p->env = *env;
  return p;
}

static void release(embps_push_prep_t *p) {
  if (p->buf)
    p->env.release(p->env.arg, p->buf, p->buf_bytes);
  p->buf = NULL;
}

static void decline(embps_push_prep_t *p) {
  release(p);
  p->phase = PREP_DECLINED;
}

int embps_push_prep_declined(const embps_push_prep_t *p) { return p->phase == PREP_DECLINED; }

static size_t up64(size_t b) { return (b + 63) & ~(size_t)63; }

/* At the gradients' header: everything the sum needs, then the dedup. Declines when the request
 * is not one the prep can make. */
static void setup(embps_push_prep_t *p, const uint8_t *msg, size_t grads_len) {
  size_t n = p->tokens_len / sizeof(int64_t), ds, nb, ws, U;
  uint8_t *b;
  int64_t *unique;

  if (!p->have_tokens || !p->have_name || p->tokens_len % sizeof(int64_t) != 0 || n == 0 ||
      n > EMBPS_PUSH_PREP_MAX_TOKENS ||
      !p->env.shape(p->env.arg, (const char *)msg + p->name_at, p->name_len, &p->shape)) {
    decline(p);
    return;
  }
  const size_t width = p->shape.width;
  const int in_place = p->shape.in_place && p->shape.dtype == EMBPS_DTYPE_F32;
  ds = embps_dtype_size(p->shape.dtype);
  p->in_row = width * ds;
  if (p->in_row == 0 || grads_len % p->in_row != 0 || grads_len / p->in_row != n) {
    decline(p); /* the request will fail its own checks */
    return;
  }
  p->n = n;
  p->block = embps_row_stats_block(width);
  nb = p->block ? width / p->block : 0;
  ws = embps_dedup_workspace_bytes(n);
  p->buf_bytes = up64(n * sizeof(int64_t)) * 2 + up64(n * sizeof(uint32_t)) + up64(ws) +
                 up64(embps_segment_sum_stats_workspace_bytes(n)) +
                 up64(n * width * sizeof(float)) + up64(n * nb * sizeof(float)) +
                 (in_place ? up64(n * sizeof(void *)) : 0);
  if (!(p->buf = p->env.alloc(p->env.arg, p->buf_bytes))) {
    decline(p);
    return;
  }
  b = p->buf;
  p->tokens = (int64_t *)b;
  b += up64(n * sizeof(int64_t));
  unique = (int64_t *)b;
  b += up64(n * sizeof(int64_t));
  p->segment_ids = (uint32_t *)b;
  b += up64(n * sizeof(uint32_t));
  void *dedup_ws = b;
  b += up64(ws);
  p->count = b;
  b += up64(embps_segment_sum_stats_workspace_bytes(n));
  p->result.summed = (float *)b;
  b += up64(n * width * sizeof(float));
  p->partials = (float *)b;
  p->result.partials = p->partials;
  b += up64(n * nb * sizeof(float));
  p->grad_at = in_place ? (const void **)b : NULL;
  p->result.grad_at = p->grad_at;

  memcpy(p->tokens, msg + p->tokens_at, p->tokens_len);
  U = embps_dedup_cpu(p->tokens, n, unique, p->segment_ids, dedup_ws);
  embps_segment_sum_stats_count_cpu(p->segment_ids, n, p->count, 0, U);
  p->result.unique = unique;
  p->result.num_unique = U;
  p->rows_done = 0;
  p->phase = PREP_SUM;
}

/* Walks the fields complete in msg[0..got) up to the gradients' header. */
static void head(embps_push_prep_t *p, const uint8_t *msg, size_t got, size_t len) {
  while (p->phase == PREP_HEAD) {
    uint64_t key, v = 0;
    size_t i = p->at, k, m;
    if (i >= len) { /* the whole message without gradients: nothing to prepare */
      decline(p);
      return;
    }
    if (!(k = embps_varint_get(msg + i, got - i, &key)))
      goto more;
    i += k;
    switch (key & 7) {
    case 0:
      if (!(m = embps_varint_get(msg + i, got - i, &v)))
        goto more;
      p->at = i + m;
      continue;
    case 1:
    case 5:
      m = (key & 7) == 1 ? 8 : 4;
      if (got - i < m)
        goto more;
      p->at = i + m;
      continue;
    case 2:
      break;
    default:
      decline(p);
      return;
    }
    if (!(m = embps_varint_get(msg + i, got - i, &v)))
      goto more;
    i += m;
    if (v > len - i) { /* malformed: the unpack will say so */
      decline(p);
      return;
    }
    if ((key >> 3) == FIELD_GRADIENTS) {
      p->grads_at = i;
      p->grads = msg + i;
      setup(p, msg, (size_t)v);
      return;
    }
    if (i + v > got)
      return; /* the field's bytes are not all here */
    if ((key >> 3) == FIELD_TABLE) {
      p->name_at = i;
      p->name_len = (size_t)v;
      p->have_name = 1;
    } else if ((key >> 3) == FIELD_TOKENS) {
      if (p->have_tokens) { /* protobuf would merge them: leave that to the unpack */
        decline(p);
        return;
      }
      p->tokens_at = i;
      p->tokens_len = (size_t)v;
      p->have_tokens = 1;
    }
    p->at = i + (size_t)v;
  }
  return;
more: /* a varint cut by the end of what arrived; past 10 bytes it is malformed */
  if (got - p->at > 2 * EMBPS_VARINT_MAX || got == len)
    decline(p);
}

void embps_push_prep_feed(embps_push_prep_t *p, const uint8_t *msg, size_t got, size_t len) {
  if (p->phase == PREP_HEAD)
    head(p, msg, got, len);
  if (p->phase != PREP_SUM || got < p->grads_at)
    return;
  size_t rows = (got - p->grads_at) / p->in_row;
  if (rows > p->n)
    rows = p->n;
  if (rows > p->rows_done) {
    embps_segment_sum_stats_positions_cpu(
        p->grads, p->shape.dtype, p->shape.width, p->segment_ids, p->rows_done, rows, p->block,
        p->result.summed, p->partials, p->count, 0, p->result.num_unique, p->grad_at);
    p->rows_done = rows;
  }
  if (p->rows_done == p->n)
    p->phase = PREP_DONE;
}

const embps_push_prepared_t *embps_push_prep_result(embps_push_prep_t *p, const int64_t *tokens,
                                                    size_t n, const void *grads,
                                                    const embps_push_prep_shape_t *shape) {
  if (p->phase != PREP_DONE || n != p->n || grads != (const void *)p->grads ||
      shape->width != p->shape.width || shape->dtype != p->shape.dtype ||
      shape->in_place != p->shape.in_place || memcmp(tokens, p->tokens, n * sizeof(int64_t)) != 0)
    return NULL;
  return &p->result;
}

void embps_push_prep_free(embps_push_prep_t *p) {
  if (!p)
    return;
  release(p);
  embps_free(p);
}
