"""Cache-aware versus round-robin routing over real radixray replicas (Ray, tiny model).

A multi-tenant shared-prefix workload (``--groups`` tenants, each with a ``--system-len``-token
system prompt, ``--per-group`` questions each) goes through a router in front of ``--replicas``
replicas whose KV pools are small (``--pool`` tokens each), so where a prompt lands decides
whether its system prompt is still cached. Per policy, in one run and on the same replicas
(caches flushed in between): the engines' real hit rate (sum of ``cached_tokens`` over prompt
tokens), throughput, and the spread of requests over replicas (max/min). Beside them, the hit
rate of one replica with all the memory (``replicas x pool``) on the same workload.

    python bench/router_replicas.py --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import threading
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402


def workload(groups: int, per_group: int, system_len: int, question_len: int, vocab: int,
             seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(5, vocab) for _ in range(system_len)] for _ in range(groups)]
    prompts = [systems[g] + [rng.randrange(5, vocab) for _ in range(question_len)]
               for g in range(groups) for _ in range(per_group)]
    rng.shuffle(prompts)  # tenants interleave, as real traffic does
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(policy: str, urls: list[str]):
    import uvicorn

    from radixray.router.app import build_app
    from radixray.router.config import RouterConfig

    port = free_port()
    config = RouterConfig(port=port, worker_urls=tuple(urls), policy=policy, log_level="warning")
    server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


async def run_load(url: str, prompts: list[list[int]], concurrency: int, max_new: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    cached = prompt = 0

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(ids):
            nonlocal cached, prompt
            async with sem:
                r = await client.post(f"{url}/generate", json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": max_new,
                                                          "temperature": 0, "ignore_eos": True}})
                r.raise_for_status()
                meta = r.json()["meta_info"]
                cached += meta["cached_tokens"]
                prompt += meta["prompt_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return {"hit_rate": cached / prompt, "seconds": elapsed,
            "req_per_s": len(prompts) / elapsed}


def served_counts(urls: list[str]) -> list[float]:
    counts = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        total = sum(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("radixray:num_requests_total{"))
        counts.append(total)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--pool", type=int, default=1536, help="KV tokens per replica")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--system-len", type=int, default=300)
    ap.add_argument("--question-len", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None, help="model folder; default: a tiny random Llama")
    args = ap.parse_args()

    import tempfile

    import ray

    from radixray.cluster.replica import start_replica
    from radixray.worker.make_model import make_model

    model = args.model or make_model(tempfile.mkdtemp(prefix="rr-bench-"), arch="llama")
    prompts = workload(args.groups, args.per_group, args.system_len, args.question_len, 2048)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", namespace="radixray")
    counts_before = None
    try:
        actors = [start_replica(f"bench{i}", model, {"max_total_tokens": args.pool})
                  for i in range(args.replicas)]
        urls = ray.get([a.get_url.remote() for a in actors])
        results = {}
        for policy in ("round_robin", "cache_aware"):
            for url in urls:
                httpx.post(f"{url}/flush_cache", timeout=30)
            counts_before = served_counts(urls)
            server, router_url = start_router(policy, urls)
            results[policy] = asyncio.run(run_load(router_url, prompts, args.concurrency,
                                                   args.max_new))
            after = served_counts(urls)
            spread = [a - b for a, b in zip(after, counts_before)]
            results[policy]["spread"] = max(spread) / max(min(spread), 1)
            results[policy]["per_replica"] = spread
            server.should_exit = True
        for a in actors:
            ray.get(a.shutdown.remote())
            ray.kill(a)
        big = start_replica("bench-big", model, {"max_total_tokens": args.pool * args.replicas})
        results["one_replica_all_memory"] = asyncio.run(run_load(
            ray.get(big.get_url.remote()), prompts, args.concurrency, args.max_new))
        ray.get(big.shutdown.remote())
    finally:
        ray.shutdown()

    one = results["one_replica_all_memory"]["hit_rate"]
    rr, ca = results["round_robin"], results["cache_aware"]
    print(f"{len(prompts)} requests, {args.groups} tenants x {args.per_group}, system prompt "
          f"{args.system_len} tokens, {args.replicas} replicas x {args.pool} KV tokens")
    for name, r in results.items():
        extra = (f"  spread max/min {r['spread']:.2f} {r['per_replica']}"
                 if "spread" in r else "")
        print(f"{name:24s} hit rate {r['hit_rate']:.3f}  {r['req_per_s']:.1f} req/s{extra}")
    print(f"cache_aware / round_robin: hit rate x{ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}"
          f", throughput x{ca['req_per_s'] / rr['req_per_s']:.2f}; cache_aware hit rate is "
          f"{ca['hit_rate'] / one:.1%} of one replica with all the memory")


if __name__ == "__main__":
    main()
