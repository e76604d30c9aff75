/* The command line of `embps`: values, flags, commands' usages and the global settings.
 *
 * Everything the CLI reads from argv and the environment is declared as a table (a command's
 * embps_cli_flag_t array, the embps_cli_setting_t array of global settings) and goes through
 * this file, so a flag is parsed and documented in --help from the same line, and every usage
 * error is printed the same way ("embps: COMMAND: message", exit 2).
 *
 * strtoull and strtod are lenient: they skip leading spaces, accept a sign on unsigned
 * values ("-1" becomes 2^64-1), stop at the first bad character and saturate on overflow.
 * Each parser here checks the characters itself first and the whole-string consumption and
 * range after, so "--rows 10x", "--rows -1" or "--lr nan" are refused with a message rather
 * than turned into a surprising table. */
#include "client/cli/args.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int embps_cli_parse_u64(const char *what, const char *s, uint64_t min, uint64_t max, uint64_t *out,
                        char *err, size_t errlen) {
  uint64_t v = 0;
  if (!s || !*s) {
    snprintf(err, errlen, "%s: expected a whole number, got an empty value", what);
    return -1;
  }
  for (const char *p = s; *p; p++) {
    if (*p < '0' || *p > '9') {
      snprintf(err, errlen, "%s: '%s' is not a whole number", what, s);
      return -1;
    }
    if (v > (UINT64_MAX - (uint64_t)(*p - '0')) / 10) {
      snprintf(err, errlen, "%s: '%s' is too large", what, s);
      return -1;
    }
    v = v * 10 + (uint64_t)(*p - '0');
  }
  if (v < min || v > max) {
    snprintf(err, errlen, "%s: %s is outside [%llu, %llu]", what, s, (unsigned long long)min,
             (unsigned long long)max);
    return -1;
  }
  *out = v;
  return 0;
}

/* A decimal floating literal: [+-]digits[.digits][e[+-]digits], at least one digit. */
static int decimal_syntax(const char *s, size_t len) {
  size_t i = 0, digits = 0;
  if (i < len && (s[i] == '+' || s[i] == '-'))
    i++;
  while (i < len && s[i] >= '0' && s[i] <= '9')
    i++, digits++;
  if (i < len && s[i] == '.') {
    i++;
    while (i < len && s[i] >= '0' && s[i] <= '9')
      i++, digits++;
  }
  if (digits == 0)
    return 0;
  if (i < len && (s[i] == 'e' || s[i] == 'E')) {
    size_t exp_digits = 0;
    i++;
    if (i < len && (s[i] == '+' || s[i] == '-'))
      i++;
    while (i < len && s[i] >= '0' && s[i] <= '9')
      i++, exp_digits++;
    if (exp_digits == 0)
      return 0;
  }
  return i == len;
}

/* Parses s[0..len) as a finite double; 0 or -1. */
static int parse_double_n(const char *s, size_t len, double *out) {
  char buf[128];
  char *end;
  double v;
  if (len == 0 || len >= sizeof(buf) || !decimal_syntax(s, len))
    return -1;
  memcpy(buf, s, len);
  buf[len] = '\0';
  errno = 0;
  v = strtod(buf, &end);
  if (*end != '\0' || !isfinite(v) || (errno == ERANGE && fabs(v) > 1.0))
    return -1;
  *out = v;
  return 0;
}

int embps_cli_parse_double(const char *what, const char *s, double min, double max, double *out,
                           char *err, size_t errlen) {
  double v;
  if (!s || parse_double_n(s, strlen(s), &v) != 0) {
    snprintf(err, errlen, "%s: '%s' is not a finite decimal number", what, s ? s : "");
    return -1;
  }
  if (v < min || v > max) {
    snprintf(err, errlen, "%s: %s is outside [%g, %g]", what, s, min, max);
    return -1;
  }
  *out = v;
  return 0;
}

