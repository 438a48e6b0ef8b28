"""Rendering helm/radixray for the tests/test_deploy_helm*.py files: values files, rendered
documents, the head container and the `radixray serve` command it runs."""

import argparse
import shlex
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "radixray"
VALUES_FILES = ["default"] + sorted(p.name for p in (CHART / "ci").glob("*.yaml"))


def values_for(name):
    return {} if name == "default" else yaml.safe_load((CHART / "ci" / name).read_text())


def merged_values(name):
    return helm.Chart.load(CHART).merge_values(values_for(name))


def render(values, name="demo", namespace="llm"):
    rendered = helm.Chart.load(CHART).render(values, name=name, namespace=namespace)
    docs = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [(path, d) for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs, kind):
    return [d for _, d in docs if d["kind"] == kind]


def container_command(container):
    return " ".join(container.get("command", []) + container.get("args", []))


def head_container(docs):
    (cluster,) = by_kind(docs, "RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return head


def head_liveness_command(container, port):
    """The head's exec liveness probe: a shell command that asks serve's router for /liveness
    on serve.port."""
    probe = container["livenessProbe"]
    assert set(probe) - {"periodSeconds", "failureThreshold", "timeoutSeconds",
                         "initialDelaySeconds"} == {"exec"}
    command = probe["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3
    assert f"http://127.0.0.1:{port}/liveness" in command[2]
    return command


def serve_parser():
    """`radixray serve`'s argument parser (a missing subcommand fails, it does not skip)."""
    from radixray.cluster.cli import SUBCOMMANDS

    assert "serve" in SUBCOMMANDS, "`radixray serve` is missing from radixray.cluster.cli"
    parser = argparse.ArgumentParser(exit_on_error=False)
    SUBCOMMANDS["serve"][1](parser)
    return parser


def serve_flags(docs):
    """`radixray serve`'s parsed arguments as the head runs them."""
    argv = shlex.split(container_command(head_container(docs)).split("exec ", 1)[1])
    return serve_parser().parse_args(argv[2:])
