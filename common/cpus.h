/* How many CPUs this process may use (what sizes its thread pools), and their L2 cache. */
#ifndef EMBPS_COMMON_CPUS_H
#define EMBPS_COMMON_CPUS_H

#include <stddef.h>

/** The CPUs in this process's affinity mask (which a container's cpuset narrows), lowered to its
 * cgroup v2 CPU limit when it has one (cpu.max "QUOTA PERIOD", rounded up: a Kubernetes pod's
 * limits.cpu); at least 1. */
unsigned embps_usable_cpus(void);

/** One core's L2 cache in bytes: sysconf(_SC_LEVEL2_CACHE_SIZE), else the level-2 data or unified
 * cache that /sys/devices/system/cpu/cpu0/cache lists; 0 when neither says. */
size_t embps_l2_cache_bytes(void);

/** The level-2 data or unified cache listed under cache_dir (laid out as
 * /sys/devices/system/cpu/cpu0/cache: indexN/{level,type,size}), in bytes; 0 when none is. */
size_t embps__l2_cache_bytes_in(const char *cache_dir);

#endif
