"""SGLang's /tokenize and /detokenize (also under /v1/): the replica's own tokenizer over HTTP,
so that a client can count a prompt's tokens against the context length before sending it, or
read the text of token ids it holds, with exactly the ids the server will use.

Tokenize: ``prompt`` (a string or a list of strings), ``add_special_tokens`` (default true, as
/generate encodes text) -> ``tokens`` (ids, a list per prompt for list input), ``count`` and
``max_model_len``. Detokenize: ``tokens`` (ids, or a list of id lists),
``skip_special_tokens`` (default true) -> ``text`` (a string, or one per list).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .api_errors import bad_request
from .generation import ServingContext
from .request_checks import check_text


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no true for 1, "yes" for true
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def tokenize(body: TokenizeRequest, ctx: ServingContext) -> dict:
    tokenizer = ctx.tokenizer
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    for i, p in enumerate(prompts):  # a lone surrogate: the tokenizer's TypeError was a 500
        check_text(p, f"prompt[{i}]" if isinstance(body.prompt, list) else "prompt")
    ids = [tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
    if isinstance(body.prompt, list):
        return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": ctx.context_len}
    return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": ctx.context_len}


def detokenize(body: DetokenizeRequest, ctx: ServingContext) -> dict:
    nested = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists = body.tokens if nested else [body.tokens]
    for i, ids in enumerate(lists):
        bad = next((t for t in ids if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            where = f"tokens[{i}]" if nested else "tokens"
            raise bad_request(f"{where}: token id {bad} is outside the vocabulary "
                              f"[0, {ctx.vocab_size})", param="tokens")
    texts = [ctx.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
             for ids in lists]
    return {"text": texts if nested else texts[0]}
