/* The eviction registry's lookups, expanded from EMBPS_EVICTIONS (eviction.h). The kind -> name
 * lookup is a switch with one case per row and no default, so that an enum constant added to
 * include/embps/eviction.h without a row fails the build under -Wswitch. */
#include "common/eviction.h"

#include <stddef.h>
#include <string.h>

#define COUNT_DEFAULT(kind, name, dflt) +(dflt)
_Static_assert((0 EMBPS_EVICTIONS(COUNT_DEFAULT)) == 1,
               "exactly one row of EMBPS_EVICTIONS is the server's default");
#undef COUNT_DEFAULT

const char *embps_eviction_name(embps_eviction_t kind) {
  switch (kind) {
#define CASE(k, name, dflt)                                                                        \
  case EMBPS_EVICTION_##k:                                                                         \
    return name;
    EMBPS_EVICTIONS(CASE)
#undef CASE
  }
  return "unknown"; /* EMBPS_EVICTION_DEFAULT, or a number off the wire that names no policy */
}

int embps_eviction_known(embps_eviction_t kind) {
  return strcmp(embps_eviction_name(kind), "unknown") != 0;
}

embps_status_t embps_eviction_from_name(const char *name, embps_eviction_t *out) {
  static const struct {
    embps_eviction_t kind;
    const char *name;
  } rows[] = {
#define ROW(k, name, dflt) {EMBPS_EVICTION_##k, name},
      EMBPS_EVICTIONS(ROW)
#undef ROW
  };
  if (!name)
    return EMBPS_INVALID_ARGUMENT;
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
    if (strcmp(name, rows[i].name) == 0) {
      *out = rows[i].kind;
      return EMBPS_OK;
    }
  return EMBPS_INVALID_ARGUMENT;
}
