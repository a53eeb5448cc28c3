"""Config loading and validation: bad values are named, good files round-trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.config import ConfigError, HitRule, KVServeConfig, TrafficClasses, parse_size
from kvserve.cli import main


def test_defaults_are_deepseeks_ttls() -> None:
    cfg = KVServeConfig()
    assert cfg.classes.ttl("agent") == 3 * 86_400
    assert cfg.classes.ttl("chat") == 7 * 86_400
    assert cfg.classes.ttl("") == cfg.classes.ttl(cfg.classes.default)
    assert cfg.blocks.reserve == 1


@pytest.mark.parametrize(("matched", "length", "expected"), [
    (10_000, 1_000, 832),     # L-134 = 866 -> floor to 64 = 832
    (128, 1_000, 128),        # matched shorter than the rule
    (100, 1_000, 64),         # matched not block aligned
    (0, 1_000, 0),
    (1_000, 134, 0),          # nothing usable below the reserve
    (1_000, 198, 64),
])
def test_hit_rule_hybrid(matched: int, length: int, expected: int) -> None:
    rule = HitRule(block_tokens=64, window=128, backtrack=6)
    assert rule.reserve == 134
    assert rule.usable_tokens(matched, length) == expected


def test_hit_rule_full_attention_reserves_the_last_token() -> None:
    rule = HitRule(block_tokens=64)
    assert rule.usable_tokens(128, 128) == 64
    assert rule.usable_tokens(128, 129) == 128


def test_sizes_and_errors(tmp_path: Path) -> None:
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_size("lots")
    with pytest.raises(ConfigError, match="unknown traffic class"):
        TrafficClasses().resolve("bulk")
    with pytest.raises(ConfigError, match="replay_keep_tokens"):
        HitRule(window=128, backtrack=6, replay_keep_tokens=100)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['ttl'\]"):
        KVServeConfig.from_dict({"classes": {"ttl": 1}})
    with pytest.raises(ConfigError, match="unknown config section"):
        KVServeConfig.from_dict({"clases": {}})


def test_config_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[classes]\ndefault = "agent"\n[classes.ttl_s]\nagent = 60\nchat = 120\n'
                    '[tiers]\ng2_bytes = "1GiB"\n')
    assert main(["config", "check", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[classes]\ndefault = "bulk"\n')
    assert main(["config", "check", str(bad)]) == 2
    assert "classes.default 'bulk' is not a class" in capsys.readouterr().err


def test_config_check_lists_every_bad_field_with_path_and_type(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text('[blocks]\nblock_tokens = "64"\n[tiers]\ng2_bytes = [1]\nnode = 5\n'
                   '[ports]\nhttp = "x"\n[model]\ndtype = "fp8"\n[bogus]\n')
    with pytest.raises(ConfigError) as err:
        KVServeConfig.load(bad)
    known = sorted(f.name for f in dataclasses.fields(KVServeConfig))  # every section
    assert {"blocks", "quotas", "tiers"} <= set(known)
    assert err.value.problems == (
        f"unknown config section(s) ['bogus']; known: {known}",
        "model.dtype must be float32, bfloat16 or float16, got 'fp8'",
        "blocks.block_tokens: expected an integer, got str '64'",
        "tiers.g2_bytes: expected an integer or a size such as 4GiB, got list [1]",
        "tiers.node: expected a string, got int 5",
        "ports.http: expected an integer, got str 'x'")
    res = subprocess.run([sys.executable, "-m", "kvserve.cli", "config", "check", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "6 problems in the config" in res.stderr
    assert "not supported between" not in res.stderr and "Traceback" not in res.stderr


def test_whatif_section_parses_lists_and_names_bad_values() -> None:
    cfg = KVServeConfig.from_dict({"whatif": {"ttls": "30s, 1h,3d,inf", "capacities": "50M,inf"}})
    assert cfg.whatif.ttl_values() == (30.0, 3600.0, 259_200.0, float("inf"))
    assert cfg.whatif.capacity_values() == (50e6, float("inf"))
    assert KVServeConfig().whatif.capacity_values() == (float("inf"),)
    for bad in ({"ttls": "1h,soon"}, {"ttls": "0"}, {"capacities": "-5"},
                {"ttls": ",".join(["1h"] * 33)}):
        with pytest.raises(ConfigError, match="whatif"):
            KVServeConfig.from_dict({"whatif": bad})
