"""Grammars for constrained decoding, with xgrammar: the kinds, their parsing and checks
(``grammar_compile.py`` compiles them for a tokenizer).

``validate_grammar`` is the cheap synchronous check for the HTTP layer: it parses without the
tokenizer-dependent compilation (well under a millisecond) and raises ``GrammarError``, a
``ValueError`` whose message starts with the kind (the field) and names the problem: a grammar
no finite text satisfies, a schema ``pattern`` too costly to build, a bad structural tag.

JSON schemas compile with ``any_whitespace=False`` (separators ``", "`` and ``": "``): with
free whitespace nothing is ever forced and jump-forward finds nothing to do. xgrammar 0.2.9
lets JSON strings with ``minLength``/``maxLength`` hold raw control characters, which JSON
forbids; the schema's grammar is narrowed here (see ``_LOOSE_JSON_CHAR``).
"""

from __future__ import annotations

import functools
import json
import re

import xgrammar as xgr

from ..worker.sampling_params import CONSTRAINT_KINDS
from .grammar_check import unfinishable_rule

JSON_KINDS = ("json_schema", "structural_tag")  # given as JSON (an object is accepted too)
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what OpenAI's response_format json_object means
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: .*? is false: )?")
# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as this class,
# which lets raw control characters (U+0000-U+001F) through; JSON forbids them unescaped.
_LOOSE_JSON_CHAR = r'[^\"\\\r\n]'
_STRICT_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'
# xgrammar turns a schema's regex ``pattern`` into rules at once, in time that grows with the
# cube of its repetition counts: ``{10,2000}`` 0.6-1.4 s, ``{10,12000}`` ~50 s, ``{10,30000}``
# over 5 minutes, with nothing able to stop it. Counts are bounded per pattern (each, and
# their sum) so that one stays under ~0.3 s; a top-level ``regex`` is converted lazily.
MAX_PATTERN_REPEAT = 1000
MAX_PATTERN_REPEAT_SUM = 3000
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


class GrammarError(ValueError):
    """An invalid or uncompilable grammar. The message starts with the field name (the kind),
    like the HTTP layer's other 400s: ``"regex: Regex parsing error at position 4: ..."``."""

    def __init__(self, kind: str, problem: str, status_code: int = 400):
        super().__init__(f"{kind}: {problem}")
        self.kind = kind
        self.problem = problem
        self.status_code = status_code  # 429/503: the server's load or state, not the grammar


def _problem(exc: BaseException) -> str:
    """xgrammar's C++ errors carry a timestamp and a source location; keep the problem."""
    return _XGR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__


def _normalize(kind: str, text) -> str:
    """Check ``kind`` and return the grammar text the cache is keyed by."""
    if kind not in CONSTRAINT_KINDS:
        raise GrammarError("constraint",
                           f"unknown kind {kind!r}; expected one of {CONSTRAINT_KINDS}")
    if kind in JSON_KINDS and isinstance(text, (dict, bool)):
        text = json.dumps(text, sort_keys=True)  # a schema object from a client library
    # " " is a regex (one space) and an EBNF string can be blank only where it is invalid
    if not isinstance(text, str) or not (text.strip() if kind in JSON_KINDS else text):
        raise GrammarError(kind, "must be a non-empty string")
    return text


def _pattern_problem(schema_text: str) -> str | None:
    """Why a JSON schema's regex patterns are too costly to convert (see MAX_PATTERN_REPEAT),
    or None. Only ``pattern`` values and ``patternProperties`` keys are regexes."""
    try:
        stack = [json.loads(schema_text)]
    except (ValueError, RecursionError):
        return None  # xgrammar names the problem
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        patterns = [node.get("pattern")]
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            if not isinstance(pattern, str):
                continue
            counts = [int(n) for m in _REPEAT.finditer(pattern) for n in m.groups() if n]
            if counts and (max(counts) > MAX_PATTERN_REPEAT
                           or sum(counts) > MAX_PATTERN_REPEAT_SUM):
                return (f"pattern {pattern[:60]!r}: repetition counts above "
                        f"{MAX_PATTERN_REPEAT} (or {MAX_PATTERN_REPEAT_SUM} together) are "
                        "not supported; they make the grammar too costly to build")
        stack.extend(node.values())
    return None


def _grammar(kind: str, text: str) -> xgr.Grammar:
    """Parse without the tokenizer; raises xgrammar's error for a bad grammar."""
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        grammar = _structural_tag(text)
    else:
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    ebnf = str(grammar)
    if _LOOSE_JSON_CHAR in ebnf:  # the printed EBNF parses back to the same grammar
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR))
    return grammar


