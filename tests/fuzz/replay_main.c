/* The main() of a fuzz target in builds without libFuzzer (gcc, the release and sanitizer
 * builds): runs LLVMFuzzerTestOneInput once on every file named on the command line, and on
 * every file in every directory named, so ctest replays the committed corpus in every build.
 * Exits non-zero when a file cannot be read; a crash in the target ends the process as it
 * would under libFuzzer (sanitizer report, abort). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  uint8_t *buf = NULL;
  long n;
  if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fprintf(stderr, "cannot read %s\n", path);
    if (f)
      fclose(f);
    return -1;
  }
  /* A copy of exactly n bytes, so reading past the input trips AddressSanitizer. */
  buf = malloc(n ? (size_t)n : 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "cannot read %s\n", path);
    free(buf);
    fclose(f);
    return -1;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) {
  return strcmp((*a)->d_name, (*b)->d_name);
}

int main(int argc, char **argv) {
  long inputs = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (argv[i][0] == '-') /* libFuzzer flags (-runs=0) mean nothing here */
      continue;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "no such file or directory: %s\n", argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (replay_file(argv[i]) != 0)
        return 1;
      inputs++;
      continue;
    }
    struct dirent **names;
    int n = scandir(argv[i], &names, NULL, by_name);
    if (n < 0) {
      fprintf(stderr, "cannot list %s\n", argv[i]);
      return 1;
    }
    int failed = 0;
    for (int k = 0; k < n; k++) {
      char path[4096];
      if (!failed && names[k]->d_name[0] != '.') {
        snprintf(path, sizeof(path), "%s/%s", argv[i], names[k]->d_name);
        if (replay_file(path) != 0)
          failed = 1;
        else
          inputs++;
      }
      free(names[k]);
    }
    free(names);
    if (failed)
      return 1;
  }
  printf("replayed %ld inputs\n", inputs);
  return inputs > 0 ? 0 : 1;
}
