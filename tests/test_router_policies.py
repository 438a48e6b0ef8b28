"""Routing policies on crafted loads and trees; config and command line."""

import argparse
import random
from collections import Counter

import pytest

from radixray.router.circuit import CircuitBreaker
from radixray.router.cli import add_router_arguments, config_from_args
from radixray.router.config import POLICY_NAMES, RouterConfig
from radixray.router.policies import POLICIES, RequestInfo, make_policy
from radixray.router.tree import ApproxRadixTree
from radixray.router.workers import Worker

SYSTEM = "You are a careful assistant. Answer briefly and cite sources. " * 4  # 248 chars


def workers(*loads):
    return [Worker(f"http://w{i}:1", CircuitBreaker(), load=load) for i, load in enumerate(loads)]


def setup(policy="cache_aware", **kw):
    config = RouterConfig(policy=policy, seed=0, **kw)
    tree = ApproxRadixTree(config.max_tree_size)
    return make_policy(config, random.Random(0), tree), tree


def choose(policy, tree, ws, text, key=None):
    return policy.choose(RequestInfo(text, key), ws, tree.match(text))


def test_registry_matches_config_names():
    assert set(POLICIES) == set(POLICY_NAMES)
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="smallest_tree")


class TestCacheAware:
    def test_repeated_prefix_goes_to_its_worker(self):
        policy, tree = setup()
        ws = workers(0, 0, 0)
        tree.insert(SYSTEM + "question one", ws[2].url)
        d = choose(policy, tree, ws, SYSTEM + "question two")
        assert (d.worker, d.kind) == (ws[2], "cache_hit")

    def test_new_tenants_on_idle_workers_split_evenly(self):
        policy, tree = setup()
        ws = workers(0, 0)
        for tenant in range(16):  # each a new prefix; loads stay equal (sequential requests)
            text = f"tenant {tenant} " * 30 + "question"
            d = choose(policy, tree, ws, text)
            assert d.kind == "cache_miss"
            tree.insert(text, d.worker.url)
        owners = Counter(tree.match(f"tenant {t} " * 30).best({w.url for w in ws})[1][0]
                         for t in range(16))
        assert sorted(owners.values()) == [8, 8]

    def test_among_holders_the_least_loaded_wins(self):
        policy, tree = setup()
        ws = workers(0, 3, 1)
        tree.insert(SYSTEM, ws[1].url)
        tree.insert(SYSTEM, ws[2].url)
        d = choose(policy, tree, ws, SYSTEM + "q")
        assert (d.worker, d.kind) == (ws[2], "cache_hit")

    def test_short_match_is_a_miss_to_the_least_loaded(self):
        policy, tree = setup(cache_threshold=0.5)
        ws = workers(2, 1, 5)
        tree.insert("x" * 40, ws[0].url)
        d = choose(policy, tree, ws, "x" * 40 + "y" * 60)  # 40% matched < 50%
        assert (d.worker, d.kind) == (ws[1], "cache_miss")
        d = choose(policy, tree, ws, "x" * 40 + "y" * 30)  # 57% matched
        assert (d.worker, d.kind) == (ws[0], "cache_hit")

    def test_miss_goes_to_least_loaded_not_smallest_tree(self):
        policy, tree = setup()
        ws = workers(4, 0)  # w0 has the smallest (empty) tree but is busier
        for i in range(20):
            tree.insert(f"old prompt {i}", ws[1].url)
        d = choose(policy, tree, ws, "a brand new prompt")
        assert (d.worker, d.kind) == (ws[1], "cache_miss")

    def test_imbalance_overrides_affinity(self):
        policy, tree = setup(balance_abs_threshold=32, balance_rel_threshold=1.5)
        ws = workers(40, 0, 5)
        tree.insert(SYSTEM, ws[0].url)
        d = choose(policy, tree, ws, SYSTEM)
        assert (d.worker, d.kind) == (ws[1], "balance")

    @pytest.mark.parametrize("loads", [(30, 0), (200, 150)])  # abs gap too small; rel too small
    def test_affinity_holds_below_either_threshold(self, loads):
        policy, tree = setup(balance_abs_threshold=32, balance_rel_threshold=1.5)
        ws = workers(*loads)
        tree.insert(SYSTEM, ws[0].url)
        d = choose(policy, tree, ws, SYSTEM)
        assert (d.worker, d.kind) == (ws[0], "cache_hit")

    def test_only_candidates_count_as_holders(self):
        policy, tree = setup()
        ws = workers(0, 0, 0)
        tree.insert(SYSTEM, ws[0].url)
        d = choose(policy, tree, ws[1:], SYSTEM)  # the holder is unavailable
        assert d.kind == "cache_miss" and d.worker in ws[1:]

    def test_sequential_misses_spread_over_idle_workers(self):
        policy, tree = setup()
        ws = workers(0, 0, 0, 0)
        picks = Counter()
        for i in range(400):
            text = f"unique prompt number {i} " * 3
            d = choose(policy, tree, ws, text)
            tree.insert(text, d.worker.url)
            picks[d.worker.url] += 1
        assert len(picks) == 4 and min(picks.values()) > 60


