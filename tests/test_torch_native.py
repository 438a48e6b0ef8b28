"""The torch_native attention backend's CPU machinery (worker/attention.py,
cascade_attention.py, kv_stage.py) against plain per-request SDPA: padded-call buckets,
shared-prefix groups merged by log-sum-exp, staged decode keys across steps, bfloat16."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from radixray.worker.attention import AttentionMetadata, KVCache, TorchNativeBackend
from radixray.worker.cascade_attention import (attention_with_lse, attention_with_lse_chunked,
                                               buckets)


@pytest.mark.parametrize("sizes, waste, small, expected", [
    ([(1, 10), (1, 10), (1, 10)], 2.0, 0, [[0, 1, 2]]),  # equal rows: no padding at all
    ([(1, 100), (1, 10), (1, 10), (1, 10)], 2.0, 0, [[0, 1], [2, 3]]),  # 3 x 100 > 2 x 120
    ([(1, 100), (1, 10), (1, 10)], 2.0, 300, [[0, 1, 2]]),  # small enough to pad anyway
    ([(30, 30), (1, 5), (1, 5)], float("inf"), 0, [[0, 1, 2]]),
    ([(30, 30), (1, 5), (1, 5)], 0.0, 0, [[0], [1], [2]]),  # a single row always fits
])
def test_buckets_keep_padding_within_the_waste_bound(sizes, waste, small, expected):
    assert buckets(sizes, waste, small) == expected


def test_buckets_cover_every_row_once_within_the_bound():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [(rng.choice([1, 1, 4, 32, 128]), rng.randrange(1, 3000))
                 for _ in range(rng.randrange(1, 40))]
        calls = buckets(sizes, 2.0)
        assert sorted(i for c in calls for i in c) == list(range(len(sizes)))
        for c in calls:
            padded = len(c) * max(sizes[i][0] for i in c) * max(sizes[i][1] for i in c)
            assert len(c) == 1 or padded <= 2.0 * sum(sizes[i][0] * sizes[i][1] for i in c)


@pytest.mark.parametrize("prefixes, extends, shared, pad_waste, calls", [
    # calls: (own-key calls, shared-prefix calls, fresh prompts run alone)
    ([0, 9, 30], [6, 4, 1], [0, 0, 0], 0.0, (2, 0, 1)),  # no padding allowed: one call each
    ([0, 9, 30], [6, 4, 1], [0, 0, 0], float("inf"), (1, 0, 1)),
    ([12, 9, 30], [6, 4, 1], [0, 0, 0], float("inf"), (1, 0, 0)),
    ([0, 0, 0], [5, 5, 5], [0, 0, 0], 2.0, (0, 0, 3)),  # fresh prompts of one length
    # requests whose tables start with the same slots (one cached system prompt): the prefix
    # is read once per group and merged with each request's own keys
    ([40, 45, 60, 40, 33], [1, 1, 1, 1, 1], [40, 40, 40, 40, 0], 2.0, (2, 1, 0)),  # decode
    ([40, 45, 60, 40, 50], [3, 5, 1, 2, 4], [40, 36, 36, 40, 0], float("inf"), (1, 1, 0)),
    ([40, 45, 60, 35, 50], [3, 5, 1, 2, 4], [40, 40, 0, 35, 35], float("inf"), (1, 1, 0)),
    # a long extend goes into a call of its own (padding the others to it would not pay)
    ([40, 45, 40], [1, 1, 30], [40, 40, 40], 2.0, (2, 1, 0)),
    # a group far bigger than another: their prefixes are read in separate calls
    ([40, 40, 40, 40, 300, 300], [1, 1, 1, 1, 1, 1], [40, 40, 40, 40, 0, 300], 2.0, (1, 2, 0)),
])
def test_torch_native_paths_equal_per_request_causal_sdpa(prefixes, extends, shared, pad_waste,
                                                          calls):
    """``shared[i]``: how many leading slots request i takes from the group of earlier
    requests with the same first slot (0: a table of its own)."""
    heads, kv_heads, dim = 4, 2, 8
    rows = list(range(1, len(prefixes) + 1))
    torch.manual_seed(0)
    kv = KVCache(1, 1024, kv_heads, dim, torch.float32, "cpu", len(rows) + 1, 512)
    kv.k[0].normal_(), kv.v[0].normal_()
    perm, used, leader = torch.randperm(1023) + 1, 0, None
    for row, n, s in zip(rows, [p + e for p, e in zip(prefixes, extends)], shared):
        if s and leader is not None and s <= int((kv.req_to_token[leader] > 0).sum()):
            kv.req_to_token[row, :s] = kv.req_to_token[leader, :s]
        else:
            s, leader = 0, row
        kv.req_to_token[row, s:n] = perm[used : used + n - s]
        used += n - s
    out_loc = [int(kv.req_to_token[r, p + i]) for r, p, e in zip(rows, prefixes, extends)
               for i in range(e)]
    q = torch.randn(sum(extends), heads, dim)
    k, v = torch.randn(sum(extends), kv_heads, dim), torch.randn(sum(extends), kv_heads, dim)
    t = torch.tensor
    backend = TorchNativeBackend()
    backend.PAD_WASTE, backend.SMALL_CALL = pad_waste, 0  # split by the waste rule alone
    backend.prepare(AttentionMetadata(t(rows), t(prefixes), t(extends), t(out_loc), prefixes,
                                      extends, decode_only=set(extends) == {1}), kv)
    out = backend.forward(0, q, k, v)
    assert (len(backend.own_calls), len(backend.shared_calls), len(backend.fresh)) == calls
    start = 0
    for row, p, e in zip(rows, prefixes, extends):
        slots = kv.req_to_token[row, : p + e]
        causal = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        ref = F.scaled_dot_product_attention(
            q[start : start + e].transpose(0, 1), kv.k[0][slots].transpose(0, 1),
            kv.v[0][slots].transpose(0, 1), attn_mask=causal, enable_gqa=True)
        assert torch.allclose(out[start : start + e], ref.transpose(0, 1).reshape(e, -1),
                              atol=1e-5)
        start += e


def test_staged_decode_keys_equal_gathered_keys_across_steps():
    """Decode steps reuse the K/V gathered at the first step (own keys grow by one per row,
    the shared prefix stays); a request leaving drops its row, one joining makes the call
    gather afresh. Every step must equal plain causal attention over each request's slots."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    kv = KVCache(2, 1024, kv_heads, dim, torch.float32, "cpu", 8, 256)
    for buf in kv.k + kv.v:
        buf.normal_()
    free = iter(range(1, 1024))
    shared = [next(free) for _ in range(40)]
    rows, lens = [1, 2, 3, 4, 5], [45, 50, 41, 12, 30]
    for row, n in zip(rows, lens):
        own = [next(free) for _ in range(n - (40 if row <= 3 else 0))]
        kv.req_to_token[row, :n] = torch.tensor((shared if row <= 3 else []) + own)
    backend, t = TorchNativeBackend(), torch.tensor
    modes = []
    for step in range(7):
        if step == 3:  # the request in row 2 (the longest) finishes
            rows, lens = [r for r in rows if r != 2], [n for r, n in zip(rows, lens) if r != 2]
        if step == 5:  # a request joins in row 6
            kv.req_to_token[6, :20] = torch.tensor([next(free) for _ in range(20)])
            rows, lens = rows + [6], lens + [20]
        loc = [next(free) for _ in rows]
        for row, n, slot in zip(rows, lens, loc):
            kv.req_to_token[row, n] = slot
        backend.prepare(AttentionMetadata(t(rows), t(lens), t([1] * len(rows)), t(loc), lens,
                                          [1] * len(rows), decode_only=True), kv)
        modes.append({name[0]: entry.fill for name, entry in backend.stage.entries.items()})
        for layer in range(2):
            q = torch.randn(len(rows), heads, dim)
            k, v = torch.randn(len(rows), kv_heads, dim), torch.randn(len(rows), kv_heads, dim)
            out = backend.forward(layer, q, k, v)
            for i, (row, n) in enumerate(zip(rows, lens)):
                slots = kv.req_to_token[row, : n + 1]
                ref = F.scaled_dot_product_attention(
                    q[i : i + 1].transpose(0, 1), kv.k[layer][slots].transpose(0, 1),
                    kv.v[layer][slots].transpose(0, 1), enable_gqa=True)
                assert torch.allclose(out[i], ref.transpose(0, 1).reshape(-1), atol=1e-5)
        lens = [n + 1 for n in lens]
    # own keys: gathered at the first step and when a request joins, kept otherwise (the
    # leaving request's row dropped); the shared prefix keeps its keys throughout
    assert [m["own"] for m in modes] == [True, False, False, False, False, True, False]
    assert [m["shared"] for m in modes] == [True, False, False, False, False, False, False]


