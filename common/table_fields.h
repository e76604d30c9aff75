/* The table settings: every field of a table's specification besides its name, declared once.
 * The client's public embps_table_spec_t and the server's embps_table_config_t carry them; the
 * client and the service map them to and from the protobuf TableSpec (proto/embps/v1/
 * embps.proto), and the server to and from the bytes of its checkpoint headers and of the
 * group's control frames. Each of those is an expansion of EMBPS_TABLE_FIELDS, so a new setting
 * is one line here, its field in the .proto, and its member in the client's public struct (whose
 * layout is API, so it is written by hand; EMBPS_TABLE_FIELDS_CHECK refuses to compile it without
 * the member). The name is not in the list: each codec carries it its own way (a pointer in the
 * client, an array on the server, a u32- or u8-prefixed string in bytes). Header-only. */
#ifndef EMBPS_TABLE_FIELDS_H
#define EMBPS_TABLE_FIELDS_H

#include <stdint.h>
#include <string.h>

#include "common/byteorder.h"
#include "common/dtype.h"
#include "common/eviction.h"
#include "common/optimizer.h"

/** X(field, type, wire, message, pb_field), one per setting, in the order of their bytes.
 *
 * field: the member of embps_table_spec_t and embps_table_config_t; type: its C type.
 * wire: its bytes in the binary layouts (the checkpoint header, the control frame): u64 and u32
 * little-endian, e32 an enum as a u32, f32 a float's IEEE-754 bits as a u32.
 * message: where it sits in protobuf, SPEC (embps.v1.TableSpec) or OPTIMIZER (TableSpec.optimizer,
 * an embps.v1.OptimizerConfig); pb_field: its name there.
 *
 * Zero means "the server's default" for every setting; embps_table_config_resolve (server/store)
 * fills the defaults in. A setting is appended, never inserted: it changes the checkpoint format
 * and the control frame, so bump EMBPS_CKPT_FORMAT_VERSION and EMBPS__CONTROL_VERSION with it,
 * and list the settings each earlier checkpoint version holds (EMBPS_TABLE_FIELDS_V1), which the
 * checkpoint reader reads as a prefix, the rest zero. */
#define EMBPS_TABLE_FIELDS(X) EMBPS_TABLE_FIELDS_V1(X) EMBPS_TABLE_FIELDS_HASH(X)

/** The settings of checkpoint format version 1 (a dense table of rows), in their order. */
#define EMBPS_TABLE_FIELDS_V1(X)                                                                   \
  X(rows, uint64_t, u64, SPEC, rows)                                                               \
  X(emb_width, uint32_t, u32, SPEC, emb_width)                                                     \
  X(dtype, embps_dtype_t, e32, SPEC, dtype)                                                        \
  X(seed, uint64_t, u64, SPEC, seed)                                                               \
  X(init_scale, float, f32, SPEC, init_scale)                                                      \
  X(optimizer, embps_optimizer_t, e32, OPTIMIZER, kind)                                            \
  X(lr, float, f32, OPTIMIZER, lr)                                                                 \
  X(eps, float, f32, OPTIMIZER, eps)                                                               \
  X(half_life, float, f32, OPTIMIZER, half_life)                                                   \
  X(initial_accumulator, float, f32, OPTIMIZER, initial_accumulator)                               \
  X(weight_decay, float, f32, OPTIMIZER, weight_decay)                                             \
  X(beta1, float, f32, OPTIMIZER, beta1)                                                           \
  X(beta2, float, f32, OPTIMIZER, beta2)

/** Appended in checkpoint format version 2: a hash-keyed table (docs/design.md, "Hash-keyed
 * tables"). capacity 0 is a dense table, and every other setting here is then 0. */
#define EMBPS_TABLE_FIELDS_HASH(X)                                                                 \
  X(capacity, uint64_t, u64, SPEC, capacity)                                                       \
  X(admit_after, uint32_t, u32, SPEC, admit_after)                                                 \
  X(eviction, embps_eviction_t, e32, SPEC, eviction)                                               \
  X(half_life_steps, uint64_t, u64, SPEC, half_life_steps)                                         \
  X(ttl_steps, uint64_t, u64, SPEC, ttl_steps)                                                     \
  X(sketch_width, uint32_t, u32, SPEC, sketch_width)

/** Declares the settings as members: `EMBPS_TABLE_FIELDS(EMBPS_TABLE_FIELD_MEMBER)` in a struct. */
#define EMBPS_TABLE_FIELD_MEMBER(field, type, wire, message, pb_field) type field;

/* ---- the binary layout ----------------------------------------------------------------------- */

#define EMBPS__TABLE_WIRE_BYTES_u64 8
#define EMBPS__TABLE_WIRE_BYTES_u32 4
#define EMBPS__TABLE_WIRE_BYTES_e32 4
#define EMBPS__TABLE_WIRE_BYTES_f32 4
#define EMBPS__TABLE_FIELD_BYTES(field, type, wire, message, pb_field)                             \
  +EMBPS__TABLE_WIRE_BYTES_##wire

