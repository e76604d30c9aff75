/* sequencer_bench: the leader's ordering work alone, on one core, per notice and per batch
 * (issue 34, "the leader's limit").
 *
 * For each group size N it feeds the sequencer (server/group/sequencer.c, pure bookkeeping)
 * batches of lookups with --in-flight of them pending at once: every batch gets one notice from
 * each of the N ranks, the ranks' notices of the in-flight batches interleaved as a loaded group
 * sends them, and after every N notices (a wake-up's worth) the leader takes a round
 * (embps_sequencer_next_round). It also times the control codec's share: parsing a NOTICE frame
 * (embps__parse_notice, once per notice) and encoding a ROUND frame (embps__frame_round, per
 * round of the batches ready). Prints, per N:
 *   arrive   ns per notice in embps_sequencer_arrive
 *   round    ns per batch in embps_sequencer_next_round
 *   parse    ns per notice in embps__parse_notice
 *   encode   ns per batch in embps__frame_round
 *   ordered  batches/s one core could order if this were all the leader did:
 *            1e9 / (N x (arrive + parse) + round + encode)
 * Not a test: it asserts only that every batch was ordered once (--check, the ctest smoke run).
 * The syscalls that carry the frames are not here: tests/bench/round_cost.py measures the whole.
 *
 * With --failed F the sequencer first fails F batches (cancelled), as a group that has seen
 * failures has: the ring of failed batches (up to 4096) is searched on every notice.
 *
 *   sequencer_bench [--ranks N[,N...]] [--batches B] [--in-flight P] [--failed F] [--check] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/group/control.h"
#include "server/group/sequencer.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void desc_of(embps_batch_desc_t *d, uint64_t batch) {
  memset(d, 0, sizeof(*d));
  d->client_id = 0x1234;
  d->batch_id = batch;
  d->digest = batch * 0x9e3779b97f4a7c15ull | 1;
  d->kind = EMBPS_OP_LOOKUP;
  d->tokens_per_batch = 4096;
  snprintf(d->table, sizeof(d->table), "%s", "embeddings");
  d->table_id = 7;
  d->has_deadline = 1;
  d->deadline_left_ms = 30000;
}

static int run(uint32_t n, uint64_t batches, uint64_t in_flight, uint64_t failed, int check) {
  embps_sequencer_t *s = NULL;
  embps_round_entry_t *round = calloc(EMBPS__ROUND_MAX, sizeof(*round));
  embps_table_config_t *configs = calloc(EMBPS__ROUND_MAX, sizeof(*configs));
  embps__buf_t frame = {0}, out = {0};
  embps_batch_desc_t d;
  embps_error_t err;
  double t_arrive = 0, t_round = 0, t_parse = 0, t_encode = 0;
  uint64_t ordered = 0, notices = 0, next = 0, rounds = 0;
  if (!round || !configs || embps_sequencer_new(&s, n, 60000) != EMBPS_OK) {
    fprintf(stderr, "sequencer_bench: out of memory\n");
    return 1;
  }
  desc_of(&d, 1);
  if (embps__frame_notice(&frame, &d, &err) != EMBPS_OK) {
    fprintf(stderr, "sequencer_bench: cannot encode a notice\n");
    return 1;
  }
  /* The ring of failed batches holds `failed` entries, as after that many cancellations. */
  for (uint64_t f = 0; f < failed; f++) {
    desc_of(&d, UINT64_C(1) << 40 | f);
    embps_sequencer_arrive(s, 0, &d, 1000);
    embps_sequencer_withdraw(s, 0, d.client_id, d.batch_id, 0, 1000);
    while (embps_sequencer_next_round(s, 1000, round, EMBPS__ROUND_MAX) > 0) {
    }
  }
  /* Batches [next, next + in_flight) are pending; rank r's notice of each goes in rank order,
   * batch by batch, so every batch completes at its last rank's notice. */
  while (next < batches) {
    uint64_t end = next + in_flight < batches ? next + in_flight : batches;
    for (uint32_t r = 0; r < n; r++) {
      double t0 = now_ns();
      for (uint64_t b = next; b < end; b++) {
        embps_batch_desc_t parsed;
        uint8_t type;
        const uint8_t *payload;
        size_t len, flen;
        (void)embps__frame_next(frame.data, frame.len, &type, &payload, &len, &flen, &err);
        (void)embps__parse_notice(payload, len, &parsed, &err);
      }
      double t1 = now_ns();
      for (uint64_t b = next; b < end; b++) {
        desc_of(&d, b + 1);
        embps_sequencer_arrive(s, r, &d, 1000);
        notices++;
      }
      double t2 = now_ns();
      t_parse += t1 - t0;
      t_arrive += t2 - t1;
    }
    for (;;) {
      double t0 = now_ns();
      size_t k = embps_sequencer_next_round(s, 1000, round, EMBPS__ROUND_MAX);
      double t1 = now_ns();
      t_round += t1 - t0;
      if (k == 0)
        break;
      out.len = 0;
      if (embps__frame_round(&out, round, configs, NULL, k, &err) != EMBPS_OK) {
        fprintf(stderr, "sequencer_bench: cannot encode a round\n");
        return 1;
      }
      t_encode += now_ns() - t1;
      for (size_t i = 0; i < k; i++)
        if (round[i].action != EMBPS_ROUND_RUN) {
          fprintf(stderr, "sequencer_bench: batch %llu failed: %s\n",
                  (unsigned long long)round[i].batch_id, round[i].message);
          return 1;
        }
      ordered += k;
      rounds++;
    }
    next = end;
  }
  if (check && ordered != batches) {
    fprintf(stderr, "sequencer_bench: %llu of %llu batches ordered\n", (unsigned long long)ordered,
            (unsigned long long)batches);
    return 1;
  }
  double arrive = t_arrive / (double)notices, parse = t_parse / (double)notices;
  double per_round = t_round / (double)batches, encode = t_encode / (double)batches;
  printf("%5u %10.1f %10.1f %10.1f %10.1f %14.0f %8.1f\n", n, arrive, per_round, parse, encode,
         1e9 / ((double)n * (arrive + parse) + per_round + encode),
         (double)batches / (double)(rounds ? rounds : 1));
  embps_sequencer_free(s);
  embps__buf_free(&frame);
  embps__buf_free(&out);
  free(round);
  free(configs);
  return 0;
}

