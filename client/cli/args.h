/* Strict parsing of the command line's numbers and lists: a value is accepted only if the
 * whole string is one well-formed number in range; anything else gets a message naming the
 * flag. */
#ifndef EMBPS_CLI_ARGS_H
#define EMBPS_CLI_ARGS_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

/** Parses a whole number in [min, max] (decimal digits only: no sign, spaces or suffix).
 * Returns 0, or -1 with a message in err (errlen bytes) naming what. */
int embps_cli_parse_u64(const char *what, const char *s, uint64_t min, uint64_t max, uint64_t *out,
                        char *err, size_t errlen);

/** Parses a finite decimal number in [min, max] (strtod syntax without leading spaces,
 * hex, inf or nan). Returns 0, or -1 with a message. */
int embps_cli_parse_double(const char *what, const char *s, double min, double max, double *out,
                           char *err, size_t errlen);

/** Parses "1,2,3" into a new array of int64 (freed with free()); *n its length (>= 1).
 * Returns 0, or -1 with a message naming the bad item. */
int embps_cli_parse_i64_list(const char *what, const char *s, int64_t **out, size_t *n, char *err,
                             size_t errlen);

/** Parses "0.1,0.2|0.3,0.4" (rows separated by '|', values by ',') into a new float array
 * (freed with free()), *n values in all and *rows rows; every row must have the same number
 * of values. Returns 0, or -1 with a message. */
int embps_cli_parse_f32_rows(const char *what, const char *s, float **out, size_t *n, size_t *rows,
                             char *err, size_t errlen);

/** Parses a mix of batch sizes, "1024:3,4096:1" (size:weight; a size alone weighs 1), each size
 * in [1, max_batch] and each weight a number > 0, into two new arrays (freed with free()) of *n
 * entries. Returns 0, or -1 with a message naming the bad item. */
int embps_cli_parse_mix(const char *what, const char *s, uint64_t max_batch, uint64_t **batches,
                        double **weights, size_t *n, char *err, size_t errlen);

/** Writes s to f as a JSON string: quotes, with '"', '\\' and control bytes escaped. */
void embps_cli_json_string(FILE *f, const char *s);

#endif
