/* common/hostport.c: host:port parsing for server, client and CLI (IPv4, [IPv6], DNS names,
 * ports, listen addresses), lists, formatting, and resolution to socket addresses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/hostport.h"

static embps_status_t parse(embps_hostport_t *hp, const char *text, unsigned flags,
                            embps_error_t *err) {
  return embps_hostport_parse(hp, text, strlen(text), "server address", flags, err);
}

static void test_parse_ok(void **state) {
  static const struct {
    const char *in;
    const char *host;
    unsigned port;
    int ipv6;
  } ok[] = {
      {"127.0.0.1:7070", "127.0.0.1", 7070, 0},
      {"localhost:1", "localhost", 1, 0},
      {"embps-1.embps.default.svc.cluster.local:65535", "embps-1.embps.default.svc.cluster.local",
       65535, 0},
      {"ps_0:80", "ps_0", 80, 0},
      {"rooted.name.:80", "rooted.name.", 80, 0},
      {"[::1]:7070", "::1", 7070, 1},
      {"[fe80::1%eth0]:7070", "fe80::1%eth0", 7070, 1},
      {"[::ffff:10.0.0.1]:9", "::ffff:10.0.0.1", 9, 1},
      {"h:00080", "h", 80, 0},
  };
  (void)state;
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    embps_hostport_t hp;
    embps_error_t err;
    if (parse(&hp, ok[i].in, 0, &err) != EMBPS_OK)
      fail_msg("'%s' refused: %s", ok[i].in, err.message);
    assert_string_equal(hp.host, ok[i].host);
    assert_int_equal(hp.port, ok[i].port);
    assert_int_equal(hp.ipv6, ok[i].ipv6);
  }
  /* The length bounds the text: what follows is not read. */
  embps_hostport_t hp;
  assert_int_equal(embps_hostport_parse(&hp, "a:12,b:34", 4, "x", 0, NULL), EMBPS_OK);
  assert_string_equal(hp.host, "a");
  assert_int_equal(hp.port, 12);
}

static void test_parse_refused(void **state) {
  char long_label[128], long_host[300];
  const struct {
    const char *in;
    const char *msg;
  } bad[] = {
      {"", "empty server address (expected host:port)"},
      {"host", "server address 'host' has no port (expected host:port)"},
      {"host:", "'host:' has a bad port (expected 1..65535)"},
      {"host:0", "bad port (expected 1..65535)"},
      {"host:65536", "bad port"},
      {"host:123456", "bad port"},
      {"host:80x", "bad port"},
      {"host:-1", "bad port"},
      {"host: 80", "bad port"},
      {":80", "':80' has an empty host"},
      {"::1:80", "'::1:80': write IPv6 hosts as [addr]:port"},
      {"[::1]80", "'[::1]80' is not [ipv6]:port"},
      {"[::1]", "is not [ipv6]:port"},
      {"[::1", "is not [ipv6]:port"},
      {"[]:80", "has an empty host"},
      {"[not-v6]:80", "'not-v6' is not an IPv6 address"},
      {"[10.0.0.1]:80", "is not an IPv6 address"},
      {"[::1%]:80", "is not an IPv6 address"},
      {"[::1%a b]:80", "is not an IPv6 address"},
      {"a b:80", "has a bad character ' ' in its host"},
      {"a/b:80", "bad character '/'"},
      {"h\x01:80", "bad character (byte 0x01)"},
      {"a..b:80", "has an empty label in its host"},
      {".a:80", "empty label"},
      {long_label, "label longer than 63 characters"},
      {long_host, "host longer than 253 characters"},
  };
  (void)state;
  memset(long_label, 'l', 64);
  snprintf(long_label + 64, sizeof(long_label) - 64, ".com:80");
  for (int i = 0; i < 254; i++)
    long_host[i] = i % 10 == 9 ? '.' : 'h';
  snprintf(long_host + 254, sizeof(long_host) - 254, ":80");
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    embps_hostport_t hp;
    embps_error_t err;
    memset(&hp, 0x5a, sizeof(hp));
    embps_error_clear(&err);
    assert_int_equal(parse(&hp, bad[i].in, 0, &err), EMBPS_INVALID_ARGUMENT);
    if (!strstr(err.message, bad[i].msg))
      fail_msg("'%s': message '%s' lacks '%s'", bad[i].in, err.message, bad[i].msg);
    assert_int_equal(hp.port, 0x5a5a); /* untouched */
  }
  embps_error_t err;
  embps_hostport_t hp;
  assert_int_equal(embps_hostport_parse(&hp, NULL, 0, "--listen", 0, &err), EMBPS_INVALID_ARGUMENT);
  assert_string_equal(err.message, "empty --listen (expected host:port)");
}

