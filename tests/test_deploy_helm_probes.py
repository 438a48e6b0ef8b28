"""helm/radixray, what runs in the pods: the head's shell command with hostile values (run
by bash against a stub), the probes (their paths asked of the real router app; the head's exec
liveness probe run in its own PID namespace) and the port-forward NOTES.txt prints."""

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
from helm_helpers import (CHART, REPO, VALUES_FILES, by_kind, head_container, head_liveness_command,
                          helm, merged_values, render, serve_flags, values_for)


# --------------------------------------------------------------------------- the head's command

TRICKY_WORDS = ["bob's model", "it''s", "'", "$HOME", "$(id)", "`id`", '"quoted"', "back\\slash",
                "semi;colon && true", "  spaces  ", "glob*?[x]", "tab\there", "#hash", "!bang", ""]


def tricky_values():
    return {"model": {"path": "/models/o'brien's $HOME `x` model"},
            "serve": {"extraArgs": ["--served-model-name", *TRICKY_WORDS]}}


def run_head_command(script, tmp_path):
    """Run the head container's shell script as bash would in the pod, with KubeRay's
    `ray start` replaced by `true` and `radixray` by a stub that records its arguments."""
    stub = tmp_path / "bin" / "radixray"
    stub.parent.mkdir()
    out = tmp_path / "argv.json"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}",
           "KUBERAY_GEN_RAY_START_CMD": "true --block"}
    # The pod runs /bin/bash -lc; --noprofile keeps this machine's profile from resetting PATH
    # (and so from running the real radixray).
    result = subprocess.run(["/bin/bash", "--noprofile", "--norc", "-c", "--", script],
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_head_command_survives_quotes_and_shell_characters(tmp_path):
    """model.path and serve.extraArgs reach `radixray serve` exactly as given, each one word:
    quoted for bash with every ' escaped (a bare ' used to end the quoting and crash-loop the
    head)."""
    values = tricky_values()
    head = head_container(render(values))
    assert head["command"] == ["/bin/bash", "-lc", "--"]
    (script,) = head["args"]
    syntax = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    argv = run_head_command(script, tmp_path)
    assert argv[0] == "serve"
    assert argv[argv.index("--model") + 1] == values["model"]["path"]
    assert argv[-len(values["serve"]["extraArgs"]):] == values["serve"]["extraArgs"]
    # and what the other tests parse with shlex is what bash runs
    assert ["radixray", *argv] == shlex.split(script.split("exec ", 1)[1])


def test_extra_args_come_after_the_charts_flags_so_they_override_them():
    args = serve_flags(render({"serve": {"extraArgs": ["--placement-timeout", "3600"]}}))
    assert args.placement_timeout == 3600


# --------------------------------------------------------------------------- probes

def probed_paths(docs):
    """(container, probe kind, path) of every HTTP probe in the chart's pods."""
    found = []
    (cluster,) = by_kind(docs, "RayCluster")
    pods = [cluster["spec"]["headGroupSpec"]["template"]] + \
        [g["template"] for g in cluster["spec"]["workerGroupSpecs"]] + \
        [d["spec"]["template"] for d in by_kind(docs, "Deployment")]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "httpGet" in container.get(kind, {}):
                    found.append((container["name"], kind, container[kind]["httpGet"]["path"]))
    return found


@pytest.mark.parametrize("name", VALUES_FILES)
def test_no_probe_restarts_anything_for_an_unhealthy_replica(name):
    """/health is 503 whenever no replica is healthy; as a liveness or startup probe it turned
    a replica's model reload (minutes) into restarts of the router pods and of the head, whose
    main process is serve (and with it the Ray cluster)."""
    for container, kind, path in probed_paths(render(values_for(name))):
        assert path != "/health", (container, kind)
        if kind != "readinessProbe":
            assert path == "/liveness", (container, kind)


def test_the_head_serves_its_router_whether_or_not_the_router_deployment_exists():
    """router.enabled only adds the Deployment: `radixray serve` on the head always runs its own
    router on serve.port (`python -m radixray.router`, the process the head's liveness probe
    looks for), so the head's probes are the same either way."""
    source = (REPO / "cluster" / "router_process.py").read_text()
    assert '"-m", "radixray.router"' in source
    heads = [head_container(render(v)) for v in ({}, {"router": {"enabled": False}})]
    assert heads[0]["livenessProbe"] == heads[1]["livenessProbe"]
    assert heads[0]["readinessProbe"] == heads[1]["readinessProbe"]


def test_the_probed_paths_exist_on_the_router():
    """What the probes ask for, asked of the real router app with no replica: /liveness is 200
    all the same; /readiness is 503."""
    from starlette.testclient import TestClient

    from radixray.router.app import build_app
    from radixray.router.config import RouterConfig

    app = build_app(RouterConfig(worker_urls=[]))
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/liveness", "/readiness"} <= paths
    with TestClient(app) as client:
        assert client.get("/liveness").status_code == 200
        assert client.get("/readiness").status_code == 503
    probed = {path for _, _, path in probed_paths(render({}))}
    assert probed <= paths


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_ROUTER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(sys.argv[2]) if self.path == "/liveness" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def isolated_probe(probe, setup=""):
    """Run the probe command in a fresh PID namespace with its own /proc (as in the pod, which
    sees only its own processes; this machine may run real routers), after `setup`; its exit
    status. The module name is spelt through a variable: bash's own command line must not
    look like a router to the probe."""
    script = f"M=radixray.router; {setup}\n\"$@\""
    result = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script,
                             "bash", *probe], capture_output=True, text=True, timeout=60)
    return result.returncode


