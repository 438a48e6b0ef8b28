"""HF transformers as the oracle: greedy continuations and logits on a model folder.

A manual greedy loop over HF's forward with ``past_key_values`` equals ``generate`` and has no
EOS logic to work around. Models are cached per path so several tests share one load.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


# transformers >= 5.2x renamed past_key_values to cache; support both spellings
_CACHE_KWARG = "cache"


def _cache_of(out):
    global _CACHE_KWARG
    if "cache" in out:
        return out["cache"]
    _CACHE_KWARG = "past_key_values"
    return out["past_key_values"]


@torch.inference_mode()
def hf_greedy(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(model_path)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past, tokens = _cache_of(out), []
    next_id = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        tokens.append(next_id)
        if len(tokens) == max_new_tokens:
            break
        out = model(torch.tensor([[next_id]]), **{_CACHE_KWARG: past}, use_cache=True)
        past, next_id = _cache_of(out), int(out.logits[0, -1].argmax())
    return tokens


@torch.inference_mode()
def hf_logits(model_path: str, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids``: [len(ids), V] float32."""
    return hf_model(model_path)(torch.tensor([ids])).logits[0].float()
