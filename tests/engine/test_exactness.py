"""Lossless restore, canonical blocks, G1 reuse and batch invariance on the
random-weight configs (docs/architecture.md#batch-invariance)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import Engine, SamplingParams, bik
from tests.engine.conftest import TINY, make_engine, random_prompts

GREEDY32 = SamplingParams(max_tokens=32, ignore_eos=True)


def chain(tokens: list[int], block: int, salt: bytes = b"t") -> list[bytes]:
    """Stand-in chain keys (the real ones live in kvstore.keys)."""
    keys, prev = [], salt
    for i in range(len(tokens) // block):
        h = hashlib.blake2b(prev + bytes(str(tokens[i * block:(i + 1) * block]), "ascii"),
                            digest_size=16).digest()
        keys.append(h)
        prev = h
    return keys


@dataclass(frozen=True, slots=True)
class BatchRun:
    tokens: list[list[int]]          # 32 greedy tokens per prompt
    kv: list[torch.Tensor]           # each sequence's KV at the end
    reused: list[int]                # tokens restored per prompt
    prompt_blocks: list[torch.Tensor]  # the prompt's full blocks right after prefill


def generate_batch(eng: Engine, prompts: list[list[int]],
                   restored: list[torch.Tensor] | None = None) -> BatchRun:
    """Greedy 32 tokens for every prompt, decoded together (batching is shown
    invariant below)."""
    sids, reused, blocks = [], [], []
    for i, p in enumerate(prompts):
        res = eng.prefill(f"g{i}", p, sampling=GREEDY32,
                          restored=None if restored is None else restored[i])
        sids.append(f"g{i}")
        reused.append(res.restored_tokens)
        blocks.append(eng.export_blocks(f"g{i}").clone())
    for _ in range(GREEDY32.max_tokens - 1):
        eng.decode_step(sids)
    tokens = [eng.seq_tokens(s)[len(p):] for s, p in zip(sids, prompts, strict=True)]
    kv = [eng.export_tokens(s, 0, len(eng.seq_tokens(s)) - 1) for s in sids]
    for s in sids:
        eng.free(s)
    return BatchRun(tokens, kv, reused, blocks)


def stored_blocks(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """Every full block of the prompt, as a warehouse would hold them."""
    eng.prefill("store", prompt)
    blocks = eng.export_blocks("store").clone()
    eng.free("store")
    return blocks


@pytest.mark.parametrize("model", TINY)
def test_lossless_restore_20_prompts(model: str) -> None:
    cold_eng, fresh = make_engine(model), make_engine(model)   # fresh never saw the prompts
    B, rule = cold_eng.config.block_tokens, cold_eng.hit_rule
    prompts = random_prompts(20, 20, 150, 256, seed=7)
    # The warehouse would hold every full block of the prompt; the engine
    # applies the hit rule itself and takes only the usable ones.
    cold = generate_batch(cold_eng, prompts)
    stored = cold.prompt_blocks
    warm = generate_batch(fresh, prompts, stored)
    for i, p in enumerate(prompts):
        L = len(p)
        assert warm.reused[i] == rule.usable_tokens(stored[i].shape[0] * B, L), (i, L)
        if stored[i].shape[0] * B >= L - rule.reserve:   # fully matched: replay is bounded
            assert L - warm.reused[i] <= rule.replay_keep_tokens + B - 1
        assert warm.tokens[i] == cold.tokens[i], f"prompt {i} (L={L}) diverged after restore"
        assert torch.equal(warm.kv[i], cold.kv[i]), f"prompt {i}: KV bits differ"
    assert sum(r > 0 for r in warm.reused) >= 15


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_bigger_prefill_chunks_stay_exact(model: str) -> None:
    """torch kernels, chunks of 3 blocks: reuse snaps down to a chunk boundary, so
    a restored run still repeats the cold run's chunks exactly."""
    cold_eng, fresh = (make_engine(model, prefill_chunk=48, kernels="torch")
                       for _ in range(2))
    rule = cold_eng.hit_rule
    prompts = random_prompts(20, 20, 150, 256, seed=17)
    cold = generate_batch(cold_eng, prompts)
    warm = generate_batch(fresh, prompts, cold.prompt_blocks)
    for i, p in enumerate(prompts):
        usable = rule.usable_tokens(cold.prompt_blocks[i].shape[0] * 16, len(p))
        assert warm.reused[i] == usable // 48 * 48
        assert warm.tokens[i] == cold.tokens[i] and torch.equal(warm.kv[i], cold.kv[i])
    # Only blocks before the prompt's last chunk boundary are canonical.
    cold_eng.prefill("s", prompts[0] + [7] * 40, sampling=GREEDY32)
    L = len(prompts[0]) + 40
    assert cold_eng.canonical_full("s") == L // 48 * 3
    for _ in range(31):
        cold_eng.decode_step(["s"])
    first, canon = cold_eng.canonical_blocks("s")
    toks = cold_eng.seq_tokens("s")[:-1]
    cold_eng.prefill("c", toks)
    assert first == L // 48 * 3 and first + canon.shape[0] == len(toks) // 48 * 3
    assert torch.equal(canon, cold_eng.export_blocks("c", first, canon.shape[0]))


