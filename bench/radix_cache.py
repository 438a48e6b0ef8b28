"""RadixCache micro-benchmark: edge comparison against a plain token loop, match / insert /
evict throughput, and a long run of random scheduler-like operations.

    python bench/radix_cache.py            # ~45 s on a quiet 2-core box
    python bench/radix_cache.py --ops 100000

Everything runs in one process and prints ratios next to absolute times, because the
machines are noisy. Keys are built before timing (a request builds its RadixKey once); the cost
of building one is printed separately.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from array import array

import torch

from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import RadixCache, RadixKey


class TokenLoopRadixCache(RadixCache):
    """The baseline: the same tree, comparing edges one token at a time in Python."""

    def _edge_match_len(self, edge, key, start, stop):
        i = 0
        for a, b in zip(edge.token_ids, itertools.islice(key.token_ids, start, stop)):
            if a != b:
                break
            i += 1
        return i


def per_call(fn, min_time=0.2) -> float:
    """Seconds per call: best of 3 timed loops of at least ``min_time`` each."""
    n, best = 1, float("inf")
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            break
        n *= 4
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return min(best, elapsed) / n


def fresh_ints(tokens):
    """The same values as new int objects, as another request's tokens would be."""
    return array("q", tokens).tolist()


def compare_bench(rng: random.Random) -> None:
    print("== edge comparison: galloping on packed bytes vs token loop (per match) ==")
    print(f"{'prefix':>8} {'case':<22} {'gallop':>10} {'token loop':>11} {'ratio':>7}")
    for n in (1_000, 10_000, 100_000):
        tokens = [rng.randrange(150_000) for _ in range(n)]
        caches = []
        for cls in (RadixCache, TokenLoopRadixCache):
            cache = cls(TokenToKVPoolAllocator(n + 8))
            cache.insert(RadixKey(tokens), cache.allocator.alloc(n))
            caches.append(cache)
        # Whole shared prefix: the query is the cached prompt plus one new token.
        query = RadixKey(fresh_ints(tokens) + [7])
        fast, loop = (per_call(lambda c=c: c.match_prefix(query)) for c in caches)
        assert len(caches[0].match_prefix(query).indices) == n
        print(f"{n:>8} {'match_prefix, full hit':<22} {fast * 1e6:>8.2f}us {loop * 1e6:>9.1f}us "
              f"{loop / fast:>6.0f}x")
        # First difference late in the edge: the galloping + bisection path itself.
        cut = n - 1 - rng.randrange(n // 10)
        probe = fresh_ints(tokens)
        probe[cut] = -1
        probe = RadixKey(probe)
        edge = caches[0].root.children[next(iter(caches[0].root.children))].key
        fast, loop = (per_call(lambda c=c: c._edge_match_len(edge, probe, 0, n)) for c in caches)
        assert caches[0]._edge_match_len(edge, probe, 0, n) == cut
        print(f"{n:>8} {'edge, mismatch at ' + str(cut):<22} {fast * 1e6:>8.2f}us "
              f"{loop * 1e6:>9.1f}us {loop / fast:>6.0f}x")
        ints = fresh_ints(tokens)
        build = per_call(lambda: RadixKey(ints))
        print(f"{n:>8} {'RadixKey(list) build':<22} {build * 1e6:>8.1f}us "
              f"{'(once per request)':>18}")


def workload(rng: random.Random, num_seqs: int, num_prefixes: int, lo: int, hi: int,
             tail: int):
    """Keys that share "system prompts": a prefix of lo..hi tokens from a small pool plus a
    random tail of 1..tail tokens."""
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(lo, hi))]
                for _ in range(num_prefixes)]
    return [RadixKey(rng.choice(prefixes) + [rng.randrange(50_000)
                                             for _ in range(rng.randrange(1, tail + 1))])
            for _ in range(num_seqs)]


def throughput_bench(rng: random.Random) -> None:
    print("\n== throughput (real allocator; 20k keys: 200 shared prefixes of 64-512 tokens "
          "+ 1-64 own tokens) ==")
    keys = workload(rng, 20_000, 200, 64, 512, 64)
    total = sum(len(k) for k in keys)
    allocator = TokenToKVPoolAllocator(total + 1)
    cache = RadixCache(allocator)
    t0 = time.perf_counter()
    for key in keys:
        value = allocator.alloc(len(key))
        cached = cache.insert(key, value)
        allocator.free(value[:cached])
    t_insert = time.perf_counter() - t0
    t0 = time.perf_counter()
    for key in keys:
        cache.match_prefix(key)
    t_match = time.perf_counter() - t0
    size, calls = cache.total_size(), 0
    t0 = time.perf_counter()
    while cache.evict(256):
        calls += 1
    t_evict = time.perf_counter() - t0
    n = len(keys)
    print(f"insert: {n / t_insert:>9,.0f} keys/s ({t_insert / n * 1e6:.1f} us each, "
          "with alloc/free)")
    print(f"match:  {n / t_match:>9,.0f} keys/s ({t_match / n * 1e6:.1f} us each, all hits)")
    print(f"evict:  {calls / t_evict:>9,.0f} calls/s of 256 tokens; {size / t_evict:,.0f} tokens/s "
          f"(tree of {size:,} tokens emptied in {t_evict:.2f} s)")
    t_empty = per_call(lambda: cache.evict(256))
    print(f"evict with nothing evictable: {t_empty * 1e9:.0f} ns")


def random_ops_bench(rng: random.Random, num_ops: int) -> None:
    print(f"\n== {num_ops:,} random scheduler-like ops (real allocator, 100k slots) ==")
    keys = workload(rng, 5_000, 100, 16, 128, 64)
    allocator = TokenToKVPoolAllocator(100_000)
    cache = RadixCache(allocator, eviction_policy="lru")
    running: list = []
    counts = dict.fromkeys(("admit", "finish", "match", "evict"), 0)
    ops = rng.choices(list(counts), weights=[3, 3, 3, 1], k=num_ops)
    picks = [rng.randrange(len(keys)) for _ in range(num_ops)]
    t0 = time.perf_counter()
    for op, pick in zip(ops, picks):
        if op == "admit" and len(running) >= 64 or op == "finish" and not running:
            op = "finish" if running else "admit"
        counts[op] += 1
        if op == "match":
            cache.match_prefix(keys[pick])
        elif op == "evict":
            cache.evict(pick % 32)  # occasional pressure; most eviction is on demand
        elif op == "admit":  # lock the matched prefix while the request runs
            key = keys[pick]
            indices, node = cache.match_prefix(key)
            cache.inc_lock_ref(node)
            running.append((key, indices, node))
        else:  # finish: compute the rest, cache the whole sequence, unlock
            key, indices, node = running.pop(pick % len(running))
            need = len(key) - len(indices)
            slots = allocator.alloc(need)
            if slots is None:
                cache.evict(need - allocator.available_size())
                slots = allocator.alloc(need)
            if slots is not None:
                value = torch.cat([indices, slots])
                cached = cache.insert(key, value)
                allocator.free(value[len(indices) : cached])
            cache.dec_lock_ref(node)
    elapsed = time.perf_counter() - t0
    print(f"{num_ops:,} ops in {elapsed:.1f} s ({num_ops / elapsed:,.0f} ops/s); mix {counts}")
    print(f"tree at the end: {cache.total_size():,} tokens, {len(running)} running requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000, help="random ops in the last part")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    compare_bench(rng)
    throughput_bench(rng)
    random_ops_bench(rng, args.ops)


if __name__ == "__main__":
    main()
