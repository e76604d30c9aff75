/* `embps lookup-features FILE`: one feature batch (docs/design.md, "Feature batches") read from a
 * small JSON file, looked up in one call per rank, its rows printed.
 *
 * The file (or "-" for standard input) holds an object:
 *
 *   {"batch_size": 2,
 *    "features": [
 *      {"name": "clicks", "table": "items", "pooling": "sum", "ids": [3, 5], "lengths": [2, 0]},
 *      {"name": "cats", "table": "cats", "pooling": "weighted_sum", "ids": [7, 2, 0],
 *       "lengths": [1, 2], "weights": [0.5, 2, 1]}]}
 *
 * "features" is an array of objects with a "name", or an object from names to features (in the
 * file's order). A feature's "pooling" is none (the default, as on the wire), sum, mean or
 * weighted_sum; "lengths" (one per sample) defaults to a bag of one id per id; "batch_size"
 * defaults to the first feature's sample count. The reader is strict: an unknown key, a value of
 * the wrong type, an id outside int64 or a length outside uint32 is refused naming the feature
 * and the key (exit 2), and jansson's parse errors name the line and column. What the library
 * checks (lengths that add up, weights with weighted sum only) it refuses in its own words.
 *
 * Rows print one a line, "NAME SAMPLE v v ..." for a pooled feature and "NAME SAMPLE ID v v ..."
 * for pooling none, values as %.9g (an f32 round-trips); --json prints an object with each
 * feature's table, pooling, emb_width, dtype and rows. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "common/dtype.h"
#include "embps/embps.h"

embps_cli_flag_t embps_cli_lookup_features_flags[] = {
    {"--json", NULL, "print a JSON object: every feature's emb_width, dtype and rows", NULL},
    {NULL, NULL, NULL, NULL}};

static const char *const pooling_names[] = {"none", "sum", "mean", "weighted_sum"};

/* What the file gave for one feature, in arrays owned here. */
typedef struct jfeature {
  const char *name, *table; /* borrowed from the JSON document */
  int pooling;
  int64_t *ids;
  size_t num_ids;
  uint32_t *lengths;
  size_t num_lengths;
  float *weights; /* NULL when the file has none */
  size_t num_weights;
} jfeature_t;

static int file_error(const char *cmd, const char *file, const char *feature, const char *msg) {
  char line[900];
  if (feature)
    snprintf(line, sizeof(line), "%s: feature '%s': %s", file, feature, msg);
  else
    snprintf(line, sizeof(line), "%s: %s", file, msg);
  return embps_cli_usage_error(cmd, line);
}

/* Reads the array v (of key) into a new array of n elements of size es through put. Returns 0,
 * or EMBPS_CLI_EXIT_USAGE after printing why. */
static int read_array(const char *cmd, const char *file, const char *feature, const char *key,
                      json_t *v, size_t es, int (*put)(json_t *x, void *to), void **out,
                      size_t *n) {
  char msg[300];
  size_t i;
  json_t *x;
  uint8_t *a;
  if (!json_is_array(v)) {
    snprintf(msg, sizeof(msg), "\"%s\" must be an array", key);
    return file_error(cmd, file, feature, msg);
  }
  if (!(a = malloc(json_array_size(v) * es + 1))) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    return 1;
  }
  json_array_foreach(v, i, x) {
    if (put(x, a + i * es) != 0) {
      free(a);
      snprintf(msg, sizeof(msg), "\"%s\"[%zu] is not %s", key, i,
               strcmp(key, "ids") == 0       ? "a whole number in int64's range"
               : strcmp(key, "lengths") == 0 ? "a whole number in [0, 4294967295]"
                                             : "a number");
      return file_error(cmd, file, feature, msg);
    }
  }
  *out = a;
  *n = json_array_size(v);
  return 0;
}

static int put_id(json_t *x, void *to) {
  int64_t v;
  if (!json_is_integer(x))
    return -1;
  v = (int64_t)json_integer_value(x);
  memcpy(to, &v, sizeof(v));
  return 0;
}

