"""The router process ``radixray serve`` runs beside its replicas: its command line, its
environment, and what serve needs to restart it (``serve.py`` supervises it).

The router runs as ``python -m radixray.router`` in a process of its own (it imports no torch),
finds the replicas at their start-up URLs and follows them through Ray, and gets the
replicas' API key through its environment, never argv.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from ..router.config import WORKER_API_KEY_ENV

ROUTER_RESTART_WINDOW_S, ROUTER_MAX_RESTARTS = 60.0, 5  # more exits than that: serve gives up
ROUTER_HEALTH_MARGIN_S = 5.0  # the router's health checks wait this much longer than /health


def router_command(args: argparse.Namespace, urls: list[str], discovery: list[str]) -> list[str]:
    """The router process serve starts. Its health checks wait longer than a replica's /health
    takes to give its verdict: with equal limits the router gave up first, and a busy replica
    (whose late answer is "healthy") dropped out of rotation after three checks. ``-P``
    (Python >= 3.11): serve's working directory is not on its path (an ``h2.py`` there
    shadowed a module the router imports, and it crashed at every start)."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "radixray.router", "--host", args.host, "--port",
            str(args.port), "--policy", args.router_policy, "--worker-urls", *urls,
            "--health-check-timeout", f"{args.health_check_timeout + ROUTER_HEALTH_MARGIN_S:g}",
            "--health-check-interval", f"{args.health_check_interval:g}",
            *discovery, *shlex.split(args.router_args)]


def check_router_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag if the router would refuse its command (--router-args)."""
    from ..router.cli import add_router_arguments, config_from_args

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # instead of printing the usage and exiting
            raise ValueError(message)

    try:
        command = router_command(args, [], [])  # (shlex: ValueError for a lone quote)
        flags = command[command.index("radixray.router") + 1:]
        config_from_args(add_router_arguments(Parser()).parse_args(flags))
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"router_args: {e}") from None


def router_env(api_key: str | None) -> dict[str, str]:
    """The router's environment: ours, plus the replicas' API key (for the router's own
    requests to them) when they have one; the environment, not argv, keeps it out of ``ps``."""
    env = dict(os.environ)
    if api_key:
        env[WORKER_API_KEY_ENV] = api_key
    return env


def discovery_args(ray, namespace: str) -> list[str]:
    """The router's flags to watch this driver's Ray cluster for the replicas in ``namespace``;
    none when its GCS address is not known here (a Ray Client connection): the router then
    keeps the start-up URLs."""
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - any failure only costs discovery
        return []
    return ["--ray-address", address, "--ray-namespace", namespace] if address else []


def exit_reason(code: int) -> str:
    """A child's exit status in words: "exit code 1", "killed by SIGKILL"."""
    names = {s.value: s.name for s in signal.Signals}
    return f"exit code {code}" if code >= 0 else f"killed by {names.get(-code, -code)}"


def die_with_parent():
    """A preexec_fn that makes the router get SIGTERM when serve exits, however it exits.

    When its Ray cluster goes away (``ray stop``, ``ray down``), Ray ends this driver with a hard
    exit that skips ``finally``; without this the router would keep the port, answering 503.
    (Only this machine's raylet dying leaves the GCS up: serve sees its node dead and stops,
    ``own_node_alive`` in serve.py.)
    Linux only (``prctl``); None elsewhere. The libc call is looked up here, before the fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
