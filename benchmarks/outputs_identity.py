"""Whether a served run's answers are a cache-less engine's (issue 18: "outputs
token-identical to cache-less runs at temperature 0").

Input: the artifact folder of an AIPerf run against ``kvserve up`` made with
``--export-level raw --export-outputs-json --extra-inputs temperature:0``
(docs/benchmark-tools.md): each request's payload and the text it was answered.
Every greedy request is recomputed by one engine alone, from its prompt, with
nothing cached (``Engine.generate`` without block keys: no G1 lookup, no
warehouse, no hand-off), and the two texts are compared. The run itself may
have served a request from G1, the warehouse or a restored prefix; this says
whether any of that changed a token. Prints a table; ``--json`` the counts and
every mismatch. Exit 1 when any answer differs.

    python -m benchmarks.outputs_identity --artifacts DIR [--model smollm2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.runner import Engine
from engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Served:
    request_id: str
    prompt: str
    max_tokens: int
    ignore_eos: bool
    text: str               # what the run answered


@dataclass(slots=True)
class Verdict:
    requests: int = 0
    identical: int = 0
    not_greedy: int = 0     # sampled at a temperature: nothing to compare
    mismatches: list[dict[str, object]] = field(default_factory=list)


def load_run(artifacts: Path) -> tuple[list[Served], int]:
    """The greedy requests of an AIPerf run, and how many were not greedy."""
    payloads = {}
    with (artifacts / "profile_export_raw.jsonl").open() as f:
        for line in f:
            rec = json.loads(line)
            payloads[rec["metadata"]["x_request_id"]] = rec.get("payload") or {}
    outputs = json.loads((artifacts / "outputs.json").read_text())["data"]
    served, not_greedy = [], 0
    for out in outputs:
        p = payloads.get(out["x_request_id"])
        if p is None or not isinstance(p.get("prompt"), str):
            raise ValueError(f"request {out['x_request_id']}: no completions payload in the "
                             "raw export (run AIPerf with --export-level raw)")
        if float(p.get("temperature", 1.0)) != 0.0:
            not_greedy += 1
            continue
        served.append(Served(out["x_request_id"], p["prompt"], int(p.get("max_tokens", 16)),
                             bool(p.get("ignore_eos", False)), out.get("response_text") or ""))
    return served, not_greedy


def check(engine: Engine, served: list[Served], progress: bool = False) -> Verdict:
    v = Verdict()
    for i, s in enumerate(served):
        tokens = engine.tokenizer.encode(s.prompt)
        res = engine.generate(tokens, SamplingParams(max_tokens=s.max_tokens,
                                                     ignore_eos=s.ignore_eos))
        v.requests += 1
        if res.text == s.text:
            v.identical += 1
        else:
            v.mismatches.append({"request_id": s.request_id, "prompt_tokens": len(tokens),
                                 "served": s.text, "cache_less": res.text})
        if progress:
            print(f"\r{i + 1}/{len(served)} recomputed, {len(v.mismatches)} differ",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.outputs_identity",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, required=True, help="AIPerf's artifact folder")
    ap.add_argument("--model", default="smollm2", help="the model the run served")
    ap.add_argument("--num-blocks", type=int, default=256, help="the engine's KV pool")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    served, not_greedy = load_run(a.artifacts)
    engine = Engine(EngineConfig(model=a.model, num_blocks=a.num_blocks))
    v = check(engine, served, progress=True)
    v.not_greedy = not_greedy
    if a.json:
        print(json.dumps(asdict(v), indent=1))
    else:
        print(f"requests recomputed   {v.requests}\nidentical answers     {v.identical}\n"
              f"differing answers     {len(v.mismatches)}\nnot greedy (skipped)  {v.not_greedy}")
    return 1 if v.mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
