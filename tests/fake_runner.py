"""A stand-in model runner that makes every slot-bookkeeping bug visible in the outputs.

``FakeRunner`` keeps what a real worker keeps: a "KV" array (``kv[slot]`` = the token id whose
K/V sit in that slot) and a mirror of the request-to-token table, updated exactly by the
``ForwardBatch`` slot rule (carried prefixes are written, new tokens go to ``out_cache_loc``).
The next token is a hash of the whole context *read back through the slots*, so a request
that reads a slot holding another token (freed too early, shared wrongly, not carried after
its row changed) generates different tokens than ``reference_tokens`` computes from the plain
token sequence. Reading a slot nobody wrote raises.
"""

from __future__ import annotations

import torch

from radixray.worker.forward_batch import ForwardBatch, ForwardOutput

VOCAB = 1000
_MAX_CONTEXT = 1 << 15
_W = torch.randint(1, 1 << 20, (_MAX_CONTEXT,), generator=torch.Generator().manual_seed(7))


def _prefix_hashes(ctx: torch.Tensor) -> torch.Tensor:
    """hash(ctx[:k + 1]) for every k: position-weighted sums (no overflow: < 2^46)."""
    return torch.cumsum((ctx + 1) * _W[: len(ctx)], 0)


def _mix(h: int) -> int:
    """Scramble a context hash (a plain sum mod vocab would settle into a fixed point)."""
    return (h * 0x9E3779B97F4A7C15 >> 29) & 0x7FFFFFFF


def next_token(ctx: list[int] | torch.Tensor, vocab: int = VOCAB) -> int:
    ctx = torch.as_tensor(ctx, dtype=torch.int64)
    return _mix(int(_prefix_hashes(ctx)[-1])) % vocab


def fake_logprob(prefix_hash: int, token: int) -> float:
    """A deterministic 'logprob' of ``token`` after a context with hash ``prefix_hash``."""
    return -(((_mix(prefix_hash) * 31 + token) % 997) / 100.0)


def reference_tokens(prompt: list[int], max_new_tokens: int, vocab: int = VOCAB,
                     eos: int | None = None) -> list[int]:
    """What an unbatched, uncached run generates (greedy), stopping at ``eos``."""
    ctx, out = list(prompt), []
    for _ in range(max_new_tokens):
        tok = next_token(ctx, vocab)
        out.append(tok)
        ctx.append(tok)
        if tok == eos:
            break
    return out


def reference_input_logprobs(prompt: list[int], start: int) -> list[tuple]:
    """SGLang's layout: positions start.., first value None."""
    hashes = _prefix_hashes(torch.tensor(prompt)).tolist()
    return [(None, prompt[start])] + [(fake_logprob(hashes[k - 1], prompt[k]), prompt[k])
                                      for k in range(start + 1, len(prompt))]


