"""Prefill under concurrent load, through the whole stack (``kvserve up``, HTTP
front, streaming completions), for one or more checkouts of kvserve side by
side on the same machine (e.g. this branch and the commit before it):

* **burst**: N cold prompts of L tokens sent at once; TTFT of each, p50 / p99,
  and the time until the last first token;
* **long + chat**: a long cold prompt, and a short chat sent ``--chat-after``
  seconds later; the chat's TTFT is what a small user waits behind a document;
* **single**: one request alone, cold then warm (the same 1,493-token prompt
  again: its blocks in the prefill engine's G1), TTFT through the front, and a
  third, direct gRPC ``Prefill`` of it whose handle timings split the prefill
  side (queue, lookup, fetch, compute, total).

Prompts are random token ids (``/v1/completions`` takes token-id prompts), the
same for every checkout and unseen by any earlier run (a fresh stack, no disk
tier). Each checkout runs in its own ``kvserve up --free-ports --state-dir``
with its own code on PYTHONPATH, one stack at a time, alternated per round.

    flock /tmp/kvserve-heavy.lock python scripts/prefill_load.py \\
        --checkout /tmp/base --checkout . --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

VOCAB = 49_152


@dataclass(frozen=True, slots=True)
class Scenario:
    burst: int = 16
    burst_tokens: int = 480
    long_tokens: int = 6_250
    chat_tokens: int = 60
    chat_after_s: float = 1.0
    max_tokens: int = 2
    single_tokens: int = 1_493
    model: str = ""                 # "" = kvserve up's default (smollm2)
    vocab: int = VOCAB


@dataclass(slots=True)
class Run:
    checkout: str
    round: int
    burst_ttft_s: list[float] = field(default_factory=list)     # answered requests only
    errors: list[str] = field(default_factory=list)             # what the others got
    burst_total_s: float = 0.0
    long_ttft_s: float = 0.0
    chat_ttft_s: float = 0.0
    cold_ttft_s: float = 0.0
    warm_ttft_s: float = 0.0
    warm_prefill: dict[str, float] = field(default_factory=dict)    # handle timings, direct
    uptime: str = ""

    def summary(self) -> dict[str, float]:
        xs = sorted(self.burst_ttft_s) or [float("nan")]
        return {"burst_p50_s": statistics.median(xs), "burst_p99_s": _pct(xs, 0.99),
                "errors": float(len(self.errors)),
                "burst_total_s": self.burst_total_s, "long_ttft_s": self.long_ttft_s,
                "chat_ttft_s": self.chat_ttft_s, "cold_ttft_s": self.cold_ttft_s,
                "warm_ttft_s": self.warm_ttft_s}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _prompt(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]


async def ttft(session: aiohttp.ClientSession, base: str, prompt: list[int],
               max_tokens: int, model: str = "smollm2") -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            # The first chunk with a choice carries the first token (its text may be
            # empty: a held-back stop-string prefix or half a UTF-8 character).
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get(
                    "choices"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the server streamed no token")
    return first - t0


async def _direct_prefill(address: str, prompt: list[int]) -> dict[str, float]:
    """A Prefill call straight to the instance: the handle's own timings."""
    import grpc

    from proto import common_pb2, prefill_pb2, prefill_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        t0 = time.perf_counter()
        h = await stub.Prefill(prefill_pb2.PrefillRequest(
            token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=600)
        rpc_s = time.perf_counter() - t0
        await stub.Release(prefill_pb2.ReleaseRequest(request_id=h.ctx.request_id), timeout=30)
    t = h.timings
    return {"rpc_s": rpc_s, "queue_s": t.queue_s, "lookup_s": t.lookup_s, "fetch_s": t.fetch_s,
            "compute_s": t.compute_s, "total_s": t.total_s, "cached_tokens": h.cached_tokens}


async def _scenarios(base: str, sc: Scenario, seed: int, run: Run, prefill: str) -> None:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return _prompt(rng, n, sc.vocab)

    async def _ttft(s: aiohttp.ClientSession, base: str, p: list[int], n: int) -> float:
        """TTFT, or NaN for a request that failed (its error is kept)."""
        try:
            return await ttft(s, base, p, n, sc.model or "smollm2")
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            run.errors.append(str(exc)[:300])
            return float("nan")

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await _ttft(s, base, prompt(64), 1)          # first-request costs, not timed
        prompts = [prompt(sc.burst_tokens) for _ in range(sc.burst)]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_ttft(s, base, p, sc.max_tokens) for p in prompts))
        run.burst_ttft_s = [x for x in got if x == x]          # NaN: failed
        run.burst_total_s = time.perf_counter() - t0
        long = asyncio.ensure_future(_ttft(s, base, prompt(sc.long_tokens), sc.max_tokens))
        await asyncio.sleep(sc.chat_after_s)
        run.chat_ttft_s = await _ttft(s, base, prompt(sc.chat_tokens), sc.max_tokens)
        run.long_ttft_s = await long
        single = prompt(sc.single_tokens)
        run.cold_ttft_s = await _ttft(s, base, single, sc.max_tokens)
        run.warm_ttft_s = await _ttft(s, base, single, sc.max_tokens)
        try:
            run.warm_prefill = await _direct_prefill(prefill, single)
        except Exception as exc:
            run.errors.append(f"direct prefill: {exc!r}"[:300])


