"""Router benchmarks (no model, no torch): overhead over HTTP, and a routing simulation.

``overhead``: a fake instant worker (radixray.router.fake_worker) in its own process, the router
in another, pinned to one core. Sequential requests direct and through the router give the added
p50/p99 latency; closed-loop concurrent clients give requests per second.

``simulate``: no HTTP; the router's own tree and policies route a multi-tenant shared-prefix
workload (groups with a long system prompt each, Zipf popularity) over simulated workers. Each
worker has an exact LRU prefix cache (the engine's radix cache) of ``--cache-chars``; a request's
prefill work is its uncached characters, served processor-sharing at ``--rate`` chars/s per
worker, then it decodes for ``--decode-s`` seconds; in-flight counts feed the policies as real
loads would. Reported per policy: the engines' hit rate (the real one, not the tree's
prediction), spread of requests and of prefill work across workers (max/min), mean latency,
tree memory and decision time, next to the hit rate one worker with all the cache memory gets.

    python bench/router.py simulate                        # 4 workers, then 64 x 100k requests
    python bench/router.py overhead --seconds 5
    python bench/router.py all --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import time

from radixray.router.circuit import CircuitBreaker
from radixray.router.config import RouterConfig
from radixray.router.policies import RequestInfo, make_policy
from radixray.router.tree import ApproxRadixTree
from radixray.router.workers import Worker

ALPHABET = "abcdefghijklmnopqrstuvwxyz      "


# ---------------------------------------------------------------------------------- simulation
def make_workload(n_requests, n_groups, system_len, question_len, zipf_s, seed=0):
    """[(group, text)]: a group's system prompt + a fresh question, groups drawn by Zipf(s)."""
    rng = random.Random(seed)
    systems = ["".join(rng.choices(ALPHABET, k=system_len)) for _ in range(n_groups)]
    weights = [1.0 / (g + 1) ** zipf_s for g in range(n_groups)]
    groups = rng.choices(range(n_groups), weights=weights, k=n_requests)
    return [(g, systems[g] + "".join(rng.choices(ALPHABET, k=question_len))) for g in groups]


class SimWorker:
    """An engine: exact LRU prefix cache + processor-sharing prefill + fixed decode time."""

    def __init__(self, url, cache_chars, rate):
        self.w = Worker(url, CircuitBreaker())
        self.cache = ApproxRadixTree(cache_chars)
        self.rate = rate
        self.vtime = 0.0  # work each active prefill has received so far
        self.t_last = 0.0
        self.prefills: list[tuple[float, int]] = []  # heap of (finish vtime, request id)
        self.version = 0
        self.work = 0.0
        self.served = 0

    def advance(self, now):
        if self.prefills:
            self.vtime += (now - self.t_last) * self.rate / len(self.prefills)
        self.t_last = now

    def next_prefill_done(self):
        if not self.prefills:
            return None
        return self.t_last + (self.prefills[0][0] - self.vtime) * len(self.prefills) / self.rate


