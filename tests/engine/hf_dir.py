"""Write a random-weight engine's weights as an HF-layout directory, so loader
tests and the transformers oracle can run on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine import Engine
from engine.weights import DenseFFNWeights


def _byte_tokenizer(vocab_size: int) -> Tokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_hf_dir(engine: Engine, out: Path, model_type: str = "llama") -> Path:
    cfg, w = engine.model_config, engine.model.w
    d, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed,
                                        "model.norm.weight": w.norm}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = w.lm_head_t.t()
    for i, ly in enumerate(w.layers):
        p = f"model.layers.{i}."
        assert isinstance(ly.ffn, DenseFFNWeights)
        wq, wk, wv = ly.qkv_t.t().split([q, kv, kv])
        gate, up = ly.ffn.gate_up_t.t().chunk(2)
        tensors.update({
            p + "input_layernorm.weight": ly.attn_norm,
            p + "post_attention_layernorm.weight": ly.ffn_norm,
            p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
            p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": ly.o_t.t(),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": ly.ffn.down_t.t(),
        })
        if ly.bqkv is not None:
            bq, bk, bv = ly.bqkv.split([q, kv, kv])
            tensors.update({p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                            p + "self_attn.v_proj.bias": bv})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    config = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": d, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": cfg.qkv_bias, "torch_dtype": "float32",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
    }
    (out / "config.json").write_text(json.dumps(config))
    _byte_tokenizer(cfg.vocab_size).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<extra_257>"}))
    return out
