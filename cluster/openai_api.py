"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``: request models, their
translation into engine requests, and the response / stream-chunk shapes.

SGLang's extra request fields are accepted (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, no_stop_trim, regex, json_schema, ebnf,
response_format, priority, rid, extra_key / cache_salt). Unknown fields are ignored, as OpenAI
clients send a few this server has no use for (user, store, metadata).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..worker.sampling_params import SamplingParams
from .detokenizer import token_texts
from .engine_protocol import GenerateRequest
from .generation import (APIError, RequestState, ServingContext, bad_request, expand_copies,
                         new_rid)
from .request_checks import check_lengths, check_sampling_params, check_text, check_token_ids
from .tool_calls import NamedToolChoice, Tool, ToolPlan, plan_tools, template_message

# SamplingParams name -> the OpenAI field a client wrote
RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    # "schema" would shadow a BaseModel attribute
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    priority: int | None = None
    rid: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the parsers return every call


# ---------------------------------------------------------------------------------------------
# Requests


def sampling_params(body: _SamplingFields, max_new_tokens: int) -> SamplingParams:
    """The SamplingParams a request asks for (OpenAI defaults: temperature 1, top_p 1)."""
    values = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": body.min_tokens, "n": body.n,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty, "repetition_penalty": body.repetition_penalty,
        "stop": body.stop, "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens, "no_stop_trim": body.no_stop_trim,
        "seed": body.seed, "logit_bias": body.logit_bias, "regex": body.regex,
        "json_schema": body.json_schema, "ebnf": body.ebnf,
    }
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if body.json_schema is not None:
            raise bad_request("response_format: give either response_format or json_schema",
                              param="response_format")
        if fmt.type == "json_object":
            values["json_schema"] = '{"type": "object"}'
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema: required for type "
                              "json_schema", param="response_format")
        else:
            values["json_schema"] = json.dumps(fmt.json_schema.schema_)
    try:
        sp = SamplingParams.from_dict(values)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise bad_request(f"{RENAME.get(name, name)}: {msg}", param=RENAME.get(name, name))
    return sp


def check_model(body: _SamplingFields, ctx: ServingContext, model_path: str) -> None:
    """404 model_not_found unless the request names the served model (or its path)."""
    if body.model not in (ctx.model_name, model_path):
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{ctx.model_name}'", param="model", code="model_not_found",
                       err_type="NotFoundError")


def _engine_request(body: _SamplingFields, ctx: ServingContext, ids: list[int],
                    sp: SamplingParams, rid: str, logprob_start: int, top_n: int,
                    return_logprob: bool) -> GenerateRequest:
    return GenerateRequest(
        rid=rid, input_ids=ids, sampling_params=sp, return_logprob=return_logprob,
        logprob_start_len=logprob_start if return_logprob else -1,
        top_logprobs_num=top_n if return_logprob else 0, priority=body.priority or 0,
        extra_key=body.extra_key or body.cache_salt)


def _check_max(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise bad_request(f"{name}: must be a non-negative integer", param=name)


def completion_requests(body: CompletionRequest, ctx: ServingContext
                        ) -> tuple[list[GenerateRequest], list[list[GenerateRequest]]]:
    """Per prompt: the request filling its cache (used when n > 1) and its n copies."""
    p = body.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise bad_request("prompt: the prompt is empty", param="prompt")
    _check_max(body.max_tokens, "max_tokens")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    sp = sampling_params(body, max_tokens)
    check_sampling_params(sp, ctx.vocab_size, RENAME)
    base = body.rid or new_rid()
    firsts, copies = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if prompt == "":
                raise bad_request("prompt: the prompt is empty", param="prompt")
            check_text(prompt, "prompt")
            ids = ctx.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            check_token_ids(ids, ctx.vocab_size, "prompt")
        check_lengths(len(ids), max_tokens, ctx.context_len, "prompt", "max_tokens")
        rid = base if len(prompts) == 1 else f"{base}-{i}"
        start = 0 if body.echo else len(ids) - 1
        req = _engine_request(body, ctx, ids, sp, rid, start, body.logprobs or 0,
                              body.logprobs is not None)
        firsts.append(req)
        copies.append(expand_copies(req, sp.n))
    return firsts, copies


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer,
                    tools: list[dict] | None = None) -> list[int]:
    """Apply the tokenizer's chat template (it adds any BOS itself), showing it ``tools``, and
    tokenize."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  param="messages")
            content = "".join(part.text for part in content)
        check_text(m.role, f"messages[{i}].role")
        check_text(content or "", f"messages[{i}].content")
        messages.append(template_message(m, content or ""))
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja raises on roles or orders the template rejects
        raise bad_request(f"messages: the chat template rejected them ({e})",
                          param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def tool_plan(body, parser_name: str | None) -> ToolPlan:
    """What a ChatCompletionRequest's tools mean here; 400s name the field."""
    choice = body.tool_choice
    try:
        return plan_tools([t.model_dump(exclude_none=True) for t in body.tools] if body.tools
                          else None,
                          choice.model_dump() if isinstance(choice, BaseModel) else choice,
                          parser_name)
    except ValueError as e:
        name = str(e).partition(":")[0]
        raise bad_request(str(e), param=name.split(".")[0].split("[")[0]) from None


