"""The connector's pure parts, without a vLLM server: configuration, identity,
the G1 picture, the launch spec and the install fix-up's choices."""

from __future__ import annotations

import json

import pytest

from common.config import ConfigError
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_identity import IdentityError, fingerprint, tenant_of, traffic_class_of
from connectors.vllm_presence import LocalBlocks
from kvserve.launch_vllm import VLLMSpec


def test_config_rejects_unknown_keys_and_bad_values_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key.*'stroe'"):
        ConnectorConfig.from_extra({"stroe": "x"})
    with pytest.raises(ConfigError, match="default_class"):
        ConnectorConfig.from_extra({"default_class": "batch"})
    with pytest.raises(ConfigError, match="instance_ttl_s"):
        ConnectorConfig.from_extra({"heartbeat_s": 5, "instance_ttl_s": 5})
    cfg = ConnectorConfig.from_extra({"window": 128, "backtrack": 6, "classes": ["agent", "chat"]})
    assert cfg.hit_rule.reserve == 134
    assert cfg.hit_rule.usable_tokens(1536, 1493) == 1344     # the L - 134 rule, floored to 64
    assert ConnectorConfig().hit_rule.usable_tokens(1472, 1493) == 1472


def test_tenant_comes_from_cache_salt_and_distinct_salts_stay_distinct() -> None:
    assert tenant_of(None) == tenant_of("") == "default"
    assert tenant_of("alice") == "alice"
    odd_a, odd_b = tenant_of("tenant with spaces/1"), tenant_of("tenant with spaces/2")
    assert odd_a.startswith("salt-") and odd_b.startswith("salt-") and odd_a != odd_b
    assert tenant_of("tenant with spaces/1") == odd_a                 # stable


def test_traffic_class_from_kv_transfer_params_with_a_configured_default() -> None:
    classes = ConnectorConfig(default_class="agent").traffic_classes()
    assert traffic_class_of(None, classes) == "agent"
    assert traffic_class_of({"kv_class": "chat"}, classes) == "chat"
    with pytest.raises(IdentityError, match="unknown traffic class"):
        traffic_class_of({"kv_class": "nightly"}, classes)


def test_fingerprint_covers_weights_dtype_layout_and_block_size() -> None:
    base = dict(dtype="float32", cache_dtype="auto", layout="LBHNC", block_tokens=64)
    ref = fingerprint(b"w" * 16, **base)
    changed = [fingerprint(b"x" * 16, **base)] + [
        fingerprint(b"w" * 16, **{**base, k: v})
        for k, v in (("dtype", "bfloat16"), ("cache_dtype", "fp8"), ("layout", "LBNHC"),
                     ("block_tokens", 32))]
    assert len({ref, *changed}) == 6 and all(len(f) == 16 for f in changed)


def test_local_blocks_announces_new_keys_once_and_evicts_least_recent() -> None:
    g1 = LocalBlocks(capacity=3)
    assert g1.touch([b"a", b"b"]) == ([b"a", b"b"], [])
    assert g1.touch([b"a", b"c"]) == ([b"c"], [])                # a is only refreshed
    assert g1.touch([b"d"]) == ([b"d"], [b"b"])                  # b is the least recent


def test_spec_builds_the_connector_config_vllm_reads() -> None:
    spec = VLLMSpec(model_dir="/m", port=8100, store="h:1", redis_url="redis://r",
                    instance_id="v1", insecure=True, extra_config={"window": 4})
    argv = spec.argv()
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector_module_path"] == "connectors.vllm"
    assert ktc["kv_load_failure_policy"] == "recompute"
    assert argv[argv.index("--block-size") + 1] == "64"
    cfg = ConnectorConfig.from_extra(ktc["kv_connector_extra_config"])  # what vLLM passes
    assert (cfg.store, cfg.advertise, cfg.window, cfg.insecure) == ("h:1",
                                                                   "http://127.0.0.1:8100", 4,
                                                                   True)
    with pytest.raises(ValueError, match="multiple of 32"):
        VLLMSpec(model_dir="/m", port=1, store="", redis_url="", instance_id="x",
                 block_tokens=48)
