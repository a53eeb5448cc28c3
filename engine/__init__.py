"""The model runner shared by prefill and decode (docs/engine.md; the contract:
docs/architecture.md#engine-contract).

Block tensor shape: ``[n_blocks, layers, 2, kv_heads, block_tokens, head_dim]``
(2 = K then V), engine dtype, contiguous.
"""

import os

# libgomp reads this when torch loads it, so it only helps if nothing imported
# torch yet (kvserve/cli.py sets it too). Spinning OpenMP workers on an
# oversubscribed machine (several engine processes on 2 cores) made a 2-thread
# attention call 400x slower (28 ms vs 68 us, measured on cpu-2c).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
