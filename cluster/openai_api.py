"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``: request models and their
translation into engine requests (the response shapes are in ``openai_responses``).

SGLang's extra request fields are accepted (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, no_stop_trim, stop_regex, regex, json_schema,
ebnf, response_format, priority, rid, extra_key / cache_salt; for chat, continue_final_message and
chat_template_kwargs, and vLLM's add_generation_prompt: see ``chat_prompt``). Unknown fields
are ignored, as OpenAI clients send a few this server has no use for (user, store, metadata).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from ..worker.sampling_params import SamplingParams
from .chat_prompt import chat_prompt_ids, check_strings
from .engine_protocol import GenerateRequest
from .api_errors import APIError, bad_request
from .generation import ServingContext, new_rid
from .parallel_sampling import expand_copies
from .request_checks import (cache_namespace, check_batch_size, check_lengths,
                             check_sampling_params, check_text, check_token_ids)
from .tool_calls import NamedToolChoice, Tool, ToolPlan, plan_tools

MAX_TOP_LOGPROBS = 20
MAX_COPIES = 128  # n and best_of, as SamplingParams.n
# OpenAI's chat roles ("function" is the deprecated form of "tool")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # with include_usage: usage on every chunk too


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    # "schema" would shadow a BaseModel attribute
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: SGLang's structures and triggers, or xgrammar's format
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: dict[str, Any] | None = None


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
    stop_regex: str | list[str] | None = None
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
    best_of: int | None = None  # candidates per prompt; the n most likely are returned
    suffix: str | None = None  # insert mode: only null or "" (the models have none)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[CHAT_ROLES]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    # an earlier reply's thinking (DeepSeek-R1's, Qwen3's field): templates that show or
    # strip it read it (vLLM and SGLang pass it on)
    reasoning_content: str | None = None
    function_call: Any = None  # OpenAI's deprecated form of tool_calls: a 400, never dropped


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per reply
    # how the template renders the messages (chat_prompt)
    continue_final_message: bool | None = False  # SGLang's: continue the final assistant message
    add_generation_prompt: bool | None = None  # vLLM's; None: true unless continuing
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    # OpenAI's deprecated forms of tools and tool_choice: a 400, never silently dropped
    functions: Any = None
    function_call: Any = None


# ---------------------------------------------------------------------------------------------
# Requests


def client_field_names(body: _SamplingFields) -> dict[str, str]:
    """SamplingParams name -> the field this request wrote, for the names in 400s."""
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
    if getattr(body, "max_completion_tokens", None) is not None:
        names["max_new_tokens"] = "max_completion_tokens"
    if body.response_format is not None and body.response_format.type != "text":
        names["json_schema"] = "response_format"  # the grammar came from there
        names["structural_tag"] = "response_format"
    return names


def sampling_params(body: _SamplingFields, max_new_tokens: int,
                    names: dict[str, str]) -> SamplingParams:
    """The SamplingParams a request asks for (OpenAI defaults: temperature 1, top_p 1);
    ``names`` as ``client_field_names``."""
    values = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": body.min_tokens, "n": body.n,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty, "repetition_penalty": body.repetition_penalty,
        "stop": body.stop, "stop_regex": body.stop_regex, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
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
        elif fmt.type == "structural_tag":
            values["structural_tag"] = json.dumps(fmt.model_dump(
                include={"type", "structures", "triggers", "format"}, exclude_none=True))
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema: required for type "
                              "json_schema", param="response_format")
        else:
            values["json_schema"] = json.dumps(fmt.json_schema.schema_)
    try:
        sp = SamplingParams.from_dict(values)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise bad_request(f"{names.get(name, name)}: {msg}", param=names.get(name, name))
    return sp


def check_model(model: str, ctx: ServingContext, model_path: str) -> None:
    """404 model_not_found unless ``model`` names the served model (or its path)."""
    check_text(model, "model")  # the 404 quotes it, and a lone surrogate cannot be sent back
    if model not in (ctx.model_name, model_path):
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{ctx.model_name}'", param="model", code="model_not_found",
                       err_type="NotFoundError")


def _engine_request(body: _SamplingFields, ctx: ServingContext, ids: list[int],
                    sp: SamplingParams, rid: str, logprob_start: int, top_n: int,
                    return_logprob: bool) -> GenerateRequest:
    return GenerateRequest(
        rid=rid, input_ids=ids, sampling_params=sp, return_logprob=return_logprob,
        logprob_start_len=logprob_start if return_logprob else -1,
        top_logprobs_num=top_n if return_logprob else 0, priority=body.priority or 0,
        extra_key=cache_namespace(body.extra_key, body.cache_salt))


