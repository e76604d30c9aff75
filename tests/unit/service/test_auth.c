/* Bearer tokens: the tokens file's parser (what it accepts, what it refuses and how it says so,
 * without ever quoting a token), each method's least role as the service's method table gives
 * it, and the check a call goes through with that role. Includes auth.c to reach its static
 * helpers; the method table comes with the service's sources over the shared fake
 * (embps_service_faked), whose own auth.c the included one stands in for. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/service/auth.c"
#include "server/service/service_internal.h"

#define ADMIN "admin-0123456789abcdef"
#define WORKER "worker-0123456789abcdef"
#define READER "reader-0123456789abcdef"

static embps_auth_t *parse_ok(const char *text) {
  embps_auth_t *a = NULL;
  embps_error_t err;
  embps_error_clear(&err);
  assert_int_equal(embps_auth_parse(&a, text, strlen(text), "tokens.txt", &err), EMBPS_OK);
  assert_non_null(a);
  return a;
}

/* Parsing text fails with INVALID_ARGUMENT and a message containing want, and no token. */
static void parse_fails(const char *text, const char *want) {
  embps_auth_t *a = (embps_auth_t *)(uintptr_t)1; /* must stay untouched */
  embps_error_t err;
  embps_error_clear(&err);
  assert_int_equal(embps_auth_parse(&a, text, strlen(text), "tokens.txt", &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_ptr_equal(a, (embps_auth_t *)(uintptr_t)1);
  if (!strstr(err.message, want))
    fail_msg("message '%s' lacks '%s'", err.message, want);
  assert_null(strstr(err.message, "0123456789abcdef"));
}

static embps_status_t check(const embps_auth_t *a, const char *method, const char *header,
                            embps_error_t *err) {
  char path[128];
  snprintf(path, sizeof(path), "/embps.v1.EmbeddingService/%s", method);
  embps_error_clear(err);
  return embps_auth_check(a, embps__svc_method_role(path), path, header, err);
}

static void test_parse_accepts(void **state) {
  (void)state;
  embps_auth_t *a = parse_ok("# who may do what\n"
                             "\n"
                             "admin " ADMIN "\n"
                             "  worker\t" WORKER "   # the trainers\r\n"
                             "reader " READER "\n"
                             "reader b64+/token_with.all~chars-==");
  assert_int_equal(a->n, 4);
  assert_int_equal(embps_auth_count(a, EMBPS_AUTH_ADMIN), 1);
  assert_int_equal(embps_auth_count(a, EMBPS_AUTH_WORKER), 1);
  assert_int_equal(embps_auth_count(a, EMBPS_AUTH_READER), 2);
  assert_int_equal(a->width, strlen("b64+/token_with.all~chars-=="));
  assert_int_equal(find_role(a, (const uint8_t *)WORKER, strlen(WORKER)), EMBPS_AUTH_WORKER);
  assert_int_equal(find_role(a, (const uint8_t *)"b64+/token_with.all~chars-==", 28),
                   EMBPS_AUTH_READER);
  /* a prefix, an extension and a same-length variant of a token are all unknown */
  assert_int_equal(find_role(a, (const uint8_t *)WORKER, strlen(WORKER) - 1), 0);
  assert_int_equal(find_role(a, (const uint8_t *)WORKER "x", strlen(WORKER) + 1), 0);
  assert_int_equal(find_role(a, (const uint8_t *)"worker-0123456789abcdeF", strlen(WORKER)), 0);
  embps_auth_free(a);
}

static void test_parse_refuses(void **state) {
  char big[700];
  (void)state;
  parse_fails("", "tokens.txt holds no tokens");
  parse_fails("# only comments\n\n", "holds no tokens");
  parse_fails("admin " ADMIN "\nroot " READER "\n",
              "tokens.txt line 2: unknown role 'root': each line is 'ROLE TOKEN' with ROLE admin, "
              "worker or reader");
  parse_fails("Admin " ADMIN "\n", "unknown role 'Admin'"); /* roles are lower case */
  /* TOKEN ROLE is the wrong order, and the message must not quote the token */
  parse_fails(ADMIN " admin\n", "line 1: the first word is not a role");
  parse_fails("worker\n", "line 1: role worker without a token");
  parse_fails("reader short-token\n", "line 1: the token is 11 characters; tokens need 16 to 512");
  memset(big, 'z', sizeof(big));
  memcpy(big, "reader ", 7);
  big[sizeof(big) - 1] = '\0';
  parse_fails(big, "the token is 692 characters");
  parse_fails("reader abc\"def0123456789abc\n", "character outside A-Z a-z 0-9 - . _ ~ + / (then "
                                                "'=' padding) at column 11");
  parse_fails("reader a=b0123456789abcdefgh\n", "at column 10"); /* '=' only at the end */
  parse_fails("reader " READER " extra\n", "line 1: text after the token");
  parse_fails("admin " ADMIN "\nreader " ADMIN "\n",
              "tokens.txt line 2: the same token as line 1: give each token one role");
  {
    static const char nul[] = "admin " ADMIN "\n\0reader x";
    embps_auth_t *a;
    embps_error_t err;
    assert_int_equal(embps_auth_parse(&a, nul, sizeof(nul) - 1, "tokens.txt", &err),
                     EMBPS_INVALID_ARGUMENT);
    assert_non_null(strstr(err.message, "line 2: a NUL byte"));
  }
}

static void test_load(void **state) {
  char path[] = "/tmp/embps-test-auth-XXXXXX";
  embps_auth_t *a = NULL;
  embps_error_t err;
  int fd = mkstemp(path);
  (void)state;
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "admin " ADMIN "\n", strlen(ADMIN) + 7), (ssize_t)strlen(ADMIN) + 7);
  close(fd);
  assert_int_equal(embps_auth_load(&a, path, &err), EMBPS_OK);
  assert_int_equal(embps_auth_count(a, EMBPS_AUTH_ADMIN), 1);
  embps_auth_free(a);
  unlink(path);
  a = NULL;
  assert_int_equal(embps_auth_load(&a, path, &err), EMBPS_INVALID_ARGUMENT);
  assert_null(a);
  assert_non_null(strstr(err.message, "cannot read /tmp/embps-test-auth-"));
  assert_non_null(strstr(err.message, "No such file or directory"));
}

