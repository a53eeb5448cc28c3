"""The limits ``kvserve bench stack`` reads its figures against, measured on the
device in the same run, before the stack starts (a process of its own, so its
memory is gone when the engines load):

- ``h2d_gbps``: pinned host -> device copy (CPU: one host memcpy): what a
  restore from G2 (host memory) into the engine's pool can move at best.
- ``copy_gbps``: a device copy, bytes read plus written (``kvserve bench
  engine``'s ceiling): the memory roofline of decode.
- ``prefill_s``: a reference prefill of the model's shape at a few prompt
  lengths, the device's own libraries (cuBLAS / SDPA; on CPU torch's), random
  weights; ``fit_a``/``fit_b`` fit ``t(T) = a*T + b*T^2`` (the GEMMs grow with T,
  causal attention with T^2), so the compute of a request's misses, its prompt L
  with c tokens cached, is ``t(L) - t(c)``.
- ``weight_bytes`` and ``kv_bytes_per_token``: what decode reads per step
  (every weight but the embedding table, plus each sequence's KV).

``python -m benchmarks.stack_limits --model M --device D --dtype T`` prints them
as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Limits:
    device: str
    model: str
    dtype: str
    h2d_gbps: float
    copy_gbps: float
    prefill_s: dict[str, float]         # prompt length -> seconds of the reference prefill
    fit_a: float                        # seconds per token
    fit_b: float                        # seconds per token^2
    weight_bytes: int
    kv_bytes_per_token: int

    def prefill_time(self, tokens: float) -> float:
        return self.fit_a * tokens + self.fit_b * tokens * tokens

    def miss_time(self, prompt: int, cached: int) -> float:
        """Compute of a prompt's uncached suffix (its rows attend to the whole prompt)."""
        return max(0.0, self.prefill_time(prompt) - self.prefill_time(min(cached, prompt)))

    def decode_roofline(self, batch: float, context: float) -> float:
        """Tokens/s when a step reads every weight once and each sequence's KV."""
        step_bytes = self.weight_bytes + batch * context * self.kv_bytes_per_token
        return batch * self.copy_gbps * 1e9 / step_bytes

    def slo_batch(self, tpot_s: float, context: float, most: int) -> int:
        """The largest batch (<= ``most``) whose roofline step fits the TPOT SLO."""
        room = tpot_s * self.copy_gbps * 1e9 - self.weight_bytes
        b = int(room // (context * self.kv_bytes_per_token)) if room > 0 else 1
        return max(1, min(most, b))

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> Limits:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})  # type: ignore[arg-type]


def model_config(model: str) -> ModelConfig:
    """The model's shape: a named config, a fetchable model or a directory."""
    from pathlib import Path

    from engine.config import named_configs, read_config
    from engine.fetch import KNOWN_MODELS, fetch_model

    if model in named_configs():
        return ModelConfig.from_name(model)
    return read_config(fetch_model(model) if model in KNOWN_MODELS else Path(model).expanduser())


def weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Bytes of the weights a decode step reads: every layer, the final norm and
    the LM head (the embedding table only when it is the LM head)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size + 2 * d
    return elem * (cfg.num_layers * per_layer + d + cfg.vocab_size * d)


def fit_quadratic(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a*T + b*T^2`` (no constant), both kept >= 0."""
    s11 = sum(t * t for t, _ in points)
    s12 = sum(t ** 3 for t, _ in points)
    s22 = sum(t ** 4 for t, _ in points)
    y1 = sum(t * y for t, y in points)
    y2 = sum(t * t * y for t, y in points)
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det
        if a >= 0 and b >= 0:
            return a, b
    # Degenerate or a negative term (noise at short lengths): the linear fit alone.
    return y1 / s11, 0.0


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    fn()
    _sync(dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_rates(dev: torch.device) -> tuple[float, float]:
    """(pinned host -> device GB/s, device copy GB/s read + written)."""
    n = 2**30 if dev.type == "cuda" else 2**28
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    src.fill_(7)
    h2d = n / _best(lambda: dst.copy_(src, non_blocking=True), dev, 5) / 1e9
    other = torch.empty_like(dst)
    copy = 2 * n / _best(lambda: other.copy_(dst), dev, 10) / 1e9
    return h2d, copy


def reference_prefill(cfg: ModelConfig, tokens: int, dev: torch.device,
                      dtype: torch.dtype) -> float:
    """Seconds of one prefill of ``tokens`` through every layer of ``cfg``'s shape
    (one set of random weights reused by each layer: the same arithmetic)."""
    g = torch.Generator(device=dev).manual_seed(0)
    d, hd, h, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    ff = cfg.intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(
            dtype)

    wqkv, wo, w13, w2 = w(d, (h + 2 * kvh) * hd), w(h * hd, d), w(d, 2 * ff), w(ff, d)
    head = w(d, cfg.vocab_size)
    x = w(tokens, d)

    def run() -> torch.Tensor:
        y = x
        for _ in range(cfg.num_layers):
            qkv = y @ wqkv
            q = qkv[:, : h * hd].view(tokens, h, hd).transpose(0, 1)
            k = qkv[:, h * hd: (h + kvh) * hd].view(tokens, kvh, hd).transpose(0, 1)
            v = qkv[:, (h + kvh) * hd:].view(tokens, kvh, hd).transpose(0, 1)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                               enable_gqa=h != kvh)[0]
            y = y + a.transpose(0, 1).reshape(tokens, h * hd) @ wo
            u = y @ w13
            y = y + (F.silu(u[:, :ff]) * u[:, ff:]) @ w2
        return y[-1:] @ head

    with torch.inference_mode():
        return _best(run, dev, 2)


def measure(model: str, device: str, dtype: str, lengths: Sequence[int]) -> Limits:
    dev = torch.device(device)
    cfg = model_config(model)
    h2d, copy = copy_rates(dev)
    times = {}
    for n in lengths:
        n = min(n, cfg.max_position)
        times[str(n)] = reference_prefill(cfg, n, dev, _DTYPES[dtype])
        print(f"[limits] reference prefill {n} tokens: {times[str(n)]:.4f} s "
              f"({n / times[str(n)]:,.0f} tok/s)", file=sys.stderr, flush=True)
    a, b = fit_quadratic([(float(k), v) for k, v in times.items()])
    elem = torch.empty(0, dtype=_DTYPES[dtype]).element_size()
    kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    return Limits(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                  f"cpu ({torch.get_num_threads()} threads)", model=model, dtype=dtype,
                  h2d_gbps=h2d, copy_gbps=copy, prefill_s=times, fit_a=a, fit_b=b,
                  weight_bytes=weight_bytes(cfg, elem), kv_bytes_per_token=kv_tok)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--lengths", default="512,2048,8192",
                   help="reference prefill lengths (tokens), comma-separated")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    lim = measure(args.model, args.device, args.dtype, lengths)
    print(json.dumps(asdict(lim), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
