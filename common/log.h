/* Logging to stderr with a level, a timestamp and the source location. */
#ifndef EMBPS_LOG_H
#define EMBPS_LOG_H

typedef enum embps_log_level {
  EMBPS_LOG_DEBUG = 0,
  EMBPS_LOG_INFO = 1,
  EMBPS_LOG_WARN = 2,
  EMBPS_LOG_ERROR = 3,
} embps_log_level_t;

/** Messages below level are dropped (default INFO). */
void embps_log_set_level(embps_log_level_t level);
/** Parses "debug", "info", "warn", "error"; returns -1 for anything else. */
int embps_log_parse_level(const char *name);
/** Writes one line; use the macros below. */
void embps_log_write(embps_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define EMBPS_LOG(level, ...) embps_log_write(level, __FILE__, __LINE__, __VA_ARGS__)
#define EMBPS_DEBUG(...) EMBPS_LOG(EMBPS_LOG_DEBUG, __VA_ARGS__)
#define EMBPS_INFO(...) EMBPS_LOG(EMBPS_LOG_INFO, __VA_ARGS__)
#define EMBPS_WARN(...) EMBPS_LOG(EMBPS_LOG_WARN, __VA_ARGS__)
#define EMBPS_ERROR(...) EMBPS_LOG(EMBPS_LOG_ERROR, __VA_ARGS__)

/* Check macros for calls into the OS and libraries (NCCL's CHECKGOTO): log file:line and jump
 * to the label. `ret` must be an embps_status_t in scope. */
#define EMBPS_CHECK_GOTO(cond, status, label, ...)                                                 \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      EMBPS_ERROR(__VA_ARGS__);                                                                    \
      ret = (status);                                                                              \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

/* For libuv calls returning a negative errno. */
#define EMBPS_UV_CHECK_GOTO(call, label)                                                           \
  do {                                                                                             \
    int uv_rc_ = (call);                                                                           \
    if (uv_rc_ < 0) {                                                                              \
      EMBPS_ERROR("%s: %s", #call, uv_strerror(uv_rc_));                                           \
      ret = EMBPS_UNAVAILABLE;                                                                     \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#endif
