"""Restored blocks given as runs of host memory (engine.layer_restore.HostRuns):
accepted wherever a block tensor is, with the same result; bad runs refused."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import EngineInputError
from engine.layer_restore import HostRuns, feed_applies
from tests.engine.conftest import make_engine, random_prompts


def test_host_runs_restore_like_one_tensor() -> None:
    a, b = make_engine("tiny-dense"), make_engine("tiny-dense")
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for prompt in random_prompts(3, 100, 220, 256, seed=5):
        want = a.generate(prompt, sp).tokens
        a.prefill("x", prompt)
        blocks = a.export_blocks("x")
        a.free("x")
        runs = HostRuns((blocks[:1].clone(), blocks[1:3].clone(), blocks[3:].clone()))
        assert runs.n_blocks == blocks.shape[0]
        assert torch.equal(runs.head(2).cat(), blocks[:2])
        for k in (1, 2, 3):
            assert torch.equal(runs.skip(k).cat(), blocks[k:])
        res = b.prefill("y", prompt, restored=runs)
        assert res.restored_tokens > 0
        b.free("y")
        assert b.generate(prompt, sp, restored=runs).tokens == want
        assert not feed_applies(b.device, runs)          # CPU: imported in one copy


def test_host_runs_are_checked() -> None:
    eng = make_engine("tiny-dense")
    eng.prefill("x", list(range(1, 200)))
    blocks = eng.export_blocks("x")
    eng.free("x")
    with pytest.raises(ValueError, match="at least one run"):
        HostRuns(())
    with pytest.raises(ValueError, match="differ"):
        HostRuns((blocks[:1], blocks[1:2].double()))
    with pytest.raises(ValueError, match="contiguous"):
        HostRuns((blocks.transpose(0, 1),))
    wrong = HostRuns((blocks[:, :1].contiguous(),))                # one layer only
    with pytest.raises(EngineInputError, match="restored blocks"):
        eng.prefill("y", list(range(1, 200)), restored=wrong)
