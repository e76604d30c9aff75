/* host:port parsing and resolution, one set of rules for server, client and CLI.
 *
 * Parsing is strict and offline: the host must look like an IPv4 literal or a DNS name
 * (letters, digits, '-', '_', '.', labels of 1..63 characters) or, in brackets, be an IPv6
 * literal that inet_pton accepts (with an optional "%zone"). Whether a name exists is a
 * question for resolution, which callers make when they use the address: a peer's name may
 * only start resolving once that peer's pod exists. Every refusal quotes the text and says
 * which part is wrong, since users meet these messages on the command line. */
#include "common/hostport.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"

#define LABEL_MAX 63

/* Refuses text with a message "<what> '<text>'<tail>". */
static embps_status_t refuse(embps_error_t *err, const char *what, const char *text, size_t len,
                             const char *tail) {
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s '%.*s'%s", what,
                         (int)(len > 300 ? 300 : len), text, tail);
}

static int name_char(char c) {
  return isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.';
}

/* Checks a DNS name or IPv4 literal; writes the tail of a refusal to why and returns -1 when it
 * is neither. */
static int check_name(const char *host, size_t len, char *why, size_t cap) {
  size_t label = 0;
  for (size_t i = 0; i < len; i++) {
    char c = host[i];
    if (!name_char(c)) {
      if (isprint((unsigned char)c))
        snprintf(why, cap, " has a bad character '%c' in its host", c);
      else
        snprintf(why, cap, " has a bad character (byte 0x%02x) in its host", (unsigned char)c);
      return -1;
    }
    if (c != '.') {
      if (++label > LABEL_MAX) {
        snprintf(why, cap, " has a host with a label longer than %d characters", LABEL_MAX);
        return -1;
      }
      continue;
    }
    if (label == 0) { /* a leading dot or two in a row; one trailing dot is a rooted name */
      snprintf(why, cap, " has an empty label in its host");
      return -1;
    }
    label = 0;
  }
  return 0;
}

/* Checks an IPv6 literal with an optional "%zone". */
static int check_ipv6(const char *host, size_t len, char *why, size_t cap) {
  char addr[INET6_ADDRSTRLEN];
  struct in6_addr a6;
  const char *pct = memchr(host, '%', len);
  size_t alen = pct ? (size_t)(pct - host) : len;
  int ok = alen > 0 && alen < sizeof(addr);
  if (ok) {
    memcpy(addr, host, alen);
    addr[alen] = '\0';
    ok = inet_pton(AF_INET6, addr, &a6) == 1;
  }
  if (ok && pct) {
    size_t zlen = len - alen - 1;
    ok = zlen > 0;
    for (size_t i = 0; ok && i < zlen; i++)
      ok = name_char(pct[1 + i]);
  }
  if (!ok)
    snprintf(why, cap, ": '%.*s' is not an IPv6 address", (int)(len > 64 ? 64 : len), host);
  return ok ? 0 : -1;
}

embps_status_t embps_hostport_parse(embps_hostport_t *out, const char *text, size_t len,
                                    const char *what, unsigned flags, embps_error_t *err) {
  const int listen = (flags & EMBPS_HOSTPORT_LISTEN) != 0;
  const char *host, *colon, *port;
  size_t host_len, port_len;
  unsigned long p = 0;
  int ipv6 = 0;
  char why[160];

  if (!text || len == 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "empty %s (expected host:port)", what);
  if (text[0] == '[') {
    const char *close = memchr(text, ']', len);
    if (!close || close + 1 >= text + len || close[1] != ':')
      return refuse(err, what, text, len, " is not [ipv6]:port");
    host = text + 1;
    host_len = (size_t)(close - host);
    colon = close + 1;
    ipv6 = 1;
  } else {
    colon = NULL;
    for (size_t i = 0; i < len; i++)
      if (text[i] == ':')
        colon = text + i;
    if (!colon)
      return refuse(err, what, text, len, " has no port (expected host:port)");
    host = text;
    host_len = (size_t)(colon - text);
    if (memchr(host, ':', host_len))
      return refuse(err, what, text, len, ": write IPv6 hosts as [addr]:port");
  }
  port = colon + 1;
  port_len = (size_t)(text + len - port);
  for (size_t i = 0; i < port_len && port_len <= 5; i++) {
    if (port[i] < '0' || port[i] > '9') {
      port_len = 0;
      break;
    }
    p = p * 10 + (unsigned long)(port[i] - '0');
  }
  if (port_len == 0 || port_len > 5 || p > 65535 || (p == 0 && !listen))
    return refuse(err, what, text, len,
                  listen ? " has a bad port (expected 0..65535)"
                         : " has a bad port (expected 1..65535)");
  if (host_len == 0 && (ipv6 || !listen))
    return refuse(err, what, text, len, " has an empty host");
  if (host_len > EMBPS_HOSTPORT_HOST_MAX) {
    snprintf(why, sizeof(why), " has a host longer than %d characters", EMBPS_HOSTPORT_HOST_MAX);
    return refuse(err, what, text, len, why);
  }
  if ((ipv6 ? check_ipv6 : check_name)(host, host_len, why, sizeof(why)) != 0)
    return refuse(err, what, text, len, why);
  memcpy(out->host, host, host_len);
  out->host[host_len] = '\0';
  out->port = (uint16_t)p;
  out->ipv6 = ipv6;
  return EMBPS_OK;
}

