/* The compute backends a server runs on, with their names, declared once: the setting
 * (--device: a backend's name, cuda with an optional :N) is parsed here, the engine picks its
 * operations by the value, and the stats and metrics print the name. Header-only. */
#ifndef EMBPS_BACKEND_H
#define EMBPS_BACKEND_H

#include <string.h>

/** X(NAME, value, name): every backend, with the name that settings, stats and metrics use. CPU:
 * tables in host memory; CUDA: tables in GPU memory, kernels on the engine's stream, NCCL between
 * ranks. */
#define EMBPS_BACKEND_MAP(X)                                                                       \
  X(CPU, 0, "cpu")                                                                                 \
  X(CUDA, 1, "cuda")

/** A backend: EMBPS_BACKEND_CPU, EMBPS_BACKEND_CUDA. */
typedef enum embps_backend {
#define EMBPS_BACKEND_ENUM(NAME, value, name) EMBPS_BACKEND_##NAME = value,
  EMBPS_BACKEND_MAP(EMBPS_BACKEND_ENUM)
#undef EMBPS_BACKEND_ENUM
} embps_backend_t;

/** The backend's name ("cpu", "cuda"); "unknown" for a value that is none. Static string. */
static inline const char *embps_backend_name(embps_backend_t backend) {
  switch (backend) {
#define EMBPS_BACKEND_NAME(NAME, value, name)                                                      \
  case EMBPS_BACKEND_##NAME:                                                                       \
    return name;
    EMBPS_BACKEND_MAP(EMBPS_BACKEND_NAME)
#undef EMBPS_BACKEND_NAME
  }
  return "unknown";
}

/** Sets *out to the backend named name (as embps_backend_name gives it). Returns 0, or -1 (and
 * leaves *out untouched) when no backend has that name. */
static inline int embps_backend_parse(const char *name, embps_backend_t *out) {
#define EMBPS_BACKEND_PARSE(NAME, value, text)                                                     \
  if (strcmp(name, text) == 0) {                                                                   \
    *out = EMBPS_BACKEND_##NAME;                                                                   \
    return 0;                                                                                      \
  }
  EMBPS_BACKEND_MAP(EMBPS_BACKEND_PARSE)
#undef EMBPS_BACKEND_PARSE
  return -1;
}

#endif
