"""EngineMetrics: exported names, counter bookkeeping from cumulative totals, histograms."""

import math

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from radixray.cluster.metrics import (
    EngineMetrics,
    exported_metric_names,
    metric_names_in_exposition,
)

# The names issue 9 lists, written out independently of cluster/metrics.py.
ISSUE_GAUGES = ["num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs", "token_usage",
                "cache_hit_rate", "gen_throughput", "new_token_ratio", "kv_available_tokens",
                "kv_evictable_tokens"]
ISSUE_COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "cached_tokens_total",
                  "num_requests_total", "num_aborted_requests_total",
                  "num_retracted_reqs_total", "evicted_tokens_total",
                  "host_cached_tokens_total",  # the last two: issue 11 (hierarchical cache)
                  "hicache_copy_failures_total",
                  "engine_restarts_total", "head_restarts_total"]  # a replica's restarts
ISSUE_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                    "e2e_request_latency_seconds", "queue_time_seconds"]
LABELS = {"model_name": "tiny-llama", "replica": "3"}


@pytest.fixture
def reg():
    return CollectorRegistry()


def value(reg, name, **extra):
    return reg.get_sample_value(name, {**LABELS, **extra})


def test_exported_names_are_exactly_the_issue_list(reg):
    EngineMetrics(reg, "tiny-llama", 3)
    names = exported_metric_names(reg)
    for g in ISSUE_GAUGES:
        assert f"radixray:{g}" in names
    for c in ISSUE_COUNTERS:
        assert f"radixray:{c}" in names, c
        assert f"radixray:{c}_total" not in names  # no doubled suffix
    for h in ISSUE_HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"radixray:{h}{suffix}" in names
    # Everything else is prometheus-client's `_created` timestamps, nothing unexpected.
    expected_core = ({f"radixray:{n}" for n in ISSUE_GAUGES + ISSUE_COUNTERS}
                     | {f"radixray:{h}{s}" for h in ISSUE_HISTOGRAMS
                        for s in ("_bucket", "_sum", "_count")})
    assert all(n.endswith("_created") for n in names - expected_core)
    assert all(n.startswith("radixray:") for n in names)


def test_every_series_carries_model_name_and_replica(reg):
    EngineMetrics(reg, "tiny-llama", 3)
    text = generate_latest(reg).decode()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series
    for line in series:
        assert 'model_name="tiny-llama"' in line and 'replica="3"' in line, line


def test_nothing_lands_on_the_global_registry(reg):
    before = set(metric_names_in_exposition(generate_latest(REGISTRY).decode()))
    EngineMetrics(reg, "tiny-llama", 3)
    after = set(metric_names_in_exposition(generate_latest(REGISTRY).decode()))
    assert not {n for n in after - before if n.startswith("radixray:")}


def test_two_replicas_on_separate_registries_are_independent():
    a, b = CollectorRegistry(), CollectorRegistry()
    ma, mb = EngineMetrics(a, "m", 0), EngineMetrics(b, "m", 1)
    ma.update_scheduler_stats({"prompt_tokens_total": 7})
    mb.update_scheduler_stats({"prompt_tokens_total": 2})
    assert a.get_sample_value("radixray:prompt_tokens_total", {"model_name": "m", "replica": "0"}) == 7
    assert b.get_sample_value("radixray:prompt_tokens_total", {"model_name": "m", "replica": "1"}) == 2


