/* Test helpers over the table settings (common/table_fields.h), for the tests of every codec that
 * carries them (client admin, service, checkpoint header, control frame):
 *
 * - TABLE_FIELDS_FIXTURE(prefix, T) defines prefix_fill(T *), which gives every setting a value
 *   that no other setting has (nonzero, distinct in every byte a codec carries), and
 *   prefix_assert_same(const T *, const T *), which fails naming the first setting that differs
 *   (bit for bit for floats). Both walk EMBPS_TABLE_FIELDS, so a setting added there is filled and
 *   compared everywhere, and a codec that forgets it fails its round trip.
 * - assert_table_fields_bytes(p, c) checks the binary layout of the settings at p against c
 *   field by field at hand-written offsets: it is the format's independent statement, which the
 *   declaration is checked against (checkpoints written before must still restore). */
#ifndef EMBPS_TEST_TABLE_FIELDS_FIXTURE_H
#define EMBPS_TEST_TABLE_FIELDS_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <string.h>

#include "common/byteorder.h"
#include "common/table_fields.h"

/* The k-th setting's value by its wire kind (k from 1). */
static inline uint64_t table_fields_u64(unsigned k) {
  return UINT64_C(0xa1b2c3d4e5f60000) | (uint64_t)(k * 0x0101u);
}
static inline uint32_t table_fields_u32(unsigned k) { return 0x51627300u | k; }
static inline uint32_t table_fields_e32(unsigned k) { return 40u + k; }
static inline float table_fields_f32(unsigned k) { return 1.5f + (float)k * 0.25f; }

#define TABLE_FIELDS_FILL_(field, type, wire, message, pb_field)                                   \
  s->field = (type)table_fields_##wire(++k);
#define TABLE_FIELDS_SAME_(field, type, wire, message, pb_field)                                   \
  if (memcmp(&a->field, &b->field, sizeof(a->field)) != 0)                                         \
    fail_msg("table setting '%s' differs", #field);

#define TABLE_FIELDS_FIXTURE(prefix, T)                                                            \
  static void prefix##_fill(T *s) {                                                                \
    unsigned k = 0;                                                                                \
    EMBPS_TABLE_FIELDS(TABLE_FIELDS_FILL_)                                                         \
  }                                                                                                \
  static void prefix##_assert_same(const T *a, const T *b) {                                       \
    EMBPS_TABLE_FIELDS(TABLE_FIELDS_SAME_)                                                         \
  }

static inline void assert_table_fields_f32(const uint8_t *p, float want) {
  uint32_t bits;
  memcpy(&bits, &want, sizeof(bits));
  assert_int_equal(embps_get_le32(p), bits);
}

/* The settings' bytes as the checkpoint header and the control frame carry them after the name:
 * rows u64 | emb_width u32 | dtype u32 | seed u64 | init_scale | optimizer u32 | lr | eps |
 * half_life | initial_accumulator | weight_decay | beta1 | beta2 (60 bytes, all that checkpoint
 * format version 1 holds) | capacity u64 | admit_after u32 | eviction u32 | half_life_steps u64 |
 * ttl_steps u64 | sketch_width u32, 96 bytes. Written out by hand (not from EMBPS_TABLE_FIELDS)
 * on purpose. */
#define TABLE_FIELDS_LAYOUT_BYTES 96
#define TABLE_FIELDS_LAYOUT_V1_BYTES 60
#define assert_table_fields_bytes(p, c)                                                            \
  do {                                                                                             \
    const uint8_t *q_ = (p);                                                                       \
    assert_int_equal(EMBPS_TABLE_FIELDS_WIRE_BYTES, TABLE_FIELDS_LAYOUT_BYTES);                    \
    assert_true(embps_get_le64(q_) == (c)->rows);                                                  \
    assert_int_equal(embps_get_le32(q_ + 8), (c)->emb_width);                                      \
    assert_int_equal(embps_get_le32(q_ + 12), (uint32_t)(c)->dtype);                               \
    assert_true(embps_get_le64(q_ + 16) == (c)->seed);                                             \
    assert_table_fields_f32(q_ + 24, (c)->init_scale);                                             \
    assert_int_equal(embps_get_le32(q_ + 28), (uint32_t)(c)->optimizer);                           \
    assert_table_fields_f32(q_ + 32, (c)->lr);                                                     \
    assert_table_fields_f32(q_ + 36, (c)->eps);                                                    \
    assert_table_fields_f32(q_ + 40, (c)->half_life);                                              \
    assert_table_fields_f32(q_ + 44, (c)->initial_accumulator);                                    \
    assert_table_fields_f32(q_ + 48, (c)->weight_decay);                                           \
    assert_table_fields_f32(q_ + 52, (c)->beta1);                                                  \
    assert_table_fields_f32(q_ + 56, (c)->beta2);                                                  \
    assert_int_equal(EMBPS_TABLE_FIELDS_V1_WIRE_BYTES, TABLE_FIELDS_LAYOUT_V1_BYTES);              \
    assert_true(embps_get_le64(q_ + 60) == (c)->capacity);                                         \
    assert_int_equal(embps_get_le32(q_ + 68), (c)->admit_after);                                   \
    assert_int_equal(embps_get_le32(q_ + 72), (uint32_t)(c)->eviction);                            \
    assert_true(embps_get_le64(q_ + 76) == (c)->half_life_steps);                                  \
    assert_true(embps_get_le64(q_ + 84) == (c)->ttl_steps);                                        \
    assert_int_equal(embps_get_le32(q_ + 92), (c)->sketch_width);                                  \
  } while (0)

#endif
