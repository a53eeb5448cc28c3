"""The G1 budget and instance counts as configuration: ``[engine]`` in the TOML,
``--g1`` / ``--prefill`` / ``--decode`` on ``kvserve up``, and G1 as whole blocks."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from common.config import ConfigError, KVServeConfig
from engine.kv_pool import BlockPool
from kvserve import launcher
from service.config import block_nbytes_for, engine_spec_from


def _up(*flags: str, cfg: KVServeConfig | None = None) -> KVServeConfig:
    p = argparse.ArgumentParser()
    launcher.configure(p)
    return launcher.effective_config(cfg or KVServeConfig(), p.parse_args(list(flags)))


def test_g1_bytes_becomes_whole_blocks() -> None:
    cfg = KVServeConfig.from_dict({"engine": {"g1_bytes": "256MiB"},
                                   "model": {"name": "tiny-dense"}})
    spec = engine_spec_from(cfg)
    per_block = block_nbytes_for(spec)
    assert spec.num_blocks == 256 * 2**20 // per_block
    assert spec.num_blocks * per_block <= 256 * 2**20 < (spec.num_blocks + 1) * per_block
    # No budget: the services' own default pool.
    assert engine_spec_from(KVServeConfig()).num_blocks == 2048


def test_smollm2_block_size_matches_its_layout(smollm2_dir: str) -> None:
    cfg = KVServeConfig.from_dict({"engine": {"g1_bytes": "256MiB"}})
    # 30 layers x K,V x 3 kv heads x 64 tokens x 64 dims x 4 bytes
    assert block_nbytes_for(engine_spec_from(cfg)) == 30 * 2 * 3 * 64 * 64 * 4
    assert engine_spec_from(cfg).num_blocks == 91


@pytest.mark.parametrize("bad,field", [({"g1_bytes": "lots"}, "g1_bytes"),
                                       ({"prefill": 0}, "prefill"),
                                       ({"decode": 65}, "decode"),
                                       ({"threads": -1}, "threads")])
def test_bad_engine_sections_name_the_field(bad: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"engine\.{field}"):
        KVServeConfig.from_dict({"engine": bad})


def test_up_flags_override_the_config_and_split_threads() -> None:
    base = KVServeConfig.from_dict({"engine": {"prefill": 3, "g1_bytes": "1GiB"}})
    cfg = _up("--prefill", "2", "--decode", "2", "--g1", "128MiB", cfg=base)
    assert (cfg.engine.prefill, cfg.engine.decode, cfg.engine.g1_bytes) == (2, 2, 128 * 2**20)
    unset = replace(cfg.engine, threads=0)
    assert cfg.engine.threads == launcher.engine_threads(unset)    # what up wrote
    assert launcher.engine_threads(unset, cpus=2) == 1
    assert launcher.engine_threads(unset, cpus=16) == 8
    assert launcher.engine_threads(replace(unset, threads=3), cpus=16) == 3
    one = _up()
    assert (one.engine.prefill, one.engine.decode, one.engine.threads) == (1, 1, 0)
    with pytest.raises(ConfigError, match=r"engine\.prefill"):
        _up("--prefill", "0")
    # Every instance gets its own ports, and the config a child reads round-trips.
    metrics = launcher._metrics_ports(cfg, free=False)
    slots = launcher.engine_slots(cfg, metrics, free=False)
    assert [s.name for s in slots] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert len({s.port for s in slots}) == len({s.metrics_port for s in slots}) == 4
    assert KVServeConfig.from_dict(__import__("tomllib").loads(launcher.to_toml(cfg))) == cfg


def test_reset_cache_forgets_keys_but_not_running_blocks() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"ka")
    pool.cache(b, b"kb")
    pool.release([a])                 # a: cached and idle; b: cached and held
    assert pool.match([b"ka"]) == [a] and pool.num_free == 3
    assert pool.reset_cache() == (2, 1)
    assert pool.match([b"ka"]) == [] and pool.match([b"kb"]) == []
    assert pool.num_free == 3 and pool.num_cached == 0
    pool.release([b])                 # b goes back free, not to a cache it left
    assert pool.num_free == 4
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_decode_pool_may_differ(tmp_path: object) -> None:
    from pathlib import Path

    cfg = _up("--g1", "128MiB", "--decode-g1", "1GiB", "--free-ports")
    assert (cfg.engine.g1_bytes, cfg.engine.decode_g1_bytes) == (128 * 2**20, 2**30)
    metrics = launcher._metrics_ports(cfg, free=True)
    children = launcher._children(cfg, Path(str(tmp_path)) / "k.toml", Path(str(tmp_path)),
                                  router=False, metrics=metrics, free=True)
    by = {c.name: c.argv for c in children}
    blocks = 2**30 // block_nbytes_for(engine_spec_from(cfg))
    assert by["decode"][by["decode"].index("--num-blocks") + 1] == str(blocks)
    assert "--num-blocks" not in by["prefill"]       # prefill reads [engine].g1_bytes itself



def test_kernels_and_prefill_chunk_reach_both_engines() -> None:
    """``[engine] kernels`` / ``prefill_chunk``: one section both services read (the
    chunk is part of the fingerprint with non-invariant kernels), bad values named."""
    cfg = KVServeConfig.from_dict({"model": {"name": "tiny-dense"},
                                   "engine": {"kernels": "torch", "prefill_chunk": 512}})
    spec = engine_spec_from(cfg)
    assert (spec.kernels, spec.prefill_chunk) == ("torch", 512)
    assert (spec.engine_config().kernels, spec.engine_config().prefill_chunk) == ("torch", 512)
    default = engine_spec_from(KVServeConfig())
    assert (default.kernels, default.prefill_chunk) == ("auto", 0)
    assert KVServeConfig.from_dict(__import__("tomllib").loads(launcher.to_toml(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"engine\.prefill_chunk"):
        KVServeConfig.from_dict({"engine": {"prefill_chunk": -64}})
    with pytest.raises(ConfigError, match=r"engine\.prefill_chunk"):
        engine_spec_from(KVServeConfig.from_dict({"engine": {"prefill_chunk": 100}}))
    with pytest.raises(ConfigError, match=r"engine\.kernels"):
        engine_spec_from(KVServeConfig.from_dict({"engine": {"kernels": "fastest"}}))
    with pytest.raises(ConfigError, match=r"engine\.kernels"):
        KVServeConfig.from_dict({"engine": {"kernels": "Bad Name"}})


def test_gpu_shares_split_one_device_and_reach_each_engine(tmp_path: object) -> None:
    """``[engine] gpu_fraction`` / ``decode_gpu_fraction``: each engine process's
    cap on the shared GPU (issue 18 run 4: decode OOM beside an uncapped
    prefill); shares that add up past the device are refused up front."""
    from pathlib import Path

    cfg = KVServeConfig.from_dict({"model": {"name": "tiny-dense"},
                                   "engine": {"gpu_fraction": 0.3, "decode_gpu_fraction": 0.6}})
    assert engine_spec_from(cfg).engine_config().gpu_fraction == 0.3   # prefill's own
    metrics = launcher._metrics_ports(cfg, free=True)
    children = launcher._children(cfg, Path(str(tmp_path)) / "k.toml", Path(str(tmp_path)),
                                  router=False, metrics=metrics, free=True)
    by = {c.name: c.argv for c in children}
    assert by["decode"][by["decode"].index("--gpu-fraction") + 1] == "0.6"
    assert "--gpu-fraction" not in by["prefill"]
    assert KVServeConfig.from_dict(__import__("tomllib").loads(launcher.to_toml(cfg))) == cfg
    # decode's share defaults to prefill's: two engines of 0.5 fill the device exactly
    assert KVServeConfig.from_dict({"engine": {"gpu_fraction": 0.5}}).engine.decode_fraction \
        == 0.5
    with pytest.raises(ConfigError, match=r"add up to 1\.2"):
        KVServeConfig.from_dict({"engine": {"gpu_fraction": 0.3, "decode_gpu_fraction": 0.9}})
    with pytest.raises(ConfigError, match=r"add up to 1\.2"):    # 2 prefill x 0.3 + 0.6
        KVServeConfig.from_dict({"engine": {"prefill": 2, "gpu_fraction": 0.3,
                                            "decode_gpu_fraction": 0.6}})
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"engine\.gpu_fraction"):
            KVServeConfig.from_dict({"engine": {"gpu_fraction": bad}})
