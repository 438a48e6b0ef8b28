"""Sampler: filters never leak excluded tokens, draws follow the filtered distribution, logit
transforms match their definitions, seeds reproduce across batch compositions, logprobs are the
raw model's."""

import math

import pytest
import torch
from helpers import sampling_batch

from radixray.worker.sampler import (Sampler, filter_logits, seed_for_step, token_logprobs,
                                     top_logprobs)
from radixray.worker.sampling_params import SamplingParams
from radixray.worker.vocab_mask import unpack_vocab_mask

EOS = 3
# The sampler's own tests run on CPU; where a GPU is present the key ones also run on it.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def draw(logits_row, params, n=4000, seed=0, device="cpu"):
    """n independent draws from one logits row: a batch of n identical requests."""
    sampler = Sampler(eos_token_ids=[EOS], seed=seed)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous().to(device)
    out = sampler(logits, sampling_batch([params] * n))
    return torch.bincount(out.next_token_ids.cpu(), minlength=logits_row.numel())


def reference_distribution(logits_row, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Plain-Python statement of the documented filters, independent of the implementation."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    keep = order if top_k <= 0 else order[:top_k]
    total = sum(probs[t] for t in keep)
    if top_p < 1.0:
        mass, kept = 0.0, []
        for t in keep:
            if mass >= top_p:
                break
            kept.append(t)
            mass += probs[t] / total
        keep = kept
    top = max(probs)
    keep = {t for t in keep if probs[t] >= min_p * top}
    z = sum(probs[t] for t in keep)
    return torch.tensor([probs[t] / z if t in keep else 0.0 for t in range(len(probs))])


def assert_matches(counts, expected):
    """Chi-square goodness of fit at roughly p = 1e-4 (Wilson-Hilferty critical value)."""
    n = counts.sum().item()
    support = expected > 0
    assert counts[~support].sum() == 0, f"excluded tokens drawn: {counts[~support].tolist()}"
    exp = expected[support].double() * n
    chi2 = float(((counts[support].double() - exp) ** 2 / exp).sum())
    dof = max(int(support.sum()) - 1, 1)
    z = 3.72
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit:.1f}; counts {counts.tolist()}"


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])


# ---------------------------------------------------------------- filters and distributions

@pytest.mark.parametrize("kw, excludes", [
    (dict(), False),
    (dict(temperature=0.5), False),
    (dict(top_k=3), True),
    (dict(top_p=0.6), True),
    (dict(min_p=0.3), True),
    (dict(temperature=1.7, top_k=6, top_p=0.85, min_p=0.05), True),
])
@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_filtered_distribution(kw, excludes, device):
    counts = draw(LOGITS, SamplingParams(**kw), n=6000, device=device)
    expected = reference_distribution(LOGITS, **kw)
    assert bool((expected == 0).any()) == excludes  # the case tests what it claims
    assert_matches(counts, expected)


def test_filters_never_emit_excluded_tokens_over_many_draws():
    torch.manual_seed(1)
    logits = torch.randn(200) * 3
    for kw in (dict(top_k=5), dict(top_p=0.3), dict(min_p=0.2)):
        counts = draw(logits, SamplingParams(**kw), n=20000, seed=2)
        allowed = reference_distribution(logits, **kw) > 0
        assert counts[~allowed].sum() == 0, kw
        assert counts[allowed].sum() == 20000


def test_filter_logits_acts_per_row():
    torch.manual_seed(0)
    x = torch.randn(4, 50)
    out = filter_logits(x, torch.tensor([1.0, 0.5, 2.0, 1.0]), torch.tensor([-1, 4, -1, 2]),
                        torch.tensor([1.0, 1.0, 0.5, 0.9]), torch.tensor([0.0, 0.0, 0.0, 0.5]))
    assert torch.equal(out[0], x[0])  # every filter off, temperature 1
    kept = torch.isfinite(out[1]).nonzero().flatten()
    assert sorted(kept.tolist()) == sorted(x[1].topk(4).indices.tolist())
    assert torch.allclose(out[1, kept], x[1, kept] / 0.5)
    assert torch.equal(torch.isfinite(out[2]),
                       reference_distribution(x[2], temperature=2.0, top_p=0.5) > 0)
    assert torch.equal(torch.isfinite(out[3]),
                       reference_distribution(x[3], top_k=2, top_p=0.9, min_p=0.5) > 0)


