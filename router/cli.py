"""Command line of the router: ``radixray router ...`` (or ``python -m radixray.router ...``).

``add_router_arguments(parser)`` adds the flags to any argparse parser (the main CLI hooks it as a
sub-command); ``config_from_args`` turns parsed flags into a RouterConfig; ``serve(config)`` runs
the app with uvicorn until interrupted; ``run_router(argv)`` does all three. Defaults come from
RouterConfig, so the flags and the dataclass cannot disagree; router/README.md explains them.
"""

from __future__ import annotations

import argparse
import logging
import os

from .config import LOG_LEVELS, POLICY_NAMES, WORKER_API_KEY_ENV, RouterConfig

D = RouterConfig()

# (flag, type, help); the dest is the flag without dashes, the default RouterConfig's field.
_FLAGS = [
    ("--host", str, "address to listen on (0.0.0.0 to serve a cluster)"),
    ("--port", int, "port to listen on (SGLang's 30000)"),
    ("--cache-threshold", float, "min matched/request length to follow the cached prefix"),
    ("--balance-abs-threshold", int, "imbalance: max - min in-flight must exceed this ..."),
    ("--balance-rel-threshold", float, "... and max must exceed min times this"),
    ("--max-tree-size", int, "characters of request text remembered per worker (a cap)"),
    ("--tree-chars-per-token", float, "per-worker bound = its KV tokens x this (0: off)"),
    ("--eviction-interval", float, "seconds between tree sweeps (the bound holds on insert)"),
    ("--health-check-interval", float, "seconds between health checks of every worker"),
    ("--health-check-timeout", float, "seconds a health check may take"),
    ("--health-failure-threshold", int, "failed checks in a row before a worker is unhealthy"),
    ("--max-concurrent-requests", int, "requests in flight before queueing (<= 0: no limit)"),
    ("--queue-size", int, "requests that may wait for a slot; beyond, 429"),
    ("--queue-timeout", float, "seconds a request may wait for a slot; then 429"),
    ("--max-retries", int, "retries after the first attempt, each on another worker if any"),
    ("--retry-initial-backoff", float, "seconds before the first retry"),
    ("--retry-max-backoff", float, "cap on the backoff, seconds"),
    ("--retry-backoff-multiplier", float, "backoff growth per retry"),
    ("--retry-jitter", float, "backoff randomisation, fraction"),
    ("--breaker-failure-threshold", int, "failures within the window that open a circuit"),
    ("--breaker-window", float, "seconds over which failures are counted"),
    ("--breaker-cooldown", float, "seconds a circuit stays open before it half-opens"),
    ("--breaker-success-threshold", int, "successes in a row that close a half-open circuit"),
    ("--request-timeout", float, "seconds a worker may take to answer"),
    ("--connect-timeout", float, "seconds to connect to a worker"),
    ("--shutdown-timeout", float, "seconds in-flight requests get to finish on SIGTERM"),
    ("--max-payload-size", int, "largest request body in bytes; larger ones get 413"),
    ("--ray-address", str, "Ray cluster to watch for replicas (e.g. auto or ray://host:10001)"),
    ("--ray-namespace", str, "namespace the replicas register in"),
    ("--ray-actor-prefix", str, "name prefix of replica actors"),
    ("--discovery-interval", float, "seconds between Ray discovery polls"),
    ("--seed", int, "seed of the random tie-breaks"),
]


def add_router_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the router's flags to ``parser`` (mutates it) and return it."""
    parser.add_argument("--worker-urls", nargs="*", default=list(D.worker_urls),
                        metavar="URL", help="workers to route to (more can come from Ray or "
                        "POST /workers)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=D.policy,
                        help=f"routing policy (default: {D.policy})")
    # choices: a bad level is a usage error here, not a traceback from logging at start-up
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=D.log_level,
                        help=f"uvicorn and router log level (default: {D.log_level})")
    for flag, kind, text in _FLAGS:
        dest = flag[2:].replace("-", "_")
        default = getattr(D, dest)
        parser.add_argument(flag, type=kind, default=default,
                            help=f"{text} (default: {default})")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """A RouterConfig from parsed flags; ValueError naming the field if one is out of range."""
    values = {name: getattr(args, name) for name in RouterConfig.field_names()
              if hasattr(args, name)}
    return RouterConfig(**values, worker_api_key=os.environ.get(WORKER_API_KEY_ENV) or None)


def serve(config: RouterConfig) -> None:
    """Serve a router with ``config`` until interrupted (blocks; for `radixray serve`)."""
    import uvicorn
    from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

    from .app import build_app

    # by number: "trace" is uvicorn's own level, unknown to logging until uvicorn configures it
    logging.basicConfig(level=UVICORN_LEVELS[config.log_level],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is noise
    uvicorn.run(build_app(config), host=config.host, port=config.port,
                log_level=config.log_level, access_log=False,
                # the peer address is the client: no X-Forwarded-For may make anyone loopback
                # (router/admin.py lets loopback clients manage workers without a key)
                proxy_headers=False,
                timeout_graceful_shutdown=config.shutdown_timeout)


def run_router(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and serve the router until interrupted."""
    parser = add_router_arguments(argparse.ArgumentParser(
        prog="radixray router", description="Cache-aware router in front of SGLang-compatible "
        "workers."))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    serve(config)
