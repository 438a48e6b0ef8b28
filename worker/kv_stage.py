"""Gathered K/V kept from one decode step to the next (torch_native on CPU).

Token-granular slots make every attention call gather its keys row by row from the KV
buffers (``index_select`` over 64-512-byte rows), and in a long decode that gather costs more
than the attention itself: every step re-reads the same keys in the same order plus one new
key per request. The stage keeps each padded call's gathered keys and values per layer and,
while consecutive steps are decode steps over the same requests, only writes each request's
new key into its row: the gather happens once, when the batch changes.

Why it is safe: between two decode-only steps no slot a staged row reads changes (KV of a
slot a request holds is written once; a request leaving frees its slots, but then its row's
slots differ and the call is gathered afresh, as after any extend or prefill step). The check
is on the slots themselves: the previous step's slot rows must be a prefix of this step's.

Memory: a staged copy of the batch's KV, bounded by ``budget_bytes``; over it, calls gather
every layer as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADROOM = 64  # key columns allocated ahead, so a decode run appends without regathering


@dataclass
class _Entry:
    slots: torch.Tensor  # [n, S] the slots this entry's columns hold
    lens: torch.Tensor  # [n] keys filled per row
    keys: list[torch.Tensor]  # per layer [n, cap, Hkv, D]
    values: list[torch.Tensor]
    growth: int  # keys each row gains per step (1: a request's own keys; 0: a shared prefix)
    fill: bool = True  # this step gathers (True), or reuses the entry, appending new keys


class KVStage:
    """The staged K/V of one attention backend: an entry per padded call of the last decode
    step, named by the backend (``("own", i)``, ``("shared", i)``)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: dict[tuple[str, int], _Entry] = {}

    def clear(self) -> None:
        self.entries.clear()

    def plan(self, calls: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int]],
             kv_shape: tuple[int, int, int, int], dtype: torch.dtype,
             device: torch.device) -> None:
        """Before a decode-only step: ``calls`` maps a call's name to (slots [n, S], keys per
        row [n], keys each row gains per step: 1 for requests' own keys, 0 for a shared
        prefix). Each call either reuses its staged entry (same rows, that many keys more) or
        is gathered afresh this step; entries of calls that are gone are dropped."""
        layers, heads, dim, elt = kv_shape
        need = sum(2 * layers * s.shape[0] * (s.shape[1] + HEADROOM) * heads * dim * elt
                   for s, _, _ in calls.values())
        if need > self.budget_bytes:
            self.clear()
            return
        kept = {}
        for name, (slots, lens, growth) in calls.items():
            entry = self.entries.get(name)
            if entry is not None and self._extends(entry, slots, lens, growth):
                entry.slots, entry.lens, entry.fill = slots, lens, False
            else:
                n, cap = slots.shape[0], slots.shape[1] + HEADROOM
                # zeros: columns a row has not reached are masked, but must not hold NaN bits
                new = lambda: torch.zeros((n, cap, heads, dim), dtype=dtype,  # noqa: E731
                                          device=device)
                entry = _Entry(slots, lens, [new() for _ in range(layers)],
                               [new() for _ in range(layers)], growth)
            kept[name] = entry
        self.entries = kept

    @staticmethod
    def _extends(entry: _Entry, slots: torch.Tensor, lens: torch.Tensor, growth: int) -> bool:
        """Same rows, each ``growth`` keys longer, room left, the old keys' slots unchanged."""
        old = entry.slots
        if (old.shape[0] != slots.shape[0] or slots.shape[1] > entry.keys[0].shape[1]
                or not torch.equal(lens, entry.lens + growth)):
            return False
        width = old.shape[1]
        same = slots[:, :width] == old
        filled = torch.arange(width, device=old.device)[None, :] < entry.lens[:, None]
        return bool((same | ~filled).all())

    def keys_values(self, name, layer: int, gather, k_buf, v_buf, new_k, new_v):
        """This step's [n, S, Hkv, D] keys and values of call ``name`` for ``layer``, or None
        when the call is not staged. ``gather(buf, slots, "k" or "v")`` reads a KV buffer;
        ``new_k()``/``new_v()`` give the rows' new keys and values, [n, Hkv, D], to append."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        width = entry.slots.shape[1]
        keys, values = entry.keys[layer][:, :width], entry.values[layer][:, :width]
        if entry.fill:
            keys.copy_(gather(k_buf, entry.slots, "k"))
            values.copy_(gather(v_buf, entry.slots, "v"))
        elif entry.growth:  # one new key per row, at its last position
            rows = torch.arange(len(entry.lens), device=entry.lens.device)
            keys[rows, entry.lens - 1] = new_k()
            values[rows, entry.lens - 1] = new_v()
        return keys, values
