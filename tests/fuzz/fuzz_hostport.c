/* Fuzz target: the small text parsers a user's input meets first: host:port addresses
 * (common/hostport.c: one, and lists), the client's server list (client/group.c), SIZE values
 * and the server's whole command line (server/settings.c).
 *
 * The first byte picks the parser; the rest is its text (for the command line: arguments
 * separated by NUL bytes). Checked: an address that parses formats back to text that parses to
 * the same address; the list parsers agree with parsing each entry alone; refusals carry a
 * message; nothing leaks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client/group.h"
#include "common/alloc.h"
#include "common/hostport.h"
#include "server/settings.h"

static void check_round_trip(const embps_hostport_t *hp, unsigned flags) {
  char text[EMBPS_HOSTPORT_HOST_MAX + 16];
  embps_hostport_t again;
  embps_error_t err;
  if (embps_hostport_format(hp, text, sizeof(text)) != EMBPS_OK)
    abort(); /* every parsed address fits host max + brackets + port */
  if (embps_hostport_parse(&again, text, strlen(text), "address", flags, &err) != EMBPS_OK ||
      strcmp(again.host, hp->host) != 0 || again.port != hp->port || again.ipv6 != hp->ipv6)
    abort();
}

static void fuzz_one(const char *text, size_t len, unsigned flags) {
  embps_hostport_t hp;
  embps_error_t err;
  if (embps_hostport_parse(&hp, text, len, "address", flags, &err) == EMBPS_OK)
    check_round_trip(&hp, flags);
  else if (!err.message[0])
    abort();
}

static void fuzz_list(const char *text, unsigned flags) {
  embps_hostport_t *list = NULL;
  size_t n = 0;
  embps_error_t err;
  if (embps_hostport_parse_list(text, "--peers", 16, flags, &list, &n, &err) == EMBPS_OK) {
    if (n == 0 || n > 16)
      abort();
    for (size_t i = 0; i < n; i++)
      check_round_trip(&list[i], flags);
    embps_free(list);
  } else if (!err.message[0] || list) {
    abort();
  }
}

static void fuzz_servers(const char *text) {
  embps__addr_t *addrs = NULL;
  size_t n = 0;
  embps_error_t err;
  if (embps__parse_servers(text, &addrs, &n, &err) == EMBPS_OK) {
    for (size_t i = 0; i < n; i++)
      if (!addrs[i].host[0] || !addrs[i].port[0] ||
          strnlen(addrs[i].authority, sizeof(addrs[i].authority)) == sizeof(addrs[i].authority))
        abort();
    embps_free(addrs);
  } else if (!err.message[0]) {
    abort();
  }
}

static void fuzz_size(const char *text) {
  uint64_t v;
  (void)embps_settings_parse_size(text, &v);
}

/* The arguments are the NUL-separated pieces of text[0..len) (text[len] is a NUL). */
static void fuzz_settings(char *text, size_t len) {
  char *argv[32];
  int argc = 0, help;
  embps_settings_t s;
  embps_error_t err;
  argv[argc++] = "embps-server";
  for (size_t i = 0; i <= len && argc < 32; i += strlen(text + i) + 1)
    argv[argc++] = text + i;
  if (embps_settings_load(&s, argc, argv, &help, &err) != EMBPS_OK && !err.message[0])
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  char *text = malloc(size); /* the rest, NUL-terminated */
  size_t len = size - 1;
  memcpy(text, data + 1, len);
  text[len] = '\0';
  switch (data[0] % 6) {
  case 0:
  case 1: /* exactly len bytes: the parser must not read past them */
    fuzz_one((const char *)data + 1, len, data[0] % 6 ? EMBPS_HOSTPORT_LISTEN : 0);
    break;
  case 2:
    fuzz_list(text, data[0] & 0x80 ? EMBPS_HOSTPORT_LISTEN : 0);
    break;
  case 3:
    fuzz_servers(text);
    break;
  case 4:
    fuzz_size(text);
    break;
  default:
    fuzz_settings(text, len);
    break;
  }
  free(text);
  return 0;
}
