"""What an engine holds in memory beyond its weights and KV pool, for /metrics
and the stack benchmark (issue 18: two engine processes on one GPU).

``mirror_bytes`` is the live sequences' contiguous KV mirrors
(engine/attention.py): allocated per sequence outside the pool, so they grow
with concurrency and context, not with anything admission counts. They exist
only where attention reads them (the CPU kernels, SDPA prefill chunks, the
non-paged decode). The ``device_*`` figures are torch's caching allocator on
a CUDA device (0 on the CPU): what this process allocated and holds now and
at its peak, and the cap ``EngineConfig.gpu_fraction`` put on it (0: none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class EngineMemory:
    mirror_bytes: int = 0                 # live sequences' mirrors, now
    device_allocated_bytes: int = 0       # tensors alive on the device, now
    device_peak_allocated_bytes: int = 0  # their peak since start
    device_reserved_bytes: int = 0        # held by the allocator (alive + cached), now
    device_peak_reserved_bytes: int = 0   # its peak: what nvidia-smi shows this process at
    device_cap_bytes: int = 0             # the process's cap (gpu_fraction x total), 0: none


def mirror_bytes(mirrors: Callable[[], Iterable[torch.Tensor]]) -> int:
    """Sum of the mirrors' bytes. Read from another thread (a /metrics scrape)
    while the engine thread admits and frees sequences: a dict changing size
    under the iteration is read again rather than locked against."""
    for _ in range(8):
        try:
            return sum(m.numel() * m.element_size() for m in mirrors())
        except RuntimeError:
            continue
    return 0


def engine_memory(device: torch.device, mirrors: int, fraction: float) -> EngineMemory:
    if device.type != "cuda":
        return EngineMemory(mirror_bytes=mirrors)
    total = torch.cuda.get_device_properties(device).total_memory
    return EngineMemory(mirrors, torch.cuda.memory_allocated(device),
                        torch.cuda.max_memory_allocated(device),
                        torch.cuda.memory_reserved(device),
                        torch.cuda.max_memory_reserved(device),
                        int(fraction * total) if fraction else 0)
