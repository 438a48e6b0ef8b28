"""deploy/ray cluster YAMLs: valid for Ray's own schema and config preparation, and they install
radixray and start `radixray serve` on the head."""

import argparse
import copy
import json
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

RAY_DIR = Path(__file__).resolve().parent.parent / "deploy" / "ray"
CLUSTERS = ["local.yaml", "aws.yaml", "gcp.yaml"]
SCHEMA = json.loads((Path(os.path.dirname(ray.__file__)) / "autoscaler" / "ray-schema.json").read_text())


def load(name):
    return yaml.safe_load((RAY_DIR / name).read_text())


def schema_errors(cfg):
    validator = jsonschema.Draft7Validator(SCHEMA)
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(cfg)]


def test_the_three_clusters_exist():
    assert sorted(p.name for p in RAY_DIR.glob("*.yaml")) == sorted(CLUSTERS)


@pytest.mark.parametrize("name", CLUSTERS)
def test_schema_accepts_the_file_as_written(name):
    assert schema_errors(load(name)) == []


@pytest.mark.parametrize("name", CLUSTERS)
def test_ray_prepares_and_validates_it(name):
    prepared = prepare_config(copy.deepcopy(load(name)))
    validate_config(prepared)
    assert schema_errors(prepared) == []


def test_schema_pass_catches_a_misspelt_key():
    cfg = load("aws.yaml")
    cfg["setup_command"] = cfg.pop("setup_commands")
    errors = schema_errors(cfg)
    assert any("setup_command" in e for e in errors), errors


def serve_command(cfg):
    (cmd,) = [c for c in cfg["head_start_ray_commands"] if "radixray serve" in c]
    return cmd


@pytest.mark.parametrize("name", CLUSTERS)
def test_head_installs_torch_then_radixray(name):
    prepared = prepare_config(copy.deepcopy(load(name)))
    for key in ("head_setup_commands", "worker_setup_commands"):
        commands = prepared[key]
        torch = next(i for i, c in enumerate(commands) if re.match(r"pip install torch\b", c))
        radixray = next(i for i, c in enumerate(commands) if c.startswith("pip install ~/radixray"))
        assert torch < radixray, (key, commands)
    # The repo that is installed is the one `ray up` runs from.
    assert prepared["file_mounts"]["~/radixray"] == "."


@pytest.mark.parametrize("name", CLUSTERS)
def test_head_starts_ray_then_radixray_serve_on_the_public_port(name):
    commands = load(name)["head_start_ray_commands"]
    ray_start = next(i for i, c in enumerate(commands) if "ray start --head" in c)
    serve = next(i for i, c in enumerate(commands) if "radixray serve" in c)
    assert ray_start < serve
    cmd = serve_command(load(name))
    assert cmd.startswith("nohup ") and cmd.rstrip().endswith("&")  # must not block `ray up`
    argv = shlex.split(cmd.split(">")[0])[1:]
    assert argv[:2] == ["radixray", "serve"]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--host"] == "0.0.0.0"
    assert flags["--port"] == "30000"
    assert flags["--ray-address"] == "auto"


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_gpu_workers_fit_a_replica(name):
    """Each GPU worker has at least --tp-size GPUs and enough workers start for --replicas."""
    cfg = load(name)
    argv = shlex.split(serve_command(cfg).split(">")[0])
    flags = dict(zip(argv[3::2], argv[4::2]))
    tp, replicas = int(flags["--tp-size"]), int(flags["--replicas"])
    worker = cfg["available_node_types"]["gpu_worker"]
    if name == "gcp.yaml":
        (acc,) = worker["node_config"]["guestAccelerators"]
        gpus = acc["acceleratorCount"]
        assert worker["resources"]["GPU"] == gpus  # the autoscaler does not detect them on GCP
        assert {"onHostMaintenance": "TERMINATE"} in worker["node_config"]["scheduling"]
    else:
        known = {"g5.xlarge": 1, "g5.2xlarge": 1, "g5.12xlarge": 4, "g5.48xlarge": 8,
                 "p4d.24xlarge": 8, "g6.xlarge": 1, "g6.12xlarge": 4}
        gpus = known[worker["node_config"]["InstanceType"]]
    assert gpus >= tp
    assert worker["min_workers"] * (gpus // tp) >= replicas
    # The model path the replicas load is the one the setup commands download to.
    assert any(flags["--model"] in c for c in cfg["setup_commands"])


@pytest.mark.parametrize("name", CLUSTERS)
def test_serve_flags_exist_in_the_serve_cli(name):
    cli = pytest.importorskip("radixray.cluster.cli")
    if "serve" not in getattr(cli, "SUBCOMMANDS", {}):
        pytest.skip("`radixray serve` not in radixray.cluster.cli yet")
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.SUBCOMMANDS["serve"][1](parser)
    argv = shlex.split(serve_command(load(name)).split(">")[0])[3:]
    parser.parse_args(argv)


# Accelerators without bfloat16 (pre-Ampere), which `--dtype auto` picks on GPUs.
NO_BFLOAT16 = ("nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-p4",
               "nvidia-tesla-k80")


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_gpu_clusters_run_the_ranks_on_gpus(name):
    """serve starts on the CPU head before the GPU workers join, so `--device auto` would see
    no GPU: the GPU files say cuda, and a dtype their GPUs have."""
    cfg = load(name)
    argv = shlex.split(serve_command(cfg).split(">")[0])
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--device"] == "cuda"
    accelerators = cfg["available_node_types"]["gpu_worker"]["node_config"].get(
        "guestAccelerators", [])
    if any(a["acceleratorType"] in NO_BFLOAT16 for a in accelerators):
        assert flags.get("--dtype") in ("float16", "float32")
    else:
        assert flags.get("--dtype", "auto") in ("auto", "bfloat16", "float16")


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_gpu_clusters_wait_for_their_gpu_workers(name):
    """serve starts on the head before the autoscaler has booted a GPU worker, installed CUDA
    torch and downloaded the model: it must wait for the replicas' GPUs without a limit
    (serve's default limit would end the nohup'd serve and leave nothing on port 30000)."""
    argv = shlex.split(serve_command(load(name)).split(">")[0])
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--placement-timeout"] == "0"
