"""Where a replica runs and how it is reached, as pure decisions (no Ray cluster, no GPU):
the ranks' device (``--device auto`` against the cluster's GPUs), the head's node (rank 0's),
the URL it advertises (its node's IP when bound to a wildcard), and its HTTP port
(``--replica-port-policy``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from radixray.cluster.replica import ACTOR_PREFIX, NAMESPACE, advertised_url, replica_actor_options
from radixray.cluster.serve import add_serve_arguments, replica_port, server_args_from
from radixray.cluster.tp_worker import is_gpu_device
from radixray.cluster.worker_group import rank_bundle, resolve_device
from radixray.worker.model_runner import RunnerConfig


def serve_args(*argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------------ bug 1: the ranks' device
@pytest.mark.parametrize("requested, cluster_gpus, device", [
    ("auto", 0, "cpu"),
    ("auto", 0.5, "cpu"),  # a fraction of a GPU cannot hold a rank
    ("auto", 1, "cuda"),
    ("auto", 16, "cuda"),
    ("cpu", 8, "cpu"),  # asked for: kept, GPUs or not
    ("cuda", 0, "cuda"),  # GPU nodes may join later (autoscaling): the ranks wait for them
    ("cuda:1", 8, "cuda"),  # Ray shows each rank its own GPU as cuda:0
])
def test_resolve_device(requested, cluster_gpus, device):
    assert resolve_device(requested, cluster_gpus) == device


def test_serve_defaults_to_auto_and_passes_it_on():
    args = serve_args()
    assert args.device == "auto"
    assert server_args_from(args)["device"] == "auto"
    assert server_args_from(serve_args("--device", "cuda:0"))["device"] == "cuda:0"


def test_serve_draws_one_random_seed_for_all_replicas():
    args = serve_args()
    assert args.random_seed is None
    drawn = {server_args_from(args)["random_seed"] for _ in range(8)}
    assert all(isinstance(s, int) for s in drawn) and len(drawn) > 1  # a new one per start
    assert server_args_from(serve_args("--random-seed", "5"))["random_seed"] == 5


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_devices_ask_ray_for_a_gpu_per_rank(device):
    assert is_gpu_device(device)
    assert rank_bundle(device) == {"GPU": 1, "CPU": 1}


@pytest.mark.parametrize("device", ["cpu", "meta", "cudax"])
def test_other_devices_ask_for_a_cpu_only(device):
    assert not is_gpu_device(device)
    assert rank_bundle(device) == {"CPU": 1}


def test_unresolved_auto_is_refused_for_placement():
    with pytest.raises(ValueError, match="auto"):
        rank_bundle("auto")


@pytest.mark.parametrize("cluster_gpus, dtype", [(0, torch.float32), (4, torch.bfloat16)])
def test_dtype_auto_follows_the_resolved_device(cluster_gpus, dtype):
    """--dtype auto: float32 on CPU, bfloat16 on GPU, once the device is resolved (an
    unresolved "auto" device would have read as not-CPU)."""
    cfg = RunnerConfig("unused", device=resolve_device("auto", cluster_gpus))
    assert cfg.torch_dtype == dtype


def test_offline_engine_resolves_auto_to_what_this_process_has(tiny_llama_path):
    from radixray.cluster.engine import Engine

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    with Engine(tiny_llama_path, device="auto", max_total_tokens=256) as engine:
        assert engine.server_args["device"] == expected
        assert engine.runner.device.type == expected


# ------------------------------------------------------------------ bug 2: URL and head node
@pytest.mark.parametrize("bind_host, node_ip, url", [
    ("0.0.0.0", "10.0.3.7", "http://10.0.3.7:30001"),
    ("::", "fd00::7", "http://[fd00::7]:30001"),
    ("", "10.0.3.7", "http://10.0.3.7:30001"),
    ("127.0.0.1", "10.0.3.7", "http://127.0.0.1:30001"),  # a specific address is kept
    ("10.0.3.9", "10.0.3.7", "http://10.0.3.9:30001"),
])
def test_advertised_url(bind_host, node_ip, url):
    assert advertised_url(bind_host, 30001, node_ip) == url


def test_head_is_pinned_to_rank_zeros_node():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = "ab" * 28
    options = replica_actor_options("3", node_id)
    strategy = options["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert strategy.node_id == node_id
    assert strategy.soft  # a restart after that node died goes elsewhere instead of never
    # Unchanged: discoverable by name, no CPU of its own, restarted by Ray when it dies.
    assert options["name"] == f"{ACTOR_PREFIX}3" and options["namespace"] == NAMESPACE
    assert options["num_cpus"] == 0 and options["max_restarts"] == -1


def test_two_deployments_in_one_cluster_name_nothing_alike():
    """Placement group names are global in a Ray cluster: a second serve (another model) on
    the cluster failed with "placement group 'replica:0' already exists", and a restarted head
    would have removed the other deployment's worker groups (it removes its name prefix's)."""
    from radixray.cluster.replica import pg_name
    from radixray.cluster.cli import build_parser

    assert replica_actor_options("0", "ab" * 28, "team-b")["namespace"] == "team-b"
    a, b = pg_name(NAMESPACE, "0"), pg_name("team-b", "0")
    assert a != b and not (a + "/").startswith(b + "/") and not (b + "/").startswith(a + "/")
    assert build_parser().parse_args(["serve"]).ray_namespace == NAMESPACE


# ------------------------------------------------------------------ bug 3: replica ports
def test_per_replica_ports_are_unique_in_the_cluster():
    nodes = ["a", "b", "a", "c"]
    assert [replica_port("per-replica", 30001, i, nodes[:i], n) for i, n in enumerate(nodes)] \
        == [30001, 30002, 30003, 30004]


def test_per_node_ports_repeat_across_nodes():
    nodes = ["a", "b", "a", "c", "a"]
    assert [replica_port("per-node", 8000, i, nodes[:i], n) for i, n in enumerate(nodes)] \
        == [8000, 8000, 8001, 8000, 8002]


def test_per_node_on_one_machine_is_per_replica():
    nodes = ["only"] * 3
    for i in range(3):
        assert replica_port("per-node", 30001, i, nodes[:i], "only") \
            == replica_port("per-replica", 30001, i, nodes[:i], "only")


def test_port_policy_flag():
    assert serve_args().replica_port_policy == "per-replica"
    assert serve_args("--replica-port-policy", "per-node").replica_port_policy == "per-node"
    with pytest.raises(SystemExit):
        serve_args("--replica-port-policy", "same")
    with pytest.raises(ValueError, match="policy"):
        replica_port("same", 30001, 0, [], "a")


def test_a_restarted_head_takes_the_next_free_port_when_its_own_is_taken():
    """With the per-node policy, Ray may restart a head on a node where another replica
    listens on its port: it must serve on the next free one rather than fail for good."""
    import socket

    from radixray.cluster.replica import bindable_port

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert bindable_port("127.0.0.1", port) > port
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert bindable_port("127.0.0.1", port) == port  # free again: kept
