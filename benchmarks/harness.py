"""The one harness every ``kvserve bench …`` command stands on.

- **Timing**: ``timed`` runs a function ``repeats`` times after warm-ups and
  keeps every sample (wall and process CPU seconds), so a figure can be read
  as min, median or max; ``interleaved`` times several functions in turn
  within each round, so a row and its baseline see the same moments of a
  shared, busy machine (timeit's rule applies: the minimum is the sample least
  disturbed by other load).
- **Goals against limits of the same run**: a ``Goal`` compares a metric with
  a bound or with a multiple of another metric measured in the same run (a
  memcpy, a raw file write, a roofline), never with a figure from another day.
- **One way out**: ``runner`` wraps a command's measurement; the ``Report`` it
  returns is printed as a table (with the machine's load average at start and
  end), as JSON with ``--json`` (the command's own documented keys, on stdout;
  the table then goes to stderr) and drawn with ``--png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Clock = Callable[[], float]


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, interpolated between the closest ranks."""
    if not xs:
        raise ValueError("quantile of no samples")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call, one sample per repeat; ``cpu`` the process CPU seconds
    of the same samples (steadier than wall time when other processes share
    the cores)."""

    samples: tuple[float, ...]
    cpu: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return quantile(self.samples, 0.5)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def total(self) -> float:
        return math.fsum(self.samples)

    def quantile(self, q: float) -> float:
        return quantile(self.samples, q)

    def as_json(self) -> dict[str, float]:
        return {"min_s": self.min, "median_s": self.median, "max_s": self.max,
                "repeats": len(self.samples)}


def timed(fn: Callable[[], object], *, repeats: int = 1, warmup: int = 1, calls: int = 1,
          sync: Callable[[], None] | None = None, clock: Clock = time.perf_counter,
          progress: str = "") -> Timing:
    """``warmup`` untimed calls, then ``repeats`` samples of ``calls`` calls each
    (seconds per call). ``sync`` runs before and after each sample (a device
    synchronisation); ``progress`` names a progress bar on stderr."""
    if repeats < 1 or calls < 1 or warmup < 0:
        raise ValueError("repeats and calls must be >= 1, warmup >= 0")
    for _ in range(warmup):
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in _steps(repeats, progress):
        if sync is not None:
            sync()
        c0 = time.process_time()
        t0 = clock()
        for _ in range(calls):
            fn()
        if sync is not None:
            sync()
        t1 = clock()
        cpu.append((time.process_time() - c0) / calls)
        wall.append((t1 - t0) / calls)
    return Timing(tuple(wall), tuple(cpu))


def interleaved(fns: Mapping[str, Callable[[int], object]], *, rounds: int,
                warmup: bool = False, calls: Mapping[str, int] | None = None,
                clock: Clock = time.perf_counter) -> dict[str, Timing]:
    """Every function once per round, in turn (each gets the round's index, so
    it can use fresh keys), ``calls[name]`` calls per sample (default 1)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if warmup:
        for fn in fns.values():
            fn(-1)
    n = {name: (calls or {}).get(name, 1) for name in fns}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(n[name]):
                fn(r)
            samples[name].append((clock() - t0) / n[name])
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def calls_to_last(fn: Callable[[], object], min_s: float) -> int:
    """Calls of ``fn`` that add up to about ``min_s``: short samples, many
    rounds, since on a shared machine most long samples include a preemption."""
    t0 = time.perf_counter()
    fn()
    return max(1, int(min_s / max(time.perf_counter() - t0, 1e-7)))


def _steps(n: int, progress: str) -> Sequence[int] | Any:
    if not progress:
        return range(n)
    from tqdm import tqdm

    return tqdm(range(n), desc=progress, file=sys.stderr, mininterval=1.0)


# ------------------------------------------------------------------ goals


@dataclass(frozen=True, slots=True)
class Verdict:
    goal: str
    metric: str
    value: float
    target: float
    met: bool

    def as_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": round(self.value, 3),
                "target": round(self.target, 3), "met": self.met}

    def line(self) -> str:
        return (f"{'met ' if self.met else 'MISS'}  {self.goal}: {self.value:.4g} "
                f"(target {self.target:.4g})")


@dataclass(frozen=True, slots=True)
class Goal:
    """``metric`` >= ``at_least``, <= ``at_most`` or < ``below``; with ``ref`` the
    bound is that multiple of the metric ``ref`` measured in the same run."""

    name: str
    metric: str
    at_least: float | None = None
    at_most: float | None = None
    below: float | None = None
    ref: str | None = None

    def __post_init__(self) -> None:
        if sum(b is not None for b in (self.at_least, self.at_most, self.below)) != 1:
            raise ValueError(f"goal {self.name!r}: give one of at_least, at_most and below")

    def check(self, values: Mapping[str, Any]) -> Verdict | None:
        """The verdict, or None when this run did not measure the metric (or its ref)."""
        if self.metric not in values or (self.ref is not None and self.ref not in values):
            return None
        value = float(values[self.metric])
        scale = 1.0 if self.ref is None else float(values[self.ref])
        if self.at_least is not None:
            target = self.at_least * scale
            return Verdict(self.name, self.metric, value, target, value >= target)
        if self.at_most is not None:
            target = self.at_most * scale
            return Verdict(self.name, self.metric, value, target, value <= target)
        target = float(self.below) * scale
        return Verdict(self.name, self.metric, value, target, value < target)


