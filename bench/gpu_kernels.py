"""GPU kernel microbenchmarks behind issue 10's decode target, on Llama-3-8B's layer shapes.

1. Decode attention alone (one layer, batch 128, 1,024-token contexts): time and share of the
   HBM bandwidth per split count, for slots scattered at random and contiguous (as one prefill
   allocates them), with the device's fixed block shape and with the autotuner's pick (the
   line to copy into decode_attention.DECODE_CONFIG_BY_DEVICE).
2. Prefill attention alone (one 4,096-token request, causal) per block config of the extend
   kernel, in TFLOP/s.
3. The elementwise work of one layer at batch 128 (two RMSNorms with the residual add, SiLU and
   multiply, RoPE): torch ops against the fused Triton kernels, microseconds per layer.

Timings are triton.testing.do_bench's (CUDA events, L2 flushed between runs). Side by side in
one process, so ratios hold on a noisy machine.

    python bench/gpu_kernels.py          # on the GPU machine, from the repo root
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --smoke   # tiny shapes on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import CARDS, bootstrap_import, seconds_per_call  # noqa: E402

bootstrap_import()

from radixray.worker.layer_ops import TORCH_OPS  # noqa: E402

# Llama-3-8B; --smoke: tiny shapes on the CPU (TRITON_INTERPRET=1), to check the script
SHAPES = dict(heads=32, kv_heads=8, dim=128, hidden=4096, inter=14336)
SMOKE_SHAPES = dict(heads=4, kv_heads=2, dim=16, hidden=64, inter=128)


def timed_ms(args, fn) -> float:
    """Milliseconds per call: do_bench on a GPU; a plain mean under --smoke."""
    if args.smoke:
        return seconds_per_call(fn, 0, 3) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn)


def attention_sweep(args, bandwidth: float, results: list) -> None:
    from radixray.kernels.decode_attention import decode_attention, tuned_decode_configs

    bs, ctx, dev, dtype = args.batch, args.context, args.device, args.dtype
    heads, kv_heads, dim = (args.shapes[n] for n in ("heads", "kv_heads", "dim"))
    num_slots = bs * ctx + 1
    k = torch.randn(num_slots, kv_heads, dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(bs, heads, dim, device=dev, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    tables = {"random": (torch.randperm(num_slots - 1, generator=g) + 1).view(bs, ctx),
              "contiguous": torch.arange(1, num_slots).view(bs, ctx)}
    rows = torch.arange(bs, device=dev)
    seq_lens = torch.full((bs,), ctx, device=dev)
    kv_bytes = 2 * bs * ctx * kv_heads * dim * k.element_size()
    for layout, table in tables.items():
        table = table.to(dev)
        for splits in args.splits:
            times = {}
            for config in [None] + (["autotune"] if dev == "cuda" else []):
                def run():
                    decode_attention(q, k, v, table, rows, seq_lens, splits, config=config)

                run()  # compiles; "autotune": tries DECODE_CONFIGS on these inputs, once
                times[config or "fixed"] = timed_ms(args, run)
            picked = [c for key, c in tuned_decode_configs().items()
                      if tuple(key[:3]) == (heads // kv_heads, dim, splits)]
            ms = times["fixed"]
            entry = dict(what="decode_attention", layout=layout, batch=bs, context=ctx,
                         splits=splits, ms=ms, bw_fraction=kv_bytes / (ms / 1e3) / bandwidth,
                         tuned_ms=times.get("autotune"), tuned_config=picked[0] if picked else None)
            results.append(entry)
            tuned = (f"; autotuned {entry['tuned_ms'] * 1e3:.1f} us = "
                     f"{kv_bytes / (entry['tuned_ms'] / 1e3) / bandwidth:5.1%} "
                     f"({entry['tuned_config']})" if entry["tuned_ms"] else "")
            print(f"attention {layout:10s} bs={bs} ctx={ctx} splits={splits:2d}: fixed "
                  f"{ms * 1e3:7.1f} us = {entry['bw_fraction']:5.1%} of HBM{tuned}", flush=True)


EXTEND_CONFIGS = [dict(block_m=128, block_n=64, num_warps=8, num_stages=2),  # the backend's
                  dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
                  dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                  dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
                  dict(block_m=64, block_n=128, num_warps=4, num_stages=2)]


def extend_sweep(args, bandwidth: float, results: list) -> None:
    """Prefill attention alone (one request of ``args.prefill`` new tokens, causal, one layer)
    per block config of the extend kernel, in TFLOP/s: the first is the triton backend's."""
    from radixray.kernels.extend_attention import extend_attention

    n, dev, dtype = args.prefill, args.device, args.dtype
    heads, kv_heads, dim = (args.shapes[k] for k in ("heads", "kv_heads", "dim"))
    k = torch.randn(n + 1, kv_heads, dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(n, heads, dim, device=dev, dtype=dtype)
    table = torch.arange(1, n + 1, device=dev).view(1, n)
    zero, lens = torch.zeros(1, dtype=torch.int64, device=dev), torch.full((1,), n, device=dev)
    flops = 4 * heads * dim * n * (n + 1) / 2  # QK^T and PV over the causal half
    for config in (EXTEND_CONFIGS if dev == "cuda" else EXTEND_CONFIGS[2:3]):
        def run():
            extend_attention(q, k, v, table, zero, zero, lens, zero, n, **config)

        run()
        ms = timed_ms(args, run)
        results.append(dict(what="extend_attention", tokens=n, ms=ms, config=config,
                            tflops=flops / (ms / 1e3) / 1e12))
        print(f"extend    tokens={n}: {ms * 1e3:8.1f} us = {flops / ms / 1e9:6.1f} TFLOP/s "
              f"({config})", flush=True)


def layer_ops(args, bandwidth: float, results: list) -> None:
    from radixray.kernels import pick_layer_ops

    fused = pick_layer_ops("triton", args.device)
    bs, dev, dtype = args.batch, args.device, args.dtype
    hidden, inter, heads, kv_heads, dim = (args.shapes[n] for n in
                                           ("hidden", "inter", "heads", "kv_heads", "dim"))
    x = torch.randn(bs, hidden, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, device=dev, dtype=dtype)
    gate_up = torch.randn(bs, 2 * inter, device=dev, dtype=dtype)
    qkv = torch.randn(bs, (heads + 2 * kv_heads) * dim, device=dev, dtype=dtype)
    q = qkv[:, :heads * dim].view(bs, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(bs, kv_heads, dim)
    cos = torch.rand(2048, dim // 2, device=dev)
    sin = torch.rand_like(cos)
    positions = torch.randint(0, 2048, (bs,), device=dev)
    timings = {}
    for ops in (TORCH_OPS, fused):
        def layer():  # the elementwise work of one decoder layer
            ops.add_rms_norm(x, residual, weight, 1e-5)
            ops.rotary(q, k, cos, sin, positions)
            ops.add_rms_norm(x, residual, weight, 1e-5)
            ops.silu_and_mul(gate_up)

        layer()
        timings[ops.name] = timed_ms(args, layer) * 1e3
    entry = dict(what="layer_ops", batch=bs, torch_us=timings["torch"],
                 triton_us=timings["triton"], ratio=timings["torch"] / timings["triton"])
    results.append(entry)
    print(f"layer ops bs={bs} per layer: torch {timings['torch']:.1f} us, fused triton "
          f"{timings['triton']:.1f} us ({entry['ratio']:.1f}x); x32 layers: "
          f"{(timings['torch'] - timings['triton']) * 32 / 1e3:.2f} ms saved per step", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--splits", default="1,2,3,4,6,8")
    p.add_argument("--prefill", type=int, default=4096, help="tokens of the extend sweep")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)")
    args = p.parse_args()
    args.splits = [int(s) for s in args.splits.split(",")]
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment", flush=True)
            return 2
        args.batch, args.context, args.prefill = 4, 40, 48
        args.device, args.dtype, args.shapes, name = "cpu", torch.float32, SMOKE_SHAPES, "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: these are GPU kernels (--smoke checks the script on a CPU)",
              flush=True)
        return 2
    else:
        args.device, args.dtype, args.shapes = "cuda", torch.bfloat16, SHAPES
        name = torch.cuda.get_device_name()
    bandwidth = CARDS[next((c for c in CARDS if c in name), "H200")][0]
    print(f"device {name}, roofline bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results: list = []
    for part in (attention_sweep, extend_sweep, layer_ops):
        try:
            part(args, bandwidth, results)
        except Exception as exc:  # one failure must not hide the other part's figures
            print(f"FAILED {part.__name__}: {exc!r}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_kernels.json"), "w") as f:
            json.dump(dict(device=name, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
