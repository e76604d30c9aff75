/* How many CPUs this process may use: what sizes its thread pools. */
#ifndef EMBPS_COMMON_CPUS_H
#define EMBPS_COMMON_CPUS_H

/** The CPUs in this process's affinity mask (which a container's cpuset narrows), lowered to its
 * cgroup v2 CPU limit when it has one (cpu.max "QUOTA PERIOD", rounded up: a Kubernetes pod's
 * limits.cpu); at least 1. */
unsigned embps_usable_cpus(void);

#endif