def test_round_robin_cycles():
    policy, tree = setup("round_robin")
    ws = workers(5, 0, 9)
    picks = [choose(policy, tree, ws, "t").worker for _ in range(6)]
    assert picks == ws + ws
    assert {choose(policy, tree, ws, "t").kind} == {"other"}


def test_random_covers_all_workers_evenly():
    policy, tree = setup("random")
    ws = workers(0, 0, 0, 0)
    picks = Counter(choose(policy, tree, ws, "t").worker.url for _ in range(2000))
    assert len(picks) == 4 and min(picks.values()) > 400


def test_power_of_two_never_picks_the_busiest():
    policy, tree = setup("power_of_two")
    ws = workers(0, 5, 10)
    picks = Counter(choose(policy, tree, ws, "t").worker.url for _ in range(600))
    assert picks[ws[2].url] == 0
    assert picks[ws[0].url] > picks[ws[1].url] > 0


def test_least_load_picks_the_minimum_and_breaks_ties_randomly():
    policy, tree = setup("least_load")
    ws = workers(3, 1, 2, 1)
    picks = Counter(choose(policy, tree, ws, "t").worker.url for _ in range(200))
    assert set(picks) == {ws[1].url, ws[3].url}
    assert min(picks.values()) > 50


class TestConsistentHash:
    def test_key_is_sticky_and_keys_spread(self):
        policy, tree = setup("consistent_hash")
        ws = workers(0, 0, 0, 0)
        first = {k: choose(policy, tree, ws, "t", f"session-{k}").worker for k in range(1000)}
        again = {k: choose(policy, tree, ws, "t", f"session-{k}").worker for k in range(1000)}
        assert first == again
        share = Counter(w.url for w in first.values())
        assert len(share) == 4 and min(share.values()) > 150

    def test_losing_a_worker_moves_only_its_keys(self):
        policy, tree = setup("consistent_hash")
        ws = workers(0, 0, 0, 0)
        before = {k: choose(policy, tree, ws, "t", str(k)).worker for k in range(1000)}
        after = {k: choose(policy, tree, ws[:3], "t", str(k)).worker for k in range(1000)}
        for k in range(1000):
            if before[k] is not ws[3]:
                assert after[k] is before[k]
            else:
                assert after[k] in ws[:3]

    def test_no_key_goes_to_least_loaded(self):
        policy, tree = setup("consistent_hash")
        ws = workers(4, 0, 7)
        assert choose(policy, tree, ws, "t", None).worker is ws[1]


@pytest.mark.parametrize("field,value", [
    ("cache_threshold", 1.5), ("balance_rel_threshold", 0.5), ("max_tree_size", 0),
    ("max_retries", -1), ("health_check_interval", 0), ("breaker_failure_threshold", 0),
    ("retry_jitter", 1.0), ("port", 70000),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        RouterConfig(**{field: value})


def test_cli_flags_build_a_config_with_documented_defaults():
    parser = add_router_arguments(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args([
        "--worker-urls", "http://a:1", "http://b:2", "--policy", "power_of_two",
        "--cache-threshold", "0.7", "--max-tree-size", "1000", "--ray-address", "auto"]))
    assert config.worker_urls == ("http://a:1", "http://b:2")
    assert (config.policy, config.cache_threshold, config.max_tree_size) == ("power_of_two", 0.7,
                                                                             1000)
    assert config.ray_address == "auto"
    defaults = config_from_args(parser.parse_args([]))
    assert defaults == RouterConfig()
    with pytest.raises(ValueError, match="^cache_threshold"):
        config_from_args(parser.parse_args(["--cache-threshold", "2"]))


def test_the_workers_api_key_comes_from_the_environment_only(monkeypatch):
    """``radixray serve --api-key`` hands the key to its router in the environment: no flag
    shows it in process listings, and the config's repr leaves it out."""
    from radixray.cluster.serve import router_env
    from radixray.router.config import WORKER_API_KEY_ENV

    parser = add_router_arguments(argparse.ArgumentParser())
    assert not any("key" in a.dest for a in parser._actions)
    monkeypatch.setenv(WORKER_API_KEY_ENV, "s3cret")
    config = config_from_args(parser.parse_args([]))
    assert config.worker_api_key == "s3cret" and "s3cret" not in repr(config)
    assert router_env("k")[WORKER_API_KEY_ENV] == "k"
    assert router_env(None).get(WORKER_API_KEY_ENV) == "s3cret"  # inherited as it was
