"""The connector's pure parts, without a vLLM server: configuration, identity,
the G1 picture, the launch spec and the install fix-up's choices."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.config import ConfigError
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_identity import IdentityError, fingerprint, traffic_class_of
from connectors.vllm_presence import LocalBlocks
from kvserve.launch_vllm import VLLMSpec
from security.secret_files import write_private


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


def test_spec_builds_the_connector_config_vllm_reads(tmp_path) -> None:
    secret_url = "redis://engine:Zq8vT1pLw0x@r:6379/0"
    url = write_private(tmp_path / "redis-url", secret_url + "\n")
    spec = VLLMSpec(model_dir="/m", port=8100, store="h:1", redis_url="",
                    redis_url_file=str(url), instance_id="v1", insecure=True,
                    extra_config={"window": 4})
    argv = spec.argv()
    assert not any("Zq8vT1pLw0x" in a for a in argv)        # the password stays out of argv
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector_module_path"] == "connectors.vllm"
    assert ktc["kv_load_failure_policy"] == "recompute"
    assert argv[argv.index("--block-size") + 1] == "64"
    cfg = ConnectorConfig.from_extra(ktc["kv_connector_extra_config"])  # what vLLM passes
    assert (cfg.store, cfg.advertise, cfg.window, cfg.insecure) == ("h:1",
                                                                   "http://127.0.0.1:8100", 4,
                                                                   True)
    assert (cfg.redis_url, cfg.registry_url()) == ("", secret_url)
    with pytest.raises(ValueError, match="password never goes on vLLM's command line"):
        dataclasses.replace(spec, redis_url=secret_url, redis_url_file="").argv()
    assert "VLLM_SERVER_DEV_MODE" not in spec.env() and "VLLM_API_KEY" not in spec.env()
    with pytest.raises(ValueError, match="multiple of 32"):
        VLLMSpec(model_dir="/m", port=1, store="", redis_url="", instance_id="x",
                 block_tokens=48, insecure=True)
    with pytest.raises(ValueError, match="tls_dir"):
        VLLMSpec(model_dir="/m", port=1, store="", redis_url="", instance_id="x")


def test_a_secure_spec_serves_https_with_its_identity_and_the_key_in_env(tmp_path) -> None:
    from kvserve.launch_vllm import engine_identity
    from security.pki import ensure_deployment
    from security.vllm_trust import vllm_api_key

    dep = ensure_deployment(tmp_path / "dep")
    ident = engine_identity(dep, "vllm-7")
    spec = VLLMSpec(model_dir="/m", port=8443, store="h:1", redis_url="", instance_id="vllm-7",
                    tls_dir=str(ident), secret_file=str(dep / "secret"),
                    kv_events="ipc:///tmp/x.ev")
    argv, env = spec.argv(), spec.env()
    assert spec.base_url == "https://127.0.0.1:8443"
    assert argv[argv.index("--ssl-cert-reqs") + 1] == "2"          # client certificates
    assert argv[argv.index("--ssl-certfile") + 1] == str(ident / "tls.crt")
    key = vllm_api_key(bytes.fromhex((dep / "secret").read_text().strip()))
    assert env["VLLM_API_KEY"] == key and not any(key in a for a in argv)
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "ipc:///tmp/x.ev"
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector_extra_config"]["tls_dir"] == str(ident)
    assert oct((ident / "tls.key").stat().st_mode & 0o777) == "0o600"


def test_a_missing_setup_step_is_named_in_one_line_not_a_traceback(tmp_path) -> None:
    """What `pip install -e '.[vllm]'` without `kvserve vllm-setup` leaves behind: a
    torchvision that dies on import beside the CPU torch. A real package on the path
    (with its distribution metadata), not a patched function."""
    import os
    import subprocess
    import sys

    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    meta = tmp_path / "torchvision-0.99.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for argv in (["bench", "vllm", "--insecure"],
                 ["bench", "vllm-trace", "--trace", str(tmp_path / "t.jsonl")],
                 ["up", "--engine", "vllm", "--insecure", "--state-dir", str(tmp_path / "st")]):
        proc = subprocess.run([sys.executable, "-m", "kvserve.cli", *argv], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in proc.stderr
        assert any("kvserve vllm-setup" in ln and "torchvision" in ln for ln in lines), lines
