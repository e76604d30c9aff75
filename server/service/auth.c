/* Bearer tokens with roles.
 *
 * The tokens file is small and read at startup (and again on SIGHUP, by main.c), so parsing
 * favours clear messages over speed: every refusal names the file and the line, and never the
 * token itself, since server logs are read by more people than the tokens file.
 *
 * A check runs on every call, so the set keeps its tokens in one array of fixed-width slots
 * (the longest token's length, zero-padded), and a presented token is compared with every slot
 * over the whole width, OR-ing byte differences without an early exit. The time a check takes
 * then depends only on the number of tokens and the longest one's length, not on how much of a
 * guess matches, nor on which token matched. With a handful of tokens that is well under a
 * microsecond, against the tens of microseconds of the smallest call.
 *
 * Which role a method needs is not auth's business: it is a column of the service's method
 * table (service.c), and the service passes it to every check. */
#include "server/service/auth.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/alloc.h"

#define FILE_MAX (1u << 20)

struct embps_auth {
  size_t n;        /* tokens */
  size_t width;    /* bytes per slot: the longest token's length */
  uint8_t *slots;  /* n slots of width bytes, each a token zero-padded */
  size_t *lens;    /* each token's length */
  uint8_t *roles;  /* each token's embps_auth_role_t */
  size_t count[4]; /* tokens per role */
};

const char *embps_auth_role_name(embps_auth_role_t role) {
  switch (role) {
  case EMBPS_AUTH_OPEN:
    return "open";
  case EMBPS_AUTH_READER:
    return "reader";
  case EMBPS_AUTH_WORKER:
    return "worker";
  case EMBPS_AUTH_ADMIN:
    return "admin";
  }
  return "unknown";
}

/* ---- the tokens file ---- */

/* RFC 6750's b64token: what an authorization header carries unchanged. */
static int token_char(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_' || c == '~' || c == '+' || c == '/';
}

/* The length of the b64token at p[0..len), or 0 with *bad the offset of a character that does
 * not belong (or len when it is empty). */
static size_t token_span(const char *p, size_t len, size_t *bad) {
  size_t i = 0;
  while (i < len && token_char((unsigned char)p[i]))
    i++;
  if (i == 0) {
    *bad = 0;
    return 0;
  }
  while (i < len && p[i] == '=')
    i++;
  *bad = i;
  return i;
}

static int is_space(char c) { return c == ' ' || c == '\t'; }

typedef struct entry {
  const char *token;
  size_t len;
  embps_auth_role_t role;
  size_t line;
} entry_t;

/* Parses one line (without its '\n'); *e is set when it holds a token. Returns EMBPS_OK or
 * INVALID_ARGUMENT naming origin:line. */
