"""Shared-prefix ("cascade") attention: read a prefix that many requests share once.

Requests that hit the same cached prefix in the radix tree hold the *same KV slots* for it, so
a decode batch of 128 requests built from 8 system prompts holds 8 distinct prefixes, not 128.
Plain attention gathers and reads every request's whole context; cascade attention splits each
request's keys at the shared length ``P`` of its group:

    shared part   all queries of the group (every request, every query head of a KV head)
                  against the group's ``P`` prefix keys, no mask (every query sits after it)
    own part      each request's queries against its keys ``P .. seq_len``, causal

and merges the two softmaxes exactly with their log-sum-exps (the FlashAttention / FlashInfer
"merge state" identity): with ``m = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - m) + out_b * exp(lse_b - m)``.

Two requests share position ``i`` of their prefix exactly when their tables hold the same slot
there (a slot belongs to one tree node, and a node has one path to the root), so the groups are
found from the slot table alone; the scheduler sends nothing extra.

Both parts run as ``PaddedCall``s: many rows (requests, or groups) in one attention call,
queries padded to the longest row's and keys to the longest row's, which on a CPU is far
cheaper than one small call per request. ``buckets`` splits rows whose sizes differ too much.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SHARED_LEN = 32  # shorter shared prefixes are not worth a separate matmul and merge
SCORE_BUDGET = 1 << 26  # attention scores materialised at once off the CPU (float32: 256 MB)


@dataclass
class SharedPrefixGroup:
    members: list[int]  # batch indices of the requests that share the prefix
    length: int  # shared prefix length P (positions 0 .. P-1, all cached before this batch)


def find_shared_prefixes(table: torch.Tensor, candidates: list[int], prefix_lens: list[int],
                         min_len: int = MIN_SHARED_LEN) -> list[SharedPrefixGroup]:
    """Groups of >= 2 ``candidates`` (batch indices) whose rows of ``table`` ([B, L] slots)
    start with the same >= ``min_len`` slots, within their cached prefixes. A group's length is
    the longest prefix all its members share (a tree of deeper branches counts once, at the
    fork nearest the root). A fixed handful of tensor ops, however many groups."""
    firsts = table[:, 0].tolist()
    by_first: dict[int, list[int]] = {}
    for b in candidates:
        if prefix_lens[b] >= min_len:
            by_first.setdefault(firsts[b], []).append(b)
    member_groups = [m for m in by_first.values() if len(m) > 1]
    if not member_groups:
        return []
    dev = table.device
    members = torch.tensor([b for m in member_groups for b in m], device=dev)
    leaders = torch.tensor([m[0] for m in member_groups for _ in m], device=dev)
    group_of = torch.tensor([g for g, m in enumerate(member_groups) for _ in m], device=dev)
    limit = torch.tensor(prefix_lens, device=dev)[members]  # [M] cached positions
    cap = int(limit.max())
    head = table[:, :cap]
    # position of each member's first slot that differs from its group leader's
    differs = ((head.index_select(0, members) != head.index_select(0, leaders))
               | (torch.arange(cap, device=dev)[None, :] >= limit[:, None]))  # [M, cap]
    agree = torch.where(differs.any(1), differs.to(torch.uint8).argmax(1), cap)  # [M]
    lengths = torch.full((len(member_groups),), cap, dtype=agree.dtype, device=dev)
    lengths = lengths.scatter_reduce(0, group_of, agree, "amin").tolist()
    return [SharedPrefixGroup(m, n)
            for m, n in zip(member_groups, lengths) if n >= min_len]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores.

    q: [N, Hkv, R, D] (R query rows per KV head: the query heads of that KV head folded into
    the rows, so K/V are never repeated for grouped-query attention); k, v: [N, Hkv, S, D];
    bias: additive mask in q's dtype (0 = visible, -inf = hidden) broadcastable to
    [N, Hkv, R, S], or None. Returns out [N, Hkv, R, D] and lse [N, Hkv, R].

    On CPU this is torch's fused flash kernel (the one SDPA uses, called directly because SDPA
    does not return the log-sum-exp): 4-7x faster than the three-pass version below, which
    materialises the scores (in chunks of query rows of at most ``SCORE_BUDGET`` elements) and
    serves other devices."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias)
    return attention_with_lse_chunked(q, k, v, bias)


def attention_with_lse_chunked(q, k, v, bias=None, budget: int = SCORE_BUDGET):
    """``attention_with_lse`` in plain matmuls, float32, ``budget`` scores at a time."""
    n, heads, rows, _ = q.shape
    step = max(1, budget // max(n * heads * k.shape[-2], 1))
    out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
    for r in range(0, rows, step):
        scores = (q[:, :, r : r + step].float() @ k.float().transpose(-1, -2)
                  * q.shape[-1] ** -0.5)  # [N, Hkv, rows, S]
        if bias is not None:
            scores = scores + (bias[:, :, r : r + step] if bias.shape[-2] > 1 else bias)
        lse[:, :, r : r + step] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[:, :, r : r + step].unsqueeze(-1))
        out[:, :, r : r + step] = (probs @ v.float()).to(q.dtype)
    return out, lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A + B from attention over A and over B: out [..., D], lse [...]."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
           + out_b * torch.exp(lse_b - lse).unsqueeze(-1))
    return out, lse


def fold_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., N, Hq, D] -> [..., Hkv, N * G, D]: each KV head's G query heads become query rows
    (row ``n * G + g``), so grouped-query attention needs no copies of K and V."""
    *lead, n, heads, dim = x.shape
    group = heads // kv_heads
    x = x.reshape(*lead, n, kv_heads, group, dim).transpose(-4, -3)  # [..., Hkv, N, G, D]
    return x.reshape(*lead, kv_heads, n * group, dim)


