"""``KVServeConnector``: kvserve's warehouse as vLLM's external KV cache.

Load it with no patch to vLLM::

    vllm serve MODEL --block-size 64 --kv-transfer-config '{
      "kv_connector": "KVServeConnector",
      "kv_connector_module_path": "connectors.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "127.0.0.1:50051", "redis_url": "redis://..."}}'

vLLM builds one instance in its scheduler process and one per worker process
(started with spawn, so this module imports in both). The scheduler half is
``connectors.vllm_scheduler``, the worker half ``connectors.vllm_worker``; this
class only wires vLLM's hooks to them. kvserve's core packages never import
this module (vLLM is the optional extra ``kvserve[vllm]``).

Hybrid sliding-window models: the class declares ``SupportsHMA`` (vLLM's
hybrid allocator stays on), blocks map per KV cache group, and the hit rule's
reserve (``window`` + ``backtrack`` in the extra config) keeps the tokens a
sliding window must recompute out of the restored prefix.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from common.config import ConfigError
from connectors.vllm_bridge import StoreBridge
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_entry import attested, events_endpoint
from connectors.vllm_identity import LAYOUT_TAG, fingerprint, model_weights_id
from connectors.vllm_meta import KVServeMeta
from connectors.vllm_presence import Presence
from connectors.vllm_scheduler import SchedulerSide
from connectors.vllm_worker import WorkerSide
from kvstore.registry import InstanceInfo

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _client_takes_security() -> bool:
    import inspect

    from kvstore.client import KVStoreClient

    return "security" in inspect.signature(KVStoreClient).parameters


class KVServeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        block = vllm_config.cache_config.block_size
        if block != self.cfg.block_tokens:
            raise ConfigError(f"vLLM --block-size {block} must equal the connector's "
                              f"block_tokens {self.cfg.block_tokens} (the warehouse's block)")
        if ktc.kv_load_failure_policy != "recompute":
            raise ConfigError('set "kv_load_failure_policy": "recompute" in --kv-transfer-config:'
                              " a block that fails its checksum must be recomputed, not fail "
                              "the request")
        # The same id in the scheduler and every worker (their counters add up).
        self.instance_id = self.cfg.instance_id or \
            f"vllm-{os.uname().nodename}-{str(ktc.engine_id)[:8]}"
        self.kv_role = ktc.kv_role
        mc = vllm_config.model_config
        dtype = str(mc.dtype).removeprefix("torch.")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.fingerprint = fingerprint(model_weights_id(mc.model), dtype=dtype,
                                       cache_dtype=cache_dtype, layout=LAYOUT_TAG,
                                       block_tokens=block)
        self.security = self.cfg.security()
        registry = self.cfg.registry_url()
        self.presence = (Presence(registry, self.instance_id, heartbeat_s=self.cfg.heartbeat_s,
                                  ttl_s=self.cfg.instance_ttl_s)
                         if registry else None)
        self.bridge = self._bridge() if self.cfg.store else None
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
            blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 1)
            groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()) or 1
            self.sched = SchedulerSide(self.cfg, self.fingerprint, self.bridge, self.presence,
                                       max_requests=max_seqs, local_blocks=blocks,
                                       secret=self.security.require_secret(), kv_groups=groups)
            if self.presence is not None:
                self.presence.register(self._info(blocks), self.sched.load)
        else:
            self.worker = WorkerSide(self.cfg, self.bridge, self.presence)
        log.info("kvserve connector %s (%s, %s): store %s, fingerprint %s", self.instance_id,
                 role.name.lower(), self.kv_role, self.cfg.store, self.fingerprint.hex())

    def _bridge(self) -> StoreBridge:
        security = self.security if _client_takes_security() else None
        on_degraded = (lambda why: self.presence.count("degraded")) if self.presence else None
        return StoreBridge(self.cfg.store, use_shm=self.cfg.use_shm,
                           retry_after_s=self.cfg.retry_after_s, security=security,
                           on_degraded=on_degraded)

    def _info(self, blocks: int) -> InstanceInfo:
        # A consumer only decodes what a producer prefilled; kv_both does both and
        # is listed as prefill (the router's vLLM backend sends it whole requests).
        role = "decode" if self.kv_role == "kv_consumer" else "prefill"
        events = events_endpoint(getattr(self._vllm_config, "kv_events_config", None),
                                 self.cfg.advertise)
        return attested(InstanceInfo(instance_id=self.instance_id, role=role,
                                     address=self.cfg.advertise, node=self.cfg.node,
                                     model_fingerprint=self.fingerprint.hex(),
                                     capacity=float(blocks), kv_events=events), self.security)

    @property
    def requires_kv_delivery(self) -> bool:
        return False            # a cache: a dropped save is a future miss, nothing more

    # -- worker side -------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVServeMeta):
            self.worker.bind(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches, self._kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KVServeMeta):
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KVServeMeta):
            self.worker.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving, _failed = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.loads.close()
        if self.bridge is not None:
            self.bridge.close()
        if self.presence is not None:
            self.presence.close()

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_meta(scheduler_output)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.finished(request)

    def take_events(self) -> list[Any]:
        return self.sched.take_events() if self.sched is not None else []
