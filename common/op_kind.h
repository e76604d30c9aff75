/* What one entry of a round does, declared once: the service asks for it, the group's sequencer
 * orders it (every rank's shard of a batch must say the same), the control frames carry it
 * between the ranks as its value, and the engine runs every kind but CHECKPOINT, which the
 * group's checkpointer runs. Header-only. */
#ifndef EMBPS_OP_KIND_H
#define EMBPS_OP_KIND_H

#include <stdint.h>

/** X(NAME, value, name): every kind of op, with the name logs and messages use. The values
 * travel in the ranks' control frames: a value is never reused for another kind. */
#define EMBPS_OP_KIND_MAP(X)                                                                       \
  X(LOOKUP, 1, "lookup")                                                                           \
  X(PUSH, 2, "push")                                                                               \
  X(CREATE_TABLE, 3, "create")                                                                     \
  X(CHECKPOINT, 4, "checkpoint")                                                                   \
  X(DROP_TABLE, 5, "drop")                                                                         \
  X(ASSIGN, 6, "assign")

/** A kind of op: EMBPS_OP_LOOKUP, EMBPS_OP_PUSH, EMBPS_OP_ASSIGN (a batch's shards, one on every
 * rank; an assign writes rows as given and is ordered, deduplicated and retried like a push),
 * EMBPS_OP_CREATE_TABLE, EMBPS_OP_DROP_TABLE (the table named; asked of the leader, run on every
 * rank), EMBPS_OP_CHECKPOINT (ordered by the leader itself, run by the group, not the engine). */
typedef enum embps_op_kind {
#define EMBPS_OP_KIND_ENUM(NAME, value, name) EMBPS_OP_##NAME = value,
  EMBPS_OP_KIND_MAP(EMBPS_OP_KIND_ENUM)
#undef EMBPS_OP_KIND_ENUM
} embps_op_kind_t;

/** The kind's name ("lookup", "push", "create", "checkpoint", "drop", "assign"); "unknown" for a
 * value that is none. Static string. */
static inline const char *embps_op_kind_name(embps_op_kind_t kind) {
  switch (kind) {
#define EMBPS_OP_KIND_NAME(NAME, value, name)                                                      \
  case EMBPS_OP_##NAME:                                                                            \
    return name;
    EMBPS_OP_KIND_MAP(EMBPS_OP_KIND_NAME)
#undef EMBPS_OP_KIND_NAME
  }
  return "unknown";
}

/** Whether v (as a control frame carries it) is the value of a kind. */
static inline int embps_op_kind_valid(uint32_t v) {
#define EMBPS_OP_KIND_VALID(NAME, value, name)                                                     \
  if (v == (uint32_t)(value))                                                                      \
    return 1;
  EMBPS_OP_KIND_MAP(EMBPS_OP_KIND_VALID)
#undef EMBPS_OP_KIND_VALID
  return 0;
}

#endif
