"""``radixray serve``: replicas on Ray behind the cache-aware router.

The command starts (or joins, with ``--ray-address``) a Ray cluster, starts ``--replicas``
replica actors (each a scheduler head plus ``--tp-size`` worker actors, see ``replica.py``),
each serving HTTP on a port from ``--replica-base-port`` (``replica_port``), then runs the
router on ``--port`` in its own process (``router_process.py``) and waits, starting the router
again if it exits. Ctrl-C or SIGTERM stops the router, the replicas and the local Ray.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import subprocess
import sys
import time

from ..router.config import POLICY_NAMES
from .chat_prompt import read_chat_template
from .engine_protocol import HEALTH_CHECK_TIMEOUT_S as REPLICA_HEALTH_TIMEOUT_S
from .router_process import (ROUTER_HEALTH_MARGIN_S, ROUTER_MAX_RESTARTS,
                             ROUTER_RESTART_WINDOW_S, check_router_args, die_with_parent,
                             discovery_args, exit_reason, router_command, router_env)
from .tool_calls import PARSERS as TOOL_CALL_PARSERS

DEMO_MODEL_NAME = "radixray-demo"  # what clients send as "model" to the built-in demo model
REPLICA_PORT_POLICIES = ("per-replica", "per-node")

# Scheduler arguments as flags: SchedulerConfig's field -> (type, help). Defaults come from
# SchedulerConfig itself, so --help always shows the real ones.
_SCHEDULER_FLAGS = {
    "schedule_policy": (str, "waiting-queue order"),
    "schedule_max_wait": (float, "lpm, dfs-weight, lof, routing-key: a request waiting longer "
                                 "(s) goes first, oldest first; 0: never"),
    "schedule_conservativeness": (float, "> 1 admits fewer requests at once, < 1 more"),
    "chunked_prefill_size": (int, "longest prefill piece per step; -1 turns chunking off"),
    "max_prefill_tokens": (int, "prompt tokens per prefill batch"),
    "max_total_tokens": (int, "KV pool size in tokens; None: sized from memory"),
    "max_running_requests": (int, "running-request cap; None: 256"),
    "page_size": (int, "tokens per KV page"),
    "radix_eviction_policy": (str, "which cached prefixes go first when memory runs short"),
    "disable_radix_cache": (bool, "no prefix sharing at all"),
    "enable_mixed_chunk": (bool, "running decodes ride along with prefill batches"),
    "disable_overlap_schedule": (bool, "wait for each batch's tokens before building the next"),
    "debug_invariants": (bool, "check the KV memory invariant after every step (slow)"),
    "random_seed": (int, "seed for unseeded sampling and the random queue policy; None: "
                         "one drawn at start (the replicas share it)"),
    "disable_jump_forward": (bool, "decode text a grammar forces token by token instead of "
                                   "appending it at once"),
    "grammar_compile_timeout": (float, "seconds a grammar may take to compile before its "
                                       "request fails"),
    "enable_hierarchical_cache": (bool, "keep evicted prefixes in a host-memory KV tier and "
                                        "load them back instead of recomputing them"),
    "hicache_ratio": (float, "host KV pool size as a multiple of the device pool"),
    "hicache_size": (float, "host KV pool size in GB per rank; overrides --hicache-ratio "
                            "when > 0"),
    "hicache_write_policy": (str, "write_through: copy to host on insert; write_back: on "
                                  "eviction from the device"),
}


def replica_port(policy: str, base_port: int, index: int, earlier_nodes: list[str],
                 node: str) -> int:
    """The HTTP port of replica ``index``, whose ranks (and so its head) are on ``node``;
    ``earlier_nodes``: the nodes of replicas 0..index-1.

    per-replica: ``base_port + index``, unique in the cluster (one machine, or firewall rules
    per port). per-node: ``base_port`` + how many earlier replicas share the node, so with one
    replica per node (one per Kubernetes worker pod) every replica listens on ``base_port``,
    the one port a Service or ServiceMonitor over the pods can name."""
    if policy == "per-replica":
        return base_port + index
    if policy == "per-node":
        return base_port + earlier_nodes.count(node)
    raise ValueError(f"replica port policy: {policy!r}; use one of {REPLICA_PORT_POLICIES}")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixray serve`` (mutates ``p``)."""
    from ..kernels import ATTENTION_BACKEND_CHOICES
    from ..scheduler.config import (EVICTION_POLICIES, SCHEDULE_POLICIES, WRITE_POLICIES,
                                    SchedulerConfig)
    from .replica import PLACEMENT_TIMEOUT_S

    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--model", "--model-path", dest="model_path", default=None,
                   help="HF model folder; None: the built-in demo model (trained, shipped "
                        "with radixray)")
    p.add_argument("--tokenizer-path", default=None, help="None: the model folder")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send; None: the model path "
                        f"({DEMO_MODEL_NAME!r} for the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000,
                   help="the router's port (the cluster's front door)")
    p.add_argument("--replica-base-port", type=int, default=None,
                   help="first replica HTTP port (see --replica-port-policy); None: --port + 1")
    p.add_argument("--replica-port-policy", choices=REPLICA_PORT_POLICIES, default="per-replica",
                   help="per-replica: replica i listens on base + i; per-node: on base + the "
                        "number of replicas placed before it on the same node (one replica per "
                        "node: all on base, as the Helm chart expects)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="require Authorization: Bearer KEY on every endpoint but /health* and "
                        f"/metrics; default: ${API_KEY_ENV} (out of process listings)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 beyond this many requests waiting for their first token; "
                        "None: no limit")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="parse tool calls in the chat API's replies, in this model family's "
                        "format (qwen25/hermes: <tool_call> blocks; llama3: JSON); None: "
                        "replies stay text")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file for /v1/chat/completions, instead of the "
                        "tokenizer's (read here, once, and sent to every replica)")
    p.add_argument("--health-check-timeout", type=float, default=REPLICA_HEALTH_TIMEOUT_S,
                   help="seconds a replica's /health may wait for its one-token generation "
                        "(past it, a replica that made progress meanwhile is busy, so "
                        "healthy); the router serve starts waits this plus "
                        f"{ROUTER_HEALTH_MARGIN_S:g} s for the answer")
    p.add_argument("--health-check-interval", type=float, default=10.0,
                   help="seconds between the router's health checks of each replica (each a "
                        "one-token generation); a restarted replica gets traffic again at "
                        "the next one")
    g = p.add_argument_group("cluster")
    g.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks per replica (one Ray actor each)")
    g.add_argument("--replicas", "--dp-size", dest="replicas", type=int, default=1,
                   help="data-parallel replicas behind the router")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (e.g. auto); None: start a local Ray")
    g.add_argument("--ray-dashboard-port", type=int, default=None,
                   help="start the local Ray's dashboard on this port of 127.0.0.1 (for `ray "
                        "list` and the web view; it can run jobs, so it never "
                        "listens beyond loopback); None: no dashboard, a quicker start. A "
                        "cluster joined with --ray-address has its own")
    g.add_argument("--ray-namespace", default="radixray",
                   help="Ray namespace of this deployment's replicas (the router discovers "
                        "them there); give each serve on one Ray cluster its own")
    g.add_argument("--router-policy", default="cache_aware", choices=POLICY_NAMES,
                   help="routing policy (see radixray router --help)")
    g.add_argument("--router-args", default="",
                   help="more flags for the router, as one string (e.g. \"--cache-threshold "
                        "0.3 --tree-chars-per-token 2.5\"; see radixray router --help); they "
                        "come last, so they win over serve's own")
    g.add_argument("--placement-timeout", type=float, default=PLACEMENT_TIMEOUT_S,
                   help="seconds each replica waits for nodes with room for its ranks (a "
                        "cluster's autoscaler may be starting them); 0: wait for ever, "
                        "saying so every minute")
    g.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds a forward step may take before its replica restarts")
    g = p.add_argument_group("model runner")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default="auto",
                   help="torch device of the ranks: cpu, cuda (cuda:N counts as cuda: Ray gives "
                        "each rank its GPU), or auto: cuda when the Ray cluster has GPUs when "
                        "serve starts, else cpu")
    g.add_argument("--context-length", type=int, default=None,
                   help="None: the model's max_position_embeddings")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="GPU: share of memory for weights and KV cache")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES,
                   help="auto: flashinfer (if it takes the model) > triton on CUDA, "
                        "torch_native on CPU")
    g.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights (benchmarks)")
    g = p.add_argument_group("scheduler")
    defaults = SchedulerConfig.field_defaults()  # (an instance would have drawn random_seed)
    choices = {"schedule_policy": SCHEDULE_POLICIES, "radix_eviction_policy": EVICTION_POLICIES,
               "hicache_write_policy": WRITE_POLICIES}
    for name, (kind, help_text) in _SCHEDULER_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)
        else:
            g.add_argument(flag, type=kind, default=default, choices=choices.get(name),
                           help=help_text)


