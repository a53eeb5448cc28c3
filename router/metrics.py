"""Prometheus metrics of one router process, on a registry of its own.

A private ``CollectorRegistry`` per ``RouterMetrics`` keeps several routers
in one process (tests) from colliding on the global registry. Placement
decisions are counted with the policy's reason and the chosen score observed,
so /metrics shows why traffic went where it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.config import HitRule

if TYPE_CHECKING:
    from router.metrics_vllm import VllmSeries

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    stream_errors: Counter = field(init=False)
    in_flight: Gauge = field(init=False)
    request_seconds: Histogram = field(init=False)
    ttft_seconds: Histogram = field(init=False)
    tokens: Counter = field(init=False)
    placements: Counter = field(init=False)
    placement_score: Histogram = field(init=False)
    retries: Counter = field(init=False)
    instances: Gauge = field(init=False)
    kv_events: Counter = field(init=False)
    hit_rule: Gauge = field(init=False)
    # The admission layer (router.admission).
    admitted: Counter = field(init=False)
    rejected: Counter = field(init=False)
    queue_wait_seconds: Histogram = field(init=False)
    queue_depth: Gauge = field(init=False)
    in_service: Gauge = field(init=False)
    in_flight_now: int = 0
    warmups: Counter = field(init=False)
    warmed_blocks: Counter = field(init=False)
    local_tails: Counter = field(init=False)
    local_colds: Counter = field(init=False)
    vllm: VllmSeries | None = None      # vLLM-named series, once the model is known

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "Requests answered",
                                ["endpoint", "status"], registry=r)
        self.stream_errors = Counter("kvserve_router_stream_errors",
                                     "Streams that failed after the first token", registry=r)
        self.in_flight = Gauge("kvserve_router_in_flight", "Requests being served", registry=r)
        self.request_seconds = Histogram("kvserve_router_request_seconds",
                                         "Time from request to last byte", ["endpoint"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kvserve_router_ttft_seconds",
                                      "Time from request to the first generated token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("kvserve_router_tokens", "Tokens by kind (prompt, cached, "
                              "completion)", ["kind"], registry=r)
        self.placements = Counter("kvserve_router_placements",
                                  "Placement decisions by role, policy, chosen instance and "
                                  "reason", ["role", "policy", "instance", "reason"], registry=r)
        self.placement_score = Histogram("kvserve_router_placement_score",
                                         "Score of the chosen instance", ["role", "policy"],
                                         buckets=(-1e6, -1e4, -100, -10, -1, 0, 1, 10, 100,
                                                  1e4, 1e6), registry=r)
        self.retries = Counter("kvserve_router_retries",
                               "Instances abandoned before the first token, by role and reason",
                               ["role", "reason"], registry=r)
        self.instances = Gauge("kvserve_router_live_instances",
                               "Instances in the live view by role", ["role"], registry=r)
        self.kv_events = Counter("kvserve_router_kv_events", "KV events applied to the view",
                                 ["kind"], registry=r)
        self.hit_rule = Gauge("kvserve_router_hit_rule",
                              "Hit-rule configuration (docs/architecture.md#the-hit-rule)",
                              ["field"], registry=r)
        self.admitted = Counter("kvserve_router_admitted",
                                "Requests the admission layer let through", registry=r)
        self.rejected = Counter("kvserve_router_rejected",
                                "Requests refused before any work, by reason (429: rate_limited, "
                                "queue_full, over_slo, queue_timeout, busy; 503: no_instance)",
                                ["reason"], registry=r)
        self.queue_wait_seconds = Histogram("kvserve_router_queue_wait_seconds",
                                            "Time admitted requests waited for room",
                                            buckets=(0.0, *_LATENCY_BUCKETS), registry=r)
        self.queue_depth = Gauge("kvserve_router_queue_depth",
                                 "Requests waiting in each tenant's fair queue", ["tenant"],
                                 registry=r)
        self.in_service = Gauge("kvserve_router_in_service",
                                "Admitted requests in prefill, and in service (prefill + "
                                "decode)", ["stage"], registry=r)
        self.warmups = Counter("kvserve_router_warmups", "Session warm-ups (G3/G4 -> G2 on "
                               "arrival) by outcome", ["outcome"], registry=r)
        self.warmed_blocks = Counter("kvserve_router_warmed_blocks",
                                     "Blocks moved up to G2 by warm-ups", registry=r)
        self.local_tails = Counter("kvserve_router_local_tails",
                                   "Prompts sent to the decode instance holding their prefix "
                                   "with no prefill (router.dispatch), by outcome: served, "
                                   "declined (the instance no longer held enough: prefilled "
                                   "instead), busy, failed", ["outcome"], registry=r)
        self.local_colds = Counter("kvserve_router_local_colds",
                                   "Short prompts no instance held, sent to a decode instance "
                                   "with no prefill (router.dispatch), by outcome: served, "
                                   "declined (prefilled instead), busy, failed", ["outcome"],
                                   registry=r)

    def enable_vllm_series(self, model_name: str) -> VllmSeries:
        """Add the vLLM-named series benchmark tools scrape (router.metrics_vllm)."""
        from router.metrics_vllm import VllmSeries

        self.vllm = VllmSeries(self.registry, model_name)
        return self.vllm

    def begin_request(self) -> None:
        self.in_flight_now += 1
        self.in_flight.inc()

    def end_request(self) -> None:
        self.in_flight_now -= 1
        self.in_flight.dec()

    def set_hit_rule(self, rule: HitRule) -> None:
        for name, value in (("block_tokens", rule.block_tokens), ("window", rule.window),
                            ("backtrack", rule.backtrack), ("reserve", rule.reserve),
                            ("replay_keep_tokens", rule.replay_keep_tokens)):
            self.hit_rule.labels(field=name).set(value)

    def exposition(self) -> tuple[bytes, str]:
        """Body and content type of GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
