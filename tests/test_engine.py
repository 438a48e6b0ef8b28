"""The offline Engine on the tiny Llama: greedy outputs equal HF transformers under every
policy, with chunked prefill, mixed chunk and retraction, plus the client-facing contract
(cache hits, stop strings, logprobs, argument errors). Every test ends with the memory
invariant and nothing locked."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import hf_greedy, hf_logits
from radixray.cluster.engine import Engine
from radixray.scheduler.config import SCHEDULE_POLICIES

GREEDY = {"temperature": 0, "ignore_eos": True}


def assert_clean(engine):
    s = engine.scheduler
    s.check_invariant()
    assert not s.has_work and s.cache.tree.protected_size() == 0
    assert s.cache.available_size() + s.cache.tree.total_size() == s.cache.pool_size


@pytest.fixture(scope="module")
def workload(tiny_llama_path):
    """Three groups sharing a 40-token system prompt, questions of 3-20 tokens, with their
    HF greedy continuations."""
    rng = random.Random(0)
    prompts, lens = [], []
    for _ in range(3):
        system = [rng.randrange(5, 2048) for _ in range(40)]
        for _ in range(4):
            prompts.append(system + [rng.randrange(5, 2048) for _ in range(rng.randint(3, 20))])
            lens.append(rng.randint(4, 12))
    order = list(range(len(prompts)))
    rng.shuffle(order)
    prompts, lens = [prompts[i] for i in order], [lens[i] for i in order]
    return prompts, lens, [hf_greedy(tiny_llama_path, p, n) for p, n in zip(prompts, lens)]


def run_workload(engine, workload):
    prompts, lens, expected = workload
    outs = engine.generate(input_ids=prompts,
                           sampling_params=[{"max_new_tokens": n, **GREEDY} for n in lens])
    for out, want, n in zip(outs, expected, lens):
        assert out["output_ids"] == want
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert_clean(engine)
    return outs


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
def test_greedy_equals_hf_under_every_policy(tiny_llama_path, workload, policy):
    with Engine(tiny_llama_path, schedule_policy=policy, max_total_tokens=4096,
                debug_invariants=True) as engine:
        outs = run_workload(engine, workload)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0  # prefixes were shared


@pytest.mark.parametrize("mixed,page", [(False, 1), (True, 1), (True, 4)])
def test_greedy_equals_hf_with_chunked_prefill(tiny_llama_path, workload, mixed, page):
    with Engine(tiny_llama_path, chunked_prefill_size=16, enable_mixed_chunk=mixed,
                page_size=page, max_total_tokens=4096, debug_invariants=True) as engine:
        run_workload(engine, workload)
        assert (engine.scheduler.stats.num_mixed_batches > 0) == mixed


def test_greedy_equals_hf_through_retraction(tiny_llama_path, workload):
    prompts, _, _ = workload
    lens = [24] * len(prompts)
    expected = [hf_greedy(tiny_llama_path, p, 24) for p in prompts]
    with Engine(tiny_llama_path, max_total_tokens=160, chunked_prefill_size=32,
                debug_invariants=True) as engine:
        run_workload(engine, (prompts, lens, expected))
        assert engine.scheduler.stats.num_retracted > 0


@pytest.fixture(scope="module")
def long_context_llama_path(tmp_path_factory):
    from conftest import TINY
    from radixray.worker.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny-llama-12k")), arch="llama",
                      **{**TINY, "max_position": 12288})


def test_cache_hit_contract(long_context_llama_path):
    """SGLang's end-to-end test, with token ids taken mod 2000 to fit the tiny vocabulary."""
    with Engine(long_context_llama_path, max_total_tokens=24000,
                chunked_prefill_size=2048) as engine:

        def cached(n):
            out = engine.generate(input_ids=[i % 2000 for i in range(n)],
                                  sampling_params={"max_new_tokens": 1, **GREEDY})
            return out["meta_info"]["cached_tokens"]

        assert engine.flush_cache()
        assert [cached(100), cached(10000), cached(10000), cached(1000), cached(11000)] == \
            [0, 100, 9999, 999, 10000]
        assert_clean(engine)


