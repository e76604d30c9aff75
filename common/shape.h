/* Validation of a group's shapes, shared by client and server so that both say the same words
 * (DESIGN.md's error table). Each check returns EMBPS_OK or sets err and returns its status. */
#ifndef EMBPS_SHAPE_H
#define EMBPS_SHAPE_H

#include <stdint.h>

#include "status.h"

/** tokens_per_batch must split into group_size equal token shards. INVALID_ARGUMENT if not. */
embps_status_t embps_shape_check_tokens_per_batch(uint64_t tokens_per_batch, uint32_t group_size,
                                                  embps_error_t *err);

/** A feature batch's batch_size (samples) must split into group_size equal sample shards
 * (docs/design.md, "Feature batches"). INVALID_ARGUMENT if not, in the server's words. */
embps_status_t embps_shape_check_batch_size(uint64_t batch_size, uint32_t group_size,
                                            embps_error_t *err);

/** emb_width must split into group_size equal column slices. INVALID_ARGUMENT if not. */
embps_status_t embps_shape_check_emb_width(uint64_t emb_width, uint32_t group_size,
                                           embps_error_t *err);

/** The smallest multiple of group_size that is >= tokens_per_batch (the padded batch size). */
uint64_t embps_shape_padded_tokens(uint64_t tokens_per_batch, uint32_t group_size);

#endif
