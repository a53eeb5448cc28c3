"""Regenerates the checked-in gRPC stubs from the .proto sources.

Run from the repository root: ``python -m proto.build``. The stubs are
checked in so a fresh install needs no protoc; tests/proto/test_stubs.py
regenerates them into a temporary folder and fails on any difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "proto").glob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # test/dev dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *SOURCES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