@pytest.mark.parametrize("budget", [1 << 26, 3 * 2 * 40 * 3])  # one chunk; 3 rows a chunk
@pytest.mark.parametrize("per_row_mask", [True, False])
def test_chunked_attention_with_lse_equals_the_cpu_kernel(budget, per_row_mask):
    """The matmul path (devices other than the CPU) against the fused CPU kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 10, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    visible = torch.rand(3, 1, 10 if per_row_mask else 1, 40) > 0.3
    visible[..., 0] = True
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    out, lse = attention_with_lse(q, k, v, bias)
    out2, lse2 = attention_with_lse_chunked(q, k, v, bias, budget)
    assert torch.allclose(out, out2, atol=1e-5) and torch.allclose(lse, lse2, atol=1e-5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_staged_decode_under_random_leaves_and_joins(seed):
    """Random decode runs over shared prefixes with requests leaving and joining (through an
    extend step, as the scheduler does, or straight into a decode step): every step equals
    plain attention over each request's slots."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    kv = KVCache(1, 4096, kv_heads, dim, torch.float32, "cpu", 40, 256)
    kv.k[0].normal_(), kv.v[0].normal_()
    free = iter(torch.randperm(4095).add(1).tolist())
    prefixes = [[next(free) for _ in range(rng.randrange(32, 80))] for _ in range(3)]
    backend, t = TorchNativeBackend(), torch.tensor
    live: dict[int, int] = {}  # table row -> tokens with K/V
    spare = list(range(1, 40))

    def join():
        row = spare.pop(rng.randrange(len(spare)))
        shared = rng.choice(prefixes + [[]])
        own = [next(free) for _ in range(rng.randrange(1, 20))]
        kv.req_to_token[row, : len(shared) + len(own)] = torch.tensor(shared + own)
        live[row] = len(shared) + len(own)

    for _ in range(6):
        join()
    staged_steps = 0
    for _ in range(40):
        if rng.random() < 0.15 and len(live) > 1:  # a request leaves (its row is not reused)
            live.pop(rng.choice(sorted(live)))
        extend_step = rng.random() < 0.1 and spare
        if rng.random() < 0.15 and spare:
            join()
        rows = sorted(live)
        lens = [live[r] for r in rows]
        loc = [next(free) for _ in rows]
        for row, n, slot in zip(rows, lens, loc):
            kv.req_to_token[row, n] = slot
        backend.prepare(AttentionMetadata(t(rows), t(lens), t([1] * len(rows)), t(loc), lens,
                                          [1] * len(rows), decode_only=not extend_step), kv)
        staged_steps += any(not e.fill for e in backend.stage.entries.values())
        q = torch.randn(len(rows), heads, dim)
        k, v = torch.randn(len(rows), kv_heads, dim), torch.randn(len(rows), kv_heads, dim)
        out = backend.forward(0, q, k, v)
        for i, (row, n) in enumerate(zip(rows, lens)):
            slots = kv.req_to_token[row, : n + 1]
            ref = F.scaled_dot_product_attention(
                q[i : i + 1].transpose(0, 1), kv.k[0][slots].transpose(0, 1),
                kv.v[0][slots].transpose(0, 1), enable_gqa=True)
            assert torch.allclose(out[i], ref.transpose(0, 1).reshape(-1), atol=1e-5)
        for row in rows:
            live[row] += 1
    assert staged_steps > 10  # the staged path ran


