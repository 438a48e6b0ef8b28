"""The offline Engine keeps serving after what used to leave it unusable: per-request values of
the wrong type (they failed a later step, for every request in it), an exception in the middle
of a step (Ctrl-C in a notebook, a failed forward), and two threads calling generate at once.
And a max_new_tokens far past the context no longer serialises a batch."""

from __future__ import annotations

import threading

import pytest

from radixray.cluster.engine import Engine
from scheduler_harness import make, req, run
from test_engine import assert_clean

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(tiny_llama_path, max_total_tokens=1024) as eng:
        yield eng


@pytest.mark.parametrize("field, value", [("priority", "high"), ("priority", True),
                                          ("routing_key", {"a": 1}), ("extra_key", 5)])
def test_a_wrong_typed_value_is_refused_before_anything_runs(engine, field, value):
    expected = engine.generate("def f(x):", sampling_params=GREEDY)["output_ids"]
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        engine.generate(["def f(x):", "hello"], sampling_params=GREEDY, **{field: value})
    assert engine.generate("def f(x):", sampling_params=GREEDY)["output_ids"] == expected
    assert_clean(engine)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_exception_mid_step_leaves_a_working_engine(engine, monkeypatch, failure):
    expected = engine.generate("def f(x):", sampling_params=GREEDY)["output_ids"]
    forward, calls = engine.runner.forward, [0]

    def failing_forward(batch):  # stands in for Ctrl-C during the first prefill
        calls[0] += 1
        if calls[0] == 1:
            raise failure("interrupted")
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    with pytest.raises(failure):
        engine.generate(["hello", "def f(x):"], sampling_params=GREEDY)
    # it said "future token read before it was written (scheduler bug)" from here on
    assert engine.generate("def f(x):", sampling_params=GREEDY)["output_ids"] == expected
    assert engine.flush_cache()
    assert_clean(engine)


def test_two_threads_generating_at_once_both_get_their_answers(engine):
    prompts = [f"def f{i}(x):" for i in range(4)]
    expected = [o["output_ids"] for o in engine.generate(prompts, sampling_params=GREEDY)]
    results, errors = {}, []

    def call(k):
        try:
            results[k] = [o["output_ids"] for o in engine.generate(prompts, sampling_params=GREEDY)]
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == {0: expected, 1: expected}
    assert_clean(engine)


@pytest.mark.usefixtures("runner_kind")
def test_a_max_new_tokens_past_the_context_does_not_serialise_the_batch():
    """Its KV reservation counted 4,096 tokens that a 256-token context can never produce, so
    one request took the whole pool and 8 ran one after another (1,880 decode batches, not
    235)."""
    sched, _ = make(pool=2048, context=256)
    peak = []
    step = sched.step

    def counting_step():
        out = step()
        peak.append(len(sched.running))
        return out

    sched.step = counting_step
    results = run(sched, [req(f"r{i}", [i + 1] * 20, 10**6) for i in range(8)])
    assert max(peak) == 8
    assert all(len(r.tokens) == 256 - 20 for r in results.values())


@pytest.mark.parametrize("args, message", [
    ({"context_length": -1}, "context_length: must be an integer"),
    ({"context_length": 2.5}, "context_length: must be an integer"),
    ({"context_length": "64"}, "context_length: must be an integer"),
    ({"context_length": 4096}, "context_length: 4096 exceeds the model's"),
    ({"mem_fraction_static": 2.0}, "mem_fraction_static: must be in"),
    ({"device": "tpu"}, "device: 'tpu'; use cpu, cuda"),
])
def test_runner_arguments_are_checked_by_name(tiny_llama_path, args, message):
    """They were a torch RuntimeError or TypeError naming nothing, or silently accepted."""
    with pytest.raises(ValueError, match=f"^{message}"):
        Engine(tiny_llama_path, max_total_tokens=256, **args)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "a", "sampling_params": "x"}, "sampling_params: must be a dict"),
    ({"prompt": ["a", "b"], "sampling_params": [1, 2]}, "sampling_params: must be a dict"),
    ({"input_ids": [[1, 2], 3]}, "input_ids: a batch must be a list of lists"),
])
def test_malformed_generate_arguments_are_value_errors_naming_them(engine, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        engine.generate(**kwargs)
    assert_clean(engine)


def test_flush_after_shutdown_says_so(tiny_llama_path):
    eng = Engine(tiny_llama_path, max_total_tokens=256)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.flush_cache()
