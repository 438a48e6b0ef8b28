"""One serving replica as a Ray actor: TP worker group + scheduler thread + HTTP server.

``ReplicaServer`` is the replica's head: it holds the Scheduler and the radix cache (CPU
bookkeeping) and drives its ``WorkerGroup`` (the ranks that hold weights and KV). It runs the
replica's HTTP server in a thread of its own process, so a request goes HTTP -> scheduler
thread -> rank 0 with no extra hop. It registers as the named actor ``replica:<id>`` in the
``radixray`` namespace; the router discovers replicas there and calls ``get_url``.

Failures: a supervisor thread watches the engine and the ranks. When a rank dies or a step
hangs past the timeout, every live request ends with an abort finish reason (nobody hangs),
the worker group is torn down and started afresh with an empty KV pool and radix cache, and the
replica serves again; ``restarts`` counts how often. While it restarts, health and generation
requests answer 503 (``RestartGate``). If the head itself dies, Ray restarts the actor
(``max_restarts``): the new head starts fresh ranks and serves on the same port.

Placement: ``start_replica`` first reserves the ranks' placement group (owned by the caller,
kept across restarts), then places the head on the node of rank 0's bundle. So the head's
steps reach rank 0 without crossing machines, and the replica's HTTP port is on a node that
holds its GPUs (on Kubernetes: the worker pod whose port the chart exposes). A head bound to a
wildcard address advertises its node's IP, which the router can reach from any node.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time
import uuid

from ..scheduler.config import SchedulerConfig
from ..scheduler.scheduler import Scheduler
from .async_engine import InProcessEngine
from .server_args import runner_config, split_server_args, tokenizer_eos
from .engine_slot import RestartGate, SwappableEngine
from .heap import freeze_startup_heap
from .tp_worker import free_port
from .worker_group import (WorkerGroup, WorkerGroupError, bundle_node_id, exit_with_raylet,
                           remove_placement_groups, reserve_rank_bundles, resolve_device)

log = logging.getLogger(__name__)
NAMESPACE = "radixray"  # the default; serve's --ray-namespace keeps deployments apart
ACTOR_PREFIX = "replica:"
SUPERVISE_INTERVAL_S = 0.5
PLACEMENT_TIMEOUT_S = 1800.0  # how long a replica waits for a node with room for its ranks
PLACEMENT_PROGRESS_S = 60.0  # how often a replica still waiting for its nodes says so
START_TIMEOUT_S = 1800.0  # loading the model on every rank and binding; then it failed
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
RESTART_KV_NAMESPACE = "radixray"


def advertised_url(bind_host: str, port: int, node_ip: str) -> str:
    """The URL others reach a server at: a server bound to every interface is reached at its
    node's IP (advertising 0.0.0.0 would make the router, on another node, call itself)."""
    host = node_ip if bind_host in WILDCARD_HOSTS else bind_host
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def port_is_free(host: str, port: int) -> bool:
    """Can a server listen on ``host:port`` now (as uvicorn binds it)?"""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as uvicorn binds: a dead predecessor's connections in TIME_WAIT do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def bindable_port(host: str, preferred: int, tries: int = 64) -> int:
    """``preferred`` if a server can listen on it at ``host`` now, else the next port up that
    can; ``preferred`` again if none of ``tries`` can (the bind then fails loudly)."""
    return next((candidate for candidate in range(preferred, min(preferred + tries, 65536))
                 if port_is_free(host, candidate)), preferred)


def pg_name(namespace: str, replica_id: str) -> str:
    """The name of a replica's reserved rank bundles; its heads' worker groups are named under
    it plus "/". Placement group names are global in a Ray cluster, unlike actor names, so the
    namespace is part of them: two deployments in one cluster must not share (or, after a head
    restart, remove) each other's."""
    return f"{namespace}/{ACTOR_PREFIX}{replica_id}"