@pytest.mark.parametrize("scale", [6.0, 0.5])  # peaked: nucleus in the top candidates; flat: not
@pytest.mark.parametrize("device", DEVICES)
def test_filter_logits_large_vocab_matches_reference(scale, device):
    torch.manual_seed(3)
    v = 3000  # above TOP_CANDIDATES, so the partial ranking and its fallback both run
    x = torch.randn(5, v) * scale
    rows = [dict(top_p=0.9), dict(top_k=1500, top_p=0.95), dict(top_k=40), dict(),
            dict(temperature=0.7, top_p=0.8, min_p=0.01)]
    vec = lambda key, off: torch.tensor([r.get(key, off) for r in rows], device=device)
    out = filter_logits(x.to(device), vec("temperature", 1.0), vec("top_k", -1),
                        vec("top_p", 1.0), vec("min_p", 0.0)).cpu()
    for i, kw in enumerate(rows):
        assert torch.equal(torch.isfinite(out[i]), reference_distribution(x[i], **kw) > 0), kw
    assert torch.equal(out[3], x[3])


def test_top_p_counts_mass_outside_the_ranked_candidates():
    # 1100 likely tokens hold ~95% of the mass, 1900 unlikely ones the rest: the nucleus for
    # top_p=0.9 lies inside the top 1024, but must be measured against the full vocabulary.
    torch.manual_seed(4)
    x = torch.cat([torch.randn(1100) * 0.3 + 5.0, torch.full((1900,), 1.6)])
    probs = x.softmax(-1)
    assert 0.9 < probs.topk(1024).values.sum() < 0.97
    one = torch.ones(1)
    out = filter_logits(x[None], one, -one.long(), one * 0.9, one * 0.0)[0]
    assert torch.equal(torch.isfinite(out), reference_distribution(x, top_p=0.9) > 0)


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    """top_p 1e-50 is in (0, 1] but rounds to 0 in float32, where it masked every token and
    each output became id 0."""
    x = torch.tensor([0.1, 2.0, 0.3, 1.9])
    for top_p in (1e-50, 1e-40, 1e-3):
        assert draw(x, SamplingParams(top_p=top_p), n=200).argmax() == 1
        assert draw(x, SamplingParams(top_p=top_p), n=200)[1] == 200


def test_temperature_sharpens():
    hot = draw(LOGITS, SamplingParams(temperature=2.0), n=6000)
    cold = draw(LOGITS, SamplingParams(temperature=0.25), n=6000)
    assert cold[0] > hot[0] * 1.5
    assert_matches(cold, reference_distribution(LOGITS, temperature=0.25))


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax_in_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(7, 300)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.8)] * 3 + [
        SamplingParams(temperature=1e-7)]
    sampler = Sampler(eos_token_ids=EOS)
    out = sampler(logits, sampling_batch(params))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    out16 = sampler(logits.bfloat16(), sampling_batch(params))
    assert torch.equal(out16.next_token_ids, logits.bfloat16().argmax(-1))
    assert out.next_token_logprobs is None and out.top_logprobs is None


def test_greedy_rows_beside_sampled_rows_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams() for i in range(6)]
    out = Sampler(seed=0)(logits, sampling_batch(params))
    assert torch.equal(out.next_token_ids[1::2], logits[1::2].argmax(-1))


# ---------------------------------------------------------------- logit transforms

def test_penalties_transform_logits_exactly():
    v = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0, 3.0, -2.0]] * 3)
    prompt, output = [0, 1, 1], [2, 3, 3, 3]
    params = [SamplingParams(repetition_penalty=2.0),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]  # no penalties: row untouched
    batch = sampling_batch(params, history=[(prompt, output), (prompt, output), None])
    got = Sampler().adjust_logits(logits, batch)

    rep = logits[0].clone()
    for t in set(prompt + output):
        rep[t] = rep[t] / 2.0 if rep[t] > 0 else rep[t] * 2.0
    freq = logits[1].clone()
    for t in set(output):  # prompt tokens do not count for frequency/presence
        freq[t] -= 0.5 * output.count(t) + 0.25
    assert torch.equal(got[0], rep)
    assert torch.equal(got[1], freq)
    assert torch.equal(got[2], logits[2])
    assert got[0].tolist()[:4] == [1.0, -2.0, 0.25, -1.0] and got.shape == (3, v)
    assert got[1].tolist()[:4] == [2.0, -1.0, -0.25, -2.25]


def test_penalties_combine_repetition_first():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=1.25, frequency_penalty=1.0)]
    got = Sampler().adjust_logits(logits, sampling_batch(params, history=[([0], [1, 1])]))
    assert torch.equal(got[0], torch.tensor([2.0 / 1.25, -1.0 * 1.25 - 2.0, 0.5]))


