"""Tool calls: the request fields, the prompt rendering, the grammar that
enforces a call, and the parser that turns the model's output back into calls.

Format (Hermes / Qwen2.5, what vLLM's ``hermes`` parser reads): the tools are
listed as JSON inside ``<tools></tools>`` in the system message, and the model
answers a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(one block per call, blocks separated by a newline). SmolLM2's chat template
knows no tools, so the rendering happens here, into plain system/user/assistant
messages that then go through the model's own template and tokenizer (user
text, tool arguments and tool outputs stay text, never control tokens):
an assistant turn's calls are appended to its content as ``<tool_call>`` blocks,
and consecutive ``tool`` messages become one user turn of ``<tool_response>``
blocks, as Qwen2.5's template does.

``tool_choice``: ``none`` renders the tools but neither constrains nor parses;
``auto`` lets the model write text or calls, and a call it starts is held to the
tools' schemas by the grammar; ``required`` and a named function force calls
(constrained decoding), so even a 135M model always returns a valid call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.grammar import GrammarSpec
from router.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("auto", "none", "required", "function")
_SEPARATORS = (", ", ": ")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def listing(self) -> str:
        return json.dumps({"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.parameters}}, separators=_SEPARATORS, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str = "auto"            # one of TOOL_CHOICES
    name: str = ""                  # the function forced when choice == "function"
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.choice not in TOOL_CHOICES:
            raise ValueError(f"ToolSpec.choice {self.choice!r} not in {TOOL_CHOICES}")

    @property
    def parses(self) -> bool:
        return self.choice != "none"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str                  # JSON text of the arguments object

    @staticmethod
    def new_id(prefix: str = "call_") -> str:
        return prefix + uuid.uuid4().hex[:24]


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _obj(value: object, param: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{param} must be an object", param)
    return value


def _name(value: object, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 64 or not all(
            c.isalnum() or c in "_-" for c in value):
        raise _bad(f"{param} must be 1-64 characters of a-z, A-Z, 0-9, _ or -", param)
    return value


def make_tool(name: object, description: object, parameters: object, param: str) -> Tool:
    desc = "" if description is None else description
    if not isinstance(desc, str):
        raise _bad(f"{param}.description must be a string", f"{param}.description")
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    _obj(params, f"{param}.parameters")
    return Tool(_name(name, f"{param}.name"), desc, params)


def parse_openai_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise _bad("tools must be a non-empty list", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        t = _obj(t, p)
        if t.get("type") != "function":
            raise _bad(f"{p}.type must be 'function'", f"{p}.type")
        fn = _obj(t.get("function"), f"{p}.function")
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                               f"{p}.function"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    name = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad("tool_choice.type must be 'function'", "tool_choice.type")
        name = _name(_obj(choice.get("function"), "tool_choice.function").get("name"),
                     "tool_choice.function.name")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise _bad(f"tool_choice must be 'auto', 'none', 'required' or a function, got "
                   f"{choice!r}", "tool_choice")
    return checked_spec(tuple(tools), choice, name, parallel is not False, "tool_choice")


def checked_spec(tools: tuple[Tool, ...], choice: str, name: str, parallel: bool,
                 param: str) -> ToolSpec:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct names", "tools")
    if choice == "function" and name not in names:
        raise _bad(f"the forced function {name!r} is not among the tools {names}", param)
    return ToolSpec(tools, choice, name, parallel)


def parse_message_tool_calls(value: object, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (the history of an agent loop)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(f"{param} must be a list", param)
    out: list[ToolCall] = []
    for i, c in enumerate(value):
        p = f"{param}[{i}]"
        fn = _obj(_obj(c, p).get("function"), f"{p}.function")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise _bad(f"{p}.function.arguments must be a JSON string", f"{p}.function.arguments")
        out.append(ToolCall(str(c.get("id") or ToolCall.new_id()),
                            _name(fn.get("name"), f"{p}.function.name"), args))
    return tuple(out)


# -- rendering -----------------------------------------------------------------------

def system_block(tools: Sequence[Tool]) -> str:
    listing = "\n".join(t.listing() for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def call_text(name: str, arguments: str) -> str:
    try:
        args: object = json.loads(arguments)
    except ValueError:
        args = arguments             # a client's malformed history stays as it was
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": args},
                                    separators=_SEPARATORS, ensure_ascii=False) + f"\n{CLOSE}"


class Turn(Protocol):
    """A message as the fronts parse it (router.openai_schema.Message)."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...