RAY_CHECK_INTERVAL_S = 5.0  # how often serve checks that its own Ray node is alive
REPLICA_SHUTDOWN_WAIT_S = 10.0  # how long serve waits for its replicas' graceful shutdown
API_KEY_ENV = "RADIXRAY_API_KEY"  # --api-key's default: a key no `ps` shows


def missing_resources(cluster: dict, device: str, ranks: int) -> str | None:
    """What ``ranks`` ranks on ``device`` need beyond ``cluster``'s total resources (as
    ``ray.cluster_resources()``), as "4 CPU" ; None if they fit."""
    from .worker_group import rank_bundle

    need = {k: v * ranks for k, v in rank_bundle(device).items()}
    short = [f"{need[k]:g} {k}" for k in sorted(need) if cluster.get(k, 0) < need[k]]
    return ", ".join(short) or None


def own_node_alive(ray) -> bool:
    """Whether the Ray node this process runs on is alive (Ray's GCS marks a node whose raylet
    died dead within seconds); True when the GCS cannot say (a transient error)."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:
        return True


def ray_dashboard_args(port: int | None) -> dict:
    """ray.init's dashboard arguments: none, or one on loopback (a dashboard runs jobs)."""
    if port is None:
        return {"include_dashboard": False}
    return {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port}