def test_gauges_follow_the_latest_snapshot_and_missing_keys_stay(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    m.update_scheduler_stats({"num_running_reqs": 4, "token_usage": 0.25, "kv_available_tokens": 900})
    m.update_scheduler_stats({"num_running_reqs": 1})
    assert value(reg, "radixray:num_running_reqs") == 1
    assert value(reg, "radixray:token_usage") == 0.25
    assert value(reg, "radixray:kv_available_tokens") == 900


def test_counters_take_differences_of_cumulative_totals(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    m.update_scheduler_stats({"prompt_tokens_total": 10, "generation_tokens_total": 3})
    m.update_scheduler_stats({"prompt_tokens_total": 25, "generation_tokens_total": 3})
    m.update_scheduler_stats({"prompt_tokens_total": 25})
    assert value(reg, "radixray:prompt_tokens_total") == 25
    assert value(reg, "radixray:generation_tokens_total") == 3


def test_a_total_going_down_is_a_scheduler_restart_and_counters_stay_monotonic(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    m.update_scheduler_stats({"num_retracted_reqs_total": 40})
    m.update_scheduler_stats({"num_retracted_reqs_total": 5})  # restarted, counted 5 since
    assert value(reg, "radixray:num_retracted_reqs_total") == 45
    m.update_scheduler_stats({"num_retracted_reqs_total": 8})
    assert value(reg, "radixray:num_retracted_reqs_total") == 48


def test_bad_stats_are_rejected_naming_the_field_and_change_nothing(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    with pytest.raises(ValueError, match="num_runing_reqs"):
        m.update_scheduler_stats({"num_running_reqs": 2, "num_runing_reqs": 1})
    assert value(reg, "radixray:num_running_reqs") == 0  # validated before anything is applied
    with pytest.raises(ValueError, match="token_usage"):
        m.update_scheduler_stats({"token_usage": "high"})
    with pytest.raises(ValueError, match="cache_hit_rate"):
        m.update_scheduler_stats({"cache_hit_rate": math.nan})
    with pytest.raises(ValueError, match="evicted_tokens_total"):
        m.update_scheduler_stats({"evicted_tokens_total": -1})


def test_constructor_checks_its_arguments():
    with pytest.raises(TypeError, match="registry"):
        EngineMetrics(None, "m", 0)
    with pytest.raises(ValueError, match="model_name"):
        EngineMetrics(CollectorRegistry(), "", 0)


def test_observe_request_fills_the_right_buckets(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    m.observe_request(ttft=0.003, itl_list=[0.005, 0.005, 0.5], e2e=0.6, queue_time=0.0002)
    ttft = "radixray:time_to_first_token_seconds_bucket"
    # 3 ms is below SGLang's first bucket (0.1 s): the finer low buckets tell it apart.
    assert value(reg, ttft, le="0.0025") == 0
    assert value(reg, ttft, le="0.005") == 1
    assert value(reg, "radixray:time_to_first_token_seconds_sum") == pytest.approx(0.003)
    itl = "radixray:inter_token_latency_seconds_bucket"
    assert value(reg, itl, le="0.006") == 2
    assert value(reg, itl, le="0.6") == 3
    assert value(reg, "radixray:inter_token_latency_seconds_count") == 3
    assert value(reg, "radixray:e2e_request_latency_seconds_count") == 1
    assert value(reg, "radixray:queue_time_seconds_bucket", le="0.0005") == 1
    # The GPU-scale range is still there.
    assert value(reg, ttft, le="400.0") == 1
    assert value(reg, itl, le="8.0") == 3


def test_observe_request_without_first_token(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    m.observe_request(ttft=None, itl_list=[], e2e=1.5, queue_time=None)
    assert value(reg, "radixray:time_to_first_token_seconds_count") == 0
    assert value(reg, "radixray:queue_time_seconds_count") == 0
    assert value(reg, "radixray:e2e_request_latency_seconds_count") == 1


def test_observe_request_rejects_bad_durations(reg):
    m = EngineMetrics(reg, "tiny-llama", 3)
    with pytest.raises(ValueError, match=r"itl_list\[1\]"):
        m.observe_request(0.1, [0.01, -0.01], 0.2, 0.0)
    with pytest.raises(ValueError, match="e2e"):
        m.observe_request(0.1, [], math.inf, 0.0)
    assert value(reg, "radixray:inter_token_latency_seconds_count") == 0


def test_metric_names_in_exposition_reads_a_foreign_body():
    body = ("# TYPE x_seconds histogram\n"
            'x_seconds_bucket{le="1.0"} 1\nx_seconds_bucket{le="+Inf"} 1\n'
            "x_seconds_sum 0.5\nx_seconds_count 1\n"
            "# TYPE y counter\ny_total 3\n")
    assert metric_names_in_exposition(body) == {"x_seconds_bucket", "x_seconds_sum",
                                                "x_seconds_count", "y_total"}
