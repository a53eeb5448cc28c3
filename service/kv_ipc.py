"""Same-GPU hand-off of a prompt's KV through CUDA IPC (issue 18, run 11).

When prefill and decode run on the same CUDA device (their device UUIDs match;
decode names its own in ``PullKVRequest.ipc_device``), prefill keeps the KV as
one contiguous device tensor (a staging copy gathered out of its pool) and
shares its storage the way torch.multiprocessing does (``_share_cuda_``: an
IPC handle of the allocation, the offset in it, and a reference counter in a
small shared-memory file of the producer). Decode opens it, copies it device
to device into a tensor of its own, checks that copy (``device_digest``)
and drops the mapping, which counts the producer's reference back down; then
it releases the handle and prefill frees the staging copy.

Lifetimes: a staging copy is shared only when an IPC pull asks for it, so an
entry nobody pulls is plain device memory, freed by the buffer's usual drop.
Once shared, torch keeps a freed block in its limbo while the counter says a
consumer may still map it; decode's close brings it to zero. A decode killed
between the share and its close never does: prefill's hold (``ipc_hold_s``)
then reads the counter and, if the decode process named in the request is
gone, counts its reference down for it (``release_orphan``), so the block
returns to prefill's allocator instead of staying in limbo for the process's
life.

Integrity: the bytes never pass through a file a third process can open; the
64-byte handle travels only in the authenticated PullKV reply. Decode still
checks what it adopts: ``device_digest`` is a keyed linear hash over the
KV's 32-bit words with weights drawn from the handle's secret ``kv_seed``
(two independent 64-bit lanes), computed by prefill on its staging copy and
by decode on its own copy after the device-to-device copy. A change chosen
without the seed gets past one level of a lane with probability at most
2**-33, a lane at most about 2**-28, both lanes about 2**-56.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from service import kv_shm

_WIDTH = 4096               # 32-bit words a row of the digest; its weights repeat per row
_DIGEST_ROWS = 1024         # rows hashed per pass (bounds the int64 temporaries: 32 MiB)
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Share:
    """What a consumer needs to map a producer's storage (torch's ``_share_cuda_``)."""

    handle: bytes               # cudaIpcMemHandle of the allocation
    storage_bytes: int
    offset_bytes: int           # of the storage in the allocation
    ref_handle: bytes           # the producer's reference-counter file
    ref_offset: int
    event_handle: bytes
    event_sync: bool


def device_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device (what two processes compare: indexes differ with
    ``CUDA_VISIBLE_DEVICES``); "" for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def peer_id() -> str:
    """This process as ``<pid namespace>-<pid>`` (hex, decimal): lets prefill
    tell whether a decode that never closed a mapping is still alive."""
    return f"{kv_shm.pid_namespace():x}-{os.getpid()}"


def peer_gone(peer: str) -> bool:
    """Whether the process ``peer_id`` named is known to be gone (False when
    unknown: another pid namespace, or a malformed id)."""
    try:
        ns, pid = peer.split("-", 1)
        if int(ns, 16) != kv_shm.pid_namespace():
            return False
        return not kv_shm.alive(int(pid))
    except ValueError:
        return False


def share(t: torch.Tensor) -> Share:
    """Share ``t``'s storage (contiguous, CUDA) with another process; each call
    adds one reference the consumer's close (or ``release_orphan``) takes back."""
    (_dev, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = t.untyped_storage()._share_cuda_()
    return Share(handle, size, offset, ref_handle, ref_offset,
                 event_handle or b"", bool(event_sync))


def open_shared(s: Share, device: torch.device, dtype: torch.dtype,
                dims: tuple[int, ...]) -> torch.Tensor:
    """Map the producer's storage on ``device`` (this process's index of the same
    GPU) as a tensor of ``dims``; dropping it counts the reference down."""
    nbytes = dtype.itemsize
    for d in dims:
        nbytes *= d
    if nbytes > s.storage_bytes:
        raise ValueError(f"shared storage of {s.storage_bytes} bytes, {nbytes} expected")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(),
        s.handle, s.storage_bytes, s.offset_bytes, s.ref_handle, s.ref_offset,
        s.event_handle, s.event_sync)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, dims)


def release_unopened(s: Share, device: torch.device) -> None:
    """Give the reference back without mapping (the consumer will not open it)."""
    with torch.cuda.device(device):
        torch.UntypedStorage._release_ipc_counter_cuda(s.ref_handle, s.ref_offset)


def references(s: Share, shm_dir: str = "/dev/shm") -> int | None:
    """Consumers that still hold (or have yet to close) the shared storage: the
    producer's counter, read from its file; None when it cannot be read."""
    name = s.ref_handle.decode(errors="replace").lstrip("/")
    try:
        with open(Path(shm_dir) / name, "rb") as f:
            f.seek(8 * s.ref_offset)
            raw = f.read(8)
    except OSError:
        return None
    return struct.unpack("<q", raw)[0] if len(raw) == 8 else None


def release_orphan(s: Share, peer: str, device: torch.device,
                   shm_dir: str = "/dev/shm") -> bool:
    """A shared staging copy whose consumer died before closing it: count its
    references down for it (only when ``peer`` is known gone and the counter
    says they are still held), so the block can be freed. True when it did."""
    held = references(s, shm_dir)
    if not held or held < 0 or not peer_gone(peer):
        return False
    for _ in range(held):
        release_unopened(s, device)
    return True


def _weights(seed: int, n: int, lane: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed ^ (0x9E3779B97F4A7C15 * (lane + 1))) & ((1 << 63) - 1))
    w = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=g)
    hi = torch.randint(0, 2, (n,), dtype=torch.int64, generator=g) << 62
    return (w ^ hi).to(device)     # all 64 bits random


def device_digest(t: torch.Tensor, seed: int) -> bytes:
    """16 bytes keyed by ``seed`` over the bytes of contiguous ``t`` (any device,
    computed where ``t`` is): per lane, row sums of weight * word over the
    tensor's unsigned 32-bit words, then a weighted sum of the rows, both
    modulo 2**64. Bytes that differ anywhere change a lane unless the weights
    happen to cancel the difference (about 2**-28 at most for a change made
    without the seed). Equal on any two devices for equal bytes (integer
    arithmetic). ``t`` must be complete (its writes synchronized): on CUDA the
    digest runs on a stream of its own, never behind the step in flight on
    the default stream (run 11: queued there, it made a pull take 0.56 s)."""
    side = torch.cuda.Stream(t.device) if t.device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        return _digest(t, seed)


def _digest(t: torch.Tensor, seed: int) -> bytes:
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    pad = -n % (4 * _WIDTH)
    words = flat.view(torch.int32) if pad == 0 else torch.cat(
        [flat, flat.new_zeros(pad)]).view(torch.int32)
    rows = words.view(-1, _WIDTH)
    out = []
    for lane in range(2):
        cols = _weights(seed, _WIDTH, lane, t.device)
        row_w = _weights(seed, rows.shape[0], lane + 2, t.device)
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        for r0 in range(0, rows.shape[0], _DIGEST_ROWS):
            part = rows[r0:r0 + _DIGEST_ROWS].to(torch.int64) & _MASK32
            sums = (part * cols).sum(1)
            total += (sums * row_w[r0:r0 + _DIGEST_ROWS]).sum()
        out.append(int(total.item()) & ((1 << 64) - 1))
    return struct.pack("<QQ", *out)
