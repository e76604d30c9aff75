/* Shape validation messages. The wording is part of the product (users search for it), so each
 * message is written once here and both the client library and the server call it. */
#include "shape.h"

embps_status_t embps_shape_check_tokens_per_batch(uint64_t tokens_per_batch, uint32_t group_size,
                                                  embps_error_t *err) {
  if (group_size == 0 || tokens_per_batch % group_size == 0)
    return EMBPS_OK;
  return embps_error_set(
      err, EMBPS_INVALID_ARGUMENT,
      "tokens_per_batch=%llu does not shard evenly over the %u-rank "
      "communicator: pad the batch to %llu tokens (a multiple of %u) with "
      "padding token 0",
      (unsigned long long)tokens_per_batch, group_size,
      (unsigned long long)embps_shape_padded_tokens(tokens_per_batch, group_size), group_size);
}

embps_status_t embps_shape_check_batch_size(uint64_t batch_size, uint32_t group_size,
                                            embps_error_t *err) {
  if (group_size == 0 || batch_size % group_size == 0)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                         "batch_size=%llu does not shard evenly over the %u-rank communicator: "
                         "pad the batch to %llu samples (a multiple of %u) with empty bags",
                         (unsigned long long)batch_size, group_size,
                         (unsigned long long)embps_shape_padded_tokens(batch_size, group_size),
                         group_size);
}

embps_status_t embps_shape_check_emb_width(uint64_t emb_width, uint32_t group_size,
                                           embps_error_t *err) {
  if (group_size == 0 || emb_width % group_size == 0)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                         "emb_width=%llu does not shard evenly over the %u-rank communicator: "
                         "choose an emb_width that is a multiple of %u, or change the mesh",
                         (unsigned long long)emb_width, group_size, group_size);
}

uint64_t embps_shape_padded_tokens(uint64_t tokens_per_batch, uint32_t group_size) {
  if (group_size == 0)
    return tokens_per_batch;
  return (tokens_per_batch + group_size - 1) / group_size * group_size;
}
