"""Service configs: built from the deployment config plus flags, validated."""

from __future__ import annotations

import pytest

from common.config import ConfigError, KVServeConfig
from decode_svc.config import DecodeConfig
from prefill_svc.config import PrefillConfig
from service.config import CostConfig, Endpoint, EngineSpec


def test_from_kvserve_applies_sections_and_overrides() -> None:
    cfg = KVServeConfig.from_dict({"model": {"name": "tiny-dense"}, "blocks": {"block_tokens": 32},
                                   "ports": {"host": "127.0.0.2", "kvstore": 6000,
                                             "prefill": 6001, "decode": 6002},
                                   "classes": {"ttl_s": {"agent": 60, "chat": 120}}})
    p = PrefillConfig.from_kvserve(cfg, redis_url="redis://x:1/0", port=None,
                                   buffer_ttl_s=5.0, fetch_policy="always", num_blocks=99)
    assert (p.engine.model, p.engine.block_tokens, p.engine.num_blocks) == ("tiny-dense", 32, 99)
    assert (p.endpoint.host, p.endpoint.port) == ("127.0.0.2", 6001)
    assert p.endpoint.store_address == "127.0.0.2:6000"
    assert p.endpoint.redis_url == "redis://x:1/0"
    assert p.buffer_ttl_s == 5.0 and p.cost.fetch_policy == "always"
    assert p.classes.ttl_s == {"agent": 60, "chat": 120}
    d = DecodeConfig.from_kvserve(cfg, store_address="", max_seqs=3)
    assert (d.endpoint.port, d.endpoint.store_address, d.max_seqs) == (6002, "", 3)
    with pytest.raises(ConfigError, match="unknown setting"):
        PrefillConfig.from_kvserve(cfg, bogus=1)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: EngineSpec(dtype="int8"), "dtype"),
    (lambda: EngineSpec(device="tpu"), "device"),
    (lambda: Endpoint(port=70000), "port"),
    (lambda: Endpoint(heartbeat_s=2.0, instance_ttl_s=1.0), "instance_ttl_s"),
    (lambda: Endpoint(metrics_port=-2), "metrics_port"),
    (lambda: CostConfig(fetch_policy="sometimes"), "fetch_policy"),
    (lambda: PrefillConfig(default_tenant="no spaces"), "default_tenant"),
    (lambda: PrefillConfig(chunk_bytes=100), "chunk_bytes"),
    (lambda: PrefillConfig(buffer_ttl_s=0), "buffer_ttl_s"),
    (lambda: DecodeConfig(max_seqs=0), "max_seqs"),
    (lambda: DecodeConfig(ep_redundant=-1), "ep_redundant"),
])
def test_bad_values_name_the_field(build: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()  # type: ignore[operator]


def test_sizes_accept_units() -> None:
    assert PrefillConfig(buffer_max_bytes="1GiB").buffer_max_bytes == 2**30  # type: ignore[arg-type]
