"""radixray: LLM serving on Ray around RadixAttention.

The public face is kept light: ``import radixray`` does not import torch, so the router
(``radixray.router``) can run in a process without it. ``radixray.Engine`` is loaded on first use.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name):
    if name == "Engine":
        from .cluster.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixray' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "Engine"])