static embps_status_t parse_line(const char *p, size_t len, const char *origin, size_t line,
                                 entry_t *e, int *has, embps_error_t *err) {
  size_t i = 0, rs, re, ts, tl, bad;
  *has = 0;
  if (len > 0 && p[len - 1] == '\r')
    len--;
  while (i < len && is_space(p[i]))
    i++;
  if (i == len || p[i] == '#')
    return EMBPS_OK;
  rs = i;
  while (i < len && !is_space(p[i]))
    i++;
  re = i;
  if (re - rs == 5 && memcmp(p + rs, "admin", 5) == 0)
    e->role = EMBPS_AUTH_ADMIN;
  else if (re - rs == 6 && memcmp(p + rs, "worker", 6) == 0)
    e->role = EMBPS_AUTH_WORKER;
  else if (re - rs == 6 && memcmp(p + rs, "reader", 6) == 0)
    e->role = EMBPS_AUTH_READER;
  else if (re - rs < EMBPS_AUTH_TOKEN_MIN) /* a longer word may be a token: never echo it */
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: unknown role '%.*s': each line is 'ROLE TOKEN' with "
                           "ROLE admin, worker or reader",
                           origin, line, (int)(re - rs), p + rs);
  else
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: the first word is not a role: each line is 'ROLE "
                           "TOKEN' with ROLE admin, worker or reader",
                           origin, line);
  while (i < len && is_space(p[i]))
    i++;
  if (i == len)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: role %s without a token: each line is 'ROLE TOKEN'",
                           origin, line, embps_auth_role_name(e->role));
  ts = i;
  tl = token_span(p + ts, len - ts, &bad);
  if (tl == 0 || (ts + bad < len && !is_space(p[ts + bad])))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: the token has a character outside A-Z a-z 0-9 - . _ "
                           "~ + / (then '=' padding) at column %zu",
                           origin, line, ts + bad + 1);
  if (tl < EMBPS_AUTH_TOKEN_MIN || tl > EMBPS_AUTH_TOKEN_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: the token is %zu characters; tokens need %d to %d "
                           "(e.g. `openssl rand -hex 32`)",
                           origin, line, tl, EMBPS_AUTH_TOKEN_MIN, EMBPS_AUTH_TOKEN_MAX);
  i = ts + tl;
  while (i < len && is_space(p[i]))
    i++;
  if (i < len && p[i] != '#')
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%.300s line %zu: text after the token: each line is 'ROLE TOKEN', "
                           "optionally followed by '# comment'",
                           origin, line);
  e->token = p + ts;
  e->len = tl;
  e->line = line;
  *has = 1;
  return EMBPS_OK;
}

embps_status_t embps_auth_parse(embps_auth_t **out, const char *text, size_t len,
                                const char *origin, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  entry_t *entries = NULL;
  embps_auth_t *a = NULL;
  size_t n = 0, line = 0, width = 0;
  const char *p = text, *end = text + len;

  entries = embps_calloc(EMBPS_AUTH_MAX_TOKENS, sizeof(*entries));
  if (!entries)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %.300s", origin);
  while (p < end) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    size_t ll = nl ? (size_t)(nl - p) : (size_t)(end - p);
    entry_t e;
    int has;
    line++;
    if (memchr(p, '\0', ll)) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                            "%.300s line %zu: a NUL byte: %.300s is "
                            "not a text file",
                            origin, line, origin);
      goto fail;
    }
    if ((ret = parse_line(p, ll, origin, line, &e, &has, err)) != EMBPS_OK)
      goto fail;
    p += ll + (nl != NULL);
    if (!has)
      continue;
    for (size_t k = 0; k < n; k++)
      if (entries[k].len == e.len && memcmp(entries[k].token, e.token, e.len) == 0) {
        ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                              "%.300s line %zu: the same token as line %zu: give each token "
                              "one role",
                              origin, line, entries[k].line);
        goto fail;
      }
    if (n == EMBPS_AUTH_MAX_TOKENS) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%.300s holds more than %d tokens", origin,
                            EMBPS_AUTH_MAX_TOKENS);
      goto fail;
    }
    entries[n++] = e;
    if (e.len > width)
      width = e.len;
  }
  if (n == 0) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                          "%.300s holds no tokens: write one 'ROLE TOKEN' per line (ROLE admin, "
                          "worker or reader)",
                          origin);
    goto fail;
  }
  a = embps_calloc(1, sizeof(*a));
  if (!a || !(a->slots = embps_calloc(n, width)) || !(a->lens = embps_calloc(n, sizeof(size_t))) ||
      !(a->roles = embps_calloc(n, 1))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %.300s", origin);
    goto fail;
  }
  a->n = n;
  a->width = width;
  for (size_t k = 0; k < n; k++) {
    memcpy(a->slots + k * width, entries[k].token, entries[k].len);
    a->lens[k] = entries[k].len;
    a->roles[k] = (uint8_t)entries[k].role;
    a->count[entries[k].role]++;
  }
  *out = a;
exit:
  embps_free(entries);
  return ret;
