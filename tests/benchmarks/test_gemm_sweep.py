"""benchmarks/gemm_sweep.py's choice of decode GEMM plans (CPU: the timing
needs CUDA; what is picked from the rows, and how the table loads, does not)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks import gemm_sweep as gs
from engine import triton_gemm as tg

SHAPES = {"qkv": (4096, 6144), "down": (14336, 4096)}


def _row(shape: str, m: int, plan: tg.GemmPlan, us: float, same: bool = True,
         shipped: bool = False) -> dict:
    r = {"shape": shape, "m": m, "plan": gs.label(plan), "same_bits": same, "us": us,
         "gbps": 1.0, "of_copy": 0.5, "spec": asdict(plan)}
    return {**r, "shipped": True} if shipped else r


def test_pick_takes_the_fastest_plan_whose_rows_matched_and_beats_the_shipped() -> None:
    a, b, c = (tg.GemmPlan(64, 128, 8, 3, swap=True, bk=128), tg.GemmPlan(64, 64, 4, 4, bk=128),
               tg.GemmPlan(64, 64, 4, 4, swap=True, bk=128, persistent=True))
    rows = [_row("qkv", 64, tg.NARROW_64, 20.0, shipped=True),
            _row("qkv", 64, a, 15.0, same=False),          # faster, other bits: never picked
            _row("qkv", 64, b, 17.0), _row("qkv", 64, c, 18.0),
            _row("qkv", 48, c, 1.0),                        # not a bucket's own row count
            {"shape": "qkv", "m": 64, "plan": "x", "error": "OutOfResources"},
            _row("down", 64, tg.NARROW_64, 30.0, shipped=True),
            _row("down", 64, b, 29.8)]                      # within the margin
    got = gs.pick(rows, SHAPES, margin=0.02)
    assert got["best"]["qkv@64"]["best"]["plan"] == gs.label(b)
    assert got["best"]["qkv@64"]["gain"] == pytest.approx(20 / 17 - 1)
    assert got["best"]["down@64"]["best"]["plan"] == gs.label(b)
    assert got["table"] == [{"k": 4096, "n": 6144, "bucket": 64, "plan": asdict(b),
                             "label": gs.label(b)}]


def test_the_table_loads_as_decode_plans_and_serves_its_bucket(tmp_path: Path) -> None:
    plan = tg.GemmPlan(64, 128, 8, 3, swap=True, bk=128)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"table": [{"k": 4096, "n": 6144, "bucket": 32,
                                           "plan": asdict(plan), "label": gs.label(plan)}]}))
    table = gs.load_table(str(path))
    assert table == {(4096, 6144, 32): plan}
    shipped, tg.DECODE_PLANS = tg.DECODE_PLANS, table
    try:
        assert tg.plan_16bit(17, 6144, 1, k=4096) == tg.GemmPlan(32, 128, 8, 3, swap=True,
                                                                 bk=128)
        assert tg.plan_16bit(33, 6144, 1, k=4096) == tg.plan_16bit(33, 6144, 1)
    finally:
        tg.DECODE_PLANS = shipped


def test_bucket_rows_span_each_bucket_and_candidates_fit_the_layout() -> None:
    assert gs.bucket_rows(64) == (33, 48, 64)
    assert gs.bucket_rows(32) == (17, 24, 32)
    assert gs.bucket_rows(16) == (1, 8, 16)
    assert len({gs.label(p) for p in gs.CANDIDATES}) == len(gs.CANDIDATES)
    for p in gs.CANDIDATES:          # GemmPlan validates; the input side follows M
        assert gs.at_m(p, 20).bm == (32 if p.swap else 64)


def test_the_written_table_module_builds_the_picked_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--write-table``'s module (what engine/triton_gemm_table.py holds) gives
    back the picked plans, and passes the repository's lint line length."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    plans = {(14336, 4096, 64): tg.GemmPlan(64, 64, 4, 6, swap=True, bk=128, persistent=True),
             (4096, 6144, 32): tg.GemmPlan(64, 64, 4, 4, bk=128)}
    names = {(14336, 4096): "down", (4096, 6144): "qkv"}
    res = {"model": "llama-8b-shape", "layout": "kn", "copy_gbps": 4180.0,
           "table": [{"k": k, "n": n, "bucket": b, "plan": asdict(p), "label": gs.label(p)}
                     for (k, n, b), p in plans.items()],
           "best": {f"{names[k, n]}@{b}": {"best": {"us": 30.0, "of_copy": 0.8},
                                          "shipped": {"us": 40.0, "plan": "shipped: x"}}
                    for (k, n, b) in plans}}
    src = gs.table_module(res)
    assert max(len(line) for line in src.splitlines()) <= 100
    assert "30.0 us (0.800 of the copy) against 40.0" in src
    ns: dict[str, object] = {}
    exec(compile(src, "triton_gemm_table.py", "exec"), ns)
    table = ns["TABLE"]
    assert isinstance(table, dict)
    assert {key: tg.GemmPlan(**spec) for key, spec in table.items()} == plans
