/* embps_usable_cpus: the affinity mask bounds it, whatever the machine (a cgroup CPU limit can
 * only lower it further). embps_l2_cache_bytes: the level-2 data or unified cache of a sysfs-like
 * tree, whatever the order of its entries. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cpus.h"

static void test_follows_affinity(void **state) {
  cpu_set_t all, one;
  (void)state;
  assert_int_equal(sched_getaffinity(0, sizeof(all), &all), 0);
  unsigned n = embps_usable_cpus();
  assert_true(n >= 1 && n <= (unsigned)CPU_COUNT(&all));
  /* Narrowed to the first CPU it may use: exactly one. */
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &all)) {
      CPU_SET(c, &one);
      break;
    }
  assert_int_equal(sched_setaffinity(0, sizeof(one), &one), 0);
  assert_int_equal(embps_usable_cpus(), 1);
  assert_int_equal(sched_setaffinity(0, sizeof(all), &all), 0);
  assert_int_equal(embps_usable_cpus(), n);
}

/* Writes dir/indexN/{level,type,size}. */
static void cache_entry(const char *dir, int index, const char *level, const char *type,
                        const char *size) {
  char path[256];
  const char *names[3] = {"level", "type", "size"}, *values[3] = {level, type, size};
  snprintf(path, sizeof(path), "%s/index%d", dir, index);
  assert_int_equal(mkdir(path, 0700), 0);
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof(path), "%s/index%d/%s", dir, index, names[i]);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", values[i]);
    fclose(f);
  }
}

static void test_l2_from_sysfs(void **state) {
  char a[] = "/tmp/embps-cache-XXXXXX", b[] = "/tmp/embps-cache-XXXXXX";
  (void)state;
  assert_non_null(mkdtemp(a));
  assert_non_null(mkdtemp(b));
  /* Intel's order: L1d, L1i, L2, L3. */
  cache_entry(a, 0, "1", "Data", "48K");
  cache_entry(a, 1, "1", "Instruction", "32K");
  cache_entry(a, 2, "2", "Unified", "1280K");
  cache_entry(a, 3, "3", "Unified", "105M");
  assert_int_equal(embps__l2_cache_bytes_in(a), 1280u << 10);
  /* An instruction L2 listed first is not it; sizes in M count too; no level 2: 0. */
  cache_entry(b, 0, "2", "Instruction", "4M");
  cache_entry(b, 1, "3", "Unified", "32M");
  assert_int_equal(embps__l2_cache_bytes_in(b), 0);
  cache_entry(b, 2, "2", "Data", "2M");
  assert_int_equal(embps__l2_cache_bytes_in(b), 2u << 20);
  assert_int_equal(embps__l2_cache_bytes_in("/nonexistent/embps"), 0);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s %s", a, b);
  assert_int_equal(system(cmd), 0);
  /* This machine's: what sysfs says, where it says it (sysconf may say it too). */
  size_t sys = embps__l2_cache_bytes_in("/sys/devices/system/cpu/cpu0/cache");
  if (sys)
    assert_true(embps_l2_cache_bytes() > 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_follows_affinity),
                                     cmocka_unit_test(test_l2_from_sysfs)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
