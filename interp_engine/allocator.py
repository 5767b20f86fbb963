"""glibc's malloc settings for the processes that run a model on the CPU: this one (eager) and a vLLM engine's.

By default glibc maps each large block afresh and hands freed heap back to the kernel above a threshold it adapts
(at most 64 MiB), so every call faults its activations' pages in again. A capture's records outlive the forward,
so the forward's own tensors land on fresh pages too: at 16x128, capturing a Llama's 99 points other than
attn_result and mlp_pre on eager faulted ~470 MiB per call, the whole of its 1.28x over HF's forward (1.02-1.03x
without the faults; all 123 points 1.51x -> 1.11-1.13x; `benchmarks/eager_points.py`), and vLLM's CPU prefill at
64x128 took 2.82 s instead of ~2.2 s (`benchmarks/small_calls.py`). With these settings freed memory
stays with the process, up to its peak, and is reused. A setting the user made (its environment variable, or
GLIBC_TUNABLES naming it) stays theirs; setting one alone keeps glibc from adapting the other, so each is set
whenever the user has not set it.
"""

import ctypes
import functools
import os
import sys

# environment variable: (its GLIBC_TUNABLES name, mallopt's parameter, value)
SETTINGS = {
    "MALLOC_TRIM_THRESHOLD_": ("glibc.malloc.trim_threshold", -1, 4 << 30),  # M_TRIM_THRESHOLD
    "MALLOC_MMAP_THRESHOLD_": ("glibc.malloc.mmap_threshold", -3, 1 << 30),  # M_MMAP_THRESHOLD
}
_INT_MAX = (1 << 31) - 1


def _unset() -> list[str]:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return [k for k, (tunable, _, _) in SETTINGS.items() if k not in os.environ and tunable not in tunables]


def environ() -> dict[str, str]:
    """The settings the user has not made, as environment variables for a child process to start with."""
    return {k: str(SETTINGS[k][2]) for k in _unset()}


@functools.cache
def apply() -> tuple[str, ...]:
    """Make the settings the user has not made in this process, once (glibc's mallopt); return those made.
    Nothing where the C library is not glibc's."""
    if not sys.platform.startswith("linux"):
        return ()
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ()
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt takes a C int, so the trim threshold is 2 GiB - 1 here (4 GiB for a child, through its environment).
    return tuple(k for k in _unset() if mallopt(SETTINGS[k][1], min(SETTINGS[k][2], _INT_MAX)) == 1)
