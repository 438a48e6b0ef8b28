"""The cache-aware router: an HTTP front door that sends each request where its prefix lives.

Imports neither torch nor any other radixray folder; see router/README.md. Entry points:
``radixray.router.cli.run_router(argv)`` and ``radixray.router.app.build_app(config)``.
"""

from .config import RouterConfig

__all__ = ["RouterConfig"]
