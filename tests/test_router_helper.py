"""The router's body-parsing helper processes (router/helper.py, bodies.py's Offloader): off the
event loop, started with the router, a body that kills its helper is not parsed again in the
router (the bodies queued behind it are, in a fresh helper), a helper that cannot start is given
up after a few tries, and answers' token counts are booked without anyone waiting for them.

Functions the helper runs live here, in a module with light imports: a helper process imports
the module of each function it is sent."""

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

from radixray.router import bodies as bodies_module
from radixray.router import helper as helper_module
from radixray.router.bodies import HUGE_BODY_BYTES, LARGE_BODY_BYTES, Offloader
from radixray.router.helper import MAX_START_FAILURES, Helper, HelperDied
from radixray.router.request import answer_counts, read_request


def in_helper() -> bool:
    return multiprocessing.parent_process() is not None


def die_in_the_helper(value):
    if in_helper():
        os._exit(1)  # the helper dies under this job (as if killed for its memory)
    return value


def pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def read_request_or_die(raw, header_key, native):
    """read_request, in a helper that dies under every body it is given."""
    die_in_the_helper(None)
    return read_request(raw, header_key, native)


def slow_answer_counts(raw, copies):
    """answer_counts, seconds late in a helper."""
    if in_helper():
        time.sleep(SLOW_ANSWER_S)
    return answer_counts(raw, copies)


def slow_answer_facts(raw, copies, by_ids=False):
    """answer_facts (what the proxy books), seconds late in a helper."""
    from radixray.router.request import answer_facts

    if in_helper():
        time.sleep(SLOW_ANSWER_S)
    return answer_facts(raw, copies, by_ids)


SLOW_ANSWER_S = 3.0


def cannot_start():
    os._exit(1)  # as a helper that dies while it starts (a program serving at import time)


def test_a_large_body_is_parsed_without_stalling_the_event_loop():
    raw = json.dumps({"text": ["ab"] * 1_500_000, "sampling_params": {"n": 2}}).encode()

    async def longest_stall(parse):
        """(parse's result, the longest the event loop went without running meanwhile)"""
        gaps = []

        async def ticker():
            while True:
                before = time.perf_counter()
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - before)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        result = await parse()
        tick.cancel()
        return result, max(gaps)

    async def scenario():
        offload = Offloader()
        try:
            # start the helper first (a fresh interpreter): not what is measured here
            await offload.run(HUGE_BODY_BYTES, read_request, b'{"text": "warm"}', None, True)
            helper, thread = [], []  # longest stalls: through the helper, from a thread
            for _ in range(3):  # a loaded machine stalls the loop now and then by itself
                _, stall = await longest_stall(
                    lambda: asyncio.to_thread(read_request, raw, "key", True))
                thread.append(stall)
                info, stall = await longest_stall(
                    lambda: offload.run(len(raw), read_request, raw, "key", True))
                helper.append(stall)
                if min(helper) < min(thread) / 3:
                    break
            return info, helper, thread
        finally:
            await offload.aclose()

    info, helper, thread = asyncio.run(scenario())
    assert (info.text, info.routing_key, info.stream) == ("ab", "key", False)
    assert info.copies == 2
    # json.loads holds the GIL for the whole parse: from a thread it stalls the loop as long
    # as inline (the parse's duration, at least); through the helper, not.
    assert min(helper) < min(thread) / 3, (helper, thread)


def test_a_body_that_kills_its_helper_is_not_parsed_again_in_the_router():
    async def scenario():
        offload = Offloader()
        try:
            # the body that kills the helper, and one queued behind it (started before it
            # died: the sleep keeps the helper busy until the second one has come)
            first = asyncio.create_task(offload.run(LARGE_BODY_BYTES, pid_after, 1.0))
            killer = asyncio.create_task(offload.run(LARGE_BODY_BYTES, die_in_the_helper, 1))
            await asyncio.sleep(0.1)
            queued = asyncio.create_task(offload.run(LARGE_BODY_BYTES, pid_after, 0))
            results = await asyncio.gather(first, killer, queued, return_exceptions=True)
            after = await offload.run(LARGE_BODY_BYTES, pid_after, 0)
            return results, after
        finally:
            await offload.aclose()

    (first, killer, queued), after = asyncio.run(scenario())
    assert isinstance(killer, HelperDied), killer  # not parsed again in a thread
    assert first != os.getpid() and queued != os.getpid() and after != os.getpid()
    assert queued != first and after == queued  # a fresh helper, which stays