def unfold_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``fold_heads``: [..., Hkv, N * G, D] -> [..., N, Hq, D]."""
    *lead, kv_heads, rows, dim = x.shape
    x = x.reshape(*lead, kv_heads, n, rows // n, dim).transpose(-4, -3)  # [..., N, Hkv, G, D]
    return x.reshape(*lead, n, kv_heads * (rows // n), dim)


def buckets(sizes: list[tuple[int, int]], max_waste: float,
            small_call: int = 0) -> list[list[int]]:
    """Split rows of (queries, keys) into padded calls: each call costs (rows x most queries x
    most keys) at most ``max_waste`` x its real query-key pairs, or at most ``small_call``
    pairs (too little work for a second call's fixed cost to pay); a single row always fits.
    Greedy from the largest row: big rows go alone, small ones ride together."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i][0] * sizes[i][1], reverse=True)
    calls: list[list[int]] = []
    most_q = most_k = real = 0  # of the open call
    for i in order:
        q, k = sizes[i]
        if calls:
            new_q, new_k, new_real = max(most_q, q), max(most_k, k), real + q * k
            if (len(calls[-1]) + 1) * new_q * new_k <= max(max_waste * new_real, small_call):
                calls[-1].append(i)
                most_q, most_k, real = new_q, new_k, new_real
                continue
        calls.append([i])
        most_q, most_k, real = q, k, q * k
    return calls


@dataclass
class PaddedCall:
    """One attention call over ``n`` padded rows: requests (each attending to its own keys,
    causally) or shared-prefix groups (all members' queries attending to the group's prefix).
    Queries are padded to ``E`` per row and keys to ``S``."""

    q_index: torch.Tensor  # [n, E] batch token of each padded query (0 for padding)
    q_valid: torch.Tensor  # [n, E] bool
    tokens: torch.Tensor  # [T'] = q_index[q_valid], the batch tokens this call covers
    slots: torch.Tensor  # [n, S] KV slot of each key
    key_lens: torch.Tensor  # [n] keys each row reads (the rest of its S is padding)
    visible: torch.Tensor  # [n, E, S] bool: padded query e of row n may read key s; [n, 1, S]
    # when every query of a row reads the same keys
    _bias: torch.Tensor | None = None

    @classmethod
    def for_requests(cls, table: torch.Tensor, requests: list[int], prefix_lens: list[int],
                     extend_lens: list[int], skip: list[int],
                     starts: list[int]) -> "PaddedCall":
        """Requests' queries against their keys from position ``skip[b]`` (the shared prefix
        read elsewhere) to their end, causally. ``table``: [B, L] slots of the batch."""
        dev = table.device
        pick = torch.tensor(requests, device=dev)
        prefix = torch.tensor([prefix_lens[b] for b in requests], device=dev)
        first = torch.tensor([skip[b] for b in requests], device=dev)
        own = prefix + torch.tensor([extend_lens[b] for b in requests], device=dev) - first
        q_index, q_valid = _pad_queries([range(starts[b], starts[b + 1]) for b in requests], dev)
        s = torch.arange(int(own.max()), device=dev)
        key_pos = first[:, None] + s[None, :]  # [n, S] position of each key
        slots = table[pick[:, None], key_pos.clamp(max=table.shape[1] - 1)]
        q_pos = prefix[:, None] + torch.arange(q_index.shape[1], device=dev)[None, :]  # [n, E]
        visible = ((key_pos[:, None, :] <= q_pos[:, :, None])
                   & (s[None, None, :] < own[:, None, None]))
        # padded query rows read every key: their output is dropped, and a row that reads
        # nothing would be NaN
        return cls(q_index, q_valid, q_index[q_valid], slots, own,
                   visible | ~q_valid[:, :, None])

    @classmethod
    def for_groups(cls, groups: list[SharedPrefixGroup], table: torch.Tensor,
                   starts: list[int]) -> "PaddedCall":
        """All queries of each group's members against the group's prefix."""
        dev = table.device
        q_index, q_valid = _pad_queries(
            [[t for b in g.members for t in range(starts[b], starts[b + 1])] for g in groups],
            dev)
        lengths = torch.tensor([g.length for g in groups], device=dev)
        s = torch.arange(int(lengths.max()), device=dev)
        slots = table[[g.members[0] for g in groups], : len(s)]  # [n, S]
        # every query of a group reads the same keys: one mask row per group, [n, 1, S]
        return cls(q_index, q_valid, q_index[q_valid], slots, lengths,
                   (s[None, :] < lengths[:, None])[:, None])

    def attend(self, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the covered tokens over ``keys``/``values`` ([n, S, Hkv, D], the K/V
        of ``slots``): out [T', Hq, D] and lse [T', Hq]."""
        q_pad = q[self.q_index]  # [n, E, Hq, D]
        length, kv_heads = q_pad.shape[1], keys.shape[2]
        out, lse = attention_with_lse(
            fold_heads(q_pad, kv_heads), keys.transpose(1, 2), values.transpose(1, 2),
            self.bias(q.shape[1] // kv_heads, q.dtype))  # [n, Hkv, E*G, D], [n, Hkv, E*G]
        return (unfold_heads(out, length)[self.q_valid],
                unfold_heads(lse.unsqueeze(-1), length)[self.q_valid][..., 0])

    def bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``visible`` as an additive mask for queries with heads folded into rows
        ([n, 1, E * G or 1, S]); built once per batch (every layer reuses it)."""
        if self._bias is None or self._bias.dtype != dtype:
            n, length, keys = self.visible.shape
            visible = self.visible
            if length > 1:  # row e * G + g is query e's head g
                visible = visible[:, :, None, :].expand(n, length, group, keys)
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._bias = bias.masked_fill_(~visible, float("-inf")).view(n, 1, -1, keys)
        return self._bias


def _pad_queries(rows: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-index lists -> [n, E] index (0-padded) and [n, E] validity."""
    width = max(len(r) for r in rows)
    index = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], device=device)
    valid = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows],
                         device=device)
    return index, valid
