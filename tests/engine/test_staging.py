"""Staged hand-off copies (engine.staging): the same bytes as one plain copy,
whatever the chunking, with the checksum of what was read; CPU here, the same
loops drive the pinned DMA on CUDA."""

from __future__ import annotations

import gc
import os
import tempfile

import pytest
import torch

from engine import SamplingParams
from engine.errors import EngineInputError
from engine.kv_pool import KVLayout, KVStorage
from engine.staging import CaptureGuard, DeviceBudget, PinnedChunks, export_rows, upload_file
from service import kv_shm
from tests.engine.conftest import make_engine


def _storage() -> KVStorage:
    lay = KVLayout(layers=3, kv_heads=2, block_tokens=4, head_dim=8, dtype="float32")
    st = KVStorage(lay, num_blocks=10, device=torch.device("cpu"))
    st.data.copy_(torch.randn(st.data.shape, generator=torch.Generator().manual_seed(1)))
    return st


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4096, 1 << 20])
def test_export_tokens_into_is_export_tokens_at_any_chunking(chunk_bytes: int) -> None:
    """Rows grouped into chunks (one row per chunk, several, all; a row larger
    than a chunk) land where one gather puts them."""
    st = _storage()
    slots = torch.tensor([9, 3, 4, 5, 30, 31, 0])
    want = st.export_tokens(slots)
    out = torch.full_like(want, float("nan"))       # every element must be written
    chunks = PinnedChunks(sets=1, chunk_bytes=chunk_bytes, pin=False)
    assert st.export_tokens_into(slots, out, chunks) is out
    assert torch.equal(out, want)


def test_export_rows_needs_a_contiguous_row_layout() -> None:
    rows = torch.randn(6, 20, 8)
    slots = torch.tensor([19, 0, 7])
    out = torch.empty(6, 3, 8)
    export_rows(rows, slots, out, PinnedChunks(sets=2, chunk_bytes=200, pin=False))
    assert torch.equal(out, rows.index_select(1, slots))


def _file(data: bytes) -> str:
    fd, path = tempfile.mkstemp()
    os.write(fd, data)
    os.close(fd)
    return path


@pytest.mark.parametrize("chunk_bytes", [7, 256, 1 << 20])
def test_upload_file_copies_and_checksums_what_it_read(chunk_bytes: int) -> None:
    src = torch.randn(3, 2, 2, 5, 8)
    raw = src.numpy().tobytes()
    path = _file(b"\x01" * 13 + raw)
    try:
        dest = torch.empty_like(src)
        fd = os.open(path, os.O_RDONLY)
        try:
            digest = upload_file(fd, 13, dest, PinnedChunks(sets=1, chunk_bytes=chunk_bytes,
                                                            pin=False), seed=42)
        finally:
            os.close(fd)
        assert torch.equal(dest, src)
        assert digest == kv_shm.piece_checksum(raw, 42)
        assert digest != kv_shm.piece_checksum(raw, 43)
    finally:
        os.unlink(path)


def test_upload_file_refuses_a_short_file() -> None:
    path = _file(b"\x00" * 100)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(ValueError, match="short"):
                upload_file(fd, 0, torch.empty(64), PinnedChunks(sets=1, chunk_bytes=64,
                                                                 pin=False), seed=0)
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def test_pinned_chunks_are_made_once_and_shared_in_turn() -> None:
    chunks = PinnedChunks(sets=1, chunk_bytes=16, pin=False)
    with chunks.take() as a:
        pass
    with chunks.take() as b:
        assert b[0] is a[0] and b[1] is a[1]


def test_device_budget_comes_back_when_the_tensor_goes() -> None:
    budget = DeviceBudget(100)
    assert budget.take(60) and not budget.take(50)
    t = budget.hold(torch.empty(15), 60)
    assert budget.used == 60
    del t
    gc.collect()
    assert budget.used == 0 and budget.take(100)
    budget.give(100)
    assert budget.used == 0


def test_engine_export_into_a_destination_is_its_plain_export() -> None:
    """The copy-out prefill hands decode (``Engine.export_tokens(out=, chunks=)``,
    slots from the host block list) equals the plain export, from any start;
    a destination of the wrong shape is refused before anything is written."""
    eng = make_engine("tiny-hybrid")
    prompt = list(range(3, 80))
    eng.prefill("p", prompt, sampling=SamplingParams(max_tokens=1))
    L, _, H, _, D = eng.layout.block_shape
    chunks = PinnedChunks(sets=1, chunk_bytes=512, pin=False)
    for start in (0, 17, 76):
        want = eng.export_tokens("p", start, len(prompt))
        out = torch.full((L, 2, H, len(prompt) - start, D), float("nan"), dtype=eng.dtype)
        assert eng.export_tokens("p", start, len(prompt), out=out, chunks=chunks) is out
        assert torch.equal(out, want)
    with pytest.raises(EngineInputError, match="does not fit"):
        eng.export_tokens("p", 0, len(prompt), out=torch.empty(L, 2, H, 3, D, dtype=eng.dtype))


def test_a_graph_capture_waits_for_copies_and_holds_new_ones_back() -> None:
    """H200 stack run (2026-12-02): a decode graph captured while a pull's
    staged upload ran on another thread failed, and every later step with it."""
    import threading
    import time

    guard = CaptureGuard()
    seen: list[str] = []
    copying, captured = threading.Event(), threading.Event()

    def copy() -> None:
        with guard.copy():
            copying.set()
            time.sleep(0.2)
            seen.append("copy done")

    def later_copy() -> None:
        captured.wait()
        with guard.copy():
            seen.append("later copy")

    def capture() -> None:
        copying.wait()
        with guard.capture():
            seen.append("capture")
            captured.set()
            time.sleep(0.1)
            seen.append("capture done")

    threads = [threading.Thread(target=f) for f in (copy, capture, later_copy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert seen == ["copy done", "capture", "capture done", "later copy"]


def test_host_copy_gives_the_tensor_on_the_host_once() -> None:
    """CPU: the gathered blocks are already on the host; ``wait`` hands them
    over once (a second wait is a caller's bug, not a silent empty copy)."""
    from engine.staging import HostCopy

    st = _storage()
    want = st.export(torch.tensor([4, 1, 7]))
    got = HostCopy.start(st.export(torch.tensor([4, 1, 7]), on_device=True))
    assert got.nbytes == want.numel() * want.element_size()
    assert torch.equal(got.wait(), want)
    with pytest.raises(RuntimeError, match="twice"):
        got.wait()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copy_on_cuda_waits_for_the_gather_not_the_engine_thread() -> None:
    """The copy is ordered after the gather queued on the engine's stream (the
    pool is overwritten right after: the copy must still see the old bytes)
    and lands in pinned memory."""
    from engine.staging import HostCopy

    lay = KVLayout(layers=4, kv_heads=2, block_tokens=16, head_dim=64, dtype="bfloat16")
    st = KVStorage(lay, num_blocks=64, device=torch.device("cuda"))
    st.data.copy_(torch.randn(st.data.shape, device="cuda"))
    ids = torch.tensor([5, 0, 63, 9], device="cuda")
    want = st.export(ids).clone()
    copy = HostCopy.start(st.export(ids, on_device=True))
    st.data.zero_()                     # queued after the gather on the same stream
    out = copy.wait()
    assert out.is_pinned() and torch.equal(out, want)
