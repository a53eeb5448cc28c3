"""Model and engine configuration: slotted dataclasses validated at construction.

``ModelConfig.from_name`` knows the random-weight shapes used by tests and GPU
benchmarks; ``ModelConfig.from_hf_config`` reads an HF ``config.json`` (Llama,
Mistral, Qwen2 families).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.config import HitRule
from engine.errors import ModelConfigError, ModelLoadError

ATTENTION_KINDS = ("full", "sliding")
KERNEL_NAMES = ("auto", "torch", "bik", "triton", "triton_bi")      # engine/kernels.py
DTYPES = ("float32", "bfloat16", "float16")
# Bumped whenever the block tensor layout or the prefill chunking changes: it is
# part of the fingerprint, so KV from an older layout can never be served.
KV_LAYOUT_VERSION = 1
# Tokens speculative decoding may unwind (docs/architecture.md#the-hit-rule); only SWA
# models reserve them.
SWA_BACKTRACK = 6


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Shared experts plus top-k routed experts with softmax gating."""

    n_experts: int = 8
    top_k: int = 2
    n_shared: int = 1
    expert_intermediate: int = 64

    def __post_init__(self) -> None:
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ModelConfigError(
                f"moe: need 1 <= top_k ({self.top_k}) <= n_experts ({self.n_experts})")
        if self.n_shared < 0 or self.expert_intermediate < 1:
            raise ModelConfigError("moe: n_shared must be >= 0 and expert_intermediate >= 1")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False                       # Qwen2 style q/k/v projection biases
    layer_types: tuple[str, ...] = ()            # per layer "full" | "sliding"; () = all full
    sliding_window: int = 0                      # keys a sliding layer sees, itself included
    moe: MoEConfig | None = None
    gpu_only: bool = False                       # too big to allocate on a CPU machine
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model {self.name}: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"model {self.name}: head_dim must be even for RoPE")
        types = self.layer_types or ("full",) * self.num_layers
        object.__setattr__(self, "layer_types", tuple(types))
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"model {self.name}: layer_types has {len(self.layer_types)} entries "
                f"for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(ATTENTION_KINDS))
        if bad:
            raise ModelConfigError(
                f"model {self.name}: unknown attention kind(s) {bad}; known: {ATTENTION_KINDS}")
        if "sliding" in self.layer_types and self.sliding_window < 1:
            raise ModelConfigError(
                f"model {self.name}: sliding layers need sliding_window >= 1")

    @property
    def has_sliding(self) -> bool:
        return "sliding" in self.layer_types

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: 0 for full attention, else the sliding window in tokens."""
        return tuple(self.sliding_window if t == "sliding" else 0 for t in self.layer_types)

    def hit_rule(self, block_tokens: int) -> HitRule:
        if not self.has_sliding:
            return HitRule(block_tokens=block_tokens)
        reserve = self.sliding_window + SWA_BACKTRACK
        return HitRule(block_tokens=block_tokens, window=self.sliding_window,
                       backtrack=SWA_BACKTRACK, replay_keep_tokens=reserve)

    def describe(self) -> str:
        """Stable text of every field: hashed into random-weight fingerprints."""
        return repr(self)

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        try:
            return _NAMED[name]
        except KeyError:
            raise ModelConfigError(
                f"unknown model config {name!r}; known: {sorted(_NAMED)} "
                "(or a path to an HF-layout directory)") from None

    @classmethod
    def from_hf_config(cls, data: dict[str, Any], name: str = "hf") -> ModelConfig:
        """From an HF config.json dict; raises KeyError/TypeError/ModelConfigError."""
        heads = int(data["num_attention_heads"])
        hidden = int(data["hidden_size"])
        layers = int(data["num_hidden_layers"])
        window = int(data.get("sliding_window") or 0)
        types = data.get("layer_types")
        if types is None:
            types = ["sliding" if window and data.get("use_sliding_window", True)
                     and data.get("model_type") == "mistral" else "full"] * layers
        types = tuple("sliding" if t in ("sliding", "sliding_attention") else
                      "full" if t in ("full", "full_attention") else t for t in types)
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        scaling = data.get("rope_scaling") or data.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelConfigError(f"rope scaling {rope_type!r} is not supported")
        theta = data.get("rope_theta", scaling.get("rope_theta", 10_000.0))
        return cls(
            name=name,
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_eps=float(data.get("rms_norm_eps", 1e-5)),
            max_position=int(data.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=bool(data.get("attention_bias", data.get("model_type") == "qwen2")),
            layer_types=types,
            sliding_window=window if "sliding" in types else 0,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


# Byte-level tokenizer ids used by the random-weight configs (engine.tokenizer).
BYTE_VOCAB = 384
_TINY = ModelConfig(
    name="tiny-dense", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=160,
    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, max_position=1024,
    bos_token_id=256, eos_token_ids=(257,),
)
_NAMED: dict[str, ModelConfig] = {
    "tiny-dense": _TINY,
    "tiny-hybrid": replace(
        _TINY, name="tiny-hybrid", qkv_bias=True, sliding_window=16,
        layer_types=("sliding", "full", "sliding", "sliding")),
    "tiny-moe": replace(
        _TINY, name="tiny-moe", tie_embeddings=False,
        moe=MoEConfig(n_experts=8, top_k=2, n_shared=1, expert_intermediate=64)),
    # SmolLM2-135M's exact shape with random weights: GPU benchmarks on a machine that
    # cannot fetch the real weights measure the same arithmetic.
    "smollm2-shape": ModelConfig(
        name="smollm2-shape", vocab_size=49_152, hidden_size=576, intermediate_size=1_536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100_000.0,
        max_position=8_192, tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    "llama-8b-shape": ModelConfig(
        name="llama-8b-shape", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
        max_position=32_768, tie_embeddings=False, gpu_only=True,
        bos_token_id=256, eos_token_ids=(257,)),
}


def named_configs() -> tuple[str, ...]:
    return tuple(_NAMED)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny-dense"       # a named config, "smollm2", or an HF-layout directory
    dtype: str = "float32"
    device: str = "cpu"
    block_tokens: int = 64
    num_blocks: int = 2048
    decode_bucket: int = 8          # decode rows per forward; fixed so batching is invariant
    seed: int = 0                   # random-weight configs only
    prefill_chunk: int = 0          # 0 = block_tokens; a multiple of it (docs/engine.md)
    max_position: int = 0           # 0 = the model's context; else override it (benchmarks)
    threads: int = 0                # > 0: torch.set_num_threads (process-wide) at start
    kernels: str = "auto"           # engine/kernels.py: auto | torch | bik | triton | triton_bi
    paged_decode: bool = True       # CUDA: one Triton paged-attention kernel per decode step
    cuda_graphs: bool = True        # CUDA: replay each decode bucket from a captured graph
    layer_restore: bool = True      # CUDA: copy restored blocks layer by layer under the compute
    # CUDA: the share of the device's memory this process's allocator may hold (0: no
    # cap). Two engine processes on one GPU each keep what they ever held in torch's
    # cache, so without an explicit split one's peak starves the other (issue 18 run 4).
    gpu_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ModelConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 1 <= self.block_tokens <= 4096:
            raise ModelConfigError(f"block_tokens must be in 1..4096, got {self.block_tokens}")
        if self.num_blocks < 2:
            raise ModelConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.decode_bucket < 1:
            raise ModelConfigError(f"decode_bucket must be >= 1, got {self.decode_bucket}")
        if self.kernels not in KERNEL_NAMES:
            raise ModelConfigError(f"kernels must be one of {KERNEL_NAMES}, got {self.kernels!r}")
        if self.max_position < 0 or self.threads < 0:
            raise ModelConfigError("max_position and threads must be >= 0")
        if not 0.0 <= self.gpu_fraction <= 1.0:
            raise ModelConfigError(f"gpu_fraction must be in 0..1 (0: no cap), got "
                                   f"{self.gpu_fraction}")
        if self.prefill_chunk < 0 or self.prefill_chunk % self.block_tokens:
            raise ModelConfigError(
                f"prefill_chunk ({self.prefill_chunk}) must be 0 or a multiple of "
                f"block_tokens ({self.block_tokens})")

    @property
    def chunk_tokens(self) -> int:
        return self.prefill_chunk or self.block_tokens


SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (not an HF-layout model directory)")
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    mtype = data.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {mtype!r} is not supported; supported: {SUPPORTED_TYPES}")
    try:
        return ModelConfig.from_hf_config(data, name=model_dir.name)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc}") from exc
    except (TypeError, ValueError, ModelConfigError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
