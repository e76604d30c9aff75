/* "host:port" addresses, parsed one way for the whole project: the server's --listen and
 * --peers, the group's bootstrap, the client library's server list and the CLI. A host is an
 * IPv4 literal, an IPv6 literal in brackets ("[::1]:7070", a "%zone" allowed) or a DNS name;
 * names are resolved with getaddrinfo, when they are used rather than when they are parsed
 * (names that appear late, as in Kubernetes, still work). */
#ifndef EMBPS_HOSTPORT_H
#define EMBPS_HOSTPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "common/status.h"

/** Longest host accepted, in characters (a DNS name's limit). */
#define EMBPS_HOSTPORT_HOST_MAX 253

/** Flags of embps_hostport_parse. */
enum {
  /** A listen address: also accepts port 0 (the kernel picks one) and an empty host
   * (":7070", every IPv4 interface). */
  EMBPS_HOSTPORT_LISTEN = 1,
};

/** One parsed address. */
typedef struct embps_hostport {
  char host[EMBPS_HOSTPORT_HOST_MAX + 1]; /* without brackets; "" only with EMBPS_HOSTPORT_LISTEN */
  uint16_t port;
  int ipv6; /* an IPv6 literal, written in brackets */
} embps_hostport_t;

/**
 * Parses the len bytes at text as "host:port" with a port in 1..65535 (0..65535 with
 * EMBPS_HOSTPORT_LISTEN). what names the address in messages ("server address", "--listen").
 * Returns EMBPS_OK with *out filled, or EMBPS_INVALID_ARGUMENT with a message that quotes the
 * text and says what is wrong (no port, a bad port, an empty host, a bad character in the
 * host, an IPv6 address without brackets, ...); *out is then untouched.
 */
embps_status_t embps_hostport_parse(embps_hostport_t *out, const char *text, size_t len,
                                    const char *what, unsigned flags, embps_error_t *err);

/**
 * Parses a comma-separated list of at most max addresses (white space around entries is
 * ignored). On EMBPS_OK *out is an array of *n addresses, freed with embps_free. Returns
 * EMBPS_INVALID_ARGUMENT (an empty list or entry, more than max entries, or an entry that does
 * not parse: the message names it) or EMBPS_RESOURCE_EXHAUSTED; *out and *n are then untouched.
 */
embps_status_t embps_hostport_parse_list(const char *list, const char *what, size_t max,
                                         unsigned flags, embps_hostport_t **out, size_t *n,
                                         embps_error_t *err);

/**
 * Writes the address as "host:port" ("[v6]:port") to out (cap bytes, NUL-terminated). Returns
 * EMBPS_OK, or EMBPS_INVALID_ARGUMENT when it does not fit (out is then untouched).
 */
embps_status_t embps_hostport_format(const embps_hostport_t *hp, char *out, size_t cap);

/**
 * Resolves the address to one socket address with its port: literals directly, "localhost" as
 * 127.0.0.1 (as every embps listener has always taken it), other names with getaddrinfo (the
 * first answer). An empty host gives 0.0.0.0. Returns EMBPS_OK, or EMBPS_UNAVAILABLE with
 * getaddrinfo's reason when the name does not resolve (it may later).
 */
embps_status_t embps_hostport_resolve(const embps_hostport_t *hp, struct sockaddr_storage *ss,
                                      socklen_t *len, embps_error_t *err);

/** The numeric form of a resolved address (ss, len bytes), into *out: an IPv4 or IPv6 literal
 * (with its %zone where it has one) and the port. Returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT
 * for an address that is neither IPv4 nor IPv6. */
embps_status_t embps_hostport_numeric(const struct sockaddr_storage *ss, socklen_t len,
                                      embps_hostport_t *out);

/** 1 when ss is the wildcard address of its family (0.0.0.0 or ::), else 0. */
int embps_hostport_is_wildcard(const struct sockaddr_storage *ss);

#endif
