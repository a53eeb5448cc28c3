"""Constrained decoding and logit processing in the engine, on the real SmolLM2:
grammars hold (JSON schema, regex, Lark), masks are per row (batch invariance
with co-tenants), a decode-side adopt replays the prefill token into the
matcher, penalties and logit_bias change exactly what they should."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import Engine, SamplingParams
from engine.constrained import GrammarSpec
from engine.errors import EngineInputError
from tests.engine.conftest import make_engine

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(smollm2_dir: str) -> Engine:
    return make_engine(smollm2_dir, num_blocks=256, decode_bucket=4)


def _chat(eng: Engine, text: str) -> list[int]:
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _json(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens,
                          grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))


def test_json_schema_output_validates(smol: Engine) -> None:
    free = smol.generate(_chat(smol, "Describe a cat named Tom, age 3, as JSON."),
                         SamplingParams(max_tokens=12))
    assert not free.text.startswith("{"), free.text   # unconstrained it writes prose/markdown
    res = smol.generate(_chat(smol, "Describe a cat named Tom, age 3, as JSON."), _json())
    jsonschema.validate(json.loads(res.text), SCHEMA)
    assert res.finish_reason == "stop"                # the grammar ends in EOS


def test_regex_and_lark(smol: Engine) -> None:
    prompt = _chat(smol, "Is the sky blue?")
    res = smol.generate(prompt, SamplingParams(max_tokens=8,
                                               grammar=GrammarSpec("regex", "(yes|no)[.!]")))
    assert re.fullmatch("(yes|no)[.!]", res.text), res.text
    lark = 'start: "Answer: " ANSWER\nANSWER: /[0-9]{1,3}/'
    res = smol.generate(_chat(smol, "What is 2+2?"),
                        SamplingParams(max_tokens=10, grammar=GrammarSpec("lark", lark)))
    assert re.fullmatch(r"Answer: [0-9]{1,3}", res.text), res.text


def test_bad_grammars_are_input_errors(smol: Engine) -> None:
    with pytest.raises(EngineInputError, match="regex"):
        smol.generate([1, 2, 3], SamplingParams(grammar=GrammarSpec("regex", "[a-")))
    with pytest.raises(EngineInputError, match="not one of"):
        GrammarSpec("xml", "<a/>")
    with pytest.raises(EngineInputError, match="not valid JSON"):
        GrammarSpec("json_schema", "{nope")
    assert smol.live_sequences == []                  # nothing leaked


def test_mask_is_per_row_batch_invariant(smol: Engine) -> None:
    """A constrained row's tokens are the same alone and beside co-tenants, and an
    unconstrained co-tenant's tokens are the same with or without it."""
    prompts = [_chat(smol, f"Describe person number {i} as JSON.") for i in range(3)]
    alone = [smol.generate(p, _json(24)).tokens for p in prompts[:2]]
    plain_alone = smol.generate(prompts[2], SamplingParams(max_tokens=24)).tokens
    params = [_json(24), _json(24), SamplingParams(max_tokens=24)]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        smol.prefill(f"b{i}", p, sampling=sp)
    ids = [f"b{i}" for i in range(3)]
    try:
        while any(smol.finish_reason(s) is None for s in ids):
            smol.decode_step([s for s in ids if smol.finish_reason(s) is None])
        got = [smol.seq_tokens(s)[len(p):] for s, p in zip(ids, prompts, strict=True)]
    finally:
        for s in ids:
            smol.free(s)
    assert got[:2] == alone
    assert got[2] == plain_alone


def test_adopt_replays_the_first_token_into_the_matcher(smol: Engine) -> None:
    """Decode adopts KV plus prefill's first token; the grammar goes on from there."""
    prompt = _chat(smol, "Describe a dog named Rex, age 5, as JSON.")
    whole = smol.generate(prompt, _json())
    pre = smol.prefill("p", prompt, sampling=_json())
    kv = smol.export_tokens("p", 0, len(prompt))
    smol.free("p")
    smol.adopt("d", prompt, kv, pre.first_token, _json())
    try:
        while smol.finish_reason("d") is None:
            smol.decode_step(["d"])
        assert smol.completion_text("d") == whole.text
    finally:
        smol.free("d")


def test_penalties_and_logit_bias(smol: Engine) -> None:
    prompt = _chat(smol, "Repeat the word cat many times.")
    base = smol.generate(prompt, SamplingParams(max_tokens=16))
    the = smol.tokenizer.encode(" dog")[0]
    biased = smol.generate(prompt, SamplingParams(max_tokens=4, logit_bias=((the, 100.0),)))
    assert biased.tokens == [the] * 4
    pen = smol.generate(prompt, SamplingParams(max_tokens=16, frequency_penalty=2.0,
                                               presence_penalty=2.0))
    # A repeated token is penalised: the penalised run repeats less.
    def repeats(t: list[int]) -> int:
        return len(t) - len(set(t))
    assert repeats(pen.tokens) < repeats(base.tokens), (base.text, pen.text)
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        smol.generate(prompt, SamplingParams(logit_bias=((10**6, 1.0),)))
    with pytest.raises(EngineInputError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)


def test_logits_processing_reads_only_its_row(smol: Engine) -> None:
    """RowSampler.process returns a new tensor: the batch logits are untouched."""
    from engine.sampling import RowSampler

    logits = torch.randn(2, smol.model_config.vocab_size)
    before = logits.clone()
    s = RowSampler.create(SamplingParams(logit_bias=((5, 50.0),), presence_penalty=1.0),
                          smol.model_config.vocab_size)
    s.accept(7)
    out = s.process(logits[0])
    assert torch.equal(logits, before)
    assert out[5] == before[0, 5] + 50.0 and out[7] == before[0, 7] - 1.0
