"""Remembered chat segments (engine/encode_memo.py) with SmolLM2's real
tokenizer: a conversation encoded through the memo, the first time and when
it comes back with more turns, gives exactly the ids of encoding it whole;
a tenant never hits another tenant's segments; the memo stays in its bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.encode_memo import EncodeMemo, EncodeMemoConfig
from engine.tokenizer import HFTokenizer

WORDS = ("alpha", "beta", "  spaced ", "12345", "x9y8", "é café", "日本語", "\n\n", "\t",
         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_start", "im_end|>",
         "<repo_name><reponame>", "!?", "' s", "  ")


@pytest.fixture(scope="module")
def tok(smollm2_dir: str) -> HFTokenizer:
    return HFTokenizer(Path(smollm2_dir))


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(("", " ", "\n")) for _ in range(n))


def _conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": _text(rng, 60)}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": _text(rng, rng.randint(0, 120))},
                 {"role": "assistant", "content": _text(rng, rng.randint(1, 80))}]
    return [*msgs, {"role": "user", "content": _text(rng, 90)}]


def test_the_tokenizer_can_be_cut_at_its_markers(tok: HFTokenizer) -> None:
    assert tok._markers is not None
    assert tok._marker_ids["<|im_start|>"] == tok._tok.token_to_id("<|im_start|>")


def test_remembered_segments_give_the_ids_of_the_whole(tok: HFTokenizer) -> None:
    rng = random.Random(7)
    memo = EncodeMemo(EncodeMemoConfig(min_chars=16))
    for trial in range(12):
        msgs = _conversation(rng, trial % 4)
        want = tok.apply_chat_template(msgs)
        assert tok.apply_chat_template(msgs, memo=memo.for_scope("t")) == want   # misses
        hits = memo.hits
        assert tok.apply_chat_template(msgs, memo=memo.for_scope("t")) == want   # hits
        assert memo.hits > hits
        # The same conversation back with an answer and a new message: its earlier
        # segments come from the memo, and the ids are still those of the whole.
        more = [*msgs, {"role": "assistant", "content": _text(rng, 40)},
                {"role": "user", "content": _text(rng, 50)}]
        hits = memo.hits
        assert tok.apply_chat_template(more, memo=memo.for_scope("t")) == \
            tok.apply_chat_template(more)
        assert memo.hits > hits


def test_a_tenant_never_hits_another_tenants_segments(tok: HFTokenizer) -> None:
    memo = EncodeMemo(EncodeMemoConfig(min_chars=16))
    msgs = [{"role": "user", "content": "a private note that is long enough " * 4}]
    tok.apply_chat_template(msgs, memo=memo.for_scope("acme"))
    hits = memo.hits
    assert tok.apply_chat_template(msgs, memo=memo.for_scope("globex")) == \
        tok.apply_chat_template(msgs)
    assert memo.hits == hits
    tok.apply_chat_template(msgs, memo=memo.for_scope("acme"))
    assert memo.hits > hits


def test_the_memo_stays_within_its_characters(tok: HFTokenizer) -> None:
    memo = EncodeMemo(EncodeMemoConfig(max_chars=600, min_chars=16))
    rng = random.Random(3)
    for i in range(20):
        msgs = [{"role": "user", "content": f"{i} " + _text(rng, 30)}]
        assert tok.apply_chat_template(msgs, memo=memo.for_scope("t")) == \
            tok.apply_chat_template(msgs)
        assert memo.chars <= 600
    assert memo.chars > 0
    off = EncodeMemo(EncodeMemoConfig(max_chars=0))
    tok.apply_chat_template(msgs, memo=off.for_scope("t"))
    assert off.chars == 0 and off.hits == 0 and off.misses == 0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        EncodeMemoConfig(max_chars=-1)
    with pytest.raises(ValueError, match="min_chars"):
        EncodeMemoConfig(min_chars=0)