int main(int argc, char **argv) {
  const char *ranks = "2,8,16,32,64,256";
  uint64_t batches = 20000, in_flight = 8, failed = 0;
  int check = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--ranks") && i + 1 < argc)
      ranks = argv[++i];
    else if (!strcmp(argv[i], "--batches") && i + 1 < argc)
      batches = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--in-flight") && i + 1 < argc)
      in_flight = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--failed") && i + 1 < argc)
      failed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--check"))
      check = 1;
    else {
      fprintf(
          stderr,
          "usage: sequencer_bench [--ranks N[,N...]] [--batches B] [--in-flight P] [--failed F] "
          "[--check]\n");
      return 2;
    }
  }
  if (in_flight < 1 || in_flight > EMBPS__ROUND_MAX) {
    fprintf(stderr, "sequencer_bench: --in-flight must be 1 to %d\n", EMBPS__ROUND_MAX);
    return 2;
  }
  printf("%5s %10s %10s %10s %10s %14s %8s\n", "N", "arrive ns", "round ns", "parse ns",
         "encode ns", "ordered/s", "b/round");
  for (const char *p = ranks; *p;) {
    char *end;
    unsigned long n = strtoul(p, &end, 10);
    if (end == p || n < 1 || n > 4096) {
      fprintf(stderr, "sequencer_bench: bad --ranks '%s'\n", ranks);
      return 2;
    }
    if (run((uint32_t)n, batches, in_flight, failed, check) != 0)
      return 1;
    p = *end == ',' ? end + 1 : end;
  }
  return 0;
}
