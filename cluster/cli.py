"""The ``radixray`` command line.

Each subcommand is a pair of small functions, ``add_arguments(parser)`` and ``run(args) -> int``,
registered in ``SUBCOMMANDS``; heavy imports happen inside ``run`` so ``radixray --help`` is fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def _add_make_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="folder to write (created; existing files are overwritten)")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="default: tied for qwen2, untied for llama")


def _run_make_model(args: argparse.Namespace) -> int:
    from ..worker.make_model import make_model

    start = time.perf_counter()
    try:
        path = make_model(
            args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            max_position=args.max_position, seed=args.seed, dtype=args.dtype,
            tie_word_embeddings=args.tie_word_embeddings)
    except ValueError as e:  # bad sizes: the message names the field
        print(f"radixray make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.arch} model to {path} in {time.perf_counter() - start:.1f}s")
    return 0


# Scheduler arguments as flags: SchedulerConfig's field -> (type, help). Defaults come from
# SchedulerConfig itself, so --help always shows the real ones.
_SCHEDULER_FLAGS = {
    "schedule_policy": (str, "waiting-queue order"),
    "schedule_conservativeness": (float, "> 1 admits fewer requests at once, < 1 more"),
    "chunked_prefill_size": (int, "longest prefill piece per step; -1 turns chunking off"),
    "max_prefill_tokens": (int, "prompt tokens per prefill batch"),
    "max_total_tokens": (int, "KV pool size in tokens; None: sized from memory"),
    "max_running_requests": (int, "running-request cap; None: 256"),
    "page_size": (int, "tokens per KV page"),
    "radix_eviction_policy": (str, "which cached prefixes go first when memory runs short"),
    "disable_radix_cache": (bool, "no prefix sharing at all"),
    "enable_mixed_chunk": (bool, "running decodes ride along with prefill batches"),
    "debug_invariants": (bool, "check the KV memory invariant after every step (slow)"),
    "random_seed": (int, "seed for sampling and the random queue policy"),
}


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from ..scheduler.config import EVICTION_POLICIES, SCHEDULE_POLICIES, SchedulerConfig

    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--model", "--model-path", dest="model_path", default=None,
                   help="HF model folder; None: the built-in demo model (made if missing)")
    p.add_argument("--tokenizer-path", default=None, help="None: the model folder")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send; None: the model path")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on every endpoint but /health*")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 beyond this many requests waiting for their first token; "
                        "None: no limit")
    p.add_argument("--health-check-timeout", type=float, default=20.0,
                   help="seconds /health may wait for its one-token generation")
    g = p.add_argument_group("model runner")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default="cpu", help="torch device")
    g.add_argument("--context-length", type=int, default=None,
                   help="None: the model's max_position_embeddings")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="GPU: share of memory for weights and KV cache")
    g.add_argument("--attention-backend", default="torch_native", help="attention kernels")
    g.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights (benchmarks)")
    g = p.add_argument_group("scheduler")
    defaults = SchedulerConfig()
    choices = {"schedule_policy": SCHEDULE_POLICIES, "radix_eviction_policy": EVICTION_POLICIES}
    for name, (kind, help_text) in _SCHEDULER_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)
        else:
            g.add_argument(flag, type=kind, default=default, choices=choices.get(name),
                           help=help_text)


def _run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..worker.make_model import ensure_default_model
    from .async_engine import InProcessEngine
    from .http_server import ServerArgs, create_app

    model_path = args.model_path
    if model_path is None:
        print("radixray serve: no --model given; using the built-in demo model "
              "(made on first use)", flush=True)
        model_path = ensure_default_model()
    server_args = {name: getattr(args, name) for name in _SCHEDULER_FLAGS}
    server_args.update(dtype=args.dtype, device=args.device, context_length=args.context_length,
                       mem_fraction_static=args.mem_fraction_static,
                       attention_backend=args.attention_backend, load_format=args.load_format,
                       tokenizer_path=args.tokenizer_path)
    try:
        engine = InProcessEngine.from_model(model_path, **server_args)
    except ValueError as e:  # an invalid argument: the message names it
        print(f"radixray serve: error: {e}", file=sys.stderr)
        return 2
    http_args = ServerArgs(
        model_path=model_path, served_model_name=args.served_model_name,
        tokenizer_path=args.tokenizer_path, host=args.host, port=args.port,
        api_key=args.api_key, max_queued_requests=args.max_queued_requests,
        health_check_timeout=args.health_check_timeout, extra=server_args)
    app = create_app(engine, engine.tokenizer, http_args)
    print(f"radixray serving {http_args.model_name} at http://{args.host}:{args.port} "
          f"(OpenAI API under /v1, SGLang native POST /generate)", flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again; a no-op
    # handler turns that into a normal return, so the engine is stopped and the exit code is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0


# name -> (help, add_arguments, run)
SUBCOMMANDS = {
    "make-model": ("write a tiny random-weight HF model folder with a trained tokenizer",
                   _add_make_model_arguments, _run_make_model),
    "serve": ("serve a model over HTTP (OpenAI-compatible and SGLang-native APIs); for now "
              "on the in-process engine (one process, no Ray) until the Ray replica lands",
              _add_serve_arguments, _run_serve),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixray", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the chosen subcommand; returns its exit code."""
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
