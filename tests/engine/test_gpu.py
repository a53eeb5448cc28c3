"""CUDA paths (skipped without a GPU): exact restore on the device, pinned export."""

from __future__ import annotations

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


def test_llama_8b_shape_builds_on_gpu() -> None:
    eng = make_engine("llama-8b-shape", device="cuda", dtype="bfloat16", block_tokens=64,
                      num_blocks=64)
    assert eng.layout.name == "L32xH8xT64xD128:bfloat16"
    assert eng.generate(list(range(100)), SamplingParams(max_tokens=4)).tokens
