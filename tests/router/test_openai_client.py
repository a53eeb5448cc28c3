"""The official ``openai`` client, unchanged, against a real stack serving the
real SmolLM2-135M-Instruct (tests/router/agent_stack.py): models, chat,
streaming chat, multi-turn, completions, cached_tokens on a repeat, and errors
raised as the SDK's own exception types."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.router.front_stack import RouterProc

MODEL = "smollm2"
# Long enough for several 64-token blocks, so a repeat restores some of them.
SYSTEM = ("You are a helpful geography tutor. Answer in one short sentence. "
          "Be precise, be polite, and never invent facts. " * 6).strip()


@pytest.fixture(scope="module")
def stack(agent_stack: RouterProc) -> RouterProc:
    """The package's SmolLM2 stack (tests/router/conftest.py), which the tools and
    Messages API tests share: the same processes ``kvserve up`` starts, with
    the same configuration; ``kvserve up`` itself is tests/kvserve's (test_up.py,
    test_first_run.py, and test_serve_tools.py's tools over HTTP)."""
    return agent_stack


@pytest.fixture(scope="module")
def client(stack: RouterProc) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()


def _ask(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_then_cached_repeat(client: openai.OpenAI) -> None:
    messages = _ask("What is the capital of France?")
    first = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    answer = first.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert first.choices[0].message.role == "assistant"
    assert first.usage is not None and first.usage.prompt_tokens > 128
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    second = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0 and cached % 64 == 0 and cached < second.usage.prompt_tokens
    # Restoring is lossless: the greedy answer does not change.
    assert second.choices[0].message.content == answer


def test_streaming_chat(client: openai.OpenAI) -> None:
    messages = _ask("What is the capital of Italy?")
    stream = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts: list[str] = []
    usage = None
    finish = None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    text = "".join(parts)
    assert "Rome" in text, text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1
    whole = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == text


def test_multi_turn(client: openai.OpenAI) -> None:
    messages = _ask("What is the capital of Germany?")
    first = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    reply = first.choices[0].message.content or ""
    assert "Berlin" in reply, reply
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And what is the capital of Spain?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
    assert "Madrid" in (second.choices[0].message.content or "")
    # The second turn starts with the first turn's prompt: its blocks are reused.
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 128


def test_agent_loop_with_zero_think_time_hits_the_previous_turn(client: openai.OpenAI) -> None:
    """Six turns, each sent the moment the previous answer ends: from turn 2
    cached_tokens is at least the hit rule on the previous prompt + output
    (decode stores those blocks before it finishes the answer)."""
    from common.config import HitRule

    rule = HitRule(block_tokens=64)               # SmolLM2: full attention, reserve 1
    messages = _ask("List three rivers of Europe.")
    prev_kv = 0                                   # tokens with KV: prompt + output - 1
    for turn in range(6):
        r = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=24, temperature=0,
                                           extra_headers={"X-KV-Class": "agent"})
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens or 0
        if turn:
            want = rule.usable_tokens(prev_kv, r.usage.prompt_tokens)
            assert want > 0 and cached >= want, (turn, cached, want)
        prev_kv = r.usage.prompt_tokens + r.usage.completion_tokens - 1
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"Tool result {turn}: ok. Next step?"}]


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=6, temperature=0)
    assert "Paris" in r.choices[0].text, r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
        stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_errors_are_sdk_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=_ask("hi"))  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL, messages=_ask("hi"),  # type: ignore[arg-type]
                                       max_tokens=10**9)
    assert br.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
