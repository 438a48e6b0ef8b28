"""What the host tier reports: every device eviction counts (also those a load makes room
with), a failed copy batch counts once, a request that waited for two loads reports both as
host hits; and what it keeps: a prompt bigger than the host pool does not empty it. Also the
new-token ratio going back to its initial value once the scheduler is idle, and the
hicache size fields refusing infinity. FakeRunner: tokens are a hash of the context read back
through the KV slots, so a wrong copy would change them."""

from __future__ import annotations

import math

import pytest

from fake_runner import FakeRunner, reference_tokens
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.sampling_params import SamplingParams


def hi_sched(pool=512, host=1024, **cfg):
    runner = FakeRunner(pool, 16, 4096, host_pool_tokens=host)
    return Scheduler(SchedulerConfig(debug_invariants=True, enable_hierarchical_cache=True,
                                     **cfg), runner)


def run_one(sched, rid, prompt, max_new=1):
    sched.add_request(Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new)))
    out, last = [], None
    while sched.has_work:
        for o in sched.step():
            out += o.new_token_ids
            last = o if o.finished else last
    assert out == reference_tokens(prompt, max_new)
    sched.check_invariant()
    return last


A, B = list(range(1000, 1300)), list(range(2000, 2300))


def test_evictions_made_for_a_load_are_counted():
    """A, B, A on a 512-token pool: B evicts A to host, and loading A back evicts B."""
    sched = hi_sched()
    for rid, prompt in (("a", A), ("b", B)):
        run_one(sched, rid, prompt)
    before = sched.metrics()["evicted_tokens_total"]
    assert before >= 88  # B needed room: some of A left the device
    out = run_one(sched, "a2", A)
    assert out.host_cached_tokens > 0  # A came back from host
    evicted = sched.metrics()["evicted_tokens_total"] - before
    assert evicted >= out.host_cached_tokens - sched.cache.available_size()
    assert evicted > 0


def test_a_prompt_bigger_than_the_host_pool_leaves_it_alone():
    sched = hi_sched(pool=400, host=100)
    run_one(sched, "a", A[:60])
    hi = sched.cache.hicache
    assert hi.host_size() >= 60  # written through
    run_one(sched, "big", B[:250])  # its leaf cannot fit the host pool at all
    assert hi.stats.host_evicted == 0 and hi.host_size() >= 60
    assert hi.stats.backup_failed >= 250


def test_a_failed_copy_batch_counts_once():
    """One batch carrying a store and a load, both failed: one failed batch."""
    from radixray.scheduler.hicache import HiRadixCache
    from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
    from radixray.scheduler.radix_key import RadixKey

    tree = HiRadixCache(TokenToKVPoolAllocator(64, 1), TokenToKVPoolAllocator(128, 1), 1)

    def insert(tokens):
        slots = tree.allocator.alloc(len(tokens))
        tree.allocator.free(slots[:tree.insert(RadixKey(tokens), slots)])

    a, b = list(range(20)), list(range(100, 120))
    insert(a)
    tree.ack_copies(tree.take_copies()[2])  # a's store confirmed
    tree.evict(20)  # a: host only
    insert(b)  # b's store queued
    assert tree.start_load(tree.match_tiers(RadixKey(a))[1]) is not None  # a's load queued
    ticket = tree.take_copies()[2]
    assert ticket.stores and ticket.loads
    tree.ack_copies(ticket, stores_ok=False, loads_ok=False)
    assert tree.stats.store_failures == tree.stats.load_failures == 1
    assert tree.stats.failed_batches == 1


def test_ratio_resets_once_idle():
    sched = hi_sched()
    sched.ratio.value = 0.93  # as after a retraction
    run_one(sched, "a", A[:20], max_new=4)
    assert sched.ratio.value == sched.ratio.init


@pytest.mark.parametrize("field", ["hicache_ratio", "hicache_size"])
def test_sizes_must_be_finite(field):
    with pytest.raises(ValueError, match=f"^{field}: must be a finite number"):
        SchedulerConfig(**{field: math.inf})


