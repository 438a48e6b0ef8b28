"""Batched next-token sampling over per-request parameters, plus logprob helpers.

For each request ``i`` of a batch, the logits row goes through, in this order:

1. ``vocab_mask`` (grammar bitmask, see vocab_mask.py): disallowed tokens get -inf.
2. ``logit_bias``: ``logit[t] += bias[t]``.
3. penalties. Repetition (HF style) over prompt + output tokens: a seen token's positive logit
   is divided by the penalty, a negative one multiplied. Then frequency / presence (OpenAI
   style) over output tokens only: ``logit[t] -= freq * count[t] + presence * (count[t] > 0)``.
4. ``min_new_tokens``: while ``output_lens[i] < min_new_tokens`` the EOS ids and
   ``stop_token_ids`` get -inf (unless that would leave no allowed token: the grammar wins).
5. greedy rows (``params.is_greedy``) take the argmax of the adjusted logits.
6. other rows: divide by temperature, then top-k, top-p, min-p, each filter acting on the
   distribution the previous one left (renormalised), then sample.

Sampling uses the exponential race: ``argmax(logit - log(E))`` with ``E ~ Exp(1)`` per token
draws exactly from ``softmax(logit)``. A request with ``seed`` draws its ``E`` from a generator
seeded by ``(seed, output_lens[i])`` alone, so its tokens do not depend on its batch-mates;
unseeded rows share the sampler's own generator.

Logprobs are always those of the model's raw distribution ``log_softmax(logits)``, before any
step above (temperature, penalties, bias, grammar mask), so they compare across requests and
with the model itself. SGLang by default reports them after those steps instead (its
``SGLANG_RETURN_ORIGINAL_LOGPROB`` gives raw ones); at temperature 0 or 1 with no penalties,
bias or grammar the two agree.

On a GPU a sampling step never waits for the device: every decision (which filters run, how
many candidates to rank) is taken from the host-side parameters, and host values reach the
device through ``host_copy.to_device`` (a blocking copy would wait for the whole forward pass
queued before it, and overlap scheduling would lose its head start).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .forward_batch import ForwardBatch, ForwardOutput
from .host_copy import to_device
from .sampling_params import SamplingParams
from .vocab_mask import apply_vocab_mask_, check_vocab_mask

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
TOP_CANDIDATES = 1024  # tokens ranked before falling back to a full-vocabulary sort


# ---------------------------------------------------------------- pure helpers (reusable)

def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of ``target_ids[n]`` under ``log_softmax(logits[n])``: [N, V], [N] -> [N] float32."""
    x = logits.float()
    picked = x.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logprobs per row, descending: [N, V] -> (values [N, k] float32, ids)."""
    x = logits.float()
    # sorted descending; logprobs share the logits' order. A k past the vocabulary: all of it
    values, ids = x.topk(min(k, x.shape[-1]), dim=-1)
    return values - torch.logsumexp(x, dim=-1, keepdim=True), ids


def apply_penalties(logits: torch.Tensor, rows: list[int],
                    histories: list[tuple[list[int], list[int]]],
                    repetition: list[float], frequency: list[float],
                    presence: list[float]) -> None:
    """Penalise ``logits[rows[r]]`` in place given each row's (prompt ids, output ids).

    Repetition first (over prompt + output, HF style), then frequency/presence (over output
    only, OpenAI style); see the module docstring for the exact formulas.
    """
    vocab, device = logits.shape[1], logits.device
    row_index = to_device(rows, device)
    sub = logits[row_index]  # a copy, written back at the end
    rep_r, rep_t, cnt_r, cnt_t = [], [], [], []
    for r, (prompt, output) in enumerate(histories):
        if repetition[r] != 1.0:
            seen = list(prompt) + list(output)
            rep_r += [r] * len(seen)
            rep_t += seen
        if frequency[r] != 0.0 or presence[r] != 0.0:
            cnt_r += [r] * len(output)
            cnt_t += list(output)
    for ids in (rep_t, cnt_t):
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            raise ValueError(f"penalty_history: token ids must be in [0, {vocab})")
    if rep_t:
        seen = torch.zeros_like(sub, dtype=torch.bool)
        seen[to_device(rep_r, device), to_device(rep_t, device)] = True
        pen = to_device(repetition, device, sub.dtype).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    if cnt_t:
        counts = torch.zeros_like(sub)
        counts.index_put_((to_device(cnt_r, device), to_device(cnt_t, device)),
                          torch.ones(len(cnt_t), device=device), accumulate=True)
        freq = to_device(frequency, device, sub.dtype).unsqueeze(1)
        pres = to_device(presence, device, sub.dtype).unsqueeze(1)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[row_index] = sub


def filter_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p,
                  full_sort: bool | None = None) -> torch.Tensor:
    """Temperature-scale [S, V] logits and set tokens outside top-k / top-p / min-p to -inf.

    Per-row host values [S] (lists or CPU tensors; what filters run is decided from them, not
    from the device): top_k <= 0 means off, top_p >= 1 off, min_p 0 off. Top-p keeps the
    shortest most-likely prefix whose mass (after top-k, renormalised) reaches top_p. Min-p
    drops tokens with probability below ``min_p * max probability``. ``full_sort`` (see
    ``_top_k_top_p``): rows with top-p but no top-k sort the whole vocabulary, rather than
    rank the best candidates and check on the device whether they sufficed (None: on any
    device but the CPU). Returns a new tensor.
    """
    device, vocab = logits.device, logits.shape[1]
    temperature, top_p, min_p = (_host_list(v, float) for v in (temperature, top_p, min_p))
    top_k = _host_list(top_k, int)
    use_k = [0 < k < vocab for k in top_k]
    k = [k if use else vocab for k, use in zip(top_k, use_k)]
    use_p = [p < 1.0 for p in top_p]
    x = logits / to_device(temperature, device).unsqueeze(1)
    if any(use_k) or any(use_p):
        full_sort = device.type != "cpu" if full_sort is None else full_sort
        x = _top_k_top_p(x, use_k, k, use_p, top_p, full_sort)
    if any(p > 0 for p in min_p):
        # Renormalising does not change ratios to the max, so min-p can use these probs.
        probs = x.softmax(dim=-1)
        floor = (probs.max(dim=-1, keepdim=True).values
                 * to_device(min_p, device, probs.dtype).unsqueeze(1))
        x = x.masked_fill(probs < floor, _NEG_INF)
    return x


def _host_list(values, kind) -> list:
    return [kind(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _top_k_top_p(x: torch.Tensor, use_k: list[bool], k: list[int], use_p: list[bool],
                 top_p: list[float], full_sort: bool) -> torch.Tensor:
    """The top-k and top-p part of ``filter_logits``, on the tokens ranked by one sort.

    The ranking covers the best ``m`` tokens (``topk``): the largest top-k when every row
    that filters has one. A row with top-p alone needs its nucleus ranked, of unknown size:
    a full sort of the vocabulary is slow on the CPU, so there (``full_sort`` False) the best
    TOP_CANDIDATES are ranked and everything is sorted only if some nucleus spills past them
    (their mass stays below top_p). That check reads the device; on a GPU the sort is cheap
    and waiting is not, so there (``full_sort``) such a batch sorts everything at once.
    ``k`` [S] holds each row's top-k, ``vocab`` where top-k is off.
    """
    vocab, device = x.shape[1], x.device
    probs = x.softmax(dim=-1)
    p_only = [p and not use for p, use in zip(use_p, use_k)]
    m = max((n for n, use in zip(k, use_k) if use), default=0)
    if any(p_only):
        m = vocab if full_sort else max(m, TOP_CANDIDATES)
    m = min(m, vocab)
    if m < vocab:
        ranked, order = x.topk(m, dim=-1)
        if any(p_only):
            short = probs.gather(1, order).sum(dim=-1) < to_device(top_p, device)
            if bool((short & to_device(p_only, device)).any()):
                m = vocab
    if m == vocab:  # stable: ties keep the lower token id first
        ranked, order = x.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(m, device=device)
    beyond_k = pos >= to_device(k, device).unsqueeze(1)
    ranked = ranked.masked_fill(beyond_k, _NEG_INF)
    if any(use_p):
        p_ranked = probs.gather(1, order).masked_fill(beyond_k, 0.0)
        # Renormalise over the top-k survivors; rows without top-k keep the full-vocab mass.
        p_ranked = p_ranked / torch.where(to_device(use_k, device), p_ranked.sum(dim=-1),
                                          1.0).unsqueeze(1)
        mass_before = p_ranked.cumsum(dim=-1) - p_ranked
        # a top_p below float32's smallest normal (1e-50) would round to 0 there and mask the
        # top token too (every token became id 0): any such top_p keeps the top token alone
        tiny = torch.finfo(p_ranked.dtype).tiny
        p = to_device([max(t, tiny) if use else math.inf for t, use in zip(top_p, use_p)],
                      device, p_ranked.dtype)
        ranked = ranked.masked_fill(mass_before >= p.unsqueeze(1), _NEG_INF)  # top token stays
    filtered = torch.full_like(x, _NEG_INF).scatter_(1, order, ranked)
    # Rows without top-k or top-p were ranked only to share the batch's tensors: keep them whole.
    untouched = to_device([not (a or b) for a, b in zip(use_k, use_p)], device)
    return torch.where(untouched.unsqueeze(1), x, filtered)


def seed_for_step(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, output position), splitmix64-mixed so that
    nearby pairs such as (1, 2) and (2, 1) give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# ---------------------------------------------------------------- the sampler

class Sampler:
    """Turns a batch's last-position logits into next tokens (and logprobs when asked).

    ``eos_token_ids``: the model's EOS ids, blocked while a request is below min_new_tokens.
    ``seed``: seeds the generator shared by unseeded requests (None: nondeterministic).
    ``full_sort``: see ``filter_logits`` (None: by device).
    """

    def __init__(self, eos_token_ids: Iterable[int] | int | None = None, seed: int | None = None,
                 full_sort: bool | None = None):
        if eos_token_ids is None:
            eos_token_ids = []
        elif isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self._seed = seed
        self.full_sort = full_sort
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: ForwardBatch) -> ForwardOutput:
        """Sample one token per request. Leaves ``logits`` untouched; the returned tensors live
        on the logits' device except ``top_logprobs``, which are CPU tensors.
        Advances the shared generator when unseeded requests sample."""
        params = batch.sampling_params
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits: expected shape [{len(params)}, V], got {list(logits.shape)}")
        out_lens = self._output_lens(batch)
        greedy = [p.is_greedy for p in params]
        if all(greedy) and not self._needs_adjust(params, batch, out_lens):
            next_ids = logits.argmax(dim=-1)  # the fast path: nothing else to do
        else:
            adjusted = self.adjust_logits(logits, batch)
            sample_rows = [i for i, g in enumerate(greedy) if not g]
            if len(sample_rows) == len(params):
                next_ids = self._sample(adjusted, params, out_lens)
            else:
                next_ids = adjusted.argmax(dim=-1)
                if sample_rows:
                    rows = to_device(sample_rows, logits.device)
                    next_ids[rows] = self._sample(adjusted[rows], [params[i] for i in sample_rows],
                                                  [out_lens[i] for i in sample_rows])
        out = ForwardOutput(next_token_ids=next_ids)
        if batch.return_logprob is not None and bool(batch.return_logprob.any()):
            self._fill_logprobs(out, logits, batch)
        return out

    def adjust_logits(self, logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Steps 1-4 of the module docstring: a new float32 [B, V] tensor, ``logits`` untouched."""
        params = batch.sampling_params
        x = logits.to(torch.float32, copy=True)
        batch_size, vocab = x.shape
        device = x.device
        if batch.vocab_mask is not None:
            check_vocab_mask(batch.vocab_mask, batch_size, vocab)  # on the host
            apply_vocab_mask_(x, to_device(batch.vocab_mask, device),
                              checked=True)

        bias_r, bias_t, bias_v = [], [], []
        for i, p in enumerate(params):
            for tok, val in (p.logit_bias or {}).items():
                bias_r.append(i)
                bias_t.append(int(tok))
                bias_v.append(float(val))
        if bias_t:
            if not (0 <= min(bias_t) and max(bias_t) < vocab):
                raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
            x.index_put_((to_device(bias_r, device), to_device(bias_t, device)),
                         to_device(bias_v, device), accumulate=True)

        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            history = batch.penalty_history
            missing = [i for i in pen_rows if i >= len(history) or history[i] is None]
            if missing:
                raise ValueError(f"penalty_history: request {missing[0]} has penalties but no "
                                 "token history")
            apply_penalties(x, pen_rows, [history[i] for i in pen_rows],
                            [float(params[i].repetition_penalty) for i in pen_rows],
                            [float(params[i].frequency_penalty) for i in pen_rows],
                            [float(params[i].presence_penalty) for i in pen_rows])

        self._block_stop_tokens(x, params, self._output_lens(batch))
        return x

    # ------------------------------------------------------------ internals

    def _block_stop_tokens(self, x: torch.Tensor, params: list[SamplingParams],
                           out_lens: list[int]) -> None:
        """min_new_tokens: set EOS and stop_token_ids to -inf in rows still below the minimum,
        except in rows where that would forbid every token (a grammar allowing only EOS)."""
        vocab, device = x.shape[1], x.device
        rows, toks = [], []
        for i, p in enumerate(params):
            if out_lens[i] < p.min_new_tokens:
                stops = set(self.eos_token_ids) | {int(t) for t in p.stop_token_ids}
                stops = sorted(t for t in stops if 0 <= t < vocab)
                rows += [i] * len(stops)
                toks += stops
        if not toks:
            return
        index = (to_device(rows, device), to_device(toks, device))
        saved = x[index]
        x[index] = _NEG_INF
        row_ids = sorted(set(rows))
        dead = torch.isneginf(x[to_device(row_ids, device)]).all(dim=-1)  # [len(row_ids)]
        # put back the stop tokens of dead rows; decided on the device, so no sync
        position = {r: j for j, r in enumerate(row_ids)}
        entry_row = to_device([position[r] for r in rows], device)
        x[index] = torch.where(dead[entry_row], saved, _NEG_INF)

    def _needs_adjust(self, params: list[SamplingParams], batch: ForwardBatch,
                      out_lens: list[int]) -> bool:
        return (batch.vocab_mask is not None
                or any(p.logit_bias or p.has_penalties for p in params)
                or any(n < p.min_new_tokens for p, n in zip(params, out_lens)))

    @staticmethod
    def _output_lens(batch: ForwardBatch) -> list[int]:
        if batch.output_lens is None:
            return [0] * len(batch.sampling_params)
        return [int(n) for n in batch.output_lens.tolist()]

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def _sample(self, x: torch.Tensor, params: list[SamplingParams],
                out_lens: list[int]) -> torch.Tensor:
        """Draw one token per row of adjusted logits x [S, V] (rows are non-greedy)."""
        device = x.device
        filtered = filter_logits(
            x, [p.temperature for p in params], [p.top_k for p in params],
            [p.top_p for p in params], [p.min_p for p in params], self.full_sort)
        # Exponential race: argmax(logit - log E), E ~ Exp(1), is a draw from softmax(logit).
        # E = -log U with U uniform, because torch's exponential_ is several times slower.
        uniform = torch.empty_like(filtered)
        unseeded = [r for r, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            uniform.uniform_(generator=self._generator(device))
        elif unseeded:
            uniform[to_device(unseeded, device)] = torch.rand(
                len(unseeded), x.shape[1], device=device, generator=self._generator(device))
        for r, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed_for_step(p.seed, out_lens[r]))
                uniform[r].uniform_(generator=gen)
        # The clamp keeps U == 0 (E == inf) harmless and stops a U rounding to 1 (E == 0) from
        # turning an excluded -inf token into a NaN.
        exp = uniform.log_().neg_().clamp_min_(1e-30)
        return (filtered - exp.log_()).argmax(dim=-1)

    def _fill_logprobs(self, out: ForwardOutput, logits: torch.Tensor,
                       batch: ForwardBatch) -> None:
        """Set out.next_token_logprobs [B] and out.top_logprobs (raw distribution)."""
        out.next_token_logprobs = token_logprobs(logits, out.next_token_ids)
        wanted = batch.return_logprob.tolist()
        nums = (batch.top_logprobs_num.tolist() if batch.top_logprobs_num is not None
                else [0] * len(wanted))
        ks = [min(int(k), logits.shape[1]) if w else 0 for w, k in zip(wanted, nums)]
        if max(ks) <= 0:
            out.top_logprobs = [None] * len(ks)
            return
        values, ids = top_logprobs(logits, max(ks))
        values, ids = values.cpu(), ids.cpu()  # one transfer, then per-request slices
        out.top_logprobs = [(values[i, :k], ids[i, :k]) if k > 0 else None
                            for i, k in enumerate(ks)]
