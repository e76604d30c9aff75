/* Logging. One fprintf per line so that lines from the loop and engine threads do not
 * interleave mid-line. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static embps_log_level_t min_level = EMBPS_LOG_INFO;
static const char *const level_names[] = {"debug", "info", "warn", "error"};

void embps_log_set_level(embps_log_level_t level) { min_level = level; }

int embps_log_parse_level(const char *name) {
  for (int i = 0; i < 4; i++)
    if (strcmp(name, level_names[i]) == 0)
      return i;
  return -1;
}

void embps_log_write(embps_log_level_t level, const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  struct timespec ts;
  struct tm tm;
  va_list ap;
  const char *base = strrchr(file, '/');

  if (level < min_level)
    return;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s:%d %s\n", tm.tm_year + 1900,
          tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
          level_names[level], base ? base + 1 : file, line, msg);
}
