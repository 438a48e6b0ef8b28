"""A /v1/chat/completions request's prompt: its messages (and tools) rendered by the
tokenizer's chat template, then tokenized.

Besides OpenAI's fields this reads SGLang's ``continue_final_message`` (the reply continues the
final assistant message instead of starting a new one: an assistant prefill) and
``chat_template_kwargs`` (extra template variables, such as ``enable_thinking``), and vLLM's
``add_generation_prompt`` (default true; SGLang always adds it).

Every string the template may show is checked for lone UTF-16 surrogates first: JSON may escape
one ("\\ud800") and json.loads keeps it, but the tokenizer cannot encode it. Each is named by
its path (``tools[0].function.description``), so the 400 points at the field.
"""

from __future__ import annotations

import inspect
import re
import uuid
from functools import lru_cache

from .api_errors import APIError, bad_request
from .request_checks import check_text
from .tool_calls import template_message

# What a role becomes for a chat template that does not name it
TEMPLATE_ROLE_FALLBACKS = {"developer": "system", "function": "tool"}


def chat_prompt_ids(body, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """``body`` (a ChatCompletionRequest) as prompt token ids: the chat template (which adds
    any BOS itself) shows it ``tools`` (checked as the request's by openai_api.tool_plan);
    400s name the field at fault."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    if not tokenizer.chat_template:
        raise bad_request("messages: this model's tokenizer has no chat template; use "
                          "/v1/completions or /generate with a prompt", param="messages")
    add_generation_prompt, continue_final = generation_mode(body)
    kwargs = template_kwargs(body.chat_template_kwargs, tokenizer)
    messages = template_messages(body, tokenizer.chat_template)
    try:
        if continue_final:
            text = render_continuing(tokenizer, messages, tools, kwargs)
        else:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
    except APIError:  # render_continuing's own 400
        raise
    except Exception as e:  # jinja raises on roles or orders the template rejects
        raise bad_request(f"messages: the chat template rejected them ({e})",
                          param="messages") from None
    # Every input was checked above; this catches what a template variable of its own (a
    # special token's text) might add, so the tokenizer never sees text it cannot encode.
    check_text(text, "messages")
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, UnicodeError) as e:
        raise bad_request(f"messages: the rendered prompt cannot be tokenized ({e})",
                          param="messages") from None



def generation_mode(body) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) for the template; 400s for
    combinations that cannot both hold."""
    continue_final = bool(body.continue_final_message)
    if not continue_final:
        return body.add_generation_prompt is not False, False
    if body.add_generation_prompt:
        raise bad_request("continue_final_message: cannot be combined with "
                          "add_generation_prompt true (the reply would start a new message "
                          "instead of continuing the final one)", param="continue_final_message")
    if body.messages[-1].role != "assistant":
        raise bad_request(f"continue_final_message: the final message must be an assistant "
                          f"message to continue (it is {body.messages[-1].role!r})",
                          param="continue_final_message")
    return False, True


def template_messages(body, template) -> list[dict]:
    """The messages as chat templates take them, each string checked (a 400 naming it)."""
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  param=f"messages[{i}].content")
            content = "".join(part.text for part in content)
        check_text(content or "", f"messages[{i}].content")
        for j, call in enumerate(m.tool_calls or []):
            _check_earlier_call(call, f"messages[{i}].tool_calls[{j}]")
        message = template_message(m, content or "")
        # after template_message: a call's arguments, a JSON string, are parsed there, and
        # may escape a surrogate ("\\ud800") that only parsing reveals
        for name in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            check_strings(message.get(name), f"messages[{i}].{name}")
        message["role"] = template_role(m.role, template)
        messages.append(message)
    return messages


