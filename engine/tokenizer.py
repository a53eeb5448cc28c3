"""Tokenizers: an HF ``tokenizer.json`` (via the ``tokenizers`` library) with a
jinja2 chat template, and a byte-level tokenizer for random-weight configs.

Control tokens are text unless the text is trusted: ``encode`` treats
control-token strings (``<|im_start|>``...) as plain text by default, and
``apply_chat_template`` makes only the template's own markers special tokens
(engine.control_text says how). ``encode(text, special=True)`` is for text a
trusted caller built itself (a benchmark's hand-made turns).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTok

from engine.config import BYTE_VOCAB
from engine.control_text import ControlStrings, Piece, new_nonce
from engine.encode_memo import MemoView
from engine.errors import EngineInputError, ModelLoadError

Messages = Sequence[Mapping[str, Any]]


class Tokenizer(ABC):
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    vocab_size: int
    # Most UTF-8 bytes one token of plain text can stand for (None: no bound known,
    # e.g. a normalizer that may drop characters). len(text) / this <= tokens.
    max_token_bytes: int | None = None

    @abstractmethod
    def encode(self, text: str, *, special: bool = False) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True, *,
                            memo: MemoView | None = None, **template_kwargs: Any) -> list[int]:
        """``memo``: segments encoded before for this scope (engine/encode_memo.py),
        used where the tokenizer can cut at its markers and ignored elsewhere."""

    def stable_prefix(self, ids: Sequence[int]) -> int:
        """A length j <= len(ids) such that for every continuation c,
        ``decode(ids + c) == decode(ids[:j]) + decode(ids[j:] + c)``: the text
        of the first j ids never changes again, so a caller may keep it and
        decode only what follows. 0 (the default): no such promise."""
        return 0

    def min_tokens(self, n_chars: int) -> int:
        """A lower bound on the tokens of ``n_chars`` characters of plain text
        (each character is at least one UTF-8 byte): a cheap too-long check."""
        return n_chars // self.max_token_bytes if self.max_token_bytes else 0


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
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
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
            # HF's tojson (transformers' chat templates): no HTML escaping, no \uXXXX.
            env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "sort_keys": False}
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateError as exc:
                raise ModelLoadError(f"{model_dir}: bad chat template ({exc})") from exc
        self._controls, self._plain_ids = self._control_strings()
        self._markers, self._marker_ids = self._segmentable()
        vocab = self._tok.get_vocab(with_added_tokens=False)
        self.max_token_bytes = (max((len(t.encode()) for t in vocab), default=1)
                                if self._tok.normalizer is None else None)

    def _control_strings(self) -> tuple[ControlStrings, dict[str, list[int]]]:
        """Every added token's text, and its encoding as plain text (by a copy of
        the tokenizer that has no added tokens)."""
        added = self._tok.get_added_tokens_decoder()
        controls = ControlStrings(a.content for a in added.values())
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        plain = _HFTok.from_str(json.dumps(spec))
        ids: dict[str, list[int]] = {}
        for s in controls.strings:
            got = plain.encode(s, add_special_tokens=False).ids
            if set(got) & set(added):
                # The plain vocabulary can still form the token: spell it character by
                # character (no single character is a control string of several).
                got = [i for ch in s for i in plain.encode(ch, add_special_tokens=False).ids]
            ids[s] = got
        return controls, ids

    def _segmentable(self) -> tuple[re.Pattern[str] | None, dict[str, int]]:
        """The added tokens as one pattern when the tokenizer matches them as exact
        strings and encodes the text between them on its own (no normalizer, no
        lstrip/rstrip/single_word): then ``encode(a + marker + b)`` is ``encode(a) +
        [marker] + encode(b)``, and a segment's ids can be remembered (encode_memo)."""
        added = self._tok.get_added_tokens_decoder()
        if self._tok.normalizer is not None or not added or any(
                a.lstrip or a.rstrip or a.single_word for a in added.values()):
            return None, {}
        ids = {a.content: i for i, a in added.items()}
        # Longest first: the alternation then takes the longest marker at a position,
        # as the tokenizer's own leftmost-longest match does.
        alternatives = sorted(ids, key=len, reverse=True)
        return re.compile("|".join(re.escape(a) for a in alternatives)), ids

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        if special or not self._controls:
            return self._encode_pieces([Piece(text, False)])
        nonce = new_nonce()
        return self._encode_pieces(self._controls.split(self._controls.neutralise(text, nonce),
                                                        nonce))

    def _encode_pieces(self, pieces: Sequence[Piece], memo: MemoView | None = None) -> list[int]:
        if memo is not None and self._markers is not None and memo.memo.cfg.max_chars:
            return self._encode_remembered(pieces, memo)
        # encode_batch releases the GIL (encode does not: 8 MB of text held it ~16 s);
        # its _fast form (tokenizers >= 0.21) also skips the character offsets nobody
        # here reads: the same ids in 0.55-0.8x the time (a 1,493-token prompt: 4.6
        # against 5.6 ms, on every request's path).
        texts = [p.text for p in pieces if not p.control]
        encoded = iter(self._encode_batch(texts, add_special_tokens=False)) if texts else None
        out: list[int] = []
        for p in pieces:
            if p.control:
                out += self._plain_ids[p.text]
            else:
                assert encoded is not None
                out += next(encoded).ids
        return out

    def _encode_remembered(self, pieces: Sequence[Piece], view: MemoView) -> list[int]:
        """``_encode_pieces`` cut further at the markers, each long segment looked up
        in the memo first; what is not there is encoded in one call and remembered."""
        assert self._markers is not None
        parts: list[list[int] | str] = []
        for p in pieces:
            if p.control:
                parts.append(self._plain_ids[p.text])
                continue
            pos = 0
            for m in self._markers.finditer(p.text):
                if m.start() > pos:
                    parts.append(p.text[pos:m.start()])
                parts.append([self._marker_ids[m.group()]])
                pos = m.end()
            if pos < len(p.text):
                parts.append(p.text[pos:])
        memo, scope = view.memo, view.scope
        todo: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                got = memo.get(scope, part) if memo.wants(part) else None
                if got is None:
                    todo.append(i)
                else:
                    parts[i] = got
        if todo:
            texts = [str(parts[i]) for i in todo]
            for i, text, enc in zip(todo, texts, self._encode_batch(
                    texts, add_special_tokens=False), strict=True):
                memo.put(scope, text, enc.ids)
                parts[i] = enc.ids
        return [t for part in parts for t in part]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def tokenizer_json(self) -> str:
        """The HF tokenizer as JSON text (what grammar compilers read: engine.constrained)."""
        return str(self._tok.to_str())

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True, *,
                            memo: MemoView | None = None, **template_kwargs: Any) -> list[int]:
        """Render and encode; every string the caller passes in (message fields at
        any depth, tools, other template variables) is untrusted text. ``memo``:
        the caller's segments seen before (engine/encode_memo.py)."""
        _check_messages(messages)
        if self._template is None:
            raise EngineInputError("this model has no chat template; send a plain prompt")
        nonce = new_nonce()
        safe = self._controls.neutralise
        try:
            text = self._template.render(
                **{k: safe(v, nonce) for k, v in template_kwargs.items()},
                messages=safe(list(messages), nonce),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos or "", eos_token=self._eos or "")
        except jinja2.TemplateError as exc:
            raise EngineInputError(f"chat template failed: {exc}") from exc
        return self._encode_pieces(self._controls.split(text, nonce), memo)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; then <bos>, <eos>, <|im_start|>, <|im_end|>.

    Shape-only configs (random weights at a real model's shape, e.g. llama-8b-shape)
    have vocabularies far past the ids that mean anything here. Those from
    ``BYTE_VOCAB`` on decode to one ASCII letter each: without text, a stream of
    them would reach clients as nothing at all, and the peers' benchmark tools time
    tokens by the text they carry (a first content chunk is their TTFT). The tiny
    configs' vocabulary ends at ``BYTE_VOCAB``, so their text is unchanged."""

    BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
    _LETTERS = b"abcdefghijklmnopqrstuvwxyz"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids = frozenset({self.EOS, self.IM_END})

    max_token_bytes = 1

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        # Bytes only: no text can ever become one of the ids above 255.
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i >= BYTE_VOCAB:
                out.append(self._LETTERS[i % len(self._LETTERS)])
        return out.decode("utf-8", errors="replace")

    def stable_prefix(self, ids: Sequence[int]) -> int:
        """Up to the last id that starts a character: each id is one byte (or
        none), and UTF-8 decoding, replacement included, restarts at every
        byte that is not a continuation byte (0x80-0xBF)."""
        for j in range(len(ids) - 1, -1, -1):
            i = ids[j]
            if i >= BYTE_VOCAB or 0 <= i < 0x80 or 0xC0 <= i < 256:
                return j
        return 0

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True, *,
                            memo: MemoView | None = None, **template_kwargs: Any) -> list[int]:
        _check_messages(messages)
        out: list[int] = []
        for m in messages:
            out += [self.IM_START, *self.encode(f"{m['role']}\n{m['content']}"), self.IM_END]
            out += self.encode("\n")
        if add_generation_prompt:
            out += [self.IM_START, *self.encode("assistant\n")]
        return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


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