def replica_actor_options(replica_id: str, node_id: str, namespace: str = NAMESPACE) -> dict:
    """``ray.remote(ReplicaServer).options(...)`` for a head that belongs on ``node_id`` (rank
    0's node). It takes no CPU of its own, so its ranks get the node's cores. The affinity is
    soft: if that node is gone when Ray restarts the head, the head starts elsewhere rather than
    never (Ray reschedules the ranks' placement group on its own)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"name": f"{ACTOR_PREFIX}{replica_id}", "namespace": namespace, "num_cpus": 0,
            "max_concurrency": 8, "max_restarts": -1,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}


class RestartLedger:
    """A replica's restart counts, kept in Ray's GCS key-value store so that they outlive its
    head: ``engine`` counts the ranks' restarts (the supervisor's), ``head`` the times Ray
    restarted the head actor. A fresh head (a new ``serve``) starts both from zero; a head Ray
    restarted goes on from its predecessor's and adds one to ``head``. (Ray's internal KV is
    the store its own libraries use for this; no public API holds a value across restarts.)"""

    def __init__(self, namespace: str, replica_id: str, restarted: bool):
        from ray.experimental import internal_kv

        self._kv, self._key = internal_kv, f"restarts/{namespace}/{replica_id}".encode()
        self.engine = self.head = 0
        if restarted:
            raw = internal_kv._internal_kv_get(self._key, namespace=RESTART_KV_NAMESPACE)
            if raw:
                self.engine, self.head = map(int, raw.split(b","))
            self.head += 1
        self.save()

    def save(self) -> None:
        self._kv._internal_kv_put(self._key, f"{self.engine},{self.head}".encode(),
                                  overwrite=True, namespace=RESTART_KV_NAMESPACE)

    def totals(self) -> dict[str, int]:
        """As the metrics export them (counters: monotonic across head restarts too)."""
        return {"engine_restarts_total": self.engine, "head_restarts_total": self.head}




class ReplicaServer:
    """Ray actor class (see ``start_replica``). Construction returns once the model is loaded
    on every rank and the HTTP server listens."""

    def __init__(self, replica_id: str, model_path: str, server_args: dict, tp_size: int = 1,
                 host: str = "127.0.0.1", port: int | None = None, http_args: dict | None = None,
                 step_timeout_s: float = 60.0, reserved_pg=None, namespace: str = NAMESPACE):
        import ray
        import uvicorn
        from transformers import AutoTokenizer

        from .http_server import ServerArgs, create_app

        if threading.current_thread() is threading.main_thread():  # (Ray runs __init__ there)
            # Ray's own SIGTERM handler only stops the actor taking calls: its HTTP server
            # served on, half-dead, and Ray never restarted it. Exit, as on SIGKILL.
            signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
        exit_with_raylet(f"replica {replica_id}")

        sched_args, runner_args = split_server_args(server_args)
        runner_args["device"] = resolve_device(runner_args["device"])  # what /get_server_info shows
        self.config = SchedulerConfig(**sched_args)
        self.tokenizer = AutoTokenizer.from_pretrained(runner_args["tokenizer_path"] or model_path)
        self.runner_cfg = runner_config(model_path, self.config, runner_args,
                                        tokenizer_eos(self.tokenizer))
        self.replica_id, self.tp_size, self.step_timeout_s = replica_id, tp_size, step_timeout_s
        self.reserved_pg = reserved_pg  # the ranks' bundles, kept across restarts; None: per group
        self.server_args = {**server_args, "device": runner_args["device"], "tp_size": tp_size}
        self.group: WorkerGroup | None = None
        self.engine = SwappableEngine()
        self.pg_prefix = pg_name(namespace, replica_id) + "/"  # its worker groups' names
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.restarts = RestartLedger(namespace, replica_id, restarted)
        self.engine.own_totals = self.restarts.totals()
        if restarted:
            n = remove_placement_groups(self.pg_prefix)  # the dead head's; its ranks died with it
            log.warning("replica %s: head restarted by Ray; removed %d placement group(s) of "
                        "its predecessor", replica_id, n)
        # The port first: a taken one must fail the replica before it loads its ranks.
        self.host, self.port = host, port or free_port()
        if restarted and port:
            # Ray may restart the head on another node (its own died), where with the per-node
            # port policy another replica can hold this port: serve on the next free one
            # (Ray discovery finds the new URL) rather than fail the restart for good.
            self.port = bindable_port(host, port)
            if self.port != port:
                log.warning("replica %s: port %d is taken on this node; serving on %d",
                            replica_id, port, self.port)
        elif not port_is_free(host, self.port):
            raise RuntimeError(f"replica {replica_id}: port {self.port} is already in use on "
                               f"{host} (another radixray serve?); pick other ports")
        self.url = advertised_url(host, self.port, ray.util.get_node_ip_address())
        self._stop = threading.Event()
        # before the engine: what it makes is replaced on a restart or a flush (heap.py)
        freeze_startup_heap()
        self._start_engine()
        try:
            self._serve_http(ServerArgs(model_path=model_path, host=host, port=self.port,
                                        replica=replica_id, extra=self.server_args,
                                        **(http_args or {})), create_app, uvicorn)
        except BaseException:
            self._stop.set()  # the ranks' watch would keep this dead actor's process alive
            self.engine.current.shutdown()
            self.group.shutdown()
            raise
        threading.Thread(target=self._supervise, name="replica-supervisor", daemon=True).start()

    # ------------------------------------------------------------------ lifecycle
    def _serve_http(self, http, create_app, uvicorn) -> None:
        """Serve the app on a thread; return once it listens (raise if it cannot)."""
        app = RestartGate(create_app(self.engine, self.tokenizer, http), self.engine)
        self._server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port,
                                                     log_level="warning"))
        thread = threading.Thread(target=self._server.run, name="replica-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"replica {self.replica_id}: HTTP server did not start on "
                                   f"{self.host}:{self.port}")
            time.sleep(0.02)

    def _start_engine(self) -> None:
        """Start ranks, scheduler and scheduler thread; then point the HTTP app at them."""
        group = WorkerGroup(self.runner_cfg, self.tp_size, step_timeout_s=self.step_timeout_s,
                            name=self.pg_prefix + uuid.uuid4().hex[:8],
                            reserved_pg=self.reserved_pg)
        scheduler = Scheduler(self.config, group, eos_token_ids=group.info["eos_token_ids"],
                              decode=self.tokenizer.decode, vocab_size=group.info["vocab_size"],
                              tokenizer=self.tokenizer)
        info = {**self.server_args, "model_path": self.runner_cfg.model_path,
                "engine": "ray-replica", "replica": self.replica_id,
                "max_total_num_tokens": group.max_total_tokens,
                "max_running_requests": group.max_running_requests,
                "max_context_len": group.max_context_len,
                "vocab_size": group.info["vocab_size"], "restarts": self.restarts.engine,
                "head_restarts": self.restarts.head,
                "disable_overlap_schedule": not scheduler.overlap,  # the effective choices
                "enable_hierarchical_cache": group.host_pool_tokens > 0,
                "host_pool_tokens": group.host_pool_tokens}
        bos = self.tokenizer.bos_token_id
        engine = InProcessEngine(scheduler, info, health_input_ids=[bos if bos is not None else 0])
        engine.tokenizer = self.tokenizer
        engine.start()
        self.group = group
        self.engine.swap(engine)

    def _supervise(self) -> None:
        while not self._stop.wait(SUPERVISE_INTERVAL_S):
            engine, group = self.engine.current, self.group
            problem = engine.failure if engine is not None else None
            if problem is None and group is not None:
                try:
                    group.check_peers()
                except WorkerGroupError as e:
                    problem = e
            if problem is None:
                continue
            log.warning("replica %s: %s; restarting its workers", self.replica_id, problem)
            self._restart()

    def _restart(self) -> None:
        old = self.engine.current
        if old is not None:
            old.shutdown(timeout=self.step_timeout_s)  # live requests end with an abort reason
        self.engine.swap(None)  # after the shutdown: its final totals count those aborts
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        while not self._stop.is_set():
            try:
                self.restarts.engine += 1
                self.restarts.save()
                self.engine.own_totals = self.restarts.totals()
                self._start_engine()
                return
            except Exception as e:  # keep trying: a node may be coming back
                log.error("replica %s: restart failed: %s", self.replica_id, e)
                time.sleep(2.0)

    # ------------------------------------------------------------------ actor methods
    def get_url(self) -> str:
        return self.url

    def info(self) -> dict:
        import ray

        group = self.group
        try:
            pids = group.pids() if group is not None else []
        except Exception:  # a rank died and the supervisor has not replaced the group yet
            pids = []
        return {"url": self.get_url(), "restarts": self.restarts.engine,
                "head_restarts": self.restarts.head, "pid": os.getpid(),
                "gc_frozen_objects": {"head": gc.get_freeze_count(),
                                      "ranks": group.gc_frozen_objects if group else []},
                "healthy": self.engine.ready, "worker_pids": pids,
                "node_id": ray.get_runtime_context().get_node_id()}

    def engine_is_frozen(self) -> bool:
        """Whether the engine's scheduler is frozen (heap.py): it must not be, or a restart
        would leak it. (``gc.get_objects`` lists every tracked object but the frozen ones.)"""
        scheduler = self.engine.current.scheduler
        return not any(obj is scheduler for obj in gc.get_objects())

    def check_invariant(self) -> int:
        """Assert the scheduler's memory invariant; returns the number of live requests."""
        return self.engine.current.check_invariant()

    def shutdown(self) -> None:
        self._stop.set()
        self._server.should_exit = True
        if self.engine.current is not None:
            self.engine.current.shutdown()
        if self.group is not None:
            self.group.shutdown()
        if self.reserved_pg is not None:  # the head is not in it: removing it spares the head
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.reserved_pg)
            self.reserved_pg = None


