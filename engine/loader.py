"""Load an HF-layout model directory (config.json + *.safetensors + tokenizer.json).

Any problem (missing file, bad JSON, truncated safetensors, missing or
misshapen tensor) raises ``ModelLoadError`` naming the file and the problem.
The weights hash (part of the fingerprint) is cached beside the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# read_config is engine/config.py's (no torch: the router reads a model's config too).
from engine.config import ModelConfig, read_config
from engine.errors import ModelLoadError
from engine.tokenizer import HFTokenizer
from engine.weights import DenseFFNWeights, LayerWeights, ModelWeights, move_weights

HASH_CACHE = ".kvserve-weights-hash.json"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: HFTokenizer
    weights_hash: bytes          # 16 bytes: BLAKE2b of the safetensors files' bytes


class _TensorSource:
    """Tensors by name across the directory's safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
                names = list(h.keys())
            except Exception as exc:
                raise ModelLoadError(f"{f}: corrupted safetensors file ({exc})") from exc
            self._handles[f] = h
            for n in names:
                self._where[n] = f

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"tensor {name!r} is missing from the safetensors files")
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({exc})") from exc
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {shape}")
        return t.float()


def _weights(cfg: ModelConfig, src: _TensorSource) -> ModelWeights:
    hd, d = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
    embed = src.get("model.embed_tokens.weight", (cfg.vocab_size, hd))
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = src.get(p + "self_attn.q_proj.weight", (q_rows, hd))
        k = src.get(p + "self_attn.k_proj.weight", (kv_rows, hd))
        v = src.get(p + "self_attn.v_proj.weight", (kv_rows, hd))
        bqkv = None
        if cfg.qkv_bias:
            bqkv = torch.cat([src.get(p + f"self_attn.{n}_proj.bias", (r,))
                              for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))])
        gate = src.get(p + "mlp.gate_proj.weight", (cfg.intermediate_size, hd))
        up = src.get(p + "mlp.up_proj.weight", (cfg.intermediate_size, hd))
        layers.append(LayerWeights(
            attn_norm=src.get(p + "input_layernorm.weight", (hd,)),
            qkv_t=torch.cat([q, k, v]).t(),
            bqkv=bqkv,
            o_t=src.get(p + "self_attn.o_proj.weight", (hd, q_rows)).t(),
            ffn_norm=src.get(p + "post_attention_layernorm.weight", (hd,)),
            ffn=DenseFFNWeights(gate_up_t=torch.cat([gate, up]).t(),
                                down_t=src.get(p + "mlp.down_proj.weight",
                                               (hd, cfg.intermediate_size)).t()),
        ))
    norm = src.get("model.norm.weight", (hd,))
    if cfg.tie_embeddings and not src.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = src.get("lm_head.weight", (cfg.vocab_size, hd))
    # Transposed views here; move_weights makes them contiguous [in, out].
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head_t=lm_head.t())


def weights_hash(files: list[Path], cache_dir: Path) -> bytes:
    """BLAKE2b-128 of the files' bytes, cached (keyed by name, size and mtime)."""
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    cache = cache_dir / HASH_CACHE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("files") == stamp:
            return bytes.fromhex(cached["blake2b"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    digest = h.digest()
    try:
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"files": stamp, "blake2b": digest.hex()}))
        os.replace(tmp, cache)
    except OSError:
        pass                     # a read-only model directory: hash again next time
    return digest


def load_model_dir(model_dir: str | Path, device: torch.device,
                   dtype: torch.dtype) -> LoadedModel:
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"{root}: not a directory")
    cfg = read_config(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors weight files")
    if not (root / "tokenizer.json").is_file():
        raise ModelLoadError(f"{root / 'tokenizer.json'}: missing")
    weights = _weights(cfg, _TensorSource(files))
    tokenizer = HFTokenizer(root, eos_ids=cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{root / 'tokenizer.json'}: {tokenizer.vocab_size} tokens but the "
                             f"model's vocab_size is {cfg.vocab_size}")
    return LoadedModel(cfg, move_weights(weights, device, dtype), tokenizer,
                       weights_hash(files, root))
