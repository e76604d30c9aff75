/* Server settings: declared once in EMBPS_SERVER_SETTINGS with their flag, environment
 * variable, default and help (NCCL's NCCL_PARAM), and the same table parses the command line,
 * reads the environment and prints --help. */
#ifndef EMBPS_SETTINGS_H
#define EMBPS_SETTINGS_H

#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

/* X(field, type, flag, default, help). The environment variable is EMBPS_ followed by the flag
 * upper-cased with '-' turned into '_' (--max-message-bytes: EMBPS_MAX_MESSAGE_BYTES).
 * Types: STR (a string), SIZE (an unsigned count that takes K/M/G/T suffixes, powers of 1024),
 * U64 (a plain unsigned count). */
#define EMBPS_SERVER_SETTINGS(X)                                                              \
  X(listen, STR, "listen", "127.0.0.1:7070", "address to serve gRPC clients on (HOST:PORT)")   \
  X(max_message_bytes, SIZE, "max-message-bytes", "256M",                                     \
    "largest gRPC request message accepted; larger ones get RESOURCE_EXHAUSTED")              \
  X(max_table_bytes, SIZE, "max-table-bytes", "0",                                            \
    "largest table (rows, optimizer state) CreateTable accepts; 0 = 3/4 of physical memory")   \
  X(max_tables, U64, "max-tables", "1024", "most tables a server holds")                      \
  X(max_connections, U64, "max-connections", "4096", "most client connections at once")       \
  X(stall_timeout_ms, U64, "stall-timeout-ms", "10000",                                       \
    "close a connection that stops sending in the middle of a request for this long")         \
  X(idle_timeout_ms, U64, "idle-timeout-ms", "0",                                             \
    "close a connection with no calls that stays silent this long; 0 = never")                \
  X(backend, STR, "backend", "auto", "compute backend: auto or cpu")                          \
  X(log_level, STR, "log-level", "info", "debug, info, warn or error")

typedef struct embps_settings {
#define EMBPS_SETTING_FIELD_STR(name) char name[256];
#define EMBPS_SETTING_FIELD_SIZE(name) uint64_t name;
#define EMBPS_SETTING_FIELD_U64(name) uint64_t name;
#define EMBPS_SETTING_FIELD(name, type, flag, def, help) EMBPS_SETTING_FIELD_##type(name)
  EMBPS_SERVER_SETTINGS(EMBPS_SETTING_FIELD)
#undef EMBPS_SETTING_FIELD
} embps_settings_t;

/**
 * Fills s from defaults, then the environment, then argv (flags win). Accepts "--flag VALUE" and
 * "--flag=VALUE". Sets *want_help when --help or -h is given. Returns EMBPS_OK or
 * EMBPS_INVALID_ARGUMENT with err naming the flag or variable and the bad value.
 */
embps_status_t embps_settings_load(embps_settings_t *s, int argc, char **argv, int *want_help,
                                   embps_error_t *err);

/** Prints usage: every flag with its variable, default and help. */
void embps_settings_usage(FILE *out, const char *prog);

/** Parses a SIZE value ("256M", "1G", "4096"); returns EMBPS_OK or EMBPS_INVALID_ARGUMENT. */
embps_status_t embps_settings_parse_size(const char *text, uint64_t *out);

#endif
