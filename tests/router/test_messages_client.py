"""The official ``anthropic`` client against a real stack serving SmolLM2-135M
(tests/router/agent_stack.py)
through ``POST /v1/messages``: a message, streaming events, a tool_use /
tool_result round trip, stop sequences, usage reporting cache reads on a
repeat, and errors in Anthropic's shape (raised as the SDK's own types)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.router.front_stack import RouterProc, http

MODEL = "smollm2"
# Long enough for several 64-token blocks, so a repeat restores some of them.
SYSTEM = ("You are a helpful geography tutor. Answer in one short sentence. "
          "Be precise, be polite, and never invent facts. " * 6).strip()
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def stack(agent_stack: RouterProc) -> RouterProc:
    return agent_stack


@pytest.fixture(scope="module")
def client(stack: RouterProc) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def test_message_then_cached_repeat(client: anthropic.Anthropic) -> None:
    kw = {"model": MODEL, "system": SYSTEM, "max_tokens": 16, "extra_body": {"temperature": 0.0},
          "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    first = client.messages.create(**kw)  # type: ignore[arg-type]
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].type == "text" and "Paris" in first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.input_tokens > 128 and first.usage.output_tokens >= 1
    second = client.messages.create(**kw)  # type: ignore[arg-type]
    cached = second.usage.cache_read_input_tokens or 0
    assert cached > 0 and cached % 64 == 0
    # input_tokens counts what was not read from the cache, as Anthropic reports it.
    assert second.usage.input_tokens + cached == first.usage.input_tokens
    assert second.content[0].text == first.content[0].text    # type: ignore[union-attr]


def test_streaming_events(client: anthropic.Anthropic) -> None:
    kinds: list[str] = []
    with client.messages.stream(model=MODEL, system=SYSTEM, max_tokens=16,
                                extra_body={"temperature": 0.0}, messages=[{"role": "user",
                                           "content": "What is the capital of Italy?"}]) as s:
        for ev in s:
            kinds.append(ev.type)
        text = s.get_final_text()
        final = s.get_final_message()
    assert "Rome" in text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for k in ("content_block_start", "content_block_delta", "content_block_stop",
              "message_delta"):
        assert k in kinds
    assert final.usage.output_tokens >= 1 and final.usage.input_tokens > 0


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0.0},
                                   tools=[WEATHER],  # type: ignore[list-item]
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   messages=messages)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("city"), str)
    assert uses[0].id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": "sunny, 24 C"}]}]
    second = client.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0},
                                    tools=[WEATHER], tool_choice={"type": "none"},  # type: ignore[list-item]
                                    messages=messages)  # type: ignore[arg-type]
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and second.content[0].type == "text"
    # The history grew (input_tokens counts only what was not read from the cache).
    def prompt(u: anthropic.types.Usage) -> int:
        return u.input_tokens + (u.cache_read_input_tokens or 0)
    assert prompt(second.usage) > prompt(first.usage)


def test_streamed_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=40, tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0.0},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.name == "get_weather" and "city" in use.input  # type: ignore[operator]


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0},
                               stop_sequences=["Paris"],
                               messages=[{"role": "user",
                                          "content": "What is the capital of France?"}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    assert "Paris" not in r.content[0].text  # type: ignore[union-attr]


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, stack: RouterProc) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, extra_body={"top_k": 5},
                               messages=[{"role": "user", "content": "hi"}])
    r = http("POST", stack.http + "/v1/messages", {"model": MODEL, "messages": []})
    assert r.status == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
