"""Placement policies: which prefill instance, then which decode instance.

Policies are registered by name (``make_router_policy``) and see the same
typed inputs whether a live router or a trace replay asks:

* a ``CandidateSet`` (router.view): the instances of one role as arrays;
* a ``PlacementRequest``: the prompt length and, for cache-aware policies, the
  tokens each candidate can restore, by the fastest tier holding them.

Scores are in *tokens of prefill work* (higher is better), so affinity and load
trade off in one unit:

* ``round_robin``: the next instance in id order.
* ``least_load``: fewest pending tokens (prefill: prompt tokens queued or
  computing; decode: context tokens of running sequences).
* ``cache_aware``: prefill score = sum_t credit_t * restorable_t
  - load_weight * pending. ``credit_t`` is the share of a token's compute
  saved by restoring it from tier t (G1 > G2 > G3 > G4: the deeper the tier,
  the more the fetch costs), so the best score is the lowest estimated TTFT
  (queued work + compute of what cannot be restored). Decode: least pending.
* ``cache_expert_aware``: a MoE step waits for the slowest expert rank, so an
  instance's work is multiplied by its reported expert imbalance (max / mean
  rank load): prefill score = -imbalance * (load_weight * pending + prompt
  - sum_t credit_t * restorable_t) (with imbalance 1 everywhere this ranks
  candidates exactly as ``cache_aware``); decode score = -imbalance *
  (pending + prompt).

Ties go to the first best candidate after a rotating offset, so an idle
cluster is filled round-robin rather than piling onto the first instance.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from common.config import HitRule
from router.view import N_TIERS, TIERS, CandidateSet, PrefixView

log = logging.getLogger(__name__)


class UnknownPolicyError(ValueError):
    """A routing policy name that is not registered; the message lists them."""


class NoCandidateError(LookupError):
    """No live instance of the role to choose from."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    tier_credit: tuple[float, float, float, float] = (1.0, 0.9, 0.6, 0.4)   # G1..G4
    load_weight: float = 1.0        # tokens of affinity worth one pending token

    def __post_init__(self) -> None:
        if len(self.tier_credit) != N_TIERS:
            raise ValueError(f"tier_credit needs {N_TIERS} values ({', '.join(TIERS)}), "
                             f"got {len(self.tier_credit)}")
        if any(not 0.0 <= c <= 1.0 for c in self.tier_credit):
            raise ValueError(f"tier_credit values must be in [0, 1], got {self.tier_credit}")
        if list(self.tier_credit) != sorted(self.tier_credit, reverse=True):
            raise ValueError(f"tier_credit must not increase from G1 to G4, "
                             f"got {self.tier_credit}")
        if not self.load_weight >= 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")

    @classmethod
    def from_costs(cls, bandwidth_Bps: dict[str, float], latency_s: dict[str, float], *,
                   block_bytes: int, block_tokens: int, prefill_tokens_per_s: float,
                   fetch_blocks: int = 64, load_weight: float = 1.0) -> PolicyConfig:
        """Tier credits from measured costs (the numbers prefill's cost rule
        learns, service/cost.py): a token restored from tier t saves its
        compute minus its fetch, credit_t = 1 - fetch_s / recompute_s per block,
        where a fetch of ``fetch_blocks`` blocks pays the tier's latency once;
        clamped to [0, 1] and made non-increasing G1 -> G4 (a deeper tier is
        never credited above a faster one). G1 (the engine's own pool) is 1."""
        if min(block_bytes, block_tokens, fetch_blocks) <= 0 or not prefill_tokens_per_s > 0:
            raise ValueError("block_bytes, block_tokens, fetch_blocks and "
                             "prefill_tokens_per_s must be > 0")
        recompute_s = block_tokens / prefill_tokens_per_s
        credits = [1.0]
        for tier in TIERS[1:]:
            bw, lat = bandwidth_Bps.get(tier), latency_s.get(tier)
            if bw is None or lat is None or bw <= 0:
                c = 0.0                           # unknown or unusable: no credit
            else:
                fetch_s = lat / fetch_blocks + block_bytes / bw
                c = min(1.0, max(0.0, 1.0 - fetch_s / recompute_s))
            credits.append(min(c, credits[-1]))
        return cls(tier_credit=(credits[0], credits[1], credits[2], credits[3]),
                   load_weight=load_weight)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    prompt_tokens: int
    # [C, 4] tokens each candidate can restore (after the hit rule), by fastest
    # tier G1..G4; None when the caller has no cache information.
    hit_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen instance, every candidate's score, and a short reason
    (a fixed vocabulary, fit for a metrics label; ``detail`` says more)."""

    instance_id: str
    scores: dict[str, float]
    reason: str
    index: int = -1                 # position of the choice in the CandidateSet
    policy: str = ""
    restorable_tokens: int = 0      # of the chosen instance (prefill)
    pending_tokens: float = 0.0     # of the chosen instance when chosen

    @property
    def score(self) -> float:
        return self.scores.get(self.instance_id, 0.0)

    @property
    def detail(self) -> str:
        return (f"{self.policy}: {self.instance_id} ({self.reason}; restorable "
                f"{self.restorable_tokens} tokens, pending {self.pending_tokens:.0f}, "
                f"score {self.score:.1f} of {len(self.scores)} candidates)")


def restorable_tokens(hit_blocks: np.ndarray, block_tokens: int, prompt_tokens: int,
                      hit_rule: HitRule | None = None) -> np.ndarray:
    """[C, 4] matched blocks -> [C, 4] usable tokens under the hit rule
    (docs/architecture.md#the-hit-rule); the excess over the rule's cap is taken from
    the slowest tier."""
    rule = hit_rule or HitRule(block_tokens=block_tokens)
    tokens = hit_blocks * block_tokens
    # HitRule.usable_tokens = floor_to_block(min(matched, L - reserve)): with
    # whole blocks matched, only the prompt-side cap can bite.
    limit = prompt_tokens - rule.reserve
    cap = max(0, limit - limit % rule.block_tokens)
    total = tokens.sum(axis=1)
    if total.max(initial=0) <= cap:
        return tokens
    tokens = tokens.copy()
    excess = np.maximum(total - cap, 0)
    for t in range(N_TIERS - 1, -1, -1):
        take = np.minimum(excess, tokens[:, t])
        tokens[:, t] -= take
        excess -= take
    return tokens


class RouterPolicy(ABC):
    name: ClassVar[str] = ""
    uses_cache: ClassVar[bool] = False      # whether prefill needs restorable tokens

    def __init__(self, cfg: PolicyConfig | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        self._credit = np.array(self.cfg.tier_credit, dtype=np.float64)
        # One rotation per role: a shared one advances twice per request (prefill, then
        # decode), so with two instances of a role every tie went to the same one.
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def choose_prefill(self, cands: CandidateSet, req: PlacementRequest) -> Decision:
        scores, reason = self.prefill_scores(cands, req)
        return self._decide(cands, req, scores, reason, "prefill")

    def choose_decode(self, cands: CandidateSet, req: PlacementRequest) -> Decision:
        scores, reason = self.decode_scores(cands, req)
        return self._decide(cands, req, scores, reason, "decode")

    @abstractmethod
    def prefill_scores(self, cands: CandidateSet, req: PlacementRequest
                       ) -> tuple[np.ndarray, str]:
        """[C] scores (higher is better) and the reason for the best one."""

    def decode_scores(self, cands: CandidateSet, req: PlacementRequest
                      ) -> tuple[np.ndarray, str]:
        return -cands.pending_tokens, "least_load"

    # -- shared helpers --------------------------------------------------------------

    def _credited(self, cands: CandidateSet, req: PlacementRequest) -> np.ndarray:
        """[C] credited restorable tokens (zeros without cache information)."""
        if req.hit_tokens is None:
            return np.zeros(len(cands))
        if req.hit_tokens.shape != (len(cands), N_TIERS):
            raise ValueError(f"hit_tokens has shape {req.hit_tokens.shape}; expected "
                             f"({len(cands)}, {N_TIERS}) for {len(cands)} candidates")
        return req.hit_tokens @ self._credit

    def _decide(self, cands: CandidateSet, req: PlacementRequest, scores: np.ndarray,
                reason: str, role: str) -> Decision:
        n = len(cands)
        if n == 0:
            raise NoCandidateError("no live instance to place the request on")
        start = next(self._turns[role]) % n
        ties = np.flatnonzero(scores == scores.max())
        after = ties[ties >= start]
        best = int(after[0] if len(after) else ties[0])
        restorable = 0 if req.hit_tokens is None else int(req.hit_tokens[best].sum())
        return Decision(cands.ids[best], dict(zip(cands.ids, scores.tolist(), strict=True)),
                        reason, best, self.name, restorable,
                        float(cands.pending_tokens[best]))


_REGISTRY: dict[str, type[RouterPolicy]] = {}


def register_router_policy(name: str) -> Callable[[type[RouterPolicy]], type[RouterPolicy]]:
    def deco(cls: type[RouterPolicy]) -> type[RouterPolicy]:
        if name in _REGISTRY:
            raise ValueError(f"router policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def router_policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_router_policy(name: str, cfg: PolicyConfig | None = None) -> RouterPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(f"unknown router policy {name!r}; choose one of "
                                 f"{router_policy_names()}") from None
    return cls(cfg)


@register_router_policy("round_robin")
class RoundRobin(RouterPolicy):
    # Equal scores: the rotating tie-break in _decide is the round robin.
    def prefill_scores(self, cands: CandidateSet, req: PlacementRequest
                       ) -> tuple[np.ndarray, str]:
        return np.zeros(len(cands)), "round_robin"

    def decode_scores(self, cands: CandidateSet, req: PlacementRequest
                      ) -> tuple[np.ndarray, str]:
        return np.zeros(len(cands)), "round_robin"


@register_router_policy("least_load")
class LeastLoad(RouterPolicy):
    def prefill_scores(self, cands: CandidateSet, req: PlacementRequest
                       ) -> tuple[np.ndarray, str]:
        return -cands.pending_tokens, "least_load"


@register_router_policy("cache_aware")
class CacheAware(RouterPolicy):
    uses_cache = True

    def prefill_scores(self, cands: CandidateSet, req: PlacementRequest
                       ) -> tuple[np.ndarray, str]:
        credited = self._credited(cands, req)
        scores = credited - self.cfg.load_weight * cands.pending_tokens
        return scores, "prefix_affinity" if credited.any() else "least_load"


@register_router_policy("cache_expert_aware")
class CacheExpertAware(RouterPolicy):
    uses_cache = True

    def prefill_scores(self, cands: CandidateSet, req: PlacementRequest
                       ) -> tuple[np.ndarray, str]:
        credited = self._credited(cands, req)
        work = self.cfg.load_weight * cands.pending_tokens + req.prompt_tokens - credited
        return -cands.imbalance * work, ("prefix_affinity" if credited.any()
                                         else "expert_balance")

    def decode_scores(self, cands: CandidateSet, req: PlacementRequest
                      ) -> tuple[np.ndarray, str]:
        return -cands.imbalance * (cands.pending_tokens + req.prompt_tokens), "expert_balance"


class Placer:
    """A policy plus the prefix view: one call per placement (what the live
    router and ``kvserve bench router`` use)."""

    def __init__(self, policy: RouterPolicy, prefixes: PrefixView | None = None, *,
                 hit_rule: HitRule | None = None) -> None:
        self.policy = policy
        self.prefixes = prefixes if prefixes is not None else PrefixView()
        self.hit_rule = hit_rule or HitRule()
        self._sources_cands: CandidateSet | None = None
        self._sources_locations = -1
        self._sources = np.zeros((0, 3), dtype=np.intp)

    def _cached_sources(self, cands: CandidateSet) -> np.ndarray:
        # Valid while the candidate set (the same object: ClusterView caches it
        # until the view changes) and the location list are unchanged.
        n_loc = self.prefixes.location_count
        if cands is not self._sources_cands or n_loc != self._sources_locations:
            self._sources = self.prefixes.sources(cands)
            self._sources_cands, self._sources_locations = cands, n_loc
        return self._sources

    def prefill_request(self, cands: CandidateSet, keys: Sequence[Hashable],
                        prompt_tokens: int) -> PlacementRequest:
        if not self.policy.uses_cache or not keys:
            return PlacementRequest(prompt_tokens)
        blocks = self.prefixes.match_candidates(keys, cands, self._cached_sources(cands))
        return PlacementRequest(prompt_tokens, restorable_tokens(
            blocks, self.hit_rule.block_tokens, prompt_tokens, self.hit_rule))

    def place_prefill(self, cands: CandidateSet, keys: Sequence[Hashable],
                      prompt_tokens: int, *, sticky: str = "",
                      slack_tokens: float = 0.0) -> Decision:
        """The policy's choice, or ``sticky`` (the instance that served the
        request's session last, router.session) while that one is a candidate
        and its pending work is within ``slack_tokens`` of the least loaded."""
        if len(cands) == 0:
            raise NoCandidateError("no live prefill instance to place the request on")
        req = self.prefill_request(cands, keys, prompt_tokens)
        d = self.policy.choose_prefill(cands, req)
        d = self._sticky(cands, d, sticky, slack_tokens, "session_affinity", req.hit_tokens)
        if log.isEnabledFor(logging.DEBUG):       # formatting 64 scores is not free
            log.debug("prefill %s scores=%s", d.detail, d.scores)
        return d

    @staticmethod
    def _sticky(cands: CandidateSet, d: Decision, sticky: str, slack_tokens: float,
                reason: str, hit_tokens: np.ndarray | None) -> Decision:
        """``sticky`` instead of the policy's choice while it is a candidate and
        its pending work is within ``slack_tokens`` of the least loaded
        (llm-d's "sticky unless overloaded")."""
        if not sticky or sticky == d.instance_id or sticky not in cands.ids:
            return d
        i = cands.ids.index(sticky)
        pending = cands.pending_tokens
        if pending[i] - pending.min() > slack_tokens:
            return d
        return Decision(sticky, d.scores, reason, i, d.policy,
                        0 if hit_tokens is None else int(hit_tokens[i].sum()),
                        float(pending[i]))

    def place_decode(self, cands: CandidateSet, prompt_tokens: int, *, sticky: str = "",
                     slack_tokens: float = 0.0) -> Decision:
        """The policy's choice, or ``sticky`` (the decode instance whose G1 holds
        the prompt's prefix) while it is a candidate within ``slack_tokens``."""
        if len(cands) == 0:
            raise NoCandidateError("no live decode instance to place the request on")
        d = self.policy.choose_decode(cands, PlacementRequest(prompt_tokens))
        d = self._sticky(cands, d, sticky, slack_tokens, "decode_affinity", None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decode %s scores=%s", d.detail, d.scores)
        return d


__all__ = [
    "Decision",
    "NoCandidateError",
    "PlacementRequest",
    "Placer",
    "PolicyConfig",
    "RouterPolicy",
    "UnknownPolicyError",
    "make_router_policy",
    "register_router_policy",
    "restorable_tokens",
    "router_policy_names",
]
