"""Per-request sampling parameters, with SGLang's names and defaults.

``SamplingParams.from_dict`` accepts what clients send (null or empty values mean "default") and
``verify`` raises ``ValueError`` whose message starts with the offending field's name, so the
HTTP layer can turn it into a 400 that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import regex

GREEDY_TEMPERATURE = 1e-6  # temperature below this means greedy (argmax)
# The sampler works on float32 logits, where a masked token is -inf. A temperature that rounds
# to inf there, a repetition penalty that rounds to 0, or an infinite logit bias turns such a
# token into NaN (-inf / inf, -inf * 0, -inf + inf), and NaN wins the sampler's argmax: the
# request gets a token its grammar forbids. These bounds keep every adjusted logit finite.
FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 1e-6  # 1 / penalty stays far from float32 overflow
# Seeds a request may carry: any 64-bit integer, signed or not (OpenAI's seed is an int64)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
# The grammar constraints, at most one per request (SGLang's names): each a string, a
# structural tag being its JSON (xgrammar's format, or SGLang's structures and triggers).
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


# SGLang sampling parameters radixray knows but does not implement: a value is a 400 saying so.
UNSUPPORTED = {"custom_params": "not supported (radixray has no custom logit processors)"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        """Build from a client dict. Unknown keys raise; None and empty values keep defaults."""
        d = {k: v for k, v in (d or {}).items() if v is not None}  # null: not given
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            why = UNSUPPORTED.get(unknown[0], "unknown sampling parameter")
            name = unknown[0] if surrogate_at(unknown[0]) is None else ascii(unknown[0])
            raise ValueError(f"{name}: {why}")  # (a lone surrogate cannot go out as JSON)
        kwargs = {k: v for k, v in d.items() if v is not None and v != [] and v != ""}
        for key in ("stop", "stop_regex"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = [kwargs[key]]
            if isinstance(kwargs.get(key), list):
                # An empty stop string is an empty value, not a stop that matches anywhere (the
                # scheduler would end the output at its first token; the detokenizer ignores it).
                kwargs[key] = [s for s in kwargs[key] if s != ""]
        if isinstance(kwargs.get("stop_token_ids"), int):
            kwargs["stop_token_ids"] = [kwargs["stop_token_ids"]]
        if kwargs.get("logit_bias"):
            try:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
            except (TypeError, ValueError, AttributeError, OverflowError):  # 1e400 as an int
                raise ValueError("logit_bias: must map token ids to numbers") from None
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraint, if any."""
        for kind in CONSTRAINT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError("<field>: <problem>") for values no request may carry."""

        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens",
              "must be a non-negative integer")
        check(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens, "min_new_tokens",
              "must be a non-negative integer")
        check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
              "must not exceed max_new_tokens")
        check(is_int(self.n) and 1 <= self.n <= 128, "n", "must be an integer in [1, 128]")
        check(is_num(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX, "temperature",
              "must be a finite number >= 0")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
              "must be -1 (off) or a positive integer")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(is_num(self.repetition_penalty)
              and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
              "repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 2]")
        check(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
              "stop", "must be a string or a list of strings")
        check(isinstance(self.stop_token_ids, list)
              and all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative integers")
        check(isinstance(self.stop_regex, list)
              and all(isinstance(s, str) for s in self.stop_regex),
              "stop_regex", "must be a string or a list of strings")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):  # "false" would read as true, "no" crash the tokenizer
            check(isinstance(getattr(self, name), bool), name, "must be true or false")
        for name in CONSTRAINT_KINDS:
            value = getattr(self, name)
            check(value is None or isinstance(value, str), name, "must be a string")
        for name in ("stop", "stop_regex", *CONSTRAINT_KINDS):
            value = getattr(self, name)
            for text in [value] if isinstance(value, str) else value or ():
                # JSON may escape a lone UTF-16 surrogate; no tokenizer or regex engine takes it
                check(surrogate_at(text) is None, name, "not valid Unicode text (a lone surrogate)")
        for pattern in self.stop_regex:
            _check_stop_regex(pattern)
        check(self.seed is None or is_int(self.seed), "seed", "must be an integer")
        # the sampler mixes seeds as 64 bits: a wider one would alias a narrower one
        check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed",
              f"must be in [{MIN_SEED}, {MAX_SEED}] (64 bits)")
        check(all(is_num(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                  for v in (self.logit_bias or {}).values()),
              "logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        constraints = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        check(len(constraints) <= 1, constraints[-1] if constraints else "regex",
              "at most one of regex, json_schema, ebnf and structural_tag may be given")
        if vocab_size is not None:
            check(all(t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                  f"token ids must be < vocab size {vocab_size}")
            check(all(0 <= t < vocab_size for t in (self.logit_bias or {})), "logit_bias",
                  f"token ids must be in [0, {vocab_size})")


def surrogate_at(text: str) -> int | None:
    """Where ``text`` stops being encodable as UTF-8 (a lone surrogate, which JSON may escape
    and json.loads keeps; no tokenizer or regex engine takes one), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


MAX_STOP_REGEX_CHARS = 512  # searched at every token: a long one stalled a whole replica


def _check_stop_regex(pattern: str) -> None:
    """A stop regex must be short, compile (with the ``regex`` module the stop check uses) and
    not match the empty string, which would stop every output at its first token."""
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise ValueError(f"stop_regex: a pattern may have at most {MAX_STOP_REGEX_CHARS} "
                         f"characters, got {len(pattern)}")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"stop_regex: {pattern!r} is not a valid regular expression ({e})") \
            from None
    if compiled.search("", timeout=1.0) is not None:
        raise ValueError(f"stop_regex: {pattern!r} matches the empty string")