def test_hybrid_hit_rule_bounds_replay() -> None:
    eng = make_engine("tiny-hybrid")
    rule = eng.hit_rule
    assert (rule.window, rule.backtrack) == (16, 6) and rule.replay_keep_tokens >= 22
    # However long the conversation, a fully matched prompt replays < reserve + B tokens.
    for L in (40, 200, 700):
        prompt = random_prompts(1, L, L, 256, seed=L)[0]
        res = eng.prefill("b", prompt, restored=stored_blocks(eng, prompt))
        eng.free("b")
        assert res.restored_tokens == rule.usable_tokens(L, L) == (L - 22) // 16 * 16
        assert 22 <= res.computed_tokens <= rule.replay_keep_tokens + 15


def test_kv_comparison_detects_one_ulp() -> None:
    """The bitwise KV check has teeth: one ulp of noise in restored KV shows."""
    a, b = make_engine("tiny-dense"), make_engine("tiny-dense")
    prompts = random_prompts(3, 60, 120, 256, seed=3)
    cold = generate_batch(a, prompts)
    noisy = [torch.nextafter(x, torch.full_like(x, float("inf"))) for x in cold.prompt_blocks]
    warm = generate_batch(b, prompts, noisy)
    for c, w in zip(cold.kv, warm.kv, strict=True):
        assert not torch.equal(c, w)


