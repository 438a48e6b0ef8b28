"""Server arguments (SGLang's names) as the offline Engine and every replica take them: which
are the scheduler's (``SchedulerConfig``'s fields) and which the model runner's
(``RUNNER_ARGS``), checked by name before anything loads, and the ``RunnerConfig`` they make.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from ..scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from ..worker.model_runner import RunnerConfig

# Server arguments for the model runner and tokenizer (the rest are SchedulerConfig's fields).
RUNNER_ARGS = {
    "dtype": "auto",
    # "auto": cuda if this process sees a GPU, else cpu. The default stays cpu for the offline
    # Engine (and replicas started from Python): its users and tests compare against float32
    # CPU output; `radixray serve` defaults to "auto" and resolves it against the Ray cluster.
    "device": "cpu",
    "attention_backend": "auto",  # flashinfer, else triton, on CUDA; torch_native elsewhere
    "context_length": None,  # default: the model's max_position_embeddings
    "mem_fraction_static": 0.85,
    "load_format": "safetensors",
    "tokenizer_path": None,  # default: model_path
}


def split_server_args(server_args: dict) -> tuple[dict, dict]:
    """(SchedulerConfig kwargs, runner kwargs); unknown names raise ValueError naming them."""
    sched_names = set(SchedulerConfig.field_names())
    unknown = sorted(set(server_args) - sched_names - set(RUNNER_ARGS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown server argument"
                         + (f"s {', '.join(unknown)}" if len(unknown) > 1 else ""))
    sched = {k: v for k, v in server_args.items() if k in sched_names}
    runner = {**RUNNER_ARGS, **{k: v for k, v in server_args.items() if k in RUNNER_ARGS}}
    _check_runner_args(runner)
    return sched, runner


def _check_runner_args(runner: dict) -> None:
    """ValueError naming the argument, before anything loads (torch's own errors name none)."""
    context = runner["context_length"]
    if context is not None and (type(context) is not int or context < 2):
        raise ValueError("context_length: must be an integer >= 2 (None: the model's)")
    fraction = runner["mem_fraction_static"]
    if type(fraction) not in (int, float) or not 0 < fraction <= 1:
        raise ValueError("mem_fraction_static: must be in (0, 1]")
    device = runner["device"]
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"device: {device!r}; use cpu, cuda, cuda:N or auto")


def runner_config(model_path: str, config: SchedulerConfig, runner_args: dict,
                  eos_token_ids: tuple[int, ...] = ()) -> RunnerConfig:
    """The model runner's configuration from the server arguments (SGLang names) and the
    tokenizer's EOS ids; the offline Engine's and every replica's."""
    from ..worker.model_runner import RunnerConfig

    return RunnerConfig(
        model_path, dtype=runner_args["dtype"], device=runner_args["device"],
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=runner_args["mem_fraction_static"],
        max_running_requests=config.max_running_requests,
        max_context_len=runner_args["context_length"], page_size=config.page_size,
        attention_backend=runner_args["attention_backend"],
        load_format=runner_args["load_format"], seed=config.random_seed,
        enable_hierarchical_cache=config.enable_hierarchical_cache,
        hicache_ratio=config.hicache_ratio, hicache_size=config.hicache_size,
        eos_token_ids=eos_token_ids)


def take_process_args(server_args: dict) -> dict:
    """The server arguments less ``sglang.Engine``'s ones about this process, applied here:
    ``tp_size``/``dp_size`` (1 only), ``log_level``, ``trust_remote_code`` (unused)."""
    server_args = dict(server_args)
    for name in ("tp_size", "dp_size"):  # ported code passes them
        if server_args.pop(name, 1) != 1:
            raise ValueError(f"{name}: the in-process Engine runs one rank; use `radixray "
                             "serve --tp-size N --replicas M` for more")
    server_args.pop("trust_remote_code", None)
    log_level = server_args.pop("log_level", None)
    if log_level is not None:
        try:
            logging.getLogger("radixray").setLevel(str(log_level).upper())
        except ValueError as e:
            raise ValueError(f"log_level: {e}") from None
    return server_args


def tokenizer_eos(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS id, if it has one: it ends a request as the model config's do."""
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
