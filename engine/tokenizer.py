"""Tokenizers: an HF ``tokenizer.json`` (via the ``tokenizers`` library) with a
jinja2 chat template, and a byte-level tokenizer for random-weight configs."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTok

from engine.errors import EngineInputError, ModelLoadError

Messages = Sequence[dict[str, str]]


class Tokenizer(ABC):
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def apply_chat_template(self, messages: Messages,
                            add_generation_prompt: bool = True) -> list[int]: ...


def _check_messages(messages: Messages) -> None:
    if not messages:
        raise EngineInputError("chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EngineInputError(f"message {i} must be a dict with 'role' and 'content'")


def _raise(msg: str) -> None:
    raise EngineInputError(f"chat template: {msg}")


class HFTokenizer(Tokenizer):
    def __init__(self, model_dir: Path, eos_ids: Sequence[int] = ()) -> None:
        path = model_dir / "tokenizer.json"
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bos = _token_text(cfg.get("bos_token"))
        self._eos = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self._bos) if self._bos else None
        eos = set(eos_ids)
        if self._eos and self._tok.token_to_id(self._eos) is not None:
            eos.add(self._tok.token_to_id(self._eos))
        self.eos_token_ids = frozenset(eos)
        self._template: jinja2.Template | None = None
        source = cfg.get("chat_template")
        if source:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateError as exc:
                raise ModelLoadError(f"{model_dir}: bad chat template ({exc})") from exc

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Messages,
                            add_generation_prompt: bool = True) -> list[int]:
        _check_messages(messages)
        if self._template is None:
            raise EngineInputError("this model has no chat template; send a plain prompt")
        text = self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self._bos or "", eos_token=self._eos or "")
        return self.encode(text)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; then <bos>, <eos>, <|im_start|>, <|im_end|>."""

    BOS, EOS, IM_START, IM_END = 256, 257, 258, 259

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids = frozenset({self.EOS, self.IM_END})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages,
                            add_generation_prompt: bool = True) -> list[int]:
        _check_messages(messages)
        out: list[int] = []
        for m in messages:
            out += [self.IM_START, *self.encode(f"{m['role']}\n{m['content']}"), self.IM_END]
            out += self.encode("\n")
        if add_generation_prompt:
            out += [self.IM_START, *self.encode("assistant\n")]
        return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):
        return str(tok.get("content")) if tok.get("content") else None
    return str(tok) if tok else None
