"""``kvserve bench pd --device cuda``: the restore path in ONE process.

The engine on the device and the warehouse tiers in-process: G2 a pinned
host arena (``mem://``, cudaHostRegister'ed by the tier), G3 a local disk
directory (``file://``); no Redis, no sockets. Per prompt length:

- TTFT cold: ``Engine.prefill`` of the whole prompt;
- TTFT at a 90 % prefix hit: the first 90 % (whole blocks) were stored in G2
  by the cold run; a new prompt shares that prefix and differs after it. Its
  TTFT covers finding the blocks, copying them from the arena to the device
  (runs of adjacent arena slots coalesced into one DMA each), and
  ``Engine.prefill`` of the rest;
- restore bandwidth (the arena -> device copies alone) against the pinned
  memcpy peak of the same byte count measured in the same run;
- the cost-aware rule (service.cost) when the only copy is in G3: its
  inputs are measured here (a probe read with the page cache dropped for the
  files, the cold prefill speed), its choice is compared with both actual
  alternatives, fetch-then-compute and recompute.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import timed
from kvserve.cli import UsageError

HIT_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class LengthResult:
    tokens: int
    hit_fraction: float
    cached_tokens: int
    ttft_cold_s: float
    ttft_hit_s: float
    restore_bytes: int
    restore_s: float
    memcpy_GBps: float
    restore_copies: int
    compute_s: float                # the hit's prefill alone, restored KV already on the device
    single_shot_s: float            # the same prompt cold in ONE chunk (the prefill limit)
    ttft_hit_staged_s: float        # the hit with every block copied before the compute

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_hit_s

    @property
    def ttft_cold_vs_limit(self) -> float:
        """single-shot / chunked cold prefill (1.0 = chunking costs nothing)."""
        return self.single_shot_s / self.ttft_cold_s

    @property
    def ttft_hit_vs_limit(self) -> float:
        """compute of the rest / TTFT of the hit (1.0 = the restore is fully hidden)."""
        return self.compute_s / self.ttft_hit_s

    @property
    def restore_GBps(self) -> float:
        return self.restore_bytes / self.restore_s / 1e9

    @property
    def restore_vs_peak(self) -> float:
        return self.restore_GBps / self.memcpy_GBps


@dataclass(frozen=True, slots=True)
class DiskResult:
    tokens: int
    blocks: int
    probe_GBps: float               # what the rule was told (measured probe read)
    predicted_fetch_s: float
    predicted_recompute_s: float
    decision: str
    actual_fetch_then_compute_s: float
    actual_recompute_s: float

    @property
    def correct(self) -> bool:
        fetch_better = self.actual_fetch_then_compute_s < self.actual_recompute_s
        return (self.decision == "recompute") != fetch_better


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} needs a CUDA GPU, and this machine has none "
                         "(torch.cuda.is_available() is False). Run the GPU benchmark on a GPU "
                         "machine, or drop --device for the CPU services benchmark.")


def run(args: Any) -> tuple[list[LengthResult], list[DiskResult]]:
    from engine import Engine, EngineConfig

    check_device(args.device)
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    B = args.block_tokens
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    fractions = [float(x) for x in args.hit_fractions.split(",") if x.strip()]
    if not fractions or not all(0 < f < 1 for f in fractions):
        raise UsageError("--hit-fractions must be numbers in (0, 1), e.g. 0.9,0.99")
    if not lengths or min(lengths) < 2 * B:
        raise UsageError(f"--lengths must be >= {2 * B} tokens each")
    chunk = max(B, args.prefill_chunk // B * B)
    longest = max(lengths)
    eng = Engine(EngineConfig(model=args.model, dtype=dtype, device=args.device,
                               block_tokens=B, num_blocks=-(-longest // B) + 8,
                               prefill_chunk=chunk, kernels=args.kernels))
    limit = eng.model_config.max_position - 1
    lengths = [min(n, limit) for n in lengths]
    # The prefill limit measured in the same run: each prompt cold in a single chunk.
    single = Engine(EngineConfig(model=args.model, dtype=dtype, device=args.device,
                                 block_tokens=B, num_blocks=-(-longest // B) + 8,
                                 prefill_chunk=-(-longest // B) * B, kernels=args.kernels))
    with tempfile.TemporaryDirectory(prefix="kvserve-g3-", dir=args.g3_dir) as g3_dir:
        return _bench(eng, lengths, fractions, Path(g3_dir), single)


def _sync(eng: Any) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def _bench(eng: Any, lengths: Sequence[int], fractions: Sequence[float], g3_dir: Path,
           single: Any) -> tuple[list[LengthResult], list[DiskResult]]:
    from tqdm import tqdm

    from kvstore.tiers import open_tier

    B = eng.layout.block_tokens
    max_prefix = max(int(f * n) // B for n in lengths for f in fractions)
    g2_bytes = int(1.25 * max_prefix * eng.layout.block_nbytes) + 2**20
    _check_shm(g2_bytes)
    g2 = open_tier("mem://bench-pd", name="G2", capacity_bytes=g2_bytes)
    g3 = open_tier(f"file://{g3_dir}", name="G3", capacity_bytes=2**44)
    gen = torch.Generator().manual_seed(0)
    restore = ArenaRestore(eng, g2, max_prefix)
    _warmup(eng, g2, restore, gen)
    restores: list[LengthResult] = []
    disks: list[DiskResult] = []
    try:
        for n in tqdm(lengths, desc="lengths", file=sys.stderr):
            r, d = _one_length(eng, g2, g3, restore, n, fractions, gen, single)
            restores.extend(r)
            disks.append(d)
    finally:
        g2.close()
        g3.close()
    return restores, disks


def _check_shm(nbytes: int, path: str = "/dev/shm") -> None:
    """G2 lives in /dev/shm: writing past a small tmpfs would SIGBUS, so say so first."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise UsageError(f"G2 needs {nbytes / 2**30:.1f} GiB of {path} but only "
                         f"{free / 2**30:.1f} GiB is free; pass shorter --lengths or enlarge "
                         f"{path} (e.g. docker --shm-size)")


