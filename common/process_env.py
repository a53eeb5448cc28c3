"""Process-wide settings every process of ours takes before it computes.

Importing this module first (the CLI, which starts every service; the engine
package; the benchmarks; the test suite) applies them before any torch import:

- ``OMP_WAIT_POLICY=PASSIVE``. libgomp reads it once, when torch loads it.
  Spinning OpenMP workers made a 2-thread attention call 400x slower with
  several engine processes on 2 cores (cpu-2c), and a cold 1,493-token prefill
  started without the CLI in front 1.4-1.5x slower, its GEMMs included: torch's
  idle workers spun beside the kernels' own threads.
- glibc keeps freed buffers up to 32 MiB in the heap (``mallopt``) instead of
  returning each to the kernel. A prefill allocates MB-sized activations every
  layer; above glibc's default 128 KiB threshold each one was a fresh mapping
  whose every page faulted on first write: a residual add + RMSNorm of
  512 x 576 took 1.1-1.9 ms instead of 0.15 ms, and a cold 1,493-token prefill
  about 10 % longer (cpu-2c, 2026-12-03). The cost is memory held after a
  peak: at most ``TRIM_THRESHOLD`` of free heap per process before glibc trims.

An operator's own setting wins: ``OMP_WAIT_POLICY`` is only set when absent,
and any ``MALLOC_*`` variable in the environment leaves glibc's tuning to it."""

import ctypes
import os

OMP_WAIT_POLICY = "PASSIVE"

# mallopt parameters (glibc's malloc.h) and the values we set.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20      # glibc's ceiling for this parameter on 64-bit
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20             # address space only: untouched pages cost nothing


def keep_buffers_mapped(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Applies the glibc tuning; False where the operator tuned malloc or the
    C library is not glibc (then nothing changes)."""
    if any(name.startswith("MALLOC_") for name in environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)


os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
keep_buffers_mapped()
