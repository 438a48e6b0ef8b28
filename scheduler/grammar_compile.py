"""Grammar compilation for constrained decoding, with xgrammar.

``GrammarBackend`` compiles ``(kind, text)`` grammars (``grammar.py``) on a small thread pool
(a compile past the timeout frees its pool thread and finishes in its own). ``submit`` returns
a ``GrammarFuture`` at once; the scheduler polls ``done()`` and never waits. Compiled grammars
are cached by ``(kind, text)``, and concurrent submits of one grammar share one compilation,
which is dropped if it has not started when the last request waiting for it leaves.
``new_state`` makes a request's ``GrammarState`` (see grammar_state.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import xgrammar as xgr

from .grammar import GrammarError, _grammar, _normalize, _problem
from .grammar_state import GrammarState, GrammarVocab

QUEUED_TIMEOUTS = 4  # a compilation not started within 4 timeouts: a 429 (the load)


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