static int put_length(json_t *x, void *to) {
  json_int_t v;
  uint32_t u;
  if (!json_is_integer(x) || (v = json_integer_value(x)) < 0 || v > (json_int_t)UINT32_MAX)
    return -1;
  u = (uint32_t)v;
  memcpy(to, &u, sizeof(u));
  return 0;
}

static int put_weight(json_t *x, void *to) {
  float v;
  if (!json_is_number(x))
    return -1;
  v = (float)json_number_value(x);
  memcpy(to, &v, sizeof(v));
  return 0;
}

/* Reads the feature object o, named name, into *f. */
static int read_feature(const char *cmd, const char *file, const char *name, json_t *o,
                        jfeature_t *f) {
  const char *key;
  json_t *v;
  char msg[300];
  int rc;
  f->name = name;
  f->pooling = EMBPS_POOLING_NONE;
  if (!json_is_object(o))
    return file_error(cmd, file, name, "a feature must be an object");
  json_object_foreach(o, key, v) {
    if (strcmp(key, "name") == 0) {
      continue; /* read by the caller */
    } else if (strcmp(key, "table") == 0) {
      if (!json_is_string(v))
        return file_error(cmd, file, name, "\"table\" must be a string");
      f->table = json_string_value(v);
    } else if (strcmp(key, "pooling") == 0) {
      int p = -1;
      for (int k = 0; k < 4 && json_is_string(v); k++)
        if (strcmp(json_string_value(v), pooling_names[k]) == 0)
          p = k;
      if (p < 0)
        return file_error(cmd, file, name,
                          "\"pooling\" must be \"none\", \"sum\", \"mean\" or \"weighted_sum\"");
      f->pooling = p;
    } else if (strcmp(key, "ids") == 0) {
      if ((rc = read_array(cmd, file, name, key, v, sizeof(int64_t), put_id, (void **)&f->ids,
                           &f->num_ids)))
        return rc;
    } else if (strcmp(key, "lengths") == 0) {
      if ((rc = read_array(cmd, file, name, key, v, sizeof(uint32_t), put_length,
                           (void **)&f->lengths, &f->num_lengths)))
        return rc;
    } else if (strcmp(key, "weights") == 0) {
      if ((rc = read_array(cmd, file, name, key, v, sizeof(float), put_weight, (void **)&f->weights,
                           &f->num_weights)))
        return rc;
    } else {
      snprintf(msg, sizeof(msg),
               "unknown key \"%.100s\" (a feature has name, table, pooling, ids, lengths and "
               "weights)",
               key);
      return file_error(cmd, file, name, msg);
    }
  }
  if (!f->table)
    return file_error(cmd, file, name, "\"table\" is required");
  if (!f->ids)
    return file_error(cmd, file, name, "\"ids\" is required");
  if (f->weights && f->num_weights != f->num_ids) {
    snprintf(msg, sizeof(msg), "\"weights\" holds %zu numbers for %zu ids: give one per id",
             f->num_weights, f->num_ids);
    return file_error(cmd, file, name, msg);
  }
  if (!f->lengths) { /* a bag of one id per id */
    if (!(f->lengths = malloc(f->num_ids * sizeof(uint32_t) + 1))) {
      fprintf(stderr, "embps: %s: out of memory\n", cmd);
      return 1;
    }
    for (size_t i = 0; i < f->num_ids; i++)
      f->lengths[i] = 1;
    f->num_lengths = f->num_ids;
  }
  return 0;
}

/* The entries of an array or an object. */
static size_t json_size(const json_t *v) {
  return json_is_array(v) ? json_array_size(v) : json_object_size(v);
}