int embps_cli_parse_i64_list(const char *what, const char *s, int64_t **out, size_t *n, char *err,
                             size_t errlen) {
  size_t count = 1, k = 0;
  int64_t *v;
  const char *p;
  if (!s || !*s) {
    snprintf(err, errlen, "%s: expected a comma-separated list of tokens, got an empty value",
             what);
    return -1;
  }
  for (p = s; *p; p++)
    count += *p == ',';
  v = malloc(count * sizeof(*v));
  if (!v) {
    snprintf(err, errlen, "%s: out of memory", what);
    return -1;
  }
  p = s;
  for (;;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    size_t i = 0;
    int neg = 0;
    uint64_t mag = 0;
    if (len > 0 && p[0] == '-')
      neg = 1, i = 1;
    if (i == len)
      goto bad;
    for (; i < len; i++) {
      if (p[i] < '0' || p[i] > '9')
        goto bad;
      if (mag > ((uint64_t)INT64_MAX + 1 - (uint64_t)(p[i] - '0')) / 10)
        goto bad;
      mag = mag * 10 + (uint64_t)(p[i] - '0');
    }
    if (!neg && mag > (uint64_t)INT64_MAX)
      goto bad;
    v[k++] = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    if (!e)
      break;
    p = e + 1;
    continue;
  bad:
    snprintf(err, errlen, "%s: item %zu ('%.*s') is not an int64 token", what, k + 1,
             (int)(len > 40 ? 40 : len), p);
    free(v);
    return -1;
  }
  *out = v;
  *n = k;
  return 0;
}

int embps_cli_parse_f32_rows(const char *what, const char *s, float **out, size_t *n, size_t *rows,
                             char *err, size_t errlen) {
  size_t count = 1, k = 0, nrows = 1, width = 0, in_row = 0;
  float *v;
  const char *p;
  if (!s || !*s) {
    snprintf(err, errlen, "%s: expected values like '0.1,0.2|0.3,0.4', got an empty value", what);
    return -1;
  }
  for (p = s; *p; p++)
    count += *p == ',' || *p == '|';
  v = malloc(count * sizeof(*v));
  if (!v) {
    snprintf(err, errlen, "%s: out of memory", what);
    return -1;
  }
  p = s;
  for (;;) {
    size_t len = strcspn(p, ",|");
    double d;
    if (parse_double_n(p, len, &d) != 0 || fabs(d) > 3.4028234663852886e38) {
      snprintf(err, errlen, "%s: value %zu ('%.*s') is not a finite number", what, k + 1,
               (int)(len > 40 ? 40 : len), p);
      free(v);
      return -1;
    }
    v[k++] = (float)d;
    in_row++;
    if (p[len] != ',') {
      if (width == 0)
        width = in_row;
      else if (in_row != width) {
        snprintf(err, errlen, "%s: row %zu has %zu values, row 1 has %zu", what, nrows, in_row,
                 width);
        free(v);
        return -1;
      }
      in_row = 0;
      if (p[len] == '\0')
        break;
      nrows++;
    }
    p += len + 1;
  }
  *out = v;
  *n = k;
  *rows = nrows;
  return 0;
}

int embps_cli_parse_mix(const char *what, const char *s, uint64_t max_batch, uint64_t **batches,
                        double **weights, size_t *n, char *err, size_t errlen) {
  size_t count = 1, k = 0;
  uint64_t *b;
  double *w;
  const char *p;
  if (!s || !*s) {
    snprintf(err, errlen, "%s: expected sizes like '1024:3,4096:1', got an empty value", what);
    return -1;
  }
  for (p = s; *p; p++)
    count += *p == ',';
  b = malloc(count * sizeof(*b));
  w = malloc(count * sizeof(*w));
  if (!b || !w) {
    snprintf(err, errlen, "%s: out of memory", what);
    goto fail;
  }
  for (p = s;; k++) {
    size_t len = strcspn(p, ","), nlen = strcspn(p, ",:");
    char num[32];
    uint64_t v;
    double weight = 1.0;
    if (nlen > 0 && nlen < sizeof(num)) {
      memcpy(num, p, nlen);
      num[nlen] = '\0';
    }
    if (nlen == 0 || nlen >= sizeof(num) ||
        embps_cli_parse_u64(what, num, 1, max_batch, &v, err, errlen) != 0) {
      snprintf(err, errlen,
               "%s: item %zu ('%.*s'): the batch size must be a whole number in "
               "[1, %llu]",
               what, k + 1, (int)(len > 40 ? 40 : len), p, (unsigned long long)max_batch);
      goto fail;
    }
    if (nlen < len &&
        (parse_double_n(p + nlen + 1, len - nlen - 1, &weight) != 0 || !(weight > 0))) {
      snprintf(err, errlen, "%s: item %zu ('%.*s'): the weight after ':' must be a number > 0",
               what, k + 1, (int)(len > 40 ? 40 : len), p);
      goto fail;
    }
    b[k] = v;
    w[k] = weight;
    if (p[len] == '\0')
      break;
    p += len + 1;
  }
  *batches = b;
  *weights = w;
  *n = k + 1;
  return 0;
fail:
  free(b);
  free(w);
  return -1;
}

