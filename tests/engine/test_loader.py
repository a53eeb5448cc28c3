"""HF-layout loading, checked against transformers on tiny models (Llama,
Qwen2 q/k/v biases, Mistral sliding window)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import Engine
from tests.engine.conftest import make_engine
from tests.engine.hf_dir import write_hf_dir

transformers = pytest.importorskip("transformers")


def _hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_loaded_dir_equals_random_engine_bitwise(tmp_path: Path) -> None:
    src = make_engine("tiny-dense")
    d = write_hf_dir(src, tmp_path / "tiny")
    loaded = make_engine(str(d))
    ids = list(range(3, 60))
    assert torch.equal(loaded.score(ids), src.score(ids))
    assert loaded.model_config.num_layers == 4 and loaded.layout.name == "L4xH2xT16xD16:float32"
    # Fingerprint: hash of the weight bytes, cached beside them, stable on reload.
    assert (d / ".kvserve-weights-hash.json").is_file()
    assert make_engine(str(d)).fingerprint == loaded.fingerprint != src.fingerprint


@pytest.mark.parametrize(("model", "model_type", "window"), [
    ("tiny-dense", "llama", 0), ("tiny-hybrid", "qwen2", 0), ("tiny-dense", "mistral", 16)])
def test_matches_transformers(tmp_path: Path, model: str, model_type: str, window: int) -> None:
    d = write_hf_dir(make_engine(model), tmp_path / model_type, model_type=model_type)
    if window:
        cfg = json.loads((d / "config.json").read_text())
        cfg["sliding_window"] = window
        (d / "config.json").write_text(json.dumps(cfg))
    eng: Engine = make_engine(str(d))
    assert eng.model_config.qkv_bias == (model_type == "qwen2")
    assert eng.model_config.layer_windows == (window,) * 4
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    diff = (eng.score(ids) - _hf_logits(d, ids)).abs().max().item()
    assert diff < 1e-3
