"""OpenAI tool calling for /v1/chat/completions.

The request's ``tools`` go to the chat template, which tells the model how to call them; what
the model writes back is parsed into ``tool_calls`` by the parser the server was started with
(``--tool-call-parser``), one per model family's format:

- ``qwen25`` (alias ``hermes``): Qwen2/2.5/3 and Hermes models write each call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after any plain text.
- ``llama3``: Llama 3.1+ writes a call as the whole reply, ``{"name": ..., "parameters":
  {...}}`` (several separated by ``;``), optionally after ``<|python_tag|>``.

``tool_choice``: ``auto`` (default) lets the model choose; ``none`` hides the tools; ``required``
or ``{"type": "function", "function": {"name": ...}}`` constrain decoding (xgrammar) to one
call in the parser's format, of one of the allowed tools, with arguments that satisfy its
``parameters`` schema. A call that names no offered tool, or whose JSON does not parse, stays
plain text. ``parallel_tool_calls: false`` keeps only the first call of a reply.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name,  # the model's characters, not \u escapes
                             "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def _call(obj, names: set[str], args_key: str) -> ToolCall | None:
    """A ToolCall from a decoded JSON object, or None if it is not a call of an offered tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


class ToolCallParser:
    """One model family's tool-call format. ``parse`` splits a finished reply into content and
    calls; ``content_end`` says how much of a reply still being streamed is surely content;
    ``forced_grammar`` is the EBNF of exactly one call, for tool_choice required / named."""

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict]) -> str:
        raise NotImplementedError


def _forced(prefix: str, tools: list[dict], args_key: str, suffix: str) -> str:
    """EBNF of ``prefix``, one call object of any of ``tools``, ``suffix``."""
    # imported here: `radixray serve --help` reads PARSERS, and xgrammar loads torch (seconds)
    from ..scheduler.grammar import wrapped_json_schema_ebnf

    return wrapped_json_schema_ebnf(prefix, _call_schema(tools, args_key), suffix)


def _call_schema(tools: list[dict], args_key: str) -> str:
    """JSON schema of one call object of any of ``tools`` (OpenAI tool dicts). Each tool's
    ``parameters`` goes under ``$defs`` with its references rebased there: a ``#/$defs/Item``
    of its own (as Pydantic writes them) would otherwise point into this wrapper."""
    defs, cases = {}, []
    for i, tool in enumerate(tools):
        home = f"#/$defs/tool{i}"
        defs[f"tool{i}"] = _rebase_refs(tool["function"].get("parameters") or ANY_OBJECT, home)
        cases.append({"type": "object", "required": ["name", args_key],
                      "properties": {"name": {"const": tool["function"]["name"]},
                                     args_key: {"$ref": home}}})
    return json.dumps({**(cases[0] if len(cases) == 1 else {"anyOf": cases}), "$defs": defs})


def _rebase_refs(node, home: str):
    """``node`` with each local ``$ref`` (``#...``) made relative to ``home`` instead."""
    if isinstance(node, list):
        return [_rebase_refs(v, home) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: home + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _rebase_refs(v, home) for k, v in node.items()}


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def _blocks(self, text: str):
        """(start, end, decoded JSON or None) of each ``<tool_call>`` block. The JSON is read
        by a decoder, not up to the first end tag: a string argument may hold "</tool_call>"."""
        decoder, pos = json.JSONDecoder(), 0
        while (start := text.find(self.START, pos)) >= 0:
            inner, obj, end = start + len(self.START), None, -1
            try:
                obj, after = decoder.raw_decode(text, _skip_space(text, inner))
                after = _skip_space(text, after)
                if text.startswith(self.END, after):
                    end = after + len(self.END)
            except (ValueError, RecursionError):  # not JSON, or nested too deep
                pass
            if end < 0:  # no JSON object right up to an end tag: not a call; skip the block
                obj, close = None, text.find(self.END, inner)
                if close < 0:
                    return
                end = close + len(self.END)
            yield start, end, obj
            pos = end

    def parse(self, text, names):
        """Content is the text around the calls: before the first (as streamed, leading
        newlines included), and any text after or between them, including blocks that are
        not calls of offered tools."""
        calls, pieces, pos = [], [], 0
        for start, end, obj in self._blocks(text):
            call = _call(obj, names, "arguments")
            if call is not None:
                calls.append(call)
                pieces.append(text[pos:start])
                pos = end
        if not calls:
            return text, []
        rest = [p.strip() for p in pieces[1:] + [text[pos:]]]
        return "\n".join(p for p in [pieces[0].rstrip(), *rest] if p), calls

    def content_end(self, text):
        start = text.find(self.START)
        if start < 0:  # a call may be starting at the end
            start = len(text) - next((k for k in range(len(self.START) - 1, 0, -1)
                                      if text.endswith(self.START[:k])), 0)
        return len(text[:start].rstrip())  # whitespace may turn out to precede a call

    def forced_grammar(self, tools):
        return _forced(self.START + "\n", tools, "arguments", "\n" + self.END)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def parse(self, text, names):
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # not JSON, or nested too deep
                return text, []
            call = _call(obj, names, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return ("", calls) if calls else (text, [])

    def content_end(self, text):
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[:len(self.TAG)]):
            return 0  # the reply may be a call: it is decided when it ends
        return len(text)

    def forced_grammar(self, tools):
        return _forced("", tools, "parameters", "")


PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen25": HermesParser, "hermes": HermesParser, "llama3": Llama3JsonParser}


class ToolStream:
    """Turns a streamed reply (its cumulative released text) into content deltas, and at the
    end into either the rest of the content or the tool calls."""

    def __init__(self, parser: ToolCallParser, names: set[str], max_calls: int | None = None):
        self.parser, self.names, self.max_calls = parser, names, max_calls
        self.sent = 0  # characters of content sent

    def update(self, text: str) -> str:
        """The content delta that is safe to send now (may be "")."""
        end = max(self.parser.content_end(text), self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply ended: (the content not sent yet, the calls)."""
        content, calls = self.parser.parse(text, self.names)
        rest = content[self.sent:] if content.startswith(text[:self.sent]) else ""
        self.sent = len(content)
        return rest, calls[:self.max_calls]


# --------------------------------------------------------------------------------- requests

class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionName


def template_message(m, content: str) -> dict:
    """A ChatMessage as chat templates take it: an earlier call's arguments as a dict (OpenAI
    sends a JSON string; templates write them out with ``tojson``)."""
    message = {"role": m.role, "content": content}
    if m.tool_calls:
        message["tool_calls"] = [_parsed_arguments(call) for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    if getattr(m, "reasoning_content", None) is not None:
        message["reasoning_content"] = m.reasoning_content
    return message


def _parsed_arguments(call: dict) -> dict:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function,
                                         "arguments": json.loads(function["arguments"])}}
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            pass  # left as the client wrote it
    return call


# --------------------------------------------------------------------------------- planning

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass
class ToolPlan:
    """What a chat request's tools mean for this server."""
    template_tools: list[dict] | None = None  # for the chat template; None: no tools shown
    parser: ToolCallParser | None = None  # None: the reply is plain content
    names: frozenset[str] = frozenset()
    forced_ebnf: str | None = None  # tool_choice required / named: the one call to decode
    max_calls: int | None = None  # 1 with parallel_tool_calls false: later calls are dropped

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished reply's content and calls (``parser`` must be set)."""
        content, calls = self.parser.parse(text, self.names)
        return content, calls[:self.max_calls]


def plan_tools(tools: list[dict] | None, tool_choice, parser_name: str | None) -> ToolPlan:
    """Check ``tools`` (OpenAI tool dicts) and ``tool_choice`` ("none", "auto", "required" or
    a named-function dict); raises ValueError("<field>: <problem>") for a 400."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: give tools to choose from")
        return ToolPlan()
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name: must be 1-64 letters, digits, _ or -")
        schema_type = (tools[i]["function"].get("parameters") or ANY_OBJECT).get("type")
        if schema_type not in (None, "object"):  # a call's arguments are a JSON object
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema of an "
                             f"object (type \"object\"), got type {schema_type!r}")
    if len(set(names)) < len(names):
        raise ValueError("tools: function names must be unique")
    if tool_choice == "none":
        return ToolPlan()
    parser = PARSERS[parser_name]() if parser_name else None
    plan = ToolPlan(tools, parser, frozenset(names))
    if tool_choice in (None, "auto"):
        return plan
    if parser is None:
        raise ValueError("tool_choice: forcing a call needs a server started with "
                         "--tool-call-parser")
    chosen = tools
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == wanted]
        if not chosen:
            raise ValueError(f"tool_choice.function.name: {wanted!r} is not among the tools")
    from ..scheduler.grammar import validate_grammar  # lazily, as in _forced

    try:
        plan.forced_ebnf = parser.forced_grammar(chosen)
        validate_grammar("ebnf", plan.forced_ebnf)  # a 400 naming tools, not ebnf
    except ValueError as e:
        raise ValueError(f"tools: a function's parameters are not a usable JSON schema "
                         f"({e})") from None
    return plan
