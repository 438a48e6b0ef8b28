"""The tensor-parallel ranks of one replica: placement, start-up, stepping, tear-down.

``WorkerGroup`` runs one ``TPWorker`` actor per rank in a STRICT_PACK placement group of one
bundle per rank (so a TP group never spans machines), joins them into a process group through a
port that rank 0 picks, and loads the shards. The placement group is either its own, or one the
caller reserved with ``reserve_rank_bundles`` and keeps across groups (a replica reserves one
first, so that its head can be placed on rank 0's node, and reuses it when its ranks
restart). It then looks like a model runner to the scheduler: ``submit(batch)`` returns a
handle at once (overlap scheduling submits the next batch before this one's tokens are back),
``result(handle)`` waits for the tokens with a per-step timeout, ``forward(batch)`` does both.

Any failure (actor died, step timed out, start-up error) raises ``WorkerGroupError``; the caller
decides to restart. ``shutdown`` always leaves nothing running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import ray
from ray.util.placement_group import (PlacementGroup, placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..worker.forward_batch import ForwardBatch, ForwardOutput
from ..worker.model_runner import RunnerConfig
from .heap import freeze_startup_heap
from .tp_worker import TPWorker, is_gpu_device


RAYLET_CHECK_INTERVAL_S = 2.0


def exit_with_raylet(who: str) -> None:
    """End this actor process once the raylet that started it is gone (killed, out of memory).

    Ray's workers are the raylet's children; left behind, a replica head kept its port and
    answered 503 "restarting" for ever while its restart loop retried a placement group Ray
    had removed, and ranks kept their memory, so nothing upstream saw the replica as dead."""
    if ray.get_runtime_context().get_actor_id() is None:
        return  # not a Ray actor (built in-process): its parent is no raylet
    raylet = os.getppid()

    def watch() -> None:
        while os.getppid() == raylet:
            time.sleep(RAYLET_CHECK_INTERVAL_S)
        logging.getLogger(__name__).error("%s: its node's raylet is gone; exiting", who)
        os._exit(1)

    threading.Thread(target=watch, name="raylet-watch", daemon=True).start()


class RankActor(TPWorker):
    """A TPWorker as its Ray actor: a SIGTERM ends the process at once, as a SIGKILL does. Ray's
    own handler only stops the actor taking calls; its long-running watch or follow call then
    kept a half-dead rank alive, which ``check_peers`` never noticed (rank 0: every request
    waited out the step timeout)."""

    def __init__(self, *args):
        super().__init__(*args)
        if threading.current_thread() is threading.main_thread():  # (Ray runs __init__ there)
            signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
        exit_with_raylet(f"rank {self.rank}")

    def init(self, *args, **kwargs) -> dict:
        info = super().init(*args, **kwargs)
        info["gc_frozen_objects"] = freeze_startup_heap()  # the model is loaded (heap.py)
        return info


def resolve_device(requested: str, cluster_gpus: float | None = None) -> str:
    """The torch device a replica's ranks run on.

    "auto": cuda when the Ray cluster has at least one GPU (``cluster_gpus``; None: ask Ray's
    ``cluster_resources()``): the ranks are placed where the GPUs are, so the process that
    decides (the serve driver, a replica head) need not have one itself; else cpu. Only nodes
    already in the cluster count: GPU nodes that join later need an explicit "cuda".
    "cuda:N" becomes "cuda": Ray gives each rank its own GPU, which the rank sees as cuda:0, so an
    index cannot pick one; what counts is that the ranks ask Ray for a GPU."""
    if requested == "auto":
        if cluster_gpus is None:
            cluster_gpus = ray.cluster_resources().get("GPU", 0)
        return "cuda" if cluster_gpus >= 1 else "cpu"
    return "cuda" if is_gpu_device(requested) else requested


def rank_bundle(device: str) -> dict:
    """What one rank reserves: a GPU and a CPU on GPU devices ("cuda", "cuda:N"), else a CPU."""
    if device == "auto":
        raise ValueError("device: resolve 'auto' first (resolve_device)")
    return {"GPU": 1, "CPU": 1} if is_gpu_device(device) else {"CPU": 1}


def reserve_rank_bundles(tp_size: int, device: str, name: str = "") -> PlacementGroup:
    """A STRICT_PACK placement group of one ``rank_bundle`` per rank (not waited for)."""
    return placement_group([rank_bundle(device) for _ in range(tp_size)],
                           strategy="STRICT_PACK", name=name)


def bundle_node_id(pg: PlacementGroup, index: int = 0) -> str:
    """The Ray node id holding bundle ``index`` of a ready placement group."""
    return placement_group_table(pg)["bundles_to_node_id"][index]


class WorkerGroupError(RuntimeError):
    """A rank died, hung past the step timeout, or failed to start."""


class WorkerGroup:
    def __init__(self, runner_cfg: RunnerConfig, tp_size: int = 1, step_timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0, name: str = "",
                 reserved_pg: PlacementGroup | None = None):
        self.tp_size, self.step_timeout_s = tp_size, step_timeout_s
        device = resolve_device(runner_cfg.device)  # "cuda:N" -> "cuda"
        bundle = rank_bundle(device)
        # A placement group the caller reserved outlives this group (restarts reuse it).
        self.owns_pg = reserved_pg is None
        self.pg = reserve_rank_bundles(tp_size, device, name) if self.owns_pg else reserved_pg
        if self.pg.bundle_count != tp_size:
            raise ValueError(f"reserved_pg: {self.pg.bundle_count} bundles for {tp_size} ranks")
        self.workers: list = []
        self.watch_refs: list = []  # calls that end only if their rank dies (check_peers)
        self._seq = 0  # batches submitted so far
        try:
            ray.get(self.pg.ready(), timeout=start_timeout_s)
            actor_cls = ray.remote(RankActor)
            nodes = placement_group_table(self.pg)["bundles_to_node_id"]
            for rank in range(tp_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank)
                ranks_on_host = sum(nodes[r] == nodes[rank] for r in range(tp_size))
                cfg = dataclasses.replace(runner_cfg, device=device, tp_rank=rank,
                                          tp_size=tp_size, ranks_on_host=ranks_on_host)
                # threads: two forwards (overlap scheduling), watch or follow, control calls
                self.workers.append(actor_cls.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy, max_concurrency=5).remote(rank, tp_size, cfg))
            addr = ray.get(self.workers[0].node_address.remote(), timeout=start_timeout_s)
            port = ray.get(self.workers[0].pick_port.remote(), timeout=start_timeout_s)
            infos = ray.get([w.init.remote(addr, port) for w in self.workers],
                            timeout=start_timeout_s)
        except Exception as e:
            self.shutdown()
            raise WorkerGroupError(f"replica workers failed to start: {_reason(e)}") from e
        self.info = infos[0]
        # Pools sized from each rank's free memory may differ: the scheduler hands out slot
        # numbers every rank must hold, so the smallest counts. A rank whose host pool could
        # not be allocated (0) turns the host tier off for the replica (recompute instead).
        self.max_total_tokens = min(i["max_total_tokens"] for i in infos)
        self.max_running_requests = self.info["max_running_requests"]
        self.max_context_len = self.info["max_context_len"]
        self.host_pool_tokens = min(i["host_pool_tokens"] for i in infos)
        self.gc_frozen_objects = [i["gc_frozen_objects"] for i in infos]
        self.watch_refs = ([self.workers[0].watch.remote()]
                           + [w.follow.remote() for w in self.workers[1:]])
        # A call per step: Ray's task events for them (state API, dashboard) filled the GCS
        # with ~300 MB of records (up to its 100k cap) and sent it a message per step.
        self._forward = self.workers[0].forward.options(enable_task_events=False)

    def submit(self, batch: ForwardBatch):
        """Send a batch to rank 0 and return at once; batches run in submission order."""
        self._seq += 1
        return self._forward.remote(batch, self._seq - 1)

    def result(self, handle) -> ForwardOutput:
        try:
            return ray.get(handle, timeout=self.step_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerGroupError(f"a forward step took longer than {self.step_timeout_s}s "
                                   "(hung collective or worker)") from e
        except Exception as e:
            raise WorkerGroupError(f"worker failed: {_reason(e)}") from e

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return self.result(self.submit(batch))

    def check_peers(self) -> None:
        """Raise if a rank died: rank 0's ``watch`` or a peer's ``follow`` loop has ended (they
        only end by dying here). Rank 0 is watched too, or with nothing to run its death would
        go unseen until the next request failed on it."""
        done, _ = ray.wait(self.watch_refs, timeout=0) if self.watch_refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                raise WorkerGroupError(f"tensor-parallel rank died: {_reason(e)}") from e
            raise WorkerGroupError("tensor-parallel rank left its loop")

    def pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers], timeout=30)

    def shutdown(self) -> None:
        """Kill every rank and release the placement group if it is this group's own (a
        reserved one stays for the next group). Safe to call twice."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers, self.watch_refs = [], []
        if self.pg is not None and self.owns_pg:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def remove_placement_groups(prefix: str) -> int:
    """Remove every live placement group whose name starts with ``prefix``; returns how many.

    For a replica head that Ray restarted: Ray removes an actor's placement groups only once
    the actor is gone for good, so its predecessor's bundles stay reserved (its ranks died
    with it) and the new ranks might never fit."""
    removed = 0
    for pg_id, entry in placement_group_table().items():
        if entry["name"].startswith(prefix) and entry["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
    return removed


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
