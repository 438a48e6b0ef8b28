"""Strict weight loading from safetensors (one file or a sharded index).

Every checkpoint tensor is routed to one of our parameters, whose ``weight_loader`` copies this
rank's slice in (see layers.py). Missing, unexpected or misshaped tensors raise one error that
names them all: a silently half-loaded model is the worst bug a server can have.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

# HF checkpoints may carry these buffers; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                            f"{model_path!r}")


def _route(name: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int]:
    for ckpt_piece, (ours, part) in stacked.items():
        if f".{ckpt_piece}." in name:
            return name.replace(f".{ckpt_piece}.", f".{ours}."), part
    return name, 0


def load_weights(model: nn.Module, model_path: str) -> None:
    """Fill every parameter of ``model`` from the checkpoint. Mutates the parameters in place."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    stacked = getattr(model, "stacked_params", {})
    received: dict[str, set[int]] = {}
    unexpected, errors = [], []
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, part = _route(name, stacked)
                if target not in params:
                    unexpected.append(name)
                    continue
                param = params[target]
                try:
                    with torch.no_grad():
                        param.weight_loader(param, f.get_tensor(name), part)
                except ValueError as e:
                    errors.append(f"{name}: {e}")
                    continue
                received.setdefault(target, set()).add(part)
    missing = [n for n, p in params.items()
               if len(received.get(n, ())) < getattr(p, "num_parts", 1)]
    problems = []
    if missing:
        problems.append(f"missing tensors for parameters {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    problems.extend(errors)
    if problems:
        raise ValueError(f"checkpoint {model_path!r} does not fit the model: "
                         + "; ".join(problems))
