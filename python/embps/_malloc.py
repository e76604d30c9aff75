"""glibc malloc settings for a process that moves megabytes per call.

Every lookup of a 4096 x 128 f32 batch makes gRPC and CPython allocate and free a few buffers of
2 MiB (the slices read from the socket, the bytearray gRPC joins them into, the bytes it hands
over, the result). glibc serves such blocks from mmap, or, once its dynamic threshold has risen,
from the heap top, which it trims back to the kernel as soon as more than twice that threshold
lies free. Either way the pages are returned and faulted in anew on the next call: measured on
loopback, a 2 MiB lookup took 12-30 ms with the defaults and 0.9-1.5 ms with the settings
below, where most of the difference was page faults under memmove (perf).

tune() sets what glibc's dynamic adjustment itself converges to at its ceiling (mmap threshold
32 MiB, DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), with a trim threshold of 128 MiB instead of
2 x 32 MiB, once per process, when the first embps.Client is made. It does nothing when
EMBPS_MALLOC_TUNE=0, when the user set any MALLOC_*_ variable (their choice wins), or when the
C library is not glibc. The cost: up to 128 MiB of freed heap may stay mapped.
"""
import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20

_done = False
_lock = threading.Lock()


def tune():
    """Applies the settings once per process; True if they were applied by this call."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
    if os.environ.get("EMBPS_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
