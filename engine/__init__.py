"""The model runner shared by prefill and decode (DESIGN §6, INTERFACES §1).

Block tensor shape: ``[n_blocks, layers, 2, kv_heads, block_tokens, head_dim]``
(2 = K then V), engine dtype, contiguous.
"""

from engine.config import EngineConfig, ModelConfig, MoEConfig
from engine.errors import (
    DeviceError,
    EngineError,
    EngineInputError,
    ModelConfigError,
    ModelLoadError,
    PoolExhaustedError,
)
from engine.kv_pool import KVLayout
from engine.runner import Engine
from engine.sampling import SamplingParams
from engine.sequence import GenerationResult, PrefillResult
from engine.tokenizer import Tokenizer

__all__ = [
    "DeviceError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineInputError",
    "GenerationResult",
    "KVLayout",
    "MoEConfig",
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "PoolExhaustedError",
    "PrefillResult",
    "SamplingParams",
    "Tokenizer",
]
