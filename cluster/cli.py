"""The ``radixray`` command line.

Each subcommand is a pair of small functions, ``add_arguments(parser)`` and ``run(args) -> int``,
registered in ``SUBCOMMANDS``; heavy imports happen inside ``run`` so ``radixray --help`` is fast.
"""

from __future__ import annotations

import argparse
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


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from .serve import add_serve_arguments

    add_serve_arguments(p)


def _run_serve(args: argparse.Namespace) -> int:
    from .serve import run_serve

    return run_serve(args)


def _add_router_arguments(p: argparse.ArgumentParser) -> None:
    from ..router.cli import add_router_arguments

    add_router_arguments(p)


def _run_router(args: argparse.Namespace) -> int:
    from ..router.cli import config_from_args, serve

    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"radixray router: error: {e}", file=sys.stderr)
        return 2
    serve(config)
    return 0


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


def _add_train_demo_arguments(p: argparse.ArgumentParser) -> None:
    from ..worker.train_demo import add_arguments

    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add_arguments(p)


def _run_train_demo(args: argparse.Namespace) -> int:
    from ..worker.train_demo import run

    return run(args)


# name -> (help, add_arguments, run)
SUBCOMMANDS = {
    "make-model": ("write a tiny random-weight HF model folder with a trained tokenizer",
                   _add_make_model_arguments, _run_make_model),
    "train-demo-model": ("train the built-in demo model (a small Llama) on Python's stdlib "
                         "sources, ~35 minutes on 2 CPU cores",
                         _add_train_demo_arguments, _run_train_demo),
    "serve": ("serve a model: replicas on Ray (local Ray unless --ray-address) behind the "
              "cache-aware router; OpenAI-compatible and SGLang-native APIs",
              _add_serve_arguments, _run_serve),
    "router": ("run the cache-aware router alone, in front of replicas given by URL or Ray",
               _add_router_arguments, _run_router),
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
