"""Qwen2 (Yang et al., 2024) is Llama's decoder with two differences that matter here: q, k
and v projections carry a bias, and small checkpoints tie the LM head to the embedding. Both
come from ``ModelConfig`` (``qkv_bias`` is always on for qwen2; ``tie_word_embeddings`` as
configured), so the network is Llama's; this file pins the bias so a config cannot drop it.
"""

from __future__ import annotations

import dataclasses

from ..layer_ops import TORCH_OPS, LayerOps
from ..model_config import ModelConfig
from ..parallel import TensorParallel
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ops: LayerOps = TORCH_OPS):
        super().__init__(dataclasses.replace(cfg, qkv_bias=True), tp, ops)
