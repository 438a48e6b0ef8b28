"""Garbage collection in serving processes: freeze what start-up made.

A replica's head and ranks hold a few hundred thousand Python objects once torch, transformers,
the tokenizer and the model are loaded (~300k in a head on the demo model). CPython's full
collection walks all of them: 0.4-0.6 s on these machines, with the GIL held, so every decode
step and the HTTP event loop of that process stall meanwhile (``bench/gc_pause.py``). They run
whenever enough objects have survived into the oldest generation since the last one, which a
busy server reaches again and again. Start-up objects live as long as the process, so after
start-up they are collected once and frozen (``gc.freeze``): later full collections walk only
what was made since. Objects frozen are never collected as garbage; start-up makes few that
later die in cycles.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now to the permanent generation. Returns how many
    objects are frozen (``gc.get_freeze_count``). Call once start-up is done (and again after a
    restart loaded a new engine: its predecessor's objects are collected first)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
