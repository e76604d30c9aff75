/* The CUDA simulator's own face (beyond the fake <cuda_runtime_api.h>): what the fake kernels
 * (sim_kernels.c) and the tests use to enqueue work, to check device pointers and to ask what
 * is still in flight. See sim_cuda.c for the semantics. Every check fails loudly: it prints
 * what was wrong to stderr with a backtrace and aborts, since a wrong call is a bug of the
 * program under test, not a condition to handle. */
#ifndef EMBPS_SIM_CUDA_H
#define EMBPS_SIM_CUDA_H

#include <cuda_runtime_api.h>
#include <stddef.h>

/** Prints "sim_cuda: <message>" and a backtrace to stderr and aborts. */
void sim_cuda_fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/**
 * Appends a closure to `stream` (0 or cudaStreamLegacy: the current device's legacy stream):
 * fn(copy of args) runs when something forces the stream that far (see sim_cuda.c). args_size
 * bytes of args are copied now, so the caller's struct may go out of scope. `what` names the
 * work in messages (a string literal). The stream must belong to the calling thread's current
 * device, as a kernel launch requires.
 */
void sim_cuda_enqueue(cudaStream_t stream, void (*fn)(void *args), const void *args,
                      size_t args_size, const char *what);

/**
 * Aborts unless [p, p + bytes) lies wholly inside one live device allocation of the device
 * that `stream` belongs to. bytes == 0 checks nothing. For the enqueue-time checks of kernels.
 */
void sim_cuda_check_device(cudaStream_t stream, const void *p, size_t bytes, const char *what);

/** Bytes from p to the end of the live device allocation holding p; aborts when p is not
 * device memory. For the checks a kernel can only make when it runs (data-dependent rows). */
size_t sim_cuda_device_extent(const void *p, const char *what);

/** Fills n bytes with the poison pattern (a quiet NaN as f32, f64 and bf16; a huge int). */
void sim_cuda_poison(void *p, size_t n);

/** Operations queued and not yet run, over every stream of every device. */
size_t sim_cuda_pending(void);

/** Operations queued and not yet run on the streams of one device. Ranks that run in threads of
 * one process each own a device, so a rank asks about its own. */
size_t sim_cuda_pending_device(int device);

/** What a device cost its host so far (since the process started). */
typedef struct sim_cuda_counts {
  /* Calls that made the host wait for the device's work: cudaStreamSynchronize (and
   * cudaStreamQuery) on its streams, cudaEventSynchronize (cudaEventQuery) of its events,
   * cudaDeviceSynchronize, and the synchronous copies and memsets. */
  size_t syncs;
  /* Copies from its memory to host memory (pinned or not), asynchronous or not, and their
   * bytes. */
  size_t d2h_copies, d2h_bytes;
} sim_cuda_counts_t;

/** The counts of one device, for tests that hold the engine to its round trips per op. */
void sim_cuda_counts(int device, sim_cuda_counts_t *out);

/** Live device allocations, pinned allocations, streams and events created on a device (any
 * of the outputs may be NULL). */
void sim_cuda_live(int device, size_t *device_allocs, size_t *pinned_allocs, size_t *streams,
                   size_t *events);

/** Devices that cudaGetDeviceCount reports (1 unless SIM_CUDA_DEVICES says otherwise); at most
 * SIM_CUDA_MAX_DEVICES. Call before any other thread uses the simulator. */
#define SIM_CUDA_MAX_DEVICES 16
void sim_cuda_set_device_count(int n);

/** Caps the device memory that cudaMalloc hands out on `device` (0: no cap); beyond it
 * cudaMalloc returns cudaErrorMemoryAllocation. */
void sim_cuda_set_memory_limit(int device, size_t bytes);

/**
 * Device memory is mapped without access while no simulated work runs, so host code that
 * dereferences a device pointer crashes at once (with a message naming the allocation). A
 * stand-in for a device-side library (the NCCL communicator) brackets its host access to one
 * device's memory with these. Calls nest.
 */
void sim_cuda_device_access_begin(int device);
void sim_cuda_device_access_end(int device);

/* With SIM_CUDA_REPORT=1 in the environment, the process prints at exit, for every device it
 * allocated on, the device and pinned allocations made and the allocations, streams, events and
 * queued operations still live, and how many cudaPointerGetAttributes queries found pinned host,
 * device and pageable host memory ("sim_cuda report: ..." lines on stderr). */

#endif
