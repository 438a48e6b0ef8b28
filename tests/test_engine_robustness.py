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
    ({"tokenizer_path": "/no/such/tokenizer"}, "tokenizer_path: '/no/such/tokenizer' is not a "
                                               "folder"),
    # sglang.Engine's names: taken when they mean this one process, named when they do not
    ({"tp_size": 2}, "tp_size: the in-process Engine runs one rank"),
    ({"dp_size": 4}, "dp_size: the in-process Engine runs one rank"),
    ({"log_level": "loud"}, "log_level: Unknown level"),
])
def test_runner_arguments_are_checked_by_name(tiny_llama_path, args, message):
    """They were a torch RuntimeError or TypeError naming nothing, or silently accepted."""
    with pytest.raises(ValueError, match=f"^{message}"):
        Engine(tiny_llama_path, max_total_tokens=256, **args)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "a", "sampling_params": "x"}, "sampling_params: must be a dict"),
    ({"prompt": ["a", "b"], "sampling_params": [1, 2]}, "sampling_params: must be a dict"),
    ({"input_ids": [[1, 2], 3]}, "input_ids: a batch must be a list of lists"),
    # HTTP's type checks, now the Engine's too: "false" read as true, "no" crashed the tokenizer
    ({"prompt": "a", "sampling_params": {"ignore_eos": "false"}}, "ignore_eos: must be true"),
    ({"prompt": "a", "sampling_params": {"skip_special_tokens": "no"}},
     "skip_special_tokens: must be true"),
    ({"prompt": "a", "sampling_params": {"stop": ["\ud800"]}}, "stop: not valid Unicode"),
    ({"prompt": "a\udfff"}, "prompt: not valid Unicode text"),
    ({"prompt": "import os\n" * 600}, "prompt: the prompt has"),  # it said input_ids
    ({"prompt": "import os\n" * 450}, "prompt: the prompt has .* the KV cache holds 1024"),
    ({"prompt": "import os\n" * 600, "sampling_params": {"max_new_tokens": 4}},
     "prompt: the prompt has"),  # it blamed max_new_tokens
    ({"prompt": 5}, "prompt: must be a string"),  # a TypeError from list(5)
    ({"prompt": "a", "return_logprob": "no"}, "return_logprob: must be true or false"),
    ({"prompt": "a", "return_text_in_logprobs": 1}, "return_text_in_logprobs: must be true"),
    ({"prompt": ["a", "b"], "rid": ["x", 3]}, "rid: must be a string"),
])
def test_malformed_generate_arguments_are_value_errors_naming_them(engine, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        engine.generate(**kwargs)
    assert_clean(engine)


def test_sglangs_calling_convention_and_none_defaults(engine):
    """generate(prompt, sampling_params) positionally, as SGLang's and vLLM's engines take it
    (the second parameter was input_ids), and SGLang's None defaults for the logprob fields."""
    alone = engine.generate(prompt="def f(x):", sampling_params=GREEDY)
    assert engine.generate("def f(x):", GREEDY)["output_ids"] == alone["output_ids"]
    out = engine.generate("def f(x):", GREEDY, return_logprob=True, logprob_start_len=None,
                          top_logprobs_num=None)
    assert out["output_ids"] == alone["output_ids"]
    assert len(out["meta_info"]["input_token_logprobs"]) == 1  # the last prompt token only
    assert "output_top_logprobs" not in out["meta_info"]
    assert "Engine" in dir(__import__("radixray"))
    assert_clean(engine)


def test_sglang_engine_arguments_for_one_process_are_taken(tiny_llama_path):
    """Code ported from sglang.Engine(model_path=..., tp_size=1, ...) failed at once with
    "unknown server argument"."""
    with Engine(model_path=tiny_llama_path, tp_size=1, dp_size=1, trust_remote_code=True,
                log_level="warning", max_total_tokens=256) as e:
        assert e.generate("a", GREEDY)["meta_info"]["completion_tokens"] > 0


def test_a_missing_model_folder_fails_at_once():
    """A typo retried the (unreachable) model hub for ~50 s before failing."""
    import time

    started = time.monotonic()
    with pytest.raises(ValueError, match="^model_path: '/no/such/model' is not a folder"):
        Engine("/no/such/model")
    assert time.monotonic() - started < 10


def test_shutdown_waits_for_a_generate_in_another_thread(tiny_llama_path):
    """It dropped the scheduler under the running call: AttributeError on None."""
    eng = Engine(tiny_llama_path, max_total_tokens=1024)
    result = {}

    def long_call():
        try:
            result["out"] = eng.generate("x", {"max_new_tokens": 300, "ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - the test reports it
            result["error"] = e

    thread = threading.Thread(target=long_call)
    thread.start()
    while eng.scheduler is not None and not eng.scheduler.live:
        pass  # until the call has queued its request
    eng.shutdown()
    thread.join(60)
    assert "error" not in result, result
    assert result["out"]["meta_info"]["completion_tokens"] == 300
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("x")


def test_flush_after_shutdown_says_so(tiny_llama_path):
    eng = Engine(tiny_llama_path, max_total_tokens=256)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.flush_cache()


def test_shutdown_ends_the_forward_thread(tiny_llama_path):
    """Overlap scheduling runs forwards on the runner's own thread; every Engine a program
    built and shut down left one behind."""
    def forward_threads():
        return [t for t in threading.enumerate() if t.name.startswith("radixray-forward")]

    before = len(forward_threads())
    eng = Engine(tiny_llama_path, max_total_tokens=256, disable_overlap_schedule=False)
    eng.generate("x", {"max_new_tokens": 4})
    assert len(forward_threads()) == before + 1
    eng.shutdown()
    assert len(forward_threads()) == before
