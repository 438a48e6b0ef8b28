"""Full garbage collections in a serving process, before and after freezing the start-up heap.

    python bench/gc_pause.py                # ~20 s on a quiet 2-core box

A process that has loaded torch, transformers, the tokenizer and a model holds a few hundred
thousand objects the cyclic garbage collector tracks. Every full (oldest-generation)
collection walks all of them with the GIL held: the engine's decode steps and the HTTP event
loop of that process stall meanwhile. CPython starts one whenever the objects that survived
into the oldest generation since the last one reach a quarter of those it holds, which a busy
server reaches again and again. Replicas freeze the start-up heap once they are up
(``cluster/heap.py``); this measures the pause of a full collection (``gc.collect()``, median
of ``--samples``) in an offline Engine's process, after a warm-up batch of ``--batch``
requests, before and after ``freeze_startup_heap()``, side by side in one process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

from radixray.cluster.engine import Engine
from radixray.cluster.heap import freeze_startup_heap
from radixray.worker.make_model import make_model


def collect_pause_ms(samples: int) -> float:
    pauses = []
    for _ in range(samples):
        t0 = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(pauses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    model = make_model(tempfile.mkdtemp(prefix="radixray-bench-"), arch="llama")
    engine = Engine(model_path=model)
    prompts = [f"def f{i}(x):\n    return" for i in range(args.batch)]
    try:
        engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0})
        tracked = len(gc.get_objects())
        before = collect_pause_ms(args.samples)
        frozen = freeze_startup_heap()
        engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0})
        left = len(gc.get_objects())
        after = collect_pause_ms(args.samples)
    finally:
        engine.shutdown()
    print(f"objects the collector tracks: {tracked:,} before the freeze ({frozen:,} frozen), "
          f"{left:,} after it and another batch")
    print(f"full collection pause: {before:.1f} ms before the freeze, {after * 1e3:.0f} us "
          f"after ({before / max(after, 1e-3):,.0f}x shorter)")


if __name__ == "__main__":
    main()