def test_a_request_that_waits_for_two_loads_reports_both_as_host_hits():
    """A = N1+Y and B = N1+N2+Z, both prefixes on the host only: A's load brings N1, then B
    loads N2; all of B's 120 cached tokens came from the host."""
    sched = hi_sched(schedule_policy="fcfs")
    n1, n2 = list(range(3000, 3060)), list(range(4000, 4060))
    for rid, prompt in (("w1", n1 + n2 + [7] * 20), ("w2", n1 + [8] * 20)):
        run_one(sched, rid, prompt)
    sched.cache.tree.evict(10 ** 6)
    reqs = [Req("a", n1 + [5] * 5, SamplingParams(max_new_tokens=2)),
            Req("b", n1 + n2 + [6] * 5, SamplingParams(max_new_tokens=2))]
    for r in reqs:
        sched.add_request(r)
    done = {}
    while sched.has_work:
        for o in sched.step():
            if o.finished:
                done[o.rid] = o
    sched.check_invariant()
    assert done["b"].cached_tokens == 120 and done["b"].host_cached_tokens == 120


def test_server_info_says_whether_the_host_tier_is_on(tiny_llama_path):
    from radixray.cluster import Engine

    with Engine(tiny_llama_path, max_total_tokens=512, enable_hierarchical_cache=True,
                hicache_size=1e-9) as eng:  # rounds to no host pool at all
        assert eng.server_args["enable_hierarchical_cache"] is False
        assert eng.server_args["host_pool_tokens"] == 0
    with Engine(tiny_llama_path, max_total_tokens=512, enable_hierarchical_cache=True) as eng:
        assert eng.server_args["enable_hierarchical_cache"] is True
        assert eng.server_args["host_pool_tokens"] == 1024


def test_host_tier_without_the_radix_cache_is_refused():
    """The scheduler builds no host tier without the radix cache, yet the workers allocated
    its pool and /get_server_info reported it on (with --hicache-size, GBs wasted per rank)."""
    with pytest.raises(ValueError, match="^enable_hierarchical_cache: needs the radix cache"):
        SchedulerConfig(enable_hierarchical_cache=True, disable_radix_cache=True)


def test_host_pool_size_is_in_gb_and_bounded_by_free_memory(monkeypatch, caplog):
    """--hicache-size was read as GiB (7.4% more than SGLang's GB); and a pool near the
    machine's free memory was zeroed until the kernel swapped or killed the process."""
    import torch

    from radixray.worker import host_pool
    from radixray.worker.host_pool import HostKVPool, host_pool_tokens

    assert host_pool_tokens(1000, 1000, 2.0, 1.0) == 1_000_000  # 1 GB of 1,000-byte tokens
    args = (1, 2, 2, 8, torch.float32, "cpu")  # page, layers, kv heads, head dim: 256 B/token
    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: 256 * 1000)
    assert HostKVPool.try_create(500, *args) is not None  # ~50% of what is free
    assert HostKVPool.try_create(900, *args) is None  # over 80%: the tier is off, logged
    assert "hierarchical cache off" in caplog.text
    # two ranks of a replica on one host allocate from the same free memory at once
    assert HostKVPool.try_create(500, *args, ranks_on_host=2) is None
    assert HostKVPool.try_create(350, *args, ranks_on_host=2) is not None


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_host_memory_reads_a_containers_cgroup_limit(tmp_path, version):
    """In a pod with a memory limit the host's MemAvailable counts memory the container may
    not take: a pool sized from it gets the pod OOM-killed instead of the tier turned off."""
    from radixray.worker.host_pool import (_cgroup_available, _meminfo_available,
                                           available_host_bytes)

    gb = 10**9
    folder = tmp_path if version == "v2" else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    names = (("memory.max", "memory.current", "inactive_file") if version == "v2" else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    (folder / names[0]).write_text(f"{8 * gb}\n")
    (folder / names[1]).write_text(f"{3 * gb}\n")  # 1 GB of it reclaimable page cache
    (folder / "memory.stat").write_text(f"anon 1\n{names[2]} {gb}\nactive_file 5\n")
    assert _cgroup_available(str(tmp_path)) == 6 * gb  # 8 GB less the 2 GB working set
    assert available_host_bytes(str(tmp_path)) == min(6 * gb, _meminfo_available())
    (folder / names[0]).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    assert _cgroup_available(str(tmp_path)) is None  # no limit
    assert available_host_bytes(str(tmp_path)) == _meminfo_available()
