/* The tables the checkpoint fuzz target restores and the seed generator writes: both must agree
 * on them, since a slice file is only read for a table whose spec its manifest repeats. */
#ifndef EMBPS_TESTS_FUZZ_CKPT_TABLES_H
#define EMBPS_TESTS_FUZZ_CKPT_TABLES_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/store/store.h"

#define FUZZ_CKPT_ROUND 3
#define FUZZ_CKPT_TABLES 2

/* Table `which` (0: adam over f32, two state arrays per column; 1: rowwise adagrad over bf16,
 * one state value per row), resolved for a group of one. */
static inline void fuzz_ckpt_table(int which, embps_table_config_t *c) {
  embps_error_t err;
  memset(c, 0, sizeof(*c));
  snprintf(c->name, sizeof(c->name), "t%d", which);
  c->rows = which ? 7 : 5;
  c->emb_width = which ? 2 : 4;
  c->dtype = which ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
  c->optimizer = which ? EMBPS_OPTIMIZER_ROWWISE_ADAGRAD : EMBPS_OPTIMIZER_ADAM;
  c->seed = 5;
  if (embps_table_config_resolve(c, 1, 1 << 20, &err) != EMBPS_OK)
    abort();
}

#endif
