"""The model runner shared by prefill and decode (docs/engine.md; the contract:
docs/architecture.md#engine-contract).

Block tensor shape: ``[n_blocks, layers, 2, kv_heads, block_tokens, head_dim]``
(2 = K then V), engine dtype, contiguous.
"""

import importlib

import common.process_env  # noqa: F401  (before torch loads: common/process_env.py)

# Exported lazily (PEP 562): ``import engine.errors`` or ``engine.tokenizer`` in a
# process that never computes (the router, ``kvserve up``) must not load torch
# and the model runner, seconds of a start on a 2-core machine.
_EXPORTS = {
    "EngineConfig": "engine.config", "ModelConfig": "engine.config",
    "MoEConfig": "engine.config",
    "DeviceError": "engine.errors", "EngineError": "engine.errors",
    "EngineInputError": "engine.errors", "ModelConfigError": "engine.errors",
    "ModelLoadError": "engine.errors", "PoolExhaustedError": "engine.errors",
    "KVLayout": "engine.kv_pool", "Engine": "engine.runner",
    "SamplingParams": "engine.sampling", "GenerationResult": "engine.sequence",
    "PrefillResult": "engine.sequence", "Tokenizer": "engine.tokenizer",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