def server_args_from(args: argparse.Namespace) -> dict:
    """The engine's server arguments (SGLang names) from parsed flags."""
    server_args = {name: getattr(args, name) for name in _SCHEDULER_FLAGS}
    if server_args["random_seed"] is None:  # one draw for the deployment (/get_server_info)
        server_args["random_seed"] = random.randrange(1 << 30)
    server_args.update(dtype=args.dtype, device=args.device, context_length=args.context_length,
                       mem_fraction_static=args.mem_fraction_static,
                       attention_backend=args.attention_backend, load_format=args.load_format,
                       tokenizer_path=args.tokenizer_path)
    return server_args


def run_serve(args: argparse.Namespace) -> int:
    import ray

    from ..scheduler.config import SchedulerConfig
    from ..worker.make_model import ensure_default_model
    from .server_args import split_server_args
    from .replica import port_is_free, reserve_replica_ranks, start_replica
    from .worker_group import resolve_device

    model_path = args.model_path
    if model_path is None:
        print("radixray serve: no --model given; using the built-in demo model "
              "(the trained model shipped with radixray)", flush=True)
        model_path = ensure_default_model()
        if args.served_model_name is None:
            args.served_model_name = DEMO_MODEL_NAME
    server_args = server_args_from(args)
    try:  # reject bad arguments before anything starts
        SchedulerConfig(**split_server_args(server_args)[0])
        for name in ("tp_size", "replicas"):
            if getattr(args, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if args.max_queued_requests is not None and args.max_queued_requests < 1:
            raise ValueError("max_queued_requests: must be >= 1 (leave it out for no limit)")
        for name in ("health_check_timeout", "health_check_interval", "step_timeout"):
            if not 0 < getattr(args, name) < math.inf:
                raise ValueError(f"{name}: must be a number of seconds > 0")
        if not 0 <= args.placement_timeout < math.inf:
            raise ValueError("placement_timeout: must be a number of seconds >= 0 (0: no limit)")
        check_router_args(args)
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        if args.ray_dashboard_port is not None and args.ray_address is not None:
            raise ValueError("ray_dashboard_port: only for the local Ray serve starts; the "
                             "cluster at --ray-address has its own dashboard")
    except ValueError as e:
        print(f"radixray serve: error: {e}", file=sys.stderr)
        return 2
    http_args = {"served_model_name": args.served_model_name, "api_key": args.api_key,
                 "tool_call_parser": args.tool_call_parser, "chat_template": chat_template,
                 "max_queued_requests": args.max_queued_requests,
                 "health_check_timeout": args.health_check_timeout}
    base_port = args.replica_base_port or args.port + 1
    # A wildcard host binds every interface; each replica then advertises its node's IP.
    replica_host = "127.0.0.1" if args.host in ("127.0.0.1", "localhost") else args.host
    if not port_is_free(args.host, args.port):  # before minutes of start-up, not after
        print(f"radixray serve: error: port {args.port} is already in use on {args.host}",
              file=sys.stderr)
        return 1
    stopping = []

    def stop(*_):  # from here on a SIGTERM (Kubernetes, systemd) ends serve through finally
        stopping.append(True)
        if router is None:
            raise KeyboardInterrupt
        router.terminate()

    replicas, router = [], None
    signal.signal(signal.SIGTERM, stop)
    try:
        ray.init(address=args.ray_address or "local", namespace=args.ray_namespace,
                 log_to_driver=False, **ray_dashboard_args(args.ray_dashboard_port))
        signal.signal(signal.SIGTERM, stop)  # again: ray.init installs its own
        gpus = ray.cluster_resources().get("GPU", 0)
        server_args["device"] = resolve_device(args.device, gpus)
        print(f"radixray serve: device {server_args['device']} (--device {args.device}; the Ray "
              f"cluster has {gpus:g} GPU(s) now)", flush=True)
        short = missing_resources(ray.cluster_resources(), server_args["device"],
                                  args.tp_size * args.replicas)
        if short and args.ray_address is None:  # a local cluster never grows: fail now
            raise RuntimeError(f"{args.replicas} replica(s) x {args.tp_size} rank(s) need "
                               f"{short}; this machine's Ray cluster has less (lower "
                               "--tp-size or --replicas, or start Ray with more resources)")
        nodes = []  # of the replicas started so far
        for i in range(args.replicas):
            reserved = reserve_replica_ranks(str(i), server_args, args.tp_size,
                                             args.placement_timeout, args.ray_namespace)
            port = replica_port(args.replica_port_policy, base_port, i, nodes, reserved[1])
            nodes.append(reserved[1])
            replicas.append(start_replica(str(i), model_path, server_args, args.tp_size,
                                          replica_host, port, http_args, args.step_timeout,
                                          reserved=reserved, namespace=args.ray_namespace))
        urls = ray.get([r.get_url.remote() for r in replicas])
        print(f"radixray: {len(urls)} replica(s) ready: {' '.join(urls)}", flush=True)
        # The router starts with the replicas' URLs and also watches Ray: a head that Ray
        # restarts elsewhere, or where its port is taken, serves at another URL.
        command = router_command(args, urls, discovery_args(ray, args.ray_namespace))
        router = subprocess.Popen(command, preexec_fn=die_with_parent(),
                                  env=router_env(args.api_key))
        print(f"radixray serving {args.served_model_name or model_path} at "
              f"http://{args.host}:{args.port} (router; OpenAI API under /v1, SGLang native "
              f"POST /generate)", flush=True)
        # The router holds no state the replicas need: one that dies (killed for its memory,
        # a crash) is started again, instead of taking every replica down with serve.
        exits: list[float] = []
        node_dead = 0  # checks in a row that found this machine's Ray node dead
        while True:
            try:
                code = router.wait(timeout=RAY_CHECK_INTERVAL_S)
            except subprocess.TimeoutExpired:
                node_dead = 0 if own_node_alive(ray) else node_dead + 1
                if node_dead >= 2:  # twice in a row; its replicas went with it
                    print("radixray serve: error: this machine's Ray node is gone (its raylet "
                          "died or was killed); stopping", file=sys.stderr, flush=True)
                    return 1
                continue
            except KeyboardInterrupt:
                return 0
            if stopping:
                return 0  # a router we stopped exits by the signal
            exits = [t for t in exits if time.monotonic() - t < ROUTER_RESTART_WINDOW_S]
            exits.append(time.monotonic())
            if len(exits) > ROUTER_MAX_RESTARTS:
                print(f"radixray serve: error: the router exited {len(exits)} times within "
                      f"{ROUTER_RESTART_WINDOW_S:g} s (last: {exit_reason(code)}); stopping",
                      file=sys.stderr, flush=True)
                return 1
            print(f"radixray serve: the router exited ({exit_reason(code)}); starting it "
                  "again", file=sys.stderr, flush=True)
            time.sleep(1.0)  # its port is free again once the kernel has closed its socket
            router = subprocess.Popen(command, preexec_fn=die_with_parent(),
                                      env=router_env(args.api_key))
            if stopping:  # a SIGTERM meanwhile signalled the old one
                router.terminate()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while starting
        return 0
    except Exception as e:
        print(f"radixray serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            router.wait(10)
        # All at once, and not for long: Ctrl-C in a terminal (or a signal to serve's process
        # group) has stopped a local Ray with serve, and each wait then ran to its timeout
        # (30 s per replica, in turn). The replicas end with this job in any case.
        try:
            ray.wait([r.shutdown.remote() for r in replicas], num_returns=len(replicas),
                     timeout=REPLICA_SHUTDOWN_WAIT_S)
        except Exception:
            pass
        ray.shutdown()
