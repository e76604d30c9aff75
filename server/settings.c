/* Settings: one table (settings.h) drives defaults, environment variables, flags and --help.
 * Containers configure the server through EMBPS_* variables and people through flags, so both
 * read the same parser and flags take precedence. */
#include "settings.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/hostport.h"

typedef enum { TYPE_STR, TYPE_SIZE, TYPE_U64, TYPE_ADDR, TYPE_ADDRS } setting_type_t;

typedef struct setting_desc {
  const char *flag;
  setting_type_t type;
  const char *def;
  const char *help;
  size_t offset;
} setting_desc_t;

static const setting_desc_t settings_table[] = {
#define EMBPS_SETTING_DESC(name, type, flag, def, help)                                            \
  {flag, TYPE_##type, def, help, offsetof(embps_settings_t, name)},
    EMBPS_SERVER_SETTINGS(EMBPS_SETTING_DESC)
#undef EMBPS_SETTING_DESC
};
#define NUM_SETTINGS (sizeof(settings_table) / sizeof(settings_table[0]))

static void env_name(const setting_desc_t *d, char *out, size_t cap) {
  size_t n = (size_t)snprintf(out, cap, "EMBPS_");
  for (const char *p = d->flag; *p && n + 1 < cap; p++)
    out[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
  out[n] = '\0';
}

embps_status_t embps_settings_parse_size(const char *text, uint64_t *out) {
  char *end;
  unsigned long long v;
  unsigned shift = 0;

  if (!text || !isdigit((unsigned char)text[0]))
    return EMBPS_INVALID_ARGUMENT;
  errno = 0;
  v = strtoull(text, &end, 10);
  if (errno)
    return EMBPS_INVALID_ARGUMENT;
  switch (*end) {
  case '\0':
    break;
  case 'K':
  case 'k':
    shift = 10;
    end++;
    break;
  case 'M':
  case 'm':
    shift = 20;
    end++;
    break;
  case 'G':
  case 'g':
    shift = 30;
    end++;
    break;
  case 'T':
  case 't':
    shift = 40;
    end++;
    break;
  default:
    return EMBPS_INVALID_ARGUMENT;
  }
  if (*end == 'i' || *end == 'B') /* accept 256Mi, 256MB, 256MiB */
    end += (*end == 'i' && end[1] == 'B') ? 2 : 1;
  if (*end != '\0' || (shift && v > (UINT64_MAX >> shift)))
    return EMBPS_INVALID_ARGUMENT;
  *out = (uint64_t)v << shift;
  return EMBPS_OK;
}

/* Checks an ADDR or ADDRS value (a STR passes) with the parser every address goes through. */
static embps_status_t check_addresses(setting_type_t type, const char *value, const char *source,
                                      embps_error_t *err) {
  char what[160];
  embps_hostport_t one, *list = NULL;
  size_t n;
  embps_status_t ret = EMBPS_OK;
  if (type == TYPE_ADDR)
    ret = embps_hostport_parse(&one, value, strlen(value), source, EMBPS_HOSTPORT_LISTEN, err);
  else if (type == TYPE_ADDRS) {
    snprintf(what, sizeof(what), "%s entry", source);
    ret = embps_hostport_parse_list(value, what, EMBPS_SETTINGS_MAX_PEERS, 0, &list, &n, err);
    embps_free(list);
  }
  return ret;
}

static embps_status_t set_value(embps_settings_t *s, const setting_desc_t *d, const char *value,
                                const char *source, embps_error_t *err) {
  char *field = (char *)s + d->offset;
  embps_status_t ret;
  uint64_t v;

  switch (d->type) {
  case TYPE_STR:
  case TYPE_ADDR:
  case TYPE_ADDRS:
    if (strlen(value) >= sizeof(s->listen))
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s: value too long", source);
    if (value[0] && (ret = check_addresses(d->type, value, source, err)) != EMBPS_OK)
      return ret;
    strcpy(field, value);
    return EMBPS_OK;
  case TYPE_SIZE:
    if (embps_settings_parse_size(value, &v) != EMBPS_OK)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "%s: '%s' is not a size (a count with an optional K, M, G or T)",
                             source, value);
    break;
  case TYPE_U64: {
    char *end;
    if (!isdigit((unsigned char)value[0]))
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s: '%s' is not a number", source,
                             value);
    errno = 0;
    v = strtoull(value, &end, 10);
    if (errno || *end)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s: '%s' is not a number", source,
                             value);
    break;
  }
  default:
    return EMBPS_INTERNAL;
  }
  memcpy(field, &v, sizeof(v));
  return EMBPS_OK;
}