def chat_requests(body: ChatCompletionRequest, ctx: ServingContext
                  ) -> tuple[GenerateRequest, list[GenerateRequest], ToolPlan]:
    plan = tool_plan(body, ctx.tool_call_parser)
    ids = chat_prompt_ids(body, ctx.tokenizer, plan.template_tools)
    _check_max(body.max_tokens, "max_tokens")
    _check_max(body.max_completion_tokens, "max_completion_tokens")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]",
                          param="top_logprobs")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    max_tokens = max(ctx.context_len - len(ids), 0) if limit is None else limit
    sp = sampling_params(body, max_tokens)
    if plan.forced_ebnf is not None:
        if sp.regex is not None or sp.json_schema is not None or sp.ebnf is not None:
            raise bad_request("tool_choice: a forced call cannot be combined with regex, "
                              "json_schema, ebnf or response_format", param="tool_choice")
        sp = replace(sp, ebnf=plan.forced_ebnf)
    check_sampling_params(sp, ctx.vocab_size, RENAME)
    check_lengths(len(ids), max_tokens, ctx.context_len, "messages", "max_tokens")
    req = _engine_request(body, ctx, ids, sp, body.rid or new_rid(), len(ids) - 1,
                          body.top_logprobs or 0, bool(body.logprobs))
    return req, expand_copies(req, sp.n), plan


# ---------------------------------------------------------------------------------------------
# Responses


def usage(states: list[RequestState], n: int) -> dict:
    """Prompt tokens once per prompt (every n-th state); completion and cached tokens summed."""
    prompt = sum(s.prompt_tokens or len(s.req.input_ids) for s in states[::n])
    completion = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)}}


def finish_fields(state: RequestState) -> dict:
    reason = state.finish_reason if state.finished else None
    return {"finish_reason": None if reason is None else reason.get("type"),
            "matched_stop": None if reason is None else reason.get("matched")}


def completion_logprobs(pairs, tops, tokenizer, offset: int) -> dict:
    """OpenAI's legacy logprobs object for the (logprob, id) pairs; text offsets start at
    ``offset`` (the length of the text before these tokens) and advance by each token's
    visible text: a special token such as the prompt's BOS is listed by name but is in neither
    the echoed prompt nor the output text."""
    ids = [t for _, t in pairs]
    texts = token_texts(tokenizer, ids)
    offsets = []
    for visible in (tokenizer.decode([t], skip_special_tokens=True) for t in ids):
        offsets.append(offset)
        offset += len(visible)
    top = []
    for row in tops or [None] * len(pairs):
        if row is None:
            top.append(None)
        else:
            names = token_texts(tokenizer, [t for _, t in row])
            top.append({name: lp for name, (lp, _) in zip(names, row)})
    return {"tokens": texts, "token_logprobs": [lp for lp, _ in pairs],
            "top_logprobs": top if tops is not None else None, "text_offset": offsets}


def chat_logprobs(pairs, tops, tokenizer) -> dict:
    texts = token_texts(tokenizer, [t for _, t in pairs])
    content = []
    for k, (text, (lp, _)) in enumerate(zip(texts, pairs)):
        row = tops[k] if tops and k < len(tops) and tops[k] else []
        names = token_texts(tokenizer, [t for _, t in row])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": nm, "logprob": tlp, "bytes": list(nm.encode())}
                                         for nm, (tlp, _) in zip(names, row)]})
    return {"content": content}


def completion_choice(index: int, state: RequestState, body: CompletionRequest, tokenizer,
                      prompt_text: str) -> dict:
    text = state.text
    logprobs = None
    if body.logprobs is not None:
        want_top = body.logprobs > 0
        pairs, tops, offset = state.output_token_logprobs, state.output_top_logprobs, 0
        if body.echo:
            inputs = state.input_token_logprobs or []
            pairs = list(inputs) + list(pairs)
            tops = list(state.input_top_logprobs or [None] * len(inputs)) + list(tops)
        logprobs = completion_logprobs(pairs, tops if want_top else None, tokenizer, offset)
    if body.echo:
        text = prompt_text + text
    return {"index": index, "text": text, "logprobs": logprobs, **finish_fields(state)}


def chat_choice(index: int, state: RequestState, body: ChatCompletionRequest, tokenizer,
                plan: ToolPlan) -> dict:
    logprobs = None
    if body.logprobs:
        logprobs = chat_logprobs(state.output_token_logprobs, state.output_top_logprobs,
                                 tokenizer)
    message = {"role": "assistant", "content": state.text}
    fields = finish_fields(state)
    if plan.parser is not None:
        content, calls = plan.parser.parse(state.text, plan.names)
        if calls:
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [c.to_openai() for c in calls]}
            fields = tool_finish_fields(state)
    return {"index": index, "message": message, "logprobs": logprobs, **fields}


def tool_finish_fields(state: RequestState) -> dict:
    """A reply that ended in calls finishes with "tool_calls" (unless cut by a limit)."""
    fields = finish_fields(state)
    if fields["finish_reason"] == "stop":
        fields = {**fields, "finish_reason": "tool_calls"}
    return fields


def envelope(kind: str, rid: str, model: str, choices: list[dict], usage_: dict | None) -> dict:
    """kind: text_completion | chat.completion | chat.completion.chunk."""
    prefix = "cmpl-" if kind == "text_completion" else "chatcmpl-"
    out = {"id": prefix + rid, "object": kind, "created": int(time.time()), "model": model,
           "choices": choices}
    if usage_ is not None or not kind.endswith("chunk"):
        out["usage"] = usage_
    return out