@pytest.fixture(scope="module")
def head_probe():
    if shutil.which("wget") is None:
        pytest.skip("wget not installed (the image has it: deploy/docker/Dockerfile)")
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:
        pytest.skip("unshare --pid --mount-proc needs root")
    port = free_port()
    return port, head_liveness_command(head_container(render({"serve": {"port": port}})), port)


def wait_for_port(port):
    return (f"for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; "
            "sleep 0.1; done; ")


def test_head_liveness_probe_passes_while_serve_brings_the_replicas_up(head_probe):
    """No router process yet: serve is waiting for GPU pods or loading models, for as long as
    that takes; it exits by itself (restarting the container) if it fails."""
    _, probe = head_probe
    assert isolated_probe(probe) == 0
    assert isolated_probe(probe, "python3 -c 'import time; time.sleep(60)' serve & sleep 0.3;") == 0


def test_head_liveness_probe_asks_the_router_once_it_runs(head_probe):
    port, probe = head_probe
    fake = FAKE_ROUTER.replace("\n", "\\n")
    answering = f"python3 -c \"$(printf '{fake}')\" {port} 200 -m \"$M\" & {wait_for_port(port)}"
    assert isolated_probe(probe, answering) == 0
    failing = f"python3 -c \"$(printf '{fake}')\" {port} 503 -m \"$M\" & {wait_for_port(port)}"
    assert isolated_probe(probe, failing) != 0
    # a router process that does not answer at all (hung, or its port not open)
    assert isolated_probe(probe, "python3 -c 'import time; time.sleep(60)' -m \"$M\" & sleep 0.3;") != 0


# --------------------------------------------------------------------------- NOTES.txt

def notes(values):
    return helm.Chart.load(CHART).render(values, name="llm", namespace="llm")[
        "radixray/templates/NOTES.txt"]


def port_forwards(text):
    return [line.split() for line in text.splitlines() if "port-forward" in line]


@pytest.mark.parametrize("name", VALUES_FILES)
def test_notes_forward_a_high_local_port_to_what_serves(name):
    values = merged_values(name)
    (forward,) = port_forwards(notes(values_for(name)))
    target, ports = forward[-2], forward[-1]
    local, remote = ports.split(":")
    assert int(local) >= 1024  # binding a port under 1024 needs root
    if values["router"]["enabled"]:
        assert target == "svc/llm-router" if name.startswith("worker-urls") else "svc/llm-radixray-router"
        assert int(remote) == values["router"]["service"]["port"]
    else:  # serve's own router on the head, through KubeRay's head Service
        assert target.endswith("-head-svc")
        assert int(remote) == values["serve"]["port"]
    assert f"curl http://127.0.0.1:{local}/" in notes(values_for(name))


def test_notes_with_a_privileged_service_port_and_no_router():
    (forward,) = port_forwards(notes({"router": {"service": {"port": 80}}}))
    assert forward[-1] == "30000:80"
    (forward,) = port_forwards(notes({"router": {"replicas": 0}}))
    assert forward[-2:] == ["svc/llm-radixray-head-svc", "30000:30000"]
    (forward,) = port_forwards(notes({"router": {"enabled": False}, "serve": {"port": 8080}}))
    assert forward[-2:] == ["svc/llm-radixray-head-svc", "30000:8080"]
