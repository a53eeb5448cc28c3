"""Weight containers (plain tensors, fused where it saves a GEMM) and the
deterministic random initialisation of the named configs.

Fusion: q/k/v are one matrix and gate/up one, so a layer runs four GEMMs
instead of seven. Matrices are stored transposed, ``[in, out]`` (suffix
``_t``): ``x @ w_t`` measured 1.2-1.7x faster than ``F.linear(x, w)`` on the
CPU machine for 1-64 rows (MKL), and the same on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import DeviceError

# Part of a random-weight model's identity: bump when _Init draws differently.
RANDOM_INIT_VERSION = 2


@dataclass(slots=True)
class DenseFFNWeights:
    gate_up_t: torch.Tensor        # [hidden, 2 * I]  (gate columns first, then up)
    down_t: torch.Tensor           # [I, hidden]


@dataclass(slots=True)
class MoEWeights:
    router_t: torch.Tensor         # [hidden, E]
    experts: list[DenseFFNWeights]
    shared: DenseFFNWeights | None  # all shared experts merged into one wider FFN


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor        # [hidden]
    qkv_t: torch.Tensor            # [hidden, (H + 2 * Hkv) * D]
    bqkv: torch.Tensor | None      # [(H + 2 * Hkv) * D]
    o_t: torch.Tensor              # [H * D, hidden]
    ffn_norm: torch.Tensor         # [hidden]
    ffn: DenseFFNWeights | MoEWeights


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor            # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor             # [hidden]
    lm_head_t: torch.Tensor        # [hidden, V]; a transposed copy of embed when tied

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm, self.lm_head_t]
        for layer in self.layers:
            out += [layer.attn_norm, layer.qkv_t, layer.o_t, layer.ffn_norm]
            if layer.bqkv is not None:
                out.append(layer.bqkv)
            ffns = [layer.ffn] if isinstance(layer.ffn, DenseFFNWeights) else (
                layer.ffn.experts + ([layer.ffn.shared] if layer.ffn.shared else []))
            if isinstance(layer.ffn, MoEWeights):
                out.append(layer.ffn.router_t)
            for f in ffns:
                out += [f.gate_up_t, f.down_t]
        return out

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


class _Init:
    """Draws tensors in a fixed order from one seeded generator: the same
    config and seed give the same weights in any process."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)
        return t.mul_(std)

    def linear(self, out_f: int, in_f: int) -> torch.Tensor:
        """An HF-convention [out, in] draw, returned transposed (a view)."""
        # 2/sqrt(fan_in): at 1/sqrt(fan_in) the tiny models collapse to repeating
        # one token; at 2x they generate varied text, which makes exactness
        # tests sensitive (any changed bit soon changes a token).
        return self.normal(out_f, in_f, std=2.0 / math.sqrt(in_f)).t()

    def norm(self, n: int) -> torch.Tensor:
        return self.normal(n, std=0.1).add_(1.0)

    def ffn(self, hidden: int, inter: int) -> DenseFFNWeights:
        return DenseFFNWeights(gate_up_t=self.linear(2 * inter, hidden),
                               down_t=self.linear(hidden, inter))


def init_device(cfg: ModelConfig, device: torch.device) -> torch.device:
    """Where random weights are drawn: CPU (then moved) unless the shape is GPU-only."""
    if cfg.gpu_only:
        if device.type != "cuda":
            raise DeviceError(
                f"model config {cfg.name!r} is GPU-only (about "
                f"{estimate_params(cfg) * 2 / 1e9:.0f} GB in bf16); use device='cuda'")
        return device
    return torch.device("cpu")


def estimate_params(cfg: ModelConfig) -> int:
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size
    attn = qkv + cfg.hidden_size * cfg.num_heads * cfg.head_dim
    if cfg.moe is None:
        ffn = 3 * cfg.hidden_size * cfg.intermediate_size
    else:
        m = cfg.moe
        ffn = 3 * cfg.hidden_size * m.expert_intermediate * (m.n_experts + m.n_shared)
    emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * (attn + ffn) + emb


def random_weights(cfg: ModelConfig, seed: int, device: torch.device,
                   dtype: torch.dtype) -> ModelWeights:
    where = init_device(cfg, device)
    init = _Init(seed, where, dtype if where.type == "cuda" else torch.float32)
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    embed = init.normal(cfg.vocab_size, cfg.hidden_size, std=1.0)
    layers = []
    for _ in range(cfg.num_layers):
        attn_norm = init.norm(cfg.hidden_size)
        qkv_t = init.linear(qkv_rows, cfg.hidden_size)
        bqkv = init.normal(qkv_rows, std=0.1) if cfg.qkv_bias else None
        o_t = init.linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        ffn_norm = init.norm(cfg.hidden_size)
        ffn: DenseFFNWeights | MoEWeights
        if cfg.moe is None:
            ffn = init.ffn(cfg.hidden_size, cfg.intermediate_size)
        else:
            m = cfg.moe
            router_t = init.linear(m.n_experts, cfg.hidden_size)
            experts = [init.ffn(cfg.hidden_size, m.expert_intermediate) for _ in range(m.n_experts)]
            shared = init.ffn(cfg.hidden_size, m.expert_intermediate * m.n_shared) \
                if m.n_shared else None
            ffn = MoEWeights(router_t=router_t, experts=experts, shared=shared)
        layers.append(LayerWeights(attn_norm, qkv_t, bqkv, o_t, ffn_norm, ffn))
    norm = init.norm(cfg.hidden_size)
    lm_head_t = embed.t() if cfg.tie_embeddings else init.linear(cfg.vocab_size,
                                                                   cfg.hidden_size)
    weights = ModelWeights(embed=embed, layers=layers, norm=norm, lm_head_t=lm_head_t)
    return move_weights(weights, device, dtype)


def move_weights(w: ModelWeights, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    """Cast/move every tensor once; the result is contiguous (transposed views
    become real ``[in, out]`` matrices)."""
    cache: dict[int, torch.Tensor] = {}

    def mv(t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        if key not in cache:
            cache[key] = t.to(device=device, dtype=dtype).contiguous()
        return cache[key]

    def mv_ffn(f: DenseFFNWeights) -> DenseFFNWeights:
        return DenseFFNWeights(mv(f.gate_up_t), mv(f.down_t))

    layers = []
    for ly in w.layers:
        ffn: DenseFFNWeights | MoEWeights
        if isinstance(ly.ffn, DenseFFNWeights):
            ffn = mv_ffn(ly.ffn)
        else:
            ffn = MoEWeights(mv(ly.ffn.router_t), [mv_ffn(e) for e in ly.ffn.experts],
                             mv_ffn(ly.ffn.shared) if ly.ffn.shared else None)
        layers.append(LayerWeights(mv(ly.attn_norm), mv(ly.qkv_t),
                                   mv(ly.bqkv) if ly.bqkv is not None else None,
                                   mv(ly.o_t), mv(ly.ffn_norm), ffn))
    return ModelWeights(mv(w.embed), layers, mv(w.norm), mv(w.lm_head_t))