@pytest.mark.parametrize("extends", [[1, 1, 1], [3, 1, 5]], ids=["decode", "extend"])
def test_cascade_in_bfloat16_matches_float_attention(extends):
    """bfloat16 KV: the shared-prefix merge runs in float32 and writes back in bfloat16."""
    torch.manual_seed(0)
    kv = KVCache(1, 1024, 2, 64, torch.bfloat16, "cpu", 8, 256)
    kv.k[0].normal_(), kv.v[0].normal_()
    rows, prefixes, shared, nxt = [1, 2, 3], [120, 130, 110], list(range(1, 101)), 200
    for row, p, e in zip(rows, prefixes, extends):
        kv.req_to_token[row, : p + e] = torch.tensor(shared + list(range(nxt, nxt + p + e - 100)))
        nxt += p + e
    out_loc = [int(kv.req_to_token[r, p + i]) for r, p, e in zip(rows, prefixes, extends)
               for i in range(e)]
    t = torch.tensor
    backend = TorchNativeBackend()
    backend.prepare(AttentionMetadata(t(rows), t(prefixes), t(extends), t(out_loc), prefixes,
                                      extends, decode_only=set(extends) == {1}), kv)
    total = sum(extends)
    q = torch.randn(total, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out = backend.forward(0, q, k, v)
    assert len(backend.shared_calls) == 1 and out.dtype == torch.bfloat16
    start = 0
    for row, p, e in zip(rows, prefixes, extends):
        slots = kv.req_to_token[row, : p + e]
        causal = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        ref = F.scaled_dot_product_attention(
            q[start : start + e].float().transpose(0, 1), kv.k[0][slots].float().transpose(0, 1),
            kv.v[0][slots].float().transpose(0, 1), attn_mask=causal, enable_gqa=True)
        assert torch.allclose(out[start : start + e].float(),
                              ref.transpose(0, 1).reshape(e, -1), atol=2e-2)
        start += e
