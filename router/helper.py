"""One helper process that runs pure functions of large bodies off the router's event loop
(bodies.py says why a thread would not do), and what happens when it cannot start or dies.

- It is a fresh interpreter ("spawn": forking a process that runs threads is unsafe), started
  from a thread: ``Process.start()`` blocks 20-30 ms, and the interpreter takes 0.4-1 s more,
  during which jobs wait for it.
- It runs one job at a time, in the order they came.
- If it dies under a job (killed for its memory, most likely: a 256 MiB body of short strings
  parses to several GB), that job raises ``HelperDied``. It is not parsed again in the router,
  which the out-of-memory killer would pick next. Jobs that were queued behind it had no part
  in it: they go to a fresh helper.
- Where no process can be started at all (no semaphores; a program that starts the router at
  import time, outside ``if __name__ == "__main__":``, so that each helper dies starting, or
  hangs: ``START_TIMEOUT``), jobs run in a thread: correct, only not off the GIL. After
  ``MAX_START_FAILURES`` failed starts in a row it stops trying, rather than spawn an
  interpreter for every large body.
- After ``close()`` jobs run in a thread too (a stream's cleanup can finish during shutdown),
  and no helper is started again.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

log = logging.getLogger("radixray.router")

MAX_START_FAILURES = 3
# A fresh interpreter answers within 0.4-2 s even on a loaded machine; one that has not after
# this long is stuck importing (a program serving at import time) and will not.
START_TIMEOUT = 30.0


class HelperDied(Exception):
    """The helper process died while it ran this job (most likely killed for its memory)."""


def _start_helper() -> None:
    """Runs first in the helper process."""
    # Ctrl-C reaches the whole process group: the router shuts its helper down itself, so the
    # helper should not die first with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A router killed without its shutdown (SIGKILL, or uvicorn re-raising SIGTERM before the
    # pool's own exit hook ran) would leave the helper waiting for work forever: it holds both
    # ends of its work queue, so it never reads an end of file. It leaves with its parent.
    parent = multiprocessing.parent_process()

    def exit_with_parent():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


class _Unsupported(Exception):
    """No process pool can be made here at all (no working semaphores): no use trying again."""


@dataclass(eq=False)
class _Process:
    pool: ProcessPoolExecutor
    ready: Future  # the first job, done once the interpreter runs
    jobs: list = field(default_factory=list)  # its jobs in order, succeeded ones pruned

    def culprit(self) -> Future | None:
        """After the process died: the job it was running. Jobs run one at a time, in order,
        so that is the oldest one neither finished nor cancelled before it ran."""
        return next((job for job in self.jobs if not _settled(job)), None)


def _settled(job: Future) -> bool:
    """Finished (whatever it returned or raised), or cancelled before it ran."""
    return job.cancelled() or (job.done() and not isinstance(job.exception(), BrokenProcessPool))


class Helper:
    """One helper process, as the module's docstring says."""

    def __init__(self, name: str):
        self.name = name  # what it parses, for messages: "request bodies", "answers"
        self._lock = threading.Lock()  # the start runs in a thread, close() may too
        self._launch: Future | None = None  # -> _Process, set by the starting thread
        self._thread: threading.Thread | None = None
        self._failed_starts = 0
        self._gave_up = False
        self._closed = False

    def start(self) -> Future | None:
        """Start the process, unless it runs or is starting; a future of its ``_Process``
        (None once closed)."""
        with self._lock:
            if self._closed:
                return None
            if self._launch is None:
                self._launch = Future()
                self._thread = threading.Thread(target=self._spawn, args=(self._launch,),
                                                name=f"radixray-router-{self.name}", daemon=True)
                self._thread.start()
            return self._launch

    def _spawn(self, launch: Future) -> None:
        """In a thread: make the pool and give it its first job, which starts the process."""
        try:
            pool = ProcessPoolExecutor(max_workers=1, initializer=_start_helper,
                                       mp_context=multiprocessing.get_context("spawn"))
        except (OSError, NotImplementedError, ImportError) as exc:  # no semaphores here
            launch.set_exception(_Unsupported(exc))
            return
        try:
            proc = _Process(pool, pool.submit(os.getpid))
        except Exception as exc:  # no memory or process slots just now
            pool.shutdown(wait=False)
            launch.set_exception(exc)
            return
        with self._lock:  # close() either sees this process or this thread sees it closed
            if not self._closed:
                launch.set_result(proc)
                return
        pool.shutdown(wait=False, cancel_futures=True)
        launch.set_exception(RuntimeError("closed"))

    async def _process(self) -> _Process | None:
        """The running helper, started if need be; None: run the job in a thread."""
        launch = None if self._gave_up else self.start()
        if launch is None:
            return None
        try:
            # shielded: a job's cancellation must not cancel the start that others wait for
            proc = await asyncio.shield(asyncio.wrap_future(launch))
            if not proc.ready.done():
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(proc.ready)),
                                       START_TIMEOUT)
            proc.ready.result()
        except Exception as exc:  # the process could not start, or died starting
            self._start_failed(launch, exc)
            return None
        self._failed_starts = 0
        return proc

    def _start_failed(self, launch: Future, exc: Exception) -> None:
        with self._lock:
            if self._launch is not launch:
                return  # counted already, by another job that waited for the same start
            self._launch = None
        if launch.done() and launch.exception() is None:
            launch.result().pool.shutdown(wait=False, cancel_futures=True)
        self._failed_starts += 1
        if isinstance(exc, _Unsupported) or self._failed_starts >= MAX_START_FAILURES:
            self._gave_up = True
            log.error("router: no helper process for %s could be started (%r); they are "
                      "parsed in a thread from now on, stalling the event loop meanwhile. A "
                      "program that serves the router must do so under "
                      "`if __name__ == \"__main__\":`", self.name, exc)
        else:
            log.warning("router: the helper process for %s did not start (%r); this job runs "
                        "in a thread, the next one tries again", self.name, exc)

    def _forget(self, proc: _Process) -> None:
        """The process died: the next job starts a fresh one."""
        with self._lock:
            launch = self._launch
            if launch is not None and launch.done() and launch.exception() is None \
                    and launch.result() is proc:
                self._launch = None
                log.warning("router: the helper process for %s died; starting another",
                            self.name)
        proc.pool.shutdown(wait=False)

    async def run(self, fn, *args):
        """``fn(*args)`` in the helper process (in a thread where there is none); HelperDied
        if the process died while running it."""
        for _ in range(2):  # a second helper for a job queued behind the one that killed one
            proc = await self._process()
            if proc is None:
                return await asyncio.to_thread(fn, *args)
            try:
                job = proc.pool.submit(fn, *args)
            except (BrokenProcessPool, RuntimeError):  # died, or closed, before this job came
                self._forget(proc)
                continue
            proc.jobs = [j for j in proc.jobs if not _settled(j)] + [job]
            try:
                return await asyncio.wrap_future(job)
            except BrokenProcessPool:
                self._forget(proc)
                if proc.culprit() is job:
                    break
        raise HelperDied(f"the router's helper process for {self.name} died while parsing "
                         "this body (out of memory?)")

    def close(self, wait: bool = False) -> None:
        """Stop the helper; from now on jobs run in a thread. ``wait``: until it has exited
        (the router's shutdown, in a thread: the process may exit right after, before the
        pool's own exit hook would have run); jobs already in it finish first."""
        with self._lock:
            self._closed = True
            launch, thread, self._launch = self._launch, self._thread, None
        if wait and thread is not None:
            thread.join(5)  # a start in progress: a moment (the interpreter starts on its own)
        if launch is not None and launch.done() and launch.exception() is None:
            launch.result().pool.shutdown(wait=wait)
