"""How the engines of ``kvserve up`` share one GPU (kvserve/gpu_share.py): the
``[engine] gpu_share`` knob and its checks, the variables each child gets under
MPS, the private pipe directory, and the one-line refusal where the MPS control
binary is missing. The daemon itself needs the NVIDIA driver: it runs on the GPU
machine (scripts/mps_probe.py, scripts/gpu_serve.sh with GPU_SHARE=mps)."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from common.config import ConfigError, EngineSection, KVServeConfig
from kvserve import gpu_share, launcher
from kvserve.children import Child
from kvserve.gpu_share import (
    LOG_ENV,
    PIPE_ENV,
    SM_ENV,
    GpuShareError,
    MpsDaemon,
    TimeSlicing,
    pipe_dir_for,
    start_gpu_share,
)


def _up(*flags: str, cfg: KVServeConfig | None = None) -> KVServeConfig:
    p = argparse.ArgumentParser()
    launcher.configure(p)
    return launcher.effective_config(cfg or KVServeConfig(), p.parse_args(list(flags)))


def test_time_slicing_is_the_default_and_mps_round_trips_through_toml(tmp_path: Path) -> None:
    assert KVServeConfig().engine.gpu_share == "time"
    cfg = KVServeConfig.from_dict({"engine": {"gpu_share": "mps", "prefill_sm_percent": 70,
                                              "decode_sm_percent": 40}})
    path = tmp_path / "k.toml"
    path.write_text(launcher.to_toml(cfg))
    back = KVServeConfig.load(str(path)).engine
    assert (back.gpu_share, back.prefill_sm_percent, back.decode_sm_percent) == ("mps", 70, 40)


@pytest.mark.parametrize("bad,message", [
    ({"gpu_share": "mig"}, r"engine\.gpu_share must be one of time, mps, got 'mig'"),
    ({"gpu_share": "mps", "prefill_sm_percent": 101}, r"engine\.prefill_sm_percent .*101"),
    ({"gpu_share": "mps", "decode_sm_percent": -1}, r"engine\.decode_sm_percent .*-1"),
    # A cap means nothing when the driver gives each process every SM in turn.
    ({"decode_sm_percent": 30}, r"engine\.decode_sm_percent needs engine\.gpu_share"),
])
def test_bad_gpu_share_settings_name_the_field(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVServeConfig.from_dict({"engine": bad})


def test_up_flag_overrides_the_config() -> None:
    base = KVServeConfig.from_dict({"engine": {"gpu_share": "mps", "prefill_sm_percent": 0}})
    assert _up("--gpu-share", "time", cfg=base).engine.gpu_share == "time"
    assert _up("--gpu-share", "mps").engine.gpu_share == "mps"
    assert _up(cfg=base).engine.gpu_share == "mps"
    p = argparse.ArgumentParser()
    launcher.configure(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--gpu-share", "slices"])


def _children(tmp: Path) -> list[Child]:
    return [Child("kvstore", [], "", tmp / "kvstore.log"),
            Child("prefill-0", [], "", tmp / "p0.log", role="prefill"),
            Child("prefill-1", [], "", tmp / "p1.log", role="prefill"),
            Child("decode", [], "", tmp / "d.log", role="decode"),
            Child("router", [], "", tmp / "r.log")]


def test_under_mps_the_cuda_children_join_the_daemon_engines_with_their_sm_cap(
        tmp_path: Path) -> None:
    daemon = MpsDaemon("/nonexistent/nvidia-cuda-mps-control", tmp_path / "pipe",
                       tmp_path / "log", {"prefill": 70, "decode": 0})
    children = _children(tmp_path)
    for c in children:
        c.env = daemon.env(c.role or c.name)
    by = {c.name: c.env for c in children}
    where = {PIPE_ENV: str(tmp_path / "pipe"), LOG_ENV: str(tmp_path / "log")}
    assert by["prefill-0"] == by["prefill-1"] == where | {SM_ENV: "70"}
    assert by["decode"] == where                      # 0: every SM, so no variable at all
    # The kvstore's context (it pins G2) joins too, with no cap: it runs no kernels.
    assert by["kvstore"] == where
    assert by["router"] == {}                         # no CUDA context, nothing to join


def test_time_slicing_adds_nothing_and_starts_nothing(tmp_path: Path) -> None:
    children = _children(tmp_path)
    share = start_gpu_share(EngineSection(), tmp_path, children)
    assert isinstance(share, TimeSlicing) and share.mode == "time"
    assert all(c.env == {} for c in children)
    assert list(tmp_path.iterdir()) == []             # no folder, no daemon
    share.stop()


def test_pipe_directory_is_private_and_short_enough_for_sockets(tmp_path: Path) -> None:
    # A run directory short enough on any machine: pytest's own tmp_path can be too
    # long for the sockets already (a longer user name, an xdist worker's folder).
    run = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        short = pipe_dir_for(run)
        assert short.parent == run.resolve()
        assert stat.S_IMODE(short.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(run)
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    moved = pipe_dir_for(deep)
    try:
        assert not str(moved).startswith(str(deep))
        assert len(str(moved / "control")) < 108
        assert stat.S_IMODE(moved.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(moved)


def test_mps_without_the_control_binary_is_one_clear_error(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    run = tmp_path / "run"
    run.mkdir()
    children = _children(tmp_path)
    with pytest.raises(GpuShareError, match=r'gpu_share = "mps" needs nvidia-cuda-mps-control '
                                            r"on the PATH") as err:
        start_gpu_share(EngineSection(gpu_share="mps"), run, children)
    assert "\n" not in str(err.value)
    assert list(run.iterdir()) == []                  # nothing made before the refusal
    assert all(c.env == {} for c in children)
    assert gpu_share.MPS_CONTROL == "nvidia-cuda-mps-control"


def test_kvserve_up_refuses_mps_without_the_binary_and_starts_no_engine(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "KVSERVE_"))}
    env |= {"PATH": str(Path(sys.executable).parent), "KVSERVE_CACHE": str(tmp_path / "cache"),
            "REDIS_URL_FILE": ""}
    res = subprocess.run([sys.executable, "-m", "kvserve.cli", "up", "--model", "tiny-dense",
                          "--free-ports", "--insecure", "--gpu-share", "mps", "--state-dir",
                          str(tmp_path / "state"), "--g3-path", "none"],
                         env=env, text=True, capture_output=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert 'gpu_share = "mps" needs nvidia-cuda-mps-control on the PATH' in res.stderr
    run = tmp_path / "state" / "run"
    assert not any(run.glob("prefill*.log")) and not any(run.glob("decode*.log"))
    assert not (tmp_path / "state" / "up.json").exists()
