"""Prefill under concurrent load, through the whole stack (``kvserve up``, HTTP
front, streaming completions), for one or more checkouts of kvserve side by
side on the same machine (e.g. this branch and the commit before it):

* **burst**: N cold prompts of L tokens sent at once; TTFT of each, p50 / p99,
  and the time until the last first token;
* **long + chat**: a long cold prompt, and a short chat sent ``--chat-after``
  seconds later; the chat's TTFT is what a small user waits behind a document.

Prompts are random token ids (``/v1/completions`` takes token-id prompts), the
same for every checkout and unseen by any earlier run (a fresh stack, no disk
tier). Each checkout runs in its own ``kvserve up --free-ports --state-dir``
with its own code on PYTHONPATH, one stack at a time, alternated per round.

    flock /tmp/kvserve-heavy.lock python -m kvserve.bench_prefill_load \\
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


@dataclass(slots=True)
class Run:
    checkout: str
    round: int
    burst_ttft_s: list[float] = field(default_factory=list)
    burst_total_s: float = 0.0
    long_ttft_s: float = 0.0
    chat_ttft_s: float = 0.0
    uptime: str = ""

    def summary(self) -> dict[str, float]:
        xs = sorted(self.burst_ttft_s)
        return {"burst_p50_s": statistics.median(xs), "burst_p99_s": _pct(xs, 0.99),
                "burst_total_s": self.burst_total_s, "long_ttft_s": self.long_ttft_s,
                "chat_ttft_s": self.chat_ttft_s}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


async def _ttft(session: aiohttp.ClientSession, base: str, prompt: list[int],
                max_tokens: int) -> float:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(c.get("token_ids") or c.get("text") for c in chunk.get("choices") or []):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("the server streamed no token")
    return first - t0


async def _scenarios(base: str, sc: Scenario, seed: int, run: Run) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await _ttft(s, base, _prompt(rng, 64), 1)          # first-request costs, not timed
        prompts = [_prompt(rng, sc.burst_tokens) for _ in range(sc.burst)]
        t0 = time.perf_counter()
        run.burst_ttft_s = list(await asyncio.gather(
            *(_ttft(s, base, p, sc.max_tokens) for p in prompts)))
        run.burst_total_s = time.perf_counter() - t0
        long = asyncio.ensure_future(_ttft(s, base, _prompt(rng, sc.long_tokens), sc.max_tokens))
        await asyncio.sleep(sc.chat_after_s)
        run.chat_ttft_s = await _ttft(s, base, _prompt(rng, sc.chat_tokens), sc.max_tokens)
        run.long_ttft_s = await long


def _up(checkout: Path, state: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-m", "kvserve.cli", "up", "--free-ports", "--state-dir", str(state),
            "--g3-path", "none", "--insecure"]
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
    proc = _up(checkout, state, log)
    try:
        base = _wait_http(proc, state, log, 900)
        run = Run(str(checkout), rnd, uptime=os.getloadavg().__repr__())
        asyncio.run(_scenarios(base, sc, seed, run))
        return run
    finally:
        _stop(proc)


def table(runs: list[Run]) -> str:
    head = (f"{'checkout':<28} {'rnd':>3} {'burst p50':>9} {'p99':>7} {'total':>7} "
            f"{'long':>7} {'chat':>7}  load")
    rows = [head]
    for r in runs:
        m = r.summary()
        rows.append(f"{Path(r.checkout).name[:28]:<28} {r.round:>3} {m['burst_p50_s']:>9.2f} "
                    f"{m['burst_p99_s']:>7.2f} {m['burst_total_s']:>7.2f} "
                    f"{m['long_ttft_s']:>7.2f} {m['chat_ttft_s']:>7.2f}  {r.uptime}")
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
    b.bar(names, [r.chat_ttft_s for r in runs])
    b.set(ylabel="chat TTFT (s)", title="small chat behind a long prompt")
    b.tick_params(axis="x", rotation=20)
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
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: the time)")
    p.add_argument("--json", default="", help="write every run and summary here")
    p.add_argument("--png", default="", help="plot TTFTs here")
    args = p.parse_args(argv)
    checkouts = [Path(c).resolve() for c in args.checkout] or [Path(__file__).parents[1]]
    sc = Scenario(args.burst, args.burst_tokens, args.long_tokens, args.chat_tokens,
                  args.chat_after)
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
