/* embps_usable_cpus and embps_l2_cache_bytes (cpus.h). */
#include "common/cpus.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The CPUs a cgroup v2 CPU limit allows, rounded up, or 0 when there is none or it cannot be
 * read. */
static long cgroup_cpu_limit(void) {
  FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
  long quota = 0, period = 0;
  char first[32] = "";
  if (!f)
    return 0;
  if (fscanf(f, "%31s %ld", first, &period) != 2 || strcmp(first, "max") == 0 || period <= 0)
    period = 0;
  else
    quota = strtol(first, NULL, 10);
  fclose(f);
  return quota > 0 && period > 0 ? (quota + period - 1) / period : 0;
}

unsigned embps_usable_cpus(void) {
  cpu_set_t set;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN), limit = cgroup_cpu_limit();
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    cpus = CPU_COUNT(&set);
  if (limit > 0 && limit < cpus)
    cpus = limit;
  return cpus < 1 ? 1u : (unsigned)cpus;
}

/* The first line of dir/name, without its newline, into buf; 0 when it cannot be read. */
static int read_line(const char *dir, const char *name, char *buf, size_t len) {
  char path[512];
  FILE *f;
  int ok;
  if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path) ||
      !(f = fopen(path, "r")))
    return 0;
  ok = fgets(buf, (int)len, f) != NULL;
  fclose(f);
  if (ok)
    buf[strcspn(buf, "\n")] = '\0';
  return ok;
}

size_t embps__l2_cache_bytes_in(const char *cache_dir) {
  for (int i = 0; i < 16; i++) {
    char dir[512], level[16], type[32], size[32], *end;
    if (snprintf(dir, sizeof(dir), "%s/index%d", cache_dir, i) >= (int)sizeof(dir))
      return 0;
    if (!read_line(dir, "level", level, sizeof(level)) ||
        !read_line(dir, "type", type, sizeof(type)) || strcmp(level, "2") != 0 ||
        strcmp(type, "Instruction") == 0 || !read_line(dir, "size", size, sizeof(size)))
      continue;
    unsigned long long v = strtoull(size, &end, 10);
    if (end == size)
      continue;
    if (*end == 'K')
      v <<= 10;
    else if (*end == 'M')
      v <<= 20;
    else if (*end != '\0')
      continue;
    return (size_t)v;
  }
  return 0;
}

size_t embps_l2_cache_bytes(void) {
  long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return v > 0 ? (size_t)v : embps__l2_cache_bytes_in("/sys/devices/system/cpu/cpu0/cache");
}
