"""Qwen2 (Yang et al., 2024) is Llama's decoder with two differences that matter here: q, k
and v projections carry a bias, and small checkpoints tie the LM head to the embedding. Both
come from ``ModelConfig`` (``qkv_bias`` is always on for the qwen2 model type; see
``ModelConfig.from_dict``; ``tie_word_embeddings`` as configured), so the network is Llama's.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's network; the registry's name for HF's ``Qwen2ForCausalLM`` checkpoints."""