def render_continuing(tokenizer, messages: list[dict], tools, kwargs: dict) -> str:
    """The template's rendering of ``messages``, cut right after the final message's content,
    so that the reply continues it. A marker appended to that content finds where the template
    wrote it (after whatever it put around the message), and nothing after it is kept. Done
    here rather than with transformers' own ``continue_final_message``, whose cut differs
    between versions (older ones search for the content's text, which fails for "")."""
    marker = f"<radixray-continue-{uuid.uuid4().hex}>"
    # The marker goes before the content's trailing whitespace: a template that trims the
    # content (Llama 3's, Gemma's) then drops that whitespace as transformers' cut does
    content = messages[-1]["content"]
    kept = content.rstrip()
    tail = content[len(kept):]
    final = {**messages[-1], "content": kept + marker + tail}
    text = tokenizer.apply_chat_template([*messages[:-1], final], tools=tools, tokenize=False,
                                         add_generation_prompt=False, **kwargs)
    at = text.rfind(marker)
    if at < 0:
        raise bad_request("continue_final_message: the chat template does not write the final "
                          "message's content, so it cannot be continued",
                          param="continue_final_message")
    return text[:at] + (tail if text.startswith(tail, at + len(marker)) else "")


def template_kwargs(kwargs: dict | None, tokenizer) -> dict:
    """``chat_template_kwargs`` as template variables. A name that apply_chat_template takes
    itself (``tokenize``, ``chat_template``, ...) would change how the prompt is built, not
    what the template sees: a 400."""
    if not kwargs:
        return {}
    check_strings(kwargs, "chat_template_kwargs")
    taken = _call_parameters(type(tokenizer))
    for key in kwargs:
        if key in taken:
            raise bad_request(f"chat_template_kwargs: {key!r} is an argument of the template "
                              f"call, not a template variable", param="chat_template_kwargs")
    return dict(kwargs)


@lru_cache(maxsize=8)
def _call_parameters(tokenizer_type: type) -> frozenset[str]:
    """apply_chat_template's named parameters, and the names it renders the template with."""
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind is not p.VAR_KEYWORD) | {"messages", "conversations"}


def _check_earlier_call(call: dict, path: str) -> None:
    """An assistant's earlier call as OpenAI writes it: a function object with a string name
    and its arguments as a JSON string (or an object); the template failed on anything else
    with an error that named no field, or rendered it silently wrong."""
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{path}.function: must be an object with name and arguments",
                          param=f"{path}.function")
    if not isinstance(function.get("name"), str):
        raise bad_request(f"{path}.function.name: must be a string",
                          param=f"{path}.function.name")
    if not isinstance(function.get("arguments", "{}"), (str, dict)):
        raise bad_request(f"{path}.function.arguments: must be a JSON string",
                          param=f"{path}.function.arguments")


def check_strings(value, path: str) -> None:
    """check_text on every string inside a JSON value (keys included), naming the first bad
    one by its path. Iterative: a body nested as deep as the JSON parser allows must not
    overflow the stack here."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            check_text(node, where)
        elif isinstance(node, dict):
            for key, child in reversed(node.items()):
                check_text(str(key), where)  # a bad key is named by its object
                stack.append((child, f"{where}.{key}"))
        elif isinstance(node, (list, tuple)):
            stack.extend((child, f"{where}[{k}]") for k, child in reversed(list(enumerate(node))))


def template_role(role: str, template) -> str:
    """``role``, or what stands in for it when the chat template never compares a message's
    role with it (a template that knows only "system" would drop or garble "developer")."""
    fallback = TEMPLATE_ROLE_FALLBACKS.get(role)
    if fallback is None or not isinstance(template, str) or _template_names_role(template, role):
        return role
    return fallback


@lru_cache(maxsize=64)
def _template_names_role(template: str, role: str) -> bool:
    """Whether one jinja statement of ``template`` mentions ``role`` and compares it as a
    string: ``message.role == "developer"``, ``message['role'] in ['system', 'developer']``."""
    return re.search(r"role\b[^%}]*['\"]" + re.escape(role) + r"['\"]", template) is not None


def read_chat_template(path: str) -> str:
    """The text of a Jinja chat template file (``--chat-template``), parsed once so that a
    syntax error stops serve at start; ValueError naming the flag otherwise. Some models ship
    a template that does not take OpenAI-style messages (DeepSeek-V3's joins an earlier
    call's arguments as a string; radixray, like vLLM, gives templates a dict):
    those are served with a template of the user's choosing, as SGLang and vLLM do."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"chat_template: cannot read {path!r} ({e})") from None
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: {path!r} line {e.lineno}: {e.message}") from None
    if not text.strip():
        raise ValueError(f"chat_template: {path!r} is empty")
    return text