def test_stop_strings_on_text(tiny_llama_path):
    prompt = "def main(args):\n    return"
    with Engine(tiny_llama_path, max_total_tokens=2048) as engine:
        free = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24, **GREEDY})
        text, ids = free["text"], free["output_ids"]
        # A stop string that ends in the middle of the 6th token's text at the earliest.
        upto = engine.tokenizer.decode(ids[:6])
        stop = upto[-3:] if len(upto) >= 3 else upto
        cut = text.find(stop)
        out = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24,
                                                              "stop": stop, **GREEDY})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"] == text[:cut]
        assert out["output_ids"] == ids[: len(out["output_ids"])]
        kept = engine.generate(prompt=prompt, sampling_params={
            "max_new_tokens": 24, "stop": [stop], "no_stop_trim": True, **GREEDY})
        assert kept["text"].startswith(text[:cut] + stop)
        assert_clean(engine)


def test_logprobs_match_hf(tiny_llama_path):
    prompt = [random.Random(1).randrange(5, 2048) for _ in range(30)]
    with Engine(tiny_llama_path, max_total_tokens=2048) as engine:
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, **GREEDY},
                              return_logprob=True, logprob_start_len=10, top_logprobs_num=2)
        meta = out["meta_info"]
        ref = torch.log_softmax(hf_logits(tiny_llama_path, prompt + out["output_ids"]), -1)
        inputs = meta["input_token_logprobs"]
        assert len(inputs) == 20 and inputs[0] == [None, prompt[10], None]
        for k, (lp, tok, text) in enumerate(inputs[1:], start=11):
            assert tok == prompt[k] and text is None
            assert lp == pytest.approx(float(ref[k - 1, tok]), abs=2e-4)
        for j, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
            assert lp == pytest.approx(float(ref[len(prompt) - 1 + j, tok]), abs=2e-4)
        assert [len(t) for t in meta["output_top_logprobs"]] == [2, 2, 2]
        tops = meta["input_top_logprobs"]  # one per input entry, the first null
        assert len(tops) == 20 and tops[0] is None
        for k, top in enumerate(tops[1:], start=11):
            best = ref[k - 1].topk(2)
            assert [t for _, t, _ in top] == best.indices.tolist()
            assert [lp for lp, _, _ in top] == pytest.approx(best.values.tolist(), abs=2e-4)
        # max_new_tokens 0: only fills the cache, still returns input logprobs
        fill = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=28,
                               return_text_in_logprobs=True)
        assert fill["output_ids"] == [] and fill["meta_info"]["completion_tokens"] == 0
        assert len(fill["meta_info"]["input_token_logprobs"]) == 2
        assert isinstance(fill["meta_info"]["input_token_logprobs"][1][2], str)
        # the default logprob_start_len (-1) is the last prompt token, as over HTTP
        last = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1},
                               return_logprob=True)["meta_info"]
        assert last["input_token_logprobs"] == [[None, prompt[-1], None]]
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=30)
        assert_clean(engine)


def test_input_logprobs_across_chunks_equal_an_unchunked_prefill(tiny_llama_path):
    """A prompt prefilled in chunks gets the input logprobs (and tops) of one unchunked
    prefill, the first entry the only null: each chunk's last logits score the next chunk's
    first token. Starts on a seam, inside a chunk, and select()'s ``len - 2`` with
    max_new_tokens 0 (its two entries straddle the last seam); alone, and with a request
    decoding beside the chunks (mixed chunk) under overlap scheduling."""
    rng = random.Random(2)
    cases = [(0, 2), (16, 2), (21, 2), (63, 0)]  # (logprob_start_len, max_new_tokens)
    prompts = [[rng.randrange(5, 2048) for _ in range(65)] for _ in cases]  # fresh: no hits
    busy = [rng.randrange(5, 2048) for _ in range(4)]

    def input_logprobs(**cfg):
        metas = []
        with Engine(tiny_llama_path, max_total_tokens=1024, debug_invariants=True,
                    **cfg) as engine:
            for prompt, (start, new) in zip(prompts, cases):
                outs = engine.generate(
                    input_ids=[busy, prompt], return_logprob=[False, True],
                    sampling_params=[{"max_new_tokens": 12, **GREEDY},
                                     {"max_new_tokens": new, **GREEDY}],
                    logprob_start_len=[-1, start], top_logprobs_num=[0, 3])
                metas.append(outs[1]["meta_info"])
            assert_clean(engine)
        return metas

    want = input_logprobs(chunked_prefill_size=-1)
    for cfg in ({"enable_mixed_chunk": False, "disable_overlap_schedule": True},
                {"enable_mixed_chunk": True, "disable_overlap_schedule": False}):
        got = input_logprobs(chunked_prefill_size=16, **cfg)
        for (start, _), g, w in zip(cases, got, want):
            g_lps, w_lps = g["input_token_logprobs"], w["input_token_logprobs"]
            assert len(g_lps) == 65 - start and [e[0] for e in g_lps].count(None) == 1
            assert g_lps[0][0] is None and [e[1] for e in g_lps] == [e[1] for e in w_lps]
            assert [e[0] for e in g_lps[1:]] == pytest.approx([e[0] for e in w_lps[1:]],
                                                              abs=2e-4), (cfg, start)
            g_tops, w_tops = g["input_top_logprobs"], w["input_top_logprobs"]
            assert len(g_tops) == 65 - start and g_tops[0] is None
            for gt, wt in zip(g_tops[1:], w_tops[1:]):
                assert [e[1] for e in gt] == [e[1] for e in wt]
                assert [e[0] for e in gt] == pytest.approx([e[0] for e in wt], abs=2e-4)