/* Reads the whole batch: *feats (*n of them, each to be freed) and *batch_size. */
static int read_batch(const char *cmd, const char *file, json_t *doc, jfeature_t **feats, size_t *n,
                      size_t *batch_size) {
  json_t *fs = NULL, *v;
  const char *key;
  int rc;
  size_t i;
  if (!json_is_object(doc))
    return file_error(cmd, file, NULL, "the batch must be a JSON object with \"features\"");
  json_object_foreach(doc, key, v) {
    if (strcmp(key, "features") == 0) {
      fs = v;
    } else if (strcmp(key, "batch_size") == 0) {
      if (!json_is_integer(v) || json_integer_value(v) < 1 ||
          json_integer_value(v) > (json_int_t)UINT32_MAX)
        return file_error(cmd, file, NULL,
                          "\"batch_size\" must be a whole number in [1, 4294967295]");
      *batch_size = (size_t)json_integer_value(v);
    } else {
      char msg[200];
      snprintf(msg, sizeof(msg), "unknown key \"%.100s\" (the batch has features and batch_size)",
               key);
      return file_error(cmd, file, NULL, msg);
    }
  }
  if (!fs || (!json_is_array(fs) && !json_is_object(fs)) || json_size(fs) == 0)
    return file_error(cmd, file, NULL,
                      "\"features\" must be a non-empty array of features, or an object from "
                      "names to features");
  *n = json_size(fs);
  if (!(*feats = calloc(*n, sizeof(**feats)))) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    return 1;
  }
  if (json_is_array(fs)) {
    json_array_foreach(fs, i, v) {
      json_t *name = json_object_get(v, "name");
      if (!json_is_string(name) || !json_string_value(name)[0]) {
        char msg[120];
        snprintf(msg, sizeof(msg), "feature %zu has no \"name\" (a non-empty string)", i);
        return file_error(cmd, file, NULL, msg);
      }
      if ((rc = read_feature(cmd, file, json_string_value(name), v, &(*feats)[i])))
        return rc;
    }
  } else {
    i = 0;
    json_object_foreach(fs, key, v) {
      if ((rc = read_feature(cmd, file, key, v, &(*feats)[i++])))
        return rc;
    }
  }
  if (!*batch_size)
    *batch_size = (*feats)[0].num_lengths;
  for (i = 0; i < *n; i++)
    if ((*feats)[i].num_lengths != *batch_size) {
      char msg[200];
      snprintf(msg, sizeof(msg), "\"lengths\" holds %zu bags for a batch of %zu samples",
               (*feats)[i].num_lengths, *batch_size);
      return file_error(cmd, file, (*feats)[i].name, msg);
    }
  return 0;
}

static float value_at(const uint8_t *rows, int dtype, size_t i) {
  float v;
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h;
    memcpy(&h, rows + 2 * i, 2);
    return embps_bf16_to_f32(h);
  }
  memcpy(&v, rows + 4 * i, 4);
  return v;
}

/* Prints every feature's rows: text lines or one JSON object. */
static void print_rows(const embps_feature_t *f, const jfeature_t *jf,
                       const embps_table_spec_t *const *t, size_t n, size_t B, int json) {
  if (json)
    printf("{\"batch_size\":%zu,\"features\":[", B);
  for (size_t k = 0; k < n; k++) {
    int pooled = f[k].pooling != EMBPS_POOLING_NONE;
    int dtype = pooled ? EMBPS_DTYPE_F32 : t[k]->dtype;
    size_t rows = pooled ? B : f[k].num_ids, w = t[k]->emb_width, sample = 0, left = 0;
    if (json) {
      printf("%s{\"name\":", k ? "," : "");
      embps_cli_json_string(stdout, f[k].name);
      printf(",\"table\":");
      embps_cli_json_string(stdout, f[k].table);
      printf(",\"pooling\":\"%s\",\"emb_width\":%zu,\"dtype\":\"%s\",\"rows\":[",
             pooling_names[f[k].pooling], w, embps_dtype_name(dtype));
    }
    for (size_t r = 0; r < rows; r++) {
      if (!pooled) { /* the sample whose bag holds id r */
        while (left == 0)
          left = jf[k].lengths[sample++];
        left--;
      }
      if (json)
        printf("%s[", r ? "," : "");
      else if (pooled)
        printf("%s %zu", f[k].name, r);
      else
        printf("%s %zu %lld", f[k].name, sample - 1, (long long)f[k].ids[r]);
      for (size_t j = 0; j < w; j++)
        printf("%s%.9g", json ? (j ? "," : "") : " ", value_at(f[k].out, dtype, r * w + j));
      printf(json ? "]" : "\n");
    }
    if (json)
      printf("]}");
  }
  if (json)
    printf("]}\n");
}

