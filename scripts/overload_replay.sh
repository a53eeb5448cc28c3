#!/usr/bin/env bash
# Overload replay with vLLM's own client: a Mooncake conversation-trace slice
# against `kvserve up`, counting what completed, what was refused up front (429)
# and what failed after the work. Used for docs/bench-notes/h2-overload.md.
#
#   scripts/overload_replay.sh KVSERVE_VENV OUT_DIR [REQUESTS] [SPEEDUP]
#
# KVSERVE_VENV: the virtualenv whose `kvserve` to start (e.g. /work/main/.venv
# for the code before a change, .venv for this checkout). The client is always
# `python -m connectors.vllm_cli bench serve` from this checkout's venv. Heavy:
# run it under `flock /tmp/kvserve-heavy.lock`.
set -euo pipefail
venv=$1; out=$2; n=${3:-40}; speed=${4:-4}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"; chmod 700 "$out"
trace=${KVSERVE_TRACE:-$here/../shared/traces/mooncake-fast25/conversation_trace.jsonl}

# The slice: the first N requests, contexts scaled 1/8 (a 512-token hash block
# becomes 64 tokens) and capped at 24 blocks, 24 output tokens, arrivals SPEEDUP
# times faster than recorded.
"$here/.venv/bin/python" - "$trace" "$out/slice.jsonl" "$n" "$speed" <<'EOF'
import json, sys
src, dst, n, speed = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
with open(src) as f, open(dst, "w") as g:
    rows = [json.loads(line) for _, line in zip(range(n), f)]
    t0 = rows[0]["timestamp"]
    for r in rows:
        hashes = r["hash_ids"][:24]
        g.write(json.dumps({"timestamp": (r["timestamp"] - t0) / speed,
                            "input_length": min(r["input_length"] // 8, 64 * len(hashes)),
                            "output_length": 24, "hash_ids": hashes}) + "\n")
EOF

state=$out/state
rm -rf "$state"
"$venv/bin/kvserve" up --free-ports --state-dir "$state" --g3-path "$state/g3" \
    >"$out/up.out" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$state/up.json" ] && break; sleep 0.5; done
url=$("$here/.venv/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["router_http"])' "$state/up.json")
metrics() {
    "$here/.venv/bin/python" - "$state/up.json" "$1" <<'EOF'
import json, sys, urllib.request
state = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as out:
    for role, url in sorted(state["metrics"].items()):
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line and not line.startswith("#"):
                out.write(f"{role} {line}\n")
EOF
}
uptime >"$out/load.txt"
PYTHONHASHSEED=0 "$here/.venv/bin/python" -m connectors.vllm_cli bench serve \
    --backend openai --base-url "$url" --endpoint /v1/completions --model smollm2 \
    --tokenizer "$HOME/.cache/kvserve/models/smollm2" --dataset-name timed_trace \
    --dataset-path "$out/slice.jsonl" --timed-trace-chunk-hash-size 64 \
    --timed-trace-sec-multiplier 0.001 --num-prompts "$n" --seed 1 --save-result \
    --save-detailed --result-dir "$out" --result-filename bench.json \
    --percentile-metrics ttft,e2el --metric-percentiles 50,90,99 --disable-tqdm \
    >"$out/bench.out" 2>&1 || true
uptime >>"$out/load.txt"
metrics "$out/metrics.txt"
"$here/.venv/bin/python" - "$out" <<'EOF'
import collections, json, re, sys
out = sys.argv[1]
b = json.load(open(f"{out}/bench.json"))
errors = collections.Counter(re.sub(r"[0-9a-f]{16,}|\d+(\.\d+)?", "#", e)[:120]
                             for e in b.get("errors", []) if e)
m = open(f"{out}/metrics.txt").read()
pick = lambda pat: sum(float(x) for x in re.findall(pat + r" ([0-9.e+]+)", m))
print(json.dumps({
    "completed": b["completed"], "failed": b.get("failed", len(b.get("errors", [])) - b["completed"]),
    "ttft_p50_s": b["median_ttft_ms"] / 1e3, "ttft_p99_s": b["p99_ttft_ms"] / 1e3,
    "duration_s": b["duration"],
    "prefill_ok": pick(r'kvserve_prefill_prefill_requests_total\{kind="ok"\}'),
    "router_rejected": pick(r"kvserve_router_rejected_total\{[^}]*\}"),
    "errors": dict(errors.most_common(5))}, indent=1))
EOF
