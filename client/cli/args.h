/* The command line of `embps`, parsed in one place: the global settings (flag, environment
 * variable, default), each command's flags, and their values. Declarations are tables that both
 * parse argv and print --help. Values are parsed strictly: a value is accepted only if the
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

/* ---- flags and commands ---- */

/** The exit status of a usage error (a bad option, value or command); a failed call exits 1. */
#define EMBPS_CLI_EXIT_USAGE 2

/** One flag of a command, in a table ended by an all-NULL entry. The table parses argv
 * (embps_cli_parse_flags) and prints the command's --help (embps_cli_usage_command). An entry
 * whose name does not start with '-' ("FILE.npy", arg NULL) is a further positional argument,
 * required, after the command's own: its value is the argument's text. */
typedef struct embps_cli_flag {
  const char *name;  /* "--rows" */
  const char *arg;   /* the value's placeholder ("R"); NULL for a switch */
  const char *help;  /* one line */
  const char *value; /* set by embps_cli_parse_flags: argv's text, "1" for a switch, or NULL */
} embps_cli_flag_t;

/** A command's handler: runs it with the parsed flags and its positional argument (NULL when
 * the command has none). Returns the exit status: 0, 1 (a failed call, already printed) or
 * EMBPS_CLI_EXIT_USAGE. */
typedef int (*embps_cli_handler_t)(const char *cmd, embps_cli_flag_t *flags, const char *pos);

/** One command of `embps`: a row of the command table that dispatches, parses and prints the
 * usage. */
typedef struct embps_cli_command {
  const char *name;        /* "create-table" */
  const char *positional;  /* "NAME", or NULL for a command without one */
  const char *summary;     /* one sentence, shown in both usages */
  embps_cli_handler_t run; /* never NULL */
  embps_cli_flag_t *flags; /* the command's flag table (never NULL; values set in place) */
} embps_cli_command_t;

/** Prints c's usage: its synopsis, summary and one line per flag, then --help. */
void embps_cli_usage_command(FILE *f, const embps_cli_command_t *c);

/** Parses argc/argv (what follows the command's name) into c->flags' values, the first
 * positional (*pos; NULL when none) and the further positionals the flag table declares. Accepts
 * "--flag VALUE", "--flag=VALUE" and switches. Returns 0; -1 after printing the usage for --help or
 * -h; or EMBPS_CLI_EXIT_USAGE after printing to stderr what is wrong (an unknown option, a missing
 * value or positional, an extra argument). */
int embps_cli_parse_flags(const embps_cli_command_t *c, int argc, char **argv, const char **pos);

/** The value of the flag called name in flags (NULL when not given or not declared). */
const char *embps_cli_flag(const embps_cli_flag_t *flags, const char *name);

/** Prints "embps: CMD: MSG" to stderr and returns EMBPS_CLI_EXIT_USAGE. */
int embps_cli_usage_error(const char *cmd, const char *msg);

/** The value of flag name as a whole number in [min, max], or def when not given. Returns 0,
 * or EMBPS_CLI_EXIT_USAGE after printing why. */
int embps_cli_flag_u64(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                       uint64_t min, uint64_t max, uint64_t def, uint64_t *out);

/** The value of flag name as a finite number in [min, max], or def when not given. Returns 0,
 * or EMBPS_CLI_EXIT_USAGE after printing why. */
int embps_cli_flag_double(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                          double min, double max, double def, double *out);

/** The value of flag name as a float in [0, 3.4e38], or 0 when not given (the server's
 * default). Returns 0, or EMBPS_CLI_EXIT_USAGE after printing why. */
int embps_cli_flag_float(const char *cmd, const embps_cli_flag_t *flags, const char *name,
                         float *out);

/* ---- global settings ---- */

/** A global setting: a flag before the command, with an environment variable and a default. */
typedef struct embps_cli_setting {
  const char *flag;  /* "--servers" */
  const char *env;   /* "EMBPS_SERVERS" */
  const char *def;   /* the default text ("" for none) */
  const char *help;  /* one line */
  int is_switch;     /* the flag alone means "1" (a value only as --flag=V) */
  const char *value; /* set by embps_cli_parse_settings: flag, else environment, else def */
} embps_cli_setting_t;

/** Sets each of the n settings' value from its environment variable (when set and not
 * empty) or its default, then from the flags at argv[1...] up to the first argument that is
 * not an option, or up to --help, -h or --version, which are left for the caller. *next is
 * the index of that argument (argc when none). Returns 0, or EMBPS_CLI_EXIT_USAGE after
 * printing what is wrong (an unknown option, a missing value). */
int embps_cli_parse_settings(embps_cli_setting_t *settings, size_t n, int argc, char **argv,
                             int *next);

/** Prints the n settings, each with its flag, help, environment variable and default. */
void embps_cli_usage_settings(FILE *f, const embps_cli_setting_t *settings, size_t n);

#endif
