/* `embps stats` and `embps health`: every rank asked about itself.
 *
 * Both connect with the group size taken from --servers instead of learning it from rank 0, so
 * they work on a group that is not ready yet. stats prints each rank's counters as text or
 * JSON, or its Prometheus text: the ranks' texts are merged into one valid exposition, each
 * family's HELP and TYPE once and then every rank's samples of it with a rank label, because a
 * family's samples must be contiguous and a family repeated per rank would be rejected by a
 * scraper. health asks each rank's grpc.health.v1 service. */
#include <stdio.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "embps/embps.h"

embps_cli_flag_t embps_cli_stats_flags[] = {
    {"--json", NULL, "print a JSON array, one object per rank", NULL},
    {"--prometheus", NULL,
     "print the ranks' metrics in the Prometheus text format (what --metrics-listen serves at "
     "/metrics); with several ranks, every sample gets a rank label",
     NULL},
    {NULL, NULL, NULL, NULL}};

/* The end of the line at p (the '\n' or the NUL). */
static const char *line_end(const char *p) {
  const char *e = strchr(p, '\n');
  return e ? e : p + strlen(p);
}

/* The family a "# HELP name ..." line names, into name (cap bytes). */
static void help_name(const char *line, char *name, size_t cap) {
  size_t n = strcspn(line + 7, " \n");
  snprintf(name, cap, "%.*s", (int)(n < cap ? n : cap - 1), line + 7);
}

/* Prints rank r's samples of family `fam` (from its text) with a rank label added. Families
 * are the blocks that start at "# HELP". */
static void print_family_samples(FILE *f, const char *text, const char *fam, size_t r, int label) {
  char name[256];
  int in = 0;
  for (const char *p = text; *p;) {
    const char *e = line_end(p);
    if (strncmp(p, "# HELP ", 7) == 0) {
      help_name(p, name, sizeof(name));
      in = strcmp(name, fam) == 0;
    } else if (in && p[0] != '#' && e > p) {
      size_t nl = strcspn(p, "{ ");
      if (!label)
        fprintf(f, "%.*s\n", (int)(e - p), p);
      else if (p[nl] == '{')
        fprintf(f, "%.*s{rank=\"%zu\",%.*s\n", (int)nl, p, r, (int)(e - p - nl - 1), p + nl + 1);
      else
        fprintf(f, "%.*s{rank=\"%zu\"}%.*s\n", (int)nl, p, r, (int)(e - p - nl), p + nl);
    }
    p = *e ? e + 1 : e;
  }
}

/* Prints every family once (HELP, TYPE), with the samples of every rank under it, so the merged
 * text stays valid exposition (a family's samples must be contiguous). */
void embps_cli_print_prometheus(FILE *f, char **texts, size_t n) {
  char name[256];
  for (size_t r = 0; r < n; r++)
    for (const char *p = texts[r]; *p;) {
      const char *e = line_end(p);
      if (strncmp(p, "# HELP ", 7) == 0) {
        int seen = 0;
        help_name(p, name, sizeof(name));
        for (size_t q = 0; q < r && !seen; q++) { /* printed with an earlier rank's */
          char needle[300];
          snprintf(needle, sizeof(needle), "# HELP %s ", name);
          seen = strstr(texts[q], needle) != NULL;
        }
        if (!seen) {
          const char *te = *e ? line_end(e + 1) : e;
          fprintf(f, "%.*s\n", (int)(te - p), p); /* HELP and TYPE */
          for (size_t q = r; q < n; q++)
            print_family_samples(f, texts[q], name, q, n > 1);
        }
      }
      p = *e ? e + 1 : e;
    }
}

void embps_cli_print_table_stats(FILE *out, const embps_table_stats_t *t, int json) {
  unsigned long long cap = t->capacity, keys = t->keys;
  if (json) {
    fprintf(out, "{\"name\":");
    embps_cli_json_string(out, t->name);
    fprintf(out,
            ",\"kind\":\"%s\",\"rows\":%llu,\"emb_width\":%u,\"lookups\":%llu,\"pushes\":%llu,"
            "\"rows_looked_up\":%llu,\"rows_pushed\":%llu,\"steps_applied\":%llu,"
            "\"steps_skipped\":%llu,\"bytes\":%llu,\"capacity\":%llu,\"keys\":%llu,"
            "\"keys_admitted\":%llu,\"keys_evicted\":%llu,\"keys_expired\":%llu,"
            "\"keys_refused\":%llu,\"gradients_dropped\":%llu}",
            cap ? "hash" : "dense", (unsigned long long)t->rows, t->emb_width,
            (unsigned long long)t->lookups, (unsigned long long)t->pushes,
            (unsigned long long)t->rows_looked_up, (unsigned long long)t->rows_pushed,
            (unsigned long long)t->steps_applied, (unsigned long long)t->steps_skipped,
            (unsigned long long)t->bytes, cap, keys, (unsigned long long)t->keys_admitted,
            (unsigned long long)t->keys_evicted, (unsigned long long)t->keys_expired,
            (unsigned long long)t->keys_refused, (unsigned long long)t->gradients_dropped);
    return;
  }
  fprintf(out, "  table %s: ", t->name);
  if (cap)
    fprintf(out, "capacity %llu, keys %llu, load %.1f%%, ", cap, keys,
            100.0 * (double)keys / (double)cap);
  else
    fprintf(out, "rows %llu, ", (unsigned long long)t->rows);
  fprintf(out,
          "emb_width %u, lookups %llu, pushes %llu, rows looked up %llu, rows pushed %llu, "
          "steps applied %llu, steps skipped %llu, bytes %llu",
          t->emb_width, (unsigned long long)t->lookups, (unsigned long long)t->pushes,
          (unsigned long long)t->rows_looked_up, (unsigned long long)t->rows_pushed,
          (unsigned long long)t->steps_applied, (unsigned long long)t->steps_skipped,
          (unsigned long long)t->bytes);
  if (cap)
    fprintf(out,
            ", keys admitted %llu, evicted %llu, expired %llu, refused %llu, gradients dropped "
            "%llu",
            (unsigned long long)t->keys_admitted, (unsigned long long)t->keys_evicted,
            (unsigned long long)t->keys_expired, (unsigned long long)t->keys_refused,
            (unsigned long long)t->gradients_dropped);
  fprintf(out, "\n");
}

