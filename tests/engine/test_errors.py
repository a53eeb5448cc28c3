"""Bad input gives a clear error naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, EngineInputError, ModelLoadError
from engine.loader import load_model_dir
from tests.engine.conftest import make_engine
from tests.engine.hf_dir import write_hf_dir


@pytest.fixture(scope="module")
def eng() -> Engine:
    return make_engine("tiny-dense")


def test_empty_prompt(eng: Engine) -> None:
    with pytest.raises(EngineInputError, match="empty prompt"):
        eng.prefill("a", [])
    with pytest.raises(EngineInputError, match="empty prompt"):
        eng.generate([])


@pytest.mark.parametrize("bad", [-1, 384, 10**9, 10**30])     # 10**30: past int64
def test_token_out_of_vocabulary(eng: Engine, bad: int) -> None:
    with pytest.raises(EngineInputError, match=rf"token id {bad} at position 2 .*\[0, 384\)"):
        eng.prefill("a", [1, 2, bad, 3])
    assert "a" not in eng.live_sequences


def test_prompt_ids_of_any_int_type_come_back_as_python_ints(eng: Engine) -> None:
    from engine.checks import check_prompt

    mc = eng.model_config
    for given in ([3, 7, 383], torch.tensor([3, 7, 383]), [np.int32(3), np.int64(7), 383]):
        got = check_prompt(given, mc)
        assert got == [3, 7, 383] and all(type(t) is int for t in got), given


def test_prompt_longer_than_context(eng: Engine) -> None:
    with pytest.raises(EngineInputError, match="1024 tokens is too long: the context is 1024"):
        eng.prefill("a", [5] * 1024)


def test_restored_blocks_of_the_wrong_shape(eng: Engine) -> None:
    with pytest.raises(EngineInputError, match=r"restored blocks are \(1, 4, 2, 2, 8, 16\)"):
        eng.prefill("a", [5] * 40, restored=torch.zeros(1, 4, 2, 2, 8, 16))
    with pytest.raises(EngineInputError, match=r"expected .* torch.float32"):
        eng.prefill("a", [5] * 40, restored=torch.zeros(1, 4, 2, 2, 16, 16, dtype=torch.float16))
    assert eng.free_blocks == eng.config.num_blocks


def test_unknown_and_duplicate_sequences(eng: Engine) -> None:
    with pytest.raises(EngineInputError, match="no live sequence 'ghost'"):
        eng.decode_step(["ghost"])
    eng.prefill("dup", [1, 2, 3])
    with pytest.raises(EngineInputError, match="already live"):
        eng.prefill("dup", [1, 2, 3])
    with pytest.raises(EngineInputError, match="blocks \\[0, 1\\) out of range"):
        eng.export_blocks("dup", 0, 1)
    eng.free("dup")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_dir(make_engine("tiny-dense"), tmp_path_factory.mktemp("m") / "tiny")


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))


def _reshape_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"][:10].clone()
    save_file(t, str(d / "model.safetensors"))


def _bad_config(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda d: (d / "config.json").unlink(), r"config.json: missing"),
    (lambda d: (d / "config.json").write_text("{not json"), r"config.json: not valid JSON"),
    (_bad_config, r"config.json: missing key 'hidden_size'"),
    (lambda d: (d / "config.json").write_text('{"model_type": "gpt2"}'),
     r"model_type 'gpt2' is not supported"),
    (_truncate, r"model.safetensors: corrupted safetensors file"),
    (lambda d: (d / "model.safetensors").unlink(), r"no \*.safetensors weight files"),
    (_drop_tensor, r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    (_reshape_tensor, r"'model.norm.weight' has shape \(10,\), expected \(64,\)"),
    (lambda d: (d / "tokenizer.json").write_text("garbage"), r"tokenizer.json: cannot load"),
])
def test_corrupted_model_dir(tiny_dir: Path, tmp_path: Path, corrupt, message: str) -> None:
    d = _corrupt_copy(tiny_dir, tmp_path / "bad")
    corrupt(d)
    with pytest.raises(ModelLoadError, match=message):
        Engine(EngineConfig(model=str(d), block_tokens=16, num_blocks=8))


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model_dir(tmp_path / "nothing.txt", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*tiny-dense"):
        Engine(EngineConfig(model="nope"))
