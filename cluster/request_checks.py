"""Request validation shared by the native and OpenAI APIs: each check raises a 400
(``generation.bad_request``) whose message starts with the client's field name."""

from __future__ import annotations

import json
import re

from ..scheduler.grammar import validate_grammar
from ..scheduler.request import prompt_fit_problem
from ..worker.sampling_params import CONSTRAINT_KINDS, SamplingParams, surrogate_at
from .api_errors import bad_request


# Sequences (prompts x n) one request may ask for. Each waiting one costs the replica ~12 KB
# and its abort a pass over the queue: one body of 1M two-byte prompts (8 MB) grew a replica
# to 12.6 GB and froze it for minutes. Send larger batches as several requests.
MAX_SEQUENCES_PER_REQUEST = 65536


def check_batch_size(count: int, field_name: str) -> None:
    """A 400 naming ``field_name`` for a request of more than MAX_SEQUENCES_PER_REQUEST."""
    if count > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"{field_name}: {count} sequences (prompts x n) in one request; at "
                          f"most {MAX_SEQUENCES_PER_REQUEST}: send the batch as several "
                          "requests", param=field_name)


def check_sampling_params(sp: SamplingParams, vocab_size: int | None,
                          rename: dict[str, str] | None = None, where: str = "") -> None:
    """``sp.verify`` plus checks it leaves out; raises a 400 naming the client's field
    (``rename`` maps SamplingParams names to the API's, e.g. max_new_tokens -> max_tokens, in
    the message's text too: "min_tokens: must not exceed max_tokens"; ``where`` goes before
    the name: "sampling_params[1]." for the second prompt's own parameters)."""
    rename = rename or {}
    try:
        sp.verify(vocab_size)
        if isinstance(sp.json_schema, str):
            try:
                json.loads(sp.json_schema)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"json_schema: not valid JSON ({e})") from None
        if sp.constraint is not None:  # parses it (no compilation); names the problem
            validate_grammar(*sp.constraint)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        for ours, theirs in rename.items():  # not the grammar kinds a message lists: two
            if ours not in CONSTRAINT_KINDS:  # of them may come from one response_format
                msg = re.sub(rf"\b{ours}\b", theirs, msg)
        name = where + rename.get(name, name)
        raise bad_request(f"{name}: {msg}", param=name) from None


def check_lengths(prompt_len: int, max_new_tokens: int, context_len: int, prompt_field: str,
                  max_field: str, pool_tokens: int | None = None) -> None:
    """400 when the prompt is empty, alone fills the context or the KV pool (``pool_tokens``
    slots), or prompt + completion exceed the context. Checked here, before any stream
    starts, so the answer is a real 400 naming the client's field."""
    if prompt_len == 0:
        raise bad_request(f"{prompt_field}: the prompt is empty", param=prompt_field)
    problem = prompt_fit_problem(prompt_len, context_len, pool_tokens, prompt_field)
    if problem:
        raise bad_request(problem, param=prompt_field)
    overflow = context_overflow(prompt_len, max_new_tokens, context_len, max_field)
    if overflow:
        raise bad_request(overflow, param=max_field)


def context_overflow(prompt_len: int, max_new_tokens: int, context_len: int,
                     max_field: str) -> str | None:
    """Why prompt + ``max_new_tokens`` do not fit the context (a message naming
    ``max_field``), or None; the offline Engine raises it as a ValueError."""
    if prompt_len + max_new_tokens <= context_len:
        return None
    return (f"{max_field}: {max_new_tokens} new tokens after a {prompt_len}-token prompt "
            f"exceed the context length of {context_len} tokens")


def check_text(text: str, field_name: str) -> None:
    """400 when ``text`` cannot be encoded as UTF-8: JSON may escape a lone UTF-16 surrogate
    ("\\ud800") that json.loads keeps, and the tokenizer then fails with a TypeError."""
    at = surrogate_at(text)
    if at is not None:
        raise bad_request(f"{field_name}: not valid Unicode text (a lone surrogate at character "
                          f"{at})", param=field_name)


def cache_namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The radix key's ``extra_key`` for a request: requests share cached prefixes only when
    both their ``extra_key`` and their ``cache_salt`` are equal (empty means unset). The pair
    is encoded as one JSON list, so no salt can pass for another request's extra_key."""
    if not extra_key and not cache_salt:
        return None
    return json.dumps([extra_key or None, cache_salt or None])


def check_token_ids(ids: list[int], vocab_size: int, field_name: str) -> None:
    if any(t < 0 or t >= vocab_size for t in ids):
        raise bad_request(f"{field_name}: token ids must be in [0, {vocab_size})",
                          param=field_name)
