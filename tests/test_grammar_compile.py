"""The grammar compile pool (scheduler/grammar.py ``GrammarBackend``): one compilation per
grammar, deadlines that run from a compilation's start, a bound on compilations that run past
them, and schema patterns too costly to build refused at once."""

import json
import threading
import time

import pytest

from radixray.scheduler.grammar import GrammarError, validate_grammar
from radixray.scheduler.grammar_compile import GrammarBackend

VOCAB = 2048
SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                           "b": {"type": "string"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


def test_compile_cache_compiles_once(tokenizer):
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=2)
    schema = json.dumps(SCHEMA)
    futures, barrier = [], threading.Barrier(4)

    def client():
        barrier.wait()
        futures.append(backend.submit("json_schema", schema))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compiled = {id(f.result(wait=True)) for f in futures}
    assert len(compiled) == 1 and backend.num_compiles == 1
    backend.submit("json_schema", schema).result(wait=True)
    backend.submit("regex", schema).done()  # another kind with the same text is another key
    assert backend.num_compiles == 2 and backend.cache_size == 2
    backend.shutdown()


def test_submit_never_blocks_and_times_out(tokenizer):
    """The deadline runs from the compilation's start: time queued behind other clients'
    grammars does not count (a trivial regex queued behind four slow schemas timed out)."""
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=0.2)
    gate, real = threading.Event(), backend._compile
    backend._pool.submit(gate.wait)  # occupy the only compile thread
    future = backend.submit("regex", "[a-z]+")
    assert not future.done()
    with pytest.raises(RuntimeError, match="not done"):
        future.result()
    time.sleep(0.4)  # twice the timeout, queued
    assert not future.done()

    hang = threading.Event()

    def stuck(kind, text):
        hang.wait()
        return real(kind, text)

    backend._compile = stuck
    gate.set()  # the compilation starts now, and hangs
    with pytest.raises(GrammarError, match="^regex: compilation timed out after 0.2 s"):
        future.result(wait=True)
    assert future.done()
    hang.set()
    # the compilation itself carried on; a later request gets it from the cache (with a
    # deadline a loaded machine cannot miss)
    backend._compile = real
    backend.compile_timeout_s = 30.0
    late = backend.submit("regex", "[a-z]+")
    assert late.result(wait=True) is not None and backend.num_compiles == 1
    backend.shutdown()


def test_compilations_past_their_timeout_are_bounded(tokenizer):
    """Each compilation past its timeout kept a thread (and a core) for as long as it ran:
    a client with a few costly schemas kept the replica's cores busy while it sat idle. At most
    2 x threads compile at once; beyond, a request fails with a 429 and is not cached."""
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=0.1)
    gate, real = threading.Event(), backend._compile

    def compile_(kind, text):
        if text.startswith("slow"):
            gate.wait()
        return real(kind, text)

    backend._compile = compile_
    try:
        for text in ("slow1+", "slow2+"):
            with pytest.raises(GrammarError, match="timed out"):
                backend.submit("regex", text).result(wait=True)
        time.sleep(0.15)  # the pool's own wait for the second has passed
        with pytest.raises(GrammarError, match="still compiling past their timeout") as e:
            backend.submit("regex", "[a-z]+").result(wait=True)
        assert e.value.status_code == 429
    finally:
        gate.set()
    time.sleep(0.2)  # the stuck ones finish; the refused grammar was not cached as failed
    backend.compile_timeout_s = 30.0
    assert backend.submit("regex", "[a-z]+").result(wait=True) is not None
    backend.shutdown()


def test_costly_schema_patterns_are_refused_at_once():
    """A 70-byte schema with pattern "[a-z ]{10,12000}" kept xgrammar busy ~50 s (cubic in the
    count), on the replica's event loop: every request and /health waited."""
    started = time.monotonic()
    for schema in ({"type": "string", "pattern": "[a-z ]{10,12000}"},
                   {"type": "object", "patternProperties": {"^x{5000}$": {}}},
                   {"type": "array", "items": {"type": "string",
                                               "pattern": "a{0,900}b{0,900}c{0,900}d{0,900}"}}):
        with pytest.raises(GrammarError, match="^json_schema: pattern .*repetition counts"):
            validate_grammar("json_schema", json.dumps(schema))
    assert time.monotonic() - started < 1.0
    validate_grammar("json_schema", json.dumps({"type": "string", "pattern": "[a-z]{1,200}"}))
    validate_grammar("json_schema", json.dumps({"type": "string", "pattern": r"a\{5000\}"}))


