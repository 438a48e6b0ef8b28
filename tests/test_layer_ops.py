"""The fused elementwise kernels (kernels/elementwise.py) against the torch LayerOps they
replace, alone and inside a model. CPU runs them under TRITON_INTERPRET=1 in float32; a GPU
also runs bfloat16."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_batch
from triton_setup import CUDA, DEV, DTYPES

pytest.importorskip("triton")

from radixray.kernels import pick_layer_ops  # noqa: E402
from radixray.worker.layer_ops import TORCH_OPS  # noqa: E402
from radixray.worker.layers import rope_inv_freq  # noqa: E402
from radixray.worker.model_config import RopeScaling  # noqa: E402

# float32: same operations in another order; bfloat16: one rounding step apart at most
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def triton_ops():
    ops = pick_layer_ops("triton", DEV)
    assert ops.name == "triton" and ops is not TORCH_OPS
    return ops


def _close(got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    scale = ref.float().abs().max().clamp(min=1.0)
    assert ((got.float() - ref.float()).abs().max() / scale).item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of two (masked lanes)
def test_rms_norm_and_residual_add(triton_ops, dtype, hidden):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, hidden, generator=g) * 3).to(DEV, dtype)
    residual = torch.randn(5, hidden, generator=g).to(DEV, dtype)
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(DEV, dtype)
    _close(triton_ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6), dtype)

    ref_y, ref_res = TORCH_OPS.add_rms_norm(x, residual.clone(), weight, 1e-6)
    mine = residual.clone()
    y, res = triton_ops.add_rms_norm(x, mine, weight, 1e-6)
    _close(y, ref_y, dtype)
    assert torch.equal(res, ref_res)  # the residual sum is the same rounding of the same add
    assert res.data_ptr() == mine.data_ptr()  # updated in place, as the interface allows
    # an empty batch (a copies-only step never reaches here, but a zero-token slice may)
    empty = x[:0]
    assert triton_ops.rms_norm(empty, weight, 1e-6).shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])  # 1500: several column blocks, a partial one
def test_silu_and_mul(triton_ops, dtype, inter):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 4).to(DEV, dtype)
    _close(triton_ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 24)])
def test_rotary_in_place_on_fused_qkv_views(triton_ops, dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(2)
    tokens, max_pos = 7, 64
    inv_freq = rope_inv_freq(head_dim, 10000.0, RopeScaling())
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(DEV)
    # q and k are strided views of one [T, (Hq + 2 Hkv) D] projection output, as in the model
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEV, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    views = lambda t: (t[:, :q_size].view(tokens, heads, head_dim),  # noqa: E731
                       t[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim))
    ref_q, ref_k = TORCH_OPS.rotary(*views(qkv.clone()), cos, sin, positions)
    mine = qkv.clone()
    q, k = triton_ops.rotary(*views(mine), cos, sin, positions)
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    assert torch.equal(mine[:, q_size + kv_size:], qkv[:, q_size + kv_size:])  # v untouched
    _close(views(mine)[0], ref_q, dtype)  # written into the projection output itself


def test_auto_picks_torch_on_cpu_and_rejects_unknown():
    assert pick_layer_ops("auto", "cpu") is TORCH_OPS
    assert pick_layer_ops("torch", DEV) is TORCH_OPS
    with pytest.raises(ValueError, match="layer_ops"):
        pick_layer_ops("fused", DEV)
    if CUDA:
        assert pick_layer_ops("auto", "cuda").name == "triton"


def test_model_with_fused_ops_equals_torch_ops(tmp_path):
    """Whole runners (prefill, then decode steps) with the same weights: fused layer ops give
    the torch ops' logits."""
    import json

    from radixray.worker.model_runner import ModelRunner, RunnerConfig

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)))
    runners, logits = [], [[], []]
    for i, ops in enumerate(("torch", "triton")):
        runner = ModelRunner(RunnerConfig(str(tmp_path), device=DEV, dtype="float32",
                                          layer_ops=ops, attention_backend="torch_native",
                                          load_format="dummy", max_total_tokens=256,
                                          max_running_requests=4, max_context_len=128))
        torch.manual_seed(0)
        with torch.no_grad():
            for p in runner.model.parameters():
                p.normal_(std=0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
        sample = runner.sampler
        runner.sampler = lambda lg, b, i=i, s=sample: (logits[i].append(lg.cpu()), s(lg, b))[1]
        runners.append(runner)
    prompts = [list(range(3, 20)), [5, 9, 2, 7]]
    ids = [list(p) for p in prompts]
    slots, next_slot = [[], []], 1
    for step in range(4):
        extend = [p if step == 0 else p[-1:] for p in ids]
        out = []
        for r, e in enumerate(extend):
            out.append(list(range(next_slot, next_slot + len(e))))
            slots[r] += out[-1]
            next_slot += len(e)
        prefix = [len(i) - len(e) for i, e in zip(ids, extend)]
        batch = greedy_batch(sum(extend, []),
                             sum([list(range(p, p + len(e))) for p, e in zip(prefix, extend)], []),
                             [1, 2], prefix, [len(e) for e in extend], sum(out, []))
        tokens = [runner.forward(batch).next_token_ids.tolist() for runner in runners]
        assert tokens[0] == tokens[1]
        for seq, tok in zip(ids, tokens[0]):
            seq.append(tok)
    assert runners[1].model.model.norm.ops.name == "triton"
    for ref, got in zip(*logits):
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
