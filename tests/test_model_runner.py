"""ModelRunner equals HF transformers, token for token, through prefill, extend-on-prefix and
decode, for both architectures. Batches are driven by hand here (no scheduler) so a failure
points at the runner."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import hf_greedy, hf_logits
from radixray.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixray.worker.forward_batch import ForwardBatch
from radixray.worker.model_runner import ModelRunner, RunnerConfig
from radixray.worker.sampling_params import SamplingParams

LOGIT_TOL = 2e-4  # float32 on CPU; the runner and HF sum in different orders


class Req:
    def __init__(self, ids):
        self.ids = list(ids)  # all tokens so far (prompt + generated)
        self.row = None
        self.slots = torch.empty(0, dtype=torch.int64)  # slots of ids[:cached]
        self.out = []


class Driver:
    """Minimal hand-rolled slot bookkeeping: enough to build every kind of ForwardBatch."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows = ReqToTokenPool(runner.max_running_requests, runner.max_context_len)
        self.alloc = TokenToKVPoolAllocator(runner.max_total_tokens)
        self.captured = []
        sampler = runner.sampler

        def capture(logits, batch):
            self.captured.append(logits.clone())
            return sampler(logits, batch)

        runner.sampler = capture

    def step(self, work: list[tuple[Req, int, torch.Tensor | None]], future: bool = False):
        """work: (req, prefix_len, carried prefix slots or None). Computes ids[prefix_len:].
        ``future``: decode inputs go as overlap scheduling's references (-row) to the token
        the runner sampled last for that row, instead of the token itself."""
        ids, pos, rows, plens, elens, out, pslots, pslot_lens = [], [], [], [], [], [], [], []
        for req, prefix, carried in work:
            if req.row is None:
                req.row = self.rows.alloc()
            new = req.ids[prefix:]
            slots = self.alloc.alloc(len(new))
            ids += [-req.row] if future and len(new) == 1 else new
            pos += list(range(prefix, len(req.ids)))
            rows.append(req.row)
            plens.append(prefix)
            elens.append(len(new))
            out.append(slots)
            if carried is not None:
                pslots.append(carried)
                pslot_lens.append(len(carried))
                req.slots = torch.cat([carried, slots])
            else:
                pslot_lens.append(0)
                req.slots = torch.cat([req.slots, slots])
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(
            input_ids=t(ids), positions=t(pos), req_pool_indices=t(rows), prefix_lens=t(plens),
            extend_lens=t(elens), out_cache_loc=torch.cat(out),
            prefix_slots=torch.cat(pslots) if pslots else torch.empty(0, dtype=torch.int64),
            prefix_slot_lens=t(pslot_lens),
            sampling_params=[SamplingParams(temperature=0.0) for _ in work])
        result = self.runner.forward(batch)
        for (req, _, _), tok in zip(work, result.next_token_ids.tolist()):
            req.out.append(tok)
        return result


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(params=["llama", "qwen2"])
def model_path(request, tiny_llama_path, tiny_qwen2_path):
    return tiny_llama_path if request.param == "llama" else tiny_qwen2_path


def test_prefill_then_decode_equals_hf(model_path):
    runner = ModelRunner(RunnerConfig(model_path, max_total_tokens=4096, max_running_requests=16))
    driver = Driver(runner)
    prompts = _prompts(8, runner.model_config.vocab_size, seed=1)
    reqs = [Req(p) for p in prompts]
    driver.step([(r, 0, None) for r in reqs])  # one prefill batch of 8 mixed-length prompts
    last_logits = driver.captured[-1]
    for i, p in enumerate(prompts):
        ref = hf_logits(model_path, p)[-1]
        assert torch.allclose(last_logits[i], ref, atol=LOGIT_TOL), (i, (last_logits[i] - ref).abs().max())
    steps = 12
    for _ in range(steps - 1):
        for r in reqs:
            r.ids.append(r.out[-1])
        driver.step([(r, len(r.ids) - 1, None) for r in reqs])  # decode batch
    for r, p in zip(reqs, prompts):
        assert r.out == hf_greedy(model_path, p, steps)