@pytest.mark.parametrize("model", TINY)
def test_canonical_blocks_equal_cold_prefill(model: str) -> None:
    eng = make_engine(model)
    B = eng.config.block_tokens
    prompt = random_prompts(1, 37, 37, 256, seed=11)[0]
    eng.prefill("s", prompt, sampling=SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(50):
        eng.decode_step(["s"])
    toks = eng.seq_tokens("s")
    first, canon = eng.canonical_blocks("s")
    kv_len = len(toks) - 1
    assert first == 37 // B and canon.shape[0] == kv_len // B - first
    eng.prefill("cold", toks[:kv_len])
    cold = eng.export_blocks("cold", first, canon.shape[0])
    assert torch.equal(canon, cold)
    # The prompt's own full blocks were already canonical.
    assert torch.equal(eng.export_blocks("s", 0, first), eng.export_blocks("cold", 0, first))
    eng.free("cold")
    eng.free("s")


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_canonical_blocks_on_device_are_the_same_blocks(model: str, kernels: str) -> None:
    """Decode's answer-end export gathers on the device and copies to the host
    off the engine thread (``on_device``): the same blocks as the host export,
    whether the kernels keep them as decoded or recompute them."""
    engines = [make_engine(model, kernels=kernels), make_engine(model, kernels=kernels)]
    prompt = random_prompts(1, 41, 41, 256, seed=5)[0]
    got = []
    for eng, on_device in zip(engines, (False, True), strict=True):
        eng.prefill("s", prompt, sampling=SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(39):
            eng.decode_step(["s"])
        got.append(eng.canonical_blocks("s", on_device=on_device))
        eng.free("s")
    (f0, host), (f1, dev) = got
    assert f0 == f1 and dev.shape[0] == host.shape[0] > 0
    assert torch.equal(dev.cpu(), host)


def test_g1_prefix_cache_reuse_and_lru() -> None:
    eng = make_engine("tiny-dense", num_blocks=24)
    B = eng.config.block_tokens
    prompt = random_prompts(1, 100, 100, 256, seed=5)[0]
    keys = chain(prompt, B)
    cold = eng.generate(prompt, GREEDY32)
    first = eng.prefill("a", prompt, sampling=GREEDY32, block_keys=keys)
    assert first.g1_tokens == 0 and eng.g1_match(keys) == len(keys)
    eng.free("a")
    # A second request with the same prefix hits G1 and generates the same tokens.
    warm = eng.generate(prompt, GREEDY32, block_keys=keys)
    assert warm.prefill.g1_tokens == eng.hit_rule.usable_tokens(len(keys) * B, len(prompt))
    assert warm.tokens == cold.tokens
    # Unreferenced cached blocks are evicted (LRU) only when the pool runs out.
    other = random_prompts(1, 300, 300, 256, seed=6)[0]
    eng.prefill("big", other)
    assert eng.g1_match(keys) < len(keys)
    eng.free("big")


def test_free_keeps_canonical_generated_blocks() -> None:
    eng = make_engine("tiny-dense")
    B = eng.config.block_tokens
    prompt = random_prompts(1, 40, 40, 256, seed=8)[0]
    eng.prefill("s", prompt, sampling=SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(40):
        eng.decode_step(["s"])
    toks = eng.seq_tokens("s")
    eng.canonical_blocks("s")
    keys = chain(toks[:-1], B)
    eng.free("s", keep_keys=keys)
    assert eng.g1_match(keys) == len(keys)
    # Next turn: the whole history comes from G1 and equals a cold run.
    nxt = toks + random_prompts(1, 10, 10, 256, seed=9)[0]
    warm = eng.generate(nxt, GREEDY32, block_keys=chain(nxt, B))
    assert warm.prefill.g1_tokens == eng.hit_rule.usable_tokens(len(keys) * B, len(nxt))
    assert warm.tokens == make_engine("tiny-dense").generate(nxt, GREEDY32).tokens


@pytest.mark.parametrize("model", TINY)
def test_continuous_batching_is_invariant(model: str) -> None:
    eng = make_engine(model, decode_bucket=4)
    prompts = random_prompts(7, 10, 90, 256, seed=21)
    params = [SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i)
              for i in range(len(prompts))]
    solo = [eng.generate(p, sp).tokens for p, sp in zip(prompts, params, strict=True)]
    # Sequence i joins at step 2*i; each leaves once it has its max_tokens; up to
    # 7 live at once means two decode buckets of 4.
    got: dict[int, list[int]] = {}
    live: dict[int, str] = {}
    step = 0
    while len(got) < len(prompts):
        for i in range(len(prompts)):
            if step == 2 * i:
                first = eng.prefill(f"s{i}", prompts[i], sampling=params[i]).first_token
                live[i] = f"s{i}"
                assert first == solo[i][0]
        for i, sid in list(live.items()):
            if eng.finish_reason(sid) is not None:
                got[i] = eng.seq_tokens(sid)[len(prompts[i]):]
                eng.free(sid)
                del live[i]
        if live:
            eng.decode_step(list(live.values())[::-1])
        step += 1
    for i in range(len(prompts)):
        assert got[i] == solo[i], f"sequence {i} changed when batched"


def test_moe_counts_routed_tokens_not_padding() -> None:
    eng = make_engine("tiny-moe")
    top_k = eng.model_config.moe.top_k  # type: ignore[union-attr]
    eng.expert_counts()
    eng.prefill("a", list(range(40)))
    counts = eng.expert_counts()
    assert counts is not None and counts.shape == (4, 8)
    assert counts.sum(dim=1).tolist() == [40 * top_k] * 4
    eng.prefill("b", list(range(9)))
    eng.expert_counts()
    eng.decode_step(["a", "b"])                 # 2 real rows in a bucket of 8
    assert eng.expert_counts().sum(dim=1).tolist() == [2 * top_k] * 4  # type: ignore[union-attr]
    assert make_engine("tiny-dense").expert_counts() is None


_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from engine import Engine, EngineConfig, SamplingParams
data = torch.load(sys.argv[1])
eng = Engine(EngineConfig(model="tiny-hybrid", block_tokens=16, num_blocks=128))
out = [eng.generate(p, SamplingParams(max_tokens=32, ignore_eos=True), restored=b).tokens
       for p, b in zip(data["prompts"], data["blocks"])]
print(json.dumps({"fingerprint": eng.fingerprint_hex, "tokens": out}))
"""


def test_restore_in_another_process(tmp_path: Path) -> None:
    """Random weights are the same in any process; KV moved as bytes restores exactly."""
    eng = make_engine("tiny-hybrid")
    prompts = random_prompts(3, 60, 120, 256, seed=31)
    blocks, cold = [], []
    for p in prompts:
        cold.append(eng.generate(p, GREEDY32).tokens)
        eng.prefill("x", p)
        blocks.append(eng.export_blocks("x").clone())
        eng.free("x")
    path = tmp_path / "blocks.pt"
    torch.save({"prompts": prompts, "blocks": blocks}, path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                          text=True, check=True, cwd=Path(__file__).parents[2])
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["fingerprint"] == eng.fingerprint_hex
    assert child["tokens"] == cold


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefill_here_decode_there(temperature: float) -> None:
    """A PD split (export_tokens -> adopt) generates exactly what one engine does."""
    pre, dec = make_engine("tiny-hybrid"), make_engine("tiny-hybrid")
    sp = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    for prompt in random_prompts(4, 20, 90, 256, seed=41):
        alone = pre.generate(prompt, sp).tokens
        first = pre.prefill("p", prompt, sampling=sp).first_token
        kv = pre.export_tokens("p", 0, len(prompt))
        pre.free("p")
        dec.adopt("d", prompt, kv, first, sp)
        while dec.finish_reason("d") is None:
            dec.decode_step(["d"])
        assert dec.seq_tokens("d")[len(prompt):] == alone
        dec.free("d")
    with pytest.raises(ValueError, match="adopted KV has shape"):
        dec.adopt("d", [1, 2, 3], torch.zeros(4, 2, 2, 2, 16), 5)


@pytest.mark.skipif(not bik.available(), reason="native._bik not built")
@pytest.mark.parametrize("model", TINY)
def test_invariant_kernels_restore_at_any_block_and_decode_kv_is_canonical(model: str) -> None:
    """Batch-invariant kernels: a cold run in 48-token chunks and a restored run
    in 16-token chunks agree bit for bit with reuse at every block the hit rule
    allows (no chunk cut); KV written by decode equals a cold prefill's."""
    cold_eng = make_engine(model, prefill_chunk=48)
    fresh = make_engine(model, prefill_chunk=16)
    assert cold_eng.invariant and fresh.fingerprint == cold_eng.fingerprint
    rule = cold_eng.hit_rule
    prompts = random_prompts(20, 20, 150, 256, seed=19)
    cold = generate_batch(cold_eng, prompts)
    warm = generate_batch(fresh, prompts, cold.prompt_blocks)
    for i, p in enumerate(prompts):
        usable = rule.usable_tokens(cold.prompt_blocks[i].shape[0] * 16, len(p))
        assert warm.reused[i] == usable
        assert warm.tokens[i] == cold.tokens[i] and torch.equal(warm.kv[i], cold.kv[i])
    # Decode's own blocks are canonical: no recompute, equal to a cold prefill.
    eng = make_engine(model)
    eng.prefill("s", prompts[1], sampling=GREEDY32)
    for _ in range(40):
        eng.decode_step(["s"])
    first, canon = eng.canonical_blocks("s")
    toks = eng.seq_tokens("s")[:-1]
    assert first == len(prompts[1]) // 16 and first + canon.shape[0] == len(toks) // 16
    eng.prefill("c", toks)
    assert torch.equal(canon, eng.export_blocks("c", first, canon.shape[0]))


@pytest.mark.skipif(not bik.available(), reason="native._bik not built")
def test_invariant_kernels_agree_on_every_simd_path() -> None:
    """AVX-512, AVX2 and scalar paths give the same bits (nodes of different CPUs
    share blocks), and a row's result does not depend on the rows beside it."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 96, generator=g)
    w = bik.pack(torch.randn(96, 200, generator=g))
    norm_w = torch.randn(96, generator=g)
    gu = torch.randn(13, 2 * 70, generator=g) * 4
    q = torch.randn(13, 4, 32, generator=g)
    kv = torch.randn(2, 2, 64, 32, generator=g)
    results = []
    for path in bik.paths():
        bik.use_path(path)
        att = torch.empty(13, 4 * 32)
        bik.attend(q, [bik.AttnSegment(0, 13, 40, kv)], 2, 0, att)
        results.append((bik.linear(x, w), bik.rms_norm(x, norm_w, 1e-5), bik.silu_mul(gu), att))
        rows = torch.cat([bik.linear(x[i:i + 1], w) for i in range(13)])
        assert torch.equal(rows, results[-1][0])
        one = torch.empty(1, 4 * 32)
        bik.attend(q[5:6], [bik.AttnSegment(0, 1, 45, kv)], 2, 0, one)
        assert torch.equal(one, att[5:6])
    bik.use_path(bik.paths()[-1])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def _prefix_keys(tokens: list[int], block_tokens: int) -> list[bytes]:
    return [hashlib.sha256(repr(tokens[:(i + 1) * block_tokens]).encode()).digest()
            for i in range(len(tokens) // block_tokens)]


@pytest.mark.parametrize("model", TINY)
def test_a_next_turn_adopted_on_decodes_own_g1_prefix_is_exact(model: str) -> None:
    """Decode keeps a finished turn's canonical blocks in G1; the session's next
    turn pins them and adopts only the pulled tail: its KV and tokens equal a
    whole adopt's, and pins go back on an error or an unpin."""
    pre, dec = make_engine(model), make_engine(model)
    B = dec.config.block_tokens
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    context = random_prompts(1, 3 * B + 5, 3 * B + 6, 256, seed=43)[0]
    prev_kv = 0                                            # tokens of the last turn with KV
    for turn in range(3):
        want = pre.generate(context, sp).tokens
        first = pre.prefill("p", context, sampling=sp).first_token
        kv = pre.export_tokens("p", 0, len(context))
        pre.free("p")
        keys = _prefix_keys(context, B)
        held = dec.pin_prefix(keys[:(len(context) - 1) // B])
        assert len(held) == prev_kv // B, f"turn {turn}"
        if held:
            with pytest.raises(ValueError, match="adopted KV has shape"):
                dec.adopt("d", context, kv, first, sp, prefix=held)     # the whole KV: wrong
            assert all(dec.blocks.ref_count(b) == 1 for b in held), "pins stay the caller's"
        dec.adopt("d", context, kv[:, :, :, len(held) * B:, :], first, sp, prefix=held,
                  block_keys=keys)
        assert torch.equal(dec.export_tokens("d", 0, len(context)), kv)
        while dec.finish_reason("d") is None:
            dec.decode_step(["d"])
        assert dec.seq_tokens("d")[len(context):] == want, f"turn {turn}"
        tokens = dec.seq_tokens("d")
        dec.canonical_blocks("d")
        dec.free("d", keep_keys=_prefix_keys(tokens, B))
        prev_kv = len(tokens) - 1                          # the last token has no KV
        context = tokens + random_prompts(1, B + 3, B + 4, 256, seed=50 + turn)[0]
    held = dec.pin_prefix(_prefix_keys(context, B))
    assert held and all(dec.blocks.ref_count(b) == 1 for b in held)
    dec.unpin(held)
    assert all(dec.blocks.ref_count(b) == 0 for b in held)
    assert dec.free_blocks == dec.blocks.num_blocks        # cached, idle: all allocatable


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_completion_text_decodes_only_the_new_tokens_and_stays_exact(stop: tuple[str, ...]
                                                                      ) -> None:
    """The text a step reads is the whole completion decoded, step after step,
    though only the tokens after the kept prefix are decoded again (the step's
    ``read`` was 2-2.5 ms at batch 28-38 on the H200 stack)."""
    eng = make_engine("tiny-dense")
    sp = SamplingParams(max_tokens=300, ignore_eos=True, temperature=1.0, seed=3, stop=stop)
    eng.prefill("s", random_prompts(1, 20, 20, 256, seed=2)[0], sampling=sp)
    for _ in range(200):
        gen = eng.seq_tokens("s")[20:]
        full = eng.tokenizer.decode(gen)
        cut = [full.find(x) for x in stop if x in full]
        assert eng.completion_text("s") == (full[:min(cut)] if cut else full)
        if eng.finish_reason("s"):
            break
        eng.decode_step(["s"])
    kept, _ = eng._seq("s").text_cache
    assert kept > 100                       # most of the completion is decoded once
    eng.free("s")