void embps_cli_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}

/* ---- flags and commands ---- */

/* A flag-table entry that is a further positional argument (its name is not an option's). */
static int is_positional(const embps_cli_flag_t *fl) { return fl->name[0] != '-'; }

void embps_cli_usage_command(FILE *f, const embps_cli_command_t *c) {
  fprintf(f, "usage: embps [GLOBAL OPTIONS] %s%s%s", c->name, c->positional ? " " : "",
          c->positional ? c->positional : "");
  for (const embps_cli_flag_t *fl = c->flags; fl && fl->name; fl++)
    if (is_positional(fl))
      fprintf(f, " %s", fl->name);
  fprintf(f, " [OPTIONS]\n\n%s\n\noptions:\n", c->summary);
  for (const embps_cli_flag_t *fl = c->flags; fl && fl->name; fl++) {
    char left[64];
    snprintf(left, sizeof(left), "%s%s%s", fl->name, fl->arg ? " " : "", fl->arg ? fl->arg : "");
    fprintf(f, "  %-26s %s\n", left, fl->help);
  }
  fprintf(f, "  %-26s %s\n", "--help", "show this help");
}

const char *embps_cli_flag(const embps_cli_flag_t *flags, const char *name) {
  for (const embps_cli_flag_t *fl = flags; fl && fl->name; fl++)
    if (strcmp(fl->name, name) == 0)
      return fl->value;
  return NULL;
}

int embps_cli_parse_flags(const embps_cli_command_t *c, int argc, char **argv, const char **pos) {
  *pos = NULL;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      embps_cli_usage_command(stdout, c);
      return -1;
    }
    if (strncmp(a, "--", 2) == 0) {
      const char *eq = strchr(a, '=');
      size_t len = eq ? (size_t)(eq - a) : strlen(a);
      embps_cli_flag_t *fl;
      for (fl = c->flags; fl && fl->name; fl++)
        if (strlen(fl->name) == len && strncmp(fl->name, a, len) == 0)
          break;
      if (!fl || !fl->name) {
        fprintf(stderr, "embps: %s: unknown option '%.*s' (see embps %s --help)\n", c->name,
                (int)len, a, c->name);
        return EMBPS_CLI_EXIT_USAGE;
      }
      if (!fl->arg) {
        if (eq) {
          fprintf(stderr, "embps: %s: %s takes no value\n", c->name, fl->name);
          return EMBPS_CLI_EXIT_USAGE;
        }
        fl->value = "1";
      } else if (eq) {
        fl->value = eq + 1;
      } else if (i + 1 < argc) {
        fl->value = argv[++i];
      } else {
        fprintf(stderr, "embps: %s: %s needs a value %s\n", c->name, fl->name, fl->arg);
        return EMBPS_CLI_EXIT_USAGE;
      }
      continue;
    }
    if (c->positional && !*pos) {
      *pos = a;
      continue;
    }
    if (c->positional) { /* a further positional: the next one the flag table declares */
      embps_cli_flag_t *fl;
      for (fl = c->flags; fl && fl->name; fl++)
        if (is_positional(fl) && !fl->value)
          break;
      if (fl && fl->name) {
        fl->value = a;
        continue;
      }
    }
    fprintf(stderr, "embps: %s: unexpected argument '%s' (see embps %s --help)\n", c->name, a,
            c->name);
    return EMBPS_CLI_EXIT_USAGE;
  }
  if (c->positional && !*pos) {
    fprintf(stderr, "embps: %s: missing %s (see embps %s --help)\n", c->name, c->positional,
            c->name);
    return EMBPS_CLI_EXIT_USAGE;
  }
  for (const embps_cli_flag_t *fl = c->flags; fl && fl->name; fl++)
    if (is_positional(fl) && !fl->value) {
      fprintf(stderr, "embps: %s: missing %s (see embps %s --help)\n", c->name, fl->name, c->name);
      return EMBPS_CLI_EXIT_USAGE;
    }
  return 0;
}

