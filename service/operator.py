"""Operator RPCs both engine services answer the same way (thin handlers call these)."""

from __future__ import annotations

from typing import Any

from proto import common_pb2
from service.engine_thread import EngineThread


async def reset_prefix_cache(thread: EngineThread, engine: Any
                             ) -> common_pb2.ResetPrefixCacheResponse:
    """Drop the engine's G1 prefix cache, on its own thread (the pool is not
    thread-safe); what the warehouse holds is untouched."""
    dropped, in_use = await thread.call(engine.blocks.reset_cache)
    return common_pb2.ResetPrefixCacheResponse(dropped_blocks=dropped, in_use_blocks=in_use)