def test_logit_bias_adds_and_steers_sampling():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(logit_bias={4: 5.0, 1: -2.5}), SamplingParams(temperature=0.0)]
    got = Sampler().adjust_logits(logits, sampling_batch(params))
    assert got[0].tolist() == [0.0, -2.5, 0.0, 0.0, 5.0, 0.0]
    assert got[1].tolist() == [0.0] * 6
    counts = draw(torch.zeros(6), SamplingParams(logit_bias={2: 100.0}), n=500)
    assert counts[2] == 500
    greedy = Sampler()(torch.zeros(1, 6), sampling_batch([SamplingParams(temperature=0,
                                                                     logit_bias={5: 1.0})]))
    assert greedy.next_token_ids.tolist() == [5]


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, 6), -5.0)
    logits[0, EOS], logits[0, 5] = 10.0, 9.0  # EOS, then a stop id, are by far the likeliest
    params = [SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[5])]
    sampler = Sampler(eos_token_ids=[EOS])
    early = sampler(logits, sampling_batch(params, output_lens=[1]))
    assert early.next_token_ids.item() not in (EOS, 5)
    assert sampler(logits, sampling_batch(params, output_lens=[2])).next_token_ids.item() == EOS
    sampled = draw(logits[0], SamplingParams(min_new_tokens=1, stop_token_ids=[5]), n=2000)
    assert sampled[EOS] == 0 and sampled[5] == 0


def test_min_new_tokens_yields_to_a_grammar_that_only_allows_eos():
    mask = torch.zeros(1, 1, dtype=torch.int32)
    mask[0, 0] = 1 << EOS
    params = [SamplingParams(min_new_tokens=4)]
    out = Sampler(eos_token_ids=EOS)(torch.randn(1, 20), sampling_batch(params, output_lens=[0],
                                                                   vocab_mask=mask))
    assert out.next_token_ids.item() == EOS


def test_vocab_mask_layout_matches_xgrammar():
    apply_token_bitmask_inplace = pytest.importorskip("xgrammar").apply_token_bitmask_inplace
    torch.manual_seed(0)
    v = 77  # not a multiple of 32
    mask = torch.randint(-2**31, 2**31 - 1, (5, 3), dtype=torch.int32)
    ours = torch.zeros(5, v).masked_fill(~unpack_vocab_mask(mask, v), float("-inf"))
    theirs = torch.zeros(5, v)
    apply_token_bitmask_inplace(theirs, mask)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_vocab_mask_excludes_tokens(device):
    v = 40
    allowed = [1, 7, 31, 32, 39]
    word = [0, 0]
    for t in allowed:
        word[t // 32] |= 1 << (t % 32)
    row = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in word], dtype=torch.int32)
    n = 3000
    logits = torch.randn(n, v)
    logits[:, 0] = 50.0  # the model's favourite is forbidden
    params = [SamplingParams(temperature=1.0)] * (n - 1) + [SamplingParams(temperature=0.0)]
    mask = row.expand(n, 2).contiguous()
    out = Sampler(seed=0)(logits.to(device), sampling_batch(params, vocab_mask=mask))
    assert set(out.next_token_ids.tolist()) == set(allowed)
    assert out.next_token_ids[-1] == allowed[int(logits[-1, allowed].argmax())]


# ---------------------------------------------------------------- seeds

@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproduces_across_batch_compositions(device):
    torch.manual_seed(0)
    target = torch.randn(64)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(extra, out_len, sampler_seed):
        rows = [target] + [torch.randn(64) for _ in range(extra)]
        params = [p] + [SamplingParams(seed=(7 if k % 2 else None)) for k in range(extra)]
        perm = list(reversed(range(len(rows))))  # the seeded request moves around
        batch = sampling_batch([params[k] for k in perm], output_lens=[out_len] * len(rows))
        logits = torch.stack([rows[k] for k in perm]).to(device)
        out = Sampler(seed=sampler_seed)(logits, batch)
        return out.next_token_ids[perm.index(0)].item()

    for step in range(5):
        tokens = {run(extra, step, s) for extra, s in ((0, 1), (3, 2), (9, 3))}
        assert len(tokens) == 1
    # the position in the output changes the draw; over 40 steps several tokens appear
    assert len({run(2, step, 0) for step in range(40)}) > 3


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(50, 100)
    params = [SamplingParams()] * 50
    a = Sampler(seed=5)(logits, sampling_batch(params)).next_token_ids
    b = Sampler(seed=5)(logits, sampling_batch(params)).next_token_ids
    c = Sampler(seed=6)(logits, sampling_batch(params)).next_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_seed_for_step_separates_nearby_pairs():
    values = {seed_for_step(s, t) for s in range(20) for t in range(20)}
    assert len(values) == 400 and all(0 <= x < 2**64 for x in values)