def _check_request(body: _SamplingFields) -> None:
    """Checks both endpoints share, before any work."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed with stream true",
                          param="stream_options")
    if body.rid is not None:
        check_text(body.rid, "rid")  # it becomes the answer's id


def _check_max(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise bad_request(f"{name}: must be a non-negative integer", param=name)


class CompletionBatch(NamedTuple):
    """A /v1/completions request as engine requests: per prompt, the request filling its cache
    (used when it has several copies) and its copies, ``best_of`` of them when that is more
    than ``n`` (the answer keeps the ``n`` most likely)."""

    rid: str  # the response's id, whatever the number of prompts
    firsts: list[GenerateRequest]
    copies: list[list[GenerateRequest]]
    n: int


def _check_candidates(body: CompletionRequest, n: int) -> int:
    """How many copies of each prompt to generate: ``best_of`` if given, else ``n``."""
    if body.suffix:
        raise bad_request("suffix: not supported (the model has no insert mode)", param="suffix")
    if body.best_of is None or body.best_of == n:
        return n
    if body.best_of < n:
        raise bad_request(f"best_of: must be at least n ({n})", param="best_of")
    if body.best_of > MAX_COPIES:
        raise bad_request(f"best_of: must be at most {MAX_COPIES}", param="best_of")
    if body.stream:
        raise bad_request("best_of: cannot be combined with stream (the best are known only "
                          "at the end)", param="best_of")
    return body.best_of


def completion_requests(body: CompletionRequest, ctx: ServingContext) -> CompletionBatch:
    p = body.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise bad_request("prompt: the prompt is empty", param="prompt")
    check_batch_size(len(prompts), "prompt")
    _check_request(body)
    _check_max(body.max_tokens, "max_tokens")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    names = client_field_names(body)
    sp = sampling_params(body, max_tokens, names)
    check_sampling_params(sp, ctx.vocab_size, names)
    candidates = _check_candidates(body, sp.n)
    ranked = candidates > sp.n  # the answer ranks copies by their output logprobs
    base = body.rid or new_rid()
    firsts, copies = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):  # "" is BOS alone where the tokenizer adds one, as OpenAI
            check_text(prompt, "prompt")
            ids = ctx.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            check_token_ids(ids, ctx.vocab_size, "prompt")
        check_lengths(len(ids), max_tokens, ctx.context_len, "prompt", names["max_new_tokens"],
                      ctx.pool_tokens)
        rid = base if len(prompts) == 1 else f"{base}-{i}"
        start = 0 if body.echo else len(ids) - 1
        req = _engine_request(body, ctx, ids, sp, rid, start, body.logprobs or 0,
                              body.logprobs is not None or ranked)
        firsts.append(req)
        copies.append(expand_copies(req, candidates))
    return CompletionBatch(base, firsts, copies, sp.n)


def tool_plan(body, parser_name: str | None) -> ToolPlan:
    """What a ChatCompletionRequest's tools mean here; 400s name the field."""
    choice = body.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    for i, tool in enumerate(tools or []):
        check_strings(tool, f"tools[{i}]")  # before its schema reaches the grammar compiler
    try:
        plan = plan_tools(tools, choice.model_dump() if isinstance(choice, BaseModel) else choice,
                          parser_name)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).partition(":")[0]) from None
    if body.parallel_tool_calls is False:
        plan.max_calls = 1
    return plan


def _check_legacy_functions(body: ChatCompletionRequest) -> None:
    """OpenAI's deprecated function-calling fields are refused: ignored, the model would not
    see the functions (or an earlier call) and the client would wait for a function_call."""
    for name, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, name) is not None:
            raise bad_request(f"{name}: deprecated by OpenAI and not supported; use {new}",
                              param=name)
    for i, m in enumerate(body.messages):
        if m.function_call is not None:
            raise bad_request(f"messages[{i}].function_call: deprecated by OpenAI and not "
                              "supported; use tool_calls", param=f"messages[{i}].function_call")


def chat_requests(body: ChatCompletionRequest, ctx: ServingContext
                  ) -> tuple[GenerateRequest, list[GenerateRequest], ToolPlan]:
    _check_request(body)
    _check_legacy_functions(body)
    _check_max(body.max_tokens, "max_tokens")
    _check_max(body.max_completion_tokens, "max_completion_tokens")
    if body.top_logprobs is not None:
        if not body.logprobs:  # OpenAI's rule; ignoring it would return no logprobs at all
            raise bad_request("top_logprobs: requires logprobs true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]",
                              param="top_logprobs")
    plan = tool_plan(body, ctx.tool_call_parser)
    ids = chat_prompt_ids(body, ctx.tokenizer, plan.template_tools)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    max_tokens = max(ctx.context_len - len(ids), 0) if limit is None else limit
    names = client_field_names(body)
    sp = sampling_params(body, max_tokens, names)
    if plan.forced_ebnf is not None:
        if sp.constraint is not None:
            raise bad_request("tool_choice: a forced call cannot be combined with regex, "
                              "json_schema, ebnf or response_format", param="tool_choice")
        if sp.stop or sp.stop_regex or sp.stop_token_ids:
            # a stop inside the call's JSON would cut it to text
            raise bad_request("tool_choice: a forced call cannot be combined with stop, "
                              "stop_regex or stop_token_ids", param="tool_choice")
        sp = replace(sp, ebnf=plan.forced_ebnf)
    if plan.parser is not None:  # the parser reads the call tags, special tokens to some
        sp = replace(sp, skip_special_tokens=False)  # tokenizers (Hermes checkpoints)
    check_sampling_params(sp, ctx.vocab_size, names)
    check_lengths(len(ids), max_tokens, ctx.context_len, "messages", names["max_new_tokens"],
                  ctx.pool_tokens)
    req = _engine_request(body, ctx, ids, sp, body.rid or new_rid(), len(ids) - 1,
                          body.top_logprobs or 0, bool(body.logprobs))
    return req, expand_copies(req, sp.n), plan
