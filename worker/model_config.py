"""The HF ``config.json`` normalised once into a frozen ``ModelConfig``.

Nothing downstream of this module touches a transformers config object: model files, the
weight loader, the KV cache and the scheduler read these fields only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class RopeScaling:
    """Only the ``llama3`` type rescales frequencies; ``default`` means plain RoPE."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # dtype the checkpoint was saved in

    @property
    def context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model path {model_path!r} has no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f), model_path)

    @classmethod
    def from_dict(cls, cfg: dict, model_path: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            raise ValueError(f"unsupported architectures {archs}; radixray serves "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_path=model_path,
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
