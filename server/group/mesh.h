/* The group's topology as a named mesh (DESIGN.md "The shard group"): axes with sizes, a
 * table_axis (the axes whose ranks form the communicator that splits table columns) and a
 * data_axis (the axes clients split tokens over). Parsing and validation only; the checks say
 * DESIGN.md's words, which users search for. */
#ifndef EMBPS_MESH_H
#define EMBPS_MESH_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define EMBPS_MESH_MAX_AXES 8
#define EMBPS_MESH_AXIS_NAME 32

typedef struct embps_mesh {
  size_t num_axes;
  char names[EMBPS_MESH_MAX_AXES][EMBPS_MESH_AXIS_NAME];
  uint32_t sizes[EMBPS_MESH_MAX_AXES];
  size_t num_table_axes;
  int table_axes[EMBPS_MESH_MAX_AXES]; /* indices into names */
  size_t num_data_axes;
  int data_axes[EMBPS_MESH_MAX_AXES];
} embps_mesh_t;

/**
 * Parses and validates a mesh for a group of group_size ranks.
 * mesh_text: "name=size[,name=size...]"; empty means one axis "shard" of group_size.
 * table_axis, data_axis: "name[,name...]"; empty means "shard".
 * Returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT with DESIGN.md's message: an axis that is not a
 * mesh axis; a table axis missing from data_axis; a data_axis that shards tokens over more than
 * one position outside table_axis; plus malformed text, sizes whose product is not
 * group_size, and (not supported yet) axes outside table_axis, which would replicate tables.
 */
embps_status_t embps_mesh_parse(embps_mesh_t *mesh, const char *mesh_text, const char *table_axis,
                                const char *data_axis, uint32_t group_size, embps_error_t *err);

/** The communicator's size: the product of the table axes' sizes. */
uint32_t embps_mesh_communicator_size(const embps_mesh_t *mesh);

/** Writes the mesh as "shard=4" / "batch=2,shard=4" (canonical, for identities and stats). */
void embps_mesh_format(const embps_mesh_t *mesh, char *out, size_t cap);

/** Writes an axis list as "shard" / "batch,shard". which: 0 table_axis, 1 data_axis. */
void embps_mesh_format_axes(const embps_mesh_t *mesh, int which, char *out, size_t cap);

#endif
