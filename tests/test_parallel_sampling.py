"""n > 1 on the serving path: the prompts' warm-ups run together, and the copies report the
request's real arrival, queue time and cache hit (the warm-up's), against an engine stand-in
whose warm-up takes a known time."""

from __future__ import annotations

import asyncio
import time

from transformers import AutoTokenizer

from radixray.cluster.engine_protocol import GenerateRequest, TokenOutput
from radixray.cluster.generation import ServingContext
from radixray.cluster.parallel_sampling import collect_states, expand_copies
from radixray.worker.sampling_params import SamplingParams

WARMUP_S = 0.6


class SlowWarmupEngine:
    """Warm-ups (max_new_tokens 0) take WARMUP_S and report a cache hit and queue time of their
    own; every other request answers one token at once."""

    def __init__(self):
        self.warmups_running = self.most_warmups_at_once = 0

    async def generate(self, req: GenerateRequest):
        prompt = len(req.input_ids)
        if req.sampling_params.max_new_tokens == 0:
            self.warmups_running += 1
            self.most_warmups_at_once = max(self.most_warmups_at_once, self.warmups_running)
            await asyncio.sleep(WARMUP_S)
            self.warmups_running -= 1
            yield TokenOutput(req.rid, [], True, {"type": "length", "length": 0}, prompt,
                              cached_tokens=3, queue_time=0.25)
        else:
            yield TokenOutput(req.rid, [7], True, {"type": "length", "length": 1}, prompt,
                              cached_tokens=prompt - 1, completion_tokens=1, queue_time=0.001)

    async def abort(self, rid):
        pass


def test_copies_report_the_requests_arrival_queue_time_and_cache_hit(tiny_llama_path):
    engine = SlowWarmupEngine()
    ctx = ServingContext(engine, AutoTokenizer.from_pretrained(tiny_llama_path), "tiny",
                         context_len=2048, vocab_size=2048)
    prompts = [GenerateRequest(f"p{i}", [5 + i] * 10, SamplingParams(max_new_tokens=1, n=2))
               for i in range(3)]
    copies = [expand_copies(p, 2) for p in prompts]
    started = time.perf_counter()
    states = asyncio.run(collect_states(ctx, prompts, copies))
    elapsed = time.perf_counter() - started
    assert engine.most_warmups_at_once == 3  # one after another, three prompts took 3x as long
    assert elapsed < 2 * WARMUP_S
    for state in states:
        # the client waited for the warm-up: its TTFT and latency include it
        assert state.first_token_time - state.start >= WARMUP_S
        assert state.e2e_latency >= WARMUP_S
        assert state.queue_time == 0.25 and state.cached_tokens == 3
