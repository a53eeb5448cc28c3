"""One chart of a rate sweep assembled from several `kvserve bench serve --json`
runs (a run per rate or per few rates, as the machine's time allows): TTFT p90
and goodput against the offered rate, kvserve and the peer, so the rate where
each stops serving within the SLO shows at a glance (docs/BENCHMARKS.md,
issue 18's agent-session target).

    python3 scripts/serve_sweep_chart.py sweep.png run1.json run2.json ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SERIES = ("kvserve", "peer")


def points(paths: list[str]) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    """system -> its points, one per offered rate (a later file wins a rate)."""
    by: dict[str, dict[float, dict]] = {s: {} for s in SERIES}  # type: ignore[type-arg]
    for path in paths:
        for p in json.loads(Path(path).read_text())["points"]:
            if p["system"] in by:
                by[p["system"]][round(p["offered_rps"], 4)] = p
    return {s: [by[s][r] for r in sorted(by[s])] for s in SERIES}


def chart(out: str, paths: list[str]) -> None:
    pts = points(paths)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s, marker in zip(SERIES, ("o", "s"), strict=True):
        rates = [p["offered_rps"] for p in pts[s]]
        if not rates:
            continue
        a.plot(rates, [p["ttft_p90_s"] for p in pts[s]], marker=marker, label=f"{s} p90")
        b.plot(rates, [p["goodput_rps"] for p in pts[s]], marker=marker, label=s)
    top = max((p["offered_rps"] for s in SERIES for p in pts[s]), default=1.0)
    b.plot([0, top], [0, top], ls=":", c="grey", label="offered (all within the SLO)")
    a.set(title="TTFT p90 vs offered rate", xlabel="offered rate (req/s)", ylabel="s",
          yscale="log")
    b.set(title="goodput (requests within the SLO per s)", xlabel="offered rate (req/s)",
          ylabel="req/s")
    a.legend()
    b.legend()
    fig.tight_layout()
    old = os.umask(0o077)           # results are private, like everything kvserve writes
    try:
        fig.savefig(out, dpi=110)
    finally:
        os.umask(old)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    chart(sys.argv[1], sys.argv[2:])