def check_goals(goals: Sequence[Goal], values: Mapping[str, Any]) -> list[Verdict]:
    return [v for g in goals if (v := g.check(values)) is not None]


# ------------------------------------------------------------------ output


@dataclass(slots=True)
class Table:
    """Columns and rows; floats print with four significant digits, strings as given."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    title: str = ""

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(cells)

    def render(self) -> str:
        cells = [self.columns, *[tuple(_cell(c) for c in row) for row in self.rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title] if self.title else []
        for n, row in enumerate(cells):
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths, strict=True))))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


@dataclass(frozen=True, slots=True)
class Chart:
    """A PNG: grouped bars (``labels`` on x), horizontal bars, or lines (``labels``
    are then the x values; a series may be None where it has no point). ``refs``
    draws horizontal lines: goals and limits."""

    title: str
    labels: tuple[Any, ...]
    series: Mapping[str, Sequence[float | None]]
    ylabel: str = ""
    xlabel: str = ""
    kind: str = "bar"
    logx: int = 0                   # log base of the x axis (lines); 0 = linear
    refs: tuple[tuple[str, float], ...] = ()

    def save(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        draw = _DRAW.get(self.kind)
        if draw is None:
            raise ValueError(f"chart kind {self.kind!r}: one of {sorted(_DRAW)}")
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(self.labels) + 2), 4.0))
        draw(ax, self)
        for (name, y), style in zip(self.refs, ("--", ":", "-."), strict=False):
            ax.axhline(y, color="k", linestyle=style, linewidth=0.8, label=name)
        ax.set_title(self.title, fontsize=10)
        if self.ylabel:
            ax.set_ylabel(self.ylabel)
        if self.xlabel:
            ax.set_xlabel(self.xlabel)
        if len(self.series) + len(self.refs) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _bars(ax: Any, c: Chart) -> None:
    width = 0.8 / max(1, len(c.series))
    for i, (name, ys) in enumerate(c.series.items()):
        xs = [x + (i - (len(c.series) - 1) / 2) * width for x in range(len(c.labels))]
        ax.bar(xs, [y or 0.0 for y in ys], width=width, label=name)
    ax.set_xticks(list(range(len(c.labels))), [str(x) for x in c.labels], fontsize=8)


def _barh(ax: Any, c: Chart) -> None:
    (name, xs), *_ = c.series.items()
    ax.barh([str(x) for x in c.labels], [x or 0.0 for x in xs], label=name)


def _lines(ax: Any, c: Chart) -> None:
    for name, ys in c.series.items():
        pts = [(x, y) for x, y in zip(c.labels, ys, strict=True) if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=name)
    if c.logx:
        ax.set_xscale("log", base=c.logx)


_DRAW: dict[str, Callable[[Any, Chart], None]] = {"bar": _bars, "barh": _barh, "line": _lines}


@dataclass(slots=True)
class Report:
    """What a benchmark hands the harness: ``payload`` is the ``--json``
    document (each command keeps its documented keys), the rest the text."""

    title: str
    payload: Any
    tables: list[Table] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    chart: Chart | None = None

    def render(self) -> str:
        parts = [self.title, *(t.render() for t in self.tables)]
        if self.verdicts:
            parts.append("\n".join(v.line() for v in self.verdicts))
        if self.notes:
            parts.append("\n".join(self.notes))
        return "\n\n".join(p for p in parts if p)


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def output_flags(p: argparse.ArgumentParser, *, png: Sequence[str] = ("--png",),
                 png_default: str = "", json_flag: bool = True) -> None:
    """``--json`` and the PNG flag(s), the same on every bench command
    (``json_flag=False`` where shared flags already define ``--json``)."""
    if json_flag:
        p.add_argument("--json", action="store_true",
                       help="print the results as JSON (the table goes to stderr)")
    p.add_argument(*png, dest="png", default=png_default, metavar="PNG",
                   help="also draw the results into this PNG"
                   + (f" (default {png_default}; '' = none)" if png_default else ""))


def save_json(res: Mapping[str, Any], path: str) -> None:
    """A device benchmark's results to ``path`` (none when empty), a private file."""
    if path:
        from security.secret_files import write_private

        write_private(path, json.dumps(res, indent=1))


def emit(report: Report, *, as_json: bool, png: str = "") -> None:
    if png and report.chart is not None:
        report.chart.save(png)
        print(f"chart: {png}", file=sys.stderr)
    if as_json:
        print(report.render(), file=sys.stderr)
        print(json.dumps(report.payload, indent=1))
    else:
        print(report.render())
    sys.stdout.flush()


def runner(measure: Callable[[argparse.Namespace], Report]) -> Callable[[argparse.Namespace], int]:
    """A command's run: measure, note the load around it, print, draw."""

    def run(args: argparse.Namespace) -> int:
        load0 = load_average()
        report = measure(args)
        report.notes.append(f"load average (1 min): {load0:.2f} at start, "
                            f"{load_average():.2f} at end, {os.cpu_count()} CPUs")
        emit(report, as_json=bool(getattr(args, "json", False)),
             png=getattr(args, "png", "") or "")
        return 0

    run.__doc__ = measure.__doc__
    return run


__all__ = ["Chart", "Goal", "Report", "Table", "Timing", "Verdict", "calls_to_last",
           "check_goals", "emit", "interleaved", "load_average", "output_flags", "quantile",
           "runner", "timed"]
