"""TPWorker without Ray (a plain class): calls that arrive out of order run in submission
order, each reading the tokens the step before it sampled (overlap scheduling's references)."""

from __future__ import annotations

import threading

import torch

from helpers import greedy_batch
from hf_reference import hf_greedy
from radixray.cluster.tp_worker import TPWorker
from radixray.worker.forward_batch import ForwardOutput
from radixray.worker.model_runner import RunnerConfig


def test_out_of_order_calls_run_in_sequence_and_read_the_last_tokens(tiny_llama_path):
    worker = TPWorker(0, 1, RunnerConfig(tiny_llama_path, max_total_tokens=256,
                                         max_running_requests=4))
    worker.init("127.0.0.1", 0)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    prefill = greedy_batch(sum(prompts, []), [0, 1, 2, 3, 4, 0, 1, 2], [1, 2], [0, 0], [5, 3],
                     range(1, 9))
    # overlap scheduling's next step: decode inputs are references to the tokens the prefill
    # is about to sample (-row), sent before the prefill's tokens are back
    decodes = [greedy_batch([-1, -2], [5, 3], [1, 2], [5, 3], [1, 1], [9, 10]),
               greedy_batch([-1, -2], [6, 4], [1, 2], [6, 4], [1, 1], [11, 12])]
    results: dict[int, ForwardOutput] = {}

    def call(batch, seq):
        results[seq] = worker.forward(batch, seq)

    threads = [threading.Thread(target=call, args=(b, s))
               for s, b in reversed(list(enumerate([prefill] + decodes)))]  # last one first
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert sorted(results) == [0, 1, 2]
    tokens = [[results[s].next_token_ids[i].item() for s in range(3)] for i in range(2)]
    assert tokens == [hf_greedy(tiny_llama_path, p, 3) for p in prompts]


def test_start_host_copy_leaves_cpu_outputs_as_they_are():
    out = ForwardOutput(next_token_ids=torch.tensor([4, 2]))
    assert out.start_host_copy()() is out and out.next_token_ids.tolist() == [4, 2]


IDLE_PEER = r"""
import sys, time
from radixray.cluster.tp_worker import TPWorker
from radixray.worker.model_runner import RunnerConfig
rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
worker = TPWorker(rank, 2, RunnerConfig(path, max_total_tokens=64, max_running_requests=2,
                                        tp_rank=rank, tp_size=2))
worker.init("127.0.0.1", port, timeout_s=2.0)  # the group's timeout: 2 s
if rank == 0:
    time.sleep(5)  # idle for longer than that
    worker.stop()
else:
    print("steps", worker.follow(), flush=True)
# leave together: a rank exiting while its peer still reads the group can abort the peer
import torch.distributed as dist
dist.barrier()
dist.destroy_process_group()
"""


def test_an_idle_peer_outlives_the_group_timeout(tiny_llama_path):
    """A peer waits in the batch broadcast for as long as its replica is idle; it used to die
    when that wait passed the process group's timeout (every idle minute)."""
    import subprocess
    import sys

    from radixray.cluster.tp_worker import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", IDLE_PEER, str(rank), str(port),
                               tiny_llama_path], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][1][-2000:]
    assert "steps 0" in outs[1][0]
