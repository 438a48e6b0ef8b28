"""Hierarchical cache benchmark: multi-turn chats whose history outgrows the device KV pool.

    python bench/hicache.py                 # ~20 s on a quiet 2-core box
    python bench/hicache.py --turns 4       # shorter

Each turn sends every conversation's whole history plus a new user message (one batch through
the offline Engine), greedy, and appends the reply. By the last turn the histories outgrow the
device pool several times over (``--convs``, ``--user-tokens`` and ``--turns`` against
``--pool`` set by how much), so without a second tier most of each history has been evicted by
the time its conversation comes back and is prefilled again. With
``--enable-hierarchical-cache`` (host pool ``--hicache-ratio`` x the device pool) it is
loaded back from host memory instead. Same workload, same process, ``--repeat`` runs per
configuration (the fastest counts); prints prefill tokens computed, host-hit tokens, forward batches (and how many of them
carried tier copies only: a load is confirmed by the output of the batch that carries it
before its request runs), wall time and throughput, with ratios.
Outputs are checked to be identical across configurations. Replies are short by default
(4 tokens) so that prompt processing, which the tier saves, dominates the time, as it does for
time to first token; decode steps cost the same in every configuration.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from radixray.cluster.engine import Engine
from radixray.worker.make_model import make_model

MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768,
             vocab_size=4096, max_position=4096, seed=0)


def run(model: str, args, **server_args) -> dict:
    rng = random.Random(args.seed)
    user_len, reply_len = args.user_tokens, args.reply_tokens
    history = [[] for _ in range(args.convs)]
    outputs = []
    with Engine(model, max_total_tokens=args.pool, **server_args) as engine:
        start = time.perf_counter()
        for _ in range(args.turns):
            for h in history:
                h += [rng.randrange(3, MODEL["vocab_size"]) for _ in range(user_len)]
            results = engine.generate(input_ids=[list(h) for h in history], sampling_params={
                "max_new_tokens": reply_len, "temperature": 0, "ignore_eos": True})
            for h, r in zip(history, results):
                h += r["output_ids"]
                outputs.append(r["output_ids"])
        elapsed = time.perf_counter() - start
        engine.scheduler.check_invariant()
        stats = engine.scheduler.stats
        return {"outputs": outputs, "seconds": elapsed, "prefill": stats.prefill_tokens,
                "prompt": stats.prompt_tokens, "generated": stats.generated_tokens,
                "host_hits": stats.host_cached_tokens, "cached": stats.cached_tokens,
                "batches": stats.num_prefill_batches + stats.num_decode_batches
                + stats.num_copy_batches, "copy_batches": stats.num_copy_batches,
                "history": sum(len(h) for h in history)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder; default: a small random Llama")
    p.add_argument("--pool", type=int, default=1024, help="device KV pool (tokens)")
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--reply-tokens", type=int, default=4)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="runs per config; the fastest counts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or make_model(tempfile.mkdtemp(prefix="hicache-bench-"), arch="llama",
                                     **MODEL)
    configs = {
        "device only": {},
        "L2 write_through": {"enable_hierarchical_cache": True,
                             "hicache_ratio": args.hicache_ratio},
        "L2 write_back": {"enable_hierarchical_cache": True, "hicache_ratio": args.hicache_ratio,
                          "hicache_write_policy": "write_back"},
    }
    results = {name: min((run(model, args, **cfg) for _ in range(args.repeat)),
                         key=lambda r: r["seconds"]) for name, cfg in configs.items()}
    base = results["device only"]
    print(f"{args.convs} chats x {args.turns} turns ({args.user_tokens} user + "
          f"{args.reply_tokens} reply tokens a turn); final history {base['history']} tokens "
          f"= {base['history'] / args.pool:.1f}x the {args.pool}-token device pool; host pool "
          f"{args.hicache_ratio:g}x")
    print(f"{'config':18} {'prefill tok':>11} {'host hits':>10} {'batches':>8} {'copy-only':>9} "
          f"{'seconds':>8} {'tok/s':>8} {'prefill vs base':>16} {'speed vs base':>14}")
    for name, r in results.items():
        assert r["outputs"] == base["outputs"], f"{name}: outputs differ from device only"
        rate = (r["prompt"] + r["generated"]) / r["seconds"]
        base_rate = (base["prompt"] + base["generated"]) / base["seconds"]
        print(f"{name:18} {r['prefill']:11d} {r['host_hits']:10d} {r['batches']:8d} "
              f"{r['copy_batches']:9d} {r['seconds']:8.2f} "
              f"{rate:8.0f} {r['prefill'] / base['prefill']:15.2f}x {rate / base_rate:13.2f}x")
    print("outputs identical across configurations")


if __name__ == "__main__":
    main()
