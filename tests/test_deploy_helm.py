"""helm/radixray: rendered with several values files and linted by Helm's own Go code
(helm-python-sdk); core manifests validated with kubernetes-validate; the KubeRay RayCluster
and the ServiceMonitor (CRDs) checked structurally, their pod templates as core PodSpecs; the
flags the chart passes parsed by the real CLIs. The head's command run by bash, the probes and
NOTES.txt: test_deploy_helm_probes.py."""

import argparse
import re
import shlex

import pytest
import yaml
from helm_helpers import (CHART, REPO, VALUES_FILES, by_kind, container_command, head_liveness_command,
                          helm, merged_values, render, serve_flags, values_for)

kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="pip install kubernetes-validate")

K8S_VERSION = "1.30.0"
CRD_API_GROUPS = ("ray.io/", "monitoring.coreos.com/")


@pytest.fixture(scope="module", params=VALUES_FILES)
def case(request):
    return request.param, merged_values(request.param), render(values_for(request.param))


def test_there_are_several_values_files():
    assert len(VALUES_FILES) >= 4


@pytest.mark.parametrize("name", VALUES_FILES)
def test_lint_strict_is_clean(name):
    report = helm.lint(CHART, values_for(name), strict=True, namespace="llm")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_core_manifests_pass_kubernetes_validate(case):
    _, _, docs = case
    core = [d for _, d in docs if not d["apiVersion"].startswith(CRD_API_GROUPS)]
    assert {"Service", "ConfigMap"} & {d["kind"] for d in core}
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_rejects_a_bad_field():
    """The strict validation above has teeth: an unknown field in a rendered Service fails."""
    (service,) = [d for d in by_kind(render({}), "Service") if d["metadata"]["name"].endswith("-replicas")]
    service["spec"]["portz"] = service["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def as_pod(template):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "template", "labels": template["metadata"]["labels"]},
            "spec": template["spec"]}