def test_batch_shapes_n_and_ids(tiny_llama_path):
    with Engine(tiny_llama_path, max_total_tokens=2048) as engine:
        long = "import os\nimport sys\n" * 12
        computed = engine.scheduler.stats.prefill_tokens
        outs = engine.generate(prompt=["a b c", long], rid=["first", "second"],
                               sampling_params=[{"max_new_tokens": 2, **GREEDY},
                                                {"max_new_tokens": 3, "n": 2, **GREEDY}])
        assert [o["meta_info"]["id"] for o in outs] == ["first", "second-0", "second-1"]
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3, 3]
        assert outs[1]["output_ids"] == outs[2]["output_ids"]
        # As the HTTP API: the prompt is computed once (a warm-up), each copy recomputes only
        # its last token, and every copy reports the prompt's own hit (none, fresh), where the
        # first copy said 0 and the others the hit it gave them.
        short, n_long = outs[0]["meta_info"], outs[1]["meta_info"]["prompt_tokens"]
        assert engine.scheduler.stats.prefill_tokens - computed == \
            short["prompt_tokens"] - short["cached_tokens"] + n_long + 2
        assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [0, 0]
        again = engine.generate(prompt=long, sampling_params={"max_new_tokens": 1, "n": 3})
        assert [o["meta_info"]["cached_tokens"] for o in again] == [n_long - 1] * 3
        # one rid for a batch names its prompts rid-0, rid-1 (as the HTTP API); it was
        # repeated, and the batch refused as "appears twice"
        outs = engine.generate(prompt=["a", "b"], rid="both", sampling_params=GREEDY)
        assert [o["meta_info"]["id"] for o in outs] == ["both-0", "both-1"]
        assert_clean(engine)


def test_server_argument_errors_name_the_argument(tiny_llama_path):
    with pytest.raises(ValueError, match="^schedule_polcy: unknown server argument"):
        Engine(tiny_llama_path, schedule_polcy="lpm")
    with pytest.raises(ValueError, match="^schedule_policy: "):
        Engine(tiny_llama_path, schedule_policy="sjf")
    with pytest.raises(ValueError, match="^chunked_prefill_size: "):
        Engine(tiny_llama_path, chunked_prefill_size=0)
    with Engine(tiny_llama_path, max_total_tokens=512) as engine:
        with pytest.raises(ValueError, match="^temperature: "):
            engine.generate(input_ids=[1, 2, 3], sampling_params={"temperature": -1})
        with pytest.raises(ValueError, match="^input_ids: "):
            engine.generate(input_ids=list(range(600)))
        with pytest.raises(ValueError, match="^prompt: "):
            engine.generate()
        with pytest.raises(ValueError, match="^input_ids: "):
            engine.generate(input_ids=[[1, 2], []])
        # "" is BOS alone, as in SGLang and the HTTP API: a generation, not an error
        empty = engine.generate(prompt=["a", ""], sampling_params={"max_new_tokens": 2})
        assert empty[1]["meta_info"]["prompt_tokens"] == 1
        assert_clean(engine)
    with Engine(tiny_llama_path, max_total_tokens=4096) as engine:
        # a max_new_tokens the caller set must fit the context (it was silently cut short);
        # the default is cut short at the context's end, as in SGLang
        with pytest.raises(ValueError, match="^max_new_tokens: 100 new tokens after a "
                                             "2000-token prompt exceed the context length"):
            engine.generate(input_ids=[5] * 2000, sampling_params={"max_new_tokens": 100})
        out = engine.generate(input_ids=[5] * 2040, sampling_params={"ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        assert_clean(engine)


def test_overlap_scheduling_gives_the_same_tokens_as_one_batch_at_a_time(tiny_llama_path):
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11]]
    params = [{"max_new_tokens": 20, "temperature": 1.0, "seed": 3},
              {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "seed": 5},
              {"max_new_tokens": 12, "temperature": 0}]
    results = []
    for disable in (False, True):
        with Engine(tiny_llama_path, max_total_tokens=4096,
                    disable_overlap_schedule=disable) as engine:
            assert engine.scheduler.overlap is not disable
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            results.append([o["output_ids"] for o in outs])
            engine.scheduler.check_invariant()
    assert results[0] == results[1]
    assert results[0][2] == hf_greedy(tiny_llama_path, prompts[2], 12)


