"""Shared by the GPU benchmarks (gpu_bench.py, gpu_kernels.py): card figures, ``import
radixray`` from a plain checkout, the Llama-3-8B model shape, the result report, timing, and a
kernel profile."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import types

# Card figures: HBM bandwidth (bytes/s) and dense bf16 matmul peak (FLOP/s).
CARDS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}


def bootstrap_import():
    """Make ``import radixray`` work from a plain checkout: the repo root *is* the package."""
    try:
        import radixray  # noqa: F401
        return
    except ImportError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    link_dir = tempfile.mkdtemp(prefix="radixray_path_")
    os.symlink(root, os.path.join(link_dir, "radixray"))
    sys.path.insert(0, link_dir)
    try:
        import safetensors  # noqa: F401
    except ImportError:  # only the checkpoint loader needs it; dummy weights do not
        stub = types.ModuleType("safetensors")
        stub.safe_open = None
        sys.modules["safetensors"] = stub


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            rope_theta=10000.0)


def write_config(folder: str, dims: dict) -> None:
    """config.json only: the runner builds the model from it and draws random weights."""
    try:
        from transformers import LlamaConfig

        LlamaConfig(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, **dims).save_pretrained(folder)
    except ImportError:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama",
                           rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **dims), f)


class Report:
    """Prints each result as it comes and rewrites the JSON summary after each."""

    def __init__(self, path: str | None, header: dict):
        self.path, self.data = path, dict(header, results=[], checks=[], errors=[])

    def add(self, kind: str, entry: dict, line: str) -> None:
        self.data[kind].append(entry)
        print(line, flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def seconds_per_call(fn, warmup: int, iters: int) -> float:
    """Seconds per call of ``fn`` (which must finish its GPU work itself), after warm-up."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def kernel_profile(fn, top: int = 10) -> tuple[int, float, list[dict]]:
    """The GPU kernels that one call of ``fn`` (which syncs itself) runs, by torch.profiler:
    (launches, milliseconds of kernel time, the ``top`` largest by time with their counts), so
    a gap to the roofline can be pinned on kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    rows = [(r.key, r.count, getattr(r, "device_time_total", None)
             or getattr(r, "cuda_time_total", 0)) for r in prof.key_averages()]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    largest = [dict(kernel=k[:80], count=c, ms=us / 1e3) for k, c, us in rows[:top]]
    return sum(r[1] for r in rows), sum(r[2] for r in rows) / 1e3, largest