/** Bytes of the settings in the binary layouts, the name apart. */
#define EMBPS_TABLE_FIELDS_WIRE_BYTES (0 EMBPS_TABLE_FIELDS(EMBPS__TABLE_FIELD_BYTES))
/** Bytes of the settings of checkpoint format version 1 (EMBPS_TABLE_FIELDS_V1): a prefix of the
 * layout. */
#define EMBPS_TABLE_FIELDS_V1_WIRE_BYTES (0 EMBPS_TABLE_FIELDS_V1(EMBPS__TABLE_FIELD_BYTES))

/** Writers and readers of one setting's bytes by its wire kind: each writes or reads at *p and
 * moves *p past what it wrote or read. */
static inline void embps_table_wire_put_u64(uint8_t **p, uint64_t v) {
  embps_put_le64(*p, v);
  *p += 8;
}
static inline void embps_table_wire_put_u32(uint8_t **p, uint32_t v) {
  embps_put_le32(*p, v);
  *p += 4;
}
static inline void embps_table_wire_put_e32(uint8_t **p, uint32_t v) {
  embps_table_wire_put_u32(p, v);
}
static inline void embps_table_wire_put_f32(uint8_t **p, float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  embps_table_wire_put_u32(p, bits);
}
static inline uint64_t embps_table_wire_get_u64(const uint8_t **p) {
  *p += 8;
  return embps_get_le64(*p - 8);
}
static inline uint32_t embps_table_wire_get_u32(const uint8_t **p) {
  *p += 4;
  return embps_get_le32(*p - 4);
}
static inline uint32_t embps_table_wire_get_e32(const uint8_t **p) {
  return embps_table_wire_get_u32(p);
}
static inline float embps_table_wire_get_f32(const uint8_t **p) {
  uint32_t bits = embps_table_wire_get_u32(p);
  float v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

/* ---- protobuf: for files that include "embps/v1/embps.pb-c.h" ------------------------------ */

#define EMBPS__TABLE_PB_SPEC(spec, optimizer) (spec)
#define EMBPS__TABLE_PB_OPTIMIZER(spec, optimizer) (optimizer)
#define EMBPS__TABLE_PB_HAS_SPEC(spec) 1
#define EMBPS__TABLE_PB_HAS_OPTIMIZER(spec) ((spec)->optimizer != NULL)
/* an enum goes over as an int: the .proto's enums have the values of embps_dtype_t,
 * embps_optimizer_t and embps_eviction_t */
#define EMBPS__TABLE_PB_VALUE_u64(v) (v)
#define EMBPS__TABLE_PB_VALUE_u32(v) (v)
#define EMBPS__TABLE_PB_VALUE_e32(v) ((int)(v))
#define EMBPS__TABLE_PB_VALUE_f32(v) (v)

#define EMBPS__TABLE_FIELD_TO_PB(field, type, wire, message, pb_field)                             \
  EMBPS__TABLE_PB_##message(ts, oc)->pb_field = EMBPS__TABLE_PB_VALUE_##wire(s->field);
#define EMBPS__TABLE_FIELD_FROM_PB(field, type, wire, message, pb_field)                           \
  if (EMBPS__TABLE_PB_HAS_##message(ts))                                                           \
    s->field = (type)EMBPS__TABLE_PB_##message(ts, ts->optimizer)->pb_field;

/** Defines `static void fn(const T *s, Embps__V1__TableSpec *ts, Embps__V1__OptimizerConfig *oc)`,
 * which copies every setting of *s into ts and oc (both initialized by the caller) and points
 * ts->optimizer at oc. T is a struct with the members of EMBPS_TABLE_FIELDS; ts->name is the
 * caller's to set. */
#define EMBPS_TABLE_FIELDS_TO_PB(fn, T)                                                            \
  static void fn(const T *s, Embps__V1__TableSpec *ts, Embps__V1__OptimizerConfig *oc) {           \
    EMBPS_TABLE_FIELDS(EMBPS__TABLE_FIELD_TO_PB)                                                   \
    ts->optimizer = oc;                                                                            \
  }

/** Defines `static void fn(const Embps__V1__TableSpec *ts, T *s)`, which copies every setting of
 * ts into *s; those of the OptimizerConfig only when ts has one (else they are left as they
 * were). The name is the caller's to copy. */
#define EMBPS_TABLE_FIELDS_FROM_PB(fn, T)                                                          \
  static void fn(const Embps__V1__TableSpec *ts, T *s) {                                           \
    EMBPS_TABLE_FIELDS(EMBPS__TABLE_FIELD_FROM_PB)                                                 \
  }

/* ---- a struct declared by hand ------------------------------------------------------------- */

#define EMBPS__TABLE_FIELD_CHECK(field, type, wire, message, pb_field)                             \
  _Static_assert(_Generic(((embps__table_fields_checked_t *)0)->field, type : 1, default : 0),     \
                 "member " #field " missing or not a " #type " (common/table_fields.h)");

/** At file scope: static assertions that struct T has every setting as a member of its declared
 * type, for a struct that is written by hand rather than with EMBPS_TABLE_FIELD_MEMBER. Once per
 * translation unit. */
#define EMBPS_TABLE_FIELDS_CHECK(T)                                                                \
  typedef T embps__table_fields_checked_t;                                                         \
  EMBPS_TABLE_FIELDS(EMBPS__TABLE_FIELD_CHECK)

#endif
