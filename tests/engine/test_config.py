"""Config validation, named configs, deterministic random weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import DeviceError, Engine, EngineConfig, ModelConfig, ModelConfigError
from engine.config import MoEConfig
from engine.sampling import SamplingParams
from tests.engine.conftest import make_engine


def test_named_configs() -> None:
    hyb = ModelConfig.from_name("tiny-hybrid")
    assert hyb.has_sliding and hyb.sliding_window == 16 and "full" in hyb.layer_types
    rule = hyb.hit_rule(16)
    assert (rule.window, rule.backtrack, rule.reserve) == (16, 6, 22)
    assert rule.replay_keep_tokens >= 22
    moe = ModelConfig.from_name("tiny-moe").moe
    assert moe is not None and (moe.n_experts, moe.top_k) == (8, 2)
    assert ModelConfig.from_name("tiny-dense").hit_rule(64).reserve == 1
    with pytest.raises(ModelConfigError, match=r"known: .*tiny-dense"):
        ModelConfig.from_name("tiny-nope")


def test_llama_8b_shape_refuses_cpu_without_allocating() -> None:
    with pytest.raises(DeviceError, match=r"GPU-only.*device='cuda'"):
        Engine(EngineConfig(model="llama-8b-shape", dtype="bfloat16"))


def test_cuda_requested_without_gpu_is_clear() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(DeviceError, match="no CUDA device"):
        Engine(EngineConfig(model="tiny-dense", device="cuda"))


@pytest.mark.parametrize(("change", "message"), [
    ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
    ({"layer_types": ("full",) * 3}, "3 entries for 4 layers"),
    ({"layer_types": ("full", "local", "full", "full")}, "unknown attention kind"),
    ({"layer_types": ("sliding",) * 4, "sliding_window": 0}, "sliding_window >= 1"),
])
def test_model_config_validation(change: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        replace(ModelConfig.from_name("tiny-dense"), **change)  # type: ignore[arg-type]
    with pytest.raises(ModelConfigError, match="top_k"):
        MoEConfig(n_experts=2, top_k=3)


@pytest.mark.parametrize(("kw", "message"), [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"device": "tpu"}, "device must be"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"prefill_chunk": 100, "block_tokens": 64}, "multiple of block_tokens"),
    ({"decode_bucket": 0}, "decode_bucket"),
])
def test_engine_config_validation(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        EngineConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "message"), [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": ("",)}, "stop strings"),
])
def test_sampling_validation(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_random_weights_follow_the_seed() -> None:
    a, b, c = make_engine("tiny-moe"), make_engine("tiny-moe"), make_engine("tiny-moe", seed=1)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 16 and a.fingerprint_hex == a.fingerprint.hex()
    assert all(torch.equal(x, y) for x, y in zip(a.model.w.tensors(), b.model.w.tensors(),
                                                  strict=True))
    assert not torch.equal(a.model.w.embed, c.model.w.embed)
    # Block size and dtype are part of the fingerprint.
    assert make_engine("tiny-moe", block_tokens=32).fingerprint != a.fingerprint
    assert make_engine("tiny-moe", dtype="bfloat16").fingerprint != a.fingerprint
    # With batch-invariant kernels the chunk changes no bit, so it is not part of
    # the identity; the kernel family is. With torch kernels the chunk is.
    assert make_engine("tiny-moe", prefill_chunk=128).fingerprint == a.fingerprint
    t = make_engine("tiny-moe", kernels="torch")
    assert t.fingerprint != a.fingerprint
    assert make_engine("tiny-moe", kernels="torch", prefill_chunk=128).fingerprint \
        != t.fingerprint


def test_sampling_stops_and_text() -> None:
    eng = make_engine("tiny-dense")
    prompt = list(range(30, 90))
    greedy = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 40
    # A stop string cut from the greedy text ends the run there.
    text = greedy.text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                 and text[i:i + 2].strip()), None)
    if stop is not None:
        cut = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert text.startswith(cut.text)
    # Seeded sampling is reproducible and differs across seeds.
    hot = [eng.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                               ignore_eos=True)).tokens for s in (1, 1, 2)]
    assert hot[0] == hot[1] != hot[2]
