"""Triton kernels against their torch references, on tiny shapes.

Without a GPU the kernels run under TRITON_INTERPRET=1 (see triton_setup.py). Skipped when
triton is not installed. With a GPU the same tests run natively, plus bf16, CUDA-graph and
flashinfer checks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_batch, write_dummy_llama
from triton_setup import CUDA, DEV, DTYPES

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from radixray.kernels import load_attention_backend, pick_attention_backend  # noqa: E402
from radixray.kernels.decode_attention import decode_attention  # noqa: E402
from radixray.kernels.extend_attention import extend_attention  # noqa: E402
from radixray.kernels.sampling import apply_token_bitmask_  # noqa: E402
from radixray.kernels.store_kv import store_kv  # noqa: E402
from radixray.kernels.triton_backend import TritonBackend  # noqa: E402
from radixray.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator  # noqa: E402
from radixray.worker.attention import AttentionMetadata, KVCache, TorchNativeBackend  # noqa: E402
from radixray.worker.forward_batch import ForwardBatch  # noqa: E402
from radixray.worker.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from radixray.worker.vocab_mask import unpack_vocab_mask  # noqa: E402
from radixray.worker.sampling_params import SamplingParams  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _slot_table(rows, lengths, num_slots, max_len, seed=0):
    """A request-to-token table whose rows list distinct, scattered slots (never slot 0)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    table = torch.zeros(max(rows) + 2, max_len, dtype=torch.int64)
    offset = 0
    for row, n in zip(rows, lengths):
        table[row, :n] = perm[offset : offset + n]
        offset += n
    return table.to(DEV)


def _sdpa(q, keys, values, mask=None):
    # q [Hq, M, D]; keys/values [Hkv, N, D] -> [M, Hq, D], float32 reference
    out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def test_store_kv_writes_slots_from_strided_views():
    T, H, D = 7, 2, 24
    fused = torch.randn(T, 3 * H * D, device=DEV)
    k = fused[:, H * D : 2 * H * D].view(T, H, D)  # strided views, as out of the qkv matmul
    v = fused[:, 2 * H * D :].view(T, H, D)
    loc = torch.tensor([5, 1, 9, 12, 3, 30, 2], device=DEV)
    k_buf, v_buf = torch.zeros(32, H, D, device=DEV), torch.zeros(32, H, D, device=DEV)
    store_kv(k_buf, v_buf, loc, k, v)
    ref_k, ref_v = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    ref_k[loc], ref_v[loc] = k, v
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,splits", [(4, 2, 16, 1), (4, 2, 16, 3),
                                                             (3, 3, 24, 2)])
