"""A GPU step never waits for the GPU: the sampler and the model runner decide everything from
host values and copy host tensors to the device without blocking, so under overlap scheduling
the next batch is queued while the previous one still runs.

On the CPU the sampler is checked for reads of tensor values back to the host (on a GPU each is
a stream sync); with a GPU, torch's sync debug mode turns any synchronising call (a blocking
copy, ``.item()``, ``nonzero``) into an error for the sampler, an eager prefill and a CUDA-graph
decode step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import greedy_batch, sampling_batch, write_dummy_llama
from torch.utils._python_dispatch import TorchDispatchMode

from radixray.worker.sampler import Sampler
from radixray.worker.sampling_params import SamplingParams

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a GPU")
EOS, VOCAB = 2, 2048  # above TOP_CANDIDATES: the CPU's partial ranking runs


class HostReads(TorchDispatchMode):
    """Records ops that read tensor values back to the host: ``item`` / ``bool()``, ``nonzero``
    and indexing by a boolean mask (which runs ``nonzero``)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if func is torch.ops.aten.index.Tensor else []
        if func in self.READS or any(i is not None and i.dtype == torch.bool for i in indices):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def mixed_batch():
    """One request of each kind the sampler treats differently."""
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_new_tokens=2),  # EOS blocked: not the argmax
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(top_p=0.9),  # top-p alone: the partial ranking's fallback case
        SamplingParams(min_p=0.1, seed=7),
        SamplingParams(top_k=10, top_p=0.5, logit_bias={"1": 5.0}),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(min_new_tokens=3),  # the grammar allows only EOS: EOS stays
    ]
    mask = torch.full((len(params), VOCAB // 32), -1, dtype=torch.int32)
    mask[7] = 0
    mask[7, EOS // 32] = 1 << (EOS % 32)
    history = [None] * 6 + [([4, 5], [5, 6, 6])] + [None]
    batch = sampling_batch(params, output_lens=[0] * len(params), history=history,
                           vocab_mask=mask)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, EOS] = 50.0
    return logits, batch


def test_the_sampler_decides_from_host_values():
    logits, batch = mixed_batch()
    with HostReads() as mode:
        out = Sampler(eos_token_ids=[EOS], seed=3, full_sort=True)(logits, batch)
    assert mode.reads == []
    ids = out.next_token_ids.tolist()
    assert ids[1] != EOS and ids[7] == EOS and ids[0] == int(logits[0].argmax())
    # the CPU's partial ranking filters exactly as the full sort does: the same draws
    partial = Sampler(eos_token_ids=[EOS], seed=3, full_sort=False)(logits, batch)
    assert partial.next_token_ids.tolist() == ids


def test_flashinfer_page_lists_are_built_from_host_lengths():
    """FlashInfer's page lists (kernels/page_lists.py): each request's slots in order, without
    a boolean mask (whose size only the device knows) or other host reads."""
    from radixray.kernels.page_lists import page_lists

    table = torch.randint(1, 1000, (6, 40))
    rows, lens = torch.tensor([4, 0, 2]), [7, 1, 33]
    with HostReads() as mode:
        indptr, indices, last = page_lists(table, rows, lens)
    assert mode.reads == []
    assert indptr.tolist() == [0, 7, 8, 41] and last.tolist() == [1, 1, 1]
    assert indices.dtype == torch.int32
    want = [slot for r, n in zip(rows.tolist(), lens) for slot in table[r, :n].tolist()]
    assert indices.tolist() == want


@gpu
def test_the_sampler_never_waits_for_the_gpu():
    logits, batch = mixed_batch()
    want = Sampler(eos_token_ids=[EOS], seed=3)(logits, batch).next_token_ids.tolist()
    logits = logits.cuda()
    sampler = Sampler(eos_token_ids=[EOS], seed=3)
    sampler(logits, batch)  # warm-up: the generator, kernels, cached tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = out.next_token_ids.tolist()
    assert got[1] != EOS and got[7] == EOS and got[0] == want[0]


@gpu
def test_prefill_and_graph_decode_never_wait_for_the_gpu(tmp_path):
    from radixray.worker.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(write_dummy_llama(tmp_path), device="cuda",
                                      dtype="bfloat16", attention_backend="triton",
                                      load_format="dummy", max_total_tokens=512,
                                      max_running_requests=8, max_context_len=256))
    assert runner.graphs is not None
    sampled = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=4),
               SamplingParams(temperature=0)]
    rows, lens = [1, 2, 3], [5, 9, 3]
    slots = torch.arange(1, 1 + sum(lens) + 3 * len(rows))

    def prefill(first_row):
        ids = [t % 100 + 3 for t in range(sum(lens))]
        batch = greedy_batch(ids, [p for n in lens for p in range(n)],
                             [r + first_row for r in rows], [0] * 3, lens, slots[:sum(lens)])
        return dataclasses.replace(batch, sampling_params=sampled)

    def decode(step, first_row):
        at = [n + step for n in lens]
        batch = greedy_batch([-(r + first_row) for r in rows], at,
                             [r + first_row for r in rows], at, [1] * 3,
                             slots[sum(lens) + 3 * step:][:3])
        return dataclasses.replace(batch, sampling_params=sampled)

    runner.forward(prefill(0))  # warm-up: compiles the kernels, captures nothing new
    runner.forward(decode(0, 0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.forward(prefill(3))
        for step in range(2):
            assert runner.graphs.can_run(decode(step, 3))
            out = runner.forward(decode(step, 3))
        wait = out.start_host_copy()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(wait().next_token_ids.tolist()) == 3
