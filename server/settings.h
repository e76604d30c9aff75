/* Server settings: declared once in EMBPS_SERVER_SETTINGS with their flag, environment
 * variable, default and help (NCCL's NCCL_PARAM), and the same table parses the command line,
 * reads the environment and prints --help. */
#ifndef EMBPS_SETTINGS_H
#define EMBPS_SETTINGS_H

#include <stdint.h>
#include <stdio.h>

#include "common/backend.h"
#include "common/status.h"

/* X(field, type, flag, default, help). The environment variable is EMBPS_ followed by the flag
 * upper-cased with '-' turned into '_' (--max-message-bytes: EMBPS_MAX_MESSAGE_BYTES).
 * Types: STR (a string), SIZE (an unsigned count that takes K/M/G/T suffixes, powers of 1024),
 * U64 (a plain unsigned count), ADDR (empty, or a listen address as common/hostport.h parses
 * it: HOST:PORT, [V6]:PORT, port 0 allowed), ADDRS (empty, or a comma-separated list of at most
 * EMBPS_SETTINGS_MAX_PEERS HOST:PORT addresses). Hosts are IP literals or DNS names. */
#define EMBPS_SERVER_SETTINGS(X)                                                                   \
  X(listen, ADDR, "listen", "",                                                                    \
    "address to serve gRPC clients on (HOST:PORT); default: this rank's entry of --peers, "        \
    "else 127.0.0.1:7070")                                                                         \
  X(rank, U64, "rank", "0", "this server's rank in the shard group (0 is the leader)")             \
  X(peers, ADDRS, "peers", "",                                                                     \
    "every rank's client address in rank order (HOST:PORT,HOST:PORT,...); empty: a group of "      \
    "one")                                                                                         \
  X(peer_port_offset, U64, "peer-port-offset", "1000",                                             \
    "server-to-server traffic uses each rank's client port plus this offset")                      \
  X(mesh, STR, "mesh", "", "named mesh axes with sizes (e.g. shard=4); default shard=N")           \
  X(table_axis, STR, "table-axis", "shard",                                                        \
    "mesh axes whose ranks split table columns (the communicator)")                                \
  X(data_axis, STR, "data-axis", "shard", "mesh axes that clients split tokens over")              \
  X(group_secret_file, STR, "group-secret-file", "",                                               \
    "file holding the group secret (16 to 4096 bytes; one trailing newline is dropped): ranks "    \
    "prove they hold it to each other at bootstrap; empty: any process reaching the peer port "    \
    "can join the group")                                                                          \
  X(bootstrap_timeout_ms, U64, "bootstrap-timeout-ms", "120000",                                   \
    "how long a rank waits at startup for the whole group")                                        \
  X(peer_timeout_ms, U64, "peer-timeout-ms", "30000",                                              \
    "bound on one collective; a peer silent this long breaks the group")                           \
  X(batch_deadline_ms, U64, "batch-deadline-ms", "10000",                                          \
    "a batch whose shards do not all reach their ranks within this fails (DEADLINE_EXCEEDED)")     \
  X(max_message_bytes, SIZE, "max-message-bytes", "256M",                                          \
    "largest gRPC message, request or reply: a larger request, or a lookup whose reply (its "      \
    "rows) would be larger, gets RESOURCE_EXHAUSTED before any work; one connection may hold "     \
    "4 times this in replies not yet read by its client (one reply alone always fits)")            \
  X(max_memory_bytes, SIZE, "max-memory-bytes", "0",                                               \
    "most bytes all tables (rows, optimizer state, and with checkpoints on the cpu backend their " \
    "snapshot copies) take on this rank; CreateTable and restore refuse a table beyond it; 0 = "   \
    "80% of physical memory (cpu) or of the GPU's memory (cuda)")                                  \
  X(control_fanout, STR, "control-fanout", "auto",                                                 \
    "followers per control relay: each group's lowest rank carries the others' control frames "    \
    "to and from the leader, so the leader keeps about N/K control connections instead of N-1; "   \
    "0 or 1: every rank talks to the leader directly; auto: ceil(sqrt(N)) from 16 ranks, else "    \
    "0; every rank must have the same")                                                            \
  X(max_connections, U64, "max-connections", "4096", "most client connections at once")            \
  X(stall_timeout_ms, U64, "stall-timeout-ms", "10000",                                            \
    "close a connection that stops sending in the middle of a request, or reads none of its "      \
    "replies, for this long")                                                                      \
  X(idle_timeout_ms, U64, "idle-timeout-ms", "300000",                                             \
    "close a connection with no calls that stays silent this long (with GOAWAY); any frame, an "   \
    "HTTP/2 PING (gRPC keepalive) too, keeps it open; 0 = never")                                  \
  X(max_connections_per_source, U64, "max-connections-per-source", "256",                          \
    "most client connections at once from one IP address; 0 = no limit but --max-connections")     \
  X(drain_timeout_ms, U64, "drain-timeout-ms", "20000",                                            \
    "on SIGTERM, how long to finish the calls already taken (new ones are refused) before "        \
    "exiting; a second signal exits at once")                                                      \
  X(auth_tokens_file, STR, "auth-tokens-file", "",                                                 \
    "bearer tokens clients must send, one 'ROLE TOKEN' per line (ROLE admin, worker or "           \
    "reader), reread on SIGHUP; empty: no client authentication")                                  \
  X(device, STR, "device", "auto",                                                                 \
    "where tables live and compute runs: cpu (host memory, TCP between ranks), cuda (GPU "         \
    "memory, NCCL between ranks; the device is the rank modulo the devices visible), cuda:N "      \
    "(device N), or auto (cuda when a GPU is visible, else cpu)")                                  \
  X(engine_threads, U64, "engine-threads", "0",                                                    \
    "cpu: threads that apply a push (segment sum, row statistics, optimizer update), the "         \
    "engine's own included; every row stays on one thread, so the tables get the same bits with "  \
    "any number; 0 = the CPUs this process may use (affinity, cgroup CPU limit), at most 8")       \
  X(retry_window, U64, "retry-window", "1024",                                                     \
    "pushes remembered per client for exactly-once retries (a retried push still remembered is "   \
    "answered with its first result, not applied again); min 1, max 1048576")                      \
  X(checkpoint_dir, STR, "checkpoint-dir", "",                                                     \
    "directory for checkpoints, one filesystem shared by every rank; empty: tables live in "       \
    "memory only")                                                                                 \
  X(checkpoint_keep, U64, "checkpoint-keep", "3",                                                  \
    "complete checkpoints kept (of every table, and of each single table); older ones are "        \
    "removed once a newer one is complete; 0 keeps all")                                           \
  X(checkpoint_interval_s, U64, "checkpoint-interval-s", "0",                                      \
    "take a checkpoint of every table this often; 0: only when asked (Checkpoint, SIGTERM)")       \
  X(checkpoint_full_every, U64, "checkpoint-full-every", "1",                                      \
    "every this many checkpoints a full one; those between write only the rows changed since "     \
    "the previous checkpoint, chained to the full one; 1: every checkpoint is full (0 is "         \
    "refused)")                                                                                    \
  X(restore, STR, "restore", "auto",                                                               \
    "at startup: auto (the latest complete checkpoint of every table in --checkpoint-dir, if "     \
    "any), none, or the path of a checkpoint")                                                     \
  X(tls_cert, STR, "tls-cert", "",                                                                 \
    "serve gRPC over TLS with this PEM certificate chain (needs --tls-key); empty: cleartext "     \
    "HTTP/2, for loopback development")                                                            \
  X(tls_key, STR, "tls-key", "", "the PEM private key of --tls-cert")                              \
  X(tls_client_ca, STR, "tls-client-ca", "",                                                       \
    "mutual TLS: clients must present a certificate signed by a CA in this PEM file; empty: "      \
    "any client may connect")                                                                      \
  X(peer_tls_cert, STR, "peer-tls-cert", "",                                                       \
    "TLS between ranks: this rank's PEM certificate chain, naming the host of its --peers "        \
    "address (needs --peer-tls-key and --peer-tls-ca; every rank the same way); empty: "           \
    "cleartext between ranks. The cuda backend's NCCL traffic is not encrypted by embps: "         \
    "isolate it on the pod network")                                                               \
  X(peer_tls_key, STR, "peer-tls-key", "", "the PEM private key of --peer-tls-cert")               \
  X(peer_tls_ca, STR, "peer-tls-ca", "",                                                           \
    "TLS between ranks: the PEM CA certificates every rank's --peer-tls-cert must chain to")       \
  X(metrics_listen, ADDR, "metrics-listen", "",                                                    \
    "serve Prometheus metrics over HTTP at GET /metrics on this address (HOST:PORT); empty: "      \
    "off")                                                                                         \
  X(log_level, STR, "log-level", "info", "debug, info, warn or error")

