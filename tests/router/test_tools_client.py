"""The official ``openai`` client against a real stack serving SmolLM2-135M
(tests/router/agent_stack.py):
tool calls (auto, required, a named function, parallel, streamed as
``delta.tool_calls``, a full round trip with the tool's answer in the
history), ``response_format`` json_schema validated with ``jsonschema`` over
20 prompts, regex/grammar extensions, sampling fields reaching the engine, and
400s that name the field for what is refused."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.tokenizer import HFTokenizer
from tests.router.front_stack import RouterProc, http

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 16}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(agent_stack: RouterProc) -> RouterProc:
    return agent_stack


@pytest.fixture(scope="module")
def client(stack: RouterProc) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _round_trip(client: openai.OpenAI, tool_choice: object, question: str) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": question}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=tool_choice,  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])    # type: ignore[index]
    assert calls[0].id.startswith("call_")
    # The tool's answer goes back in the history; the model answers in text.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id,
                  "content": json.dumps({"city": args["city"], "weather": "sunny, 24 C"})}]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type]
        max_tokens=24, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_tool_round_trip_required(client: openai.OpenAI) -> None:
    # Forced by the grammar: the 135M model would answer this one in prose.
    _round_trip(client, "required", "What is the weather in Paris right now?")


def test_tool_round_trip_auto(client: openai.OpenAI) -> None:
    # The model's own choice: told to, it opens a <tool_call> and the grammar holds
    # the call it began to the tool's schema.
    _round_trip(client, "auto",
                "Respond only with a <tool_call> block that calls get_weather for Paris.")


def test_auto_may_answer_in_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_user("Say hello."),  # type: ignore[arg-type]
                                       tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_named_function_and_parallel_calls(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=_user("What is the weather in Rome?"), tools=[WEATHER, TIME],  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40,
        temperature=0)
    calls = named.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    # Parallel calls parse into several tool_calls, each with its own id.
    both = client.chat.completions.create(
        model=MODEL, messages=_user("Weather and time in Rome, then in Oslo?"),  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=90, temperature=0)
    calls = both.choices[0].message.tool_calls or []
    assert len(calls) >= 1 and len({c.id for c in calls}) == len(calls)
    assert {c.function.name for c in calls} <= {"get_weather", "get_time"}
    one = client.chat.completions.create(
        model=MODEL, messages=_user("Weather and time in Rome, then in Oslo?"),  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        max_tokens=90, temperature=0)
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=_user("What is the weather in Paris?"), tools=[WEATHER],  # type: ignore[arg-type]
        tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0,
        stream=True)
    deltas = []
    finish = None
    text = ""
    for chunk in stream:
        d = chunk.choices[0].delta
        text += d.content or ""
        deltas += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert "<tool_call>" not in text
    assert deltas and deltas[0].index == 0 and deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert "city" in json.loads(args)


def test_json_schema_validates_for_20_prompts(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    people = ["Ada", "Bob", "Chen", "Dora", "Emil", "Fatima", "Goro", "Hana", "Ivan", "Jon",
              "Kofi", "Lea", "Mika", "Nia", "Omar", "Pia", "Quinn", "Ravi", "Sara", "Tomas"]

    def ask(i: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model=MODEL, messages=_user(f"{people[i]} is {20 + i} and lives in Lyon. As JSON."),  # type: ignore[arg-type]
            response_format=fmt, max_tokens=48, temperature=0)  # type: ignore[arg-type]
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    # Concurrent: the decode instance batches them (and each row keeps its own mask).
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(ask, range(len(people))))
    for content, finish in answers:
        jsonschema.validate(json.loads(content), PERSON)
        assert finish == "stop", content
    assert len({c for c, _ in answers}) > 1


def test_json_object_regex_and_grammar(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=_user("Give the JSON object for: x is 1, y is 2."),  # type: ignore[arg-type]
        response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    content = r.choices[0].message.content or ""
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":      # else cut by max_tokens, mid-object
        assert isinstance(json.loads(content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=_user("Is water wet?"), max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"response_format": {"type": "regex", "regex": "(Yes|No), [a-z]+\\."}})
    assert re.fullmatch(r"(Yes|No), [a-z]+\.", r.choices[0].message.content or "")
    r = client.chat.completions.create(
        model=MODEL, messages=_user("Pick a colour."), max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"response_format": {"type": "grammar",
                                        "grammar": 'start: "red" | "green" | "blue"'}})
    assert r.choices[0].message.content in ("red", "green", "blue")


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, smollm2_dir: str) -> None:
    dog = HFTokenizer(Path(smollm2_dir)).encode(" dog")[0]
    r = client.chat.completions.create(model=MODEL, messages=_user("Name an animal."),  # type: ignore[arg-type]
                                       logit_bias={str(dog): 100}, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == " dog dog dog"
    kw = {"model": MODEL, "messages": _user("Write a poem."), "max_tokens": 12,
          "temperature": 1.0, "seed": 7}
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    base = client.chat.completions.create(model=MODEL, messages=_user("Say cat cat cat."),  # type: ignore[arg-type]
                                          max_tokens=12, temperature=0)
    pen = client.chat.completions.create(model=MODEL, messages=_user("Say cat cat cat."),  # type: ignore[arg-type]
                                         max_tokens=12, temperature=0, frequency_penalty=2.0,
                                         presence_penalty=2.0)
    assert pen.choices[0].message.content != base.choices[0].message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "regex", "regex": ""}}, "response_format.regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"logit_bias": {"cat": 1}}, "logit_bias.cat"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"response_format": {"type": "regex", "regex": "[a-"}}, "response_format"),
    ({"response_format": {"type": "grammar", "grammar": "start: foo"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools"),
])
def test_refusals_name_the_field(stack: RouterProc, extra: dict[str, object], param: str) -> None:
    body = {"model": MODEL, "messages": _user("hi"), "max_tokens": 2, **extra}
    r = http("POST", stack.http + "/v1/chat/completions", body)
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param
