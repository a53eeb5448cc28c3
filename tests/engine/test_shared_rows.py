"""Shared prompt rows (engine/shared_rows.py): prompts that agree on a prefix
copy its KV from a sequence that has it (or computes it in the same forward)
instead of computing it, and every sequence's tokens and KV stay bit-identical
to its prefill alone; rows whose tokens agree after different histories are
never shared, nor rows of another tenant's (another share scope's) prompt."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, bik
from tests.engine.conftest import TINY, make_engine, random_prompts
from tests.engine.test_batched_prefill import GREEDY8, alone, mixed

needs_bik = pytest.mark.skipif(not bik.available(), reason="native._bik not built")
VOCAB = 256


def sharing_prompts(seed: int) -> list[list[int]]:
    """Prompts agreeing on prefixes below a block (16 tokens here), across block
    boundaries, whole (one prompt twice, one a prefix of another), and one that
    repeats another's tokens after a different head."""
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(150)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    p = [base[:11] + tail(30), base[:11] + tail(45), base[:40] + tail(20),
         base[:40] + tail(9), base[:100] + tail(33), base + tail(12)]
    p.append(list(p[-1]))                        # the same prompt again
    p.append(p[2] + tail(50))                    # another prompt's whole prompt, then more
    p.append(tail(24) + base[24:100] + tail(10))  # base's rows after a different head
    p += random_prompts(3, 20, 120, VOCAB, seed=seed)
    return p


@needs_bik
@pytest.mark.parametrize("model", TINY)
def test_shared_rows_keep_every_bit(model: str) -> None:
    prompts = sharing_prompts(7)
    ref = [alone(make_engine(model), p) for p in prompts]
    for seed in (1, 2, 3):
        eng = make_engine(model)
        toks, kvs = mixed(eng, prompts, [None] * len(prompts), [None] * len(prompts), seed,
                           scope="t")
        assert eng.shared_rows_total > 0, f"nothing shared (seed {seed})"
        for i in range(len(prompts)):
            assert toks[i] == ref[i][0], f"prompt {i}: tokens changed (seed {seed})"
            assert torch.equal(kvs[i], ref[i][1]), f"prompt {i}: KV bits changed (seed {seed})"


def _step_all(eng: Engine, sids: list[str]) -> None:
    budgets = dict.fromkeys(sids, 1000)
    while budgets:
        for d in eng.prefill_step(budgets):
            del budgets[d.seq_id]


@needs_bik
def test_prompts_arriving_together_compute_their_common_rows_once() -> None:
    """One step, 4 prompts agreeing on their first 40 tokens: one computes them,
    the other 3 copy them in that forward (3 x 40 rows), and none computes
    fewer rows than its own part."""
    eng = make_engine("tiny-dense")
    rng = random.Random(3)
    head = [rng.randrange(VOCAB) for _ in range(40)]
    prompts = [head + [rng.randrange(VOCAB) for _ in range(10 + i)] for i in range(4)]
    sids = [f"t{i}" for i in range(4)]
    for sid, p in zip(sids, prompts, strict=True):
        eng.admit(sid, p, sampling=GREEDY8, share_scope="t")
    done = eng.prefill_step(dict.fromkeys(sids, 1000))
    assert len(done) == 4
    assert eng.shared_rows_total == 3 * 40
    assert sorted(d.result.computed_tokens for d in done) == sorted(
        [len(prompts[0]), *(len(p) - 40 for p in prompts[1:])])
    for sid, p in zip(sids, prompts, strict=True):
        ref = alone(make_engine("tiny-dense"), p)
        for _ in range(7):
            eng.decode_step([sid])
        assert eng.seq_tokens(sid)[len(p):] == ref[0]
        assert torch.equal(eng.export_tokens(sid, 0, len(p) + 7), ref[1])


@needs_bik
def test_a_prompt_copies_rows_a_decoding_sequence_holds() -> None:
    """A sequence is decoding; a prompt of the same tenant agreeing with its
    first 30 tokens copies them from the pool before the forward; one agreeing
    only after a different first token, another tenant's with the same tokens
    and one admitted with no scope copy nothing."""
    eng = make_engine("tiny-dense")
    rng = random.Random(4)
    first = [rng.randrange(VOCAB) for _ in range(50)]
    eng.prefill("first", first, sampling=GREEDY8, share_scope="t")
    eng.decode_step(["first"])
    same = first[:30] + [rng.randrange(VOCAB) for _ in range(12)]
    other = [(first[0] + 1) % VOCAB] + first[1:30] + [rng.randrange(VOCAB) for _ in range(12)]
    cases = (("same", same, "t"), ("other", other, "t"), ("tenant-u", list(same), "u"),
             ("unscoped", list(same), None))
    for sid, p, scope in cases:
        eng.admit(sid, p, sampling=GREEDY8, share_scope=scope)
    _step_all(eng, [sid for sid, _, _ in cases])
    assert eng.shared_rows_total == 30
    for sid, p, _ in cases:
        ref = alone(make_engine("tiny-dense"), p)
        for _ in range(7):
            eng.decode_step([sid])
        assert eng.seq_tokens(sid)[len(p):] == ref[0]
        assert torch.equal(eng.export_tokens(sid, 0, len(p) + 7), ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_shared_rows_keep_every_bit_on_the_gpu(model: str) -> None:
    """triton_bi reads the paged pool too: the same mixes, the same bits."""
    kw = {"device": "cuda", "dtype": "bfloat16", "kernels": "triton_bi", "num_blocks": 1024}
    prompts = sharing_prompts(8)
    ref = [alone(make_engine(model, **kw), p) for p in prompts]
    for seed in (1, 2):
        eng = make_engine(model, **kw)
        toks, kvs = mixed(eng, prompts, [None] * len(prompts), [None] * len(prompts), seed,
                           scope="t")
        assert eng.shared_rows_total > 0
        for i in range(len(prompts)):
            assert toks[i] == ref[i][0], f"prompt {i}: tokens changed (seed {seed})"
            assert torch.equal(kvs[i], ref[i][1]), f"prompt {i}: KV bits changed (seed {seed})"
