"""What the scheduler-side connector tells the worker-side one each step.

A ``BlockTransfer`` names warehouse blocks (128-bit chained keys) and the vLLM
block ids they occupy, one list per KV cache group (hybrid models have a group
per attention type; a group's null block id means "nothing to copy for that
group's layers", e.g. a sliding-window group outside its window). Everything
here pickles cheaply: vLLM ships the metadata to every worker each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.types import RequestCtx


@dataclass(slots=True)
class BlockTransfer:
    req_id: str
    ctx: RequestCtx
    keys: list[bytes]
    block_ids: list[list[int]]          # [group][i]: vLLM block of keys[i]
    first_block: int = 0                # index of keys[0] in the request's chain

    def __post_init__(self) -> None:
        if any(len(g) != len(self.keys) for g in self.block_ids):
            raise ValueError(f"{self.req_id}: {len(self.keys)} keys but block id lists of "
                             f"{[len(g) for g in self.block_ids]}")


@dataclass(slots=True)
class KVServeMeta(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)        # this step's forward needs them
    async_loads: list[BlockTransfer] = field(default_factory=list)  # done between steps
    saves: list[BlockTransfer] = field(default_factory=list)
    new_requests: int = 0           # requests computing their first tokens this step (timing)
