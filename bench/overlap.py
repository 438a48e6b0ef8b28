"""Overlap scheduling and tensor parallelism benchmark: decode throughput, side by side.

One run, tiny random-weight Llamas made on the fly, every figure a ratio of two configurations
measured in the same process (alternating, median of ``--repeats``):

1. In one process (``Engine``: scheduler + ``ModelRunner``, whose ``submit`` runs the forward on
   its own thread): decode throughput with overlap scheduling on versus off, for a tiny model
   (scheduler work is a large share of a step) and a larger one (the forward dominates).
2. On Ray (``Scheduler`` + ``WorkerGroup``: rank-0 actor, peers follow over gloo): tp=1 versus
   tp=2, each with overlap on and off.
3. The per-step cost of rank 0's broadcast of a decode batch between two gloo processes: the
   packed batch through ``BatchChannel`` (one byte tensor, one collective, as
   ``cluster/tp_worker.py`` does; pack and unpack included) beside ``broadcast_object_list`` of
   the pickled ``ForwardBatch`` (what it did before), a one-element tensor broadcast (the latency
   floor) and a decode step of the same batch.

    python bench/overlap.py                 # about 3 minutes on 2 cores
    python bench/overlap.py --repeats 1 --output-len 32   # quicker
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time

import torch

from radixray.cluster.engine import Engine
from radixray.worker.make_model import make_model

MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128),
    "small": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                  intermediate_size=1408),
}


def workload(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 2000, (batch, prompt_len), generator=g).tolist()


def decode_throughput(run_once, prompts, output_len: int) -> float:
    """Output tokens per second of one full run (all requests submitted at once)."""
    start = time.perf_counter()
    outs = run_once(prompts, output_len)
    elapsed = time.perf_counter() - start
    assert all(len(o) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def alternate(configs: dict, prompts, output_len: int, repeats: int) -> dict[str, float]:
    """Median throughput per configuration, measured in alternation so drift hits all."""
    samples = {name: [] for name in configs}
    for _ in range(repeats):
        for name, run_once in configs.items():
            samples[name].append(decode_throughput(run_once, prompts, output_len))
    return {name: statistics.median(v) for name, v in samples.items()}


# ---------------------------------------------------------------------------------- 1. Engine
def engine_runner(engine: Engine):
    params = lambda n: {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}  # noqa: E731

    def run_once(prompts, output_len):
        return [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                         sampling_params=params(output_len))]
    return run_once


def bench_engine(path: str, args) -> dict[str, float]:
    prompts = workload(args.batch, args.prompt_len)
    engines = {name: Engine(path, max_total_tokens=16384, disable_overlap_schedule=not on)
               for name, on in (("overlap", True), ("no-overlap", False))}
    outs = {n: engine_runner(e)(prompts, 8) for n, e in engines.items()}  # warm up + check
    assert outs["overlap"] == outs["no-overlap"], "overlap changed greedy outputs"
    result = alternate({n: engine_runner(e) for n, e in engines.items()}, prompts,
                       args.output_len, args.repeats)
    for e in engines.values():
        e.scheduler.check_invariant()
        e.shutdown()
    return result


# ---------------------------------------------------------------------------------- 2. Ray
def ray_runner(group, overlap: bool, vocab_size: int, max_running: int | None = None):
    from radixray.scheduler.config import SchedulerConfig
    from radixray.scheduler.request import Req
    from radixray.scheduler.scheduler import Scheduler
    from radixray.worker.sampling_params import SamplingParams

    def run_once(prompts, output_len):
        sched = Scheduler(SchedulerConfig(disable_overlap_schedule=not overlap,
                                          max_running_requests=max_running), group,
                          eos_token_ids=set(), vocab_size=vocab_size)
        for i, p in enumerate(prompts):
            sched.add_request(Req(f"r{i}", p, SamplingParams(
                max_new_tokens=output_len, temperature=0, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while sched.has_work:
            for out in sched.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        sched.check_invariant()
        return [tokens[f"r{i}"] for i in range(len(prompts))]
    return run_once


def bench_ray(path: str, args) -> dict[str, float]:
    import ray

    from radixray.cluster.server_args import RUNNER_ARGS, runner_config
    from radixray.cluster.worker_group import WorkerGroup
    from radixray.scheduler.config import SchedulerConfig

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    cfg = runner_config(path, SchedulerConfig(max_total_tokens=16384),
                        {**RUNNER_ARGS, "device": "cpu"})
    prompts = workload(args.batch, args.prompt_len)
    groups = {tp: WorkerGroup(cfg, tp) for tp in (1, 2)}
    vocab = groups[1].info["vocab_size"]
    configs = {f"tp{tp} {'overlap' if on else 'no-overlap'}":
               ray_runner(g, on, vocab, args.max_running)
               for tp, g in groups.items() for on in (True, False)}
    first = {name: run(prompts, 8) for name, run in configs.items()}  # warm up + check
    assert len({str(v) for v in first.values()}) == 1, "tp/overlap changed greedy outputs"
    result = alternate(configs, prompts, args.output_len, args.repeats)
    for g in groups.values():
        g.shutdown()
    ray.shutdown()
    return result


# ---------------------------------------------------------------------------------- 3. broadcast
def _broadcast_worker(rank: int, port: int, payload: bytes, steps: int, queue) -> None:
    import torch.distributed as dist

    from radixray.cluster.tp_worker import BatchChannel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    batch = pickle.loads(payload)
    channel = BatchChannel("cpu")
    timings = {}
    for name in ("object", "packed", "tensor") * 2:  # twice, alternating; keep the second
        one = torch.zeros(1, dtype=torch.int64)
        for i in range(steps + 10):
            if i == 10:
                dist.barrier()
                start = time.perf_counter()
            if name == "object":
                dist.broadcast_object_list([batch] if rank == 0 else [None], src=0)
            elif name == "packed":
                channel.send(batch) if rank == 0 else channel.recv()
            else:
                dist.broadcast(one, src=0)
        timings[name] = (time.perf_counter() - start) / steps
    if rank == 0:
        queue.put(timings)
    dist.destroy_process_group()


def bench_broadcast(path: str, args) -> dict[str, float]:
    import torch.multiprocessing as mp

    from radixray.cluster.tp_worker import free_port
    from radixray.worker.forward_batch import pack_batch

    engine = Engine(path, max_total_tokens=16384, disable_overlap_schedule=True)
    captured = []
    forward = engine.runner.forward

    def recording_forward(batch):
        if batch.batch_size == args.batch and batch.num_tokens == args.batch:
            captured.append(batch)
        return forward(batch)
    engine.runner.forward = recording_forward
    engine_runner(engine)(workload(args.batch, args.prompt_len), 4)
    batch = captured[-1]
    step_start = time.perf_counter()
    for _ in range(20):
        forward(batch)
    step = (time.perf_counter() - step_start) / 20
    engine.shutdown()
    payload = pickle.dumps(batch)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_worker, args=(r, port, payload, 200, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    timings = queue.get(timeout=300)
    for p in procs:
        p.join()
    return {"bytes": len(payload), "packed_bytes": pack_batch(batch).numel(),
            "object_s": timings["object"], "packed_s": timings["packed"],
            "tensor_s": timings["tensor"], "decode_step_s": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--max-running", type=int, default=None,
                    help="cap running requests (the rest queue) in the Ray part; None: all run")
    args = ap.parse_args()
    os.environ.setdefault("RADIXRAY_TORCH_THREADS", "1")  # the Ray workers: one core each
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: make_model(os.path.join(tmp, name), arch="llama", vocab_size=2048,
                                  max_position=4096, seed=0, **shape)
                 for name, shape in MODELS.items()}
        print(f"batch {args.batch}, prompt {args.prompt_len}, output {args.output_len} tokens, "
              f"median of {args.repeats}; {torch.get_num_threads()} torch threads in process")
        print("\n1. one process (Engine), decode throughput, output tokens/s")
        for name, path in paths.items():
            r = bench_engine(path, args)
            print(f"  {name:6s} overlap {r['overlap']:8.0f}  no-overlap {r['no-overlap']:8.0f}"
                  f"  ratio {r['overlap'] / r['no-overlap']:.2f}x")
        if not args.skip_ray:
            print("\n2. Ray replica workers (rank-0 actor + gloo peers), output tokens/s")
            for name, path in paths.items():
                r = bench_ray(path, args)
                cells = "  ".join(f"{k} {v:7.0f}" for k, v in r.items())
                print(f"  {name:6s} {cells}")
                print(f"  {name:6s} overlap/no-overlap tp1 "
                      f"{r['tp1 overlap'] / r['tp1 no-overlap']:.2f}x, tp2 "
                      f"{r['tp2 overlap'] / r['tp2 no-overlap']:.2f}x; tp2/tp1 (overlap) "
                      f"{r['tp2 overlap'] / r['tp1 overlap']:.2f}x")
        print("\n3. rank-0 broadcast of one decode batch (gloo, 2 processes)")
        for name, path in paths.items():
            b = bench_broadcast(path, args)
            print(f"  {name:6s} packed {b['packed_bytes']} B: {b['packed_s'] * 1e6:5.0f} us; "
                  f"broadcast_object_list {b['bytes']} B: {b['object_s'] * 1e6:5.0f} us; one-int "
                  f"floor {b['tensor_s'] * 1e6:.0f} us; decode step "
                  f"{b['decode_step_s'] * 1e3:.2f} ms -> packed broadcast = "
                  f"{b['packed_s'] / b['decode_step_s']:.1%} of a step (object: "
                  f"{b['object_s'] / b['decode_step_s']:.1%})")


if __name__ == "__main__":
    main()
