"""The L3 tier's interface: KV pages in external storage, addressed by prefix hash.

A page's key is a hash chained over every page before it (``prefix_hashes``), so equal keys
mean equal prefixes, and a prefix's pages can be looked up in order without a tree: the first
missing key ends the usable prefix. ``KVStorage`` is what a backend provides (get, put,
exists); ``LocalDiskStorage`` keeps one file per page in a folder, for tests and single-node
use.

Status: the interface and the local-disk backend are tested on their own; the radix tree does
not use them yet (the hierarchical cache stops at the host tier, L2). Wiring it in means: the
worker writes host-evicted pages with ``put`` and, on a match that runs past the tree, the
scheduler asks ``exists`` page by page and has the worker ``get`` them into host slots.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import tempfile
from typing import Protocol

import torch

_KEY = re.compile(r"^[0-9a-f]{64}$")


def prefix_hashes(token_ids: list[int], page_size: int, extra_key=None) -> list[str]:
    """One hex key per whole page of ``token_ids``: sha256 of the previous page's key, the
    ``extra_key`` and the page's tokens. A partial last page gets no key."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    keys, previous = [], repr(extra_key).encode()
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        digest = hashlib.sha256(previous)
        digest.update(struct.pack(f"<{page_size}q", *page))
        previous = digest.hexdigest().encode()
        keys.append(previous.decode())
    return keys


class KVStorage(Protocol):
    """An L3 backend. Values are one page's KV as a CPU tensor (any shape the caller uses)."""

    def exists(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor | None:
        """The stored page, or None when it is missing or unreadable (the caller then
        recomputes: a storage problem never becomes wrong output)."""
        ...

    def put(self, key: str, value: torch.Tensor) -> bool:
        """Store a page; False when the backend could not (full, I/O error)."""
        ...


class LocalDiskStorage:
    """One ``<key>.pt`` file per page under ``root``. Writes go to a temporary file that is
    renamed into place, so a reader never sees half a page."""

    def __init__(self, root: str):
        if not isinstance(root, str) or not root:
            raise ValueError("hicache storage root must be a non-empty path")
        os.makedirs(root, exist_ok=True)
        self.root = root

    def _path(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"key must be a prefix hash (64 hex digits), got {key!r}")
        return os.path.join(self.root, key + ".pt")

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def get(self, key: str) -> torch.Tensor | None:
        path = self._path(key)
        try:
            value = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # missing, truncated, foreign: any unreadable page is a miss
            return None
        return value if isinstance(value, torch.Tensor) else None

    def put(self, key: str, value: torch.Tensor) -> bool:
        """Mutates the folder: writes (or replaces) the key's file."""
        path = self._path(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"value must be a tensor, got {type(value).__name__}")
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                torch.save(value.detach().cpu().contiguous(), f)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        return True

    def matched_pages(self, keys: list[str]) -> int:
        """How many leading ``keys`` are stored: the usable L3 prefix, in pages."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)
