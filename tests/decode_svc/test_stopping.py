"""Stop rules and streamed text: EOS, max_tokens, stop strings, held-back text."""

from __future__ import annotations

import pytest

from decode_svc.stopping import StopRule, StopState
from engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer(384)
EOS = ByteTokenizer.EOS


def _run(rule: StopRule, text: bytes | list[int]) -> tuple[str, str, list[str], int]:
    st = StopState(rule, TOK.decode)
    deltas = []
    for t in list(text):
        step = st.accept(t)
        deltas.append(step.text)
        if step.finished:
            return "".join(deltas), step.finish_reason, deltas, len(st.tokens)
    return "".join(deltas), "", deltas, len(st.tokens)


def test_max_tokens_gives_length() -> None:
    text, reason, _, n = _run(StopRule(max_tokens=5), b"hello world")
    assert (text, reason, n) == ("hello", "length", 5)


def test_eos_stops_and_is_not_text() -> None:
    rule = StopRule(max_tokens=50, eos_ids=frozenset({EOS}))
    text, reason, _, n = _run(rule, [*b"hi", EOS, *b"more"])
    assert (text, reason, n) == ("hi", "stop", 3)
    text, reason, _, n = _run(StopRule(max_tokens=4, eos_ids=frozenset({EOS}), ignore_eos=True),
                              [*b"hi", EOS, *b"more"])
    assert (text, reason, n) == ("him", "length", 4)


def test_stop_string_is_cut_and_never_shown() -> None:
    rule = StopRule(max_tokens=50, stop=("END",))
    text, reason, deltas, n = _run(rule, b"abc ENxEND tail")
    assert (text, reason) == ("abc ENx", "stop")
    assert n == len(b"abc ENxEND")
    assert all("END" not in d for d in deltas)
    # "EN" was held back while it could have been the start of "END", then released.
    assert deltas[4:7] == ["", "", "ENx"]


def test_multibyte_characters_are_never_split() -> None:
    text, reason, deltas, _ = _run(StopRule(max_tokens=50), "é€x".encode())
    assert "\ufffd" not in "".join(deltas)
    assert text == "é€x" and reason == ""


def test_rule_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        StopRule(max_tokens=0)
    with pytest.raises(ValueError, match="non-empty"):
        StopRule(max_tokens=1, stop=("",))
