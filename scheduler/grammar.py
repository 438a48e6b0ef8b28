"""Grammar compilation for constrained decoding, with xgrammar.

- ``GrammarBackend`` compiles ``(kind, text)`` grammars on a small thread pool (a compile
  past the timeout frees its pool thread and finishes in its own). ``submit``
  returns a ``GrammarFuture`` at once; the scheduler polls ``done()`` and never waits.
  Compiled grammars are cached by ``(kind, text)``, and concurrent submits of one grammar share
  one compilation. ``new_state`` makes a request's ``GrammarState`` (see grammar_state.py).
- ``validate_grammar`` is the cheap synchronous check for the HTTP layer: it parses without the
  tokenizer-dependent compilation (well under a millisecond) and raises ``GrammarError``, a
  ``ValueError`` whose message starts with the kind (the field) and names the problem.

JSON schemas compile with ``any_whitespace=False`` (separators ``", "`` and ``": "``): with
free whitespace nothing is ever forced and jump-forward finds nothing to do. xgrammar 0.2.9
lets JSON strings with ``minLength``/``maxLength`` hold raw control characters, which JSON
forbids; the schema's grammar is narrowed here (see ``_LOOSE_JSON_CHAR``).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import xgrammar as xgr

from ..worker.sampling_params import CONSTRAINT_KINDS
from .grammar_check import unfinishable_rule
from .grammar_state import GrammarState, GrammarVocab

KINDS = CONSTRAINT_KINDS
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
QUEUED_TIMEOUTS = 4  # a compilation not started within 4 timeouts: a 429 (the load)
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
    if kind not in KINDS:
        raise GrammarError("constraint", f"unknown kind {kind!r}; expected one of {KINDS}")
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
    except ValueError as e:
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
    except ValueError:
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


# ---------------------------------------------------------------------- compilation
class GrammarFuture:
    """One request's view of a (possibly shared) compilation, with its own deadline."""

    def __init__(self, kind: str, future: Future, timeout_s: float,
                 release: "Callable[[Future], None] | None" = None):
        self.kind = kind
        self._future = future
        self._timeout_s = timeout_s
        self._submitted = time.monotonic()
        self._release = release

    def release(self) -> None:
        """This request no longer waits (it left the grammar queue: compiled, failed, or
        aborted). A compilation no request waits for any more is dropped if it has not
        started. Call once."""
        if self._release is not None:
            self._release(self._future)
            self._release = None

    @property
    def _deadline(self) -> float:
        """``timeout_s`` after the later of this submit and the compilation's start (set by
        the pool thread): time queued behind other requests' grammars does not count."""
        started = getattr(self._future, "started_at", None)
        if started is None:  # queued: each pool thread frees up within a timeout
            return self._submitted + QUEUED_TIMEOUTS * self._timeout_s
        return max(started, self._submitted) + self._timeout_s

    def done(self) -> bool:
        """True once ``result()`` returns or raises without waiting (compiled, failed, or past
        the deadline). Never blocks."""
        return self._future.done() or time.monotonic() >= self._deadline

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (never past the deadline) for ``done()``; returns it. For a
        scheduler with nothing else to do, instead of spinning."""
        try:
            self._future.result(timeout=max(min(timeout_s, self._deadline - time.monotonic()), 0))
        except Exception:  # timed out, or failed: either way done() tells
            pass
        return self.done()

    def result(self, wait: bool = False) -> xgr.CompiledGrammar:
        """The compiled grammar. Raises ``GrammarError`` if compilation failed or timed out, and
        ``RuntimeError`` if not ``done()`` (unless ``wait``: then block up to the deadline)."""
        while not self._future.done() and wait and time.monotonic() < self._deadline:
            try:  # (the deadline is unknown until the compilation starts)
                self._future.result(timeout=min(max(self._deadline - time.monotonic(), 0), 1.0))
            except (TimeoutError, GrammarError):
                pass
        if not self._future.done():
            if time.monotonic() < self._deadline:
                raise RuntimeError("grammar compilation is not done; poll done() first")
            if getattr(self._future, "started_at", None) is None:  # the server's load, not it
                raise GrammarError(self.kind, "waited too long behind other grammars' "
                                   "compilations; try again later", status_code=429)
            raise GrammarError(self.kind, f"compilation timed out after {self._timeout_s:g} s")
        return self._future.result()


class GrammarBackend:
    """Compiles grammars for one tokenizer on a thread pool, caching them by (kind, text)."""

    def __init__(self, tokenizer, vocab_size: int, *, num_threads: int = 2,
                 compile_timeout_s: float = 30.0, stop_token_ids: Sequence[int] | None = None,
                 max_cache_entries: int = 1024):
        """``tokenizer`` is a Hugging Face tokenizer; ``vocab_size`` the model's (the logits'
        width, which may exceed the tokenizer's). ``stop_token_ids`` default to its EOS."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self.tokenizer = tokenizer  # jump-forward re-tokenizes with it
        self.tokenizer_info = info
        self.vocab = GrammarVocab(info, vocab_size, getattr(tokenizer, "all_special_ids", ()))
        # xgrammar's own cache is off: ours below also shares compilations in flight.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self.compile_timeout_s = compile_timeout_s
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # compilations started (cache misses)
        self.num_abandoned = 0  # queued compilations dropped: no request waited any more
        self._compiling: set[threading.Thread] = set()  # compile threads still running
        # Compilations past their timeout run on (Python cannot stop them); at most this many
        # threads compile at once, so a client's costly grammars cannot take every core.
        self.max_live_compiles = 2 * num_threads

    def submit(self, kind: str, text) -> GrammarFuture:
        """Start compiling (or reuse the cached or in-flight compilation of) ``(kind, text)``.
        Raises ``GrammarError`` at once only for an unknown kind or an empty text; other errors
        come from ``result()``. Mutates the cache."""
        text = _normalize(kind, text)
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = Future()
                future.key, future.waiters = key, 0
                self._pool.submit(self._run, future, kind, text)
                self._cache[key] = future
                self.num_compiles += 1
                self._evict()
            else:
                self._cache.move_to_end(key)
            future.waiters += 1
        return GrammarFuture(kind, future, self.compile_timeout_s, self._release)

    def _release(self, future: Future) -> None:
        """One waiter of ``future`` is gone. The last one of a queued compilation cancels it:
        a client that sent costly grammars and hung up must not keep the pool busy."""
        with self._lock:
            future.waiters -= 1
            if (future.waiters == 0 and not future.done()
                    and getattr(future, "started_at", None) is None):
                self._cache.pop(future.key, None)
                future.set_exception(GrammarError(future.key[0], "no request waits for it"))
                self.num_abandoned += 1

    def compile(self, kind: str, text) -> xgr.CompiledGrammar:
        """Blocking ``submit(...).result(wait=True)``: for tests, benchmarks and warm-up."""
        return self.submit(kind, text).result(wait=True)

    def new_state(self, compiled: xgr.CompiledGrammar,
                  output_ids: Sequence[int] = ()) -> "GrammarState":
        """A matcher for one request, advanced over ``output_ids`` (see ``from_tokens``)."""
        return GrammarState.from_tokens(compiled, self.vocab, output_ids)

    def _run(self, future: Future, kind: str, text: str) -> None:
        """On a pool thread: compile in a thread of its own, and hold this pool thread only
        until the timeout. Python cannot stop a compilation; one past every deadline carries
        on (and is cached when done) without making the grammars queued behind it time out."""
        worker = threading.Thread(target=self._compile_into, args=(future, kind, text),
                                  name="grammar-compile", daemon=True)
        with self._lock:  # started under the lock: shutdown only ever joins started threads
            if future.done():  # failed by shutdown, or abandoned, while it was queued
                return
            if len(self._compiling) >= self.max_live_compiles:
                self._cache.pop((kind, text), None)  # not the grammar's fault: try it later
                future.set_exception(GrammarError(
                    kind, f"{len(self._compiling)} grammars are still compiling past their "
                          "timeout; try again later", status_code=429))
                return
            future.started_at = time.monotonic()
            self._compiling.add(worker)
            worker.start()
        worker.join(self.compile_timeout_s)

    def _compile_into(self, future: Future, kind: str, text: str) -> None:
        try:
            future.set_result(self._compile(kind, text))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            with self._lock:
                self._compiling.discard(threading.current_thread())

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(_grammar(kind, text))
        except Exception as exc:
            raise GrammarError(kind, _problem(exc)) from None

    def _evict(self) -> None:
        """Drop the least recently used finished entries beyond the limit (lock held)."""
        excess = len(self._cache) - self.max_cache_entries
        for key in [k for k, f in self._cache.items() if f.done()][:max(excess, 0)]:
            del self._cache[key]

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def shutdown(self, wait_s: float = 10.0) -> None:
        """Stop the pool; queued compilations are dropped, and those in flight get ``wait_s``
        to finish: a process that exits while one runs in C++ aborts (SIGABRT) when Python
        ends the thread under it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # the queued ones never run now: their waiters must not wait for ever
            for (kind, _), future in self._cache.items():
                if not future.done() and getattr(future, "started_at", None) is None:
                    future.set_exception(GrammarError(kind, "the server is shutting down",
                                                      status_code=503))
        deadline = time.monotonic() + wait_s
        with self._lock:
            running = list(self._compiling)
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
