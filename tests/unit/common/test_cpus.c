/* embps_usable_cpus: the affinity mask bounds it, whatever the machine (a cgroup CPU limit can
 * only lower it further). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <sched.h>

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

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_follows_affinity)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