def test_overlap_defaults_off_for_an_in_process_cpu_runner(tiny_llama_path):
    """Unset, the runner decides: an in-process CPU forward competes with the scheduler for the
    GIL and the cores, so it runs one batch at a time; False forces overlap on."""
    with Engine(tiny_llama_path, max_total_tokens=512) as engine:
        assert engine.runner.overlap_by_default is False
        assert engine.scheduler.overlap is False
        assert engine.server_args["disable_overlap_schedule"] is True
        assert engine.generate(input_ids=[1, 2, 3], sampling_params={
            "max_new_tokens": 3, "temperature": 0})["output_ids"] == hf_greedy(
                tiny_llama_path, [1, 2, 3], 3)
    with pytest.raises(ValueError, match="disable_overlap_schedule"):
        Engine(tiny_llama_path, disable_overlap_schedule="yes")


def test_n_copies_are_seeded_apart_like_the_http_api(tiny_llama_path):
    """Copy i of an n > 1 request samples with seed + i, as /generate's copies do (before, all
    copies shared the seed and came out identical), and the copies' ids share one base."""
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 5}
    with Engine(tiny_llama_path, max_total_tokens=2048) as engine:
        outs = engine.generate(input_ids=[1, 2, 3], sampling_params={**sampled, "n": 3})
        alone = [engine.generate(input_ids=[1, 2, 3], sampling_params={**sampled, "seed": s})
                 for s in (5, 6, 7)]
        assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]
        assert len({tuple(o["output_ids"]) for o in outs}) == 3
        bases = {o["meta_info"]["id"].rsplit("-", 1)[0] for o in outs}
        assert len(bases) == 1 and outs[2]["meta_info"]["id"].endswith("-2")
        assert_clean(engine)


def test_the_largest_seed_with_n_copies_wraps_as_over_http(tiny_llama_path):
    """Copy k took seed + k unwrapped: seed 2**64 - 1 with n = 2 was refused as out of range,
    a seed the caller sent correctly (the HTTP API wraps it)."""
    params = {"max_new_tokens": 3, "temperature": 1.0, "n": 2, "seed": (1 << 64) - 1}
    with Engine(tiny_llama_path, max_total_tokens=2048) as engine:
        outs = engine.generate(input_ids=[1, 2, 3], sampling_params=params)
        wrapped = engine.generate(input_ids=[1, 2, 3], sampling_params={**params, "n": 1,
                                                                        "seed": 0})
        assert outs[1]["output_ids"] == wrapped["output_ids"]  # copy 1: 2**64 wraps to 0


def test_min_new_tokens_holds_back_the_tokenizers_eos_too(tiny_llama_path, tmp_path):
    """The scheduler stops on the config's EOS ids and the tokenizer's; the sampler held back
    only the config's below min_new_tokens, so a model whose tokenizer names another EOS
    ended a request at once with it ([1, 1, 1, 1, 1], min_new_tokens 5)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "other-eos"
    shutil.copytree(tiny_llama_path, path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = 4 if eos != 4 else 5  # not the tokenizer's
    (path / "config.json").write_text(json.dumps(config))
    params = {"max_new_tokens": 12, "min_new_tokens": 5, "temperature": 0,
              "logit_bias": {str(eos): 100.0}}
    with Engine(str(path), max_total_tokens=1024) as engine:
        out = engine.generate(input_ids=[7, 8, 9], sampling_params=params)
    assert eos not in out["output_ids"][:5] and out["output_ids"][5] == eos, out["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_generate_after_shutdown_says_so(tiny_llama_path):
    engine = Engine(tiny_llama_path, max_total_tokens=512)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):  # was an AttributeError on None
        engine.generate(input_ids=[1, 2, 3])
