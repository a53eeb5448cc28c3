"""Import a Llama-architecture GGUF file into an HF-layout directory:
dequantized float32 safetensors, config.json, tokenizer.json (byte-level BPE
rebuilt from the GGUF vocabulary) and the GGUF's chat template.

llama.cpp's converter permutes the rows of Q and K so that RoPE pairs
adjacent elements (GPT-J style); HF Llama pairs the two halves of each head
("rotate_half"). ``_unpermute`` puts the rows back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTok
from tqdm import tqdm

from engine.errors import ModelLoadError

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_gpt2() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _pre_smollm() -> Any:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _pre_gpt2()])


def _pre_llama3() -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> the pre-tokenizer that splits text as llama.cpp does.
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "default": _pre_gpt2, "gpt2": _pre_gpt2, "smollm": _pre_smollm, "llama-bpe": _pre_llama3,
}
SUPPORTED_ARCHS = ("llama",)
# engine/fetch.py's IMPORT_VERSION is bumped when this module's output bytes change.
_TOKEN_CONTROL, _TOKEN_USER = 3, 4


@dataclass(frozen=True, slots=True)
class GGUFImport:
    out_dir: Path
    tensors: int
    params: int


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # w: [n_head * head_dim, in]; rows inside each head were interleaved as
    # (head_dim/2, 2) by llama.cpp; HF wants (2, head_dim/2).
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _hf_name(name: str) -> str | None:
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    sub = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if parts[2] not in sub:
        return None
    return f"model.layers.{parts[1]}.{sub[parts[2]]}.{parts[3]}"


def _tokenizer(reader: Any) -> tuple[HFTok, dict[str, Any]]:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' "
                             "byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; "
                             f"supported: {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = HFTok(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER)])
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", -1))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", -1))
    tcfg: dict[str, Any] = {
        "bos_token": tokens[bos] if bos >= 0 else None,
        "eos_token": tokens[eos] if eos >= 0 else None,
        "chat_template": _field(reader, "tokenizer.chat_template", ""),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, tcfg


def _config(reader: Any, vocab: int, tied: bool) -> dict[str, Any]:
    a = "llama"
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{a}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 2048)),
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
    }
    if f"{a}.rope.scaling.type" in reader.fields:
        raise ModelLoadError("GGUF rope scaling is not supported")
    return cfg


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *,
               progress: bool = True) -> GGUFImport:
    """Dequantize ``gguf_path`` into an HF-layout directory ``out_dir``."""
    import gguf

    src, out = Path(gguf_path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(str(src))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{src}: no such GGUF file") from exc
    except Exception as exc:
        raise ModelLoadError(f"{src}: not a readable GGUF file ({exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{src}: architecture {arch!r} is not supported; "
                             f"supported: {SUPPORTED_ARCHS}")
    tok, tcfg = _tokenizer(reader)
    names = {t.name for t in reader.tensors}
    vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    cfg = _config(reader, vocab, tied="output.weight" not in names)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"import {src.name}", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{src}: unexpected tensor {t.name!r}")
        # A copy: F32 tensors are read-only views of the memory-mapped file.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True, exist_ok=True)
    # One metadata key only: safetensors writes the metadata map in hash order,
    # and two keys made the file bytes (so the fingerprint) differ run to run.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    return GGUFImport(out, len(tensors), sum(t.numel() for t in tensors.values()))