int embps_cli_cmd_lookup_features(const char *cmd, embps_cli_flag_t *fl, const char *file) {
  json_error_t jerr;
  json_t *doc;
  jfeature_t *jf = NULL;
  embps_feature_t *f = NULL;
  const embps_table_spec_t **spec = NULL;
  embps_table_spec_t *tables = NULL;
  size_t n = 0, nt = 0, B = 0;
  embps_client_t *c;
  embps_status_t st;
  int rc;

  doc = strcmp(file, "-") == 0 ? json_loadf(stdin, JSON_REJECT_DUPLICATES, &jerr)
                               : json_load_file(file, JSON_REJECT_DUPLICATES, &jerr);
  if (!doc) {
    char msg[400];
    snprintf(msg, sizeof(msg), "line %d, column %d: %s", jerr.line, jerr.column, jerr.text);
    return file_error(cmd, file, NULL, msg);
  }
  if ((rc = read_batch(cmd, file, doc, &jf, &n, &B)))
    goto exit;
  rc = 1;
  if (!(f = calloc(n, sizeof(*f))) || !(spec = calloc(n, sizeof(*spec)))) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    goto exit;
  }
  if (!(c = embps_cli_connect(cmd, 1)))
    goto exit;
  if ((st = embps_list_tables(c, &tables, &nt)) != EMBPS_OK) {
    embps_cli_call_failed(cmd, c, st);
    goto exit;
  }
  for (size_t k = 0; k < n; k++) {
    size_t rows;
    for (size_t i = 0; i < nt && !spec[k]; i++)
      if (strcmp(tables[i].name, jf[k].table) == 0)
        spec[k] = &tables[i];
    if (!spec[k]) {
      fprintf(stderr,
              "embps: %s: NOT_FOUND: feature '%s': table '%s' does not exist (see embps "
              "tables)\n",
              cmd, jf[k].name, jf[k].table);
      goto exit;
    }
    f[k].name = jf[k].name;
    f[k].table = jf[k].table;
    f[k].pooling = (embps_pooling_t)jf[k].pooling;
    f[k].ids = jf[k].ids;
    f[k].num_ids = jf[k].num_ids;
    f[k].lengths = jf[k].lengths;
    f[k].weights = jf[k].weights;
    rows = f[k].pooling != EMBPS_POOLING_NONE ? B : f[k].num_ids;
    f[k].out_bytes = rows * spec[k]->emb_width *
                     (f[k].pooling != EMBPS_POOLING_NONE ? 4 : embps_dtype_size(spec[k]->dtype));
    if (!(f[k].out = malloc(f[k].out_bytes + 1))) {
      fprintf(stderr, "embps: %s: out of memory\n", cmd);
      goto exit;
    }
  }
  if ((st = embps_lookup_features(c, f, n, B)) != EMBPS_OK) {
    embps_cli_call_failed(cmd, c, st);
    goto exit;
  }
  print_rows(f, jf, spec, n, B, embps_cli_flag(fl, "--json") != NULL);
  rc = 0;
exit:
  for (size_t k = 0; jf && k < n; k++) {
    free(jf[k].ids);
    free(jf[k].lengths);
    free(jf[k].weights);
    if (f)
      free(f[k].out);
  }
  free(jf);
  free(f);
  free(spec);
  embps_tables_free(tables, nt);
  json_decref(doc);
  return rc;
}
