"""``radixray serve`` end to end: a real process that prints its URL, answers health checks and
requests with the flags it was given, stops cleanly on SIGTERM, and stops with an error when its
machine's Ray node dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from helpers import ports_below_ephemeral, processes_using, wait_healthy
from radixray.cluster.cli import build_parser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_scheduler_flags_with_defaults(capsys):
    parser = build_parser()
    try:
        parser.parse_args(["serve", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("--schedule-policy", "(default: fcfs)", "--chunked-prefill-size",
                     "(default: 2048)", "--max-queued-requests", "--api-key", "--port",
                     "(default: 30000)", "(default: 127.0.0.1)", "--radix-eviction-policy",
                     "(default: lru)", "--max-prefill-tokens", "(default: 16384)",
                     "--tp-size", "--replicas", "(default: cache_aware)"):
        assert fragment in text, fragment


def test_bad_flag_value_names_it(tiny_llama_path):
    r = subprocess.run([sys.executable, "-m", "radixray.cluster.cli", "serve", "--model",
                        tiny_llama_path, "--page-size", "0", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "page_size" in r.stderr
    r = _serve(["--model", tiny_llama_path, "--ray-address", "auto", "--ray-dashboard-port",
                "8265", "--port", str(free_port())])
    assert r.returncode == 2 and "ray_dashboard_port: only for the local Ray" in r.stderr
    # it passed, Ray and the replicas started, then the router refused it and serve ended
    r = _serve(["--model", tiny_llama_path, "--health-check-timeout", "nan", "--port",
                str(free_port())])
    assert r.returncode == 2 and "health_check_timeout: must be" in r.stderr
    # 0 timed out every step: the replica restarted for ever
    r = _serve(["--model", tiny_llama_path, "--step-timeout", "0", "--port", str(free_port())])
    assert r.returncode == 2 and "step_timeout: must be a number of seconds > 0" in r.stderr
    # 0 refused every request with a 429 while /health said 200: the router kept sending
    r = _serve(["--model", tiny_llama_path, "--max-queued-requests", "0", "--port",
                str(free_port())])
    assert r.returncode == 2 and "max_queued_requests: must be >= 1" in r.stderr
    r = _serve(["--model", tiny_llama_path, "--chat-template", "/no/such.jinja", "--port",
                str(free_port())])
    assert r.returncode == 2 and "chat_template: cannot read '/no/such.jinja'" in r.stderr


def test_serve_without_model_uses_the_default_model(tiny_llama_path, tmp_path):
    port, replica, dashboard = ports_below_ephemeral(3)  # none that Ray may take meanwhile
    # the default model's folder already holds weights, so serve uses it as is
    env = {**os.environ, "RADIXRAY_MODEL_DIR": tiny_llama_path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixray.cluster.cli", "serve", "--port", str(port),
         "--replica-base-port", str(replica), "--schedule-policy", "lpm",
         "--max-total-tokens", "4096", "--debug-invariants", "--ray-dashboard-port",
         str(dashboard)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)  # its own process group, with the local Ray it starts
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        lines = []
        while True:  # the URL is printed before the server listens
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            if url in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        wait_healthy(url, deadline - time.monotonic(), lambda: proc.poll() is None)
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert info["schedule_policy"] == "lpm" and info["max_total_num_tokens"] == 4096
        # --device auto (the default) resolved against the local Ray cluster's GPUs, logged
        device = "cuda" if torch.cuda.is_available() else "cpu"
        assert info["device"] == device
        assert any(f"device {device} (--device auto" in line for line in lines), lines
        assert info["disable_overlap_schedule"] is False  # Ray workers: overlap on
        assert info["model_path"] == tiny_llama_path
        r = httpx.post(url + "/v1/completions", json={"model": tiny_llama_path, "prompt": "def",
                                                      "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # the router also watches Ray: discovery finds the replica and follows it from now on
        while httpx.get(url + "/workers", timeout=10).json()["workers"][0]["source"] != "ray":
            assert time.monotonic() < deadline + 30, "Ray discovery never found the replica"
            time.sleep(0.5)
        # --ray-dashboard-port: `ray list` sees the replica (without a dashboard it could not)
        listed = subprocess.run(["ray", "list", "actors", "--address",
                                 f"http://127.0.0.1:{dashboard}"], capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0 and "ReplicaServer" in listed.stdout, listed
        # --debug-invariants checked the memory invariant after every step; a violation
        # would have failed the engine and with it the health check
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        # a router that dies is started again (serve used to exit, taking the replicas down)
        threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                         daemon=True).start()  # serve's output from here on, without blocking
        (router,) = processes_using("radixray.router", f"--port {port}")
        os.kill(router, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not any("the router exited (killed by SIGKILL); starting it again" in line
                      for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        wait_healthy(url, 60, lambda: proc.poll() is None)
    finally:
        # the whole group, as systemd stops a service (and Ctrl-C a terminal's job): the local
        # Ray goes down with serve, whose replica shutdown waited 30 s per replica for it
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(60)
        finally:
            proc.kill()
    assert code == 0 and time.monotonic() - stopped < 25, "".join(lines)


def test_serve_stops_when_its_machines_raylet_dies(tiny_llama_path):
    """The raylet killed (for its memory, say): serve waited on its router for ever while the
    orphaned replica kept its port, answering 503 "restarting"; nothing upstream saw a dead
    deployment to restart."""
    port, replica = ports_below_ephemeral(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixray.cluster.cli", "serve", "--model", tiny_llama_path,
         "--port", str(port), "--replica-base-port", str(replica), "--max-total-tokens", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 180, lambda: proc.poll() is None)
        (raylet,) = [p for p in processes_using("raylet/raylet") if os.getsid(p) == proc.pid]
        os.kill(raylet, signal.SIGKILL)
        code = proc.wait(120)
        said = lambda: any("Ray node is gone" in line for line in lines)  # noqa: E731
        deadline = time.monotonic() + 10  # the reader thread's last lines
        while not said() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert code == 1 and said(), "".join(lines)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and port_in_use(replica):
            time.sleep(0.5)
        assert not port_in_use(replica), "the replica's port is still served by an orphan"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            finally:
                proc.kill()


def port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _serve(args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "radixray.cluster.cli", "serve", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_taken_router_port_fails_before_anything_starts(tiny_llama_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        started = time.monotonic()
        r = _serve(["--model", tiny_llama_path, "--port", str(held.getsockname()[1])])
    assert r.returncode == 1 and "already in use" in r.stderr, r.stderr
    assert "serving" not in r.stdout and time.monotonic() - started < 60


def test_a_taken_replica_port_fails_serve_instead_of_hanging(tiny_llama_path):
    """The replica checks its port before loading its ranks, and a replica that fails takes its
    ranks down with it (their pending watch kept the dead head's process alive, and serve
    waited for it forever)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = _serve(["--model", tiny_llama_path, "--port", str(free_port()),
                    "--replica-base-port", str(port), "--max-total-tokens", "1024"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"port {port} is already in use" in r.stderr, r.stderr


def test_missing_resources_names_what_the_ranks_lack():
    from radixray.cluster.serve import missing_resources

    assert missing_resources({"CPU": 2.0}, "cpu", 4) == "4 CPU"
    assert missing_resources({"CPU": 8.0}, "cpu", 4) is None
    assert missing_resources({"CPU": 8.0, "GPU": 2.0}, "cuda", 4) == "4 GPU"
    assert missing_resources({"CPU": 2.0}, "cuda", 4) == "4 CPU, 4 GPU"


def test_the_router_waits_for_a_busy_replicas_health_verdict():
    """With equal limits (20 s each) the router gave up on /health just before a busy replica
    answered "healthy" at its limit, so a busy replica left rotation after three checks."""
    import argparse

    from radixray.cluster.serve import router_command
    from radixray.router.cli import add_router_arguments

    for flags, replica_limit, interval in (([], 15.0, 10.0), (
            ["--health-check-timeout", "40", "--health-check-interval", "2.5"], 40.0, 2.5)):
        args = build_parser().parse_args(["serve", *flags])
        assert args.health_check_timeout == replica_limit
        command = router_command(args, ["http://127.0.0.1:1"], [])
        module = command.index("-m")
        assert command[module + 1] == "radixray.router"
        router = add_router_arguments(argparse.ArgumentParser()).parse_args(command[module + 2:])
        assert router.health_check_timeout >= replica_limit + 5
        # (serve gave its router no interval: a restarted replica waited up to 10 s for work)
        assert router.health_check_interval == interval


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is 3.11's")
def test_the_router_ignores_modules_in_serves_working_directory(tmp_path):
    """serve ran `python -m radixray.router` in its own working directory, which Python puts
    first on the path: a user's h2.py there shadowed a module the router imports, and the
    router crashed at every start while the replicas stayed up."""
    from radixray.cluster.serve import router_command

    (tmp_path / "radixray").mkdir()  # shadows the whole package, not only one module
    (tmp_path / "radixray" / "__init__.py").write_text("raise SystemExit(7)\n")
    args = build_parser().parse_args(["serve"])
    command = router_command(args, ["http://127.0.0.1:1"], [])
    module = command.index("-m")
    result = subprocess.run([*command[:module + 2], "--help"], cwd=tmp_path, timeout=60,
                            capture_output=True, text=True)
    assert result.returncode == 0 and "--cache-threshold" in result.stdout, result.stderr
    shadowed = [sys.executable, "-m", "radixray.router", "--help"]
    assert subprocess.run(shadowed, cwd=tmp_path, timeout=60).returncode == 7


def test_router_args_reach_the_router_and_bad_ones_fail_serve_at_once():
    """serve passed its router only the policy: cache and tree settings were out of reach."""
    import argparse

    from radixray.cluster.serve import check_router_args, router_command
    from radixray.router.cli import add_router_arguments

    args = build_parser().parse_args(["serve", "--router-args",
                                      "--cache-threshold 0.3 --tree-chars-per-token 2.5"])
    check_router_args(args)
    command = router_command(args, ["http://127.0.0.1:1"], [])
    flags = command[command.index("radixray.router") + 1:]
    router = add_router_arguments(argparse.ArgumentParser()).parse_args(flags)
    assert (router.cache_threshold, router.tree_chars_per_token) == (0.3, 2.5)
    for bad, problem in (("--cache-threshold 7", "cache_threshold: must be in [0, 1]"),
                         ("--no-such-flag 1", "unrecognized arguments"),
                         ('--cache-threshold "0.3', "No closing quotation")):
        with pytest.raises(ValueError, match="^router_args: .*" + re.escape(problem)):
            check_router_args(build_parser().parse_args(["serve", "--router-args", bad]))