static void test_method_roles(void **state) {
  (void)state;
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/CreateTable"),
                   EMBPS_AUTH_ADMIN);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/DropTable"),
                   EMBPS_AUTH_ADMIN);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/Checkpoint"),
                   EMBPS_AUTH_ADMIN);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/PushGradients"),
                   EMBPS_AUTH_WORKER);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/Assign"), EMBPS_AUTH_WORKER);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/Lookup"), EMBPS_AUTH_READER);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/ListTables"),
                   EMBPS_AUTH_READER);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/GetStats"),
                   EMBPS_AUTH_READER);
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/ListCheckpoints"),
                   EMBPS_AUTH_READER);
  assert_int_equal(embps__svc_method_role("/grpc.health.v1.Health/Check"), EMBPS_AUTH_OPEN);
  assert_int_equal(embps__svc_method_role("/grpc.health.v1.Health/Watch"), EMBPS_AUTH_OPEN);
  /* anything else needs a known token: no probing of unknown methods without one */
  assert_int_equal(embps__svc_method_role("/embps.v1.EmbeddingService/Nope"), EMBPS_AUTH_READER);
  assert_int_equal(
      embps__svc_method_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
      EMBPS_AUTH_READER);
  assert_int_equal(embps__svc_method_role("/grpc.health.v1.Health/Check/x"), EMBPS_AUTH_READER);
}

static void test_check(void **state) {
  embps_auth_t *a = parse_ok("admin " ADMIN "\nworker " WORKER "\nreader " READER "\n");
  embps_error_t err;
  (void)state;
  /* auth off: everything passes, with or without a header */
  assert_int_equal(check(NULL, "CreateTable", NULL, &err), EMBPS_OK);
  /* open methods pass without a header */
  embps_error_clear(&err);
  assert_int_equal(embps_auth_check(a, embps__svc_method_role("/grpc.health.v1.Health/Check"),
                                    "/grpc.health.v1.Health/Check", NULL, &err),
                   EMBPS_OK);

  assert_int_equal(check(a, "Lookup", NULL, &err), EMBPS_UNAUTHENTICATED);
  assert_string_equal(err.message, "missing authorization metadata: this server requires "
                                   "'authorization: Bearer TOKEN'");
  assert_int_equal(check(a, "Lookup", "Basic " READER, &err), EMBPS_UNAUTHENTICATED);
  assert_string_equal(err.message, "the authorization metadata is not 'Bearer TOKEN': this "
                                   "server accepts bearer tokens only");
  assert_int_equal(check(a, "Lookup", "Bearer", &err), EMBPS_UNAUTHENTICATED);
  assert_int_equal(check(a, "Lookup", "Bearer" READER, &err), EMBPS_UNAUTHENTICATED);
  assert_int_equal(check(a, "Lookup", "Bearer ", &err), EMBPS_UNAUTHENTICATED);
  assert_string_equal(err.message, "the bearer token is not known to this server");
  assert_int_equal(check(a, "Lookup", "Bearer wrong-0123456789abcdef", &err),
                   EMBPS_UNAUTHENTICATED);
  assert_string_equal(err.message, "the bearer token is not known to this server");
  assert_int_equal(check(a, "Lookup", "Bearer " READER " ", &err), EMBPS_UNAUTHENTICATED);

  /* each role reaches its own methods and those below */
  assert_int_equal(check(a, "Lookup", "Bearer " READER, &err), EMBPS_OK);
  assert_int_equal(check(a, "GetStats", "bearer  " READER, &err), EMBPS_OK);
  assert_int_equal(check(a, "PushGradients", "Bearer " READER, &err), EMBPS_PERMISSION_DENIED);
  assert_string_equal(err.message, "role 'reader' may not call PushGradients (needs 'worker')");
  assert_int_equal(check(a, "PushGradients", "Bearer " WORKER, &err), EMBPS_OK);
  assert_int_equal(check(a, "Lookup", "Bearer " WORKER, &err), EMBPS_OK);
  assert_int_equal(check(a, "CreateTable", "Bearer " WORKER, &err), EMBPS_PERMISSION_DENIED);
  assert_string_equal(err.message, "role 'worker' may not call CreateTable (needs 'admin')");
  assert_int_equal(check(a, "Checkpoint", "Bearer " READER, &err), EMBPS_PERMISSION_DENIED);
  assert_string_equal(err.message, "role 'reader' may not call Checkpoint (needs 'admin')");
  assert_int_equal(check(a, "CreateTable", "Bearer " ADMIN, &err), EMBPS_OK);
  assert_int_equal(check(a, "Checkpoint", "Bearer " ADMIN, &err), EMBPS_OK);
  assert_int_equal(check(a, "PushGradients", "Bearer " ADMIN, &err), EMBPS_OK);
  assert_int_equal(check(a, "Lookup", "Bearer " ADMIN, &err), EMBPS_OK);
  embps_auth_free(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_accepts), cmocka_unit_test(test_parse_refuses),
      cmocka_unit_test(test_load),          cmocka_unit_test(test_method_roles),
      cmocka_unit_test(test_check),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
