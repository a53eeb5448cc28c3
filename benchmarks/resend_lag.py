"""How long after a long context's first copy its resends are answered (issue 18):
against a running ``kvserve up`` (its state file), one cold context of
``--blocks`` 64-token blocks, then ``--resends`` copies of it, each with a new last
block, sent while the first is still in prefill (as the cc50 trace's agent session
resends its 5.5k-token context). Prints each request's TTFT and, for the resends,
how long after the first copy's first token theirs came (vLLM-CPU answers them
with it: it computes their tails beside the first copy's last chunk).

    kvserve up --free-ports --state-dir /tmp/s --g1 512MiB    # then:
    python -m benchmarks.resend_lag --state /tmp/s/up.json [--seed 7] [--json]

Send it to a stack started with ``[router] local_tail_tokens = 0``, or decode
computes resends that arrive after the first copy's hand-off itself."""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Answer:
    request: int
    sent_s: float           # after the first copy was sent
    ttft_s: float
    lag_s: float            # its first token after the first copy's


def _first_token(base: str, prompt: str) -> float:
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 2,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "X-Session-Affinity": "resend-lag"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: ") and b'"text"' in line:
                at = time.perf_counter()
                for _ in resp:
                    pass
                return at
    raise RuntimeError("the stream ended without a token")


def run(state: Path, blocks: int, delays: list[float], seed: int) -> list[Answer]:
    from kvserve.trace_export import BlockText

    base = json.loads(state.read_text())["router_http"]
    text = BlockText("smollm2", 64, seed=seed)
    context = "".join(text.block(i) for i in range(blocks))
    prompts = [context + text.block(blocks + 1000 + j) for j in range(len(delays))]
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    t0 = time.perf_counter()

    def send(j: int) -> None:
        time.sleep(delays[j])
        sent[j] = time.perf_counter()
        first[j] = _first_token(base, prompts[j])

    threads = [threading.Thread(target=send, args=(j,)) for j in range(len(delays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(first) != len(delays):
        raise RuntimeError("a request failed (see the stack's logs)")
    return [Answer(j, sent[j] - t0, first[j] - sent[j], first[j] - first[0])
            for j in range(len(delays))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.resend_lag", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", type=Path, required=True, help="the stack's up.json")
    ap.add_argument("--blocks", type=int, default=86, help="64-token blocks of the context")
    ap.add_argument("--resends", type=float, nargs="*", default=[2.9, 5.0],
                    help="seconds after the first copy each resend is sent")
    ap.add_argument("--seed", type=int, default=7, help="another seed: another cold context")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    answers = run(a.state, a.blocks, [0.0, *a.resends], a.seed)
    if a.json:
        print(json.dumps([asdict(x) for x in answers]))
        return 0
    print(f"{'request':>7s} {'sent s':>7s} {'TTFT s':>7s} {'after the first copy s':>23s}")
    for x in answers:
        print(f"{x.request:7d} {x.sent_s:7.2f} {x.ttft_s:7.2f} {x.lag_s:23.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