def simulate(policy, workload, n_workers, cache_chars, tree_chars, rate, decode_s,
             arrival_rate, seed=0, **config_kw):
    config = RouterConfig(policy=policy, max_tree_size=tree_chars, seed=seed, **config_kw)
    tree = ApproxRadixTree(tree_chars)
    pol = make_policy(config, tree=tree)
    workers = [SimWorker(f"http://sim{i}", cache_chars, rate) for i in range(n_workers)]
    cands = [sw.w for sw in workers]
    by_url = {sw.w.url: sw for sw in workers}
    rng = random.Random(seed + 1)
    events = []  # (time, kind, worker index, version/request id): kind 0 prefill done, 1 finish
    arrivals, prompt_chars, cached_chars, predicted_chars, decide_ns = [], 0, 0, 0, []
    latencies, t = [], 0.0

    def schedule(i):
        sw = workers[i]
        sw.version += 1
        done = sw.next_prefill_done()
        if done is not None:
            heapq.heappush(events, (done, 0, i, sw.version))

    def run_until(limit):
        while events and events[0][0] <= limit:
            when, kind, i, tag = heapq.heappop(events)
            sw = workers[i]
            if kind == 1:  # decode finished: the request leaves
                sw.w.load -= 1
                sw.served += 1
                latencies.append(when - arrivals[tag])
                continue
            if tag != sw.version:
                continue  # stale prediction
            sw.advance(when)
            _, rid = heapq.heappop(sw.prefills)
            heapq.heappush(events, (when + decode_s, 1, i, rid))
            schedule(i)

    for rid, (_, text) in enumerate(workload):
        t += rng.expovariate(arrival_rate)
        run_until(t)
        arrivals.append(t)
        start = time.perf_counter_ns()
        match = tree.match(text)
        decision = pol.choose(RequestInfo(text), cands, match)
        predicted_chars += match.chars_for(decision.worker.url)
        tree.insert(text, decision.worker.url)
        decide_ns.append(time.perf_counter_ns() - start)
        sw = by_url[decision.worker.url]
        hit = min(sw.cache.match(text).chars_for("kv"), len(text) - 1)
        sw.cache.insert(text, "kv")
        prompt_chars += len(text)
        cached_chars += hit
        work = len(text) - hit
        sw.work += work
        sw.advance(t)
        heapq.heappush(sw.prefills, (sw.vtime + work, rid))
        sw.w.load += 1
        schedule(workers.index(sw))
    run_until(float("inf"))
    served = [sw.served for sw in workers]
    work = [sw.work for sw in workers]
    decide_ns.sort()
    return {
        "policy": policy, "workers": n_workers, "requests": len(workload),
        "hit_rate": cached_chars / prompt_chars,
        "predicted_hit_rate": predicted_chars / prompt_chars,
        "requests_max_min": max(served) / max(min(served), 1),
        "work_max_min": max(work) / max(min(work), 1),
        "prefill_chars_per_request": sum(work) / len(workload),
        "mean_latency_s": statistics.fmean(latencies),
        "p99_latency_s": sorted(latencies)[int(0.99 * len(latencies))],
        "decision_us_p50": decide_ns[len(decide_ns) // 2] / 1e3,
        "decision_us_p99": decide_ns[int(0.99 * len(decide_ns))] / 1e3,
        "tree_chars_stored": tree.total_chars(),
        "tree_chars_per_worker_max": max(tree.size(sw.w.url) for sw in workers),
        "tree_nodes": tree.num_nodes(),
        "tree_mib": tree_bytes(tree) / 2**20,
    }


def tree_bytes(tree) -> int:
    """Python heap bytes of the tree: nodes, edge strings, child dicts, tenant sets, LRU dicts."""
    total, stack = 0, [tree.root]
    while stack:
        n = stack.pop()
        total += (sys.getsizeof(n) + sys.getsizeof(n.text) + sys.getsizeof(n.children)
                  + sys.getsizeof(n.tenants))
        stack.extend(n.children.values())
    total += sum(sys.getsizeof(lru) for lru in tree._lru.values())
    return total


def single_cache_hit_rate(workload, cache_chars):
    """One worker holding all the cache memory: the hit rate routing cannot beat."""
    cache, cached, total = ApproxRadixTree(cache_chars), 0, 0
    for _, text in workload:
        cached += min(cache.match(text).chars_for("kv"), len(text) - 1)
        cache.insert(text, "kv")
        total += len(text)
    return cached / total


def run_simulation(args):
    results = []
    for n_workers, n_requests, n_groups in ((args.small_workers, args.small_requests,
                                             args.small_groups),
                                            (args.workers, args.requests, args.groups)):
        workload = make_workload(n_requests, n_groups, args.system_len, args.question_len,
                                 args.zipf, args.seed)
        mean_len = args.system_len + args.question_len
        # arrivals at --load of what the workers could prefill with no cache at all
        arrival = args.load * n_workers * args.rate / mean_len
        bound = single_cache_hit_rate(workload, n_workers * args.cache_chars)
        print(f"\n{n_workers} workers, {n_requests} requests, {n_groups} groups "
              f"(system {args.system_len} + question {args.question_len} chars, "
              f"zipf {args.zipf}); one worker with all the cache: hit rate {bound:.3f}")
        runs = [("cache_aware", args.cache_chars), ("round_robin", args.cache_chars),
                ("least_load", args.cache_chars)]
        if n_workers == args.workers:  # the tree's memory at the default bound, for scale
            runs.append(("cache_aware", RouterConfig().max_tree_size))
        base_work = None
        for policy, tree_chars in runs:
            started = time.perf_counter()
            r = simulate(policy, workload, n_workers, args.cache_chars, tree_chars,
                         args.rate, args.decode_s, arrival, args.seed)
            r["single_cache_hit_rate"] = bound
            r["tree_bound_chars"] = tree_chars
            base_work = base_work or r["prefill_chars_per_request"]
            r["wall_s"] = time.perf_counter() - started
            results.append(r)
            label = policy if tree_chars == args.cache_chars else f"{policy}, tree 2^23"
            print(f"  {label:12s} hit {r['hit_rate']:.3f} (tree predicted "
                  f"{r['predicted_hit_rate']:.3f})  requests max/min {r['requests_max_min']:.2f}"
                  f"  work max/min {r['work_max_min']:.2f}  latency mean "
                  f"{r['mean_latency_s']:.2f} s p99 {r['p99_latency_s']:.2f} s  decision p50 "
                  f"{r['decision_us_p50']:.0f} us p99 {r['decision_us_p99']:.0f} us  tree "
                  f"{r['tree_chars_stored']:,} chars / {r['tree_nodes']:,} nodes / "
                  f"{r['tree_mib']:.1f} MiB  prefill/request {r['prefill_chars_per_request']:.0f}"
                  f" chars ({r['prefill_chars_per_request'] / base_work:.2f}x cache_aware's)"
                  f"  ({r['wall_s']:.0f} s)")
    return results


# ------------------------------------------------------------------------------------ overhead
def _spawn(argv, cpu):
    def pin():
        os.sched_setaffinity(0, {cpu})

    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True,
                            preexec_fn=None if cpu is None else pin)