def reserve_replica_ranks(replica_id: str, server_args: dict, tp_size: int = 1,
                          timeout_s: float = PLACEMENT_TIMEOUT_S, namespace: str = NAMESPACE):
    """Reserve a replica's rank bundles and wait until Ray has placed them; returns
    ``(placement group, node id of rank 0's bundle, device)``, ``device`` being the server
    arguments' with "auto" resolved against the cluster's GPUs. The placement group belongs to
    the caller's job (it ends with it); the replica's ``shutdown`` removes it. ``timeout_s``
    0 waits for ever: a cluster whose autoscaler is still starting GPU nodes (pulling images,
    installing, downloading the model) may take longer than any fixed limit."""
    import ray
    from ray.util.placement_group import remove_placement_group

    device = resolve_device(split_server_args(server_args)[1]["device"])
    # Not under the head's own prefix (this name + "/"): a restarted head removes what is
    # left under that prefix, and this group must outlive head restarts.
    pg = reserve_rank_bundles(tp_size, device, name=pg_name(namespace, replica_id))
    started, ready_ref = time.monotonic(), pg.ready()  # one ref: each call queues a task
    try:
        while True:
            left = None if timeout_s == 0 else timeout_s - (time.monotonic() - started)
            if left is not None and left <= 0:
                raise RuntimeError(f"replica {replica_id}: no node had room for {tp_size} "
                                   f"rank(s) on {device} within {timeout_s:.0f}s (raise "
                                   "--placement-timeout, or 0 to wait for ever)")
            ready, _ = ray.wait([ready_ref], timeout=min(PLACEMENT_PROGRESS_S, left or 1e9))
            if ready:
                break
            log.warning("replica %s: waiting for a node with room for %d rank(s) on %s "
                        "(%.0fs so far)", replica_id, tp_size, device, time.monotonic() - started)
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg, bundle_node_id(pg, 0), device


