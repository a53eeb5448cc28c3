"""The byte tokenizer of the random-weight configs: ids past ``BYTE_VOCAB`` (the
shapes of real models, e.g. llama-8b-shape) decode to one visible letter each, so a
stream of generated tokens reaches clients as text; the tiny configs' text is as
before, and no text ever encodes to an id above the bytes."""

from __future__ import annotations

from engine.config import BYTE_VOCAB, ModelConfig
from engine.tokenizer import ByteTokenizer


def test_tiny_vocabulary_decodes_as_before() -> None:
    t = ByteTokenizer(BYTE_VOCAB)
    ids = [*"héllo".encode(), t.BOS, t.EOS, t.IM_START, 300, BYTE_VOCAB - 1]
    assert t.decode(ids) == "héllo"


def test_every_token_past_the_bytes_is_one_letter() -> None:
    vocab = ModelConfig.from_name("llama-8b-shape").vocab_size
    t = ByteTokenizer(vocab)
    ids = list(range(BYTE_VOCAB, vocab, 977))
    text = t.decode(ids)
    assert len(text) == len(ids) and text.isascii() and text.isalpha()
    # Incremental decoding (what decode streams) adds exactly one character a token.
    assert all(len(t.decode(ids[:n + 1])) == n + 1 for n in range(len(ids)))
    assert t.decode([104, 105, t.EOS, BYTE_VOCAB + 1]) == "hi" + t.decode([BYTE_VOCAB + 1])
    # Text never becomes those ids (nor the markers): encoding stays bytes.
    assert max(t.encode(text + "<|im_start|>")) < 256


def test_stable_prefix_never_changes_its_text() -> None:
    """``stable_prefix`` promises that the text of the ids before it never
    changes, whatever follows: checked on random mixes of ASCII, multi-byte
    characters cut anywhere, stray continuation and invalid bytes, markers and
    letter ids, against every continuation of a few bytes."""
    import random

    t = ByteTokenizer(BYTE_VOCAB + 50)
    rng = random.Random(7)
    pool = [*range(256), t.BOS, t.EOS, t.IM_END, 300, BYTE_VOCAB, BYTE_VOCAB + 49,
            *"é€😀".encode()]
    tails = [[], [0x80], [0xBF, 0x41], [0xE2, 0x82, 0xAC], [t.EOS, 0x9F], [0xF0, 0x9F]]
    checked = 0
    for _ in range(3000):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 9))]
        j = t.stable_prefix(ids)
        assert 0 <= j <= max(0, len(ids) - 1)
        for c in tails:
            assert t.decode(ids + c) == t.decode(ids[:j]) + t.decode(ids[j:] + c)
        checked += j > 0
    assert checked > 1000                   # most cut points are real ones, not 0
    assert t.stable_prefix([*b"ab", 0xE2, 0x82]) == 2     # before the cut character
