"""The offline Engine's per-call plumbing: each request's outputs gathered over the steps, and
its per-request arguments (one value for all prompts, or a list of one per prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..scheduler.request import RequestOutput
from ..worker.sampling_params import MAX_SEED


@dataclass
class Collected:
    """One request's outputs gathered over the steps."""

    output_ids: list[int] = field(default_factory=list)
    last: RequestOutput | None = None
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    latency: float = 0.0  # seconds from submission to the final output

    def add(self, out: RequestOutput) -> None:
        self.output_ids += out.new_token_ids
        self.output_token_logprobs += out.output_token_logprobs
        self.output_top_logprobs += out.output_top_logprobs
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = out.input_token_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        self.last = out

    def after_warmup(self, warm: "Collected", prompt_len: int) -> None:
        """A copy (n > 1) reports its warm-up's cache hit (capped as a generating request's:
        it recomputes the last prompt token) and waited for it too."""
        cached = min(warm.last.cached_tokens, prompt_len - 1)
        self.last = replace(self.last, cached_tokens=cached,
                            host_cached_tokens=min(warm.last.host_cached_tokens, cached))
        self.latency += warm.latency


def plain_entry(logprob, token_id) -> list:
    return [logprob, token_id, None]


_KIND_NAMES = {bool: "true or false", int: "an integer", str: "a string", dict: "a dict"}


def per_request(value, count: int, name: str, item_type: type | None = None) -> list:
    """One value for all requests, or a list with one per request. With ``item_type`` (the
    value's own type is a list for no argument but sampling_params' dicts) anything else is a
    ValueError naming ``name``."""
    if isinstance(value, list) and (item_type is None or all(
            isinstance(v, item_type) or v is None for v in value)):
        if len(value) != count:
            raise ValueError(f"{name}: got {len(value)} values for {count} prompts")
        return value
    if item_type is not None and value is not None and not isinstance(value, item_type):
        kind = _KIND_NAMES.get(item_type, item_type.__name__)
        raise ValueError(f"{name}: must be {kind} or a list with one per prompt")
    return [value] * count


def logprob_start(return_logprob: bool, start: int, prompt_len: int) -> int:
    """SGLang's rule, as the HTTP API's: -1 means the last prompt token only (one null entry);
    without logprobs the value is ignored."""
    if not return_logprob:
        return -1
    if start is None or start == -1:
        return prompt_len - 1
    if not 0 <= start < prompt_len:
        raise ValueError(f"logprob_start_len: must be -1 or in [0, {prompt_len}), got {start}")
    return start


def copy_seed(seed: int | None, i: int) -> int | None:
    """Copy ``i``'s seed: ``seed + i``, wrapped past the largest (the sampler takes seeds
    modulo 2**64); None stays None."""
    if seed is None:
        return None
    return seed + i if seed + i <= MAX_SEED else seed + i - (1 << 64)