def start_replica(replica_id: str, model_path: str, server_args: dict, tp_size: int = 1,
                  host: str = "127.0.0.1", port: int | None = None,
                  http_args: dict | None = None, step_timeout_s: float = 60.0,
                  reserved: tuple | None = None, namespace: str = NAMESPACE):
    """Create the named replica actor (``replica:<id>`` in ``namespace``) on the node
    of its rank 0 and wait until it serves. Needs ``ray.init`` first. ``reserved``: what
    ``reserve_replica_ranks`` returned, for a caller that needed rank 0's node first (to pick
    a port there); None: reserved here.

    Ray restarts a head whose process dies (its ranks die with it, as their owner; the new
    head starts fresh ones in the same reserved bundles); ``shutdown`` then ``ray.kill``, or
    the driver's exit, end it for good."""
    import ray
    from ray.util.placement_group import remove_placement_group

    pg, node_id, device = reserved or reserve_replica_ranks(replica_id, server_args, tp_size,
                                                            namespace=namespace)
    log.info("replica %s: ranks on %s, head on rank 0's node %s", replica_id, device, node_id)
    options = replica_actor_options(replica_id, node_id, namespace)
    actor = ray.remote(ReplicaServer).options(**options).remote(
        replica_id, model_path, {**server_args, "device": device}, tp_size, host, port,
        http_args, step_timeout_s, pg, namespace)
    try:
        ray.get(actor.get_url.remote(), timeout=START_TIMEOUT_S)
    except Exception as e:  # leave nothing behind: no head, no reserved bundles
        ray.kill(actor)
        remove_placement_group(pg)
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise RuntimeError(f"replica {replica_id}: not serving {START_TIMEOUT_S:.0f}s "
                               "after it started loading the model") from None
        raise
    return actor
