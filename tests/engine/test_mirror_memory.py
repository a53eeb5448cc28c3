"""A sequence's contiguous KV mirror lives outside the pool (engine/attention.py),
so it is allocated only while something reads it (issue 18 run 4: 64 decode
sequences' mirrors, 1.5x their prompts' KV each, OOMed the decode process on
the H200). A released mirror is rebuilt from the pool by the next decode step,
with the same bits. The CPU's invariant kernels read the pool itself: there,
no sequence ever has one."""

from __future__ import annotations

import pytest

from engine import SamplingParams, bik
from engine.errors import EngineInputError
from tests.engine.conftest import make_engine, random_prompts

SP = SamplingParams(max_tokens=24, ignore_eos=True)


def _kv_bytes(engine: object, tokens: int) -> int:
    L, two, H, _, D = engine.layout.block_shape          # type: ignore[attr-defined]
    return L * two * H * tokens * D * 4                   # fp32


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_released_mirror_costs_nothing_and_decode_rebuilds_it_exactly(kernels: str) -> None:
    eng = make_engine("tiny-dense", kernels=kernels)
    paged = kernels == "auto" and bik.paged()       # attention reads the pool
    prompts = random_prompts(3, 40, 150, 256, seed=5)
    want = [eng.generate(p, SP).tokens for p in prompts]
    assert eng.memory().mirror_bytes == 0                 # nothing live
    for i, p in enumerate(prompts):
        eng.prefill(f"s{i}", p, sampling=SP)
    # The torch path reads mirrors: each prompt has one, with room to decode.
    held = eng.memory().mirror_bytes
    if paged:
        assert held == 0
    else:
        assert held >= sum(_kv_bytes(eng, len(p)) for p in prompts)
    for i in range(len(prompts)):
        eng.release_mirror(f"s{i}")
    assert eng.memory().mirror_bytes == 0
    ids = [f"s{i}" for i in range(len(prompts))]
    while any(eng.finish_reason(s) is None for s in ids):
        eng.decode_step([s for s in ids if eng.finish_reason(s) is None])
    assert [eng.seq_tokens(s)[len(p):] for s, p in zip(ids, prompts, strict=True)] == want
    assert (eng.memory().mirror_bytes > 0) is not paged   # rebuilt for decode
    for s in ids:
        eng.free(s)
    assert eng.memory().mirror_bytes == 0
    with pytest.raises(EngineInputError):
        eng.release_mirror("s0")                          # no longer live


def test_cpu_engines_report_no_device_memory() -> None:
    mem = make_engine("tiny-dense").memory()
    assert (mem.device_allocated_bytes, mem.device_peak_reserved_bytes,
            mem.device_cap_bytes) == (0, 0, 0)