def render(turns: Sequence[Turn], spec: ToolSpec | None) -> list[tuple[str, str]]:
    """(role, content) pairs for the chat template: tools in the system turn, calls in
    assistant turns, tool results as <tool_response> user turns."""
    out: list[tuple[str, str]] = []
    rest = list(turns)
    if spec is not None:
        block = system_block(spec.tools)
        if rest and rest[0].role == "system":
            out.append(("system", f"{rest[0].content}\n\n{block}" if rest[0].content
                        else block))
            rest = rest[1:]
        else:
            out.append(("system", block))
    for t in rest:
        if t.role == "tool":
            resp = f"<tool_response>\n{t.content}\n</tool_response>"
            if out and out[-1][0] == "user" and out[-1][1].startswith("<tool_response>"):
                out[-1] = ("user", f"{out[-1][1]}\n{resp}")
            else:
                out.append(("user", resp))
        elif t.role == "assistant" and t.tool_calls:
            calls = "\n".join(call_text(c.name, c.arguments) for c in t.tool_calls)
            out.append(("assistant", f"{t.content}\n{calls}" if t.content else calls))
        else:
            out.append((t.role, t.content))
    return out


# -- the grammar ----------------------------------------------------------------------

def _call_schema(tool: Tool) -> dict[str, Any]:
    params = dict(tool.parameters)
    # Only the properties the schema names: an unconstrained small model invents keys.
    params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar(spec: ToolSpec) -> GrammarSpec | None:
    """The Lark grammar (llguidance) a reply must match, or None for free text."""
    if spec.choice == "none":
        return None
    tools = [t for t in spec.tools if spec.choice != "function" or t.name == spec.name]
    body = (_call_schema(tools[0]) if len(tools) == 1
            else {"anyOf": [_call_schema(t) for t in tools]})
    body["x-guidance"] = {"whitespace_flexible": False, "item_separator": _SEPARATORS[0],
                          "key_separator": _SEPARATORS[1]}
    many = spec.parallel and spec.choice != "function"
    lines = [
        # auto: free text that does not start a call, or calls (a call begun is held
        # to the schemas); the others: calls only.
        "start: TEXT | calls" if spec.choice == "auto" else "start: calls",
        'calls: call ("\\n" call)*' if many else "calls: call",
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
        "body: %json " + json.dumps(body),
        r"TEXT: /[^<](.|\n)*/",
    ]
    return GrammarSpec("lark", "\n".join(lines))


# -- parsing the output -----------------------------------------------------------------

Piece = str | ToolCall


def _parse_call(body: str, names: frozenset[str], id_prefix: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(ToolCall.new_id(id_prefix), str(obj["name"]),
                    json.dumps(args, separators=_SEPARATORS, ensure_ascii=False))


@dataclass(slots=True)
class ToolStream:
    """Incremental parser: text in, text pieces and complete calls out. A tail that
    could begin ``<tool_call>`` is held back until decided; a block that does not
    parse as a call of a known tool is passed on as text."""

    spec: ToolSpec | None
    id_prefix: str = "call_"
    calls: int = 0
    _buf: str = ""
    _inside: bool = False
    _names: frozenset[str] = field(default=frozenset())

    def __post_init__(self) -> None:
        if self.spec is not None:
            self._names = frozenset(t.name for t in self.spec.tools)

    @property
    def active(self) -> bool:
        return self.spec is not None and self.spec.parses

    def feed(self, text: str) -> list[Piece]:
        if not self.active:
            return [text] if text else []
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._emit(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._emit(out, self._buf[:i])
                self._buf, self._inside = self._buf[i + len(OPEN):], True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return out
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(CLOSE):], False
                call = _parse_call(body, self._names, self.id_prefix)
                if call is None:
                    self._emit(out, OPEN + body + CLOSE)
                else:
                    self.calls += 1
                    out.append(call)

    def finish(self) -> list[Piece]:
        """The rest at the end of the output. An unfinished block (cut by max_tokens)
        stays text when it is all there is, and is dropped after complete calls."""
        out: list[Piece] = []
        if not (self._inside and self.calls):
            self._emit(out, (OPEN if self._inside else "") + self._buf)
        self._buf, self._inside = "", False
        return out

    def _emit(self, out: list[Piece], text: str) -> None:
        # Separators around calls are format, not content.
        if text and not (self.calls and not text.strip()):
            out.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_output(text: str, spec: ToolSpec | None, id_prefix: str = "call_"
                 ) -> tuple[str, tuple[ToolCall, ...]]:
    """A whole output as (content, calls); content is stripped around calls."""
    stream = ToolStream(spec, id_prefix)
    pieces = stream.feed(text) + stream.finish()
    calls = tuple(p for p in pieces if isinstance(p, ToolCall))
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content.strip() if calls else content), calls


def with_grammar(sampling: Any, spec: ToolSpec | None, response_format: GrammarSpec | None,
                 ) -> Any:
    """The request's sampling with the grammar the engine must enforce (tools or
    response_format; asking for both a forced call and a format is refused)."""
    tool_grammar = grammar(spec) if spec is not None else None
    if tool_grammar is not None and response_format is not None:
        raise _bad("response_format cannot be combined with tools unless tool_choice is "
                   "'none'", "response_format")
    chosen = tool_grammar or response_format
    return sampling if chosen is None else replace(sampling, grammar=chosen)