# ---------------------------------------------------------------- logprobs

def test_logprob_helpers_equal_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 33) * 4
    targets = torch.randint(0, 33, (5,))
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(token_logprobs(logits, targets).double(),
                          ref.gather(1, targets[:, None])[:, 0], atol=1e-5)
    vals, ids = top_logprobs(logits.bfloat16(), 4)
    assert vals.dtype == torch.float32
    assert (vals[:, :-1] >= vals[:, 1:]).all()
    ref16 = torch.log_softmax(logits.bfloat16().double(), -1)
    assert torch.allclose(vals.double(), ref16.gather(1, ids), atol=1e-5)
    assert torch.equal(ids[:, 0], logits.bfloat16().argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_forward_output_logprobs_are_raw_model_logprobs(device):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logit_bias={0: 30.0}),
              SamplingParams(),
              SamplingParams(temperature=0.0)]
    batch = sampling_batch(params, history=[([1, 2], [3]), None, None, None],
                       return_logprob=[True, True, False, True], top_logprobs_num=[3, 0, 5, 50])
    out = Sampler(seed=0)(logits.to(device), batch)
    out.next_token_ids = out.next_token_ids.cpu()
    out.next_token_logprobs = out.next_token_logprobs.cpu()
    ref = torch.log_softmax(logits, -1)
    assert out.next_token_ids[1] == 0  # the bias steered the token ...
    assert out.next_token_logprobs.dtype == torch.float32
    assert torch.allclose(out.next_token_logprobs,  # ... but the logprob is the model's own
                          ref.gather(1, out.next_token_ids[:, None])[:, 0], atol=1e-6)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    vals, ids = out.top_logprobs[0]
    assert ids.tolist() == ref[0].topk(3).indices.tolist()
    assert torch.allclose(vals, ref[0].topk(3).values, atol=1e-6)
    vals, ids = out.top_logprobs[3]
    assert len(vals) == 50 and (vals[:-1] >= vals[1:]).all()
    assert torch.allclose(vals, ref[3][ids], atol=1e-6)


# ---------------------------------------------------------------- bad input

def test_bad_input_names_the_field():
    sampler = Sampler()
    with pytest.raises(ValueError, match="^penalty_history"):
        sampler(torch.zeros(1, 8), sampling_batch([SamplingParams(presence_penalty=1.0)]))
    with pytest.raises(ValueError, match="^logit_bias"):
        sampler(torch.zeros(1, 8), sampling_batch([SamplingParams(logit_bias={8: 1.0})]))
    with pytest.raises(ValueError, match="^vocab_mask"):
        sampler(torch.zeros(1, 40), sampling_batch([SamplingParams()],
                                               vocab_mask=torch.zeros(1, 1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="^vocab_mask"):
        sampler(torch.zeros(1, 8), sampling_batch([SamplingParams()],
                                              vocab_mask=torch.zeros(1, 1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="^logits"):
        sampler(torch.zeros(2, 8), sampling_batch([SamplingParams()]))


def test_mask_allowing_only_tokens_past_the_vocab_is_rejected():
    mask = torch.tensor([[0, 1 << 10]], dtype=torch.int32)  # token 42 only; the vocab is 40
    with pytest.raises(ValueError, match="^vocab_mask: row 0 allows no token"):
        Sampler()(torch.zeros(1, 40), sampling_batch([SamplingParams()], vocab_mask=mask))
    mask = torch.tensor([[0, 1 << 7]], dtype=torch.int32)  # token 39, the last one
    out = Sampler()(torch.zeros(1, 40), sampling_batch([SamplingParams()], vocab_mask=mask))
    assert out.next_token_ids.tolist() == [39]


def test_a_forbidden_token_with_an_infinite_logit_stays_forbidden():
    """+inf - inf is NaN, and argmax and sampling both picked the NaN: the grammar was bypassed
    on the CPU path (a float16 logit can overflow to +inf)."""
    from radixray.worker.vocab_mask import apply_vocab_mask_

    logits = torch.zeros(2, 40)
    logits[:, 5] = float("inf")  # forbidden
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[:, 0] = 1 << 3  # only token 3 allowed
    apply_vocab_mask_(logits, mask)
    assert logits.argmax(-1).tolist() == [3, 3]
    assert torch.isneginf(logits[:, 5]).all() and not logits.isnan().any()
