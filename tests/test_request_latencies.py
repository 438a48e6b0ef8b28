"""What a request records in the latency histograms (generation.run_request), against an engine
stand-in with known timings: TTFT starts at the first token computed after the prefill, not at
text a grammar forces before it; a request the client cuts is recorded up to the cut; one the
engine refuses is not recorded."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from radixray.cluster.engine_protocol import GenerateRequest, TokenOutput
from radixray.cluster.api_errors import APIError
from radixray.cluster.generation import ServingContext, run_request
from radixray.worker.sampling_params import SamplingParams

PREFILL_S = 0.3


class ScriptedEngine:
    """A grammar's forced opening at once (no queue_time yet: not admitted), then one token per
    call after a prefill of PREFILL_S; prompts of token 0 are refused."""

    def __init__(self, forced: list[int], tokens: int):
        self.forced, self.tokens = forced, tokens

    async def generate(self, req: GenerateRequest):
        if req.input_ids[0] == 0:
            raise ValueError("input_ids: refused")
            yield  # an async generator
        if self.forced:
            yield TokenOutput(req.rid, list(self.forced), prompt_tokens=len(req.input_ids))
        await asyncio.sleep(PREFILL_S)
        for k in range(self.tokens):
            last = k == self.tokens - 1
            yield TokenOutput(req.rid, [40 + k], last,
                              {"type": "length", "length": self.tokens} if last else None,
                              len(req.input_ids), queue_time=0.01)
            await asyncio.sleep(0.01)

    async def abort(self, rid):
        pass


class Recorder:
    def __init__(self):
        self.seen = []

    def observe_request(self, ttft, itl_list, e2e, queue_time):
        self.seen.append((ttft, list(itl_list), e2e, queue_time))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def serve(tokenizer, engine, prompt=(5, 6, 7), read=None, metrics=None):
    metrics = metrics or Recorder()
    ctx = ServingContext(engine, tokenizer, "tiny", context_len=2048, vocab_size=2048,
                         metrics=metrics)
    req = GenerateRequest("r", list(prompt), SamplingParams(max_new_tokens=8))

    async def client():
        states = run_request(ctx, req)
        try:
            async for state in states:
                if read is not None and len(state.output_ids) >= read:
                    break  # the client hangs up
        finally:
            await states.aclose()

    asyncio.run(client())
    return metrics.seen


def test_ttft_starts_after_the_prefill_not_at_a_grammars_forced_opening(tokenizer):
    (ttft, itl, e2e, queue), = serve(tokenizer, ScriptedEngine(forced=[11, 12, 13], tokens=3))
    assert ttft >= PREFILL_S  # was ~0: the forced `{"name":` went out before the prefill
    assert len(itl) == 2 and max(itl) < PREFILL_S  # the prefill is not an inter-token gap
    assert queue == 0.01 and e2e >= ttft


def test_an_answer_the_grammar_forces_whole_has_a_first_token(tokenizer):
    """It never runs a prefill (no queue_time): its TTFT was missing from the histogram."""
    class Forced(ScriptedEngine):
        async def generate(self, req):
            yield TokenOutput(req.rid, [11, 12], True, {"type": "stop", "matched": 2},
                              len(req.input_ids))

    (ttft, itl, e2e, queue), = serve(tokenizer, Forced(forced=[], tokens=0))
    assert ttft is not None and ttft <= e2e and queue is None


def test_a_request_the_client_cuts_is_recorded_up_to_the_cut(tokenizer):
    (ttft, itl, e2e, queue), = serve(tokenizer, ScriptedEngine(forced=[], tokens=8), read=2)
    assert ttft >= PREFILL_S and len(itl) == 1 and queue == 0.01
    assert PREFILL_S <= e2e < PREFILL_S + 0.5


def test_a_refused_request_records_nothing(tokenizer):
    metrics = Recorder()
    with pytest.raises(APIError):
        serve(tokenizer, ScriptedEngine(forced=[], tokens=1), prompt=(0, 1), metrics=metrics)
    assert metrics.seen == []
    serve(tokenizer, ScriptedEngine(forced=[], tokens=1), metrics=metrics)
    assert len(metrics.seen) == 1