/** Most entries --peers takes (the largest group). */
#define EMBPS_SETTINGS_MAX_PEERS 1024

typedef struct embps_settings {
#define EMBPS_SETTING_FIELD_STR(name) char name[1024];
#define EMBPS_SETTING_FIELD_ADDR(name) char name[1024];
#define EMBPS_SETTING_FIELD_ADDRS(name) char name[1024];
#define EMBPS_SETTING_FIELD_SIZE(name) uint64_t name;
#define EMBPS_SETTING_FIELD_U64(name) uint64_t name;
#define EMBPS_SETTING_FIELD(name, type, flag, def, help) EMBPS_SETTING_FIELD_##type(name)
  EMBPS_SERVER_SETTINGS(EMBPS_SETTING_FIELD)
#undef EMBPS_SETTING_FIELD
} embps_settings_t;

/**
 * Fills s from defaults, then the environment, then argv (flags win). Accepts "--flag VALUE"
 * and
 * "--flag=VALUE". Sets *want_help when --help or -h is given. Returns EMBPS_OK or
 * EMBPS_INVALID_ARGUMENT with err naming the flag or variable and the bad value.
 */
embps_status_t embps_settings_load(embps_settings_t *s, int argc, char **argv, int *want_help,
                                   embps_error_t *err);

/** Prints usage: every flag with its variable, default and help. */
void embps_settings_usage(FILE *out, const char *prog);

/**
 * Reads --device: "auto" (cuda when num_devices > 0, on device rank modulo num_devices; else cpu),
 * "cpu", "cuda" (device rank modulo num_devices) or "cuda:N" (device N), the backend named as
 * common/backend.h names it. Sets *backend and *device (0 for cpu). Returns EMBPS_OK;
 * EMBPS_INVALID_ARGUMENT for a value of none of those forms; EMBPS_FAILED_PRECONDITION for cuda
 * with no device visible, or a cuda:N beyond those visible; err names the flag and the value.
 */
embps_status_t embps_settings_device(const char *text, uint64_t rank, int num_devices,
                                     embps_backend_t *backend, int *device, embps_error_t *err);

/** Parses a SIZE value ("256M", "1G", "4096"); returns EMBPS_OK or EMBPS_INVALID_ARGUMENT. */
embps_status_t embps_settings_parse_size(const char *text, uint64_t *out);

#endif
