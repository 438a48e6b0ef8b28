"""Llama (Touvron et al., 2023; Llama 3's RoPE scaling): a pre-norm decoder of
RMSNorm -> grouped-query attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual.

Shapes: T = tokens in the batch (all requests' new tokens, concatenated), H = hidden size,
D = head dim; heads are this rank's share.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend
from ..layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding,
                      RowParallelLinear, SwiGLUMLP, VocabParallelEmbedding)
from ..layer_ops import TORCH_OPS, LayerOps
from ..model_config import ModelConfig
from ..parallel import TensorParallel


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        d = cfg.head_dim
        q_start, self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        kv_start, self.num_kv_heads = tp.kv_head_range(cfg.num_kv_heads)
        self.head_dim, self.layer_id = d, layer_id
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
            bias=cfg.qkv_bias, tp=tp,
            part_ranges=[(q_start * d, self.num_heads * d),
                         (kv_start * d, self.num_kv_heads * d),
                         (kv_start * d, self.num_kv_heads * d)])
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, tp)

    def forward(self, x, positions, rotary: RotaryEmbedding, attn: AttentionBackend):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return self.o_proj(attn.forward(self.layer_id, q, k, v))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)). The residual stream travels beside the
    sublayer output and is added inside the next norm (one fused pass): the layer takes and
    returns (sublayer output, residual); the first layer gets residual None."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, tp, ops)

    def forward(self, x, residual, positions, rotary, attn):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(
            self.self_attn(x, positions, rotary, attn), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, ops)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, ops)

    def forward(self, input_ids, positions, attn):  # [T] -> [T, H]
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our merged parameter's name piece, part index)
    stacked_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V], float32
        return self.lm_head.logits(hidden).float()
