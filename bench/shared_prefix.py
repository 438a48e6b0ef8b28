"""Shared-prefix benchmark: what the radix cache and the scheduler buy on SGLang's
``generated-shared-prefix`` workload (groups of prompts that share a long system prompt).

One run, one model (a small random Llama made on the fly, or ``--model``), side by side:

1. Prefill tokens computed by radixray (``lpm`` and ``fcfs``) versus the minimum possible, the
   number of distinct tokens in the trie of all prompts.
2. Throughput (requests and output tokens per second, all requests submitted at once) of
   radixray versus radixray with ``--disable-radix-cache`` and versus HF ``generate`` in
   static batches; greedy outputs are compared with HF's as a sanity check.
3. Scheduler CPU time per decode step with 64 running requests, against a runner that does
   no work, so only ``schedule()`` + ``process_output()`` are timed.

    python bench/shared_prefix.py                      # defaults: under a minute on 2 cores
    python bench/shared_prefix.py --tiny               # the test suite's hidden-64 model
    python bench/shared_prefix.py --groups 4 --prompts-per-group 8 --output-len 8   # quicker
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from radixray.cluster.engine import Engine
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.radix_cache import RadixCache, RadixKey
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.forward_batch import ForwardOutput
from radixray.worker.sampling_params import SamplingParams

# The default model: small, but shaped like an LLM (head_dim 64, linear layers doing most of
# the FLOPs). ``--tiny`` takes the test suite's shape instead (hidden 64, head_dim 16), where
# attention FLOPs dominate and bound what prefix reuse can save (see bench/README.md).
SMALL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688,
             vocab_size=2048, max_position=4096, seed=0)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            vocab_size=2048, max_position=4096, seed=0)


def make_workload(groups: int, per_group: int, system_len: int, question_len: int,
                  vocab: int, seed: int = 0) -> list[list[int]]:
    """``groups x per_group`` prompts: a group's system prompt + a random question each,
    shuffled (a queue that arrives interleaved, as real traffic does)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(5, vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(5, vocab) for _ in range(question_len)]
                    for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def trie_tokens(prompts: list[list[int]]) -> int:
    """Distinct tokens in the trie of all prompts: the least prefill any system can do."""
    trie = RadixCache()
    for p in prompts:
        trie.insert(RadixKey(p), torch.zeros(len(p), dtype=torch.int64))
    return trie.total_size()


def run_radixray(model_path: str, prompts, output_len: int, repeat: int,
                 **server_args) -> dict:
    """Best of ``repeat`` runs, each from an empty cache, after a warm-up."""
    with Engine(model_path, **server_args) as engine:
        forward, spent = engine.runner.forward, [0.0]

        def timed_forward(batch):
            t = time.perf_counter()
            out = forward(batch)
            spent[0] += time.perf_counter() - t
            return out

        engine.runner.forward = timed_forward
        engine.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 2})  # warm-up
        best = None
        for _ in range(repeat):
            engine.flush_cache()
            prefill_before, spent[0] = engine.scheduler.stats.prefill_tokens, 0.0
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
            wall = time.perf_counter() - start
            if best is None or wall < best["wall"]:
                best = {"wall": wall, "forward": spent[0],
                        "outputs": [o["output_ids"] for o in outs],
                        "prefill_tokens": engine.scheduler.stats.prefill_tokens - prefill_before}
        return best


@torch.inference_mode()
def run_hf(model_path: str, prompts, output_len: int, batch_size: int, repeat: int) -> dict:
    """HF ``generate`` over static batches in arrival order; best of ``repeat`` after a
    warm-up batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # like ignore_eos: EOS may be sampled and does not stop (min_new_tokens would instead
    # forbid EOS, changing greedy outputs wherever EOS is the argmax)
    model.generation_config.eos_token_id = None
    pad = 2

    def generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad)
        return gen[:, width:].tolist()

    generate(prompts[:batch_size])  # warm-up
    best = None
    for _ in range(repeat):
        outputs, start = [], time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            outputs += generate(prompts[b : b + batch_size])
        wall = time.perf_counter() - start
        if best is None or wall < best["wall"]:
            best = {"wall": wall, "outputs": outputs}
    return best


class NullRunner:
    """Answers instantly (token 7 every time): isolates the scheduler's own cost."""

    def __init__(self, max_total_tokens: int, max_running_requests: int, max_context_len: int):
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len

    def forward(self, batch) -> ForwardOutput:
        return ForwardOutput(next_token_ids=torch.full((batch.batch_size,), 7))