def _structural_tag(text: str) -> xgr.Grammar:
    """A structural tag: xgrammar's format (``{"type": "structural_tag", "format": ...}``), or
    SGLang's (``structures``: ``begin``, ``schema``, ``end``; ``triggers``). Free text until
    a trigger, then the tag whose ``begin`` follows, its content constrained, until its end."""
    try:
        tag = json.loads(text)
    except (ValueError, RecursionError) as e:  # (nested past the parser's depth)
        raise ValueError(f"not valid JSON ({e})") from None
    if not (isinstance(tag, dict) and "structures" in tag):
        return xgr.Grammar.from_structural_tag(text)
    if "format" in tag:
        raise ValueError("give either format (xgrammar's form) or structures (SGLang's)")
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("structures must be a non-empty list and triggers a list of strings")
    items = []
    for i, item in enumerate(structures):
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str)
                and isinstance(item.get("end"), str) and isinstance(item.get("schema"), dict)):
            raise ValueError(f"structures[{i}] needs begin and end strings and a schema object")
        items.append(xgr.StructuralTagItem(begin=item["begin"], end=item["end"],
                                           schema=json.dumps(item["schema"])))
    return xgr.Grammar.from_structural_tag(items, triggers)


def _tag_schemas_problem(text: str) -> str | None:
    """The first problem of a JSON schema inside a structural tag (SGLang's ``structures``,
    or xgrammar's ``json_schema`` contents), named by its path; None if they are fine."""
    try:
        stack = [(json.loads(text), "")]
    except (ValueError, RecursionError):
        return None  # _structural_tag names it
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            schema_key = ("schema" if "begin" in node and "end" in node else
                          "json_schema" if node.get("type") == "json_schema" else None)
            schema = node.get(schema_key) if schema_key else None
            if isinstance(schema, (dict, bool)):
                problem = _parse_problem("json_schema", json.dumps(schema, sort_keys=True))
                if problem is not None:
                    return f"{path.lstrip('.')}.{schema_key}: {problem}"
            stack.extend((v, f"{path}.{k}") for k, v in reversed(list(node.items()))
                         if k != schema_key)
    return None


def wrapped_json_schema_ebnf(prefix: str, schema: str, suffix: str) -> str:
    """EBNF of ``prefix``, then JSON satisfying ``schema`` (as a json_schema constraint
    compiles it), then ``suffix``: how a tool call is forced in a model's own format. Raises
    GrammarError("json_schema: ...") for a bad schema."""
    if problem := _pattern_problem(schema):  # (a tool's parameters: no other check runs)
        raise GrammarError("json_schema", problem)
    try:
        parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}")] if prefix else []
        parts.append(_grammar("json_schema", schema))
        if suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
    except Exception as exc:
        raise GrammarError("json_schema", _problem(exc)) from None
    return str(xgr.Grammar.concat(*parts)) if len(parts) > 1 else str(parts[0])


def validate_grammar(kind: str, text) -> None:
    """Raise ``GrammarError`` naming the problem if ``text`` is not a valid ``kind`` grammar.

    Parsing only, no tokenizer needed; verdicts are cached (a schema is usually sent many
    times, and both the HTTP layer and the scheduler check it). A grammar that passes could in
    rare cases still fail to compile; that request then finishes with an error from the
    scheduler."""
    text = _normalize(kind, text)
    problem = _parse_problem(kind, text)
    if problem is not None:
        raise GrammarError(kind, problem)


@functools.lru_cache(maxsize=1024)
def _parse_problem(kind: str, text: str) -> str | None:
    if kind in JSON_KINDS and (problem := _pattern_problem(text)):
        return problem
    if kind == "structural_tag":  # its printed grammar (a tag dispatch) hides its rules from
        problem = _tag_schemas_problem(text)  # the checks below: check each schema alone
        if problem is not None:
            return problem
    try:
        grammar = _grammar(kind, text)
    except Exception as exc:  # xgrammar raises RuntimeError and its own subclasses
        return _problem(exc)
    rule = unfinishable_rule(str(grammar))
    if rule is not None:  # jump-forward would follow it forever; no output could complete
        what = "root" if rule == "root" else f"its rule {rule!r}"
        return (f"no finite text satisfies {what} (it recurses without end); "
                "such a grammar can never complete")
    return None
