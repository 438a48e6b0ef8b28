"""A replica's engine slot: the one EngineClient its HTTP app holds while the supervisor
replaces the engine behind it (``SwappableEngine``), and the gate that answers generation
requests with a marked 503 while there is none (``RestartGate``).

A restart must not disturb /metrics: the counters go on from the replaced engines' final
totals (requests the dead engine failed included), and the gauges say that nothing runs here
rather than what the dead engine said last.
"""

from __future__ import annotations

import threading
from typing import AsyncIterator

from .async_engine import InProcessEngine
from .engine_protocol import GenerateRequest, TokenOutput
from .api_errors import EngineRestarting, unavailable
from .metrics import COUNTERS

RESTARTING_MESSAGE = "replica is restarting"  # its 503 also carries RESTARTING_HEADER
# What /metrics shows while no engine serves: nothing runs, nothing waits, no KV pool.
RESTARTING_GAUGES = {"num_running_reqs": 0, "num_queue_reqs": 0, "num_grammar_queue_reqs": 0,
                     "gen_throughput": 0.0, "token_usage": 0.0, "kv_available_tokens": 0,
                     "kv_evictable_tokens": 0}


class SwappableEngine:
    """The EngineClient the HTTP app holds; forwards to the replica's current engine, which the
    supervisor replaces (``swap``) after a restart. No engine, or a dead one (restarting):
    requests get a 503."""

    def __init__(self):
        self.current: InProcessEngine | None = None
        self._retired: dict[str, float] = {}  # final counter totals of the engines swapped out
        # Engines swapped out whose thread still runs (a shutdown that timed out inside a
        # step): the requests they fail when it ends still count.
        self._retiring: list[InProcessEngine] = []
        self._lock = threading.Lock()  # swap against stats: a total must never drop
        self._last_info: dict = {}  # what the last engine said of itself (kept while restarting)
        self.own_totals: dict[str, float] = {}  # counters the replica keeps itself (restarts)

    def swap(self, engine: InProcessEngine | None) -> None:
        """Put ``engine`` in the slot (None while restarting). The engine taken out goes on
        counting until its thread ends; then its final totals are kept for good."""
        with self._lock:
            old, self.current = self.current, engine
            if old is not None:
                self._retiring.append(old)
            if engine is not None:
                self._last_info = engine.server_info()

    def _retired_totals(self) -> dict[str, float]:
        """The swapped-out engines' counters: folded for good once an engine has stopped."""
        for old in [e for e in self._retiring if e.stopped]:
            self._retiring.remove(old)
            final = old.stats()
            for key in COUNTERS:
                self._retired[key] = self._retired.get(key, 0) + final.get(key, 0)
        totals = dict(self._retired)
        for old in self._retiring:
            snapshot = old.stats()
            for key in COUNTERS:
                totals[key] = totals.get(key, 0) + snapshot.get(key, 0)
        return totals

    def _engine(self) -> InProcessEngine:
        if not self.ready:
            raise EngineRestarting(RESTARTING_MESSAGE)
        return self.current

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.alive

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenOutput]:
        async for out in self._engine().generate(req):
            yield out

    async def abort(self, rid: str) -> None:
        if self.current is not None:
            await self.current.abort(rid)

    async def flush_cache(self) -> bool:
        return await self._engine().flush_cache()

    def cache_epoch(self) -> str:
        return self.current.cache_epoch() if self.current is not None else ""  # no cache yet

    async def health_check(self, timeout: float) -> bool:
        engine = self.current
        return engine is not None and await engine.health_check(timeout)

    def server_info(self) -> dict:
        """The engine's arguments and figures; while restarting, the last engine's (a monitor
        reading ``restarts`` or the pool size gets them then too)."""
        return self.current.server_info() if self.current is not None else dict(self._last_info)

    def stats(self) -> dict:
        """The current engine's snapshot with the counters summed over every engine this
        replica has run; while restarting, the gauges of an idle replica."""
        with self._lock:
            engine = self.current
            stats = engine.stats() if engine is not None else {}
            if not self.ready:
                stats.update(RESTARTING_GAUGES)
            for key, total in self._retired_totals().items():
                stats[key] = stats.get(key, 0) + total
            stats.update(self.own_totals)
        # "since the replica started", as the counters: a new engine's own rate began at 0
        prompt = stats.get("prompt_tokens_total", 0)
        stats["cache_hit_rate"] = stats.get("cached_tokens_total", 0) / prompt if prompt else 0.0
        return stats


GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")  # may stream


class RestartGate:
    """ASGI wrapper: while the replica restarts, generation requests get a 503 before the app
    sees them. A streamed answer sends its 200 before the engine is asked, so without this a
    stream would report the restart in-band, which the router cannot retry on another replica
    (it retries a stream only until its first byte)."""

    def __init__(self, app, engine: SwappableEngine):
        from fastapi.responses import JSONResponse

        from .http_server import error_body

        self.app, self.engine = app, engine
        err = unavailable(EngineRestarting(RESTARTING_MESSAGE))
        self.answers = {path: JSONResponse(error_body(path, err), status_code=503,
                                           headers=err.headers)
                        for path in GENERATION_PATHS}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] in self.answers and not self.engine.ready:
            return await self.answers[scope["path"]](scope, receive, send)
        await self.app(scope, receive, send)
