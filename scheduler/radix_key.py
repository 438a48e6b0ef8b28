"""RadixKey: the token sequence the radix tree is keyed by, packed once for fast comparison.

Edges are compared on a packed ``bytes`` copy of the token ids (4 bytes per token, native
int32), so each comparison is one C-level ``memcmp`` (see radix_cache.py).
"""

from __future__ import annotations

import struct

import torch

_BYTES_PER_TOKEN = 4  # token ids are packed as native int32


def _pack(token_ids: list) -> bytes:
    try:
        return struct.pack(f"={len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"RadixKey.token_ids must be ints in the int32 range ({e})") from None


class RadixKey:
    """A token sequence plus an optional ``extra_key`` (LoRA id, cache salt, ...).

    Keys with different ``extra_key`` never share a prefix. ``token_ids`` is copied into a list,
    and packed once into ``packed`` (int32 bytes) on which the tree compares edges.
    """

    __slots__ = ("token_ids", "extra_key", "packed")

    def __init__(self, token_ids, extra_key=None):
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"RadixKey.extra_key must be hashable, got {type(extra_key).__name__}")
        self.token_ids = list(token_ids)
        self.extra_key = extra_key
        self.packed = _pack(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            return self.token_ids[index]
        start, stop, step = index.indices(len(self.token_ids))
        if step != 1:
            raise ValueError("RadixKey slices must be contiguous (step 1)")
        stop = max(stop, start)
        out = RadixKey.__new__(RadixKey)
        out.token_ids = self.token_ids[start:stop]
        out.extra_key = self.extra_key
        out.packed = self.packed[start * _BYTES_PER_TOKEN : stop * _BYTES_PER_TOKEN]
        return out

    def __eq__(self, other) -> bool:
        return (isinstance(other, RadixKey) and self.extra_key == other.extra_key
                and self.token_ids == other.token_ids)

    __hash__ = None  # mutable-looking and compared by value: not a dict key

    def __repr__(self) -> str:
        ids = self.token_ids if len(self) <= 8 else [*self.token_ids[:8], "..."]
        extra = "" if self.extra_key is None else f", extra_key={self.extra_key!r}"
        return f"RadixKey({ids}, len={len(self)}{extra})"
