/* embps_usable_cpus (cpus.h). */
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
