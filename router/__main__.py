"""``python -m radixray.router ...``: the router alone (same flags as ``radixray router``)."""

from .cli import run_router

if __name__ == "__main__":
    run_router()