int embps_cli_cmd_stats(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  embps_rank_stats_t *s;
  size_t n;
  embps_client_t *c = embps_cli_connect(cmd, 0);
  embps_status_t st;
  int json = embps_cli_flag(f, "--json") != NULL;
  (void)pos;
  if (!c)
    return 1;
  if (embps_cli_flag(f, "--prometheus")) {
    char **texts;
    if ((st = embps_stats_prometheus(c, &texts, &n)) != EMBPS_OK)
      return embps_cli_call_failed(cmd, c, st);
    embps_cli_print_prometheus(stdout, texts, n);
    embps_stats_prometheus_free(texts, n);
    return 0;
  }
  st = embps_stats(c, &s, &n);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  if (json)
    printf("[");
  for (size_t i = 0; i < n; i++) {
    const embps_rank_stats_t *r = &s[i];
    if (json) {
      printf("%s{\"rank\":%u,\"group_size\":%u,\"address\":", i ? "," : "", r->rank, r->group_size);
      embps_cli_json_string(stdout, r->address);
      printf(",\"backend\":");
      embps_cli_json_string(stdout, r->backend);
      printf(",\"version\":");
      embps_cli_json_string(stdout, r->version);
      printf(",\"mesh\":");
      embps_cli_json_string(stdout, r->mesh);
      printf(",\"ready\":%s,\"uptime_s\":%.3f,\"requests\":%llu,\"errors\":%llu,"
             "\"bytes_in\":%llu,\"bytes_out\":%llu,\"connections\":%u,"
             "\"peer_bytes_sent\":%llu,\"peer_bytes_received\":%llu,"
             "\"collective_calls\":%llu,\"tables\":[",
             r->ready ? "true" : "false", r->uptime_s, (unsigned long long)r->requests,
             (unsigned long long)r->errors, (unsigned long long)r->bytes_in,
             (unsigned long long)r->bytes_out, r->connections,
             (unsigned long long)r->peer_bytes_sent, (unsigned long long)r->peer_bytes_received,
             (unsigned long long)r->collective_calls);
      for (size_t j = 0; j < r->num_tables; j++) {
        printf("%s", j ? "," : "");
        embps_cli_print_table_stats(stdout, &r->tables[j], 1);
      }
      printf("]}");
    } else {
      printf("rank %u/%u (%s): %s, mesh %s, backend %s, version %s, uptime %.1f s, requests "
             "%llu, errors %llu, bytes in %llu, bytes out %llu, connections %u, peer bytes "
             "sent %llu, received %llu\n",
             r->rank, r->group_size, r->address, r->ready ? "ready" : "NOT READY", r->mesh,
             r->backend, r->version, r->uptime_s, (unsigned long long)r->requests,
             (unsigned long long)r->errors, (unsigned long long)r->bytes_in,
             (unsigned long long)r->bytes_out, r->connections,
             (unsigned long long)r->peer_bytes_sent, (unsigned long long)r->peer_bytes_received);
      for (size_t j = 0; j < r->num_tables; j++)
        embps_cli_print_table_stats(stdout, &r->tables[j], 0);
    }
  }
  if (json)
    printf("]\n");
  embps_stats_free(s, n);
  return 0;
}

embps_cli_flag_t embps_cli_health_flags[] = {
    {"--service", "NAME", "service to ask about (default \"\": the whole server)", NULL},
    {NULL, NULL, NULL, NULL}};

int embps_cli_cmd_health(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  embps_client_t *c = embps_cli_connect(cmd, 0);
  int serving = 0;
  embps_status_t st;
  (void)pos;
  if (!c)
    return 1;
  st = embps_health(c, embps_cli_flag(f, "--service") ? embps_cli_flag(f, "--service") : "",
                    &serving);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  if (!serving) {
    printf("NOT_SERVING\n");
    fprintf(stderr, "embps: %s: %s\n", cmd, embps_client_last_error(c));
    return 1;
  }
  printf("SERVING\n");
  return 0;
}
