"""Garbage collection in serving processes: freeze what start-up made.

A replica's head and ranks hold a few hundred thousand Python objects once torch, transformers,
the tokenizer and the model are loaded (~400k). CPython's full collection walks all of them
with the GIL held: 0.27-1.2 s on these machines (``bench/gc_pause.py``), during which every
decode step and the HTTP event loop of that process stall. Full collections run whenever
enough objects have survived into the oldest generation since the last one, which a busy
server reaches again and again. Objects that live as long as the process are therefore
collected once and frozen (``gc.freeze``): later full collections walk only what was made
since.

A frozen object is never collected, and neither is anything in a reference cycle with one:
freeze only what is never replaced. A head freezes before it builds its engine (a restart
replaces the scheduler, a flush the radix tree; frozen, each would leak whole); a rank after
it loaded its model (it never replaces it: a new rank is a new process).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now to the permanent generation. Returns how many
    objects are frozen (``gc.get_freeze_count``). Call once, before making objects that will be
    replaced (see the module docstring)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
