"""Gathered K/V kept from one decode step to the next (torch_native on CPU).

Token-granular slots make every attention call gather its keys row by row from the KV
buffers (``index_select`` over 64-512-byte rows), and in a long decode that gather costs more
than the attention itself: every step re-reads the same keys in the same order plus one new
key per request. The stage keeps each padded call's gathered keys and values per layer and,
while consecutive steps are decode steps, only writes each request's new key into its row;
rows of requests that left are dropped (whole rows copied, no gather). The call is gathered
afresh when a request joins it, and after any step that is not decode-only.

Why it is safe: between two decode-only steps no slot a staged row reads changes (the KV of
a slot a request holds is written once; a freed slot gets new KV only from an extend or
prefill step, which drops the stage). Each row of the new call is found by the slot of its
last staged key and must hold the same slots where it held keys before; otherwise the call
is gathered afresh.

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
        prefix). Each call either reuses its staged entry (its rows still there, each that
        many keys longer; rows of requests that left are dropped) or is gathered afresh this
        step; entries of calls that are gone are dropped."""
        layers, heads, dim, elt = kv_shape
        need = sum(2 * layers * s.shape[0] * (s.shape[1] + HEADROOM) * heads * dim * elt
                   for s, _, _ in calls.values())
        if need > self.budget_bytes:
            self.clear()
            return
        kept = {}
        for name, (slots, lens, growth) in calls.items():
            entry = self.entries.get(name)
            rows = self._match(entry, slots, lens, growth) if entry is not None else None
            if rows is not None:
                if not (len(rows) == len(entry.lens) and bool((rows == torch.arange(
                        len(rows), device=rows.device)).all())):
                    # requests left (or rows moved): keep the others' staged rows, whole
                    entry.keys = [k.index_select(0, rows) for k in entry.keys]
                    entry.values = [v.index_select(0, rows) for v in entry.values]
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
    def _match(entry: _Entry, slots: torch.Tensor, lens: torch.Tensor,
               growth: int) -> torch.Tensor | None:
        """For each row of this step's call, its row in ``entry`` ([n] indices), or None
        unless every row is there with ``growth`` more keys, room left and its old keys'
        slots unchanged. A row is found by the slot of its last staged key (a request's
        newest token, a prefix's last token: no two rows share it)."""
        if (growth != entry.growth or slots.shape[1] > entry.keys[0].shape[1]
                or bool((lens - growth < 1).any())):
            return None
        old = entry.slots
        n_old = torch.arange(len(entry.lens), device=old.device)
        where = dict(zip(old[n_old, entry.lens - 1].tolist(), n_old.tolist()))
        n_new = torch.arange(len(lens), device=slots.device)
        found = [where.get(s) for s in slots[n_new, lens - 1 - growth].tolist()]
        if None in found or len(set(found)) != len(found):
            return None
        rows = torch.tensor(found, device=old.device)
        if not torch.equal(lens, entry.lens[rows] + growth):
            return None
        width = old.shape[1]
        same = slots[:, :width] == old[rows][:, : slots.shape[1]]
        filled = torch.arange(same.shape[1], device=old.device)[None, :] < entry.lens[rows, None]
        return rows if bool((same | ~filled).all()) else None

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