def scheduler_overhead(num_running: int = 64, prompt_len: int = 512, steps: int = 300) -> dict:
    """Microseconds of schedule() and process_output() per decode step, in this thread's CPU
    time (wall time would count whatever else the machine runs meanwhile)."""
    sched = Scheduler(SchedulerConfig(), NullRunner(1 << 17, 256, 8192))
    rng = random.Random(1)
    for i in range(num_running):
        prompt = [rng.randrange(5, 2048) for _ in range(prompt_len)]
        sched.add_request(Req(f"r{i}", prompt, SamplingParams(max_new_tokens=10_000)))
    while len(sched.running) < num_running or sched.waiting or sched.chunked_req:
        sched.step()
    sched.step()  # the last prefill batch merges into the running set
    schedule_us, process_us = [], []
    for _ in range(steps):
        t0 = time.thread_time()
        batch = sched.schedule()
        t1 = time.thread_time()
        out = sched.runner.forward(batch.forward_batch)
        t2 = time.thread_time()
        sched.advance(batch)
        sched.process_output(batch, out)
        t3 = time.thread_time()
        assert len(batch.decode) == num_running and not batch.prefill
        schedule_us.append((t1 - t0) * 1e6)
        process_us.append((t3 - t2) * 1e6)
    total = sorted(a + b for a, b in zip(schedule_us, process_us))
    return {"schedule": statistics.median(schedule_us), "process": statistics.median(process_us),
            "p50": total[len(total) // 2], "p99": total[int(len(total) * 0.99)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool size (default: every prompt and output, even unshared)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per system; the best counts")
    ap.add_argument("--model", help="model folder (default: make a small random Llama)")
    ap.add_argument("--tiny", action="store_true",
                    help="make the test suite's hidden-64 Llama instead of the hidden-256 one")
    args = ap.parse_args()
    torch.manual_seed(0)

    model_path = args.model
    if model_path is None:
        from radixray.worker.make_model import make_model
        dims = TINY if args.tiny else SMALL
        model_path = make_model(tempfile.mkdtemp(prefix="radixray-bench-"), arch="llama", **dims)
    prompts = make_workload(args.groups, args.prompts_per_group, args.system_len,
                            args.question_len, SMALL["vocab_size"])
    n_req, n_out = len(prompts), len(prompts) * args.output_len
    print(f"workload: {args.groups} groups x {args.prompts_per_group} prompts, system "
          f"{args.system_len} + question {args.question_len} tokens, {args.output_len} out; "
          f"model {model_path}")

    minimum, total_prompt = trie_tokens(prompts), sum(len(p) for p in prompts)
    common = dict(max_total_tokens=args.max_total_tokens or total_prompt + n_out + 1024)
    out_len, repeat = args.output_len, args.repeat
    runs = {
        "radixray lpm": run_radixray(model_path, prompts, out_len, repeat,
                                     schedule_policy="lpm", **common),
        "radixray fcfs": run_radixray(model_path, prompts, out_len, repeat,
                                      schedule_policy="fcfs", **common),
        "radixray no cache": run_radixray(model_path, prompts, out_len, repeat,
                                          disable_radix_cache=True, **common),
        "HF generate": run_hf(model_path, prompts, out_len, args.hf_batch_size, repeat),
    }

    print(f"\n1. prefill tokens computed (minimum = distinct trie tokens = {minimum}; "
          f"all prompt tokens = {total_prompt})")
    for name in ("radixray lpm", "radixray fcfs", "radixray no cache"):
        computed = runs[name]["prefill_tokens"]
        print(f"   {name:18s} {computed:8d}   {computed / minimum:6.3f}x minimum")

    hf = runs["HF generate"]
    print(f"\n2. throughput ({n_req} requests, {n_out} output tokens, all submitted at once)")
    for name, r in runs.items():
        same = sum(a == b for a, b in zip(r["outputs"], hf["outputs"]))
        extra = (f"  forward {r['forward'] / r['wall']:5.1%} of wall" if "forward" in r else "")
        print(f"   {name:18s} {n_req / r['wall']:7.2f} req/s {n_out / r['wall']:8.1f} out tok/s"
              f"   {hf['wall'] / r['wall']:6.2f}x HF   same tokens as HF {same}/{n_req}{extra}")
    nocache = runs["radixray no cache"]["wall"]
    print(f"   radix cache speed-up (lpm vs --disable-radix-cache): "
          f"{nocache / runs['radixray lpm']['wall']:.2f}x")

    o = scheduler_overhead()
    print("\n3. scheduler CPU time per decode step, 64 running requests (runner does no work)")
    print(f"   schedule {o['schedule']:.0f} us + process_output {o['process']:.0f} us (medians);"
          f" total p50 {o['p50']:.0f} us, p99 {o['p99']:.0f} us  (target < 1000 us)")


if __name__ == "__main__":
    main()