int embps_cli_usage_error(const char *cmd, const char *msg) {
  fprintf(stderr, "embps: %s: %s\n", cmd, msg);
  return EMBPS_CLI_EXIT_USAGE;
}

int embps_cli_flag_u64(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                       uint64_t min, uint64_t max, uint64_t def, uint64_t *out) {
  char err[512];
  const char *v = embps_cli_flag(flags, name);
  if (!v) {
    *out = def;
    return 0;
  }
  if (embps_cli_parse_u64(name, v, min, max, out, err, sizeof(err)) != 0)
    return embps_cli_usage_error(cmd, err);
  return 0;
}

int embps_cli_flag_double(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                          double min, double max, double def, double *out) {
  char err[512];
  const char *v = embps_cli_flag(flags, name);
  if (!v) {
    *out = def;
    return 0;
  }
  if (embps_cli_parse_double(name, v, min, max, out, err, sizeof(err)) != 0)
    return embps_cli_usage_error(cmd, err);
  return 0;
}

int embps_cli_flag_float(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                         float *out) {
  double d;
  int rc = embps_cli_flag_double(cmd, flags, name, 0.0, 3.4e38, 0.0, &d);
  if (rc == 0)
    *out = (float)d;
  return rc;
}

/* ---- global settings ---- */

int embps_cli_parse_settings(embps_cli_setting_t *settings, size_t n, int argc, char **argv,
                             int *next) {
  int i = 1;
  for (size_t s = 0; s < n; s++) {
    const char *e = getenv(settings[s].env);
    settings[s].value = e && *e ? e : settings[s].def;
  }
  for (; i < argc && argv[i][0] == '-'; i++) {
    const char *a = argv[i];
    size_t s;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0 || strcmp(a, "--version") == 0)
      break;
    for (s = 0; s < n; s++) {
      size_t len = strlen(settings[s].flag);
      if (strncmp(a, settings[s].flag, len) == 0 && (a[len] == '\0' || a[len] == '='))
        break;
    }
    if (s == n) {
      fprintf(stderr, "embps: unknown option '%s' (see embps --help)\n", a);
      return EMBPS_CLI_EXIT_USAGE;
    }
    {
      size_t len = strlen(settings[s].flag);
      if (a[len] == '=') {
        settings[s].value = a + len + 1;
      } else if (settings[s].is_switch) {
        settings[s].value = "1";
      } else if (i + 1 < argc) {
        settings[s].value = argv[++i];
      } else {
        fprintf(stderr, "embps: %s needs a value\n", a);
        return EMBPS_CLI_EXIT_USAGE;
      }
    }
  }
  *next = i;
  return 0;
}

void embps_cli_usage_settings(FILE *f, const embps_cli_setting_t *settings, size_t n) {
  for (size_t i = 0; i < n; i++) {
    char left[64];
    snprintf(left, sizeof(left), "%s%s", settings[i].flag, settings[i].is_switch ? "" : " VALUE");
    fprintf(f, "  %-28s %s\n  %-28s   (env %s, default %s)\n", left, settings[i].help, "",
            settings[i].env, settings[i].def[0] ? settings[i].def : "none");
  }
}
