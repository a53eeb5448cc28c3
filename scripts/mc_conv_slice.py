"""The Mooncake conversation slice of the cache-aware vs round-robin benchmark
(docs/BENCHMARKS.md, issue 18): the trace's first 12 conversations (rows
grouped by their second hash id) with 3 or more turns, their first 4 turns,
input lengths / 8 (a 512-token hash id becomes a 64-token block), 16 output
tokens, arrivals stretched or squeezed to span 120 s, written in the format
`vllm bench serve --dataset-name timed_trace` and AIPerf's mooncake_trace load.

    python3 scripts/mc_conv_slice.py \
        $SHARED/traces/mooncake-fast25/conversation_trace.jsonl mc-conv.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONVERSATIONS, MIN_TURNS, TURNS, SCALE, OUTPUT, SPAN_MS = 12, 3, 4, 8, 16, 120_000.0


def slice_rows(rows: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    groups: dict[int, list[dict]] = {}  # type: ignore[type-arg]
    for r in rows:
        if len(r["hash_ids"]) >= 2:
            groups.setdefault(r["hash_ids"][1], []).append(r)
    convs = [g for g in groups.values() if len(g) >= MIN_TURNS][:CONVERSATIONS]
    pick = sorted((r for g in convs for r in g[:TURNS]), key=lambda r: r["timestamp"])
    t0 = pick[0]["timestamp"]
    span = max(1.0, pick[-1]["timestamp"] - t0)
    return [{"timestamp": round((r["timestamp"] - t0) * SPAN_MS / span, 1),
             "input_length": r["input_length"] // SCALE, "output_length": OUTPUT,
             "hash_ids": r["hash_ids"]} for r in pick]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line]
    out = slice_rows(rows)
    Path(argv[1]).write_text("".join(json.dumps(o) + "\n" for o in out))
    print(f"{argv[1]}: {len(out)} requests, {sum(o['input_length'] for o in out):,} prompt "
          f"tokens over {out[-1]['timestamp'] / 1000:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