embps_status_t embps_settings_load(embps_settings_t *s, int argc, char **argv, int *want_help,
                                   embps_error_t *err) {
  embps_status_t ret;
  char name[96], source[128];

  memset(s, 0, sizeof(*s));
  *want_help = 0;
  for (size_t i = 0; i < NUM_SETTINGS; i++) {
    const setting_desc_t *d = &settings_table[i];
    const char *env;
    snprintf(source, sizeof(source), "default of --%s", d->flag);
    if ((ret = set_value(s, d, d->def, source, err)) != EMBPS_OK)
      return ret;
    env_name(d, name, sizeof(name));
    if ((env = getenv(name)) != NULL && (ret = set_value(s, d, env, name, err)) != EMBPS_OK)
      return ret;
  }
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i], *value = NULL, *eq;
    const setting_desc_t *d = NULL;
    size_t len;

    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      *want_help = 1;
      continue;
    }
    if (strncmp(arg, "--", 2) != 0)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "unexpected argument '%s'", arg);
    arg += 2;
    eq = strchr(arg, '=');
    len = eq ? (size_t)(eq - arg) : strlen(arg);
    for (size_t k = 0; k < NUM_SETTINGS; k++)
      if (strlen(settings_table[k].flag) == len && strncmp(settings_table[k].flag, arg, len) == 0)
        d = &settings_table[k];
    if (!d)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "unknown flag '%s' (see --help)",
                             argv[i]);
    if (eq)
      value = eq + 1;
    else if (i + 1 < argc)
      value = argv[++i];
    else
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "flag --%s needs a value", d->flag);
    snprintf(source, sizeof(source), "--%s", d->flag);
    if ((ret = set_value(s, d, value, source, err)) != EMBPS_OK)
      return ret;
  }
  return EMBPS_OK;
}

void embps_settings_usage(FILE *out, const char *prog) {
  char name[96];
  fprintf(out,
          "usage: %s [FLAGS]\n\n"
          "embps-server holds sharded embedding tables and serves Lookup and PushGradients\n"
          "over gRPC (service embps.v1.EmbeddingService, plus grpc.health.v1.Health).\n\n"
          "Every flag can also be set by its environment variable; flags win.\n\n",
          prog);
  for (size_t i = 0; i < NUM_SETTINGS; i++) {
    const setting_desc_t *d = &settings_table[i];
    env_name(d, name, sizeof(name));
    fprintf(out, "  --%-20s %s", d->flag, d->help);
    if (d->def[0]) /* an empty default says nothing the help does not */
      fprintf(out, " (default %s)", d->def);
    fprintf(out, "\n  %-22s   env %s\n", "", name);
  }
  fprintf(out, "  --%-20s print this help\n", "help");
}

embps_status_t embps_settings_device(const char *text, uint64_t rank, int num_devices,
                                     embps_backend_t *backend, int *device, embps_error_t *err) {
  char name[16], *end;
  const char *colon = strchr(text, ':');
  size_t len = colon ? (size_t)(colon - text) : strlen(text);
  embps_backend_t b;
  long n;

  if (strcmp(text, "auto") == 0) {
    *backend = num_devices > 0 ? EMBPS_BACKEND_CUDA : EMBPS_BACKEND_CPU;
    *device = num_devices > 0 ? (int)(rank % (uint64_t)num_devices) : 0;
    return EMBPS_OK;
  }
  if (len < sizeof(name)) {
    memcpy(name, text, len);
    name[len] = '\0';
  }
  if (len >= sizeof(name) || embps_backend_parse(name, &b) != 0 ||
      (colon && b != EMBPS_BACKEND_CUDA))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "--device: '%s' is not auto, cpu, cuda or cuda:N", text);
  if (b == EMBPS_BACKEND_CPU) {
    *backend = b;
    *device = 0;
    return EMBPS_OK;
  }
  if (num_devices <= 0)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "--device %s: no CUDA device is visible to this process", text);
  if (!colon) {
    *backend = b;
    *device = (int)(rank % (uint64_t)num_devices);
    return EMBPS_OK;
  }
  errno = 0;
  n = strtol(colon + 1, &end, 10);
  if (!isdigit((unsigned char)colon[1]) || *end != '\0' || errno)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "--device: '%s' is not auto, cpu, cuda or cuda:N", text);
  if (n >= num_devices)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "--device %s: no such CUDA device; this process sees %d (cuda:0 to "
                           "cuda:%d)",
                           text, num_devices, num_devices - 1);
  *backend = b;
  *device = (int)n;
  return EMBPS_OK;
}