def test_raycluster(case):
    name, values, docs = case
    (cluster,) = by_kind(docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert spec["rayVersion"] == values["ray"]["version"]
    # KubeRay leaves our commands alone only with this annotation.
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"

    head = spec["headGroupSpec"]
    kubernetes_validate.validate(as_pod(head["template"]), K8S_VERSION, strict=True)
    (head_container,) = head["template"]["spec"]["containers"]
    cmd = container_command(head_container)
    assert "$KUBERAY_GEN_RAY_START_CMD" in cmd or "${KUBERAY_GEN_RAY_START_CMD" in cmd
    serve = shlex.split(cmd.split("exec ", 1)[1])
    assert serve[:2] == ["radixray", "serve"]
    flags = dict(zip(serve[2::2], serve[3::2]))
    assert flags["--ray-address"] == "auto"
    assert flags["--port"] == str(values["serve"]["port"])
    assert flags["--tp-size"] == str(values["tpSize"])
    assert flags["--replicas"] == str(values["replicas"])
    assert flags.get("--model", "") == values["model"]["path"]
    # The worker pods have GPUs, the head pod none, and they may join after serve starts: the
    # ranks must ask Ray for GPUs whatever serve sees at start (auto could pick cpu).
    assert flags["--device"] == "cuda"
    # serve starts before the GPU pods exist: it must wait for them, not exit (and restart Ray).
    assert flags["--placement-timeout"] == "0"
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # serve opens its port only once every replica is up: no startup probe can bound that, and
    # liveness never needs a replica (see test_head_liveness_probe_*).
    assert "startupProbe" not in head_container
    assert head_container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert head_liveness_command(head_container, values["serve"]["port"])
    assert "nvidia.com/gpu" not in str(head_container["resources"])

    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"] == values["ray"]["worker"]["groupName"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == values["replicas"]
    assert group["rayStartParams"]["num-gpus"] == str(values["tpSize"])
    kubernetes_validate.validate(as_pod(group["template"]), K8S_VERSION, strict=True)
    (worker,) = group["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert worker["resources"][kind]["nvidia.com/gpu"] == values["tpSize"]
    assert "--block" in container_command(worker)
    mounts = {m["mountPath"]: m for m in worker["volumeMounts"]}
    assert "/dev/shm" in mounts
    if values["model"]["persistentVolumeClaim"]:
        assert mounts[values["model"]["mountPath"]]["readOnly"] is True
        claims = [v["persistentVolumeClaim"]["claimName"]
                  for v in group["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [values["model"]["persistentVolumeClaim"]]
    image = f"{values['image']['repository']}:{values['image']['tag'] or '0.1.0'}"
    assert head_container["image"] == worker["image"] == image


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def test_router(case):
    name, values, docs = case
    deployments = by_kind(docs, "Deployment")
    if not values["router"]["enabled"]:
        assert deployments == []
        return
    (deployment,) = deployments
    (cluster,) = by_kind(docs, "RayCluster")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:2] == ["radixray", "router"]
    if values["router"]["workerUrls"]:
        i = args.index("--worker-urls")
        assert args[i + 1:i + 1 + len(values["router"]["workerUrls"])] == values["router"]["workerUrls"]
        assert "--ray-address" not in args
    else:
        # KubeRay names the head's Service <RayCluster name>-head-svc; 10001 is the Ray client port.
        address = args[args.index("--ray-address") + 1]
        assert address == f"ray://{cluster['metadata']['name']}-head-svc:10001"
    # /health is 503 while no replica is healthy (a replica reloading its model): never a
    # liveness or startup probe, or a replica restart restarts the routers.
    assert container["startupProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        timings = {k: v for k, v in container[probe].items() if k != "httpGet"}
        assert timings == values["probes"][probe.removesuffix("Probe")]
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-router")]
    assert selects(service["spec"]["selector"], pod_labels)
    assert not selects(service["spec"]["selector"],
                       cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
    assert service["spec"]["ports"][0]["port"] == values["router"]["service"]["port"]
    assert container["ports"][0]["containerPort"] == values["router"]["port"]


def test_router_args_parse_with_the_router_cli(case):
    """The flags the chart passes are flags `radixray router` has, with valid values."""
    _, values, docs = case
    from radixray.router import cli

    for deployment in by_kind(docs, "Deployment"):
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        parser = cli.add_router_arguments(argparse.ArgumentParser(exit_on_error=False))
        parsed = parser.parse_args(args[2:])
        config = cli.config_from_args(parsed)
        assert config.port == values["router"]["port"]
        assert list(config.worker_urls) == values["router"]["workerUrls"]


def test_serve_args_parse_with_the_serve_cli(case):
    """The flags the chart passes are flags `radixray serve` has, with valid values, among
    them --placement-timeout (serve waits for the GPU pods)."""
    _, _, docs = case
    args = serve_flags(docs)
    assert args.placement_timeout == 0


def test_replicas_service_selects_exactly_the_gpu_workers(case):
    _, values, docs = case
    (cluster,) = by_kind(docs, "RayCluster")
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-replicas")]
    selector = service["spec"]["selector"]
    assert selects(selector, cluster["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"])
    assert not selects(selector, cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["port"] == values["serve"]["replicaPort"]


def test_every_replica_listens_where_the_chart_scrapes_it(case):
    """Where replicas really listen (serve's port assignment, one replica per worker pod: a
    replica needs tpSize GPUs and a pod has tpSize) is the port the worker pods expose, the
    -replicas Service targets, the ServiceMonitor scrapes, and static router URLs name."""
    from radixray.cluster.serve import replica_port

    _, values, docs = case
    args = serve_flags(docs)
    (cluster,) = by_kind(docs, "RayCluster")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["rayStartParams"]["num-gpus"] == str(args.tp_size)  # one replica fits a pod
    pods = [f"{group['groupName']}-worker-{i}" for i in range(group["replicas"])]
    base = args.replica_base_port or args.port + 1
    listening = {replica_port(args.replica_port_policy, base, i, pods[:i], pod)
                 for i, pod in enumerate(pods)}
    assert listening == {values["serve"]["replicaPort"]}

    (worker,) = group["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert container_ports["http"] == values["serve"]["replicaPort"]
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-replicas")]
    (port,) = service["spec"]["ports"]
    assert container_ports[port["targetPort"]] in listening
    for monitor in by_kind(docs, "ServiceMonitor"):
        (endpoint,) = monitor["spec"]["endpoints"]
        assert container_ports[endpoint["port"]] in listening
    for url in values["router"]["workerUrls"]:
        assert int(url.rsplit(":", 1)[1]) in listening, url


def test_replicas_on_one_node_would_not_collide():
    """The per-node policy the chart uses still gives replicas sharing a node distinct ports
    (e.g. after a pod restart moved two replicas' bundles onto one node)."""
    from radixray.cluster.serve import replica_port

    args = serve_flags(render({"replicas": 3}))
    nodes = ["node-a"] * 3
    ports = [replica_port(args.replica_port_policy, args.replica_base_port, i, nodes[:i], "node-a")
             for i in range(3)]
    assert len(set(ports)) == 3


def alert_jobs():
    text = (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
    return set(re.findall(r'job="([^"]+)"', text))


def test_servicemonitor(case):
    _, values, docs = case
    monitors = by_kind(docs, "ServiceMonitor")
    if not values["serviceMonitor"]["enabled"]:
        assert monitors == []
        return
    (monitor,) = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    for key, value in values["serviceMonitor"]["labels"].items():
        assert monitor["metadata"]["labels"][key] == value
    spec = monitor["spec"]
    assert set(spec) <= {"jobLabel", "selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == values["serviceMonitor"]["interval"]
    scraped = [s for s in by_kind(docs, "Service") if selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
    jobs = {s["metadata"]["labels"][spec["jobLabel"]] for s in scraped}
    assert jobs == {"radixray-replicas", "radixray-router"}  # without the Deployment: serve's
    # The alert rules select on these job names.
    assert alert_jobs() <= jobs
    for service in scraped:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_dashboards_configmap(case):
    _, values, docs = case
    maps = by_kind(docs, "ConfigMap")
    if not values["grafanaDashboards"]["enabled"]:
        assert maps == []
        return
    (config_map,) = maps
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    expected = {p.name: p.read_text() for p in (REPO / "deploy" / "grafana").glob("*.json")}
    assert config_map["data"] == expected


def test_chart_dashboards_are_a_copy_of_deploy_grafana():
    """Helm reads only files inside the chart, so the chart keeps a copy; keep it equal:
    cp deploy/grafana/*.json helm/radixray/dashboards/"""
    source = {p.name: p.read_bytes() for p in (REPO / "deploy" / "grafana").glob("*.json")}
    copy = {p.name: p.read_bytes() for p in (CHART / "dashboards").glob("*.json")}
    assert copy == source


@pytest.mark.parametrize("values, field", [
    ({"tpSize": 0}, "/tpSize"),
    ({"tp_size": 2}, "tp_size"),
    ({"replicas": "two"}, "/replicas"),
    ({"router": {"workerUrls": ["10.0.0.1:30001"]}}, "/router/workerUrls/0"),
    ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
    # they go into the head's command, a YAML block scalar: a line break would end it
    ({"serve": {"extraArgs": ["--served-model-name", "two\nlines"]}}, "/serve/extraArgs/1"),
    ({"model": {"path": "/models/a\r"}}, "/model/path"),
])
def test_bad_values_are_rejected_naming_the_field(values, field):
    with pytest.raises(helm.HelmValuesError, match=re.escape(field)):
        helm.Chart.load(CHART).render(values, name="demo", namespace="llm")


def test_an_api_key_comes_from_a_secret_into_serve_and_the_router(monkeypatch):
    """The only way to a key was serve.extraArgs: in clear text in the RayCluster and in `ps`,
    and the router Deployment never got the key its health and admin requests need."""
    from radixray.cluster.serve import API_KEY_ENV, add_serve_arguments
    from radixray.router.config import WORKER_API_KEY_ENV

    docs = render({"apiKey": {"existingSecret": "llm-key", "secretKey": "token"}})
    ref = {"secretKeyRef": {"name": "llm-key", "key": "token"}}
    (cluster,) = by_kind(docs, "RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["env"] == [{"name": API_KEY_ENV, "valueFrom": ref}]
    assert "token" not in container_command(head) and "llm-key" not in container_command(head)
    (router,) = by_kind(docs, "Deployment")
    assert router["spec"]["template"]["spec"]["containers"][0]["env"] == [
        {"name": WORKER_API_KEY_ENV, "valueFrom": ref}]
    kubernetes_validate.validate(as_pod(cluster["spec"]["headGroupSpec"]["template"]),
                                 K8S_VERSION, strict=True)
    # serve takes the variable as --api-key's default
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).api_key == "s3cret"
    assert parser.parse_args(["--api-key", "other"]).api_key == "other"
    for name in ("default", "no-router-values.yaml"):  # no Secret: no env at all
        docs = render(values_for(name))
        for kind in ("RayCluster", "Deployment"):
            assert "env" not in str(by_kind(docs, kind)), (name, kind)


def test_without_the_router_deployment_serves_router_is_scraped():
    """With router.enabled=false nothing scraped the head's router: its dashboard stayed empty
    and RadixrayRouterBreakerOpen could never fire."""
    docs = render({**values_for("no-router-values.yaml"), "serviceMonitor": {"enabled": True}})
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (cluster,) = by_kind(docs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]
    services = [s for s in by_kind(docs, "Service")
                if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    (router,) = [s for s in services if s["metadata"]["labels"]["radixray.io/job"]
                 == "radixray-router"]
    assert selects(router["spec"]["selector"], head["metadata"]["labels"])
    (port,) = router["spec"]["ports"]
    assert port["targetPort"] == "http" and port["port"] == merged_values(
        "no-router-values.yaml")["serve"]["port"]
    assert {"name": "http", "containerPort": port["port"]} in head["spec"]["containers"][0][
        "ports"]
    kubernetes_validate.validate(router, K8S_VERSION, strict=True)


def test_worker_resources_can_drop_the_defaults_and_claim_names_stay_strings():
    """`--set ray.worker.resources.requests=null` rendered `requests: null` plus the GPU line,
    which is no YAML; a claim named 123 rendered as a number, which the API server refuses."""
    docs = render({"ray": {"worker": {"resources": {"requests": None, "limits": None}}},
                   "model": {"persistentVolumeClaim": "123"}})
    (cluster,) = by_kind(docs, "RayCluster")
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"nvidia.com/gpu": 1},
                                                         "limits": {"nvidia.com/gpu": 1}}
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["123"]
    kubernetes_validate.validate(as_pod(pod), K8S_VERSION, strict=True)


def test_long_release_names_keep_kuberay_names_valid():
    docs = render({}, name="a-very-long-release-name-for-a-production-cluster-x")
    (cluster,) = by_kind(docs, "RayCluster")
    # KubeRay appends "-head-svc" and "-<group>-worker-xxxxx"; pod names stay under 63.
    assert len(cluster["metadata"]["name"]) + len("-gpu-worker-xxxxx") <= 63


def test_dockerfile_builds_the_default_image():
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    runs = [l for l in text.splitlines() if l.startswith("RUN ")]
    torch = next(i for i, l in enumerate(runs) if "TORCH_SPEC" in l)
    radixray = next(i for i, l in enumerate(runs) if "pip install --no-cache-dir /opt/radixray" in l)
    assert torch < radixray
    assert "wget" in text  # KubeRay's injected probes call wget
    assert re.search(r'^CMD \["radixray", "serve"', text, re.M)
    # The chart's default tag is the package version the image installs.
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version
    # the image's Ray is the one the chart tells KubeRay (a drift breaks the cluster)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f'ARG RAY_SPEC="ray[default]=={values["ray"]["version"]}"' in text
