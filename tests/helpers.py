"""Workloads and process plumbing that several test files share."""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path

import torch


def multi_turn_chats(engine, turns=4, convs=4, seed=1):
    """``convs`` conversations of ``turns`` turns through ``engine.generate`` (60 tokens of
    history, then 15 user + 6 greedy reply tokens a turn: ~130 tokens each by the end, so a
    300-token device pool evicts earlier turns). Returns every turn's results."""
    rng = random.Random(seed)
    history = [[rng.randrange(3, 2000) for _ in range(60)] for _ in range(convs)]
    results = []
    for _ in range(turns):
        for h in history:
            h += [rng.randrange(3, 2000) for _ in range(15)]
        res = engine.generate(input_ids=[list(h) for h in history], sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        for h, r in zip(history, res):
            h += r["output_ids"]
        results.append(res)
    engine.scheduler.check_invariant()
    return results


def run_ranks(target, *args, world: int = 2, timeout: float = 120) -> dict:
    """Run ``target(rank, port, *args, queue)`` in ``world`` spawned processes (a free port
    for their process group) and return what each put on the queue, by rank: ``target``
    ends with ``queue.put((rank, result))``."""
    import torch.multiprocessing as mp

    from radixray.cluster.tp_worker import free_port

    ctx = mp.get_context("spawn")
    queue, port, read = ctx.Queue(), free_port(), ctx.Event()
    procs = [ctx.Process(target=_rank_main, args=(target, rank, port, args, queue, read))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        read.set()
    for p in procs:
        p.join(timeout=30)
    return results


def _rank_main(target, rank: int, port: int, args: tuple, queue, read) -> None:
    target(rank, port, *args, queue)
    # Tensors on a torch queue travel as shared-memory handles that the receiver opens through
    # this process: leaving before the parent has read them fails its read (EOFError).
    read.wait(timeout=120)


def all_nodes(cache):
    """Every node of a RadixCache, the root included."""
    stack, out = [cache.root], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def greedy_batch(ids, positions, rows, prefix_lens, extend_lens, slots):
    """A ForwardBatch of greedy requests that carry no prefix slots (their rows were written
    by earlier steps): every argument a list or tensor of ints."""
    from radixray.worker.forward_batch import ForwardBatch
    from radixray.worker.sampling_params import SamplingParams

    t = lambda x: torch.as_tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        input_ids=t(ids), positions=t(positions), req_pool_indices=t(rows),
        prefix_lens=t(prefix_lens), extend_lens=t(extend_lens), out_cache_loc=t(slots),
        prefix_slots=t([]), prefix_slot_lens=t([0] * len(rows)),
        sampling_params=[SamplingParams(temperature=0.0) for _ in rows])


def sampling_batch(params, output_lens=None, history=None, vocab_mask=None,
                   return_logprob=None, top_logprobs_num=None):
    """A ForwardBatch that only the sampler reads: one decode token per request of ``params``
    (SamplingParams), with the sampler's optional per-request inputs."""
    from radixray.worker.forward_batch import ForwardBatch

    b = len(params)
    zeros = torch.zeros(b, dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.zeros(b, dtype=torch.int64), positions=zeros.clone(),
        req_pool_indices=torch.arange(1, b + 1), prefix_lens=zeros.clone(),
        extend_lens=torch.ones(b, dtype=torch.int64), out_cache_loc=torch.arange(1, b + 1),
        prefix_slots=torch.zeros(0, dtype=torch.int64), prefix_slot_lens=zeros.clone(),
        sampling_params=params, penalty_history=history or [],
        output_lens=None if output_lens is None else torch.tensor(output_lens),
        return_logprob=None if return_logprob is None else torch.tensor(return_logprob),
        top_logprobs_num=None if top_logprobs_num is None else torch.tensor(top_logprobs_num),
        vocab_mask=vocab_mask)


def write_dummy_llama(path, head_dim: int = 16) -> str:
    """A Llama config.json alone in ``path`` (2 layers, 4 heads, 2 KV heads, vocab 128): a
    runner with load_format="dummy" draws random weights for it. Returns the folder."""
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], hidden_size=4 * head_dim, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)))
    return str(path)


def processes_using(*words: str) -> set[int]:
    """Ids of processes whose command line mentions every one of ``words``."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and all(w in cmdline for w in words):
            pids.add(int(entry.name))
    return pids


def wait_healthy(url: str, timeout: float, alive=lambda: True, interval: float = 0.2) -> None:
    """Until ``url``'s /health answers 200; AssertionError after ``timeout`` seconds, or as
    soon as ``alive()`` (the server's process still runs, say) turns false."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # nothing listens yet (starting, or restarting)
        assert alive(), f"{url}: the server's process ended"
        assert time.monotonic() < deadline, f"{url} did not become healthy in {timeout} s"
        time.sleep(interval)


def ports_below_ephemeral(count: int) -> list[int]:
    """``count`` free ports below the kernel's ephemeral range. A port from bind(0) lies inside
    it, and Ray, starting a moment later, binds its own ports there: a serve's replica on
    --port + 1 found that port taken in one CI run of two."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    chosen: list[int] = []
    while len(chosen) < count:
        port = rng.randrange(max(1024, low - 12000), low - 1)
        if port in chosen:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    return chosen
