"""The process's C allocator, set for serving: big blocks reused, not freshly mapped (glibc).

XLA on the CPU takes every output and temporary buffer from the C library's ``malloc``. glibc
gives a block of 128 KiB or more an ``mmap`` of its own and unmaps it on ``free`` (the threshold
rises with the blocks freed, up to 32 MiB: larger blocks always), and returns the top of its heap
to the OS once a few MiB are free there. So every call of a step writes its large outputs into
fresh pages, which the OS faults in and zeroes first: at Qwen3-Next shapes ~1,250 page faults per
T = 8192 prefill step (README.md, "Deployment: the host allocator", has the times).

:func:`tune_host_malloc` makes glibc serve every block, XLA's worker threads' too, from its
main heap and keep up to ``trim_threshold_bytes`` of free memory at the heap's top, so that a
step reuses the pages the previous step freed (after a few steps: the heap first grows to hold
the blocks of consecutive steps side by side). The price is resident memory: the process keeps
about its peak heap (measured: the core's prefill step at T = 8192 0.9 GiB against 0.78, the
whole layer 1.0-1.5 GiB against 0.8). The same settings without code, for any program, set
before it starts::

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824:glibc.malloc.arena_max=1

With another allocator preloaded (tcmalloc) the settings reach nothing it uses; tcmalloc reuses
its memory itself (ffi/README.md, Limits).
"""
from __future__ import annotations

import ctypes
import operator

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

DEFAULT_TRIM_THRESHOLD = 1 << 30


def mallopt_settings(trim_threshold_bytes: int = DEFAULT_TRIM_THRESHOLD) -> tuple:
    """The ``(name, mallopt parameter, value)`` triples :func:`tune_host_malloc` sets, in order
    (benchmarks/vllm_compare.py gives vLLM's harness the same)."""
    return (("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, trim_threshold_bytes), ("M_MMAP_MAX", M_MMAP_MAX, 0),
            ("M_ARENA_MAX", M_ARENA_MAX, 1))


def _glibc():
    """The process's C library if it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def tune_host_malloc(trim_threshold_bytes: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Sets this process's glibc ``malloc`` to reuse freed memory instead of mapping fresh pages.

    Call it once at start-up, before the first JAX computation (it applies to blocks allocated
    after the call, and to the arenas of threads that allocate for the first time after it); it
    changes the whole process, JAX, NumPy and every other library in it:
    ``mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes)`` (free memory at the heap's top is
    returned to the OS only beyond that), ``mallopt(M_MMAP_MAX, 0)`` (no block gets a mapping of
    its own) and ``mallopt(M_ARENA_MAX, 1)`` (threads that have not allocated yet share the main
    heap: XLA's worker threads allocate a jitted program's buffers, and a thread's own arena maps
    every block over 64 MiB afresh whatever the settings). See the module's docstring for what it
    saves and costs.

    Args:
      trim_threshold_bytes: free bytes the heap keeps at its top, an int in [0, 2**31 - 1]
        (glibc takes a C int); default 1 GiB. At least the largest step's outputs and
        temporaries, or the pages are returned and faulted in again.

    Returns:
      True if set; False where the process's C library is not glibc (musl, macOS): nothing
      changed there.

    Raises:
      ValueError: ``trim_threshold_bytes`` is not an int in [0, 2**31 - 1].
      OSError: glibc refused a setting.
    """
    t = trim_threshold_bytes
    try:  # an int or a NumPy integer (no bool, no float)
        t = None if isinstance(t, bool) else operator.index(t)
    except TypeError:
        t = None
    if t is None or not 0 <= t <= 2**31 - 1:
        raise ValueError(f"trim_threshold_bytes must be an int in [0, 2**31 - 1], got {trim_threshold_bytes!r}")
    libc = _glibc()
    if libc is None:
        return False
    for name, param, value in mallopt_settings(t):
        if libc.mallopt(param, value) != 1:
            raise OSError(f"glibc mallopt({name}, {value}) failed")
    return True
