"""vLLM-named Prometheus series on the router's /metrics.

Benchmark tools and dashboards built for vLLM (``vllm bench serve``, AIPerf's
server-metrics scrape, Grafana boards, llm-d's scorers) read these names; the
values are the router's view of the whole deployment (every engine behind it),
with vLLM's labels ``model_name`` and ``engine`` ("0": one logical engine).

Meaning, as in vLLM v1 (vllm/v1/metrics/loggers.py):
- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: prompt tokens
  looked up / found cached, so hits / queries is the prefix-cache hit rate. For
  kvserve "cached" is what the answer's ``cached_tokens`` reports: the engine's
  own G1 plus what it restored from the warehouse (G2-G4).
- ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success``
  (by ``finished_reason``), ``vllm:num_requests_running`` (requests in flight),
  ``vllm:num_requests_waiting`` (0: waiting is inside the services),
  ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_LABELS = ("model_name", "engine")


@dataclass(slots=True)
class VllmSeries:
    registry: CollectorRegistry
    model_name: str
    queries: Counter = field(init=False)
    hits: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    success: Counter = field(init=False)
    running: Gauge = field(init=False)
    waiting: Gauge = field(init=False)
    ttft: Histogram = field(init=False)
    e2e: Histogram = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.queries = Counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.",
                               _LABELS, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            _LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     _LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", _LABELS,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed "
                               "requests.", (*_LABELS, "finished_reason"), registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model "
                             "execution batches.", _LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", _LABELS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _LABELS,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _LABELS,
                             buckets=_E2E_BUCKETS, registry=r)
        self.waiting.labels(*self._lv).set(0)

    @property
    def _lv(self) -> tuple[str, str]:
        return (self.model_name, "0")

    def finished(self, prompt: int, cached: int, generated: int, reason: str) -> None:
        lv = self._lv
        self.queries.labels(*lv).inc(prompt)
        self.hits.labels(*lv).inc(cached)
        self.prompt_tokens.labels(*lv).inc(prompt)
        self.generation_tokens.labels(*lv).inc(generated)
        self.success.labels(*lv, reason or "stop").inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(*self._lv).observe(ttft_s)

    def in_flight(self, n: int) -> None:
        self.running.labels(*self._lv).set(n)