def _tokens(eng: Any, n: int, gen: torch.Generator) -> list[int]:
    # Ids from the regular vocabulary (special tokens sit at the low end of some vocabularies).
    vocab = eng.model_config.vocab_size
    return torch.randint(min(1000, vocab // 2), vocab, (n,), generator=gen).tolist()


def _warmup(eng: Any, g2: Any, restore: ArenaRestore, gen: torch.Generator) -> None:
    """Kernels, allocator and the arena pages touched once before timing."""
    B = eng.layout.block_tokens
    toks = _tokens(eng, 4 * B, gen)
    _prefill(eng, "warmup", toks)
    blocks = eng.export_blocks("warmup", 0, 2)
    eng.free("warmup")
    keys = _store(eng, g2, toks, blocks)
    _prefill(eng, "warmup", toks, restored=restore(keys))
    eng.free("warmup")
    _prefill(eng, "warmup", toks, restored=restore.host_runs(keys))
    restore.release()
    eng.free("warmup")
    for k in keys:
        g2.delete(k)


def _prefill(eng: Any, seq: str, toks: list[int], restored: Any = None,
             cap: int | None = None) -> float:
    from engine import SamplingParams

    return timed(lambda: eng.prefill(seq, toks, sampling=SamplingParams(max_tokens=1),
                                     restored=restored, max_restore_tokens=cap),
                 repeats=1, warmup=0, sync=lambda: _sync(eng)).min


def _keys(eng: Any, toks: list[int]) -> list[bytes]:
    from kvstore.keys import chain_keys

    return chain_keys(toks, block_tokens=eng.layout.block_tokens, tenant="bench",
                      fingerprint=eng.fingerprint)


def _store(eng: Any, tier: Any, toks: list[int], blocks: torch.Tensor) -> list[bytes]:
    """Put blocks [0, n) of ``toks`` into a tier; returns their keys."""
    from kvstore.blockfile import BlockMeta

    keys = _keys(eng, toks)[:blocks.shape[0]]
    host = blocks.to("cpu").contiguous()
    for i, key in enumerate(keys):
        meta = BlockMeta(key, eng.fingerprint_hex, eng.layout.name, eng.layout.block_tokens,
                         "agent", time.time() + 3600)
        tier.put(key, host[i].reshape(-1).view(torch.uint8).numpy().data, meta)
    return keys


class ArenaRestore:
    """G2 arena -> device: locate the leading stored blocks, then copy runs of
    adjacent arena slots with one DMA each into a staging tensor allocated
    once (a server keeps its staging area too)."""

    def __init__(self, eng: Any, g2: Any, max_blocks: int) -> None:
        self.eng, self.g2 = eng, g2
        self.staging = torch.empty((max_blocks, *eng.layout.block_shape), dtype=eng.dtype,
                                   device=eng.device)
        self.copy_s = 0.0
        self.copies = 0

    def _slots(self, keys: Sequence[bytes]) -> list[Any]:
        slots = []
        for key in keys[:self.staging.shape[0]]:
            slot = self.g2.locate(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def _runs(self, slots: list[Any]) -> list[tuple[int, int, int]]:
        """(first block, blocks, arena offset) of each run of adjacent slots."""
        nbytes, out, i = self.eng.layout.block_nbytes, [], 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j].offset == slots[j - 1].offset + nbytes:
                j += 1
            out.append((i, j - i, slots[i].offset))
            i = j
        return out

    def _check(self, slots: list[Any], gen: int) -> None:
        # Trust the copy only if no slot can have been reused meanwhile (kvstore.tiers.shm).
        if self.g2._generation != gen or time.monotonic() >= min(
                (s.valid_until for s in slots), default=float("inf")):
            raise RuntimeError("G2 slots were reused during the restore (arena too small)")

    def __call__(self, keys: Sequence[bytes]) -> torch.Tensor:
        """[n, *block_shape] on the device for the leading stored keys."""
        eng, g2 = self.eng, self.g2
        slots = self._slots(keys)
        n, nbytes = len(slots), eng.layout.block_nbytes
        dst = self.staging[:n].view(-1).view(torch.uint8)
        # The tier's own mapping: the address range its cudaHostRegister pinned.
        arena = torch.frombuffer(g2._live_buf(), dtype=torch.uint8)
        gen = g2._generation
        t0 = time.perf_counter()
        runs = self._runs(slots)
        for i, k, start in runs:
            dst[i * nbytes:(i + k) * nbytes].copy_(arena[start:start + k * nbytes],
                                                   non_blocking=True)
        self.copies = len(runs)
        _sync(eng)
        self.copy_s = time.perf_counter() - t0
        self._check(slots, gen)
        return self.staging[:n]

    def host_runs(self, keys: Sequence[bytes]) -> Any:
        """The leading stored keys as views of the pinned arena itself
        (engine.layer_restore.HostRuns): the engine copies them layer by layer
        under the suffix's compute."""
        from engine.layer_restore import HostRuns

        eng = self.eng
        slots = self._slots(keys)
        self._gen, self._held = self.g2._generation, slots
        arena = torch.frombuffer(self.g2._live_buf(), dtype=torch.uint8)
        nbytes = eng.layout.block_nbytes
        return HostRuns(tuple(
            arena[start:start + k * nbytes].view(eng.dtype).view(k, *eng.layout.block_shape)
            for _, k, start in self._runs(slots)))

    def release(self) -> None:
        """After a ``host_runs`` prefill: the slots must not have been reused."""
        self._check(self._held, self._gen)


def _memcpy_peak(eng: Any, nbytes: int) -> float:
    """Pinned host -> device copy of ``nbytes``: best of 3, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=eng.device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=eng.device)
    best = timed(lambda: dst.copy_(src, non_blocking=True), repeats=3, warmup=0,
                 sync=lambda: _sync(eng)).min
    return nbytes / best / 1e9


def _one_length(eng: Any, g2: Any, g3: Any, restore: ArenaRestore, n: int,
                fractions: Sequence[float], gen: torch.Generator, single: Any
                ) -> tuple[list[LengthResult], DiskResult]:
    """The cold run stores the longest prefix any fraction needs; each hit
    prompt shares its own prefix and differs after it."""
    B = eng.layout.block_tokens
    toks = _tokens(eng, n, gen)
    _prefill(single, "warm", toks)          # one untimed run: kernels, allocator
    single.free("warm")
    single_s = _prefill(single, "single", toks)
    single.free("single")
    ttft_cold = _prefill(eng, "cold", toks)
    prefixes = [min(int(f * n) // B, (n - 1) // B) for f in fractions]
    blocks = eng.export_blocks("cold", 0, max(prefixes))
    eng.free("cold")
    keys = _store(eng, g2, toks, blocks)
    results, suffix_s = [], 0.0
    for f, prefix in zip(fractions, prefixes, strict=True):
        hit_toks = toks[:prefix * B] + _tokens(eng, n - prefix * B, gen)
        hit_keys = _keys(eng, hit_toks)
        # Staged: every block copied to the device, then the suffix computed.
        _sync(eng)
        t0 = time.perf_counter()
        restored = restore(hit_keys)
        cap = eng.hit_rule.usable_tokens(restored.shape[0] * B, n)
        compute_s = _prefill(eng, "hit", hit_toks, restored=restored, cap=cap)
        ttft_staged = time.perf_counter() - t0
        eng.free("hit")
        # Pipelined (the default on CUDA): layer l's copy runs under layer l-1's compute.
        _sync(eng)
        t0 = time.perf_counter()
        runs = restore.host_runs(hit_keys)
        _prefill(eng, "hit", hit_toks, restored=runs, cap=cap)
        ttft_hit = time.perf_counter() - t0
        restore.release()
        eng.free("hit")
        nbytes = restored.shape[0] * eng.layout.block_nbytes
        results.append(LengthResult(n, f, cap, ttft_cold, ttft_hit, nbytes, restore.copy_s,
                                    _memcpy_peak(eng, nbytes), restore.copies, compute_s,
                                    single_s, ttft_staged))
        if f == HIT_FRACTION:
            suffix_s = compute_s
    for k in keys:
        g2.delete(k)
    # The case for the disk: the 90 % prefix (else the first fraction's).
    i = fractions.index(HIT_FRACTION) if HIT_FRACTION in fractions else 0
    suffix_s = suffix_s or results[i].ttft_hit_s
    disk = _disk_choice(eng, g3, toks, blocks[:prefixes[i]], ttft_cold, suffix_s)
    return results, disk


def _drop_page_cache(root: Path) -> None:
    """Evict the G3 files from the page cache so reads come from the device."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_to_device(eng: Any, g3: Any, keys: Sequence[bytes]) -> float:
    """Seconds to read blocks from G3 (verified) into a pinned buffer and to the device."""
    nbytes = eng.layout.block_nbytes
    host = torch.empty(len(keys) * nbytes, dtype=torch.uint8,
                       pin_memory=eng.device.type == "cuda")
    _sync(eng)
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        hit = g3.get(key)
        if hit is None:
            raise RuntimeError(f"G3 lost block {key.hex()}")
        host[i * nbytes:(i + 1) * nbytes].copy_(torch.frombuffer(hit.payload, dtype=torch.uint8))
    host.to(eng.device, non_blocking=True)
    _sync(eng)
    return time.perf_counter() - t0


def _disk_choice(eng: Any, g3: Any, toks: list[int], blocks: torch.Tensor, ttft_cold: float,
                 suffix_compute_s: float) -> DiskResult:
    from service.config import CostConfig
    from service.cost import CostModel

    B = eng.layout.block_tokens
    keys = _store(eng, g3, toks, blocks)
    root = Path(g3.root) if hasattr(g3, "root") else None
    if root is not None:
        _drop_page_cache(root)
    probe = keys[:max(1, min(4, len(keys)))]
    probe_s = _read_to_device(eng, g3, probe)
    cost = CostModel(CostConfig(), block_nbytes=eng.layout.block_nbytes, block_tokens=B)
    cost.observe_prefill(len(toks), ttft_cold, calibrate=True)
    for _ in range(8):          # the probe replaces the prior (EWMA)
        cost.observe_fetch({"G3": len(probe)}, len(probe) * eng.layout.block_nbytes, probe_s)
    plan = cost.plan(["G3"] * len(keys), 0, len(keys))
    if root is not None:
        _drop_page_cache(root)
    fetch_s = _read_to_device(eng, g3, keys) + suffix_compute_s
    for k in keys:
        g3.delete(k)
    return DiskResult(len(toks), len(keys),
                      len(probe) * eng.layout.block_nbytes / probe_s / 1e9, plan.fetch_all_s,
                      plan.recompute_s, plan.decision, fetch_s, ttft_cold)
