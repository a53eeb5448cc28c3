"""``kvserve bench router``: placement decisions per second on one core.

Setup: ``instances`` prefill instances, 8 per node; a prefix view filled by
KV events as a running cluster would produce them: ``conversations`` prompts
of ``prompt_tokens`` tokens that all begin with a shared 1,024-token system
prompt (stored in G4, so every instance matches its blocks), each stored in
G2 on one node and partly (the first quarter) in G1 of one instance there.
Each decision is one ``Placer.place_prefill`` call on a prompt's token list:
BLAKE2b block hashing (``kvstore.keys.chain_keys``), the prefix match over
all instances, the hit rule and the policy's scores. Tokenizing is excluded
from it and timed separately (SmolLM2's tokenizer when ``engine.fetch`` can
provide it, else the engine's byte-level tokenizer, whose figure is then a
lower bound).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.harness import Chart, Goal, Report, Table, check_goals, timed
from common.config import HitRule
from kvserve.cli import UsageError
from kvstore.keys import chain_keys
from kvstore.registry import InstanceInfo
from router.placement import Placer, UnknownPolicyError, make_router_policy
from router.view import GLOBAL, ClusterView, PrefixView

SYSTEM_TOKENS = 1024
PER_NODE = 8
GOALS = (Goal("decisions/s >= 5000 on one core", "decisions_per_s", at_least=5000),
         Goal("decision p99 < 2 ms", "p99_ms", below=2.0))


@dataclass(frozen=True, slots=True)
class BenchConfig:
    instances: int = 64
    prompt_tokens: int = 8192
    decisions: int = 5000
    conversations: int = 1000
    block_tokens: int = 64
    policy: str = "cache_aware"
    cpu: int | None = 0          # pin to this core (None: leave the affinity alone)
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        if self.instances < 1 or self.decisions < 1 or self.conversations < 1:
            raise ValueError("instances, decisions and conversations must be >= 1")
        if self.prompt_tokens <= SYSTEM_TOKENS:
            raise ValueError(f"prompt_tokens must exceed the {SYSTEM_TOKENS}-token system prompt")


@dataclass(frozen=True, slots=True)
class BenchResult:
    decisions: int
    decisions_per_s: float        # wall clock
    decisions_per_cpu_s: float    # per second of this thread's CPU time (less noisy when
                                  #   other processes share the core)
    p50_ms: float
    p99_ms: float
    hash_ms_p50: float            # hashing alone, for scale
    tokenize_ms_p50: float
    tokenizer: str
    cpu: str
    keys_in_view: int


def _pin(cpu: int | None) -> str:
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return "unpinned"
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:
        return f"unpinned ({exc})"
    return f"core {cpu}"


def _tokenizer() -> tuple[object, str]:
    try:
        from engine.fetch import fetch_model
        from engine.tokenizer import HFTokenizer

        return HFTokenizer(fetch_model("smollm2", progress=False)), "smollm2"
    except Exception:
        from engine.tokenizer import ByteTokenizer

        return ByteTokenizer(260), "byte-level fallback (lower bound)"


def time_tokenize(prompt_tokens: int, runs: int = 30) -> tuple[float, str]:
    tok, name = _tokenizer()
    encode = tok.encode  # type: ignore[attr-defined]
    words = ["the", "router", "hashes", "every", "block", "of", "the", "prompt", "before",
             "it", "scores", "instances"]
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(prompt_tokens))
    while len(encode(text)) > prompt_tokens * 1.2:
        text = text[: int(len(text) * 0.8)]
    return timed(lambda: encode(text), repeats=runs, warmup=0).median * 1e3, name


def _build(cfg: BenchConfig, rng: np.random.Generator
           ) -> tuple[ClusterView, PrefixView, list[list[int]], bytes]:
    fp = bytes(range(16))
    cv = ClusterView(expiry_s=1e9)
    cv.replace([InstanceInfo(f"prefill-{i:03d}", "prefill", f"10.0.{i // PER_NODE}.{i}:50052",
                             node=f"node-{i // PER_NODE}",
                             tokens_in_flight=int(rng.integers(0, 4 * cfg.prompt_tokens)),
                             queue=int(rng.integers(0, 4)))
                for i in range(cfg.instances)])
    pv = PrefixView()
    system = rng.integers(0, 49152, SYSTEM_TOKENS).tolist()
    n_sys = SYSTEM_TOKENS // cfg.block_tokens
    prompts: list[list[int]] = []
    nodes = max(1, cfg.instances // PER_NODE)
    for c in range(cfg.conversations):
        prompt = system + rng.integers(0, 49152, cfg.prompt_tokens - SYSTEM_TOKENS).tolist()
        keys = chain_keys(prompt, block_tokens=cfg.block_tokens, tenant="bench", fingerprint=fp)
        if c == 0:
            pv.apply_event("stored", GLOBAL, "G4", keys[:n_sys])
        node = c % nodes
        pv.apply_event("stored", f"node-{node}", "G2", keys)
        inst = node * PER_NODE + int(rng.integers(0, PER_NODE))
        if inst < cfg.instances:
            pv.apply_event("stored", f"prefill-{inst:03d}", "G1", keys[:len(keys) // 4])
        prompts.append(prompt)
    return cv, pv, prompts, fp


def run_bench(cfg: BenchConfig) -> BenchResult:
    pinned = _pin(cfg.cpu)
    rng = np.random.default_rng(cfg.seed)
    cv, pv, prompts, fp = _build(cfg, rng)
    placer = Placer(make_router_policy(cfg.policy), pv,
                    hit_rule=HitRule(block_tokens=cfg.block_tokens))
    # Most requests continue a conversation; one in eight is new (shares only
    # the system prompt).
    fresh = [list(p) for p in prompts[:64]]
    for p in fresh:
        p[SYSTEM_TOKENS:] = rng.integers(0, 49152, len(p) - SYSTEM_TOKENS).tolist()
    pick = rng.integers(0, len(prompts), cfg.decisions)
    is_new = rng.random(cfg.decisions) < 0.125
    work = [fresh[k % len(fresh)] if new else prompts[k] for k, new in zip(pick, is_new,
                                                                         strict=True)]
    for prompt in work[:200]:                         # warm caches and the allocator
        placer.place_prefill(cv.candidates("prefill"), chain_keys(
            prompt, block_tokens=cfg.block_tokens, tenant="bench", fingerprint=fp), len(prompt))
    todo = iter(work)

    def decide() -> None:
        prompt = next(todo)
        keys = chain_keys(prompt, block_tokens=cfg.block_tokens, tenant="bench", fingerprint=fp)
        placer.place_prefill(cv.candidates("prefill"), keys, len(prompt))

    lat = timed(decide, repeats=cfg.decisions, warmup=0,
                progress="bench router" if cfg.progress else "")
    hashed = iter(work[:500])
    hashing = timed(lambda: chain_keys(next(hashed), block_tokens=cfg.block_tokens,
                                       tenant="bench", fingerprint=fp),
                    repeats=min(500, len(work)), warmup=0)
    tok_ms, tok_name = time_tokenize(cfg.prompt_tokens)
    return BenchResult(cfg.decisions, cfg.decisions / lat.total,
                       cfg.decisions / max(sum(lat.cpu), 1e-9), lat.quantile(0.5) * 1e3,
                       lat.quantile(0.99) * 1e3, hashing.median * 1e3, tok_ms, tok_name,
                       pinned, len(pv))


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench router``: the flags in, the harness's report out."""
    try:
        cfg = BenchConfig(instances=args.instances, prompt_tokens=args.prompt_tokens,
                          decisions=args.decisions, policy=args.policy,
                          cpu=None if args.cpu < 0 else args.cpu,
                          progress=sys.stderr.isatty())
        res = run_bench(cfg)
    except (UnknownPolicyError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    verdicts = check_goals(GOALS, asdict(res))
    out = asdict(res) | {"instances": cfg.instances, "prompt_tokens": cfg.prompt_tokens,
                         "policy": cfg.policy,
                         "goal": {"decisions_per_s": 5000, "p99_ms": 2.0},
                         "goal_met": all(v.met for v in verdicts)}
    table = Table(("decisions/s", "per CPU s", "p50 ms", "p99 ms", "hash ms", "tokenize ms"))
    table.add(res.decisions_per_s, res.decisions_per_cpu_s, res.p50_ms, res.p99_ms,
              res.hash_ms_p50, res.tokenize_ms_p50)
    return Report(f"{cfg.policy}, {cfg.instances} instances, {cfg.prompt_tokens}-token "
                  f"prompts, {res.cpu}, {res.keys_in_view} block keys in the view", out,
                  [table], verdicts, notes=[f"tokenizer: {res.tokenizer}"],
                  chart=Chart(f"one placement decision, {cfg.instances} instances",
                              ("decision p50", "decision p99", "hashing p50", "tokenize p50"),
                              {"ms": [res.p50_ms, res.p99_ms, res.hash_ms_p50,
                                      res.tokenize_ms_p50]}, kind="barh", xlabel="ms"))


__all__ = ["BenchConfig", "BenchResult", "report", "run_bench", "time_tokenize"]
