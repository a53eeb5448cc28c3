"""The bench harness: timing samples and their statistics, rows timed in turn,
goals against limits of the same run, the table, the PNG, and one output path
for every ``kvserve bench`` command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.commands import COMMANDS, module_name
from benchmarks.harness import (
    Chart,
    Goal,
    Report,
    Table,
    Timing,
    check_goals,
    interleaved,
    quantile,
    runner,
    timed,
)
from kvserve.cli import build_parser


def _clock(*ticks: float) -> Callable[[], float]:
    """A clock that reads the given instants in turn: exact samples to assert on."""
    it = iter(ticks)
    return lambda: next(it)


def test_quantile_interpolates_between_ranks() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.0) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)
    assert quantile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_timed_warms_up_then_keeps_every_sample() -> None:
    calls: list[int] = []
    tm = timed(lambda: calls.append(1), repeats=3, warmup=2, calls=2,
               clock=_clock(0.0, 2.0, 10.0, 11.0, 20.0, 26.0))
    assert len(calls) == 2 + 3 * 2
    assert tm.samples == (1.0, 0.5, 3.0)           # seconds per call of each sample
    assert (tm.min, tm.median, tm.max, tm.total) == (0.5, 1.0, 3.0, 4.5)
    assert len(tm.cpu) == 3 and all(c >= 0 for c in tm.cpu)
    assert tm.as_json() == {"min_s": 0.5, "median_s": 1.0, "max_s": 3.0, "repeats": 3}
    with pytest.raises(ValueError):
        timed(lambda: None, repeats=0)
    with pytest.raises(ValueError):
        Timing(())


def test_timed_syncs_around_each_sample() -> None:
    events: list[str] = []
    timed(lambda: events.append("run"), repeats=2, warmup=1,
          sync=lambda: events.append("sync"))
    assert events == ["run", "sync", "run", "sync", "sync", "run", "sync"]


def test_interleaved_runs_rows_in_turn_with_the_round() -> None:
    order: list[tuple[str, int]] = []
    out = interleaved({"row": lambda r: order.append(("row", r)),
                       "base": lambda r: order.append(("base", r))},
                      rounds=2, warmup=True, calls={"base": 2},
                      clock=_clock(0, 1, 1, 5, 5, 7, 7, 9))
    assert order == [("row", -1), ("base", -1), ("row", 0), ("base", 0), ("base", 0),
                     ("row", 1), ("base", 1), ("base", 1)]
    assert out["row"].samples == (1.0, 2.0) and out["base"].samples == (2.0, 1.0)


def test_goals_against_bounds_and_limits_of_the_same_run() -> None:
    values = {"g3_write_gbps": 0.95, "raw_write_gbps": 1.0, "p99_ms": 2.0, "ttft_s": 1.3,
              "local_s": 1.0}
    goals = (Goal("write >= 0.9x raw", "g3_write_gbps", at_least=0.9, ref="raw_write_gbps"),
             Goal("p99 < 2 ms", "p99_ms", below=2.0),
             Goal("ttft <= 1.3x local", "ttft_s", at_most=1.3, ref="local_s"),
             Goal("not measured", "mooncake_gbps", at_least=1.0),
             Goal("ref not measured", "p99_ms", below=1.0, ref="mooncake_p99_ms"))
    verdicts = check_goals(goals, values)
    assert [(v.goal, v.met) for v in verdicts] == [("write >= 0.9x raw", True),
                                                   ("p99 < 2 ms", False),
                                                   ("ttft <= 1.3x local", True)]
    assert verdicts[0].as_json() == {"metric": "g3_write_gbps", "value": 0.95, "target": 0.9,
                                     "met": True}
    assert verdicts[1].line() == "MISS  p99 < 2 ms: 2 (target 2)"
    with pytest.raises(ValueError):
        Goal("two bounds", "x", at_least=1.0, below=2.0)
    with pytest.raises(ValueError):
        Goal("no bound", "x")


def test_table_aligns_and_formats_cells() -> None:
    t = Table(("metric", "value", "ok"), title="t")
    t.add("a", 1.23456, True)
    t.add("longer", None, False)
    assert t.render() == ("t\n"
                          "metric  value   ok\n"
                          "------  -----  ---\n"
                          "a       1.235  yes\n"
                          "longer          NO")
    with pytest.raises(ValueError):
        t.add("too few")


@pytest.mark.parametrize("kind", ["bar", "barh", "line"])
def test_chart_writes_a_png(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.png"
    Chart("t", (16, 32, 64), {"a": [1.0, None, 3.0], "b": [2.0, 2.0, 2.0]}, kind=kind,
          logx=2 if kind == "line" else 0, refs=(("goal", 2.5),)).save(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_refuses_an_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of"):
        Chart("t", ("a",), {"a": [1.0]}, kind="pie").save(str(tmp_path / "x.png"))


def test_runner_prints_json_on_stdout_the_table_on_stderr_and_draws(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def measure(args: argparse.Namespace) -> Report:
        table = Table(("metric", "value"), [("x_gbps", 2.0)])
        return Report("demo", {"x_gbps": 2.0}, [table],
                      check_goals((Goal("x >= 1", "x_gbps", at_least=1.0),), {"x_gbps": 2.0}),
                      chart=Chart("demo", ("x",), {"GB/s": [2.0]}, kind="barh"))

    png = tmp_path / "demo.png"
    assert runner(measure)(argparse.Namespace(json=True, png=str(png))) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == {"x_gbps": 2.0}
    assert "x_gbps" in out.err and "met   x >= 1" in out.err
    assert "load average (1 min):" in out.err and f"chart: {png}" in out.err
    assert png.stat().st_size > 1000
    assert runner(measure)(argparse.Namespace(json=False, png="")) == 0
    out = capsys.readouterr()
    assert out.out.startswith("demo\n") and "load average" in out.out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_bench_command_runs_on_the_harness(command: str) -> None:
    extra = {"policies": ["--trace", "t.jsonl", "--capacity", "1e6"],
             "serve": ["--trace", "t.jsonl"], "vllm-trace": ["--trace", "t.jsonl"]}.get(command, [])
    args = build_parser().parse_args(["bench", command, *extra, "--json", "--png", "x.png"])
    assert args.json is True and args.png == "x.png"
    assert args._run.__qualname__ == "runner.<locals>.run"
    # Its benchmark module, found by name when it runs (a hyphen read as "_").
    source = Path(__file__).resolve().parents[2] / (module_name(command).replace(".", "/") + ".py")
    assert "def report(args: argparse.Namespace) -> Report:" in source.read_text()
