"""Configuration the router refuses up front (non-finite numbers, unknown log levels), and a
health-check loop that outlives a check gone wrong."""

import argparse
import asyncio
import dataclasses
import math

import httpx
import pytest
from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

from radixray.router.cli import add_router_arguments, config_from_args, run_router
from radixray.router.config import LOG_LEVELS, RouterConfig
from radixray.router.health import HealthChecker
from radixray.router.workers import WorkerRegistry

FLOAT_FIELDS = [f.name for f in dataclasses.fields(RouterConfig) if f.type == "float"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_knob_must_be_finite(field, value):
    # NaN passed every range check (nan <= 0 is False), and inf overflowed later, inside the
    # health checker, when a worker's tree bound became an int
    with pytest.raises(ValueError, match=f"^{field}: must be a finite number"):
        RouterConfig(**{field: value})


def test_an_int_knob_given_nan_is_refused_too():
    with pytest.raises(ValueError, match="^balance_abs_threshold"):
        RouterConfig(balance_abs_threshold=math.nan)


def test_non_finite_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_router(["--tree-chars-per-token", "inf"])
    assert exit_.value.code == 2
    assert "tree_chars_per_token: must be a finite number" in capsys.readouterr().err


def test_the_log_level_is_checked(capsys):
    assert set(LOG_LEVELS) == set(UVICORN_LEVELS)  # the levels uvicorn (and serve) accept
    with pytest.raises(ValueError, match="^log_level"):
        RouterConfig(log_level="bogus")
    with pytest.raises(SystemExit) as exit_:
        run_router(["--log-level", "bogus"])  # a usage error, not a traceback from logging
    assert exit_.value.code == 2
    assert "argument --log-level: invalid choice: 'bogus'" in capsys.readouterr().err
    parser = add_router_arguments(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args(["--log-level", "DEBUG"])).log_level == "debug"


def test_the_payload_limit_flag():
    parser = add_router_arguments(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])).max_payload_size == 256 << 20  # SGLang's
    assert config_from_args(parser.parse_args(["--max-payload-size", "1024"])) \
        .max_payload_size == 1024
    with pytest.raises(ValueError, match="^max_payload_size"):
        RouterConfig(max_payload_size=0)


class FlakyClient:
    """Health checks of ``broken`` raise what no check expects; every other worker refuses."""

    def __init__(self, broken: str):
        self.broken = broken
        self.checks: dict[str, int] = {}

    async def get(self, url, **kwargs):
        worker = url.rsplit("/", 1)[0]
        self.checks[worker] = self.checks.get(worker, 0) + 1
        if worker == self.broken:
            raise RuntimeError("a check gone wrong")
        raise httpx.ConnectError("refused")


def test_a_check_that_raises_ends_neither_the_round_nor_the_loop(caplog):
    config = RouterConfig(health_check_interval=0.01)
    registry = WorkerRegistry(config)
    for url in ("http://a:1", "http://b:1"):
        registry.add(url)
    client = FlakyClient("http://a:1")

    async def scenario():
        task = asyncio.create_task(HealthChecker(registry, client, config).run())
        await asyncio.sleep(0.3)
        assert not task.done()  # the loop lives on
        task.cancel()

    asyncio.run(scenario())
    assert client.checks["http://a:1"] > 3  # checked again and again
    assert not registry.get("http://b:1").healthy  # the others' checks ran and counted
    assert "health check of http://a:1 failed" in caplog.text