embps_status_t embps_hostport_parse_list(const char *list, const char *what, size_t max,
                                         unsigned flags, embps_hostport_t **out, size_t *n,
                                         embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps_hostport_t *hps;
  size_t count = 1, k = 0;

  if (!list)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "no %s given", what);
  for (const char *s = list; *s; s++)
    count += *s == ',';
  if (count > max)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%zu %s entries, at most %zu", count, what,
                           max);
  hps = embps_calloc(count, sizeof(*hps));
  if (!hps)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for %zu addresses", count);
  for (const char *s = list;; k++) {
    const char *end = strchr(s, ',');
    const char *e = end ? end : s + strlen(s);
    while (s < e && isspace((unsigned char)*s))
      s++;
    while (e > s && isspace((unsigned char)e[-1]))
      e--;
    if (s == e) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                            "empty %s in the list (expected host:port[,host:port...])", what);
      goto fail;
    }
    if ((ret = embps_hostport_parse(&hps[k], s, (size_t)(e - s), what, flags, err)) != EMBPS_OK)
      goto fail;
    if (!end)
      break;
    s = end + 1;
  }
  *out = hps;
  *n = k + 1;
  return EMBPS_OK;
fail:
  embps_free(hps);
  return ret;
}

embps_status_t embps_hostport_format(const embps_hostport_t *hp, char *out, size_t cap) {
  char buf[EMBPS_HOSTPORT_HOST_MAX + 16];
  int n = snprintf(buf, sizeof(buf), hp->ipv6 ? "[%s]:%u" : "%s:%u", hp->host, hp->port);
  if (n < 0 || (size_t)n >= cap)
    return EMBPS_INVALID_ARGUMENT;
  memcpy(out, buf, (size_t)n + 1);
  return EMBPS_OK;
}

embps_status_t embps_hostport_resolve(const embps_hostport_t *hp, struct sockaddr_storage *ss,
                                      socklen_t *len, embps_error_t *err) {
  struct addrinfo hints, *res = NULL;
  int rc;

  memset(ss, 0, sizeof(*ss));
  if (!hp->ipv6 && (hp->host[0] == '\0' || strcmp(hp->host, "localhost") == 0)) {
    struct sockaddr_in *in = (struct sockaddr_in *)ss;
    in->sin_family = AF_INET;
    in->sin_port = htons(hp->port);
    in->sin_addr.s_addr = htonl(hp->host[0] ? INADDR_LOOPBACK : INADDR_ANY);
    *len = sizeof(*in);
    return EMBPS_OK;
  }
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = hp->ipv6 ? AF_INET6 : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = hp->ipv6 ? AI_NUMERICHOST : 0;
  rc = getaddrinfo(hp->host, NULL, &hints, &res);
  if (rc != 0)
    return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot resolve '%s': %s", hp->host,
                           gai_strerror(rc));
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  if (ss->ss_family == AF_INET6)
    ((struct sockaddr_in6 *)ss)->sin6_port = htons(hp->port);
  else
    ((struct sockaddr_in *)ss)->sin_port = htons(hp->port);
  return EMBPS_OK;
}

embps_status_t embps_hostport_numeric(const struct sockaddr_storage *ss, socklen_t len,
                                      embps_hostport_t *out) {
  char host[sizeof(out->host)];
  int v6 = ss->ss_family == AF_INET6;
  if ((ss->ss_family != AF_INET && !v6) || getnameinfo((const struct sockaddr *)ss, len, host,
                                                       sizeof(host), NULL, 0, NI_NUMERICHOST) != 0)
    return EMBPS_INVALID_ARGUMENT;
  memcpy(out->host, host, sizeof(host));
  out->port = ntohs(v6 ? ((const struct sockaddr_in6 *)ss)->sin6_port
                       : ((const struct sockaddr_in *)ss)->sin_port);
  out->ipv6 = v6;
  return EMBPS_OK;
}

int embps_hostport_is_wildcard(const struct sockaddr_storage *ss) {
  if (ss->ss_family == AF_INET)
    return ((const struct sockaddr_in *)ss)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (ss->ss_family == AF_INET6)
    return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)ss)->sin6_addr);
  return 0;
}
