"""Batched prefill (engine/prefill_steps.py): a sequence's KV and tokens are
bit-identical alone and in any mix of co-tenants, chunk budgets and restored
starts; a stopped prefill publishes nothing it did not compute."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, EngineInputError, SamplingParams, bik
from tests.engine.conftest import TINY, make_engine, random_prompts
from tests.engine.test_exactness import chain

GREEDY8 = SamplingParams(max_tokens=8, ignore_eos=True)
needs_bik = pytest.mark.skipif(not bik.available(), reason="native._bik not built")


def alone(eng: Engine, prompt: list[int], restored: torch.Tensor | None = None,
          start: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Reference: one-shot prefill then 7 decode steps of this sequence only."""
    eng.prefill("ref", prompt, sampling=GREEDY8, restored=restored, restored_start_block=start)
    for _ in range(7):
        eng.decode_step(["ref"])
    out = (eng.seq_tokens("ref")[len(prompt):], eng.export_tokens("ref", 0, len(prompt) + 7))
    eng.free("ref")
    return out


def mixed(eng: Engine, prompts: list[list[int]], restored: list[torch.Tensor | None],
          starts: list[int | None], seed: int, scope: str | None = None,
          ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Admit the prompts at random steps, give each step a random subset of the
    prefilling ones with random budgets, decode the finished ones together.
    ``scope``: the share scope every prompt is admitted with (shared prompt rows)."""
    rng = random.Random(seed)
    waiting = list(range(len(prompts)))
    rng.shuffle(waiting)
    prefilling: list[int] = []
    live: list[int] = []
    firsts: dict[int, int] = {}
    while waiting or prefilling:
        for _ in range(rng.randint(0, 3)):
            if waiting:
                i = waiting.pop()
                adm = eng.admit(f"s{i}", prompts[i], sampling=GREEDY8, restored=restored[i],
                                restored_start_block=starts[i], share_scope=scope)
                assert adm.to_compute == eng.prefill_remaining(f"s{i}") >= 1
                prefilling.append(i)
        step = [i for i in prefilling if rng.random() < 0.7] or prefilling[:1]
        if not step:
            continue
        done = eng.prefill_step({f"s{i}": rng.choice([1, 5, 16, 23, 64, 200]) for i in step})
        for d in done:
            i = int(d.seq_id[1:])
            prefilling.remove(i)
            firsts[i] = d.result.first_token
            live.append(i)
        # Decode the live ones between prefill steps (continuous batching beside it).
        ready = [i for i in live if len(eng.seq_tokens(f"s{i}")) - len(prompts[i]) < 8]
        if ready:
            eng.decode_step([f"s{i}" for i in ready])
    while any(len(eng.seq_tokens(f"s{i}")) - len(prompts[i]) < 8 for i in live):
        eng.decode_step([f"s{i}" for i in live
                         if len(eng.seq_tokens(f"s{i}")) - len(prompts[i]) < 8])
    toks, kvs = [], []
    for i, p in enumerate(prompts):
        toks.append(eng.seq_tokens(f"s{i}")[len(p):])
        assert toks[-1][0] == firsts[i]
        kvs.append(eng.export_tokens(f"s{i}", 0, len(p) + 7))
        eng.free(f"s{i}")
    return toks, kvs


def _stored(eng: Engine, prompt: list[int]) -> torch.Tensor:
    eng.prefill("store", prompt)
    blocks = eng.export_blocks("store").clone()
    eng.free("store")
    return blocks


@needs_bik
@pytest.mark.parametrize("model", TINY)
def test_invariant_batched_prefill_is_bit_identical_to_alone(model: str) -> None:
    """bik: 12 prompts, half with their first k blocks restored (k at random),
    admitted at random steps with random budgets and decoded beside each
    other: tokens and KV equal each one's prefill alone."""
    eng = make_engine(model)
    assert eng.invariant
    prompts = random_prompts(12, 20, 220, 256, seed=3)
    rng = random.Random(5)
    restored: list[torch.Tensor | None] = []
    starts: list[int | None] = []
    for i, p in enumerate(prompts):
        full = _stored(eng, p)
        if i % 2 and full.shape[0] > 1:
            restored.append(full[:rng.randrange(1, full.shape[0] + 1)].clone())
        else:
            restored.append(None)
        starts.append(None)
    ref = [alone(make_engine(model), p) for p in prompts]
    for seed in (1, 2):
        toks, kvs = mixed(make_engine(model), prompts, restored, starts, seed)
        for i in range(len(prompts)):
            assert toks[i] == ref[i][0], f"prompt {i}: tokens changed in a batch (seed {seed})"
            assert torch.equal(kvs[i], ref[i][1]), f"prompt {i}: KV bits changed (seed {seed})"


@needs_bik
def test_restored_at_random_block_boundaries_with_g1_before_them() -> None:
    """The G1 hit covers blocks [0, k), the warehouse gives [k, ...): a batched
    admission reuses both, for k at random boundaries, and stays exact."""
    eng = make_engine("tiny-dense", num_blocks=1024)
    B = eng.config.block_tokens
    prompts = random_prompts(8, 100, 200, 256, seed=9)
    rng = random.Random(11)
    restored, starts, refs = [], [], []
    for p in prompts:
        full = _stored(make_engine("tiny-dense"), p)
        k = rng.randrange(1, full.shape[0])
        keys = chain(p[:k * B], B)
        eng.prefill("warm", [*p[:k * B], 3], block_keys=keys)   # puts blocks [0, k) in G1
        eng.free("warm", keep_keys=keys)
        restored.append(full[k:].clone())
        starts.append(k)
        refs.append(alone(make_engine("tiny-dense"), p))
    sids = [f"r{i}" for i in range(len(prompts))]
    for sid, p, r, k in zip(sids, prompts, restored, starts, strict=True):
        adm = eng.admit(sid, p, sampling=GREEDY8, block_keys=chain(p, B), restored=r,
                        restored_start_block=k)
        assert adm.g1_tokens == k * B
        assert adm.g1_tokens + adm.restored_tokens == eng.hit_rule.usable_tokens(len(p), len(p))
    budgets = dict.fromkeys(sids, 48)
    while budgets:
        for d in eng.prefill_step(budgets):
            del budgets[d.seq_id]
    for _ in range(7):
        eng.decode_step(sids)
    for i, (sid, p) in enumerate(zip(sids, prompts, strict=True)):
        assert eng.seq_tokens(sid)[len(p):] == refs[i][0]
        assert torch.equal(eng.export_tokens(sid, 0, len(p) + 7), refs[i][1])


def test_g1_that_grew_after_the_plan_is_used_before_the_restored_blocks() -> None:
    """A request planned its restore from the G1 hit it saw on arrival (k blocks,
    or none); by its admission a prompt sharing the prefix has put j > k blocks in
    G1. Those j are used, then only the restored blocks after them, within the
    planned cap grown by G1's own hit: exact, and nothing recomputed that G1 or
    the warehouse held (a held resend used to recompute its whole context)."""
    eng = make_engine("tiny-dense", num_blocks=1024)
    B = eng.config.block_tokens
    prompts = random_prompts(4, 150, 220, 256, seed=21)
    for i, p in enumerate(prompts):
        full = _stored(make_engine("tiny-dense"), p)
        n = full.shape[0]
        k, j = (0, n - 2) if i % 2 else (2, n // 2)       # planned start, G1 by admission
        keys = chain(p[:j * B], B)
        eng.prefill("warm", [*p[:j * B], 3], block_keys=keys)
        eng.free("warm", keep_keys=keys)
        planned = eng.hit_rule.usable_tokens(n * B if k else 0, len(p))
        rest = full[k:].clone() if k else None
        adm = eng.admit(f"g{i}", p, sampling=GREEDY8, block_keys=chain(p, B), restored=rest,
                        restored_start_block=k, max_restore_tokens=planned)
        assert adm.g1_tokens == j * B, i
        assert adm.g1_tokens + adm.restored_tokens == (
            eng.hit_rule.usable_tokens(len(p), len(p)) if k
            else eng.hit_rule.usable_tokens(j * B, len(p))), i
        budgets = {f"g{i}": 64}
        while budgets:
            for d in eng.prefill_step(budgets):
                del budgets[d.seq_id]
        for _ in range(7):
            eng.decode_step([f"g{i}"])
        want = alone(make_engine("tiny-dense"), p)
        assert eng.seq_tokens(f"g{i}")[len(p):] == want[0]
        assert torch.equal(eng.export_tokens(f"g{i}", 0, len(p) + 7), want[1])
        eng.free(f"g{i}")


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_torch_kernels_interleave_at_chunk_boundaries(model: str) -> None:
    """Non-invariant kernels: each sequence runs alone at absolute chunk
    boundaries, whatever the budgets: still exactly the one-shot prefill."""
    prompts = random_prompts(6, 30, 180, 256, seed=13)
    ref = [alone(make_engine(model, kernels="torch", prefill_chunk=48), p) for p in prompts]
    eng = make_engine(model, kernels="torch", prefill_chunk=48)
    toks, kvs = mixed(eng, prompts, [None] * 6, [None] * 6, seed=4)
    for i in range(len(prompts)):
        assert toks[i] == ref[i][0] and torch.equal(kvs[i], ref[i][1]), i


def test_budget_cut_to_chunk_boundary_but_always_progresses() -> None:
    eng = make_engine("tiny-dense", kernels="torch", prefill_chunk=48)
    eng.admit("a", random_prompts(1, 150, 150, 256, seed=1)[0])
    eng.prefill_step({"a": 5})                  # less than a chunk: one whole chunk
    assert eng.prefill_remaining("a") == 150 - 48
    eng.prefill_step({"a": 60})                 # 48 + 60 = 108: cut back to 96
    assert eng.prefill_remaining("a") == 150 - 96
    assert eng.prefill_step({"a": 1000})[0].result.computed_tokens == 150
    assert eng.prefill_remaining("a") == 0


def test_given_first_token_is_taken_not_sampled() -> None:
    """A rebuild continues a known answer: the first token is the one given,
    and decoding goes on exactly as after adopt of the same KV."""
    eng, ref = make_engine("tiny-dense"), make_engine("tiny-dense")
    prompt = random_prompts(1, 70, 70, 256, seed=2)[0]
    sampled = ref.prefill("p", prompt).first_token
    forced = (sampled + 1) % 256
    kv = ref.export_tokens("p", 0, len(prompt))
    ref.free("p")
    ref.adopt("p", prompt, kv, forced, GREEDY8)
    eng.admit("b", prompt, sampling=GREEDY8, first_token=forced)
    (done,) = eng.prefill_step({"b": 1000})
    assert done.result.first_token == forced
    for _ in range(5):
        eng.decode_step(["b"])
        ref.decode_step(["p"])
    assert eng.seq_tokens("b") == ref.seq_tokens("p")


def test_stopped_prefill_publishes_only_computed_blocks_and_frees_all() -> None:
    eng = make_engine("tiny-dense", num_blocks=64)
    B = eng.config.block_tokens
    free0 = eng.free_blocks
    prompt = random_prompts(1, 200, 200, 256, seed=6)[0]
    keys = chain(prompt, B)
    eng.admit("x", prompt, block_keys=keys)
    with pytest.raises(EngineInputError, match="still prefilling"):
        eng.decode_step(["x"])
    eng.prefill_step({"x": 40})                 # 2 full blocks + 8 tokens computed
    eng.free("x", keep_keys=keys)
    assert eng.g1_match(keys) == 40 // B
    assert eng.free_blocks == free0
    eng.admit("y", prompt[:20])
    assert len(eng.prefill_step({"y": 100})) == 1
    with pytest.raises(EngineInputError, match="not prefilling"):
        eng.prefill_step({"y": 1})


def test_g1_admission_says_what_admitting_would_take_from_the_pool() -> None:
    """The prefill scheduler sizes waiting prompts with ``g1_admission``: fresh
    blocks for the part G1 lacks, and which reused blocks are idle (counted
    free until pinned). It must match what ``admit`` then takes."""
    eng = make_engine("tiny-dense", num_blocks=64)
    B = eng.config.block_tokens
    p = random_prompts(1, 200, 200, 256, seed=5)[0]
    keys = chain(p, B)
    cold = eng.g1_admission(keys, len(p))
    assert (cold.held_blocks, cold.usable_tokens, cold.idle_blocks) == (0, 0, ())
    assert cold.fresh_blocks == -(-len(p) // B)
    eng.prefill("first", p, block_keys=keys)
    eng.free("first", keep_keys=keys)
    resend = [*p, 1, 2, 3]
    warm = eng.g1_admission(keys, len(resend))
    use = warm.usable_tokens // B
    assert warm.held_blocks == len(keys) and use >= 1 and len(warm.idle_blocks) == use
    before = eng.free_blocks
    adm = eng.admit("r1", resend, block_keys=keys)
    assert adm.g1_tokens == warm.usable_tokens
    assert before - eng.free_blocks == warm.fresh_blocks + len(warm.idle_blocks)
    # Held by a running sequence now: a second resend pins nothing more.
    again = eng.g1_admission(keys, len(resend))
    assert again.idle_blocks == () and again.fresh_blocks == warm.fresh_blocks
