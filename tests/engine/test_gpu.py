"""CUDA paths (skipped without a GPU): exact restore on the device, pinned export."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import make_engine, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_restore_on_gpu_is_exact_and_export_is_pinned() -> None:
    a, b = make_engine("tiny-hybrid", device="cuda"), make_engine("tiny-hybrid", device="cuda")
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    for prompt in random_prompts(4, 40, 120, 256, seed=1):
        cold = a.generate(prompt, sp)
        a.prefill("x", prompt)
        blocks = a.export_blocks("x")
        a.free("x")
        assert blocks.device.type == "cpu" and blocks.is_pinned()
        assert b.generate(prompt, sp, restored=blocks).tokens == cold.tokens


def test_layer_pipelined_restore_equals_the_one_copy_restore() -> None:
    """Per-layer copies on a side stream (from one pinned tensor, from runs of
    it, and the pageable fallback) leave the same pool bits and tokens as the
    one-copy import."""
    from dataclasses import replace

    from engine import Engine
    from engine.layer_restore import HostRuns, feed_applies

    a = make_engine("tiny-hybrid", device="cuda")
    staged = Engine(replace(a.config, layer_restore=False))
    piped = Engine(a.config)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for prompt in random_prompts(3, 90, 200, 256, seed=3):
        want = a.generate(prompt, sp).tokens
        a.prefill("x", prompt)
        blocks = a.export_blocks("x")
        a.free("x")
        assert feed_applies(piped.device, blocks)
        half = blocks.shape[0] // 2
        sources = [blocks, HostRuns((blocks[:half].clone().pin_memory(),
                                     blocks[half:].clone().pin_memory())),
                   blocks.clone()]                                   # pageable: one copy
        ref = staged.prefill("r", prompt, restored=blocks)
        ref_kv = staged.export_blocks("r")
        staged.free("r")
        for src in sources:
            got = piped.prefill("p", prompt, restored=src)
            assert got.restored_tokens == ref.restored_tokens > 0
            assert torch.equal(piped.export_blocks("p"), ref_kv)
            piped.free("p")
            assert piped.generate(prompt, sp, restored=src).tokens == want


def test_llama_8b_shape_builds_on_gpu() -> None:
    eng = make_engine("llama-8b-shape", device="cuda", dtype="bfloat16", block_tokens=64,
                      num_blocks=64)
    assert eng.layout.name == "L32xH8xT64xD128:bfloat16"
    assert eng.generate(list(range(100)), SamplingParams(max_tokens=4)).tokens


def _reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                      window: int) -> torch.Tensor:
    # q: [B, H, D]; k, v: [B, Hkv, T, D] contiguous per row -> [B, H * D] in fp64
    out = []
    group = q.shape[1] // k.shape[1]
    for i, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        kk = k[i, :, lo:n].double().repeat_interleave(group, 0)
        vv = v[i, :, lo:n].double().repeat_interleave(group, 0)
        s = (kk @ q[i].double().unsqueeze(-1)).squeeze(-1) / q.shape[-1] ** 0.5
        out.append((s.softmax(-1).unsqueeze(1) @ vv).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_kernel_matches_reference(window: int, splits: int) -> None:
    from engine.paged_decode import paged_decode

    g = torch.Generator(device="cuda").manual_seed(window + splits)
    B, H, Hkv, D, BT, nb = 5, 32, 8, 128, 64, 64
    lens = [1, 63, 64, 300, 1000]
    kpool = torch.randn(Hkv, nb, BT, D, device="cuda", generator=g, dtype=torch.bfloat16)
    vpool = torch.randn(Hkv, nb, BT, D, device="cuda", generator=g, dtype=torch.bfloat16)
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros(B, 16, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // BT)
        tables[i, :k] = perm[used:used + k]
        used += k
    q = torch.randn(B, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    acc = torch.full((B, splits, H, D), float("nan"), device="cuda")
    ml = torch.full((B, splits, H, 2), float("nan"), device="cuda")
    out = paged_decode(q, kpool, vpool, tables, torch.tensor(lens, dtype=torch.int32,
                       device="cuda"), window, splits, acc, ml)
    # contiguous copies of each row's keys, in table order
    kc = torch.stack([kpool[:, tables[i].long()].reshape(Hkv, -1, D) for i in range(B)])
    vc = torch.stack([vpool[:, tables[i].long()].reshape(Hkv, -1, D) for i in range(B)])
    ref = _reference_decode(q, kc, vc, lens, window)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err < 1e-2, err


@pytest.mark.parametrize("graphs", [False, True])
def test_paged_decode_engine_matches_sdpa_path(graphs: bool) -> None:
    """fp32 tiny model: paged decode (with and without CUDA graphs) gives the same
    greedy tokens as the per-sequence SDPA path, alone and in a mixed batch."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = make_engine("tiny-hybrid", device="cuda", paged_decode=False)
    eng = make_engine("tiny-hybrid", device="cuda", cuda_graphs=graphs)
    assert eng._paged is not None
    # Every bucket's graph captured up front (a decode instance's start-up) serves
    # the same tokens as one captured at its first use.
    assert eng.capture_decode_graphs() == (7 if graphs else 0)
    prompts = random_prompts(6, 20, 200, 256, seed=3)
    want = [ref.generate(p, sp).tokens for p in prompts]
    assert [eng.generate(p, sp).tokens for p in prompts] == want
    ids = [f"s{i}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts, strict=True):
        eng.prefill(i, p, sampling=sp)
    for _ in range(23):
        eng.decode_step(ids)
    assert [eng.seq_tokens(i)[len(p):] for i, p in zip(ids, prompts, strict=True)] == want


@pytest.mark.parametrize("kernels", ["triton_bi", "triton"])
def test_paged_decode_sequences_hold_no_mirrors(kernels: str) -> None:
    """Paged decode reads the pool, and so does triton_bi's prefill: no sequence
    keeps a mirror once its prompt is computed (with triton, SDPA prefill chunks
    read one until then), adopted sequences never get one, an adopted copy of a
    prompt decodes as the prompt did, and with triton_bi the tokens are those of
    the non-paged path (issue 18 run 4: the mirrors OOMed decode on the H200)."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = make_engine("tiny-hybrid", device="cuda", kernels=kernels)
    prompts = random_prompts(4, 40, 200, 256, seed=9)
    ids = [f"s{i}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts, strict=True):
        eng.prefill(i, p, sampling=sp)
    assert eng.memory().mirror_bytes == 0
    first = eng.seq_tokens("s0")[len(prompts[0])]
    eng.adopt("a", prompts[0], eng.export_tokens("s0", 0, len(prompts[0])).to("cuda"), first,
              sp)
    assert eng.memory().mirror_bytes == 0
    before = torch.cuda.memory_allocated()
    for _ in range(23):
        eng.decode_step([*ids, "a"])
        assert eng.memory().mirror_bytes == 0
    # graphs + a block or two, and with torch.mm (kernels="triton") cuBLAS's
    # workspace for each stream it first runs on here, 32 MiB each on Hopper: the
    # graph's warm-up side stream and torch's capture stream (66.1 MiB on the H200
    # once the engine's start had collected earlier tests' engines; the 64 MiB
    # bound before held only while their garbage was freed inside this loop)
    grown = torch.cuda.memory_allocated() - before
    assert grown < 128 * 2**20, grown
    got = [eng.seq_tokens(i)[len(p):] for i, p in zip(ids, prompts, strict=True)]
    assert eng.seq_tokens("a")[len(prompts[0]):] == got[0]
    if kernels == "triton_bi":      # invariant: bit-exact against the non-paged decode
        ref = make_engine("tiny-hybrid", device="cuda", kernels=kernels, paged_decode=False)
        assert got == [ref.generate(p, sp).tokens for p in prompts]


def test_staged_decode_inputs_and_fused_draw_step_as_main_did() -> None:
    """engine/step_inputs.py's inputs (the block table sent only when a row's list
    changed) and the fused draw (bf16 logits widened in the kernel, one pick
    launch) give, step after step, the tokens of main's path before issue 21
    (every input rebuilt, an fp32 copy, torch's pick), greedy and sampled rows
    alike, through batches that shrink, reorder, regrow and cross blocks."""
    from engine import draw

    prompts = random_prompts(5, 20, 120, 256, seed=11)
    params = [SamplingParams(max_tokens=64, ignore_eos=True, seed=i,
                             temperature=(0.0, 0.9, 1.3)[i % 3], top_p=(1.0, 0.8)[i % 2])
              for i in range(len(prompts))]
    engines = [make_engine("tiny-hybrid", device="cuda", dtype="bfloat16",
                           kernels="triton_bi") for _ in range(2)]
    new, old = engines
    assert new._paged is not None and old._paged is not None
    old._paged.staged = False
    ids = [f"s{i}" for i in range(len(prompts))]
    for eng in engines:
        for i, p, sp in zip(ids, prompts, params, strict=True):
            eng.prefill(i, p, sampling=sp)
    batches = [ids] * 6 + [ids[3:0:-1]] * 6 + [ids[::-1]] * 6 + [ids[:2]] * 4 + [ids] * 18
    for batch in batches:
        draw.FUSED = False
        try:
            want = old.decode_step(batch)
        finally:
            draw.FUSED = True
        assert new.decode_step(batch) == want, batch
    assert [new.seq_tokens(i) for i in ids] == [old.seq_tokens(i) for i in ids]
    # the table went over only when a row's blocks changed: not every step
    sends = sum(ins.table_sends for ins in new._paged._inputs.values())
    assert 0 < sends < len(batches), sends


def test_a_gpu_share_too_small_for_weights_pool_and_a_context_refuses_to_start() -> None:
    """``gpu_fraction`` caps the process (two engines share one GPU): an engine
    whose share cannot hold its weights, its pool and one context's KV twice
    fails at start with the figures, not a request later with an OOM."""
    from engine.errors import DeviceError

    total = torch.cuda.get_device_properties(0).total_memory
    # cuBLAS keeps a live workspace per (handle, stream) in torch's cache, carved
    # from whatever free block fitted when the tests before (kernels=triton) first
    # ran a GEMM on that stream, and a live block keeps its whole segment
    # reserved (main's whole GPU set, test_gpu.py first, on the H200: 964 MiB).
    # Those tests' engines are garbage now, so nothing replays into them; an
    # engine's start cannot drop them (a live engine's graphs may).
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    # what the tests before this one left in this process (their engines are
    # reference cycles, freed by the collector): the engine's start drops it
    left = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    try:
        with pytest.raises(DeviceError, match="gpu_fraction"):
            make_engine("tiny-dense", device="cuda", num_blocks=4096,
                        gpu_fraction=(4096 * 16 * 2**10) / total)   # about the pool alone
        eng = make_engine("tiny-dense", device="cuda", gpu_fraction=0.5)
        mem = eng.memory()
        assert mem.device_cap_bytes == int(0.5 * total)
        # what loading freed went back to the driver, not to this process's cache
        cached = mem.device_reserved_bytes - mem.device_allocated_bytes
        print(f"cached-but-unused before the engines {left / 2**20:.1f} MiB, after the start "
              f"{cached / 2**20:.1f} MiB ({mem.device_allocated_bytes / 2**20:.1f} MiB "
              f"allocated)")
        assert cached < 32 * 2**20, (cached, left, mem, _pinned_segments())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _pinned_segments() -> list[tuple[int, list[int]]]:
    """Segments holding more than 32 MiB unused: (size, sizes of their live blocks),
    what keeps them from the driver."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        live = [b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"]
        if seg["total_size"] - sum(live) > 32 * 2**20:
            out.append((seg["total_size"], live))
    return out
