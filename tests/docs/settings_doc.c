/* Writes the server's settings as a Markdown table, from the one declaration that also drives
 * parsing and --help (EMBPS_SERVER_SETTINGS in server/settings.h), so docs/operations.md lists
 * exactly the settings the server has. check_docs.py puts this output between the settings
 * markers of docs/operations.md (--write) and fails when the two differ.
 *
 * The environment variable is derived by settings.h's rule (EMBPS_ and the flag upper-cased,
 * '-' as '_'); check_docs.py also checks every variable `embps-server --help` prints against
 * the docs, so a change of that rule cannot pass unnoticed. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "server/settings.h"

/* What a setting's type accepts, in the words of settings.h's type list. */
static const char *kind(const char *type) {
  static const char *const names[][2] = {
      {"STR", "string"},     {"SIZE", "size (K, M, G, T)"}, {"U64", "number"},
      {"ADDR", "HOST:PORT"}, {"ADDRS", "HOST:PORT list"},   {"BOOL", "true/false"},
  };
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (strcmp(type, names[i][0]) == 0)
      return names[i][1];
  return type; /* a type settings.h added since: shown as declared */
}

/* Prints s as one Markdown table cell: '|' escaped, no newline. */
static void cell(const char *s) {
  for (; *s; s++) {
    if (*s == '|')
      fputc('\\', stdout);
    fputc(*s == '\n' ? ' ' : *s, stdout);
  }
}

static void row(const char *flag, const char *type, const char *def, const char *help) {
  printf("| `--%s` | `EMBPS_", flag);
  for (const char *p = flag; *p; p++)
    putchar(*p == '-' ? '_' : toupper((unsigned char)*p));
  printf("` | %s%s%s | %s | ", def[0] ? "`" : "", def, def[0] ? "`" : "", kind(type));
  cell(help);
  printf(" |\n");
}

int main(void) {
  printf("| flag | environment variable | default | value | meaning |\n");
  printf("|---|---|---|---|---|\n");
#define EMBPS_SETTING_ROW(name, type, flag, def, help) row(flag, #type, def, help);
  EMBPS_SERVER_SETTINGS(EMBPS_SETTING_ROW)
#undef EMBPS_SETTING_ROW
  return 0;
}