def test_an_overdue_compile_gives_its_thread_to_the_next_grammar(tokenizer):
    """Python cannot stop a compilation past its deadline; it carries on, but not on the pool
    thread the next grammars need. Before, two slow grammars on the replica's 2 threads made
    every other grammar queued behind them abort with "compilation timed out" (found with
    --grammar-compile-timeout 1 and two 5000-key schemas)."""
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=0.5)
    gate, real = threading.Event(), backend._compile

    def compile_(kind, text):  # "slow+" stands for a grammar that takes long to compile
        if text == "slow+":
            gate.wait()
        return real(kind, text)

    backend._compile = compile_
    try:
        slow = backend.submit("regex", "slow+")
        with pytest.raises(GrammarError, match="^regex: compilation timed out after 0.5 s"):
            slow.result(wait=True)
        time.sleep(0.05)  # the pool's own deadline for the slow compile has passed too
        assert backend.submit("regex", "[a-z]+").result(wait=True) is not None
    finally:
        gate.set()  # the slow compilation finishes (in its own thread) and is cached
    backend.compile_timeout_s = 30.0
    assert backend.submit("regex", "slow+").result(wait=True) is not None
    assert backend.num_compiles == 2
    backend.shutdown()


def test_a_queued_compile_times_out_after_four_timeouts_and_shutdown_ends_it(tokenizer):
    """A compilation that never starts had no deadline at all: its request waited for ever,
    and after shutdown() (which drops queued work) result(wait=True) never returned."""
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=0.1)
    gate = threading.Event()
    backend._pool.submit(gate.wait)  # the only thread stays busy
    queued = backend.submit("regex", "[a-z]+")
    with pytest.raises(GrammarError, match="waited too long behind other grammars") as e:
        queued.result(wait=True)  # ~0.4 s: four timeouts, never started
    assert e.value.status_code == 429  # the server's load: not a 400 blaming the grammar
    other = backend.submit("regex", "[0-9]+")
    backend.shutdown(wait_s=0.1)
    with pytest.raises(GrammarError, match="shutting down") as e:
        other.result(wait=True)
    assert e.value.status_code == 503
    gate.set()


def test_a_queued_compile_nobody_waits_for_is_dropped(tokenizer):
    """A client that sent costly grammars and hung up left them queued: each compiled later on
    the replica's pool, ahead of the grammars of clients still waiting. The last waiter gone,
    a compilation that has not started is dropped; one someone still waits for is kept."""
    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=30)
    gate = threading.Event()
    backend._pool.submit(gate.wait)  # the only thread stays busy
    try:
        first, second = backend.submit("regex", "[a-z]+"), backend.submit("regex", "[a-z]+")
        alone = backend.submit("regex", "[0-9]+")
        first.release()
        alone.release()
        assert backend.num_abandoned == 1 and backend.cache_size == 1
        gate.set()
        assert second.result(wait=True) is not None  # still wanted: compiled
        assert backend.num_compiles == 2 and backend.submit("regex", "[0-9]+").result(wait=True)
        assert backend.num_compiles == 3  # compiled afresh when asked again
    finally:
        gate.set()
        backend.shutdown()


def test_the_scheduler_reports_a_queue_timeout_as_429_not_an_abandoned_compile(tokenizer):
    """poll() let go of the compilation before reading it: the last waiter's release dropped
    the queued compile, and the request read "no request waits for it", a 400 blaming its
    grammar, instead of the 429 (the server's load) it had earned."""
    from radixray.scheduler.constrained import ConstrainedDecoding
    from radixray.scheduler.request import Req
    from radixray.worker.sampling_params import SamplingParams

    backend = GrammarBackend(tokenizer, VOCAB, num_threads=1, compile_timeout_s=0.05)
    gate = threading.Event()
    backend._pool.submit(gate.wait)  # the only thread stays busy
    try:
        grammars = ConstrainedDecoding(backend, max_context_len=512)
        req = Req("r", [1, 2], SamplingParams(regex="[a-z]+"))
        grammars.add(req)
        time.sleep(0.3)  # past four timeouts, never started
        (finished, _), = grammars.poll()
        assert finished is req and req.finish_reason.status_code == 429, req.finish_reason
        assert "waited too long" in req.finish_reason.message
    finally:
        gate.set()
        backend.shutdown()


def test_a_tools_parameters_get_the_pattern_limit_too():
    """Forced tool calls build their grammar through another path, which skipped the check."""
    from radixray.scheduler.grammar import wrapped_json_schema_ebnf

    schema = json.dumps({"type": "object", "properties": {
        "x": {"type": "string", "pattern": "a{10,30000}"}}})
    started = time.monotonic()
    with pytest.raises(GrammarError, match="^json_schema: pattern .*repetition counts"):
        wrapped_json_schema_ebnf("<tool_call>", schema, "</tool_call>")
    assert time.monotonic() - started < 1.0