def _wait_ready(url, timeout=30.0):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _closed_loop(url, seconds, concurrency, body):
    import httpx

    done = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        stop = time.perf_counter() + seconds

        async def loop():
            nonlocal done
            while time.perf_counter() < stop:
                r = await client.post("/generate", json=body)
                assert r.status_code == 200, r.text
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def _cpu_seconds(pid):
    """user + system CPU seconds of a process, from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_overhead(args):
    import httpx

    cpus = sorted(os.sched_getaffinity(0))
    # --pin: router alone on the first core, worker and client on the second. On a machine
    # shared with other jobs pinning measures the neighbours; CPU seconds per request do not.
    worker_cpu = router_cpu = None
    if args.pin and len(cpus) > 1:
        router_cpu, worker_cpu = cpus[0], cpus[1]
    worker = _spawn(["-m", "radixray.router.fake_worker", "--port", "0"], worker_cpu)
    worker_url = f"http://127.0.0.1:{int(worker.stdout.readline().split()[1])}"
    port = _free_port()
    router = _spawn(["-m", "radixray.router", "--worker-urls", worker_url, "--port", str(port),
                     "--policy", args.policy, "--log-level", "warning"], router_cpu)
    router_url = f"http://127.0.0.1:{port}"
    if worker_cpu is not None:
        os.sched_setaffinity(0, {worker_cpu})  # the client shares the worker's core
    result = {"policy": args.policy, "concurrency": args.concurrency, "pinned": args.pin}
    try:
        _wait_ready(worker_url)
        _wait_ready(router_url)
        body = {"text": "You are a helpful assistant. " * 20 + "What is 2+2?",
                "sampling_params": {"max_new_tokens": 8}}
        with httpx.Client(timeout=30) as client:
            for name, url, pid in (("direct", worker_url, worker.pid),
                                   ("router", router_url, router.pid)):
                for _ in range(50):  # warm up connections and code paths
                    client.post(url + "/generate", json=body)
                samples, cpu0 = [], _cpu_seconds(pid)
                for _ in range(args.requests):
                    start = time.perf_counter()
                    client.post(url + "/generate", json=body)
                    samples.append(time.perf_counter() - start)
                result[f"{name}_server_cpu_ms_per_request"] = \
                    (_cpu_seconds(pid) - cpu0) / args.requests * 1e3
                samples.sort()
                result[f"{name}_p50_ms"] = samples[len(samples) // 2] * 1e3
                result[f"{name}_p99_ms"] = samples[int(0.99 * len(samples))] * 1e3
        for name, url in (("direct", worker_url), ("router", router_url)):
            result[f"{name}_rps"] = asyncio.run(_closed_loop(url, args.seconds,
                                                             args.concurrency, body))
    finally:
        for p in (router, worker):
            p.terminate()
            p.wait(timeout=10)
    result["added_p50_ms"] = result["router_p50_ms"] - result["direct_p50_ms"]
    result["added_p99_ms"] = result["router_p99_ms"] - result["direct_p99_ms"]
    r = result
    print(f"\noverhead ({args.policy}, {'pinned' if args.pin else 'not pinned'}, "
          f"{args.requests} sequential "
          f"requests, then {args.concurrency} concurrent for {args.seconds:g} s):")
    print(f"  latency direct p50 {r['direct_p50_ms']:.2f} ms p99 {r['direct_p99_ms']:.2f} ms; "
          f"through the router p50 {r['router_p50_ms']:.2f} ms p99 {r['router_p99_ms']:.2f} ms; "
          f"added p50 {r['added_p50_ms']:.2f} ms p99 {r['added_p99_ms']:.2f} ms")
    print(f"  CPU per request: router {r['router_server_cpu_ms_per_request']:.2f} ms "
          f"(-> {1e3 / r['router_server_cpu_ms_per_request']:.0f} req/s on one core), fake "
          f"worker {r['direct_server_cpu_ms_per_request']:.2f} ms")
    print(f"  throughput direct {r['direct_rps']:.0f} req/s, through the router "
          f"{r['router_rps']:.0f} req/s")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["simulate", "overhead", "all"], nargs="?", default="all")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("simulation")
    s.add_argument("--workers", type=int, default=64)
    s.add_argument("--requests", type=int, default=100_000)
    s.add_argument("--groups", type=int, default=640)
    s.add_argument("--small-workers", type=int, default=4)
    s.add_argument("--small-requests", type=int, default=20_000)
    s.add_argument("--small-groups", type=int, default=40)
    s.add_argument("--system-len", type=int, default=2000)
    s.add_argument("--question-len", type=int, default=200)
    s.add_argument("--zipf", type=float, default=0.8)
    s.add_argument("--cache-chars", type=int, default=40_000, help="engine cache per worker")
    s.add_argument("--rate", type=float, default=200_000.0, help="prefill chars/s per worker")
    s.add_argument("--decode-s", type=float, default=1.0)
    s.add_argument("--load", type=float, default=1.0,
                   help="arrival rate as a fraction of the no-cache prefill capacity")
    o = p.add_argument_group("overhead")
    o.add_argument("--policy", default="cache_aware")
    o.add_argument("--requests-overhead", dest="requests_overhead", type=int, default=1000)
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--pin", action="store_true", help="router on one core, the rest on another")
    o.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    out = {}
    if args.what in ("simulate", "all"):
        out["simulation"] = run_simulation(args)
    if args.what in ("overhead", "all"):
        args.requests = args.requests_overhead
        out["overhead"] = run_overhead(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
