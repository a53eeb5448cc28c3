"""The Llama-family decoder in plain torch: RMSNorm, RoPE, GQA, SwiGLU, optional
q/k/v biases and MoE FFN. Attention itself is a callback supplied by the runner,
which owns the paged KV pool; this module never sees blocks.

Every op here works row by row (a row = one token), so a token's result
depends only on its own row and on how many rows the call has; with the
batch-invariant kernels (engine/kernels.py) not even on that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kernels import Kernels, TorchKernels
from engine.weights import DenseFFNWeights, LayerWeights, ModelWeights, MoEWeights

# attend(layer, q [M, H, D], k [M, Hkv, D], v [M, Hkv, D]) -> [M, H * D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RotaryTable:
    """cos/sin of every position, computed once in fp32 (as HF does per call)."""

    def __init__(self, head_dim: int, theta: float, max_position: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                    .to(torch.float32) / head_dim))
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)                  # [P, D/2]
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)


_TORCH = TorchKernels()


def dense_ffn(h: torch.Tensor, w: DenseFFNWeights, k: Kernels = _TORCH) -> torch.Tensor:
    # h: [M, hidden] -> [M, hidden]
    return k.linear(k.silu_mul(k.linear(h, w.gate_up_t)), w.down_t)


def moe_ffn(h: torch.Tensor, w: MoEWeights, top_k: int, n_real: int,
            counts: torch.Tensor | None, k: Kernels = _TORCH) -> torch.Tensor:
    """Shared experts + softmax-gated top-k routed experts.

    Each used expert runs on ALL M rows (rows not routed to it get weight 0):
    gathering only its rows would make the GEMM's row count depend on the
    other tokens in the batch and so change the bits of this token's result.
    """
    probs = k.linear(h, w.router_t).float().softmax(dim=-1)  # [M, E]
    top_w, top_i = probs.topk(top_k, dim=-1)                 # [M, k]
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(h.dtype)
    real = top_i[:n_real].reshape(-1)
    hist = torch.bincount(real, minlength=len(w.experts))
    if counts is not None:
        counts += hist.to(counts.device)
    out = dense_ffn(h, w.shared, k) if w.shared is not None else torch.zeros_like(h)
    for e in hist.nonzero().flatten().tolist():
        weight = (top_w * (top_i == e)).sum(-1, keepdim=True)   # [M, 1], 0 where not routed
        out = out + weight * dense_ffn(h, w.experts[e], k)
    return out


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 dtype: torch.dtype, kernels: Kernels | None = None) -> None:
        self.cfg, self.w = cfg, weights
        self.k: Kernels = kernels or _TORCH
        self.device, self.dtype = device, dtype
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.max_position, device, dtype)
        self._q_heads = cfg.num_heads
        self._qk_heads = cfg.num_heads + cfg.num_kv_heads

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                n_real: int, expert_counts: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [M] -> hidden states [M, hidden] (before the final norm).

        Rows >= n_real are padding: they run through every GEMM (to keep M
        fixed) but are not counted as routed tokens.
        """
        x = F.embedding(tokens, self.w.embed)                  # [M, hidden]
        # a layer's FFN output is added to the residual by the next layer's first
        # norm (one kernel for both); the last one here
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.w.layers):
            x, pending = self._layer(i, layer, x, pending, positions, attend, n_real,
                                     expert_counts)
        return x if pending is None else x + pending

    def _layer(self, i: int, layer: LayerWeights, x: torch.Tensor, pending: torch.Tensor | None,
               positions: torch.Tensor, attend: AttendFn, n_real: int,
               expert_counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, this layer's FFN output still to be added to it)."""
        cfg, k = self.cfg, self.k
        if pending is None:
            h = k.rms_norm(x, layer.attn_norm, cfg.rms_eps)
        else:
            x, h = k.add_rms_norm(x, pending, layer.attn_norm, cfg.rms_eps)
        qkv = k.linear(h, layer.qkv_t, layer.bqkv).view(x.shape[0], -1, cfg.head_dim)
        qk = k.rope(qkv[:, : self._qk_heads], positions, self.rope.cos,
                    self.rope.sin)                                  # [M, H + Hkv, D]
        q, kk = qk[:, : self._q_heads], qk[:, self._q_heads:]
        v = qkv[:, self._qk_heads:]                                  # [M, Hkv, D]
        x, h = k.add_rms_norm(x, k.linear(attend(i, q, kk, v), layer.o_t), layer.ffn_norm,
                              cfg.rms_eps)
        if isinstance(layer.ffn, DenseFFNWeights):
            return x, dense_ffn(h, layer.ffn, k)
        counts = expert_counts[i] if expert_counts is not None else None
        assert cfg.moe is not None
        return x, moe_ffn(h, layer.ffn, cfg.moe.top_k, n_real, counts, k)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, V] in fp32
        k = self.k
        return k.linear(k.rms_norm(hidden, self.w.norm, self.cfg.rms_eps),
                        self.w.lm_head_t).float()