fail:
  embps_auth_free(a);
  goto exit;
}

embps_status_t embps_auth_load(embps_auth_t **out, const char *path, embps_error_t *err) {
  embps_status_t ret;
  char *buf = NULL;
  size_t len;
  FILE *f = fopen(path, "rb");
  if (!f)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "cannot read %.300s: %s", path,
                           strerror(errno));
  buf = embps_malloc(FILE_MAX + 1);
  if (!buf) {
    fclose(f);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %.300s", path);
  }
  len = fread(buf, 1, FILE_MAX + 1, f);
  if (ferror(f))
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "cannot read %.300s: %s", path,
                          strerror(errno));
  else if (len > FILE_MAX)
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%.300s is larger than %u bytes", path,
                          FILE_MAX);
  else
    ret = embps_auth_parse(out, buf, len, path, err);
  fclose(f);
  explicit_bzero(buf, len < FILE_MAX + 1 ? len : FILE_MAX + 1);
  embps_free(buf);
  return ret;
}

void embps_auth_free(embps_auth_t *auth) {
  if (!auth)
    return;
  if (auth->slots)
    explicit_bzero(auth->slots, auth->n * auth->width);
  embps_free(auth->slots);
  embps_free(auth->lens);
  embps_free(auth->roles);
  embps_free(auth);
}

size_t embps_auth_count(const embps_auth_t *auth, embps_auth_role_t role) {
  return auth && role >= EMBPS_AUTH_READER && role <= EMBPS_AUTH_ADMIN ? auth->count[role] : 0;
}

/* ---- checking a call ---- */

/* The role of the token t[0..len), 0 (EMBPS_AUTH_OPEN) when it is not known. Every slot is
 * compared over its whole width, whatever matched, so the time tells nothing of the tokens. */
static unsigned find_role(const embps_auth_t *a, const uint8_t *t, size_t len) {
  unsigned found = 0;
  if (len > a->width)
    return 0; /* longer than every token: only its length, the caller's own, decides */
  for (size_t k = 0; k < a->n; k++) {
    const uint8_t *slot = a->slots + k * a->width;
    unsigned diff = a->lens[k] != len;
    for (size_t i = 0; i < a->width; i++)
      diff |= (unsigned)(slot[i] ^ (i < len ? t[i] : 0));
    found |= a->roles[k] & (0u - (unsigned)(diff == 0));
  }
  return found;
}

embps_status_t embps_auth_check(const embps_auth_t *auth, embps_auth_role_t need, const char *path,
                                const char *authorization, embps_error_t *err) {
  const char *tok, *method;
  unsigned role;

  if (!auth || need == EMBPS_AUTH_OPEN)
    return EMBPS_OK;
  if (!authorization)
    return embps_error_set(err, EMBPS_UNAUTHENTICATED,
                           "missing authorization metadata: this server requires "
                           "'authorization: Bearer TOKEN'");
  if (strncasecmp(authorization, "Bearer", 6) != 0 || !is_space(authorization[6]))
    return embps_error_set(err, EMBPS_UNAUTHENTICATED,
                           "the authorization metadata is not 'Bearer TOKEN': this server "
                           "accepts bearer tokens only");
  tok = authorization + 7;
  while (is_space(*tok))
    tok++;
  role = find_role(auth, (const uint8_t *)tok, strlen(tok));
  if (role == EMBPS_AUTH_OPEN)
    return embps_error_set(err, EMBPS_UNAUTHENTICATED,
                           "the bearer token is not known to this server");
  if (role < (unsigned)need) {
    method = strrchr(path, '/');
    return embps_error_set(err, EMBPS_PERMISSION_DENIED,
                           "role '%s' may not call %.200s (needs '%s')",
                           embps_auth_role_name((embps_auth_role_t)role),
                           method ? method + 1 : path, embps_auth_role_name(need));
  }
  return EMBPS_OK;
}
