"""Where a model comes from, by name: a random-weight config, a fetchable real
model, or an HF-layout directory (a registry, tried in that order)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig, named_configs
from engine.errors import ModelConfigError
from engine.fetch import KNOWN_MODELS, fetch_model
from engine.loader import load_model_dir
from engine.tokenizer import ByteTokenizer, Tokenizer
from engine.weights import RANDOM_INIT_VERSION, ModelWeights, init_device, random_weights


@dataclass(frozen=True, slots=True)
class ModelSource:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    weights_id: bytes            # identifies the weights (hash of files, or config + seed)


def _random(name: str, device: torch.device, dtype: torch.dtype, seed: int) -> ModelSource:
    cfg = ModelConfig.from_name(name)
    where = init_device(cfg, device)
    weights = random_weights(cfg, seed, device, dtype)
    ident = f"random-v{RANDOM_INIT_VERSION}|{cfg.describe()}|seed={seed}|init={where.type}"
    wid = hashlib.blake2b(ident.encode(), digest_size=16).digest()
    return ModelSource(cfg, weights, ByteTokenizer(cfg.vocab_size), wid)


def _directory(path: Path, device: torch.device, dtype: torch.dtype) -> ModelSource:
    m = load_model_dir(path, device, dtype)
    return ModelSource(m.config, m.weights, m.tokenizer, m.weights_hash)


def load_source(model: str, device: torch.device, dtype: torch.dtype, seed: int) -> ModelSource:
    if model in named_configs():
        return _random(model, device, dtype, seed)
    if model in KNOWN_MODELS:
        return _directory(fetch_model(model), device, dtype)
    path = Path(model).expanduser()
    if path.exists():
        return _directory(path, device, dtype)
    raise ModelConfigError(
        f"unknown model {model!r}: not a named config {list(named_configs())}, "
        f"not a fetchable model {sorted(KNOWN_MODELS)}, and no directory of that name")
