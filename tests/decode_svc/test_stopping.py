"""Streamed text: held back while it could still become a stop string or ends
in half a character, released when decided."""

from __future__ import annotations

from decode_svc.stopping import TextStream


def _feed(stream: TextStream, texts: list[str], final: str) -> list[str]:
    out = [stream.delta(t, False) for t in texts]
    out.append(stream.delta(final, True))
    return out


def test_a_possible_stop_string_is_held_back_then_released() -> None:
    deltas = _feed(TextStream(("END",)), ["abc", "abc E", "abc EN", "abc ENx"], "abc ENxy")
    assert deltas == ["abc", " ", "", "ENx", "y"]
    assert "".join(deltas) == "abc ENxy"


def test_the_engine_cut_text_is_shown_whole_at_the_end() -> None:
    # The engine's completion_text is cut before the stop string when it stops.
    deltas = _feed(TextStream(("END",)), ["ab", "ab E", "ab EN"], "ab ")
    assert "".join(deltas) == "ab " and all("E" not in d for d in deltas)


def test_half_characters_wait_for_the_rest() -> None:
    deltas = _feed(TextStream(), ["x", "x\ufffd", "xé"], "xé!")
    assert deltas == ["x", "", "é", "!"]


def test_several_stop_strings_hold_the_longest_match() -> None:
    s = TextStream(("<|end|>", "\n\n"))
    assert s.delta("hi <|e", False) == "hi "
    assert s.delta("hi <|e\n", False) == "<|e"       # no longer "<|end|>"; "\n" may start "\n\n"
    assert s.delta("hi <|e\nok", False) == "\nok"