def test_future_token_references_resolve_to_the_last_sampled_token(tiny_llama_path):
    runner = ModelRunner(RunnerConfig(tiny_llama_path, max_total_tokens=1024,
                                      max_running_requests=8))
    driver = Driver(runner)
    prompts = _prompts(3, runner.model_config.vocab_size, seed=4)
    reqs = [Req(p) for p in prompts]
    driver.step([(r, 0, None) for r in reqs])
    for _ in range(5):
        for r in reqs:
            r.ids.append(r.out[-1])
        driver.step([(r, len(r.ids) - 1, None) for r in reqs], future=True)
    for r, p in zip(reqs, prompts):
        assert r.out == hf_greedy(tiny_llama_path, p, 6)
    # a reference to a row nothing was sampled for is a scheduler bug, caught on the host
    stray = Req([5])
    stray.row = driver.rows.alloc()
    with pytest.raises(RuntimeError, match="before it was written"):
        driver.step([(stray, 0, None)], future=True)


def test_extend_on_cached_prefix_and_mixed_batch(model_path):
    runner = ModelRunner(RunnerConfig(model_path, max_total_tokens=4096, max_running_requests=16))
    driver = Driver(runner)
    vocab = runner.model_config.vocab_size
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(30)]
    first = Req(shared + [5, 6, 7])
    driver.step([(first, 0, None)])
    # Two requests reuse the first one's KV for the shared 30 tokens (slots carried, not
    # recomputed), while a third request decodes in the same batch.
    a, b = Req(shared + [11, 12]), Req(shared[:20] + [13, 14, 15, 16])
    first.ids.append(first.out[-1])
    driver.step([(a, 30, first.slots[:30]), (b, 20, first.slots[:20]),
                 (first, len(first.ids) - 1, None)])
    logits = driver.captured[-1]
    for i, req in enumerate([a, b, first]):
        ref = hf_logits(model_path, req.ids)[-1]
        assert torch.allclose(logits[i], ref, atol=LOGIT_TOL)
    for _ in range(6):
        for r in (a, b):
            r.ids.append(r.out[-1])
        driver.step([(r, len(r.ids) - 1, None) for r in (a, b)])
    assert a.out == hf_greedy(model_path, shared + [11, 12], 7)
    assert b.out == hf_greedy(model_path, shared[:20] + [13, 14, 15, 16], 7)


def test_input_logprobs_match_hf(tiny_llama_path):
    runner = ModelRunner(RunnerConfig(tiny_llama_path, max_total_tokens=1024))
    driver = Driver(runner)
    ids = _prompts(1, runner.model_config.vocab_size, seed=3)[0] + [9, 10, 11]
    req = Req(ids)
    batch_start = 2
    original = driver.runner.forward

    def with_logprobs(batch):
        batch.input_logprob_starts = torch.tensor([batch_start])
        return original(batch)

    driver.runner.forward = with_logprobs
    out = driver.step([(req, 0, None)])
    got = out.input_token_logprobs[0]
    ref = torch.log_softmax(hf_logits(tiny_llama_path, ids), -1)
    want = torch.stack([ref[j, ids[j + 1]] for j in range(batch_start, len(ids) - 1)])
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=LOGIT_TOL)


def test_a_chunk_scores_the_prompt_token_after_it(tiny_llama_path):
    """A chunk that stops inside the prompt also returns the logprob (and tops) of the token
    after it from its last logits (``next_prompt_ids``): the next chunk cannot compute it."""
    runner = ModelRunner(RunnerConfig(tiny_llama_path, max_total_tokens=1024))
    driver = Driver(runner)
    ids = _prompts(1, runner.model_config.vocab_size, seed=4)[0] + [9, 10, 11, 12]
    cut, start = len(ids) - 3, 1
    chunk = Req(ids[:cut])
    original = driver.runner.forward

    def with_seam(batch):
        batch.input_logprob_starts = torch.tensor([start])
        batch.top_logprobs_num = torch.tensor([2])
        batch.next_prompt_ids = torch.tensor([ids[cut]])
        return original(batch)

    driver.runner.forward = with_seam
    out = driver.step([(chunk, 0, None)])
    ref = torch.log_softmax(hf_logits(tiny_llama_path, ids), -1)
    want = torch.stack([ref[j, ids[j + 1]] for j in range(start, cut)])  # the last: ids[cut]
    assert torch.allclose(out.input_token_logprobs[0], want, atol=LOGIT_TOL)
    values, top_ids = out.input_top_logprobs[0]
    assert values.shape == (cut - start, 2)
    best = ref[cut - 1].topk(2)
    assert top_ids[-1].tolist() == best.indices.tolist()
    assert torch.allclose(values[-1], best.values, atol=LOGIT_TOL)


def test_context_longer_than_the_model_positions_is_refused(tiny_llama_path):
    with pytest.raises(ValueError, match="context_length: .* max_position_embeddings"):
        ModelRunner(RunnerConfig(tiny_llama_path, max_total_tokens=64,
                                 max_context_len=10 ** 6))