@pytest.mark.parametrize("forced", [True, False])  # False: the device's (autotuned on a GPU)
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, head_dim, splits, forced):
    rows, lengths = [3, 1, 2], [1, 40, 97]  # one context shorter than a split, one spanning many
    torch.manual_seed(0)
    k_buf = torch.randn(200, kv_heads, head_dim, device=DEV, dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    table = _slot_table(rows, lengths, 200, 128)
    q = torch.randn(len(rows), heads, head_dim, device=DEV, dtype=dtype)
    out = decode_attention(q, k_buf, v_buf, table, torch.tensor(rows, device=DEV),
                           torch.tensor(lengths, device=DEV), splits,
                           config=dict(BLOCK_N=16, num_warps=4, num_stages=2) if forced
                           else "autotune" if CUDA else None)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        slots = table[row, :n]
        ref = _sdpa(q[b][:, None], k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1))
        assert torch.allclose(out[b].float(), ref[0], atol=TOL[dtype]), (b, splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_matches_causal_sdpa_over_prefix(dtype):
    heads, kv_heads, head_dim = 4, 2, 16
    rows, prefixes, extends = [2, 5, 1], [0, 37, 5], [20, 3, 45]
    torch.manual_seed(1)
    k_buf = torch.randn(200, kv_heads, head_dim, device=DEV, dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    table = _slot_table(rows, [p + e for p, e in zip(prefixes, extends)], 200, 128)
    q = torch.randn(sum(extends), heads, head_dim, device=DEV, dtype=dtype)
    ext = torch.tensor(extends, device=DEV)
    out = extend_attention(q, k_buf, v_buf, table, torch.tensor(rows, device=DEV),
                           torch.tensor(prefixes, device=DEV), ext, torch.cumsum(ext, 0) - ext,
                           max(extends), block_m=16, block_n=16)
    start = 0
    for row, p, e in zip(rows, prefixes, extends):
        slots = table[row, : p + e]
        causal = (torch.arange(p + e, device=DEV)[None, :]
                  <= torch.arange(p, p + e, device=DEV)[:, None])
        ref = _sdpa(q[start : start + e].transpose(0, 1), k_buf[slots].transpose(0, 1),
                    v_buf[slots].transpose(0, 1), causal)
        assert torch.allclose(out[start : start + e].float(), ref, atol=TOL[dtype]), row
        start += e


def _meta(rows, prefixes, extends, out_loc):
    t = lambda x: torch.tensor(x, device=DEV)  # noqa: E731
    return AttentionMetadata(req_rows=t(rows), prefix_lens=t(prefixes), extend_lens=t(extends),
                             out_cache_loc=t(out_loc), prefix_lens_cpu=list(prefixes),
                             extend_lens_cpu=list(extends),
                             decode_only=all(e == 1 for e in extends))


@pytest.mark.parametrize("decode", [False, True])
def test_triton_backend_equals_torch_native(decode):
    heads, kv_heads, head_dim = 4, 2, 16
    rows, prefixes = [1, 2, 3], [0, 9, 30]
    extends = [1, 1, 1] if decode else [6, 4, 1]  # mixed: prefill, extend on prefix, decode
    caches, outs = [], []
    torch.manual_seed(2)
    q = torch.randn(sum(extends), heads, head_dim, device=DEV)
    k = torch.randn(sum(extends), kv_heads, head_dim, device=DEV)
    v = torch.randn_like(k)
    for backend in (TorchNativeBackend(), TritonBackend(device=DEV)):
        torch.manual_seed(3)  # identical cached prefixes in both caches
        kv = KVCache(1, 128, kv_heads, head_dim, torch.float32, DEV, 4, 64)
        kv.k[0].normal_(), kv.v[0].normal_()
        lengths = [p + e for p, e in zip(prefixes, extends)]
        kv.req_to_token.copy_(_slot_table(rows, lengths, 128, 64, seed=4)[: 5])
        out_loc = [int(kv.req_to_token[r, p + i]) for r, p, e in zip(rows, prefixes, extends)
                   for i in range(e)]
        backend.prepare(_meta(rows, prefixes, extends, out_loc), kv)
        outs.append(backend.forward(0, q, k, v))
        caches.append((kv.k[0], kv.v[0]))
    assert outs[1].shape == outs[0].shape == (sum(extends), heads * head_dim)
    assert torch.allclose(outs[1], outs[0], atol=2e-5)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


def test_token_bitmask_matches_unpacked_reference():
    torch.manual_seed(5)
    batch, vocab = 3, 100  # not a multiple of 32; the mask has a spare word
    logits = torch.randn(batch, vocab, device=DEV)
    mask = torch.randint(-2**31, 2**31 - 1, (batch, 5), dtype=torch.int32, device=DEV)
    mask[1] = -1  # row 1 allows everything
    got = logits.clone()
    apply_token_bitmask_(got, mask)
    want = logits.masked_fill(~unpack_vocab_mask(mask, vocab), float("-inf"))
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])
    with pytest.raises(ValueError, match="vocab_mask"):
        apply_token_bitmask_(got, mask[:, :3])


