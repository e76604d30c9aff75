/* The optimizer registry's lookups, all expanded from EMBPS_OPTIMIZERS (optimizer.h). The rows
 * sit in one static array; the kind -> row lookup is a switch with one case per row and no
 * default, so that an enum constant added to include/embps/optimizer.h without a row fails the
 * build under -Wswitch (part of -Wall), rather than being found unknown at run time. Names are
 * looked up by a scan of four rows: only table creation and the CLI ask. */
#include "common/optimizer.h"

#include <string.h>

/* The row index of each kind. */
enum {
#define ROW_INDEX(kind, ...) ROW_##kind,
  EMBPS_OPTIMIZERS(ROW_INDEX)
#undef ROW_INDEX
      ROW_COUNT
};

static const embps_optimizer_info_t registry[ROW_COUNT] = {
#define ROW(kind, name, dflt, per_element, per_row, acc)                                           \
  [ROW_##kind] = {EMBPS_OPTIMIZER_##kind, name, dflt, per_element, per_row, acc},
    EMBPS_OPTIMIZERS(ROW)
#undef ROW
};

#define COUNT_DEFAULT(kind, name, dflt, ...) +(dflt)
_Static_assert((0 EMBPS_OPTIMIZERS(COUNT_DEFAULT)) == 1,
               "exactly one row of EMBPS_OPTIMIZERS is the server's default");
#undef COUNT_DEFAULT

const embps_optimizer_info_t *embps_optimizer_info(embps_optimizer_t kind) {
  switch (kind) {
#define CASE(k, ...)                                                                               \
  case EMBPS_OPTIMIZER_##k:                                                                        \
    return &registry[ROW_##k];
    EMBPS_OPTIMIZERS(CASE)
#undef CASE
  }
  return NULL; /* EMBPS_OPTIMIZER_DEFAULT, or a number off the wire that names no optimizer */
}

const char *embps_optimizer_name(embps_optimizer_t kind) {
  const embps_optimizer_info_t *info = embps_optimizer_info(kind);
  return info ? info->name : "unknown";
}

/* Whether s is name with any '_' of it written '-'. */
static int same_name(const char *s, const char *name) {
  for (; *s && *name; s++, name++)
    if (*s != *name && !(*s == '-' && *name == '_'))
      return 0;
  return *s == *name;
}

embps_status_t embps_optimizer_from_name(const char *name, embps_optimizer_t *out) {
  if (!name)
    return EMBPS_INVALID_ARGUMENT;
  for (size_t i = 0; i < ROW_COUNT; i++)
    if (same_name(name, registry[i].name)) {
      *out = registry[i].kind;
      return EMBPS_OK;
    }
  return EMBPS_INVALID_ARGUMENT;
}