def _up(checkout: Path, state: Path, log: Path, model: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-m", "kvserve.cli", "up", "--free-ports", "--state-dir", str(state),
            "--g3-path", "none", "--insecure", *(("--model", model) if model else ())]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=checkout, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _wait_http(proc: subprocess.Popen[bytes], state: Path, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve up exited ({proc.returncode}):\n"
                               f"{log.read_text()[-2000:]}")
        try:
            http = json.loads((state / "up.json").read_text()).get("router_http", "")
        except (OSError, ValueError):
            http = ""
        if http:
            return str(http)
        time.sleep(0.5)
    raise TimeoutError(f"kvserve up not ready after {timeout_s}s:\n{log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_one(checkout: Path, sc: Scenario, seed: int, rnd: int, work: Path) -> Run:
    state = Path(tempfile.mkdtemp(prefix="up-", dir=work))
    log = state / "up.log"
    proc = _up(checkout, state, log, sc.model)
    try:
        base = _wait_http(proc, state, log, 900)
        prefill = json.loads((state / "up.json").read_text())["prefill"]
        run = Run(str(checkout), rnd, uptime=os.getloadavg().__repr__())
        asyncio.run(_scenarios(base, sc, seed, run, prefill))
        return run
    finally:
        _stop(proc)


def table(runs: list[Run]) -> str:
    head = (f"{'checkout':<22} {'rnd':>3} {'burst p50':>9} {'p99':>7} {'total':>7} "
            f"{'long':>7} {'chat':>7} {'cold':>7} {'warm':>7} {'err':>3}  warm prefill (direct)  "
            f"load")
    rows = [head]
    for r in runs:
        m, w = r.summary(), r.warm_prefill
        split = " ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in w.items()
                         if k.endswith("_s"))
        rows.append(f"{Path(r.checkout).name[:22]:<22} {r.round:>3} {m['burst_p50_s']:>9.2f} "
                    f"{m['burst_p99_s']:>7.2f} {m['burst_total_s']:>7.2f} "
                    f"{m['long_ttft_s']:>7.2f} {m['chat_ttft_s']:>7.2f} "
                    f"{m['cold_ttft_s']:>7.2f} {m['warm_ttft_s']:>7.3f} {len(r.errors):>3}  "
                    f"{split}  {r.uptime}")
    return "\n".join(rows)


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        label = f"{Path(r.checkout).name} #{r.round}"
        a.plot(range(1, len(r.burst_ttft_s) + 1), sorted(r.burst_ttft_s), marker="o", label=label)
    a.set(xlabel="request (sorted by TTFT)", ylabel="TTFT (s)",
          title=f"{len(runs[0].burst_ttft_s)} prompts at once")
    a.legend()
    names = [f"{Path(r.checkout).name} #{r.round}" for r in runs]
    width = 0.8 / 3
    for i, (what, get) in enumerate((("chat behind a long prompt", lambda r: r.chat_ttft_s),
                                     ("alone, cold", lambda r: r.cold_ttft_s),
                                     ("alone, warm", lambda r: r.warm_ttft_s))):
        b.bar([j + i * width for j in range(len(runs))], [get(r) for r in runs], width,
              label=what)
    b.set_xticks([j + width for j in range(len(runs))], names, rotation=20)
    b.set(ylabel="TTFT (s)", title="single requests")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", default=[],
                   help="kvserve source tree to run (repeat; default: this one)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--burst-tokens", type=int, default=480)
    p.add_argument("--long-tokens", type=int, default=6_250)
    p.add_argument("--chat-tokens", type=int, default=60)
    p.add_argument("--chat-after", type=float, default=1.0)
    p.add_argument("--single-tokens", type=int, default=1_493)
    p.add_argument("--model", default="", help="model of the stacks (default smollm2); "
                   "tiny-dense (--vocab 384, prompts < 1024 tokens) smoke-tests the harness")
    p.add_argument("--vocab", type=int, default=VOCAB, help="prompt token ids are below this")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: the time)")
    p.add_argument("--json", default="", help="write every run and summary here")
    p.add_argument("--png", default="", help="plot TTFTs here")
    args = p.parse_args(argv)
    checkouts = [Path(c).resolve() for c in args.checkout] or [Path(__file__).parents[1]]
    sc = Scenario(args.burst, args.burst_tokens, args.long_tokens, args.chat_tokens,
                  args.chat_after, single_tokens=args.single_tokens, model=args.model,
                  vocab=args.vocab)
    seed = int(time.time()) if args.seed is None else args.seed
    work = Path(tempfile.mkdtemp(prefix="bench-prefill-load-"))
    runs: list[Run] = []
    for rnd in range(args.rounds):
        for c in checkouts:
            print(f"round {rnd + 1}/{args.rounds}: {c} ...", file=sys.stderr, flush=True)
            runs.append(run_one(c, sc, seed + rnd, rnd, work))
            print(table(runs[-1:]), file=sys.stderr, flush=True)
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"scenario": asdict(sc), "seed": seed,
             "runs": [{**asdict(r), "summary": r.summary()} for r in runs]}, indent=1))
    if args.png:
        plot(runs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