def test_pick_attention_backend(monkeypatch):
    assert pick_attention_backend("auto", "cpu") == "torch_native"
    assert pick_attention_backend("torch_native", DEV) == "torch_native"
    assert pick_attention_backend("triton", DEV) == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        pick_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        pick_attention_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="flashinfer does not take head_dim 32"):
        pick_attention_backend("flashinfer", "cuda", head_dim=32)
    with pytest.raises(ValueError, match="flashinfer does not take a torch.float32 KV"):
        pick_attention_backend("flashinfer", "cuda", head_dim=128, dtype=torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pick_attention_backend("triton", "cpu")
    if CUDA:
        assert pick_attention_backend("auto", "cuda") in ("flashinfer", "triton")
        # a model FlashInfer cannot take gets triton, not an error
        assert pick_attention_backend("auto", "cuda", head_dim=32) == "triton"
        assert pick_attention_backend("auto", "cuda", 128, torch.float32) == "triton"


# ---------------------------------------------------------------- through the model runner

@pytest.fixture(scope="module")
def dummy_llama(tmp_path_factory):
    return write_dummy_llama(tmp_path_factory.mktemp("dummy_llama_16"), 16)


@pytest.fixture(scope="module")
def dummy_llama_hd64(tmp_path_factory):  # FlashInfer's smallest head_dim
    return write_dummy_llama(tmp_path_factory.mktemp("dummy_llama_64"), 64)


def _runners(model_path, device, dtype, backends):
    """Runners with identical weights, drawn with std 0.2 and norm weights 1, so attention is
    peaked and logits spread (the runner's dummy std 0.02 makes both nearly flat). The GPU
    backends run the fused layer ops, torch_native the torch ones."""
    runners = []
    for name in backends:
        runner = ModelRunner(RunnerConfig(model_path, device=device, dtype=dtype,
                                          attention_backend=name, load_format="dummy",
                                          layer_ops="torch" if name == "torch_native"
                                          else "triton",
                                          max_total_tokens=512, max_running_requests=8,
                                          max_context_len=256))
        torch.manual_seed(0)
        with torch.no_grad():
            for p in runner.model.parameters():
                if p.dim() == 2:
                    p.normal_(std=0.2)
                else:
                    p.fill_(1.0)
        runners.append(runner)
    return runners


def _assert_logits_close(drive, rel_tol):
    ref_all, got_all = drive.logits
    assert len(ref_all) == len(got_all)
    for ref, got in zip(ref_all, got_all):
        assert ref.shape == got.shape
        err = (got - ref).abs().max() / ref.abs().max()
        assert err <= rel_tol, err


class Lockstep:
    """Drives several runners through identical batches (same rows, slots and input tokens)
    and keeps each runner's logits per step."""

    def __init__(self, runners):
        self.runners = runners
        self.rows = ReqToTokenPool(8, 256)
        self.alloc = TokenToKVPoolAllocator(runners[0].max_total_tokens)
        self.logits = [[] for _ in runners]
        for i, runner in enumerate(runners):
            sample = runner.sampler

            def keep(logits, batch, i=i, sample=sample):
                self.logits[i].append(logits.to("cpu", torch.float32, copy=True))
                return sample(logits, batch)

            runner.sampler = keep

    def step(self, work):
        """work: (request dict, prefix_len, carried prefix slots or None)."""
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        ids, pos, rows, plens, elens, out, pslots, pslot_lens = [], [], [], [], [], [], [], []
        for req, prefix, carried in work:
            if "row" not in req:
                req["row"] = self.rows.alloc()
            new = req["ids"][prefix:]
            slots = self.alloc.alloc(len(new))
            ids += new
            pos += range(prefix, len(req["ids"]))
            rows.append(req["row"])
            plens.append(prefix)
            elens.append(len(new))
            out.append(slots)
            pslot_lens.append(0 if carried is None else len(carried))
            if carried is not None:
                pslots.append(carried)
            req["slots"] = torch.cat([carried if carried is not None
                                      else req.get("slots", t([])), slots])
        batch = ForwardBatch(
            input_ids=t(ids), positions=t(pos), req_pool_indices=t(rows), prefix_lens=t(plens),
            extend_lens=t(elens), out_cache_loc=torch.cat(out),
            prefix_slots=torch.cat(pslots) if pslots else t([]), prefix_slot_lens=t(pslot_lens),
            sampling_params=[SamplingParams(temperature=0.0) for _ in work])
        tokens = [runner.forward(batch).next_token_ids.tolist() for runner in self.runners]
        for (req, _, _), tok in zip(work, tokens[0]):
            req["ids"].append(tok)  # every runner continues from the reference's tokens


def test_model_runner_triton_equals_torch_native(dummy_llama):
    assert load_attention_backend("triton")
    runners = _runners(dummy_llama, DEV, "float32", ("torch_native", "triton"))
    assert type(runners[1].attn).__name__ == "TritonBackend"
    drive = Lockstep(runners)
    a, b = {"ids": list(range(3, 40))}, {"ids": [7, 8, 9, 10, 11]}
    drive.step([(a, 0, None), (b, 0, None)])  # prefill
    c = {"ids": a["ids"][:30] + [50, 51, 52]}  # reuses a's first 30 slots
    drive.step([(c, 30, a["slots"][:30]), (a, len(a["ids"]) - 1, None)])  # extend + decode
    for _ in range(2):
        drive.step([(r, len(r["ids"]) - 1, None) for r in (a, b, c)])  # decode
    assert len(drive.logits[1]) == 4
    _assert_logits_close(drive, 1e-5)


# ---------------------------------------------------------------- GPU only

@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("backend,dtype,tol", [("triton", "float32", 1e-4),
                                               ("triton", "bfloat16", 0.1),
                                               ("flashinfer", "bfloat16", 0.1)])
def test_cuda_graph_decode_equals_eager(dummy_llama, dummy_llama_hd64, backend, dtype, tol):
    """A backend under CUDA graphs (batch padded to a captured size) equals torch_native."""
    if not load_attention_backend(backend):
        pytest.skip(f"{backend} not importable")
    from radixray.kernels.cuda_graph import CudaGraphRunner

    model = dummy_llama_hd64 if backend == "flashinfer" else dummy_llama
    runners = _runners(model, "cuda", dtype, ("torch_native", backend))
    drive = Lockstep(runners)
    reqs = [{"ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    drive.step([(r, 0, None) for r in reqs])
    graphs = CudaGraphRunner(runners[1], batch_sizes=(1, 4, 8))

    def replay(batch):  # every decode below replays a graph
        assert graphs.can_run(batch)
        return graphs.forward(batch)

    runners[1].forward = replay
    for _ in range(3):
        drive.step([(r, len(r["ids"]) - 1, None) for r in reqs])  # batch 3, padded to 4
    drive.step([(reqs[0], len(reqs[0]["ids"]) - 1, None)])  # batch 1
    assert len(drive.logits[1]) == 5
    _assert_logits_close(drive, tol)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_graph_resolves_future_references_on_the_device(dummy_llama):
    """Overlap scheduling's decode inputs (-row: the token sampled for that row last step)
    give a graph replay the same logits as the tokens themselves."""
    from radixray.kernels.cuda_graph import CudaGraphRunner

    (runner,) = _runners(dummy_llama, "cuda", "bfloat16", ("triton",))
    drive = Lockstep([runner])
    reqs = [{"ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    drive.step([(r, 0, None) for r in reqs])  # prefill; each request's ids gain its token
    graphs = CudaGraphRunner(runner, batch_sizes=(4,))
    slots = drive.alloc.alloc(len(reqs))

    def decode(ids):  # the same rows, positions and slots each time: replays are idempotent
        n = [len(r["ids"]) - 1 for r in reqs]
        return greedy_batch(ids, n, [r["row"] for r in reqs], n, [1] * len(reqs), slots)

    by_ref = graphs.forward(decode([-r["row"] for r in reqs])).next_token_ids.tolist()
    ref_logits = drive.logits[0][-1]
    by_token = graphs.forward(decode([r["ids"][-1] for r in reqs])).next_token_ids.tolist()
    assert torch.equal(drive.logits[0][-1], ref_logits) and by_ref == by_token
    assert runner.future_tokens[[r["row"] for r in reqs]].tolist() == by_token
    with pytest.raises(RuntimeError, match="before it was written"):
        graphs.forward(decode([-7, reqs[1]["ids"][-1], reqs[2]["ids"][-1]]))  # row 7: unused


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_forward_output_leaves_the_gpu_worker_on_the_cpu():
    """What a TP worker returns through Ray must unpickle in the scheduler's CPU-only actor."""
    from radixray.worker.forward_batch import ForwardOutput

    out = ForwardOutput(next_token_ids=torch.tensor([3, 4], device="cuda"),
                        next_token_logprobs=torch.tensor([-0.5, -1.0], device="cuda"))
    assert out.start_host_copy()() is out
    assert out.next_token_ids.device.type == "cpu" and out.next_token_ids.tolist() == [3, 4]
    assert out.next_token_logprobs.device.type == "cpu"
