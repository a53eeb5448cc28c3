"""No secret in sight: one redaction helper for URLs, errors and logs; secrets
only by files that are not world-readable; placeholder or default secrets (the
ones our manifests ship) refuse to start, naming the setting."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from pathlib import Path

import pytest

from common.config import ConfigError, KVServeConfig, RedisSection
from connectors.vllm_config import ConnectorConfig
from kvserve.cli import main
from kvstore.errors import StoreUnavailable
from kvstore.index import BlockIndex
from router.auth import ApiKeyFileError, ApiKeys
from security.config import SecurityError, read_secret
from security.flags import redis_url_from
from security.redact import RedactingFilter, redact, redact_url, register_secret
from security.secret_files import (
    SecretFileError,
    check_url_secret,
    read_secret_text,
    refuse_placeholder,
    write_private,
)

K8S = Path(__file__).resolve().parents[2] / "k8s"


def test_redact_masks_url_passwords_and_registered_secrets() -> None:
    assert redact_url("redis://kvstore:s3cr3t-pw@10.0.0.1:6379/0") == \
        "redis://kvstore:***@10.0.0.1:6379/0"
    assert redact_url("rediss+cluster://:pw@[::1]:7000") == "rediss+cluster://:***@[::1]:7000"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    text = "Error connecting to redis://prefill:hunter2-xyz@h:1/0 and rediss://u:p@q@x:2"
    out = redact(text)
    assert "hunter2-xyz" not in out and "p@q" not in out and "redis://prefill:***@h:1/0" in out
    register_secret("9f0e8d7c6b5a4a3b2c1d")
    register_secret(bytes.fromhex("00112233445566778899aabbccddeeff"))
    assert redact("key 9f0e8d7c6b5a4a3b2c1d, secret 00112233445566778899aabbccddeeff") == \
        "key ***, secret ***"


def test_log_records_are_scrubbed_arguments_and_tracebacks_included() -> None:
    register_secret("tok-5c2f1e0d9b8a")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger("test.redaction")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("connecting to %s", "redis://router:pw-abc123@h:6379/0")
        try:
            raise RuntimeError("auth with tok-5c2f1e0d9b8a failed")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "pw-abc123" not in text and "tok-5c2f1e0d9b8a" not in text
    assert "redis://router:***@h:6379/0" in text and "RuntimeError" in text


@pytest.mark.parametrize("value", ["", "   ", "replace-me-in-your-overlay", "CHANGE-ME",
                                   "changeme", "change_me", "password", "secret", "<your-key>",
                                   "xxxxxxxx", "your-password-here"])
def test_placeholders_are_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(SecretFileError, match="the API key"):
        refuse_placeholder(value, "the API key")


def test_real_secrets_pass() -> None:
    assert refuse_placeholder("sk-4f9a1c0e7b2d", "x") == "sk-4f9a1c0e7b2d"
    assert check_url_secret("redis://kvstore:Zq8vT1pLw0@h:1/0", "x")


def _shipped_values() -> list[tuple[str, str]]:
    """Every secret value the manifests ship: secretGenerator literals and env files."""
    out: list[tuple[str, str]] = []
    for kust in K8S.rglob("kustomization.yaml"):
        for m in re.finditer(r"^\s*-\s*([A-Za-z0-9_.-]+)=(.+?)\s*$", kust.read_text(), re.M):
            if not m.group(2).endswith((".acl", ".env")):       # a file: read below
                out.append((f"{kust.relative_to(K8S)}: {m.group(1)}", m.group(2)))
    for env in K8S.rglob("*.env"):
        for line in env.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                out.append((f"{env.relative_to(K8S)}: {key}", value))
    return out


def test_every_secret_the_manifests_ship_refuses_to_start() -> None:
    shipped = _shipped_values()
    secrets = [(w, v) for w, v in shipped
               if ("://" in v and "@" in v) or re.search(r"key|secret|password", w)]
    assert len(secrets) >= 13, shipped     # 4 Redis users x 3 places, the API keys, S3
    for where, value in secrets:
        with pytest.raises(SecretFileError, match=r"placeholder|empty"):
            if "://" in value:
                check_url_secret(value, where)
            else:
                refuse_placeholder(value, where)


def test_a_password_never_goes_on_a_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["store", "serve"], ["prefill", "serve"], ["router", "serve"], ["status"],
                ["up"]):
        with pytest.raises(SystemExit) as exc:
            main([*cmd, "--redis-url", "redis://kvstore:Zq8vT1pLw0@127.0.0.1:1/0"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--redis-url-file" in err and "Zq8vT1pLw0" not in err, cmd
    with pytest.raises(SystemExit):
        main(["store", "serve", "--g4-url", "s3://AKIA4EXAMPLE7Q:Zq8vT1pLw0@bucket/kv"])
    assert "Zq8vT1pLw0" not in capsys.readouterr().err


def test_redis_url_files_must_be_private_and_real(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL_FILE", raising=False)
    loose = tmp_path / "loose.url"
    loose.write_text("redis://kvstore:Zq8vT1pLw0@127.0.0.1:1/0\n")
    loose.chmod(0o644)
    placeholder = write_private(tmp_path / "p.url",
                                "redis://kvstore:replace-me-in-your-overlay@h:6379/0\n")
    for path, why in ((loose, "readable by every local user"), (placeholder, "placeholder"),
                      (tmp_path / "missing.url", "cannot read")):
        code = main(["store", "reindex", "--redis-url-file", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and why in err and "--redis-url-file" in err, err
        assert "Zq8vT1pLw0" not in err
    good = write_private(tmp_path / "good.url", "redis://kvstore:Zq8vT1pLw0@127.0.0.1:1/0\n")
    assert read_secret_text(good, "x").endswith("/0")
    monkeypatch.setenv("REDIS_URL_FILE", str(good))
    assert redis_url_from(None).startswith("redis://kvstore:")


def test_config_files_and_vllm_flags_carry_no_redis_password() -> None:
    with pytest.raises(ConfigError, match="url_file"):
        RedisSection(url="redis://:Zq8vT1pLw0@h:1/0")
    with pytest.raises(ConfigError, match="url_file"):
        KVServeConfig.from_dict({"redis": {"url": "redis://u:Zq8vT1pLw0@h:1/0"}})
    assert RedisSection(url="redis://h:1/0", url_file="/run/redis.url").url_file
    with pytest.raises(ConfigError, match="redis_url_file"):
        ConnectorConfig(redis_url="redis://engine:Zq8vT1pLw0@h:1/0")


def test_placeholder_api_keys_and_secrets_refuse_to_start(tmp_path: Path) -> None:
    keys = write_private(tmp_path / "keys", "# replace me? no: comments are fine\n"
                                            "sk-4f9a1c0e7b2d alice\n"
                                            "replace-me-in-your-overlay default\n")
    with pytest.raises(ApiKeyFileError, match=r"keys:3.*placeholder"):
        ApiKeys.load(keys)
    write_private(keys, "sk-4f9a1c0e7b2d alice\n")
    assert ApiKeys.load(keys).tenant_for("Bearer sk-4f9a1c0e7b2d") == "alice"
    keys.chmod(0o644)
    with pytest.raises(ApiKeyFileError, match="readable by every local user"):
        ApiKeys.load(keys)
    zeros = write_private(tmp_path / "secret", "00" * 32 + "\n")
    with pytest.raises(SecurityError, match="placeholder"):
        read_secret(zeros)


def test_placeholder_object_store_credentials_refuse_to_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA4EXAMPLE7Q")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "CHANGE-ME")
    code = main(["store", "serve", "--g4-url", "s3://bucket/kv", "--port", "0",
                 "--redis-url", "redis://127.0.0.1:1/0", "--insecure"])
    err = capsys.readouterr().err
    assert code == 2 and "$AWS_SECRET_ACCESS_KEY" in err and "placeholder" in err, err


def test_store_unavailable_names_redis_without_its_password() -> None:
    url = "redis://kvstore:Zq8vT1pLw0@127.0.0.1:1/0"        # nothing listens on port 1

    async def body() -> str:
        ix = BlockIndex(url, node="n", classes=KVServeConfig().classes)
        try:
            await ix.start()
        except StoreUnavailable as exc:
            return str(exc)
        finally:
            await ix.close()
        return ""

    message = asyncio.run(body())
    assert "127.0.0.1" in message and "Zq8vT1pLw0" not in message and "***" in message
