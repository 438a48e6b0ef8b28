"""GPU code paths, each beside a torch reference: Triton kernels and the attention backends
built on them (``triton``, ``flashinfer``), fused elementwise layer ops, plus CUDA graphs for
decode.

Importing this package imports neither triton nor flashinfer: ``load_attention_backend``
imports a backend module (which registers it with ``worker.attention``) only when asked, and
reports a missing optional dependency instead of raising.
"""

from __future__ import annotations

import importlib
import os

ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "triton", "flashinfer")
_MODULES = {"triton": ".triton_backend", "flashinfer": ".flashinfer_backend"}
_load_errors: dict[str, str] = {}


def load_attention_backend(name: str) -> bool:
    """Import (and so register) backend ``name``; False when its dependency is missing or
    fails to import (the reason is kept for ``pick_attention_backend``'s error)."""
    if name == "torch_native":
        return True
    if name not in _MODULES:
        raise ValueError(f"attention_backend: unknown {name!r}")
    if name in _load_errors:
        return False
    try:
        importlib.import_module(_MODULES[name], __name__)
        return True
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        _load_errors[name] = f"{type(exc).__name__}: {exc}"
        return False


LAYER_OPS_CHOICES = ("auto", "torch", "triton")


def pick_layer_ops(requested: str, device):
    """The LayerOps (worker/layer_ops.py) for a model on ``device``. ``auto``: the fused
    ``triton`` kernels on CUDA when triton imports, torch elsewhere. ``triton`` off CUDA needs
    ``TRITON_INTERPRET=1`` (tests)."""
    from ..worker.layer_ops import LAYER_OPS

    if requested not in LAYER_OPS_CHOICES:
        raise ValueError(f"layer_ops: unknown {requested!r}; use one of "
                         f"{list(LAYER_OPS_CHOICES)}")
    on_cuda = _device_type(device) == "cuda"
    if requested == "torch" or (requested == "auto" and not on_cuda):
        return LAYER_OPS["torch"]
    if requested == "triton" and not _triton_runs_on(device):
        raise ValueError("layer_ops: triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    try:
        importlib.import_module(".elementwise", __name__)
    except Exception as exc:
        if requested == "auto":
            return LAYER_OPS["torch"]
        raise ValueError(f"layer_ops: triton is not available here ({type(exc).__name__}: "
                         f"{exc})") from exc
    return LAYER_OPS["triton"]


def _device_type(device) -> str:
    return device.type if hasattr(device, "type") else str(device).split(":")[0]


def _triton_runs_on(device) -> bool:
    """Triton kernels run on CUDA, and anywhere under its interpreter (tests on CPU)."""
    return _device_type(device) == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# What FlashInfer's kernels take: head dims it ships kernels for, 16-bit KV only.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = ("torch.float16", "torch.bfloat16")


def pick_attention_backend(requested: str, device, head_dim: int | None = None,
                           dtype=None) -> str:
    """The backend name to pass to ``create_attention_backend``; imports (registers) it.

    ``auto``: flashinfer (when it imports and supports the model's head_dim and KV dtype),
    else triton, on CUDA; torch_native elsewhere. An explicit name is checked against the
    device (triton off CUDA needs ``TRITON_INTERPRET=1``), its dependency and, for flashinfer,
    the head_dim and dtype; a clear ``attention_backend`` error names what is wrong.
    """
    if requested not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend: unknown {requested!r}; use one of "
                         f"{list(ATTENTION_BACKEND_CHOICES)}")
    on_cuda = _device_type(device) == "cuda"
    flashinfer_unfit = _flashinfer_unfit(head_dim, dtype)
    if requested == "auto":
        if on_cuda:
            for name in ("flashinfer", "triton"):
                if not (name == "flashinfer" and flashinfer_unfit) and load_attention_backend(name):
                    return name
        return "torch_native"
    if requested == "flashinfer" and not on_cuda:
        raise ValueError("attention_backend: flashinfer needs a CUDA device")
    if requested == "flashinfer" and flashinfer_unfit:
        raise ValueError(f"attention_backend: flashinfer does not take {flashinfer_unfit}; "
                         "use triton")
    if requested == "triton" and not _triton_runs_on(device):
        raise ValueError("attention_backend: triton needs a CUDA device (or TRITON_INTERPRET=1 "
                         "on CPU, for tests)")
    if not load_attention_backend(requested):
        raise ValueError(f"attention_backend: {requested} is not available here "
                         f"({_load_errors[requested]}); install the matching extra or use auto")
    return requested


def _flashinfer_unfit(head_dim: int | None, dtype) -> str:
    """What of the model FlashInfer cannot take ("" when nothing, or when not known)."""
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {head_dim} (it takes {list(FLASHINFER_HEAD_DIMS)})"
    if dtype is not None and str(dtype) not in FLASHINFER_DTYPES:
        return f"a {dtype} KV cache (float16 or bfloat16 only)"
    return ""


__all__ = ["ATTENTION_BACKEND_CHOICES", "LAYER_OPS_CHOICES", "load_attention_backend",
           "pick_attention_backend", "pick_layer_ops"]
