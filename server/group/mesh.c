/* Mesh parsing and validation.
 *
 * The checks run in the order a user fixes them: first that every named axis exists, then that
 * tokens vary across the communicator (every table axis is a data axis), then that each
 * communicator rank gets exactly one token shard (no data axis outside the communicator splits
 * tokens further). The texts follow DESIGN.md's error table word for word and end with the
 * remedy. */
#include "mesh.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int find_axis(const embps_mesh_t *m, const char *name, size_t len) {
  for (size_t i = 0; i < m->num_axes; i++)
    if (strlen(m->names[i]) == len && strncmp(m->names[i], name, len) == 0)
      return (int)i;
  return -1;
}

void embps_mesh_format(const embps_mesh_t *m, char *out, size_t cap) {
  size_t n = 0;
  out[0] = '\0';
  for (size_t i = 0; i < m->num_axes && n < cap; i++)
    n += (size_t)snprintf(out + n, cap - n, "%s%s=%u", i ? "," : "", m->names[i], m->sizes[i]);
}

static void format_list(const embps_mesh_t *m, const int *axes, size_t count, char *out,
                        size_t cap) {
  size_t n = 0;
  out[0] = '\0';
  for (size_t i = 0; i < count && n < cap; i++)
    n += (size_t)snprintf(out + n, cap - n, "%s%s", i ? "," : "", m->names[axes[i]]);
}

void embps_mesh_format_axes(const embps_mesh_t *m, int which, char *out, size_t cap) {
  if (which == 0)
    format_list(m, m->table_axes, m->num_table_axes, out, cap);
  else
    format_list(m, m->data_axes, m->num_data_axes, out, cap);
}

static int valid_name(const char *s, size_t len) {
  if (len == 0 || len >= EMBPS_MESH_AXIS_NAME)
    return 0;
  for (size_t i = 0; i < len; i++)
    if (!(isalnum((unsigned char)s[i]) || s[i] == '_'))
      return 0;
  return 1;
}

static embps_status_t parse_axes(embps_mesh_t *m, const char *text, const char *flag, int *axes,
                                 size_t *count, embps_error_t *err) {
  const char *p = (text && *text) ? text : "shard";
  char mesh_text[256];
  *count = 0;
  while (*p) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    int idx;
    if (!valid_name(p, len))
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "%s '%s' is not a list of axis names (e.g. shard or batch,shard)",
                             flag, text);
    if ((idx = find_axis(m, p, len)) < 0) {
      embps_mesh_format(m, mesh_text, sizeof(mesh_text));
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "axis '%.*s' is not a mesh axis of (%s): name axes of --mesh in %s",
                             (int)len, p, mesh_text, flag);
    }
    for (size_t i = 0; i < *count; i++)
      if (axes[i] == idx)
        return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s names axis '%s' twice", flag,
                               m->names[idx]);
    axes[(*count)++] = idx;
    p = end ? end + 1 : p + len;
  }
  return EMBPS_OK;
}

static int contains(const int *axes, size_t count, int idx) {
  for (size_t i = 0; i < count; i++)
    if (axes[i] == idx)
      return 1;
  return 0;
}

embps_status_t embps_mesh_parse(embps_mesh_t *m, const char *mesh_text, const char *table_axis,
                                const char *data_axis, uint32_t group_size, embps_error_t *err) {
  char buf[256], ta[256], da[256], missing[256];
  uint64_t product = 1, outside = 1;
  embps_status_t ret;

  memset(m, 0, sizeof(*m));
  if (!mesh_text || !*mesh_text) {
    snprintf(buf, sizeof(buf), "shard=%u", group_size);
    mesh_text = buf;
  }
  for (const char *p = mesh_text; *p;) {
    const char *end = strchr(p, ','), *eq = strchr(p, '=');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    char *num_end;
    unsigned long size;
    if (!eq || eq > p + len || !valid_name(p, (size_t)(eq - p)) || !isdigit((unsigned char)eq[1]))
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "--mesh '%s' is not a list of axis=size (e.g. shard=4 or "
                             "batch=2,shard=4)",
                             mesh_text);
    size = strtoul(eq + 1, &num_end, 10);
    if (num_end != p + len || size == 0 || size > 65536)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "--mesh '%s': axis sizes must be whole numbers from 1 to 65536",
                             mesh_text);
    if (m->num_axes == EMBPS_MESH_MAX_AXES)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "--mesh '%s' has more than %d axes",
                             mesh_text, EMBPS_MESH_MAX_AXES);
    if (find_axis(m, p, (size_t)(eq - p)) >= 0)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "--mesh '%s' names axis '%.*s' twice",
                             mesh_text, (int)(eq - p), p);
    memcpy(m->names[m->num_axes], p, (size_t)(eq - p));
    m->sizes[m->num_axes++] = (uint32_t)size;
    product *= size;
    p = end ? end + 1 : p + len;
  }
  if (m->num_axes == 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "--mesh is empty");

  if ((ret = parse_axes(m, table_axis, "--table-axis", m->table_axes, &m->num_table_axes, err)) !=
          EMBPS_OK ||
      (ret = parse_axes(m, data_axis, "--data-axis", m->data_axes, &m->num_data_axes, err)) !=
          EMBPS_OK)
    return ret;

  embps_mesh_format_axes(m, 0, ta, sizeof(ta));
  embps_mesh_format_axes(m, 1, da, sizeof(da));
  {
    int missing_axes[EMBPS_MESH_MAX_AXES];
    size_t n = 0;
    for (size_t i = 0; i < m->num_table_axes; i++)
      if (!contains(m->data_axes, m->num_data_axes, m->table_axes[i]))
        missing_axes[n++] = m->table_axes[i];
    if (n) {
      format_list(m, missing_axes, n, missing, sizeof(missing));
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "requires token shards to vary across the communicator: table_axis "
                             "(%s) missing from data_axis (%s): add it to --data-axis",
                             missing, da);
    }
  }
  for (size_t i = 0; i < m->num_data_axes; i++)
    if (!contains(m->table_axes, m->num_table_axes, m->data_axes[i]))
      outside *= m->sizes[m->data_axes[i]];
  if (outside > 1)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "requires exactly one token shard per communicator rank: data_axis "
                           "(%s) shards tokens over %llu positions outside table_axis (%s): "
                           "drop those axes from --data-axis or add them to --table-axis",
                           da, (unsigned long long)outside, ta);
  embps_mesh_format(m, buf, sizeof(buf));
  if (product != group_size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "--mesh (%s) has %llu positions but --peers lists %u ranks: the "
                           "product of the axis sizes must equal the number of peers",
                           buf, (unsigned long long)product, group_size);
  if (embps_mesh_communicator_size(m) != group_size) {
    char rest[256];
    int others[EMBPS_MESH_MAX_AXES];
    size_t n = 0;
    for (size_t i = 0; i < m->num_axes; i++)
      if (!contains(m->table_axes, m->num_table_axes, (int)i))
        others[n++] = (int)i;
    format_list(m, others, n, rest, sizeof(rest));
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "mesh axes outside table_axis (%s) would replicate every table, which "
                           "this version does not support: put every axis of --mesh in "
                           "--table-axis",
                           rest);
  }
  return EMBPS_OK;
}

uint32_t embps_mesh_communicator_size(const embps_mesh_t *m) {
  uint64_t s = 1;
  for (size_t i = 0; i < m->num_table_axes; i++)
    s *= m->sizes[m->table_axes[i]];
  return (uint32_t)s;
}