static void test_listen_addresses(void **state) {
  embps_hostport_t hp;
  embps_error_t err;
  (void)state;
  assert_int_equal(parse(&hp, "127.0.0.1:0", EMBPS_HOSTPORT_LISTEN, &err), EMBPS_OK);
  assert_int_equal(hp.port, 0);
  assert_int_equal(parse(&hp, ":7070", EMBPS_HOSTPORT_LISTEN, &err), EMBPS_OK);
  assert_string_equal(hp.host, "");
  assert_int_equal(hp.port, 7070);
  assert_int_equal(parse(&hp, "[::]:0", EMBPS_HOSTPORT_LISTEN, &err), EMBPS_OK);
  assert_int_equal(parse(&hp, "[]:7070", EMBPS_HOSTPORT_LISTEN, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(parse(&hp, "h:65536", EMBPS_HOSTPORT_LISTEN, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "expected 0..65535"));
}

static void test_lists(void **state) {
  embps_hostport_t *hps = NULL;
  size_t n = 0;
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_hostport_parse_list(" a:1 ,[::1]:2,\tb.example.com:3 ", "server address",
                                             8, 0, &hps, &n, &err),
                   EMBPS_OK);
  assert_int_equal(n, 3);
  assert_string_equal(hps[0].host, "a");
  assert_int_equal(hps[1].ipv6, 1);
  assert_string_equal(hps[2].host, "b.example.com");
  assert_int_equal(hps[2].port, 3);
  embps_free(hps);

  static const struct {
    const char *in;
    const char *msg;
  } bad[] = {
      {"", "empty peer in the list (expected host:port[,host:port...])"},
      {"a:1,", "empty peer in the list"},
      {"a:1,,b:2", "empty peer"},
      {" , ", "empty peer"},
      {"a:1,b", "peer 'b' has no port"},
      {"a:1,b:2,c:3,d:4", "4 peer entries, at most 3"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    hps = NULL;
    n = 99;
    assert_int_equal(embps_hostport_parse_list(bad[i].in, "peer", 3, 0, &hps, &n, &err),
                     EMBPS_INVALID_ARGUMENT);
    assert_null(hps);
    assert_int_equal(n, 99);
    if (!strstr(err.message, bad[i].msg))
      fail_msg("'%s': message '%s' lacks '%s'", bad[i].in, err.message, bad[i].msg);
  }
  assert_int_equal(embps_hostport_parse_list(NULL, "peer", 2, 0, &hps, &n, &err),
                   EMBPS_INVALID_ARGUMENT);
  embps_alloc_fail_after(1);
  assert_int_equal(embps_hostport_parse_list("a:1", "peer", 2, 0, &hps, &n, &err),
                   EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
}

static void test_format(void **state) {
  embps_hostport_t hp;
  char out[32];
  (void)state;
  assert_int_equal(parse(&hp, "[::1]:7070", 0, NULL), EMBPS_OK);
  assert_int_equal(embps_hostport_format(&hp, out, sizeof(out)), EMBPS_OK);
  assert_string_equal(out, "[::1]:7070");
  assert_int_equal(parse(&hp, "10.0.0.5:00080", 0, NULL), EMBPS_OK);
  assert_int_equal(embps_hostport_format(&hp, out, sizeof(out)), EMBPS_OK);
  assert_string_equal(out, "10.0.0.5:80");
  /* 12 bytes with the NUL: 11 do not hold it, and out stays as it was. */
  strcpy(out, "untouched");
  assert_int_equal(embps_hostport_format(&hp, out, 11), EMBPS_INVALID_ARGUMENT);
  assert_string_equal(out, "untouched");
  assert_int_equal(embps_hostport_format(&hp, out, 12), EMBPS_OK);
}

/* Resolves text and checks the numeric form that comes back. */
static void resolves_to(const char *text, unsigned flags, const char *numeric, int wildcard) {
  embps_hostport_t hp, back;
  struct sockaddr_storage ss;
  socklen_t len;
  embps_error_t err;
  char out[80];
  assert_int_equal(parse(&hp, text, flags, &err), EMBPS_OK);
  if (embps_hostport_resolve(&hp, &ss, &len, &err) != EMBPS_OK)
    fail_msg("'%s' did not resolve: %s", text, err.message);
  assert_int_equal(embps_hostport_numeric(&ss, len, &back), EMBPS_OK);
  assert_int_equal(embps_hostport_format(&back, out, sizeof(out)), EMBPS_OK);
  assert_string_equal(out, numeric);
  assert_int_equal(embps_hostport_is_wildcard(&ss), wildcard);
}

static void test_resolve(void **state) {
  (void)state;
  resolves_to("127.0.0.1:7070", 0, "127.0.0.1:7070", 0);
  resolves_to("localhost:7070", 0, "127.0.0.1:7070", 0); /* as every embps listener takes it */
  resolves_to("[::1]:9", 0, "[::1]:9", 0);
  resolves_to("0.0.0.0:7070", EMBPS_HOSTPORT_LISTEN, "0.0.0.0:7070", 1);
  resolves_to(":0", EMBPS_HOSTPORT_LISTEN, "0.0.0.0:0", 1);
  resolves_to("[::]:8000", EMBPS_HOSTPORT_LISTEN, "[::]:8000", 1);
}

/* A DNS name goes through getaddrinfo: this host's own name where the system resolves it, and a
 * name under .invalid (RFC 6761: never resolves) fails with UNAVAILABLE and the resolver's
 * reason. */
static void test_resolve_names(void **state) {
  char name[256], text[300], want[80];
  struct addrinfo hints, *res = NULL;
  embps_hostport_t hp;
  struct sockaddr_storage ss;
  socklen_t len;
  embps_error_t err;
  (void)state;
  assert_int_equal(parse(&hp, "no-such-host.invalid:80", 0, &err), EMBPS_OK);
  assert_int_equal(embps_hostport_resolve(&hp, &ss, &len, &err), EMBPS_UNAVAILABLE);
  assert_non_null(strstr(err.message, "cannot resolve 'no-such-host.invalid'"));
  memset(&hints, 0, sizeof(hints));
  hints.ai_socktype = SOCK_STREAM;
  if (gethostname(name, sizeof(name)) != 0 || getaddrinfo(name, NULL, &hints, &res) != 0)
    skip();
  if (res->ai_family == AF_INET) {
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &((struct sockaddr_in *)res->ai_addr)->sin_addr, ip, sizeof(ip));
    snprintf(want, sizeof(want), "%s:4242", ip);
  } else {
    char ip[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, &((struct sockaddr_in6 *)res->ai_addr)->sin6_addr, ip, sizeof(ip));
    snprintf(want, sizeof(want), "[%s]:4242", ip);
  }
  freeaddrinfo(res);
  snprintf(text, sizeof(text), "%s:4242", name);
  if (parse(&hp, text, 0, &err) != EMBPS_OK)
    skip(); /* a host name that is not a DNS name */
  resolves_to(text, 0, want, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_ok),         cmocka_unit_test(test_parse_refused),
      cmocka_unit_test(test_listen_addresses), cmocka_unit_test(test_lists),
      cmocka_unit_test(test_format),           cmocka_unit_test(test_resolve),
      cmocka_unit_test(test_resolve_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
