"""CPU memory: keep freed memory in the process for the next step instead of handing it back to the system.

A DP-SGD step on the CPU allocates and frees much more than a non-private one: the per-example gradients of a
chunk (138 MB for ResNet-20 at 128 examples), the grouped-convolution outputs, the recorded activations. glibc's
malloc returns large freed blocks to the operating system (``munmap``, or trimming the top of the heap), so the
next step takes them back page by page: 70,000 page faults per ResNet-20 step of 128 fixed-size examples, where the
non-private step of the same benchmark run took none, and 7,200 per cnn28 step of 256. On this project's 2-core machine that churn
was most of dptrain's overhead over non-private training with fixed-size batches (docs/performance.md); with
Poisson batches, whose sizes vary, fewer of the faults go away.

:func:`keep_freed_memory` sets two malloc parameters (``mallopt``): blocks up to 32 MiB come from the heap rather
than from their own mappings (``M_MMAP_THRESHOLD``, glibc's largest), and the heap is not trimmed until 1 GiB is
free at its top (``M_TRIM_THRESHOLD``). The process's peak memory is what it was; it just does not give memory
back between steps. This is the tuning PyTorch's CPU performance guide reaches with jemalloc or tcmalloc, without
preloading a library. It changes the whole process, so the library never calls it on its own: ``dptrain train``
and ``dptrain reproduce`` (whose process it is) do, unless ``DPTRAIN_SYSTEM_MALLOC=1`` is set; a Python user calls
``dptrain.keep_freed_memory()`` once, if they want it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**30
#: Set to 1 to leave malloc as the system configured it (the CLI then does not call keep_freed_memory).
OPT_OUT = "DPTRAIN_SYSTEM_MALLOC"


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (module docstring). Returns True when both parameters were
    set; False where there is no glibc (macOS, Windows, musl), where it refuses, or when ``DPTRAIN_SYSTEM_MALLOC=1``."""
    if os.environ.get(OPT_OUT, "") not in ("", "0") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
