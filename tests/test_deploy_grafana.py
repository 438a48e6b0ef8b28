"""deploy/grafana dashboards (and the alert rules): every PromQL expression parses with promtool
and uses only metric names that radixray exports, read from a live `/metrics`."""

import json
import re
import shutil
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from radixray.cluster.metrics import (
    EXPOSITION_CONTENT_TYPE,
    EngineMetrics,
    metric_names_in_exposition,
    render_metrics,
)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
PROMTOOL = shutil.which("promtool")

# The router's metrics as the router issue names them: name -> (type, labels). The dashboards
# are checked against radixray.router.metrics when it exists (and that against this list).
ROUTER_METRICS = {
    "requests_total": ("counter", {"route", "status"}),
    "errors_total": ("counter", {"worker", "kind"}),
    "retries_total": ("counter", {"worker"}),
    "policy_decisions_total": ("counter", {"policy", "decision"}),
    "predicted_cached_chars_total": ("counter", set()),
    "request_chars_total": ("counter", set()),
    "real_cached_tokens_total": ("counter", set()),
    "real_prompt_tokens_total": ("counter", set()),
    "worker_load": ("gauge", {"worker"}),
    "worker_healthy": ("gauge", {"worker"}),
    "circuit_state": ("gauge", {"worker"}),
    "tree_size_chars": ("gauge", {"worker"}),
    "predicted_cache_hit_rate": ("gauge", set()),
    "real_cache_hit_rate": ("gauge", set()),
    "request_duration_seconds": ("histogram", {"route"}),
}
# Series Prometheus makes itself for every target.
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Values that make Grafana's template variables valid PromQL.
TEMPLATE_VALUES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}


def sample_names(name, kind):
    """Names a metric family's samples have in the text exposition."""
    if kind == "histogram":
        return {name + s for s in ("_bucket", "_sum", "_count")}
    if kind == "counter":
        return {name if name.endswith("_total") else name + "_total"}
    return {name}


def router_names_from_list():
    return set().union(*(sample_names("radixray_router:" + n, kind)
                         for n, (kind, _) in ROUTER_METRICS.items()))


def router_names_from_module():
    """Names the router's own RouterMetrics registers, or None before router/metrics.py exists."""
    try:
        from radixray.router.metrics import RouterMetrics
    except ImportError:
        return None
    # Families are listed even before a labelled child exists (samples are not).
    return set().union(*(sample_names(f.name, f.type) for f in RouterMetrics().registry.collect()))


def router_metric_names():
    from_module = router_names_from_module()
    return router_names_from_list() if from_module is None else from_module


def test_router_module_exports_the_issue_list():
    from_module = router_names_from_module()
    if from_module is None:
        pytest.skip("radixray.router.metrics not present")
    assert from_module == router_names_from_list()


