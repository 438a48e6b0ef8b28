"""deploy/prometheus: promtool checks the config and rules and runs the alert unit tests; a real
Prometheus server scrapes a replica-shaped /metrics on loopback and answers queries."""

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry

from radixray.cluster.metrics import EXPOSITION_CONTENT_TYPE, EngineMetrics, render_metrics

PROM_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(apt-get install prometheus)")

ALERTS = ["RadixrayReplicaDown", "RadixrayQueueGrowing", "RadixrayTTFTP99High",
          "RadixrayKVCacheNearFull", "RadixrayReplicaRestarted", "RadixrayRouterBreakerOpen"]


def promtool(*args, cwd=PROM_DIR):
    proc = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@needs_promtool
def test_config_is_valid():
    out = promtool("check", "config", "prometheus.yml")
    assert "1 rule files found" in out


@needs_promtool
def test_rules_are_valid():
    promtool("check", "rules", "alerts.yml")


def test_every_issue_alert_is_defined():
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert sorted(names) == sorted(ALERTS)


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())["tests"]
    firing, quiet = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing == set(ALERTS)
    assert quiet == set(ALERTS)


@needs_promtool
def test_alert_unit_tests_pass():
    out = promtool("test", "rules", "alerts_test.yml")
    assert "SUCCESS" in out


@needs_promtool
def test_alert_unit_tests_can_fail(tmp_path):
    """A raised threshold must break the TTFT case: the unit tests really evaluate the rules."""
    rules = (PROM_DIR / "alerts.yml").read_text()
    assert ") > 5\n" in rules
    (tmp_path / "alerts.yml").write_text(rules.replace(") > 5\n", ") > 30\n"))
    shutil.copy(PROM_DIR / "alerts_test.yml", tmp_path)
    proc = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "RadixrayTTFTP99High" in proc.stdout + proc.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prom_query(port, query):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def serve_metrics(registry):
    """A replica-shaped `/metrics` endpoint on loopback, answering as a replica does."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = render_metrics(registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", EXPOSITION_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def scrape_and_query(tmp_path, targets, queries, timeout=15.0):
    """Run a real Prometheus that scrapes `targets` (job radixray-replicas) every second; wait
    until every query in `queries` returns a series and return {query: result}."""
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(PROM_DIR / "alerts.yml")],
              "scrape_configs": [{"job_name": "radixray-replicas",
                                  "static_configs": [{"targets": targets}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        deadline = time.monotonic() + timeout
        results = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                results = {q: prom_query(port, q) for q in queries}
            except OSError:  # not listening yet
                results = {}
            if results and all(results.values()):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
                    groups = json.load(r)["data"]["groups"]
                results["alerts"] = sorted(rule["name"] for g in groups for rule in g["rules"])
                return results
            time.sleep(0.25)
        raise AssertionError(f"no data after {timeout}s: {results}\n"
                             + (tmp_path / "prometheus.log").read_text()[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_real_prometheus_scrapes_engine_metrics(tmp_path):
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny-llama", 0)
    metrics.update_scheduler_stats({"prompt_tokens_total": 123, "num_queue_reqs": 4})
    metrics.observe_request(ttft=0.004, itl_list=[0.003, 0.003], e2e=0.01, queue_time=0.001)
    server = serve_metrics(registry)
    port = server.server_address[1]
    try:
        results = scrape_and_query(tmp_path, [f"127.0.0.1:{port}"], [
            'up{job="radixray-replicas"}',
            "radixray:prompt_tokens_total",
            "radixray:num_queue_reqs",
            "radixray:inter_token_latency_seconds_count",
        ])
    finally:
        server.shutdown()
        server.server_close()
    assert results["alerts"] == sorted(ALERTS)  # the shipped rules load in a real server
    assert results['up{job="radixray-replicas"}'][0]["value"][1] == "1"
    (tokens,) = results["radixray:prompt_tokens_total"]
    assert tokens["metric"]["model_name"] == "tiny-llama"
    assert tokens["metric"]["replica"] == "0"
    assert float(tokens["value"][1]) == 123
    assert float(results["radixray:num_queue_reqs"][0]["value"][1]) == 4
    assert float(results["radixray:inter_token_latency_seconds_count"][0]["value"][1]) == 2
