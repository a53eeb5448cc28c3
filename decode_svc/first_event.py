"""The first token's event, sent before the prompt's KV is here.

Prefill already sampled the first token (it travels in the handle), so its
event does not need the KV: only whether the sequence goes on after it and
its text. Both follow the engine's rules (``Engine.finish_reason`` /
``Engine.completion_text``) for a sequence that has generated one token;
where the first token might end the sequence (EOS, a stop string,
``max_tokens`` 1, a prompt at the context limit) there is no early event and
the usual path decides. Sending it early takes the KV pull and the adopt off
the time to first token (docs/services.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EarlyFirst:
    token: int
    text: str                       # the completion text after this one token


def early_first(engine: Any, prompt_tokens: int, first_token: int,
                sampling: Any) -> EarlyFirst | None:
    """The first token's outcome when it cannot end the sequence, else None."""
    tok = engine.tokenizer
    if sampling.max_tokens <= 1 or prompt_tokens >= engine.model_config.max_position:
        return None
    if not sampling.ignore_eos and first_token in tok.eos_token_ids:
        return None
    text = tok.decode([first_token])
    if any(s in text for s in sampling.stop):
        return None
    return EarlyFirst(first_token, text)
