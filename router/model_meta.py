"""What the router knows about the served model: its config and tokenizer.

The router tokenizes (block keys are computed from token ids) and checks the
context length, but never loads weights: it reads ``config.json`` and the
tokenizer of the same model the instances serve, resolved by the same names
the engine accepts (a random-weight config, a fetchable model, a directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig, named_configs, read_config
from engine.errors import ModelConfigError
from engine.fetch import KNOWN_MODELS, fetch_model
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class ModelMeta:
    served_name: str              # the id clients send as "model" and /v1/models lists
    config: ModelConfig
    tokenizer: Tokenizer

    @property
    def max_context(self) -> int:
        return self.config.max_position

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def _served_name(model: str) -> str:
    return Path(model).name if "/" in model else model


def load_model_meta(model: str, *, served_name: str = "") -> ModelMeta:
    """Config and tokenizer of ``model`` (a named config, a known model, or a directory)."""
    name = served_name or _served_name(model)
    if model in named_configs():
        cfg = ModelConfig.from_name(model)
        return ModelMeta(name, cfg, ByteTokenizer(cfg.vocab_size))
    if model in KNOWN_MODELS:
        root = fetch_model(model)
    else:
        root = Path(model).expanduser()
        if not root.is_dir():
            raise ModelConfigError(
                f"unknown model {model!r}: not a named config {list(named_configs())}, "
                f"not a fetchable model {sorted(KNOWN_MODELS)}, and no directory of that name")
    cfg = read_config(root)
    return ModelMeta(name, cfg, HFTokenizer(root, eos_ids=cfg.eos_token_ids))
