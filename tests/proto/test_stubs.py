"""The checked-in stubs are exactly what protoc generates from the sources."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_regenerated_stubs_match_checked_in(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    from proto.build import generate

    generate(tmp_path)
    generated = sorted((tmp_path / "proto").glob("*_pb2*"))
    assert generated, "protoc generated nothing"
    fix = "run python -m proto.build"
    for new in generated:
        old = ROOT / "proto" / new.name
        assert old.exists(), f"{new.name} is generated but not checked in: {fix}"
        assert filecmp.cmp(new, old, shallow=False), f"{new.name} is stale: {fix}"
    checked_in = {p.name for p in (ROOT / "proto").glob("*_pb2*")}
    assert checked_in == {p.name for p in generated}, "stubs without a .proto source"


def test_stubs_import_and_share_the_package() -> None:
    from proto import common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, router_pb2

    for mod in (common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, router_pb2):
        assert mod.DESCRIPTOR.package == "kvserve.v1"
    handle = prefill_pb2.KVHandle(prompt_ids=[1, 2, 3], cached_tokens=64)
    assert prefill_pb2.KVHandle.FromString(handle.SerializeToString()) == handle
