"""Ray actors, the offline Engine, the HTTP server and the command line.

``from radixray.cluster import Engine`` loads the in-process engine lazily (no Ray, no torch on
plain import of this package).
"""

__all__ = ["Engine"]


def __getattr__(name):
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'radixray.cluster' has no attribute {name!r}")