def test_a_helper_that_cannot_start_is_given_up_after_a_few_tries(monkeypatch, caplog):
    pools = []

    class CountedPool(helper_module.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(helper_module, "ProcessPoolExecutor", CountedPool)
    monkeypatch.setattr(helper_module, "_start_helper", cannot_start)

    async def scenario():
        helper = Helper("test")
        try:
            return [await helper.run(pid_after, 0) for _ in range(MAX_START_FAILURES + 2)]
        finally:
            helper.close(True)

    pids = asyncio.run(scenario())
    assert pids == [os.getpid()] * len(pids)  # every job done all the same, in a thread
    assert len(pools) == MAX_START_FAILURES  # then no more interpreters spawned in vain
    gave_up = [r for r in caplog.records if "could be started" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].levelname == "ERROR"


def test_after_close_no_helper_starts_again():
    async def scenario():
        offload = Offloader()
        first = await offload.run(LARGE_BODY_BYTES, pid_after, 0)
        await offload.aclose()
        # a stream's cleanup finishing during the shutdown: in a thread
        return first, await offload.run(LARGE_BODY_BYTES, pid_after, 0), \
            await offload.parse_answer(LARGE_BODY_BYTES, pid_after, 0)

    first, *late = asyncio.run(scenario())
    assert first != os.getpid() and late == [os.getpid()] * 2


def test_the_request_helpers_start_before_the_first_large_body():
    before = {p.pid for p in multiprocessing.active_children()}

    def started():
        return {p.pid for p in multiprocessing.active_children()} - before

    async def scenario():
        offload = Offloader()
        try:
            offload.start()
            deadline = time.monotonic() + 30
            while len(started()) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            helpers = started()
            # the first large body finds its helper up: one of those two parses it
            pid = await offload.run(LARGE_BODY_BYTES, pid_after, 0)
            return helpers, pid
        finally:
            await offload.aclose()

    helpers, pid = asyncio.run(scenario())
    assert len(helpers) == 2 and pid in helpers  # the answers' helper waits for an answer


def test_answers_are_booked_in_the_background_within_a_bound(monkeypatch):
    monkeypatch.setattr(bodies_module, "ANSWER_BACKLOG_BYTES", LARGE_BODY_BYTES)
    answer = json.dumps({"text": "x" * LARGE_BODY_BYTES,
                         "meta_info": {"prompt_tokens": 7, "cached_tokens": 3}}).encode()
    booked = []

    async def scenario():
        offload = Offloader()
        try:
            started = time.perf_counter()
            for _ in range(2):  # the second finds the first waiting: past the bound
                offload.book(len(answer), slow_answer_counts, (answer, 1), booked.append)
            assert time.perf_counter() - started < 0.5  # nobody waits for the parse
            deadline = time.monotonic() + 30 + SLOW_ANSWER_S
            while not booked and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            # one still waiting at the shutdown goes uncounted, quietly
            offload.book(len(answer), slow_answer_counts, (answer, 1), booked.append)
        finally:
            await offload.aclose()

    asyncio.run(scenario())
    assert booked == [(3, 7)]


def gone(pid: int) -> bool:
    """No such process, or a zombie (a container's init may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_helper_leaves_with_a_router_killed_without_its_shutdown():
    # SIGKILL, or uvicorn re-raising SIGTERM after its shutdown: no exit hook of the pool runs
    code = ("import asyncio, os, signal\n"
            "from radixray.router.bodies import LARGE_BODY_BYTES, Offloader\n"
            "async def main():\n"
            "    print(await Offloader().run(LARGE_BODY_BYTES, os.getpid), flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "asyncio.run(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    helper = int(proc.stdout)
    deadline = time.monotonic() + 5
    while not gone(helper) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(helper)