class FakeRunner:
    def __init__(self, max_total_tokens: int = 4096, max_running_requests: int = 64,
                 max_context_len: int = 16384, page_size: int = 1, vocab: int = VOCAB,
                 host_pool_tokens: int = 0):
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.vocab = vocab
        num_slots = (max_total_tokens // page_size + 1) * page_size
        self.kv = torch.full((num_slots,), -1, dtype=torch.int64)
        # hierarchical cache: the host tier, same fake KV (token id per slot)
        self.host_pool_tokens = host_pool_tokens
        self.host_kv = torch.full(((host_pool_tokens // page_size + 1) * page_size,), -1,
                                  dtype=torch.int64)
        self.tokens_stored = self.tokens_loaded = 0
        self.table = torch.zeros((max_running_requests + 1, max_context_len), dtype=torch.int64)
        self.future = torch.full((max_running_requests + 1,), -1, dtype=torch.int64)  # per row
        self.batches: list[ForwardBatch] = []
        self.keep_batches = False
        self.num_forward = 0
        self.tokens_computed = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.num_forward += 1
        if self.keep_batches:
            self.batches.append(batch)
        if batch.kv_store is not None:  # tier copies first: stores, then loads
            device, host = batch.kv_store
            assert bool((self.kv[device] >= 0).all()), "stored a device slot never written"
            self.host_kv[host] = self.kv[device]
            self.tokens_stored += len(host)
        if batch.kv_load is not None:
            host, device = batch.kv_load
            assert bool((self.host_kv[host] >= 0).all()), "loaded a host slot never written"
            self.kv[device] = self.host_kv[host]
            self.tokens_loaded += len(host)
        n = batch.batch_size
        assert int(batch.extend_lens.sum()) == batch.num_tokens == len(batch.out_cache_loc)
        assert len(batch.sampling_params) == n and len(batch.prefix_slot_lens) == n
        assert int(batch.prefix_slot_lens.sum()) == len(batch.prefix_slots)
        assert bool((batch.out_cache_loc > 0).all()), "slot 0 is padding"
        assert len(set(batch.out_cache_loc.tolist())) == batch.num_tokens, "slot used twice"
        assert len(set(batch.req_pool_indices.tolist())) == n, "row used twice"
        self.tokens_computed += batch.num_tokens

        # The slot rule: write carried prefixes, then each request's new slots, then the KV.
        p_off = t_off = 0
        for i in range(n):
            row, prefix, extend = (int(batch.req_pool_indices[i]), int(batch.prefix_lens[i]),
                                   int(batch.extend_lens[i]))
            carried = int(batch.prefix_slot_lens[i])
            assert carried in (0, prefix), "a carried prefix must be whole"
            if prefix == 0:
                self.future[row] = -1  # the row's new owner has sampled nothing yet
            if carried:
                self.table[row, :prefix] = batch.prefix_slots[p_off : p_off + carried]
                p_off += carried
            self.table[row, prefix : prefix + extend] = batch.out_cache_loc[t_off : t_off + extend]
            positions = batch.positions[t_off : t_off + extend]
            assert torch.equal(positions, torch.arange(prefix, prefix + extend)), "positions"
            t_off += extend
        input_ids = batch.input_ids.clone()  # resolve overlap's future references (-row)
        future = input_ids < 0
        input_ids[future] = self.future[-input_ids[future]]
        assert bool((input_ids >= 0).all()), "a future token read before it was sampled"
        self.kv[batch.out_cache_loc] = input_ids

        next_ids, logprobs, tops, input_lps = [], [], [], []
        t_off = 0
        for i in range(n):
            row, prefix, extend = (int(batch.req_pool_indices[i]), int(batch.prefix_lens[i]),
                                   int(batch.extend_lens[i]))
            ctx = self.kv[self.table[row, : prefix + extend]]
            if bool((ctx < 0).any()):
                raise RuntimeError(f"request row {row} read a slot that was never written")
            hashes = _prefix_hashes(ctx)
            tok = _mix(int(hashes[-1])) % self.vocab
            next_ids.append(tok)
            logprobs.append(fake_logprob(int(hashes[-1]), tok))
            k = int(batch.top_logprobs_num[i]) if batch.top_logprobs_num is not None else 0
            tops.append((torch.tensor([logprobs[-1] - j for j in range(k)]),
                         torch.tensor([(tok + j) % self.vocab for j in range(k)]))
                        if k > 0 else None)
            start = (int(batch.input_logprob_starts[i])
                     if batch.input_logprob_starts is not None else -1)
            if start >= 0:
                h = hashes.tolist()
                lps = [fake_logprob(h[prefix + j], int(ctx[prefix + j + 1]))
                       for j in range(start, extend - 1)]
                next_id = (int(batch.next_prompt_ids[i])
                           if batch.next_prompt_ids is not None else -1)
                if next_id >= 0:  # a chunk: its last logits score the next chunk's first token
                    lps.append(fake_logprob(h[-1], next_id))
                input_lps.append(torch.tensor(lps, dtype=torch.float32))
            else:
                input_lps.append(None)
            t_off += extend
        self.future[batch.req_pool_indices] = torch.tensor(next_ids, dtype=torch.int64)
        return ForwardOutput(
            next_token_ids=torch.tensor(next_ids, dtype=torch.int64),
            next_token_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            top_logprobs=tops,
            input_token_logprobs=input_lps if batch.input_logprob_starts is not None else None)


class OverlapFakeRunner(FakeRunner):
    """FakeRunner with the overlap interface: ``submit`` runs the batch at once (a very fast
    worker) and ``result`` hands its output back later, so the scheduler builds batch N+1
    before it has seen batch N's tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_flight = 0
        self.max_in_flight = 0

    def submit(self, batch: ForwardBatch) -> ForwardOutput:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return self.forward(batch)

    def result(self, handle: ForwardOutput) -> ForwardOutput:
        self.in_flight -= 1
        return handle


def run_random_workload(sched, rng, make_prompt, *, steps: int, max_reqs: int,
                        max_new: int) -> None:
    """Drive ``sched`` through a random workload and check every output.

    Each step may add a request (``make_prompt(rng)`` -> (prompt, extendable prefix or None);
    the prefix joins the bases later prompts start from), abort a live one, and step. At the
    end the scheduler drains, the memory invariant holds, and every request that was not
    aborted generated exactly ``reference_tokens``."""
    from radixray.scheduler.request import Req
    from radixray.worker.sampling_params import SamplingParams

    reqs, outs, aborted = [], {}, set()

    def collect():
        for o in sched.step():
            outs[o.rid] += o.new_token_ids

    for _ in range(steps):
        if rng.random() < 0.3 and len(reqs) < max_reqs:
            prompt = make_prompt(rng)
            reqs.append(Req(f"r{len(reqs)}", prompt,
                            SamplingParams(max_new_tokens=rng.randrange(1, max_new))))
            outs[reqs[-1].rid] = []
            sched.add_request(reqs[-1])
        if rng.random() < 0.03 and sched.live:
            rid = rng.choice(sorted(sched.live))
            aborted.add(rid)
            sched.abort(rid)
        collect()
    while sched.has_work:
        collect()
    sched.check_invariant()
    for r in reqs:
        if r.rid not in aborted and r.finish_reason.type != "abort":
            assert outs[r.rid] == reference_tokens(r.origin_input_ids,
                                                   r.sampling_params.max_new_tokens), r.rid