def engine_metric_names_from_live_endpoint():
    """Serve an EngineMetrics registry over HTTP as a replica does and read the names back."""
    registry = CollectorRegistry()
    EngineMetrics(registry, "tiny", 0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = render_metrics(registry)
            self.send_response(200)
            self.send_header("Content-Type", EXPOSITION_CONTENT_TYPE)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return metric_names_in_exposition(resp.read().decode())
    finally:
        server.shutdown()
        server.server_close()


def known_metric_names():
    return engine_metric_names_from_live_endpoint() | router_metric_names() | PROMETHEUS_BUILTINS


def substitute_template_vars(expr):
    """Replace Grafana's $var / ${var} with PromQL-valid text (`.*` inside label matchers)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: TEMPLATE_VALUES.get(m.group(1), ".*"), expr)


def dashboard_exprs(path):
    board = json.loads(path.read_text())
    exprs = [(f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
             for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":  # label_values(<selector>, label): check the selector
            selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"]).group(1)
            exprs.append((f"variable {var['name']}", selector))
    return exprs


def alert_exprs():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def selector_names(expr):
    promql_parser = pytest.importorskip("promql_parser")
    names, nameless = [], []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            (names if node.name else nameless).append(node.name or str(node))

    promql_parser.walk(promql_parser.parse(substitute_template_vars(expr)), visit)
    assert not nameless, f"selector without a metric name in {expr!r}: {nameless}"
    return names


def selector_label_names(expr):
    """{metric name: label names its matchers use} for every selector in `expr`."""
    promql_parser = pytest.importorskip("promql_parser")
    used = {}

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            used.setdefault(node.name, set()).update(m.name for m in node.matchers.matchers)

    promql_parser.walk(promql_parser.parse(substitute_template_vars(expr)), visit)
    return used


@pytest.mark.parametrize("source", ["radixray-engine.json", "radixray-router.json", "alerts.yml"])
def test_label_matchers_use_labels_the_metric_has(source):
    target_labels = {"job", "instance"}  # added by Prometheus to every scraped series
    router_labels = {"radixray_router:" + n: labels for n, (_, labels) in ROUTER_METRICS.items()}
    exprs = alert_exprs() if source == "alerts.yml" else dashboard_exprs(DEPLOY / "grafana" / source)
    for where, expr in exprs:
        for name, labels in selector_label_names(expr).items():
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith("radixray:"):
                allowed = {"model_name", "replica"}
            elif family in router_labels or name in router_labels:
                allowed = router_labels.get(family, router_labels.get(name))
            else:
                allowed = set()
            allowed = allowed | target_labels | ({"le"} if name.endswith("_bucket") else set())
            assert labels <= allowed, f"{source} {where}: {name} has no label {labels - allowed}"


def test_there_are_an_engine_and_a_router_dashboard():
    assert [p.name for p in DASHBOARDS] == ["radixray-engine.json", "radixray-router.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_json_is_importable(path):
    board = json.loads(path.read_text())
    for key in ("uid", "title", "panels", "templating", "schemaVersion"):
        assert key in board, key
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in variables
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$\{?(\w+)\}?", target["expr"])) - set(TEMPLATE_VALUES)
            assert used <= variables, f"{panel['title']!r} uses undefined {used - variables}"


def all_panel_exprs(name):
    return "\n".join(e for _, e in dashboard_exprs(DEPLOY / "grafana" / name))


def test_engine_dashboard_covers_the_issue_panels():
    text = all_panel_exprs("radixray-engine.json")
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert re.search(rf"histogram_quantile\({q}, [^\n]*radixray:{hist}_bucket", text), (hist, q)
    for metric in ("generation_tokens_total", "num_running_reqs", "num_queue_reqs", "token_usage",
                   "cache_hit_rate", "num_retracted_reqs_total", "evicted_tokens_total",
                   "new_token_ratio"):
        assert f"radixray:{metric}" in text, metric


def test_router_dashboard_covers_the_issue_panels():
    text = all_panel_exprs("radixray-router.json")
    for metric in ("requests_total", "errors_total", "retries_total", "worker_load",
                   "predicted_cache_hit_rate", "real_cache_hit_rate"):
        assert f"radixray_router:{metric}" in text, metric


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_expression_parses_with_promtool(tmp_path):
    """promtool parses each expression as the body of a recording rule."""
    rules, origin = [], {}
    for path in DASHBOARDS:
        for i, (where, expr) in enumerate(dashboard_exprs(path)):
            record = f"dashboard:{path.stem.replace('-', '_')}:{i}"
            rules.append({"record": record, "expr": substitute_template_vars(expr)})
            origin[record] = f"{path.name} {where}"
    assert len(rules) > 30
    (tmp_path / "dashboards.rules.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", "dashboards.rules.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_rejects_a_broken_expression(tmp_path):
    """The parse check above can fail: a dropped parenthesis is caught."""
    (tmp_path / "bad.yml").write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum(rate(radixray:prompt_tokens_total[1m])"}]}]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", "bad.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


@pytest.mark.parametrize("source", ["radixray-engine.json", "radixray-router.json", "alerts.yml"])
def test_expressions_use_only_exported_metric_names(source):
    known = known_metric_names()
    exprs = alert_exprs() if source == "alerts.yml" else dashboard_exprs(DEPLOY / "grafana" / source)
    used = set()
    for where, expr in exprs:
        names = selector_names(expr)
        unknown = set(names) - known
        assert not unknown, f"{source} {where} uses unexported {sorted(unknown)}"
        used |= set(names)
    prefix = "radixray_router:" if "router" in source else "radixray:"
    assert any(n.startswith(prefix) for n in used)


def test_name_check_catches_a_misspelt_metric():
    assert selector_names('rate(radixray:prompt_token_total{replica=~"$replica"}[$__rate_interval])') \
        == ["radixray:prompt_token_total"]
    assert "radixray:prompt_token_total" not in known_metric_names()
    assert "radixray:prompt_tokens_total" in known_metric_names()


def test_every_engine_metric_appears_on_a_dashboard_or_alert():
    """No exported engine figure is left unwatched."""
    used = {n for path in DASHBOARDS for _, e in dashboard_exprs(path) for n in selector_names(e)}
    used |= {n for _, e in alert_exprs() for n in selector_names(e)}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    exported = {re.sub(r"_(bucket|sum|count)$", "", n)
                for n in engine_metric_names_from_live_endpoint() if not n.endswith("_created")}
    assert exported - families == set()
